"""Hopper (sm_90) fast path of sparse_mla_prefill, written in Gluon (Triton's explicit-layout dialect).

Same semantics as the portable Triton kernel in sparse_mla_prefill.py, for d_v 512 with d_qk 576 (V3.2:
512 latent + 64 rope) or 512 (V4: the rope inside the 512 columns, so K and V are the same columns). What the portable kernel cannot express and this one does:
the gather of key chunk i+1 (cp.async into the other half of a double buffer) is issued before the
tensor-core work of chunk i, so its latency hides behind that work, and chunk i+2's indices are
loaded one step earlier still. Triton 3.6's pipeliner issues the gather after chunk i's math and
waits for it at once (docs/perf/prefill.md). One program = one query token x 64 heads, 8 warps; the
attention step itself is mla_sm90.attend_chunk.

Gluon has no interpreter: this kernel runs only on sm_90 GPUs. sparse_mla_prefill dispatches to it
there (uses_sm90_kernel) and to the portable kernel everywhere else (CPU interpreter, other GPUs, other
head dims, an explicit PrefillConfig).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .mla_sm90 import (BLOCK_H, BLOCK_N, COL_S, D_LAT, D_ROPE, LAT_L, LN2, LOG2E, NUM_WARPS, O_LAYOUT, ROPE_L,
                       ROW_O, ROW_S, attend_chunk, chunk_indices, load_q)


@gluon.jit(do_not_specialize=["s_kv", "h_q", "topk", "n_head_blocks"])
def _sparse_mla_prefill_sm90_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, attn_sink_ptr,
    out_ptr, max_logits_ptr, lse_ptr,
    s_kv, h_q, topk, n_head_blocks, sm_scale_log2,
    stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_idx_k, stride_tl_s, stride_sink_h,
    stride_o_s, stride_o_h, stride_o_d, stride_ml_s, stride_ml_h, stride_lse_s, stride_lse_h,
    HAS_TOPK_LENGTH: gl.constexpr, HAS_ATTN_SINK: gl.constexpr, HAS_ROPE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    LAT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], dtype)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
    pid = gl.program_id(0)
    token = (pid // n_head_blocks).to(gl.int64)
    head0 = (pid % n_head_blocks) * BLOCK_H

    q_lat_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LAT], LAT_SMEM)
    q_rope_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], ROPE_SMEM)
    load_q(q_ptr + token * stride_q_s, stride_q_h, head0, h_q, q_lat_smem, q_rope_smem, HAS_ROPE)

    n_keys = topk
    if HAS_TOPK_LENGTH:
        n_keys = gl.minimum(gl.maximum(gl.load(topk_length_ptr + token * stride_tl_s), 0), topk)
    k_lat_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_LAT], LAT_SMEM)
    k_rope_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_ROPE], ROPE_SMEM)
    idx_row = indices_ptr + token * stride_idx_s
    LAT_ROWS: gl.constexpr = gl.SliceLayout(1, LAT_L)
    
    # Prologue: gather chunk 0, load chunk 1's indices.
    _gather(kv_ptr, stride_kv_s, s_kv, chunk_indices(idx_row, stride_idx_k, 0, n_keys, LAT_ROWS),
            idx_row, stride_idx_k, 0, n_keys, k_lat_smem.index(0), k_rope_smem.index(0), HAS_ROPE)
    idx_next = chunk_indices(idx_row, stride_idx_k, BLOCK_N, n_keys, LAT_ROWS)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, O_LAYOUT)
    for i in range(gl.cdiv(n_keys, BLOCK_N)):
        buf = i % 2
        # Chunk i has landed (this thread's copies: wait_group; everyone's: the barrier, which also
        # means every warp is done with chunk i-1, so its buffer can be refilled).
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        _gather(kv_ptr, stride_kv_s, s_kv, idx_next, idx_row, stride_idx_k, (i + 1) * BLOCK_N, n_keys,
                k_lat_smem.index(1 - buf), k_rope_smem.index(1 - buf), HAS_ROPE)
        idx_next = chunk_indices(idx_row, stride_idx_k, (i + 2) * BLOCK_N, n_keys, LAT_ROWS)
        idx_s = chunk_indices(idx_row, stride_idx_k, i * BLOCK_N, n_keys, COL_S)
        m_i, l_i, acc = attend_chunk(q_lat_smem, q_rope_smem, k_lat_smem.index(buf), k_rope_smem.index(buf),
                                     (idx_s >= 0) & (idx_s < s_kv), sm_scale_log2, m_i, l_i, acc, HAS_ROPE)
    cp.wait_group(0)

    # As in the portable kernel: l_i == 0 means no valid key (out 0, lse +inf, max_logits -inf).
    has_keys = l_i > 0.0
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    denom = gl.where(has_keys, l_i, 1.0)
    offs_h = head0 + gl.arange(0, BLOCK_H, ROW_S)
    h_mask = offs_h < h_q
    if HAS_ATTN_SINK:
        sink = gl.load(attn_sink_ptr + offs_h * stride_sink_h, mask=h_mask, other=0.0)
        denom += gl.exp2(sink * LOG2E - m_ref)
    out = acc * gl.convert_layout(gl.where(has_keys, 1.0 / denom, 0.0), ROW_O)[:, None]
    offs_ho = head0 + gl.arange(0, BLOCK_H, ROW_O)
    offs_d = gl.arange(0, D_LAT, gl.SliceLayout(0, O_LAYOUT))
    gl.store(out_ptr + token * stride_o_s + offs_ho[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=(offs_ho < h_q)[:, None])
    lse = gl.where(has_keys, (m_ref + gl.log2(gl.where(has_keys, l_i, 1.0))) * LN2, float("inf"))
    gl.store(max_logits_ptr + token * stride_ml_s + offs_h * stride_ml_h, m_i * LN2, mask=h_mask)
    gl.store(lse_ptr + token * stride_lse_s + offs_h * stride_lse_h, lse, mask=h_mask)


@gluon.jit
def _gather(kv_ptr, stride_kv_s, s_kv, idx_lat, idx_row, stride_idx_k, start, n_keys, lat_smem, rope_smem,
            HAS_ROPE: gl.constexpr):
    """cp.async the kv rows of one chunk (idx_lat: its indices in the latent copy layout; the rope
    copy loads them in its own) into shared memory. Invalid rows are never read: the masked copies
    zero-fill their smem rows, so no NaN from unreferenced rows reaches the MMAs."""
    valid = (idx_lat >= 0) & (idx_lat < s_kv)
    rows = kv_ptr + gl.where(valid, idx_lat, 0).to(gl.int64) * stride_kv_s
    cp.async_copy_global_to_shared(lat_smem, rows[:, None] + gl.arange(0, D_LAT, gl.SliceLayout(0, LAT_L))[None, :],
                                   mask=valid[:, None])
    if HAS_ROPE:
        idx_rope = chunk_indices(idx_row, stride_idx_k, start, n_keys, gl.SliceLayout(1, ROPE_L))
        valid = (idx_rope >= 0) & (idx_rope < s_kv)
        rows = kv_ptr + gl.where(valid, idx_rope, 0).to(gl.int64) * stride_kv_s
        cp.async_copy_global_to_shared(rope_smem, rows[:, None] + D_LAT
                                       + gl.arange(0, D_ROPE, gl.SliceLayout(0, ROPE_L))[None, :], mask=valid[:, None])
    cp.commit_group()


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether this kernel takes the call: an sm_90 GPU, d_v 512 with d_qk 576 or 512, and q / kv rows
    that are contiguous with 16-byte aligned kv rows (the copies move 16-byte vectors)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.shape[2] in (D_LAT + D_ROPE, D_LAT) and d_v == D_LAT and q.stride(2) == 1 and kv.stride(2) == 1
            and kv.stride(0) * kv.element_size() % 16 == 0 and kv.data_ptr() % 16 == 0)


def launch(q, kv, indices, sm_scale_log2, attn_sink, topk_length, out):
    """Run the kernel on inputs checked by sparse_mla_prefill; out = (o, max_logits, lse), written."""
    s_q, h_q, d_qk = q.shape
    o, max_logits, lse = out
    n_head_blocks = triton.cdiv(h_q, BLOCK_H)
    # Unused optional pointers still need a tensor argument; the constexpr flags keep them unread.
    sink = attn_sink if attn_sink is not None else lse
    lengths = topk_length if topk_length is not None else indices
    _sparse_mla_prefill_sm90_kernel[(s_q * n_head_blocks,)](
        q, kv, indices, lengths, sink, o, max_logits, lse,
        kv.shape[0], h_q, indices.shape[2], n_head_blocks, sm_scale_log2,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), indices.stride(2), lengths.stride(0),
        sink.stride(0), o.stride(0), o.stride(1), o.stride(2), max_logits.stride(0), max_logits.stride(1),
        lse.stride(0), lse.stride(1),
        HAS_TOPK_LENGTH=topk_length is not None, HAS_ATTN_SINK=attn_sink is not None, HAS_ROPE=d_qk > D_LAT,
        num_warps=NUM_WARPS,
    )
    return o, max_logits, lse
