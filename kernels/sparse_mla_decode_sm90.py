"""Hopper (sm_90) fast path of sparse_mla_decode_fp8, written in Gluon.

Same semantics, runtime arguments and launch geometry as the portable Triton kernel in
sparse_mla_decode.py (programs = query rows x blocks of 64 heads x top-k splits; split partials are
merged by that module's merge kernel). The 656-byte tokens of chunk i+1 are gathered by cp.async into
a double buffer while chunk i is dequantised (fp8 * scale -> bf16 in shared memory) and multiplied on
the tensor cores. Fewer than 64 heads are padded to 64 (zero query rows): wgmma needs M = 64. One
program = one query row x 64 heads x one split, 8 warps; the attention step itself is attend_chunk.

Gluon has no interpreter: this kernel runs only on sm_90 GPUs. sparse_mla_decode_fp8 dispatches to it
there (uses_sm90_kernel) and to the portable kernel everywhere else.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from minirt import formats

# One program attends 64 query heads (one wgmma M tile) with 8 warps = two warpgroups, over chunks of
# 64 keys whose 512 latent + 64 rope columns sit in shared memory. For the scores S = Q.K^T
# [heads, keys] the warpgroups split the keys; for O = P.V [heads, 512] they split the columns.
BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
D_LAT = gl.constexpr(formats.KV_LATENT_DIM)
D_ROPE = gl.constexpr(formats.KV_ROPE_DIM)
NUM_WARPS = gl.constexpr(8)
LN2 = gl.constexpr(formats.LN2)

S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
# Register layouts of [rows, 512] and [rows, 64] copies: 16-byte vectors along the contiguous dim.
LAT_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]))
ROPE_L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0]))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))    # per-head vectors of the softmax
COL_S = gl.constexpr(gl.SliceLayout(0, S_LAYOUT.value))    # per-key vectors of the scores
ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))    # per-head vectors of the output


@gluon.jit
def load_q(q_base, stride_h, head0, h_q, q_lat_smem, q_rope_smem):
    """Heads head0..head0+63 of one query row (q_base points at its head 0, 576 contiguous values
    per head) into the two shared-memory tiles; heads >= h_q become zero rows."""
    h_lat = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LAT_L))
    q_lat_smem.store(gl.load(q_base + h_lat[:, None] * stride_h + gl.arange(0, D_LAT, gl.SliceLayout(0, LAT_L))[None, :],
                             mask=(h_lat < h_q)[:, None], other=0.0))
    h_rope = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ROPE_L))
    q_rope_smem.store(gl.load(q_base + h_rope[:, None] * stride_h + D_LAT
                              + gl.arange(0, D_ROPE, gl.SliceLayout(0, ROPE_L))[None, :],
                              mask=(h_rope < h_q)[:, None], other=0.0))


@gluon.jit
def attend_chunk(q_lat_smem, q_rope_smem, k_lat_smem, k_rope_smem, valid, sm_scale_log2, m_i, l_i, acc):
    """One online-softmax step over a chunk of 64 keys in shared memory (k_lat doubles as V).

    valid [64] (COL_S): keys to attend; the others get probability 0. m_i (running max of the scores
    scaled by sm_scale_log2, i.e. in base 2; -inf before any valid key), l_i (ROW_S) and acc [64, 512]
    (O_LAYOUT) are updated and returned. m_ref replaces a -inf running max by 0 in every subtraction,
    so a fully masked chunk gives alpha = exp2(-inf) = 0 and p = 0, never exp2(-inf - -inf) = NaN."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_lat_smem, k_lat_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q_rope_smem, k_rope_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    # P is rounded to the operand dtype for the tensor cores, as in FlashMLA.
    p_op = gl.convert_layout(p.to(k_lat_smem.dtype), P_LAYOUT)
    acc = warpgroup_mma(p_op, k_lat_smem, acc * gl.convert_layout(alpha, ROW_O)[:, None], is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return m_new, l_i, acc

# The V32 cache token (minirt.formats): 4 tiles of 128 e4m3 values, their fp32 scales, the bf16 rope.
TILES = gl.constexpr(formats.KV_NUM_TILES)
TILE = gl.constexpr(formats.FP8_GROUP)
TOKEN_BYTES = gl.constexpr(formats.KV_TOKEN_BYTES)
SCALES_AT = gl.constexpr(formats.KV_SCALES_AT)
ROPE_AT = gl.constexpr(formats.KV_ROPE_AT)
WORDS = gl.constexpr(TILE // 4)   # 32-bit words per tile
# fp8 tokens as 32-bit words [keys, tile, 32]: one warp copies one 512-byte token row in 16-byte
# vectors. (Words, not bytes: Triton would unpack bytes and pack them again for the dequant asm.)
WORDS_L = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 4, 8], [8, 1, 1], [2, 1, 0]))
# The dequantisation is integer work, not conversions (FlashMLA measured e4m3 -> bf16 conversions at
# ~50 cycles per token, more than the MMAs of 64 heads): a byte permute spreads two e4m3 bytes into
# 16-bit lanes with each sign replicated above it; a shift and a mask leave sign | exponent | mantissa
# where bf16 keeps them, which is the value times 2^-120 exactly (subnormals included); two bf16
# multiplies, by 2^120 and by the tile's scale, give value * scale exactly, the scale being a power of
# two (as the cache writer makes it). (The e4m3 NaN code decodes as 480; the writer never stores it.)
# $2: 4 e4m3 bytes -> $0: bf16x2 of bytes 0, 1; $1: of bytes 2, 3; $3: the scale as bf16x2.
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
# Runtime integers of the decode kernels (this one and sparse_mla_decode's portable one): only
# compared or multiplied, so specialising on their values would only multiply compiles.
RUNTIME_ARGS = [
    "s_q", "h_q", "n_head_blocks", "topk", "split_len", "block_size", "num_slots", "block_stride_16",
    "has_topk_length", "has_sink", "stride_q_b", "stride_q_s", "stride_i_b", "stride_i_s",
    "stride_o_split", "stride_o_b", "stride_o_s", "stride_l_split", "stride_l_b", "stride_l_s",
    "stride_l_h"]


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_decode_sm90_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, split_len, block_size, num_slots, block_stride_16, sm_scale_log2,
    has_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    SPLIT: gl.constexpr,
):
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    LAT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], gl.bfloat16)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], gl.bfloat16)
    LAT_WORDS_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    KEYS_W: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, WORDS_L))

    pid = gl.program_id(0)
    split = gl.program_id(1)
    row = pid // n_head_blocks
    b = (row // s_q).to(gl.int64)
    s = (row % s_q).to(gl.int64)
    head0 = (pid % n_head_blocks) * BLOCK_H

    q_lat_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], LAT_SMEM)
    q_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], ROPE_SMEM)
    load_q(q_ptr + b * stride_q_b + s * stride_q_s, stride_q_h, head0, h_q, q_lat_smem, q_rope_smem)

    n_used = topk
    if has_topk_length:
        n_used = gl.minimum(gl.maximum(gl.load(topk_length_ptr + b), 0), topk)
    lo = split * split_len
    hi = gl.minimum(lo + split_len, n_used)
    n_chunks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    raw_smem = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, TILES, WORDS], RAW_SMEM)
    k_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], ROPE_SMEM)
    k_lat_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D_LAT], LAT_SMEM)
    idx_row = indices_ptr + b * stride_i_b + s * stride_i_s
    offs_n = gl.arange(0, BLOCK_N, KEYS_W)
    offs_tile = gl.arange(0, TILES, gl.SliceLayout(0, gl.SliceLayout(2, WORDS_L)))
    offs_in_tile = gl.arange(0, WORDS, gl.SliceLayout(0, gl.SliceLayout(1, WORDS_L)))
    offs_rope = gl.arange(0, D_ROPE, gl.SliceLayout(0, ROPE_L))

    # Prologue: gather chunk 0 and load its scales; load chunk 1's slot ids.
    slot_cur = gl.load(idx_row + lo + offs_n, mask=lo + offs_n < hi, other=-1)
    scale_cur = _gather(cache_ptr, slot_cur, num_slots, block_size, block_stride_16, raw_smem.index(0),
                        k_rope_smem.index(0), offs_tile, offs_in_tile, offs_rope)
    slot_next = gl.load(idx_row + lo + BLOCK_N + offs_n, mask=lo + BLOCK_N + offs_n < hi, other=-1)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, O_LAYOUT)
    for i in range(n_chunks):
        buf = i % 2
        # Chunk i's bytes have landed everywhere, and every warpgroup is done with chunk i-1.
        cp.wait_group(0)
        gl.thread_barrier()
        scale_next = _gather(cache_ptr, slot_next, num_slots, block_size, block_stride_16, raw_smem.index(1 - buf),
                             k_rope_smem.index(1 - buf), offs_tile, offs_in_tile, offs_rope)
        start_after = lo + (i + 2) * BLOCK_N
        slot_after = gl.load(idx_row + start_after + offs_n, mask=start_after + offs_n < hi, other=-1)

        # fp8 * 2^e is exact in bf16: the bf16 tile equals the dequantised cache. Word w of a tile
        # gives its bf16 columns 4w..4w+3 (pairs_lo, then pairs_hi); the bf16 tile seen as 32-bit words has the
        # same bytes and the same 128-byte swizzle.
        pairs_lo, pairs_hi = gl.inline_asm_elementwise(DEQUANT_ASM, "=r,=r,r,r", [raw_smem.index(buf).load(WORDS_L),
                                           scale_cur[:, :, None]], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        k_lat_smem._reinterpret(gl.int32, [BLOCK_N, D_LAT // 2], LAT_WORDS_SMEM).store(
            gl.reshape(gl.join(pairs_lo, pairs_hi), [BLOCK_N, D_LAT // 2]))
        fence_async_shared()
        gl.thread_barrier()

        slot_s = gl.convert_layout(slot_cur, COL_S)
        m_i, l_i, acc = attend_chunk(q_lat_smem, q_rope_smem, k_lat_smem, k_rope_smem.index(buf),
                                     (slot_s >= 0) & (slot_s < num_slots), sm_scale_log2, m_i, l_i, acc)
        slot_cur = slot_next
        scale_cur = scale_next
        slot_next = slot_after
    cp.wait_group(0)

    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(has_keys, m_ref + gl.log2(l_safe), float("-inf"))
    offs_h = head0 + gl.arange(0, BLOCK_H, ROW_S)
    h_mask = offs_h < h_q
    scale_o = 1.0 / l_safe
    if not SPLIT:
        # Final result: exp(lse) / (exp(lse) + exp(sink)) folded into the row scale; empty rows keep
        # out = 0 (acc is 0) and get lse = +inf.
        lse = gl.where(has_keys, lse2 * LN2, 0.0)
        if has_sink:
            sink = gl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
            scale_o = scale_o / (1.0 + gl.exp(sink - lse))
    offs_ho = head0 + gl.arange(0, BLOCK_H, ROW_O)
    offs_d = gl.arange(0, D_LAT, gl.SliceLayout(0, O_LAYOUT))
    o = acc * gl.convert_layout(scale_o, ROW_O)[:, None]
    out_rows = out_ptr + split * stride_o_split + b * stride_o_b + s * stride_o_s + offs_ho * stride_o_h
    gl.store(out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=(offs_ho < h_q)[:, None])
    lse_ptrs = lse_ptr + split * stride_l_split + b * stride_l_b + s * stride_l_s + offs_h * stride_l_h
    if SPLIT:
        # Partial result: normalised fp32 out and base-2 lse (-inf: nothing in this split).
        gl.store(lse_ptrs, lse2, mask=h_mask)
    else:
        gl.store(lse_ptrs, gl.where(has_keys, lse, float("inf")), mask=h_mask)


@gluon.jit
def _gather(cache_ptr, slot, num_slots, block_size, block_stride_16, raw_smem, rope_smem,
            offs_tile, offs_in_tile, offs_rope):
    """cp.async one chunk of tokens (fp8 latent as 32-bit words, bf16 rope) into shared memory and load
    their scales [keys, tiles] as bf16x2 pairs (int32, returned). Invalid slots are never read: masked
    copies zero-fill, scales are 0."""
    valid = (slot >= 0) & (slot < num_slots)
    slot = gl.where(valid, slot, 0)
    block = slot // block_size
    token = cache_ptr + (block.to(gl.int64) * block_stride_16 * 16
                         + (slot - block * block_size).to(gl.int64) * TOKEN_BYTES)
    word_rows = token.to(gl.pointer_type(gl.int32))[:, None, None]
    cp.async_copy_global_to_shared(raw_smem, word_rows + offs_tile[None, :, None] * WORDS + offs_in_tile[None, None, :],
                                   mask=valid[:, None, None])
    rope_rows = gl.convert_layout((token + ROPE_AT).to(gl.pointer_type(gl.bfloat16)), gl.SliceLayout(1, ROPE_L))
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, ROPE_L))
    cp.async_copy_global_to_shared(rope_smem, rope_rows[:, None] + offs_rope[None, :], mask=valid_r[:, None])
    cp.commit_group()
    scales = gl.load((token + SCALES_AT).to(gl.pointer_type(gl.int32))[:, None] + offs_tile[None, :],
                     mask=valid[:, None], other=0)
    # A power-of-two fp32 scale's bf16 is its top 16 bits; the dequantisation takes it as a bf16 pair.
    bf16_bits = (scales >> 16) & 0xFFFF
    return bf16_bits | (bf16_bits << 16)


def supported(q: torch.Tensor) -> bool:
    """Whether this kernel takes the call: an sm_90 GPU (the cache layout is already checked)."""
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


def launch(grid, args, split: bool) -> None:
    """Run the kernel on the runtime arguments that sparse_mla_decode_fp8 builds for both decode kernels
    (the kernel's parameters before SPLIT, in order) over grid (query rows x head blocks, top-k splits);
    split: write partial results (fp32 out, base-2 lse) for the merge kernel."""
    _sparse_decode_sm90_kernel[grid](*args, SPLIT=split, num_warps=NUM_WARPS)
