"""The indexer key cache (fp8 format: writer vs the torch reference, bit for bit; dequantisation) and
paged_indexer_scores against an fp64 torch reference over the dequantised keys, in both cache formats.

Runs the real Triton kernels: compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU.
Caches start NaN-poisoned: every byte no key was written to (unallocated pages, slots past a sequence's
written keys) holds NaN, and outputs are NaN-poisoned before each call.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from test_lightning_indexer import BF16X3_ELEMENT_BOUND, BF16X3_REL_TOL
from minirt.errors import InputError
from minirt.formats import E4M3_MAX, FP8_DTYPE, INDEX_KEY_BYTES
from minirt.kernels import indexer_cache as ic
from minirt.kernels import _indexer_tiles
from minirt.kernels._launch import Kept
from minirt.kernels import lightning_indexer as li
from minirt.kernels.indexer_cache import (dequantize_index_cache, index_cache_parts, new_index_cache,
                                          paged_indexer_scores, quantize_index_keys, write_index_keys)
from minirt.kernels.lightning_indexer import IndexerConfig, indexer_topk

ON_GPU = DEVICE == "cuda"
D = 128
# Elementwise error bound, as a fraction of the magnitude sum_h |w_h| sum_d |q_hd k_d| of the terms:
# exact keys as lightning_indexer's float32 inputs (three bf16 products of split operands); fp8: exact
# e4m3 products and fp32 sums stay far below 2^-16, but Hopper's fp8 tensor cores accumulate with
# fewer bits (about 2^-13 of the running sum per add), hence 2^-8 for compiled fp8.
ELEMENT_BOUND = {"exact": BF16X3_ELEMENT_BOUND, "fp8": 2.0**-8 if ON_GPU else 2.0**-16}
REL_TOL = {"exact": BF16X3_REL_TOL, "fp8": 1e-3 if ON_GPU else 1e-6}


# ----------------------------------------------------------------------------------------------
# writer and reference
# ----------------------------------------------------------------------------------------------

def random_keys(gen, n, dtype=torch.float32):
    """n keys of random magnitudes (amax from 1e-6 to 1e4, so scales from the 2^-22 floor up) and
    signs, in dtype."""
    magnitude = 10.0 ** (torch.rand((n, 1), generator=gen, device=DEVICE) * 10 - 6)
    return (torch.randn((n, D), generator=gen, device=DEVICE) * magnitude).to(dtype)


def boundary_keys():
    """Keys whose quantisation sits on the rule's edges: all zeros (scale 2^-22, finite); amax below
    the 1e-4 floor; amax exactly 448 * 2^e (scale exactly 2^e) and one float32 ulp above it (the next
    power); values halfway between e4m3 neighbours (ties to even), in the subnormal range, and at
    +-448 after scaling."""
    keys = torch.zeros((8, D), dtype=torch.float32)
    keys[1, :4] = torch.tensor([3e-5, -7e-5, 1e-5, 9.9e-5])
    keys[2, 0] = 448.0 * 2.0**-3
    keys[2, 1:] = torch.linspace(-56.0, 56.0, D - 1)
    keys[3] = keys[2]
    keys[3, 0] = torch.nextafter(torch.tensor(56.0), torch.tensor(100.0))
    # With amax 448 (scale 1): e4m3 neighbours 1 and 1.125, 256 and 288, subnormals 2^-9 apart.
    halfway = torch.tensor([1.0625, 1.1875, 272.0, 304.0, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-10, 2.0**-6 - 2.0**-10,
                            448.0, -448.0, 0.5 * 2.0**-9, 15 * 2.0**-10])
    keys[4, :halfway.numel()] = halfway
    keys[5, :halfway.numel()] = -halfway * 2.0**-20           # the same pattern at scale 2^-20
    keys[5, -1] = 448.0 * 2.0**-20
    keys[6] = torch.linspace(-1e4, 1e4, D)
    keys[7, 0] = 1e-4                                          # exactly at the floor
    return keys.to(DEVICE)


def reference_write(cache, k, slots):
    """The writer's semantics in torch: quantize_index_keys(k) at each valid slot's page and offset."""
    values, scales = quantize_index_keys(k)
    cache_values, cache_scales = index_cache_parts(cache)
    block_size = cache.shape[1]
    valid = (slots >= 0) & (slots < cache.shape[0] * block_size)
    slots = slots[valid].long()
    cache_values.view(torch.uint8)[slots // block_size, slots % block_size] = values[valid].view(torch.uint8)
    cache_scales[slots // block_size, slots % block_size] = scales[valid]


def poisoned_cache(num_blocks, block_size, gen=None):
    """A cache whose bytes are random (gen) or all 0xFF (NaN e4m3 values and NaN scales)."""
    cache = new_index_cache(num_blocks, block_size, device=DEVICE)
    if gen is None:
        return cache.fill_(0xFF)
    return cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, device=DEVICE, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writer_matches_reference_bitwise(dtype):
    """Random keys plus the boundary cases, shuffled slots, padding (-1) and out-of-range slots: every
    byte of the cache equals the reference's (unwritten slots keep their random bytes)."""
    gen = torch.Generator(DEVICE).manual_seed(1)
    num_blocks, block_size = 7, 12
    keys = torch.cat([random_keys(gen, 40), boundary_keys()]).to(dtype)
    if dtype == torch.float16:
        keys = keys.float().clamp(-6e4, 6e4).to(dtype)
    n = keys.shape[0]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:n]
    slots[::7] = -1
    slots[3], slots[11] = num_blocks * block_size, 2**31 - 1
    for slot_dtype in (torch.int64, torch.int32):
        cache = poisoned_cache(num_blocks, block_size, gen)
        expected = cache.clone()
        write_index_keys(cache, keys, slots.to(slot_dtype))
        reference_write(expected, keys, slots)
        assert torch.equal(cache, expected)


def test_writer_on_a_slice_of_pages():
    """A cache that is a slice of a bigger one's pages: slots count from the slice's first page, the
    pages around it stay untouched, and leading dims of k are flattened."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    big = poisoned_cache(10, 8, gen)
    cache = big[3:8]
    before = big.clone()
    keys = random_keys(gen, 24).view(4, 6, D)
    slots = torch.randperm(40, generator=gen, device=DEVICE)[:24].view(4, 6)
    expected = cache.clone()
    write_index_keys(cache, keys, slots)
    reference_write(expected, keys.view(-1, D), slots.view(-1))
    assert torch.equal(cache, expected)
    assert torch.equal(big[:3], before[:3]) and torch.equal(big[8:], before[8:])


def test_byte_layout():
    """The page layout spelled out in bytes (module docstring; vLLM's indexer_k_quant_and_cache): token
    o of page n has its 128 e4m3 values at n * bs * 132 + o * 128, its float32 scale at
    n * bs * 132 + bs * 128 + 4 * o."""
    gen = torch.Generator(DEVICE).manual_seed(4)
    block_size = 8
    cache = new_index_cache(3, block_size, device=DEVICE)
    keys = random_keys(gen, 3 * block_size)
    slots = torch.randperm(3 * block_size, generator=gen, device=DEVICE)
    write_index_keys(cache, keys, slots)
    values, scales = quantize_index_keys(keys)
    flat = cache.view(-1)
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, block_size)
        at = page * block_size * INDEX_KEY_BYTES
        assert torch.equal(flat[at + offset * D:at + offset * D + D], values[i].view(torch.uint8))
        at += block_size * D + 4 * offset
        assert torch.equal(flat[at:at + 4], scales[i:i + 1].view(torch.uint8))


def test_quantisation_rule_and_round_trip():
    """Scales are powers of two, 2^ceil(log2(max(amax, 1e-4) / 448)); values within e4m3 rounding of
    k / scale; dequantisation of the written cache reproduces k to e4m3 precision."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    n_random = 64
    keys = torch.cat([random_keys(gen, n_random), boundary_keys()])
    values, scales = quantize_index_keys(keys)
    # The oracle in float64 on the CPU, whose log2 is exact at the powers of two boundary_keys hit.
    amax = keys.abs().amax(-1).double().cpu()
    exponent = torch.ceil(torch.log2(amax.clamp_min(1e-4) / E4M3_MAX))
    assert torch.equal(scales.double().cpu(), torch.exp2(exponent))
    assert scales.min() == 2.0**math.ceil(math.log2(1e-4 / E4M3_MAX)) and torch.isfinite(values.float()).all()
    assert (values.float().abs().amax(-1).cpu()[amax > 1e-4] >= E4M3_MAX / 2).all(), "scale not the smallest"

    cache = poisoned_cache(16, 8)
    slots = torch.randperm(128, generator=gen, device=DEVICE)[:keys.shape[0]]
    write_index_keys(cache, keys, slots)
    got = dequantize_index_cache(cache)[slots // 8, slots % 8]
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal steps of 2^-9 * scale.
    bound = keys.abs() * 2.0**-4 + scales[:, None] * 2.0**-10
    assert ((got - keys).abs() <= bound).all()
    assert (got[n_random] == 0).all(), "the zero key dequantises to zeros"


def test_new_index_cache():
    cache = new_index_cache(3, 16, device=DEVICE)
    assert cache.shape == (3, 16, 1, INDEX_KEY_BYTES) and cache.dtype == torch.uint8 and (cache == 0).all()
    values, scales = index_cache_parts(cache)
    assert values.shape == (3, 16, D) and values.dtype == FP8_DTYPE and scales.shape == (3, 16)
    for args in [(0, 16), (3, 6), (3, True), (2.0, 16)]:
        with pytest.raises(InputError):
            new_index_cache(*args)


# ----------------------------------------------------------------------------------------------
# paged scores
# ----------------------------------------------------------------------------------------------

def make_case(gen, fmt, limit, block_size, max_blocks, n_heads, spare_blocks=3):
    """Inputs of paged_indexer_scores for query rows limited by `limit` [b, t] (int64).

    Sequence b has written keys at positions [0, max_t limit[b, t] + 1); it owns enough pages for
    them plus one more when the table has room, drawn at random (shuffled, non-contiguous) from a
    cache of spare_blocks more pages than all sequences own; table entries past its pages are -1.
    Everything not written (the rest of its last pages, the spare pages) stays NaN."""
    n_batch, n_queries = limit.shape
    written = (limit.amax(-1) + 1).clamp_min(0).tolist()
    owned = [min(max_blocks, -(-n // block_size) + 1) for n in written]
    num_blocks = sum(owned) + spare_blocks
    pages = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    table = torch.full((n_batch, max_blocks), -1, dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(owned):
        table[b, :n] = pages[start:start + n]
        start += n
    positions = [torch.arange(n, device=DEVICE) for n in written]
    slots = torch.cat([table[b, p // block_size].long() * block_size + p % block_size
                       for b, p in enumerate(positions)])
    keys = torch.randn((slots.numel(), D), generator=gen, device=DEVICE)
    if fmt == "fp8":
        cache = poisoned_cache(num_blocks, block_size)
        reference_write(cache, keys, slots)
        q = torch.randn((n_batch, n_queries, n_heads, D), generator=gen, device=DEVICE).to(FP8_DTYPE)
    else:
        cache = torch.full((num_blocks, block_size, D), math.nan, device=DEVICE)
        cache.view(-1, D)[slots] = keys
        q = torch.randn((n_batch, n_queries, n_heads, D), generator=gen, device=DEVICE)
    weights = torch.randn((n_batch, n_queries, n_heads), generator=gen, device=DEVICE) * (n_heads * D) ** -0.5
    return q, weights, cache, table, limit


def reference(q, weights, cache, table, limit, n_keys):
    """fp64 scores over the dequantised keys at each sequence's logical positions; also the
    magnitude sum_h |w_h| sum_d |q_hd k_d| and the validity mask, all [b, t, n_keys]."""
    pages = (dequantize_index_cache(cache) if cache.dtype == torch.uint8 else cache).double()
    block_size = pages.shape[1]
    pos = torch.arange(n_keys, device=DEVICE)
    page_index = pos // block_size
    in_table = page_index < table.shape[1]
    page = torch.where(in_table, table[:, page_index.clamp(max=table.shape[1] - 1)], -1).long()
    allocated = (page >= 0) & (page < pages.shape[0])
    keys = pages[page.clamp(0, pages.shape[0] - 1), pos % block_size]          # [b, S, D]
    valid = allocated[:, None, :] & (pos <= limit[..., None])                  # [b, t, S]
    used = valid.any(1)
    assert not keys[used].isnan().any(), "test setup: a key some row may see was never written"
    keys = torch.where(used[..., None], keys, 0.0)
    q64, w64 = q.double(), weights.double()
    logits = torch.einsum("bthd,bsd->bths", q64, keys)
    scores = (logits.relu() * w64[..., None]).sum(2)
    magnitude = (torch.einsum("bthd,bsd->bths", q64.abs(), keys.abs()) * w64.abs()[..., None]).sum(2)
    return scores.masked_fill(~valid, -math.inf), magnitude, valid


def check(out, q, weights, cache, table, limit, fmt):
    ref, magnitude, valid = reference(q, weights, cache, table, limit, out.shape[-1])
    assert torch.equal(out == -math.inf, ~valid), "-inf exactly where s > limit or the page is unallocated"
    assert torch.isfinite(out[valid]).all(), "valid scores must be finite"
    err = (out.double()[valid] - ref[valid]).abs()
    excess = err - ELEMENT_BOUND[fmt] * magnitude[valid]
    assert valid.sum() == 0 or excess.max() <= 0, f"off by {excess.max():.3g} beyond the elementwise bound"
    if valid.any():
        rel = (err.norm() / magnitude[valid].norm()).item()
        assert rel < REL_TOL[fmt], f"relative error {rel:.3g}"


def run_case(q, weights, cache, table, limit, fmt, n_keys=None):
    width = table.shape[1] * cache.shape[1] if n_keys is None else n_keys
    out = torch.full((q.shape[0], q.shape[1], width), math.nan, device=DEVICE)
    got = paged_indexer_scores(q, weights, cache, table, limit, n_keys=n_keys, out=out)
    assert got is out
    check(out, q, weights, cache, table, limit, fmt)
    return out


FORMATS = ["fp8", "exact"]
# Exact keys both ways the kernel takes them: split into bf16 parts as each tile is loaded (decode) or
# once per call (split_pages, prefill chunks of PRESPLIT_MIN_QUERIES rows or more).
KEY_PATHS = [("fp8", None), ("exact", False), ("exact", True)]


def use_presplit(monkeypatch, presplit):
    if presplit is not None:
        monkeypatch.setattr(li, "PRESPLIT_MIN_QUERIES", 1 if presplit else 2**31)


@pytest.fixture(params=KEY_PATHS, ids=["fp8", "exact-split-in-loop", "exact-presplit"])
def fmt(request, monkeypatch):
    """A cache format, exact keys taking each path (checked: split_pages runs on the presplit path only)."""
    fmt, presplit = request.param
    use_presplit(monkeypatch, presplit)
    calls, split_pages = [], ic.split_pages
    monkeypatch.setattr(ic, "split_pages", lambda *args: calls.append(args) or split_pages(*args))
    yield fmt
    assert bool(calls) == bool(presplit)


def test_decode_batch(fmt):
    """b = 6 sequences, one query each: lengths ending mid-block, at a block's end, a row of -1 (all
    -inf; its page was never written), a one-key sequence, pages missing inside a length; V3.2's 64
    heads."""
    gen = torch.Generator(DEVICE).manual_seed(10)
    limit = torch.tensor([[37], [15], [-1], [0], [100], [63]], device=DEVICE)
    q, weights, cache, table, limit = make_case(gen, fmt, limit, block_size=16, max_blocks=8, n_heads=64)
    # Holes inside sequence 4's length: an unallocated page and a page id past the cache (-inf).
    table[4, 2], table[4, 3] = -1, cache.shape[0]
    out = run_case(q, weights, cache, table, limit, fmt)
    assert (out[2] == -math.inf).all() and (out[4, 0, 32:64] == -math.inf).all()
    assert torch.isfinite(out[4, 0, :32]).all() and torch.isfinite(out[4, 0, 64:101]).all()


def test_prefill_chunk(fmt):
    """One sequence, a chunk of 50 query tokens starting at position 70 (limit = 70 + t) over the keys
    written so far: -inf exactly above the diagonal, rows limited in the middle of blocks."""
    gen = torch.Generator(DEVICE).manual_seed(11)
    limit = (70 + torch.arange(50, device=DEVICE))[None]
    case = make_case(gen, fmt, limit, block_size=16, max_blocks=9, n_heads=8)
    out = run_case(*case, fmt)
    assert torch.isinf(out[0, 0, 71:]).all() and torch.isfinite(out[0, -1, :120]).all()


@pytest.mark.skipif(not ON_GPU, reason="DeepSeek-V3.2 shapes; the interpreter would take minutes")
def test_prefill_chunk_deepseek_shape(fmt):
    """A chunk of 256 queries at positions 7936.. over 8192 keys in shuffled pages of 64, 64 heads, with
    the default launch shape; exact keys: the top-2048 is the fp64 oracle's but for near-ties (keys whose
    oracle scores differ by less than twice the error bound)."""
    gen = torch.Generator(DEVICE).manual_seed(19)
    limit = (7936 + torch.arange(256, device=DEVICE))[None]
    q, weights, cache, table, limit = make_case(gen, fmt, limit, block_size=64, max_blocks=128, n_heads=64)
    out = run_case(q, weights, cache, table, limit, fmt)
    if fmt == "exact":
        ref, magnitude, _ = reference(q, weights, cache, table, limit, out.shape[-1])
        got, want = indexer_topk(out, 2048).long(), indexer_topk(ref.float(), 2048).long()
        differs = got != want
        gap = (ref.gather(-1, got) - ref.gather(-1, want)).abs()
        bound = 2 * ELEMENT_BOUND["exact"] * magnitude.amax(-1, keepdim=True)
        assert (gap <= bound)[differs].all(), f"{int(differs.sum())} entries differ beyond near-ties"


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernel compiles for sm_90 GPUs only")
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_chunk_sm90(monkeypatch, fmt):
    """The sm_90 kernel (pages of 64 as key tiles, 4 query rows a program), checked it ran: two sequences of
    37 rows (a partial last query tile), rows limited mid-page, at a page's last key, -1 (all -inf) and past
    the width; a page missing inside a length and one past the cache (their keys NaN, never read); a width
    ending mid-page and past the table; one key chunk a query tile and many."""
    if not ic.indexer_scores_sm90.takes(64, D, 64, 1, 37, torch.device(DEVICE)):
        pytest.skip("not an sm_90 GPU")
    calls, launch = [], ic.indexer_scores_sm90.paged_scores
    monkeypatch.setattr(ic.indexer_scores_sm90, "paged_scores", lambda *args: calls.append(1) or launch(*args))
    gen = torch.Generator(DEVICE).manual_seed(20)
    limit = torch.stack([200 + torch.arange(37, device=DEVICE) * 9, 600 - torch.arange(37, device=DEVICE) * 16])
    limit[0, 3], limit[0, 4], limit[1, 5], limit[1, 36] = -1, 127, 10**6, 0
    q, weights, cache, table, _ = make_case(gen, fmt, limit.clamp(max=639), block_size=64, max_blocks=10, n_heads=64)
    table[0, 2], table[1, 4] = -1, cache.shape[0]
    for programs in (1, 10**6):
        monkeypatch.setattr(_indexer_tiles, "num_programs_target", lambda device: programs)
        ic._KEPT.clear()
        for n_keys in (None, 600, 700):
            run_case(q, weights, cache, table, limit, fmt, n_keys=n_keys)
    assert len(calls) == 6


def test_static_width(fmt):
    """n_keys narrower than the table's capacity (positions past it are not scored) and wider
    (positions past the table are -inf); limits past the width are clamped."""
    gen = torch.Generator(DEVICE).manual_seed(12)
    limit = torch.tensor([[30, 2**40], [-2**40, 5]], device=DEVICE)
    case = list(make_case(gen, fmt, limit.clamp(max=47), block_size=8, max_blocks=6, n_heads=4))
    case[-1] = limit
    for n_keys in (21, 48, 70):
        run_case(*case, fmt, n_keys=n_keys)


@st.composite
def cases(draw):
    n_batch = draw(st.integers(1, 3))
    n_queries = draw(st.integers(1, 6))
    block_size = draw(st.sampled_from([4, 8, 16, 64]))
    max_blocks = draw(st.integers(1, 5))
    capacity = max_blocks * block_size
    limit = draw(st.lists(st.lists(st.integers(-2, capacity - 1), min_size=n_queries, max_size=n_queries),
                          min_size=n_batch, max_size=n_batch))
    fmt, presplit = draw(st.sampled_from(KEY_PATHS))
    return dict(fmt=fmt, presplit=presplit, limit=limit, block_size=block_size, max_blocks=max_blocks,
                n_heads=draw(st.sampled_from([1, 3, 16, 64])), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_reference(c):
    gen = torch.Generator(DEVICE).manual_seed(c["seed"])
    limit = torch.tensor(c["limit"], device=DEVICE)
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_presplit(monkeypatch, c["presplit"])
        run_case(*make_case(gen, c["fmt"], limit, c["block_size"], c["max_blocks"], c["n_heads"]), c["fmt"])


@pytest.mark.parametrize("programs", [1, 10**6], ids=["one-chunk", "one-tile-per-chunk"])
@pytest.mark.parametrize("config", [
    IndexerConfig(block_t=1, block_s=32, num_warps=4, num_stages=2),
    IndexerConfig(block_t=4, block_s=64, num_warps=8, num_stages=3),
    IndexerConfig(block_t=2, block_s=128, num_warps=8, num_stages=2),
], ids=lambda c: f"t{c.block_t}-s{c.block_s}")
@pytest.mark.parametrize("fmt", FORMATS)
def test_launch_shapes(monkeypatch, programs, config, fmt):
    """Every launch shape the benchmark tries, with the keys split into one chunk per query tile or one
    tile per chunk: chunks partly computed, partly -inf-filled, or all filled."""
    monkeypatch.setattr(_indexer_tiles, "num_programs_target", lambda device: programs)
    gen = torch.Generator(DEVICE).manual_seed(13)
    limit = torch.tensor([[5, 70, 0, 200, 31, -1]], device=DEVICE)
    q, weights, cache, table, limit = make_case(gen, fmt, limit, block_size=16, max_blocks=20, n_heads=16)
    out = torch.full((1, 6, 320), math.nan, device=DEVICE)
    fp8, geometry, _ = ic._check_scores_inputs(q, weights, cache, table, limit, None, out)
    assert ic._launch_paged(q, weights, cache, table, limit, out, Kept((fp8, geometry, config, 320))) is out
    check(out, q, weights, cache, table, limit, fmt)


def test_exact_cache_is_the_runtime_key_tensor():
    """The runtime's [num_slots, D] float32 keys, viewed as pages, and strided q / weights / limit /
    out: the same scores as contiguous copies."""
    gen = torch.Generator(DEVICE).manual_seed(14)
    limit = torch.tensor([[40, 12], [7, 55]], device=DEVICE)
    q, weights, cache, table, limit = make_case(gen, "exact", limit, block_size=8, max_blocks=8, n_heads=4)
    flat = cache.view(-1, D)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    weights_strided = weights.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full((64, 2, 2), math.nan, device=DEVICE).permute(1, 2, 0)
    paged_indexer_scores(q_strided, weights_strided, flat.view(-1, 8, D), table, limit.t().contiguous().t(), out=out)
    check(out, q, weights, cache, table, limit, "exact")


@pytest.mark.parametrize("fmt", FORMATS)
def test_topk_on_paged_decode_scores(fmt):
    """The decode step's selection: indexer_topk over the static-width scores (-inf past each length,
    unallocated pages) equals a stable sort; fewer valid keys than topk pad with -1."""
    gen = torch.Generator(DEVICE).manual_seed(15)
    limit = torch.tensor([[90], [10], [-1]], device=DEVICE)
    q, weights, cache, table, limit = make_case(gen, fmt, limit, block_size=16, max_blocks=8, n_heads=1)
    # One head with a negative weight: the keys whose relu clips score 0 (or -0.0) and are the best,
    # ~45 of them in row 0: exact ties across the top-32 boundary.
    scores = paged_indexer_scores(q, -weights.abs(), cache, table, limit)
    assert (scores[0] == 0).sum() > 32, "the case needs exact-zero ties across the boundary"
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    expected = torch.where(values == -math.inf, -1, order)[..., :32].to(torch.int32)
    assert torch.equal(indexer_topk(scores, 32), expected)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_step_is_graph_capturable(fmt):
    """write + scores + top-k captured once, replayed on new queries, limits and keys: the same result
    as eager calls (no host synchronisation, static shapes)."""
    gen = torch.Generator(DEVICE).manual_seed(16)
    limit = torch.tensor([[2300], [1000], [5], [-1]], device=DEVICE)
    q, weights, cache, table, limit = make_case(gen, fmt, limit, block_size=64, max_blocks=40, n_heads=64)
    new_keys = torch.randn((4, D), generator=gen, device=DEVICE)
    slots = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)

    def step():
        if fmt == "fp8":
            write_index_keys(cache, new_keys, slots)
        return indexer_topk(paged_indexer_scores(q, weights, cache, table, limit), 2048)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                                  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # The next step: new queries, each sequence one longer, its new key written into its slot.
    q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE).to(q.dtype))
    limit[:3] += 1
    pos = limit[:3, 0]
    slots[:3] = table[torch.arange(3, device=DEVICE), pos // 64].long() * 64 + pos % 64
    if fmt == "exact":
        cache.view(-1, D)[slots[:3]] = new_keys[:3]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

def _valid_args():
    gen = torch.Generator(DEVICE).manual_seed(20)
    return make_case(gen, "fp8", torch.tensor([[10, 20]], device=DEVICE), block_size=8, max_blocks=4, n_heads=4)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, w, c, t, l: (q.float(), w, c, t, l, {}), "float8_e4m3fn for an fp8"),
    (lambda q, w, c, t, l: (q[0], w, c, t, l, {}), r"\[b, t, H, D\]"),
    (lambda q, w, c, t, l: (q[..., :64], w, c, t, l, {}), "head dim 64"),
    (lambda q, w, c, t, l: (q, w[..., :3], c, t, l, {}), "weights must be"),
    (lambda q, w, c, t, l: (q, w.double(), c, t, l, {}), "weights must be"),
    (lambda q, w, c, t, l: (q, w, c[..., :131], t, l, {}), "fp8 index cache"),
    (lambda q, w, c, t, l: (q, w, c.view(torch.int8), t, l, {}), "cache must be an fp8 index cache"),
    (lambda q, w, c, t, l: (q, w, c[:, :4], t, l, {}), "contiguous"),
    (lambda q, w, c, t, l: (q, w, c[::2], t, l, {}), "contiguous"),
    (lambda q, w, c, t, l: (q, w, torch.zeros(c.numel() + 4, dtype=torch.uint8, device=DEVICE)[4:].view(c.shape),
                            t, l, {}), "16-byte"),
    (lambda q, w, c, t, l: (q, w, c, t.long(), l, {}), "block_table must be"),
    (lambda q, w, c, t, l: (q, w, c, t[:, None], l, {}), "block_table must be"),
    (lambda q, w, c, t, l: (q, w, c, t, l.float(), {}), "limit must be"),
    (lambda q, w, c, t, l: (q, w, c, t, l[:, :1], {}), "limit must be"),
    (lambda q, w, c, t, l: (q, w, c, t, l, {"n_keys": -1}), "n_keys must be"),
    (lambda q, w, c, t, l: (q, w, c, t, l, {"n_keys": 2**31}), "n_keys must be"),
    (lambda q, w, c, t, l: (q, w, c, t, l, {"out": torch.empty(1, 2, 31, device=DEVICE)}), "preallocated out"),
    (lambda q, w, c, t, l: (q, w, c, t, l.to("meta"), {}), "one device"),
    (lambda q, w, c, t, l: (q.float(), w, torch.zeros(4, 8, 128, dtype=torch.float64, device=DEVICE), t, l, {}),
     "cache must be"),
    (lambda q, w, c, t, l: (q.float(), w, torch.zeros(4, 8, 128, device=DEVICE)[None], t, l, {}), "exact index keys"),
    (lambda q, w, c, t, l: (q.float(), w, torch.zeros(4, 8, 128, device=DEVICE).transpose(1, 2), t, l, {}),
     "packed"),
    (lambda q, w, c, t, l: (q.float(), w, torch.zeros(4, 8, 64, device=DEVICE), t, l, {}), "head dim 128"),
])
def test_bad_input_raises_input_error(mutate, message):
    q, weights, cache, table, limit, kwargs = mutate(*_valid_args())
    with pytest.raises(InputError, match=message):
        paged_indexer_scores(q, weights, cache, table, limit, **kwargs)


def test_writer_bad_input():
    cache = new_index_cache(2, 8, device=DEVICE)
    keys = torch.randn(3, D, device=DEVICE)
    with pytest.raises(InputError, match="contiguous"):
        write_index_keys(cache[:, :4], keys, torch.arange(3, device=DEVICE))
    slots = torch.arange(3, device=DEVICE)
    for args, message in [
        ((cache, keys.double(), slots), "k must be"),
        ((cache, keys[:, :64], slots), "k must be"),
        ((cache, keys, slots.float()), "slots must be"),
        ((cache, keys, slots[:2]), "slots must be"),
        ((cache[..., :100], keys, slots), "fp8 index cache"),
        ((cache, keys.to("meta"), slots.to("meta")), "one device"),
    ]:
        with pytest.raises(InputError, match=message):
            write_index_keys(*args)
