"""Top-k selection for a few long rows of indexer scores (decode: one query row per sequence, up to
163,840 keys), spread over many programs per row: a two-pass radix select on the order-preserving
int32 image of the scores, then the selected keys are placed in order by their ranks.

Launches (no host synchronisation, static shapes: CUDA-graph capturable), for R rows of S scores:

1. a zeroed workspace (histograms and a slot counter per row);
2. pass 1, grid (R, S / TILE): histogram of the high 16 bits of every valid (> -inf) score, as 256
   coarse bins (the top 8 bits; per-tile tl.histogram, then one atomic per bin) and 65,536 fine bins
   (one atomic per score);
3. pass 2, same grid: each program finds the high half of the k-th largest score from pass 1's
   histograms (a scan of 256 coarse then 256 fine bins), then histograms the low 16 bits of the
   scores in that bin: together the k-th largest score T and how many exceed it;
4. gather, same grid: the scores above T, and those equal to T when all of them are taken, go to
   slots of the row's selection buffer (a per-row atomic counter) as (value, ~index) int64 keys;
5. rank, grid (R, next_pow2(topk) / 16): each gathered key's output position is the number of the
   row's gathered keys above it (int64 keys are unique, and their descending order is value
   descending, index ascending): a program compares its 16 keys with all of them at once. When more
   scores equal T than are taken, the gather took only those above T, and the row's first program
   takes the lowest key indices scoring T, after them, by a scan of the row in order (rare: exact
   float ties at the boundary). A one-program bitonic tl.sort of 2048 keys took ~41 µs on an H100: the comparisons
   spread over 128 programs a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET
from ._launch import Kept, cdiv, described, launch, per_signature
from .lightning_indexer import check_topk_inputs, indexer_topk

# Scores per program of the histogram and gather passes: 163,840 keys give 80 programs per row.
TILE = 2048
# A row's selection buffer holds next_pow2(topk) int64 keys, each compared with all of them for its rank;
# larger topk go to indexer_topk.
MAX_TOPK = 4096
_COARSE = tl.constexpr(256)         # bins of a digit's top 8 bits
_FINE = tl.constexpr(65536)         # bins of a 16-bit digit
_PASS_WORDS = tl.constexpr(_COARSE.value + _FINE.value)     # one pass's histograms (coarse, then fine), int32
_ROW_WORDS = 2 * _PASS_WORDS.value + 1      # both passes', then the row's slot counter
# Order-preserving int32 image of -inf (lightning_indexer._NEG_INF_ORDERED): scores at or below it
# are never selected.
_NEG_INF_ORDERED = tl.constexpr(-2139095041)
# The key of an empty selection slot: below every selected key (whose high half exceeds -inf's image).
_EMPTY_SLOT = tl.constexpr(-2139095041 * 2**32)
# Scores per step of a tied row's scan.
_TIE_ROW_BLOCK = 1024
# Keys a rank program places (each compared with all of the row's).
_RANK_BLOCK = 16


@triton.jit
def _ordered(x):
    """The order-preserving int32 image of float32 x (lightning_indexer._order_keys), -0.0 as +0.0."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _pick_bin(hist_ptr, rem):
    """Of one pass's histograms at hist_ptr (256 coarse bins, then 65,536 fine), the 16-bit bin
    holding the rem-th largest digit (rem >= 1, at most the histogram's total) and how many digits
    lie in higher bins."""
    offs = tl.arange(0, _COARSE)
    coarse = tl.load(hist_ptr + offs)
    # Inclusive suffix sums are non-increasing: the bins whose suffix reaches rem are the top ones.
    suffix = tl.sum(coarse, 0) - tl.cumsum(coarse, 0) + coarse
    top = tl.maximum(tl.sum((suffix >= rem).to(tl.int32), 0) - 1, 0)
    above = tl.sum(tl.where(offs > top, coarse, 0), 0)
    fine = tl.load(hist_ptr + _COARSE + top * _COARSE + offs)
    suffix = above + tl.sum(fine, 0) - tl.cumsum(fine, 0) + fine
    low = tl.maximum(tl.sum((suffix >= rem).to(tl.int32), 0) - 1, 0)
    return top * _COARSE + low, above + tl.sum(tl.where(offs > low, fine, 0), 0)


@triton.jit
def _threshold(hist_row, topk, PASSES: tl.constexpr):
    """The row's selection from its histograms: (take_all: topk >= the valid scores, all taken; the
    high 16-bit bin of the topk-th largest; the scores above that bin). With PASSES == 2 also
    (threshold T, the topk-th largest's int32 image; scores above T; scores equal to T)."""
    n_valid = tl.sum(tl.load(hist_row + tl.arange(0, _COARSE)), 0)
    take_all = n_valid <= topk
    high, above_high = _pick_bin(hist_row, tl.minimum(topk, n_valid))
    if PASSES == 1:
        return take_all, n_valid, high, above_high, 0, 0, 0
    else:
        low_hist = hist_row + _PASS_WORDS
        low, above_low = _pick_bin(low_hist, tl.maximum(topk - above_high, 1))
        n_equal = tl.load(low_hist + _COARSE + low)
        threshold = (high - 32768) * 65536 + low
        return take_all, n_valid, high, above_high, threshold, above_high + above_low, n_equal


@triton.jit
def _row_tile(scores_ptr, hist_ptr, n_keys, stride_row, TILE: tl.constexpr, ROW_WORDS: tl.constexpr):
    """Program (row, tile)'s row, its TILE key indices, their scores' int32 images (-inf past the row)
    and the row's workspace."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    x = tl.load(scores_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_keys, other=float("-inf"))
    return row, cols, _ordered(x), hist_ptr + row.to(tl.int64) * ROW_WORDS


@triton.jit(do_not_specialize=["n_keys", "stride_row", "topk"])
def _histogram_kernel(scores_ptr, hist_ptr, n_keys, stride_row, topk,
                      PASS: tl.constexpr, TILE: tl.constexpr, ROW_WORDS: tl.constexpr):
    # Program (row, tile): TILE scores of one row, counted into that row's pass-PASS histograms.
    row, cols, key, hist_row = _row_tile(scores_ptr, hist_ptr, n_keys, stride_row, TILE, ROW_WORDS)
    high = (key >> 16) + 32768
    if PASS == 1:
        counted = key > _NEG_INF_ORDERED
        digit = high
        hist = hist_row
    else:
        take_all, n_valid, high_bin, above_high, t, a, e = _threshold(hist_row, topk, 1)
        counted = (key > _NEG_INF_ORDERED) & (high == high_bin) & (take_all == 0)
        digit = key & 0xFFFF
        hist = hist_row + _PASS_WORDS
    # Coarse bins: one tile histogram, one atomic per non-empty bin (a row's scores share few of them).
    coarse = tl.histogram(digit >> 8, _COARSE, mask=counted)
    tl.atomic_add(hist + tl.arange(0, _COARSE), coarse, mask=coarse > 0, sem="relaxed")
    tl.atomic_add(hist + _COARSE + digit, 1, mask=counted, sem="relaxed")


@triton.jit(do_not_specialize=["n_keys", "stride_row", "topk"])
def _gather_kernel(scores_ptr, hist_ptr, keys_ptr, n_keys, stride_row, topk,
                   TILE: tl.constexpr, ROW_WORDS: tl.constexpr, SLOTS: tl.constexpr):
    # Program (row, tile): the tile's selected scores as int64 keys into the row's SLOTS slots.
    row, cols, key, hist_row = _row_tile(scores_ptr, hist_ptr, n_keys, stride_row, TILE, ROW_WORDS)
    take_all, n_valid, h, ah, threshold, n_above, n_equal = _threshold(hist_row, topk, 2)
    valid = key > _NEG_INF_ORDERED
    # Scores equal to T are taken here only when all of them are; else the first rank program scans for them.
    chosen = valid & ((key > threshold) | ((key == threshold) & (n_above + n_equal == topk)) | take_all)
    n_chosen = tl.sum(chosen.to(tl.int32), 0)
    first = tl.atomic_add(hist_row + 2 * _PASS_WORDS, n_chosen, sem="relaxed")
    slot = first + tl.cumsum(chosen.to(tl.int32), 0) - 1
    # (value, then lower index) in one int64, unique per index: lightning_indexer._order_keys.
    order_key = (key.to(tl.int64) << 32) | (cols.to(tl.int64) ^ 0xFFFFFFFF)
    tl.store(keys_ptr + row.to(tl.int64) * SLOTS + slot, order_key, mask=chosen)


@triton.jit(do_not_specialize=["n_keys", "stride_row", "stride_out", "topk"])
def _rank_kernel(scores_ptr, hist_ptr, keys_ptr, out_ptr, n_keys, stride_row, stride_out, topk,
                 ROW_WORDS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr,
                 INTERPRETED: tl.constexpr, INTERPRETED_KEYS: tl.constexpr):
    # Program (row, block): BLOCK of the row's gathered keys, each written to the output position given
    # by its rank (how many gathered keys exceed it: keys are unique); the padding -1 of its positions;
    # block 0 also the boundary ties.
    row = tl.program_id(0)
    block = tl.program_id(1)
    hist_row = hist_ptr + row.to(tl.int64) * ROW_WORDS
    row_keys = keys_ptr + row.to(tl.int64) * SLOTS
    row_out = out_ptr + row.to(tl.int64) * stride_out
    take_all, n_valid, h, ah, threshold, n_above, n_equal = _threshold(hist_row, topk, 2)
    n_selected = tl.where(take_all, n_valid, topk)
    tied = (take_all == 0) & (n_above + n_equal != topk)
    # Tied: the gather took only the n_above keys above T; the topk - n_above lowest key indices scoring T
    # follow them in key order, so they take positions n_above on in one scan of the row in order.
    n_gathered = tl.where(tied, n_above, n_selected)
    mine = block * BLOCK + tl.arange(0, BLOCK)
    keys = tl.load(row_keys + mine, mask=mine < n_gathered, other=_EMPTY_SLOT)
    # Every pairwise comparison at once, [BLOCK, SLOTS], with no loop: a loop over 32-key chunks, 128 keys a
    # program, took ~20 µs a row at top-k 2048 on an H100 (likely its loads' latency, one per iteration).
    others = tl.arange(0, SLOTS)
    other_keys = tl.load(row_keys + others, mask=others < n_gathered, other=_EMPTY_SLOT)
    rank = tl.sum((other_keys[None, :] > keys[:, None]).to(tl.int32), 1)
    indices = ((keys & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(tl.int32)
    tl.store(row_out + rank, indices, mask=mine < n_gathered)
    tl.store(row_out + mine, tl.full((BLOCK,), -1, tl.int32), mask=(mine >= n_selected) & (mine < topk))
    n_needed = topk - n_above
    n_seen = n_needed * 0
    scan = tied & (block == 0)
    # The interpreter cannot loop to a runtime bound: it scans every row, masked.
    offs = tl.arange(0, ROW_BLOCK)
    row_scores = scores_ptr + row.to(tl.int64) * stride_row
    for start in range(0, INTERPRETED_KEYS if INTERPRETED else tl.where(scan, n_keys, 0), ROW_BLOCK):
        cols = start + offs
        x = tl.load(row_scores + cols, mask=scan & (cols < n_keys), other=float("-inf"))
        equal = scan & (cols < n_keys) & (_ordered(x) == threshold)
        position = n_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
        tl.store(row_out + n_above + position, cols, mask=equal & (position < n_needed))
        n_seen += tl.sum(equal.to(tl.int32), 0)


def decode_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """
    indexer_topk for a few long rows (a decode step's scores): per row, the key indices of the topk
    largest scores, best first, equal scores in ascending key order (the first topk of a stable
    descending sort); -inf scores are never selected and rows are padded with -1 (fewer valid keys
    than topk). The result equals indexer_topk's, element for element.

    Args:
        scores: [..., S] float32 (paged_indexer_scores output), S < 2^31, on a CUDA device (or the
            CPU under TRITON_INTERPRET=1). NaN is unsupported.
        topk: int >= 1 (V3.2: 2048); may exceed S. topk > MAX_TOPK (4096) runs indexer_topk.

    Returns:
        [..., topk] int32 key indices in [0, S) or -1.

    Four Triton launches and a workspace memset (module docstring), each histogram / gather pass
    over R x ceil(S / 2048) programs, so one row fills the GPU; no host synchronisation (CUDA-graph
    capturable). Workspace: R x 526 KB of int32 histograms and R x next_pow2(topk) int64 keys.

    Raises:
        minirt.errors.InputError: scores not float32 [..., S], topk not a positive int, or a device
            the kernels cannot run on.
    """
    kept = per_signature(_KEPT, lambda: (described(scores), topk.__class__, topk),
                         lambda: check_topk_inputs(scores, topk) or Kept({}))
    if topk > MAX_TOPK:
        return indexer_topk(scores, topk)
    n_keys = scores.shape[-1]
    if kept.args is None:
        n_rows = scores.shape[:-1].numel()
        rows = scores.reshape(n_rows, n_keys)
        copy = rows.stride(-1) != 1 or rows.data_ptr() != scores.data_ptr()   # (not a view of scores as rows)
        slots = triton.next_power_of_2(topk)
        row_stride = n_keys if copy else rows.stride(0)
        kept.args = (n_rows, copy, slots, (n_rows, cdiv(n_keys, TILE)), (n_keys, row_stride, topk), dict(
            TILE=TILE, ROW_WORDS=_ROW_WORDS, num_warps=4), (n_keys, row_stride, topk, topk), dict(
            ROW_WORDS=_ROW_WORDS, SLOTS=slots, BLOCK=min(slots, _RANK_BLOCK),
            ROW_BLOCK=_TIE_ROW_BLOCK, INTERPRETED=INTERPRET, INTERPRETED_KEYS=n_keys if INTERPRET else 0,
            num_warps=4))
    n_rows, copy, slots, grid, integers, pass_constexprs, rank_integers, rank_constexprs = kept.args
    # (out [..., topk] contiguous: the rank kernel's rows of stride topk.)
    out = torch.empty((*scores.shape[:-1], topk), dtype=torch.int32, device=scores.device)
    if n_rows == 0 or n_keys == 0:
        return out.fill_(-1)
    rows = scores.reshape(n_rows, n_keys).contiguous() if copy else scores
    hist = torch.zeros((n_rows, _ROW_WORDS), dtype=torch.int32, device=scores.device)
    keys = torch.empty((n_rows, slots), dtype=torch.int64, device=scores.device)
    # (Each pass's own compiled kernel: the second's in kept.value.)
    for pass_, compiled in ((1, kept.compiled), (2, kept.value)):
        launch(_histogram_kernel, grid, (rows, hist, *integers), dict(PASS=pass_, **pass_constexprs), compiled)
    launch(_gather_kernel, grid, (rows, hist, keys, *integers), dict(SLOTS=slots, **pass_constexprs), kept.compiled)
    launch(_rank_kernel, (n_rows, slots // rank_constexprs["BLOCK"]), (rows, hist, keys, out, *rank_integers),
           rank_constexprs, kept.compiled)
    return out


# Call signature (scores' class, dtype, shape, strides, device and alignment; topk) -> its Kept (value: the
# second histogram pass's compiled kernel; args: the launches): a signature seen before passed the checks.
_KEPT: dict = {}
