"""The fused mHC kernels (kernels/mhc.py) against the fp32 torch reference of DeepSeek-V4's eager model."""
import pytest
import torch

from minirt.errors import InputError
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


def test_bad_inputs_name_the_tensor():
    X = torch.zeros(2, 4, 128, device=DEVICE)
    with pytest.raises(InputError, match="fn must be"):
        hc_pre(X, torch.zeros(24, 100, device=DEVICE), torch.zeros(24, device=DEVICE), torch.zeros(3, device=DEVICE),
               eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    with pytest.raises(InputError, match="comb must be"):
        hc_post(torch.zeros(2, 128, device=DEVICE), X, torch.zeros(2, 4, device=DEVICE),
                torch.zeros(2, 4, 4, dtype=torch.float64, device=DEVICE))
