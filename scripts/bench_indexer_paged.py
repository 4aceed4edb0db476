"""Benchmark the paged indexer (scores from the key cache + indexer_topk) on the GPU, in both cache
formats, with the ceilings measured in the same run.

    python3 scripts/bench_indexer_paged.py [--out results.md] [--variants 4,128,8,3 2,64,8,3 ...] [--decode-only]
    python3 scripts/bench_indexer_paged.py --sweep [--formats fp8]     # the prefill chunk only, over SWEEP_VARIANTS
    python3 scripts/bench_indexer_paged.py --decode-sweep               # decode scores only, over DECODE_SWEEP_VARIANTS
    python3 scripts/bench_indexer_paged.py --topk-sweep                 # decode_topk alone, both of its selections
    python3 scripts/bench_indexer_paged.py --programs-sweep             # decode scores by programs a launch

Decode: B in {1, 16} sequences, one query each, of L in {1024, 32768, 131072} cached tokens, over a
block table of capacity 163840 (V3.2's max_position_embeddings; the scores' static width), pages of
64 in shuffled order; H 64, D 128, top-k 2048. Memory-bound: GB/s counts the keys the rows must read
(L x 132 bytes fp8, L x 512 exact) plus the scores written (163840 x 4 per row). The top-k rows time
indexer_topk and decode_topk (the runtime's decode selection) after the scores and alone, after
checking that both select the same indices. --decode-only skips the prefill chunk. The runtime's
current decode indexer (gather every slot's fp32 key, torch einsums, full stable sort) is timed at
the same shapes for comparison.
Prefill chunk: one sequence, the last t = 2048 queries of a 131072-token prompt (limit[t] = 129024 +
t) over its 131072 keys; TFLOP/s counts the causal part needed, 2 H D sum_t (limit[t] + 1); exact keys
are split into bf16 parts once (the pages the chunk sees), and, in one more row, as each tile loads. On
sm_90 the default is the Gluon kernel (indexer_scores_sm90), timed beside the Triton kernel's. Variants
(block_t, block_s, num_warps, num_stages) of the launch run at this shape; --sweep runs only the
prefill chunk, over each format's SWEEP_VARIANTS (every one compiles for sm_90a within its shared
memory), and ends each format with the fastest correct launch; --decode-sweep likewise times only the
decode scores, at B 1 and 16 over DECODE_SWEEP_LENGTH keys, over DECODE_SWEEP_VARIANTS (one query row a
sequence: block_t 1). --topk-sweep times decode_topk alone on B rows of L random scores (TOPK_SWEEP), replayed
from a CUDA graph as a decode step runs it, through each of its selections (one program a row, the default up
to decode_topk.ROW_PROGRAM_KEYS keys, which it can take no further, and the histogram passes over programs of
2048 keys), after checking both against indexer_topk. --programs-sweep times the decode scores (default launch
shape) at B 1 and 16 over PROGRAMS_SWEEP_LENGTHS keys with the programs a launch aims at
(_indexer_tiles.num_programs_target, which splits a row's keys into chunks) at each multiple of the SMs in
PROGRAMS_SWEEP, each checked.
Every measured kernel is first compared with an eager fp32 torch evaluation over the dequantised keys
on a sample of rows. Times are triton.testing.do_bench medians (L2 cleared before each rep). A failing
measurement is reported in its cell; the run goes on.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from bench_indexer import attempt, bench_ms, launch_sweep, parse_variant, split_as_tiles_load
from ceilings import measure_ceilings, write_report

from minirt.formats import FP8_DTYPE, INDEX_KEY_BYTES
from minirt.kernels.indexer_cache import (dequantize_index_cache, new_index_cache, paged_config,
                                          paged_indexer_scores, write_index_keys)
from minirt.kernels import _indexer_tiles, indexer_cache, indexer_scores_sm90, lightning_indexer
from minirt.kernels._common import num_sms
from minirt.kernels.decode_topk import decode_topk
from minirt.kernels.lightning_indexer import indexer_topk

H, D, TOPK, BLOCK_SIZE = 64, 128, 2048, 64
CAPACITY = 163840
DECODE_BATCHES = (1, 16)
DECODE_LENGTHS = (1024, 32768, 131072)
CHUNK_T, CHUNK_KEYS = 2048, 131072
DEFAULT_VARIANTS = ["4,128,8,3", "2,64,8,3", "4,64,4,3", "8,64,8,2", "2,128,8,2"]
FORMATS = ("fp8", "exact")
# Launch shapes for --sweep besides the default: those that fit sm_90a's shared memory at the prefill
# chunk's shape (compiled on the CPU as scripts/sm90_registers.py does). A default must not spill there
# (tests/test_sm90_registers.py); these spill: fp8 4,128,4,3; exact 4,64,4,3 (166 spill instructions),
# 4,64,4,2, 4,64,8,2 and 4,64,8,3.
SWEEP_VARIANTS = {
    "fp8": ["4,64,4,2", "4,64,8,3", "8,64,8,2", "8,64,8,3", "4,128,8,2", "4,128,8,3", "2,128,4,3", "2,64,4,3",
            "4,32,4,3"],
    "exact": ["2,128,4,2", "2,64,4,3", "2,64,8,3", "4,32,8,3", "4,32,8,4", "4,64,4,3", "4,64,8,2", "4,64,8,3"],
}

# Decode launch shapes for --decode-sweep besides paged_config's (block_t 1: one query a sequence): key
# steps, warps and stages around it that compile for sm_90a without spills (exact 1,128,4,2 spills).
DECODE_SWEEP_LENGTH = 131072
# --topk-sweep: top-k (V3.2's, V4's compressed entries'), rows (B) and row lengths (L) of decode_topk's two
# selections.
TOPK_SWEEP = ((2048, 512), (1, 16, 64), (1024, 2048, 4096, 8192, 16384, 163840))
# --programs-sweep: programs a decode scores launch aims at, as multiples of the SMs (the default: 4), and the
# rows' valid keys.
PROGRAMS_SWEEP = (1, 2, 3, 4, 6, 8, 12)
PROGRAMS_SWEEP_LENGTHS = (32768, 131072, 163840)
DECODE_SWEEP_VARIANTS = {
    "fp8": ["1,64,4,3", "1,64,8,3", "1,64,4,4", "1,128,4,3", "1,128,8,3", "1,32,4,4", "1,256,8,2"],
    "exact": ["1,128,8,2", "1,128,8,3", "1,64,8,3", "1,64,4,4", "1,64,8,4", "1,32,4,4", "1,32,8,4",
              "1,32,4,6"],
}


def make_inputs(fmt: str, n_batch: int, n_queries: int, capacity: int, gen: torch.Generator):
    """A cache with n_batch sequences' pages (random page ids, every slot written), the block
    table, q and weights."""
    blocks_per_seq = capacity // BLOCK_SIZE
    num_blocks = n_batch * blocks_per_seq
    table = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(n_batch, blocks_per_seq)
    keys = torch.randn((num_blocks * BLOCK_SIZE, D), generator=gen, device="cuda")
    slots = torch.arange(num_blocks * BLOCK_SIZE, device="cuda")
    q = torch.randn((n_batch, n_queries, H, D), generator=gen, device="cuda")
    if fmt == "fp8":
        cache = new_index_cache(num_blocks, BLOCK_SIZE, device="cuda")
        write_index_keys(cache, keys, slots)
        q = q.to(FP8_DTYPE)
    else:
        cache = keys.view(num_blocks, BLOCK_SIZE, D)
    weights = torch.randn((n_batch, n_queries, H), generator=gen, device="cuda") * (H * D) ** -0.5
    return q, weights, cache, table


def eager_scores(q, weights, cache, table, limit, n_keys):
    """fp32 torch scores of every row over the dequantised keys at the logical positions."""
    pages = dequantize_index_cache(cache) if cache.dtype == torch.uint8 else cache
    pos = torch.arange(n_keys, device="cuda")
    keys = pages[table[:, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE]             # [b, S, D]
    logits = torch.einsum("bthd,bsd->bths", q.float(), keys).relu_()
    scores = torch.einsum("bths,bth->bts", logits, weights)
    return scores.masked_fill(pos > limit[..., None], float("-inf"))


def check(got, expected, fmt) -> str:
    """'' when got matches expected (same -inf mask, relative error below 1e-4, or 1e-2 for fp8, whose
    Hopper tensor-core sums keep fewer bits), else the failure."""
    finite = torch.isfinite(expected)
    rel = ((got[finite] - expected[finite]).norm() / expected[finite].norm()).item()
    if rel < (1e-2 if fmt == "fp8" else 1e-4) and torch.equal(torch.isfinite(got), finite):
        return ""
    return f"WRONG (rel err {rel:.2g})"


def runtime_decode_ms(q, weights, cache, table, limit) -> float:
    """Today's decode indexer (minirt/models/deepseek_v32/layers.py): fp32 keys of every slot the table holds, einsums,
    a full stable sort of each row."""
    keys = cache if cache.dtype == torch.float32 else dequantize_index_cache(cache)
    flat = keys.view(-1, D)
    pos = torch.arange(table.shape[1] * BLOCK_SIZE, device="cuda")
    qf = q.float()

    def step():
        key_slots = table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        logits = torch.einsum("bthd,bsd->bths", qf, flat[key_slots]).relu_()
        scores = torch.einsum("bths,bth->bts", logits, weights).masked_fill(pos > limit[..., None], float("-inf"))
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        return torch.where(torch.isneginf(values[..., :TOPK]), -1, order[..., :TOPK])
    return bench_ms(step)


def topk_cell(scores) -> str:
    """indexer_topk of a prefill chunk's scores over the rows' candidates (its path for many wide rows)
    and over the rows themselves (torch.topk, its path for few rows), checked equal; with the candidates
    a row kept (the top-k alone where a row had more than room for)."""
    over_candidates = indexer_topk(scores, TOPK)
    new_ms = bench_ms(lambda: indexer_topk(scores, TOPK))
    min_rows = lightning_indexer._PRESELECT_MIN_ROWS
    lightning_indexer._PRESELECT_MIN_ROWS = 2**62
    try:
        over_rows = indexer_topk(scores, TOPK)
        old_ms = bench_ms(lambda: indexer_topk(scores, TOPK))
    finally:
        lightning_indexer._PRESELECT_MIN_ROWS = min_rows
    if not torch.equal(over_candidates, over_rows):
        return f"WRONG ({int((over_candidates != over_rows).any(-1).sum())} rows differ)"
    kept = (lightning_indexer._preselect(scores.view(-1, scores.shape[-1]), TOPK)[1] < scores.shape[-1]).sum(-1).float()
    return (f"{new_ms:.3f} ms / {old_ms:.3f} ms (candidates a row: mean {kept.mean():.0f}, max {kept.max():.0f}, "
            f"{int((kept == TOPK).sum())} rows of exactly {TOPK}: overflowed, or tau the k-th score)")


def decode_sweep(fmt: str, gen: torch.Generator, row) -> None:
    """--decode-sweep: the decode scores at B 1 and 16 over DECODE_SWEEP_LENGTH keys with each of
    DECODE_SWEEP_VARIANTS[fmt], checked, then the fastest correct one; row(name, fmt, cell) reports."""
    key_bytes = INDEX_KEY_BYTES if fmt == "fp8" else 4 * D
    for n_batch in DECODE_BATCHES:
        q, weights, cache, table = make_inputs(fmt, n_batch, 1, CAPACITY, gen)
        limit = torch.full((n_batch, 1), DECODE_SWEEP_LENGTH - 1, dtype=torch.int32, device="cuda")
        expected = eager_scores(q, weights, cache, table, limit, CAPACITY)
        traffic = n_batch * (DECODE_SWEEP_LENGTH * key_bytes + CAPACITY * 4)

        def run(config):
            out = paged_indexer_scores(q, weights, cache, table, limit, config=config)
            return check(out, expected, fmt) or bench_ms(
                lambda: paged_indexer_scores(q, weights, cache, table, limit, out=out, config=config))

        launch_sweep(f"decode B {n_batch}, L {DECODE_SWEEP_LENGTH}: scores", paged_config(1, H, D, fmt == "fp8"),
                     DECODE_SWEEP_VARIANTS[fmt], run, lambda ms: f"{traffic / ms / 1e6:.0f} GB/s ({ms:.3f} ms)",
                     lambda label, cell: row(label, fmt, cell))


def programs_sweep(fmt: str, gen: torch.Generator, row) -> None:
    """--programs-sweep: the decode scores with each programs target of PROGRAMS_SWEEP, checked."""
    default, sms = _indexer_tiles.num_programs_target, num_sms(torch.device("cuda"), 0)
    key_bytes = INDEX_KEY_BYTES if fmt == "fp8" else 4 * D
    for n_batch in DECODE_BATCHES:
        q, weights, cache, table = make_inputs(fmt, n_batch, 1, CAPACITY, gen)
        for length in PROGRAMS_SWEEP_LENGTHS:
            limit = torch.full((n_batch, 1), length - 1, dtype=torch.int32, device="cuda")
            expected = eager_scores(q, weights, cache, table, limit, CAPACITY)
            traffic = n_batch * (length * key_bytes + CAPACITY * 4)
            cells = []
            for per_sm in PROGRAMS_SWEEP:
                _indexer_tiles.num_programs_target, indexer_cache._KEPT = (lambda device, n=per_sm * sms: n), {}
                try:
                    wrong = check(paged_indexer_scores(q, weights, cache, table, limit), expected, fmt)
                    ms = bench_ms(lambda: paged_indexer_scores(q, weights, cache, table, limit))
                    cells.append(f"{per_sm} x SMs {ms * 1e3:.1f} µs ({traffic / ms / 1e6:.0f} GB/s)"
                                 + (f" {wrong}" if wrong else ""))
                finally:
                    _indexer_tiles.num_programs_target, indexer_cache._KEPT = default, {}
            row(f"decode scores B {n_batch}, L {length}, by programs a launch", fmt, ", ".join(cells))


def topk_sweep(gen: torch.Generator, row) -> None:
    """--topk-sweep: decode_topk's graph-replay time through each selection, by rows and row length."""
    module = sys.modules[decode_topk.__module__]
    default = module.ROW_PROGRAM_KEYS
    for topk, n_batch, length in itertools.product(*TOPK_SWEEP):
        scores = torch.randn((n_batch, length), generator=gen, device="cuda")
        expected = indexer_topk(scores, topk)
        cells = []
        for name, row_program_keys in (("one program a row", default), ("programs of 2048 keys", 0)):
            if length > row_program_keys > 0:
                continue
            module.ROW_PROGRAM_KEYS, module._KEPT = row_program_keys, {}
            try:
                same = torch.equal(decode_topk(scores, topk), expected)
                ms = do_bench_cudagraph(lambda: decode_topk(scores, topk))
                cells.append(f"{name} {ms * 1e3:.1f} µs" + ("" if same else " (WRONG)"))
            finally:
                module.ROW_PROGRAM_KEYS, module._KEPT = default, {}
        row(f"decode_topk B {n_batch}, L {length}, top {topk} (graph replay)", "-", ", ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="-", help="markdown destination (default stdout)")
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                        help="prefill-chunk launch shapes block_t,block_s,num_warps,num_stages besides the default")
    parser.add_argument("--decode-only", action="store_true", help="only the decode rows (no prefill chunk)")
    parser.add_argument("--sweep", action="store_true",
                        help="only the prefill chunk, over SWEEP_VARIANTS (--variants ignored), naming the fastest")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only the decode scores, over DECODE_SWEEP_VARIANTS, naming the fastest")
    parser.add_argument("--topk-sweep", action="store_true",
                        help="only decode_topk, through each of its selections, over TOPK_SWEEP")
    parser.add_argument("--programs-sweep", action="store_true",
                        help="only the decode scores, by programs a launch (PROGRAMS_SWEEP multiples of the SMs)")
    parser.add_argument("--formats", nargs="*", choices=FORMATS, default=FORMATS, help="cache formats to run")
    args = parser.parse_args()

    matmul_tflops, copy_gbps = measure_ceilings()
    lines = [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}",
        f"- ceilings: bf16 matmul 8192^3 {matmul_tflops:.0f} TFLOP/s, device copy {copy_gbps:.0f} GB/s (read + write)",
        f"- decode: capacity {CAPACITY} (static width), pages of {BLOCK_SIZE} shuffled, H {H}, D {D}, top-k {TOPK}; "
        f"prefill chunk: t {CHUNK_T} over {CHUNK_KEYS} keys",
        "",
        "| what | format | result |",
        "|---|---|---:|",
    ]
    print("\n".join(lines), flush=True)

    def row(name, fmt, cell):
        lines.append(f"| {name} | {fmt} | {cell} |")
        print(lines[-1], flush=True)

    gen = torch.Generator("cuda").manual_seed(0)
    if args.topk_sweep:
        topk_sweep(gen, row)
        args.formats = ()
    for fmt in args.formats if args.decode_sweep else ():
        decode_sweep(fmt, gen, row)
    for fmt in args.formats if args.programs_sweep else ():
        programs_sweep(fmt, gen, row)
    for fmt in () if args.sweep or args.decode_sweep or args.programs_sweep else args.formats:
        key_bytes = INDEX_KEY_BYTES if fmt == "fp8" else 4 * D
        for n_batch in DECODE_BATCHES:
            for length in DECODE_LENGTHS:
                def decode_cells():
                    q, weights, cache, table = make_inputs(fmt, n_batch, 1, CAPACITY, gen)
                    limit = torch.full((n_batch, 1), length - 1, dtype=torch.int32, device="cuda")
                    wrong = check(paged_indexer_scores(q, weights, cache, table, limit),
                                  eager_scores(q, weights, cache, table, limit, CAPACITY), fmt)
                    if wrong:
                        return wrong, wrong, ""
                    traffic = n_batch * (length * key_bytes + CAPACITY * 4)
                    scores_ms = bench_ms(lambda: paged_indexer_scores(q, weights, cache, table, limit))
                    both_ms = bench_ms(lambda: indexer_topk(paged_indexer_scores(q, weights, cache, table, limit), TOPK))
                    scores = paged_indexer_scores(q, weights, cache, table, limit)
                    same = torch.equal(decode_topk(scores, TOPK), indexer_topk(scores, TOPK))
                    topk_ms = [bench_ms(lambda: select(scores, TOPK)) for select in (indexer_topk, decode_topk)]
                    decode_ms = bench_ms(lambda: decode_topk(paged_indexer_scores(q, weights, cache, table, limit), TOPK))
                    today = attempt(lambda: f"{runtime_decode_ms(q, weights, cache, table, limit):.3f} ms")
                    return (f"{traffic / scores_ms / 1e6:.0f} GB/s ({scores_ms:.3f} ms)", f"{both_ms:.3f} ms", today,
                            f"{decode_ms:.3f} ms", f"indexer_topk {topk_ms[0]:.3f} ms, decode_topk {topk_ms[1]:.3f} ms"
                            + ("" if same else " (WRONG: decode_topk differs from indexer_topk)"))
                cells = attempt(decode_cells)
                cells = (cells,) * 5 if isinstance(cells, str) else cells
                name = f"decode B {n_batch}, L {length}"
                row(f"{name}: scores", fmt, cells[0])
                row(f"{name}: scores + indexer_topk", fmt, cells[1])
                row(f"{name}: scores + decode_topk (the runtime's decode)", fmt, cells[3])
                row(f"{name}: top-k alone", fmt, cells[4])
                row(f"{name}: today's torch indexer (einsum + full sort)", fmt, cells[2])

    for fmt in () if args.decode_only or args.decode_sweep or args.programs_sweep else args.formats:
        q, weights, cache, table = make_inputs(fmt, 1, CHUNK_T, CHUNK_KEYS, gen)
        limit = (CHUNK_KEYS - CHUNK_T + torch.arange(CHUNK_T, device="cuda"))[None]
        flops = 2 * H * D * int((limit.long() + 1).sum())
        sample = torch.cat([torch.arange(0, 16, device="cuda"), torch.arange(CHUNK_T - 16, CHUNK_T, device="cuda")])
        expected = eager_scores(q[:, sample], weights[:, sample], cache, table, limit[:, sample], CHUNK_KEYS)
        default = paged_config(CHUNK_T, H, D, fmt == "fp8")

        timed = {}     # launch -> ms, of the correct ones

        def chunk_cell(config, text=None):
            out = paged_indexer_scores(q, weights, cache, table, limit, config=config)
            wrong = check(out[:, sample], expected, fmt)
            if wrong:
                return wrong
            ms = bench_ms(lambda: paged_indexer_scores(q, weights, cache, table, limit, out=out, config=config))
            if text:
                timed[text] = ms
            return f"{flops / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)"

        name = f"prefill chunk t {CHUNK_T} / {CHUNK_KEYS} keys"
        default_text = f"{default.block_t},{default.block_s},{default.num_warps},{default.num_stages}"
        sm90 = indexer_scores_sm90.takes(H, D, BLOCK_SIZE, 1, CHUNK_T, q.device)
        if sm90:
            row(f"{name}: scores, default (sm_90: Gluon, indexer_scores_sm90)", fmt,
                attempt(lambda: chunk_cell(None, "sm90")))
        row(f"{name}: scores, Triton {default_text}{'' if sm90 else ' (default)'}", fmt,
            attempt(lambda: chunk_cell(default, default_text)))
        if fmt == "exact" and not args.sweep:
            # The default launch of keys split as they load: paged_config's, taken under the override.
            with split_as_tiles_load():
                row(f"{name}: scores, default, keys split as each tile loads (decode's path)", fmt,
                    attempt(lambda: chunk_cell(None)))
        if not args.sweep:
            row(f"{name}: scores + indexer_topk", fmt, attempt(lambda: f"{bench_ms(lambda: indexer_topk(paged_indexer_scores(q, weights, cache, table, limit), TOPK)):.3f} ms"))
        row(f"{name}: indexer_topk alone, over candidates / over the rows (torch.topk)", fmt,
            attempt(lambda: topk_cell(paged_indexer_scores(q, weights, cache, table, limit))))
        for text in SWEEP_VARIANTS[fmt] if args.sweep else args.variants:
            row(f"{name}: scores, variant {text}", fmt, attempt(lambda: chunk_cell(parse_variant(text), text)))
        if args.sweep and timed:
            best = min(timed, key=timed.get)
            row(f"{name}: fastest correct launch {best} (default {default_text})", fmt,
                f"{flops / timed[best] / 1e9:.0f} TFLOP/s ({timed[best]:.3f} ms)")
        del q, weights, cache, table

    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
