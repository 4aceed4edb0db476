"""Benchmark the fp8 sparse MLA decode kernel on the GPU, with ceilings measured in the same run.

    python3 scripts/bench_decode.py --out docs/perf/decode_run.md

Shapes (DeepSeek-V3.2 decode): b = 128 sequences of 4096..8192 cached tokens each (pages of 64 in
shuffled order, ~0.5 GB of fp8 cache, far beyond L2), top-k 2048 distinct random valid positions per
query token, s_q = 1 and 2. h_q = 128 is compute-bound: TFLOP/s with FLOPs = 2 b s_q h_q topk (576 +
512). h_q = 16 is memory-bound: effective GB/s counting 656 bytes per attended token,
b s_q topk 656. Ceilings: a bf16 8192^3 torch matmul (TFLOP/s) and a 1 GiB device copy (GB/s,
bytes read + written). Each variant's output is compared with the default configuration's
(max |diff|), so a fast but wrong variant shows. Times are medians of triton.testing.do_bench,
which clears L2 before every repetition.
"""
from __future__ import annotations

import argparse
import datetime
import time

import torch
import triton
import triton.testing
from ceilings import measure_ceilings, plot_roofline

from minirt.formats import KV_TOKEN_BYTES
from minirt.kernels import sparse_mla_decode_sm90 as sm90
from minirt.kernels.kv_cache_fp8 import new_kv_cache, positions_to_slots
from minirt.kernels.sparse_mla_decode import (default_config, default_num_splits, mla_decode_fp8,
                                              sparse_mla_decode_fp8, uses_sm90_kernel)

TOPK = 2048
BLOCK_SIZE = 64
SM_SCALE = 0.135234   # (qk_nope + qk_rope)^-0.5 * mscale^2 for V3.2 (192^-0.5 * 1.3689^2)

# (h_q, s_q, config, num_splits or None for the heuristic). config None: the public default (the
# Gluon kernel on sm_90 GPUs); PORTABLE: the portable Triton kernel with default_config(h_q); a
# DecodeConfig: the portable kernel with that launch shape.
PORTABLE = "portable"
VARIANTS = [
    (128, 2, None, None),
    (128, 2, PORTABLE, None),
    (128, 2, None, 2),
    (128, 1, None, None),
    (128, 1, PORTABLE, None),
    (128, 1, None, 3),
    (16, 1, None, None),
    (16, 1, PORTABLE, None),
    (16, 1, None, 3),
    (16, 1, None, 4),
    (16, 2, None, None),
    (16, 2, PORTABLE, None),
    (16, 2, None, 2),
]


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def build_problem(b, device, seed=0):
    """Paged cache of b sequences with 4096..8192 tokens, block table, random (valid) cache bytes."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(4096, 8193, (b,), generator=g)
    pages = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(pages.sum())
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_pages = int(pages.max())
    table = torch.full((b, max_pages), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages.tolist()):
        table[i, :n] = order[start:start + n]
        start += n
    cache = new_kv_cache(num_blocks, BLOCK_SIZE, device=device)
    # random fp8 codes (no NaN, |v| <= 416), scales 2^-8..2^-6 (values up to ~6.5), random bf16 rope
    flat = cache.view(-1, KV_TOKEN_BYTES)
    flat[:, :512] = torch.randint(0, 0x7E, (flat.shape[0], 512), device=device, dtype=torch.uint8) \
        | (torch.randint(0, 2, (flat.shape[0], 512), device=device, dtype=torch.uint8) << 7)
    flat[:, 512:528] = torch.exp2(torch.randint(-8, -5, (flat.shape[0], 4), device=device).float()) \
        .view(torch.uint8)
    flat[:, 528:] = torch.randn(flat.shape[0], 64, device=device).to(torch.bfloat16).view(torch.uint8)
    return cache, table.to(device), lengths.to(device)


def topk_positions(b, s_q, lengths, seed):
    """TOPK distinct random positions < length per (sequence, query token)."""
    g = torch.Generator(device=lengths.device).manual_seed(seed)
    scores = torch.rand(b, s_q, int(lengths.max()), device=lengths.device, generator=g)
    scores = scores.masked_fill(torch.arange(scores.shape[-1], device=lengths.device) >= lengths[:, None, None], -1)
    return scores.topk(TOPK, dim=-1).indices.to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as a markdown table here")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting new variants after this many seconds")
    parser.add_argument("--batch", type=int, default=128, help="sequences (b)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=None,
                        help="comma-separated indices into VARIANTS (default: all)")
    parser.add_argument("--plot", help="write a roofline PNG of the default configs here")
    args = parser.parse_args()
    t_start = time.time()
    points = []
    device = torch.device(args.device)
    props = torch.cuda.get_device_properties(device)
    peak_tflops, copy_gbps = measure_ceilings(device)
    header = (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"Ceilings (same run): bf16 matmul 8192^3 {peak_tflops:.0f} TFLOP/s; "
              f"device copy {copy_gbps:.0f} GB/s (read + write)\n")
    print(header, flush=True)
    b = args.batch
    cache, table, lengths = build_problem(b, device)
    print(f"cache: {cache.shape[0]} blocks x {BLOCK_SIZE} tokens = {cache.numel() / 1e9:.2f} GB", flush=True)
    problems, reference_out = {}, {}
    rows = []
    chosen = VARIANTS if args.variants is None else [VARIANTS[int(i)] for i in args.variants.split(",")]
    for h_q, s_q, config, num_splits in chosen:
        if time.time() - t_start > args.budget_s:
            rows.append(f"| {h_q} | {s_q} | {config or 'default'} | {num_splits} | skipped: time budget | | | | |")
            continue
        if (h_q, s_q) not in problems:
            q = (torch.randn(b, s_q, h_q, 576, device=device) * 0.5).to(torch.bfloat16)
            positions = topk_positions(b, s_q, lengths, seed=s_q)
            problems[(h_q, s_q)] = (q, positions, positions_to_slots(positions, table, cache))
        q, positions, slots = problems[(h_q, s_q)]
        cfg = default_config(h_q) if config == PORTABLE else config
        splits = num_splits or default_num_splits(q, TOPK, cfg)
        shown = cfg or default_config(h_q)
        label = (f"sm90 Gluon, h{sm90.BLOCK_H.value} n{sm90.BLOCK_N.value} w{sm90.NUM_WARPS.value}"
                 if uses_sm90_kernel(q, cfg) else
                 f"portable h{shown.block_h} n{shown.block_n} w{shown.num_warps} s{shown.num_stages}")
        label += " (default)" if config is None else ""
        try:
            run = lambda: sparse_mla_decode_fp8(q, cache, slots, SM_SCALE, num_splits=splits, config=cfg)
            out, _ = run()
            torch.cuda.synchronize()
            if (h_q, s_q) not in reference_out:
                reference_out[(h_q, s_q)] = out
            diff = (out.float() - reference_out[(h_q, s_q)].float()).abs().max().item()
            ms = bench_ms(run)
        except Exception as exc:   # a variant that fails to compile or launch is a result, not a crash
            rows.append(f"| {h_q} | {s_q} | {label} | {splits} | error: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:80]} | | | | |")
            print(rows[-1], flush=True)
            continue
        flops = 2 * b * s_q * h_q * TOPK * (576 + 512)
        bytes_ = b * s_q * TOPK * KV_TOKEN_BYTES
        tflops, gbps = flops / ms / 1e9, bytes_ / ms / 1e6
        rows.append(f"| {h_q} | {s_q} | {label} | {splits} | {ms * 1e3:.1f} | {tflops:.1f} "
                    f"({100 * tflops / peak_tflops:.0f}%) | {gbps:.0f} ({100 * gbps / copy_gbps:.0f}%) | "
                    f"{diff:.2e} |")
        print(rows[-1], flush=True)
        if config is None and num_splits is None:
            points.append((f"h{h_q} s_q{s_q}", flops, bytes_, ms * 1e-3))
            ms_wrapper = bench_ms(lambda: mla_decode_fp8(q, cache, table, positions, SM_SCALE))
            rows.append(f"| {h_q} | {s_q} | mla_decode_fp8 (positions→slots + decode) | {splits} | "
                        f"{ms_wrapper * 1e3:.1f} | {flops / ms_wrapper / 1e9:.1f} | "
                        f"{bytes_ / ms_wrapper / 1e6:.0f} | |")
            print(rows[-1], flush=True)
    table_md = ("| h_q | s_q | config (BLOCK_H, BLOCK_N, warps, stages) | splits | time µs | TFLOP/s "
                "(% of matmul) | eff. GB/s (% of copy) | max abs diff vs default |\n"
                "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(table_md, flush=True)
    if args.plot:
        plot_roofline(args.plot, f"sparse_mla_decode_fp8, b {b}, topk {TOPK}", points, peak_tflops, copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"b = {b}, topk = {TOPK}, block_size = {BLOCK_SIZE}\n\n{header}\n{table_md}")


if __name__ == "__main__":
    main()
