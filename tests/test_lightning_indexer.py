"""lightning_indexer_scores against an fp64 torch reference written here (loop over heads), and
indexer_topk against a stable descending torch.sort.

Runs the real Triton kernel: compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU.
Every call gets a NaN-poisoned preallocated out; strided inputs keep NaN in the gaps of their buffers.
"""
import importlib
import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import _indexer_tiles
from minirt.kernels._launch import Kept
from minirt.kernels import lightning_indexer as li
from minirt.kernels.decode_topk import decode_topk
from minirt.kernels.lightning_indexer import IndexerConfig, indexer_topk, lightning_indexer_scores

ON_GPU = DEVICE == "cuda"
# Elementwise: |err| <= bound * sum_h |w_h| sum_d |q_hd k_d| (the magnitude of the terms summed).
# 16-bit inputs: exact products, fp32 sums: 2^-16, 256 fp32 ulps of the magnitude (fp32 rounding of
# 128-term dots and a 64-term head sum stays far below it). float32 inputs, three bf16 products of
# split operands (_indexer_tiles): each drops at most 3 * 2^-16 of its |q_d k_d|, hence 2^-14.
ELEMENT_BOUND = 2.0**-16
BF16X3_ELEMENT_BOUND = 2.0**-14
# Overall error norm relative to the magnitude norm: fp32 accumulation only, ~1e-7 typical; the GPU's
# summation order and tensor-core accumulation differ from numpy's. bf16x3: the dropped parts at
# random signs, 7e-8 (64 heads of 128) to 1.1e-6 (1 head of 16) on random inputs (a missing cross
# term: 2e-5, and the elementwise bound broken).
REL_TOL = 1e-5 if ON_GPU else 1e-6
BF16X3_REL_TOL = 2.0**-16


def reference(q, k, weights, limit):
    """fp64 oracle on the same (already rounded) inputs. Returns the scores (-inf where masked), the
    magnitude sum_h |w_h| sum_d |q_hd k_d| and the validity mask, all [..., T, S]."""
    q64, k64, w64 = q.double(), k.double(), weights.double()
    kt, kt_abs = k64.transpose(-1, -2), k64.abs().transpose(-1, -2)
    scores = torch.zeros((*q.shape[:-2], k.shape[-2]), dtype=torch.float64, device=q.device)
    magnitude = torch.zeros_like(scores)
    for h in range(q.shape[-2]):
        scores += (q64[..., h, :] @ kt).relu() * w64[..., h, None]
        magnitude += (q64[..., h, :].abs() @ kt_abs) * w64[..., h, None].abs()
    keys = torch.arange(k.shape[-2], device=q.device)
    valid = torch.ones_like(scores, dtype=torch.bool) if limit is None else keys <= limit[..., None]
    return scores.masked_fill(~valid, -math.inf), magnitude, valid


def check(out, q, k, weights, limit):
    ref, magnitude, valid = reference(q, k, weights, limit)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out == -math.inf, ~valid), "-inf exactly where s > limit"
    assert torch.isfinite(out[valid]).all(), "valid scores must be finite"
    fp32 = q.dtype == torch.float32
    err = (out.double()[valid] - ref[valid]).abs()
    excess = err - (BF16X3_ELEMENT_BOUND if fp32 else ELEMENT_BOUND) * magnitude[valid]
    assert valid.sum() == 0 or excess.max() <= 0, f"off by {excess.max():.3g} beyond the elementwise bound"
    # Normalised by the terms' magnitude, not by |ref|: a score that cancels across heads has a
    # relative error that no fp32 sum bounds (the elementwise check above covers it).
    if valid.any():
        rel = (err.norm() / magnitude[valid].norm()).item()
        assert rel < (BF16X3_REL_TOL if fp32 else REL_TOL), f"relative error {rel:.3g}"


def poisoned(shape, dtype=torch.float32, strided=False):
    """A NaN-filled tensor of `shape`, optionally a non-contiguous view (see strided_copy)."""
    x = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    return strided_copy(x) if strided else x


def strided_copy(x):
    """x's values in a non-contiguous view: dims stored in reverse order inside a padded buffer whose
    gaps hold NaN (floats) or a huge value (ints), so a wrong stride shows up in the result."""
    fill = math.nan if x.dtype.is_floating_point else 2**30
    buf = torch.full([n + 3 for n in reversed(x.shape)], fill, dtype=x.dtype, device=DEVICE)
    view = buf[tuple(slice(1, 1 + n) for n in reversed(x.shape))].permute(*reversed(range(x.dim())))
    view.copy_(x)
    return view


def random_inputs(gen, lead, n_keys, n_heads, head_dim, dtype):
    """q [*lead, H, D], k [*lead[:-1], S, D] in dtype; weights [*lead, H] fp32 of both signs, scaled
    as V3.2 scales them."""
    q = torch.randn((*lead, n_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    k = torch.randn((*lead[:-1], n_keys, head_dim), generator=gen, device=DEVICE).to(dtype)
    weights = torch.randn((*lead, n_heads), generator=gen, device=DEVICE) * (n_heads * head_dim) ** -0.5
    return q, k, weights


def run_case(q, k, weights, limit=None, strided=False, strided_out=False):
    if strided:
        q, k, weights = strided_copy(q), strided_copy(k), strided_copy(weights)
        limit = None if limit is None else strided_copy(limit)
    out = poisoned((*q.shape[:-2], k.shape[-2]), strided=strided_out)
    got = lightning_indexer_scores(q, k, weights, limit, out=out)
    assert got is out
    check(out, q, k, weights, limit)
    return out


def use_presplit(monkeypatch, presplit):
    """float32 keys split into bf16 parts once per call (presplit; any T) or as each tile is loaded."""
    monkeypatch.setattr(li, "PRESPLIT_MIN_QUERIES", 1 if presplit else 2**31)


LIMIT_KINDS = ["none", "causal", "random"]


def make_limit(kind, lead, n_keys, gen, dtype=torch.int32):
    """none; causal: the queries are the last T tokens of an S-token sequence (limit S - T + t, negative
    when T > S); random: any value in [-3, S + 3)."""
    if kind == "none":
        return None
    if kind == "causal":
        n_queries = lead[-1]
        return (torch.arange(n_queries, device=DEVICE) + n_keys - n_queries).to(dtype).expand(lead).contiguous()
    return torch.randint(-3, n_keys + 3, lead, generator=gen, device=DEVICE).to(dtype)


@st.composite
def cases(draw):
    batched = draw(st.booleans())
    n_queries = draw(st.integers(1, 9 if not ON_GPU else 300))
    return dict(
        lead=(draw(st.integers(1, 3)), n_queries) if batched else (n_queries,),
        n_keys=draw(st.integers(1, 300 if not ON_GPU else 3000)),
        n_heads=draw(st.sampled_from([1, 3, 4, 64] + ([128, 256] if ON_GPU else []))),
        head_dim=draw(st.sampled_from([64, 128] + ([16, 256] if ON_GPU else []))),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        limit=draw(st.sampled_from(LIMIT_KINDS)), limit_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        strided=draw(st.booleans()), strided_out=draw(st.booleans()), presplit=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# Few examples on the GPU: each new shape/dtype combination is a compile.
@settings(max_examples=40 if not ON_GPU else 25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_matches_reference(c):
    item_size = torch.empty((), dtype=c["dtype"]).element_size()
    assume(triton.next_power_of_2(c["n_heads"]) * c["head_dim"] * item_size <= li.MAX_Q_ROW_BYTES)
    gen = torch.Generator(DEVICE).manual_seed(c["seed"])
    q, k, weights = random_inputs(gen, c["lead"], c["n_keys"], c["n_heads"], c["head_dim"], c["dtype"])
    limit = make_limit(c["limit"], c["lead"], c["n_keys"], gen, c["limit_dtype"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_presplit(monkeypatch, c["presplit"])
        run_case(q, k, weights, limit, c["strided"], c["strided_out"])


@pytest.mark.parametrize("n_queries, n_keys, n_heads, head_dim", [
    (7, 7, 64, 128),        # V3.2 heads, prompt over its own keys, odd T
    (13, 13, 4, 128),       # tiny preset
    (5, 259, 1, 64),        # one head (padded to the dot's minimum width), S just past two tiles
    (3, 130, 3, 64),        # head count not a power of two
])
@pytest.mark.parametrize("dtype, presplit", [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)],
                         ids=["bf16", "fp32-split-in-loop", "fp32-presplit"])
def test_causal_prefill(monkeypatch, n_queries, n_keys, n_heads, head_dim, dtype, presplit):
    """limit = the query's position in a prompt of n_keys tokens: -inf exactly above the diagonal;
    float32 keys split into bf16 parts either way."""
    use_presplit(monkeypatch, presplit)
    gen = torch.Generator(DEVICE).manual_seed(n_queries * 1000 + n_keys)
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, n_heads, head_dim, dtype)
    limit = torch.arange(n_keys - n_queries, n_keys, device=DEVICE)
    out = run_case(q, k, weights, limit)
    assert torch.isinf(out[0, n_keys - n_queries + 1:]).all() and torch.isfinite(out[-1]).all()


def test_batched_decode_ignores_keys_past_limit():
    """Decode over per-sequence gathered caches: one query per sequence, different lengths; keys past a
    sequence's position (cache padding) hold NaN and must not reach any valid score."""
    gen = torch.Generator(DEVICE).manual_seed(21)
    n_batch, n_keys = 4, 700
    q, k, weights = random_inputs(gen, (n_batch, 1), n_keys, 64, 128, torch.bfloat16)
    positions = torch.tensor([[0], [129], [699], [383]], device=DEVICE)
    for b in range(n_batch):
        k[b, int(positions[b]) + 1:] = math.nan
    out = run_case(q, k, weights, positions)
    assert torch.isfinite(out[2]).all() and torch.isfinite(out[0, 0, :1]).all()


def test_limit_extremes():
    """Negative limits mask the whole row; limits at or past S (int64 past 2^32 too) mask nothing."""
    gen = torch.Generator(DEVICE).manual_seed(22)
    q, k, weights = random_inputs(gen, (5,), 200, 4, 64, torch.bfloat16)
    limit = torch.tensor([-1, -2**40, 199, 200, 2**40], dtype=torch.int64, device=DEVICE)
    out = run_case(q, k, weights, limit)
    assert (out[:2] == -math.inf).all() and torch.isfinite(out[2:]).all()


@pytest.mark.parametrize("programs", [1, 10**6], ids=["one-chunk", "one-tile-per-chunk"])
@pytest.mark.parametrize("config", [
    IndexerConfig(block_t=1, block_s=32, num_warps=4, num_stages=2),
    IndexerConfig(block_t=2, block_s=64, num_warps=4, num_stages=3),
    IndexerConfig(block_t=4, block_s=128, num_warps=8, num_stages=2),
], ids=lambda c: f"t{c.block_t}-s{c.block_s}")
def test_launch_shapes(monkeypatch, programs, config):
    """Every launch shape the benchmark tries, with the keys split into one chunk per query tile or one
    tile per chunk: chunks whose tiles are partly computed, partly -inf-filled, or all filled."""
    monkeypatch.setattr(_indexer_tiles, "num_programs_target", lambda device: programs)
    monkeypatch.setattr(li, "_KEPT", {})   # (the launch shape is kept per call signature)
    gen = torch.Generator(DEVICE).manual_seed(23)
    n_queries, n_keys = 6, 333
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, 64, 128, torch.bfloat16)
    limit = torch.tensor([5, 70, 0, 200, 31, 64], device=DEVICE)
    out = poisoned((n_queries, n_keys))
    assert lightning_indexer_scores(q, k, weights, limit, out=out, config=config) is out
    check(out, q, k, weights, limit)


def test_default_config_shapes():
    """256 (query, head) columns: 4 rows of 64 heads in prefill, 1 in decode, 64 rows of 4 heads; fewer
    columns and stages where fp32 tiles would overflow shared memory."""
    assert li.default_config(4096, 64, 128).block_t == 4
    assert li.default_config(1, 64, 128).block_t == 1
    assert li.default_config(4096, 4, 128).block_t == 64
    assert li.default_config(4096, 4, 256, element_size=4) == IndexerConfig(block_t=16, block_s=64, num_stages=1)


def test_64bit_batch_offsets():
    """Batch strides past 2^31 elements: q/k/weights batch offsets must be 64-bit. On the CPU the 4 GB
    buffers are allocated lazily and only the rows used get physical pages."""
    gen = torch.Generator(DEVICE).manual_seed(24)
    q, k, weights = random_inputs(gen, (2, 3), 50, 4, 64, torch.bfloat16)
    far = 2**31 + 64
    k_buf = torch.empty(far + k[0].numel(), dtype=torch.bfloat16, device=DEVICE)
    q_buf = torch.empty(far + q[0].numel(), dtype=torch.bfloat16, device=DEVICE)
    far_k = k_buf.as_strided(k.shape, (far, *k.stride()[1:]))
    far_q = q_buf.as_strided(q.shape, (far, *q.stride()[1:]))
    far_k.copy_(k)
    far_q.copy_(q)
    run_case(far_q, far_k, weights, torch.tensor([[49, 3, 0], [10, 49, 20]], device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="an 8 GB output; the interpreter would take hours")
def test_output_beyond_2_31_elements():
    """T * S > 2^31: out row offsets must be 64-bit. Checked on a sample of rows, the last ones too."""
    gen = torch.Generator(DEVICE).manual_seed(25)
    n_queries, n_keys = 2**16 + 3, 2**15 + 5
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, 1, 64, torch.bfloat16)
    limit = torch.arange(n_queries, device=DEVICE) % (n_keys + 7)
    out = lightning_indexer_scores(q, k, weights, limit)
    rows = torch.cat([torch.arange(0, n_queries, 4099, device=DEVICE), torch.arange(n_queries - 3, n_queries, device=DEVICE)])
    check(out[rows], q[rows], k, weights[rows], limit[rows])


@pytest.mark.skipif(not ON_GPU, reason="full DeepSeek-V3.2 shape; the interpreter would take minutes")
def test_deepseek_shape():
    gen = torch.Generator(DEVICE).manual_seed(26)
    n_queries, n_keys = 256, 8192
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, 64, 128, torch.bfloat16)
    run_case(q, k, weights, torch.arange(n_keys - n_queries, n_keys, device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernel compiles for sm_90 GPUs only")
def test_prefill_chunk_sm90(monkeypatch):
    """float32 q of 64 heads of 128 and keys [S, 128] (DeepSeek-V4's CSA keys) take the paged cache's sm_90
    kernel, checked it ran: 37 rows (a partial last query tile), S ending mid-page, limits mid-page, at a
    page's last key, -1 (all -inf) and past S; strided inputs; one key chunk a query tile and many."""
    if not li.indexer_scores_sm90.takes(64, 128, 64, 1, 37, torch.device(DEVICE)):
        pytest.skip("not an sm_90 GPU")
    calls, launch = [], li.indexer_scores_sm90.paged_scores
    monkeypatch.setattr(li.indexer_scores_sm90, "paged_scores", lambda *args: calls.append(1) or launch(*args))
    gen = torch.Generator(DEVICE).manual_seed(27)
    n_keys = 700
    q, k, weights = random_inputs(gen, (37,), n_keys, 64, 128, torch.float32)
    limit = 300 + torch.arange(37, device=DEVICE) * 9
    limit[3], limit[4], limit[5], limit[36] = -1, 127, 10**6, 0
    for programs in (1, 10**6):
        monkeypatch.setattr(_indexer_tiles, "num_programs_target", lambda device: programs)
        li._KEPT.clear()
        for strided in (False, True):
            run_case(q, k, weights, limit, strided=strided, strided_out=strided)
    assert len(calls) == 4


def test_empty_sizes():
    gen = torch.Generator(DEVICE).manual_seed(27)
    q, k, weights = random_inputs(gen, (3,), 5, 4, 64, torch.bfloat16)
    assert lightning_indexer_scores(q[:0], k, weights[:0]).shape == (0, 5)
    assert lightning_indexer_scores(q, k[:0], weights).shape == (3, 0)


def stable_topk_reference(scores, topk):
    """The first topk of a stable descending sort; -inf entries and padding are -1."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    order = torch.where(values == -math.inf, -1, order)[..., :topk]
    return torch.nn.functional.pad(order, (0, topk - order.shape[-1]), value=-1).to(torch.int32)


def tied_scores(gen, shape):
    """Rows of many exact ties (a few levels: 0 with both signs, extremes +inf, +-max, denormals; -inf
    masks) alternating with rows of distinct random values and -inf masks; one row fully masked."""
    levels = torch.tensor([-2.5, -1.0, -0.0, 0.0, 0.0, 0.75, 3.0, -math.inf, math.inf, 3.4e38, -3.4e38, 1e-45, -1e-45],
                          device=DEVICE)
    pick = torch.randint(0, len(levels), shape, generator=gen, device=DEVICE)
    tied = levels[pick]
    distinct = torch.randn(shape, generator=gen, device=DEVICE).masked_fill(pick < 2, -math.inf)
    rows = torch.arange(shape[-2], device=DEVICE)[:, None]
    scores = torch.where(rows % 2 == 0, tied, distinct)
    scores[..., 0, :] = -math.inf
    return scores


@pytest.fixture(params=["torch-topk", "candidates", "candidates-overflowing-4-bit-digits"]
                + (["decode-topk"] if ON_GPU else []))
def topk_path(request, monkeypatch):
    """indexer_topk's selection: torch.topk and the tie kernel over the row (few or narrow rows), or
    over the row's candidates (many wide rows: prefill chunks; here any row of 2 groups of 2 per
    selected key), and those with room for k candidates only, so that most rows overflow into the radix
    selection (4-bit digits in 128-score steps: eight digit passes over rows of several steps); compiled,
    also decode_topk's radix select (few wide rows; here rows of any width)."""
    if request.param == "decode-topk":
        monkeypatch.setattr(li, "_RADIX_MIN_KEYS", 1)
        monkeypatch.setattr(li, "_RADIX_MAX_ROWS", 1 << 30)
    else:
        monkeypatch.setattr(li, "_RADIX_MAX_ROWS", 0)
    if request.param not in ("torch-topk", "decode-topk"):
        for name, value in (("_PRESELECT_MIN_ROWS", 1), ("_PRESELECT_MIN_GROUPS_PER_SELECTED", 1), ("_GROUP", 2)):
            monkeypatch.setattr(li, name, value)
    if request.param == "candidates-overflowing-4-bit-digits":
        for name, value in (("_CANDIDATES_PER_SELECTED", 1), ("_RADIX_BITS", 4), ("_RADIX_BLOCK", 128)):
            monkeypatch.setattr(li, name, value)
    calls, preselect = [], li._preselect
    monkeypatch.setattr(li, "_preselect", lambda *args: calls.append(args) or preselect(*args))
    radix, dispatched = importlib.import_module("minirt.kernels.decode_topk"), []
    monkeypatch.setattr(radix, "decode_topk", lambda *args: dispatched.append(args) or decode_topk(*args))
    if request.param == "decode-topk":   # every selection dispatched: the torch.topk path's key order never runs
        monkeypatch.setattr(li, "_order_keys", lambda *args: pytest.fail("torch.topk path taken"))
    yield request.param
    assert not calls or request.param not in ("torch-topk", "decode-topk"), "candidates taken on the torch.topk path"
    assert not dispatched or request.param == "decode-topk", "decode_topk taken"


@pytest.mark.parametrize("shape, topk", [
    ((6, 300), 40), ((6, 300), 300), ((6, 50), 64), ((2, 3, 129), 1), ((4, 2048), 2048 - 5), ((3, 0), 4),
])
def test_topk_matches_stable_sort_on_ties(shape, topk, topk_path):
    gen = torch.Generator(DEVICE).manual_seed(shape[-1] + topk)
    scores = tied_scores(gen, shape)
    got = indexer_topk(scores, topk)
    assert got.dtype == torch.int32 and got.shape == (*shape[:-1], topk)
    assert torch.equal(got, stable_topk_reference(scores, topk))


def test_topk_tie_across_the_boundary_only(topk_path):
    """Distinct scores except that the k-th and (k+1)-th largest are equal: the lower key index must be
    selected, in rows where it comes first and in rows where it comes second."""
    gen = torch.Generator(DEVICE).manual_seed(30)
    n_rows, n_keys, topk = 16, 200, 50
    scores = torch.stack([torch.randperm(n_keys, generator=gen, device=DEVICE) for _ in range(n_rows)]).float()
    # Ranks topk and topk + 1 (values n_keys - topk and n_keys - topk - 1) get the same value.
    scores[scores == n_keys - topk - 1] = n_keys - topk
    assert torch.equal(indexer_topk(scores, topk), stable_topk_reference(scores, topk))


def test_topk_masked_ties_take_the_fast_path(monkeypatch):
    """-inf entries tie, but every one becomes -1: rows of distinct finite scores are never keyed as a
    whole row (the slow, exact selection); only the selection (topk + 1 per row) is."""
    exact_rows = []
    order_keys = li._order_keys
    monkeypatch.setattr(li, "_order_keys", lambda values, indices: exact_rows.append(values.shape[-1]) or order_keys(values, indices))
    gen = torch.Generator(DEVICE).manual_seed(31)
    n_rows, n_keys = 8, 300
    scores = torch.randn((n_rows, n_keys), generator=gen, device=DEVICE)
    scores = scores.masked_fill(torch.arange(n_keys, device=DEVICE) > 3 + 40 * torch.arange(n_rows, device=DEVICE)[:, None],
                                -math.inf)
    assert torch.equal(indexer_topk(scores, 100), stable_topk_reference(scores, 100))
    assert exact_rows == [101], "only the selection (topk + 1 per row) is keyed, never a whole row"


def test_topk_on_indexer_scores(topk_path):
    """Kernel output of a causal prefill where every head's relu clips for some keys (exact 0 scores)."""
    gen = torch.Generator(DEVICE).manual_seed(28)
    n_queries, n_keys = 9, 150
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, 1, 64, torch.bfloat16)
    scores = lightning_indexer_scores(q, k, weights, torch.arange(n_keys - n_queries, n_keys, device=DEVICE))
    assert (scores == 0).sum() > n_keys, "the case needs many exact-zero ties"
    torch.testing.assert_close(indexer_topk(scores, 100), stable_topk_reference(scores, 100), rtol=0, atol=0)


@pytest.mark.parametrize("per_selected", [4, 1], ids=["room", "overflowing"])
def test_candidates_hold_the_top_set(monkeypatch, per_selected):
    """The candidates of rows of many 128-score steps (groups of 4): every slot written (the outputs
    start as NaN and -7); the stable top-k's keys all among them with their scores, in key order, then
    -inf entries of index S; a row of more than C candidates holds exactly the top-k (radix selection).
    Rows: the k-th score tied far beyond the boundary (+-0.0 and a repeated value), distinct values,
    -inf masks with fewer than k finite scores, one value throughout, every third score -inf."""
    gen = torch.Generator(DEVICE).manual_seed(34)
    n_rows, n_keys, topk = 6, 1000, 100
    scores = torch.randn((n_rows, n_keys), generator=gen, device=DEVICE)
    scores[0] = torch.where(scores[0] > -0.5, torch.where(scores[0] > 0, 0.0, -0.0), scores[0])
    scores[1] = torch.where(scores[1].abs() < 1, 0.625, scores[1])
    scores[3, 60:] = -math.inf
    scores[4] = -3.0
    scores[5, ::3] = -math.inf
    empty, prefilled = torch.empty, []

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        prefilled.append(out.fill_(math.nan if out.dtype.is_floating_point else -7))
        return out
    for name, value in (("_GROUP", 4), ("_RADIX_BLOCK", 128), ("_CANDIDATES_PER_SELECTED", per_selected)):
        monkeypatch.setattr(li, name, value)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", poisoned)
        values, indices = li._preselect(scores, topk)
    assert [t.data_ptr() for t in prefilled[:2]] == [values.data_ptr(), indices.data_ptr()]
    assert values.shape == indices.shape == (n_rows, per_selected * topk)
    order = torch.sort(li._order_keys(scores, torch.arange(n_keys, device=DEVICE).expand_as(scores)),
                       descending=True).values
    top = li._key_indices(order)[:, :topk]
    overflowed = 0
    for row in range(n_rows):
        real = indices[row] < n_keys
        n_real = int(real.sum())
        assert real[:n_real].all() and (indices[row, n_real:] == n_keys).all(), f"row {row}: -inf pads last"
        assert torch.isneginf(values[row, n_real:]).all()
        held = indices[row, :n_real].long()
        assert torch.equal(values[row, :n_real], scores[row, held])
        assert set(top[row].tolist()) <= set(held.tolist()), f"row {row} lacks part of the top-k"
        if n_real == topk and not torch.equal(held, held.sort().values):
            overflowed += 1                           # the radix selection: exactly the top-k
        else:
            assert torch.equal(held, held.sort().values), f"row {row}: candidates in key order"
    assert overflowed > 0 if per_selected == 1 else overflowed == 0


@pytest.mark.parametrize("group, block", [(4, 128), (16, 2048)])
def test_tau_is_the_kth_largest_group_maximum(monkeypatch, group, block):
    """tau of each row against torch's k-th largest of the group maxima (the last group short), its maxima
    scratch poisoned (NaN): rows of random scores, +-0.0 at the boundary, -inf masks leaving fewer than k
    finite groups (tau -inf), one value throughout, a large-magnitude row, and a row whose finite scores
    are all in the short last group."""
    gen = torch.Generator(DEVICE).manual_seed(37)
    n_rows, topk = 7, 70
    n_keys = 2 * group * topk + group // 2 + 1    # a short last group; with group 4, two steps of maxima
    scores = torch.randn((n_rows, n_keys), generator=gen, device=DEVICE)
    scores[1] = torch.where(scores[1] > -0.3, torch.where(scores[1] > 0, 0.0, -0.0), scores[1])
    scores[2, group * (topk - 1):] = -math.inf
    scores[3] = 2.5
    scores[4] *= 1e30
    scores[5, :] = -math.inf
    scores[5, -1] = 7.0
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(math.nan))
    for name, value in (("_GROUP", group), ("_TAU_BLOCK", block)):
        monkeypatch.setattr(li, name, value)
    got = li._tau(scores, topk)
    padded = torch.nn.functional.pad(scores, (0, -n_keys % group), value=-math.inf)
    want = torch.topk(padded.view(n_rows, -1, group).amax(-1), topk).values[:, -1]
    assert torch.equal(got, want), (got, want)
    assert torch.isneginf(got[2]) and torch.isneginf(got[5]) and got[3] == 2.5


def test_topk_takes_candidates_for_many_wide_rows(monkeypatch):
    """indexer_topk of _PRESELECT_MIN_ROWS rows or more of _PRESELECT_MIN_GROUPS_PER_SELECTED * _GROUP *
    topk scores or more (a prefill chunk over a long context) selects over candidates, fewer rows or
    narrower ones (decode, short contexts) through torch.topk over the row; both give the stable top-k."""
    calls, preselect = [], li._preselect
    monkeypatch.setattr(li, "_preselect", lambda *args: calls.append(args[0].shape) or preselect(*args))
    monkeypatch.setattr(li, "_PRESELECT_MIN_ROWS", 4)
    monkeypatch.setattr(li, "_GROUP", 4)
    gen = torch.Generator(DEVICE).manual_seed(35)
    for shape, preselected in (((2, 2, 800), True), ((3, 800), False), ((4, 799), False)):
        scores = tied_scores(gen, shape)
        assert torch.equal(indexer_topk(scores, 100), stable_topk_reference(scores, 100))
        assert bool(calls) == preselected, shape
        calls.clear()


@pytest.mark.skipif(not ON_GPU, reason="a prefill chunk's 2048 x 131072 scores; the interpreter would take hours")
def test_topk_prefill_chunk_shape():
    """indexer_topk at a V3.2 prefill chunk's shape (2048 rows over 131072 keys, top-2048: the candidates'
    path with its defaults): causal -inf masks, rows of random scores, rows of few levels (ties across
    the boundary: more candidates than room, the radix selection), rows of clustered top scores; the
    stable top-k in every row."""
    gen = torch.Generator(DEVICE).manual_seed(36)
    n_rows, n_keys, topk = 2048, 131072, 2048
    scores = torch.randn((n_rows, n_keys), generator=gen, device=DEVICE)
    scores[1::4] = torch.randint(0, 6, (len(range(1, n_rows, 4)), n_keys), generator=gen, device=DEVICE).float()
    scores[2::4, 5000:5000 + 4 * topk] += 10.0
    limit = n_keys - n_rows + torch.arange(n_rows, device=DEVICE)
    scores.masked_fill_(torch.arange(n_keys, device=DEVICE) > limit[:, None], -math.inf)
    calls, preselect = [], li._preselect
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(li, "_preselect", lambda *args: calls.append(args) or preselect(*args))
        got = indexer_topk(scores, topk)
    assert calls, "the candidates' path"
    assert torch.equal(got, stable_topk_reference(scores, topk))


@pytest.mark.parametrize("rows_per_program", [1, 4, 256])
def test_topk_tie_kernel_repairs_any_selection(monkeypatch, rows_per_program):
    """The tie kernel on selections torch.topk could have returned: rows whose topk-th and (topk + 1)-th
    values tie hold the tied keys with the highest indices (the worst arbitrary choice, which CPU
    torch.topk never makes); after the repair they hold the lowest ones. Rows without such a tie, and
    rows whose tie is at -inf, are left as they were. Interpreted, programs take several rows (one
    when compiled): each count of rows per program is tried."""
    monkeypatch.setattr(li, "_TIE_INTERPRETED_ROWS", rows_per_program)
    gen = torch.Generator(DEVICE).manual_seed(32)
    n_rows, n_keys, topk = 6, 400, 60
    scores = torch.randn((n_rows, n_keys), generator=gen, device=DEVICE)
    tie_value = scores.sort(-1, descending=True).values[:, topk - 10, None]
    levels = torch.randint(0, 4, (n_rows, n_keys), generator=gen, device=DEVICE)
    # Rows 0-2: ~100 keys at one value across the boundary (-0.0 and +0.0 in row 2, ~30 keys above
    # them); row 3: distinct;
    # row 4: fewer than topk + 1 finite keys (-inf tie); row 5: the largest value tied everywhere.
    scores[:3] = torch.where(levels[:3] == 0, tie_value[:3], scores[:3])
    above = (levels[2] == 1) & (torch.arange(n_keys, device=DEVICE) < 120)
    scores[2] = torch.where(levels[2] == 0, torch.where(levels[2].roll(1) < 2, -0.0, 0.0),
                            torch.where(above, scores[2].abs() + 1, -scores[2].abs() - 1))
    scores[4, 30:] = -math.inf
    scores[5] = 7.5
    order = torch.sort(li._order_keys(scores, torch.arange(n_keys, device=DEVICE).expand_as(scores)),
                       descending=True).values
    best = li._key_indices(order)[:, :topk + 1].long()
    values = scores.gather(-1, best)
    # Swap the selected tied keys for the highest-indexed keys of the same value.
    worst = best.clone()
    for row in range(n_rows):
        boundary = values[row].min()
        tied = (scores[row] == boundary).nonzero().flatten()
        chosen = values[row] == boundary
        worst[row, chosen] = tied[-int(chosen.sum()):]
    selected_values, selected_indices = values.clone(), worst.clone()
    li._resolve_boundary_ties(scores, selected_values, selected_indices, Kept())
    for row in range(n_rows):
        got = sorted(zip(selected_indices[row].tolist(), selected_values[row].tolist()))
        repaired = row in (0, 1, 2, 5)
        expected = best[row] if repaired else worst[row]
        assert got == sorted(zip(expected.tolist(), scores[row, expected].tolist())), f"row {row}"
        assert not repaired or not torch.equal(best[row].sort().values, worst[row].sort().values), "test setup"


@pytest.mark.skipif(not ON_GPU, reason="host synchronisation and CUDA graphs need a GPU")
def test_topk_is_sync_free_and_graph_capturable(topk_path):
    """indexer_topk on rows with boundary ties raises no host synchronisation (sync debug mode
    "error"), and a captured graph replays it on new scores to the stable-sort reference. CPU
    tensors are rejected when compiled (the tie kernel runs on the GPU)."""
    gen = torch.Generator(DEVICE).manual_seed(33)
    shape, topk = (16, 5000), 2048
    scores = tied_scores(gen, shape)
    with pytest.raises(InputError, match="CUDA"):
        indexer_topk(scores.cpu(), topk)
    indexer_topk(scores, topk)                 # compile first: the check is about the steady state
    assert_sync_free_and_replayed(indexer_topk, scores, topk, lambda: tied_scores(gen, shape))


def assert_sync_free_and_replayed(select, scores, topk, new_scores):
    """select(scores, topk) raises no host synchronisation (sync debug mode "error"), and a CUDA graph
    capturing it replays on new_scores() (copied into scores) to the stable-sort reference."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        select(scores, topk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select(scores, topk)
    scores.copy_(new_scores())
    graph.replay()
    assert torch.equal(captured, stable_topk_reference(scores, topk))


def _valid_args():
    gen = torch.Generator(DEVICE).manual_seed(29)
    return random_inputs(gen, (3,), 8, 4, 64, torch.bfloat16)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, k, w: (q.double(), k.double(), w, {}), "bfloat16, float16 or float32"),
    (lambda q, k, w: (q, k.half(), w, {}), "differs from q dtype"),
    (lambda q, k, w: (q[0], k, w, {}), r"\[T, H, D\]"),
    (lambda q, k, w: (q, k[None], w, {}), "k must be"),
    (lambda q, k, w: (q, k[:, :32], w, {}), "does not match q"),
    (lambda q, k, w: (q[None].expand(2, 3, 4, 64), k[None].expand(3, 8, 64), w[None].expand(2, 3, 4), {}),
     "does not match q"),
    (lambda q, k, w: (q[..., :48], k[:, :48], w, {}), "power of two"),
    (lambda q, k, w: (q[:, :1].expand(3, 513, 64), k, w[:, :1].expand(3, 513), {}), "unsupported H = 513"),
    (lambda q, k, w: (q.float()[:, :1].expand(3, 257, 64), k.float(), w[:, :1].expand(3, 257), {}),
     "unsupported H = 257"),
    (lambda q, k, w: (q[:, :0], k, w[:, :0], {}), "unsupported H = 0"),
    (lambda q, k, w: (q, k, w.bfloat16(), {}), "weights must be"),
    (lambda q, k, w: (q, k, w[:, :3], {}), "weights must be"),
    (lambda q, k, w: (q, k, w, {"limit": torch.zeros(3, device=DEVICE)}), "limit must be"),
    (lambda q, k, w: (q, k, w, {"limit": torch.zeros(4, dtype=torch.int32, device=DEVICE)}), "limit must be"),
    (lambda q, k, w: (q, k, w, {"out": torch.empty(3, 9, device=DEVICE)}), "preallocated out"),
    (lambda q, k, w: (q, k, w, {"out": torch.empty(3, 8, dtype=torch.float64, device=DEVICE)}), "preallocated out"),
    (lambda q, k, w: (q, k.to("meta"), w, {}), "one device"),
    (lambda q, k, w: (q.to("meta"), k.to("meta"), w.to("meta"), {}), "meta"),
    (lambda q, k, w: ("q", k, w, {}), "torch.Tensor"),
    (lambda q, k, w: (q, k, w, {"config": (4, 64, 8, 3)}), "IndexerConfig"),
])
def test_bad_input_raises_input_error(mutate, message):
    q, k, weights, kwargs = mutate(*_valid_args())
    with pytest.raises(InputError, match=message):
        lightning_indexer_scores(q, k, weights, **kwargs)


@pytest.mark.parametrize("scores, topk, message", [
    (torch.zeros(3, 5, dtype=torch.float64), 2, "float32"),
    (torch.zeros(3, 5), 0, "positive"),
    (torch.zeros(3, 5), True, "positive"),
    (torch.zeros(3, 5), 2.0, "positive"),
])
def test_topk_bad_input(scores, topk, message):
    with pytest.raises(InputError, match=message):
        indexer_topk(scores.to(DEVICE), topk)


@pytest.mark.skipif(not ON_GPU, reason="CPU tensors are valid input under the interpreter")
def test_cpu_tensors_rejected_when_compiled():
    q, k, weights = (t.cpu() for t in _valid_args())
    with pytest.raises(InputError, match="CUDA"):
        lightning_indexer_scores(q, k, weights)


# ----------------------------------------------------------------------------------------------
# float32 inputs: three bf16 products of split operands
# ----------------------------------------------------------------------------------------------

@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    hi, lo = _indexer_tiles.split_bf16(tl.load(x_ptr + offs, mask=offs < n), INTERPRETED)
    tl.store(hi_ptr + offs, hi.to(tl.float32), mask=offs < n)
    tl.store(lo_ptr + offs, lo.to(tl.float32), mask=offs < n)


def test_bf16_split_rounds_to_nearest_even():
    """The scores kernels' split of float32 operands (the hardware conversion compiled, integer
    rounding interpreted): hi is x rounded to the nearest bfloat16, ties to even, as torch rounds;
    lo is x - hi rounded likewise; x = hi + lo within 2^-16 |x|. On halfway cases of both parities,
    their neighbours, negatives, subnormals, values near the float32 extremes and random values of
    50 decades."""
    halfway = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3 * 2.0**-130, 3.0e38, -1.0e-38])
    scale = 10.0 ** torch.arange(-25, 25).repeat(10)
    x = torch.cat([halfway, torch.nextafter(halfway, torch.zeros(())),
                   torch.randn(500, generator=torch.Generator().manual_seed(41)) * scale]).to(DEVICE)
    hi, lo = torch.full_like(x, math.nan), torch.full_like(x, math.nan)
    _split_kernel[(1,)](x, hi, lo, x.numel(), BLOCK=triton.next_power_of_2(x.numel()),
                        INTERPRETED=_indexer_tiles.INTERPRET)
    assert torch.equal(hi, x.bfloat16().float())
    assert torch.equal(lo, (x - hi).bfloat16().float())
    assert ((x - hi - lo).abs() <= x.abs() * 2.0**-16 + 2.0**-133).all()


def test_float32_scores_accuracy_and_topk():
    """float32 inputs (the exact mode): against the fp64 oracle, the error norm below 1e-6 of the
    magnitude norm, 30 times below that of one bf16 product of the rounded inputs; the top-64 of 600
    keys equals the top-64 of eager float32 torch scores (the reference model's arithmetic) and of
    the fp64 oracle, but for keys whose oracle scores are closer than the error bound."""
    gen = torch.Generator(DEVICE).manual_seed(42)
    n_queries, n_keys, topk = 8, 600, 64
    q, k, weights = random_inputs(gen, (n_queries,), n_keys, 4, 128, torch.float32)
    out = lightning_indexer_scores(q, k, weights)
    ref, magnitude, _ = reference(q, k, weights, None)
    rel = ((out.double() - ref).norm() / magnitude.norm()).item()
    assert rel < 1e-6, f"relative error {rel:.3g}"
    plain, _, _ = reference(q.bfloat16(), k.bfloat16(), weights, None)
    assert rel < ((plain - ref).norm() / magnitude.norm()).item() / 30, "no better than one bf16 product"
    eager = torch.einsum("thd,sd->ths", q, k).relu().mul(weights[..., None]).sum(1)
    got = indexer_topk(out, topk).long()
    bound = BF16X3_ELEMENT_BOUND * magnitude.amax(-1, keepdim=True)
    for want in (stable_topk_reference(eager, topk).long(), stable_topk_reference(ref.float(), topk).long()):
        differs = got != want
        gap = (ref.gather(-1, got) - ref.gather(-1, want)).abs()
        assert (gap <= 2 * bound)[differs].all(), f"{int(differs.sum())} entries differ beyond near-ties"
