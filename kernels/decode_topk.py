"""Top-k selection for a few long rows of indexer scores (decode: one query row per sequence, up to
163,840 keys): a radix select on the order-preserving int32 image of the scores, then the selected keys
are placed in order by their ranks, spread over many programs per row.

Rows of up to ROW_PROGRAM_KEYS keys (a decode step's rows up to 4,096 cached tokens) take two launches:
one program a row finds the k-th largest image T a byte at a time (four histograms of 256 bins, in
registers, each over the row's scores that share T's bytes so far: the row is read once, no workspace to
zero, no atomics), then gathers the selection in index order (the keys above T, then the lowest indices
equal to T); the rank launch (6. below) places it. Longer rows spread each pass over programs of TILE
keys, so one row fills the GPU. Launches (no host synchronisation, static shapes: CUDA-graph capturable),
for R rows of S scores:

1. a zeroed workspace (histograms and a slot counter per row);
2. pass 1, grid (R, S / TILE): histogram of the top byte of every valid (> -inf) score's image (a
   tile histogram per program, then one atomic per non-empty bin);
3. pass 2, same grid: each program finds the top byte A of the k-th largest image from pass 1's
   histogram, then histograms the second byte of the scores whose top byte is A;
4. pass 3, same grid: likewise the second byte B, then the low 16 bits of the scores whose top bytes
   are (A, B), one atomic per score (beside a histogram of their top byte): together the k-th largest
   image T, how many exceed it and how many equal it. (Two passes of 16 bits, the first with one
   atomic per score into 65,536 bins, took 0.091 ms for three rows of 163,840 on an H100, 0.022 at 1,024.)
5. gather, same grid: the scores above T, and those equal to T when all of them are taken, go to
   slots of the row's selection buffer (a per-row atomic counter) as (value, ~index) int64 keys;
6. rank, grid (R, next_pow2(topk) / 16): each gathered key's output position is the number of the
   row's gathered keys above it (int64 keys are unique, and their descending order is value
   descending, index ascending): a program compares its 16 keys with all of them at once. When more
   scores equal T than are taken, the gather took only those above T, and the row's first program
   takes the lowest key indices scoring T, after them, by a scan of the row in order (rare: exact
   float ties at the boundary). A one-program bitonic tl.sort of 2048 keys took ~41 µs on an H100: the
   comparisons spread over 128 programs a row.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import INTERPRET, check_device, paged_slot
from ._launch import Kept, cdiv, described, launch, per_signature
from .lightning_indexer import check_topk_inputs, indexer_topk

# Scores per program of the histogram and gather passes: 163,840 keys give 80 programs per row.
TILE = 2048
# Rows of at most this many keys take one program a row for the selection (module docstring): up to here
# one program holding the row takes less than the launches that spread it (bench_indexer_paged.py
# --topk-sweep on an H100: 1 and 16 rows of 8,192 keys were as fast or faster in tiles).
ROW_PROGRAM_KEYS = 4096
# A row's selection buffer holds next_pow2(topk) int64 keys, each compared with all of them for its rank;
# larger topk go to indexer_topk.
MAX_TOPK = 4096
_BINS = tl.constexpr(256)           # bins of an 8-bit digit
# A row's int32 workspace: the histograms of the scores' top byte, of their second byte, of the top byte of
# their low 16 bits and of those 16 bits, then the row's slot counter.
_HIST_B = tl.constexpr(256)
_HIST_C = tl.constexpr(512)
_HIST_FINE = tl.constexpr(768)
_COUNTER = tl.constexpr(768 + 65536)
_ROW_WORDS = _COUNTER.value + 1
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
def _pick_counts(counts, rem):
    """Of 256 bins' counts, the bin holding the rem-th largest digit (rem >= 1, at most their total) and
    how many digits lie in higher bins."""
    # Inclusive suffix sums are non-increasing: the bins whose suffix reaches rem are the top ones.
    suffix = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    picked = tl.maximum(tl.sum((suffix >= rem).to(tl.int32), 0) - 1, 0)
    return picked, tl.sum(tl.where(tl.arange(0, _BINS) > picked, counts, 0), 0)


@triton.jit
def _pick(hist, rem):
    """_pick_counts of the 256 bins at hist."""
    return _pick_counts(tl.load(hist + tl.arange(0, _BINS)), rem)


@triton.jit
def _order_key(key, cols):
    """(image, then lower index) in one int64, unique per index: lightning_indexer._order_keys."""
    return (key.to(tl.int64) << 32) | (cols.to(tl.int64) ^ 0xFFFFFFFF)


@triton.jit
def _threshold(hist_row, topk, PASSES: tl.constexpr):
    """The row's selection from the histograms of its first PASSES passes: (take_all: topk >= the valid
    scores, all taken; the valid scores; the top byte A of the topk-th largest score's image; with
    PASSES >= 2 its second byte B; with PASSES == 3 the image itself, T, how many scores exceed T and how
    many equal it)."""
    n_valid = tl.sum(tl.load(hist_row + tl.arange(0, _BINS)), 0)
    take_all = n_valid <= topk
    rem = tl.minimum(topk, n_valid)
    a, above_a = _pick(hist_row, rem)
    if PASSES == 1:
        return take_all, n_valid, a, 0, 0, 0, 0
    rem = tl.maximum(rem - above_a, 1)
    b, above_b = _pick(hist_row + _HIST_B, rem)
    if PASSES == 2:
        return take_all, n_valid, a, b, 0, 0, 0
    rem = tl.maximum(rem - above_b, 1)
    c_high, above_c_high = _pick(hist_row + _HIST_C, rem)
    c_low, above_c_low = _pick(hist_row + _HIST_FINE + c_high * _BINS, tl.maximum(rem - above_c_high, 1))
    c = c_high * _BINS + c_low
    threshold = ((a - 128) << 24) | (b << 16) | c
    n_equal = tl.load(hist_row + _HIST_FINE + c)
    return take_all, n_valid, a, b, threshold, above_a + above_b + above_c_high + above_c_low, n_equal


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
    # Program (row, tile): TILE scores of one row, counted into that row's pass-PASS histogram: pass 1 the
    # top byte of every valid (> -inf) score's image; pass 2 the second byte of those whose top byte is
    # the topk-th largest's; pass 3 the low 16 bits of those whose top two bytes are.
    row, cols, key, hist_row = _row_tile(scores_ptr, hist_ptr, n_keys, stride_row, TILE, ROW_WORDS)
    counted = key > _NEG_INF_ORDERED
    top = (key >> 24) + 128
    second = (key >> 16) & 0xFF
    if PASS == 1:
        digit = top
        hist = hist_row
    else:
        take_all, n_valid, a, b, t, n_above, n_equal = _threshold(hist_row, topk, PASS - 1)
        counted = counted & (top == a) & (take_all == 0)
        if PASS == 2:
            digit = second
            hist = hist_row + _HIST_B
        else:
            counted = counted & (second == b)
            digit = (key >> 8) & 0xFF
            hist = hist_row + _HIST_C
            # One atomic per score: few share the topk-th largest's top two bytes.
            tl.atomic_add(hist_row + _HIST_FINE + (key & 0xFFFF), 1, mask=counted, sem="relaxed")
    # One tile histogram, then one atomic per non-empty bin (a row's scores share few of them).
    counts = tl.histogram(digit, _BINS, mask=counted)
    tl.atomic_add(hist + tl.arange(0, _BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize=["n_keys", "stride_row", "topk"])
def _gather_kernel(scores_ptr, hist_ptr, keys_ptr, n_keys, stride_row, topk,
                   TILE: tl.constexpr, ROW_WORDS: tl.constexpr, SLOTS: tl.constexpr):
    # Program (row, tile): the tile's selected scores as int64 keys into the row's SLOTS slots.
    row, cols, key, hist_row = _row_tile(scores_ptr, hist_ptr, n_keys, stride_row, TILE, ROW_WORDS)
    take_all, n_valid, a, b, threshold, n_above, n_equal = _threshold(hist_row, topk, 3)
    valid = key > _NEG_INF_ORDERED
    # Scores equal to T are taken here only when all of them are; else the first rank program scans for them.
    chosen = valid & ((key > threshold) | ((key == threshold) & (n_above + n_equal == topk)) | take_all)
    n_chosen = tl.sum(chosen.to(tl.int32), 0)
    first = tl.atomic_add(hist_row + _COUNTER, n_chosen, sem="relaxed")
    slot = first + tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(keys_ptr + row.to(tl.int64) * (SLOTS + 1) + slot, _order_key(key, cols), mask=chosen)


@triton.jit(do_not_specialize=["n_keys", "stride_row", "topk"])
def _row_select_kernel(scores_ptr, keys_ptr, n_keys, stride_row, topk, ROW: tl.constexpr, SLOTS: tl.constexpr):
    # Program = one row of n_keys <= ROW scores, read once: the four bytes of the topk-th largest image T,
    # each from a histogram of the next byte of the valid scores that share T's bytes so far; then the
    # selection in index order (those above T, then the lowest indices equal to T) as int64 keys into the
    # row's SLOTS slots, their count in slot SLOTS.
    row = tl.program_id(0)
    cols = tl.arange(0, ROW)
    key = _ordered(tl.load(scores_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_keys,
                           other=float("-inf")))
    valid = key > _NEG_INF_ORDERED
    counts = tl.histogram((key >> 24) + 128, _BINS, mask=valid)
    n_valid = tl.sum(counts, 0)
    take_all = n_valid <= topk
    rem = tl.maximum(tl.minimum(topk, n_valid), 1)
    digit, n_above = _pick_counts(counts, rem)
    rem = tl.maximum(rem - n_above, 1)
    prefix = digit - 128   # T's bytes so far, as the arithmetic shift of its image
    for byte in tl.static_range(1, 4):
        sharing = valid & ((key >> (32 - 8 * byte)) == prefix)
        digit, above = _pick_counts(tl.histogram((key >> (24 - 8 * byte)) & 0xFF, _BINS, mask=sharing), rem)
        n_above += above
        rem = tl.maximum(rem - above, 1)
        prefix = (prefix << 8) | digit
    # rem: how many keys equal to T the selection takes (topk - n_above), the first in index order.
    tied = valid & (key == prefix) & (take_all == 0)
    chosen = valid & (take_all | (key > prefix) | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= rem)))
    row_keys = keys_ptr + row.to(tl.int64) * (SLOTS + 1)
    tl.store(row_keys + tl.cumsum(chosen.to(tl.int32), 0) - 1, _order_key(key, cols), mask=chosen)
    tl.store(row_keys + SLOTS, tl.sum(chosen.to(tl.int64), 0))


@triton.jit
def _selected(indices, mask, table_row_ptr, max_blocks, block_size, num_blocks, PAGED: tl.constexpr):
    """What the rank kernel writes for selected key indices: the indices, or with PAGED their cache slots
    through the row's block table (-1 past the table or on a page outside the cache)."""
    if PAGED:
        indices = paged_slot(table_row_ptr, indices, mask, max_blocks, block_size, num_blocks).to(tl.int32)
    return indices


@triton.jit(do_not_specialize=["n_keys", "stride_row", "stride_out", "topk", "max_blocks", "block_size",
                               "num_blocks", "stride_table"])
def _rank_kernel(scores_ptr, hist_ptr, keys_ptr, out_ptr, table_ptr, n_keys, stride_row, stride_out, topk,
                 max_blocks, block_size, num_blocks, stride_table, ROW_WORDS: tl.constexpr, SLOTS: tl.constexpr,
                 BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr, PAGED: tl.constexpr, ROW_SELECTED: tl.constexpr,
                 INTERPRETED: tl.constexpr, INTERPRETED_KEYS: tl.constexpr):
    # Program (row, block): BLOCK of the row's gathered keys, each written to the output position given
    # by its rank (how many gathered keys exceed it: keys are unique); the padding -1 of its positions;
    # block 0 also the boundary ties (ROW_SELECTED: _row_select_kernel's keys, ties taken and counted).
    row = tl.program_id(0)
    block = tl.program_id(1)
    row_keys = keys_ptr + row.to(tl.int64) * (SLOTS + 1)
    row_out = out_ptr + row.to(tl.int64) * stride_out
    table_row = table_ptr + row.to(tl.int64) * stride_table
    if ROW_SELECTED:
        n_selected = tl.load(row_keys + SLOTS).to(tl.int32)
        n_gathered = n_selected
    else:
        hist_row = hist_ptr + row.to(tl.int64) * ROW_WORDS
        take_all, n_valid, a, b, threshold, n_above, n_equal = _threshold(hist_row, topk, 3)
        n_selected = tl.where(take_all, n_valid, topk)
        tied = (take_all == 0) & (n_above + n_equal != topk)
        # Tied: the gather took only the n_above keys above T; the topk - n_above lowest key indices scoring
        # T follow them in key order, so they take positions n_above on in one scan of the row in order.
        n_gathered = tl.where(tied, n_above, n_selected)
    mine = block * BLOCK + tl.arange(0, BLOCK)
    keys = tl.load(row_keys + mine, mask=mine < n_gathered, other=_EMPTY_SLOT)
    # Every pairwise comparison at once, [BLOCK, SLOTS], with no loop: a loop over 32-key chunks, 128 keys a
    # program, took ~20 µs a row at top-k 2048 on an H100 (likely its loads' latency, one per iteration).
    others = tl.arange(0, SLOTS)
    other_keys = tl.load(row_keys + others, mask=others < n_gathered, other=_EMPTY_SLOT)
    rank = tl.sum((other_keys[None, :] > keys[:, None]).to(tl.int32), 1)
    indices = ((keys & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(tl.int32)
    gathered = mine < n_gathered
    tl.store(row_out + rank, _selected(indices, gathered, table_row, max_blocks, block_size, num_blocks, PAGED),
             mask=gathered)
    tl.store(row_out + mine, tl.full((BLOCK,), -1, tl.int32), mask=(mine >= n_selected) & (mine < topk))
    if not ROW_SELECTED:
        _tied_scan(scores_ptr, row_out, table_row, row, block, n_keys, stride_row, topk, n_above, tied, threshold,
                   max_blocks, block_size, num_blocks, ROW_BLOCK, PAGED, INTERPRETED, INTERPRETED_KEYS)


@triton.jit
def _tied_scan(scores_ptr, row_out, table_row, row, block, n_keys, stride_row, topk, n_above, tied, threshold,
               max_blocks, block_size, num_blocks, ROW_BLOCK: tl.constexpr, PAGED: tl.constexpr,
               INTERPRETED: tl.constexpr, INTERPRETED_KEYS: tl.constexpr):
    """The rank kernel's boundary ties (block 0 of a tied row): the topk - n_above lowest key indices scoring
    T, at positions n_above on."""
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
        taken = equal & (position < n_needed)
        tl.store(row_out + n_above + position,
                 _selected(cols, taken, table_row, max_blocks, block_size, num_blocks, PAGED), mask=taken)
        n_seen += tl.sum(equal.to(tl.int32), 0)


def decode_topk(scores: torch.Tensor, topk: int, *, pages: Optional[tuple[torch.Tensor, int, int]] = None
                ) -> torch.Tensor:
    """
    indexer_topk for a few long rows (a decode step's scores): per row, the key indices of the topk
    largest scores, best first, equal scores in ascending key order (the first topk of a stable
    descending sort); -inf scores are never selected and rows are padded with -1 (fewer valid keys
    than topk). The result equals indexer_topk's, element for element.

    Args:
        scores: [..., S] float32 (paged_indexer_scores output), S < 2^31, on a CUDA device (or the
            CPU under TRITON_INTERPRET=1). NaN is unsupported.
        topk: int >= 1 (V3.2: 2048); may exceed S. topk > MAX_TOPK (4096) runs indexer_topk.
        pages: keyword-only, optional (block_table [R, max_blocks] int32 with unit column stride, one row per
            score row (R = scores' rows); block_size and num_blocks, positive ints), topk <= MAX_TOPK: the
            selected key positions' cache slots instead, block_table[r, p // block_size] · block_size +
            p % block_size (``positions_to_slots``' mapping, in the same launch): -1 where p is past the table
            or its page outside [0, num_blocks).

    Returns:
        [..., topk] int32 key indices in [0, S) or -1 (with ``pages``, slots or -1).

    Rows of S <= ROW_PROGRAM_KEYS (4,096) keys: two Triton launches, one program a row selecting, then
    the ranks; longer rows: five Triton launches and a workspace memset (module docstring), each histogram
    / gather pass over R x ceil(S / 2048) programs, so one row fills the GPU. No host synchronisation
    (CUDA-graph capturable). Workspace: R x (next_pow2(topk) + 1) int64 keys, and for long rows R x 265 KB
    of int32 histograms.

    Raises:
        minirt.errors.InputError: scores not float32 [..., S], topk not a positive int, or a device
            the kernels cannot run on.
    """
    table, block_size, num_blocks = pages if isinstance(pages, tuple) and len(pages) == 3 else (None, 1, 1)
    kept = per_signature(_KEPT, lambda: (
        described(scores), topk.__class__, topk,
        None if pages is None else (pages.__class__, len(pages), described(table), block_size.__class__, block_size,
                                    num_blocks.__class__, num_blocks)),
        lambda: _check(scores, topk, pages) or Kept(({}, {})))
    if topk > MAX_TOPK:
        return indexer_topk(scores, topk)
    n_keys = scores.shape[-1]
    if kept.args is None:
        n_rows = scores.shape[:-1].numel()
        rows = scores.reshape(n_rows, n_keys)
        copy = rows.stride(-1) != 1 or rows.data_ptr() != scores.data_ptr()   # (not a view of scores as rows)
        slots = triton.next_power_of_2(topk)
        row_stride = n_keys if copy else rows.stride(0)
        paging = (0, block_size, num_blocks, 0) if table is None else (table.shape[1], block_size, num_blocks,
                                                                        table.stride(0))
        row_selected = n_keys <= ROW_PROGRAM_KEYS
        # (8 warps: up to 16 keys a thread, no spills at sm_90a; 1-2 us faster than 4 or 16 on an H100.)
        pass_constexprs = dict(ROW=triton.next_power_of_2(n_keys), SLOTS=slots, num_warps=8) if row_selected else \
            dict(TILE=TILE, ROW_WORDS=_ROW_WORDS, num_warps=4)
        kept.args = (n_rows, copy, slots, row_selected, (n_rows, cdiv(n_keys, TILE)), (n_keys, row_stride, topk),
                     pass_constexprs, (n_keys, row_stride, topk, topk, *paging), dict(
            ROW_WORDS=_ROW_WORDS, SLOTS=slots, BLOCK=min(slots, _RANK_BLOCK), ROW_BLOCK=_TIE_ROW_BLOCK,
            PAGED=table is not None, ROW_SELECTED=row_selected, INTERPRETED=INTERPRET,
            INTERPRETED_KEYS=n_keys if INTERPRET else 0, num_warps=4))
    n_rows, copy, slots, row_selected, grid, integers, pass_constexprs, rank_integers, rank_constexprs = kept.args
    # (out [..., topk] contiguous: the rank kernel's rows of stride topk.)
    out = torch.empty(*scores.shape[:-1], topk, dtype=torch.int32, device=scores.device)
    if n_rows == 0 or n_keys == 0:
        return out.fill_(-1)
    rows = scores.reshape(n_rows, n_keys).contiguous() if copy else scores
    # A row's selection: slots then (one program a row) their count.
    keys = torch.empty(n_rows, slots + 1, dtype=torch.int64, device=scores.device)
    if row_selected:
        hist = keys   # (unread)
        launch(_row_select_kernel, grid[:1], (rows, keys, *integers), pass_constexprs, kept.compiled)
    else:
        hist = torch.zeros(n_rows, _ROW_WORDS, dtype=torch.int32, device=scores.device)
        # (Each pass's own compiled kernel: the second's and third's in kept.value.)
        for pass_, compiled in zip((1, 2, 3), (kept.compiled, *kept.value)):
            launch(_histogram_kernel, grid, (rows, hist, *integers), dict(PASS=pass_, **pass_constexprs), compiled)
        launch(_gather_kernel, grid, (rows, hist, keys, *integers), dict(SLOTS=slots, **pass_constexprs),
               kept.compiled)
    launch(_rank_kernel, (n_rows, slots // rank_constexprs["BLOCK"]),
           (rows, hist, keys, out, hist if table is None else table, *rank_integers), rank_constexprs, kept.compiled)
    return out


def _check(scores, topk, pages) -> None:
    """decode_topk's input checks (InputError)."""
    check_topk_inputs(scores, topk)
    if pages is None:
        return
    n_rows = scores.shape[:-1].numel()
    table, block_size, num_blocks = pages if isinstance(pages, tuple) and len(pages) == 3 else (None, None, None)
    if not (isinstance(table, torch.Tensor) and table.dtype == torch.int32 and table.dim() == 2 and
            table.shape[0] == n_rows and (table.shape[1] <= 1 or table.stride(1) == 1) and
            all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (block_size, num_blocks))):
        raise InputError(f"pages must be (block_table [{n_rows}, max_blocks] int32 with unit column stride, "
                         f"block_size, num_blocks positive ints), got {type(pages).__name__}")
    if topk > MAX_TOPK:
        raise InputError(f"pages needs topk <= {MAX_TOPK}, got {topk}")
    check_device({"scores": scores, "block_table": table})


# Call signature (scores' class, dtype, shape, strides, device and alignment; topk; pages) -> its Kept (value: the
# second and third histogram passes' compiled kernels; args: the launches): a signature seen before passed the checks.
_KEPT: dict = {}
