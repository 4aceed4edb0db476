"""Runtime throughput and memory on the GPU, from short prompts to the model's full context.

    minirt init /tmp/minirt-v32 --preset v32 --device cuda
    python3 scripts/bench_runtime.py /tmp/minirt-v32 --context 1024,8192,32768,131072,163840 --batch 1,16 \\
        --out runtime-run.md

For each loading mode (``--modes``: weights bf16/fp8 x indexer exact/fp8) and each (batch, context)
with batch * context <= ``--max-tokens``: random prompts of ``context`` tokens, a prefill, then the
same prefill timed (chunked, the engine's default chunk), peak allocated memory over prefill and decode, and the median
CUDA-graph decode step at that context (each step waited for, as ``engine.decode`` does), the
step when steps are queued back to back (``engine.decode_queued``, as ``minirt generate`` runs
them), one eager step and the sum of its kernels (torch.profiler: every kernel's device time added
up, i.e. the step with no launch gaps). A warm-up prefill and decode compile every kernel first.
``--split`` profiles one prefill of the longest b 1 context and splits its kernel time into indexer /
attention / linear / other; ``--top N`` lists the N kernels that take most of one eager b 1 decode step
at each context, each beside its time inside one replay of the step's CUDA graph (and, with ``--split``,
of that prefill). "replay ms" is the CUDA graph's replay alone, waited for: the graph step less
it is ``decode``'s host work around the replay (token checks, copies, the finite check); "(launch)" the
host's part of it, until ``replay()`` returns: a few µs, unless the profiler of an earlier row left CUPTI
attached (tens of µs, and every later launch slower: docs/perf/runtime.md), which the benchmark asks
Kineto not to do; "(device)" the replay between two CUDA events recorded on the stream around it (the
device's part: from the stream reaching the graph to its last kernel's end); "(device right after the
prefill)" the same, timed before the GPU has cooled. Every other step time of a row is taken once the GPU
is back within 5 °C of its temperature before the prefill (at most 90 s of waiting; no waiting without
pynvml): a long prefill heats it, and the steps right after run slower. With ``--top``, the heading
of each step's kernel table gives the device's idle time between the kernels of one replay.

Beside each row, the floor it is bound by and the ratio to it. Decode: the bytes a step must read
(every weight it uses, with its block scales: linear layers, norms, lm_head, the batch's embedding
rows, MoE layers' shared experts and at most batch x top-k routed experts; per layer and sequence
the indexer keys of the context and the top-k latent entries) at the device-copy ceiling. Prefill:
the indexer's FLOPs (2 x heads x head_dim per causal query-key pair, per layer) at the tensor-core
ceiling of its precision (fp8: the e4m3 ceiling; exact: three bf16 products per product, bf16x3, at
the bf16 ceiling).
All ceilings are measured in the same run. DeepSeek-V4 rows have no floor columns.

Several GPUs (``--tp N``, under torchrun; NCCL): the model split over N GPUs (``minirt.parallel``: heads,
MLP width and vocabulary per rank, experts as expert parallelism), every row beside the same row on one
GPU (rank 0 alone, after the others), with the peak memory of the fullest GPU and the device time of
the collectives (NCCL kernels) in one eager decode step and in one prefill:

    torchrun --nproc-per-node 2 scripts/bench_runtime.py /tmp/minirt-v32 --tp 2 --modes fp8/exact \
        --context 1024,8192 --batch 1,16

DeepSeek-V4 checkpoints run in their one mode (fp8 linears as stored, fp4 experts, exact fp32 indexer
keys: of ``--modes`` only fp8/exact loads, the others are skipped), e.g. V4-Flash's first 4 layers:

    minirt init /tmp/minirt-v4-flash --preset v4-flash --device cuda
    python3 scripts/bench_runtime.py /tmp/minirt-v4-flash --context 1024,131072,1048576 --batch 1,64 \
        --max-tokens 1048576
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

# Kineto keeps CUPTI attached after a profile unless told to tear it down, and on an H100 (torch 2.11,
# CUDA 13) every later launch then cost more host time: a decode graph's replay 44 µs to launch instead
# of 5.5, so rows timed after an earlier row's profile read slower steps. Set before torch loads Kineto
# (TEARDOWN_CUPTI=0 in the environment keeps CUPTI attached, as before).
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile

import minirt
from minirt.errors import InputError
from minirt.models import deepseek_v32, family_of
from ceilings import measure_ceilings, measure_fp8_tflops, write_report

GIB = 2**30
# Kernel-name fragments of each part of a prefill (Triton kernels by their function names; cuBLAS,
# CUTLASS and torch's own kernels by theirs).
PARTS = {
    "indexer": ("indexer", "_paged_scores", "_write_index_keys", "topk", "_boundary_ties", "radix", "sort",
                "bitonic", "_tau_kernel", "_candidates_kernel", "_overflow_kernel"),
    "attention": ("sparse_mla", "_sparse_decode"),
    "linear": ("gemm", "_grouped_fp", "cutlass", "fp8_gemm", "quantize_act", "mla_head_proj", "nvjet", "sm90_xmma",
               "cublas"),
}


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def launch_seconds(fn) -> float:
    """Host seconds fn takes to return, the device idle before it (a graph replay's launch, not its run)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds


def temperature() -> int | None:
    """The GPU's temperature in °C, None where torch cannot read it (no pynvml)."""
    try:
        return torch.cuda.temperature()
    except Exception:  # noqa: BLE001 - a missing NVML binding only drops the cool-down and its diagnostic
        return None


def gpu_state() -> str:
    """The GPU's SM clock over NVML's last sample period (1/6 to 1 s) and its temperature, '' where torch
    cannot read them (no pynvml)."""
    degrees = temperature()
    return "" if degrees is None else f"{torch.cuda.clock_rate()} MHz, {degrees} °C"


def cool_down(before: int | None, limit_s: float = 90.0) -> float:
    """Waits until the GPU is within 5 °C of ``before`` (its temperature before a row's prefill) or
    ``limit_s`` has passed, and returns the seconds waited. A long prefill heats the GPU and the steps
    right after it run slower (an H100 at 69 °C held 1785 MHz, not 1980); timing every row's steps at the
    same temperature keeps that out of the long-context / short-context ratio."""
    start = time.perf_counter()
    while before is not None and time.perf_counter() - start < limit_s:
        now = temperature()
        if now is None or now <= before + 5:
            break
        time.sleep(0.5)
    return time.perf_counter() - start


def device_seconds(fn) -> float:
    """Seconds between CUDA events recorded on the current stream before and after fn, the device idle
    before it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def kernel_times(fn) -> dict[str, float]:
    """Device seconds of every kernel fn launches, by kernel name."""
    return kernel_timeline(fn)[0]


def kernel_timeline(fn) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """kernel_times(fn), and the device's idle gaps between fn's kernels: (seconds, the kernel after),
    longest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    spans = []
    for e in prof.events():  # kernel events only (CPU op events carry their children's device time too)
        if e.device_type == DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time_total * 1e-6
            spans.append((e.time_range.start, e.time_range.end, e.name))
    gaps, busy_until = [], None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps.append(((start - busy_until) * 1e-6, name))
        busy_until = end if busy_until is None else max(busy_until, end)
    return times, sorted(gaps, reverse=True)


def split_by_part(times: dict[str, float]) -> dict[str, float]:
    parts = dict.fromkeys([*PARTS, "other"], 0.0)
    for name, seconds in times.items():
        part = next((p for p, keys in PARTS.items() if any(k in name.lower() for k in keys)), "other")
        parts[part] += seconds
    return parts


def random_prompts(engine, batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.cfg.vocab_size, (batch, length), generator=gen).tolist()


def collective_seconds(times: dict[str, float]) -> float:
    """Device seconds of the NCCL kernels (all-reduce, all-gather, all-to-all) among ``kernel_times``."""
    return sum(t for name, t in times.items() if "nccl" in name.lower())


def decode_floor_bytes(engine, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) a V3.2 decode step of ``batch`` sequences at ``context`` tokens must
    read at least (what the module docstring lists)."""
    cfg, total = engine.cfg, 0
    for name, t in engine.model.state_dict().items():
        size = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight":
            size = batch * t[0].numel() * t.element_size()
        elif ".mlp.experts." in name:  # routed experts: at most batch x top-k of them
            size = size * min(1.0, batch * cfg.moe.num_experts_per_tok / cfg.moe.n_routed_experts)
        total += int(size)
    layer = engine.cache.layers[0]
    entry = lambda t: t[0, 0].numel() * t.element_size()  # bytes per token of a [blocks, block_size, ...] cache
    per_sequence = min(cfg.index_topk, context) * entry(layer.kv) + context * entry(layer.index_keys)
    return total, engine.num_layers * batch * per_sequence


def prefill_floor_flops(engine, batch: int, context: int) -> int:
    """The indexer's FLOPs in a V3.2 prefill of ``batch`` prompts of ``context`` tokens: every causal
    query-key pair, 2 x index_n_heads x index_head_dim each, per layer."""
    cfg = engine.cfg
    return engine.num_layers * batch * context * (context + 1) // 2 * 2 * cfg.index_n_heads * cfg.index_head_dim


def queued_step_seconds(engine, tokens: torch.Tensor, steps: int) -> float:
    """Seconds per decode step when ``steps`` steps are queued back to back, one sync at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.decode_queued(tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def bench_row(engine, batch: int, context: int, steps: int, seed: int) -> dict:
    prompts = random_prompts(engine, batch, context, seed)
    # Room for every step below: the capture, 6 x steps timed (raw replays advance the cache too), the
    # eager and profiled steps.
    engine.setup_cache(batch, context + 6 * steps + 8)
    torch.cuda.reset_peak_memory_stats()
    before = temperature()
    engine.prefill(prompts)  # compiles what the warm-up's shapes did not (Triton specialises on sizes)
    prefill_s = timed(lambda: engine.prefill(prompts))
    after_prefill = gpu_state()
    tokens = torch.randint(0, engine.cfg.vocab_size, (batch,), device=engine.device)
    engine.decode(tokens)  # the first step of a batch size captures the graph
    graph = engine._graphs[batch][0]
    hot_device_s = statistics.median(device_seconds(graph.replay) for _ in range(steps))
    waited_s = cool_down(before)
    step_s = statistics.median(timed(lambda: engine.decode(tokens)) for _ in range(steps))
    replay_s = statistics.median(timed(graph.replay) for _ in range(steps))
    launch_s = statistics.median(launch_seconds(graph.replay) for _ in range(steps))
    replay_device_s = statistics.median(device_seconds(graph.replay) for _ in range(steps))
    queued_s = queued_step_seconds(engine, tokens, steps)
    tp = engine.tp
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=engine.device)
    if tp.world > 1:
        torch.distributed.all_reduce(peak, torch.distributed.ReduceOp.MAX)  # the fullest GPU's
    engine.use_cuda_graph = False
    eager_s = statistics.median(timed(lambda: engine.decode(tokens)) for _ in range(3))
    step_kernels = kernel_times(lambda: engine.decode(tokens))
    kernels_s = sum(step_kernels.values())
    engine.use_cuda_graph = True
    row = {"batch": batch, "context": context, "prefill_ms": prefill_s * 1e3,
           "prefill_tok_s": batch * context / prefill_s, "peak_gib": peak.item() / GIB, "step_ms": step_s * 1e3,
           "replay_ms": replay_s * 1e3, "launch_ms": launch_s * 1e3,
           "replay_device_ms": replay_device_s * 1e3, "queued_ms": queued_s * 1e3,
           "eager_ms": eager_s * 1e3, "kernels_ms": kernels_s * 1e3,
           "graph_over_kernels": step_s / kernels_s, "queued_over_kernels": queued_s / kernels_s}
    if tp.world > 1:
        row["step_collectives_ms"] = collective_seconds(step_kernels) * 1e3
        row["prefill_collectives_ms"] = collective_seconds(kernel_times(lambda: engine.prefill(prompts))) * 1e3
    row["step_kernels"] = step_kernels
    row["replay_kernels"], row["replay_gaps"] = kernel_timeline(graph.replay)
    row["replay_device_hot_ms"] = hot_device_s * 1e3
    row["gpu_state"] = (f"before the prefill {before} °C" if before is not None else "",
                        after_prefill, f"{gpu_state()} after {waited_s:.0f} s of cooling and the row")
    return row


def top_kernels(times: dict[str, float], n: int, what: str, replayed: dict[str, float] | None = None,
                gaps: list[tuple[float, str]] = ()) -> list[str]:
    """A markdown table of the ``n`` kernels that take most of ``times`` (device seconds by kernel name),
    with ``replayed``: each one's time inside one replay of the step's CUDA graph beside it, and that
    replay's idle ``gaps`` (kernel_timeline's) in the heading."""
    total = sum(times.values())
    head = f"The {n} largest kernels of {what} ({total * 1e3:,.2f} ms of kernels"
    if replayed is None:
        lines = ["", head + "):", "", "| kernel | ms | share |", "|---|---:|---:|"]
    else:  # (a profiler that does not trace a graph's kernels leaves replayed empty)
        in_graph = f"{sum(replayed.values()) * 1e3:,.2f} ms" if replayed else "none traced"
        if gaps:  # where the device waits inside the graph (each gap named by the kernel that ends it)
            in_graph += (f", the device idle {sum(g for g, _ in gaps) * 1e3:,.3f} ms between its kernels; longest: "
                         + ", ".join(f"{g * 1e6:.1f} µs before `{name[:40]}`" for g, name in gaps[:4]))
        lines = ["", head + f"; inside one graph replay: {in_graph}):", "",
                 "| kernel | ms | share | in the graph ms |", "|---|---:|---:|---:|"]
    for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:n]:
        graph = "" if replayed is None else f" {replayed.get(name, 0.0) * 1e3:,.3f} |"
        lines.append(f"| `{name[:90]}` | {t * 1e3:,.3f} | {t / total:.1%} |" + graph)
    return lines


def warm_up(engine) -> None:
    """Compile every kernel (prefill of a sparse-length prompt in two chunks, graphed decode steps)."""
    n = max(2 * (engine.cfg.index_topk or 64) + 8, 2 * 128 + 8)  # V4: past the window and an HCA window
    engine.setup_cache(2, n + 8)
    chunk, engine.prefill_chunk = engine.prefill_chunk, n // 2
    tokens = engine.prefill(random_prompts(engine, 2, n, seed=99)).argmax(-1)
    engine.prefill_chunk = chunk
    for _ in range(3):
        tokens = engine.decode(tokens).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights_dir")
    ap.add_argument("--context", default="1024,8192,32768,131072,163840", help="prompt lengths")
    ap.add_argument("--batch", default="1,16", help="batch sizes")
    ap.add_argument("--max-tokens", type=int, default=16 * 32768, help="skip rows of more prompt tokens")
    ap.add_argument("--modes", default="bf16/exact,bf16/fp8,fp8/exact,fp8/fp8",
                    help="weights/indexer_precision pairs to load")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
    ap.add_argument("--split", action="store_true", help="profile the longest b 1 prefill: indexer/attention/linear")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill step (default: "
                    "the engine's)")
    ap.add_argument("--top", type=int, default=0, help="the N largest kernels of a b 1 decode step at each "
                    "context, eager and inside a graph replay (and, with --split, of that prefill)")
    ap.add_argument("--out", default="-", help="markdown report file (- for stdout)")
    ap.add_argument("--tp", type=int, default=1, help="GPUs (tensor + expert parallelism; run under torchrun "
                    "--nproc-per-node N), each row beside one GPU's")
    args = ap.parse_args()
    if args.tp > 1:
        bench_tensor_parallel(args)
        return
    contexts = [int(c) for c in args.context.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    matmul_tflops, copy_gbps = measure_ceilings()
    fp8_tflops = measure_fp8_tflops()
    lines = [f"runtime, {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}; "
             f"checkpoint {args.weights_dir}",
             f"ceilings measured in the same run: bf16 matmul {matmul_tflops:.0f} TFLOP/s, fp8 matmul "
             f"{fp8_tflops:.0f} TFLOP/s, device copy "
             f"{copy_gbps:.0f} GB/s", ""]
    for mode in args.modes.split(","):
        weights, precision = mode.split("/")
        torch.cuda.empty_cache()
        try:
            engine = minirt.load(args.weights_dir, device="cuda", weights=weights, indexer_precision=precision,
                                 prefill_chunk=args.prefill_chunk)
        except InputError as e:  # a mode this checkpoint's family does not offer
            print(f"skipping {mode}: {e}", flush=True)
            continue
        weight_gib = torch.cuda.memory_allocated() / GIB
        cfg = engine.cfg
        warm_up(engine)
        label = f"{cfg.model_type}: weights {weights}, indexer {precision}"
        lines += [f"### {label}: {engine.num_layers} layers (hidden {cfg.hidden_size}, "
                  f"{cfg.num_attention_heads} heads, index_topk {cfg.index_topk}), prefill chunk "
                  f"{engine.prefill_chunk}, weights in memory {weight_gib:.2f} GiB", "",
                  "| batch | context | prefill ms | prefill tok/s | peak GiB | graph step ms | eager step ms "
                  "| kernel sum ms | replay ms (launch; device; device right after the prefill) | queued step ms | graph / kernels "
                  "| queued / kernels | prefill floor ms | prefill / floor | decode floor ms (weights + cache) "
                  "| queued / floor |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        step_kernels, states = [], []
        for batch in batches:
            for i, context in enumerate(contexts):
                if batch * context > args.max_tokens:
                    continue
                try:
                    r = bench_row(engine, batch, context, args.steps, seed=i)
                except torch.cuda.OutOfMemoryError as e:
                    lines.append(f"| {batch} | {context:,} | out of memory: {str(e).splitlines()[0][:80]} ||||||||||||||")
                    engine.cache = None
                    torch.cuda.empty_cache()
                    continue
                prefill_floor = decode_floor = "–"
                prefill_ratio = decode_ratio = "–"
                if family_of(cfg) is deepseek_v32:
                    rate = fp8_tflops if precision == "fp8" else matmul_tflops / 3  # exact: bf16x3
                    floor_ms = prefill_floor_flops(engine, batch, context) / (rate * 1e12) * 1e3
                    prefill_floor, prefill_ratio = f"{floor_ms:,.1f}", f"{r['prefill_ms'] / floor_ms:.2f}"
                    weight_bytes, cache_bytes = decode_floor_bytes(engine, batch, context)
                    floor_ms = (weight_bytes + cache_bytes) / (copy_gbps * 1e9) * 1e3
                    decode_floor = (f"{floor_ms:.3f} ({weight_bytes / 1e9:.2f} + {cache_bytes / 1e9:.3f} GB)")
                    decode_ratio = f"{r['queued_ms'] / floor_ms:.2f}"
                replay = f"{r['replay_ms']:.2f} ({r['launch_ms']:.3f}; {r['replay_device_ms']:.2f}; " \
                         f"{r['replay_device_hot_ms']:.2f})"
                lines.append(row_line(r) + f"{replay} | {r['queued_ms']:.2f} | {r['graph_over_kernels']:.2f} | "
                             f"{r['queued_over_kernels']:.2f} | {prefill_floor} | {prefill_ratio} | {decode_floor} | "
                             f"{decode_ratio} |")
                print(lines[-1], flush=True)
                states.append(f"b {batch} at {context:,}: {' → '.join(r['gpu_state'])}")
                if batch == 1:
                    step_kernels.append((context, r["step_kernels"], r["replay_kernels"], r["replay_gaps"]))
        if any(" MHz" in state for state in states):
            lines += ["", "The GPU before each row's prefill → right after it → at the row's end (its steps are timed "
                      "once the GPU is back within 5 °C of its temperature before the prefill): "
                      + "; ".join(states)]
        if args.split:
            context = max(c for c in contexts if c <= args.max_tokens)
            prompts = random_prompts(engine, 1, context, seed=7)
            engine.setup_cache(1, context + 8)
            times = kernel_times(lambda: engine.prefill(prompts))
            parts = split_by_part(times)
            total = sum(parts.values())
            lines += ["", f"Kernel time of one b 1 prefill of {context:,} tokens: {total * 1e3:,.0f} ms; "
                      + ", ".join(f"{p} {s * 1e3:,.0f} ms ({s / total:.0%})" for p, s in parts.items())]
            if args.top:
                lines += top_kernels(times, args.top, f"one b 1 prefill of {context:,} tokens")
        for context, step, replayed, gaps in step_kernels if args.top else []:
            lines += top_kernels(step, args.top, f"one eager b 1 decode step at {context:,} tokens", replayed, gaps)
        print("\n".join(lines[-(args.top + 6) * max(1, len(step_kernels)) - 8:]), flush=True)
        lines.append("")
        del engine
    write_report("\n".join(lines) + "\n", args.out)


def row_line(r: dict) -> str:
    """A row's cells up to the kernel sum, as the tables print them (the last cells follow)."""
    return (f"| {r['batch']} | {r['context']:,} | {r['prefill_ms']:,.1f} | {r['prefill_tok_s']:,.0f} | "
            f"{r['peak_gib']:.1f} | {r['step_ms']:.2f} | {r['eager_ms']:.2f} | {r['kernels_ms']:.2f} | ")


def bench_tensor_parallel(args) -> None:
    """--tp N: each mode's rows on N GPUs (every rank runs them in step; rank 0 reports), then the same
    rows on rank 0's GPU alone while the other ranks wait at a barrier."""
    from minirt.parallel import init_from_env, local_device

    group = init_from_env(args.tp)
    contexts = [int(c) for c in args.context.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    rows = [(b, c, i) for b in batches for i, c in enumerate(contexts) if b * c <= args.max_tokens]
    lines = [f"runtime over {args.tp} GPUs (tensor + expert parallelism, NCCL) beside 1 GPU, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}; "
             f"checkpoint {args.weights_dir}", ""]
    for mode in args.modes.split(","):
        weights, precision = mode.split("/")
        results = {}
        for tp in (args.tp, 1):
            if tp == 1 and group.rank != 0:
                torch.distributed.barrier()  # rank 0 runs the 1-GPU rows meanwhile
                continue
            torch.cuda.empty_cache()
            engine = minirt.load(args.weights_dir, device=str(local_device()), weights=weights,
                                 indexer_precision=precision, tp=tp)
            results[tp, "weights"] = torch.cuda.memory_allocated() / GIB
            warm_up(engine)
            for batch, context, seed in rows:
                results[tp, batch, context] = bench_row(engine, batch, context, args.steps, seed)
            del engine
            if tp == 1:
                torch.distributed.barrier()
        if group.rank != 0:
            continue
        lines += [f"### weights {weights}, indexer {precision}: weights in memory per GPU "
                  f"{results[args.tp, 'weights']:.2f} GiB at tp {args.tp}, {results[1, 'weights']:.2f} GiB on 1 GPU", "",
                  "| batch | context | prefill ms | prefill tok/s | peak GiB | graph step ms | eager step ms "
                  "| kernel sum ms | collectives ms (step / prefill) | GPUs |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for batch, context, _ in rows:
            r = results[args.tp, batch, context]
            lines.append(row_line(r) + f"{r['step_collectives_ms']:.2f} / {r['prefill_collectives_ms']:,.1f} | "
                         f"{args.tp} |")
            lines.append(row_line(results[1, batch, context]) + "– | 1 |")
        lines.append("")
    if group.rank == 0:
        write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
