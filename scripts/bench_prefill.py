"""Benchmark minirt.kernels.sparse_mla_prefill on the GPU against the hardware ceilings and eager torch.

    python3 scripts/bench_prefill.py [--out results.md] [--variants 64,8,2 32,8,3 ...]

TFLOP/s counts 2 * attended * h_q * (d_qk + d_v), attended = s_q * topk, or sum(topk_length) where
given. The ceilings (bf16 8192^3 matmul, device copy) are measured in the same run; times are
triton.testing.do_bench medians. Indices are uniform random rows of kv, all valid, unsorted. Every kernel variant is first checked against the eager
baseline on 64 query rows.

A second table, DeepSeek-V4's prefill over two key sources (sparse_mla_prefill_two_sources: s_q 4096
queries, each with a window of 128 rows of the chunk's 4096 window keys and extra_topk rows of 16384
compressed entries; CSA: all used, HCA: extra_topk_length uniform in [0, extra_topk]; attn_sink on):
the call, the same attention through sparse_mla_prefill on the already combined buffer and index list,
and the combining alone, so the gather's share of the call shows.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

from ceilings import measure_ceilings, plot_roofline, write_report

from minirt.kernels.sparse_mla_prefill import PrefillConfig, default_config, sparse_mla_prefill
from minirt.kernels.sparse_mla_prefill_two_sources import combine_sources, sparse_mla_prefill_two_sources

S_Q, D_V = 4096, 512
# (s_kv, h_q, d_qk, topk, attn_sink and topk_length): FlashMLA's benchmark shapes, V3.2's (d_qk 576)
# and V4's (d_qk 512). The extras row draws topk_length uniformly in [0, topk].
SHAPES = [(32768, 128, 576, 2048, False), (8192, 128, 576, 2048, False), (32768, 64, 576, 2048, False),
          (8192, 64, 576, 2048, False), (32768, 64, 512, 512, False), (32768, 128, 512, 1024, False),
          (32768, 128, 512, 2048, False), (32768, 128, 576, 2048, True)]


def eager_prefill(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None, chunk=256):
    """Gather + bf16 matmuls + fp32 softmax, chunked over s_q to bound the gathered copy; the keys at
    and past topk_length are masked, the sink joins the softmax's denominator."""
    out = torch.empty((q.shape[0], q.shape[1], d_v), dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[0], chunk):
        k = kv[:, 0][indices[start:start + chunk, 0].long()]                 # [c, topk, d_qk]
        logits = torch.matmul(q[start:start + chunk], k.transpose(1, 2)).float() * sm_scale
        if topk_length is not None:
            masked = torch.arange(k.shape[1], device=q.device) >= topk_length[start:start + chunk, None, None]
            logits = logits.masked_fill(masked, float("-inf"))
        if attn_sink is not None:
            logits = torch.cat([logits, attn_sink[None, :, None].expand(logits.shape[0], -1, 1)], -1)
        p = torch.softmax(logits, -1).nan_to_num()[..., :k.shape[1]].to(q.dtype)
        out[start:start + chunk] = torch.matmul(p, k[..., :d_v])
    return out


def portable(config=None):
    """The portable Triton kernel with a launch config (default_config when None)."""
    return lambda q, kv, idx, scale, **extras: sparse_mla_prefill(
        q, kv, idx, scale, D_V, config=config or default_config(q.shape[1]), **extras)


def parse_variant(text: str):
    block_n, num_warps, num_stages = (int(x) for x in text.split(","))
    return portable(PrefillConfig(block_h=64, block_n=block_n, num_warps=num_warps, num_stages=num_stages))


# (h_q, extra_topk, extra_topk_length): V4-Flash / V4-Pro CSA layers, an HCA layer (dense over a few entries).
V4_WINDOW_ROWS, V4_EXTRA_ROWS, V4_WINDOW_TOPK = 4096, 16384, 128
V4_SHAPES = [(64, 512, False), (128, 1024, False), (64, 32, True)]


def two_source_rows() -> list[str]:
    """The DeepSeek-V4 table (see the module docstring), as markdown lines."""
    lines = ["", f"DeepSeek-V4 prefill over two sources: s_q {S_Q}, d_qk = d_v = 512, window topk {V4_WINDOW_TOPK} of "
             f"{V4_WINDOW_ROWS} rows, extra topk of {V4_EXTRA_ROWS} compressed rows, attn_sink on; TFLOP/s on the "
             "attended entries (ms)", "",
             "| h_q | extra topk | extra_topk_length | two-source call | prefill on the combined buffer | "
             "combining alone (ms) | combining's share of the call |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for h_q, extra_topk, with_length in V4_SHAPES:
        gen = torch.Generator("cuda").manual_seed(1)
        q = torch.randn((S_Q, h_q, 512), generator=gen, device="cuda").bfloat16()
        kv = torch.randn((V4_WINDOW_ROWS, 1, 512), generator=gen, device="cuda").bfloat16()
        extra_kv = torch.randn((V4_EXTRA_ROWS, 1, 512), generator=gen, device="cuda").bfloat16()
        idx = torch.randint(0, V4_WINDOW_ROWS, (S_Q, 1, V4_WINDOW_TOPK), generator=gen, device="cuda",
                            dtype=torch.int32)
        extra_idx = torch.randint(0, V4_EXTRA_ROWS, (S_Q, 1, extra_topk), generator=gen, device="cuda",
                                  dtype=torch.int32)
        sink = torch.randn(h_q, generator=gen, device="cuda")
        extra_len = (torch.randint(0, extra_topk + 1, (S_Q,), generator=gen, device="cuda", dtype=torch.int32)
                     if with_length else None)
        attended = S_Q * V4_WINDOW_TOPK + (S_Q * extra_topk if extra_len is None else int(extra_len.sum()))
        flops = 2 * attended * h_q * (512 + D_V)
        kv_all, idx_all, len_all = combine_sources(kv, idx, extra_kv, extra_idx, None, extra_len)
        first = None if len_all is None else len_all[:64]
        expected = eager_prefill(q[:64], kv_all, idx_all[:64], 512 ** -0.5, D_V, sink, first).float()
        got = sparse_mla_prefill_two_sources(q[:64], kv, idx[:64], extra_kv, extra_idx[:64], 512 ** -0.5, D_V, sink,
                                             None, None if extra_len is None else extra_len[:64])[0].float()
        rel = ((got - expected).norm() / expected.norm()).item()
        call = do_bench(lambda: sparse_mla_prefill_two_sources(q, kv, idx, extra_kv, extra_idx, 512 ** -0.5, D_V, sink,
                                                               None, extra_len), return_mode="median")
        combined = do_bench(lambda: sparse_mla_prefill(q, kv_all, idx_all, 512 ** -0.5, D_V, sink, len_all),
                            return_mode="median")
        combining = do_bench(lambda: combine_sources(kv, idx, extra_kv, extra_idx, None, extra_len),
                             return_mode="median")
        wrong = "" if rel < 1e-2 else f" WRONG (rel err {rel:.2g})"
        lines.append(f"| {h_q} | {extra_topk} | {'[0, extra_topk]' if with_length else 'full'} | "
                     f"{flops / call / 1e9:.0f} ({call:.2f}){wrong} | {flops / combined / 1e9:.0f} ({combined:.2f}) | "
                     f"{combining:.3f} | {100 * combining / call:.1f}% |")
        print(lines[-1], flush=True)
        del q, kv, extra_kv, kv_all, idx_all
        torch.cuda.empty_cache()
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="-", help="markdown table destination (default stdout)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="extra portable-kernel configs block_n,num_warps,num_stages (block_h 64)")
    parser.add_argument("--plot", help="write a roofline PNG of the default config here")
    parser.add_argument("--cases", choices=("all", "v4"), default="all",
                        help="every table, or only the DeepSeek-V4 two-source one")
    args = parser.parse_args()
    # "default" is the public function: the Gluon kernel on sm_90 (d_qk 576 and 512), the portable
    # kernel otherwise; "portable" forces the Triton kernel with its default config.
    variants = ([("default", lambda q, kv, idx, scale, **extras: sparse_mla_prefill(q, kv, idx, scale, D_V, **extras)),
                 ("portable", portable())] + [(v, parse_variant(v)) for v in args.variants])
    points = []

    mm_tflops, copy_gbs = measure_ceilings()
    lines = [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}",
        f"- ceilings: bf16 matmul 8192^3 {mm_tflops:.0f} TFLOP/s, device copy {copy_gbs:.0f} GB/s (read + write)",
        f"- s_q {S_Q}, indices uniform random over s_kv (unsorted), d_v {D_V}; TFLOP/s (ms)",
        f"- portable kernel's default config: {default_config(128)}",
        "",
        "| s_kv | h_q | d_qk | topk | eager torch | " + " | ".join(name for name, _ in variants) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(variants),
    ]
    print("\n".join(lines), flush=True)

    for s_kv, h_q, d_qk, topk, with_extras in SHAPES if args.cases == "all" else []:
        gen = torch.Generator("cuda").manual_seed(0)
        q = torch.randn((S_Q, h_q, d_qk), generator=gen, device="cuda").bfloat16()
        kv = torch.randn((s_kv, 1, d_qk), generator=gen, device="cuda").bfloat16()
        indices = torch.randint(0, s_kv, (S_Q, 1, topk), generator=gen, device="cuda", dtype=torch.int32)
        extras = {}
        attended = S_Q * topk
        if with_extras:
            sink = torch.randn(h_q, generator=gen, device="cuda")   # drawn first, as in the recorded runs
            lengths = torch.randint(0, topk + 1, (S_Q,), generator=gen, device="cuda", dtype=torch.int32)
            extras = {"attn_sink": sink, "topk_length": lengths}
            attended = int(lengths.sum())
        first = {k: v[:64] if k == "topk_length" else v for k, v in extras.items()}
        sm_scale = d_qk**-0.5
        flops = 2 * attended * h_q * (d_qk + D_V)
        expected = eager_prefill(q[:64], kv, indices[:64], sm_scale, D_V, **first).float()

        def fmt(ms):
            return f"{flops / ms / 1e9:.0f} ({ms:.2f})"

        cells = [fmt(do_bench(lambda: eager_prefill(q, kv, indices, sm_scale, D_V, **extras), return_mode="median"))]
        for name, run in variants:
            try:
                got = run(q[:64], kv, indices[:64], sm_scale, **first)[0].float()
                rel = ((got - expected).norm() / expected.norm()).item()
                if not rel < 1e-2:
                    cells.append(f"WRONG (rel err {rel:.2g})")
                    continue
                ms = do_bench(lambda: run(q, kv, indices, sm_scale, **extras), return_mode="median")
                cells.append(fmt(ms))
                if name == "default":  # fewest bytes: q, each gathered kv row once, indices, out
                    nbytes = 2 * (S_Q * h_q * (d_qk + D_V) + attended * d_qk) + 4 * S_Q * topk
                    points.append((f"h{h_q} kv{s_kv // 1024}k d{d_qk}", flops, nbytes, ms * 1e-3))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
                cells.append(f"failed: {type(e).__name__}")
        name = f"{topk}" + (" +sink +topk_length" if with_extras else "")
        row = f"| {s_kv} | {h_q} | {d_qk} | {name} | " + " | ".join(cells) + " |"
        lines.append(row)
        print(row, flush=True)
        del q, kv, indices
        torch.cuda.empty_cache()

    lines += two_source_rows()
    if args.plot:
        plot_roofline(args.plot, f"sparse_mla_prefill, s_q {S_Q}", points, mm_tflops, copy_gbs)
    text = "\n".join(lines) + "\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()
