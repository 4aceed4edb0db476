"""Benchmark minirt's block-scaled fp8 GEMM and fused MLA head projections on DeepSeek-V3.2's shapes.

    python3 scripts/bench_gemm.py [--out results.md] [--variants 128,128,8,3 64,128,4,4,swap stream:128,4,5 ...]
                                  [--decode-only]

Linear layers: every block-fp8 weight of a V3.2 dense layer used as a GEMM (shapes from
checkpoint.tensor_specs of the v32 preset; kv_b_proj is applied per head, below) at M tokens in
{1, 16, 64, 4096, 16384}. Columns: fp8_gemm as called (its default path, named: "stream", the
weight-streaming kernel for M <= 16; "scaled_mm", torch._scaled_mm with block-wise scales plus the
stream kernel for M % 16 rows; "tiles", the Triton tile kernel), fp8_gemm with the tile kernel forced
(default_config(M)), torch._scaled_mm on the same fp8 operands with DeepSeek's block-wise scales
(1x128 activations, 128x128 weights) where torch supports them on this GPU, else row-wise scales
(speed reference only; the header says which ran), and the bf16 matmul x . W^T with the dequantised
weight. Activations are quantised beforehand (quantize_act_fp8, its time in its own column). Decode
rows (M <= 16) also give the weights' bytes per second (fp8: N x K bytes; bf16: twice that), and a
last line sums a decode step's fp8 linear layers (3 V3.2 layers at M = 1). Targets: prefill (M >=
4096, the target column) fp8_gemm >= 0.8x _scaled_mm and faster than bf16; decode, that sum's
weights streamed at >= 3 TB/s (single small weights cannot: a launch costs microseconds).
--decode-only: M in {1, 16} over the GEMMs the runtime launches (q_a + wk + kv_a, q_b + wq_b and
gate + up fused, as FusedProjection runs them), no head projections (well under 3 minutes).
MLA head projections (H 128, nope = v = 128, latent 512) at T in {1, 4096}: the fused kernels
against torch.bmm with a dequantised bf16 copy of W_v / W_k (plus quantize_act_fp8 for the value
projection, whose fused kernel writes fp8). Every kernel is checked against a dequantised fp32
product first. TFLOP/s (ms), medians of triton.testing.do_bench (which clears the L2 cache before
each call: the weights come from HBM); the ceilings come from the same run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib

import torch
import triton
from triton.testing import do_bench

from ceilings import measure_ceilings, write_report

from minirt.blockfp8 import dequantize_block_fp8, quantize_block_fp8
from minirt.models.deepseek_v32.checkpoint import tensor_specs
from minirt.kernels.mla_head_proj_fp8 import mla_query_absorb, mla_value_proj_fp8
from minirt.synthetic import preset_config

# The module (minirt.kernels re-exports the function fp8_gemm under the module's name).
gemm = importlib.import_module("minirt.kernels.fp8_gemm")

M_VALUES = (1, 16, 64, 4096, 16384)
PREFILL_M = 4096                 # the targets apply from here on
DECODE_LAYERS = 3                # a v32-preset decode step: 3 V3.2 layers (+ a bf16 lm_head, not here)
DECODE_TARGET_GBPS = 3000        # the fp8 weights' rate that keeps that step within 1.5 ms
HEAD_TOKENS = (1, 4096)
CHECK_ROWS = 256                 # rows of each result checked against the fp32 product
REL_TOL = 1e-2                   # bf16 outputs (2^-9 rounding) and fp8 activations on both sides


def linear_shapes():
    """[(names, N, K)] of the v32 preset's block-fp8 GEMM weights, one entry per distinct shape."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, spec in tensor_specs(preset_config("v32", 1), 1).items():
        if spec.quantized and "kv_b_proj" not in name:
            shapes.setdefault(spec.shape, []).append(name.split(".")[-2])
    return [(names, n, k) for (n, k), names in shapes.items()]


# The runtime's fused projections (FusedProjection: one GEMM over weights stacked by rows).
FUSED = (("q_a_proj", "wk", "kv_a_proj_with_mqa"), ("q_b_proj", "wq_b"), ("gate_proj", "up_proj"))


def runtime_shapes():
    """[(names, N, K)] of the GEMMs a v32-preset layer launches: the FUSED groups as one weight each
    (named "a+b"), the other weights as linear_shapes gives them."""
    by_name = {name: (n, k) for names, n, k in linear_shapes() for name in names}
    fused = [(["+".join(group)], sum(by_name[g][0] for g in group), by_name[group[0]][1]) for group in FUSED]
    alone = [([name], n, k) for name, (n, k) in by_name.items() if not any(name in g for g in FUSED)]
    return fused + alone


def bench_ms(fn):
    """Median ms of fn (triton.testing.do_bench, shorter than its defaults: the run stays within a
    minute)."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def scaled_mm_blockwise(a, a_scales, w, w_scales):
    """torch._scaled_mm with DeepSeek's scales, as fp8_gemm's "scaled_mm" path calls it."""
    out = torch.empty((a.shape[0], w.shape[0]), dtype=torch.bfloat16, device=a.device)
    gemm.scaled_mm_blockwise(a, a_scales, w, w_scales, out)
    return out


def scaled_mm_rowwise(a, a_scales, w, w_scales):
    """torch._scaled_mm with one scale per row of a and of w (not the checkpoint's format: a speed
    reference; the scales are the per-row maxima of the block scales)."""
    row_a = a_scales.amax(1, keepdim=True)
    row_w = w_scales.amax(1).repeat_interleave(128)[: w.shape[0]][None, :].contiguous()
    return torch._scaled_mm(a, w.t(), scale_a=row_a, scale_b=row_w, out_dtype=torch.bfloat16)


def pick_scaled_mm():
    """(name, function): block-wise _scaled_mm where fp8_gemm's own check (uses_scaled_mm) accepts
    it on this GPU, else row-wise."""
    if gemm.uses_scaled_mm(PREFILL_M, 128, 512, torch.device("cuda", torch.cuda.current_device())):
        return "block-wise 1x128 / 128x128 scales", scaled_mm_blockwise
    return "row-wise scales (block-wise ones do not run here or disagree with fp8_gemm)", scaled_mm_rowwise


def dequantize(values, scales):
    """Activation values [M, K] e4m3 * scales [M, K / 128] per 128 columns, float32."""
    return (values.float().unflatten(1, (-1, 128)) * scales[..., None]).flatten(1)


def parse_variant(text: str):
    """An extra fp8_gemm launch: "block_m,block_n,num_warps,num_stages[,swap]" (the tile kernel) or
    "stream:block_n,num_warps,num_stages[,k_step[,split_k]]" (the stream kernel, decode rows only)."""
    if text.startswith("stream:"):
        parts = [int(x) for x in text[len("stream:"):].split(",")]
        return gemm.StreamConfig(block_n=parts[0], num_warps=parts[1], num_stages=parts[2],
                                 k_step=parts[3] if len(parts) > 3 else 1, split_k=parts[4] if len(parts) > 4 else None)
    parts = text.split(",")
    block_m, block_n, num_warps, num_stages = (int(x) for x in parts[:4])
    swap = parts[4:] == ["swap"]
    return gemm.Fp8GemmConfig(block_m=block_m, block_n=block_n, swap_ab=swap, group_m=1 if swap else 8,
                              num_warps=num_warps, num_stages=num_stages)


def timed(flops, fn, check=None):
    """'TFLOP/s (ms)' of fn, or why not: check() returns a relative error to accept first."""
    try:
        if check is not None:
            err = check()
            if not err < REL_TOL:
                return f"WRONG (rel err {err:.2g})", None
        ms = bench_ms(fn)
        return f"{flops / ms / 1e9:.3g} ({ms:.3f})", ms
    except Exception as e:  # noqa: BLE001 - a launch that fails is a result too
        return f"failed: {type(e).__name__}", None


def ratio(num_ms, den_ms):
    return f"{den_ms / num_ms:.2f}x" if num_ms and den_ms else "-"


def gbps(nbytes, ms):
    return f"{nbytes / ms / 1e6:.0f}" if ms else "-"


def bench_linears(scaled_name, scaled_mm, variants, lines, shapes=None, m_values=M_VALUES):
    names = ["fp8_gemm", "tiles forced", "_scaled_mm", "bf16 matmul"] + [f"fp8_gemm {v}" for v in variants]
    lines += ["", f"## Linear layers (fp8_gemm vs torch._scaled_mm with {scaled_name})", "",
              "| weight | N x K | M | path | " + " | ".join(names)
              + " | fp8 / _scaled_mm | fp8 / bf16 | weight GB/s fp8, bf16 | target | quantize_act ms |",
              "|---|---|---:|---|" + "---:|" * (len(names) + 5)]
    print("\n".join(lines[-5:]), flush=True)
    device = torch.device("cuda", torch.cuda.current_device())
    decode_ms = 0.0
    decode_bytes = 0
    for names_w, n, k in shapes or linear_shapes():
        gen = torch.Generator("cuda").manual_seed(n + k)
        w, w_scales = quantize_block_fp8(torch.randn(n, k, generator=gen, device="cuda"))
        w_fp32 = dequantize_block_fp8(w, w_scales)
        w_bf16 = w_fp32.bfloat16()
        for m in m_values:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            a, a_scales = gemm.quantize_act_fp8(x)
            rows = min(m, CHECK_ROWS)
            ref = dequantize(a[:rows], a_scales[:rows]) @ w_fp32.T
            flops = 2 * m * n * k
            configs = [None, gemm.default_config(m)] + [parse_variant(v) for v in variants]

            def check(fn):
                return lambda: rel_err(fn()[:rows], ref)

            runs = [lambda c=c: gemm.fp8_gemm(a, a_scales, w, w_scales, config=c) for c in configs]
            runs[2:2] = [lambda: scaled_mm(a, a_scales, w, w_scales), lambda: x @ w_bf16.T]
            # _scaled_mm row-wise computes another product: only its speed is compared. The bf16
            # matmul is checked against the product of its own (unquantised) operands.
            checks = [check(runs[0]), check(runs[1]),
                      check(runs[2]) if scaled_mm is scaled_mm_blockwise else None,
                      lambda: rel_err(x[:rows] @ w_bf16.T, x[:rows].float() @ w_fp32.T)]
            checks += [check(r) for r in runs[4:]]
            # Stream variants apply to decode rows only.
            cells, times = zip(*(("-", None) if isinstance(c, gemm.StreamConfig) and m > gemm.STREAM_MAX_M
                                 else timed(flops, run, chk)
                                 for c, run, chk in zip(configs[:2] + [None, None] + configs[2:], runs, checks)))
            quant_ms = bench_ms(lambda: gemm.quantize_act_fp8(x))
            fp8_ms, _, mm_ms, bf16_ms = times[:4]
            target = "-"
            weight_gbps = "-"
            if m >= PREFILL_M:
                met = bool(fp8_ms and mm_ms and bf16_ms and fp8_ms <= mm_ms / 0.8 and fp8_ms < bf16_ms)
                target = "met" if met else "MISSED"
            elif m <= gemm.STREAM_MAX_M:
                weight_gbps = f"{gbps(n * k, fp8_ms)}, {gbps(2 * n * k, bf16_ms)}"
            if m == 1 and fp8_ms:
                decode_ms += DECODE_LAYERS * len(names_w) * fp8_ms
                decode_bytes += DECODE_LAYERS * len(names_w) * n * k
            path = gemm.default_path(m, n, k, device)
            row = (f"| {', '.join(names_w)} | {n} x {k} | {m} | {path} | " + " | ".join(cells)
                   + f" | {ratio(fp8_ms, mm_ms)} | {ratio(fp8_ms, bf16_ms)} | {weight_gbps} | {target} | {quant_ms:.3f} |")
            lines.append(row)
            print(row, flush=True)
            del x, a, a_scales, ref
        del w, w_scales, w_fp32, w_bf16
        torch.cuda.empty_cache()
    lines += ["", f"Decode step, fp8 linear layers of {DECODE_LAYERS} layers at M = 1 (sum of fp8_gemm medians, "
              f"kv_b_proj and lm_head not included): {decode_ms:.3f} ms, {decode_bytes / 1e9:.2f} GB of weights "
              f"at {gbps(decode_bytes, decode_ms)} GB/s (target >= {DECODE_TARGET_GBPS})"]
    print(lines[-1], flush=True)


def bench_head_projections(lines):
    cfg = preset_config("v32", 1)
    heads, nope, v_dim, latent = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    gen = torch.Generator("cuda").manual_seed(7)
    w, w_scales = quantize_block_fp8(torch.randn(heads * (nope + v_dim), latent, generator=gen, device="cuda"))
    kv_b = dequantize_block_fp8(w, w_scales).view(heads, nope + v_dim, latent)
    w_k, w_v = kv_b[:, :nope].bfloat16(), kv_b[:, nope:].bfloat16()          # [H, nope, C], [H, v, C]
    lines += ["", f"## MLA head projections (H {heads}, nope {nope}, v {v_dim}, latent {latent}; fp8 kv_b_proj)", "",
              "| op | T | fused kernel | torch.bmm, bf16 weight copy | fused / bmm |", "|---|---:|---:|---:|---:|"]
    print("\n".join(lines[-5:]), flush=True)
    for t in HEAD_TOKENS:
        o_lat = torch.randn(t, heads, latent, generator=gen, device="cuda").bfloat16()
        q_nope = torch.randn(t, heads, nope, generator=gen, device="cuda").bfloat16()
        ref_o = torch.einsum("thc,hjc->thj", o_lat.float(), kv_b[:, nope:]).reshape(t, heads * v_dim)
        ref_q = torch.einsum("thn,hnc->thc", q_nope.float(), kv_b[:, :nope])

        def unfused_value():
            o = torch.bmm(o_lat.transpose(0, 1), w_v.transpose(1, 2))          # [H, T, v]
            return gemm.quantize_act_fp8(o.transpose(0, 1).reshape(t, heads * v_dim))

        ops = [("value projection -> fp8", 2 * t * heads * v_dim * latent,
                lambda: mla_value_proj_fp8(o_lat, w, w_scales, nope, v_dim), unfused_value,
                lambda out: rel_err(dequantize(*out), ref_o)),
               ("query absorption", 2 * t * heads * nope * latent,
                lambda: mla_query_absorb(q_nope, w, w_scales, nope, v_dim),
                lambda: torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1),
                lambda out: rel_err(out, ref_q))]
        for name, flops, fused, unfused, err in ops:
            # fp8 outputs carry e4m3 rounding (2^-4 relative per value): a looser bound for them.
            tol = 8 * REL_TOL if "fp8" in name else REL_TOL
            cells = []
            for fn in (fused, unfused):
                e = err(fn())
                cells.append(timed(flops, fn) if e < tol else (f"WRONG (rel err {e:.2g})", None))
            row = (f"| {name} | {t} | {cells[0][0]} | {cells[1][0]} | {ratio(cells[0][1], cells[1][1])} |")
            lines.append(row)
            print(row, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="-", help="markdown report destination (default stdout)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="extra fp8_gemm launches, one column each: the tile kernel's "
                             "block_m,block_n,num_warps,num_stages[,swap] (swap: b . a^T; split-K automatic) "
                             "or the stream kernel's stream:block_n,num_warps,num_stages[,k_step[,split_k]] (M <= 16)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only M = 1 and 16, over the GEMMs the runtime launches (fused projections: "
                             "runtime_shapes); no MLA head projections")
    args = parser.parse_args()
    for v in args.variants:
        parse_variant(v)
    mm_tflops, copy_gbs = measure_ceilings()
    scaled_name, scaled_mm = pick_scaled_mm()
    lines = [
        "# fp8 GEMM benchmark",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {triton.__version__}",
        f"- ceilings: bf16 matmul 8192^3 {mm_tflops:.0f} TFLOP/s, device copy {copy_gbs:.0f} GB/s (read + write)",
        f"- torch._scaled_mm ran with {scaled_name}",
        f"- fp8_gemm paths: stream for M <= {gemm.STREAM_MAX_M} ({gemm.STREAM_CONFIG}, split-K automatic); "
        "scaled_mm above where uses_scaled_mm; else tiles",
        f"- tile kernel launch (tiles forced): M > 128 {gemm.PREFILL_CONFIG}; M <= 128 decode_config(M), "
        f"e.g. {gemm.decode_config(64)}",
        "- cells: TFLOP/s (ms); ratios are speedups of fp8_gemm (> 1: fp8_gemm faster); target (M >= "
        f"{PREFILL_M}): fp8_gemm >= 0.8x _scaled_mm and > 1x bf16; decode: see the last line",
    ]
    print("\n".join(lines), flush=True)
    if args.decode_only:
        bench_linears(scaled_name, scaled_mm, args.variants, lines, runtime_shapes(), (1, 16))
    else:
        bench_linears(scaled_name, scaled_mm, args.variants, lines)
        bench_head_projections(lines)
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
