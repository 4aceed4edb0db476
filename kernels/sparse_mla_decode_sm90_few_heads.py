"""Hopper (sm_90) fp8 sparse decode for few heads (h_q <= 32: V3.2's 128 heads at tensor parallelism
4 or 8), written in Gluon. Same semantics, arguments and launch geometry as sparse_mla_decode_sm90.

Padded to wgmma's M of 64 heads, 16 heads would waste 75% of the MMAs, and the consumers' 64-row
accumulators take the registers a second producer needs; at every head count the producer (its gathers
and dequantisation) sets the cost of a block (docs/perf/decode.md). So here the keys are the MMAs' M side:

    S^T [64 keys, H] = K [64, 576] . q^T        O^T [512, H] += V^T [512, 64] . P^T [64, H]

with H = h_q rounded up to 16 or 32 (wgmma's N). One consumer warpgroup holds O^T (512 x 32 fp32 is 128
registers a thread) and computes the softmax down the key axis; two producer warpgroups (produce_blocks
of sparse_mla_decode_sm90) fill the two block buffers, each every other block, so two blocks are
gathered and dequantised at once. The consumer returns each buffer as soon as its P.V is done.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from ._launch import launch as launch_compiled
from .sparse_mla_decode_sm90 import RUNTIME_ARGS, allocate_blocks, allocate_q, producer, program_span
from .sparse_mla_prefill_sm90 import (BLOCK_N, HALF, HALF_L, NO_MAX, VEC_SMEM, inverse_denominators, load_q,
                                      opaque_zero, score_piece, store_lse, store_rows, wait_piece)

HEADS = (16, 32)   # wgmma N of the program's heads: h_q up to 32, rounded up


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_decode_few_heads_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, split_len, block_size, num_slots, block_stride_16, sm_scale_log2,
    has_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    SPLIT: gl.constexpr, PADDED_BLOCKS: gl.constexpr, H: gl.constexpr,
):
    b, s, head0, lo, hi, n_steps = program_span(n_head_blocks, s_q, topk, split_len, num_slots, has_topk_length,
                                                topk_length_ptr, batch_order_ptr, H)
    # Shared memory, 190 KiB at H 32 (170 at H 16): q (36), two bf16 key blocks (144), P^T, slot ids,
    # barriers, the reductions' scratch.
    q_halves, q_rope = allocate_q(H)
    blocks = allocate_blocks(1)
    p_t = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, H],
                                                                                                    gl.bfloat16))
    load_ids_0 = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)   # each producer's own
    load_ids_1 = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)
    source = (cache_ptr, indices_ptr + b * stride_i_b + s * stride_i_s, lo, hi,
              (num_slots, block_size, block_stride_16, PADDED_BLOCKS))
    gl.warp_specialize([
        (consumer_t, (blocks, p_t, q_ptr + b * stride_q_b + s * stride_q_s, stride_q_h, q_halves, q_rope, num_slots,
                      n_steps, head0, h_q, sm_scale_log2, sink_ptr,
                      out_ptr + gl.program_id(1) * stride_o_split + b * stride_o_b + s * stride_o_s, stride_o_h,
                      lse_ptr + gl.program_id(1) * stride_l_split + b * stride_l_b + s * stride_l_s, stride_l_h,
                      has_sink, SPLIT, True)),
        (producer, (blocks, load_ids_0, source, n_steps, 0, 2)),
        (producer, (blocks, load_ids_1, source, n_steps, 1, 2)),
    ], [4, 4], [136, 136])


@gluon.jit
def _scores_t(k_left, k_right, k_rope, ready, q_halves, q_rope, step, s_t, HAS_ROPE: gl.constexpr):
    """Issue S^T of block `step` (keys x heads) once it has landed (HAS_ROPE: see consumer_t)."""
    buf = step & 1
    zero = opaque_zero(step)
    wait_piece(ready, buf, (step >> 1) & 1)
    s_t = score_piece(k_left.index(buf), q_halves.index(zero), s_t, True)
    s_t = score_piece(k_right.index(buf), q_halves.index(zero + 1), s_t, False)
    if HAS_ROPE:
        s_t = score_piece(k_rope.index(buf), q_rope.index(zero), s_t, False)
    return s_t


@gluon.jit
def consumer_t(blocks, p_t, q_row, stride_q_h, q_halves, q_rope, num_slots, n_steps, head0, h_q, sm_scale_log2,
               sink_ptr, out_row, stride_o_h, lse_row, stride_l_h, has_sink, SPLIT: gl.constexpr,
               HAS_ROPE: gl.constexpr):
    """q, S^T, the softmax down each head's column, O^T, out and lse (a split: partials, see
    sparse_mla_decode_sm90). HAS_ROPE: q and the keys have 64 rope columns beside their 512 (V32)."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    H: gl.constexpr = p_t.shape[1]
    # Keys (or latent columns) on M, heads on N; the [64, H] scores and the [256, H] output halves share
    # it, so per-head vectors broadcast over both.
    T_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    HEAD_T: gl.constexpr = gl.SliceLayout(0, T_L)
    load_q(q_row, stride_q_h, head0, h_q, q_halves, q_rope, HAS_ROPE)
    gl.thread_barrier()   # every warp's heads of q are in shared memory before the warpgroup's MMAs
    m_i = gl.full([H], NO_MAX, gl.float32, HEAD_T)
    # Each thread's share of the row sums, reduced once at the end (the max needs a reduction across
    # the warps every block; the sums do not).
    l_t = gl.zeros([BLOCK_N, H], gl.float32, T_L)
    left = gl.zeros([HALF, H], gl.float32, T_L)
    right = gl.zeros([HALF, H], gl.float32, T_L)
    s_t = gl.zeros([BLOCK_N, H], gl.float32, T_L)
    if n_steps > 0:
        s_t = warpgroup_mma_wait(0, deps=(_scores_t(k_left, k_right, k_rope, ready, q_halves, q_rope, 0, s_t,
                                                    HAS_ROPE),))
    for step in range(n_steps):
        buf = step & 1
        ids = key_ids.index(buf).load(gl.SliceLayout(1, T_L))
        s_t = gl.where(((ids >= 0) & (ids < num_slots))[:, None], s_t * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_t, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s_t - m_new[None, :])
        l_t = l_t * alpha[None, :] + p
        m_i = m_new
        # P^T is an MMA operand from shared memory: every warp's keys land before the warpgroup reads it
        # (the previous block's P.V, its last reader, is done).
        p_t.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        left = warpgroup_mma(k_left.index(buf).permute((1, 0)), p_t, left * alpha[None, :], is_async=True)
        right = warpgroup_mma(k_right.index(buf).permute((1, 0)), p_t, right * alpha[None, :], is_async=True)
        # The buffer goes back to its producer before the next block is awaited: that block's producer
        # is the other one, and waiting for it first would chain the two producers' fills.
        left, right = warpgroup_mma_wait(0, deps=(left, right))
        mbarrier.arrive(free.index(buf))
        if step + 1 < n_steps:
            s_t = warpgroup_mma_wait(0, deps=(_scores_t(k_left, k_right, k_rope, ready, q_halves, q_rope, step + 1,
                                                        s_t, HAS_ROPE),))
    l_i = gl.sum(l_t, 0)
    inv = inverse_denominators(m_i, l_i, sink_ptr, 1, head0, h_q, has_sink, SPLIT)
    _store_out_t(left, inv, out_row, stride_o_h, 0, head0, h_q)
    _store_out_t(right, inv, out_row, stride_o_h, HALF, head0, h_q)
    store_lse(m_i, l_i, lse_row, stride_l_h, head0, h_q, SPLIT)


@gluon.jit
def _store_out_t(acc_t, inv, out_row, stride_o_h, col0, head0, h_q):
    """out_row[h, col0:col0+256] = acc_t[:, h] * inv[h] for heads head0.. (< h_q), in out's dtype
    (bf16, or fp32 partials), transposed in registers to rows of contiguous columns."""
    dtype: gl.constexpr = out_row.dtype.element_ty
    out = gl.convert_layout(gl.permute((acc_t * inv[None, :]).to(dtype), (1, 0)), HALF_L)
    store_rows(out, out_row, stride_o_h, 1, col0, head0, h_q)


def program_heads(h_q: int):
    """The heads a program of this kernel takes for h_q query heads: h_q rounded up to one of HEADS, or
    None above them (the 64-head kernel's case)."""
    for heads in HEADS:
        if h_q <= heads:
            return heads
    return None


def launch(grid, args, split: bool, padded_blocks: bool, heads: int, compiled: dict) -> None:
    """As sparse_mla_decode_sm90.launch, for h_q <= 32; heads: program_heads(h_q)."""
    # maxnreg: 12 warps x 168 registers fit the register file at launch; the partitions then move to
    # 232 / 136 / 136 (consumer / producers: scripts/sm90_registers.py shows them, without spills).
    launch_compiled(_sparse_decode_few_heads_kernel, grid, args,
                    dict(SPLIT=split, PADDED_BLOCKS=padded_blocks, H=heads, num_warps=4, maxnreg=168), compiled)
