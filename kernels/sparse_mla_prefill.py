"""NaN-safe sparse MLA prefill attention in Triton: a drop-in for FlashMLA's ``flash_mla_sparse_fwd``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minirt import formats
from minirt.errors import InputError

from . import sparse_mla_prefill_sm90 as sm90
from ._common import (INTERPRET, LN2, LOG2E, check_config, check_device, check_tensor, check_tensors,
                      softmax_rows, softmax_step)
from ._launch import Kept, cdiv, described, launch, per_signature


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the kernel: heads per program, keys per loop step, warps and pipeline depth."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Sizes are only compared, never used in addresses: specialising on them would only multiply compiles.
@triton.jit(do_not_specialize=["s_kv", "h_q", "topk", "n_head_blocks"])
def _sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, attn_sink_ptr,
    out_ptr, max_logits_ptr, lse_ptr,
    s_kv, h_q, topk, n_head_blocks, sm_scale_log2,
    stride_q_s, stride_q_h, stride_q_d,
    stride_kv_s, stride_kv_d,
    stride_idx_s, stride_idx_k,
    stride_tl_s, stride_sink_h,
    stride_o_s, stride_o_h, stride_o_d,
    stride_ml_s, stride_ml_h,
    stride_lse_s, stride_lse_h,
    D_V: tl.constexpr, D_QK: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr, HAS_ATTN_SINK: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED_TOPK: tl.constexpr,
):
    # One program: one query token x BLOCK_H heads; the heads of one token are adjacent programs so
    # their identical K gathers hit L2.
    pid = tl.program_id(0)
    token = (pid // n_head_blocks).to(tl.int64)
    offs_h = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q

    # The first D_V columns are both the "latent" part of Q.K and V; the tail (rope) only enters Q.K.
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < D_V
    q_rows = q_ptr + token * stride_q_s + offs_h[:, None] * stride_q_h
    q_lat = tl.load(q_rows + offs_v[None, :] * stride_q_d, mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
    if BLOCK_TAIL > 0:
        offs_t = D_V + tl.arange(0, BLOCK_TAIL)
        t_mask = offs_t < D_QK
        q_tail = tl.load(q_rows + offs_t[None, :] * stride_q_d, mask=h_mask[:, None] & t_mask[None, :], other=0.0)
        if UPCAST:
            q_tail = q_tail.to(tl.float32)

    n_keys = topk
    if HAS_TOPK_LENGTH:
        n_keys = tl.minimum(tl.maximum(tl.load(topk_length_ptr + token * stride_tl_s), 0), topk)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    idx_row = indices_ptr + token * stride_idx_s
    # The Triton 3.6 interpreter cannot use a runtime scalar as a loop bound with numpy >= 2.4
    # (int() of a 1-element array; it also turns every assigned name into such a tensor), so
    # interpreted runs loop to the constexpr topk instead: the extra chunks lie beyond n_keys and are
    # fully masked, exactly as on the GPU.
    for start in range(0, INTERPRETED_TOPK if UPCAST else n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + offs_n * stride_idx_k, mask=offs_n < n_keys, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        # Invalid rows are never read; their tile rows are exact zeros, so no 0 * NaN reaches the dots.
        kv_rows = kv_ptr + idx.to(tl.int64) * stride_kv_s
        k_lat = tl.load(kv_rows[:, None] + offs_v[None, :] * stride_kv_d,
                        mask=valid[:, None] & v_mask[None, :], other=0.0)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat))
        if BLOCK_TAIL > 0:
            k_tail = tl.load(kv_rows[:, None] + offs_t[None, :] * stride_kv_d,
                             mask=valid[:, None] & t_mask[None, :], other=0.0)
            if UPCAST:
                k_tail = k_tail.to(tl.float32)
            s = tl.dot(q_tail, tl.trans(k_tail), acc=s)
        m_i, l_i, acc = softmax_step(s, valid, sm_scale_log2, k_lat, m_i, l_i, acc)

    # Rows without a valid key get their fixed results: out 0, lse +inf, max_logits -inf.
    has_keys, l_safe, _ = softmax_rows(m_i, l_i)
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_safe
    if HAS_ATTN_SINK:
        # exp(lse) / (exp(lse) + exp(sink)) folded into the normaliser: sum_j 2^(s_j - m) + 2^(sink2 - m).
        sink = tl.load(attn_sink_ptr + offs_h * stride_sink_h, mask=h_mask, other=0.0)
        denom += tl.math.exp2(sink * LOG2E - m_ref)
    inv_denom = tl.where(has_keys, 1.0 / denom, 0.0)
    out = acc * inv_denom[:, None]

    out_rows = out_ptr + token * stride_o_s + offs_h[:, None] * stride_o_h
    tl.store(out_rows + offs_v[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & v_mask[None, :])
    lse = tl.where(has_keys, (m_ref + tl.math.log2(l_safe)) * LN2, float("inf"))
    tl.store(max_logits_ptr + token * stride_ml_s + offs_h * stride_ml_h, m_i * LN2, mask=h_mask)
    tl.store(lse_ptr + token * stride_lse_s + offs_h * stride_lse_h, lse, mask=h_mask)


def _padded(n: int) -> int:
    """Block width covering n columns: a power of two, at least 16 (the smallest tl.dot dimension)."""
    return max(16, 1 << (n - 1).bit_length())   # (triton.next_power_of_2: a constexpr function, µs a call)


def default_config(h_q: int) -> PrefillConfig:
    """The launch shape used by sparse_mla_prefill: 64 heads per program (8 warps, 64 keys per step,
    3 stages: fastest on an H200, docs/perf/prefill.md), fewer heads and 4 warps for small h_q."""
    if h_q >= 64:
        return PrefillConfig()
    return PrefillConfig(block_h=_padded(h_q), num_warps=4, num_stages=2)


def _check_inputs(q, kv, indices, d_v, attn_sink, topk_length, out, config) -> None:
    tensors = {"q": q, "kv": kv, "indices": indices}
    check_tensors(tensors)
    for name, t in tensors.items():
        if t.dim() != 3:
            raise InputError(f"{name} must have 3 dims, got shape {tuple(t.shape)}")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, d_qk_kv = kv.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"q must be bfloat16 or float16, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise InputError(f"kv dtype {kv.dtype} differs from q dtype {q.dtype}")
    if h_kv != 1:
        raise InputError(f"kv must have exactly one head (h_kv = 1, MQA), got kv shape {tuple(kv.shape)}")
    if d_qk_kv != d_qk:
        raise InputError(f"q head dim {d_qk} differs from kv head dim {d_qk_kv}")
    if indices.dtype != torch.int32:
        raise InputError(f"indices must be int32, got {indices.dtype}")
    if indices.shape[0] != s_q or indices.shape[1] != 1:
        raise InputError(f"indices must have shape [s_q={s_q}, h_kv=1, topk], got {tuple(indices.shape)}")
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= d_qk:
        raise InputError(f"d_v must be an int in [1, d_qk={d_qk}], got {d_v!r}")
    if d_v > 512 or d_qk - d_v > 64:
        raise InputError(f"unsupported head dims d_qk={d_qk}, d_v={d_v}: the kernel's register and shared-memory "
                         "budget needs d_v <= 512 and d_qk - d_v <= 64")
    check_tensor(tensors, "attn_sink", attn_sink, torch.float32, (h_q,), optional=True)
    check_tensor(tensors, "topk_length", topk_length, torch.int32, (s_q,), optional=True)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise InputError("out must be a tuple (out, max_logits, lse) of preallocated tensors")
        expected = (((s_q, h_q, d_v), q.dtype), ((s_q, h_q), torch.float32), ((s_q, h_q), torch.float32))
        for name, t, (shape, dtype) in zip(("out", "max_logits", "lse"), out, expected):
            check_tensor(tensors, f"preallocated {name}", t, dtype, shape)
    check_config(config, PrefillConfig)
    check_device(tensors)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment; d_v; config) -> its Kept
# (value: the portable kernel's PrefillConfig, None for the sm90 kernel): a signature seen before passed the checks.
_KEPT: dict = {}


def uses_sm90_kernel(q: torch.Tensor, kv: torch.Tensor, d_v: int, config: Optional[PrefillConfig] = None) -> bool:
    """Whether sparse_mla_prefill runs the Gluon kernel (sparse_mla_prefill_sm90) on these checked inputs:
    compiled (not interpreted), no explicit config, and inputs that kernel supports (sm_90 GPU, d_qk 576
    or 512, d_v 512, contiguous 16-byte aligned rows)."""
    return config is None and not INTERPRET and sm90.supported(q, kv, d_v)


def _launch(q, kv, indices, sm_scale_log2, attn_sink, topk_length, out, kept: Kept):
    """Run the portable kernel on inputs checked by sparse_mla_prefill; out = (o, max_logits, lse), written;
    kept: the call signature's Kept (value: its PrefillConfig)."""
    o, max_logits, lse = out
    # Unused optional pointers still need a tensor argument; the constexpr flags keep them unread.
    sink = attn_sink if attn_sink is not None else lse
    lengths = topk_length if topk_length is not None else indices
    if kept.args is None:
        config = kept.value
        s_q, h_q, d_qk = q.shape
        d_v = o.shape[2]
        n_head_blocks = cdiv(h_q, config.block_h)
        kept.args = ((s_q * n_head_blocks,), (kv.shape[0], h_q, indices.shape[2], n_head_blocks), (
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(2),
            indices.stride(0), indices.stride(2),
            lengths.stride(0), sink.stride(0),
            o.stride(0), o.stride(1), o.stride(2),
            max_logits.stride(0), max_logits.stride(1),
            lse.stride(0), lse.stride(1)), dict(
            D_V=d_v, D_QK=d_qk,
            BLOCK_V=_padded(d_v), BLOCK_TAIL=_padded(d_qk - d_v) if d_qk > d_v else 0,
            BLOCK_H=config.block_h, BLOCK_N=config.block_n,
            HAS_TOPK_LENGTH=topk_length is not None, HAS_ATTN_SINK=attn_sink is not None, UPCAST=INTERPRET,
            INTERPRETED_TOPK=indices.shape[2] if INTERPRET else 0,
            num_warps=config.num_warps, num_stages=config.num_stages))
    grid, sizes, strides, constexprs = kept.args
    launch(_sparse_mla_prefill_kernel, grid, (q, kv, indices, lengths, sink, o, max_logits, lse, *sizes, sm_scale_log2,
                                              *strides), constexprs, kept.compiled)
    return o, max_logits, lse


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    config: Optional[PrefillConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Sparse attention prefill (DeepSeek-V3.2 DSA, absorbed MLA / MQA form); same arguments and results
    as FlashMLA's flash_mla_sparse_fwd, so either can replace the other.

    Each query token i attends, in every head, to the kv rows listed in indices[i, 0, :]:
        P[i, h, j]      = sm_scale * q[i, h, :] . kv[indices[i, 0, j], 0, :]      (valid j only)
        max_logits[i,h] = max_j P[i, h, j]
        lse[i, h]       = log(sum_j exp(P[i, h, j]))                             (natural log)
        out[i, h, :]    = sum_j exp(P[i, h, j] - lse[i, h]) * kv[indices[i, 0, j], 0, :d_v]

    Args:
        q: [s_q, h_q, d_qk], bfloat16 or float16. Any h_q (not only 64/128) and any s_q
            (beyond 65535 too). d_qk is 576 for V3.2 (512 latent + 64 rope) or 512 (V4-style, no
            separate rope part); other sizes work within d_v <= 512 and d_qk - d_v <= 64.
        kv: [s_kv, h_kv, d_qk], same dtype as q; h_kv must be 1. V is kv[..., :d_v]. s_kv may exceed
            2^31 / d_qk rows (offsets are 64-bit).
        indices: [s_q, h_kv, topk], int32. Index j of row i is valid iff 0 <= indices[i, 0, j] < s_kv;
            any other value (-1, -2^31, s_kv, 2^31 - 1, ...) is skipped and its kv row never read.
            Any topk (not only multiples of the tile; topk > s_kv allowed); duplicates count twice.
        sm_scale: float, scale applied to q.k before the softmax.
        d_v: int in [1, min(d_qk, 512)] with d_qk - d_v <= 64, width of the value vectors (512 for
            DeepSeek).
        attn_sink: optional, [h_q], float32. out[i, h] is multiplied by
            exp(lse) / (exp(lse) + exp(attn_sink[h])); -inf has no effect, +inf zeroes the row.
            lse and max_logits are unchanged.
        topk_length: optional, [s_q], int32. Row i uses only indices[i, 0, :topk_length[i]]
            (values are clamped to [0, topk]); later entries are never read.
        out: keyword-only, optional tuple (out, max_logits, lse) of preallocated tensors with the
            shapes and dtypes below (any strides); every element is overwritten.
        config: keyword-only, optional PrefillConfig: run the portable Triton kernel with this launch
            shape. Default: see below.

    All tensors must be on one CUDA device (or on the CPU under TRITON_INTERPRET=1); any strides
    are honoured, nothing is copied. On sm_90 GPUs, calls without a config with d_qk 576 or 512, d_v 512
    and contiguous, 16-byte aligned q and kv rows run the Gluon kernel of sparse_mla_prefill_sm90
    (uses_sm90_kernel); all others run the portable Triton kernel here, with default_config(h_q) when
    config is None. Both kernels have the semantics below.

    Returns:
        out: [s_q, h_q, d_v], q.dtype. Compiled, the softmax weights are rounded to q.dtype for the
            P.V tensor-core product, as in FlashMLA (error <= 2^-8 * sum_j w_j |v_j| for bf16).
        max_logits: [s_q, h_q], float32, max over valid j of P (natural units, i.e. scaled logits).
        lse: [s_q, h_q], float32, natural-log log-sum-exp of P over valid j (without the sink).
        A row with no valid index gets out exactly 0, lse = +inf and max_logits = -inf. NaN or Inf
        in kv rows that no valid index points to never affects any result.

    Raises:
        minirt.errors.InputError: wrong type, dtype, shape or device, h_kv != 1, d_v not in [1, d_qk],
            head dims outside d_v <= 512 and d_qk - d_v <= 64.
    """
    kept = per_signature(_KEPT, lambda: (
        described(q), described(kv), described(indices), described(attn_sink), described(topk_length),
        None if out is None else tuple(described(t) for t in out), d_v.__class__, d_v, config),
        lambda: _check_inputs(q, kv, indices, d_v, attn_sink, topk_length, out, config)
        or Kept(None if uses_sm90_kernel(q, kv, d_v, config) else config or default_config(q.shape[1])))
    s_q, h_q, _ = q.shape
    if out is None:
        out = (torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device),
               torch.empty(s_q, h_q, dtype=torch.float32, device=q.device),
               torch.empty(s_q, h_q, dtype=torch.float32, device=q.device))
    if s_q == 0 or h_q == 0:
        return tuple(out)
    sm_scale_log2 = float(sm_scale) * formats.LOG2E
    if kept.value is None:   # (the signature's kernel: the sm90 one, else the portable one with its config)
        return sm90.launch(q, kv, indices, sm_scale_log2, attn_sink, topk_length, out, kept)
    return _launch(q, kv, indices, sm_scale_log2, attn_sink, topk_length, out, kept)
