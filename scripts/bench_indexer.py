"""Benchmark the lightning indexer kernel (scores, and scores + top-k) on the GPU against the sparse MLA
prefill it feeds and the bf16 matmul ceiling, all measured in the same run.

    python3 scripts/bench_indexer.py [--out results.md] [--variants 2,128,8,3 4,64,8,2 ...]
    python3 scripts/bench_indexer.py --decode-sweep     # only DeepSeek-V4's CSA decode shape, over launch shapes

Prefill shape (DeepSeek-V3.2): the last T = 4096 queries of a 32768-token sequence (limit[t] = 28672 + t)
against all S = 32768 keys, H = 64 heads, D = 128, bf16. TFLOP/s counts only the causal part that is
needed, FLOPs = 2 H D sum_t (limit[t] + 1) (the kernel also computes the masked part of the tiles that
straddle the diagonal). The target: scores + indexer_topk(2048) no slower than sparse_mla_prefill at
s_q 4096, s_kv 32768, top-k 2048 (random valid indices), h_q 128, d_qk 576, d_v 512.
float32 inputs with full 24-bit mantissas (the exact mode's dtype; three bf16 products of split
operands) at the same shape: scores (keys split into bf16 parts once, as prefill does, and as each tile
loads, as decode does), scores + indexer_topk, and the selection of the check rows against that of
eager fp32 torch scores (cuBLAS fp32 products).
--decode-sweep: DeepSeek-V4's CSA decode scores (float32 keys, one query a sequence, B 1 and 16, each over
DECODE_SWEEP_KEYS compressed keys: a 1,048,576-token context at ratio 4) with default_config's launch and
each of DECODE_SWEEP_VARIANTS, checked against eager fp32 torch, then the fastest correct one.
Decode rows: B sequences, one query each, against S = 32768 keys each (memory-bound: GB/s counts the
keys read and the scores written). Every kernel variant is first compared with an eager fp32 torch
evaluation on 64 query rows. Times are triton.testing.do_bench medians (L2 cleared before each rep).
A failing measurement is reported in its cell; the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime

import torch
import triton
from triton.testing import do_bench

from ceilings import measure_ceilings, write_report

from minirt.kernels import lightning_indexer
from minirt.kernels.lightning_indexer import IndexerConfig, default_config, indexer_topk, lightning_indexer_scores
from minirt.kernels.sparse_mla_prefill import sparse_mla_prefill
from minirt.report import topk_overlap

T, S, H, D, TOPK = 4096, 32768, 64, 128, 2048
DECODE_BATCHES = (1, 32, 128)
# float32 decode launch shapes (block_t 1) that compile for sm_90a without spills (1,128,4,2 and 1,128,4,3 spill).
DECODE_SWEEP_KEYS = 262144
DECODE_SWEEP_VARIANTS = ["1,64,8,3", "1,64,4,4", "1,64,4,2", "1,128,8,2", "1,32,4,4", "1,32,4,6",
                         "1,64,8,4"]
DEFAULT_VARIANTS = ["4,64,8,4", "4,64,8,2", "4,64,4,3", "4,32,4,3", "2,64,4,3", "2,128,8,3", "8,32,8,3"]


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def attempt(fn) -> str:
    """fn() formatted, or the failure in one short cell."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failure is a result too; keep benchmarking the rest
        torch.cuda.synchronize()
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def parse_variant(text: str) -> IndexerConfig:
    block_t, block_s, num_warps, num_stages = (int(x) for x in text.split(","))
    return IndexerConfig(block_t=block_t, block_s=block_s, num_warps=num_warps, num_stages=num_stages)


def launch_sweep(name: str, default: IndexerConfig, variants, run, rate, row) -> None:
    """A launch-shape sweep: run(config) (an error text, or the ms of a correct launch) for the default
    launch and each variant "block_t,block_s,num_warps,num_stages", each reported as row(label, cell)
    with rate(ms), then the fastest correct one."""
    default_text = f"{default.block_t},{default.block_s},{default.num_warps},{default.num_stages}"
    timed = {}     # launch -> ms, of the correct ones

    def cell(text):
        result = run(parse_variant(text))
        if isinstance(result, str):
            return result
        timed[text] = result
        return rate(result)

    for text in dict.fromkeys([default_text, *variants]):
        row(f"{name}, {'default' if text == default_text else 'variant'} {text}", attempt(lambda: cell(text)))
    if timed:
        best = min(timed, key=timed.get)
        row(f"{name}: fastest correct launch {best}", rate(timed[best]))


def eager_scores(q, k, weights, limit, chunk=128):
    """bf16 matmuls, fp32 relu / weighting / head sum, chunked over queries to bound [c, H, S]."""
    out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    for start in range(0, q.shape[0], chunk):
        logits = torch.matmul(q[start:start + chunk], k.T).float().relu_()       # [c, H, S]
        scores = torch.einsum("chs,ch->cs", logits, weights[start:start + chunk])
        out[start:start + chunk] = scores.masked_fill(keys[None, :] > limit[start:start + chunk, None], float("-inf"))
    return out


def attention_ms() -> float:
    """sparse_mla_prefill at the shape the indexer feeds: the time the indexer should stay under."""
    gen = torch.Generator("cuda").manual_seed(1)
    q = torch.randn((T, 128, 576), generator=gen, device="cuda").bfloat16()
    kv = torch.randn((S, 1, 576), generator=gen, device="cuda").bfloat16()
    indices = torch.randint(0, S, (T, 1, TOPK), generator=gen, device="cuda", dtype=torch.int32)
    return bench_ms(lambda: sparse_mla_prefill(q, kv, indices, 576**-0.5))


@contextlib.contextmanager
def split_as_tiles_load():
    """float32 keys split into bf16 parts in every program as it loads a tile (decode's path), at any T."""
    presplit = lightning_indexer.PRESPLIT_MIN_QUERIES
    lightning_indexer.PRESPLIT_MIN_QUERIES = 2**31
    try:
        yield
    finally:
        lightning_indexer.PRESPLIT_MIN_QUERIES = presplit


def fp32_rows(q_shape, k_shape, weights, limit, check_rows, fmt, row, gen):
    """The rows of float32 inputs (module docstring), at default_config for 4-byte inputs."""
    q = torch.randn(q_shape, generator=gen, device="cuda")
    k = torch.randn(k_shape, generator=gen, device="cuda")
    config = default_config(T, H, D, 4)
    expected = eager_scores(q[check_rows], k, weights[check_rows], limit[check_rows])
    finite = torch.isfinite(expected)

    def scores_cell():
        got = lightning_indexer_scores(q[check_rows], k, weights[check_rows], limit[check_rows], config=config)
        rel = ((got[finite] - expected[finite]).norm() / expected[finite].norm()).item()
        if not (rel < 1e-5 and torch.equal(torch.isfinite(got), finite)):
            return f"WRONG (rel err {rel:.2g})"
        got_topk, want_topk = indexer_topk(got, TOPK), indexer_topk(expected, TOPK)
        same = int((got_topk == want_topk).all(-1).sum())
        ms = bench_ms(lambda: lightning_indexer_scores(q, k, weights, limit, config=config))
        return (f"{fmt(ms)}; rel err {rel:.1e}; top-{TOPK} overlap with eager fp32 "
                f"{topk_overlap(got_topk, want_topk):.4%}, {same} of {len(check_rows)} rows identical")
    name = f"float32 inputs, default {config.block_t},{config.block_s},{config.num_warps},{config.num_stages}"
    row(f"{name}: scores", attempt(scores_cell))
    with split_as_tiles_load():
        row(f"{name}: scores, keys split as each tile loads", attempt(scores_cell))
    row(f"{name}: scores + indexer_topk", attempt(lambda: f"{bench_ms(lambda: indexer_topk(lightning_indexer_scores(q, k, weights, limit, config=config), TOPK)):.3f} ms"))


def decode_sweep(gen, row) -> None:
    """--decode-sweep (module docstring); row(name, cell) reports."""
    for n_batch in (1, 16):
        q = torch.randn((n_batch, 1, H, D), generator=gen, device="cuda")
        k = torch.randn((n_batch, DECODE_SWEEP_KEYS, D), generator=gen, device="cuda")
        weights = torch.randn((n_batch, 1, H), generator=gen, device="cuda") * (H * D) ** -0.5
        limit = torch.full((n_batch, 1), DECODE_SWEEP_KEYS - 1, device="cuda", dtype=torch.int32)
        expected = torch.stack([eager_scores(q[b], k[b], weights[b], limit[b]) for b in range(n_batch)])
        traffic = n_batch * DECODE_SWEEP_KEYS * (4 * D + 4)   # float32 keys read, scores written

        def run(config):
            out = torch.full_like(expected, float("nan"))
            lightning_indexer_scores(q, k, weights, limit, out=out, config=config)
            rel = ((out - expected).norm() / expected.norm()).item()
            if not rel < 1e-5:
                return f"WRONG (rel err {rel:.2g})"
            return bench_ms(lambda: lightning_indexer_scores(q, k, weights, limit, out=out, config=config))

        launch_sweep(f"float32 decode scores, B {n_batch} x 1 query, S {DECODE_SWEEP_KEYS} each",
                     default_config(1, H, D, 4), DECODE_SWEEP_VARIANTS, run,
                     lambda ms: f"{traffic / ms / 1e6:.0f} GB/s ({ms:.3f} ms)", row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="-", help="markdown destination (default stdout)")
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                        help="kernel configs block_t,block_s,num_warps,num_stages besides the default")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only V4's CSA decode scores (float32), over DECODE_SWEEP_VARIANTS, naming the fastest")
    args = parser.parse_args()

    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn((T, H, D), generator=gen, device="cuda").bfloat16()
    k = torch.randn((S, D), generator=gen, device="cuda").bfloat16()
    weights = torch.randn((T, H), generator=gen, device="cuda") * (H * D) ** -0.5
    limit = torch.arange(S - T, S, device="cuda", dtype=torch.int32)
    flops = 2 * H * D * int((limit.long() + 1).sum())
    check_rows = torch.cat([torch.arange(0, 32, device="cuda"), torch.arange(T - 32, T, device="cuda")])
    expected = eager_scores(q[check_rows].float(), k.float(), weights[check_rows], limit[check_rows])
    finite = torch.isfinite(expected)

    def fmt(ms):
        return f"{flops / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)"

    def scores_cell(config):
        got = lightning_indexer_scores(q[check_rows], k, weights[check_rows], limit[check_rows], config=config)
        rel = ((got[finite] - expected[finite]).norm() / expected[finite].norm()).item()
        if not (rel < 1e-4 and torch.equal(torch.isfinite(got), finite)):
            return f"WRONG (rel err {rel:.2g})"
        return fmt(bench_ms(lambda: lightning_indexer_scores(q, k, weights, limit, config=config)))

    default = default_config(T, H, D)
    matmul_tflops, copy_gbps = measure_ceilings()
    lines = [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}",
        f"- ceilings: bf16 matmul 8192^3 {matmul_tflops:.0f} TFLOP/s, device copy {copy_gbps:.0f} GB/s (read + write)",
        f"- prefill: T {T} (limit[t] = {S - T} + t), S {S}, H {H}, D {D}, bf16; TFLOP/s of the causal part "
        f"needed ({flops / 1e12:.2f} TFLOP); default config {default}",
        "",
        "| what | result |",
        "|---|---:|",
    ]
    print("\n".join(lines), flush=True)

    def row(name, cell):
        lines.append(f"| {name} | {cell} |")
        print(lines[-1], flush=True)

    if args.decode_sweep:
        decode_sweep(gen, row)
        write_report("\n".join(lines) + "\n", args.out)
        return

    row("sparse_mla_prefill (h_q 128, d_qk 576, top-k 2048): the target", attempt(lambda: f"{attention_ms():.3f} ms"))
    row(f"scores, default {default.block_t},{default.block_s},{default.num_warps},{default.num_stages}",
        attempt(lambda: scores_cell(default)))
    scores = lightning_indexer_scores(q, k, weights, limit, config=default)
    row("indexer_topk(scores, 2048) alone", attempt(lambda: f"{bench_ms(lambda: indexer_topk(scores, TOPK)):.3f} ms"))
    row("torch.topk(scores, 2048) alone (fp32, ties unordered: lower bound)",
        attempt(lambda: f"{bench_ms(lambda: torch.topk(scores, TOPK, dim=-1)):.3f} ms"))
    row("scores + indexer_topk, default", attempt(lambda: f"{bench_ms(lambda: indexer_topk(lightning_indexer_scores(q, k, weights, limit, config=default), TOPK)):.3f} ms"))
    del scores
    fp32_rows(q.shape, k.shape, weights, limit, check_rows, fmt, row, gen)
    row("eager torch scores (chunked bf16 matmul + fp32 head sum)",
        attempt(lambda: fmt(bench_ms(lambda: eager_scores(q, k, weights, limit)))))
    for text in args.variants:
        row(f"scores, variant {text}", attempt(lambda: scores_cell(parse_variant(text))))

    for n_batch in DECODE_BATCHES:
        def decode_cell():
            dq = torch.randn((n_batch, 1, H, D), generator=gen, device="cuda").bfloat16()
            dk = torch.randn((n_batch, S, D), generator=gen, device="cuda").bfloat16()
            dw = torch.randn((n_batch, 1, H), generator=gen, device="cuda") * (H * D) ** -0.5
            dlimit = torch.full((n_batch, 1), S - 1, device="cuda", dtype=torch.int32)
            config = default_config(1, H, D)
            ms = bench_ms(lambda: lightning_indexer_scores(dq, dk, dw, dlimit, config=config))
            return f"{n_batch * S * (2 * D + 4) / ms / 1e6:.0f} GB/s ({ms:.3f} ms)"
        row(f"decode scores, B {n_batch} x 1 query, S {S} each", attempt(decode_cell))

    text = "\n".join(lines) + "\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()
