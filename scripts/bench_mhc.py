"""Time DeepSeek-V4's mHC kernels (kernels/mhc.py) at decode and prefill token counts, in the launch shapes
the public functions choose (and, with --sweep, hc_pre's others).

    python3 scripts/bench_mhc.py [--out mhc-run.md] [--tokens 1 16 64 4096 16384] [--sweep]

v4-flash shapes: hidden D 4096, hc_mult 4 (fn [24, 16384] fp32, 1.5 MB). Each launch shape is first
checked against the fp32 torch reference (models/deepseek_v4/reference.py: relative-norm errors of
collapsed, post, comb and hc_post's output; outputs poisoned with NaN first). µs: medians of do_bench
over CUDA-graph replays, L2 cleared before each. GB/s counts the fewest bytes a call must move (hc_pre:
X and fn read, collapsed, post, comb written; hc_post: F, X, post, comb read, X' written) against the
device copy ceiling measured in the same run. --sweep adds hc_pre's other launch shapes (rows a
program, columns a step, tl.dot, column splits) and hc_post with all of D a program.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from bench_decode import bench_ms
from ceilings import measure_ceilings, write_report

from minirt.kernels import mhc
from minirt.models.deepseek_v4 import reference
from minirt.synthetic import preset_config

TOKENS = [1, 16, 64, 4096, 16384]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="-", help="write the markdown report here (default: stdout)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--sweep", action="store_true", help="also time hc_pre's other launch shapes")
    args = parser.parse_args()
    cfg = preset_config("v4-flash")
    hc, D = cfg.hc_mult, cfg.hidden_size
    mix = dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    props = torch.cuda.get_device_properties(0)
    _, copy_gbps = measure_ceilings("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(cfg.hc_dim, hc * D, generator=g, device="cuda") * 0.05
    base = torch.randn(cfg.hc_dim, generator=g, device="cuda")
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    rows = []
    for N in args.tokens:
        X = torch.randn(N, hc, D, generator=g, device="cuda")
        F = torch.randn(N, D, generator=g, device="cuda")
        expect = reference.hc_pre(X, fn, base, scale, cfg)
        expect_post = reference.hc_post(F, X, expect[1], expect[2])
        pre_bytes = 4 * (X.numel() + fn.numel() + N * D + N * hc + N * hc * hc)
        post_bytes = 4 * (F.numel() + 2 * X.numel() + N * hc + N * hc * hc)
        tile_rows, block, dot = mhc._pre_tile(N, hc)
        shapes = [("chosen", tile_rows, block, dot, mhc.hc_pre_splits(N, tile_rows, hc, D, X.device))]
        if args.sweep:
            shapes += [("sweep", 1, 256, False, s) for s in (1, 8, 32, 64, 128) if N <= 64]
            shapes += [("sweep", r, b, True, s) for r in (16, 32, 64, 128) for b in (32, 64) for s in (1, 2, 8, 32)
                       if r <= max(16, triton.next_power_of_2(N)) and (s <= 2 or N <= 64)]
        for label, r, b, dot, s in shapes:
            out = [torch.full((N, D), float("nan"), device="cuda"), torch.full((N, hc), float("nan"), device="cuda"),
                   torch.full((N, hc, hc), float("nan"), device="cuda")]
            run = lambda: mhc._launch_hc_pre(X, fn, base, scale, *out, mix["eps"], mix["hc_eps"],  # noqa: E731
                                             mix["sinkhorn_iters"], r, b, dot, s)
            run()
            err = max(rel(got, want) for got, want in zip(out, expect))
            us = bench_ms(run) * 1e3
            rows.append(f"| hc_pre | {N} | {label} (rows {r}, block {b}, {'tl.dot' if dot else 'broadcast'}, "
                        f"splits {s}) | {us:.1f} | {pre_bytes / us / 1e3:.0f} | {err:.1e} |")
            print(rows[-1], flush=True)
        post_shapes = [("chosen", mhc._d_slice(D, N, X.device))] + ([("sweep", D)] if args.sweep else [])
        for label, d_slice in post_shapes:
            out = torch.full_like(X, float("nan"))
            run = lambda: mhc._launch_hc_post(F, X, expect[1], expect[2], out, 1, d_slice)  # noqa: E731
            run()
            err = rel(out, expect_post)
            us = bench_ms(run) * 1e3
            rows.append(f"| hc_post | {N} | {label} (D slice {d_slice}) | {us:.1f} | {post_bytes / us / 1e3:.0f} | "
                        f"{err:.1e} |")
            print(rows[-1], flush=True)
    header = (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"Ceiling (same run): device copy {copy_gbps:.0f} GB/s (read + write); v4-flash D {D}, hc {hc}\n\n")
    table = ("| kernel | tokens | launch shape | µs | GB/s (fewest bytes) | max rel. error vs fp32 reference |\n"
             "|---|---:|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    write_report(header + table, args.out)


if __name__ == "__main__":
    main()
