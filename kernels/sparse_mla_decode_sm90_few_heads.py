"""Hopper (sm_90) fp8 sparse decode for few heads (h_q <= 32: V3.2's 128 heads at tensor parallelism
4 or 8), written in Gluon. Same semantics, arguments and launch geometry as sparse_mla_decode_sm90.

Padded to wgmma's M of 64 heads, 16 heads would waste 75% of the MMAs. So here the keys are the MMAs'
M side:

    S^T [64 keys, H] = K [64, 576] . q^T        O^T [512, H] += V^T [512, 64] . P^T [64, H]

with H = h_q rounded up to 16 or 32 (wgmma's N). One consumer warpgroup holds O^T (512 x 32 fp32 is 128
registers a thread) and computes the softmax down the key axis.

At so few heads the MMAs are short and the kernel is a gather: its speed is the bytes it keeps in flight
per SM (docs/perf/decode.md: 31 KB a warpgroup's registers hold gave 1934 GB/s, 62 KB 2682). So the
gathers do not go through registers: two producer warpgroups, each owning half of every block's keys,
cp.async the raw 656-byte tokens into a ring in shared memory, several blocks ahead, and dequantise from
there (the integer conversion of sparse_mla_decode_sm90) into one bf16 block. The ring takes the shared
memory a second bf16 block would: one block is dequantised while the consumer waits, and ~100 KB stay
in flight behind it.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from .sparse_mla_decode_sm90 import (PIECE, ROPE_AT, ROPE_W, RUNTIME_ARGS, SCALES_AT, SCALES_L, WORDS, WORDS_L,
                                     allocate_q, fill_piece, program_span, token_addresses)
from .sparse_mla_prefill_sm90 import (BLOCK_N, D_ROPE, HALF, HALF_L, NO_MAX, inverse_denominators, load_q, opaque_zero,
                                      publish_done, score_piece, store_lse, wait_piece)

HEADS = (16, 32)   # wgmma N of the program's heads: h_q up to 32, rounded up
# Ring slots (16-token pieces) per producer: what shared memory holds beside q, P^T and one bf16 block.
RING_PIECES = {16: 6, 32: 5}
TILES = gl.constexpr(4)   # 128-value fp8 tiles of a token's latent
# A piece's raw bytes as 32-bit words: latent [16, 4 tiles, 32] (a warp copies a token's 512 bytes in
# 16-byte vectors), scales [16, 4], rope [16, 32].
LATENT_COPY = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 4, 8], [4, 1, 1], [2, 1, 0]))
SCALES_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0]))
RAW_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
RAW_SMEM_2D = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_decode_few_heads_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, split_len, block_size, num_slots, block_stride_16, sm_scale_log2,
    has_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    SPLIT: gl.constexpr, PADDED_BLOCKS: gl.constexpr, H: gl.constexpr, RING: gl.constexpr,
):
    b, s, head0, lo, hi, n_steps = program_span(n_head_blocks, s_q, topk, split_len, num_slots, has_topk_length,
                                                topk_length_ptr, batch_order_ptr, H)
    # Shared memory, ~220 KiB: q (18 / 36 at H 16 / 32), one bf16 key block (72), P^T, the producers'
    # rings (123 / 103), barriers: ready (both producers -> consumer), free (consumer -> producers).
    q_halves, q_rope = allocate_q(H)
    half_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    k_left = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, HALF], half_smem)
    k_right = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, HALF], half_smem)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, D_ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16))
    p_t = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, H],
                                                                                                    gl.bfloat16))
    ring_0 = _allocate_ring(RING)
    ring_1 = _allocate_ring(RING)
    ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=2)
    mbarrier.init(free.index(0), count=1)
    tiles = (k_left, k_right, k_rope)
    geometry = (num_slots, block_size, block_stride_16, PADDED_BLOCKS)
    idx_row = indices_ptr + b * stride_i_b + s * stride_i_s
    gl.warp_specialize([
        (_consumer, (tiles, ready, free, p_t, q_ptr + b * stride_q_b + s * stride_q_s, stride_q_h, q_halves, q_rope,
                     idx_row, lo, hi, num_slots, n_steps, head0, h_q, sm_scale_log2, sink_ptr,
                     out_ptr + gl.program_id(1) * stride_o_split + b * stride_o_b + s * stride_o_s, stride_o_h,
                     lse_ptr + gl.program_id(1) * stride_l_split + b * stride_l_b + s * stride_l_s, stride_l_h,
                     has_sink, SPLIT)),
        (_producer, (tiles, ready, free, ring_0, cache_ptr, idx_row, lo, hi, n_steps, geometry, 0)),
        (_producer, (tiles, ready, free, ring_1, cache_ptr, idx_row, lo, hi, n_steps, geometry, 1)),
    ], [4, 4], [136, 136])


@gluon.jit
def _allocate_ring(slots: gl.constexpr):
    """A producer's ring of raw pieces: latent words [slots, 16, 4, 32], scales [slots, 16, 4], rope
    [slots, 16, 32] (int32; 10.25 KiB a slot)."""
    return (gl.allocate_shared_memory(gl.int32, [slots, PIECE, TILES, WORDS], RAW_SMEM),
            gl.allocate_shared_memory(gl.int32, [slots, PIECE, TILES], RAW_SMEM_2D),
            gl.allocate_shared_memory(gl.int32, [slots, PIECE, D_ROPE // 2], RAW_SMEM_2D))


@gluon.jit
def _key_ids(idx_row, lo, hi, first, n: gl.constexpr, layout: gl.constexpr):
    """Slot ids of top-k entries lo + first .. + n - 1 in `layout`; -1 at and past hi."""
    offs = lo + first + gl.arange(0, n, layout)
    return gl.load(idx_row + offs, mask=offs < hi, other=-1)


@gluon.jit
def _piece_ids(idx_row, lo, hi, piece, HALF_KEYS: gl.constexpr):
    """Slot ids of a producer's piece (16 keys: piece // 2's block, keys HALF_KEYS * 32 + (piece % 2) * 16 ..)
    in the layouts of its three copies."""
    first = (piece >> 1) * BLOCK_N + HALF_KEYS * 2 * PIECE + (piece & 1) * PIECE
    return (_key_ids(idx_row, lo, hi, first, PIECE, gl.SliceLayout(1, gl.SliceLayout(2, LATENT_COPY))),
            _key_ids(idx_row, lo, hi, first, PIECE, gl.SliceLayout(1, SCALES_COPY)),
            _key_ids(idx_row, lo, hi, first, PIECE, gl.SliceLayout(1, ROPE_W)))


@gluon.jit
def _copy_piece(ring, slot, cache_ptr, piece_ids, geometry):
    """cp.async a piece's tokens into ring slot `slot`. Invalid ids are never dereferenced: their copies
    are masked, which zero-fills (so they dequantise to 0)."""
    latent, scales, rope = ring
    latent_ids, scale_ids, rope_ids = piece_ids
    token, valid = token_addresses(cache_ptr, latent_ids, geometry)
    tile = gl.arange(0, TILES, gl.SliceLayout(0, gl.SliceLayout(2, LATENT_COPY)))
    word = gl.arange(0, WORDS, gl.SliceLayout(0, gl.SliceLayout(1, LATENT_COPY)))
    src = token.to(gl.pointer_type(gl.int32))[:, None, None] + tile[None, :, None] * WORDS + word[None, None, :]
    cp.async_copy_global_to_shared(latent.index(slot), src, mask=valid[:, None, None])
    token, valid = token_addresses(cache_ptr, scale_ids, geometry)
    src = (token + SCALES_AT).to(gl.pointer_type(gl.int32))[:, None] + gl.arange(
        0, TILES, gl.SliceLayout(0, SCALES_COPY))[None, :]
    cp.async_copy_global_to_shared(scales.index(slot), src, mask=valid[:, None])
    token, valid = token_addresses(cache_ptr, rope_ids, geometry)
    src = (token + ROPE_AT).to(gl.pointer_type(gl.int32))[:, None] + gl.arange(
        0, D_ROPE // 2, gl.SliceLayout(0, ROPE_W))[None, :]
    cp.async_copy_global_to_shared(rope.index(slot), src, mask=valid[:, None])


@gluon.jit
def _read_piece(ring, slot):
    """Ring slot `slot` in the registers fill_piece takes: latent words of tiles 0, 1 and of tiles 2, 3,
    their scales, the rope words."""
    latent, scales, rope = ring
    words = latent.index(slot)
    tile_scales = scales.index(slot)
    return (words.slice(0, 2, dim=1).load(WORDS_L), tile_scales.slice(0, 2, dim=1).load(SCALES_L),
            words.slice(2, 2, dim=1).load(WORDS_L), tile_scales.slice(2, 2, dim=1).load(SCALES_L),
            rope.index(slot).load(ROPE_W))


@gluon.jit
def _producer(tiles, ready, free, ring, cache_ptr, idx_row, lo, hi, n_steps, geometry, HALF_KEYS: gl.constexpr):
    """Keys HALF_KEYS * 32 .. + 31 of every block: copied into the ring RING - 1 pieces (16 keys) ahead of
    their dequantisation into the bf16 block (once the consumer has released it). Each piece is one
    cp.async group (empty past the last block, so the count of groups in flight stays RING - 1)."""
    k_left, k_right, k_rope = tiles
    RING: gl.constexpr = ring[0].shape[0]
    n_pieces = 2 * n_steps
    for first in gl.static_range(RING - 1):
        if first < n_pieces:
            _copy_piece(ring, first, cache_ptr, _piece_ids(idx_row, lo, hi, first, HALF_KEYS), geometry)
        cp.commit_group()
    # Slot ids two pieces ahead of their copies (loaded just before, their latency would stall each).
    ids_next = _piece_ids(idx_row, lo, hi, RING - 1, HALF_KEYS)
    ids_after = _piece_ids(idx_row, lo, hi, RING, HALF_KEYS)
    for step in range(n_steps):
        mbarrier.wait(free.index(0), (step & 1) ^ 1)   # a fresh barrier counts as free
        for part in gl.static_range(2):
            piece = 2 * step + part
            cp.wait_group(RING - 2)   # this thread's copies of `piece` have landed ...
            gl.thread_barrier()       # ... and every thread's; all reads of the previous slot are done
            ahead = piece + RING - 1
            if ahead < n_pieces:
                _copy_piece(ring, ahead % RING, cache_ptr, ids_next, geometry)
            cp.commit_group()
            ids_next = ids_after
            ids_after = _piece_ids(idx_row, lo, hi, ahead + 2, HALF_KEYS)
            fill_piece(_read_piece(ring, piece % RING), k_left, k_right, k_rope, 0, 2 * HALF_KEYS + part)
        fence_async_shared()
        publish_done(ready.index(0))


@gluon.jit
def _consumer(tiles, ready, free, p_t, q_row, stride_q_h, q_halves, q_rope, idx_row, lo, hi, num_slots, n_steps, head0,
              h_q, sm_scale_log2, sink_ptr, out_row, stride_o_h, lse_row, stride_l_h, has_sink, SPLIT: gl.constexpr):
    """q, S^T, the softmax down each head's column, O^T, out and lse (a split: partials, see
    sparse_mla_decode_sm90)."""
    k_left, k_right, k_rope = tiles
    H: gl.constexpr = p_t.shape[1]
    # Keys (or latent columns) on M, heads on N; the [64, H] scores and the [256, H] output halves share
    # it, so per-head vectors broadcast over both.
    T_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    HEAD_T: gl.constexpr = gl.SliceLayout(0, T_L)
    KEY_T: gl.constexpr = gl.SliceLayout(1, T_L)
    load_q(q_row, stride_q_h, head0, h_q, q_halves, q_rope, True)
    gl.thread_barrier()   # every warp's heads of q are in shared memory before the warpgroup's MMAs
    m_i = gl.full([H], NO_MAX, gl.float32, HEAD_T)
    # Each thread's share of the row sums, reduced once at the end (the max needs a reduction across
    # the warps every block; the sums do not).
    l_t = gl.zeros([BLOCK_N, H], gl.float32, T_L)
    left = gl.zeros([HALF, H], gl.float32, T_L)
    right = gl.zeros([HALF, H], gl.float32, T_L)
    s_t = gl.zeros([BLOCK_N, H], gl.float32, T_L)
    ids_next = _key_ids(idx_row, lo, hi, 0, BLOCK_N, KEY_T)
    for step in range(n_steps):
        ids = ids_next
        ids_next = _key_ids(idx_row, lo, hi, (step + 1) * BLOCK_N, BLOCK_N, KEY_T)
        zero = opaque_zero(step)
        wait_piece(ready, zero, step & 1)
        s_t = score_piece(k_left.index(zero), q_halves.index(zero), s_t, True)
        s_t = score_piece(k_right.index(zero), q_halves.index(zero + 1), s_t, False)
        s_t = score_piece(k_rope.index(zero), q_rope.index(zero), s_t, False)
        s_t = warpgroup_mma_wait(0, deps=(s_t,))
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
        left = warpgroup_mma(k_left.index(zero).permute((1, 0)), p_t, left * alpha[None, :], is_async=True)
        right = warpgroup_mma(k_right.index(zero).permute((1, 0)), p_t, right * alpha[None, :], is_async=True)
        left, right = warpgroup_mma_wait(0, deps=(left, right))
        mbarrier.arrive(free.index(0))
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
    offs_h = head0 + gl.arange(0, inv.shape[0], gl.SliceLayout(1, HALF_L))
    offs_d = col0 + gl.arange(0, HALF, gl.SliceLayout(0, HALF_L))
    gl.store(out_row + offs_h[:, None] * stride_o_h + offs_d[None, :], out, mask=(offs_h < h_q)[:, None])


def launch(grid, args, split: bool, padded_blocks: bool, heads: int) -> None:
    """As sparse_mla_decode_sm90.launch, for h_q <= 32; heads: h_q rounded up to one of HEADS."""
    # maxnreg: 12 warps x 168 registers fit the register file at launch; the partitions then move to
    # 232 / 136 / 136 (consumer / producers: scripts/sm90_registers.py shows them, without spills).
    _sparse_decode_few_heads_kernel[grid](*args, SPLIT=split, PADDED_BLOCKS=padded_blocks, H=heads,
                                          RING=RING_PIECES[heads], num_warps=4, maxnreg=168)
