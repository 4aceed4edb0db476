"""DeepSeek-V3.2 lightning indexer in Triton: exact (unquantised) scores of every key for each query,
and the stable top-k selection over them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import INTERPRET, check_config, check_device, check_tensor, check_tensors
from ._indexer_tiles import (fill_uncomputed, head_sum, key_chunk, key_logits, launch_shape, program_tile, query_tile,
                             split_query)
from ._launch import Kept, cdiv, described, launch, per_signature
from . import indexer_scores_sm90

# The q tile of one query row, [D, next_pow2(H)], stays in shared memory for the whole key loop; with
# the key-tile pipeline and the reduction scratch, 64 KiB for it is what fits an H100/H200's 227 KiB.
MAX_Q_ROW_BYTES = 64 * 1024
# Key-tile pipeline stages share this much shared memory.
KEY_PIPELINE_BYTES = 96 * 1024


@dataclass(frozen=True)
class IndexerConfig:
    """Launch shape: query rows per program (block_t; its heads make the dot's N = block_t * heads),
    keys per loop step (block_s), warps and pipeline depth."""

    block_t: int = 4
    block_s: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Sizes are only compared or used in index arithmetic: specialising on them would only multiply compiles.
@triton.jit(do_not_specialize=["n_queries", "n_keys", "n_heads", "n_t_tiles", "n_chunks", "tiles_per_chunk"])
def _indexer_scores_kernel(
    q_ptr, k_ptr, k_lo_ptr, w_ptr, limit_ptr, out_ptr,
    n_queries, n_keys, n_heads, n_t_tiles, n_chunks, tiles_per_chunk,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kd,
    stride_wb, stride_wt, stride_wh,
    stride_lb, stride_lt,
    stride_ob, stride_ot, stride_os,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_LIMIT: tl.constexpr, BF16X3: tl.constexpr, KEYS_SPLIT: tl.constexpr, INTERPRETED: tl.constexpr,
    INTERPRETED_TILES: tl.constexpr,
):
    batch, t_tile, chunk = program_tile(n_t_tiles, n_chunks)
    q_t, w, offs_t, t_mask, last_key = query_tile(
        q_ptr, w_ptr, limit_ptr, batch, t_tile, n_queries, n_heads, n_keys,
        stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh, stride_lb, stride_lt,
        HEAD_DIM, BLOCK_T, BLOCK_H, HAS_LIMIT, INTERPRETED)
    q_hi, q_lo = split_query(q_t, BF16X3, INTERPRETED)
    chunk_start, chunk_end, n_tiles, n_computed = key_chunk(chunk, tiles_per_chunk, n_keys, last_key, BLOCK_S)

    k_rows = k_ptr + batch * stride_kb
    k_lo_rows = k_lo_ptr + batch * stride_kb     # KEYS_SPLIT: k's bf16 parts, of the same strides
    out_rows = out_ptr + batch * stride_ob + offs_t.to(tl.int64) * stride_ot
    offs_d = tl.arange(0, HEAD_DIM)
    # The Triton 3.6 interpreter cannot use a runtime scalar as a loop bound (numpy >= 2.4), so
    # interpreted runs take the loop over all tiles of the chunk and let the store mask split them
    # at n_computed; compiled, the mask `i < n_computed` is always true.
    for i in range(0, INTERPRETED_TILES if INTERPRETED else n_computed):
        offs_s = chunk_start + i * BLOCK_S + tl.arange(0, BLOCK_S)
        s_mask = offs_s < chunk_end
        offsets = offs_s.to(tl.int64)[:, None] * stride_ks + offs_d[None, :] * stride_kd
        k = tl.load(k_rows + offsets, mask=s_mask[:, None], other=0.0)
        if KEYS_SPLIT:
            k_lo = tl.load(k_lo_rows + offsets, mask=s_mask[:, None], other=0.0)
        else:
            k_lo = k
        if INTERPRETED:
            k, k_lo = k.to(tl.float32), k_lo.to(tl.float32)
        scores = head_sum(key_logits(k, k_lo, q_hi, q_lo, BF16X3, KEYS_SPLIT, INTERPRETED), w, BLOCK_S, BLOCK_T, BLOCK_H)
        scores = tl.where(offs_s[:, None] <= last_key[None, :], scores, float("-inf"))
        tl.store(out_rows[None, :] + offs_s.to(tl.int64)[:, None] * stride_os, scores,
                 mask=s_mask[:, None] & t_mask[None, :] & (i < n_computed))
    fill_uncomputed(out_rows, stride_os, t_mask, chunk_start, chunk_end, n_computed, n_tiles,
                     BLOCK_S, BLOCK_T, INTERPRETED, INTERPRETED_TILES)


def default_config(n_queries: int, n_heads: int, head_dim: int, element_size: int = 2) -> IndexerConfig:
    """256 (query, head) columns per program where the resident q tile allows (the widest Hopper MMA:
    block_t 4 at 64 heads, 588 TFLOP/s on an H200 against 475 for block_t 2; 1 row in decode), 64-key
    steps, up to 3 pipeline stages within KEY_PIPELINE_BYTES, 8 warps; 4 for one float32 query row
    (DeepSeek-V4's CSA decode: 2994 GB/s against 1986 with 8 at b 16 over 262144 keys on an H100,
    ``bench_indexer.py --decode-sweep``)."""
    heads = triton.next_power_of_2(n_heads)
    columns = max(heads, min(256, MAX_Q_ROW_BYTES // (head_dim * element_size)))
    block_t = max(1, min(columns // heads, triton.next_power_of_2(n_queries)))
    block_s = 64
    num_stages = max(1, min(3, KEY_PIPELINE_BYTES // (block_s * head_dim * element_size)))
    num_warps = 4 if n_queries == 1 and element_size == 4 else 8
    return IndexerConfig(block_t=block_t, block_s=block_s, num_warps=num_warps, num_stages=num_stages)


def _takes_sm90(q, k, limit, config) -> bool:
    """Whether lightning_indexer_scores runs the paged cache's sm_90 kernel (indexer_scores_sm90): float32 q
    [T, 64, 128] of a prefill chunk and keys [S, 128], a limit, the default launch shape, on sm_90."""
    return config is None and limit is not None and q.dim() == 3 and k.dim() == 2 and q.dtype == torch.float32 \
        and k.shape[0] > 0 and indexer_scores_sm90.takes(q.shape[1], q.shape[2], indexer_scores_sm90.BLOCK_S,
                                                         k.shape[0], q.shape[0], q.device)


def _check_inputs(q, k, weights, limit, out, config) -> None:
    tensors = {"q": q, "k": k, "weights": weights}
    check_tensors(tensors)
    if q.dim() not in (3, 4):
        raise InputError(f"q must be [T, H, D] or [B, T, H, D], got shape {tuple(q.shape)}")
    batched = q.dim() == 4
    prefix = "B, " if batched else ""
    *lead, n_heads, head_dim = q.shape
    if k.dim() != q.dim() - 1:
        raise InputError(f"k must be [{prefix}S, D] to match q of shape {tuple(q.shape)}, got shape {tuple(k.shape)}")
    if k.shape[-1] != head_dim or (batched and k.shape[0] != q.shape[0]):
        raise InputError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: need [{prefix}S, D={head_dim}]")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if k.dtype != q.dtype:
        raise InputError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise InputError(f"head dim D must be a power of two in [16, 256], got {head_dim}")
    if n_heads < 1 or triton.next_power_of_2(n_heads) * head_dim * q.element_size() > MAX_Q_ROW_BYTES:
        raise InputError(f"unsupported H = {n_heads}, D = {head_dim} for {q.dtype}: need H >= 1 and "
                         f"next_pow2(H) * D * itemsize <= {MAX_Q_ROW_BYTES} (the q tile of a row stays in "
                         "shared memory); V3.2 has H = 64, D = 128")
    if k.shape[-2] >= 2**31 - 2**16:
        raise InputError(f"S = {k.shape[-2]} keys: must be below 2^31 - 2^16 (32-bit key indices)")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (*lead, n_heads):
        raise InputError(f"weights must be a float32 tensor of shape {[*lead, n_heads]}, got "
                         f"{weights.dtype} {list(weights.shape)}")
    check_tensor(tensors, "limit", limit, (torch.int32, torch.int64), lead, optional=True)
    check_tensor(tensors, "preallocated out", out, torch.float32, (*lead, k.shape[-2]), optional=True)
    check_config(config, IndexerConfig)
    check_device(tensors)


# float32 keys: a launch of at least this many query rows (prefill) splits them into bf16 parts once
# (split_bf16_parts) rather than in every program that reads a key tile, n_queries / block_t times;
# fewer (decode: each key read once) split each tile as it is loaded.
PRESPLIT_MIN_QUERIES = 16


def split_bf16_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x -> bfloat16 (hi, lo), contiguous: hi the nearest bfloat16 to x, lo that of x - hi
    (exact in float32), as the kernels split their operands (_indexer_tiles.split_bf16)."""
    hi = x.to(torch.bfloat16, memory_format=torch.contiguous_format)
    return hi, (x - hi.float()).to(torch.bfloat16, memory_format=torch.contiguous_format)


def _launch_args(q, k, weights, limit, out, config: IndexerConfig) -> tuple:
    """The launch lightning_indexer_scores derives from a checked call signature with launch shape config:
    (grid, whether the keys are split first, the kernel's integers after its tensors, its constexprs)."""
    batched = q.dim() == 4
    # The kernel always sees a batch dimension; an unbatched call is a batch of one (batch strides 0).
    n_batch, (n_queries, n_heads, head_dim) = (q.shape[0] if batched else 1), q.shape[-3:]
    n_keys = k.shape[-2]
    grid, tiling, tile_args = launch_shape(n_batch, n_queries, n_heads, n_keys, config, q.device)
    keys_split = q.dtype == torch.float32 and n_queries >= PRESPLIT_MIN_QUERIES

    def strides(t, rank):   # t's strides with a leading batch stride (0 unbatched)
        return t.stride() if batched else (0, *t.stride()[:rank - 1])

    # Split keys are contiguous copies of k; an absent limit is passed as weights, unread (HAS_LIMIT).
    k_strides = (n_keys * head_dim if batched else 0, head_dim, 1) if keys_split else strides(k, 3)
    integers = (n_queries, n_keys, n_heads, *tiling, *strides(q, 4), *k_strides, *strides(weights, 3),
                *(strides(limit, 2) if limit is not None else (0, 0)), *strides(out, 3))
    return grid, keys_split, integers, dict(
        HEAD_DIM=head_dim, HAS_LIMIT=limit is not None,
        # 16-bit inputs: exact products, fp32 sums. float32 inputs: three bf16 tensor-core products of
        # split operands (_indexer_tiles) instead of the fp32 FMA path, which ran at 0.9 TFLOP/s and
        # made up 65% of a v32 runtime prefill (docs/perf/indexer.md).
        BF16X3=q.dtype == torch.float32, KEYS_SPLIT=keys_split, **tile_args)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment; config; the split
# threshold, which benchmarks and tests change) -> its Kept (value: the launch shape; args: _launch_args' result):
# a signature seen before passed the checks.
_KEPT: dict = {}


def lightning_indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    limit: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[IndexerConfig] = None,
) -> torch.Tensor:
    """
    DeepSeek-V3.2 lightning indexer scores, exact mode (no Hadamard rotation, no fp8):

        out[t, s] = sum_h relu(q[t, h, :] . k[s, :]) * weights[t, h]    if s <= limit[t]
        out[t, s] = -inf                                                 otherwise

    Args:
        q: [T, H, D] or batched [B, T, H, D]; bfloat16, float16 or float32; already roped. D a
            power of two in [16, 256], any H >= 1 with next_pow2(H) * D * itemsize <= 64 KiB
            (V3.2: H = 64, D = 128; 16-bit inputs allow up to 256 heads at D = 128).
        k: [S, D] or batched [B, S, D] (one key set per batch entry), same dtype as q; already
            normalised and roped. Any S < 2^31 - 2^16, not only multiples of the tile.
        weights: [T, H] or [B, T, H], float32: the per-head weights with every scale folded in
            (weights_proj(x) * H^-0.5 * D^-0.5 for V3.2). Scores are in the units of weights * q.k.
        limit: optional, [T] or [B, T], int32 or int64: the last key index row t may see (causal
            prefill of a prompt over its own keys: limit[t] = t; decode over a cache: the query's
            position). Negative: the whole row is -inf; >= S - 1: every key is valid. None: every
            key is valid. Key tiles beyond a query tile's largest limit are not computed.
        out: keyword-only, optional preallocated float32 [T, S] / [B, T, S] (any strides); every
            element is overwritten.
        config: keyword-only, optional IndexerConfig: the launch shape (the benchmark's variants).
            Default: default_config(T, H, D, itemsize); on sm_90 a prefill chunk of float32 q [T, 64, 128]
            (T >= PRESPLIT_MIN_QUERIES) over keys [S, 128] with a limit runs the paged cache's Gluon kernel
            (indexer_scores_sm90), k's split rows standing for one sequence's pages.

    All tensors must be on one CUDA device (or on the CPU under TRITON_INTERPRET=1); any strides
    are honoured, nothing is copied but float32 keys for T >= PRESPLIT_MIN_QUERIES (16), split once
    into two contiguous bfloat16 [.., S, D] parts (as many bytes as k); element offsets are 64-bit
    (T * S may exceed 2^31).

    Returns:
        out: [T, S] or [B, T, S], float32. Products of 16-bit inputs are exact and all sums are
            fp32, so the result differs from an exact evaluation only by fp32 rounding of the sums.
            float32 inputs are split into high and low bfloat16 parts and multiplied as three bf16
            products (lo*hi + hi*lo + hi*hi, fp32 sums): each product within 3 * 2^-16 of |q_d k_d|,
            at random signs (about 1e-7 of the terms' magnitude overall at 64 heads).
            Masked entries are exactly -inf, valid ones finite for finite inputs.

    Raises:
        minirt.errors.InputError: wrong type, dtype, shape or device; H or D outside the envelope above;
            config not an IndexerConfig.
    """
    kept = per_signature(_KEPT, lambda: (
        described(q), described(k), described(weights), described(limit), described(out), config.__class__, config,
        PRESPLIT_MIN_QUERIES),
        lambda: _check_inputs(q, k, weights, limit, out, config)
        or Kept(None if _takes_sm90(q, k, limit, config) else config or default_config(*q.shape[-3:], q.element_size())))
    if out is None:
        out = torch.empty(*q.shape[:-2], k.shape[-2], dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if kept.value is None:
        # A prefill chunk on sm_90: the paged cache's Gluon kernel, k's split rows standing for one sequence's
        # pages of 64 (its block table: 0, 1, 2, ...).
        n_queries, n_keys = q.shape[0], k.shape[0]
        if kept.args is None:
            kept.args = (torch.arange(cdiv(n_keys, indexer_scores_sm90.BLOCK_S), dtype=torch.int32, device=q.device)[None],
                         indexer_scores_sm90.tiling(1, n_queries, n_keys, q.device))
        table, tiling = kept.args
        k_hi, k_lo = split_bf16_parts(k)
        indexer_scores_sm90.paged_scores(q[None], weights[None], k_hi, k_lo, table, limit[None], out[None], n_keys,
                                         False, tiling)
        return out
    if kept.args is None:
        kept.args = _launch_args(q, k, weights, limit, out, kept.value)
    grid, keys_split, integers, constexprs = kept.args
    k_hi, k_lo = split_bf16_parts(k) if keys_split else (k, k)
    launch(_indexer_scores_kernel, grid, (q, k_hi, k_lo, weights, weights if limit is None else limit, out, *integers),
           constexprs, kept.compiled)
    return out


# Order-preserving int32 image of the fp32 score -inf (see _order_keys).
_NEG_INF_ORDERED = -2139095041


def _order_keys(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (value descending, key index ascending), unique for
    distinct indices: the order-preserving int32 image of the fp32 value in the high half, the bitwise
    complement of the (int32 or int64, < 2^31) index in the low half."""
    # The two int32 halves of each key, written in place (little-endian: the low half first).
    halves = torch.empty(*values.shape, 2, dtype=torch.int32, device=values.device)
    # + 0.0 turns -0.0 into +0.0: a stable sort ties them, their bit images would not.
    bits = (values + 0.0).view(torch.int32)
    # Negative floats order backwards as ints: flip their magnitude bits.
    torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits, out=halves[..., 1])
    if indices.dtype == torch.int64:   # (its low halves: the indices as int32, without a conversion op)
        indices = indices.view(torch.int32)[..., 0::2]
    torch.bitwise_not(indices, out=halves[..., 0])
    return halves.view(torch.int64).view(values.shape)


def _key_indices(keys: torch.Tensor) -> torch.Tensor:
    """The index half of _order_keys keys (unit last stride), as int32."""
    return torch.bitwise_not(keys.view(torch.int32)[..., 0::2])


def _key_values(keys: torch.Tensor) -> torch.Tensor:
    """The value half of _order_keys keys (unit last stride): a view, int32."""
    return keys.view(torch.int32)[..., 1::2]


# Selection entries per step of the tie kernel.
_TIE_CHUNK = 4096
# Scores per step of a tied row's scan.
_TIE_ROW_BLOCK = 1024
# Rows per program of the tie kernel when interpreted (compiled: one): the interpreter's cost is per
# operation, not per element.
_TIE_INTERPRETED_ROWS = 256


@triton.jit(do_not_specialize=["n_rows", "n_keys", "stride_scores", "stride_values", "stride_indices"])
def _boundary_ties_kernel(scores_ptr, values_ptr, indices_ptr, n_rows, n_keys, stride_scores, stride_values,
                          stride_indices, N_SELECTED: tl.constexpr, CHUNK: tl.constexpr,
                          ROW_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRETED: tl.constexpr,
                          INTERPRETED_KEYS: tl.constexpr):
    # BLOCK_R rows of the torch.topk selection (N_SELECTED = topk + 1 entries per row, unordered).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    values = values_ptr + rows.to(tl.int64)[:, None] * stride_values
    indices = indices_ptr + rows.to(tl.int64)[:, None] * stride_indices
    offs = tl.arange(0, CHUNK)[None, :]

    # The boundary (the smallest selected value) and how many selected entries hold it, in one pass.
    boundary = tl.full([BLOCK_R], float("inf"), tl.float32)
    n_tied = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, N_SELECTED, CHUNK):
        in_selection = row_ok[:, None] & (start + offs < N_SELECTED)
        v = tl.load(values + start + offs, mask=in_selection, other=float("inf"))
        chunk_min = tl.min(v, 1)
        chunk_count = tl.sum(((v == chunk_min[:, None]) & in_selection).to(tl.int32), 1)
        n_tied = tl.where(chunk_min < boundary, chunk_count,
                          n_tied + tl.where(chunk_min == boundary, chunk_count, 0))
        boundary = tl.minimum(boundary, chunk_min)
    # The topk-th and (topk + 1)-th values tie: torch.topk kept an arbitrary n_tied of the keys
    # scoring `boundary`. -inf ties need no fix (every selected -inf becomes -1).
    tie = row_ok & (n_tied >= 2) & (boundary > float("-inf"))
    # The interpreter cannot branch on a tensor: there, every row runs on and the stores are masked.
    if not INTERPRETED:
        if tl.max(tie.to(tl.int32), 0) == 0:
            return

    # Rewrite tied rows in place: the entries above the boundary first (each chunk is loaded before
    # any of its positions is overwritten: the barrier), ...
    n_above = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, N_SELECTED, CHUNK):
        in_selection = tie[:, None] & (start + offs < N_SELECTED)
        v = tl.load(values + start + offs, mask=in_selection, other=0.0)
        i = tl.load(indices + start + offs, mask=in_selection, other=0)
        above = in_selection & (v != boundary[:, None])
        position = n_above[:, None] + tl.cumsum(above.to(tl.int32), 1) - 1
        tl.debug_barrier()
        tl.store(values + position, v, mask=above)
        tl.store(indices + position, i, mask=above)
        n_above += tl.sum(above.to(tl.int32), 1)
    # ... then the n_tied lowest key indices scoring `boundary`, found by scanning the row in order.
    row_scores = scores_ptr + rows.to(tl.int64)[:, None] * stride_scores
    offs_row = tl.arange(0, ROW_BLOCK)[None, :]
    n_seen = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, INTERPRETED_KEYS if INTERPRETED else n_keys, ROW_BLOCK):
        cols = start + offs_row
        in_row = tie[:, None] & (cols < n_keys)
        x = tl.load(row_scores + cols, mask=in_row, other=0.0)
        tied = in_row & (x == boundary[:, None])
        position = n_seen[:, None] + tl.cumsum(tied.to(tl.int32), 1) - 1
        take = tied & (position < n_tied[:, None])
        tl.store(values + n_above[:, None] + position, x, mask=take)
        tl.store(indices + n_above[:, None] + position, cols.to(tl.int64), mask=take)
        n_seen += tl.sum(tied.to(tl.int32), 1)


def _resolve_boundary_ties(scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, kept: Kept) -> None:
    """Make a torch.topk selection of topk + 1 entries per row exact under the tie rule, in place, on
    the device: rows whose two smallest selected values are equal (and finite) get the lowest key
    indices of that value. One launch, no host synchronisation; untied rows return at once. kept: the
    Kept of scores' signature and the selection's width (args: whether the rows are copied, the launch)."""
    if kept.args is None:
        n_keys, n_selected = scores.shape[-1], values.shape[-1]
        rows = scores.reshape(-1, n_keys)
        copy = rows.stride(1) != 1 or rows.data_ptr() != scores.data_ptr()   # (not a view of scores as rows)
        n_rows = rows.shape[0]
        block_r = min(triton.next_power_of_2(n_rows), _TIE_INTERPRETED_ROWS) if INTERPRET else 1
        # (The selection, torch.topk's contiguous output, is [n_rows, n_selected] rows.)
        kept.args = (copy, (cdiv(n_rows, block_r),), (
            n_rows, n_keys, n_keys if copy else rows.stride(0), n_selected, n_selected), dict(
            N_SELECTED=n_selected, CHUNK=min(triton.next_power_of_2(n_selected), _TIE_CHUNK),
            ROW_BLOCK=_TIE_ROW_BLOCK, BLOCK_R=block_r, INTERPRETED=INTERPRET,
            INTERPRETED_KEYS=n_keys if INTERPRET else 0, num_warps=8))
    copy, grid, integers, constexprs = kept.args
    rows = scores.reshape(-1, scores.shape[-1]).contiguous() if copy else scores
    launch(_boundary_ties_kernel, grid, (rows, values, indices, *integers), constexprs, kept.compiled)


# Candidate pre-selection (indexer_topk of many wide rows: prefill chunks). The maximum of each group of
# _GROUP consecutive scores is a score of its own group, so at least topk scores are >= the topk-th
# largest group maximum, tau: every score of the top-k is >= tau, and on random scores only about 1.2 *
# topk are (groups of 16). Those, in key order, are the candidates (at most _CANDIDATES_PER_SELECTED *
# topk a row); a row with more (ties at tau, or clustered top scores) takes the exact k largest by
# radix selection instead. The selection then runs over the candidates as over a row.
_GROUP = 16
_CANDIDATES_PER_SELECTED = 4
# Rows of at least this many groups per selected key take the pre-selection (fewer: tau is too low to
# leave few candidates), when there are at least _PRESELECT_MIN_ROWS of them (one program a row then
# fills the GPU; a decode batch has fewer rows and selects on torch.topk directly).
_PRESELECT_MIN_GROUPS_PER_SELECTED = 2
_PRESELECT_MIN_ROWS = 256
# At most _RADIX_MAX_ROWS rows, each at least _RADIX_MIN_KEYS wide (a short prefill chunk at a long context:
# torch.topk takes one block a row), and topk <= decode_topk.MAX_TOPK: compiled, decode_topk's radix select (the
# same result, each row spread over many programs). Eager calls, top-k 2048, µs of the torch.topk path against
# the radix select at 4,096 and 163,840 keys: H100, 1 row 128 / 32 and 201 / 33, 16 rows 131 / 59 and 204 / 99,
# 64 rows 131 / 143 and 328 / 310, 128 rows 121 / 257 and 529 / 588; an H200 alike (64 rows 199-340 / 141-304).
# (Interpreted, its programs cost seconds: torch.topk there.)
_RADIX_MAX_ROWS = 32
_RADIX_MIN_KEYS = 4096
# The radix selection: digits of _RADIX_BITS of the order-preserving uint32 image of the score, most
# significant first; scores per step of a pass over the row (the candidate pass's too).
_RADIX_BITS = 8
_RADIX_BLOCK = 4096
# Scores per step of the tau kernel's pass over the row, and maxima per step of its selection, and its warps.
# On an H100, 2048 rows of 131072 scores: 0.76 ms at (2048, 8), the launch the tests and the long prefill ran;
# 0.69 at (4096, 4) (0.06 ms a chunk, ~0.1% of a long prefill), 0.90 at (2048, 16); (4096, 8) spilled at sm_90a.
_TAU_BLOCK, _TAU_WARPS = 2048, 8


@triton.jit
def _ordered_bits(x):
    """The uint32 image of float32 x whose unsigned order is the float order (-0.0 as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _from_ordered_bits(u):
    """The float32 whose _ordered_bits are u (uint32)."""
    return (u ^ tl.where((u >> 31) == 1, 0x80000000, 0xFFFFFFFF).to(tl.uint32)).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_bits(row, n, K, BITS: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
                      INTERPRETED_N: tl.constexpr):
    """(_ordered_bits of the K-th largest of the n float32 values at row, how many values equal to it the K
    largest take): 32 / BITS passes over the values, each fixing one digit of its bits (histograms of the
    values sharing the digits so far), most significant first. n >= K."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    boundary = tl.zeros([], tl.uint32)     # the K-th largest value's bits, digit by digit
    k_left = tl.full([], K, tl.int32)      # how many of the values sharing the digits so far it takes
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        counts = tl.zeros([1 << BITS], tl.int32)
        for start in range(0, INTERPRETED_N if INTERPRETED else n, BLOCK):
            in_row = start + offs < n
            u = _ordered_bits(tl.load(row + start + offs, mask=in_row, other=0.0))
            if p == 0:
                match = in_row
            else:
                match = in_row & ((u >> (shift + BITS)) == (boundary >> (shift + BITS)))
            counts += tl.histogram(((u >> shift) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS, mask=match)
        # at_least[d]: values of digit >= d; the K-th largest has the largest digit with at_least >= k_left.
        at_least = tl.sum(counts) - tl.cumsum(counts, 0) + counts
        digit = tl.sum((at_least >= k_left).to(tl.int32)) - 1
        k_left -= tl.sum(tl.where(bins > digit, counts, 0))
        boundary = boundary | (digit.to(tl.uint32) << shift)
    return boundary, k_left


@triton.jit
def _radix_top(row_scores, values, indices, n_keys, K: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
               INTERPRETED: tl.constexpr, INTERPRETED_KEYS: tl.constexpr, WRITE):
    """Write the row's K largest scores (value descending, then lower index) as a set into values[0, K),
    their key indices into indices: the K-th largest score's bits (_kth_largest_bits), then one pass that
    writes every entry above it and the lowest-indexed entries at it. Stores masked by WRITE (a scalar)."""
    offs = tl.arange(0, BLOCK)
    boundary, k_left = _kth_largest_bits(row_scores, n_keys, K, BITS, BLOCK, INTERPRETED, INTERPRETED_KEYS)
    n_above = K - k_left
    seen_above = tl.zeros([], tl.int32)
    seen_at = tl.zeros([], tl.int32)
    for start in range(0, INTERPRETED_KEYS if INTERPRETED else n_keys, BLOCK):
        cols = start + offs
        in_row = cols < n_keys
        x = tl.load(row_scores + cols, mask=in_row, other=0.0)
        u = _ordered_bits(x)
        above = in_row & (u > boundary)
        at = in_row & (u == boundary)
        position_at = seen_at + tl.cumsum(at.to(tl.int32), 0) - 1
        position = tl.where(above, seen_above + tl.cumsum(above.to(tl.int32), 0) - 1, n_above + position_at)
        take = WRITE & (above | (at & (position_at < k_left)))
        tl.store(values + position, x, mask=take)
        tl.store(indices + position, cols, mask=take)
        seen_above += tl.sum(above.to(tl.int32))
        seen_at += tl.sum(at.to(tl.int32))


@triton.jit(do_not_specialize=["n_keys", "n_groups", "stride_scores"])
def _tau_kernel(scores_ptr, maxima_ptr, tau_ptr, n_keys, n_groups, stride_scores, K: tl.constexpr,
                GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
                INTERPRETED_KEYS: tl.constexpr, INTERPRETED_GROUPS: tl.constexpr):
    # One row: the maximum of each group of GROUP consecutive scores (the last group: those left) into the
    # row's maxima, then tau, the K-th largest of them.
    row = tl.program_id(0).to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    row_maxima = maxima_ptr + row * n_groups
    groups = tl.arange(0, BLOCK // GROUP)
    for start in range(0, INTERPRETED_KEYS if INTERPRETED else n_keys, BLOCK):
        g = start // GROUP + groups
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(row_scores + cols, mask=cols < n_keys, other=float("-inf"))
        tl.store(row_maxima + g, tl.max(x, axis=1), mask=g < n_groups)
    # (The maxima, written by all of the program's threads, are read by all of them.)
    tl.debug_barrier()
    boundary, _ = _kth_largest_bits(row_maxima, n_groups, K, BITS, BLOCK, INTERPRETED, INTERPRETED_GROUPS)
    tl.store(tau_ptr + row, _from_ordered_bits(boundary))


@triton.jit(do_not_specialize=["n_keys", "stride_scores", "stride_candidates"])
def _candidates_kernel(scores_ptr, tau_ptr, values_ptr, indices_ptr, counts_ptr, n_keys, stride_scores,
                       stride_candidates, CAPACITY: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
                       INTERPRETED_KEYS: tl.constexpr):
    # One row: the scores >= tau in key order into [0, CAPACITY), the rest -inf (key index n_keys), and
    # how many there were (more than CAPACITY: _overflow_kernel rewrites the row).
    row = tl.program_id(0).to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    values = values_ptr + row * stride_candidates
    indices = indices_ptr + row * stride_candidates
    tau = tl.load(tau_ptr + row)
    offs = tl.arange(0, BLOCK)
    n_taken = tl.zeros([], tl.int32)
    # Each step's scores load during the step before (the loop's running count serialises the steps).
    x_next = tl.load(row_scores + offs, mask=offs < n_keys, other=0.0)
    for start in range(0, INTERPRETED_KEYS if INTERPRETED else n_keys, BLOCK):
        cols = start + offs
        x = x_next
        x_next = tl.load(row_scores + BLOCK + cols, mask=BLOCK + cols < n_keys, other=0.0)
        take = (cols < n_keys) & (x >= tau)
        position = n_taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(values + position, x, mask=take & (position < CAPACITY))
        tl.store(indices + position, cols, mask=take & (position < CAPACITY))
        n_taken += tl.sum(take.to(tl.int32))
    tl.store(counts_ptr + row, n_taken)
    _pad_candidates(values, indices, n_taken, n_keys, CAPACITY, BLOCK, True)


@triton.jit
def _pad_candidates(values, indices, n_written, n_keys, CAPACITY: tl.constexpr, BLOCK: tl.constexpr, WRITE):
    """-inf entries of key index n_keys into a row's candidate slots [n_written, CAPACITY), if WRITE."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, CAPACITY, BLOCK):
        slots = start + offs
        pad = WRITE & (slots >= n_written) & (slots < CAPACITY)
        tl.store(values + slots, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
        tl.store(indices + slots, tl.full([BLOCK], 0, tl.int32) + n_keys, mask=pad)


@triton.jit(do_not_specialize=["n_keys", "stride_scores", "stride_candidates"])
def _overflow_kernel(scores_ptr, values_ptr, indices_ptr, counts_ptr, n_keys, stride_scores, stride_candidates,
                     K: tl.constexpr, CAPACITY: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                     INTERPRETED: tl.constexpr, INTERPRETED_KEYS: tl.constexpr):
    # One row: if it had more than CAPACITY candidates, its K largest scores instead (_radix_top), the
    # rest -inf. Other rows return at once (interpreted: run on, their stores masked; the interpreter
    # cannot branch on a tensor).
    row = tl.program_id(0).to(tl.int64)
    overflow = tl.load(counts_ptr + row) > CAPACITY
    if not INTERPRETED:
        if not overflow:
            return
    values = values_ptr + row * stride_candidates
    indices = indices_ptr + row * stride_candidates
    _radix_top(scores_ptr + row * stride_scores, values, indices, n_keys, K, BITS, BLOCK, INTERPRETED,
               INTERPRETED_KEYS, overflow)
    _pad_candidates(values, indices, K, n_keys, CAPACITY, BLOCK, overflow)


def _tau(rows: torch.Tensor, k: int) -> torch.Tensor:
    """tau [R] float32 of float32 [R, S] rows (unit stride, S >= _GROUP * k): the k-th largest maximum of groups
    of _GROUP consecutive scores (the last group: those left). One launch of a program a row, which reads
    the row once and its maxima (a [R, S / _GROUP] scratch) 32 / _RADIX_BITS times."""
    n_rows, n_keys = rows.shape
    n_groups = cdiv(n_keys, _GROUP)
    maxima = torch.empty(n_rows, n_groups, dtype=torch.float32, device=rows.device)
    tau = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    _tau_kernel[(n_rows,)](
        rows, maxima, tau, n_keys, n_groups, rows.stride(0), K=k, GROUP=_GROUP, BITS=_RADIX_BITS, BLOCK=_TAU_BLOCK,
        INTERPRETED=INTERPRET, INTERPRETED_KEYS=n_keys if INTERPRET else 0,
        INTERPRETED_GROUPS=n_groups if INTERPRET else 0, num_warps=_TAU_WARPS)
    return tau


def _preselect(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of float32 [R, S] rows (unit stride, S >= _GROUP * k) for their stable top-k (module
    comment above _GROUP): (values [R, C] float32, key indices [R, C] int32), C = _CANDIDATES_PER_SELECTED
    * k: the scores >= tau in key order, or the k largest where more than C are, then -inf entries of
    index S. Three launches of a program a row: tau (the group maxima, then their k-th largest), the
    candidates, and the radix selection of the rows that had more (others return at once)."""
    n_rows, n_keys = rows.shape
    capacity = _CANDIDATES_PER_SELECTED * k
    values = torch.empty(n_rows, capacity, dtype=torch.float32, device=rows.device)
    indices = torch.empty(n_rows, capacity, dtype=torch.int32, device=rows.device)
    counts = torch.empty(n_rows, dtype=torch.int32, device=rows.device)
    tau = _tau(rows, k)
    interpreted = dict(INTERPRETED=INTERPRET, INTERPRETED_KEYS=n_keys if INTERPRET else 0)
    _candidates_kernel[(n_rows,)](
        rows, tau, values, indices, counts, n_keys, rows.stride(0), values.stride(0),
        CAPACITY=capacity, BLOCK=_RADIX_BLOCK, **interpreted, num_warps=8)
    # A kernel of its own: the radix selection's registers would halve the candidate pass's occupancy.
    _overflow_kernel[(n_rows,)](
        rows, values, indices, counts, n_keys, rows.stride(0), values.stride(0),
        K=k, CAPACITY=capacity, BITS=_RADIX_BITS, BLOCK=_RADIX_BLOCK, **interpreted, num_warps=8)
    return values, indices


def check_topk_inputs(scores, topk) -> None:
    """The top-k selections' input checks: scores a float32 tensor [..., S] on a device the kernels run
    on, topk a positive int (InputError otherwise)."""
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() < 1:
        raise InputError("scores must be a float32 tensor [..., S]")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise InputError(f"topk must be a positive int, got {topk!r}")
    check_device({"scores": scores})


def indexer_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """
    Per row, the key indices of the topk largest scores, best first, equal scores in ascending key
    order: the first topk of a stable descending sort. Selected -inf entries (masked keys) become -1,
    and rows are padded with -1 when S < topk.

    Args:
        scores: [..., S] float32 (lightning_indexer_scores / paged scores output), on a CUDA device
            (or the CPU under TRITON_INTERPRET=1). NaN is unsupported.
        topk: int >= 1 (V3.2: 2048); may exceed S.

    Returns:
        [..., topk] int32 key indices in [0, S) or -1.

    No full sort of the rows and no host synchronisation (CUDA-graph capturable; prefill and decode
    select through this one function). A float32 torch.topk selects topk + 1 (ties broken
    arbitrarily); that only changes the selected set when the topk-th and (topk + 1)-th values are
    equal and finite, and in those rows a Triton kernel replaces the selected entries of that value
    by the lowest key indices holding it (a scan of the row; other rows cost one read of their
    selection). The selection, less its smallest element, is then sorted by unique int64 keys
    (value, then lower index: _order_keys).

    Compiled, at most 32 rows of at least 4,096 scores (a short prefill chunk at a long context) with
    topk <= 4096 take decode_topk's radix select instead (the same result, each row spread over many
    programs where torch.topk takes one block a row).

    Many wide rows (a prefill chunk: >= 256 rows of >= 32 * topk scores) select over candidates
    instead of the whole row (_preselect): the scores >= tau, the topk-th largest maximum of groups of
    16 consecutive scores (so every top-k score is one), in key order, about 1.2 * topk a row on random
    scores; a row of more than 4 * topk of them (ties at tau, clustered top scores) holds its exact
    top-k instead, found by an 8-bit radix selection over the row. The candidates' arrays take
    [rows, 4 * topk] float32 and int32, the group maxima [rows, S / 16].

    Raises:
        minirt.errors.InputError: scores not float32 [..., S], topk not a positive int, or a device
            the kernel cannot run on.
    """
    kept = per_signature(_TOPK_KEPT, lambda: (described(scores), topk.__class__, topk),
                         lambda: check_topk_inputs(scores, topk) or Kept())
    n_keys = scores.shape[-1]
    k = min(topk, n_keys)
    if k == 0 or scores.numel() == 0:
        return torch.full((*scores.shape[:-1], topk), -1, dtype=torch.int32, device=scores.device)
    n_rows = scores.numel() // n_keys
    if not INTERPRET and n_rows <= _RADIX_MAX_ROWS and n_keys >= _RADIX_MIN_KEYS:
        from .decode_topk import MAX_TOPK, decode_topk   # (decode_topk imports this module)
        if topk <= MAX_TOPK:
            return decode_topk(scores, topk)
    candidates = None
    if n_rows >= _PRESELECT_MIN_ROWS and n_keys >= _PRESELECT_MIN_GROUPS_PER_SELECTED * _GROUP * k:
        rows = scores.reshape(n_rows, n_keys)
        candidates, candidate_keys = _preselect(rows if rows.stride(1) == 1 else rows.contiguous(), k)
        # The candidates in key order stand for the row: ties resolve to the lowest candidate slot.
        scores = candidates.view(*scores.shape[:-1], -1)
        # (The tie launch over them: the pre-selection's constants decide their width, not the signature.)
        kept = per_signature(_CANDIDATES_KEPT, lambda: (described(scores), topk), Kept)
    n_selected = min(topk + 1, scores.shape[-1])
    values, indices = torch.topk(scores, n_selected, dim=-1, sorted=False)
    if n_selected > k:
        _resolve_boundary_ties(scores, values, indices, kept)
    if candidates is not None:
        indices = candidate_keys.view(*scores.shape[:-1], -1).gather(-1, indices)
    keys = _order_keys(values, indices)
    if n_selected > k:
        # Drop the (k+1)-th (the unique smallest key) by moving the last key into its slot: sorting
        # exactly k = 2048 keys stays on torch's in-shared-memory sort, 2049 would not.
        keys = keys.scatter_(-1, keys.argmin(-1, keepdim=True), keys[..., -1:].clone())[..., :k]
    keys = torch.sort(keys, dim=-1, descending=True).values
    selected = _key_indices(keys).masked_fill_(_key_values(keys) == _NEG_INF_ORDERED, -1)
    if k == topk:
        return selected
    result = torch.full((*scores.shape[:-1], topk), -1, dtype=torch.int32, device=scores.device)
    result[..., :k] = selected
    return result


# Call signature (scores' class, dtype, shape, strides, device and alignment; topk) -> its Kept (the tie
# launch's, _resolve_boundary_ties): a signature seen before passed the checks.
_TOPK_KEPT: dict = {}
# The candidates' signature and topk -> the Kept of the tie launch over them.
_CANDIDATES_KEPT: dict = {}
