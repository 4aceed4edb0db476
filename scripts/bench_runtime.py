"""Runtime throughput on the GPU: prefill and decode tokens/s of a checkpoint at several batch sizes,
and how close a CUDA-graph decode step comes to the sum of its kernels.

    minirt init /tmp/minirt-v32 --preset v32 --device cuda
    python3 scripts/bench_runtime.py /tmp/minirt-v32 --out docs/perf/runtime.md

Prompts are random token ids (different per sequence). Everything is warmed up first (Triton
compiles, the decode graph is captured), then timed with a synchronize around each region. The kernel
sum of a decode step comes from torch.profiler over one eager step: the device time of every kernel,
added up, i.e. the step's time with no launch gaps.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import minirt
from ceilings import measure_ceilings


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_sum_seconds(fn) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Kernel events only (CPU op events carry their children's device time too).
    return sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA) * 1e-6


def bench_batch(engine, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, engine.cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    engine.setup_cache(batch, prompt_len + 2 * steps + 8)
    next_tokens = engine.prefill(prompts).argmax(-1)  # warm-up: compiles every kernel
    for _ in range(3):  # the first graphed step runs eagerly and captures; then replays
        next_tokens = engine.decode(next_tokens).argmax(-1)

    prefill_s = timed(lambda: engine.prefill(prompts))
    tokens = engine.prefill(prompts).argmax(-1)
    step_s = []
    for _ in range(steps):
        step_s.append(timed(lambda: engine.decode(tokens)))
    engine.use_cuda_graph = False
    eager_step_s = statistics.median(timed(lambda: engine.decode(tokens)) for _ in range(3))
    kernels_s = kernel_sum_seconds(lambda: engine.decode(tokens))
    engine.use_cuda_graph = True
    step = statistics.median(step_s)
    return {
        "batch": batch, "prompt_len": prompt_len,
        "prefill_tok_s": batch * prompt_len / prefill_s, "prefill_ms": prefill_s * 1e3,
        "decode_tok_s": batch / step, "step_ms": step * 1e3, "eager_step_ms": eager_step_s * 1e3,
        "kernel_sum_ms": kernels_s * 1e3, "graph_over_kernels": step / kernels_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args()
    engine = minirt.load(args.weights, device="cuda")
    rows = [bench_batch(engine, int(b), args.prompt_len, args.steps, seed=i)
            for i, b in enumerate(args.batches.split(","))]
    cfg = engine.cfg
    matmul_tflops, copy_gbps = measure_ceilings()
    lines = [
        f"runtime, {engine.num_layers} layers of {args.weights} (hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
        f"index_topk {cfg.index_topk}), {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{datetime.date.today()}",
        f"ceilings measured in the same run: bf16 matmul {matmul_tflops:.0f} TFLOP/s, device copy {copy_gbps:.0f} GB/s",
        "",
        "| batch | prompt | prefill tok/s | prefill ms | decode tok/s | graph step ms | eager step ms | kernel sum ms | graph / kernels |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['prefill_tok_s']:,.0f} | {r['prefill_ms']:.1f} | "
                     f"{r['decode_tok_s']:,.0f} | {r['step_ms']:.2f} | {r['eager_step_ms']:.2f} | "
                     f"{r['kernel_sum_ms']:.2f} | {r['graph_over_kernels']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
