"""The lightning indexer's scores tiling: the Triton helpers a scores kernel is assembled from, and its
launch shape (launch_shape).

One program scores BLOCK_T query rows of one sequence (all heads of a row: column j of the dot is
(row j // BLOCK_H, head j % BLOCK_H), so one [BLOCK_S, D] x [D, BLOCK_T * BLOCK_H] product per key
tile) against one chunk of key tiles of BLOCK_S positions; tiles past the largest limit of the rows
are not computed, only filled with -inf. What a kernel adds is how it loads a key tile
(lightning_indexer.py: from one dense [S, D] key tensor per batch entry; indexer_cache.py: through a
block table, from an fp8 or fp32 paged cache).
"""
import torch
import triton
import triton.language as tl

from ._common import INTERPRET, bf16_nearest, num_sms


def num_programs_target(device: torch.device) -> int:
    """Programs a launch should have to fill the GPU (decode has few query tiles: split the keys)."""
    return 4 * num_sms(device, 1)


def launch_shape(n_batch: int, n_queries: int, n_heads: int, n_keys: int, config, device: torch.device):
    """The launch of a scores kernel over [n_batch, n_queries] rows of n_heads heads and n_keys keys with
    config's (an IndexerConfig's) block_t, block_s, num_warps and num_stages: (grid, (n_t_tiles, n_chunks,
    tiles_per_chunk) the kernel's runtime sizes, the keyword arguments of the tiling's constexprs and
    launch options). Few query tiles (decode) split the key range into chunks, so even b = 1 fills the GPU."""
    n_t_tiles = triton.cdiv(n_queries, config.block_t)
    n_s_tiles = triton.cdiv(n_keys, config.block_s)
    n_chunks = min(n_s_tiles, triton.cdiv(num_programs_target(device), n_batch * n_t_tiles))
    tiles_per_chunk = triton.cdiv(n_s_tiles, n_chunks)
    n_chunks = triton.cdiv(n_s_tiles, tiles_per_chunk)
    # tl.dot needs N >= 16: pad the heads when block_t * heads would be smaller.
    block_h = max(triton.next_power_of_2(n_heads), triton.cdiv(16, config.block_t))
    return (n_batch * n_t_tiles * n_chunks,), (n_t_tiles, n_chunks, tiles_per_chunk), dict(
        BLOCK_T=config.block_t, BLOCK_H=block_h, BLOCK_S=config.block_s,
        INTERPRETED=INTERPRET, INTERPRETED_TILES=tiles_per_chunk if INTERPRET else 0,
        num_warps=config.num_warps, num_stages=config.num_stages)


@triton.jit
def program_tile(n_t_tiles, n_chunks):
    """(batch, query tile, key chunk) of this program. The chunks of a query tile are adjacent
    programs; query tiles run last-first (under a causal limit the last rows have the most keys)."""
    pid = tl.program_id(0)
    rest = pid // n_chunks
    return (rest // n_t_tiles).to(tl.int64), n_t_tiles - 1 - rest % n_t_tiles, pid % n_chunks


@triton.jit
def query_tile(q_ptr, w_ptr, limit_ptr, batch, t_tile, n_queries, n_heads, n_keys,
                stride_qb, stride_qt, stride_qh, stride_qd, stride_wb, stride_wt, stride_wh,
                stride_lb, stride_lt, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_H: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The q tile [HEAD_DIM, BLOCK_T * BLOCK_H] (kept for the whole key loop), the weights of its
    columns, the query rows, their mask and last_key[t]: the last key row t may see, clamped to
    [-1, n_keys - 1] (limit may be int64; no limit: every key)."""
    offs_j = tl.arange(0, BLOCK_T * BLOCK_H)
    row_j = t_tile * BLOCK_T + offs_j // BLOCK_H
    head_j = offs_j % BLOCK_H
    mask_j = (row_j < n_queries) & (head_j < n_heads)
    offs_d = tl.arange(0, HEAD_DIM)
    q_t = tl.load(q_ptr + batch * stride_qb + row_j.to(tl.int64)[None, :] * stride_qt
                  + head_j[None, :] * stride_qh + offs_d[:, None] * stride_qd,
                  mask=mask_j[None, :], other=0.0)
    if INTERPRETED:
        q_t = q_t.to(tl.float32)
    # Padded (row, head) columns get weight 0, so their relu(0) * 0 adds nothing.
    w = tl.load(w_ptr + batch * stride_wb + row_j.to(tl.int64) * stride_wt + head_j * stride_wh,
                mask=mask_j, other=0.0)
    offs_t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n_queries
    if HAS_LIMIT:
        limit = tl.load(limit_ptr + batch * stride_lb + offs_t.to(tl.int64) * stride_lt, mask=t_mask, other=-1)
        last_key = tl.minimum(tl.maximum(limit, -1), n_keys - 1).to(tl.int32)
    else:
        last_key = tl.where(t_mask, n_keys - 1, -1)
    return q_t, w, offs_t, t_mask, last_key


@triton.jit
def key_chunk(chunk, tiles_per_chunk, n_keys, last_key, BLOCK_S: tl.constexpr):
    """The chunk's key range [start, end), its tile count and how many of its tiles are computed:
    tiles past every row's limit are only filled with -inf (half of a causal prefill; in decode the
    cost of a row follows its sequence's length, not the static width)."""
    start = chunk * tiles_per_chunk * BLOCK_S
    end = tl.minimum(start + tiles_per_chunk * BLOCK_S, n_keys)
    n_tiles = tl.cdiv(end - start, BLOCK_S)
    n_computed = tl.minimum(tl.cdiv(tl.maximum(tl.max(last_key) + 1 - start, 0), BLOCK_S), n_tiles)
    return start, end, n_tiles, n_computed


@triton.jit
def head_sum(logits, w, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_S, BLOCK_T * BLOCK_H] q.k logits -> [BLOCK_S, BLOCK_T] sum_h relu(q.k) * w."""
    weighted = tl.maximum(logits, 0.0) * w[None, :]
    return tl.sum(tl.reshape(weighted, [BLOCK_S, BLOCK_T, BLOCK_H]), axis=2)


@triton.jit
def fill_uncomputed(out_rows, stride_os, t_mask, chunk_start, chunk_end, n_computed, n_tiles,
                     BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRETED: tl.constexpr,
                     INTERPRETED_TILES: tl.constexpr):
    """-inf into the chunk's tiles from n_computed on (interpreted: every tile, the mask splits)."""
    for i in range(0 if INTERPRETED else n_computed, INTERPRETED_TILES if INTERPRETED else n_tiles):
        offs_s = chunk_start + i * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(out_rows[None, :] + offs_s.to(tl.int64)[:, None] * stride_os,
                 tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32),
                 mask=(offs_s < chunk_end)[:, None] & t_mask[None, :] & (i >= n_computed))


# ----------------------------------------------------------------------------------------------
# float32 products on the bf16 tensor cores
# ----------------------------------------------------------------------------------------------
# float32 inputs (the exact mode) are split into high and low bfloat16 parts, x = hi + lo within
# 2^-16 |x| (each part carries 8 significant bits), and q . k is taken as three bf16 products with
# float32 accumulation, q_lo k_hi + q_hi k_lo + q_hi k_hi. Each bf16 product is exact in float32;
# what is dropped (q_lo k_lo and the split residuals) is at most about 3 * 2^-16 of |q_d k_d| per
# term, at random signs (tf32x3 would drop about 2^-21, at half the bf16 tensor cores' rate).

@triton.jit
def split_bf16(x, INTERPRETED: tl.constexpr):
    """float32 x -> (hi, lo): hi = x rounded to the nearest bfloat16, lo = x - hi (exact in float32)
    rounded likewise. Compiled: bfloat16 tensors (the hardware's round-to-nearest-even); interpreted:
    the same values kept as float32, whose dot the interpreter evaluates exactly (its bf16 dot is
    wrong)."""
    if INTERPRETED:
        hi = bf16_nearest(x)
        lo = bf16_nearest(x - hi)
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def split_query(q_t, BF16X3: tl.constexpr, INTERPRETED: tl.constexpr):
    """The q tile as key_logits takes it, split once per program: (hi, lo) for BF16X3 (float32
    inputs), else (q_t, q_t) (lo unused)."""
    if BF16X3:
        hi, lo = split_bf16(q_t, INTERPRETED)
    else:
        hi, lo = q_t, q_t
    return hi, lo


@triton.jit
def key_logits(k, k_lo, q_hi, q_lo, BF16X3: tl.constexpr, KEYS_SPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """[BLOCK_S, D] keys . the [D, BLOCK_T * BLOCK_H] q tile (split_query's parts), float32. BF16X3:
    three bf16 products, the small ones first, of q's parts and k's: (k, k_lo) as loaded when
    KEYS_SPLIT, else float32 k split here (k_lo unused); else one product of 16-bit or fp8 operands
    (exact, float32 sums)."""
    if BF16X3:
        if KEYS_SPLIT:
            k_hi = k
        else:
            k_hi, k_lo = split_bf16(k, INTERPRETED)
        logits = tl.dot(k_lo, q_hi, input_precision="ieee")
        logits = tl.dot(k_hi, q_lo, logits, input_precision="ieee")
        logits = tl.dot(k_hi, q_hi, logits, input_precision="ieee")
    else:
        logits = tl.dot(k, q_hi, input_precision="ieee")
    return logits
