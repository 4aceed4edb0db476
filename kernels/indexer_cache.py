"""The lightning indexer's paged key cache, and the indexer scores read straight from it.

Two cache formats, addressed like the latent cache (slot = block * block_size + offset; a sequence's
logical position p lives in page ``block_table[b, p // block_size]`` at offset ``p % block_size``):

fp8 mode, DeepSeek-V3.2's format as vLLM (``indexer_k_quant_and_cache``) writes it and DeepGEMM
(``fp8_paged_mqa_logits``) reads it: per token 128 float8_e4m3fn values and one float32 scale,
132 bytes. Byte layout of one page of block_size tokens (little-endian), values of the whole page
first, then its scales:

    [0, block_size * 128)                     float8_e4m3fn  k / SCALE; token o at [o * 128, o * 128 + 128)
    [block_size * 128, block_size * 132)      float32        SCALE; token o at block_size * 128 + 4 * o

SCALE = 2^ceil(log2(max(amax, 1e-4) / 448)), amax = max |k| over the token's 128 values, evaluated
exactly (minirt.formats.pow2_scale with ACT_MIN_SCALE: the smallest scale is 2^-22); the stored value
is clamp(k / SCALE, -448, 448) rounded to nearest-even e4m3; dequantisation is fp8 * SCALE (exact in
float32). The tensor is ``[num_blocks, block_size, 1, 132]`` uint8, DeepGEMM's shape: only its page
is meaningful, ``cache[n, o]`` is not token o's bytes (use ``index_cache_parts``).

exact mode: the keys in full precision, float32 ``[num_blocks, block_size, D]`` (the runtime's
``[num_slots, D]`` key tensor viewed as pages: ``keys.view(-1, block_size, D)``).

``paged_indexer_scores`` reads either format through a block table, for a decode step (one query per
sequence) or a prefill chunk (many queries of one sequence), with a causal limit per query row.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError
from minirt.formats import ACT_MIN_SCALE, CACHE_BLOCK_SIZE, FP8_DTYPE, INDEX_KEY_BYTES, INDEX_KEY_DIM, quantize_groups

from ._common import check_config, check_device, check_slots, flat_of, rows_of, writable_slot
from ._indexer_tiles import (fill_uncomputed, head_sum, key_chunk, key_logits, launch_shape, program_tile, query_tile,
                             split_query)
from ._fp8 import ACT_MIN_EXPONENT, e4m3_bits, pow2_scale
from ._launch import Kept, described, launch, per_signature
from .kv_cache_fp8 import CacheGeometry
from . import indexer_scores_sm90, lightning_indexer
from .lightning_indexer import MAX_Q_ROW_BYTES, IndexerConfig, default_config, split_bf16_parts

# Every kernel index is 32-bit: key positions, slots, page offsets.
_MAX_KEYS = 2**31 - 2**16


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------

def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Quantise indexer keys to the fp8 cache format (torch reference of write_index_keys).

    Args:
        k: [..., 128] bfloat16, float16 or float32, finite. Normalised, roped (and, in DeepSeek's
            fp8 path, Hadamard-rotated) indexer keys.

    Returns:
        values: [..., 128] float8_e4m3fn, clamp(k / scale, -448, 448) rounded to nearest-even.
        scales: [...] float32, the power-of-two scale of each key (module docstring).

    Raises:
        minirt.errors.InputError: not a float tensor with last dim 128.
    """
    _check_keys(k)
    values, scales = quantize_groups(k, ACT_MIN_SCALE, INDEX_KEY_DIM)
    return values, scales.squeeze(-1)


def index_cache_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Views of an fp8 index cache's two parts (no copy; writing them writes the cache).

    Args:
        cache: [num_blocks, block_size, 1, 132] uint8 fp8 index cache (contiguous; see new_index_cache).

    Returns:
        values: [num_blocks, block_size, 128] float8_e4m3fn, values[n, o] = token o of page n.
        scales: [num_blocks, block_size] float32, its scales.

    Raises:
        minirt.errors.InputError: not an fp8 index cache (see new_index_cache for the constraints).
    """
    _fp8_cache_geometry(cache)
    num_blocks, block_size = cache.shape[:2]
    pages = cache.view(num_blocks, block_size * INDEX_KEY_BYTES)
    values = pages[:, :block_size * INDEX_KEY_DIM].view(num_blocks, block_size, INDEX_KEY_DIM)
    return values.view(FP8_DTYPE), pages[:, block_size * INDEX_KEY_DIM:].view(torch.float32)


def dequantize_index_cache(cache: torch.Tensor) -> torch.Tensor:
    """
    Dequantise a whole fp8 index cache (torch reference of the scores kernel's key loads).

    Args:
        cache: [num_blocks, block_size, 1, 132] uint8 fp8 index cache.

    Returns:
        [num_blocks, block_size, 128] float32, fp8 value * scale of its token (exact).

    Raises:
        minirt.errors.InputError: not an fp8 index cache.
    """
    values, scales = index_cache_parts(cache)
    return values.float() * scales[..., None]


# ----------------------------------------------------------------------------------------------
# cache construction and geometry
# ----------------------------------------------------------------------------------------------

def new_index_cache(num_blocks: int, block_size: int = CACHE_BLOCK_SIZE,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """
    Allocate a zeroed fp8 index key cache for one layer.

    Args:
        num_blocks: number of pages (>= 1).
        block_size: tokens per page, a positive multiple of 4 (a page of 132-byte tokens then spans
            a multiple of 16 bytes, which the kernels' aligned loads need); 64 as in vLLM.
        device: where to allocate.

    Returns:
        [num_blocks, block_size, 1, 132] uint8, all bytes 0 (every key dequantises to zeros).

    Raises:
        minirt.errors.InputError: num_blocks or block_size not as above.
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    if block_size % 4:
        raise InputError(f"block_size must be a multiple of 4 (pages of 16-byte multiples), got {block_size}")
    return torch.zeros(num_blocks, block_size, 1, INDEX_KEY_BYTES, dtype=torch.uint8, device=device)


def _fp8_cache_geometry(cache) -> CacheGeometry:
    """Validate an fp8 index cache; block_stride is in bytes."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 4 \
            or cache.shape[2] != 1 or cache.shape[3] != INDEX_KEY_BYTES:
        raise InputError(f"an fp8 index cache must be a uint8 tensor [num_blocks, block_size, 1, "
                         f"{INDEX_KEY_BYTES}], got {getattr(cache, 'dtype', type(cache).__name__)} "
                         f"{tuple(getattr(cache, 'shape', ()))}")
    num_blocks, block_size = cache.shape[:2]
    # Values and scales sit at fixed offsets of a page, so a view of part of the pages would misplace
    # them: the cache must be whole pages back to back (a slice of pages is fine).
    if not cache.is_contiguous():
        raise InputError(f"an fp8 index cache must be contiguous (whole pages back to back), got strides "
                         f"{cache.stride()}")
    return _paged_geometry(cache, num_blocks, block_size, block_size * INDEX_KEY_BYTES)


def _exact_cache_geometry(keys) -> CacheGeometry:
    """Validate an exact (float32) paged key tensor; block_stride is in bytes."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.float32 or keys.dim() != 3:
        raise InputError(f"exact index keys must be a float32 tensor [num_blocks, block_size, D], got "
                         f"{getattr(keys, 'dtype', type(keys).__name__)} {tuple(getattr(keys, 'shape', ()))}")
    num_blocks, block_size, head_dim = keys.shape
    if keys.stride(2) != 1 or (block_size > 1 and keys.stride(1) != head_dim):
        raise InputError(f"the keys of a page must be packed (strides [*, {head_dim}, 1]), got strides "
                         f"{keys.stride()}")
    return _paged_geometry(keys, num_blocks, block_size, block_size * head_dim * 4)


def _paged_geometry(cache, num_blocks, block_size, page_bytes) -> CacheGeometry:
    if num_blocks < 1 or block_size < 1:
        raise InputError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, got shape {tuple(cache.shape)}")
    block_stride = cache.stride(0) * cache.element_size() if num_blocks > 1 else page_bytes
    # Pages 16-byte aligned: the kernels address them as page * (block_stride / 16) * 16, so the
    # compiler knows the alignment of every key row and scale.
    if block_stride % 16 or cache.data_ptr() % 16:
        raise InputError(f"cache pages ({block_stride} bytes apart) and the data pointer must be 16-byte "
                         "aligned (fp8 caches: block_size a multiple of 4)")
    if num_blocks * block_size >= _MAX_KEYS:
        raise InputError(f"cache has {num_blocks * block_size} slots; slot ids are int32")
    return CacheGeometry(num_blocks, block_size, block_stride)


def _check_keys(k) -> None:
    if not isinstance(k, torch.Tensor) or k.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
            or k.dim() < 1 or k.shape[-1] != INDEX_KEY_DIM:
        raise InputError(f"k must be a bfloat16, float16 or float32 tensor [..., {INDEX_KEY_DIM}], got "
                         f"{getattr(k, 'dtype', type(k).__name__)} {tuple(getattr(k, 'shape', ()))}")


# ----------------------------------------------------------------------------------------------
# writer
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["block_size", "num_slots", "block_stride_16", "stride_k"])
def _write_index_keys_kernel(cache_ptr, k_ptr, slot_ptr, block_size, num_slots, block_stride_16, stride_k,
                             DIM: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot, valid = writable_slot(slot_ptr, token, num_slots)
    page = cache_ptr + (slot // block_size) * block_stride_16 * 16
    offset = slot % block_size

    cols = tl.arange(0, DIM)
    k = tl.load(k_ptr + token * stride_k + cols).to(tl.float32)
    scale, inv_scale = pow2_scale(tl.max(tl.abs(k), 0), MIN_EXPONENT)
    tl.store(page + offset * DIM + cols, e4m3_bits(k * inv_scale).to(tl.uint8), mask=valid)
    tl.store((page + block_size * DIM).to(tl.pointer_type(tl.float32)) + offset, scale, mask=valid)


def write_index_keys(cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> None:
    """
    Quantise new indexer keys and scatter them into their fp8 cache slots, in place, in one launch.

    Byte-identical to quantize_index_keys(k) written at index_cache_parts(cache)[.][slot // block_size,
    slot % block_size] for each valid slot.

    Args:
        cache: [num_blocks, block_size, 1, 132] uint8 fp8 index cache (see new_index_cache).
        k: [..., 128] bfloat16, float16 or float32, finite; last dim contiguous.
        slots: [...] int32 or int64, k's leading shape: the slot of each key. Slots outside
            [0, num_blocks * block_size) (e.g. -1 for padding tokens) are skipped. Two keys with the
            same slot leave one of them, unspecified which.

    Raises:
        minirt.errors.InputError: wrong dtype, shape or device; not an fp8 index cache.
    """
    geometry, compiled = per_signature(_WRITES, lambda: (described(cache), described(k), described(slots)),
                                       lambda: (_checked_write(cache, k, slots), {}))
    k = rows_of(k, INDEX_KEY_DIM)
    slots = flat_of(slots)
    if slots.numel() == 0:
        return
    launch(_write_index_keys_kernel, (slots.numel(),), (
        cache, k, slots, geometry.block_size, geometry.num_slots, geometry.block_stride // 16, k.stride(0)),
        dict(DIM=INDEX_KEY_DIM, MIN_EXPONENT=ACT_MIN_EXPONENT, num_warps=1), compiled)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> (the cache's
# geometry, the writer's compiled kernel): a signature seen before passed the checks.
_WRITES: dict = {}


def _checked_write(cache, k, slots) -> CacheGeometry:
    """write_index_keys' input checks (InputError); the cache's geometry."""
    geometry = _fp8_cache_geometry(cache)
    _check_keys(k)
    check_slots(slots, k.shape[:-1])
    check_device({"cache": cache, "k": k, "slots": slots})
    return geometry


# ----------------------------------------------------------------------------------------------
# scores
# ----------------------------------------------------------------------------------------------

# Sizes are only compared or used in index arithmetic: specialising on them would only multiply compiles.
@triton.jit(do_not_specialize=["n_queries", "n_keys", "n_heads", "n_t_tiles", "n_chunks", "tiles_per_chunk",
                               "block_size", "num_blocks", "max_blocks", "block_stride_16"])
def _paged_scores_kernel(
    q_ptr, w_ptr, cache_ptr, cache_lo_ptr, table_ptr, limit_ptr, out_ptr,
    n_queries, n_keys, n_heads, n_t_tiles, n_chunks, tiles_per_chunk,
    block_size, num_blocks, max_blocks, block_stride_16,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_wb, stride_wt, stride_wh,
    stride_tb, stride_lb, stride_lt,
    stride_ob, stride_ot, stride_os,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    FP8: tl.constexpr, KEYS_SPLIT: tl.constexpr, INTERPRETED: tl.constexpr,
    INTERPRETED_TILES: tl.constexpr,
):
    batch, t_tile, chunk = program_tile(n_t_tiles, n_chunks)
    q_t, w, offs_t, t_mask, last_key = query_tile(
        q_ptr, w_ptr, limit_ptr, batch, t_tile, n_queries, n_heads, n_keys,
        stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh, stride_lb, stride_lt,
        HEAD_DIM, BLOCK_T, BLOCK_H, True, INTERPRETED)
    # float32 keys (exact mode): three bf16 products of split operands (_indexer_tiles).
    q_hi, q_lo = split_query(q_t, not FP8, INTERPRETED)
    tile_last = tl.max(last_key)
    chunk_start, chunk_end, n_tiles, n_computed = key_chunk(chunk, tiles_per_chunk, n_keys, last_key, BLOCK_S)

    table_row = table_ptr + batch * stride_tb
    out_rows = out_ptr + batch * stride_ob + offs_t.to(tl.int64) * stride_ot
    offs_d = tl.arange(0, HEAD_DIM)
    # The Triton 3.6 interpreter cannot use a runtime scalar as a loop bound (numpy >= 2.4), so
    # interpreted runs take the loops over all tiles of the chunk and let the store masks split them
    # at n_computed; compiled, the masks `i < n_computed` / `i >= n_computed` are always true.
    for i in range(0, INTERPRETED_TILES if INTERPRETED else n_computed):
        offs_s = chunk_start + i * BLOCK_S + tl.arange(0, BLOCK_S)
        # Keys past the tile's largest limit, and pages that are unallocated (-1) or outside the
        # cache, are never read: masked loads, so NaN bytes there cannot reach the dot.
        needed = (offs_s <= tile_last) & (offs_s < chunk_end)
        page_index = offs_s // block_size
        page = tl.load(table_row + page_index, mask=needed & (page_index < max_blocks), other=-1)
        has_key = needed & (page >= 0) & (page < num_blocks)
        page = tl.where(has_key, page, 0)
        in_page = (offs_s - page_index * block_size).to(tl.int64)
        if FP8:
            page_bytes = cache_ptr + page.to(tl.int64) * block_stride_16 * 16
            k = tl.load((page_bytes + in_page * HEAD_DIM).to(tl.pointer_type(tl.float8e4nv))[:, None]
                        + offs_d[None, :], mask=has_key[:, None], other=0.0)
            k_scale = tl.load((page_bytes + block_size * HEAD_DIM).to(tl.pointer_type(tl.float32)) + in_page,
                              mask=has_key, other=0.0)
            k_lo = k
        elif KEYS_SPLIT:
            # Two bfloat16 parts (split_pages) whose pages hold each sequence's positions in order, so
            # the tile is one contiguous block of rows, addressed from offs_s rather than gathered
            # through the table (which only says which pages hold keys): fewer live registers at
            # sm_90a (187 against 192 at (2, 128, 8, 2); 166 spill instructions against 198 at (4, 64, 4, 3)).
            offsets = (batch * max_blocks * block_size + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
            k = tl.load(cache_ptr + offsets, mask=has_key[:, None], other=0.0)
            k_lo = tl.load(cache_lo_ptr + offsets, mask=has_key[:, None], other=0.0)
        else:
            k = tl.load(cache_ptr + page.to(tl.int64)[:, None] * block_stride_16 * 4
                        + in_page[:, None] * HEAD_DIM + offs_d[None, :], mask=has_key[:, None], other=0.0)
            k_lo = k
        if INTERPRETED:
            k, k_lo = k.to(tl.float32), k_lo.to(tl.float32)
        scores = head_sum(key_logits(k, k_lo, q_hi, q_lo, not FP8, KEYS_SPLIT, INTERPRETED), w, BLOCK_S, BLOCK_T, BLOCK_H)
        if FP8:
            # relu(q . k_fp8 * s) = relu(q . k_fp8) * s for the positive scale s: one multiply per key.
            scores = scores * k_scale[:, None]
        scores = tl.where(has_key[:, None] & (offs_s[:, None] <= last_key[None, :]), scores, float("-inf"))
        tl.store(out_rows[None, :] + offs_s.to(tl.int64)[:, None] * stride_os, scores,
                 mask=(offs_s < chunk_end)[:, None] & t_mask[None, :] & (i < n_computed))
    fill_uncomputed(out_rows, stride_os, t_mask, chunk_start, chunk_end, n_computed, n_tiles,
                     BLOCK_S, BLOCK_T, INTERPRETED, INTERPRETED_TILES)


def _check_scores_inputs(q, weights, cache, block_table, limit, n_keys, out):
    """Validate paged_indexer_scores' arguments; returns (fp8, geometry, n_keys)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q must be a tensor [b, t, H, D], got {tuple(getattr(q, 'shape', ()))}")
    n_batch, n_queries, n_heads, head_dim = q.shape
    if not isinstance(cache, torch.Tensor) or cache.dtype not in (torch.uint8, torch.float32):
        raise InputError(f"cache must be an fp8 index cache (uint8 [num_blocks, block_size, 1, {INDEX_KEY_BYTES}]) "
                         f"or exact index keys (float32 [num_blocks, block_size, D]), got "
                         f"{getattr(cache, 'dtype', type(cache).__name__)}")
    fp8 = cache.dtype == torch.uint8
    geometry = _fp8_cache_geometry(cache) if fp8 else _exact_cache_geometry(cache)
    cache_dim = INDEX_KEY_DIM if fp8 else cache.shape[2]
    want = FP8_DTYPE if fp8 else torch.float32
    if q.dtype != want:
        raise InputError(f"q must be {want} for {'an fp8' if fp8 else 'an exact (float32)'} cache, got {q.dtype}")
    if head_dim != cache_dim or head_dim not in (16, 32, 64, 128, 256):
        raise InputError(f"q head dim {head_dim} must equal the cache's key dim {cache_dim} (a power of "
                         "two in [16, 256])")
    if n_heads < 1 or triton.next_power_of_2(n_heads) * head_dim * q.element_size() > MAX_Q_ROW_BYTES:
        raise InputError(f"unsupported H = {n_heads}, D = {head_dim} for {q.dtype}: need H >= 1 and "
                         f"next_pow2(H) * D * itemsize <= {MAX_Q_ROW_BYTES}")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or tuple(weights.shape) != (n_batch, n_queries, n_heads):
        raise InputError(f"weights must be a float32 tensor [{n_batch}, {n_queries}, {n_heads}]")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
            or block_table.dim() != 2 or block_table.shape[0] != n_batch:
        raise InputError(f"block_table must be an int32 tensor [{n_batch}, max_blocks_per_seq]")
    if not isinstance(limit, torch.Tensor) or limit.dtype not in (torch.int32, torch.int64) \
            or tuple(limit.shape) != (n_batch, n_queries):
        raise InputError(f"limit must be an int32 or int64 tensor [{n_batch}, {n_queries}]")
    if n_keys is None:
        n_keys = block_table.shape[1] * geometry.block_size
    if isinstance(n_keys, bool) or not isinstance(n_keys, int) or not 0 <= n_keys < _MAX_KEYS:
        raise InputError(f"n_keys must be an int in [0, {_MAX_KEYS}), got {n_keys!r}")
    tensors = {"q": q, "weights": weights, "cache": cache, "block_table": block_table, "limit": limit}
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 \
                or tuple(out.shape) != (n_batch, n_queries, n_keys):
            raise InputError(f"preallocated out must be a float32 tensor [{n_batch}, {n_queries}, {n_keys}]")
        tensors["out"] = out
    check_device(tensors)
    return fp8, geometry, n_keys


def split_pages(cache: torch.Tensor, block_table: torch.Tensor, n_keys: int):
    """The pages of exact keys (float32 [num_blocks, block_size, D]) that block_table's entries for
    positions [0, n_keys) name, gathered and split into bfloat16 parts as the kernels split them (hi
    the nearest bfloat16, lo that of the exact rest): (hi, lo) [b * P, block_size, D] each, and the
    int32 table [b, P] over them (entry b * P + i, or -1 where block_table holds no valid page).
    Unwritten slots keep their bytes (NaN stays NaN; the kernel never reads keys past the limits)."""
    num_blocks, block_size, _ = cache.shape
    table = block_table[:, :triton.cdiv(n_keys, block_size)]
    valid = (table >= 0) & (table < num_blocks)
    hi, lo = split_bf16_parts(cache[table.clamp(0, num_blocks - 1).long()].flatten(0, 1))
    ids = torch.arange(table.numel(), device=table.device, dtype=torch.int32).view(table.shape)
    return hi, lo, torch.where(valid, ids, -1)


def _launch_paged(q, weights, cache, block_table, limit, out, kept: Kept) -> torch.Tensor:
    """Scores into out with the launch shape of kept.value (fp8, geometry, config, n_keys); inputs already
    checked. kept: the call signature's Kept (args: the launch, derived at its first launch)."""
    if out.numel() == 0:
        return out
    fp8, geometry, config, n_keys = kept.value
    plan = kept.args
    # Exact keys as lightning_indexer_scores takes float32 keys: a prefill chunk splits them once.
    copy_table, keys_split = plan[:2] if plan is not None else (
        block_table.stride(1) != 1,
        not fp8 and q.shape[1] >= lightning_indexer.PRESPLIT_MIN_QUERIES and block_table.shape[1] > 0)
    table = block_table.contiguous() if copy_table else block_table
    cache_lo = cache
    if keys_split:
        cache, cache_lo, table = split_pages(cache, table, n_keys)
    n_batch, n_queries, n_heads, head_dim = q.shape
    if config is None:
        # The sm_90 kernel (indexer_scores_sm90.takes): its key tiles are pages, ROWS query rows a program.
        if plan is None:
            plan = kept.args = (copy_table, keys_split, indexer_scores_sm90.tiling(n_batch, n_queries, n_keys, q.device))
        indexer_scores_sm90.paged_scores(q, weights, cache, cache_lo, table, limit, out, n_keys, fp8, plan[2])
        return out
    if plan is None:
        if keys_split:
            geometry = CacheGeometry(cache.shape[0], geometry.block_size, geometry.block_size * q.shape[3] * 2)
        grid, tiling, tile_args = launch_shape(n_batch, n_queries, n_heads, n_keys, config, q.device)
        plan = kept.args = (copy_table, keys_split, grid, (
            n_queries, n_keys, n_heads, *tiling,
            geometry.block_size, geometry.num_blocks, table.shape[1], geometry.block_stride // 16,
            *q.stride(), *weights.stride(), table.stride(0), *limit.stride(), *out.stride()), dict(
            # fp8: e4m3 products are exact, sums fp32 (Hopper's fp8 MMA accumulates with fewer bits).
            # float32: three bf16 tensor-core products of split operands, as lightning_indexer_scores.
            HEAD_DIM=head_dim, FP8=fp8, KEYS_SPLIT=keys_split, **tile_args))
    _, _, grid, integers, constexprs = plan
    launch(_paged_scores_kernel, grid, (q, weights, cache, cache_lo, table, limit, out, *integers), constexprs,
           kept.compiled)
    return out


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment; n_keys; config; the
# split threshold) -> its Kept (value: fp8, the cache's geometry, the launch shape, n_keys): a signature seen
# before passed the checks.
_KEPT: dict = {}


def paged_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    limit: torch.Tensor,
    *,
    n_keys: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    config: Optional[IndexerConfig] = None,
) -> torch.Tensor:
    """
    DeepSeek-V3.2 lightning indexer scores over a paged key cache, for decode steps and prefill chunks:

        out[b, t, s] = sum_h relu(q[b, t, h, :] . key(b, s)) * weights[b, t, h]    if s <= limit[b, t]
        out[b, t, s] = -inf                                                         otherwise

    key(b, s) is the key at logical position s of sequence b: page block_table[b, s // block_size],
    offset s % block_size of the cache; in fp8 mode the e4m3 key times its scale (the dot runs on the
    e4m3 values, the scale multiplies the head sum, as DeepSeek's fp8_index does).

    Args:
        q: [b, t, H, D], already roped. fp8 cache: float8_e4m3fn, D = 128, the per-(t, h) q scales
            folded into weights by the caller; exact cache: float32. Any H >= 1 with
            next_pow2(H) * D * itemsize <= 64 KiB (V3.2: H = 64, D = 128). Decode: t = 1 per sequence;
            a prefill chunk: b = 1, t query tokens.
        weights: [b, t, H] float32, every per-head factor folded in (V3.2: weights_proj(x) * H^-0.5 *
            D^-0.5, times the q scales in fp8 mode).
        cache: the layer's key cache: fp8 uint8 [num_blocks, block_size, 1, 132] (new_index_cache,
            write_index_keys), or exact float32 [num_blocks, block_size, D] (module docstring).
        block_table: [b, max_blocks_per_seq] int32 page ids. Entries < 0 (unallocated) or
            >= num_blocks are never read: their positions score -inf.
        limit: [b, t] int32 or int64, on the device: the last position row (b, t) may see (decode:
            the query's position; a chunk starting at position p0: p0 + t). Negative: the whole row
            is -inf. Keys past a row's limit are never used, those past the largest limit of a tile
            of rows never read (NaN bytes there do not matter), and tiles past it are not computed.
        n_keys: keyword-only, the static width S of the result (default: the block table's capacity
            max_blocks_per_seq * block_size). Positions past the table score -inf.
        out: keyword-only, optional preallocated float32 [b, t, S] (any strides); every element is
            overwritten.
        config: keyword-only, optional IndexerConfig launch shape of the Triton kernel (default: on sm_90, a
            prefill chunk of 64 heads of 128 over pages of 64 runs a Gluon kernel, indexer_scores_sm90;
            otherwise paged_config).

    No host synchronisation and static shapes: a decode step calling this can be captured in a CUDA
    graph. The key range is split across programs, so even b = 1 fills the GPU. All tensors must be
    on one CUDA device (or the CPU under TRITON_INTERPRET=1); element offsets are 64-bit. Exact keys
    with t >= 16 query rows (a prefill chunk): the pages of positions [0, S) are first gathered and
    split into bfloat16 parts (split_pages: b * ceil(S / block_size) pages, as many bytes as their
    float32 keys, and the float32 gather while it runs).

    Returns:
        out: [b, t, S] float32. Masked entries are exactly -inf, valid ones finite for finite
            inputs. fp8: products of e4m3 values are exact, sums fp32 when interpreted; Hopper's fp8
            tensor cores accumulate with fewer bits than fp32 (the tests allow 2^-8 of the terms'
            magnitude sum_h |w| sum_d |q k|). exact: float32 products as three bf16 products of
            operands split into high and low bf16 parts (each within 3 * 2^-16 of |q_d k_d|), fp32
            sums, as lightning_indexer_scores.

    Raises:
        minirt.errors.InputError: wrong type, dtype, shape, alignment or device; q not matching the
            cache's format or key dim.
    """
    kept = per_signature(_KEPT, lambda: (
        described(q), described(weights), described(cache), described(block_table), described(limit),
        n_keys.__class__, n_keys, described(out), config.__class__, config, lightning_indexer.PRESPLIT_MIN_QUERIES),
        lambda: Kept(_checked_launch_shape(q, weights, cache, block_table, limit, n_keys, out, config)))
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], kept.value[3], dtype=torch.float32, device=q.device)
    return _launch_paged(q, weights, cache, block_table, limit, out, kept)


def _checked_launch_shape(q, weights, cache, block_table, limit, n_keys, out, config) -> tuple:
    """paged_indexer_scores' input checks (InputError); (fp8, the cache's geometry, the launch shape (None: the
    sm_90 kernel's), n_keys)."""
    fp8, geometry, n_keys = _check_scores_inputs(q, weights, cache, block_table, limit, n_keys, out)
    check_config(config, IndexerConfig)
    key_rows = geometry.num_blocks * INDEX_KEY_BYTES * geometry.block_size // INDEX_KEY_DIM if fp8 else \
        q.shape[0] * block_table.shape[1] * geometry.block_size
    if config is None and block_table.shape[1] > 0 and indexer_scores_sm90.takes(
            q.shape[2], q.shape[3], geometry.block_size, key_rows, q.shape[1], q.device):
        return fp8, geometry, None, n_keys
    return fp8, geometry, config or paged_config(q.shape[1], q.shape[2], q.shape[3], fp8), n_keys


def paged_config(n_queries: int, n_heads: int, head_dim: int, fp8: bool) -> IndexerConfig:
    """The launch shape of paged_indexer_scores: lightning_indexer's query tiling, with the key steps
    measured fastest on an H200 for a prefill chunk (t 2048 over 131072 keys, 64 heads): fp8 keys with
    4 warps (538 TFLOP/s against 346 with 8), fp32 keys in 128-key steps of 2 stages (136 TFLOP/s as
    three bf16 products of split operands; as bf16 parts they fit sm_90a's shared memory without spills.
    The 16-bit tiling with 4 warps, (4, 64, 4, 3), measured 156 but spills at sm_90a). Decode (one query
    row) takes the shapes measured fastest on an H100 over 131072 keys at b 1 and 16
    (``bench_indexer_paged.py --decode-sweep``): fp8 keys in 128-key steps, 4 warps, 2 stages (b 16:
    2323 GB/s against 1797 for the prefill's steps); fp32 keys in 64-key steps, 4 warps, 3 stages (1964
    GB/s against 1505)."""
    config = default_config(n_queries, n_heads, head_dim, 1 if fp8 else 4)
    if n_queries == 1:
        block_s, num_stages = (128, 2) if fp8 else (64, 3)
        return dataclasses.replace(config, block_s=block_s, num_warps=4, num_stages=num_stages)
    if fp8:
        return dataclasses.replace(config, num_warps=4, num_stages=3)
    return dataclasses.replace(config, block_s=128, num_stages=2)
