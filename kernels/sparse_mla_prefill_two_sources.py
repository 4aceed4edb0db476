"""Sparse MLA prefill over two key sources in one softmax (DeepSeek-V4: each query's sliding-window keys
and its selected compressed entries), on top of sparse_mla_prefill.

Design: the two sources are one bf16 buffer (their concatenation) and the two index lists one list per
query, each list's used entries first (the window's, then the compressed ones, shifted past the window
rows), so one topk_length cuts every row's unused tail; then sparse_mla_prefill runs unchanged, with both
of its kernels (the portable one and the sm90 Gluon one, whose producer follows one index stream). vLLM's
V4 prefill does the same (it dequantises both caches into one buffer for FlashMLA's
flash_mla_sparse_fwd). When the caller keeps the sources adjacent in one allocation (extra_kv's rows right
after kv's, as DeepSeek-V4's engine keeps a prefill's keys and a layer's compressed entries) the buffer is
a view of them; otherwise they are copied into one: (s_kv + s_extra) rows of d_qk bf16 values (V4-Flash, a
4096-token chunk over 4096 window rows and 16384 compressed entries: 21 MB, against 0.34 TFLOP of
attention for 128 + 512 keys per query; in a long prefill the window rows are every earlier token's).
scripts/bench_prefill.py measures the gather's share.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, check_tensor, check_tensors
from ._launch import described, launch, per_signature
from .sparse_mla_prefill import PrefillConfig, sparse_mla_prefill


@triton.jit(do_not_specialize=["s_kv", "s_extra", "topk", "extra_topk", "has_topk_length", "has_extra_topk_length"])
def _combine_lists_kernel(indices_ptr, extra_indices_ptr, topk_length_ptr, extra_topk_length_ptr, combined_ptr,
                          lengths_ptr, s_kv, s_extra, topk, extra_topk, stride_i, stride_i_k, stride_ei, stride_ei_k,
                          has_topk_length, has_extra_topk_length, BLOCK: tl.constexpr):
    """One query row's combined list (combine_sources): its used window entries, then its used extra entries
    + s_kv, then -1, invalid entries -1; and, with either length, the used count."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    n_main = topk
    if has_topk_length:
        n_main = tl.minimum(tl.maximum(tl.load(topk_length_ptr + row), 0), topk)
    n_extra = extra_topk
    if has_extra_topk_length:
        n_extra = tl.minimum(tl.maximum(tl.load(extra_topk_length_ptr + row), 0), extra_topk)
    in_main = pos < n_main
    extra_pos = pos - n_main
    in_extra = (extra_pos >= 0) & (extra_pos < n_extra)
    main = tl.load(indices_ptr + row * stride_i + pos * stride_i_k, mask=in_main, other=-1)
    extra = tl.load(extra_indices_ptr + row * stride_ei + extra_pos * stride_ei_k, mask=in_extra, other=-1)
    main = tl.where((main >= 0) & (main < s_kv), main, -1)
    extra = tl.where((extra >= 0) & (extra < s_extra), extra + s_kv, -1)
    tl.store(combined_ptr + row * (topk + extra_topk) + pos, tl.where(in_main, main, extra),
             mask=pos < topk + extra_topk)
    if has_topk_length + has_extra_topk_length > 0:
        tl.store(lengths_ptr + row, n_main + n_extra)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> the combining
# launch's (grid, runtime integers, constexprs, compiled kernel): a signature seen before passed the checks.
_COMBINATIONS: dict = {}


def _combination(kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length) -> tuple:
    """What combine_sources derives from a call signature (grid, integers, constexprs, compiled kernels)."""
    s_q, _, topk = indices.shape
    extra_topk = extra_indices.shape[2]
    integers = (kv.shape[0], extra_kv.shape[0], topk, extra_topk, indices.stride(0), indices.stride(2),
                extra_indices.stride(0), extra_indices.stride(2), int(topk_length is not None),
                int(extra_topk_length is not None))
    return (s_q,), integers, dict(BLOCK=triton.next_power_of_2(max(1, topk + extra_topk))), {}


def combine_sources(kv: torch.Tensor, indices: torch.Tensor, extra_kv: torch.Tensor, extra_indices: torch.Tensor,
                    topk_length: Optional[torch.Tensor] = None, extra_topk_length: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """
    One key buffer and one index list per query that mean the same as the two sources (a copy of the
    sources, one launch for the lists).

    Args:
        kv: [s_kv, 1, d_qk], extra_kv: [s_extra, 1, d_qk], one dtype, on the kernels' device.
        indices: [s_q, 1, topk], extra_indices: [s_q, 1, extra_topk], int32 rows of kv / extra_kv; values
            outside [0, s_kv) / [0, s_extra) are invalid.
        topk_length, extra_topk_length: optional [s_q] int32: row i uses indices[i, 0, :topk_length[i]]
            (clamped to [0, topk]), likewise for the extra list.
        (Inputs as sparse_mla_prefill_two_sources checks them; this function does not check them.)

    Returns:
        (kv_all [s_kv + s_extra, 1, d_qk]: kv then extra_kv (a view of their memory when extra_kv's rows
         follow kv's in one allocation with kv's strides, else a copy),
         indices_all [s_q, 1, topk + extra_topk] int32: row i's used window entries, then its used extra
         entries + s_kv, then -1; invalid entries as -1 (never shifted into the other source's rows),
         topk_length_all [s_q] int32 (the used count, or None when neither length is given)).
    """
    return _combined(per_signature(_COMBINATIONS, lambda: (
        described(kv), described(indices), described(extra_kv), described(extra_indices), described(topk_length),
        described(extra_topk_length)),
        lambda: _combination(kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length)),
        kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length)


def _combined(combination: tuple, kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length):
    """combine_sources' results, with the call signature's _combination."""
    grid, integers, constexprs, compiled = combination
    s_q, _, topk = indices.shape
    combined = torch.empty(s_q, 1, topk + extra_indices.shape[2], dtype=torch.int32, device=indices.device)
    lengths = None
    if topk_length is not None or extra_topk_length is not None:
        lengths = torch.empty(s_q, dtype=torch.int32, device=indices.device)
    if s_q:
        # Lengths not given: a given tensor stands in (never read, the flags say so).
        launch(_combine_lists_kernel, grid, (
            indices, extra_indices, topk_length if topk_length is not None else indices,
            extra_topk_length if extra_topk_length is not None else indices, combined,
            lengths if lengths is not None else combined, *integers), constexprs, compiled)
    return _joined(kv, extra_kv), combined, lengths


def _joined(kv: torch.Tensor, extra_kv: torch.Tensor) -> torch.Tensor:
    """kv's rows then extra_kv's as one tensor: a view of both in place when extra_kv's rows follow kv's in
    one allocation with kv's strides (e.g. two slices of one buffer), else a copy."""
    s_kv = kv.shape[0]
    if extra_kv.stride() == kv.stride() and extra_kv.data_ptr() == kv.data_ptr() + s_kv * kv.stride(0) * \
            kv.element_size() and extra_kv.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr():
        return kv.as_strided((s_kv + extra_kv.shape[0], *kv.shape[1:]), kv.stride())
    return torch.cat([kv, extra_kv], 0)


def sparse_mla_prefill_two_sources(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    extra_kv: torch.Tensor,
    extra_indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    config: Optional[PrefillConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Sparse MLA prefill where each query attends to keys of two sources in one softmax: FlashMLA's
    flash_mla_sparse_fwd over the concatenation of the sources and of their index lists (DeepSeek-V4:
    kv = the window keys, extra_kv = the compressed entries, both bf16 K = V rows; d_qk = d_v = 512).

    Args:
        q: [s_q, h_q, d_qk], bfloat16.
        kv: [s_kv, 1, d_qk] and extra_kv: [s_extra, 1, d_qk], q.dtype.
        indices: [s_q, 1, topk] and extra_indices: [s_q, 1, extra_topk], int32 rows of kv and of extra_kv.
            Values outside [0, s_kv) (resp. [0, s_extra)) are invalid and skipped (any value); duplicates
            count twice.
        sm_scale, d_v, attn_sink: as in sparse_mla_prefill.
        topk_length, extra_topk_length: optional [s_q] int32: row i uses indices[i, 0, :topk_length[i]]
            and extra_indices[i, 0, :extra_topk_length[i]] (each clamped to its width).
        out, config: keyword-only, optional, as in sparse_mla_prefill (preallocated results; a launch shape).

    Returns:
        (out [s_q, h_q, d_v] q.dtype, max_logits [s_q, h_q] float32, lse [s_q, h_q] float32), as
        sparse_mla_prefill over both sources: lse without the sink; a row with no valid index in either
        list gets out 0, lse +inf, max_logits -inf.

    Raises:
        minirt.errors.InputError: the checks of sparse_mla_prefill, extra_kv not like kv (rank, d_qk,
            dtype), extra_indices not int32 [s_q, 1, extra_topk], a length not int32 [s_q].
    """
    combination = per_signature(_PLANS, lambda: (
        described(q), described(kv), described(indices), described(extra_kv), described(extra_indices),
        described(topk_length), described(extra_topk_length)),
        lambda: _check_sources(q, kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length)
        or _combination(kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length))
    kv_all, indices_all, lengths = _combined(combination, kv, indices, extra_kv, extra_indices, topk_length,
                                             extra_topk_length)
    return sparse_mla_prefill(q, kv_all, indices_all, sm_scale, d_v, attn_sink, lengths, out=out, config=config)


# Call signature -> its _combination: a signature seen before passed _check_sources.
_PLANS: dict = {}


def _check_sources(q, kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length) -> None:
    """sparse_mla_prefill_two_sources' checks of the second source and the lengths (InputError); the rest
    is sparse_mla_prefill's."""
    check_tensors({"q": q, "kv": kv, "indices": indices, "extra_kv": extra_kv, "extra_indices": extra_indices})
    if kv.dim() != 3 or extra_kv.dim() != 3 or extra_kv.shape[1:] != kv.shape[1:] or extra_kv.dtype != kv.dtype:
        raise InputError(f"extra_kv must be a {kv.dtype} tensor [s_extra, {', '.join(map(str, kv.shape[1:]))}] like "
                         f"kv, got {extra_kv.dtype} {tuple(extra_kv.shape)}")
    s_q = q.shape[0] if q.dim() == 3 else None
    for name, t in (("indices", indices), ("extra_indices", extra_indices)):
        if t.dim() != 3 or t.dtype != torch.int32 or t.shape[:2] != (s_q, 1):
            raise InputError(f"{name} must be an int32 tensor [s_q={s_q}, 1, topk], got {t.dtype} {tuple(t.shape)}")
    tensors = {}
    check_tensor(tensors, "topk_length", topk_length, torch.int32, (s_q,), optional=True)
    check_tensor(tensors, "extra_topk_length", extra_topk_length, torch.int32, (s_q,), optional=True)
    check_device({"q": q, "kv": kv, "indices": indices, "extra_kv": extra_kv, "extra_indices": extra_indices,
                  **tensors})
