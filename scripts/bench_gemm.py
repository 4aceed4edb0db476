"""Benchmark minirt's block-scaled fp8 GEMM and fused MLA head projections on DeepSeek-V3.2's shapes.

    python3 scripts/bench_gemm.py [--out results.md] [--variants 128,128,8,3 64,128,4,4,swap ...]

Linear layers: every block-fp8 weight of a V3.2 dense layer used as a GEMM (shapes from
checkpoint.tensor_specs of the v32 preset; kv_b_proj is applied per head, below) at M tokens in
{1, 64, 4096, 16384}. Beside fp8_gemm (its default launch for M): torch._scaled_mm on the same fp8
operands, with DeepSeek's block-wise scales (1x128 activations, 128x128 weights) where torch supports
them on this GPU, else row-wise scales (speed reference only; the header says which ran), and the
bf16 matmul x . W^T with the dequantised weight. Activations are quantised beforehand (quantize_act_fp8,
its time in its own column). Target (prefill, M >= 4096): fp8_gemm >= 0.8x _scaled_mm and faster than
bf16. MLA head projections (H 128, nope = v = 128, latent 512) at T in {1, 4096}: the fused kernels
against torch.bmm with a dequantised bf16 copy of W_v / W_k (plus quantize_act_fp8 for the value
projection, whose fused kernel writes fp8). Every kernel is checked against a dequantised fp32
product first. TFLOP/s (ms), medians of triton.testing.do_bench; the ceilings come from the same run.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

from ceilings import measure_ceilings, write_report

from minirt.blockfp8 import dequantize_block_fp8, quantize_block_fp8
from minirt.checkpoint import tensor_specs
from minirt.kernels.fp8_gemm import PREFILL_CONFIG, Fp8GemmConfig, decode_config, fp8_gemm, quantize_act_fp8
from minirt.kernels.mla_head_proj_fp8 import mla_query_absorb, mla_value_proj_fp8
from minirt.synthetic import preset_config

M_VALUES = (1, 64, 4096, 16384)
PREFILL_M = 4096                 # the targets apply from here on
HEAD_TOKENS = (1, 4096)
CHECK_ROWS = 256                 # rows of each result checked against the fp32 product
REL_TOL = 1e-2                   # bf16 outputs (2^-9 rounding) and fp8 activations on both sides


def linear_shapes():
    """[(names, N, K)] of the v32 preset's block-fp8 GEMM weights, one entry per distinct shape."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, spec in tensor_specs(preset_config("v32", 1), 1).items():
        if spec.quantized and "kv_b_proj" not in name:
            shapes.setdefault(spec.shape, []).append(name.split(".")[-2])
    return [(", ".join(names), n, k) for (n, k), names in shapes.items()]


def bench_ms(fn):
    """Median ms of fn (triton.testing.do_bench, shorter than its defaults: the run stays within a
    minute)."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def scaled_mm_blockwise(a, a_scales, w, w_scales):
    """torch._scaled_mm with DeepSeek's scales: 1x128 for a (outer-dim-major, as cuBLAS wants) and the
    checkpoint's 128x128 weight scales (their transpose is the stored row-major tensor)."""
    return torch._scaled_mm(a, w.t(), scale_a=a_scales.t().contiguous().t(), scale_b=w_scales.t(),
                            out_dtype=torch.bfloat16)


def scaled_mm_rowwise(a, a_scales, w, w_scales):
    """torch._scaled_mm with one scale per row of a and of w (not the checkpoint's format: a speed
    reference; the scales are the per-row maxima of the block scales)."""
    row_a = a_scales.amax(1, keepdim=True)
    row_w = w_scales.amax(1).repeat_interleave(128)[: w.shape[0]][None, :].contiguous()
    return torch._scaled_mm(a, w.t(), scale_a=row_a, scale_b=row_w, out_dtype=torch.bfloat16)


def pick_scaled_mm():
    """(name, function): block-wise _scaled_mm if it runs here and agrees with the dequantised
    product, else row-wise."""
    gen = torch.Generator("cuda").manual_seed(1)
    a, a_scales = quantize_act_fp8(torch.randn(256, 512, generator=gen, device="cuda"))
    w, w_scales = quantize_block_fp8(torch.randn(384, 512, generator=gen, device="cuda"))
    ref = dequantize(a, a_scales) @ dequantize_block_fp8(w, w_scales).T
    try:
        err = rel_err(scaled_mm_blockwise(a, a_scales, w, w_scales), ref)
        if err < REL_TOL:
            return "block-wise 1x128 / 128x128 scales", scaled_mm_blockwise
        reason = f"block-wise ran but is off by {err:.2g}"
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, ValueError or NotImplementedError
        reason = f"block-wise unsupported: {str(e).splitlines()[0][:120]}"
    return f"row-wise scales ({reason})", scaled_mm_rowwise


def dequantize(values, scales):
    """Activation values [M, K] e4m3 * scales [M, K / 128] per 128 columns, float32."""
    return (values.float().unflatten(1, (-1, 128)) * scales[..., None]).flatten(1)


def parse_variant(text: str) -> Fp8GemmConfig:
    parts = text.split(",")
    block_m, block_n, num_warps, num_stages = (int(x) for x in parts[:4])
    swap = parts[4:] == ["swap"]
    return Fp8GemmConfig(block_m=block_m, block_n=block_n, swap_ab=swap, group_m=1 if swap else 8,
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


def bench_linears(scaled_name, scaled_mm, variants, lines):
    names = ["fp8_gemm", "_scaled_mm", "bf16 matmul"] + [f"fp8_gemm {v}" for v in variants]
    lines += ["", f"## Linear layers (fp8_gemm vs torch._scaled_mm with {scaled_name})", "",
              "| weight | N x K | M | " + " | ".join(names) + " | fp8 / _scaled_mm | fp8 / bf16 | target | quantize_act ms |",
              "|---|---|---:|" + "---:|" * (len(names) + 4)]
    print("\n".join(lines[-5:]), flush=True)
    for names_w, n, k in linear_shapes():
        gen = torch.Generator("cuda").manual_seed(n + k)
        w, w_scales = quantize_block_fp8(torch.randn(n, k, generator=gen, device="cuda"))
        w_fp32 = dequantize_block_fp8(w, w_scales)
        w_bf16 = w_fp32.bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            a, a_scales = quantize_act_fp8(x)
            rows = min(m, CHECK_ROWS)
            ref = dequantize(a[:rows], a_scales[:rows]) @ w_fp32.T
            flops = 2 * m * n * k

            def check(fn):
                return lambda: rel_err(fn()[:rows], ref)

            runs = [lambda: fp8_gemm(a, a_scales, w, w_scales),
                    lambda: scaled_mm(a, a_scales, w, w_scales),
                    lambda: x @ w_bf16.T]
            runs += [lambda v=v: fp8_gemm(a, a_scales, w, w_scales, config=parse_variant(v)) for v in variants]
            # _scaled_mm row-wise computes another product: only its speed is compared. The bf16
            # matmul is checked against the product of its own (unquantised) operands.
            checks = [check(runs[0]), check(runs[1]) if scaled_mm is scaled_mm_blockwise else None,
                      lambda: rel_err(x[:rows] @ w_bf16.T, x[:rows].float() @ w_fp32.T)]
            checks += [check(r) for r in runs[3:]]
            cells, times = zip(*(timed(flops, run, chk) for run, chk in zip(runs, checks)))
            quant_ms = bench_ms(lambda: quantize_act_fp8(x))
            fp8_ms, mm_ms, bf16_ms = times[:3]
            target = "-"
            if m >= PREFILL_M:
                met = bool(fp8_ms and mm_ms and bf16_ms and fp8_ms <= mm_ms / 0.8 and fp8_ms < bf16_ms)
                target = "met" if met else "MISSED"
            row = (f"| {names_w} | {n} x {k} | {m} | " + " | ".join(cells)
                   + f" | {ratio(fp8_ms, mm_ms)} | {ratio(fp8_ms, bf16_ms)} | {target} | {quant_ms:.3f} |")
            lines.append(row)
            print(row, flush=True)
            del x, a, a_scales, ref
        del w, w_scales, w_fp32, w_bf16
        torch.cuda.empty_cache()


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
            return quantize_act_fp8(o.transpose(0, 1).reshape(t, heads * v_dim))

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
                        help="extra fp8_gemm launches block_m,block_n,num_warps,num_stages[,swap] (swap: "
                             "b . a^T; split-K is automatic), one column each")
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
        f"- fp8_gemm default launch: M > 128 {PREFILL_CONFIG}; M <= 128 decode_config(M), e.g. {decode_config(64)}",
        "- cells: TFLOP/s (ms); ratios are speedups of fp8_gemm (> 1: fp8_gemm faster); target (M >= "
        f"{PREFILL_M}): fp8_gemm >= 0.8x _scaled_mm and > 1x bf16",
    ]
    print("\n".join(lines), flush=True)
    bench_linears(scaled_name, scaled_mm, args.variants, lines)
    bench_head_projections(lines)
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
