"""apply_rope (one launch) against the eager reference's rope functions in fp64, both pair layouts."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import apply_rope
from minirt.rope import apply_rope_half, apply_rope_interleaved
from minirt.report import rel_err


def angles(t: int, pairs: int, gen):
    theta = torch.rand(t, pairs, generator=gen, dtype=torch.float64) * 6.3
    return theta.cos(), theta.sin()


@pytest.mark.parametrize("interleaved, heads, dtype", [(True, 5, torch.bfloat16), (False, 3, torch.float32)])
def test_rope_matches_the_reference_on_a_slice(interleaved, heads, dtype):
    gen = torch.Generator().manual_seed(heads)
    t, rope, dim = 4, 64, 128 if not interleaved else 64
    wide = torch.randn(t, heads, dim + 64, generator=gen)
    x = wide.to(DEVICE, dtype)[..., 32 : 32 + dim]  # token and head strides wider than the dims
    cos, sin = angles(t, rope // 2, gen)
    out = apply_rope(x, cos.float().to(DEVICE), sin.float().to(DEVICE), rope, interleaved, torch.float32)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    rotate = apply_rope_interleaved if interleaved else apply_rope_half
    xd = x.double().cpu()
    expected = torch.cat([rotate(xd[..., :rope], cos[:, None], sin[:, None]), xd[..., rope:]], dim=-1)
    assert rel_err(out, expected) < 1e-6
    assert torch.equal(out[..., rope:].cpu(), xd[..., rope:].float())  # the rest is copied as it is
    # Into x's dtype on a 2-D [T, D] input.
    flat = apply_rope(x[:, 0], cos.float().to(DEVICE), sin.float().to(DEVICE), rope, interleaved)
    assert flat.dtype == dtype and rel_err(flat, expected[:, 0]) < (2**-8 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("heads, dim", [(1, 128), (3, 96)])
def test_rope_after_a_layer_norm_matches_the_reference(heads, dim):
    """layer_norm: each head's row layer-normed (weight, bias) in fp32, then the half-split rope: the V3.2
    indexer's keys (F.layer_norm and apply_rope_half in fp64); rows of very different scales, means 3 std."""
    gen = torch.Generator().manual_seed(dim)
    t, rope = 5, 64
    wide = (torch.randn(t, heads, dim + 32, generator=gen) + 3.0) * torch.logspace(-2, 2, t)[:, None, None]
    x = wide.to(DEVICE, torch.bfloat16)[..., 32:]
    weight, bias = (1 + 0.5 * torch.randn(dim, generator=gen)), 0.3 * torch.randn(dim, generator=gen)
    cos, sin = angles(t, rope // 2, gen)
    out = apply_rope(x, cos.float().to(DEVICE), sin.float().to(DEVICE), rope, False, torch.float32,
                     layer_norm=(weight.to(DEVICE), bias.to(DEVICE), 1e-6))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    normed = F.layer_norm(x.double().cpu(), (dim,), weight.double(), bias.double(), 1e-6)
    expected = torch.cat([apply_rope_half(normed[..., :rope], cos[:, None], sin[:, None]), normed[..., rope:]], dim=-1)
    for row in range(t):
        assert rel_err(out[row], expected[row]) < 1e-6
    with pytest.raises(InputError, match=r"layer_norm must be \(weight \[%d\]" % dim):
        apply_rope(x, cos.float().to(DEVICE), sin.float().to(DEVICE), rope, False, layer_norm=(weight[:4], bias, 1e-6))


def test_rope_scatters_rows_into_a_cache():
    """scatter: each token's result (layer norm, rope) written to its row of out, equal to the unscattered
    result; rows -1 and past out skipped, every other row of out untouched (NaN poison kept)."""
    gen = torch.Generator().manual_seed(3)
    t, dim, rope = 6, 128, 64
    x = torch.randn(t, dim + 16, generator=gen).to(DEVICE, torch.bfloat16)[:, 16:]
    weight, bias = (1 + 0.5 * torch.randn(dim, generator=gen)).to(DEVICE), torch.randn(dim, generator=gen).to(DEVICE)
    cos, sin = (v.float().to(DEVICE) for v in angles(t, rope // 2, gen))
    cache = torch.full((4, 5, dim), float("nan"), device=DEVICE)
    rows = torch.tensor([7, -1, 0, 19, 20, 12], device=DEVICE)
    out = apply_rope(x, cos, sin, rope, False, layer_norm=(weight, bias, 1e-6), scatter=(cache.view(-1, dim), rows))
    assert out.data_ptr() == cache.data_ptr()
    whole = apply_rope(x, cos, sin, rope, False, torch.float32, layer_norm=(weight, bias, 1e-6))
    flat = cache.view(-1, dim).cpu()
    kept = [0, 2, 3, 5]
    assert torch.equal(flat[rows.cpu()[kept]], whole.cpu()[kept])
    others = torch.ones(20, dtype=torch.bool)
    others[rows.cpu()[kept]] = False
    assert flat[others].isnan().all()
    with pytest.raises(InputError, match="scatter must be"):
        apply_rope(x, cos, sin, rope, False, scatter=(cache.view(-1, dim), rows[:3]))
    with pytest.raises(InputError, match="scatter must be"):
        apply_rope(x[:, None], cos, sin, rope, False, scatter=(cache.view(-1, dim), rows))
    torch.library.opcheck(torch.ops.minirt.apply_rope_scatter, (x, cos, sin, rope, False, cache.view(-1, dim), rows,
                                                                 weight, bias, 1e-6))


@pytest.mark.parametrize("heads", [1, 5])
def test_rope_then_rotation_and_fp8_out(heads):
    """rotation: each row's rope (after its layer norm) times the Hadamard matrix, against the unrotated
    kernel's rows times it in fp64; fp8_out: the stored rows' quantize_act_fp8, bit for bit, every element
    written (NaN poison); the V3.2 fp8 indexer's queries (heads) and keys (one row a token)."""
    from minirt.formats import FP8_DTYPE
    from minirt.kernels import quantize_act_fp8
    from minirt.models.deepseek_v32.layers import hadamard_matrix
    gen = torch.Generator().manual_seed(heads)
    t, dim, rope = 3, 128, 64
    x = (torch.randn(t, heads, dim, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    x = x[:, 0] if heads == 1 else x
    cos, sin = (v.float().to(DEVICE) for v in angles(t, rope // 2, gen))
    weight, bias = (1 + 0.5 * torch.randn(dim, generator=gen)).to(DEVICE), torch.randn(dim, generator=gen).to(DEVICE)
    norm = dict(layer_norm=(weight, bias, 1e-6)) if heads == 1 else {}
    hadamard = hadamard_matrix(dim, torch.device(DEVICE))
    codes = torch.full(x.shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    scales = torch.full((*x.shape[:-1], 1), float("nan"), device=DEVICE)
    out = apply_rope(x, cos, sin, rope, False, torch.float32, rotation=hadamard, fp8_out=(codes, scales), **norm)
    plain = apply_rope(x, cos, sin, rope, False, torch.float32, **norm)
    expected = plain.double().cpu() @ hadamard.double().cpu()
    assert out.dtype == torch.float32 and rel_err(out, expected) < 1e-6
    want_codes, want_scales = quantize_act_fp8(out.reshape(-1, dim))
    assert torch.equal(codes.view(torch.uint8).reshape(-1, dim), want_codes.view(torch.uint8))
    assert torch.equal(scales.reshape(-1, 1), want_scales)
    torch.library.opcheck(torch.ops.minirt.apply_rope_fp8, (x, cos, sin, rope, False, hadamard),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(InputError, match="rotation must be"):
        apply_rope(x, cos, sin, rope, False, rotation=hadamard[:64, :64])
    with pytest.raises(InputError, match="fp8_out must be"):
        apply_rope(x, cos, sin, rope, False, fp8_out=(codes, scales))


def test_rope_refuses_bad_input():
    x = torch.randn(2, 64, device=DEVICE)
    cos = torch.ones(2, 32, device=DEVICE)
    with pytest.raises(InputError, match="rope_dims must be an even power of two"):
        apply_rope(x, cos, cos, 48, True)
    with pytest.raises(InputError, match=r"sin must be a float tensor \[2, 32\]"):
        apply_rope(x, cos, cos[:1], 64, True)


def test_rope_op_schema_and_fake():
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    cos = torch.rand(3, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    torch.library.opcheck(torch.ops.minirt.apply_rope, (x, cos, cos, 32, False, torch.float32))
    weight = torch.rand(64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    torch.library.opcheck(torch.ops.minirt.apply_rope, (x, cos, cos, 32, False, torch.float32, weight, weight, 1e-6))
