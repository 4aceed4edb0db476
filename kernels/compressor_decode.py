"""DeepSeek-V4's compressor at decode, one launch: store each token's rows in its sequence's fp32 ring
and, when the token completes its window, pool the window into the compressed entry (per-channel
softmax over the window's scores, the kv rows weighted by it), RMS-normalise it and rope its last
dims at the window's first position.

The torch form (``minirt.models.deepseek_v4.layers.Compressor``'s prefill path, the eager reference's
``compress``) takes ~40 small ops a decode step; this kernel reads the ring once and only when a window
completes (one step in ``ratio``), with no host synchronisation.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, rotated


@triton.jit
def _pool_slots(top, den, acc, sc, kv):
    """One block of slots [S, DIM] into the per-channel online softmax (running max, denominator, sum)."""
    new_top = tl.maximum(top, tl.max(sc, axis=0))
    e = tl.exp(sc - new_top[None, :])
    scale = tl.exp(top - new_top)
    return new_top, den * scale + tl.sum(e, axis=0), acc * scale + tl.sum(e * kv, axis=0)


@triton.jit
def _compressor_decode_kernel(kv_ptr, gate_ptr, ape_ptr, ring_kv_ptr, ring_score_ptr, pos_ptr, seq_ptr, w_ptr,
                              cos_ptr, sin_ptr, out_ptr, slots_ptr, stride_kv, stride_gate, stride_rb, stride_rr,
                              stride_ot, stride_ob, stride_ow, stride_c, stride_s, slots_per_seq, eps,
                              DIM: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, ROPE: tl.constexpr,
                              SLOT_BLOCK: tl.constexpr, BY_TOKEN: tl.constexpr, SLOTS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + i).to(tl.int64)
    s = tl.load(seq_ptr + i).to(tl.int64)
    w = p // RATIO
    cols = tl.arange(0, DIM)
    ROWS: tl.constexpr = RATIO * (2 if OVERLAP else 1)
    CUR: tl.constexpr = DIM if OVERLAP else 0  # the window's own channels: CSA's second halves
    ring = s * stride_rb
    ape_row = ape_ptr + (p % RATIO) * (2 * DIM if OVERLAP else DIM)
    # The token's rows go to ring row p mod ROWS (no other position of the pooled windows maps there).
    new_kv = tl.load(kv_ptr + i * stride_kv + CUR + cols)
    new_score = tl.load(gate_ptr + i * stride_gate + CUR + cols) + tl.load(ape_row + CUR + cols)
    tl.store(ring_kv_ptr + ring + (p % ROWS) * stride_rr + CUR + cols, new_kv)
    tl.store(ring_score_ptr + ring + (p % ROWS) * stride_rr + CUR + cols, new_score)
    if OVERLAP:
        first_kv = tl.load(kv_ptr + i * stride_kv + cols)
        first_score = tl.load(gate_ptr + i * stride_gate + cols) + tl.load(ape_row + cols)
        tl.store(ring_kv_ptr + ring + (p % ROWS) * stride_rr + cols, first_kv)
        tl.store(ring_score_ptr + ring + (p % ROWS) * stride_rr + cols, first_score)
    emit = (p + 1) % RATIO == 0
    if BY_TOKEN:
        out_row = out_ptr + i * stride_ot
    else:
        out_row = out_ptr + s * stride_ob + w * stride_ow
    if emit:
        # Online softmax per channel over the window's slots (its last one the token itself, finite: the
        # running max is finite from the first block on), then CSA's previous window's first halves.
        j = tl.arange(0, SLOT_BLOCK)
        top = tl.full((DIM,), float("-inf"), tl.float32)
        den = tl.zeros((DIM,), tl.float32)
        acc = tl.zeros((DIM,), tl.float32)
        for j0 in tl.static_range(0, RATIO, SLOT_BLOCK):
            q = w * RATIO + j0 + j
            from_ring = (j0 + j < RATIO - 1)[:, None]
            is_new = (j0 + j == RATIO - 1)[:, None]
            rows = ring + (q % ROWS)[:, None] * stride_rr + CUR + cols[None, :]
            sc = tl.where(from_ring, tl.load(ring_score_ptr + rows, mask=from_ring, other=0.0),
                          tl.where(is_new, new_score[None, :], float("-inf")))
            kv = tl.where(from_ring, tl.load(ring_kv_ptr + rows, mask=from_ring, other=0.0),
                          tl.where(is_new, new_kv[None, :], 0.0))
            top, den, acc = _pool_slots(top, den, acc, sc, kv)
        if OVERLAP:
            if w > 0:  # window 0 has no previous window
                for j0 in tl.static_range(0, RATIO, SLOT_BLOCK):
                    q = (w - 1) * RATIO + j0 + j
                    valid = (j0 + j < RATIO)[:, None]
                    rows = ring + (q % ROWS)[:, None] * stride_rr + cols[None, :]
                    sc = tl.load(ring_score_ptr + rows, mask=valid, other=float("-inf"))
                    kv = tl.load(ring_kv_ptr + rows, mask=valid, other=0.0)
                    top, den, acc = _pool_slots(top, den, acc, sc, kv)
        pooled = acc / den
        y = pooled / tl.sqrt(tl.sum(pooled * pooled, axis=0) / DIM + eps) * tl.load(w_ptr + cols)
        # Rope on the last ROPE dims (interleaved pairs) at the window's first position; pairs before them
        # rotate by angle 0.
        a, b = tl.split(tl.reshape(y, (DIM // 2, 2)))
        pair = tl.arange(0, DIM // 2) - (DIM - ROPE) // 2
        roped = pair >= 0
        cos = tl.load(cos_ptr + w * RATIO * stride_c + pair, mask=roped, other=1.0)
        sin = tl.load(sin_ptr + w * RATIO * stride_s + pair, mask=roped, other=0.0)
        a, b = rotated(a, b, cos, sin)
        y = tl.reshape(tl.join(a, b), (DIM,))
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty))
        if SLOTS:
            tl.store(slots_ptr + i, s * slots_per_seq + w)
    elif BY_TOKEN:
        tl.store(out_row + cols, tl.zeros((DIM,), tl.float32).to(out_ptr.dtype.element_ty))
        if SLOTS:
            tl.store(slots_ptr + i, -1)


def compressor_decode(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ring_kv: torch.Tensor,
                      ring_score: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor, weight: torch.Tensor,
                      eps: float, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *,
                      slots_per_seq: Optional[int] = None) -> Optional[torch.Tensor]:
    """
    One decode token per sequence through a V4 compressor of ratio m = ``ape.shape[0]``: token i (position
    p, sequence seq[i]) stores its rows (kv, gate + ape[p mod m]) at row p mod rows of its sequence's
    ring; when p + 1 is a multiple of m it writes window w = p // m's entry
    ``rope(rmsnorm(Σ_slots softmax(score) · kv) · weight)`` at position m · w. Overlapping windows (CSA,
    width = 2 · dim): the window's second halves and the previous window's first halves (none for w = 0);
    else (HCA, width = dim) the window's rows. The same entries as the eager reference's ``compress``.

    Args:
        kv, gate: [b, width] float32, unit last stride: the token's products ``wkv·x``, ``wgate·x``.
        ape: [m, width] float32, contiguous.
        ring_kv, ring_score: [B, rows, width] float32, contiguous, rows = 2m overlapping else m: the rows
            of the sequences' last positions (position q at row q mod rows), written in place.
        positions, seq: [b] int64: the tokens' positions and ring sequences (distinct).
        weight: [dim] float32 (the compressor's norm); eps: the norm's epsilon.
        cos, sin: [P, r / 2] float32 rope tables by position, unit last stride (r even, <= dim).
        out: the entries, either [b, dim] (by token: rows of tokens that complete no window are set to
            0) or [B, n, dim] (by sequence and window: only completed windows are written, at
            out[seq[i], w]); float32 or bfloat16, unit last stride. dim a power of two.
        slots_per_seq: with a [b, dim] out: also return the slots ``seq · slots_per_seq + w`` (−1 where no
            window completes), as write_kv_model1 takes them.

    Returns:
        [b] int64 slots with ``slots_per_seq``, else None.

    Raises:
        minirt.errors.InputError: wrong shapes, dtypes or strides, or a device the kernels cannot use.
    """
    b, width = kv.shape if kv.dim() == 2 else (0, 0)
    m = ape.shape[0] if ape.dim() == 2 else 0
    dim = out.shape[-1]
    overlap = width == 2 * dim
    rows = m * (2 if overlap else 1)
    ok = (kv.dim() == 2 and gate.shape == kv.shape and width in (dim, 2 * dim) and dim >= 2 and dim & (dim - 1) == 0
          and m >= 1 and tuple(ape.shape) == (m, width) and ring_kv.dim() == 3 and ring_kv.shape[1:] == (rows, width)
          and ring_score.shape == ring_kv.shape and tuple(positions.shape) == (b,) and tuple(seq.shape) == (b,)
          and tuple(weight.shape) == (dim,) and cos.dim() == 2 and sin.shape == cos.shape and 2 <= 2 * cos.shape[1] <= dim
          and out.dim() in (2, 3) and (out.dim() == 3 or out.shape[0] == b) and (slots_per_seq is None or out.dim() == 2))
    if not ok:
        raise InputError(f"compressor_decode: inconsistent shapes kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, ape "
                         f"{tuple(ape.shape)}, ring {tuple(ring_kv.shape)} / {tuple(ring_score.shape)}, positions "
                         f"{tuple(positions.shape)}, seq {tuple(seq.shape)}, weight {tuple(weight.shape)}, cos / sin "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}, out {tuple(out.shape)}")
    f32 = (kv, gate, ape, ring_kv, ring_score, weight, cos, sin)
    if any(t.dtype != torch.float32 for t in f32) or out.dtype not in (torch.float32, torch.bfloat16) or \
            positions.dtype != torch.int64 or seq.dtype != torch.int64:
        raise InputError("compressor_decode: float32 rows, ring, ape, weight and tables, int64 positions / seq, "
                         "float32 / bfloat16 out")
    if any(t.stride(-1) != 1 for t in (kv, gate, cos, sin, out)) or not all(
            t.is_contiguous() for t in (ape, ring_kv, ring_score, weight)):
        raise InputError("compressor_decode: kv, gate, cos, sin and out need unit last stride; ape, the rings and "
                         "weight must be contiguous")
    check_device({"kv": kv, "gate": gate, "ape": ape, "ring_kv": ring_kv, "ring_score": ring_score,
                  "positions": positions, "seq": seq, "weight": weight, "cos": cos, "sin": sin, "out": out})
    slots = torch.empty(b, dtype=torch.int64, device=kv.device) if slots_per_seq is not None else None
    if b:
        by_token = out.dim() == 2
        _compressor_decode_kernel[(b,)](
            kv, gate, ape, ring_kv, ring_score, positions, seq, weight, cos, sin, out,
            slots if slots is not None else positions, kv.stride(0), gate.stride(0), ring_kv.stride(0),
            ring_kv.stride(1), out.stride(0) if by_token else 0, 0 if by_token else out.stride(0),
            0 if by_token else out.stride(1), cos.stride(0), sin.stride(0), slots_per_seq or 0, float(eps),
            DIM=dim, RATIO=m, OVERLAP=overlap, ROPE=2 * cos.shape[1], SLOT_BLOCK=min(triton.next_power_of_2(m), 8),
            BY_TOKEN=by_token, SLOTS=slots is not None, num_warps=4)
    return slots
