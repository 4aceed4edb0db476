"""Interpreted, the row-wise kernels take a block of rows per program (``minirt.kernels._common.rows_per_program``:
the interpreter's time goes by programs and ops, not by elements); compiled, one row per program. Every
row is computed on its own, so any block gives the bits of one row per program (the GPU's launch shape),
with several programs, a last partial block and masked rows. Outputs start as NaN / 0x7F (poisoned)."""
import sys

import pytest
import torch

from conftest import DEVICE
from minirt.kernels import _common, moe_experts
from minirt.kernels.fp8_gemm import quantize_act_fp8
from minirt.kernels.kv_cache_model1 import new_model1_cache, write_kv_model1
from minirt.kernels.mhc import hc_post, hc_pre
from test_moe_kernels import generator, make_experts, poisoned  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not _common.INTERPRET, reason="compiled kernels always take one row per program")


def each_block(monkeypatch, row_elements: int, run):
    """run() with one row per program, two (several programs, the last partial) and the default block."""
    results = []
    for elements in (1, 2 * row_elements, _common.INTERPRETED_BLOCK_ELEMENTS):
        monkeypatch.setattr(_common, "INTERPRETED_BLOCK_ELEMENTS", elements)
        results.append([t.view(torch.uint8) if t.element_size() == 1 else t for t in run()])
    one_row = results[0]
    assert all(torch.isfinite(t).all() for t in one_row if t.is_floating_point())
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, one_row))


def test_quantize_act(poisoned, monkeypatch):
    x = torch.randn(5, 1024, generator=generator(1), device=DEVICE).to(torch.bfloat16)

    def quantize():   # (from a fresh plan: the rows per program are kept per call signature)
        monkeypatch.setattr(sys.modules[quantize_act_fp8.__module__], "_QUANTISATIONS", {})
        return quantize_act_fp8(x)
    each_block(monkeypatch, 8 * 128, quantize)


def test_mhc(poisoned, monkeypatch):
    gen = generator(2)
    X = torch.randn(5, 4, 256, generator=gen, device=DEVICE)
    fn = torch.randn(24, 1024, generator=gen, device=DEVICE) * 0.05
    base, scale = torch.randn(24, generator=gen, device=DEVICE), torch.rand(3, generator=gen, device=DEVICE) + 0.5
    pre = dict(eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    each_block(monkeypatch, 24 * 256, lambda: hc_pre(X, fn, base, scale, **pre))
    F = torch.randn(5, 256, generator=gen, device=DEVICE)
    _, post, comb = hc_pre(X, fn, base, scale, **pre)
    each_block(monkeypatch, 4 * 256, lambda: [hc_post(F, X, post, comb)])


def test_write_kv_model1(monkeypatch):
    kv = torch.randn(5, 512, generator=generator(3), device=DEVICE).to(torch.bfloat16)
    slots = torch.tensor([7, -1, 0, 12, 3], device=DEVICE)   # -1: skipped

    def write():
        cache = new_model1_cache(2, 8, device=DEVICE)
        cache.view(torch.uint8).fill_(0x7F)
        write_kv_model1(cache, kv, slots)
        return [cache]

    each_block(monkeypatch, 512, write)


def test_moe_gather_and_combine(poisoned, monkeypatch):
    gen = generator(4)
    experts, _ = make_experts("fp8", gen, 4, 256, 128)
    x = torch.randn(5, 256, generator=gen, device=DEVICE).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, -1], [1, 0], [3, 3], [0, 1]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(5, 2, generator=gen, device=DEVICE)
    each_block(monkeypatch, 8 * 128, lambda: [moe_experts(x, ids, weights, experts)])
