"""norm_rope (RMS norm, then rope on the last dims, one launch) against the eager reference's fp64
rmsnorm / unweighted_rmsnorm / rope_tail, on fresh random rows, tables read by position."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels.norm_rope import norm_rope
from minirt.models.deepseek_v4.reference import rope_tail
from minirt.report import rel_err


def reference(x, eps, weight, cos, sin, positions, inverse):
    y = x.double()
    if eps is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.double()
    if cos is None:
        return y
    c, s = cos[positions].double(), sin[positions].double()
    return rope_tail(y, c, -s if inverse else s)


CASES = [  # (dtype in, dtype out, heads, D, norm, weight, rope, inverse)
    (torch.bfloat16, torch.float32, 6, 512, True, False, True, False),   # V4's q: per head, unweighted
    (torch.bfloat16, torch.bfloat16, None, 512, True, True, True, False),  # kv: weighted, bf16 out
    (torch.float32, torch.float32, None, 128, True, True, True, False),    # a compressed index key
    (torch.float32, torch.bfloat16, None, 384, True, True, False, False),  # a plain norm (no rope)
    (torch.bfloat16, torch.bfloat16, 3, 512, False, False, True, True),    # the output's inverse rope
]


@pytest.mark.parametrize("dtype, out_dtype, heads, d, norm, weighted, roped, inverse", CASES)
def test_norm_rope_matches_the_reference(dtype, out_dtype, heads, d, norm, weighted, roped, inverse):
    gen = torch.Generator().manual_seed(d + (heads or 0))
    T, P = 5, 40
    shape = (T, heads, d + 64) if heads else (T, d + 64)
    wide = torch.randn(shape, generator=gen) * torch.logspace(-2, 2, T).view(T, *([1] * (len(shape) - 1)))
    x = wide.to(DEVICE, dtype)[..., 64:]  # strided rows, as a fused projection's column slice
    weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEVICE) if weighted else None
    angles = torch.rand(P, 32, generator=gen) * 6.3
    cos, sin = (angles.cos().to(DEVICE), angles.sin().to(DEVICE)) if roped else (None, None)
    positions = torch.randperm(P, generator=gen)[:T].to(DEVICE) if roped else None
    out = torch.full(x.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    got = norm_rope(x, eps=1e-6 if norm else None, weight=weight, cos=cos, sin=sin, positions=positions,
                    inverse=inverse, out=out)
    assert got is out and torch.isfinite(out).all()
    expected = reference(x, 1e-6 if norm else None, weight, cos, sin, positions, inverse)
    tol = 2**-8 if out_dtype == torch.bfloat16 else 1e-6
    for t in range(T):  # each token to its dtype's rounding, whatever its scale
        assert rel_err(out[t], expected[t]) < tol


def test_norm_rope_in_place_writes_only_the_rotated_dims():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 2, 512, generator=gen).to(DEVICE, torch.bfloat16)
    angles = torch.rand(10, 32, generator=gen) * 6.3
    cos, sin, positions = angles.cos().to(DEVICE), angles.sin().to(DEVICE), torch.tensor([9, 0, 3, 3], device=DEVICE)
    before = x.clone()
    assert norm_rope(x, cos=cos, sin=sin, positions=positions, inverse=True, out=x) is x
    assert torch.equal(x[..., :448], before[..., :448])
    expected = reference(before, None, None, cos, sin, positions, True)
    assert rel_err(x, expected) < 2**-8


def test_norm_rope_refuses_bad_input():
    x = torch.randn(3, 128, device=DEVICE)
    table = torch.ones(4, 32, device=DEVICE)
    with pytest.raises(InputError, match="weight must be a float tensor"):
        norm_rope(x, weight=torch.ones(128, device=DEVICE))  # a weight without eps
    with pytest.raises(InputError, match="together"):
        norm_rope(x, cos=table, sin=table)
    with pytest.raises(InputError, match="positions must be"):
        norm_rope(x, cos=table, sin=table, positions=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(InputError, match="unit stride"):
        norm_rope(x.t(), eps=1e-6)


@pytest.mark.parametrize("norm, roped", [(True, False), (True, True), (False, True)])
def test_norm_rope_rounds_to_bf16_in_fp32(norm, roped):
    """round_to_bf16 with an fp32 result: the fp32 result rounded to nearest bf16 (torch's cast), every element
    written; interpreted too (whose own fp32 -> bf16 casts truncate)."""
    gen = torch.Generator().manual_seed(11 + norm + 2 * roped)
    x = (torch.randn(3, 2, 256, generator=gen) * 7).to(DEVICE)
    weight = (1 + 0.5 * torch.randn(256, generator=gen)).to(DEVICE) if norm else None
    angles = torch.rand(8, 32, generator=gen) * 6.3
    rope = dict(cos=angles.cos().to(DEVICE), sin=angles.sin().to(DEVICE),
                positions=torch.tensor([5, 0, 7], device=DEVICE)) if roped else {}
    eps = 1e-6 if norm else None
    out = torch.full(x.shape, float("nan"), device=DEVICE)
    norm_rope(x, eps=eps, weight=weight, out=out, round_to_bf16=True, **rope)
    fp32 = norm_rope(x, eps=eps, weight=weight, **rope)
    assert torch.equal(out, fp32.bfloat16().float()) and not torch.equal(out, fp32)
