"""sparse_mla_decode_fp8 / mla_decode_fp8 against an fp64 torch reference written here (dequantised
cache, gather, masked softmax), and against the sparse prefill kernel on the dequantised cache.

Runs the real Triton kernels: compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU.
Every call gets NaN-poisoned preallocated out/lse, and every cache slot that no valid index points to
is filled with 0xFF bytes (NaN in fp8, float32 and bf16).
"""
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, force_portable_kernels
from minirt.errors import InputError
from minirt.kernels.kv_cache_fp8 import dequantize_kv_fp8, new_kv_cache, quantize_kv_fp8
from minirt.kernels.sparse_mla_decode import (DecodeConfig, default_config, longest_first, mla_decode_fp8,
                                              sparse_mla_decode_fp8)
from minirt.kernels.sparse_mla_prefill import sparse_mla_prefill
from minirt.kernels import sparse_mla_decode_sm90 as sm90
from minirt.kernels import sparse_mla_decode_sm90_few_heads as sm90_few_heads
from test_sparse_mla_prefill import record_launches

ON_GPU = DEVICE == "cuda"


@pytest.fixture(params=["sm90", "sm90-64-heads", "portable"] if ON_GPU else ["portable"])
def kernel_path(request, monkeypatch):
    """Which decode kernel runs (conftest's kernel_path, with one path more): on a GPU a test runs
    through the kernels the public functions pick (on sm_90 the Gluon kernels: few-heads up to 32
    heads, 64-head above), through the 64-head Gluon kernel at every h_q, and through the portable
    Triton kernels (prefill's too), forced. The CPU (interpreter) has only the portable kernels."""
    if request.param == "portable":
        force_portable_kernels(monkeypatch)
    if request.param == "sm90-64-heads":
        monkeypatch.setattr(sm90_few_heads, "HEADS", ())
    return request.param


pytestmark = pytest.mark.usefixtures("kernel_path")


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
SM_SCALE = 576 ** -0.5 * 1.3
# out: |err| <= OUT_ATOL + OUT_RTOL * |ref| + P_ROUNDING * sum_j p_j |v_j| elementwise. The cache is
# compared after dequantisation (exact in bf16). Stored out is rounded to bf16 (<= 2^-8 relative;
# the interpreter truncates: < 2^-7), inside OUT_RTOL = 3/128. On the GPU the kernel also rounds the
# softmax weights p to bf16 for the tensor-core P.V dot (as FlashMLA does): <= 2^-8 relative per
# weight, so |err| <= 2^-8 * sum_j p_j |v_j|; with |v| ~ 1 that is the 8e-4-scale absolute term, but
# it grows with |v| and does not shrink when sum_j p_j v_j cancels. The interpreter keeps p in fp32.
OUT_ATOL, OUT_RTOL = 8e-4, 3 / 128
P_ROUNDING = 2.0**-8 if ON_GPU else 0.0
# lse: relative 2/65536 plus the float32 rounding budget of the 576-term dot products,
# 2^-18 * sm_scale * max_j sum_d |q_d k_jd|, which matters only when lse itself is near 0.
LSE_RTOL, LSE_DOT_ULPS = 2 / 65536, 2.0**-18


def make_cache(num_blocks, block_size, seed, block_pad=0):
    """Random V32 cache (optionally a view with block stride (block_size + block_pad) * 656)."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * (block_size + block_pad)
    latent = torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    backing = quantize_kv_fp8(latent, rope).view(num_blocks, block_size + block_pad, 1, 656).to(DEVICE)
    return backing, backing[:, :block_size]


def random_indices(b, s_q, topk, num_slots, seed, p_invalid=0.3):
    """Random slot ids; a p_invalid share replaced by garbage invalid values."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_slots, (b, s_q, topk), generator=g, dtype=torch.int32)
    garbage = torch.tensor([-1, INT32_MIN, INT32_MAX, num_slots, -7], dtype=torch.int32)
    pick = garbage[torch.randint(0, len(garbage), idx.shape, generator=g)]
    return torch.where(torch.rand(idx.shape, generator=g) < p_invalid, pick, idx)


def poison_unused(cache, indices, topk_length=None):
    """Fill every slot that no used valid index points to with 0xFF (NaN everywhere)."""
    num_slots = cache.shape[0] * cache.shape[1]
    used = valid_mask(indices.cpu(), num_slots, None if topk_length is None else topk_length.cpu())
    touched = torch.zeros(num_slots, dtype=torch.bool)
    touched[indices.cpu()[used].long()] = True
    blocks, offsets = (~touched).nonzero()[:, 0] // cache.shape[1], (~touched).nonzero()[:, 0] % cache.shape[1]
    cache[blocks.to(DEVICE), offsets.to(DEVICE)] = 0xFF


def valid_mask(indices, num_slots, topk_length=None):
    valid = (indices >= 0) & (indices < num_slots)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1])
        valid &= pos[None, None, :] < topk_length.long()[:, None, None]
    return valid


def reference(q, cache, indices, sm_scale, attn_sink=None, topk_length=None):
    """fp64 oracle on the dequantised cache. Returns out [b,s,h,512], lse [b,h,s], empty [b,h,s],
    dot magnitude [b,h,s] and spread = sum_j p_j |v_j| [b,s,h,512]."""
    kv = dequantize_kv_fp8(cache.cpu().reshape(-1, 656), torch.float32).double()
    idx = indices.cpu().long()
    valid = valid_mask(idx, kv.shape[0], None if topk_length is None else topk_length.cpu())
    k = torch.where(valid[..., None], kv[torch.where(valid, idx, 0)], 0.0)       # [b, s, t, 576]
    q64 = q.cpu().double()
    logits = torch.einsum("bshd,bstd->bsht", q64, k) * sm_scale
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    magnitude = (torch.einsum("bshd,bstd->bsht", q64.abs(), k.abs()) * sm_scale).amax(-1)
    lse = torch.logsumexp(logits, -1)                                             # [b, s, h]
    empty = ~valid.any(-1)[:, :, None].expand_as(lse)
    lse_finite = torch.where(empty, 0.0, lse)
    p = torch.exp(logits - lse_finite[..., None])
    out = torch.einsum("bsht,bstd->bshd", p, k[..., :512])
    spread = torch.einsum("bsht,bstd->bshd", p, k[..., :512].abs())
    if attn_sink is not None:
        factor = 1.0 / (1.0 + torch.exp(attn_sink.cpu().double()[None, None, :] - lse_finite))[..., None]
        out, spread = out * factor, spread * factor
    lse = torch.where(empty, math.inf, lse)
    return out, lse.transpose(1, 2), empty.transpose(1, 2), magnitude.transpose(1, 2), spread


def decode(q, cache, indices, sm_scale, **kwargs):
    """Run the kernel into NaN-poisoned preallocated outputs."""
    b, s_q, h_q, _ = q.shape
    out = torch.full((b, s_q, h_q, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((b, h_q, s_q), math.nan, dtype=torch.float32, device=DEVICE)
    got = sparse_mla_decode_fp8(q, cache, indices, sm_scale, out=out, lse=lse, **kwargs)
    assert got[0] is out and got[1] is lse
    return out, lse


def check(got, ref):
    out, lse = got
    r_out, r_lse, empty, magnitude, spread = ref
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.isfinite(out).all(), "out has NaN/Inf"
    excess = (out - r_out).abs() - (OUT_ATOL + OUT_RTOL * r_out.abs() + P_ROUNDING * spread)
    assert excess.max() <= 0, f"out off by {excess.max():.3g} beyond tolerance"
    assert (out[empty.transpose(1, 2)] == 0).all(), "empty rows must be exactly 0"
    assert (lse[empty] == math.inf).all(), "empty rows must have lse = +inf"
    full = ~empty
    assert torch.isfinite(lse[full]).all()
    lse_excess = (lse - r_lse).abs()[full] - (LSE_RTOL * r_lse.abs() + LSE_DOT_ULPS * magnitude)[full]
    assert lse_excess.numel() == 0 or lse_excess.max() <= 0, f"lse off by {lse_excess.max():.3g}"


def random_q(b, s_q, h_q, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s_q, h_q, 576, generator=g) * 1.5).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("h_q", [64, 16])
def test_every_fp8_code_and_scale_decodes_exactly(h_q):
    """A query row with one valid slot attends to it alone (p = 1), so out is that token's dequantised
    latent, which bf16 holds exactly: bit-equal to dequantize_kv_fp8. The tokens cover every non-NaN
    e4m3 code (subnormals, both zeros, ±448) in every tile, under power-of-two scales 2^-40..2^40
    (beyond the writer's range both ways: the kernel must not depend on it)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)   # 254 codes
    n_tokens = 64
    g = torch.Generator().manual_seed(3)
    tokens = torch.empty(n_tokens, 656, dtype=torch.uint8)
    tokens[:, :512] = codes[torch.stack([torch.randperm(512, generator=g) % len(codes) for _ in range(n_tokens)])]
    exponents = torch.arange(n_tokens * 4).view(n_tokens, 4) % 81 - 40
    tokens[:, 512:528] = torch.exp2(exponents.float()).view(torch.uint8).view(n_tokens, 16)
    tokens[:, 528:] = torch.randn(n_tokens, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    cache = tokens.view(1, n_tokens, 1, 656).to(DEVICE)
    # Row t: slot t, then invalid entries (and a duplicate-free tail of -1).
    indices = torch.full((1, n_tokens, 8), -1, dtype=torch.int32)
    indices[0, :, 3] = torch.arange(n_tokens, dtype=torch.int32)
    q = random_q(1, n_tokens, h_q, 3) * 1e-3     # small logits: one key per row, any magnitude works
    out, lse = decode(q, cache, indices.to(DEVICE), SM_SCALE)
    expected = dequantize_kv_fp8(tokens, torch.float32)[:, :512]
    assert torch.isfinite(expected).all()
    assert expected.abs().max() > 1e10 and expected[expected != 0].abs().min() < 1e-10   # the range is covered
    assert torch.equal(out.cpu()[0].float(), expected[:, None, :].expand(n_tokens, h_q, 512))
    assert torch.isfinite(lse).all()


CASES = [  # b, s_q, h_q, topk, block_size, num_splits, sink, topk_length
    (2, 1, 16, 64, 64, 1, False, False),
    (2, 2, 20, 100, 16, 3, True, True),
    (1, 3, 64, 96, 64, 2, False, True),
    (3, 1, 72, 40, 32, None, True, False),
    (1, 2, 5, 33, 8, 2, True, True),
]


@pytest.mark.parametrize("b,s_q,h_q,topk,block_size,num_splits,sink,lengths", CASES)
def test_matches_reference(b, s_q, h_q, topk, block_size, num_splits, sink, lengths):
    seed = b * 1000 + h_q * 10 + topk
    _, cache = make_cache(6, block_size, seed)
    num_slots = 6 * block_size
    indices = random_indices(b, s_q, topk, num_slots, seed)
    q = random_q(b, s_q, h_q, seed)
    attn_sink = torch.randn(h_q).to(DEVICE) * 2 if sink else None
    if attn_sink is not None:
        attn_sink[0] = -math.inf
    topk_length = torch.randint(0, topk + 5, (b,), dtype=torch.int32).to(DEVICE) if lengths else None
    indices = indices.to(DEVICE)
    poison_unused(cache, indices, topk_length)
    got = decode(q, cache, indices, SM_SCALE, attn_sink=attn_sink, topk_length=topk_length,
                 num_splits=num_splits)
    check(got, reference(q, cache, indices, SM_SCALE, attn_sink, topk_length))


def test_default_allocation_and_splits_agree():
    _, cache = make_cache(4, 64, 5)
    indices = random_indices(2, 2, 128, 256, 5).to(DEVICE)
    q = random_q(2, 2, 16, 5)
    out1, lse1 = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, num_splits=1)
    out4, lse4 = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, num_splits=4)
    assert out1.shape == (2, 2, 16, 512) and lse1.shape == (2, 16, 2)
    ref = reference(q, cache, indices, SM_SCALE)
    check((out1, lse1), ref)
    check((out4, lse4), ref)


def test_matches_prefill_kernel_on_dequantised_cache():
    b, s_q, h_q, topk = 2, 2, 16, 96
    _, cache = make_cache(3, 64, 7)
    indices = random_indices(b, s_q, topk, 192, 7).to(DEVICE)
    q = random_q(b, s_q, h_q, 7)
    attn_sink = torch.randn(h_q).to(DEVICE)
    topk_length = torch.tensor([topk, 50], dtype=torch.int32, device=DEVICE)
    out, lse = decode(q, cache, indices, SM_SCALE, attn_sink=attn_sink, topk_length=topk_length,
                      num_splits=2)
    kv = dequantize_kv_fp8(cache.reshape(-1, 1, 656))                    # [s_kv, 1, 576] bf16, exact
    p_out, _, p_lse = sparse_mla_prefill(q.reshape(b * s_q, h_q, 576), kv,
                                         indices.reshape(b * s_q, 1, topk), SM_SCALE,
                                         attn_sink=attn_sink,
                                         topk_length=topk_length.repeat_interleave(s_q))
    p_out, p_lse = p_out.view(b, s_q, h_q, 512), p_lse.view(b, s_q, h_q).transpose(1, 2)
    ref = reference(q, cache, indices, SM_SCALE, attn_sink, topk_length)
    check((out, lse), ref)
    check((p_out, p_lse), ref)
    # hence the two kernels agree within twice the tolerance; they round at the same places
    tol = OUT_ATOL + OUT_RTOL * ref[0].abs() + P_ROUNDING * ref[4]
    assert ((out.cpu().double() - p_out.cpu().double()).abs() <= 2 * tol).all()
    assert torch.allclose(lse, p_lse, rtol=2 * LSE_RTOL, atol=0)


def test_empty_and_fully_invalid_rows():
    b, s_q, h_q, topk = 3, 2, 16, 64
    _, cache = make_cache(2, 64, 11)
    indices = random_indices(b, s_q, topk, 128, 11)
    indices[0, 1] = -1                                            # all padding
    indices[1, 0] = torch.tensor([INT32_MIN, INT32_MAX, 128, -1] * 16, dtype=torch.int32)  # all garbage
    indices = indices.to(DEVICE)
    topk_length = torch.tensor([topk, topk, 0], dtype=torch.int32, device=DEVICE)   # batch 2: nothing used
    attn_sink = torch.full((h_q,), -math.inf, device=DEVICE)
    attn_sink[1::2] = 1.0
    poison_unused(cache, indices, topk_length)
    for num_splits in (1, 2):
        got = decode(random_q(b, s_q, h_q, 11), cache, indices, SM_SCALE, attn_sink=attn_sink,
                     topk_length=topk_length, num_splits=num_splits)
        ref = reference(random_q(b, s_q, h_q, 11), cache, indices, SM_SCALE, attn_sink, topk_length)
        assert ref[2][0, :, 1].all() and ref[2][1, :, 0].all() and ref[2][2].all()
        check(got, ref)


def test_cache_without_blocks_gives_empty_rows():
    # No slot exists, so every index is invalid (the sm90 producer's stand-in slot 0 must not be read).
    cache = torch.empty((0, 64, 1, 656), dtype=torch.uint8, device=DEVICE)
    indices = random_indices(2, 2, 96, 128, 29, p_invalid=0.0).to(DEVICE)
    for num_splits in (1, 2):
        out, lse = decode(random_q(2, 2, 16, 29), cache, indices, SM_SCALE, num_splits=num_splits)
        assert (out == 0).all() and (lse == math.inf).all()


def test_masked_leading_chunks_do_not_poison_the_softmax():
    # vLLM #48366: a fully masked first chunk made the running max -inf and exp2(-inf - -inf) = NaN.
    # Valid slots only in the middle chunk; 4 splits so whole splits are masked too.
    b, s_q, h_q, topk = 1, 3, 16, 128
    _, cache = make_cache(2, 64, 13)
    indices = torch.full((b, s_q, topk), -1, dtype=torch.int32)
    indices[0, 0, 40:60] = torch.arange(20, dtype=torch.int32)
    indices[0, 1, 127] = 5                                        # only the very last entry
    indices[0, 2, 0] = 9                                          # only the very first entry
    indices = indices.to(DEVICE)
    poison_unused(cache, indices)
    q = random_q(b, s_q, h_q, 13)
    for num_splits in (1, 4):
        check(decode(q, cache, indices, SM_SCALE, num_splits=num_splits),
              reference(q, cache, indices, SM_SCALE))


def test_noncontiguous_block_stride():
    backing, cache = make_cache(4, 16, 17, block_pad=3)
    assert not cache.is_contiguous() and cache.stride(0) == 19 * 656
    indices = random_indices(2, 1, 48, 64, 17).to(DEVICE)
    poison_unused(cache, indices)
    backing[:, 16:] = 0xFF                                        # the gaps between blocks
    q = random_q(2, 1, 16, 17)
    check(decode(q, cache, indices, SM_SCALE, num_splits=2), reference(q, cache, indices, SM_SCALE))


def test_strided_lengths_and_sink():
    """topk_length and attn_sink may be views with a stride (every other entry of a longer tensor)."""
    b, s_q, h_q, topk = 3, 2, 16, 64
    _, cache = make_cache(2, 64, 13)
    indices = random_indices(b, s_q, topk, 128, 13).to(DEVICE)
    topk_length = torch.tensor([5, 64, 0, 64, 33, 1], dtype=torch.int32, device=DEVICE)[::2]    # 5, 0, 33
    attn_sink = torch.randn(2 * h_q).to(DEVICE)[::2]
    poison_unused(cache, indices, topk_length)
    q = random_q(b, s_q, h_q, 13)
    for num_splits in (1, 2):
        check(decode(q, cache, indices, SM_SCALE, attn_sink=attn_sink, topk_length=topk_length,
                     num_splits=num_splits), reference(q, cache, indices, SM_SCALE, attn_sink, topk_length))


@pytest.mark.parametrize("b", [1, 5, 300])
def test_longest_first_is_a_stable_descending_sort_of_the_used_lengths(b):
    topk = 64
    g = torch.Generator().manual_seed(b)
    lengths = torch.randint(-3, 70, (b,), generator=g, dtype=torch.int32)   # ties, negatives, > topk
    order = longest_first(lengths.to(DEVICE), topk).cpu()
    expected = torch.sort(lengths.clamp(0, topk), descending=True, stable=True).indices
    assert order.dtype == torch.int32 and torch.equal(order.long(), expected)


def test_batch_with_different_lengths():
    b, s_q, h_q, topk = 4, 2, 16, 96
    _, cache = make_cache(4, 64, 19)
    indices = random_indices(b, s_q, topk, 256, 19, p_invalid=0.0)
    for i, n in enumerate((96, 1, 40, 70)):                      # per-sequence top-k, padded with -1
        indices[i, :, n:] = -1
    indices = indices.to(DEVICE)
    poison_unused(cache, indices)
    q = random_q(b, s_q, h_q, 19)
    check(decode(q, cache, indices, SM_SCALE, num_splits=3), reference(q, cache, indices, SM_SCALE))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 3), s_q=st.integers(1, 3), h_q=st.integers(1, 24), topk=st.integers(1, 90),
       p_invalid=st.sampled_from([0.0, 0.5, 0.9, 1.0]), num_splits=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_random_masks(b, s_q, h_q, topk, p_invalid, num_splits, seed):
    _, cache = make_cache(3, 32, seed)
    indices = random_indices(b, s_q, topk, 96, seed, p_invalid).to(DEVICE)
    poison_unused(cache, indices)
    q = random_q(b, s_q, h_q, seed)
    check(decode(q, cache, indices, SM_SCALE, num_splits=num_splits), reference(q, cache, indices, SM_SCALE))


def test_mla_decode_fp8_maps_positions_through_the_block_table():
    b, s_q, h_q, topk, block_size = 2, 2, 16, 48, 16
    _, cache = make_cache(8, block_size, 23)
    # sequence 0 owns pages 5, 1, 6 (48 tokens); sequence 1 owns pages 2, 7 and an unallocated one
    table = torch.tensor([[5, 1, 6], [2, 7, -1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(23)
    positions = torch.randint(0, 48, (b, s_q, topk), generator=g, dtype=torch.int32)
    positions[:, :, :4] = torch.tensor([-1, 48, 1000, INT32_MIN], dtype=torch.int32)   # none / out of table
    slots = torch.full_like(positions, -1)
    for i in range(b):
        for j in range(s_q):
            for t in range(topk):
                p = int(positions[i, j, t])
                if 0 <= p < 48 and table[i, p // block_size] >= 0:
                    slots[i, j, t] = table[i, p // block_size] * block_size + p % block_size
    assert (slots[1] == -1).sum() > 8, "positions on the unallocated page must map to -1"
    poison_unused(cache, slots.to(DEVICE))
    q = random_q(b, s_q, h_q, 23)
    attn_sink = torch.randn(h_q, device=DEVICE)
    out, lse = mla_decode_fp8(q, cache, table.to(DEVICE), positions.to(DEVICE), SM_SCALE, attn_sink=attn_sink)
    check((out, lse), reference(q, cache, slots, SM_SCALE, attn_sink))


def test_bad_inputs_raise_input_error():
    cache = new_kv_cache(2, 64, device=DEVICE)
    q = random_q(1, 1, 16, 0)
    idx = torch.zeros(1, 1, 8, dtype=torch.int32, device=DEVICE)
    bad_calls = [
        dict(q=q.float()), dict(q=q[..., :512]), dict(q=q[0]),
        dict(kv_cache=cache.view(torch.int8)), dict(kv_cache=cache[..., :600]),
        dict(kv_cache=cache.view(2, 64, 656)), dict(kv_cache=torch.zeros(2, 64, 1, 576, dtype=torch.bfloat16)),
        dict(indices=idx.long()), dict(indices=idx[0]), dict(indices=torch.zeros(2, 1, 8, dtype=torch.int32)),
        dict(d_v=576), dict(attn_sink=torch.zeros(15, device=DEVICE)),
        dict(attn_sink=torch.zeros(16, dtype=torch.float64, device=DEVICE)),
        dict(topk_length=torch.zeros(1, dtype=torch.int64, device=DEVICE)),
        dict(out=torch.empty(1, 1, 16, 512, device=DEVICE)), dict(lse=torch.empty(1, 1, 16, device=DEVICE)),
        dict(num_splits=0), dict(indices=idx.to("meta")), dict(q=q.to("meta")),
        dict(config=(64, 64, 8, 2)),
    ]
    for bad in bad_calls:
        args = dict(q=q, kv_cache=cache, indices=idx, sm_scale=SM_SCALE)
        args.update(bad)
        with pytest.raises(InputError):
            sparse_mla_decode_fp8(**args)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InputError):
        mla_decode_fp8(q, cache, table, idx.long(), SM_SCALE)
    with pytest.raises(InputError):
        mla_decode_fp8(q, cache, table.long(), idx, SM_SCALE)


def test_default_config():
    assert default_config(128) == DecodeConfig(block_h=64, block_n=64, num_warps=8)
    assert default_config(16).block_h == 16 and default_config(20).block_h == 32
    assert default_config(1).block_h == 16


@pytest.mark.parametrize("config", [DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
                                    DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=3),
                                    DecodeConfig(block_h=32, block_n=64, num_warps=4, num_stages=3)])
def test_other_launch_configs(config):
    # non-default launch shapes (the benchmark's variants) compute the same thing
    b, s_q, h_q, topk = 2, 2, 24, 150
    _, cache = make_cache(4, 64, 31)
    indices = random_indices(b, s_q, topk, 256, 31).to(DEVICE)
    topk_length = torch.tensor([150, 70], dtype=torch.int32, device=DEVICE)
    poison_unused(cache, indices, topk_length)
    q = random_q(b, s_q, h_q, 31)
    attn_sink = torch.randn(h_q, device=DEVICE)
    for num_splits in (1, 2):
        check(decode(q, cache, indices, SM_SCALE, attn_sink=attn_sink, topk_length=topk_length,
                     num_splits=num_splits, config=config),
              reference(q, cache, indices, SM_SCALE, attn_sink, topk_length))


@pytest.mark.skipif(not ON_GPU, reason="production shapes only on the GPU; the CPU runs the small cases above")
@pytest.mark.parametrize("h_q,s_q", [(128, 2), (32, 1), (16, 1)])
def test_production_shape_gpu(h_q, s_q):
    b, topk, block_size = 8, 2048, 64
    _, cache = make_cache(512, block_size, 29)
    indices = random_indices(b, s_q, topk, 512 * block_size, 29, p_invalid=0.1).to(DEVICE)
    q = random_q(b, s_q, h_q, 29)
    attn_sink = torch.randn(h_q, device=DEVICE)
    got = decode(q, cache, indices, 0.1352 * 192 ** -0.5, attn_sink=attn_sink)   # default splits
    check(got, reference(q, cache, indices, 0.1352 * 192 ** -0.5, attn_sink))


def gluon_kernel(h_q):
    """(module, name) of the Gluon decode kernel that sparse_mla_decode_fp8 launches for h_q on sm_90."""
    if h_q <= max(sm90_few_heads.HEADS, default=0):
        return sm90_few_heads, "_sparse_decode_few_heads_kernel"
    return sm90, "_sparse_decode_sm90_kernel"


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("h_q", [16, 64])
def test_sm90_kernel_taken_on_hopper(kernel_path, monkeypatch, h_q):
    launched = []

    class Spy:   # stands in for the Gluon kernel object: records the launch, then runs it
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    module, name = gluon_kernel(h_q)   # on the sm90 path, the few-heads kernel at h_q 16
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, Spy())
    _, cache = make_cache(4, 64, 7)
    indices = random_indices(2, 1, 100, 256, 7).to(DEVICE)
    q = random_q(2, 1, h_q, 7)
    check(decode(q, cache, indices, SM_SCALE), reference(q, cache, indices, SM_SCALE))
    assert len(launched) == (0 if kernel_path == "portable" else 1)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("h_q", [64, 16])
def test_sm90_launch_matches_kernel_signature(monkeypatch, num_splits, h_q):
    """The Gluon kernels cannot run on the CPU (no interpreter); their launches can: each passes exactly
    its kernel's parameters, and their runtime arguments are the portable kernel's (one argument list
    built for all; at h_q 64 the 64-head kernel and the portable one take 64 heads and 64 slots per step,
    at h_q 16 the few-heads kernel and the portable one 16 heads and 64 slots, so the values match too)."""
    decode = importlib.import_module("minirt.kernels.sparse_mla_decode")
    _, cache = make_cache(2, 64, 41)
    indices = random_indices(1, 2, 200, 128, 41).to(DEVICE)
    q = random_q(1, 2, h_q, 41)
    launches, merges = [], record_launches(monkeypatch, decode, "_merge_splits_kernel")   # nothing to merge
    for use_sm90, module, name in ((False, decode, "_sparse_decode_kernel"), (True, *gluon_kernel(h_q))):
        monkeypatch.setattr(decode, "uses_sm90_kernel", lambda *args, **kwargs: use_sm90)
        monkeypatch.setattr(decode, "_PLANS", {})   # (the kernel is chosen once per call signature)
        recorded = record_launches(monkeypatch, module, name)
        sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, num_splits=num_splits)
        (arguments,) = recorded
        assert arguments["SPLIT"] == (num_splits > 1)
        launches.append(arguments)
    assert len(merges) == (2 if num_splits > 1 else 0)
    # The runtime parameters are the lower-case ones, the constexprs upper-case.
    portable, gluon = ({n: v for n, v in a.items() if not n.isupper()} for a in launches)
    assert list(portable) == list(gluon)

    def described(v):
        return (v.dtype, v.shape, v.stride()) if isinstance(v, torch.Tensor) else v
    assert [described(v) for v in portable.values()] == [described(v) for v in gluon.values()]
