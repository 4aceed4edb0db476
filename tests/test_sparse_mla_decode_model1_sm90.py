"""What the MODEL1 Gluon decode kernel (sparse_mla_decode_model1_sm90) adds to test_sparse_mla_decode_model1:
every tile of both caches lands in its own columns, bit-exactly, and its launch takes the portable
kernel's arguments. On an sm_90 GPU the decode test runs through the Gluon kernel (the pick, and its
64-head variant at every h_q) and through the portable kernel; on the CPU through the portable kernel
(the interpreter), which the launch test compares the Gluon launch with.
"""
import importlib

import pytest
import torch

from conftest import DEVICE
from minirt.kernels import sparse_mla_decode_model1_sm90 as model1_sm90
from minirt.kernels.kv_cache_model1 import dequantize_kv_model1, model1_cache_from_entries, quantize_kv_model1
from minirt.kernels.sparse_mla_decode import sparse_mla_decode_fp8
from test_sparse_mla_decode import decode, kernel_path, random_indices  # noqa: F401 (a fixture)
from test_sparse_mla_decode_model1 import random_q
from test_sparse_mla_prefill import record_launches

pytestmark = pytest.mark.usefixtures("kernel_path")
SM_SCALE = 512 ** -0.5 * 1.2


def cache_of(entries, block_size):
    """A MODEL1 cache holding entries [num_slots, 584] in pages of block_size."""
    return model1_cache_from_entries(entries.view(-1, block_size, 584)).to(DEVICE)


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
    caches = [cache_of(part, 4) for part in (main, extra)]
    # Row t: entry t of the main cache for t < 16, else entry t - 16 of the extra one; the rest invalid.
    indices = torch.full((1, n, 8), -1, dtype=torch.int32)
    extra_indices = torch.full((1, n, 8), -1, dtype=torch.int32)
    indices[0, :n // 2, 5] = torch.arange(n // 2, dtype=torch.int32)
    extra_indices[0, n // 2:, 2] = torch.arange(n // 2, dtype=torch.int32)
    q = random_q(1, n, 16, 5) * 1e-3     # small logits: one key per row, any magnitude works
    out, lse = decode(q, caches[0], indices.to(DEVICE), SM_SCALE, extra_kv_cache=caches[1],
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
    g = torch.Generator().manual_seed(9)
    cache, extra = (cache_of(quantize_kv_model1(torch.randn(n, 512, generator=g).to(torch.bfloat16)), page)
                    for n, page in ((128, 64), (8, 2)))
    indices = random_indices(1, 2, 128, 128, 9)
    record_launches(monkeypatch, decode_module, "_merge_splits_kernel")
    monkeypatch.setattr(decode_module, "longest_first", lambda topk_length, *widths: topk_length)   # no launch recorded
    launches = []
    for use_sm90, module, name in ((False, decode_module, "_sparse_decode_model1_kernel"),
                                   (True, model1_sm90, "_sparse_decode_model1_kernel")):
        monkeypatch.setattr(decode_module, "uses_sm90_kernel", lambda *args, **kwargs: use_sm90)
        monkeypatch.setattr(decode_module, "_PLANS", {})   # (the kernel is chosen once per call signature)
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


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernel is sm_90 only")
def test_sm90_kernel_taken_on_hopper(kernel_path, monkeypatch):
    """On sm_90 the default MODEL1 call runs the Gluon kernel (the portable path: not)."""
    launched = []

    class Spy:   # stands in for the Gluon kernel object: records the launch, then runs it
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    kernel = model1_sm90._sparse_decode_model1_kernel
    monkeypatch.setattr(model1_sm90, "_sparse_decode_model1_kernel", Spy())
    g = torch.Generator().manual_seed(11)
    cache = cache_of(quantize_kv_model1(torch.randn(128, 512, generator=g).to(torch.bfloat16)), 64)
    indices = random_indices(2, 1, 64, 128, 11).to(DEVICE)
    out, lse = decode(random_q(2, 1, 16, 11), cache, indices, SM_SCALE)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert len(launched) == (0 if kernel_path == "portable" else 1)
