"""sparse_mla_prefill against an fp64 torch reference (gather, mask, logsumexp) written here.

Runs the real Triton kernel: compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU.
"""
import inspect
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels.sparse_mla_prefill import PrefillConfig, default_config, sparse_mla_prefill
from minirt.kernels import sparse_mla_prefill_sm90 as sm90
from minirt.kernels._launch import Kept

ON_GPU = DEVICE == "cuda"


pytestmark = pytest.mark.usefixtures("kernel_path")


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# out: elementwise |err| <= OUT_ATOL + OUT_RTOL * |ref| + u_P * sum_j w_j |v_j|. The first two terms
# cover fp32 accumulation and the final rounding of out to q's dtype (unit roundoff 2^-8 for bf16).
# The third is the one deviation: compiled on the GPU, the kernel rounds the softmax weights P to q's
# dtype for the P.V tensor-core dot (as FlashMLA does), an error of up to u_P (2^-8 bf16, 2^-11 fp16)
# per weight. Relative to |out| it is unbounded where the weighted values cancel, so it is bounded by
# the reference's sum_j w_j |v_j| instead. The interpreter keeps P in fp32: u_P = 0 there.
OUT_ATOL, OUT_RTOL = 8e-4, 3 / 128
P_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11} if ON_GPU else {torch.bfloat16: 0.0, torch.float16: 0.0}
# lse / max_logits: relative 2/65536, plus the fp32 rounding budget of a d_qk-term dot product,
# 2^-18 * sm_scale * max_j sum_d |q_d k_jd| (about 64 ulps of the largest partial sum), which only
# matters when the value itself is close to 0.
STAT_RTOL, STAT_DOT_ULPS = 2 / 65536, 2.0**-18


def reference(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
    """fp64 oracle. Returns out, max_logits, lse, the empty-row mask [s_q, h_q], the dot magnitude
    sm_scale * max_j sum_d |q_d k_jd| [s_q, h_q] and the weighted value magnitude sum_j w_j |v_j|
    [s_q, h_q, d_v] (w: the weights that produce out, sink included)."""
    s_kv, topk = kv.shape[0], indices.shape[-1]
    idx = indices[:, 0, :].long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=idx.device)[None, :] < topk_length[:, None].long()
    # Invalid slots gather row 0 and are then zeroed, so NaN/Inf anywhere in kv cannot reach the oracle
    # through them.
    k = kv[:, 0][torch.where(valid, idx, 0)].double()
    k = torch.where(valid[..., None], k, 0.0)
    q64 = q.double()
    logits = torch.einsum("shd,std->sht", q64, k) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)
    if topk > 0:
        max_logits = logits.amax(-1)
        magnitude = (torch.einsum("shd,std->sht", q64.abs(), k.abs()) * sm_scale).amax(-1)
    else:
        max_logits, magnitude = torch.full_like(lse, -math.inf), torch.zeros_like(lse)
    empty = ~valid.any(-1)[:, None].expand_as(lse)
    lse_finite = torch.where(empty, 0.0, lse)
    weights = torch.exp(logits - lse_finite[..., None])
    if attn_sink is not None:
        weights = weights / (1.0 + torch.exp(attn_sink.double()[None, :] - lse_finite))[..., None]
    out = torch.einsum("sht,std->shd", weights, k[..., :d_v])
    value_magnitude = torch.einsum("sht,std->shd", weights, k[..., :d_v].abs())
    lse = torch.where(empty, math.inf, lse)
    return out, max_logits, lse, empty, magnitude, value_magnitude


def check(got, ref, dtype):
    out, max_logits, lse = got
    r_out, r_max, r_lse, empty, magnitude, value_magnitude = ref
    assert out.dtype == dtype and max_logits.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "out has NaN/Inf"
    out64 = out.double()
    excess = (out64 - r_out).abs() - (OUT_ATOL + OUT_RTOL * r_out.abs() + P_ROUNDING[dtype] * value_magnitude)
    assert excess.max() <= 0, f"out off by {excess.max():.3g} beyond tolerance at {divmod(int(excess.argmax()), out.shape[-1])}"
    if r_out.norm() > 0:
        assert (out64 - r_out).norm() / r_out.norm() < 1e-2
    # Rows without a valid key: exactly 0 / +inf / -inf.
    assert (out[empty] == 0).all()
    assert (lse[empty] == math.inf).all() and (max_logits[empty] == -math.inf).all()
    full = ~empty
    for name, got_stat, ref_stat in (("lse", lse, r_lse), ("max_logits", max_logits, r_max)):
        err = (got_stat.double()[full] - ref_stat[full]).abs()
        tol = STAT_RTOL * ref_stat[full].abs() + STAT_DOT_ULPS * magnitude[full]
        assert (err <= tol).all(), f"{name} off by {(err - tol).max():.3g} beyond tolerance"


def poisoned_outputs(s_q, h_q, d_v, dtype, strided=False):
    """Preallocated NaN-filled outputs: every element must be overwritten."""
    if strided:
        out = torch.full((s_q, h_q + 1, d_v + 8), math.nan, dtype=dtype, device=DEVICE)[:, 1:, 4:d_v + 4]
        stats = torch.full((2, h_q, s_q), math.nan, device=DEVICE).transpose(1, 2)
        return out, stats[0], stats[1]
    return (torch.full((s_q, h_q, d_v), math.nan, dtype=dtype, device=DEVICE),
            torch.full((s_q, h_q), math.nan, device=DEVICE), torch.full((s_q, h_q), math.nan, device=DEVICE))


def kv_with_poisoned_neighbours(s_kv, d_qk, dtype, gen):
    """kv whose memory is flanked by NaN/Inf rows: dereferencing index -1 or s_kv would poison out."""
    buf = torch.randn((s_kv + 2, 1, d_qk), generator=gen, device=gen.device).to(dtype)
    buf[0], buf[-1] = math.nan, math.inf
    return buf[1:-1]


def run_case(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None, strided_out=False, config=None):
    s_q, h_q, _ = q.shape
    out = poisoned_outputs(s_q, h_q, d_v, q.dtype, strided_out)
    got = sparse_mla_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=out, config=config)
    assert all(g is o for g, o in zip(got, out))
    check(got, reference(q, kv, indices, sm_scale, d_v, attn_sink, topk_length), q.dtype)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_masked_chunk_regression(dtype, d_qk):
    """vLLM #48364: a fully masked leading chunk made the running max -inf and poisoned the row."""
    gen = torch.Generator(DEVICE).manual_seed(1234)
    s_kv, h_q, topk = 512, 64, 384
    q = torch.randn((6, h_q, d_qk), generator=gen, device=DEVICE).to(dtype)
    kv = kv_with_poisoned_neighbours(s_kv, d_qk, dtype, gen)
    indices = torch.full((6, 1, topk), -1, dtype=torch.int32, device=DEVICE)
    arange = torch.arange(topk, dtype=torch.int32, device=DEVICE)
    indices[0, 0, 16:48] = arange[:32]                     # leading and trailing masked chunks (tile 16)
    indices[1, 0, :] = arange + 100                         # all valid
    # row 2: none valid
    indices[3, 0, 128:256] = arange[:128] * 3               # leading/trailing masked for any tile <= 128
    indices[4, 0, 64:128] = arange[:64]                     # interleaved: masked, valid, masked, valid, masked
    indices[4, 0, 256:320] = arange[:64] + 300
    indices[5, 0, 383] = 7                                  # a single valid key, in the last slot
    out, max_logits, lse = run_case(q, kv, indices, d_qk**-0.5, 512)
    assert (out[2] == 0).all() and (lse[2] == math.inf).all() and (max_logits[2] == -math.inf).all()
    # The single-key row is that key's value row exactly (up to output rounding).
    torch.testing.assert_close(out[5], kv[7, 0, :512].expand(h_q, 512), rtol=2**-8, atol=0)


ROW_KINDS = ["random", "band", "single", "none", "all", "interleaved"]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    d_qk, d_v = draw(st.sampled_from([(576, 512), (512, 512), (72, 40)]))
    s_q = draw(st.integers(1, 4))
    h_q = draw(st.sampled_from([1, 3, 16, 17, 64, 67] + ([128] if ON_GPU else [])))
    s_kv = draw(st.integers(1, 300))
    topk = draw(st.integers(1, 200 if not ON_GPU else 700))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=s_q, max_size=s_q))
    return dict(
        dtype=dtype, d_qk=d_qk, d_v=d_v, s_q=s_q, h_q=h_q, s_kv=s_kv, topk=topk, kinds=kinds,
        seed=draw(st.integers(0, 2**31 - 1)),
        topk_length=draw(st.booleans()), attn_sink=draw(st.booleans()),
        strided=draw(st.booleans()), strided_out=draw(st.booleans()),
        poison_unreferenced=draw(st.booleans()), q_scale=draw(st.sampled_from([1.0, 4.0])),
    )


def row_validity(kind, topk, gen):
    """Which of the topk slots of one row hold a valid index, for a named mask pattern."""
    pos = torch.arange(topk, device=DEVICE)
    if kind == "random":
        density = [0.05, 0.5, 0.95][int(torch.randint(3, (1,), generator=gen, device=DEVICE))]
        return torch.rand(topk, generator=gen, device=DEVICE) < density
    if kind == "band":
        a, b = sorted(torch.randint(0, topk + 1, (2,), generator=gen, device=DEVICE).tolist())
        return (pos >= a) & (pos < b)
    if kind == "single":
        return pos == int(torch.randint(topk, (1,), generator=gen, device=DEVICE))
    if kind == "none":
        return torch.zeros(topk, dtype=torch.bool, device=DEVICE)
    if kind == "all":
        return torch.ones(topk, dtype=torch.bool, device=DEVICE)
    period = [16, 32, 64][int(torch.randint(3, (1,), generator=gen, device=DEVICE))]
    return (pos // period) % 2 == 1


@settings(max_examples=200 if not ON_GPU else 50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_matches_reference(c):
    gen = torch.Generator(DEVICE).manual_seed(c["seed"])
    s_q, h_q, d_qk, s_kv, topk, dtype = c["s_q"], c["h_q"], c["d_qk"], c["s_kv"], c["topk"], c["dtype"]

    valid = torch.stack([row_validity(k, topk, gen) for k in c["kinds"]])
    good = torch.randint(0, s_kv, (s_q, topk), generator=gen, device=DEVICE, dtype=torch.int32)
    garbage_pool = torch.tensor([INT32_MIN, -1, s_kv, INT32_MAX, -7, s_kv + 5], dtype=torch.int32, device=DEVICE)
    garbage = garbage_pool[torch.randint(0, 6, (s_q, topk), generator=gen, device=DEVICE)]
    flat_indices = torch.where(valid, good, garbage)

    topk_length = None
    if c["topk_length"]:
        topk_length = torch.randint(-2, topk + 3, (s_q,), generator=gen, device=DEVICE, dtype=torch.int32)
    attn_sink = None
    if c["attn_sink"]:
        attn_sink = torch.randn(h_q, generator=gen, device=DEVICE) * 4
        attn_sink[0] = [math.inf, -math.inf, 1.0][c["seed"] % 3]

    q = torch.randn((s_q, h_q, d_qk), generator=gen, device=DEVICE) * c["q_scale"]
    kv = torch.randn((s_kv, 1, d_qk), generator=gen, device=DEVICE)
    if c["poison_unreferenced"]:
        used = valid.clone()
        if topk_length is not None:
            used &= torch.arange(topk, device=DEVICE)[None, :] < topk_length[:, None]
        referenced = torch.zeros(s_kv, dtype=torch.bool, device=DEVICE)
        referenced[flat_indices[used].long()] = True
        unreferenced = (~referenced).nonzero()[:, 0]
        specials = torch.tensor([math.nan, math.inf, -math.inf], device=DEVICE)
        kv[unreferenced] = specials[torch.arange(len(unreferenced), device=DEVICE) % 3][:, None, None]

    if c["strided"]:
        # Every input viewed out of a larger buffer: padded rows/heads/columns, transposed q, a kv
        # flanked by NaN rows, every-other-element indices, topk_length and attn_sink.
        q_buf = torch.randn((h_q + 1, s_q, d_qk + 16), generator=gen, device=DEVICE).to(dtype)
        q_buf[1:, :, 8:d_qk + 8] = q.transpose(0, 1).to(dtype)
        q = q_buf[1:, :, 8:d_qk + 8].transpose(0, 1)
        kv_buf = torch.full((s_kv + 2, 2, d_qk + 32), math.nan, device=DEVICE).to(dtype)
        kv_buf[1:-1, :1, :d_qk] = kv.to(dtype)
        kv = kv_buf[1:-1, :1, :d_qk]
        idx_buf = torch.zeros((s_q, 1, 2 * topk), dtype=torch.int32, device=DEVICE)
        idx_buf[..., ::2] = flat_indices[:, None, :]
        indices = idx_buf[..., ::2]
        if topk_length is not None:
            topk_length = torch.stack([topk_length, topk_length], 1)[:, 0]
        if attn_sink is not None:
            attn_sink = torch.stack([attn_sink, -attn_sink], 1)[:, 0]
    else:
        q, kv = q.to(dtype), kv.to(dtype)
        indices = flat_indices[:, None, :].contiguous()

    run_case(q, kv, indices, 0.1352 * d_qk**-0.5 * 2, c["d_v"], attn_sink, topk_length, c["strided_out"])


def test_attn_sink_limits():
    """+inf sink zeroes out, -inf sink changes nothing; lse and max_logits never move."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    q = torch.randn((3, 8, 576), generator=gen, device=DEVICE).bfloat16()
    kv = torch.randn((40, 1, 576), generator=gen, device=DEVICE).bfloat16()
    indices = torch.randint(0, 40, (3, 1, 50), generator=gen, device=DEVICE, dtype=torch.int32)
    plain = sparse_mla_prefill(q, kv, indices, 0.05)
    sink = torch.full((8,), -math.inf, device=DEVICE)
    sink[:4] = math.inf
    sunk = run_case(q, kv, indices, 0.05, 512, attn_sink=sink)
    assert (sunk[0][:, :4] == 0).all()
    torch.testing.assert_close(sunk[0][:, 4:], plain[0][:, 4:])
    torch.testing.assert_close(sunk[1], plain[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(sunk[2], plain[2], rtol=1e-6, atol=0)


def test_topk_length_ignores_later_entries():
    """Entries past topk_length[i] are never read, even when they point at NaN rows."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    s_kv, topk = 100, 96
    q = torch.randn((4, 16, 512), generator=gen, device=DEVICE).bfloat16()
    kv = torch.randn((s_kv, 1, 512), generator=gen, device=DEVICE).bfloat16()
    kv[50:] = math.nan
    indices = torch.randint(0, 50, (4, 1, topk), generator=gen, device=DEVICE, dtype=torch.int32)
    indices[:, :, 40:] += 50                                   # beyond the lengths below: NaN rows
    topk_length = torch.tensor([40, 0, 17, -5], dtype=torch.int32, device=DEVICE)
    out, max_logits, lse = run_case(q, kv, indices, 0.05, 512, topk_length=topk_length)
    assert (out[1] == 0).all() and (out[3] == 0).all() and (lse[1] == math.inf).all()


@pytest.mark.parametrize("config", [PrefillConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
                                    PrefillConfig(block_h=32, block_n=16, num_warps=4, num_stages=3)],
                         ids=lambda c: f"h{c.block_h}-n{c.block_n}")
def test_other_launch_configs(config):
    """An explicit config (the benchmark's variants) runs the portable kernel with that launch shape:
    several head blocks per token, a partial last one, and masked and partial key chunks."""
    gen = torch.Generator(DEVICE).manual_seed(37)
    q = torch.randn((3, 40, 576), generator=gen, device=DEVICE).bfloat16()
    kv = kv_with_poisoned_neighbours(90, 576, torch.bfloat16, gen)
    indices = torch.randint(-3, 93, (3, 1, 70), generator=gen, device=DEVICE, dtype=torch.int32)
    indices[1, 0, :40] = -1
    run_case(q, kv, indices, 0.05, 512, attn_sink=torch.randn(40, generator=gen, device=DEVICE),
             topk_length=torch.tensor([70, 65, 3], dtype=torch.int32, device=DEVICE), config=config)


def test_topk_larger_than_s_kv_and_duplicates():
    gen = torch.Generator(DEVICE).manual_seed(5)
    q = torch.randn((2, 5, 576), generator=gen, device=DEVICE).half()
    kv = torch.randn((3, 1, 576), generator=gen, device=DEVICE).half()
    indices = torch.randint(-1, 4, (2, 1, 77), generator=gen, device=DEVICE, dtype=torch.int32)
    run_case(q, kv, indices, 0.07, 512)


def test_degenerate_sizes():
    """topk = 0 gives empty rows; s_q = 0 or h_q = 0 returns empty outputs."""
    q = torch.randn((2, 3, 576), device=DEVICE).bfloat16()
    kv = torch.randn((4, 1, 576), device=DEVICE).bfloat16()
    out, max_logits, lse = run_case(q, kv, torch.zeros((2, 1, 0), dtype=torch.int32, device=DEVICE), 0.1, 512)
    assert (out == 0).all() and (lse == math.inf).all() and (max_logits == -math.inf).all()
    for s_q, h_q in ((0, 3), (2, 0)):
        got = sparse_mla_prefill(q[:s_q, :h_q], kv, torch.zeros((s_q, 1, 4), dtype=torch.int32, device=DEVICE), 0.1)
        assert [tuple(t.shape) for t in got] == [(s_q, h_q, 512), (s_q, h_q), (s_q, h_q)]


def test_64bit_kv_offsets():
    """Rows past 2^31 / d_qk: the row offset must be computed in 64 bits. On the CPU the 4.8 GB kv is
    allocated lazily and only the rows written below get physical pages."""
    s_kv, d_qk = 2**22 + 4096, 576                            # (s_kv - 1) * 576 > 2^31
    kv = torch.empty((s_kv, 1, d_qk), dtype=torch.bfloat16, device=DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(11)
    kv[-4096:] = torch.randn((4096, 1, d_qk), generator=gen, device=DEVICE).bfloat16()
    kv[:4096] = torch.randn((4096, 1, d_qk), generator=gen, device=DEVICE).bfloat16()
    far = s_kv - 1 - torch.randint(0, 4096, (2, 1, 48), generator=gen, device=DEVICE, dtype=torch.int32)
    near = torch.randint(0, 4096, (2, 1, 16), generator=gen, device=DEVICE, dtype=torch.int32)
    q = torch.randn((2, 16, d_qk), generator=gen, device=DEVICE).bfloat16()
    run_case(q, kv, torch.cat([far, near], -1), 0.04, 512)


@pytest.mark.skipif(not ON_GPU, reason="the 65535 grid limit exists only on the GPU; interpreting 70k programs takes ~30 min")
def test_s_q_beyond_grid_limit():
    """70k tokens: more programs than the 65535 grid limit of axes 1/2, and q/out element offsets past
    2^31 (70000 * 64 * 576), so token offsets must be 64-bit too."""
    gen = torch.Generator(DEVICE).manual_seed(13)
    s_q, h_q, s_kv, topk = 70_000, 64, 300, 40
    q = torch.randn((s_q, h_q, 576), generator=gen, device=DEVICE).bfloat16()
    kv = torch.randn((s_kv, 1, 576), generator=gen, device=DEVICE).bfloat16()
    indices = torch.randint(-50, s_kv, (s_q, 1, topk), generator=gen, device=DEVICE, dtype=torch.int32)
    got = sparse_mla_prefill(q, kv, indices, 0.05)
    # fp64 reference on a sample of rows, including the last ones (the ones past the grid limit).
    rows = torch.cat([torch.arange(0, s_q, 997, device=DEVICE), torch.arange(s_q - 5, s_q, device=DEVICE)])
    check([t[rows] for t in got], reference(q[rows], kv, indices[rows], 0.05, 512), torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="full DeepSeek-V3.2 prefill shape; the interpreter would take minutes")
@pytest.mark.parametrize("d_qk", [576, 512])
def test_deepseek_shape(d_qk):
    gen = torch.Generator(DEVICE).manual_seed(17)
    s_q, h_q, s_kv, topk = 64, 128, 8192, 2048
    q = torch.randn((s_q, h_q, d_qk), generator=gen, device=DEVICE).bfloat16()
    kv = torch.randn((s_kv, 1, d_qk), generator=gen, device=DEVICE).bfloat16()
    indices = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, device=DEVICE, dtype=torch.int32)
    indices[::3, :, 1000:] = -1
    run_case(q, kv, indices, 0.1352 * 192**-0.5, 512, topk_length=torch.full((s_q,), 1800, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernel's tiles in turn are sm_90 only; interpreting 700 rows "
                    "would take minutes")
@pytest.mark.parametrize("d_qk, h_q", [(576, 128), (512, 16)])
@pytest.mark.parametrize("with_lengths", [True, False])
def test_many_tiles_per_program(d_qk, h_q, with_lengths):
    """More (token, 64-head) tiles than programs (on sm_90 programs take tiles in turn, each starting while
    the last one's output is stored: one program an SM for rows of one length, programs of two tiles with
    topk_length): with lengths, rows of every length after one another and runs of empty rows among them;
    without, runs of rows whose indices are all invalid; sink on; every row against the oracle, every output
    written."""
    gen = torch.Generator(DEVICE).manual_seed(19)
    s_q, s_kv, topk = 700, 4096, 512
    q = torch.randn((s_q, h_q, d_qk), generator=gen, device=DEVICE).bfloat16()
    kv = kv_with_poisoned_neighbours(s_kv, d_qk, torch.bfloat16, gen)
    indices = torch.randint(-3, s_kv + 3, (s_q, 1, topk), generator=gen, device=DEVICE, dtype=torch.int32)
    topk_length = None
    if with_lengths:
        topk_length = torch.randint(0, topk + 1, (s_q,), generator=gen, device=DEVICE, dtype=torch.int32)
        topk_length[100:180] = 0
        topk_length[::7] = topk
        topk_length[1::11] = 0
    else:
        indices[100:180] = -1
        indices[1::11] = s_kv
    sink = torch.randn(h_q, generator=gen, device=DEVICE)
    run_case(q, kv, indices, d_qk**-0.5, 512, attn_sink=sink, topk_length=topk_length)


def _valid_args():
    q = torch.randn((2, 4, 576), device=DEVICE).bfloat16()
    kv = torch.randn((8, 1, 576), device=DEVICE).bfloat16()
    indices = torch.zeros((2, 1, 16), dtype=torch.int32, device=DEVICE)
    return q, kv, indices


@pytest.mark.parametrize("mutate, message", [
    (lambda q, kv, i: (q.float(), kv, i, {}), "bfloat16 or float16"),
    (lambda q, kv, i: (q, kv.half(), i, {}), "differs from q dtype"),
    (lambda q, kv, i: (q, kv.expand(8, 2, 576), i, {}), "h_kv = 1"),
    (lambda q, kv, i: (q, kv[..., :512], i, {}), "head dim"),
    (lambda q, kv, i: (q, kv, i.long(), {}), "int32"),
    (lambda q, kv, i: (q, kv, i[:1], {}), "indices must have shape"),
    (lambda q, kv, i: (q[0], kv, i, {}), "3 dims"),
    (lambda q, kv, i: (q, kv, i, {"d_v": 577}), "d_v"),
    (lambda q, kv, i: (q, kv, i, {"d_v": 0}), "d_v"),
    (lambda q, kv, i: (q, kv, i, {"d_v": 448}), "unsupported head dims"),
    (lambda q, kv, i: (q, kv, i, {"attn_sink": torch.zeros(3, device=DEVICE)}), "attn_sink"),
    (lambda q, kv, i: (q, kv, i, {"attn_sink": torch.zeros(4, device=DEVICE).double()}), "attn_sink"),
    (lambda q, kv, i: (q, kv, i, {"topk_length": torch.zeros(2, device=DEVICE)}), "topk_length"),
    (lambda q, kv, i: (q, kv.to("meta"), i, {}), "one device"),
    (lambda q, kv, i: (q.to("meta"), kv.to("meta"), i.to("meta"), {}), "meta"),
    (lambda q, kv, i: (q, kv, i, {"out": (torch.empty(2, 4, 512, device=DEVICE),) * 3}), "preallocated out"),
    (lambda q, kv, i: (q, kv, i, {"config": (64, 64, 8, 3)}), "PrefillConfig"),
])
def test_bad_input_raises_input_error(mutate, message):
    q, kv, indices, kwargs = mutate(*_valid_args())
    with pytest.raises(InputError, match=message):
        sparse_mla_prefill(q, kv, indices, 0.1, **kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CPU tensors are valid input under the interpreter")
def test_cpu_tensors_rejected_when_compiled():
    q, kv, indices = (t.cpu() for t in _valid_args())
    with pytest.raises(InputError, match="CUDA"):
        sparse_mla_prefill(q, kv, indices, 0.1)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("d_qk", [576, 512])
def test_sm90_kernel_taken_on_hopper(kernel_path, monkeypatch, d_qk):
    calls = []
    launch = sm90.launch
    monkeypatch.setattr(sm90, "launch", lambda *args, **kw: calls.append(1) or launch(*args, **kw))
    gen = torch.Generator(DEVICE).manual_seed(5)
    q = torch.randn((3, 64, d_qk), generator=gen, device=DEVICE).to(torch.bfloat16)
    kv = torch.randn((100, 1, d_qk), generator=gen, device=DEVICE).to(torch.bfloat16)
    indices = torch.randint(0, 100, (3, 1, 64), generator=gen, device=DEVICE, dtype=torch.int32)
    run_case(q, kv, indices, 0.05, 512)
    assert len(calls) == (1 if kernel_path == "sm90" else 0)
    run_case(q, kv, indices, 0.05, 512, config=default_config(64))     # an explicit config: portable
    assert len(calls) == (1 if kernel_path == "sm90" else 0)


def record_launches(monkeypatch, module, name):
    """Replace kernel `name` of `module` by a recorder. Returns the list to which each launch appends its
    arguments bound to the kernel's signature (launch options left out); binding raises TypeError
    unless the launch passes every parameter exactly once and nothing else."""
    signature = inspect.signature(getattr(module, name).fn)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "maxnreg")}
                launches.append(signature.bind(*args, **kwargs).arguments)
            return launch
    monkeypatch.setattr(module, name, Recorder())
    return launches


@pytest.mark.parametrize("optional", [False, True])
def test_sm90_launch_matches_kernel_signature(monkeypatch, optional):
    """The Gluon kernel cannot run on the CPU (no interpreter); its launch can: it passes exactly the
    kernel's parameters, with the flags of the optional inputs."""
    launches = record_launches(monkeypatch, sm90, "_sparse_mla_prefill_sm90_kernel")
    q, kv, indices = _valid_args()
    sink, lengths = (torch.zeros(4, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE)) \
        if optional else (None, None)
    out = poisoned_outputs(2, 4, 512, q.dtype)
    assert all(got is o for got, o in zip(sm90.launch(q, kv, indices, 0.1, sink, lengths, out, Kept()), out))
    (arguments,) = launches
    assert arguments["HAS_ATTN_SINK"] == arguments["HAS_TOPK_LENGTH"] == optional
    assert arguments["sm_scale_log2"] == 0.1 and arguments["out_ptr"] is out[0]


@pytest.mark.parametrize("n_tiles, unequal, programs", [
    (100, False, 100), (132, False, 132), (8192, False, 132),         # rows of one length: one program an SM
    (333, True, 333), (8 * 132 - 1, True, 8 * 132 - 1),             # few tiles of unequal rows: one a tile
    (8 * 132, True, 4 * 132), (8192, True, 4096), (8193, True, 4097),  # many: programs of two tiles
])
def test_sm90_grid(n_tiles, unequal, programs):
    """The Gluon kernel's grid on 132 SMs by tile count and whether rows may differ in length (topk_length)."""
    assert sm90.grid_programs(n_tiles, 132, unequal) == programs
