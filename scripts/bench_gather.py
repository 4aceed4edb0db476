"""Gather bandwidth against the bytes each SM keeps in flight, on the decode benchmark's access pattern.

    python3 scripts/bench_gather.py --out docs/perf/gather-run.md

The fp8 decode kernels read 656-byte cache tokens at random addresses (bench_decode's cache: 2.75 GB,
128 sequences of 32768 tokens in shuffled 64-token pages; the slots of its h_q 16 s_q 1 row). How fast
that can go depends on how many bytes are in flight: here k persistent programs per SM each loop over
T-token chunks, loading one chunk at a time (no software pipelining), so about k * T * 656 bytes are in
flight per SM. The decode producers hold theirs in registers (three 16-token pieces each); this table says
what a given number of bytes in flight buys. Times are medians of do_bench over CUDA-graph replays (L2
cleared before each); ceilings (matmul, copy) are measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from bench_decode import SEQLEN, TOPK, bench_ms, build_cache, build_queries, gather_tokens_kernel
from ceilings import measure_ceilings, write_report

from minirt.formats import KV_TOKEN_BYTES

# (tokens per chunk, warps); programs per SM for each.
SHAPES = [(16, 4), (32, 4), (64, 8)]
PROGRAMS_PER_SM = [1, 2, 3, 4, 6, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="-", help="write the markdown report here (default: stdout)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    peak_tflops, copy_gbps = measure_ceilings("cuda")
    cache, table = build_cache(128, SEQLEN, "cuda")
    slots = build_queries(128, 1, 16, SEQLEN, TOPK, table, seed=1016)[2].reshape(-1)
    rows = []
    for tokens, warps in SHAPES:
        for k in PROGRAMS_PER_SM:
            out = torch.empty(props.multi_processor_count * k, dtype=torch.int32, device="cuda")
            ms = bench_ms(lambda: gather_tokens_kernel[(out.numel(),)](cache.view(torch.int32), slots, out,
                                                                        slots.numel() // tokens, T=tokens,
                                                                        PERSISTENT=True, num_warps=warps))
            rows.append(f"| {tokens} | {warps} | {k} | {k * tokens * KV_TOKEN_BYTES / 1024:.0f} | "
                        f"{slots.numel() * KV_TOKEN_BYTES / ms / 1e6:.0f} |")
            print(rows[-1], flush=True)
    header = (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"Ceilings (same run): bf16 matmul 8192^3 {peak_tflops:.0f} TFLOP/s; device copy {copy_gbps:.0f} GB/s "
              f"(read + write)\n{slots.numel()} random tokens of 656 bytes\n\n")
    table_md = ("| tokens per chunk | warps | programs per SM | ~KB in flight per SM (if all resident) | GB/s |\n"
                "|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    write_report(header + table_md, args.out)


if __name__ == "__main__":
    main()
