"""rms_norm (one launch per call) against an fp64 torch RMSNorm, on fresh random rows of varying scale."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import rms_norm
from minirt.report import rel_err


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 1536), (torch.float32, 576)])
def test_rms_norm_matches_fp64_on_a_column_slice(dtype, n):
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn(5, n + 192, generator=gen) * torch.logspace(-3, 3, 5)[:, None]  # rows of every scale
    x = wide.to(DEVICE, dtype)[:, 64 : 64 + n]  # a row stride wider than the row, as a fused projection's part
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    out = torch.full((5, n), float("nan"), dtype=dtype, device=DEVICE)
    assert rms_norm(x, weight, 1e-6, out=out) is out
    assert torch.isfinite(out).all()
    expected = reference(x, weight, 1e-6)
    for row in range(5):  # each row to its dtype's rounding, whatever its scale
        assert rel_err(out[row], expected[row]) < (2**-8 if dtype == torch.bfloat16 else 1e-6)


def test_rms_norm_of_zeros_is_zero_and_eps_counts():
    x = torch.zeros(2, 256, device=DEVICE)
    assert torch.equal(rms_norm(x, torch.ones(256, device=DEVICE), 1e-6), x)
    x = torch.full((1, 256), 1e-3, device=DEVICE)
    # mean square 1e-6 plus eps 1e-6: the result is 1 / sqrt(2), not 1.
    torch.testing.assert_close(rms_norm(x, torch.ones(256, device=DEVICE), 1e-6),
                               torch.full((1, 256), 2**-0.5, device=DEVICE))


def test_rms_norm_refuses_bad_input():
    x = torch.randn(3, 128, device=DEVICE)
    with pytest.raises(InputError, match=r"weight must be a float tensor \[128\]"):
        rms_norm(x, torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(InputError, match="unit stride along N"):
        rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)
    with pytest.raises(InputError, match="2-D"):
        rms_norm(x[0], torch.ones(128, device=DEVICE), 1e-6)


def test_rms_norm_op_schema_and_fake():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    torch.library.opcheck(torch.ops.minirt.rms_norm, (x, torch.ones(256, device=DEVICE), 1e-6))
