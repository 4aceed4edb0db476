"""rms_norm and add_rms_norm (one launch per call) against an fp64 torch RMSNorm, on fresh random rows of varying
scale (rms_norm into other dtypes and rounded to bf16 too); their fp8 outputs against quantize_act_fp8."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import add_rms_norm, quantize_act_fp8, rms_norm
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
    weight = torch.ones(128, device=DEVICE)
    with pytest.raises(InputError, match=r"out must be a \[3, 128\] bfloat16, float16 or float32"):
        rms_norm(x, weight, 1e-6, out=torch.empty(3, 128, dtype=torch.float64, device=DEVICE))
    with pytest.raises(InputError, match="out must be"):
        rms_norm(x, weight, 1e-6, out=torch.empty(3, 64, device=DEVICE))
    with pytest.raises(InputError, match="out must be"):
        rms_norm(x, weight, 1e-6, out=torch.empty(128, 3, device=DEVICE).t())
    with pytest.raises(InputError, match="out_dtype must be"):
        rms_norm(x, weight, 1e-6, out_dtype=torch.int32)
    with pytest.raises(InputError, match="out_dtype must be"):
        rms_norm(x, weight, 1e-6, out_dtype=torch.float64, round_to_bf16=True)


def test_rms_norm_op_schema_and_fake():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    torch.library.opcheck(torch.ops.minirt.rms_norm, (x, torch.ones(256, device=DEVICE), 1e-6))


def _poisoned_fp8_out(m: int, n: int):
    """fp8_out buffers full of NaN (0x7F is e4m3fn's NaN): a value the kernel does not write stays NaN."""
    codes = torch.full((m, n), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    return codes, torch.full((m, n // 128), float("nan"), device=DEVICE)


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 1536), (torch.float32, 384), (torch.bfloat16, 7168)])
def test_rms_norm_fp8_out_is_quantize_act_fp8s(dtype, n):
    """fp8_out: the stored result's quantize_act_fp8, bit for bit (N not a power of two too), all written."""
    gen = torch.Generator().manual_seed(n + 1)
    wide = torch.randn(3, n + 128, generator=gen) * torch.logspace(-2, 2, 3)[:, None]
    x = wide.to(DEVICE, dtype)[:, 128:]
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE)
    codes, scales = _poisoned_fp8_out(3, n)
    y = rms_norm(x, weight, 1e-6, fp8_out=(codes, scales))
    assert torch.equal(y, rms_norm(x, weight, 1e-6))
    want_codes, want_scales = quantize_act_fp8(y)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("dtype, out_dtype, rounded, n", [
    (torch.float32, torch.float32, True, 512),    # V4's sub-layer input norms: bf16 values held in fp32
    (torch.bfloat16, torch.float32, False, 384),  # V4's q_a norm: a bf16 GEMM output normed into fp32
    (torch.float32, torch.bfloat16, True, 256),   # V4's final norm: bf16 out, rounded to nearest
    (torch.float32, torch.float32, False, 1536),
])
def test_rms_norm_out_dtype_and_fp8_out(dtype, out_dtype, rounded, n):
    """out of another dtype than x (given, or by out_dtype), with or without round_to_bf16: every element
    written, the fp64 norm to the stored dtype's rounding, fp8_out the stored result's quantize_act_fp8 bit
    for bit (the rounded values with round_to_bf16)."""
    gen = torch.Generator().manual_seed(n + 3 * rounded)
    T = 5
    wide = torch.randn(T, n + 128, generator=gen) * torch.logspace(-3, 3, T)[:, None]  # rows of every scale
    x = wide.to(DEVICE, dtype)[:, 128:]
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE)
    out = torch.full((T, n), float("nan"), dtype=out_dtype, device=DEVICE)
    codes, scales = _poisoned_fp8_out(T, n)
    assert rms_norm(x, weight, 1e-6, out=out, round_to_bf16=rounded, fp8_out=(codes, scales)) is out
    assert torch.isfinite(out).all()
    expected = reference(x, weight, 1e-6)
    tol = 2**-8 if out_dtype == torch.bfloat16 or rounded else 1e-6
    for row in range(T):  # each row to its stored rounding, whatever its scale
        assert rel_err(out[row], expected[row]) < tol
    if rounded:
        assert torch.equal(out, out.bfloat16().to(out_dtype))
    want_codes, want_scales = quantize_act_fp8(out)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    # out_dtype: the same values in a new tensor, with and without fp8_out (and again: the kept signature).
    # Without fp8_out another compiled variant runs: on a GPU its fp32 values may differ in the last bits
    # (a near-tie then rounds to the other bf16 neighbour).
    for _ in range(2):
        y = rms_norm(x, weight, 1e-6, out_dtype=out_dtype, round_to_bf16=rounded)
        assert y.dtype == out_dtype and rel_err(y, out) < (1e-3 if tol > 1e-6 else 1e-6)
        codes2, scales2 = _poisoned_fp8_out(T, n)
        assert torch.equal(rms_norm(x, weight, 1e-6, out_dtype=out_dtype, round_to_bf16=rounded,
                                    fp8_out=(codes2, scales2)), out)
        assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scales2, scales)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rounds_to_bf16(out_dtype):
    """round_to_bf16: the fp32 result rounded to nearest bf16 as torch's cast rounds it (ties to even), then
    stored in out's dtype; interpreted too (whose own fp32 -> bf16 casts truncate)."""
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(4, 768, generator=gen) * 7).to(DEVICE)
    weight = (1 + 0.5 * torch.randn(768, generator=gen)).to(DEVICE)
    fp32 = rms_norm(x, weight, 1e-6)
    out = torch.full(x.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    rms_norm(x, weight, 1e-6, out=out, round_to_bf16=True)
    assert torch.equal(out, fp32.bfloat16().to(out_dtype))
    if out_dtype == torch.float32:
        assert not torch.equal(out, fp32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    """h bit for bit torch's x + delta (rounded to nearest, interpreted too), y the norm of h (fp64), the fp8
    pair quantize_act_fp8's of y; x and delta with row strides wider than their rows."""
    n = 7168
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(4, n + 64, generator=gen) * 3).to(DEVICE, dtype)[:, 64:]
    delta = torch.randn(4, n + 128, generator=gen).to(DEVICE, dtype)[:, :n]
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE)
    codes, scales = _poisoned_fp8_out(4, n)
    h, y = add_rms_norm(x, delta, weight, 1e-6, fp8_out=(codes, scales))
    assert h.dtype == y.dtype == dtype
    assert torch.equal(h, x + delta)
    for row in range(4):  # (compiled, the fp32 sum of squares may round differently from rms_norm's launch)
        assert rel_err(y[row], reference(h, weight, 1e-6)[row]) < (2**-8 if dtype == torch.bfloat16 else 1e-6)
    want_codes, want_scales = quantize_act_fp8(y)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    h2, y2 = add_rms_norm(x, delta, weight, 1e-6)  # without fp8_out: another compiled kernel, the same sums
    assert torch.equal(h2, h) and rel_err(y2, y) < (2**-8 if dtype == torch.bfloat16 else 1e-6)


def test_add_rms_norm_refuses_bad_input():
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.ones(256, device=DEVICE)
    with pytest.raises(InputError, match=r"delta must be a torch.bfloat16 tensor \[3, 256\]"):
        add_rms_norm(x, x.float(), weight, 1e-6)
    with pytest.raises(InputError, match="delta must be"):
        add_rms_norm(x, x[:2], weight, 1e-6)
    codes, scales = _poisoned_fp8_out(3, 256)
    with pytest.raises(InputError, match="fp8_out must be"):
        add_rms_norm(x, x, weight, 1e-6, fp8_out=(codes[:2], scales))
    with pytest.raises(InputError, match="fp8_out must be"):
        rms_norm(x[:, :200], weight[:200], 1e-6, fp8_out=(codes[:, :200], scales))


def test_add_rms_norm_ops_schema_and_fake():
    gen = torch.Generator().manual_seed(5)
    x, delta = (torch.randn(3, 256, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.ones(256, device=DEVICE)
    torch.library.opcheck(torch.ops.minirt.rms_norm_fp8, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.minirt.add_rms_norm, (x, delta, weight, 1e-6))
    torch.library.opcheck(torch.ops.minirt.add_rms_norm_fp8, (x, delta, weight, 1e-6))
