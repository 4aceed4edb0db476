"""Hopper (sm_90) fast path of paged_indexer_scores for a prefill chunk, written in Gluon.

The Triton kernel's tiling (indexer_cache._paged_scores_kernel, _indexer_tiles): a program scores ROWS
query rows of one sequence, all 64 heads of each (the MMA's N is ROWS x 64), against one chunk of key
tiles, computing the tiles up to its rows' largest limit and filling the rest with -inf. Here a key tile
is one cache page of 64 keys, and the program is warp-specialised: a producer partition TMA-loads the
tiles into a ring of STAGES pages, and two consumer warpgroups, each with half of the N columns (two
query rows), multiply them and store the scores on their own pace, each tile's MMA in flight while the
previous tile's epilogue (relu, head weights, head sum, key scale, causal mask, store) runs. A consumer
releases a stage once its MMA on it is done; the producer refills it once both have.

Key formats: fp8 (the cache's page values, e4m3, against e4m3 queries; each key's scale multiplies its
head sum) or exact (split_pages' bfloat16 high and low parts against the query's, three products).
Pages outside the table or the cache are never read: their TMA box starts past the keys' rows, so the
copy fills it with zeros, and their scores are -inf.

Gluon has no interpreter: this kernel runs only on sm_90 GPUs; elsewhere paged_indexer_scores runs the
Triton kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minirt.formats import INDEX_KEY_BYTES, INDEX_KEY_DIM

from . import lightning_indexer
from ._common import INTERPRET, is_sm90
from ._indexer_tiles import launch_shape

HEADS = 64                  # index heads (V3.2): a query row is 64 of the MMA's N columns
BLOCK_S = 64                # keys a tile: one page
ROWS = 4                    # query rows a program: N = 256, 128 (two rows) a consumer warpgroup
# Key tiles in flight. Exact: 3 (q's two parts take 128 KB; three stages of both key parts, 96 KB, fill sm_90's
# 227 KB).
FP8_STAGES, EXACT_STAGES = 6, 3
_HEADS = gl.constexpr(HEADS)
_DIM = gl.constexpr(INDEX_KEY_DIM)
_BLOCK_S = gl.constexpr(BLOCK_S)
_ROWS = gl.constexpr(ROWS)
_PAGE_ROWS = gl.constexpr(INDEX_KEY_BYTES * BLOCK_S // INDEX_KEY_DIM)   # 128-byte rows of an fp8 page: 66
_PAGE_WORDS = gl.constexpr(INDEX_KEY_BYTES * BLOCK_S // 4)              # its float32 words, the scales last
# A consumer's [64 keys, 128 (row, head) columns]; the MMA's k: 32 fp8 inputs, 16 bf16.
FP8_ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
BF16_ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
# [64 keys, 2 rows] scores of a consumer: each warp stores 32 keys of one row (128 contiguous bytes).
OUT_L = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1]))
KEY_L = gl.constexpr(gl.SliceLayout(1, OUT_L.value))
ROW_L = gl.constexpr(gl.SliceLayout(0, OUT_L.value))


def takes(n_heads: int, head_dim: int, block_size: int, key_rows: int, n_queries: int, device: torch.device) -> bool:
    """Whether paged_indexer_scores runs here: 64 heads of 128, pages of 64, a prefill chunk (at least
    lightning_indexer.PRESPLIT_MIN_QUERIES rows, so that exact keys come split), key_rows (b x table width x 64
    split exact keys, num_blocks x 66 rows of 128 bytes for the fp8 cache) within TMA's int32 coordinates, on
    sm_90."""
    return not INTERPRET and n_heads == HEADS and head_dim == INDEX_KEY_DIM and block_size == BLOCK_S \
        and key_rows < 2**31 and n_queries >= lightning_indexer.PRESPLIT_MIN_QUERIES and device.type == "cuda" \
        and is_sm90(device)


def tiling(n_batch: int, n_queries: int, n_keys: int, device: torch.device) -> tuple:
    """paged_scores' tiling argument: launch_shape's (n_t_tiles, n_chunks, tiles_per_chunk) for ROWS query rows of
    HEADS heads a program and key tiles of one page."""
    config = lightning_indexer.IndexerConfig(ROWS, BLOCK_S, 8, 1)
    return launch_shape(n_batch, n_queries, HEADS, n_keys, config, device)[1]


@gluon.jit
def _page(table_row, tile, n_tiles, chunk_start, max_blocks, num_blocks):
    """The cache page of key tile `tile` of the chunk: -1 past n_tiles, past the table, or where the table's
    entry is not a page of the cache."""
    page_index = chunk_start // _BLOCK_S + tile
    page = gl.load(table_row + page_index, mask=(tile < n_tiles) & (page_index < max_blocks), other=-1)
    return gl.where((page >= 0) & (page < num_blocks), page, -1)


@gluon.jit
def _producer(smem, q_desc, q_lo_desc, k_desc, k_lo_desc, q_row, tiles, FP8: gl.constexpr, STAGES: gl.constexpr):
    """q's rows, then every computed key tile of the chunk into its stage once both consumers have released
    it (no page: a box past the keys' rows, zero-filled)."""
    q_smem, q_lo_smem, k_smem, k_lo_smem, ready, free, q_bar = smem
    table_row, n_computed, chunk_start, chunk_end, max_blocks, num_blocks, batch_row0, oob_row = tiles
    if FP8:
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    else:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_lo_desc, [q_row, 0], q_bar, q_lo_smem)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for tile in range(n_computed):
        stage = tile % STAGES
        # A fresh barrier counts as released: its phase "-1" is complete.
        mbarrier.wait(free.index(stage), ((tile // STAGES) & 1) ^ 1)
        page = _page(table_row, tile, n_computed, chunk_start, max_blocks, num_blocks)
        bar = ready.index(stage)
        if FP8:
            # Page p's 64 value rows start at row p * 66 of the cache's [num_blocks * 66, 128] byte view.
            row = gl.where(page >= 0, page * _PAGE_ROWS, oob_row)
            mbarrier.expect(bar, k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_smem.index(stage))
        else:
            # split_pages' rows hold each sequence's positions in order.
            row = gl.where(page >= 0, batch_row0 + chunk_start + tile * _BLOCK_S, oob_row)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_smem.index(stage))
            tma.async_copy_global_to_shared(k_lo_desc, [row, 0], bar, k_lo_smem.index(stage))


@gluon.jit
def _tile_logits(smem, stage, col0: gl.constexpr, FP8: gl.constexpr):
    """Issue the [64 keys, 128 columns from col0] q . k products of the tile in `stage` (async); exact: three
    bf16 products, the small ones first, as _indexer_tiles.key_logits."""
    q_smem, q_lo_smem, k_smem, k_lo_smem, ready, free, q_bar = smem
    q_hi = q_smem.slice(col0, 2 * _HEADS).permute((1, 0))
    acc = gl.zeros([_BLOCK_S, 2 * _HEADS], gl.float32, FP8_ACC_L if FP8 else BF16_ACC_L)
    if FP8:
        acc = warpgroup_mma(k_smem.index(stage), q_hi, acc, use_acc=False, is_async=True)
    else:
        acc = warpgroup_mma(k_lo_smem.index(stage), q_hi, acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(k_smem.index(stage), q_lo_smem.slice(col0, 2 * _HEADS).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma(k_smem.index(stage), q_hi, acc, is_async=True)
    return acc


@gluon.jit
def _key_scales(scale_ptr, page, FP8: gl.constexpr):
    """fp8: the [64] scales of a page's keys (0 for no page); exact: page itself (no scales)."""
    if FP8:
        offs = gl.arange(0, _BLOCK_S, KEY_L)
        return gl.load(scale_ptr + page.to(gl.int64) * _PAGE_WORDS + _BLOCK_S * _DIM // 4 + offs,
                       mask=(offs >= 0) & (page >= 0), other=0.0)
    else:
        return page


@gluon.jit
def _store_tile(logits, w, page, scale, out_rows, stride_os, last_key, t_mask, tile, chunk_start, chunk_end,
                FP8: gl.constexpr):
    """relu, head weights and head sum of one tile's logits, its keys' scales (fp8), the causal and page
    masks, stored."""
    weighted = gl.maximum(logits, 0.0) * w[None, :]
    scores = gl.convert_layout(gl.sum(gl.reshape(weighted, [_BLOCK_S, 2, _HEADS]), axis=2), OUT_L)
    if FP8:
        # relu(q . k s) = s relu(q . k) for the key's positive scale s.
        scores = scores * scale[:, None]
    keys = chunk_start + tile * _BLOCK_S + gl.arange(0, _BLOCK_S, KEY_L)
    scores = gl.where((page >= 0) & (keys[:, None] <= last_key[None, :]), scores, float("-inf"))
    gl.store(out_rows[None, :] + keys.to(gl.int64)[:, None] * stride_os, scores,
             mask=(keys < chunk_end)[:, None] & t_mask[None, :])


@gluon.jit
def _step(i, logits, page, scale, next_page, smem, tiles, w, scale_ptr, out_rows, stride_os, last_key, t_mask,
          col0: gl.constexpr, FP8: gl.constexpr, STAGES: gl.constexpr):
    """Tile i's epilogue beside tile i + 1's products (past the last tile: on a stale stage, unused; and past
    n_computed, tile i stores nothing), then tile i + 1's stage released. logits, page, scale: tile i's;
    next_page: tile i + 1's. Returns tile i + 1's logits, page and scales, and tile i + 2's page."""
    q_smem, q_lo_smem, k_smem, k_lo_smem, ready, free, q_bar = smem
    table_row, n_computed, chunk_start, chunk_end, max_blocks, num_blocks, batch_row0, oob_row = tiles
    later_page = _page(table_row, i + 2, n_computed, chunk_start, max_blocks, num_blocks)
    next_scale = _key_scales(scale_ptr, next_page, FP8)
    next_stage = (i + 1) % STAGES
    mbarrier.wait(ready.index(next_stage), ((i + 1) // STAGES) & 1, pred=i + 1 < n_computed)
    following = _tile_logits(smem, next_stage, col0, FP8)
    # A wait that leaves the products just issued in flight, through which tile i's logits pass: it keeps the
    # epilogue below after their issue.
    logits = warpgroup_mma_wait(1, deps=(logits,))
    _store_tile(logits, w, page, scale, out_rows, stride_os, last_key, t_mask & (i < n_computed), i, chunk_start,
                chunk_end, FP8)
    following = warpgroup_mma_wait(0, deps=(following,))
    mbarrier.arrive(free.index(next_stage), pred=i + 1 < n_computed)
    return following, next_page, next_scale, later_page


@gluon.jit
def _consumer(smem, tiles, w_ptr, scale_ptr, limit_ptr, out_ptr, n_queries, n_keys, batch, t0, stride_wb, stride_wt,
              stride_wh, stride_lb, stride_lt, stride_ob, stride_ot, stride_os, ROW0: gl.constexpr,
              FP8: gl.constexpr, STAGES: gl.constexpr):
    """Scores of query rows t0 + ROW0 and t0 + ROW0 + 1 (the N columns ROW0 * 64 on) over the chunk's computed
    tiles, two tiles an iteration (so that the two accumulators' registers alternate without a copy)."""
    q_smem, q_lo_smem, k_smem, k_lo_smem, ready, free, q_bar = smem
    table_row, n_computed, chunk_start, chunk_end, max_blocks, num_blocks, batch_row0, oob_row = tiles
    offs_t = t0 + ROW0 + gl.arange(0, 2, ROW_L)
    t_mask = offs_t < n_queries
    limit = gl.load(limit_ptr + batch * stride_lb + offs_t.to(gl.int64) * stride_lt, mask=t_mask, other=-1)
    last_key = gl.minimum(gl.maximum(limit, -1), n_keys - 1).to(gl.int32)
    out_rows = out_ptr + batch * stride_ob + offs_t.to(gl.int64) * stride_ot
    # The weights of the (row, head) columns; padded rows' are 0.
    cols = gl.arange(0, 2 * _HEADS, gl.SliceLayout(0, FP8_ACC_L if FP8 else BF16_ACC_L))
    w_rows = t0 + ROW0 + cols // _HEADS
    w = gl.load(w_ptr + batch * stride_wb + w_rows.to(gl.int64) * stride_wt + (cols % _HEADS) * stride_wh,
                mask=w_rows < n_queries, other=0.0)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    logits = warpgroup_mma_wait(0, deps=(_tile_logits(smem, 0, ROW0 * _HEADS, FP8),))
    mbarrier.arrive(free.index(0))
    # Loop-carried: tile i's page and key scales, tile i + 1's page; each loaded a tile ahead of its use.
    page = _page(table_row, 0, n_computed, chunk_start, max_blocks, num_blocks)
    scale = _key_scales(scale_ptr, page, FP8)
    next_page = _page(table_row, 1, n_computed, chunk_start, max_blocks, num_blocks)
    for i in range(0, n_computed, 2):
        following, page, scale, next_page = _step(i, logits, page, scale, next_page, smem, tiles, w, scale_ptr,
                                                  out_rows, stride_os, last_key, t_mask, ROW0 * _HEADS, FP8, STAGES)
        logits, page, scale, next_page = _step(i + 1, following, page, scale, next_page, smem, tiles, w, scale_ptr,
                                               out_rows, stride_os, last_key, t_mask, ROW0 * _HEADS, FP8, STAGES)


@gluon.jit
def _paged_scores_sm90_kernel(
    q_desc, q_lo_desc, k_desc, k_lo_desc, w_ptr, scale_ptr, table_ptr, limit_ptr, out_ptr,
    n_queries, n_keys, n_t_tiles, n_chunks, tiles_per_chunk, num_blocks, max_blocks, oob_row,
    stride_wb, stride_wt, stride_wh, stride_tb, stride_lb, stride_lt, stride_ob, stride_ot, stride_os,
    FP8: gl.constexpr, STAGES: gl.constexpr,
):
    # Program (batch, query tile, key chunk): the chunks of a query tile adjacent, query tiles last-first
    # (under a causal limit the last rows have the most keys), as _indexer_tiles.program_tile.
    pid = gl.program_id(0)
    rest = pid // n_chunks
    batch = rest // n_t_tiles
    t0 = (n_t_tiles - 1 - rest % n_t_tiles) * _ROWS
    chunk = pid % n_chunks

    offs_t = t0 + gl.arange(0, _ROWS, ROW_L)
    t_mask = offs_t < n_queries
    limit = gl.load(limit_ptr + batch * stride_lb + offs_t.to(gl.int64) * stride_lt, mask=t_mask, other=-1)
    last_key = gl.minimum(gl.maximum(limit, -1), n_keys - 1).to(gl.int32)
    chunk_start = chunk * tiles_per_chunk * _BLOCK_S
    chunk_end = gl.minimum(chunk_start + tiles_per_chunk * _BLOCK_S, n_keys)
    n_tiles = gl.cdiv(chunk_end - chunk_start, _BLOCK_S)
    n_computed = gl.minimum(gl.cdiv(gl.maximum(gl.max(last_key, 0) + 1 - chunk_start, 0), _BLOCK_S), n_tiles)

    if n_computed > 0:
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [_ROWS * _HEADS, _DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, _BLOCK_S, _DIM], k_desc.layout)
        if FP8:
            q_lo_smem = q_smem      # (unused)
            k_lo_smem = k_smem
        else:
            q_lo_smem = gl.allocate_shared_memory(q_desc.dtype, [_ROWS * _HEADS, _DIM], q_desc.layout)
            k_lo_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, _BLOCK_S, _DIM], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)   # one arrive a consumer
        mbarrier.init(q_bar.index(0), count=1)
        smem = (q_smem, q_lo_smem, k_smem, k_lo_smem, ready, free, q_bar.index(0))
        tiles = (table_ptr + batch * stride_tb, n_computed, chunk_start, chunk_end, max_blocks, num_blocks,
                 batch * max_blocks * _BLOCK_S, oob_row)
        # The argument tuples are written out in the call: a tuple bound to a name first would turn its
        # constexprs (ROW0, FP8, STAGES) into tensors.
        gl.warp_specialize([
            (_consumer, (smem, tiles, w_ptr, scale_ptr, limit_ptr, out_ptr, n_queries, n_keys, batch, t0, stride_wb,
                         stride_wt, stride_wh, stride_lb, stride_lt, stride_ob, stride_ot, stride_os, 0, FP8, STAGES)),
            (_consumer, (smem, tiles, w_ptr, scale_ptr, limit_ptr, out_ptr, n_queries, n_keys, batch, t0, stride_wb,
                         stride_wt, stride_wh, stride_lb, stride_lt, stride_ob, stride_ot, stride_os, 2, FP8, STAGES)),
            (_producer, (smem, q_desc, q_lo_desc, k_desc, k_lo_desc, (batch * n_queries + t0) * _HEADS, tiles, FP8,
                         STAGES)),
        ], [4, 4], [232, 40])

    # Tiles past every row's limit: -inf.
    out_rows = out_ptr + batch * stride_ob + offs_t.to(gl.int64) * stride_ot
    offs = gl.arange(0, _BLOCK_S, KEY_L)
    for i in range(n_computed, n_tiles):
        keys = chunk_start + i * _BLOCK_S + offs
        gl.store(out_rows[None, :] + keys.to(gl.int64)[:, None] * stride_os,
                 gl.full([_BLOCK_S, _ROWS], float("-inf"), gl.float32, OUT_L),
                 mask=(keys < chunk_end)[:, None] & t_mask[None, :])


def paged_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, keys_lo: torch.Tensor,
                 table: torch.Tensor, limit: torch.Tensor, out: torch.Tensor, n_keys: int, fp8: bool,
                 tiling: tuple) -> None:
    """One launch of the scores of q's rows into out (paged_indexer_scores' contract; checked inputs that
    takes() accepts). fp8: keys the fp8 index cache (uint8 [num_blocks, 64, 1, 132]), keys_lo unused; exact:
    keys, keys_lo split_pages' bfloat16 parts [b * P, 64, 128] and table its table. tiling: tiling()'s."""
    n_batch, n_queries = q.shape[:2]
    n_t_tiles, n_chunks, tiles_per_chunk = tiling
    q_rows = q.reshape(-1, INDEX_KEY_DIM)
    if q_rows.data_ptr() % 16:   # (a TMA tensor starts 16-byte aligned)
        q_rows = q_rows.clone()
    if fp8:
        q_parts = (q_rows, q_rows)
        num_blocks = keys.shape[0]
        # A page of 64 tokens is 66 rows of 128 bytes: the values' 64, then the scales'.
        rows = keys.view(torch.float8_e4m3fn).view(-1, INDEX_KEY_DIM)
        key_parts = (rows, rows)
        oob_row, stages = rows.shape[0], FP8_STAGES
        scales = keys.view(torch.float32)
    else:
        q_parts = lightning_indexer.split_bf16_parts(q_rows)
        num_blocks = keys.shape[0]
        key_parts = (keys.view(-1, INDEX_KEY_DIM), keys_lo.view(-1, INDEX_KEY_DIM))
        oob_row, stages = key_parts[0].shape[0], EXACT_STAGES
        scales = weights   # (unread)
    dtype = gl.float8e4nv if fp8 else gl.bfloat16
    q_layout = gl.NVMMASharedLayout.get_default_for([ROWS * HEADS, INDEX_KEY_DIM], dtype)
    k_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_S, INDEX_KEY_DIM], dtype)
    q_descs = [TensorDescriptor.from_tensor(t, [ROWS * HEADS, INDEX_KEY_DIM], q_layout) for t in q_parts]
    k_descs = [TensorDescriptor.from_tensor(t, [BLOCK_S, INDEX_KEY_DIM], k_layout) for t in key_parts]
    _paged_scores_sm90_kernel[(n_batch * n_t_tiles * n_chunks,)](
        *q_descs, *k_descs, weights, scales, table, limit, out,
        n_queries, n_keys, n_t_tiles, n_chunks, tiles_per_chunk, num_blocks, table.shape[1], oob_row,
        *weights.stride(), table.stride(0), *limit.stride(), *out.stride(),
        FP8=fp8, STAGES=stages, num_warps=4)
