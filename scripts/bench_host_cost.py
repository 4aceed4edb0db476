"""Host cost per call of minirt's public kernel functions: 1000 back-to-back calls on tiny shapes, where the
GPU waits on the host, beside the same call replayed from a CUDA graph, where it does not.

    python3 scripts/bench_host_cost.py                     # every function, table on stdout
    python3 scripts/bench_host_cost.py --only decode --out host_cost.md

Per row (one function on one tiny shape, after warm-up calls that compile its kernels):
- host µs: the Python thread's time per call over `--calls` calls, no synchronisation (what a caller
  spends launching it); every row is timed once a round over `--rounds` rounds and keeps its least
  round (the host's speed drifts over seconds where the machine is shared: one H100 host read the same
  rows 20-50% apart from one run to the next);
- eager µs: the same calls followed by one synchronisation, per call (the GPU's time per call when fed
  from Python: the host cost wherever it exceeds the kernels' own time);
- graph µs: the call captured `--per-graph` times into one CUDA graph, replayed, per call (the GPU's own
  time, launches included);
- eager / graph: 1 when the host keeps up.
The targets: host cost <= 15 µs per call for every public kernel function, eager decode within 10% of its
graph time (bench_decode's b 128 rows: this script's rows are host-bound on purpose). Runs in well under a
minute once the kernels are compiled (tiny shapes).

Without a GPU, ``TRITON_INTERPRET=1 python3 scripts/bench_host_cost.py --stub-kernels`` estimates the launchers'
own part: the inputs on the CPU and every kernel launch a no-op, host µs is the Python and torch work of a
call besides its launches (CPU time of the process, the least round).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch
from triton import knobs

from minirt.formats import quantized_like
from minirt.kernels import _launch
from minirt.kernels import (add_rms_norm, all_finite, apply_rope, decode_positions, decode_topk, fp8_gemm,
                            indexer_topk, indexer_weights, lightning_indexer_scores, mla_decode_fp8, mla_query_absorb,
                            mla_value_proj_fp8, new_index_cache, new_kv_cache, new_model1_cache, paged_indexer_scores,
                            positions_to_slots,
                            quantize_act_fp8, rms_norm, sparse_mla_decode_fp8, sparse_mla_prefill,
                            sparse_mla_prefill_two_sources, swiglu_quantize_fp8, write_index_keys, write_kv_fp8,
                            write_kv_model1)

DEVICE = "cuda"


def slots(b: int, s_q: int, topk: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_slots, (b, s_q, topk), generator=g, dtype=torch.int32).to(DEVICE)


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(torch.bfloat16)


def decode_cases():
    """sparse_mla_decode_fp8 (V32 and MODEL1) and mla_decode_fp8 at b 2 (host-bound)."""
    cache = new_kv_cache(16, 64, DEVICE)
    q64, q16 = bf16(2, 1, 64, 576), bf16(2, 1, 16, 576)
    idx = slots(2, 1, 256, 16 * 64, 1)
    lengths = torch.tensor([200, 37], dtype=torch.int32, device=DEVICE)
    sink = torch.zeros(64, device=DEVICE)
    yield "sparse_mla_decode_fp8", "V32 h_q 64, top-k 256", lambda: sparse_mla_decode_fp8(q64, cache, idx, 0.1)
    yield "sparse_mla_decode_fp8", "V32 h_q 16", lambda: sparse_mla_decode_fp8(q16, cache, idx, 0.1)
    yield ("sparse_mla_decode_fp8", "V32 h_q 64, sink + topk_length",
           lambda: sparse_mla_decode_fp8(q64, cache, idx, 0.1, attn_sink=sink, topk_length=lengths))
    yield ("sparse_mla_decode_fp8", "V32 h_q 64, 2 splits (+ merge)",
           lambda: sparse_mla_decode_fp8(q64, cache, idx, 0.1, num_splits=2))
    yield ("torch.ops.minirt.sparse_mla_decode_fp8", "V32 h_q 64 (the custom op's dispatch on top)",
           lambda: torch.ops.minirt.sparse_mla_decode_fp8(q64, cache, idx, 0.1))
    table = torch.arange(32, dtype=torch.int32, device=DEVICE).view(2, 16) % 16
    positions = slots(2, 1, 256, 1024, 2)
    yield "mla_decode_fp8", "V32 h_q 64 (+ positions_to_slots)", lambda: mla_decode_fp8(q64, cache, table, positions, 0.1)

    window, extra, hca = new_model1_cache(4, 256, DEVICE), new_model1_cache(32, 64, DEVICE), new_model1_cache(512, 2, DEVICE)
    m64, m16 = bf16(2, 1, 64, 512), bf16(2, 1, 16, 512)
    w_idx, e_idx, h_idx = slots(2, 1, 128, 1024, 3), slots(2, 1, 512, 2048, 4), slots(2, 1, 1024, 1024, 5)
    e_len = torch.tensor([700, 3], dtype=torch.int32, device=DEVICE)
    yield ("sparse_mla_decode_fp8", "MODEL1 h_q 64, window 128 + extra 512, sink",
           lambda: sparse_mla_decode_fp8(m64, window, w_idx, 0.1, attn_sink=sink, extra_kv_cache=extra,
                                         extra_indices=e_idx))
    yield ("sparse_mla_decode_fp8", "MODEL1 h_q 64, + extra 1024 on pages of 2, extra_topk_length",
           lambda: sparse_mla_decode_fp8(m64, window, w_idx, 0.1, attn_sink=sink, extra_kv_cache=hca,
                                         extra_indices=h_idx, extra_topk_length=e_len))
    yield ("sparse_mla_decode_fp8", "MODEL1 h_q 16, window 128 + extra 512",
           lambda: sparse_mla_decode_fp8(m16, window, w_idx, 0.1, extra_kv_cache=extra, extra_indices=e_idx))


def prefill_cases():
    q, kv = bf16(4, 64, 576), bf16(256, 1, 576)
    idx = slots(4, 1, 128, 256, 6)
    yield "sparse_mla_prefill", "s_q 4, h_q 64, d_qk 576, top-k 128", lambda: sparse_mla_prefill(q, kv, idx, 0.1)
    q5, kv5, extra5 = bf16(4, 64, 512), bf16(256, 1, 512), bf16(64, 1, 512)
    e_idx = slots(4, 1, 64, 64, 7)
    yield ("sparse_mla_prefill_two_sources", "s_q 4, h_q 64, d_qk 512, 128 + 64",
           lambda: sparse_mla_prefill_two_sources(q5, kv5, idx, extra5, e_idx, 0.1))


def indexer_cases():
    q, k, w = bf16(4, 64, 128), bf16(256, 128), torch.rand(4, 64, device=DEVICE)
    limit = torch.tensor([100, 200, 255, 10], dtype=torch.int32, device=DEVICE)
    yield "lightning_indexer_scores", "T 4, S 256, H 64", lambda: lightning_indexer_scores(q, k, w, limit)
    scores = torch.randn(4, 4096, device=DEVICE)
    yield "indexer_topk", "4 rows of 4096, top-k 2048", lambda: indexer_topk(scores, 2048)
    yield "decode_topk", "4 rows of 4096, top-k 2048", lambda: decode_topk(scores, 2048)
    pages = (torch.arange(256, dtype=torch.int32, device=DEVICE).view(4, 64), 64, 256)
    yield "decode_topk", "the same, pages (cache slots)", lambda: decode_topk(scores, 2048, pages=pages)
    cache = new_index_cache(8, 64, DEVICE)
    qf = torch.randn(2, 1, 64, 128, device=DEVICE).to(torch.float8_e4m3fn)
    wf = torch.rand(2, 1, 64, device=DEVICE)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4)
    lim = torch.tensor([[200], [100]], dtype=torch.int32, device=DEVICE)
    yield "paged_indexer_scores", "b 2, 256 positions, fp8 cache", lambda: paged_indexer_scores(qf, wf, cache, table, lim)
    x, weights = bf16(2, 1024), torch.randn(64, 1024, device=DEVICE)
    yield "indexer_weights", "T 2, H 64, D 1024", lambda: indexer_weights(x, weights, 0.011)


def writer_cases():
    new = torch.arange(4, dtype=torch.int32, device=DEVICE)
    cache = new_kv_cache(4, 64, DEVICE)
    latent, rope = bf16(4, 512), bf16(4, 64)
    yield "write_kv_fp8", "4 tokens", lambda: write_kv_fp8(cache, latent, rope, new)
    norm, angles4 = torch.rand(512, device=DEVICE), torch.rand(4, 32, device=DEVICE)
    yield "write_kv_fp8", "4 tokens, norm + rope", lambda: write_kv_fp8(cache, latent, rope, new, norm=(norm, 1e-6),
                                                                         rope=(angles4, angles4))
    m1 = new_model1_cache(4, 64, DEVICE)
    kv = bf16(4, 512)
    yield "write_kv_model1", "4 entries", lambda: write_kv_model1(m1, kv, new)
    index_cache = new_index_cache(4, 64, DEVICE)
    keys = bf16(4, 128)
    yield "write_index_keys", "4 keys", lambda: write_index_keys(index_cache, keys, new)
    positions = slots(2, 1, 256, 1024, 8)
    table = torch.arange(32, dtype=torch.int32, device=DEVICE).view(2, 16) % 4
    yield "positions_to_slots", "2 x 256 positions", lambda: positions_to_slots(positions, table, cache)
    seq_lens = torch.tensor([100, 700], device=DEVICE)
    angles = torch.rand(1024, 32, device=DEVICE)
    yield "decode_positions", "b 2", lambda: decode_positions(seq_lens, table, 64, table.numel(), angles, angles)


def gemm_cases():
    x = bf16(2, 1024)
    yield "quantize_act_fp8", "2 x 1024", lambda: quantize_act_fp8(x)
    gate_up = bf16(2, 2048)
    gate, up = gate_up[:, :1024], gate_up[:, 1024:]
    yield "swiglu_quantize_fp8", "2 x 1024 (halves of 2 x 2048)", lambda: swiglu_quantize_fp8(gate, up)
    logits = torch.randn(2, 129280, device=DEVICE)
    yield "all_finite", "2 x 129280 float32", lambda: all_finite(logits)
    a, a_scales = quantize_act_fp8(x)
    w = torch.randn(512, 1024, device=DEVICE).to(torch.float8_e4m3fn)
    w_scales = torch.rand(4, 8, device=DEVICE) + 0.5
    yield "fp8_gemm", "M 2, N 512, K 1024 (stream kernel)", lambda: fp8_gemm(a, a_scales, w, w_scales)
    heads, nope, v, c = 4, 128, 128, 512
    kv_b = torch.randn(heads * (nope + v), c, device=DEVICE).to(torch.float8_e4m3fn)
    kv_b_scale = torch.rand(heads * (nope + v) // 128, c // 128, device=DEVICE) + 0.5
    q_nope, o_lat = bf16(2, heads, nope), bf16(2, heads, c)
    yield "mla_query_absorb", "T 2, H 4", lambda: mla_query_absorb(q_nope, kv_b, kv_b_scale, nope, v)
    yield "mla_value_proj_fp8", "T 2, H 4", lambda: mla_value_proj_fp8(o_lat, kv_b, kv_b_scale, nope, v)


def norm_cases():
    x, delta = bf16(2, 1024), bf16(2, 1024)
    weight = torch.rand(1024, device=DEVICE) + 0.5
    yield "rms_norm", "2 x 1024", lambda: rms_norm(x, weight, 1e-6)
    codes, scales = quantized_like(x)
    yield "add_rms_norm", "2 x 1024, fp8_out", lambda: add_rms_norm(x, delta, weight, 1e-6, fp8_out=(codes, scales))
    keys = bf16(2, 128)
    angles = torch.rand(2, 32, device=DEVICE)
    bias = torch.rand(128, device=DEVICE)
    yield "apply_rope", "2 x 128, layer_norm", lambda: apply_rope(keys, angles, angles, 64, False, torch.float32,
                                                                 layer_norm=(weight[:128], bias, 1e-6))
    key_cache, rows = torch.zeros(256, 128, device=DEVICE), torch.tensor([5, 70], device=DEVICE)
    yield "apply_rope", "the same, scattered into 2 cache rows", lambda: apply_rope(
        keys, angles, angles, 64, False, layer_norm=(weight[:128], bias, 1e-6), scatter=(key_cache, rows))


GROUPS = {"decode": decode_cases, "prefill": prefill_cases, "indexer": indexer_cases, "writers": writer_cases,
          "gemm": gemm_cases, "norms": norm_cases}


def time_eager(fn, calls: int) -> tuple[float, float]:
    """(host µs, eager µs) per call over `calls` back-to-back calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def time_graph(fn, calls: int, per_graph: int) -> float:
    """GPU µs per call: per_graph calls captured in one CUDA graph, replayed calls / per_graph times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    replays = max(1, calls // per_graph)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * per_graph) * 1e6


def stub_kernel_launches() -> None:
    """--stub-kernels: every (interpreted) kernel launch does nothing and the cases' inputs are CPU tensors."""
    global DEVICE
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--stub-kernels needs TRITON_INTERPRET=1 set before the start")
    from triton.runtime.interpreter import InterpretedFunction
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    DEVICE = "cpu"


def time_host(fn, calls: int) -> float:
    """CPU µs of this process per call over `calls` back-to-back calls (no GPU to wait for)."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def profile(fn, calls: int) -> None:
    """Print where `calls` calls of fn spend their host time, by function (cProfile's own time first)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--per-graph", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every row; each row keeps its least")
    parser.add_argument("--only", choices=sorted(GROUPS), action="append", help="groups to run (default all)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--profile", action="store_true",
                        help="after each row, the Python functions its calls spend their host time in (cProfile)")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="no GPU: CPU inputs, kernel launches stubbed out (TRITON_INTERPRET=1): the launchers' own "
                             "host µs")
    args = parser.parse_args()
    if args.stub_kernels:
        stub_kernel_launches()
    # (Triton's launch hooks, a profiler's, send every launch through its dispatch: kernels/_launch.py.)
    device = "CPU, kernel launches stubbed out" if args.stub_kernels else f"GPU: {torch.cuda.get_device_name()}"
    lines = [f"{device}; {args.calls} calls a row, least of {args.rounds} rounds; graph: {args.per_graph} calls a "
             f"graph; Triton launch hooks set: {_launch._hooked(knobs.runtime)}", "", "| function | case | host µs / call | eager µs / call | graph µs / call | eager / graph |",
             "|---|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    cases = []
    for group in args.only or list(GROUPS):
        try:
            cases += list(GROUPS[group]())
        except Exception as error:   # a group whose inputs cannot be built still leaves the others
            cases.append((group, "inputs", error))
    for i, (name, case, fn) in enumerate(cases):
        try:
            if isinstance(fn, Exception):
                raise fn
            for _ in range(3):   # compiles, fills each launch site's caches
                fn()
        except Exception as error:   # one failing function does not hide the others' rows
            cases[i] = (name, case, error)
    # The host's speed drifts over seconds (other tenants): every row is timed once a round, the rounds
    # in turn, and each row keeps its least round, so that no row sits wholly in a slow stretch.
    best = {}
    for _ in range(args.rounds):
        for i, (name, case, fn) in enumerate(cases):
            if isinstance(fn, Exception):
                continue
            try:
                t = time_host(fn, args.calls) if args.stub_kernels else time_eager(fn, args.calls)
            except Exception as error:
                cases[i] = (name, case, error)
                continue
            best[i] = min(best.get(i, t), t, key=lambda t: t if args.stub_kernels else t[1])
    for i, (name, case, fn) in enumerate(cases):
        try:
            if isinstance(fn, Exception):
                raise fn
            if args.stub_kernels:
                row = f"| {name} | {case} | {best[i]:.1f} | | | |"
            else:
                host, eager = best[i]
                graph = time_graph(fn, args.calls, args.per_graph)
                row = f"| {name} | {case} | {host:.1f} | {eager:.1f} | {graph:.1f} | {eager / graph:.2f} |"
        except Exception as error:
            row = f"| {name} | {case} | error: {type(error).__name__}: {str(error)[:120]} | | | |"
        lines.append(row)
        print(row, flush=True)
        if args.profile and not isinstance(fn, Exception):
            profile(fn, args.calls)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
