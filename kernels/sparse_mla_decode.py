"""Sparse MLA decode on an fp8 paged cache (FlashMLA ``flash_mla_with_kvcache``, sparse fp8 mode), in
either of FlashMLA's layouts, chosen by the cache's last dim:

- V32 (DeepSeek-V3.2, 656-byte tokens, kv_cache_fp8): q is 576 wide (latent 512 | rope 64), V the
  512 latent values;
- MODEL1 (DeepSeek-V4, 584-byte entries, kv_cache_model1): q is 512 wide and K = V is the whole
  512-value entry; an optional second (extra) cache with its own indices and lengths feeds the same
  softmax (V4: the sliding-window cache, then the compressed entries).

The kernels gather each query row's top-k cache slots straight from the cache bytes, dequantise fp8 *
scale in registers (exact in bf16), and run a base-2 online softmax over chunks of BLOCK_N slots; there
is no bf16 copy of the cache. When the batch is too small to fill the GPU, each row's top-k (both
sources', as one list) is split across programs and the partial (out, lse) are merged by lse in a
second kernel. On sm_90 GPUs the default launch runs a Gluon kernel instead: for V32
sparse_mla_decode_sm90's (64 heads a program) or, up to 32 heads, sparse_mla_decode_sm90_few_heads's,
for MODEL1 sparse_mla_decode_model1_sm90's (both head counts; same semantics, same split/merge;
uses_sm90_kernel decides); elsewhere, and for an explicit DecodeConfig, the portable Triton kernels
here run. The kernels of one layout take the same runtime
arguments, built once by sparse_mla_decode_fp8.

Public entry points: ``mla_decode_fp8`` (what the runtime calls per layer and step: block table +
the indexer's top-k positions) and ``sparse_mla_decode_fp8`` (slot ids, FlashMLA's interface).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minirt import formats
from minirt.errors import InputError

from . import sparse_mla_decode_model1_sm90 as model1_sm90
from . import sparse_mla_decode_sm90 as sm90
from . import sparse_mla_decode_sm90_few_heads as sm90_few_heads
from ._common import (INTERPRET, LN2, check_config, check_device, check_tensor, check_tensors, num_sms, softmax_rows,
                      softmax_step)
from ._launch import cdiv, described, launch, per_signature
from .kv_cache_fp8 import (D_LAT, D_ROPE, ROPE_AT, SCALES_AT, TILE, TILES, TOKEN_BYTES, cache_geometry,
                           positions_to_slots)
from .kv_cache_model1 import M1_NOPE, M1_ROPE, M1_TILE, M1_TILES, model1_cache_geometry, model1_entry_addresses

D_QK = formats.KV_LATENT_DIM + formats.KV_ROPE_DIM
D_QK_MODEL1 = formats.MODEL1_DIM
D_V = formats.KV_LATENT_DIM
_MERGE_BLOCK_H = 16
# Split the top-k only when one program per (row, head block) leaves the GPU short of work. Measured
# on an H200 (docs/perf/decode.md). Portable kernel: below 2 programs per SM, split until there are 4
# per SM: 3.9 programs/SM (b 128, s_q 2, h_q 128) ran 13% faster unsplit than in 2 splits; 1
# program/SM (h_q 16, s_q 1) ran 12% faster in 5 splits than unsplit. Hopper kernel (one program fills
# an SM's shared memory): only as many splits as fit in one wave, rounding down. b 128, s_q 1 (128 or
# 256 programs on 132 SMs) ran 1.5-1.8x faster unsplit than in 2 splits at every h_q; 64 programs ran
# fastest in 2 splits (h_q 16: 88 µs against 120 unsplit and 107 in 3; h_q 128 b 32: 108 against 128).
_PORTABLE_SPLIT_RULE = (2, 4)
# Fewest top-k entries a split gets: below this its partial output (h_q * 2 KiB) costs more traffic
# than the cache rows it reads.
_MIN_SPLIT_LEN = 256


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape: heads per program, cache slots per loop step, warps, software-pipeline depth."""

    block_h: int
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def default_config(h_q: int, d_qk: int = D_QK) -> DecodeConfig:
    """The launch shape sparse_mla_decode_fp8 uses for h_q heads of width d_qk (576: V32, 512: MODEL1):
    64 heads per program, h_q rounded up to a power of two >= 16 (the smallest tl.dot width) when
    fewer; chunk sizes that compile without (or with few) register spills on sm_90. (MODEL1 at 32 heads
    a program spills in every shape tried, 231-385 spill instructions: it takes 16-head programs.)"""
    block_h = min(64, max(16, triton.next_power_of_2(h_q)))
    if block_h == 64:
        return DecodeConfig(block_h=64, block_n=64, num_warps=8)
    if d_qk == D_QK_MODEL1:
        block_h = 16
    return DecodeConfig(block_h=block_h, block_n=64 if block_h == 16 else 32, num_warps=4)


@triton.jit
def _store_final(o, lse2, offs_h, h_mask, sink_ptr, has_sink, out_rows, lse_ptrs):
    """Write final out (bf16) and natural-log lse of a block of heads; lse2 is base 2, -inf if empty."""
    empty = lse2 == float("-inf")
    # Empty rows compute with lse 0 (their out is 0 anyway) so that a -inf sink never meets a -inf lse.
    lse = tl.where(empty, 0.0, lse2 * LN2)
    if has_sink:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
        # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse))
        o = o * (1.0 / (1.0 + tl.exp(sink - lse)))[:, None]
    offs_d = tl.arange(0, D_LAT)
    tl.store(out_rows[:, None] + offs_d[None, :], o.to(out_rows.dtype.element_ty),
             mask=h_mask[:, None])
    tl.store(lse_ptrs, tl.where(empty, float("inf"), lse), mask=h_mask)


@triton.jit
def _program_row(n_head_blocks, s_q, h_q, batch_order_ptr, has_batch_order, BLOCK_H: tl.constexpr):
    """(sequence b, query row s, heads offs_h [BLOCK_H], h_mask) of this program. Axis 0 is query rows x
    blocks of heads, the heads of one row adjacent so that their identical gathers hit L2; with
    per-sequence lengths the programs take the sequences in batch_order (longest first where the programs
    do not all start at once, see sparse_mla_decode_fp8's plan)."""
    pid = tl.program_id(0)
    row = pid // n_head_blocks
    b = row // s_q
    if has_batch_order:
        b = tl.load(batch_order_ptr + b)
    b = b.to(tl.int64)
    s = (row % s_q).to(tl.int64)
    offs_h = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    return b, s, offs_h, offs_h < h_q


@triton.jit
def _used_entries(width, lengths_ptr, b, has_lengths):
    """The entries of sequence b's top-k that are used: lengths[b] clamped to [0, width], or all width."""
    n_used = width
    if has_lengths:
        n_used = tl.minimum(tl.maximum(tl.load(lengths_ptr + b), 0), width)
    return n_used


@triton.jit
def _store_result(m_i, l_i, acc, offs_h, h_mask, sink_ptr, has_sink, out_rows, lse_ptrs, SPLIT: tl.constexpr):
    """The end of a decode program: a split's partial result (normalised fp32 out and base-2 lse, -inf
    when the split saw no valid key) for the merge kernel, or the final out and lse."""
    _, l_safe, lse2 = softmax_rows(m_i, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        tl.store(out_rows[:, None] + tl.arange(0, D_LAT)[None, :], o, mask=h_mask[:, None])
        tl.store(lse_ptrs, lse2, mask=h_mask)
    else:
        _store_final(o, lse2, offs_h, h_mask, sink_ptr, has_sink, out_rows, lse_ptrs)


@triton.jit
def _gather_tokens(cache_ptr, slot, num_slots, block_size, block_stride_16):
    """Load the cache tokens of slot [N] (slot ids): (valid [N], fp8 [N, 4, 128], scales [N, 4], rope [N, 64]).

    Invalid slots are never dereferenced: their rows are exact zeros (masked loads), so NaN bytes
    anywhere outside the attended slots cannot reach the dots."""
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    block = slot // block_size
    token = cache_ptr + (block.to(tl.int64) * block_stride_16 * 16
                         + (slot - block * block_size).to(tl.int64) * TOKEN_BYTES)
    offs_tile = tl.arange(0, TILES)
    fp8 = tl.load(token.to(tl.pointer_type(tl.float8e4nv))[:, None, None]
                  + offs_tile[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :],
                  mask=valid[:, None, None], other=0.0)
    scale = tl.load((token + SCALES_AT).to(tl.pointer_type(tl.float32))[:, None] + offs_tile[None, :],
                    mask=valid[:, None], other=0.0)
    rope = tl.load((token + ROPE_AT).to(tl.pointer_type(tl.bfloat16))[:, None]
                   + tl.arange(0, D_ROPE)[None, :], mask=valid[:, None], other=0.0)
    return valid, fp8, scale, rope


@triton.jit(do_not_specialize=sm90.RUNTIME_ARGS)
def _sparse_decode_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, split_len, block_size, num_slots, block_stride_16, sm_scale_log2,
    has_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED_ITERS: tl.constexpr,
):
    # Program = (query row, block of heads) on axis 0, the top-k split on axis 1.
    split = tl.program_id(1)
    b, s, offs_h, h_mask = _program_row(n_head_blocks, s_q, h_q, batch_order_ptr, has_topk_length, BLOCK_H)
    dot_dtype = tl.float32 if UPCAST else tl.bfloat16

    offs_lat = tl.arange(0, D_LAT)
    offs_rope = tl.arange(0, D_ROPE)
    q_rows = q_ptr + b * stride_q_b + s * stride_q_s + offs_h[:, None] * stride_q_h
    q_lat = tl.load(q_rows + offs_lat[None, :], mask=h_mask[:, None], other=0.0).to(dot_dtype)
    q_rope = tl.load(q_rows + D_LAT + offs_rope[None, :], mask=h_mask[:, None], other=0.0).to(dot_dtype)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, _used_entries(topk, topk_length_ptr, b, has_topk_length))

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    idx_row = indices_ptr + b * stride_i_b + s * stride_i_s
    offs_n = lo + tl.arange(0, BLOCK_N)
    # The Triton 3.6 interpreter cannot loop to a runtime bound (numpy >= 2.4 refuses int() of its
    # 1-element scalars), so it runs the split's full constexpr length; chunks past hi are masked.
    for it in range(0, INTERPRETED_ITERS if UPCAST else tl.cdiv(hi - lo, BLOCK_N)):
        valid, fp8, scale, rope = _gather_tokens(
            cache_ptr, tl.load(idx_row + offs_n, mask=offs_n < hi, other=-1), num_slots,
            block_size, block_stride_16)
        offs_n += BLOCK_N

        # fp8 * 2^e is exact in bf16, so the bf16 tile equals the dequantised cache (and bf16 math
        # keeps the tile at half the registers of an fp32 detour).
        kv = tl.reshape(fp8.to(dot_dtype) * scale.to(dot_dtype)[:, :, None], (BLOCK_N, D_LAT))
        scores = tl.dot(q_lat, tl.trans(kv))
        scores = tl.dot(q_rope, tl.trans(rope.to(dot_dtype)), acc=scores)
        m_i, l_i, acc = softmax_step(scores, valid, sm_scale_log2, kv, m_i, l_i, acc)

    out_rows = out_ptr + split * stride_o_split + b * stride_o_b + s * stride_o_s + offs_h * stride_o_h
    lse_ptrs = lse_ptr + split * stride_l_split + b * stride_l_b + s * stride_l_s + offs_h * stride_l_h
    _store_result(m_i, l_i, acc, offs_h, h_mask, sink_ptr, has_sink, out_rows, lse_ptrs, SPLIT)


@triton.jit
def _model1_addresses(cache_ptr, slot, valid, block_size, block_stride_16):
    """(data record, scale record) addresses of MODEL1 slots (slot 0 stands in for invalid ones)."""
    return model1_entry_addresses(cache_ptr, tl.where(valid, slot, 0), block_size, block_stride_16 * 16)


@triton.jit
def _gather_model1(data, scales, valid, dot_dtype: tl.constexpr):
    """Load and dequantise the MODEL1 entries at the addresses data / scales [N] (their data and scale
    records): K = V [N, 512] in dot_dtype.

    The entry is read as an [N, 8, 64] block: tiles 0..6 the e4m3 values times their tile's ue8m0 scale
    (2^(byte - 127), built from the byte as float32 exponent bits: exact for bytes 1..254, which the
    writer's scales 2^-13.. take), tile 7 the bf16 rope. Invalid entries are never dereferenced (masked
    loads give exact zeros, so NaN bytes elsewhere cannot reach the dots)."""
    tiles = tl.arange(0, 8)
    nope_tile = tiles < M1_TILES
    cols = tl.arange(0, M1_TILE)
    fp8 = tl.load(data.to(tl.pointer_type(tl.float8e4nv))[:, None, None] + tiles[None, :, None] * M1_TILE
                  + cols[None, None, :], mask=valid[:, None, None] & nope_tile[None, :, None], other=0.0)
    exponent = tl.load(scales[:, None] + tiles[None, :], mask=valid[:, None] & nope_tile[None, :], other=0)
    scale = (exponent.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    rope = tl.load((data + M1_NOPE).to(tl.pointer_type(tl.bfloat16))[:, None] + cols[None, :],
                   mask=valid[:, None], other=0.0)
    kv = tl.where(nope_tile[None, :, None], fp8.to(dot_dtype) * scale.to(dot_dtype)[:, :, None],
                  rope.to(dot_dtype)[:, None, :])
    return tl.reshape(kv, (data.shape[0], M1_NOPE + M1_ROPE))


@triton.jit(do_not_specialize=model1_sm90.RUNTIME_ARGS)
def _sparse_decode_model1_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, extra_cache_ptr, extra_indices_ptr, extra_topk_length_ptr,
    batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, extra_topk, split_len,
    block_size, num_slots, block_stride_16, extra_block_size, extra_num_slots, extra_block_stride_16,
    sm_scale_log2, has_topk_length, has_extra_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s, stride_ei_b, stride_ei_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED_ITERS: tl.constexpr,
):
    split = tl.program_id(1)
    b, s, offs_h, h_mask = _program_row(n_head_blocks, s_q, h_q, batch_order_ptr,
                                        has_topk_length + has_extra_topk_length > 0, BLOCK_H)
    dot_dtype = tl.float32 if UPCAST else tl.bfloat16
    offs_d = tl.arange(0, M1_NOPE + M1_ROPE)
    q = tl.load(q_ptr + b * stride_q_b + s * stride_q_s + offs_h[:, None] * stride_q_h + offs_d[None, :],
                mask=h_mask[:, None], other=0.0).to(dot_dtype)

    # The row's used entries as one list, the main cache's n_main first, then the extra cache's n_extra
    # (positions n_main + j); the split takes [lo, lo + split_len) of it, so no chunk is spent on the
    # unused tail of either list. A chunk across the boundary gathers from both caches.
    n_main = _used_entries(topk, topk_length_ptr, b, has_topk_length)
    n_used = n_main + _used_entries(extra_topk, extra_topk_length_ptr, b, has_extra_topk_length)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_used)
    idx_row = indices_ptr + b * stride_i_b + s * stride_i_s
    extra_idx_row = extra_indices_ptr + b * stride_ei_b + s * stride_ei_s

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    offs_n = lo + tl.arange(0, BLOCK_N)
    # The interpreter runs the split's full constexpr length (see _sparse_decode_kernel); chunks past hi
    # are masked.
    for it in range(0, INTERPRETED_ITERS if UPCAST else tl.cdiv(hi - lo, BLOCK_N)):
        in_main = offs_n < n_main
        slot = tl.load(idx_row + offs_n, mask=in_main & (offs_n < hi), other=-1)
        extra_slot = tl.load(extra_idx_row + (offs_n - n_main), mask=~in_main & (offs_n < hi), other=-1)
        main_valid = (slot >= 0) & (slot < num_slots)
        extra_valid = (extra_slot >= 0) & (extra_slot < extra_num_slots)
        data, scales = _model1_addresses(cache_ptr, slot, main_valid, block_size, block_stride_16)
        extra_data, extra_scales = _model1_addresses(extra_cache_ptr, extra_slot, extra_valid, extra_block_size,
                                                     extra_block_stride_16)
        valid = tl.where(in_main, main_valid, extra_valid)
        kv = _gather_model1(tl.where(in_main, data, extra_data), tl.where(in_main, scales, extra_scales), valid,
                            dot_dtype)
        offs_n += BLOCK_N
        m_i, l_i, acc = softmax_step(tl.dot(q, tl.trans(kv)), valid, sm_scale_log2, kv, m_i, l_i, acc)

    out_rows = out_ptr + split * stride_o_split + b * stride_o_b + s * stride_o_s + offs_h * stride_o_h
    lse_ptrs = lse_ptr + split * stride_l_split + b * stride_l_b + s * stride_l_s + offs_h * stride_l_h
    _store_result(m_i, l_i, acc, offs_h, h_mask, sink_ptr, has_sink, out_rows, lse_ptrs, SPLIT)


_ORDER_BLOCK = 128   # sequences a program of the ordering kernel ranks, and compares them with per step


@triton.jit
def _used_of(seq, n, lengths_ptr, width, has_lengths, BLOCK: tl.constexpr):
    """The entries of one top-k list that sequences seq [BLOCK] use: lengths[seq] clamped to [0, width], or
    all width without lengths; 0 past n."""
    in_batch = seq < n
    used = tl.zeros([BLOCK], tl.int32) + width
    if has_lengths:
        used = tl.minimum(tl.maximum(tl.load(lengths_ptr + seq, mask=in_batch, other=0), 0), width)
    return tl.where(in_batch, used, 0)


@triton.jit(do_not_specialize=["n", "topk", "extra_topk", "has_topk_length", "has_extra_topk_length"])
def _longest_first_kernel(lengths_ptr, extra_lengths_ptr, order_ptr, n, topk, extra_topk, has_topk_length,
                          has_extra_topk_length, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr):
    """order[rank of sequence j] = j for BLOCK sequences j: the rank counts the sequences that use more
    entries of both lists together, or as many with a smaller index. (N_BLOCKS = cdiv(n, BLOCK): the
    interpreter cannot loop up to a runtime bound.)"""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    used_j = (_used_of(j, n, lengths_ptr, topk, has_topk_length, BLOCK)
              + _used_of(j, n, extra_lengths_ptr, extra_topk, has_extra_topk_length, BLOCK))
    rank = tl.zeros([BLOCK], tl.int32)
    for block in range(N_BLOCKS):
        m = block * BLOCK + tl.arange(0, BLOCK)
        used_m = (_used_of(m, n, lengths_ptr, topk, has_topk_length, BLOCK)
                  + _used_of(m, n, extra_lengths_ptr, extra_topk, has_extra_topk_length, BLOCK))
        more = used_m[None, :] > used_j[:, None]
        tied_before = (used_m[None, :] == used_j[:, None]) & (m[None, :] < j[:, None])
        rank += tl.sum(((more | tied_before) & (m < n)[None, :]).to(tl.int32), 1)
    tl.store(order_ptr + rank, j, mask=j < n)


_ORDERINGS: dict = {}   # longest_first's compiled kernels, by device, N_BLOCKS and the lengths' alignment


def longest_first(topk_length: Optional[torch.Tensor], topk: int, extra_topk_length: Optional[torch.Tensor] = None,
                  extra_topk: int = 0) -> torch.Tensor:
    """The sequences in the order the decode programs take them: most entries used first (over both top-k
    lists: topk_length clamped to [0, topk] plus extra_topk_length clamped to [0, extra_topk]; a list
    without lengths counts its whole width), ties by index.

    A long sequence started last would set the end of the launch: the GPU starts programs in grid
    order (H200, b 128 s_q 2 h_q 128, lengths uniform in [0, 2048]: 0.68x the plain case's efficiency
    in batch order). One launch of b^2 comparisons: torch.argsort took three, and the call 8 µs more
    (H200, same shape: 222 against 214 µs); clamping and adding the two lists' lengths in torch took
    four more launches.

    Args:
        topk_length, extra_topk_length: [b] int32, contiguous, at least one of them given.
        topk, extra_topk: the widths of the two lists (extra_topk 0: a single list).
    Returns:
        [b] int32, a permutation of 0..b-1.
    """
    lengths = topk_length if topk_length is not None else extra_topk_length
    extra_lengths = extra_topk_length if extra_topk_length is not None else lengths
    n = lengths.shape[0]
    order = torch.empty(n, dtype=torch.int32, device=lengths.device)
    n_blocks = cdiv(n, _ORDER_BLOCK)
    key = (lengths.device, n_blocks, lengths.data_ptr() % 16, extra_lengths.data_ptr() % 16)
    launch(_longest_first_kernel, (n_blocks,),
           (lengths, extra_lengths, order, n, topk, extra_topk, int(topk_length is not None),
            int(extra_topk_length is not None)),
           dict(BLOCK=_ORDER_BLOCK, N_BLOCKS=n_blocks), _ORDERINGS.setdefault(key, {}))
    return order


# (The partials' and out's row strides are specialised: their divisibility lets the loads and stores of
# whole rows vectorise, see sparse_mla_decode_sm90.RUNTIME_ARGS.)
@triton.jit(do_not_specialize=[
    "num_splits", "s_q", "h_q", "n_head_blocks", "has_sink", "stride_pl_split", "stride_pl_row", "stride_l_b",
    "stride_l_s", "stride_l_h"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr,
    num_splits, s_q, h_q, n_head_blocks, has_sink,
    stride_po_split, stride_po_row, stride_po_h, stride_pl_split, stride_pl_row,
    stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s, stride_l_h,
    BLOCK_H: tl.constexpr, UPCAST: tl.constexpr, INTERPRETED_SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_head_blocks).to(tl.int64)
    b = row // s_q
    s = row % s_q
    offs_h = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q
    offs_d = tl.arange(0, D_LAT)
    lse_rows = part_lse_ptr + row * stride_pl_row + offs_h

    lse_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(0, INTERPRETED_SPLITS if UPCAST else num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_rows + split * stride_pl_split, mask=h_mask,
                                              other=float("-inf")))
    # Empty splits have lse -inf: weight exp2(-inf - ref) = 0 with a finite ref, never NaN.
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    out_rows = part_out_ptr + row * stride_po_row + offs_h[:, None] * stride_po_h + offs_d[None, :]
    for split in range(0, INTERPRETED_SPLITS if UPCAST else num_splits):
        weight = tl.math.exp2(tl.load(lse_rows + split * stride_pl_split, mask=h_mask,
                                      other=float("-inf")) - ref)
        part = tl.load(out_rows + split * stride_po_split, mask=h_mask[:, None], other=0.0)
        acc += weight[:, None] * part
        weight_sum += weight
    # The splits' partial sums merge like softmax_step's chunks: ref is the running max, weight_sum the sum.
    _, total, lse2 = softmax_rows(ref, weight_sum)
    _store_final(acc / total[:, None], lse2, offs_h, h_mask, sink_ptr, has_sink,
                 out_ptr + b * stride_o_b + s * stride_o_s + offs_h * stride_o_h,
                 lse_ptr + b * stride_l_b + s * stride_l_s + offs_h * stride_l_h)


def uses_sm90_kernel(q: torch.Tensor, config: Optional[DecodeConfig] = None) -> bool:
    """Whether sparse_mla_decode_fp8 runs a Gluon kernel (V32: sparse_mla_decode_sm90 or, up to 32 heads,
    sparse_mla_decode_sm90_few_heads; MODEL1: sparse_mla_decode_model1_sm90) for this q and config:
    compiled (not interpreted), no explicit config, on an sm_90 GPU."""
    return config is None and not INTERPRET and sm90.supported(q)


def _tiling(q: torch.Tensor, config: Optional[DecodeConfig]) -> Tuple[bool, int, int]:
    """(uses_sm90_kernel, heads per program, top-k entries per loop step) of the kernel a call runs (the
    sm90 kernels: 64 heads, or h_q rounded up to 16 or 32 up to 32 heads)."""
    if uses_sm90_kernel(q, config):
        return True, sm90_few_heads.program_heads(q.shape[2]) or sm90.BLOCK_H.value, sm90.BLOCK_N.value
    config = config or default_config(q.shape[2], q.shape[3])
    return False, config.block_h, config.block_n


def default_num_splits(q: torch.Tensor, topk: int, config: Optional[DecodeConfig] = None) -> int:
    """Top-k splits per query row that sparse_mla_decode_fp8(q, ..., config=config) uses by default, for q
    [b, s_q, h_q, d_qk] and topk entries per row (with an extra cache: both top-k widths together),
    each split at least 256 entries; 1 off the GPU. The sm90 kernel (uses_sm90_kernel): as many splits
    as one wave of its programs (one per SM) holds, rounded down; the portable kernel: 1 with at least 2
    programs per SM, else enough splits for 4."""
    if q.device.type != "cuda":
        return 1
    use_sm90, block_h, _ = _tiling(q, config)
    b, s_q, h_q, _ = q.shape
    n_programs = max(1, b * s_q * triton.cdiv(h_q, block_h))
    n_sms = num_sms(q.device, 1)
    if use_sm90:
        wanted = n_sms // n_programs
    else:
        below, target = _PORTABLE_SPLIT_RULE
        if n_programs >= below * n_sms:
            return 1
        wanted = triton.cdiv(target * n_sms, n_programs)
    return max(1, min(wanted, topk // _MIN_SPLIT_LEN))


def _cache_layout(kv_cache) -> int:
    """The query width of kv_cache's layout, chosen by its last dim: D_QK (576) for V32's 656-byte
    tokens, D_QK_MODEL1 (512) for MODEL1's 584-byte entries."""
    width = kv_cache.shape[-1] if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() > 0 else None
    if width == formats.KV_TOKEN_BYTES:
        return D_QK
    if width == formats.MODEL1_ENTRY_BYTES:
        return D_QK_MODEL1
    raise InputError(f"kv_cache must be a uint8 tensor [num_blocks, block_size, 1, {formats.KV_TOKEN_BYTES}] (V32) "
                     f"or [num_blocks, block_size, 1, {formats.MODEL1_ENTRY_BYTES}] (MODEL1), got "
                     f"{getattr(kv_cache, 'dtype', type(kv_cache).__name__)} {tuple(getattr(kv_cache, 'shape', ()))}")


def _check_indices(name: str, indices, b: int, s_q: int) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.dtype != torch.int32 \
            or tuple(indices.shape[:2]) != (b, s_q):
        raise InputError(f"{name} must be an int32 tensor [b={b}, s_q={s_q}, topk], got "
                         f"{getattr(indices, 'dtype', type(indices).__name__)} {tuple(getattr(indices, 'shape', ()))}")


def _check_decode_inputs(q, d_qk, kv_cache, indices, d_v, attn_sink, topk_length, extra_kv_cache, extra_indices,
                         extra_topk_length, out, lse, num_splits, config) -> None:
    check_tensors({"q": q})
    if q.dim() != 4 or q.shape[3] != d_qk or q.dtype != torch.bfloat16 or q.shape[2] == 0:
        raise InputError(f"q must be a bfloat16 tensor [b, s_q, h_q >= 1, {d_qk}] (the width kv_cache's layout "
                         f"takes), got {q.dtype} {tuple(q.shape)}")
    b, s_q, h_q, _ = q.shape
    _check_indices("indices", indices, b, s_q)
    if isinstance(d_v, bool) or d_v != D_V:
        raise InputError(f"d_v must be {D_V}, got {d_v!r}")
    tensors = {"q": q, "kv_cache": kv_cache, "indices": indices}
    check_tensor(tensors, "attn_sink", attn_sink, torch.float32, (h_q,), optional=True)
    check_tensor(tensors, "topk_length", topk_length, torch.int32, (b,), optional=True)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise InputError("extra_kv_cache and extra_indices must be given together")
    if extra_kv_cache is not None:
        _check_indices("extra_indices", extra_indices, b, s_q)
        tensors.update(extra_kv_cache=extra_kv_cache, extra_indices=extra_indices)
    elif extra_topk_length is not None:
        raise InputError("extra_topk_length needs extra_kv_cache and extra_indices")
    check_tensor(tensors, "extra_topk_length", extra_topk_length, torch.int32, (b,), optional=True)
    check_tensor(tensors, "out", out, torch.bfloat16, (b, s_q, h_q, D_V), optional=True)
    check_tensor(tensors, "lse", lse, torch.float32, (b, h_q, s_q), optional=True)
    if out is not None and out.stride(3) != 1:
        raise InputError("out must have a contiguous last dim")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise InputError(f"num_splits must be a positive int, got {num_splits!r}")
    check_config(config, DecodeConfig)
    check_device(tensors)


def _launch_portable(kernel, grid, args, split: bool, plan: "_DecodePlan") -> None:
    """Run a portable kernel (_sparse_decode_kernel or _sparse_decode_model1_kernel) on the runtime
    arguments sparse_mla_decode_fp8 builds for its layout; split: write partial results (fp32 out,
    base-2 lse) for the merge kernel."""
    config = plan.config
    launch(kernel, grid, args, dict(
        BLOCK_H=config.block_h, BLOCK_N=config.block_n, SPLIT=split, UPCAST=INTERPRET,
        INTERPRETED_ITERS=cdiv(plan.split_len, config.block_n) if INTERPRET else 0,
        num_warps=config.num_warps, num_stages=config.num_stages), plan.compiled)


@dataclass(slots=True)
class _DecodePlan:
    """What sparse_mla_decode_fp8 derives from one call signature (its tensors' classes, dtypes, shapes,
    strides, devices and alignment, and its options: these decide the kernel and tiling _tiling picks),
    once: that the inputs pass the checks, the grid and split, the launches' runtime integers, and the
    compiled kernels (launch's cache)."""

    model1: bool
    use_sm90: bool
    out_shape: tuple
    lse_shape: tuple
    widths: tuple          # (topk, extra_topk)
    grid: Optional[tuple]  # (query rows x head blocks, top-k splits); None: no query rows
    split_len: int
    block_h: int
    padded_blocks: bool
    sizes: tuple           # the decode kernel's runtime integers before sm_scale_log2 ...
    flags_strides: tuple   # ... and after it
    copies: bool           # q and the index lists are copied (one of them has a non-unit last stride)
    partials: Optional[tuple]   # the split partials' shapes (out, lse); None: unsplit
    batch_order: Optional[torch.Tensor]   # with lengths, the sequences in batch order when that costs nothing
    merge: tuple           # (grid, runtime integers after the tensors, constexprs) of the merge kernel
    config: Optional[DecodeConfig]   # the portable kernel's launch shape
    compiled: dict


_PLANS: dict = {}   # call signature -> _DecodePlan


def _strides(shape: tuple) -> tuple:
    """The strides of a new contiguous tensor of shape."""
    return torch.empty(shape, device="meta").stride()


def _plan(q, kv_cache, indices, d_v, attn_sink, topk_length, extra_kv_cache, extra_indices, extra_topk_length, out,
          lse, num_splits, config) -> _DecodePlan:
    """Check a call's inputs (raising InputError) and derive its _DecodePlan."""
    d_qk = _cache_layout(kv_cache)
    model1 = d_qk == D_QK_MODEL1
    if model1:
        geometry = model1_cache_geometry(kv_cache)
        extra = None if extra_kv_cache is None else model1_cache_geometry(extra_kv_cache, "extra_kv_cache")
    else:
        geometry = cache_geometry(kv_cache)
        if extra_kv_cache is not None or extra_indices is not None or extra_topk_length is not None:
            raise InputError(f"extra_kv_cache, extra_indices and extra_topk_length need a MODEL1 kv_cache "
                             f"(last dim {formats.MODEL1_ENTRY_BYTES}), got a V32 one")
    _check_decode_inputs(q, d_qk, kv_cache, indices, d_v, attn_sink, topk_length, extra_kv_cache, extra_indices,
                         extra_topk_length, out, lse, num_splits, config)
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    extra_topk = extra_indices.shape[2] if extra_indices is not None else 0
    out_shape, lse_shape = (b, s_q, h_q, D_V), (b, h_q, s_q)
    out_strides = out.stride() if out is not None else _strides(out_shape)
    lse_strides = lse.stride() if lse is not None else _strides(lse_shape)
    # The kernels see q and the index lists with a contiguous last dim: sparse_mla_decode_fp8 copies all
    # three (contiguous() of a contiguous tensor is itself) where one is not.
    copies = q.stride(3) != 1 or indices.stride(2) != 1 or (extra_indices is not None and extra_indices.stride(2) != 1)
    q_strides = _strides(q.shape) if copies else q.stride()
    i_strides = _strides(indices.shape) if copies else indices.stride()
    if extra_indices is None:
        ei_strides = i_strides
    else:
        ei_strides = _strides(extra_indices.shape) if copies else extra_indices.stride()
    use_sm90, block_h, block_n = _tiling(q, config)
    n_head_blocks = cdiv(h_q, block_h)
    n_rows = b * s_q
    width = topk + extra_topk
    if num_splits is None:
        num_splits = default_num_splits(q, width, config)
    # Splits cover whole BLOCK_N chunks; drop splits that would start past the row's entries.
    split_len = max(block_n, cdiv(cdiv(width, num_splits), block_n) * block_n)
    num_splits = max(1, cdiv(width, split_len))
    if num_splits == 1:
        partials = None
        o_strides = (0, *out_strides[:3])
        l_strides = (0, lse_strides[0], lse_strides[2], lse_strides[1])
    else:
        partials = ((num_splits, b, s_q, h_q, D_V), (num_splits, b, s_q, h_q))
        o_strides = _strides(partials[0])[:4]
        l_strides = _strides(partials[1])
    has_sink = int(attn_sink is not None)
    if model1:
        extra_geometry = (1, 0, 0) if extra is None else (extra.block_size, extra.num_slots, extra.block_stride // 16)
        sizes = (s_q, h_q, n_head_blocks, topk, extra_topk, split_len, geometry.block_size, geometry.num_slots,
                 geometry.block_stride // 16, *extra_geometry)
        flags_strides = (int(topk_length is not None), int(extra_topk_length is not None), has_sink,
                         *q_strides[:3], *i_strides[:2], *ei_strides[:2], *o_strides, *l_strides)
    else:
        sizes = (s_q, h_q, n_head_blocks, topk, split_len, geometry.block_size, geometry.num_slots,
                 geometry.block_stride // 16)
        flags_strides = (int(topk_length is not None), has_sink, *q_strides[:3], *i_strides[:2], *o_strides,
                         *l_strides)
    grid = (n_rows * n_head_blocks, num_splits) if n_rows else None
    # With lengths the programs take the sequences longest first, unless they all start at once (at most one
    # an SM: one wave): then batch order costs nothing, and saves longest_first's launch.
    one_wave = grid is not None and grid[0] * grid[1] <= num_sms(q.device, 1)
    lengths_given = topk_length is not None or extra_topk_length is not None
    n_merge_blocks = cdiv(h_q, _MERGE_BLOCK_H)
    merge = ((n_rows * n_merge_blocks,), (
        num_splits, s_q, h_q, n_merge_blocks, has_sink, *o_strides[:1], *o_strides[2:4], *l_strides[:1],
        *l_strides[2:3], *out_strides[:3], lse_strides[0], lse_strides[2], lse_strides[1]), dict(
        BLOCK_H=_MERGE_BLOCK_H, UPCAST=INTERPRET, INTERPRETED_SPLITS=num_splits if INTERPRET else 0, num_warps=4))
    return _DecodePlan(
        model1=model1, use_sm90=use_sm90, out_shape=out_shape, lse_shape=lse_shape, widths=(topk, extra_topk),
        grid=grid, split_len=split_len, block_h=block_h,
        padded_blocks=not model1 and geometry.block_stride != geometry.block_size * formats.KV_TOKEN_BYTES,
        sizes=sizes, flags_strides=flags_strides, copies=copies, partials=partials,
        batch_order=_batch_order(b, q.device) if one_wave and lengths_given else None, merge=merge,
        config=None if use_sm90 else config or default_config(h_q, d_qk), compiled={})


def _batch_order(b: int, device: torch.device) -> Optional[torch.Tensor]:
    """0, 1, ..., b - 1 as int32 on device, copied before this returns (so every stream sees it); None while a
    CUDA graph is being captured (no copy then: the call orders its sequences with longest_first)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return torch.arange(b, dtype=torch.int32).to(device)


def sparse_mla_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_kv_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    num_splits: Optional[int] = None,
    config: Optional[DecodeConfig] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Sparse MLA decode attention over an fp8 paged cache; the semantics of FlashMLA's
    flash_mla_with_kvcache in sparse fp8 mode (is_fp8_kvcache=True, indices given), for both of its
    layouts: the cache's last dim picks V32 (656) or MODEL1 (584).

    Query token (b, i) attends, in every head h, to the cache slots indices[b, i, :] and, with an extra
    cache, to the slots extra_indices[b, i, :] of extra_kv_cache, all in one softmax:
        K_j            = dequantised entry j (V32: latent 512 | rope 64, 576 values; MODEL1: 512 values)
        V_j            = K_j[:512]                                        (V32: the latent; MODEL1: K_j)
        P[b, i, h, j]  = sm_scale * q[b, i, h, :] . K_j                   (valid j only)
        lse[b, h, i]   = log(sum_j exp(P[b, i, h, j]))                    (natural log)
        out[b, i, h]   = sum_j exp(P[b, i, h, j] - lse[b, h, i]) * V_j

    Args:
        q: [b, s_q, h_q, d_qk], bfloat16, any h_q >= 1 (no padding needed): d_qk 576 (V32: the absorbed
            query, latent 512 | rope 64) or 512 (MODEL1: nope 448 | rope 64). s_q > 1 for speculative
            steps (each query token has its own indices).
        kv_cache: [num_blocks, block_size, 1, 656] uint8 in the V32 layout (kv_cache_fp8; the block stride
            may exceed block_size * 656, a multiple of 16 bytes), or the [num_blocks, block_size, 1, 584]
            uint8 view of a MODEL1 cache (kv_cache_model1; V4: the sliding-window cache).
        indices: [b, s_q, topk], int32 slot ids (block * block_size + offset). A slot is valid iff
            0 <= slot < num_blocks * block_size; anything else (-1, ±2^31, ...) is skipped and never
            dereferenced. Duplicates count twice.
        sm_scale: float, the softmax scale applied to q.k.
        d_v: must be 512.
        attn_sink: optional [h_q] float32. out[b, i, h] is multiplied by
            exp(lse) / (exp(lse) + exp(attn_sink[h])); lse is unchanged. -inf: no effect; +inf: out 0.
        topk_length: optional [b] int32. Batch b uses only indices[b, :, :topk_length[b]]
            (clamped to [0, topk]); later entries are never read.
        extra_kv_cache, extra_indices: optional, together, MODEL1 only: a second MODEL1 cache (its own
            block_size; V4: the compressed entries) and its [b, s_q, extra_topk] int32 slot ids, valid
            as indices' are.
        extra_topk_length: optional [b] int32, with the extra cache: as topk_length for extra_indices.
        num_splits: keyword-only, optional: split each row's top-k (both lists end to end) over this many
            programs (merged by lse). Default: default_num_splits(q, topk + extra_topk, config) (enough
            programs to fill the GPU; 1 on the CPU).
        config: keyword-only, optional DecodeConfig: run the portable Triton kernel with this launch
            shape. Default: a Gluon kernel on sm_90 GPUs (uses_sm90_kernel; V32: sparse_mla_decode_sm90,
            or sparse_mla_decode_sm90_few_heads for h_q <= 32; MODEL1: sparse_mla_decode_model1_sm90),
            else the portable kernel with default_config(h_q, d_qk).
        out, lse: keyword-only, optional preallocated results (shapes below); fully overwritten.

    Returns:
        out: [b, s_q, h_q, 512] bfloat16.
        lse: [b, h_q, s_q] float32, natural log, without the sink.
        A row with no valid index (in either list) gets out = 0 and lse = +inf. Bytes of slots that no
        used valid index points to (NaN, 0xFF, anything) never affect a result.

    Raises:
        minirt.errors.InputError: wrong type, dtype or shape (a cache of neither layout, q not as wide as
            the layout takes, h_q 0, indices or lengths not int32 of their shapes, an extra cache with a
            V32 cache or without its indices), d_v != 512, num_splits not a positive int, config not a
            DecodeConfig, mismatched devices, or CPU tensors without TRITON_INTERPRET=1.
    """
    plan = per_signature(_PLANS, lambda: (
        described(q), described(kv_cache), described(indices), described(attn_sink), described(topk_length),
        described(extra_kv_cache), described(extra_indices), described(extra_topk_length), described(out),
        described(lse), d_v, num_splits.__class__, num_splits, config),
        lambda: _plan(q, kv_cache, indices, d_v, attn_sink, topk_length, extra_kv_cache, extra_indices,
                      extra_topk_length, out, lse, num_splits, config))
    device = q.device
    if out is None:
        out = torch.empty(*plan.out_shape, dtype=torch.bfloat16, device=device)
    if lse is None:
        lse = torch.empty(*plan.lse_shape, dtype=torch.float32, device=device)
    if plan.grid is None:
        return out, lse
    if plan.copies:   # (the kernels read q and the index lists with a contiguous last dim)
        q, indices, extra_indices = (t.contiguous() if t is not None else None for t in (q, indices, extra_indices))
    split = plan.partials is not None
    if split:
        dst_out = torch.empty(*plan.partials[0], dtype=torch.float32, device=device)
        dst_lse = torch.empty(*plan.partials[1], dtype=torch.float32, device=device)
    else:
        dst_out, dst_lse = out, lse
    # Unused optional pointers still need a tensor argument; the runtime flags keep them unread. The
    # kernels read sink and lengths with unit stride.
    sink = attn_sink.contiguous() if attn_sink is not None else lse
    lengths = topk_length.contiguous() if topk_length is not None else indices
    scale_log2 = float(sm_scale) * formats.LOG2E
    grid = plan.grid
    if plan.model1:
        extra_lengths = extra_topk_length.contiguous() if extra_topk_length is not None else indices
        batch_order = indices if topk_length is None and extra_topk_length is None else plan.batch_order
        if batch_order is None:
            batch_order = longest_first(None if topk_length is None else lengths, plan.widths[0],
                                        None if extra_topk_length is None else extra_lengths, plan.widths[1])
        # An empty second list (no extra cache: extra_topk 0) passes the main one's pointers, never read.
        extra_cache, extra_idx = (kv_cache, indices) if extra_kv_cache is None else (extra_kv_cache, extra_indices)
        # The runtime arguments of the MODEL1 kernels, in their parameter order.
        args = (q, kv_cache, indices, lengths, extra_cache, extra_idx, extra_lengths, batch_order, sink, dst_out,
                dst_lse, *plan.sizes, scale_log2, *plan.flags_strides)
        if plan.use_sm90:
            model1_sm90.launch(grid, args, split, plan.block_h, plan.compiled)
        else:
            _launch_portable(_sparse_decode_model1_kernel, grid, args, split, plan)
    else:
        batch_order = lengths if topk_length is None else plan.batch_order
        if batch_order is None:
            batch_order = longest_first(lengths, plan.widths[0])
        # The runtime arguments of the V32 kernels, in their parameter order.
        args = (q, kv_cache, indices, lengths, batch_order, sink, dst_out, dst_lse, *plan.sizes, scale_log2,
                *plan.flags_strides)
        if not plan.use_sm90:
            _launch_portable(_sparse_decode_kernel, grid, args, split, plan)
        elif plan.block_h in sm90_few_heads.HEADS:
            sm90_few_heads.launch(grid, args, split, plan.padded_blocks, plan.block_h, plan.compiled)
        else:
            sm90.launch(grid, args, split, plan.padded_blocks, plan.compiled)
    if split:
        merge_grid, merge_args, merge_constexprs = plan.merge
        launch(_merge_splits_kernel, merge_grid, (dst_out, dst_lse, sink, out, lse, *merge_args), merge_constexprs,
               plan.compiled)
    return out, lse


def mla_decode_fp8(
    q_absorbed: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    topk_positions: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    DSA decode attention of one MLA layer on its fp8 paged cache: the runtime's per-layer, per-step
    decode entry point.

    Maps the indexer's top-k logical positions to cache slots through the block table
    (positions_to_slots: one launch) and runs sparse_mla_decode_fp8 on them.

    Args:
        q_absorbed: [b, s_q, h_q, 576] bfloat16: per head, q_nope absorbed through kv_b_proj
            (512) followed by the roped q_pe (64).
        kv_cache: [num_blocks, block_size, 1, 656] uint8, this layer's V32 fp8 cache.
        block_table: [b, max_blocks_per_seq] int32, page ids of each sequence (-1 = unallocated).
        topk_positions: [b, s_q, topk] int32, logical token positions chosen by the indexer for
            each query token. -1 (or any position outside the table, or on an unallocated page)
            means none; such entries are skipped.
        sm_scale: float softmax scale ((qk_nope + qk_rope)^-0.5 * mscale^2 for V3.2).
        d_v, attn_sink, topk_length: as in sparse_mla_decode_fp8 (topk_length [b] limits the used
            entries of topk_positions).

    Returns:
        (out [b, s_q, h_q, 512] bfloat16, lse [b, h_q, s_q] float32 natural log); rows with no
        valid position get out = 0, lse = +inf.

    Raises:
        minirt.errors.InputError: wrong dtypes/shapes/devices (see both callees).
    """
    if not isinstance(topk_positions, torch.Tensor) or topk_positions.dtype != torch.int32 \
            or topk_positions.dim() != 3:
        raise InputError("topk_positions must be an int32 tensor [b, s_q, topk]")
    slots = positions_to_slots(topk_positions, block_table, kv_cache)
    return sparse_mla_decode_fp8(q_absorbed, kv_cache, slots, sm_scale, d_v, attn_sink, topk_length)
