"""Benchmark the fp8 sparse MLA decode kernel on the GPU, with ceilings measured in the same run.

    python3 scripts/bench_decode.py --out decode-run.md --plot decode.png

Shapes (DeepSeek-V3.2 decode, as the peer bench's decode cases): b = 128 sequences of 32768 cached
tokens each, in pages of 64 tokens in shuffled order (2.75 GB of fp8 cache, far beyond L2); each query
token attends to topk = 2048 distinct random positions of its sequence. Rows: the public default path
(config=None, default splits) at s_q 1 with h_q 128, 64, 32, 16; s_q 2, 3, 4 with h_q 128 (multi-token
prediction, compared per query token: time / s_q); s_q 2, h_q 128 with topk_length drawn uniformly in
[0, topk] per sequence; the portable Triton kernel (config=PORTABLE) at h_q 128 s_q 2 and h_q 16 s_q 1;
mla_decode_fp8 (positions -> slots + decode) at h_q 128 s_q 2.

Counting: attended = b * s_q * topk, or sum(topk_length) * s_q where given.
TFLOP/s = 2 * attended * h_q * (576 + 512) / t. Effective GB/s = (attended * 656 + q + out) / t with q
b s_q h_q 576 and out b s_q h_q 512 bfloat16 values. Ceilings: a bf16 8192^3 torch matmul (TFLOP/s)
and a 1 GiB device copy (GB/s, bytes read + written); for the gathers, a Triton kernel that only reads
the attended tokens' 656 bytes (h_q 16 s_q 1's slots; XOR of their words, many programs per SM) gives
what this access pattern (656-byte tokens at random addresses of a 2.75 GB cache) can reach. Times are
medians of triton.testing.do_bench (which clears L2 before every repetition) over CUDA-graph replays of
each call: the GPU's time without the host's. Beside it, the eager call's (do_bench of the Python call, L2
cleared the same way): where it exceeds the replay's, the host's launch is the limit.

Correctness: every row's output on the query tokens of 4 sequences is compared with an fp32 torch
attention over the dequantised selected tokens (relative Frobenius error and max |diff| of out, max
|diff| of lse), so a fast but wrong variant shows (WRONG when the out rel. error or the lse max |diff|
is not below 1e-2). One CUDA-graph check on the default path (h_q 128, s_q 2): the call captured with
preallocated out/lse, replayed into NaN-poisoned outputs, compared with the eager output and timed
(replay, L2 cleared as above); the table's notes give the result.

DeepSeek-V4 rows (--cases v4), a second table over MODEL1 caches (584-byte entries), FlashMLA's
production configs: b = 128 sequences, s_q 2, a window cache of 16384 tokens per sequence in 256-entry
pages (window topk 128) and an extra (compressed) cache of 16384 entries per sequence in 64-entry pages
(CSA: extra topk 512 at h_q 64, V4-Flash; 1024 at h_q 128, V4-Pro; 512 at h_q 32 and 16, tensor
parallelism) or 2-entry pages with extra_topk_length uniform in [0, 1024] (HCA); one window-only row
(SWA layers); attn_sink on every row; positions distinct and random, pages shuffled. Counting: attended
= window + extra entries used; TFLOP/s = 2 * attended * h_q * (512 + 512) / t; effective GB/s =
(attended * 584 + q + out) / t, q and out b s_q h_q 512 bfloat16 values. Peak memory: the most the call
allocated beyond its inputs (torch.cuda.max_memory_allocated; split partials). Correctness as above,
against fp32 attention over both caches' dequantised entries with the sink. Beside the graph replay's
time, the eager call's (do_bench of the Python call, L2 cleared the same way): where it exceeds the
graph's, the host is the limit. The last rows force 2 splits where the default takes none (the split
rule's A/B).
"""
from __future__ import annotations

import argparse
import datetime
import time

import torch
import triton
import triton.language as tl
import triton.testing
from ceilings import measure_ceilings, plot_roofline, write_report

from minirt import formats
from minirt.formats import KV_ROPE_AT, KV_SCALES_AT, KV_TOKEN_BYTES
from minirt.kernels import sparse_mla_decode_sm90 as sm90
from minirt.kernels import sparse_mla_decode_sm90_few_heads as sm90_few_heads
from minirt.kernels.kv_cache_fp8 import dequantize_kv_fp8, new_kv_cache
from minirt.kernels.kv_cache_model1 import dequantize_kv_model1, model1_cache_entries, new_model1_cache
from minirt.kernels.sparse_mla_decode import (D_QK, D_V, default_config, default_num_splits, mla_decode_fp8,
                                              sparse_mla_decode_fp8, uses_sm90_kernel)

SEQLEN = 32768
TOPK = 2048
BLOCK_SIZE = 64
SM_SCALE = 0.135234   # (qk_nope + qk_rope)^-0.5 * mscale^2 for V3.2 (192^-0.5 * 1.3689^2)
REF_SEQUENCES = 4     # sequences whose query tokens are checked against the fp32 reference
WRONG_REL = 1e-2      # out rel. error (and lse max |diff|) above which a row is marked WRONG

# (h_q, s_q, kind, topk_length). kind DEFAULT: the public default (config=None: the Gluon kernel on sm_90
# GPUs, default splits); PORTABLE: the portable Triton kernel with default_config(h_q); WRAPPER:
# mla_decode_fp8 (block table + positions, the runtime's call). topk_length: drawn in [0, topk] per sequence.
DEFAULT, PORTABLE, WRAPPER = "default", "portable", "mla_decode_fp8"
VARIANTS = [
    (128, 2, DEFAULT, False),
    (128, 1, DEFAULT, False),
    (64, 1, DEFAULT, False),
    (32, 1, DEFAULT, False),
    (16, 1, DEFAULT, False),
    (128, 3, DEFAULT, False),
    (128, 4, DEFAULT, False),
    (128, 2, DEFAULT, True),
    (128, 2, PORTABLE, False),
    (16, 1, PORTABLE, False),
    (128, 2, WRAPPER, False),
]


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn's GPU work as a CUDA graph (run once on a side stream first: compiles, caches)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_ms(fn) -> float:
    """Median ms of fn's CUDA-graph replay, L2 cleared before each."""
    return triton.testing.do_bench(capture(fn).replay, warmup=25, rep=100, return_mode="median")


def build_cache(b: int, seqlen: int, device, seed: int = 0, block_size: int = BLOCK_SIZE):
    """(cache [b * seqlen / block_size, block_size, 1, 656] uint8, block table [b, seqlen / block_size] int32):
    every sequence holds seqlen tokens in pages of block_size, pages in shuffled order. The bytes are
    random valid tokens drawn on `device`: fp8 codes without NaN (|v| <= 416), power-of-two scales
    2^-8..2^-6 (values up to 6.5), random bf16 rope."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = seqlen // block_size
    table = torch.randperm(b * pages, generator=g, device=device).to(torch.int32).view(b, pages)
    cache = new_kv_cache(b * pages, block_size, device=device)
    flat = cache.view(-1, KV_TOKEN_BYTES)
    n = flat.shape[0]

    def randint(low, high, shape):
        return torch.randint(low, high, shape, generator=g, device=device, dtype=torch.uint8)

    flat[:, :KV_SCALES_AT] = randint(0, 0x7E, (n, KV_SCALES_AT)) | (randint(0, 2, (n, KV_SCALES_AT)) << 7)
    exponents = torch.randint(-8, -5, (n, (KV_ROPE_AT - KV_SCALES_AT) // 4), generator=g, device=device)
    flat[:, KV_SCALES_AT:KV_ROPE_AT] = torch.exp2(exponents.float()).view(torch.uint8)
    rope = torch.randn(n, (KV_TOKEN_BYTES - KV_ROPE_AT) // 2, generator=g, device=device)
    flat[:, KV_ROPE_AT:] = rope.to(torch.bfloat16).view(torch.uint8)
    return cache, table


def build_queries(b: int, s_q: int, h_q: int, seqlen: int, topk: int, table: torch.Tensor, seed: int):
    """(q [b, s_q, h_q, 576] bf16, positions [b, s_q, topk] int32: topk distinct random positions < seqlen
    per query token, slots [b, s_q, topk] int32: their cache slots through the block table)."""
    g = torch.Generator(device=table.device).manual_seed(seed)
    q = (torch.randn(b, s_q, h_q, D_QK, generator=g, device=table.device) * 0.5).to(torch.bfloat16)
    positions = torch.rand(b, s_q, seqlen, generator=g, device=table.device).topk(topk, dim=-1).indices
    block_size = seqlen // table.shape[1]
    pages = table.long().gather(1, (positions // block_size).view(b, -1)).view(positions.shape)
    slots = pages * block_size + positions % block_size
    return q, positions.to(torch.int32), slots.to(torch.int32)


def draw_topk_length(b: int, topk: int, device, seed: int) -> torch.Tensor:
    """[b] int32, uniform in [0, topk]."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, topk + 1, (b,), generator=g, device=device, dtype=torch.int32)


def reference_attention(q, cache, slots, sm_scale, topk_length=None):
    """fp32 torch attention of q [n, s_q, h_q, 576] over the dequantised cache tokens slots [n, s_q, topk]
    (all valid; the first topk_length[i] of sequence i where given) -> out [n, s_q, h_q, 512] float32,
    lse [n, h_q, s_q] (+inf for a sequence with no token)."""
    kv = dequantize_kv_fp8(cache.view(-1, KV_TOKEN_BYTES)[slots.long()], torch.float32)   # [n, s, t, 576]
    logits = torch.einsum("nshd,nstd->nsht", q.float(), kv) * sm_scale
    if topk_length is not None:
        unused = torch.arange(slots.shape[-1], device=slots.device) >= topk_length.long()[:, None, None, None]
        logits = logits.masked_fill(unused, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - torch.where(lse.isinf(), 0.0, lse)[..., None])
    out = torch.einsum("nsht,nstd->nshd", p, kv[..., :D_V])
    return out, torch.where(lse.isinf(), float("inf"), lse).transpose(1, 2)


def check_rows(out, lse, q, cache, slots, sm_scale, topk_length=None):
    """(out rel. error, out max |diff|, lse max |diff|) of the kernel's out [b, s_q, h_q, 512] and
    lse [b, h_q, s_q] on REF_SEQUENCES sequences spread over the batch, against reference_attention."""
    seqs = torch.linspace(0, q.shape[0] - 1, min(REF_SEQUENCES, q.shape[0]), device=q.device).long()
    r_out, r_lse = reference_attention(q[seqs], cache, slots[seqs], sm_scale,
                                       None if topk_length is None else topk_length[seqs])
    diff = out[seqs].float() - r_out
    lse_diff = torch.where(r_lse.isinf() & (lse[seqs] == r_lse), 0.0, lse[seqs] - r_lse)
    return ((diff.norm() / r_out.norm().clamp_min(1e-30)).item(), diff.abs().max().item(),
            lse_diff.abs().max().item())


def graph_check(q, cache, slots, eager_out, eager_lse, topk_length=None) -> str:
    """Capture the default sparse_mla_decode_fp8 call with preallocated out/lse in a CUDA graph, replay it
    into NaN-poisoned outputs, compare with the eager call's and time the replay."""
    out = torch.empty_like(eager_out)
    lse = torch.empty_like(eager_lse)

    graph = capture(lambda: sparse_mla_decode_fp8(q, cache, slots, SM_SCALE, topk_length=topk_length, out=out,
                                                  lse=lse))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    out_diff = (out.float() - eager_out.float()).abs().max().item()
    lse_diff = (lse - eager_lse).abs().max().item()
    us = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
    return (f"CUDA graph (default path, h_q {q.shape[2]}, s_q {q.shape[1]}"
            f"{', topk_length' if topk_length is not None else ''}, preallocated out/lse): replay "
            f"{us:.1f} µs; max |replay - eager|: out {out_diff:.2e}, lse {lse_diff:.2e}"
            + ("" if out_diff == 0 and lse_diff == 0 else " **(differs: NaN means a result not written)**"))


TOKEN_WORDS = tl.constexpr(KV_TOKEN_BYTES // 4)


@triton.jit
def _chunk_words(cache_ptr, slots_ptr, chunk, T: tl.constexpr):
    """The 164 words of the cache tokens of chunk `chunk` (T slots), as [T, 256] (0 past word 163)."""
    slots = tl.load(slots_ptr + chunk * T + tl.arange(0, T))
    words = tl.arange(0, 256)
    return tl.load(cache_ptr + slots.to(tl.int64)[:, None] * TOKEN_WORDS + words[None, :],
                   mask=(words < TOKEN_WORDS)[None, :], other=0)


@triton.jit
def gather_tokens_kernel(cache_ptr, slots_ptr, out_ptr, n_chunks, T: tl.constexpr, PERSISTENT: tl.constexpr):
    """XOR of the words of cache tokens: the gather alone. PERSISTENT: chunks pid, pid + programs, ... (T
    slots each), one chunk's loads at a time (bench_gather's bytes in flight); else chunk pid only (one
    program per chunk: the fastest launch, bench_decode's ceiling; the loop's one trip measured 2540 GB/s
    against 3048 without it)."""
    if PERSISTENT:
        acc = tl.zeros([T, 256], tl.int32)
        for chunk in tl.range(tl.program_id(0), n_chunks, tl.num_programs(0), num_stages=1):
            acc ^= _chunk_words(cache_ptr, slots_ptr, chunk, T)
    else:
        acc = _chunk_words(cache_ptr, slots_ptr, tl.program_id(0), T)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.xor_sum(acc, 1), 0))


def gather_ceiling(cache, slots) -> float:
    """GB/s of reading the 656-byte cache tokens of slots (all valid; a multiple of 64) and nothing else:
    the best of a few launch shapes, one program per chunk."""
    flat = slots.reshape(-1)
    best = 0.0
    for tokens, warps in ((16, 4), (64, 4), (64, 8)):
        out = torch.empty(flat.numel() // tokens, dtype=torch.int32, device=slots.device)
        ms = bench_ms(lambda: gather_tokens_kernel[(out.numel(),)](cache.view(torch.int32), flat, out, out.numel(),
                                                                    T=tokens, PERSISTENT=False, num_warps=warps))
        best = max(best, flat.numel() * KV_TOKEN_BYTES / ms / 1e6)
    return best


def measure(run, device) -> tuple:
    """One variant: (out, lse of its first call, the MiB that call allocated at its peak beyond what was
    allocated before, graph-replay ms, eager ms: called from Python with L2 cleared before each call, as
    for the graph, so the host's share shows)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out, lse = run()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    return out, lse, peak_mib, bench_ms(run), triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


def rates(flops: int, bytes_: int, ms: float, peak_tflops: float, copy_gbps: float) -> tuple[float, str]:
    """(TFLOP/s, the table's "TFLOP/s (% of matmul) | eff. GB/s (% of copy)" cells) of a variant's time."""
    tflops, gbps = flops / ms / 1e9, bytes_ / ms / 1e6
    return tflops, f"{tflops:.1f} ({100 * tflops / peak_tflops:.0f}%) | {gbps:.0f} ({100 * gbps / copy_gbps:.0f}%)"


def wrong_mark(rel: float, lse_diff: float) -> str:
    return "" if rel < WRONG_REL and lse_diff < WRONG_REL else " **WRONG**"


def error_row(shape: str, label: str, splits: int, exc: Exception) -> str:
    """The table row of a variant that failed to compile or launch."""
    return (f"{shape}| {label} | {splits} | error: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:80] if str(exc) else ''} | | | | | | |")


def kernel_label(q, kind) -> str:
    if kind == WRAPPER:
        return "mla_decode_fp8 (positions→slots + decode)"
    config = default_config(q.shape[2], q.shape[3]) if kind == PORTABLE else None
    few = sm90_few_heads.program_heads(q.shape[2])
    if not uses_sm90_kernel(q, config):
        shown = default_config(q.shape[2], q.shape[3])
        label = f"portable h{shown.block_h} n{shown.block_n} w{shown.num_warps} s{shown.num_stages}"
    else:
        kernel = "sm90 Gluon MODEL1" if q.shape[3] == formats.MODEL1_DIM else "sm90 Gluon"
        label = (f"{kernel} few-heads, h{few} n{sm90.BLOCK_N.value}, keys on M, 2 producers" if few
                 else f"{kernel}, h{sm90.BLOCK_H.value} n{sm90.BLOCK_N.value} warp-specialised")
    return label + (" (default)" if kind == DEFAULT else "")


V4_TOKENS, V4_WINDOW_PAGE, V4_WINDOW_TOPK, V4_S_Q = 16384, 256, 128, 2
# (h_q, extra_topk, extra page (None: no extra cache), extra_topk_length, kind, num_splits (None: the default))
V4_VARIANTS = [
    (64, 512, 64, False, DEFAULT, None),      # V4-Flash CSA layer
    (128, 1024, 64, False, DEFAULT, None),    # V4-Pro CSA layer
    (64, 1024, 2, True, DEFAULT, None),       # HCA layer: 2-entry pages, per-sequence count
    (128, 1024, 2, True, DEFAULT, None),
    (32, 512, 64, False, DEFAULT, None),      # tensor parallelism: 2 and 4 ranks of V4-Flash
    (16, 512, 64, False, DEFAULT, None),
    (64, 0, None, False, DEFAULT, None),      # SWA-only layer: the window alone
    (64, 512, 64, False, PORTABLE, None),
    # The split rule's A/B at 10-18 blocks a row (the default: no split at >= 2 programs per SM): more,
    # shorter programs pay the fixed cost per program more often (docs/perf/decode.md predicts slower).
    (16, 512, 64, False, DEFAULT, 2),
    (128, 1024, 64, False, DEFAULT, 2),
]


def build_model1_cache(b: int, entries_per_seq: int, block_size: int, device, seed: int):
    """(cache: the [pages, block_size, 1, 584] view of b * entries_per_seq / block_size MODEL1 pages, block
    table [b, pages per sequence] int32, pages shuffled): random valid entries drawn on `device`: e4m3 codes
    without NaN (|v| <= 416), tile scales 2^-8..2^-6, random bf16 rope, pad bytes 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_pages = b * entries_per_seq // block_size
    table = torch.randperm(n_pages, generator=g, device=device).to(torch.int32).view(b, -1)
    cache = new_model1_cache(n_pages, block_size, device)
    data_bytes, n = formats.MODEL1_DATA_BYTES, block_size
    pages = cache.as_strided((n_pages, n * formats.MODEL1_ENTRY_BYTES), (cache.stride(0), 1))
    data = pages[:, :n * data_bytes].view(n_pages, n, data_bytes)
    nope = formats.MODEL1_NOPE_DIM
    codes = torch.randint(0, 0x7E, (n_pages, n, nope), generator=g, device=device, dtype=torch.uint8)
    data[..., :nope] = codes | (torch.randint(0, 2, codes.shape, generator=g, device=device, dtype=torch.uint8) << 7)
    rope = torch.randn(n_pages, n, formats.MODEL1_ROPE_DIM, generator=g, device=device).to(torch.bfloat16)
    data[..., nope:] = rope.view(torch.uint8)
    scales = pages[:, n * data_bytes:].view(n_pages, n, formats.MODEL1_SCALE_BYTES)
    exponents = torch.randint(-8, -5, (n_pages, n, formats.MODEL1_NUM_TILES), generator=g, device=device)
    scales[..., :formats.MODEL1_NUM_TILES] = (exponents + formats.UE8M0_BIAS).to(torch.uint8)
    return cache, table


def model1_slots(table: torch.Tensor, block_size: int, entries_per_seq: int, s_q: int, topk: int, seed: int):
    """[b, s_q, topk] int32: topk distinct random entries of each sequence per query token, as slots."""
    g = torch.Generator(device=table.device).manual_seed(seed)
    b = table.shape[0]
    positions = torch.rand(b, s_q, entries_per_seq, generator=g, device=table.device).topk(topk, dim=-1).indices
    pages = table.long().gather(1, (positions // block_size).view(b, -1)).view(positions.shape)
    return (pages * block_size + positions % block_size).to(torch.int32)


def reference_model1(q, sources, sm_scale, attn_sink):
    """fp32 attention of q [n, s_q, h_q, 512] over the dequantised entries of sources, a list of (cache,
    slots [n, s_q, topk], lengths [n] or None), in one softmax with the sink -> out [n, s_q, h_q, 512],
    lse [n, h_q, s_q] (without the sink; +inf for a row with nothing)."""
    ks, used = [], []
    for cache, slots, lengths in sources:
        ks.append(dequantize_kv_model1(model1_cache_entries(cache, slots), torch.float32))
        mask = torch.ones(slots.shape, dtype=torch.bool, device=slots.device)
        if lengths is not None:
            mask &= torch.arange(slots.shape[-1], device=slots.device) < lengths.long()[:, None, None]
        used.append(mask)
    kv, used = torch.cat(ks, 2), torch.cat(used, 2)
    logits = torch.einsum("nshd,nstd->nsht", q.float(), kv) * sm_scale
    logits = logits.masked_fill(~used[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    finite = torch.where(lse.isinf(), 0.0, lse)
    out = torch.einsum("nsht,nstd->nshd", torch.exp(logits - finite[..., None]), kv)
    out = out / (1.0 + torch.exp(attn_sink[None, None, :] - finite))[..., None]
    return out, torch.where(lse.isinf(), float("inf"), lse).transpose(1, 2)


def v4_rows(b: int, device, peak_tflops: float, copy_gbps: float, deadline: float) -> str:
    """The DeepSeek-V4 table (see the module docstring)."""
    t_cache = time.time()
    window, window_table = build_model1_cache(b, V4_TOKENS, V4_WINDOW_PAGE, device, seed=40)
    extras = {page: build_model1_cache(b, V4_TOKENS, page, device, seed=41 + page) for page in (64, 2)}
    torch.cuda.synchronize()
    t_cache = time.time() - t_cache
    s_q, sm_scale = V4_S_Q, formats.MODEL1_DIM ** -0.5
    slots = model1_slots(window_table, V4_WINDOW_PAGE, V4_TOKENS, s_q, V4_WINDOW_TOPK, seed=50)
    rows = []
    for h_q, extra_topk, extra_page, with_length, kind, forced_splits in V4_VARIANTS:
        shape = (f"| {h_q} | {V4_WINDOW_TOPK} | " + (f"{extra_topk} (page {extra_page})" if extra_page else "none")
                 + f" | {'[0, extra_topk]' if with_length else 'full'} ")
        if time.time() > deadline:
            rows.append(f"{shape}| {kind} | | skipped: time budget | | | | | | |")
            continue
        g = torch.Generator(device=device).manual_seed(h_q)
        q = (torch.randn(b, s_q, h_q, formats.MODEL1_DIM, generator=g, device=device) * 0.5).to(torch.bfloat16)
        sink = torch.randn(h_q, generator=g, device=device)
        extra = {}
        sources = [(window, slots, None)]
        if extra_page:
            e_cache, e_table = extras[extra_page]
            e_slots = model1_slots(e_table, extra_page, V4_TOKENS, s_q, extra_topk, seed=60 + extra_topk)
            e_length = draw_topk_length(b, extra_topk, device, seed=8) if with_length else None
            extra = dict(extra_kv_cache=e_cache, extra_indices=e_slots, extra_topk_length=e_length)
            sources.append((e_cache, e_slots, e_length))
        config = default_config(h_q, formats.MODEL1_DIM) if kind == PORTABLE else None
        width = V4_WINDOW_TOPK + extra_topk
        splits = forced_splits or default_num_splits(q, width, config)
        label = kernel_label(q, kind) + (f", {forced_splits} splits forced" if forced_splits else "")
        run = lambda: sparse_mla_decode_fp8(q, window, slots, sm_scale, attn_sink=sink, config=config,  # noqa: E731
                                            num_splits=forced_splits, **extra)
        def check(out, lse):
            seqs = torch.linspace(0, b - 1, min(REF_SEQUENCES, b), device=device).long()
            r_out, r_lse = reference_model1(q[seqs], [(c, sl[seqs], None if ln is None else ln[seqs])
                                                      for c, sl, ln in sources], sm_scale, sink)
            rel = ((out[seqs].float() - r_out).norm() / r_out.norm().clamp_min(1e-30)).item()
            return rel, torch.where(r_lse.isinf() & (lse[seqs] == r_lse), 0.0, lse[seqs] - r_lse).abs().max().item()

        try:
            out, lse, peak_mib, ms, eager_ms = measure(run, device)
            rel, lse_diff = check(out, lse)
        except Exception as exc:   # a variant that fails to compile or launch is a result, not a crash
            rows.append(error_row(shape, label, splits, exc))
            print(rows[-1], flush=True)
            continue
        used_extra = 0 if not extra_page else (b * s_q * extra_topk if not with_length
                                               else int(extra["extra_topk_length"].long().sum()) * s_q)
        attended = b * s_q * V4_WINDOW_TOPK + used_extra
        flops = 2 * attended * h_q * (formats.MODEL1_DIM + D_V)
        bytes_ = attended * formats.MODEL1_ENTRY_BYTES + b * s_q * h_q * (formats.MODEL1_DIM + D_V) * 2
        _, cells = rates(flops, bytes_, ms, peak_tflops, copy_gbps)
        rows.append(f"{shape}| {label} | {splits} | {ms * 1e3:.1f} | {eager_ms * 1e3:.1f} | {cells} | {peak_mib:.1f} | "
                    f"{rel:.2e}{wrong_mark(rel, lse_diff)} | {lse_diff:.2e} |")
        print(rows[-1], flush=True)
        del out, lse
    return (f"DeepSeek-V4 (MODEL1 cache): b = {b}, s_q = {s_q}, window {V4_TOKENS} tokens per sequence in pages of "
            f"{V4_WINDOW_PAGE}, extra cache {V4_TOKENS} entries per sequence; attn_sink on; caches "
            f"{(window.stride(0) * window.shape[0] + sum(c.stride(0) * c.shape[0] for c, _ in extras.values())) / 1e9:.2f}"
            f" GB (built in {t_cache:.1f} s)\n\n"
            "| h_q | window topk (page 256) | extra topk | extra_topk_length | kernel | splits | time µs (graph) | "
            "eager µs | TFLOP/s (% of matmul) | eff. GB/s (% of copy) | peak extra MiB | out rel err vs fp32 ref | "
            "lse max abs diff |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def v32_report(args, device, peak_tflops: float, copy_gbps: float, t_start: float) -> str:
    """The V3.2 table (see the module docstring), with its header and notes."""
    b = args.batch
    t_cache = time.time()
    cache, table = build_cache(b, SEQLEN, device)
    torch.cuda.synchronize()
    t_cache = time.time() - t_cache
    gather_gbps = gather_ceiling(cache, build_queries(b, 1, 16, SEQLEN, TOPK, table, seed=1016)[2])
    header = (f"Gather of the attended tokens alone (same run): {gather_gbps:.0f} GB/s\n"
              f"b = {b} sequences of {SEQLEN} tokens, topk = {TOPK}, block_size = {BLOCK_SIZE} (pages shuffled); "
              f"cache {cache.numel() / 1e9:.2f} GB (built in {t_cache:.1f} s)\n")
    print(header, flush=True)

    problems = {}
    rows, notes, points = [], [], []
    per_token, tflops_of = {}, {}
    chosen = VARIANTS if args.variants is None else [VARIANTS[int(i)] for i in args.variants.split(",")]
    for h_q, s_q, kind, with_length in chosen:
        shape = f"| {h_q} | {s_q} | {'[0, topk]' if with_length else 'topk'} "
        if time.time() - t_start > args.budget_s:
            rows.append(f"{shape}| {kind} | | skipped: time budget | | | | | | |")
            continue
        if (h_q, s_q) not in problems:
            problems[(h_q, s_q)] = build_queries(b, s_q, h_q, SEQLEN, TOPK, table, seed=1000 * s_q + h_q)
        q, positions, slots = problems[(h_q, s_q)]
        topk_length = draw_topk_length(b, TOPK, device, seed=7) if with_length else None
        config = default_config(h_q) if kind == PORTABLE else None
        splits = default_num_splits(q, TOPK, config)
        label = kernel_label(q, kind)
        if kind == WRAPPER:
            run = lambda: mla_decode_fp8(q, cache, table, positions, SM_SCALE)  # noqa: E731
        else:
            run = lambda: sparse_mla_decode_fp8(q, cache, slots, SM_SCALE, topk_length=topk_length,  # noqa: E731
                                                config=config)
        try:
            out, lse, _, ms, eager_ms = measure(run, device)
            rel, out_diff, lse_diff = check_rows(out, lse, q, cache, slots, SM_SCALE, topk_length)
        except Exception as exc:   # a variant that fails to compile or launch is a result, not a crash
            rows.append(error_row(shape, label, splits, exc))
            print(rows[-1], flush=True)
            continue
        attended = b * s_q * TOPK if topk_length is None else int(topk_length.long().sum()) * s_q
        flops = 2 * attended * h_q * (D_QK + D_V)
        bytes_ = attended * KV_TOKEN_BYTES + b * s_q * h_q * (D_QK + D_V) * 2
        tflops, cells = rates(flops, bytes_, ms, peak_tflops, copy_gbps)
        rows.append(f"{shape}| {label} | {splits} | {ms * 1e3:.1f} | {eager_ms * 1e3:.1f} | {ms * 1e3 / s_q:.1f} | "
                    f"{cells} | {rel:.2e}{wrong_mark(rel, lse_diff)} | {out_diff:.2e} | {lse_diff:.2e} |")
        print(rows[-1], flush=True)
        if kind == DEFAULT:
            per_token[(h_q, s_q, with_length)] = ms * 1e3 / s_q
            tflops_of[(h_q, s_q, with_length)] = tflops
            points.append((f"h{h_q} s_q{s_q}" + (" topk_length" if with_length else ""), flops, bytes_, ms * 1e-3))
            if (h_q, s_q) == (128, 2):
                try:
                    notes.append(graph_check(q, cache, slots, out, lse, topk_length))
                except Exception as exc:   # capture must keep working: a failure is the result to report
                    notes.append(f"CUDA graph capture of the default path FAILED: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
                print(notes[-1], flush=True)
        del out, lse

    base = per_token.get((128, 1, False))
    if base:
        ratios = [f"s_q {s_q} {per_token[(128, s_q, False)] / base:.2f}x"
                  for s_q in (2, 3, 4) if (128, s_q, False) in per_token]
        notes.append(f"Multi-token prediction, h_q 128, time per query token relative to s_q 1 ({base:.1f} µs; "
                     f"≤ 1.00x is at least as efficient): " + ", ".join(ratios))
    if (128, 2, True) in tflops_of and (128, 2, False) in tflops_of:
        notes.append(f"topk_length (h_q 128, s_q 2): {tflops_of[(128, 2, True)]:.1f} TFLOP/s on the attended tokens "
                     f"= {tflops_of[(128, 2, True)] / tflops_of[(128, 2, False)]:.2f}x the plain row's "
                     f"{tflops_of[(128, 2, False)]:.1f}")
    table_md = ("| h_q | s_q | topk_length | kernel (BLOCK_H, BLOCK_N, warps, stages) | splits | time µs | "
                "eager µs | µs per query token (time / s_q) | TFLOP/s (% of matmul) | eff. GB/s (% of copy) | "
                "out rel err vs fp32 ref | out max abs diff | lse max abs diff |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    notes_md = "".join(f"- {note}\n" for note in notes)
    if args.plot:
        plot_roofline(args.plot, f"sparse_mla_decode_fp8, b {b}, topk {TOPK}", points, peak_tflops, copy_gbps)
    return f"{header}\n{table_md}\n{notes_md}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as a markdown table here")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="stop starting new rows after this many seconds")
    parser.add_argument("--batch", type=int, default=128, help="sequences (b)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=None,
                        help="comma-separated indices into VARIANTS (default: all)")
    parser.add_argument("--plot", help="write a roofline PNG of the default rows here")
    parser.add_argument("--cases", choices=("v32", "v4", "all"), default="all",
                        help="the V3.2 table (656-byte cache), the DeepSeek-V4 table (MODEL1 cache), or both")
    args = parser.parse_args()
    t_start = time.time()
    device = torch.device(args.device)
    props = torch.cuda.get_device_properties(device)
    peak_tflops, copy_gbps = measure_ceilings(device)
    header = (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"Ceilings (same run): bf16 matmul 8192^3 {peak_tflops:.0f} TFLOP/s; "
              f"device copy {copy_gbps:.0f} GB/s (read + write)\n")
    print(header, flush=True)
    reports = [header]
    if args.cases in ("v32", "all"):
        reports.append(v32_report(args, device, peak_tflops, copy_gbps, t_start))
        print(reports[-1], flush=True)
    if args.cases in ("v4", "all"):
        reports.append(v4_rows(args.batch, device, peak_tflops, copy_gbps, t_start + args.budget_s))
        print(reports[-1], flush=True)
    if args.out:
        write_report("\n".join(reports), args.out)


if __name__ == "__main__":
    main()
