"""MoE kernels: route_topk / route_hash (routing) and moe_experts (the routed experts' weighted sum).

Oracles written here from the math, independent of the kernels: routing by torch's scores and a
stable descending sort (ties to the lower index); experts dequantised to float64 (block fp8 by its
128 x 128 scales, fp4 by the e2m1 value table and 2^(byte - 127)) and run token by token, slot by
slot, with the activations quantised where the kernels quantise them (x and the SwiGLU output, by
minirt.formats.quantize_groups). Inputs are fresh seeded random values; every buffer the kernels
allocate is NaN-poisoned (torch.empty filled) so that an element left unwritten shows.
"""
import ast
import inspect
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from minirt.blockfp8 import dequantize_block_fp8, quantize_block_fp8
from minirt.errors import InputError
from minirt.formats import quantize_groups
from minirt.kernels import (ExpertWeights, check_tid2eid, expert_weights_fp4, expert_weights_fp8, moe_experts,
                            route_hash, route_topk)
from minirt.kernels import moe_decode
from minirt.kernels.moe_experts import DECODE_CONFIG, PREFILL_CONFIG, PREFILL_CONFIG_FP4, MoeConfig

moe_experts_module = sys.modules["minirt.kernels.moe_experts"]

# A prefill-shaped launch (tokens on the MMA's M side) small enough for the interpreter, and the
# decode one with split-K forced (a product of 2 k blocks in 2 splits).
TILES_CONFIG = MoeConfig(block_m=16, num_warps=4, num_stages=2)
SPLIT_CONFIG = MoeConfig(block_m=16, swap_ab=True, split_k=2, num_warps=4, num_stages=2)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Relative-norm error of moe_experts against the oracle: bf16 expert outputs (2^-8 per element,
# 2^-7 where the interpreter truncates), fp32 sums in another order, and now and then a SwiGLU value
# rounding to the neighbouring e4m3 code (one element off by 2^-4 relative).
EXPERTS_TOL = 1.5e-2


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN-filled floats (fp8: the NaN code) and -777 integers while active."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype in (torch.float8_e4m3fn, torch.uint8):
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-777)
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def generator(seed):
    return torch.Generator(DEVICE).manual_seed(seed)


def ref_scores(logits, scoring):
    return torch.sigmoid(logits) if scoring == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()


def ref_route_topk(logits, bias, top_k, scoring, n_group=1, topk_group=1, normalize=True, scaling=1.0):
    scores = ref_scores(logits, scoring)
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, -1).sort(-1, descending=True).values[..., :2].sum(-1)
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // n_group, 1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ref_weights(scores.gather(1, ids), normalize, scaling), ids


def ref_weights(picked, normalize, scaling):
    return (picked / picked.sum(-1, keepdim=True) if normalize else picked) * scaling


def check_routes(weights, ids, ref_w, ref_ids):
    assert torch.equal(ids.long(), ref_ids.long())
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights, ref_w.float(), rtol=2e-6, atol=0)


@pytest.mark.parametrize("scoring, n_group, topk_group, top_k, scaling", [
    ("sigmoid", 4, 2, 6, 2.5),        # V3.2-like: groups, bias, scaled
    ("sqrtsoftplus", 1, 1, 6, 1.5),   # V4-like: no groups
])
def test_route_topk(poisoned, scoring, n_group, topk_group, top_k, scaling):
    gen = generator(0)
    t, e = 37, 32
    logits = torch.randn(t, e, generator=gen, device=DEVICE) * 4
    logits[0, :4] = torch.tensor([25.0, 30.0, -30.0, -85.0])   # softplus above its threshold, tiny scores
    bias = torch.randn(e, generator=gen, device=DEVICE) * 0.1
    weights, ids = route_topk(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group,
                              topk_group=topk_group, scaling=scaling)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    check_routes(weights, ids, *ref_route_topk(logits, bias, top_k, scoring, n_group, topk_group, True, scaling))
    # Without the bias and without normalisation: the raw scores of the top experts.
    weights, ids = route_topk(logits, None, top_k=top_k, scoring=scoring, normalize=False)
    check_routes(weights, ids, *ref_route_topk(logits, None, top_k, scoring, normalize=False))


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2)])
def test_route_topk_ties_go_to_the_lower_index(poisoned, n_group, topk_group):
    """Logits from three values only: most choices tie, and so do group scores."""
    gen = generator(1)
    t, e = 24, 16
    logits = torch.tensor([-1.0, 0.0, 0.5], device=DEVICE)[torch.randint(0, 3, (t, e), generator=gen, device=DEVICE)]
    logits[0] = 0.0                                              # every expert and every group tied
    bias = torch.tensor([0.0, 0.25], device=DEVICE)[torch.randint(0, 2, (e,), generator=gen, device=DEVICE)]
    for b in (None, bias):
        weights, ids = route_topk(logits, b, top_k=5, scoring="sigmoid", n_group=n_group, topk_group=topk_group)
        check_routes(weights, ids, *ref_route_topk(logits, b, 5, "sigmoid", n_group, topk_group))
        if b is None:
            assert ids[0].tolist() == [0, 1, 2, 3, 4]


def test_route_topk_groups_limit_the_choice(poisoned):
    """The best experts lie in groups that lose on their top-2 sums: they must not be chosen."""
    logits = torch.full((2, 16), -2.0, device=DEVICE)
    logits[:, 0] = 5.0                      # group 0: one big expert, a weak second
    logits[:, [4, 5, 8, 9]] = 1.0           # groups 1 and 2: two good experts each
    weights, ids = route_topk(logits, None, top_k=3, scoring="sigmoid", n_group=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [4, 5, 8]
    check_routes(weights, ids, *ref_route_topk(logits, None, 3, "sigmoid", 4, 2))


def test_route_hash(poisoned):
    gen = generator(2)
    t, e, vocab, top_k = 19, 16, 50, 6
    logits = torch.randn(t, e, generator=gen, device=DEVICE) * 3
    tid2eid = torch.randint(0, e, (vocab, top_k), generator=gen, device=DEVICE)
    token_ids = torch.randint(0, vocab, (t,), generator=gen, device=DEVICE)
    token_ids[3] = vocab                    # out of range: never dereferenced
    weights, ids = route_hash(logits, tid2eid, token_ids, scoring="sqrtsoftplus", scaling=1.5)
    valid = torch.arange(t, device=DEVICE) != 3
    ref_ids = tid2eid[token_ids[valid]]
    assert torch.equal(ids[valid].long(), ref_ids)
    torch.testing.assert_close(weights[valid], ref_weights(ref_scores(logits[valid], "sqrtsoftplus").gather(1, ref_ids),
                                                           True, 1.5), rtol=2e-6, atol=0)
    assert (ids[3] == -1).all() and (weights[3] == 0).all()


def test_check_tid2eid():
    table = torch.randint(0, 8, (10, 6))
    check_tid2eid(table, 8)
    table[7, 2] = 8
    with pytest.raises(InputError, match=r"layers\.0\.ffn\.gate\.tid2eid\[7, 2\] = 8"):
        check_tid2eid(table, 8, "layers.0.ffn.gate.tid2eid")


def test_route_topk_rejects_bad_input():
    logits = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(InputError, match="scoring"):
        route_topk(logits, None, top_k=2, scoring="softmax")
    with pytest.raises(InputError, match="n_group"):
        route_topk(logits, None, top_k=2, scoring="sigmoid", n_group=3)
    with pytest.raises(InputError, match="top_k"):
        route_topk(logits, None, top_k=9, scoring="sigmoid", n_group=4, topk_group=2)
    with pytest.raises(InputError, match="bias"):
        route_topk(logits, torch.zeros(8, device=DEVICE), top_k=2, scoring="sigmoid")


# Experts.

def random_fp8_expert(gen, n, k):
    """A block-fp8 [n, k] weight with per-block magnitudes varying by 2^[-3, 3)."""
    factors = torch.exp2(torch.randint(-3, 3, (n // 128, k // 128), generator=gen, device=DEVICE).float())
    w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.05 * factors.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return quantize_block_fp8(w)


def random_fp4_expert(gen, n, k):
    """Packed e2m1 codes [n, k / 2] (int8, as checkpoints store them) and e8m0 scale bytes [n, k / 32]
    around 2^-6."""
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, device=DEVICE, dtype=torch.uint8).view(torch.int8)
    return codes, torch.randint(118, 124, (n, k // 32), generator=gen, device=DEVICE, dtype=torch.uint8)


def dequantize_fp4(codes, scale_bytes):
    """Float64 [n, k] from packed e2m1 (low nibble = even element) and e8m0 bytes per 32 inputs."""
    b = codes.view(torch.uint8).long()
    nibbles = torch.stack([b & 15, b >> 4], -1).flatten(-2)
    values = E2M1.to(codes.device).double()[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0).double()
    return values * torch.exp2(scale_bytes.double() - 127).repeat_interleave(32, -1)


def make_experts(fmt, gen, e, d, i):
    """(ExpertWeights, [(W1, W3, W2) float64 per expert])."""
    random, dequantize = (random_fp8_expert, dequantize_block_fp8) if fmt == "fp8" else (random_fp4_expert, dequantize_fp4)
    w1, w3, w2 = ([random(gen, *shape) for _ in range(e)] for shape in ((i, d), (i, d), (d, i)))
    build = expert_weights_fp8 if fmt == "fp8" else expert_weights_fp4
    # fp4 scales as checkpoints store them (float8_e8m0fnu), fp8 ones as float32.
    as_stored = (lambda s: s) if fmt == "fp8" else (lambda s: s.view(torch.float8_e8m0fnu))
    experts = build(*(t for w in (w1, w3, w2) for t in ([q for q, _ in w], [as_stored(s) for _, s in w])))
    dense = [tuple(dequantize(*w[x]).double() for w in (w1, w3, w2)) for x in range(e)]
    return experts, dense


def quantized(x):
    """x as the kernels feed it to a product: quantised to e4m3 per 128 columns and dequantised."""
    values, scales = quantize_groups(x.float())
    return (values.double().unflatten(-1, (-1, 128)) * scales.double()[..., None]).flatten(-2)


def ref_moe(x, expert_ids, weights, dense, limit):
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xq = quantized(x)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            if not 0 <= e < len(dense):
                continue
            w1, w3, w2 = dense[e]
            g, u = w1 @ xq[t], w3 @ xq[t]
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = torch.nn.functional.silu(g) * u
            out[t] += float(weights[t, j]) * (w2 @ quantized(h[None].float())[0])
    return out


def rel_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt, config, n_tokens, limit, i", [
    ("fp8", DECODE_CONFIG, 1, None, 128),
    ("fp8", TILES_CONFIG, 6, None, 128),
    ("fp8", SPLIT_CONFIG, 5, 0.5, 256),      # both products split (2 k blocks each)
    ("fp4", SPLIT_CONFIG, 3, 0.5, 128),
    ("fp4", TILES_CONFIG, 4, None, 128),
    ("fp4", replace(SPLIT_CONFIG, fp4_e4m3=True), 3, 0.5, 128),
    ("fp4", replace(TILES_CONFIG, fp4_e4m3=True), 4, None, 128),
    ("fp4", replace(SPLIT_CONFIG, fp4_fold=True), 3, 0.5, 128),
    ("fp4", replace(TILES_CONFIG, fp4_fold=True), 4, None, 128),
    ("fp4", PREFILL_CONFIG_FP4, 5, 0.5, 128),
])
def test_moe_experts(poisoned, fmt, config, n_tokens, limit, i):
    gen = generator(3)
    e, d, top_k = 8, 256, 2
    experts, dense = make_experts(fmt, gen, e, d, i)
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    # The last expert gets no token.
    expert_ids = torch.stack([torch.randperm(e - 1, generator=gen, device=DEVICE)[:top_k]
                              for _ in range(n_tokens)]).int()
    weights = torch.rand(n_tokens, top_k, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit, config=config)
    assert out.dtype == torch.bfloat16 and out.shape == (n_tokens, d)
    assert torch.isfinite(out).all()
    ref = ref_moe(x, expert_ids, weights, dense, limit)
    assert rel_error(out, ref) < EXPERTS_TOL
    if limit is not None:    # the clamp bites: without it the result differs
        assert rel_error(out, ref_moe(x, expert_ids, weights, dense, None)) > 10 * EXPERTS_TOL


def experts_at_the_fold_spread(gen, e, d, i, n_tokens):
    """fp4 experts whose every 128-input block's first 32-input group is scaled 2^-FOLD_SPREAD below the rest
    in experts 0-3 and 2^-(FOLD_SPREAD + 1) in experts 4-7, their dequantised weights, and n_tokens inputs
    whose those groups are 2^9 larger (so that they carry a fair share of each product)."""
    experts, _ = make_experts("fp4", gen, e, d, i)
    for name in ("w13_scales", "w2_scales"):
        scales = getattr(experts, name)
        first = torch.arange(scales.shape[-1], device=DEVICE) % 4 == 0
        for x in range(e):
            rows, groups = scales.shape[1:]
            base = torch.randint(118, 124, (rows, groups // 4), generator=gen, device=DEVICE,
                                 dtype=torch.uint8).repeat_interleave(4, 1)
            gap = moe_experts_module.FOLD_SPREAD + (x >= 4)
            scales[x] = torch.where(first, base, base + gap)
    dense = [tuple(dequantize_fp4(w, s) for w, s in ((experts.w13[x, :i], experts.w13_scales[x, :i]),
                                                     (experts.w13[x, i:], experts.w13_scales[x, i:]),
                                                     (experts.w2[x], experts.w2_scales[x]))) for x in range(e)]
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE)
    return experts, dense, (x * torch.where(torch.arange(d, device=DEVICE) % 128 < 32, 512.0, 1.0)).bfloat16()


@pytest.mark.parametrize("config", [replace(TILES_CONFIG, fp4_fold=True), replace(SPLIT_CONFIG, fp4_fold=True),
                                    PREFILL_CONFIG_FP4])
def test_moe_experts_fp4_fold_at_and_past_its_spread(poisoned, config):
    """fp4_fold with every 128-input block's first 32-input group scaled 2^-FOLD_SPREAD below the rest
    (the e4m3 values reach the smallest normal one, 2^-6: still exact) in experts 0-3, and 2^-(FOLD_SPREAD + 1) in
    experts 4-6 (those tiles take the bf16 launch); the inputs of those groups 2^9 larger, so that
    they carry a fair share of each product. Against the oracle, and within rounding of the bf16 path
    (both exact decodes: only the fp32 sums' order differs)."""
    gen = generator(11)
    e, d, i, top_k, n_tokens = 8, 256, 128, 2, 6
    experts, dense, x = experts_at_the_fold_spread(gen, e, d, i, n_tokens)
    expert_ids = torch.stack([torch.randperm(e - 1, generator=gen, device=DEVICE)[:top_k]
                              for _ in range(n_tokens)]).int()
    weights = torch.rand(n_tokens, top_k, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, config=config)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref_moe(x, expert_ids, weights, dense, None)) < EXPERTS_TOL
    bf16_path = moe_experts(x, expert_ids, weights, experts, config=replace(config, fp4_fold=False))
    assert rel_error(out, bf16_path.double()) < 2e-3


@pytest.mark.parametrize("fmt, limit, d, i", [
    ("fp8", None, 384, 256),     # gate/up: 3 steps of 1 k block, 2 row blocks; down 1 step of 2
    ("fp4", 0.5, 512, 384),      # gate/up: 1 chunk of 4 k blocks; down: 3 chunks of 1 (4 of 16 columns)
    ("fp4", None, 1024, 256),    # gate/up: 2 chunks of 4 k blocks (16 columns); down: 4 chunks of 2
])
def test_moe_experts_per_assignment(poisoned, monkeypatch, fmt, limit, d, i):
    """Few assignments (T * top_k <= E / 4 fp8, 1.5 E fp4): moe_decode's products, against the oracle and within a few
    bf16 ulps of the grouped GEMMs; slots of expert -1 or E skipped, a token with none valid gets zeros."""
    gen = generator(10)
    e, n_tokens = 24, 3
    experts, dense = make_experts(fmt, gen, e, d, i)
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    expert_ids = torch.tensor([[e - 1, 1], [-1, e], [1, 6]], device=DEVICE)      # int64 ids
    weights = torch.rand(n_tokens, 2, generator=gen, device=DEVICE) + 0.5
    calls = []
    per_assignment = moe_decode.expert_rows_per_assignment
    monkeypatch.setattr(sys.modules["minirt.kernels.moe_experts"], "expert_rows_per_assignment",
                        lambda *args: calls.append(1) or per_assignment(*args))
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit)
    assert calls and out.dtype == torch.bfloat16 and torch.isfinite(out).all() and (out[1] == 0).all()
    ref = ref_moe(x, expert_ids, weights, dense, limit)
    assert rel_error(out, ref) < EXPERTS_TOL
    if limit is not None:
        assert rel_error(out, ref_moe(x, expert_ids, weights, dense, None)) > 10 * EXPERTS_TOL
    grouped = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit, config=DECODE_CONFIG).float()
    # Sums in another order: a bf16 ulp now and then (scaled by the row: slots may cancel).
    ulp = torch.finfo(torch.bfloat16).eps * (grouped.abs() + grouped.pow(2).mean(1, keepdim=True).sqrt())
    assert ((out.float() - grouped).abs() <= 4 * ulp).all()


def test_single_assignment_takes_the_per_assignment_path(poisoned, monkeypatch):
    """One fp8 expert (V4's shared expert shape) and one token: moe_decode's products, against the oracle; two
    tokens of it: the grouped GEMMs (each would read the expert once more)."""
    gen = generator(11)
    experts, dense = make_experts("fp8", gen, 1, 256, 256)
    calls = []
    per_assignment = moe_decode.expert_rows_per_assignment
    monkeypatch.setattr(sys.modules["minirt.kernels.moe_experts"], "expert_rows_per_assignment",
                        lambda *args: calls.append(1) or per_assignment(*args))
    for n_tokens, expect_calls in ((1, 1), (2, 1)):
        x = torch.randn(n_tokens, 256, generator=gen, device=DEVICE).bfloat16()
        ids = torch.zeros(n_tokens, 1, dtype=torch.int32, device=DEVICE)
        ones = torch.ones(n_tokens, 1, device=DEVICE)
        out = moe_experts(x, ids, ones, experts, swiglu_limit=10.0)
        assert len(calls) == expect_calls and torch.isfinite(out).all()
        assert rel_error(out, ref_moe(x, ids, ones, dense, 10.0)) < EXPERTS_TOL


@pytest.mark.parametrize("fmt, n_tokens, config", [
    ("fp4", 1, None),            # the shared expert's programs in the routed launches (e4m3 on the fp4 products)
    ("fp8", 1, None),            # the same with FMAs
    ("fp4", 3, None),            # routed per assignment, the shared expert in its own grouped GEMMs
    ("fp8", 3, DECODE_CONFIG),   # both grouped
])
def test_moe_experts_with_shared_expert(poisoned, monkeypatch, fmt, n_tokens, config):
    """shared=: every token's shared expert (weight 1) added to the routed experts' sum, against the oracle, and
    within a few bf16 ulps of the two computed apart (bf16 each, added in fp32); the one-token path passes it into
    the per-assignment launches."""
    gen = generator(12)
    e, d, i, limit = 24, 512, 384, 0.5   # fp4 gate/up: 1 chunk of 4 k blocks (fp8 parts of 2); down: 3 chunks of 1
    experts, dense = make_experts(fmt, gen, e, d, i)
    shared, shared_dense = make_experts("fp8", gen, 1, d, i)
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    expert_ids = torch.tensor([[e - 1, 1], [-1, e], [1, 6]], device=DEVICE)[:n_tokens]
    weights = torch.rand(n_tokens, 2, generator=gen, device=DEVICE) + 0.5
    zeros = torch.zeros(n_tokens, 1, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(n_tokens, 1, device=DEVICE)
    calls = []
    per_assignment = moe_decode.expert_rows_per_assignment
    monkeypatch.setattr(sys.modules["minirt.kernels.moe_experts"], "expert_rows_per_assignment",
                        lambda *args: calls.append(len(args) > 4 and args[4] is not None) or per_assignment(*args))
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit, config=config, shared=shared)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (True in calls) == (n_tokens == 1 and config is None)
    routed_ref = ref_moe(x, expert_ids, weights, dense, limit)
    ref = routed_ref + ref_moe(x, zeros, ones, shared_dense, limit)
    assert rel_error(out, ref) < EXPERTS_TOL
    assert rel_error(out, routed_ref) > 10 * EXPERTS_TOL
    apart = (moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit, config=config).float()
             + moe_experts(x, zeros, ones, shared, swiglu_limit=limit).float())
    ulp = torch.finfo(torch.bfloat16).eps * (apart.abs() + apart.pow(2).mean(1, keepdim=True).sqrt())
    assert ((out.float() - apart).abs() <= 4 * ulp).all()


def test_kernels_launched_early_wait_for_their_inputs_first():
    """Every kernel launched with launch_pdl=True (it may start while the previous kernel still runs) calls
    wait_for_inputs() before anything else but its program ids and, under ``if PREFETCH > 0``, L2 prefetches of
    weight rows and loads of the routing's expert ids (written two launches back at least); it lets the next
    kernel launch (launch_dependents()) only after its wait."""
    launched = []
    for module in (moe_decode, sys.modules["minirt.kernels.moe_experts"]):
        for call in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(call, ast.Call) and any(k.arg == "launch_pdl" for k in call.keywords):
                kernel = getattr(module, call.func.value.id)   # kernel[grid](...)
                name = kernel.fn.__name__
                body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
                body = body[1:] if isinstance(body[0].value, ast.Constant) else body   # (its docstring)
                wait = next(n for n, node in enumerate(body) if ast.unparse(node) == "wait_for_inputs()")
                for node in body[:wait]:
                    if isinstance(node, ast.If):
                        assert ast.unparse(node.test) == "PREFETCH > 0", name
                        loads = [c for c in ast.walk(node)
                                 if isinstance(c, ast.Call) and ast.unparse(c.func) == "tl.load"]
                        assert all(ast.unparse(c.args[0]).startswith("ids_ptr") for c in loads), name
                    else:
                        assert isinstance(node, ast.Assign) and "tl.program_id" in ast.unparse(node.value), name
                assert "launch_dependents()" not in "".join(ast.unparse(node) for node in body[:wait]), name
                launched.append(name)
    assert {"_fp4_operand_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"} <= set(launched)


def test_moe_experts_rejects_a_bad_shared_expert():
    gen = generator(13)
    experts, _ = make_experts("fp4", gen, 2, 256, 128)
    x = torch.randn(1, 256, device=DEVICE).bfloat16()
    ids, weights = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), torch.ones(1, 2, device=DEVICE)
    for bad, what in ((make_experts("fp4", gen, 1, 256, 128)[0], "fp4, 1 experts"),
                      (make_experts("fp8", gen, 2, 256, 128)[0], "fp8, 2 experts"),
                      (make_experts("fp8", gen, 1, 256, 256)[0], ".*intermediate size 256"),
                      (experts.w13, "Tensor")):
        with pytest.raises(InputError, match=f"shared must be .*got {what}"):
            moe_experts(x, ids, weights, experts, shared=bad)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_prefill_default_path_fp8(poisoned, monkeypatch, limit):
    """fp8 experts at a prefill size with moe_experts' own launch shape: on an sm_90 GPU both products run in
    the Gluon kernel (moe_grouped_sm90: k loops of 8 and 4 blocks, an expert over two 128-row tiles),
    elsewhere in the Triton kernel; against the oracle either way."""
    gen = generator(13)
    e, d, i, top_k, n_tokens = 8, 1024, 512, 2, 160     # 320 assignments: past DECODE_CONFIG's 16 per expert
    experts, dense = make_experts("fp8", gen, e, d, i)
    calls = []
    sm90 = sys.modules["minirt.kernels.moe_grouped_sm90"]
    grouped_fp8 = sm90.grouped_fp8
    monkeypatch.setattr(sm90, "grouped_fp8", lambda *args, **kwargs: calls.append(1) or grouped_fp8(*args, **kwargs))
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    # Expert 0 gets 160 rows (two tiles, the second partly padding); the last expert none.
    expert_ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                         1 + torch.randperm(e - 2, generator=gen, device=DEVICE)[:top_k - 1]])
                              for _ in range(n_tokens)]).int()
    weights = torch.rand(n_tokens, top_k, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit)
    on_hopper = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert len(calls) == (2 if on_hopper else 0)
    assert out.shape == (n_tokens, d) and torch.isfinite(out).all()
    ref = ref_moe(x, expert_ids, weights, dense, limit)
    assert rel_error(out, ref) < EXPERTS_TOL
    if on_hopper:   # the same products and promotion as the Triton kernel: agreeing far closer than the oracle
        triton_out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=limit, config=replace(PREFILL_CONFIG))
        assert rel_error(out, triton_out.double()) < 1e-3
    if limit is not None:    # the clamp bites
        assert rel_error(out, ref_moe(x, expert_ids, weights, dense, None)) > 10 * EXPERTS_TOL


@pytest.mark.parametrize("past_spread", [False, True])
def test_prefill_default_path_fp4(poisoned, monkeypatch, past_spread):
    """fp4 experts at a prefill size with moe_experts' own launch shape: on an sm_90 GPU the folded products run
    in the Gluon kernel (moe_grouped_fp4_sm90: k loops of 8 and 4 blocks, an expert over two 128-row tiles),
    then the Triton kernel's bf16 pass over the blocks it marked (past_spread: experts 4-7's rows span 2^12
    within a block, so every tile of theirs is marked), elsewhere both in the Triton kernel; against the
    oracle either way, and on sm_90 against the Triton kernel."""
    gen = generator(17)
    e, d, i, top_k, n_tokens = 8, 1024, 512, 2, 160     # 320 assignments: past DECODE_CONFIG's 16 per expert
    if past_spread:
        experts, dense, x = experts_at_the_fold_spread(gen, e, d, i, n_tokens)
    else:
        experts, dense = make_experts("fp4", gen, e, d, i)
        x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    calls = []
    sm90 = sys.modules["minirt.kernels.moe_grouped_fp4_sm90"]
    grouped_fp4 = sm90.grouped_fp4
    monkeypatch.setattr(sm90, "grouped_fp4", lambda *args, **kwargs: calls.append(args[-1]) or grouped_fp4(*args,
                                                                                                             **kwargs))
    # Expert 0 gets 160 rows (two tiles, the second partly padding); the last expert none.
    expert_ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                         1 + torch.randperm(e - 2, generator=gen, device=DEVICE)[:top_k - 1]])
                              for _ in range(n_tokens)]).int()
    weights = torch.rand(n_tokens, top_k, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=0.5)
    on_hopper = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert len(calls) == (2 if on_hopper else 0)
    if on_hopper:   # the marks: some blocks exactly when past the spread (the unused tiles' stay 0)
        assert all(bool(marks.any()) == past_spread for marks in calls)
    assert out.shape == (n_tokens, d) and torch.isfinite(out).all()
    assert rel_error(out, ref_moe(x, expert_ids, weights, dense, 0.5)) < EXPERTS_TOL
    if on_hopper:   # the same products and promotion as the Triton kernel
        triton_out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=0.5, config=replace(PREFILL_CONFIG_FP4))
        assert rel_error(out, triton_out.double()) < 1e-3


def test_prefill_fp4_marked_blocks_recomputed(poisoned, monkeypatch):
    """moe_experts' fp4 prefill path on sm_90 with the Gluon kernel stood in for (any device): it writes nothing
    and marks every 128-column block, so the Triton kernel's bf16 pass alone must produce every output block
    (poisoned outputs elsewhere), against the oracle; the marks sized per GEMM (I, then D columns)."""
    gen = generator(23)
    e, d, i, top_k, n_tokens = 8, 1024, 512, 2, 160
    experts, dense = make_experts("fp4", gen, e, d, i)
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    expert_ids = torch.stack([torch.randperm(e, generator=gen, device=DEVICE)[:top_k] for _ in range(n_tokens)]).int()
    weights = torch.rand(n_tokens, top_k, generator=gen, device=DEVICE) + 0.5
    marked = []

    def mark_every_block(a, a_scales, weight, scales, tile_expert, out, out_scales, unfolded, *, swiglu, limit):
        marked.append((tile_expert.numel(), unfolded.numel()))
        unfolded.fill_(1)

    sm90 = sys.modules["minirt.kernels.moe_grouped_fp4_sm90"]
    monkeypatch.setattr(sm90, "takes", lambda *args: True)
    monkeypatch.setattr(sm90, "grouped_fp4", mark_every_block)
    out = moe_experts(x, expert_ids, weights, experts, swiglu_limit=0.5)
    assert [n for _, n in marked] == [tiles * cols // 128 for (tiles, _), cols in zip(marked, (i, d))]
    assert out.shape == (n_tokens, d) and torch.isfinite(out).all()
    assert rel_error(out, ref_moe(x, expert_ids, weights, dense, 0.5)) < EXPERTS_TOL


@triton.jit
def _e2m1_pairs_kernel(packed_ptr, low_ptr, high_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    offsets = tl.arange(0, N)
    low, high = moe_decode._e2m1_pairs_as_e4m3(tl.load(packed_ptr + offsets), INTERPRETED)
    tl.store(low_ptr + offsets, low)
    tl.store(high_ptr + offsets, high)


def test_e2m1_pairs_as_e4m3_every_byte(poisoned):
    """moe_decode's fp4 decode (compiled: four bytes per PTX instruction; interpreted: per byte): every
    byte's low and high nibble become e4m3 codes of exactly 2^-6 times their e2m1 values."""
    packed = torch.randperm(256, generator=generator(5), device=DEVICE).to(torch.uint8)
    low, high = (torch.empty(256, dtype=torch.uint8, device=DEVICE) for _ in range(2))
    _e2m1_pairs_kernel[(1,)](packed, low, high, N=256, INTERPRETED=moe_decode.INTERPRET)
    b = packed.long().cpu()
    for got, nibble in ((low, b & 15), (high, b >> 4)):
        want = E2M1[nibble & 7] * torch.where(nibble >= 8, -1.0, 1.0) / 64
        assert torch.equal(got.cpu().view(torch.float8_e4m3fn).float(), want)


def test_moe_experts_expert_over_several_tiles(poisoned):
    """Expert 0 takes every token's first slot: 17 rows, two 16-row tiles (the second partly padding)."""
    gen = generator(5)
    e, d, i, n_tokens = 6, 128, 128, 17
    experts, dense = make_experts("fp8", gen, e, d, i)
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()
    expert_ids = torch.stack([torch.zeros(n_tokens, dtype=torch.long, device=DEVICE),
                              torch.randint(1, e, (n_tokens,), generator=gen, device=DEVICE)], 1)
    weights = torch.rand(n_tokens, 2, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, config=DECODE_CONFIG)
    assert rel_error(out, ref_moe(x, expert_ids, weights, dense, None)) < EXPERTS_TOL


def test_moe_experts_skips_invalid_slots(poisoned):
    """Slots of expert -1 or E add nothing; a token with none valid gets zeros."""
    gen = generator(4)
    e, d, i = 4, 128, 128
    experts, dense = make_experts("fp8", gen, e, d, i)
    x = torch.randn(3, d, generator=gen, device=DEVICE).bfloat16()
    expert_ids = torch.tensor([[2, -1], [-1, e], [1, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(3, 2, generator=gen, device=DEVICE) + 0.5
    out = moe_experts(x, expert_ids, weights, experts, config=DECODE_CONFIG)
    assert (out[1] == 0).all()
    ref = ref_moe(x, expert_ids, weights, dense, None)
    assert rel_error(out, ref) < EXPERTS_TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_expert_weights_bytes(fmt):
    experts, _ = make_experts(fmt, generator(7), 3, 256, 128)
    assert experts.nbytes == 3 * ExpertWeights.bytes_per_expert(fmt, 256, 128)
    assert experts.n_experts == 3 and experts.hidden_size == 256 and experts.intermediate_size == 128
    moved = experts.to("cpu")
    assert moved.device.type == "cpu" and torch.equal(moved.w2.view(torch.uint8).cpu(), experts.w2.view(torch.uint8).cpu())


def test_custom_ops_equal_the_functions():
    gen = generator(8)
    logits = torch.randn(3, 8, generator=gen, device=DEVICE)
    weights, ids = torch.ops.minirt.route_topk(logits, None, 2, "sqrtsoftplus", 1, 1, True, 1.5)
    ref_weights_, ref_ids = route_topk(logits, None, top_k=2, scoring="sqrtsoftplus", scaling=1.5)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights_)
    table = torch.randint(0, 8, (10, 2), generator=gen, device=DEVICE)
    tokens = torch.randint(0, 10, (3,), generator=gen, device=DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.minirt.route_hash(logits, table, tokens, "sigmoid"),
                                                 route_hash(logits, table, tokens, scoring="sigmoid")))
    experts, _ = make_experts("fp4", gen, 8, 128, 128)
    x = torch.randn(3, 128, generator=gen, device=DEVICE).bfloat16()
    expert_args = (experts.w13, experts.w13_scales, experts.w2, experts.w2_scales, "fp4", 10.0)
    out = torch.ops.minirt.moe_experts(x, ids, weights, *expert_args)
    assert torch.equal(out, moe_experts(x, ids, weights, experts, swiglu_limit=10.0))
    # Schemas, fake implementations (shapes and dtypes without a kernel) and torch.compile tracing.
    torch.library.opcheck(torch.ops.minirt.route_topk, (logits, None, 2, "sqrtsoftplus", 1, 1, True, 1.5))
    torch.library.opcheck(torch.ops.minirt.route_hash, (logits, table, tokens, "sigmoid"))
    torch.library.opcheck(torch.ops.minirt.moe_experts, (x, ids, weights, *expert_args),
                          test_utils=("test_schema", "test_faketensor"))   # the others rerun the kernels


def test_expert_weights_reject_bad_tensors():
    w = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 2, 1)
    w2 = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)
    s2 = torch.ones(2, 1, 1)
    ExpertWeights("fp8", w, s, w2, s2)
    with pytest.raises(InputError, match="w13_scales"):
        ExpertWeights("fp8", w, torch.ones(2, 1, 1), w2, s2)
    with pytest.raises(InputError, match="format"):
        ExpertWeights("fp6", w, s, w2, s2)
    with pytest.raises(InputError, match=r"w3\[1\]"):
        expert_weights_fp8([w[0], w[1]], [s[0], s[1]], [w[0], w[1][:64]], [s[0], s[1]], [w2[0], w2[1]], [s2[0], s2[1]])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and host-sync detection need a GPU")
@pytest.mark.parametrize("fmt, config, n_tokens", [
    ("fp8", None, 1), ("fp8", DECODE_CONFIG, 4),   # moe_decode's path, grouped GEMMs
    ("fp4", None, 1), ("fp4", None, 3),            # moe_decode's path (one token: its L2 prefetch)
    ("fp4", PREFILL_CONFIG_FP4, 64),               # the folded launch and its bf16 one
])
def test_moe_decode_is_sync_free_and_graph_capturable(fmt, config, n_tokens):
    """Routing and experts raise no host sync (sync debug mode "error") and replay from a CUDA graph
    on new inputs with the eager results."""
    gen = generator(6)
    e, d, i, top_k = 16, 256, 128, 4
    experts, _ = make_experts(fmt, gen, e, d, i)
    logits = torch.randn(n_tokens, e, generator=gen, device=DEVICE)
    bias = torch.randn(e, generator=gen, device=DEVICE) * 0.1
    x = torch.randn(n_tokens, d, generator=gen, device=DEVICE).bfloat16()

    def step():
        weights, ids = route_topk(logits, bias, top_k=top_k, scoring="sigmoid", n_group=4, topk_group=2)
        return moe_experts(x, ids, weights, experts, config=config)

    step()   # compiles outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(torch.randn(n_tokens, e, generator=gen, device=DEVICE))
    x.copy_(torch.randn(n_tokens, d, generator=gen, device=DEVICE))
    graph.replay()
    assert torch.equal(captured, step())


def test_moe_experts_rejects_bad_input():
    experts, _ = make_experts("fp8", generator(9), 2, 128, 128)
    x = torch.randn(3, 128, device=DEVICE).bfloat16()
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    weights = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(InputError, match=r"x must be .*\[T, 128\]"):
        moe_experts(x[:, :64], ids, weights, experts)
    with pytest.raises(InputError, match="expert_ids"):
        moe_experts(x, ids.float(), weights, experts)
    with pytest.raises(InputError, match="weights"):
        moe_experts(x, ids, weights[:, :1], experts)
    with pytest.raises(InputError, match="ExpertWeights"):
        moe_experts(x, ids, weights, (experts.w13, experts.w2))
    with pytest.raises(InputError, match="config"):
        moe_experts(x, ids, weights, experts, config=MoeConfig(block_n=64))
