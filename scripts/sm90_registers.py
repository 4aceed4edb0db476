"""Compile the warp-specialised Gluon kernels (sparse prefill; fp8 sparse decode over V32 caches, 64 heads and
few, and over MODEL1 caches), the MoE layers' fp8 grouped GEMM (Gluon) and per-assignment decode products,
the decode's split merge, fp8_gemm's weight-streaming kernel, the indexer's scores kernels (paged, Triton and
the Gluon prefill chunk's, and V4's CSA decode), decode_topk's kernels and indexer_topk's candidate kernels
for sm_90a on this machine (no GPU needed) and report each warp partition's register budget and each
kernel's spill instructions and 2-byte global accesses.

    python3 scripts/sm90_registers.py        # exit status 1 if any partition spills, or any kernel
                                             # loads or stores global memory 2 bytes at a time

The kernel is specialised exactly as the JIT would specialise a real launch (the launch is recorded
with CPU tensors of DeepSeek shapes, then bound by Triton's own binder), compiled with the wheel's
ptxas, and its SASS read with the wheel's cuobjdump. Spills decide this kernel's speed on the H200
(prefill: 222 TFLOP/s with them, 439 without: docs/perf/prefill.md), and this check needs no device
time.
"""
from __future__ import annotations

import os

# Gluon kernels call triton's library functions compiled; minirt picks the interpreter on a machine
# without a GPU unless told otherwise, before its kernels are defined.
os.environ["TRITON_INTERPRET"] = "0"

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from minirt.kernels import indexer_cache, indexer_scores_sm90, lightning_indexer  # noqa: E402
from minirt.kernels._launch import Kept  # noqa: E402
from minirt.kernels import ExpertWeights, moe_experts  # noqa: E402
from minirt.kernels.decode_topk import decode_topk  # noqa: E402
from minirt.kernels.fp8_gemm import fp8_gemm  # noqa: E402
from minirt.kernels import sparse_mla_decode as decode  # noqa: E402
from minirt.kernels import moe_grouped_fp4_sm90, moe_grouped_sm90  # noqa: E402
from minirt.kernels import sparse_mla_decode_model1_sm90  # noqa: E402
from minirt.kernels import sparse_mla_decode_sm90  # noqa: E402
from minirt.kernels import sparse_mla_decode_sm90_few_heads  # noqa: E402
from minirt.kernels import sparse_mla_prefill_sm90  # noqa: E402
from minirt.kernels.kv_cache_model1 import new_model1_cache  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class Recorder:
    """Stands in for a kernel object: kernel[grid](*args, **kwargs) records the arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextlib.contextmanager
def recording(module, names):
    """Within: module's kernels of those names replaced by Recorders, yielded as {name: (kernel, recorder)};
    the kernels put back on exit."""
    kept = {name: (getattr(module, name), Recorder()) for name in names}
    for name, (_, recorder) in kept.items():
        setattr(module, name, recorder)
    try:
        yield kept
    finally:
        for name, (kernel, _) in kept.items():
            setattr(module, name, kernel)


def recorded_prefill_launch(d_qk: int, with_options: bool):
    """(args, kwargs) that the prefill launcher passes to its kernel for s_q 4, h_q 128, topk 2048."""
    q = torch.empty((4, 128, d_qk), dtype=torch.bfloat16)
    kv = torch.empty((4096, 1, d_qk), dtype=torch.bfloat16)
    indices = torch.empty((4, 1, 2048), dtype=torch.int32)
    out = (torch.empty((4, 128, 512), dtype=torch.bfloat16), torch.empty((4, 128)), torch.empty((4, 128)))
    sink = torch.empty(128) if with_options else None
    lengths = torch.empty(4, dtype=torch.int32) if with_options else None
    kernel, recorder = sparse_mla_prefill_sm90._sparse_mla_prefill_sm90_kernel, Recorder()
    sparse_mla_prefill_sm90._sparse_mla_prefill_sm90_kernel = recorder
    try:
        sparse_mla_prefill_sm90.launch(q, kv, indices, 0.1, sink, lengths, out, Kept())
    finally:
        sparse_mla_prefill_sm90._sparse_mla_prefill_sm90_kernel = kernel
    return recorder.calls[0]


def recorded_decode_launch(num_splits: int, padded_blocks: bool = False, h_q: int = 128, merge: bool = False,
                           model1: bool = False):
    """(kernel, args, kwargs): the Gluon kernel that sparse_mla_decode_fp8 runs for b 2, s_q 2, h_q,
    topk 2048 in num_splits splits (1: final results, more: partials), over a cache whose blocks are
    packed or (padded_blocks) a view with one token's gap after each block, and what it passes; merge
    (num_splits > 1): the split merge's Triton kernel instead; model1: over V4-Flash's MODEL1 caches
    instead (a window top-k of 128 over 256-entry pages, 512 compressed entries over 64-entry pages, both
    lengths and a sink given). Its device checks are stood in for: the tensors are on the CPU."""
    saved = {name: getattr(decode, name)
             for name in ("uses_sm90_kernel", "check_device", "_merge_splits_kernel", "longest_first")}
    if model1:
        q = torch.randn((2, 2, h_q, 512)).to(torch.bfloat16)
        cache, extra = new_model1_cache(4, 256), new_model1_cache(32, 64)
        indices, extra_indices = (torch.zeros((2, 2, k), dtype=torch.int32) for k in (128, 512))
        lengths = torch.zeros(2, dtype=torch.int32)
        options = dict(attn_sink=torch.zeros(h_q), topk_length=lengths, extra_kv_cache=extra,
                       extra_indices=extra_indices, extra_topk_length=lengths)
        decode.longest_first = lambda topk_length, *widths: topk_length   # (a Triton launch on the CPU)
    else:
        q = torch.randn((2, 2, h_q, 576)).to(torch.bfloat16)
        cache = torch.zeros((64, 64 + padded_blocks, 1, 656), dtype=torch.uint8)[:, :64]
        indices = torch.zeros((2, 2, 2048), dtype=torch.int32)
        options = {}
    if model1:
        module, name = sparse_mla_decode_model1_sm90, "_sparse_decode_model1_kernel"
    elif sparse_mla_decode_sm90_few_heads.program_heads(h_q):
        module, name = sparse_mla_decode_sm90_few_heads, "_sparse_decode_few_heads_kernel"
    else:
        module, name = sparse_mla_decode_sm90, "_sparse_decode_sm90_kernel"
    kernel, recorder, merge_recorder = getattr(module, name), Recorder(), Recorder()
    decode.uses_sm90_kernel = lambda *args, **kwargs: True
    decode.check_device = lambda tensors: None
    decode._merge_splits_kernel = merge_recorder
    setattr(module, name, recorder)
    try:
        decode.sparse_mla_decode_fp8(q, cache, indices, 0.1, num_splits=num_splits, **options)
    finally:
        setattr(module, name, kernel)
        for name, value in saved.items():
            setattr(decode, name, value)
    if merge:
        return (decode._merge_splits_kernel, *merge_recorder.calls[0])
    return (kernel, *recorder.calls[0])


def recorded_indexer_launch(fp8: bool, n_queries: int, n_batch: int = 1):
    """(kernel, args, kwargs): paged_indexer_scores' launch with its default config for n_batch sequences of
    n_queries queries (64 heads of 128) over 131072 keys in pages of 64, fp8 or exact (float32) keys."""
    n_keys, block_size, heads, dim = 131072, 64, 64, 128
    num_blocks = n_keys // block_size
    if fp8:
        cache = torch.empty((num_blocks, block_size, 1, 132), dtype=torch.uint8)
        q = torch.empty((n_batch, n_queries, heads, dim), dtype=torch.float8_e4m3fn)
        geometry = indexer_cache._fp8_cache_geometry(cache)
    else:
        cache = torch.empty((num_blocks, block_size, dim))
        q = torch.empty((n_batch, n_queries, heads, dim))
        geometry = indexer_cache._exact_cache_geometry(cache)
    weights, out = torch.empty((n_batch, n_queries, heads)), torch.empty((n_batch, n_queries, n_keys))
    table = torch.empty((n_batch, n_keys // block_size), dtype=torch.int32)
    limit = torch.empty((n_batch, n_queries), dtype=torch.int64)
    config = indexer_cache.paged_config(n_queries, heads, dim, fp8)
    kernel, recorder = indexer_cache._paged_scores_kernel, Recorder()
    indexer_cache._paged_scores_kernel = recorder
    try:
        indexer_cache._launch_paged(q, weights, cache, table, limit, out, Kept((fp8, geometry, config, n_keys)))
    finally:
        indexer_cache._paged_scores_kernel = kernel
    return (kernel, *recorder.calls[0])


def recorded_indexer_sm90_launch(fp8: bool):
    """(kernel, args, kwargs): the Gluon scores kernel's launch for a prefill chunk of 2048 queries (64 heads of
    128) over 131072 keys in pages of 64, fp8 keys or exact keys split into bf16 parts (split_pages' layout)."""
    n_queries, n_keys, heads, dim = 2048, 131072, 64, 128
    num_blocks = n_keys // 64
    if fp8:
        q = torch.empty((1, n_queries, heads, dim), dtype=torch.float8_e4m3fn)
        keys = keys_lo = torch.empty((num_blocks, 64, 1, 132), dtype=torch.uint8)
    else:
        q = torch.empty((1, n_queries, heads, dim))
        keys, keys_lo = (torch.empty((num_blocks, 64, dim), dtype=torch.bfloat16) for _ in range(2))
    weights, out = torch.empty((1, n_queries, heads)), torch.empty((1, n_queries, n_keys))
    table = torch.empty((1, num_blocks), dtype=torch.int32)
    limit = torch.empty((1, n_queries), dtype=torch.int64)
    kernel, recorder = indexer_scores_sm90._paged_scores_sm90_kernel, Recorder()
    indexer_scores_sm90._paged_scores_sm90_kernel = recorder
    try:
        indexer_scores_sm90.paged_scores(q, weights, keys, keys_lo, table, limit, out, n_keys, fp8,
                                         (n_queries // indexer_scores_sm90.ROWS, 1, num_blocks))
    finally:
        indexer_scores_sm90._paged_scores_sm90_kernel = kernel
    return (kernel, *recorder.calls[0])


def recorded_csa_decode_launch():
    """(kernel, args, kwargs): lightning_indexer_scores' launch with its default config for DeepSeek-V4's CSA
    decode: 16 sequences of one float32 query (64 heads of 128), each over 262144 keys (1M tokens / 4)."""
    n_batch, n_keys, heads, dim = 16, 262144, 64, 128
    q, k = torch.empty((n_batch, 1, heads, dim)), torch.empty((n_batch, n_keys, dim))
    weights, limit = torch.empty((n_batch, 1, heads)), torch.empty((n_batch, 1), dtype=torch.int64)
    out = torch.empty((n_batch, 1, n_keys))
    config = lightning_indexer.default_config(1, heads, dim, q.element_size())
    grid, _, integers, constexprs = lightning_indexer._launch_args(q, k, weights, limit, out, config)
    return lightning_indexer._indexer_scores_kernel, (q, k, k, weights, limit, out, *integers), constexprs


def recorded_moe_grouped_launch(swiglu: bool, limit=None, fp4: bool = False):
    """(kernel, args, kwargs): the grouped GEMM launch of a MoE layer's 4096-token prefill (256 experts, 384
    tiles of 128 rows): DeepSeek-V3.2's fp8 experts (D 7168, I 2048), or fp4: V4-Flash's (D 4096, I 2048, the
    folded products); gate/up with SwiGLU (limit: V4's clamp), or down."""
    experts, d, i, tiles = 256, 4096 if fp4 else 7168, 2048, 384
    n, k = (2 * i, d) if swiglu else (d, i)
    rows = tiles * moe_grouped_sm90.BLOCK_M
    a, a_scales = torch.empty((rows, k), dtype=torch.float8_e4m3fn), torch.empty((rows, k // 128))
    if fp4:
        weight = torch.empty((experts, n, k // 2), dtype=torch.uint8)
        scales = torch.empty((experts, n, k // 32), dtype=torch.uint8)
    else:
        weight = torch.empty((experts, n, k), dtype=torch.float8_e4m3fn)
        scales = torch.empty((experts, n // 128, k // 128))
    out = torch.empty((rows, i), dtype=torch.uint8) if swiglu else torch.empty((rows, d), dtype=torch.bfloat16)
    out_scales = torch.empty((rows, i // 128)) if swiglu else None
    tile_expert = torch.empty(tiles, dtype=torch.int32)
    module, name = (moe_grouped_fp4_sm90, "_grouped_fp4_sm90_kernel") if fp4 else \
        (moe_grouped_sm90, "_grouped_fp8_sm90_kernel")
    kernel, recorder = getattr(module, name), Recorder()
    setattr(module, name, recorder)
    try:
        if fp4:
            module.grouped_fp4(a, a_scales, weight, scales, tile_expert, out, out_scales,
                               torch.empty(tiles * (n // 2 if swiglu else n) // 128, dtype=torch.int32),
                               swiglu=swiglu, limit=limit)
        else:
            module.grouped_fp8(a, a_scales, weight, scales, tile_expert, out, out_scales, swiglu=swiglu, limit=limit)
    finally:
        setattr(module, name, kernel)
    return (kernel, *recorder.calls[0])


def recorded_moe_decode_launches():
    """[(name, kernel, args, kwargs)]: moe_experts' per-assignment launches (moe_decode) at one token: V4-Flash's
    (256 fp4 experts, D 4096, I 2048, top-6, V4's clamp) with its fp8 shared expert in the same launches, and
    V3.2's (256 fp8 experts, D 7168, top-8): gate/up and down (the fp4 operand launches are elementwise)."""
    module = sys.modules[moe_experts.__module__]
    decode_module = sys.modules[module.expert_rows_per_assignment.__module__]
    names = ("_fp4_operand_kernel", "_gate_up_kernel", "_down_kernel")

    def experts(fmt, n, d, i):
        if fmt == "fp8":
            return ExpertWeights("fp8", torch.empty((n, 2 * i, d), dtype=torch.float8_e4m3fn),
                                 torch.empty((n, 2 * i // 128, d // 128)), torch.empty((n, d, i), dtype=torch.float8_e4m3fn),
                                 torch.empty((n, d // 128, i // 128)))
        return ExpertWeights("fp4", torch.empty((n, 2 * i, d // 2), dtype=torch.uint8),
                             torch.empty((n, 2 * i, d // 32), dtype=torch.uint8), torch.empty((n, d, i // 2), dtype=torch.uint8),
                             torch.empty((n, d, i // 32), dtype=torch.uint8))

    launches = []
    for label, fmt, d, top_k, limit, shared in (("V4-Flash fp4 + fp8 shared expert", "fp4", 4096, 6, 10.0, True),
                                                ("V3.2 fp8", "fp8", 7168, 8, None, False)):
        with recording(decode_module, names) as kept:
            decode_module.expert_rows_per_assignment(
                torch.empty((1, d), dtype=torch.bfloat16), torch.zeros((1, top_k), dtype=torch.int32),
                experts(fmt, 256, d, 2048), limit, experts("fp8", 1, d, 2048) if shared else None)
        launches += [(f"{label} {name}", kept[name][0], *kept[name][1].calls[0]) for name in names[1:]]
    return launches


def recorded_stream_launches():
    """[(name, kernel, args, kwargs)]: fp8_gemm's weight-streaming kernel at one token with its default launch,
    on V3.2's o_proj (7168 x 16384, split-K) and fused q_b + wq_b (32768 x 1536, unsplit)."""
    module = sys.modules[fp8_gemm.__module__]
    kernel, recorder, check_device = module._fp8_stream_kernel, Recorder(), module.check_device
    module._fp8_stream_kernel, module.check_device = recorder, lambda tensors: None   # (CPU tensors)
    try:
        for n, k, split_k in ((7168, 16384, None), (32768, 1536, 1)):
            fp8_gemm(torch.empty((1, k), dtype=torch.float8_e4m3fn), torch.empty((1, k // 128)),
                     torch.empty((n, k), dtype=torch.float8_e4m3fn), torch.empty((n // 128, k // 128)),
                     config=dataclasses.replace(module.STREAM_CONFIG, split_k=split_k))
    finally:
        module._fp8_stream_kernel, module.check_device = kernel, check_device
    return [(f"fp8_gemm stream kernel, 1 token, {what}", kernel, *call)
            for what, call in zip(("o_proj, split-K", "q_b + wq_b, unsplit"), recorder.calls)]


def recorded_topk_launches(n_keys: int):
    """[(name, kernel, args, kwargs)]: decode_topk's launches for 16 rows of n_keys scores, top 2048."""
    module = sys.modules[decode_topk.__module__]
    names = ("_histogram_kernel", "_gather_kernel", "_row_select_kernel", "_rank_kernel")
    # (Its input checks, lightning_indexer.check_topk_inputs, refuse CPU tensors outside the interpreter.)
    check_device = lightning_indexer.check_device
    lightning_indexer.check_device = lambda tensors: None
    try:
        with recording(module, names) as kept:
            decode_topk(torch.empty((16, n_keys)), 2048)
    finally:
        lightning_indexer.check_device = check_device
    return [(f"{name} {i + 1}", kept[name][0], *call) for name in names for i, call in enumerate(kept[name][1].calls)]


def recorded_preselect_launches():
    """[(name, kernel, args, kwargs)]: indexer_topk's candidate launches (tau, candidates, overflow) for a
    prefill chunk, 2048 rows of 131072 scores, top 2048."""
    names = ("_tau_kernel", "_candidates_kernel", "_overflow_kernel")
    with recording(lightning_indexer, names) as kept:
        lightning_indexer._preselect(torch.empty((2048, 131072)), 2048)
    return [(name, kept[name][0], *kept[name][1].calls[0]) for name in names]


def compile_for_sm90(kernel, args, kwargs):
    """The JIT's own path from arguments to a compiled kernel, for TARGET instead of the local device."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def sass(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(CUOBJDUMP), "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout


def report(name: str, kernel, args, kwargs, narrow_allowed: bool = False) -> bool:
    """Compile one recorded launch, print its partitions' register budgets, its spills and its 2-byte
    global loads and stores; True if it has either (narrow_allowed: spills only)."""
    code = sass(compile_for_sm90(kernel, args, kwargs))
    # setmaxnreg: the partitions' register budgets as the warps enter and leave them.
    budgets = [int(n, 16) for n in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", code)]
    spills = len(re.findall(r"\b(?:STL|LDL)\b", code))
    # q and out move as bf16: element by element when the compiler cannot prove their rows 16-byte
    # aligned (decode: 15% of the time at h_q 128, docs/perf/decode.md).
    narrow = len(re.findall(r"\b(?:LDG|STG)\.E\.(?:U16|S16|16)\b", code))
    allowed = " (allowed)" if narrow_allowed else ""
    print(f"{name}: setmaxnreg {budgets}, spill instructions {spills}, 2-byte global accesses {narrow}{allowed}",
          flush=True)
    return spills > 0 or (narrow > 0 and not narrow_allowed)


def main() -> int:
    failing = False
    for d_qk in (576, 512):
        for with_options in (False, True):
            failing |= report(f"prefill d_qk {d_qk}, attn_sink and topk_length {'on' if with_options else 'off'}",
                              sparse_mla_prefill_sm90._sparse_mla_prefill_sm90_kernel,
                              *recorded_prefill_launch(d_qk, with_options))
    for h_q, num_splits, padded_blocks in ((128, 1, False), (128, 2, False), (128, 1, True), (16, 1, False),
                                           (32, 1, False), (32, 2, False), (32, 1, True)):
        failing |= report(f"decode h_q {h_q}, {'partial' if num_splits > 1 else 'final'} results"
                          + (", padded cache blocks" if padded_blocks else ""),
                          *recorded_decode_launch(num_splits, padded_blocks, h_q))
    for h_q, num_splits in ((128, 1), (128, 2), (32, 1), (16, 2)):
        failing |= report(f"decode over MODEL1 caches h_q {h_q}, {'partial' if num_splits > 1 else 'final'} results",
                          *recorded_decode_launch(num_splits, h_q=h_q, model1=True))
    for swiglu, limit in ((True, None), (True, 10.0), (False, None)):
        failing |= report(f"moe grouped fp8 GEMM, {'gate/up with SwiGLU' if swiglu else 'down'}"
                          + (" and V4's clamp" if limit else ""), *recorded_moe_grouped_launch(swiglu, limit))
    for swiglu in (True, False):
        failing |= report(f"moe grouped fp4 GEMM (folded), {'gate/up with SwiGLU' if swiglu else 'down'}",
                          *recorded_moe_grouped_launch(swiglu, 10.0 if swiglu else None, fp4=True))
    # (Triton, no partitions; a down program stores its 64 bf16 outputs, 128 bytes: 2-byte stores allowed.)
    for name, kernel, args, kwargs in recorded_moe_decode_launches():
        failing |= report(f"moe per-assignment {name}, 1 token", kernel, args, kwargs, narrow_allowed=True)
    for h_q in (128, 32):   # the split merge (a Triton kernel): no partitions, but the same 2-byte rule
        failing |= report(f"merge of split results, h_q {h_q}", *recorded_decode_launch(2, False, h_q, merge=True))
    # The indexer's scores (Triton, no partitions): exact keys as three bf16 products (tf32x3 spilled here).
    for fp8, n_queries, n_batch in ((False, 2048, 1), (False, 1, 16), (True, 2048, 1), (True, 1, 16)):
        failing |= report(f"indexer scores over {'fp8' if fp8 else 'exact'} paged keys, b {n_batch} x t {n_queries}",
                          *recorded_indexer_launch(fp8, n_queries, n_batch))
    for fp8 in (True, False):
        failing |= report(f"indexer scores over {'fp8' if fp8 else 'exact'} paged keys, b 1 x t 2048, sm_90 (Gluon)",
                          *recorded_indexer_sm90_launch(fp8))
    failing |= report("indexer scores over exact V4 CSA keys, b 16 x t 1", *recorded_csa_decode_launch())
    # (Its accumulator holds weight rows x tokens: a program stores its 64 bf16 outputs of a token 2 bytes at a time.)
    for name, kernel, args, kwargs in recorded_stream_launches():
        failing |= report(name, kernel, args, kwargs, narrow_allowed=True)
    # (Programs of TILE keys; one program a row, at the longest rows it takes.)
    for n_keys in (163840, sys.modules[decode_topk.__module__].ROW_PROGRAM_KEYS):
        for name, kernel, args, kwargs in recorded_topk_launches(n_keys):
            failing |= report(f"decode_topk {name}, 16 rows of {n_keys}, top 2048", kernel, args, kwargs)
    for name, kernel, args, kwargs in recorded_preselect_launches():
        failing |= report(f"indexer_topk {name}, 2048 rows of 131072, top 2048", kernel, args, kwargs)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
