"""fp8 V32 paged latent cache: byte layout, round-trip bound, Triton writer vs torch reference, slots.

The writer and positions_to_slots run as real Triton kernels: compiled with CUDA tensors on a GPU,
under TRITON_INTERPRET=1 on the CPU.
"""
import math

import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.formats import KV_TOKEN_BYTES
from minirt.kernels.kv_cache_fp8 import (cache_geometry, dequantize_kv_fp8, new_kv_cache, positions_to_slots,
                                         quantize_kv_fp8, write_kv_fp8)

FP8_NAN_CODES = (0x7F, 0xFF)
_E4M3_VALUES = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_TIES = (_E4M3_VALUES[1:] + _E4M3_VALUES[:-1]) / 2
# +-448 (so the scale is 1) and 126 ties halfway between neighbouring e4m3 values, both signs
E4M3_MIDPOINTS = torch.cat([torch.tensor([448.0]), _TIES[::2], -_TIES[1::2], torch.tensor([-448.0])])


def random_tokens(n, dtype=torch.bfloat16, seed=0):
    """Random latent/rope with tiles spanning many binades, plus the edge tiles the scale rule has."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-20, 20, (n, 4, 1), generator=g).float())
    latent = (torch.randn(n, 4, 128, generator=g) * magnitude).flatten(1)
    latent[0, :128] = 0.0                                   # all-zero tile -> smallest scale
    latent[0, 128:256] = 1e-30                              # far below the 1e-4 floor
    latent[1, :128] = torch.linspace(-448.0, 448.0, 128)    # amax exactly 448 * 2^0
    latent[1, 128:256] = torch.linspace(-3.0, 448.0 * 2 ** -7, 128)  # amax exactly 448 * 2^-7
    latent[2, :128] = torch.randn(128, generator=g) * 1e30  # huge values
    latent[3, :128] = E4M3_MIDPOINTS                        # scale 1, every value a rounding tie
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    return latent.to(dtype).to(DEVICE), rope.to(DEVICE)


def exact_scale(tile: torch.Tensor) -> float:
    """2^ceil(log2(max(amax/448, 1e-4))) in exact arithmetic (the smallest 2^e with 448 * 2^e >= amax)."""
    amax = tile.double().abs().max().item()
    e = -13
    while 448.0 * 2.0 ** e < amax:
        e += 1
    return 2.0 ** e


def test_byte_layout():
    latent, rope = random_tokens(8)
    packed = quantize_kv_fp8(latent, rope)
    assert packed.shape == (8, KV_TOKEN_BYTES) and packed.dtype == torch.uint8
    scales = packed[:, 512:528].contiguous().view(torch.float32)          # [8, 4]
    for t in range(8):
        for j in range(4):
            assert scales[t, j].item() == exact_scale(latent[t, 128 * j:128 * (j + 1)])
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all(), "scales must be powers of two"
    assert scales[0, 0].item() == 2.0 ** math.ceil(math.log2(1e-4)) == 2.0 ** -13   # zero tile
    assert scales[0, 1].item() == 2.0 ** -13
    assert scales[1, 0].item() == 1.0 and scales[1, 1].item() == 2.0 ** -7
    # the element equal to 448 * scale is stored as the largest finite e4m3 (0x7E), never NaN
    assert packed[1, 127].item() == 0x7E and packed[1, 128 + 127].item() == 0x7E
    assert packed[1, 0].item() == 0xFE                                      # -448
    values = packed[:, :512]
    assert not any((values == code).any() for code in FP8_NAN_CODES), "no NaN codes, even for 1e30"
    # stored value is the fp8 rounding of latent / scale
    expected = (latent.float().view(8, 4, 128) / scales[..., None]).to(torch.float8_e4m3fn)
    assert torch.equal(values.reshape(8, 4, 128), expected.view(torch.uint8))
    # rope is copied bit-exactly, little-endian bf16
    assert torch.equal(packed[:, 528:].contiguous().view(torch.bfloat16), rope)


def test_scale_is_exact_at_power_of_two_boundaries():
    # amax = 448 * 2^k gives 2^k; the next float32 above gives 2^(k+1) (torch.log2 would round it to k).
    for k in (-5, 0, 3, 40):
        at = 448.0 * 2.0 ** k
        above = torch.nextafter(torch.tensor(at), torch.tensor(math.inf)).item()
        latent = torch.zeros(2, 512)
        latent[0, 7], latent[1, 7] = at, above
        packed = quantize_kv_fp8(latent.to(DEVICE), torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE))
        scales = packed[:, 512:528].contiguous().view(torch.float32)[:, 0]
        assert scales.tolist() == [2.0 ** k, 2.0 ** (k + 1)]


def test_saturating_cast_never_makes_nan():
    # With the exact scale no |latent / scale| exceeds 448, so the clamp before the (non-saturating)
    # torch cast is a guard: check the extreme tiles of random_tokens decode finite and within bound.
    latent, rope = random_tokens(5, torch.float32)
    back = dequantize_kv_fp8(quantize_kv_fp8(latent, rope), torch.float32)
    assert torch.isfinite(back).all()
    assert (back[:, :512].abs() <= latent.abs().view(5, 4, 128).amax(-1).repeat_interleave(128, -1)
            * (1 + 2 ** -4)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bound(dtype):
    # e4m3 has 3 mantissa bits: in the binade [2^e, 2^(e+1)) of v = x / scale the spacing is
    # 2^(e-3), so round-to-nearest errs by <= 2^(e-4) <= 2^-4 |v|; below 2^-6 (subnormals) the
    # spacing is 2^-9, error <= 2^-10. Hence |dequant - x| <= max(2^-4 |x|, 2^-10 scale).
    latent, rope = random_tokens(32, dtype, seed=1)
    packed = quantize_kv_fp8(latent, rope)
    back = dequantize_kv_fp8(packed, torch.float32)
    scale = packed[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, -1)
    x = latent.float()
    err = (back[:, :512] - x).abs()
    bound = torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.9, "bound should be attained (the test can fail)"
    assert torch.equal(back[:, 512:], rope.float())
    # bf16 result is exact: fp8 * 2^e is representable
    assert torch.equal(dequantize_kv_fp8(packed, torch.bfloat16).float(), back)


def test_dequantize_against_hand_built_bytes():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (5, 512), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00                 # no NaN codes
    exponents = torch.randint(-13, 20, (5, 4), generator=g)
    rope = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    packed = torch.cat([codes, torch.ldexp(torch.ones(5, 4), exponents).view(torch.uint8),
                        rope.view(torch.uint8)], -1).to(DEVICE)
    got = dequantize_kv_fp8(packed, torch.float32).cpu().double()
    # decode e4m3fn by hand: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals at exponent 0
    c = codes.long()
    sign = torch.where(c >= 128, -1.0, 1.0).double()
    e, m = (c >> 3) & 0xF, c & 7
    mag = torch.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * torch.exp2((e - 7).double()))
    want = sign * mag * torch.exp2(exponents.double()).repeat_interleave(128, -1)
    assert torch.equal(got[:, :512], want)
    assert torch.equal(got[:, 512:], rope.double())


def _packed_view(cache):
    return cache.view(-1, KV_TOKEN_BYTES) if cache.is_contiguous() else cache.reshape(-1, KV_TOKEN_BYTES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_writer_matches_reference_bit_exactly(dtype, strided):
    num_blocks, block_size, n = 3, 16, 20
    latent, rope = random_tokens(n, dtype, seed=3)
    if strided:
        # a cache view whose blocks are 5 tokens further apart than block_size * 656 bytes
        backing = torch.full((num_blocks, block_size + 5, 1, KV_TOKEN_BYTES), 0xFF, dtype=torch.uint8,
                             device=DEVICE)
        cache = backing[:, :block_size]
    else:
        backing = cache = torch.full((num_blocks, block_size, 1, KV_TOKEN_BYTES), 0xFF,
                                     dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:n].to(torch.int32)
    slots[3], slots[11] = -1, num_blocks * block_size          # skipped: padding, out of range
    before = backing.clone()
    write_kv_fp8(cache, latent, rope, slots.to(DEVICE))
    ref = quantize_kv_fp8(latent, rope).cpu()
    written = slots[(slots >= 0) & (slots < num_blocks * block_size)].long()
    kept = torch.tensor([i for i in range(n) if i not in (3, 11)])
    got = _packed_view(cache).cpu()
    assert torch.equal(got[written], ref[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert (got[untouched] == 0xFF).all()
    if strided:   # the gap bytes between blocks stay as they were
        assert torch.equal(backing[:, block_size:].cpu(), before[:, block_size:].cpu())


def test_writer_leading_dims_and_noncontiguous_inputs():
    cache = new_kv_cache(2, 64, device=DEVICE)
    kv = torch.randn(2, 3, 576, device=DEVICE).to(torch.bfloat16)   # kv_a_proj output [latent | rope]
    latent, rope = kv[..., :512], kv[..., 512:]
    slots = torch.tensor([[0, 70, 5], [127, -1, 64]], dtype=torch.int64, device=DEVICE)
    write_kv_fp8(cache, latent, rope, slots)
    flat = cache.view(-1, KV_TOKEN_BYTES)
    ref = quantize_kv_fp8(latent, rope)
    for (i, j) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]:
        assert torch.equal(flat[slots[i, j]], ref[i, j])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writer_norms_the_latent_and_ropes_k_rope_first(dtype):
    """norm and rope: the latent's bytes are write_kv_fp8's of rms_norm's output (the same kernel sums, bit for
    bit); k_rope is the interleaved rope of an fp32 reference rounded to bfloat16 (within one bf16 step: the
    GPU may fuse a product); the latent's values against an fp64 RMSNorm."""
    from minirt.kernels import rms_norm
    from minirt.rope import apply_rope_interleaved
    g = torch.Generator().manual_seed(7)
    n, block_size = 12, 16
    kv = (torch.randn(n, 576, generator=g) * 3).to(dtype).to(DEVICE)      # kv_a's output [latent | k_rope]
    latent, k_rope = kv[:, :512], kv[:, 512:]
    weight = (torch.rand(512, generator=g) + 0.5).to(DEVICE)
    angles = torch.rand(n, 32, generator=g, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    slots = torch.randperm(2 * block_size, generator=g)[:n].to(DEVICE)
    slots[5] = -1
    fused = torch.full((2, block_size, 1, KV_TOKEN_BYTES), 0xFF, dtype=torch.uint8, device=DEVICE)
    write_kv_fp8(fused, latent, k_rope, slots, norm=(weight, 1e-6), rope=(cos, sin))
    normed = rms_norm(latent, weight, 1e-6)
    plain = torch.full_like(fused, 0xFF)
    write_kv_fp8(plain, normed, k_rope.to(torch.bfloat16), slots)   # the same slots, rope unrotated
    got, want = _packed_view(fused).cpu(), _packed_view(plain).cpu()
    assert torch.equal(got[:, :528], want[:, :528])                  # codes and scales, unwritten slots too
    kept = slots.cpu() >= 0
    rows = slots.cpu()[kept].long()
    ref_rope = apply_rope_interleaved(k_rope.float().cpu()[:, None], cos.cpu(), sin.cpu())[:, 0]
    got_rope = dequantize_kv_fp8(got[rows], torch.float32)[:, 512:]
    torch.testing.assert_close(got_rope, ref_rope[kept].to(torch.bfloat16).float(), atol=0, rtol=2 ** -7)
    assert (got[~torch.isin(torch.arange(2 * block_size), rows)] == 0xFF).all()
    x = latent.double().cpu()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double().cpu()
    values = dequantize_kv_fp8(got[rows], torch.float32)[:, :512].double()
    assert ((values - ref[kept]).norm() / ref[kept].norm()).item() < 0.04       # e4m3: 3 mantissa bits
    with pytest.raises(InputError, match="norm must be"):
        write_kv_fp8(fused, latent, k_rope, slots, norm=(weight[:64], 1e-6), rope=(cos, sin))
    with pytest.raises(InputError, match="rope must be"):
        write_kv_fp8(fused, latent, k_rope, slots, rope=(cos[:3], sin))


def test_new_kv_cache():
    cache = new_kv_cache(3, device=DEVICE)
    assert cache.shape == (3, 64, 1, 656) and cache.dtype == torch.uint8 and not cache.any()
    assert torch.equal(dequantize_kv_fp8(cache), torch.zeros(3, 64, 1, 576, dtype=torch.bfloat16, device=DEVICE))
    assert cache_geometry(cache).num_slots == 192
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InputError):
            new_kv_cache(bad)


def test_positions_to_slots():
    block_size, num_blocks = 16, 6
    cache = new_kv_cache(num_blocks, block_size, device=DEVICE)
    table = torch.tensor([[4, 0, 2, -1], [5, 2**30, num_blocks, 1]], dtype=torch.int32)
    positions = torch.tensor([[[0, 15, 16, 47, 48, 63, 64, -1], [-2**31, 2**31 - 1, 33, 1, 2, 3, 4, 5]],
                              [[0, 17, 20, 35, 63, 64, 49, 48], [-5, 1000, 2, 18, 50, 51, 52, 53]]],
                             dtype=torch.int32)

    def expected(b, p):
        if p < 0 or p >= table.shape[1] * block_size:
            return -1
        blk = int(table[b, p // block_size])
        return blk * block_size + p % block_size if 0 <= blk < num_blocks else -1

    want = torch.tensor([[[expected(b, int(p)) for p in row] for row in positions[b]] for b in range(2)],
                        dtype=torch.int32)
    got = positions_to_slots(positions.to(DEVICE), table.to(DEVICE), cache)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    # int64 positions and a 2-D [b, n] shape (the writer's use)
    got2 = positions_to_slots(positions[:, 0].long().to(DEVICE), table.to(DEVICE), cache)
    assert torch.equal(got2.cpu(), want[:, 0])
    # Strided positions and table (copied before the launch), twice: the second call takes the kept plan.
    strided_table = torch.stack([table, torch.zeros_like(table)], -1).to(DEVICE)[..., 0]
    for _ in range(2):
        got3 = positions_to_slots(positions.transpose(1, 2).to(DEVICE).transpose(1, 2), strided_table, cache)
        assert got3.is_contiguous() and torch.equal(got3.cpu(), want)


def test_bad_inputs_raise_input_error():
    cache = new_kv_cache(2, 16, device=DEVICE)
    latent, rope = random_tokens(4)
    slots = torch.arange(4, device=DEVICE)
    misaligned = torch.zeros(2 * 16 * 656 + 8, dtype=torch.uint8, device=DEVICE)[8:].view(2, 16, 1, 656)
    bad_caches = [cache.view(torch.int8), cache[..., :600], cache.view(2, 16, 656),
                  torch.zeros(2, 16, 2, 656, dtype=torch.uint8, device=DEVICE), cache.transpose(0, 1),
                  misaligned, "cache"]
    for bad in bad_caches:
        with pytest.raises(InputError):
            write_kv_fp8(bad, latent, rope, slots)
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent.to(torch.float16).to(torch.int32), rope, slots)
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent, rope.float(), slots)
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent[:, :500], rope, slots)
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent, rope[:2], slots)
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent, rope, slots[:2])
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent, rope, slots.float())
    with pytest.raises(InputError):
        write_kv_fp8(cache, latent.to("meta"), rope.to("meta"), slots)
    with pytest.raises(InputError):
        quantize_kv_fp8(latent, rope.to("meta"))
    with pytest.raises(InputError):
        dequantize_kv_fp8(cache.view(torch.int8))
    with pytest.raises(InputError):
        dequantize_kv_fp8(cache, torch.float16)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InputError):
        positions_to_slots(torch.zeros(3, 5, dtype=torch.int32, device=DEVICE), table, cache)
    with pytest.raises(InputError):
        positions_to_slots(torch.zeros(2, 5, device=DEVICE), table, cache)
    with pytest.raises(InputError):
        positions_to_slots(torch.zeros(2, 5, dtype=torch.int32, device=DEVICE), table.long(), cache)
    with pytest.raises(InputError):
        positions_to_slots(torch.zeros(2, 5, dtype=torch.int32, device="meta"), table, cache)
