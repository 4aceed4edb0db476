"""The fused mHC kernels (kernels/mhc.py) against the fp32 torch reference of DeepSeek-V4's eager model."""
import pytest
import torch

from minirt.errors import InputError
from minirt.kernels import mhc
from minirt.kernels.mhc import hc_post, hc_pre
from minirt.models.deepseek_v4 import reference
from minirt.synthetic import preset_config

from conftest import DEVICE


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("N, D", [(5, 256), (3, 320)])  # 320: a D that is not a multiple of the block
def test_hc_pre_and_post_match_the_reference(N, D):
    cfg = preset_config("v4-tiny")
    gen = torch.Generator().manual_seed(N * D)
    hc = cfg.hc_mult
    X = torch.randn(N, hc, D, generator=gen).to(DEVICE)
    fn = (torch.randn(cfg.hc_dim, hc * D, generator=gen) * 0.05).to(DEVICE)
    base, scale = torch.randn(cfg.hc_dim, generator=gen).to(DEVICE), torch.rand(3, generator=gen).to(DEVICE) + 0.5
    collapsed, post, comb = hc_pre(X, fn, base, scale, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                                   sinkhorn_iters=cfg.hc_sinkhorn_iters)
    expect = reference.hc_pre(X, fn, base, scale, cfg)
    for got, want in zip((collapsed, post, comb), expect):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-5
    assert (comb.sum(-2) - 1).abs().max() < 1e-3  # Sinkhorn ends on columns: doubly stochastic columns
    F = torch.randn(N, D, generator=gen).to(DEVICE)
    out = hc_post(F, X, post, comb)
    assert rel(out, reference.hc_post(F, X, post, comb)) < 1e-6


def mhc_inputs(N, D, seed):
    cfg = preset_config("v4-tiny")
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(N, cfg.hc_mult, D, generator=gen).to(DEVICE)
    fn = (torch.randn(cfg.hc_dim, cfg.hc_mult * D, generator=gen) * 0.05).to(DEVICE)
    base, scale = torch.randn(cfg.hc_dim, generator=gen).to(DEVICE), torch.rand(3, generator=gen).to(DEVICE) + 0.5
    return cfg, X, fn, base, scale, torch.randn(N, D, generator=gen).to(DEVICE)


# (rows a program, columns a step, tl.dot, column splits): one row and blocks of rows, broadcast products and
# tl.dot, unsplit, split, and more splits than 256-column steps (the last ones past the columns add zeros).
@pytest.mark.parametrize("rows, block, dot, splits", [(1, 256, False, 1), (1, 256, False, 4), (4, 128, False, 8),
                                                      (16, 32, True, 2), (16, 64, True, 1), (1, 256, False, 8)])
def test_hc_pre_launch_shapes_match_the_reference(rows, block, dot, splits):
    N, D = 20, 320   # a last partial block of rows; columns not a multiple of the step
    cfg, X, fn, base, scale, _ = mhc_inputs(N, D, rows * splits)
    out = [torch.full((N, D), float("nan"), device=DEVICE), torch.full((N, 4), float("nan"), device=DEVICE),
           torch.full((N, 4, 4), float("nan"), device=DEVICE)]
    mhc._launch_hc_pre(X, fn, base, scale, *out, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, rows, block,
                       dot, splits)
    for got, want in zip(out, reference.hc_pre(X, fn, base, scale, cfg)):
        assert torch.isfinite(got).all() and rel(got, want) < 1e-5


@pytest.mark.parametrize("splits", [1, 2, 16])
def test_hc_pre_splits_argument(splits):
    cfg, X, fn, base, scale, _ = mhc_inputs(3, 256, splits)
    got = hc_pre(X, fn, base, scale, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                 splits=splits)
    for g, want in zip(got, reference.hc_pre(X, fn, base, scale, cfg)):
        assert torch.isfinite(g).all() and rel(g, want) < 1e-5


@pytest.mark.parametrize("d_slice", [256, 512])   # D 320: two slices (the last partial), or one
def test_hc_post_d_slices_match_the_reference(d_slice):
    cfg, X, fn, base, scale, F = mhc_inputs(3, 320, d_slice)
    _, post, comb = reference.hc_pre(X, fn, base, scale, cfg)
    out = torch.full_like(X, float("nan"))
    mhc._launch_hc_post(F, X, post, comb, out, 1, d_slice)
    assert torch.isfinite(out).all() and rel(out, reference.hc_post(F, X, post, comb)) < 1e-6


def test_bad_inputs_name_the_tensor():
    X = torch.zeros(2, 4, 128, device=DEVICE)
    with pytest.raises(InputError, match="fn must be"):
        hc_pre(X, torch.zeros(24, 100, device=DEVICE), torch.zeros(24, device=DEVICE), torch.zeros(3, device=DEVICE),
               eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    with pytest.raises(InputError, match="comb must be"):
        hc_post(torch.zeros(2, 128, device=DEVICE), X, torch.zeros(2, 4, device=DEVICE),
                torch.zeros(2, 4, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(InputError, match="splits must be"):
        hc_pre(X, torch.zeros(24, 512, device=DEVICE), torch.zeros(24, device=DEVICE), torch.zeros(3, device=DEVICE),
               eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, splits=3)


@pytest.mark.parametrize("N, D", [(1, 256), (5, 320)])
def test_hc_head_matches_the_reference(N, D):
    cfg = preset_config("v4-tiny")
    gen = torch.Generator().manual_seed(N + D)
    hc = cfg.hc_mult
    X = torch.randn(N, hc, D, generator=gen).to(DEVICE)
    fn = (torch.randn(hc, hc * D, generator=gen) * 0.05).to(DEVICE)
    base, scale = torch.randn(hc, generator=gen).to(DEVICE), torch.rand(1, generator=gen).to(DEVICE) + 0.5
    got = mhc.hc_head(X, fn, base, scale, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    assert torch.isfinite(got).all() and rel(got, reference.hc_head(X, fn, base, scale, cfg)) < 1e-5


