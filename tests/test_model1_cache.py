"""fp8 MODEL1 (DeepSeek-V4) paged cache: FlashMLA's byte layout and scale rule, the torch reference and
the Triton writer byte-identical to it, the round-trip bound, the page geometry.

FLASHMLA_RULE below restates FlashMLA's tests/quant.py rule (commit 9241ae3) from its description, in
FlashMLA's own operations: per 64-value tile, scale = 2^ceil(log2(max(amax / 448, 1e-4))) with torch's
log2 and pow, values (x.float() / scale) cast to e4m3, scales cast to float8_e8m0fnu; a page of B entries
is a buffer of model1_page_bytes(B) bytes, the B 576-byte data records first, then the B 8-byte scale
records. The writer runs as a real Triton kernel (compiled on a GPU, interpreted on the CPU).
"""
import pytest
import torch

from conftest import DEVICE
from minirt import formats
from minirt.errors import InputError
from minirt.kernels.kv_cache_model1 import (dequantize_kv_model1, model1_cache_entries, model1_cache_from_entries,
                                            model1_cache_geometry, new_model1_cache, quantize_kv_model1,
                                            write_kv_model1)

_E4M3_VALUES = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_TIES = (_E4M3_VALUES[1:] + _E4M3_VALUES[:-1]) / 2


def flashmla_rule(kv: torch.Tensor) -> torch.Tensor:
    """kv [num_blocks, B, 512] bf16 -> [num_blocks, page bytes] uint8 pages, FlashMLA's quantiser
    (pad bytes and the page's tail 0)."""
    num_blocks, B, _ = kv.shape
    page = (B * 584 + 575) // 576 * 576
    buf = torch.zeros((num_blocks, page), dtype=torch.uint8)
    data = buf[:, :B * 576].view(num_blocks, B, 576)
    scales = buf[:, B * 576:B * 584].view(num_blocks, B, 8)
    data[..., 448:] = kv[..., 448:].contiguous().view(torch.uint8)
    for t in range(7):
        tile = kv[..., 64 * t:64 * (t + 1)]
        scale = torch.pow(2, torch.clamp_min(tile.abs().max(dim=-1).values.float() / 448.0, 1e-4).log2().ceil())
        scales[..., t] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
        data[..., 64 * t:64 * (t + 1)] = (tile.float() / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return buf


def pages_of(cache: torch.Tensor) -> torch.Tensor:
    """The whole padded pages behind a cache view, as FlashMLA allocates them."""
    n, B = cache.shape[:2]
    return cache.as_strided((n, formats.model1_page_bytes(B)), (cache.stride(0), 1)).cpu()


def random_kv(n, seed):
    """Random entries with tiles over many binades, plus the scale rule's edge tiles (bf16)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-20, 20, (n, 8, 1), generator=g).float())
    kv = (torch.randn(n, 8, 64, generator=g) * magnitude).flatten(1)
    if n >= 4:
        kv[0, :64] = 0.0                                   # all-zero tile -> smallest scale 2^-13
        kv[0, 64:128] = 1e-30                              # far below the 1e-4 floor
        kv[1, :64] = torch.linspace(-448.0, 448.0, 64)     # amax exactly 448 * 2^0
        kv[1, 64:128] = torch.linspace(-3.0, 448.0 * 2 ** -7, 64)
        kv[2, :64] = torch.randn(64, generator=g) * 1e30  # huge values
        kv[3, :64] = torch.cat([torch.tensor([448.0]), _TIES[:63]])   # scale 1, every other value a tie
        kv[3, 128:192] = torch.cat([torch.tensor([-448.0]), -_TIES[63:]])
    return kv.to(torch.bfloat16)


@pytest.mark.parametrize("num_blocks,block_size", [(3, 2), (2, 64), (1, 256)])
def test_reference_and_writer_match_flashmla_rule(num_blocks, block_size):
    n = num_blocks * block_size
    kv = random_kv(n, seed=block_size).view(num_blocks, block_size, 512)
    expected = flashmla_rule(kv)
    assert model1_cache_from_entries(quantize_kv_model1(kv)).stride() == (expected.shape[1], 584, 584, 1)
    assert torch.equal(pages_of(model1_cache_from_entries(quantize_kv_model1(kv))), expected)
    # The writer, at up to 24 slots in a random order, into pages of noise: those entries' data and scale
    # records (at page + o * 576 and page + B * 576 + o * 8) become FlashMLA's, no other byte changes.
    cache = new_model1_cache(num_blocks, block_size, DEVICE)
    pages = cache.as_strided((num_blocks, expected.shape[1]), (cache.stride(0), 1))
    pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8).to(DEVICE))
    want = pages_of(cache).clone()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:24]
    for slot in order.tolist():
        page, o = divmod(slot, block_size)
        for at in (slice(o * 576, (o + 1) * 576), slice(block_size * 576 + o * 8, block_size * 576 + (o + 1) * 8)):
            want[page, at] = expected[page, at]
    write_kv_model1(cache, kv.view(n, 512)[order].to(DEVICE), order.int().to(DEVICE))
    assert torch.equal(pages_of(cache), want)


def test_scale_bytes_and_edge_tiles():
    kv = random_kv(8, seed=1)
    entries = quantize_kv_model1(kv)
    assert entries.shape == (8, 584) and entries.dtype == torch.uint8
    exponents = entries[:, 576:583].int() - 127
    assert (entries[:, 583] == 0).all()
    assert exponents[0, 0] == exponents[0, 1] == -13             # zero and 1e-30 tiles: the 1e-4 floor
    assert exponents[1, 0] == 0 and exponents[1, 1] == -7       # amax exactly 448 * 2^e -> 2^e
    assert exponents[2, 0] > 90                                  # 1e30-scale values
    for t in range(8):                                           # smallest 2^e with 448 * 2^e >= amax
        for j in range(7):
            amax = kv[t, 64 * j:64 * (j + 1)].double().abs().max().item()
            e = exponents[t, j].item()
            assert 448.0 * 2.0 ** e >= amax and (e == -13 or 448.0 * 2.0 ** (e - 1) < amax)
    # ties round to even: the midpoint tiles decode to the even neighbour
    back = dequantize_kv_model1(entries, torch.float32)
    codes = entries[3, 1:64].view(torch.float8_e4m3fn).float()
    assert torch.equal(back[3, 1:64], codes) and torch.equal(codes, _TIES[:63].to(torch.float8_e4m3fn).float())
    assert torch.isfinite(back).all()


def test_round_trip_error_bound_and_exact_rope():
    kv = random_kv(64, seed=2)
    entries = quantize_kv_model1(kv)
    back = dequantize_kv_model1(entries, torch.float32)
    assert torch.equal(dequantize_kv_model1(entries).float(), back)    # bf16 result is exact too
    assert torch.equal(back[:, 448:], kv[:, 448:].float())             # rope bit-exact
    scale = torch.ldexp(torch.ones(64, 7), entries[:, 576:583].int() - 127).repeat_interleave(64, 1)
    err = (back[:, :448] - kv[:, :448].float()).abs()
    # e4m3: 3 mantissa bits (relative 2^-4 at ties), subnormal steps of 2^-9 * scale
    assert (err <= torch.maximum(kv[:, :448].float().abs() * 2 ** -4, scale * 2 ** -10)).all()


def test_dequantize_against_hand_built_bytes():
    entry = torch.zeros(584, dtype=torch.uint8)
    entry[0] = 0x38                                   # e4m3 1.0
    entry[64] = 0xC0                                  # e4m3 -2.0
    entry[447] = 0x01                                 # smallest subnormal 2^-9
    entry[448:576] = torch.arange(64, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)
    entry[576:583] = torch.tensor([127, 130, 120, 127, 127, 127, 137], dtype=torch.uint8)
    back = dequantize_kv_model1(entry, torch.float32)
    assert back[0] == 1.0 and back[64] == -2.0 * 8 and back[447] == 2.0 ** -9 * 2 ** 10
    assert (back[1:64] == 0).all() and torch.equal(back[448:], torch.arange(64, dtype=torch.float32))


def test_entries_round_trip_through_pages_and_geometry():
    entries = torch.randint(0, 256, (3, 5, 584), dtype=torch.uint8)
    cache = model1_cache_from_entries(entries)
    assert torch.equal(model1_cache_entries(cache), entries)
    slots = torch.tensor([[14, 0], [3, 9]])
    assert torch.equal(model1_cache_entries(cache, slots), entries.view(15, 584)[slots])
    for bad in (torch.tensor([15]), torch.tensor([-1]), torch.tensor([1.0])):
        with pytest.raises(InputError, match="slots"):
            model1_cache_entries(cache, bad)
    g = model1_cache_geometry(cache)
    assert (g.num_blocks, g.block_size, g.block_stride) == (3, 5, formats.model1_page_bytes(5)) == (3, 5, 3456)
    # Slot n * B + o: its data record at page n + o * 576, its scale record at page n + B * 576 + o * 8.
    pages = pages_of(cache)
    assert torch.equal(pages[2, 3 * 576:4 * 576], entries[2, 3, :576])
    assert torch.equal(pages[2, 5 * 576 + 3 * 8:5 * 576 + 4 * 8], entries[2, 3, 576:])


def test_writer_skips_invalid_slots_and_takes_strided_input():
    cache = new_model1_cache(2, 4, DEVICE)
    kv = random_kv(6, seed=3)
    wide = torch.cat([kv, kv], 1).to(DEVICE)[:, :512]                  # row stride 1024
    slots = torch.tensor([5, -1, 8, 0, 2 ** 31 - 1, -2 ** 31], dtype=torch.int64, device=DEVICE)
    write_kv_model1(cache, wide, slots)
    got = model1_cache_entries(cache).view(8, 584).cpu()
    expected = torch.zeros(8, 584, dtype=torch.uint8)
    expected[5], expected[0] = quantize_kv_model1(kv[0]), quantize_kv_model1(kv[3])
    assert torch.equal(got, expected)


def test_new_model1_cache():
    cache = new_model1_cache(3, 2)
    assert cache.shape == (3, 2, 1, 584) and cache.stride() == (1728, 584, 584, 1) and (cache == 0).all()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError):
            new_model1_cache(bad, 2)
        with pytest.raises(InputError):
            new_model1_cache(2, bad)


def test_bad_inputs_raise_input_error():
    cache = new_model1_cache(2, 4, DEVICE)
    kv = random_kv(2, seed=4).to(DEVICE)
    slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    contiguous_pages = torch.zeros(2, 4, 1, 584, dtype=torch.uint8)
    assert model1_cache_geometry(contiguous_pages).block_stride == 4 * 584    # unpadded pages are fine
    for bad_cache in (cache.view(torch.int8), torch.zeros(2, 4, 1, 656, dtype=torch.uint8),
                      torch.zeros(2, 4, 584, dtype=torch.uint8), contiguous_pages[:, :, :, :583],
                      contiguous_pages.as_strided((2, 4, 1, 584), (584, 584, 584, 1)),      # overlapping pages
                      contiguous_pages.as_strided((2, 2, 1, 584), (1176, 588, 588, 1))):    # entry stride 588
        with pytest.raises(InputError, match="cache"):
            model1_cache_geometry(bad_cache)
    with pytest.raises(InputError, match="extra_kv_cache"):
        model1_cache_geometry(cache.view(torch.int8), "extra_kv_cache")
    with pytest.raises(InputError, match="kv"):
        write_kv_model1(cache, kv.float(), slots)
    with pytest.raises(InputError, match="kv"):
        write_kv_model1(cache, kv[:, :448], slots)
    with pytest.raises(InputError, match="slots"):
        write_kv_model1(cache, kv, slots[:1])
    with pytest.raises(InputError, match="slots"):
        write_kv_model1(cache, kv, slots.float())
    with pytest.raises(InputError, match="entries"):
        dequantize_kv_model1(torch.zeros(3, 576, dtype=torch.uint8))
    with pytest.raises(InputError, match="kv"):
        quantize_kv_model1(torch.zeros(3, 512))


def test_writer_custom_op_writes_the_same_bytes():
    import minirt.kernels  # noqa: F401  (registers torch.ops.minirt.*)
    kv = random_kv(4, seed=5).view(2, 2, 512)
    cache = new_model1_cache(2, 2, DEVICE)
    torch.ops.minirt.write_kv_model1(cache, kv.view(4, 512).to(DEVICE), torch.arange(4, device=DEVICE))
    assert torch.equal(pages_of(cache), flashmla_rule(kv))
