"""DeepSeek-V4's per-step index arithmetic in one launch each: what a decode step derives from the
sequences' lengths (positions, window-ring slots and indices, the indexer's last visible entry, the HCA
lengths; ~25 small torch ops), and the CSA top-k's entry ids offset to each sequence's compressed rows
(3 ops a CSA layer). Static shapes, no host sync: graph-capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, rows_per_program


@triton.jit
def _decode_step_indices_kernel(seq_lens_ptr, positions_ptr, slots_ptr, window_ptr, last_visible_ptr, lengths_ptr,
                                W: tl.constexpr, BLOCK_W: tl.constexpr, CSA_RATIO: tl.constexpr,
                                HCA_RATIO: tl.constexpr):
    # One program a sequence: it alone reads and then advances seq_lens[s] (no race).
    s = tl.program_id(0).to(tl.int64)
    p = tl.load(seq_lens_ptr + s)
    tl.store(positions_ptr + s, p)
    tl.store(seq_lens_ptr + s, p + 1)
    tl.store(slots_ptr + s, s * W + p % W)
    j = tl.arange(0, BLOCK_W)
    back = tl.maximum(p - j, 0)  # only read where p >= j (a non-negative remainder)
    tl.store(window_ptr + s * W + j, tl.where(p >= j, s * W + back % W, -1).to(tl.int32), mask=j < W)
    if CSA_RATIO > 0:
        tl.store(last_visible_ptr + s, (p + 1) // CSA_RATIO - 1)
    if HCA_RATIO > 0:
        tl.store(lengths_ptr + s, ((p + 1) // HCA_RATIO).to(tl.int32))


def decode_step_indices(seq_lens: torch.Tensor, batch: int, window: int, csa_ratio: int = 0,
                        hca_ratio: int = 0) -> dict[str, torch.Tensor]:
    """
    A decode step's indices for sequences 0 .. batch − 1 (one token each, at position p = seq_lens[s]),
    and seq_lens[:batch] advanced by one, in one launch.

    Args:
        seq_lens: [>= batch] int64, contiguous, the tokens each sequence holds; updated in place.
        batch: sequences in the step, >= 1. window: the sliding window W (ring slots a sequence).
        csa_ratio / hca_ratio: the compression ratios of the step's CSA / HCA layers, 0 when it has none.

    Returns:
        "positions" [batch] int64 (p); "window_slots" [batch] int64 (s·W + p mod W, the ring slot the token's
        kv goes to); "window" [batch, 1, W] int32 (column j: s·W + (p − j) mod W where p >= j, else −1);
        with csa_ratio "last_visible" [batch] int64 ((p + 1) // csa_ratio − 1); with hca_ratio
        "hca_lengths" [batch] int32 ((p + 1) // hca_ratio). Every element written.

    Raises:
        minirt.errors.InputError: wrong dtype, shape or sizes.
    """
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int64 or seq_lens.dim() != 1 \
            or not seq_lens.is_contiguous() or not 1 <= batch <= seq_lens.shape[0]:
        raise InputError(f"seq_lens must be a contiguous int64 tensor [>= batch], batch >= 1, got "
                         f"{getattr(seq_lens, 'dtype', None)} {tuple(getattr(seq_lens, 'shape', ()))}, batch {batch}")
    if window < 1 or csa_ratio < 0 or hca_ratio < 0:
        raise InputError(f"window must be >= 1 and the ratios >= 0, got {window}, {csa_ratio}, {hca_ratio}")
    check_device({"seq_lens": seq_lens})
    new = dict(dtype=torch.int64, device=seq_lens.device)
    out = {"positions": torch.empty(batch, **new), "window_slots": torch.empty(batch, **new),
           "window": torch.empty(batch, 1, window, dtype=torch.int32, device=seq_lens.device)}
    if csa_ratio:
        out["last_visible"] = torch.empty(batch, **new)
    if hca_ratio:
        out["hca_lengths"] = torch.empty(batch, dtype=torch.int32, device=seq_lens.device)
    dummy = out["positions"]  # never written: its ratio is 0
    _decode_step_indices_kernel[(batch,)](seq_lens, out["positions"], out["window_slots"], out["window"],
                                          out.get("last_visible", dummy), out.get("hca_lengths", dummy),
                                          W=window, BLOCK_W=triton.next_power_of_2(window), CSA_RATIO=csa_ratio,
                                          HCA_RATIO=hca_ratio)
    return out


@triton.jit
def _offset_entry_ids_kernel(topk_ptr, first_ptr, out_ptr, n_rows, K: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    ids = tl.load(topk_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=-1)
    first = tl.load(first_ptr + rows, mask=rows < n_rows, other=0)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], tl.where(ids >= 0, ids + first[:, None], -1), mask=mask)


def offset_entry_ids(topk: torch.Tensor, first: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """
    ``where(topk >= 0, topk + first[:, None], −1)`` in one launch: a CSA layer's top-k entry ids (per
    sequence, −1 none) as rows of the compressed cache (``first``: each token's sequence's first row).

    Args:
        topk: [N, k] int32, contiguous. first: [N] int32. out: optional [N, k] int32 result (may be topk).

    Returns:
        [N, k] int32, ``out`` or a new tensor, every element written.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes.
    """
    if not isinstance(topk, torch.Tensor) or topk.dtype != torch.int32 or topk.dim() != 2 or not topk.is_contiguous():
        raise InputError(f"topk must be a contiguous int32 tensor [N, k], got {getattr(topk, 'dtype', None)} "
                         f"{tuple(getattr(topk, 'shape', ()))}")
    n, k = topk.shape
    if not isinstance(first, torch.Tensor) or first.dtype != torch.int32 or tuple(first.shape) != (n,):
        raise InputError(f"first must be an int32 tensor [{n}], got {getattr(first, 'dtype', None)} "
                         f"{tuple(getattr(first, 'shape', ()))}")
    if out is None:
        out = torch.empty_like(topk)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or out.shape != topk.shape \
            or not out.is_contiguous():
        raise InputError(f"out must be a contiguous int32 tensor {tuple(topk.shape)}")
    check_device({"topk": topk, "first": first, "out": out})
    if n:
        block_k = triton.next_power_of_2(k)
        rows = rows_per_program(n, block_k)
        _offset_entry_ids_kernel[(triton.cdiv(n, rows),)](topk, first, out, n, K=k, ROWS=rows, BLOCK_K=block_k)
    return out
