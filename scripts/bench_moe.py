"""Benchmark minirt's MoE kernels on DeepSeek-V3.2's and DeepSeek-V4-Flash's expert shapes.

    python3 scripts/bench_moe.py [--out results.md] [--tokens 1 16 64 4096 16384] [--models V3.2 V4-Flash]
                                 [--configs 64,8,4 16,4,4,swap,e4m3,split8 ...]

Models: V3.2 (D 7168, I 2048, 256 experts, top-8, block-fp8 experts, sigmoid routing with 8 groups /
4 kept) and V4-Flash (D 4096, I 2048, 256 experts, top-6, fp4 experts, sqrt-softplus routing, SwiGLU
clamp 10). Random weights at full size (V3.2: 11.3 GB, V4-Flash: 3.2 GB; one model at a time).
Tables:

- routing: route_topk on [T, 256] fp32 logits, microseconds;
- grouped GEMMs (T >= 4096): moe_experts' gate/up (SwiGLU fused) and down kernels alone (the Triton
  kernel, and on sm_90 also the Gluon one that moe_experts takes there: moe_grouped_sm90 for fp8
  experts, moe_grouped_fp4_sm90 then the Triton kernel's pass over the blocks it marks for fp4), on the plan
  of a real routing, beside torch._scaled_mm (block-wise scales, via fp8_gemm.scaled_mm_blockwise) on
  one dense GEMM of the same total size ([T * top_k, K] x [N, K]^T); TFLOP/s count the routed
  tokens' products only (padding rows of the tiles are not counted). Target (V3.2, T 4096, gate/up):
  >= 900 TFLOP/s and >= 0.9x _scaled_mm;
- expert block: moe_experts as called (plan, gather + quantise, both GEMMs, combine) at every T:
  ms, TFLOP/s, GB/s of the active experts' weights (each read once at least), the ratios to the
  ceilings measured in the same run (scripts/ceilings.py: bf16 matmul, device copy), peak memory
  beyond the weights, and the times of any extra launch shapes (--configs: block_m, num_warps,
  num_stages, then flags: "swap" for the decode orientation, "e4m3" for fp4 weights on fp8 tensor
  cores 32 inputs at a time, "fold" for them with their scales folded in (whole k blocks), "splitN" for split-K at most N; block_m < 64 timed where the decode shape is the default,
  the others where the prefill one is, and also in the grouped GEMM table). Target (decode, T 1): the routed experts plus the shared
  expert read at >= 2.5 TB/s: the "layer" column. The shared expert runs as each model runs it: V3.2's as fp8_gemm
  products (its dense MLP), V4-Flash's (one fp8 expert) in moe_experts' own launches (shared=).
- decode paths (T with at most 16 assignments per expert): moe_experts through the grouped GEMMs
  (DECODE_CONFIG) beside moe_decode's per-assignment products (taken by default while
  T * top_k <= E / 4 for fp8, 1.5 E for fp4), each with GB/s of the active experts' weights (x copy ceiling) and the two
  results' relative difference, times of CUDA-graph replays (graph_ms: as decode steps run, without
  Python's launch costs); --decode-shapes times more launch shapes of the latter
  (gate/up rows, down rows, k blocks a step; fp8 experts' only). Targets: at T 1 the routed experts and the shared
  expert (as above, in the same graph) at >= 2.5 TB/s, and T 64 in at most 8 x T 1's time (the
  "vs 8 x T 1" column; T 64 has ~28 times T 1's active experts for V3.2).

Each model's decode and prefill launch shapes are first checked against each other, and V3.2's
against a dequantised fp32 computation of a few tokens. Times are medians of
triton.testing.do_bench (which clears the L2 cache before each call).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
from dataclasses import dataclass, replace

import torch
from triton.testing import do_bench

from ceilings import measure_ceilings, write_report

from minirt.blockfp8 import dequantize_block_fp8, quantize_block_fp8
from minirt.formats import quantize_groups
from minirt.kernels import route_topk
from minirt.kernels.fp8_gemm import fp8_gemm, quantize_act_fp8, scaled_mm_blockwise, uses_scaled_mm

# The module (minirt.kernels re-exports the function moe_experts under the module's name).
moe = importlib.import_module("minirt.kernels.moe_experts")
moe_decode = importlib.import_module("minirt.kernels.moe_decode")
sm90 = importlib.import_module("minirt.kernels.moe_grouped_sm90")
fp4_sm90 = importlib.import_module("minirt.kernels.moe_grouped_fp4_sm90")


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    fmt: str
    scoring: str
    n_group: int
    topk_group: int
    scaling: float
    limit: float | None


MODELS = (Model("V3.2", 7168, 2048, 256, 8, "fp8", "sigmoid", 8, 4, 2.5, None),
          Model("V4-Flash", 4096, 2048, 256, 6, "fp4", "sqrtsoftplus", 1, 1, 1.5, 10.0))
TOKENS = (1, 16, 64, 4096, 16384)
PREFILL_T = 4096
TARGET_TFLOPS = 900
TARGET_VS_SCALED_MM = 0.9
TARGET_DECODE_GBPS = 2500
CHECK_TOKENS = 8
DEVICE = "cuda"
REL_TOL = 2e-2


def bench_ms(fn):
    return do_bench(fn, warmup=5, rep=30, return_mode="median")


def graph_ms(fn, reps=30):
    """Median ms of fn captured in a CUDA graph, one replay at a time after clearing the L2 cache
    (as a decode step runs: no Python launch costs, which at a few tokens exceed the kernels' time)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def random_experts(model: Model, gen: torch.Generator) -> moe.ExpertWeights:
    """Random stacked experts: fp8 codes of magnitude <= 1.875 (bit 6 clear: no NaN code) with block
    scales 2^[-9, -6); fp4 bytes of any codes with e8m0 scales 2^[-9, -6)."""
    e, d, i = model.experts, model.hidden, model.inter

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, device=DEVICE, dtype=torch.uint8)

    def pow2(*shape):
        return torch.exp2(torch.randint(-9, -6, shape, generator=gen, device=DEVICE).float())

    if model.fmt == "fp8":
        return moe.ExpertWeights("fp8", (codes(e, 2 * i, d) & 0xBF).view(torch.float8_e4m3fn),
                                 pow2(e, 2 * i // 128, d // 128),
                                 (codes(e, d, i) & 0xBF).view(torch.float8_e4m3fn), pow2(e, d // 128, i // 128))
    scale_bytes = lambda *shape: (codes(*shape) % 3 + 118).to(torch.uint8)   # noqa: E731
    return moe.ExpertWeights("fp4", codes(e, 2 * i, d // 2), scale_bytes(e, 2 * i, d // 32),
                             codes(e, d, i // 2), scale_bytes(e, d, i // 32))


def route(model: Model, n_tokens: int, gen: torch.Generator):
    logits = torch.randn(n_tokens, model.experts, generator=gen, device=DEVICE)
    bias = 0.01 * torch.randn(model.experts, generator=gen, device=DEVICE)
    return logits, bias, lambda: route_topk(logits, bias, top_k=model.top_k, scoring=model.scoring,
                                            n_group=model.n_group, topk_group=model.topk_group,
                                            scaling=model.scaling)


def check(model, experts, x, ids, weights) -> str:
    """Relative errors: the two launch shapes against each other, and (fp8) a few tokens against
    the dequantised weights in fp32 (activations quantised as the kernels do)."""
    a = moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit, config=moe.DECODE_CONFIG)
    b = moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit, config=prefill_config(model))
    shapes_err = rel(a, b.float())
    text = f"decode vs prefill shape {shapes_err:.2e}"
    if not shapes_err < REL_TOL:
        raise SystemExit(f"moe_experts' decode and prefill launch shapes disagree: {shapes_err:.3g} ({model.name})")
    if experts.format == "fp8":
        def quantized(v):
            q, s = quantize_groups(v)
            return (q.float().unflatten(-1, (-1, 128)) * s[..., None]).flatten(-2)
        ref = torch.zeros(CHECK_TOKENS, model.hidden, device=DEVICE)
        xq = quantized(x[:CHECK_TOKENS].float())
        for t in range(CHECK_TOKENS):
            for j in range(model.top_k):
                e = int(ids[t, j])
                gu = dequantize_block_fp8(experts.w13[e], experts.w13_scales[e]) @ xq[t]
                h = torch.nn.functional.silu(gu[:model.inter]) * gu[model.inter:]
                ref[t] += weights[t, j] * (dequantize_block_fp8(experts.w2[e], experts.w2_scales[e])
                                           @ quantized(h[None])[0])
        err = rel(a[:CHECK_TOKENS], ref)
        text += f", vs fp32 {err:.2e}"
        if not err < REL_TOL:
            raise SystemExit(f"moe_experts disagrees with the fp32 computation: {err:.3g} ({model.name})")
    return text


def rel(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def prefill_config(model: Model) -> moe.MoeConfig:
    """moe_experts' default launch shape for prefill on this model's experts."""
    return moe.default_config(1 << 30, model.experts, model.fmt)


def bench_gemms(model, experts, x, ids, lines, gbps_ceiling, config=None, label="", gluon=False):
    """The two grouped GEMMs of moe_experts alone in the Triton kernel (prefill shape, or config's, named by
    label) or (gluon) as moe_experts runs them on sm_90 (fp8: moe_grouped_sm90, 128-row tiles; fp4:
    moe_grouped_fp4_sm90, then the Triton kernel's pass over the marked blocks), and _scaled_mm on dense
    equivalents; with the active experts' weight bytes a GEMM reads at least once."""
    d, i, n_slots = model.hidden, model.inter, ids.numel()
    config = config or prefill_config(model)
    active = int(torch.unique(ids).numel())
    row_token, tile_expert, _ = moe._plan(ids, model.experts, sm90.BLOCK_M if gluon else config.block_m)
    rows = row_token.numel()
    a, a_scales = moe._gather_quantize(x, row_token, experts.format == "fp4" and not config.fp4_e4m3)
    h = torch.empty((rows, i), dtype=torch.float8_e4m3fn, device=DEVICE)
    h_scales = torch.empty((rows, i // 128), device=DEVICE)
    y = torch.empty((rows, d), dtype=torch.bfloat16, device=DEVICE)
    fp4 = experts.format == "fp4"
    runs = {
        "gate/up + SwiGLU": (2 * i, d, lambda: moe._folded_fp4_sm90(
            a, a_scales, experts.w13, experts.w13_scales, tile_expert, h.view(torch.uint8), h_scales, swiglu=True,
            limit=model.limit, n_experts=model.experts, config=config)),
        "down": (d, i, lambda: moe._folded_fp4_sm90(h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None,
                                                    swiglu=False, limit=None, n_experts=model.experts, config=config)),
    } if gluon and fp4 else {
        "gate/up + SwiGLU": (2 * i, d, lambda: sm90.grouped_fp8(
            a, a_scales, experts.w13, experts.w13_scales, tile_expert, h.view(torch.uint8), h_scales, swiglu=True,
            limit=model.limit)),
        "down": (d, i, lambda: sm90.grouped_fp8(h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None,
                                                swiglu=False, limit=None)),
    } if gluon else {
        "gate/up + SwiGLU": (2 * i, d, lambda: moe._grouped_gemm(
            a, a_scales, experts.w13, experts.w13_scales, tile_expert, h.view(torch.uint8), h_scales, fp4=fp4,
            swiglu=True, limit=model.limit, n_experts=model.experts, config=config)),
        "down": (d, i, lambda: moe._grouped_gemm(
            h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None, fp4=fp4, swiglu=False,
            limit=None, n_experts=model.experts, config=config)),
    }
    for name, (n, k, fn) in runs.items():
        flops = 2 * n_slots * n * k
        ms = bench_ms(fn)
        dense = "-"
        ratio = None
        if uses_scaled_mm(n_slots, n, k, x.device):
            da, da_scales = quantize_act_fp8(torch.randn(n_slots, k, device=DEVICE))
            dw, dw_scales = quantize_block_fp8(torch.randn(n, k, device=DEVICE))
            out = torch.empty((n_slots, n), dtype=torch.bfloat16, device=DEVICE)
            mm_ms = bench_ms(lambda: scaled_mm_blockwise(da, da_scales, dw, dw_scales, out))
            dense = f"{flops / mm_ms / 1e9:.0f} ({mm_ms:.3f})"
            ratio = mm_ms / ms
            del da, dw, out
        target = "-"
        if model.fmt == "fp8" and name.startswith("gate") and ids.shape[0] == PREFILL_T:
            met = flops / ms / 1e9 >= TARGET_TFLOPS and ratio is not None and ratio >= TARGET_VS_SCALED_MM
            target = "met" if met else "MISSED"
        # Every active expert's weights cross from memory once at least (fp4: half a byte a weight).
        weight_bytes = active * n * k * (0.5 + 1 / 32 if fp4 else 1 + 4 / 128 ** 2)
        weight_gbps = weight_bytes / ms / 1e6
        row = (f"| {model.name} | {ids.shape[0]} | {name}{label} | {n_slots} x {n} x {k} | {flops / ms / 1e9:.0f} ({ms:.3f}) | "
               f"{weight_gbps:.0f} ({weight_gbps / gbps_ceiling:.2f}) | {dense} | {f'{ratio:.2f}x' if ratio else '-'} | "
               f"{target} |")
        lines.append(row)
        print(row, flush=True)


def parse_config(text: str) -> moe.MoeConfig:
    """"block_m,num_warps,num_stages[,swap][,e4m3][,fold][,splitN]" -> a MoeConfig (block_n 128):
    swap_ab, fp4_e4m3, fp4_fold, split_k N."""
    parts = text.split(",")
    block_m, num_warps, num_stages = (int(p) for p in parts[:3])
    flags = parts[3:]
    splits = [int(f[len("split"):]) for f in flags if f.startswith("split")]
    unknown = [f for f in flags if f not in ("swap", "e4m3", "fold") and not f.startswith("split")]
    if unknown or len(splits) > 1:
        raise SystemExit(f"--configs {text}: flags are swap, e4m3, fold and splitN, got {','.join(flags)}")
    return moe.MoeConfig(block_m=block_m, swap_ab="swap" in flags, num_warps=num_warps, num_stages=num_stages,
                         fp4_e4m3="e4m3" in flags, fp4_fold="fold" in flags, split_k=splits[0] if splits else None)


def per_assignment(model, experts, x, ids, weights, shape=None):
    """moe_experts' per-assignment path whatever T (moe_decode's launch shape ``shape``: gate/up rows,
    down rows, k blocks a step; None: its own)."""
    saved = moe_decode.GATE_UP_ROWS, moe_decode.DOWN_ROWS, moe_decode.STEP_BLOCKS
    if shape is not None:
        moe_decode.GATE_UP_ROWS, moe_decode.DOWN_ROWS, moe_decode.STEP_BLOCKS = shape
    try:
        out = torch.empty((x.shape[0], model.hidden), dtype=torch.bfloat16, device=DEVICE)
        y, row_of_slot = moe_decode.expert_rows_per_assignment(x, ids, experts, model.limit)
        return moe._combine(y, row_of_slot, weights, out)
    finally:
        moe_decode.GATE_UP_ROWS, moe_decode.DOWN_ROWS, moe_decode.STEP_BLOCKS = saved


def bench_decode_paths(model, experts, x, ids, weights, nbytes, gbps_ceiling, shapes, first_ms, layer,
                       decode_lines):
    """One row of the decode paths table; returns the per-assignment path's ms (T = 1: the
    reference of the T 64 target). layer: (the shared expert's bytes, fn running the routed and the shared
    experts) at T 1, else None."""
    grouped = lambda: moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit,   # noqa: E731
                                      config=moe.DECODE_CONFIG)
    new = lambda: per_assignment(model, experts, x, ids, weights)   # noqa: E731
    diff = rel(new(), grouped().float())
    grouped_ms, new_ms = graph_ms(grouped), graph_ms(new)
    n_tokens = x.shape[0]
    gbps = lambda ms: f"{nbytes / ms / 1e6:.0f} ({nbytes / ms / 1e6 / gbps_ceiling:.2f})"   # noqa: E731
    target = "-"
    if layer is not None:
        shared_bytes, layer_fn = layer
        layer_ms = graph_ms(layer_fn)
        layer_gbps = (nbytes + shared_bytes) / layer_ms / 1e6
        target = f"{layer_gbps:.0f} ({'met' if layer_gbps >= TARGET_DECODE_GBPS else 'MISSED'})"
    vs_first = "-"
    if first_ms is not None and n_tokens > 1:
        best = min(new_ms, grouped_ms)
        vs_first = f"{best:.4f} vs {8 * first_ms:.4f} ({'met' if best <= 8 * first_ms else 'MISSED'})"
    shapes_ms = ", ".join(f"{','.join(map(str, shape))}: {graph_ms(lambda s=shape: per_assignment(model, experts, x, ids, weights, s)):.4f}"
                          for shape in shapes) or "-"
    row = (f"| {model.name} | {n_tokens} | {ids.numel()} | {grouped_ms:.4f} | {gbps(grouped_ms)} | {new_ms:.4f} | "
           f"{gbps(new_ms)} | {grouped_ms / new_ms:.2f}x | {diff:.1e} | {target} | {vs_first} | {shapes_ms} |")
    decode_lines.append(row)
    print(row, flush=True)
    return new_ms


def bench_model(model, tokens, configs, shapes, tflops_ceiling, gbps_ceiling, lines, gemm_lines, route_lines,
                decode_lines):
    gen = torch.Generator(DEVICE).manual_seed(0)
    experts = random_experts(model, gen)
    per_expert = experts.nbytes // experts.n_experts
    # The shared expert: V3.2's a dense MLP of fp8_gemm products, V4-Flash's one fp8 expert passed to moe_experts.
    shared = (quantize_block_fp8(0.02 * torch.randn(2 * model.inter, model.hidden, generator=gen, device=DEVICE)),
              quantize_block_fp8(0.02 * torch.randn(model.hidden, model.inter, generator=gen, device=DEVICE)))
    shared_bytes = sum(w.numel() + s.numel() * 4 for w, s in shared)
    shared_expert = random_experts(replace(model, experts=1, fmt="fp8"), gen) if model.fmt == "fp4" else None
    checked = False
    first_ms = None
    for n_tokens in tokens:
        logits, bias, routing = route(model, n_tokens, gen)
        weights, ids = routing()
        route_us = 1e3 * bench_ms(routing)
        route_lines.append(f"| {model.name} | {n_tokens} | {route_us:.1f} |")
        print(route_lines[-1], flush=True)
        x = torch.randn(n_tokens, model.hidden, generator=gen, device=DEVICE).bfloat16()
        if not checked and n_tokens >= CHECK_TOKENS:
            lines.append(f"Check {model.name} at T = {n_tokens}: {check(model, experts, x, ids, weights)}")
            print(lines[-1], flush=True)
            checked = True
        run = lambda: moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit)   # noqa: E731
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = bench_ms(run)
        # Extra shapes of block_m < 64 where the decode shape is the default, the others where the
        # prefill one is (decode tiles on prefill T are slow, and forced splits need GBs of partials).
        decode = moe.default_config(ids.numel(), model.experts) == moe.DECODE_CONFIG
        variants = ", ".join(f"{text}: {bench_ms(lambda c=config: moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit, config=c)):.3f}"
                             for text, config in configs if (config.block_m < 64) == decode
                             and (model.fmt == "fp4" or not (config.fp4_e4m3 or config.fp4_fold))) or "-"
        active = int(torch.unique(ids).numel())
        nbytes = active * per_expert
        flops = 2 * ids.numel() * 3 * model.hidden * model.inter
        layer, layer_run = "-", None
        if n_tokens == 1:
            if shared_expert is not None:
                layer_fn = lambda: moe.moe_experts(x, ids, weights, experts, swiglu_limit=model.limit,  # noqa: E731
                                                   shared=shared_expert)
                layer_run, layer_ms = (shared_expert.nbytes, layer_fn), bench_ms(layer_fn)
            else:
                def layer_fn():
                    gate_up = fp8_gemm(x_fp8, x_scales, *shared[0])
                    h = torch.nn.functional.silu(gate_up[:, :model.inter]) * gate_up[:, model.inter:]
                    return run(), fp8_gemm(*quantize_act_fp8(h), *shared[1])

                x_fp8, x_scales = quantize_act_fp8(x)
                gu = fp8_gemm(x_fp8, x_scales, *shared[0])
                h_fp8, h_scales = quantize_act_fp8(torch.nn.functional.silu(gu[:, :model.inter]) * gu[:, model.inter:])
                layer_run = (shared_bytes, layer_fn)
                layer_ms = ms + bench_ms(lambda: fp8_gemm(x_fp8, x_scales, *shared[0])) \
                    + bench_ms(lambda: fp8_gemm(h_fp8, h_scales, *shared[1]))
            layer_bytes = nbytes + layer_run[0]
            met = "met" if layer_bytes / layer_ms / 1e6 >= TARGET_DECODE_GBPS else "MISSED"
            layer = f"{layer_bytes / layer_ms / 1e6:.0f} ({active} + 1 experts, {layer_bytes / 1e6:.0f} MB; {met})"
        if decode:
            ms_new = bench_decode_paths(model, experts, x, ids, weights, nbytes, gbps_ceiling, shapes, first_ms,
                                        layer_run, decode_lines)
            first_ms = ms_new if n_tokens == 1 else first_ms
        row = (f"| {model.name} | {n_tokens} | {ms:.3f} | {flops / ms / 1e9:.1f} ({flops / ms / 1e9 / tflops_ceiling:.2f}) | "
               f"{nbytes / ms / 1e6:.0f} ({nbytes / ms / 1e6 / gbps_ceiling:.2f}) | {active} | {layer} | {peak_mb:.0f} | {variants} |")
        lines.append(row)
        print(row, flush=True)
        if n_tokens >= PREFILL_T:
            bench_gemms(model, experts, x, ids, gemm_lines, gbps_ceiling)
            if any(m.takes(x.device, experts.format, model.hidden, model.inter) for m in (sm90, fp4_sm90)):
                bench_gemms(model, experts, x, ids, gemm_lines, gbps_ceiling, label=" (Gluon)", gluon=True)
            for text, config in configs:     # the prefill-oriented extra shapes
                if config.block_m >= 64 and (model.fmt == "fp4" or not (config.fp4_e4m3 or config.fp4_fold)):
                    bench_gemms(model, experts, x, ids, gemm_lines, gbps_ceiling, config, f" [{text}]")
        del x, logits, weights, ids
    del experts, shared
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="-", help="markdown report file (default: stdout)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--models", nargs="+", default=[m.name for m in MODELS], choices=[m.name for m in MODELS])
    parser.add_argument("--configs", nargs="*", default=[], help="extra launch shapes: block_m,num_warps,num_stages[,swap][,e4m3][,fold][,splitN]")
    parser.add_argument("--decode-shapes", nargs="*", default=[],
                        help="extra per-assignment launch shapes: gate/up rows,down rows,k blocks a step")
    args = parser.parse_args()
    configs = [(text, parse_config(text)) for text in args.configs]
    shapes = [tuple(int(v) for v in text.split(",")) for text in args.decode_shapes]
    tflops, gbps = measure_ceilings()
    name = torch.cuda.get_device_name()
    lines = [f"# MoE kernels on {name} ({datetime.date.today()})", "",
             f"Ceilings (this run): bf16 matmul {tflops:.0f} TFLOP/s, device copy {gbps:.0f} GB/s.", "",
             "## Expert block (moe_experts)", "",
             "| model | T | ms | TFLOP/s (x matmul ceiling) | weights GB/s (x copy ceiling) | active experts | "
             f"decode layer GB/s with the shared expert (target >= {TARGET_DECODE_GBPS}) | peak MB | --configs ms |",
             "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    gemm_lines = ["", "## Grouped GEMMs (prefill shape) vs torch._scaled_mm on the dense GEMM of the same size", "",
                  "| model | T | GEMM | M x N x K | grouped TFLOP/s (ms) | active experts' weights GB/s (x copy) | "
                  f"_scaled_mm TFLOP/s (ms) | ratio | target (>= {TARGET_TFLOPS}, >= {TARGET_VS_SCALED_MM}x) |",
                  "|---|---:|---|---|---:|---:|---:|---:|---|"]
    route_lines = ["", "## Routing (route_topk, 256 experts)", "", "| model | T | us |", "|---|---:|---:|"]
    decode_lines = ["", "## Decode paths: grouped GEMMs (DECODE_CONFIG) vs per-assignment products (moe_decode)", "",
                    "| model | T | assignments | grouped ms | grouped GB/s (x copy) | per-assignment ms | "
                    "per-assignment GB/s (x copy) | speed-up | rel. difference | "
                    f"T 1 layer GB/s, per-assignment + shared expert (>= {TARGET_DECODE_GBPS}) | faster path's ms vs 8 x T 1 | "
                    "--decode-shapes ms |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    print("\n".join(lines), flush=True)
    for model in MODELS:
        if model.name in args.models:
            bench_model(model, args.tokens, configs, shapes, tflops, gbps, lines, gemm_lines, route_lines, decode_lines)
    write_report("\n".join(lines + decode_lines + gemm_lines + route_lines) + "\n", args.out)


if __name__ == "__main__":
    main()
