"""sparse_mla_decode_fp8 over MODEL1 caches (a main cache and an extra one) against an fp64 torch reference
written here from FlashMLA's semantics, on the dequantised entries (dequantize_kv_model1). On an sm_90
GPU every test runs through the Gluon kernel (sparse_mla_decode_model1_sm90: the pick, and its 64-head
variant at every h_q) and through the portable kernel; on the CPU through the portable kernel (the
interpreter). Outputs are NaN-poisoned, and every entry that no used valid index points to is 0xFF.
"""
import importlib
import math

import pytest
import torch

from conftest import DEVICE
from minirt.kernels import sparse_mla_decode_model1_sm90 as model1_sm90
from minirt.kernels.kv_cache_model1 import dequantize_kv_model1, model1_cache_from_entries, quantize_kv_model1
from minirt.kernels.sparse_mla_decode import sparse_mla_decode_fp8
from test_sparse_mla_decode import check, kernel_path, random_indices, valid_mask  # noqa: F401 (a fixture)
from test_sparse_mla_prefill import record_launches

pytestmark = pytest.mark.usefixtures("kernel_path")
SM_SCALE = 512 ** -0.5 * 1.2


def make_entries(num_blocks, block_size, seed):
    """Random MODEL1 entries [num_blocks * block_size, 584], magnitudes varying by entry and tile."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    kv = torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 8), generator=g).float()
                                                        ).repeat_interleave(64, 1)
    return quantize_kv_model1(kv.to(torch.bfloat16))


def cache_of(entries, block_size, indices, lengths):
    """The cache of entries with every entry that no used valid index points to set to 0xFF (NaN in
    e4m3, ue8m0 and bf16)."""
    used = valid_mask(indices, entries.shape[0], lengths)
    touched = torch.zeros(entries.shape[0], dtype=torch.bool)
    touched[indices[used].long()] = True
    poisoned = torch.where(touched[:, None], entries, torch.full_like(entries, 0xFF))
    return model1_cache_from_entries(poisoned.view(-1, block_size, 584)).to(DEVICE)


def reference(q, sources, sm_scale, attn_sink=None):
    """fp64 oracle over both sources (entries, indices, lengths or None), one softmax. Returns what
    test_sparse_mla_decode.check takes: out, lse [b, h, s], empty [b, h, s], dot magnitude, spread."""
    keys, valids = [], []
    for entries, indices, lengths in sources:
        kv = dequantize_kv_model1(entries, torch.float32).double()
        valid = valid_mask(indices, entries.shape[0], lengths)
        keys.append(torch.where(valid[..., None], kv[torch.where(valid, indices, 0).long()], 0.0))
        valids.append(valid)
    k, valid = torch.cat(keys, 2), torch.cat(valids, 2)                           # [b, s, t, 512], [b, s, t]
    q64 = q.cpu().double()
    logits = torch.einsum("bshd,bstd->bsht", q64, k).mul(sm_scale).masked_fill(~valid[:, :, None, :], -math.inf)
    magnitude = (torch.einsum("bshd,bstd->bsht", q64.abs(), k.abs()) * sm_scale).amax(-1)
    lse = torch.logsumexp(logits, -1)
    empty = ~valid.any(-1)[:, :, None].expand_as(lse)
    lse_finite = torch.where(empty, 0.0, lse)
    p = torch.exp(logits - lse_finite[..., None])
    out, spread = torch.einsum("bsht,bstd->bshd", p, k), torch.einsum("bsht,bstd->bshd", p, k.abs())
    if attn_sink is not None:
        factor = 1.0 / (1.0 + torch.exp(attn_sink.cpu().double()[None, None, :] - lse_finite))[..., None]
        out, spread = out * factor, spread * factor
    lse = torch.where(empty, math.inf, lse)
    return out, lse.transpose(1, 2), empty.transpose(1, 2), magnitude.transpose(1, 2), spread


def decode(q, cache, indices, **kwargs):
    """Run sparse_mla_decode_fp8 into NaN-poisoned preallocated outputs."""
    b, s_q, h_q, _ = q.shape
    out = torch.full((b, s_q, h_q, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((b, h_q, s_q), math.nan, dtype=torch.float32, device=DEVICE)
    got = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, out=out, lse=lse, **kwargs)
    assert got[0] is out and got[1] is lse
    return out, lse


def random_q(b, s_q, h_q, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s_q, h_q, 512, generator=g) * 1.5).to(torch.bfloat16).to(DEVICE)


CASES = [  # b, s_q, h_q, (topk, pages, page), (extra_topk, pages, page) or None, num_splits, lengths
    # V4-Flash's CSA layer in small: a window over 256-entry pages, compressed entries over 64-entry
    # ones; row 0 has no entry in either list, row 1 more window entries than topk.
    (2, 1, 64, (128, 1, 256), (128, 3, 64), 1, ([0, 300], [0, 77])),
    # HCA: 2-entry pages and extra_topk_length; s_q 3; top-k widths off the 64-key blocks; 3 splits.
    (1, 3, 16, (40, 1, 64), (70, 40, 2), 3, (None, [50])),
    # No extra cache; a head count of no power of two; 2 splits.
    (2, 2, 24, (96, 2, 64), None, 2, ([60, -3], None)),
]


@pytest.mark.parametrize("b,s_q,h_q,main,extra,num_splits,lengths", CASES)
def test_matches_reference(b, s_q, h_q, main, extra, num_splits, lengths):
    seed = b * 1000 + h_q * 10 + main[0]
    sources, kwargs = [], {}
    for i, (spec, length) in enumerate(zip((main, extra), lengths)):
        if spec is None:
            continue
        topk, pages, page = spec
        entries = make_entries(pages, page, seed + i)
        indices = random_indices(b, s_q, topk, pages * page, seed + i)
        length = None if length is None else torch.tensor(length, dtype=torch.int32)
        cache = cache_of(entries, page, indices, length)
        sources.append((entries, indices, length))
        names = ("kv_cache", "indices", "topk_length") if i == 0 else \
            ("extra_kv_cache", "extra_indices", "extra_topk_length")
        kwargs.update(zip(names, (cache, indices.to(DEVICE), None if length is None else length.to(DEVICE))))
    attn_sink = torch.randn(h_q) * 2
    attn_sink[:3] = torch.tensor([-math.inf, math.inf, 30.0])
    q = random_q(b, s_q, h_q, seed)
    got = decode(q, kwargs.pop("kv_cache"), kwargs.pop("indices"), attn_sink=attn_sink.to(DEVICE),
                 num_splits=num_splits, **kwargs)
    ref = reference(q, sources, SM_SCALE, attn_sink)
    check(got, ref)
    assert (got[0].cpu()[:, :, 1] == 0).all(), "a sink of +inf gives out 0"


def test_every_code_and_scale_decodes_in_place():
    """A query row with one valid entry attends to it alone (p = 1), so out is that entry's dequantised
    vector, which bf16 holds exactly: bit-equal to dequantize_kv_model1. The entries cover every non-NaN
    e4m3 code in every tile and ue8m0 scales 2^-40..2^40 (beyond the writer's range both ways), from both
    caches, so every tile and the rope must land in their own columns."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)   # 254 codes
    n = 32
    g = torch.Generator().manual_seed(5)
    entries = torch.zeros(n, 584, dtype=torch.uint8)
    entries[:, :448] = codes[torch.stack([torch.randperm(448, generator=g) % len(codes) for _ in range(n)])]
    entries[:, 448:576] = torch.randn(n, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    entries[:, 576:583] = (torch.arange(n * 7).view(n, 7) % 81 - 40 + 127).to(torch.uint8)
    main, extra = entries[:n // 2], entries[n // 2:]
    caches = [model1_cache_from_entries(part.view(-1, 4, 584)).to(DEVICE) for part in (main, extra)]
    # Row t: entry t of the main cache for t < 16, else entry t - 16 of the extra one; the rest invalid.
    indices = torch.full((1, n, 8), -1, dtype=torch.int32)
    extra_indices = torch.full((1, n, 8), -1, dtype=torch.int32)
    indices[0, :n // 2, 5] = torch.arange(n // 2, dtype=torch.int32)
    extra_indices[0, n // 2:, 2] = torch.arange(n // 2, dtype=torch.int32)
    q = random_q(1, n, 16, 5) * 1e-3     # small logits: one key per row, any magnitude works
    out, lse = decode(q, caches[0], indices.to(DEVICE), extra_kv_cache=caches[1],
                      extra_indices=extra_indices.to(DEVICE))
    expected = dequantize_kv_model1(entries, torch.float32)
    assert torch.isfinite(expected).all() and expected.abs().max() > 1e10
    assert torch.equal(out.cpu()[0].float(), expected[:, None, :].expand(n, 16, 512))
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("h_q", [64, 16])
def test_sm90_launch_matches_portable_arguments(monkeypatch, num_splits, h_q):
    """The Gluon kernel cannot run on the CPU (no interpreter); its launch can: it passes exactly its
    kernel's parameters, and their runtime values are the portable MODEL1 kernel's (one argument list for
    both; at h_q 64 and 16 both take the same heads and 64 entries per step)."""
    decode_module = importlib.import_module("minirt.kernels.sparse_mla_decode")
    entries = make_entries(2, 64, 9)
    indices = random_indices(1, 2, 128, 128, 9)
    cache = cache_of(entries, 64, indices, None)
    extra = cache_of(make_entries(4, 2, 10), 2, indices % 8, None)
    record_launches(monkeypatch, decode_module, "_merge_splits_kernel")
    monkeypatch.setattr(decode_module, "longest_first", lambda lengths, topk: lengths)   # no launch recorded
    launches = []
    for use_sm90, module, name in ((False, decode_module, "_sparse_decode_model1_kernel"),
                                   (True, model1_sm90, "_sparse_decode_model1_kernel")):
        monkeypatch.setattr(decode_module, "uses_sm90_kernel", lambda *args, **kwargs: use_sm90)
        recorded = record_launches(monkeypatch, module, name)
        sparse_mla_decode_fp8(random_q(1, 2, h_q, 9), cache, indices.to(DEVICE), SM_SCALE,
                              attn_sink=torch.zeros(h_q, device=DEVICE),
                              topk_length=torch.tensor([100], dtype=torch.int32, device=DEVICE),
                              extra_kv_cache=extra, extra_indices=(indices % 8).to(DEVICE), num_splits=num_splits)
        (arguments,) = recorded
        assert arguments["SPLIT"] == (num_splits > 1)
        launches.append(arguments)
    portable, gluon = ({n: v for n, v in a.items() if not n.isupper()} for a in launches)   # runtime parameters
    assert list(portable) == list(gluon)

    def described(v):
        return (v.dtype, v.shape, v.stride()) if isinstance(v, torch.Tensor) else v
    assert [described(v) for v in portable.values()] == [described(v) for v in gluon.values()]
