"""sparse_mla_decode_fp8's launch path: the plan it keeps per call signature (checks, tiling, split and launch
integers derived once) must give every later call with that signature its own results, and must not let
through an input that the checks refuse; the ordering kernel ranks sequences by both lists' used entries;
launch (kernels/_launch.py) passes a compiled kernel's launcher every parameter in order; on a GPU later
calls launch the compiled kernels directly, with the JIT path's results bit for bit. The head projections',
the indexers', the top-k selections', the index-key writer's, the activation quantiser's, the fp8 GEMM's,
the norms', rope's, the indexer weights' and the decode positions' kept plans likewise (positions_to_slots'
is tested beside it, in test_kv_cache_fp8).
"""
import importlib
import math

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from conftest import DEVICE
from minirt.errors import InputError
from minirt.formats import quantize_groups
from minirt.kernels import (_launch, add_rms_norm, apply_rope, decode_positions, decode_topk, fp8_gemm, indexer_topk,
                            indexer_weights, lightning_indexer_scores, mla_query_absorb, mla_value_proj_fp8,
                            new_index_cache, paged_indexer_scores, quantize_act_fp8, rms_norm, write_index_keys)
from minirt.kernels import indexer_cache, lightning_indexer
from minirt.kernels.sparse_mla_decode import longest_first, sparse_mla_decode_fp8
from test_sparse_mla_decode import SM_SCALE, check, decode, make_cache, random_indices, random_q, reference
import test_indexer_cache
import test_lightning_indexer
from test_fp8_gemm import random_activations, random_weight

decode_module = importlib.import_module("minirt.kernels.sparse_mla_decode")
fp8_gemm_module = importlib.import_module("minirt.kernels.fp8_gemm")   # (the package's fp8_gemm is the function)


@pytest.mark.parametrize("with_main_lengths", [True, False])
def test_longest_first_over_both_lists(with_main_lengths):
    g = torch.Generator().manual_seed(3)
    topk, extra_topk, b = 48, 80, 37
    lengths = torch.randint(-3, 60, (b,), generator=g, dtype=torch.int32)          # negatives, > topk
    extra_lengths = torch.randint(-3, 100, (b,), generator=g, dtype=torch.int32)   # ties among the sums
    used = (lengths.clamp(0, topk) if with_main_lengths else torch.full((b,), topk)) + extra_lengths.clamp(0, extra_topk)
    order = longest_first(lengths.to(DEVICE) if with_main_lengths else None, topk, extra_lengths.to(DEVICE),
                          extra_topk).cpu()
    expected = torch.sort(used, descending=True, stable=True).indices
    assert order.dtype == torch.int32 and torch.equal(order.long(), expected)


def test_a_kept_plan_serves_new_data_and_refuses_what_the_checks_refuse():
    b, s_q, h_q, topk = 2, 1, 16, 64
    _, cache = make_cache(2, 64, 23)
    lengths = torch.tensor([40, 64], dtype=torch.int32, device=DEVICE)
    plans = []
    for seed in (1, 2):   # one signature twice: the second call takes the first one's plan
        indices = random_indices(b, s_q, topk, 128, seed).to(DEVICE)
        q = random_q(b, s_q, h_q, seed)
        check(decode(q, cache, indices, SM_SCALE, topk_length=lengths, num_splits=1),
              reference(q, cache, indices, SM_SCALE, topk_length=lengths))
        plans.append(len(decode_module._PLANS))
    assert plans[1] == plans[0]
    with pytest.raises(InputError, match="num_splits"):   # True == 1 as a dict key: the type is in the signature
        decode(q, cache, indices, SM_SCALE, topk_length=lengths, num_splits=True)
    # The same shapes and strides 8 bytes off a 16-byte boundary: the alignment is in the signature.
    backing = torch.zeros(cache.numel() + 16, dtype=torch.uint8, device=DEVICE)
    shifted = backing[8:8 + cache.numel()].view(cache.shape)
    assert shifted.stride() == cache.stride()
    with pytest.raises(InputError, match="16 bytes"):
        decode(q, shifted, indices, SM_SCALE, topk_length=lengths, num_splits=1)
    assert len(decode_module._PLANS) == plans[0]


@pytest.mark.parametrize("strided", ["q", "indices"])
def test_a_kept_plan_copies_a_list_with_a_non_unit_last_stride(strided):
    """The plan of a signature whose q or indices has a non-unit last stride copies them before every launch:
    the same results as the contiguous inputs', on the plan's first and later calls."""
    b, s_q, h_q, topk = 2, 1, 16, 64
    _, cache = make_cache(2, 64, 31)
    for seed in (3, 4):
        indices = random_indices(b, s_q, topk, 128, seed).to(DEVICE)
        q = random_q(b, s_q, h_q, seed)
        want = decode(q, cache, indices, SM_SCALE, num_splits=1)
        if strided == "q":
            q = torch.stack([q, torch.full_like(q, math.nan)], -1)[..., 0]
        else:
            indices = torch.stack([indices, torch.zeros_like(indices)], -1)[..., 0]
        assert q.stride(3) != 1 or indices.stride(2) != 1
        for got, expected in zip(decode(q, cache, indices, SM_SCALE, num_splits=1), want):
            assert torch.equal(got, expected)


def test_head_projections_keep_a_plan_per_signature_and_still_refuse_bad_input():
    """mla_query_absorb / mla_value_proj_fp8 keep one plan per call signature: a second call with new data (and
    a strided q_nope, copied) gives that data's results; an out the checks refuse still raises after a kept
    plan of the same other inputs."""
    gen = torch.Generator().manual_seed(5)
    heads, nope, v_dim, latent = 4, 128, 128, 512
    w = torch.randn(heads * (nope + v_dim), latent, generator=gen).to(DEVICE).to(torch.float8_e4m3fn)
    scales = (torch.rand(heads * (nope + v_dim) // 128, latent // 128, generator=gen) + 0.5).to(DEVICE)
    results = []
    for seed in (1, 2):
        q = torch.randn(3, heads, nope + 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        q_nope = q.to(DEVICE)[..., :nope]
        results.append((mla_query_absorb(q_nope, w, scales, nope, v_dim),
                        mla_query_absorb(q_nope.contiguous(), w, scales, nope, v_dim)))
        strided = torch.stack([q_nope, torch.full_like(q_nope, math.nan)], -1)[..., 0]
        assert torch.equal(mla_query_absorb(strided, w, scales, nope, v_dim), results[-1][1])
        o_lat = torch.randn(3, heads, latent, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        codes, o_scales = mla_value_proj_fp8(o_lat.to(DEVICE), w, scales, nope, v_dim)
        results.append((codes.view(torch.uint8), mla_value_proj_fp8(o_lat.to(DEVICE), w, scales, nope, v_dim)[0]
                        .view(torch.uint8)))
    for got, again in results:
        assert torch.equal(got, again)
    assert not torch.equal(results[0][0], results[2][0]) and not torch.equal(results[1][0], results[3][0])
    with pytest.raises(InputError, match="out must be"):
        mla_query_absorb(q_nope, w, scales, nope, v_dim, out=torch.empty(3, heads, latent, device=DEVICE))
    with pytest.raises(InputError, match="out must be"):
        mla_value_proj_fp8(o_lat.to(DEVICE), w, scales, nope, v_dim, out=(codes, o_scales[:, :1]))


@pytest.mark.parametrize("dtype, lead", [(torch.bfloat16, (5,)), (torch.float32, (2, 16))],
                         ids=["bf16-unbatched", "fp32-batched-presplit"])
def test_lightning_indexer_keeps_a_plan_per_signature_and_still_refuses_bad_input(dtype, lead):
    """lightning_indexer_scores: the second call of a signature (new data, strided inputs and out) takes the
    first one's plan and scores its own data; a bad limit or weights after it still raises."""
    kept = []
    for seed in (1, 2):
        gen = torch.Generator(DEVICE).manual_seed(seed)
        q, k, weights = test_lightning_indexer.random_inputs(gen, lead, 70, 4, 32, dtype)
        limit = torch.randint(-2, 80, lead, generator=gen, device=DEVICE)
        test_lightning_indexer.run_case(q, k, weights, limit, strided=True, strided_out=True)
        kept.append(len(lightning_indexer._KEPT))
    assert kept[1] == kept[0]
    with pytest.raises(InputError, match="limit"):
        lightning_indexer_scores(q, k, weights, limit.float())
    with pytest.raises(InputError, match="weights"):
        lightning_indexer_scores(q, k, weights[..., :2], limit)


@pytest.mark.parametrize("select", [indexer_topk, decode_topk], ids=["indexer_topk", "decode_topk"])
def test_topk_selections_keep_a_plan_per_signature_and_still_refuse_bad_input(select):
    """indexer_topk / decode_topk on strided rows (copied before the tie or histogram launches) and on fewer
    scores than topk (padded): each second call of a signature selects its own data's top-k."""
    for seed in (1, 2):
        gen = torch.Generator(DEVICE).manual_seed(seed)
        scores = test_lightning_indexer.tied_scores(gen, (300, 3)).t()
        assert scores.stride(-1) != 1
        for topk in (40, 400):
            assert torch.equal(select(scores, topk), test_lightning_indexer.stable_topk_reference(scores, topk))
    with pytest.raises(InputError, match="topk"):   # True == 1 as a dict key: the type is in the signature
        select(scores, True)
    with pytest.raises(InputError, match="float32"):
        select(scores.double(), 40)


@pytest.mark.parametrize("fmt, presplit", [("fp8", None), ("exact", True)], ids=["fp8", "exact-presplit"])
def test_paged_indexer_keeps_a_plan_per_signature_and_still_refuses_bad_input(monkeypatch, fmt, presplit):
    """paged_indexer_scores over one cache and a strided block table (copied before every launch): the second
    call of a signature scores its own q and weights; a bad out after it still raises. write_index_keys: the
    second call of a signature writes its own keys."""
    test_indexer_cache.use_presplit(monkeypatch, presplit)
    gen = torch.Generator(DEVICE).manual_seed(7)
    limit = torch.tensor([[40, 3], [17, 60]], device=DEVICE)
    q, weights, cache, table, limit = test_indexer_cache.make_case(gen, fmt, limit, block_size=8, max_blocks=10,
                                                                   n_heads=4)
    table = test_lightning_indexer.strided_copy(table)
    assert table.stride(1) != 1
    for seed in (1, 2):
        gen = torch.Generator(DEVICE).manual_seed(seed)
        q = torch.randn(q.shape, generator=gen, device=DEVICE).to(q.dtype)
        weights = torch.randn(weights.shape, generator=gen, device=DEVICE)
        test_indexer_cache.run_case(q, weights, cache, table, limit, fmt)
    with pytest.raises(InputError, match="preallocated out"):
        paged_indexer_scores(q, weights, cache, table, limit, out=torch.empty(2, 2, 79, device=DEVICE))

    index_cache = new_index_cache(4, 8, DEVICE)
    slots = torch.tensor([[30, -1, 3], [9, 17, 0]], device=DEVICE)
    for seed in (1, 2):
        keys = test_indexer_cache.random_keys(torch.Generator(DEVICE).manual_seed(seed), 6).view(2, 3, -1)
        expected = index_cache.clone()
        test_indexer_cache.reference_write(expected, keys.view(6, -1), slots.view(6))
        write_index_keys(index_cache, keys, slots)
        assert torch.equal(index_cache, expected)
    with pytest.raises(InputError, match="slots"):
        write_index_keys(index_cache, keys, slots.float())


def test_quantiser_and_stream_gemm_keep_a_plan_per_signature_and_still_refuse_bad_input(monkeypatch):
    """quantize_act_fp8 of strided activations (copied first) and fp8_gemm's stream path with split-K on an
    activation whose rows are not 16-byte aligned (copied first): each second call of a signature gives its own
    data's results, those of a fresh plan bit for bit; a bad out after it still raises."""
    w, w_scales = random_weight(torch.Generator(DEVICE).manual_seed(3), 256, 1024, rescale=True)
    for seed in (1, 2):
        gen = torch.Generator(DEVICE).manual_seed(seed)
        x = torch.randn((1024, 3), generator=gen, device=DEVICE).to(torch.bfloat16).t()
        codes, scales = quantize_act_fp8(x)
        want_codes, want_scales = quantize_groups(x)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
        a, a_scales = random_activations(gen, 3, 1024)
        unaligned = torch.cat([a.view(torch.uint8), a[:, :8].view(torch.uint8)], 1)[:, :1024].view(a.dtype)
        assert unaligned.stride(0) % 16
        got = fp8_gemm(unaligned, a_scales, w, w_scales)
        with monkeypatch.context() as fresh:
            fresh.setattr(fp8_gemm_module, "_GEMMS", {})
            assert torch.equal(got, fp8_gemm(a, a_scales, w, w_scales))
    assert fp8_gemm_module._GEMMS[next(reversed(fp8_gemm_module._GEMMS))].args[0][1] > 1, "split-K"
    with pytest.raises(InputError, match="out must be"):
        fp8_gemm(unaligned, a_scales, w, w_scales, out=torch.empty(3, 256, device=DEVICE))


def _glue_calls(seed: int) -> list:
    """rms_norm, add_rms_norm, apply_rope (layer_norm), indexer_weights and decode_positions on fresh data."""
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(3, 256, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.rand(256, generator=g).to(DEVICE) + 0.5
    keys = torch.randn(3, 128, generator=g).to(DEVICE, torch.bfloat16)
    angles = torch.rand(3, 32, generator=g).to(DEVICE)
    seq_lens = torch.randint(0, 512, (3,), generator=g).to(DEVICE)
    table = torch.randperm(24, generator=g).view(3, 8).to(DEVICE, torch.int32)
    tables = torch.rand(512, 32, generator=g).to(DEVICE)
    return [rms_norm(x, weight, 1e-6), *add_rms_norm(x, delta, weight, 1e-6),
            apply_rope(keys, angles, angles, 64, False, layer_norm=(weight[:128], weight[128:], 1e-6)),
            indexer_weights(x, torch.randn(8, 256, generator=g).to(DEVICE), 0.5),
            *decode_positions(seq_lens, table, 64, table.numel(), tables, tables)]


def test_the_glue_launchers_keep_a_plan_per_signature(monkeypatch):
    """The norms', rope's, indexer weights' and decode positions' launchers: a signature's later call with new
    data gives what a fresh plan gives it; bad input is still refused once plans are kept."""
    _glue_calls(1)
    kept = _glue_calls(2)
    for name, plans in (("rms_norm", "_NORMS"), ("rope", "_ROPES"), ("indexer_weights", "_WEIGHTS"),
                        ("decode_positions", "_STEPS")):
        module = importlib.import_module(f"minirt.kernels.{name}")
        assert getattr(module, plans), f"{name} kept no plan"
        monkeypatch.setattr(module, plans, {})
    for got, fresh in zip(kept, _glue_calls(2)):
        assert torch.equal(got, fresh)
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="delta must be"):
        add_rms_norm(x, x.float(), torch.ones(256, device=DEVICE), 1e-6)
    with pytest.raises(InputError, match="rope_dims must be"):
        apply_rope(x, torch.ones(3, 24, device=DEVICE), torch.ones(3, 24, device=DEVICE), 48, False)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels (and their direct launches) need a GPU")
@pytest.mark.parametrize("num_splits", [1, 2])
def test_compiled_launches_match_the_jit_launch(num_splits):
    """The first call of a signature goes through Triton's dispatch, the later ones straight to the compiled
    kernels (decode, ordering, merge): the same bits."""
    decode_module._PLANS.clear()
    _, cache = make_cache(4, 64, 29)
    indices = random_indices(3, 2, 256, 256, 29).to(DEVICE)
    q = random_q(3, 2, 64, 29)
    lengths = torch.tensor([256, 7, 100], dtype=torch.int32, device=DEVICE)
    first = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, topk_length=lengths, num_splits=num_splits)
    (plan,) = decode_module._PLANS.values()
    assert len(plan.compiled) == (2 if num_splits > 1 else 1)   # the decode kernel (and the merge) kept
    again = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, topk_length=lengths, num_splits=num_splits)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def _toy_kernel(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 7):
    pass


def test_launch_reuses_the_compiled_kernel_with_every_parameter_in_order(monkeypatch):
    """launch's direct path, with Triton's JIT dispatch and the compiled kernel stood in for: the first launch
    goes through kernel[grid] and keeps the compiled kernel; later ones call its launcher with the grid, the
    stream, its handles and every parameter in the kernel's order (tensors as their addresses, constexprs
    included, defaults filled in);
    launch hooks (a profiler's) and kernels that are not JITFunctions always take kernel[grid]."""
    launched = []

    class Launcher:   # a compiled kernel's launcher: its C function when the kernel needs no scratch
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = "cooperative", "pdl"

        def launch(self, *args):
            launched.append(("direct", args))

    class Compiled:
        function, packed_metadata, run = "function", "metadata", Launcher()

    class ToyJIT(JITFunction):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(("jit", grid, args, kwargs)) or Compiled()

    monkeypatch.setattr(_launch, "_current", [lambda: 3, lambda device: f"stream of {device}"])
    kernel, compiled = ToyJIT(_toy_kernel), {}
    options = dict(A=1, num_warps=4)
    x0, x1 = torch.ones(2), torch.ones(3)
    _launch.launch(kernel, (5, 2), (x0, 16), options, compiled)
    _launch.launch(kernel, (6,), (x1, 16), options, compiled)
    # The direct launch passes a tensor as its address (the launcher then skips its pointer query).
    assert launched == [("jit", (5, 2), (x0, 16), options),
                        ("direct", (6, 1, 1, "stream of 3", "function", "cooperative", "pdl", None, None, "metadata",
                                    None, None, None, x1.data_ptr(), 16, 1, 7))]
    hook = lambda metadata: None   # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch.launch(kernel, (7,), (x1, 16), options, compiled)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launched[-1] == ("jit", (7,), (x1, 16), options)

    class StandIn:   # a test's recorder: not compiled, so never kept
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(("stand-in", grid))
    for _ in range(2):
        _launch.launch(StandIn(), (1,), (), {}, compiled)
    assert launched[-2:] == [("stand-in", (1,))] * 2 and len(compiled) == 1


@pytest.mark.parametrize("b, ordered", [(2, False), (5, True)])
def test_sequences_longest_first_only_beyond_one_wave(monkeypatch, b, ordered):
    """With topk_length, the programs take the sequences longest first (longest_first's launch) only where
    they do not all start at once (more than one an SM; here 4 SMs, one program a sequence); else in batch
    order, with no launch. Either way each sequence gets its own results."""
    monkeypatch.setattr(decode_module, "num_sms", lambda device, interpreted: 4)
    monkeypatch.setattr(decode_module, "_PLANS", {})
    ordered_calls = []
    monkeypatch.setattr(decode_module, "longest_first",
                        lambda *args: ordered_calls.append(1) or longest_first(*args))
    s_q, h_q, topk = 1, 16, 64
    _, cache = make_cache(b, 64, 41)
    lengths = torch.tensor([40, 64, 3, 0, 17][:b], dtype=torch.int32, device=DEVICE)
    indices = random_indices(b, s_q, topk, 64 * b, 5).to(DEVICE)
    q = random_q(b, s_q, h_q, 5)
    check(decode(q, cache, indices, SM_SCALE, topk_length=lengths, num_splits=1),
          reference(q, cache, indices, SM_SCALE, topk_length=lengths))
    assert bool(ordered_calls) == ordered
