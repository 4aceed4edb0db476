"""Hopper (sm_90) fast path of sparse_mla_decode_fp8, written in Gluon.

Same semantics, runtime arguments and launch geometry as the portable Triton kernel in
sparse_mla_decode.py (programs = query rows x blocks of 64 heads x top-k splits; split partials are
merged by that module's merge kernel; with per-sequence lengths, programs take the sequences longest
first). One program = one query row x 64 heads (fewer heads are padded with zero rows: wgmma needs
M = 64), warp-specialised into three warpgroups that meet at mbarriers, after FlashMLA's sm90 fp8
decode (csrc/sm90/decode/sparse_fp8, written here from its description):

- the producer loads the 656-byte tokens of a 64-key block into registers (16-byte loads, three
  quarter blocks ahead of the one it converts), dequantises them and stores the bf16 block (latent left
  and right halves, rope) into one of two shared buffers, with the block's slot ids for the masks;
- consumer 0 loads q (while the producer already gathers the first blocks), computes each block's
  scores (64 heads x 64 keys, all 576 columns), the online softmax and output columns 0..255; it hands
  P (bf16, in the block's rope tile, free once the scores are done) and the rescale factors to
  consumer 1, which owns output columns 256..511. The next block's score MMAs are issued behind this
  block's P.V.

The dequantisation is integer work, not conversions (FlashMLA measured e4m3 -> bf16 conversions at
~50 cycles per token, more than the MMAs of 64 heads): a byte permute spreads two e4m3 bytes into
16-bit lanes with each sign replicated above it; a shift and a mask leave sign | exponent | mantissa
where bf16 keeps them, which is the value times 2^-120 exactly (subnormals included); two bf16
multiplies, by 2^120 and by the tile's scale, give value * scale exactly, the scale being a power of
two (as the cache writer makes it). The e4m3 NaN code decodes as 480 (the writer never stores it).

Gluon has no interpreter: this kernel runs only on sm_90 GPUs. sparse_mla_decode_fp8 dispatches to it
there (uses_sm90_kernel) for more than 32 heads (fewer: sparse_mla_decode_sm90_few_heads, which shares
the producer, produce_blocks) and to the portable kernel everywhere else.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from minirt import formats

from ._common import is_sm90
from ._launch import launch as launch_compiled
from .sparse_mla_prefill_sm90 import (BLOCK_H, BLOCK_N, COL_S, D_ROPE, HALF, NO_MAX, O_L, P_L, ROW_O, ROW_S,
                                      S_L, VEC_L, VEC_SMEM, load_q, opaque_zero, publish, publish_done, score_piece,
                                      store_lse, store_out, wait_piece)

NUM_WARPS = 4   # warps of the default partition (consumer 0); the others have 4 as well
PIECE = gl.constexpr(BLOCK_N.value // 4)   # keys per producer piece: a quarter block
WORDS = gl.constexpr(formats.FP8_GROUP // 4)   # 32-bit words per 128-value tile
TOKEN_BYTES = gl.constexpr(formats.KV_TOKEN_BYTES)
SCALES_AT = gl.constexpr(formats.KV_SCALES_AT)
ROPE_AT = gl.constexpr(formats.KV_ROPE_AT)
# Half a token's fp8 latent (two tiles) as 32-bit words [keys, 2, 32]: 16 threads read 256 bytes of a
# key in 16-byte vectors. (Words, not bytes: Triton would unpack bytes and pack them again for the asm.)
WORDS_L = gl.constexpr(gl.BlockedLayout([1, 1, 4], [2, 2, 8], [4, 1, 1], [2, 1, 0]))
KEYS_W = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, WORDS_L)))
SCALES_L = gl.constexpr(gl.SliceLayout(2, WORDS_L))
# A token's rope (64 bf16) as 32 words [keys, 32]: 8 threads read 128 bytes of a key in 16-byte vectors.
# (Words, not bf16: held as 16-bit values they would take twice the producer's registers.)
ROPE_W = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
WORD_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
# $2: 4 e4m3 bytes -> $0: bf16x2 of bytes 0, 1; $1: of bytes 2, 3; $3: the tile's scale as bf16x2.
DEQUANT_ASM = gl.constexpr("""{
.reg .b32 lo, hi, c;
prmt.b32 lo, $2, $2, 0x9180;
prmt.b32 hi, $2, $2, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
mov.b32 c, 0x7B807B80;
mul.rn.bf16x2 lo, lo, c;
mul.rn.bf16x2 hi, hi, c;
mul.rn.bf16x2 $0, lo, $3;
mul.rn.bf16x2 $1, hi, $3;
}""")
# Runtime integers of the decode kernels (this one, the few-heads one, sparse_mla_decode's portable one): only
# compared or multiplied, so specialising on their values would only multiply compiles. Not q's and out's
# row strides: their divisibility by 16 makes a row's address 16-byte aligned, which the compiler needs to
# vectorise q's loads and out's stores (unspecialised: 2-byte accesses, ~15% of the time at h_q 128).
RUNTIME_ARGS = [
    "s_q", "h_q", "n_head_blocks", "topk", "split_len", "block_size", "num_slots", "block_stride_16",
    "has_topk_length", "has_sink", "stride_i_b", "stride_i_s", "stride_l_split", "stride_l_b", "stride_l_s",
    "stride_l_h"]


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_decode_sm90_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, split_len, block_size, num_slots, block_stride_16, sm_scale_log2,
    has_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    SPLIT: gl.constexpr, PADDED_BLOCKS: gl.constexpr,
):
    b, s, head0, lo, hi, n_steps = program_span(n_head_blocks, s_q, topk, split_len, num_slots, has_topk_length,
                                                topk_length_ptr, batch_order_ptr, BLOCK_H)

    # Shared memory, 218 KiB: q (72), two bf16 key blocks (144; P of a block lives in its rope tile),
    # slot ids, rescale factors, barriers: per buffer ready (producer -> consumers), free (both
    # consumers -> producer), p_ready (consumer 0 -> 1: P and the rescale factors of the block); done:
    # consumer 0's final row max and row sum.
    q_halves, q_rope = allocate_q(BLOCK_H)
    blocks = allocate_blocks(2)
    load_ids = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)      # the producer's loads
    rescale = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    row_stats = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)   # final max, row sum
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
    mbarrier.init(done, count=1)

    out_row = out_ptr + gl.program_id(1) * stride_o_split + b * stride_o_b + s * stride_o_s
    lse_row = lse_ptr + gl.program_id(1) * stride_l_split + b * stride_l_b + s * stride_l_s
    gl.warp_specialize([
        (consumer_0, (blocks, p_ready, q_ptr + b * stride_q_b + s * stride_q_s, stride_q_h, q_halves, q_rope,
                      rescale, row_stats, done, num_slots, n_steps, head0, h_q, sm_scale_log2, sink_ptr, out_row,
                      stride_o_h, lse_row, stride_l_h, has_sink, SPLIT, True)),
        (consumer_1, (blocks, p_ready, q_halves, rescale, row_stats, done, n_steps, head0, h_q, sink_ptr, out_row,
                       stride_o_h, has_sink, SPLIT)),
        (producer, (blocks, load_ids, (cache_ptr, indices_ptr + b * stride_i_b + s * stride_i_s, lo, hi,
                                       (num_slots, block_size, block_stride_16, PADDED_BLOCKS)), n_steps, 0, 1)),
    ], [4, 4], [160, 136])


@gluon.jit
def program_span(n_head_blocks, s_q, topk, split_len, num_slots, has_topk_length, topk_length_ptr, batch_order_ptr,
                 heads: gl.constexpr):
    """(sequence b, query row s, first head, top-k range lo..hi, 64-key steps) of this program (axis 0:
    query rows x head blocks of `heads`, axis 1: top-k splits). With topk_length, programs take the
    sequences longest first (batch_order, see sparse_mla_decode_fp8)."""
    pid = gl.program_id(0)
    row = pid // n_head_blocks
    b = row // s_q
    if has_topk_length:
        b = gl.load(batch_order_ptr + b)
    b = b.to(gl.int64)
    s = (row % s_q).to(gl.int64)
    head0 = (pid % n_head_blocks) * heads
    n_used = topk
    if has_topk_length:
        n_used = gl.minimum(gl.maximum(gl.load(topk_length_ptr + b), 0), topk)
    if num_slots == 0:   # every index is invalid, and the producer's stand-in slot 0 does not exist
        n_used = 0
    lo = gl.program_id(1) * split_len
    hi = gl.minimum(lo + split_len, n_used)
    return b, s, head0, lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)


@gluon.jit
def allocate_q(heads: gl.constexpr):
    """Shared buffers of `heads` query heads: latent halves [2, heads, 256], rope [1, heads, 64] (indexed
    on an opaque zero, see opaque_zero)."""
    half_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([heads, HALF], gl.bfloat16)
    rope_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([heads, D_ROPE], gl.bfloat16)
    return (gl.allocate_shared_memory(gl.bfloat16, [2, heads, HALF], half_smem),
            gl.allocate_shared_memory(gl.bfloat16, [1, heads, D_ROPE], rope_smem))


@gluon.jit
def allocate_blocks(num_consumers: gl.constexpr):
    """The two key-block buffers that produce_blocks fills: (left latent [2, 64, 256], right latent,
    rope [2, 64, 64] bf16; slot ids [2, 64] for the consumers' masks; barriers per buffer: ready
    (producer -> consumers), free (num_consumers arrivals -> producer))."""
    half_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    tile_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16)
    k_left = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HALF], half_smem)
    k_right = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HALF], half_smem)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], tile_smem)
    key_ids = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=num_consumers)
    return k_left, k_right, k_rope, key_ids, ready, free


@gluon.jit
def _scores(q_halves, q_rope, blocks, step, s, HAS_ROPE: gl.constexpr):
    """Issue the score MMAs of block `step` once it has landed (q_halves: [2, ...] indexed on an opaque
    zero, see opaque_zero); HAS_ROPE: the keys have a rope tile beside their 512 columns (V32)."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    buf = step & 1
    zero = opaque_zero(step)
    wait_piece(ready, buf, (step >> 1) & 1)
    s = score_piece(q_halves.index(zero), k_left.index(buf), s, True)
    s = score_piece(q_halves.index(zero + 1), k_right.index(buf), s, False)
    if HAS_ROPE:
        s = score_piece(q_rope.index(zero), k_rope.index(buf), s, False)
    return s


@gluon.jit
def consumer_0(blocks, p_ready, q_row, stride_q_h, q_halves, q_rope, rescale, row_stats, done, num_slots, n_steps,
               head0, h_q, sm_scale_log2, sink_ptr, out_row, stride_o_h, lse_row, stride_l_h, has_sink,
               SPLIT: gl.constexpr, HAS_ROPE: gl.constexpr):
    """q, scores, softmax, output columns 0..255, lse. A split writes partials (fp32 out over its own
    keys, base-2 lse) for the merge kernel, which applies the sink. (q loads here, while the producer
    already gathers the first blocks.) HAS_ROPE: q and the keys have 64 rope columns beside their 512
    (V32; else the rope tile of each block only carries P)."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    # P.V is done when at most the block's score MMAs issued after it are pending.
    SCORE_MMAS: gl.constexpr = 3 if HAS_ROPE else 2
    load_q(q_row, stride_q_h, head0, h_q, q_halves, q_rope, HAS_ROPE)
    gl.thread_barrier()   # every warp's rows of q are in shared memory before the warpgroup's MMAs
    m_i = gl.full([BLOCK_H], NO_MAX, gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
    if n_steps > 0:
        s = warpgroup_mma_wait(0, deps=(_scores(q_halves, q_rope, blocks, 0, s, HAS_ROPE),))
    for step in range(n_steps):
        buf = step & 1
        ids = key_ids.index(buf).load(COL_S)
        s = gl.where(((ids >= 0) & (ids < num_slots))[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P is rounded to the operand dtype for the tensor cores, as in FlashMLA; consumer 1 takes it
        # from the block's rope tile (the scores are done with it) and the rescale factors beside it.
        p_op = p.to(gl.bfloat16)
        rescale.index(buf).store(alpha)
        publish(k_rope.index(buf), p_op, p_ready.index(buf))
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        # (Each branch issues P.V itself: a value of a runtime branch must keep its type, and an
        # issued MMA's result is not yet a tensor.)
        if step + 1 < n_steps:
            acc = warpgroup_mma(gl.convert_layout(p_op, P_L), k_left.index(buf), acc, is_async=True)
            s = _scores(q_halves, q_rope, blocks, step + 1, s, HAS_ROPE)
            acc = warpgroup_mma_wait(SCORE_MMAS, deps=(acc,))   # P.V is done; the score MMAs may run on
            mbarrier.arrive(free.index(buf))
            s = warpgroup_mma_wait(0, deps=(s,))
        else:
            acc = warpgroup_mma(gl.convert_layout(p_op, P_L), k_left.index(buf), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(free.index(buf))
    row_stats.index(0).store(m_i)
    row_stats.index(1).store(l_i)
    publish_done(done)
    # k_left is free: only this partition reads it, and the producer has filled its last block.
    store_out(acc, m_i, l_i, 0, k_left, sink_ptr, 1, out_row, stride_o_h, 1, head0, h_q, has_sink, SPLIT)
    store_lse(m_i, l_i, lse_row, stride_l_h, head0, h_q, SPLIT)


@gluon.jit
def consumer_1(blocks, p_ready, q_halves, rescale, row_stats, done, n_steps, head0, h_q, sink_ptr, out_row, stride_o_h,
               has_sink, SPLIT: gl.constexpr):
    """Output columns 256..511: P of each block from consumer 0, times the right half of its V."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
    for step in range(n_steps):
        buf = step & 1
        mbarrier.wait(p_ready.index(buf), (step >> 1) & 1)
        acc = acc * rescale.index(buf).load(ROW_O)[:, None]
        acc = warpgroup_mma(k_rope.index(buf), k_right.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(free.index(buf))
    mbarrier.wait(done, 0)
    # q is free: only consumer 0's score MMAs read it, and they are done.
    store_out(acc, row_stats.index(0).load(ROW_S), row_stats.index(1).load(ROW_S), HALF, q_halves, sink_ptr, 1,
              out_row, stride_o_h, 1, head0, h_q, has_sink, SPLIT)


@gluon.jit
def step_ids(source, step):
    """The 64 slot ids of block `step` (VEC_L); -1 at and past hi. source: (cache_ptr, idx_row (the query
    row's indices), top-k range lo..hi, geometry (see _token_addresses)), as produce_blocks takes it."""
    cache_ptr, idx_row, lo, hi, geometry = source
    offs = lo + step * BLOCK_N + gl.arange(0, BLOCK_N, VEC_L)
    return gl.load(idx_row + offs, mask=offs < hi, other=-1)


@gluon.jit
def _token_addresses(cache_ptr, ids, geometry):
    """(address of each slot's 656-byte token, validity); invalid slots point at slot 0 (see load_piece).
    geometry: (num_slots, block_size, block_stride_16, PADDED_BLOCKS); only blocks padded beyond
    block_size tokens need the division (a runtime divisor costs the producer ~25 instructions a piece)."""
    num_slots, block_size, block_stride_16, PADDED_BLOCKS = geometry
    valid = (ids >= 0) & (ids < num_slots)
    ids = gl.where(valid, ids, 0)
    if PADDED_BLOCKS:
        block = ids // block_size
        offset = block.to(gl.int64) * block_stride_16 * 16 + (ids - block * block_size).to(gl.int64) * TOKEN_BYTES
    else:
        offset = ids.to(gl.int64) * TOKEN_BYTES
    return cache_ptr + offset, valid


@gluon.jit
def piece_ids(load_ids, mine, part: gl.constexpr):
    """The slot ids of a quarter block (keys part*16..part*16+15 of the producer's block `mine`) in the
    layouts of its latent and its rope loads. Read a piece ahead of their use: behind the block MMAs' shared-memory
    reads, this load's latency would stall the producer (ncu: ~12% of its cycles)."""
    ids = load_ids.index(mine & 1).slice(part * PIECE, PIECE)
    return ids.load(KEYS_W), ids.load(gl.SliceLayout(1, ROPE_W))


@gluon.jit
def load_piece(source, step, ids):
    """Registers of a quarter block of block `step` (ids: from piece_ids): the latent's e4m3 bytes as
    words [16, 2, 32] of tiles 0, 1 and of tiles 2, 3, their float32 scales' bits [16, 2] (int32), the
    rope's bf16 pairs [16, 32] (int32). An invalid slot's id is never dereferenced: its latent words come
    from slot 0 unmasked (masked loads cost zeroing and predicates, ~6% of the kernel's time), and its
    scales and rope read as 0, so it dequantises to 0 (the integer dequantisation of any byte is finite)."""
    cache_ptr, idx_row, lo, hi, geometry = source
    ids, rope_ids = ids
    token, valid = _token_addresses(cache_ptr, ids, geometry)
    tile = gl.arange(0, 2, gl.SliceLayout(0, SCALES_L))
    word = gl.arange(0, WORDS, gl.SliceLayout(0, gl.SliceLayout(1, WORDS_L)))
    words = token.to(gl.pointer_type(gl.int32))[:, None, None] + tile[None, :, None] * WORDS + word[None, None, :]
    left = gl.load(words)
    right = gl.load(words + 2 * WORDS)
    scale_words = (token + SCALES_AT).to(gl.pointer_type(gl.int32))[:, None] + tile[None, :]
    scales = gl.load(scale_words, mask=valid[:, None], other=0)
    scales_right = gl.load(scale_words + 2, mask=valid[:, None], other=0)   # tiles 2, 3
    token, valid = _token_addresses(cache_ptr, rope_ids, geometry)
    rope = gl.load((token + ROPE_AT).to(gl.pointer_type(gl.int32))[:, None]
                   + gl.arange(0, D_ROPE // 2, gl.SliceLayout(0, ROPE_W))[None, :], mask=valid[:, None], other=0)
    return left, scales, right, scales_right, rope


@gluon.jit
def _bf16_pairs(scales):
    """A power-of-two fp32 scale's bf16 is its top 16 bits; the dequantisation takes it twice."""
    bits = (scales >> 16) & 0xFFFF
    return bits | (bits << 16)


@gluon.jit
def piece_words(dst, part: gl.constexpr):
    """Rows part*16.. of dst [64, n] bf16 (shared) as 32-bit words [16, n / 2]. The bf16 tile seen as
    words has the same bytes, 128-byte swizzle and column blocks; its rows are sliced after the
    reinterpretation (a reinterpreted slice would lose the parent's column-block stride)."""
    return dst._reinterpret(gl.int32, [BLOCK_N, dst.shape[1] // 2], WORD_SMEM).slice(part * PIECE, PIECE)


@gluon.jit
def store_dequantised(words, scale_pairs, dst):
    """dst [keys, n] int32 (shared, bf16 pairs, see piece_words) = the e4m3 values of words [keys, ...,
    w] times their tiles' scales (scale_pairs: [keys, ...], bf16x2 of each tile's scale). Word w of a
    tile gives its columns 4w..4w+3."""
    pairs_lo, pairs_hi = gl.inline_asm_elementwise(DEQUANT_ASM, "=r,=r,r,r",
                                                   [words, gl.expand_dims(scale_pairs, -1)],
                                                   dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    dst.store(gl.reshape(gl.join(pairs_lo, pairs_hi), dst.shape))


@gluon.jit
def fill(piece, blocks, buf, part: gl.constexpr):
    """Store a piece (load_piece) into rows part*16.. of buffer buf's left, right and rope tiles."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    left, left_scales, right, right_scales, rope = piece
    # (The scales become bf16 pairs here, at their first use: converted where they are loaded, the
    # producer would wait for every piece's loads as soon as it issued them.)
    store_dequantised(left, _bf16_pairs(left_scales), piece_words(k_left.index(buf), part))
    store_dequantised(right, _bf16_pairs(right_scales), piece_words(k_right.index(buf), part))
    piece_words(k_rope.index(buf), part).store(rope)


@gluon.jit
def produce_blocks(blocks, load_ids, source, n_steps, first, STRIDE: gl.constexpr, step_ids: gl.constexpr,
                   piece_ids: gl.constexpr, load_piece: gl.constexpr, fill: gl.constexpr):
    """Fill blocks first, first + STRIDE, ... of the program's n_steps blocks of 64 keys into the buffers
    of allocate_blocks (block `step` into buffer step & 1, once its consumers have released it), a
    quarter block at a time with the next three quarters' loads in flight (registers hold no more).
    load_ids: [2, 64] int32 of this producer's own. Slot ids two blocks ahead of the loads (loaded just
    before their use, their latency would stall every piece). STRIDE 2: two producers, one per buffer,
    each fill every other block.

    The cache format is four functions of it (this module's step_ids, piece_ids, load_piece, fill for
    V32) and source, what they read: step_ids(source, step) the block's 64 slot ids; piece_ids(load_ids,
    mine, part) a quarter block's ids from shared memory in the layouts of its loads; load_piece(source,
    step, ids) its registers; fill(piece, blocks, buf, part) their dequantised bf16 in the block's tiles."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    if first < n_steps:   # (the prologue's stand-in slot 0 may not exist otherwise)
        ids_cur = step_ids(source, first)
        load_ids.index(0).store(ids_cur)
        ids_next = step_ids(source, first + STRIDE)
        gl.thread_barrier()
        p0 = load_piece(source, first, piece_ids(load_ids, 0, 0))
        p1 = load_piece(source, first, piece_ids(load_ids, 0, 1))
        p2 = load_piece(source, first, piece_ids(load_ids, 0, 2))
        ids_p3 = piece_ids(load_ids, 0, 3)
        for step in range(first, n_steps, STRIDE):
            buf = step & 1
            mine = step // STRIDE   # this producer's count of blocks: its load_ids slot
            p3 = load_piece(source, step, ids_p3)
            # The other slot's ids were last read by the previous block's loads, before its barrier.
            load_ids.index((mine & 1) ^ 1).store(ids_next)
            gl.thread_barrier()
            ids_after = step_ids(source, step + 2 * STRIDE)
            ids_p = piece_ids(load_ids, mine + 1, 0)
            mbarrier.wait(free.index(buf), ((step >> 1) & 1) ^ 1)   # a fresh barrier counts as free
            key_ids.index(buf).store(ids_cur)
            fill(p0, blocks, buf, 0)
            p0 = load_piece(source, step + STRIDE, ids_p)
            ids_p = piece_ids(load_ids, mine + 1, 1)
            fill(p1, blocks, buf, 1)
            p1 = load_piece(source, step + STRIDE, ids_p)
            ids_p = piece_ids(load_ids, mine + 1, 2)
            fill(p2, blocks, buf, 2)
            p2 = load_piece(source, step + STRIDE, ids_p)
            ids_p3 = piece_ids(load_ids, mine + 1, 3)
            fill(p3, blocks, buf, 3)
            fence_async_shared()
            publish_done(ready.index(buf))
            ids_cur = ids_next
            ids_next = ids_after


@gluon.jit
def producer(blocks, load_ids, source, n_steps, first, STRIDE: gl.constexpr):
    """produce_blocks of the V32 cache (656-byte tokens, see load_piece); source: see step_ids."""
    produce_blocks(blocks, load_ids, source, n_steps, first, STRIDE, step_ids, piece_ids, load_piece, fill)


def supported(q: torch.Tensor) -> bool:
    """Whether this kernel takes the call: an sm_90 GPU (the cache layout is already checked)."""
    return q.is_cuda and is_sm90(q.device)


def launch(grid, args, split: bool, padded_blocks: bool, compiled: dict) -> None:
    """Run the kernel on the runtime arguments that sparse_mla_decode_fp8 builds for both decode kernels
    (the kernel's parameters before SPLIT, in order) over grid (query rows x head blocks, top-k splits);
    split: write partial results (fp32 out, base-2 lse) for the merge kernel; padded_blocks: the cache's
    block stride is larger than block_size tokens (slot addresses then need a division); compiled: the
    call signature's compiled kernels (minirt.kernels._launch.launch)."""
    # maxnreg: 12 warps x 168 registers fit the register file at launch; the partitions then move to
    # 208 / 160 / 136 (consumer 0 / 1 / producer: scripts/sm90_registers.py shows them, without spills).
    launch_compiled(_sparse_decode_sm90_kernel, grid, args,
                    dict(SPLIT=split, PADDED_BLOCKS=padded_blocks, num_warps=NUM_WARPS, maxnreg=168), compiled)
