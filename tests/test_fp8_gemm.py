"""Block-scaled fp8 GEMM, its activation quantiser, the fused MLA kv_b head projections and Fp8Linear.

Oracles: minirt.formats.quantize_groups (the quantiser, bit for bit) and fp64 torch products of the
dequantised operands (blockfp8.dequantize_block_fp8). Runs the real Triton kernels (fp8_gemm's stream
and tile kernels): compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU; its
torch._scaled_mm path on an sm_90 GPU only. Inputs come from seeded generators, with
magnitudes varying per 128-block so that a scale applied to the wrong block shows; outputs are
NaN-poisoned before each call. Errors are normalised by the magnitude |A| . |B|^T (the sum of the
absolute products), which bounds what a fp32 sum can get wrong independently of cancellation.
"""
import importlib
import math

import pytest
import torch

from conftest import DEVICE
from minirt.blockfp8 import dequantize_block_fp8, quantize_block_fp8
from minirt.errors import InputError
from minirt.formats import ACT_MIN_SCALE, E4M3_MAX, FP8_DTYPE, FP8_GROUP, pow2_scale, quantize_groups
from minirt.fp8_linear import Fp8Linear
from minirt.rope import apply_rope_interleaved
from minirt.kernels.fp8_gemm import (PREFILL_CONFIG, STREAM_MAX_M, Fp8GemmConfig, StreamConfig, decode_config,
                                     default_config, default_path, fp8_gemm, quantize_act_fp8, swiglu_quantize_fp8,
                                     uses_scaled_mm)
from minirt.kernels import mla_head_proj_fp8 as head_proj
from minirt.kernels.mla_head_proj_fp8 import mla_query_absorb, mla_value_proj_fp8

# The module (minirt.kernels re-exports the function fp8_gemm under the module's name).
fp8_gemm_module = importlib.import_module("minirt.kernels.fp8_gemm")

ON_GPU = DEVICE == "cuda"
# fp8_gemm accumulation error as a fraction of |A| . |B|^T, for each of its paths (stream and tile
# kernels, _scaled_mm: all promote every 128-wide k block into fp32). The fp8 products are exact (4 x 4
# significant bits). CPU: fp32 sums only (at most 128 + K/128 roundings of 2^-24 each: elementwise
# far below 2^-16, norm-wise about 2^-24 * sqrt(terms), below 2^-20 ~ 1e-6). GPU: Hopper's fp8 MMA
# keeps about 13-14 bits while it accumulates one 128-wide k block (DeepSeek-V3 report, sec.
# 3.3.2), then the block is promoted into fp32: a few roundings (truncations, so they may all lean
# one way) of ~2^-13 per block, 2^-9 elementwise with room for a handful, 2^-11 (~5e-4) norm-wise.
GEMM_ELEMENT_TOL = 2.0**-9 if ON_GPU else 2.0**-16
GEMM_NORM_TOL = 2.0**-11 if ON_GPU else 2.0**-20
# The head projections multiply bf16 activations with e4m3 weights converted to bf16 (exact) with
# fp32 accumulation (tensor cores compiled, numpy fp32 interpreted): fp32 sums of at most 512 terms.
HEAD_ELEMENT_TOL = 2.0**-14
# Relative rounding of a stored result: nearest bf16 / fp16 (8 / 11 significant bits); the
# interpreter's float32 -> bf16 cast truncates (< 1 ulp: 2^-7).
ROUNDING = {torch.bfloat16: 2.0**-8 if ON_GPU else 2.0**-7, torch.float16: 2.0**-11}
BF16_ROUNDING = ROUNDING[torch.bfloat16]
E4M3_ROUNDING = 2.0**-4          # relative, round to nearest e4m3 normal (4 significant bits)
E4M3_SUBNORMAL_STEP = 2.0**-9    # in units of the group scale
ACT_MIN_EXPONENT = math.ceil(math.log2(ACT_MIN_SCALE))


def generator(seed):
    return torch.Generator(DEVICE).manual_seed(seed)


def varied(gen, rows, cols, row_block):
    """randn [rows, cols] float32, each (row_block x 128) block scaled by its own 2^e, e in [-6, 6)."""
    blocks = (-(-rows // row_block), -(-cols // FP8_GROUP))
    exponents = torch.randint(-6, 6, blocks, generator=gen, device=DEVICE).float()
    factors = torch.exp2(exponents).repeat_interleave(row_block, 0)[:rows].repeat_interleave(FP8_GROUP, 1)[:, :cols]
    return torch.randn((rows, cols), generator=gen, device=DEVICE) * factors


def random_weight(gen, n, k, rescale=False):
    """A block fp8 weight [n, k] as checkpoints store it. rescale: scales multiplied by random
    factors in [0.5, 2) (not powers of two, as in DeepSeek-V3's checkpoints)."""
    w_fp8, scales = quantize_block_fp8(varied(gen, n, k, 128))
    if rescale:
        scales = scales * (0.5 + 1.5 * torch.rand(scales.shape, generator=gen, device=DEVICE))
    return w_fp8, scales


def random_activations(gen, m, k):
    """(a_fp8 [m, k], scales [m, ceil(k / 128)]) by the activation rule (a K that is not a multiple
    of 128 ends in a partial group)."""
    padded = torch.nn.functional.pad(varied(gen, m, k, 1), (0, -k % FP8_GROUP))
    a_fp8, scales = quantize_groups(padded)
    return a_fp8[:, :k].contiguous(), scales


def dequantize_groups(values, scales):
    """values [..., K] e4m3 * scales [..., ceil(K / 128)] per 128 columns, float64."""
    k = values.shape[-1]
    return (values.double() * scales.double().repeat_interleave(FP8_GROUP, -1)[..., :k])


def gemm_reference(a_fp8, a_scales, w_fp8, w_scales):
    """(product, magnitude) in float64: A . W^T and |A| . |W|^T of the dequantised operands."""
    a = dequantize_groups(a_fp8, a_scales)
    w = dequantize_block_fp8(w_fp8, w_scales, dtype=torch.float64)
    return a @ w.T, a.abs() @ w.abs().T


def check_gemm(out, ref, magnitude, rounding=0.0):
    """out within the accumulation tolerance of ref (plus `rounding` * |ref| for the output dtype)."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "every output element must be written and finite"
    err = (out.double() - ref).abs()
    excess = err - GEMM_ELEMENT_TOL * magnitude - rounding * ref.abs()
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the elementwise bound"
    if rounding == 0.0:
        rel = (err.norm() / magnitude.norm()).item()
        assert rel < GEMM_NORM_TOL, f"relative error {rel:.3g}"


def poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------------
# activation quantiser
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 128), (7, 1024), (33, 640)])
def test_quantize_act_is_quantize_groups(dtype, m, k):
    gen = generator(m * k)
    x = varied(gen, m, k, 1)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    values, scales = quantize_act_fp8(x)
    ref_values, ref_scales = quantize_groups(x)
    assert values.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


def boundary_groups(dtype):
    """Groups of 128 values that probe every edge of the rule, one group per row:
    e4m3 rounding midpoints (ties to even, normal and subnormal) at several scales with amax =
    448 * scale exactly; amax just above 448 * 2^k (next scale up); an all-zero group; a group whose
    amax is below the ACT_MIN_SCALE floor; huge values (float32 only); signed zeros."""
    codes = torch.arange(0, 127, dtype=torch.uint8, device=DEVICE)      # 0 .. 448, 0x7f is NaN
    grid = codes.view(FP8_DTYPE).float()
    midpoints = (grid[:-1] + grid[1:]) / 2                               # 126 values
    signs = torch.where(torch.arange(126, device=DEVICE) % 3 == 0, -1.0, 1.0)
    ties = torch.cat([torch.tensor([E4M3_MAX, -0.0], device=DEVICE), midpoints * signs])
    rows = [ties * 2.0**e for e in (-12, -3, 0, 5)]
    rows.append(torch.full((128,), E4M3_MAX * 4, device=DEVICE))
    rows.append(torch.zeros(128, device=DEVICE))
    rows.append(torch.linspace(-1e-6, 1e-6, 128, device=DEVICE))
    if dtype == torch.float32:
        rows.append(ties * 2.0**100)
    x = torch.stack(rows).to(dtype)
    # Row 4: the next value of the dtype above 448 * 4 (one bit more in the integer view).
    bits = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[4] += 1
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_act_boundaries(dtype):
    x = boundary_groups(dtype)
    values, scales = quantize_act_fp8(x)
    ref_values, ref_scales = quantize_groups(x)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert scales[5].item() == 2.0**ACT_MIN_EXPONENT, "an all-zero group gets the smallest scale"


def test_quantize_act_rejects_bad_input():
    with pytest.raises(InputError, match="multiple of 128"):
        quantize_act_fp8(torch.ones(2, 100, device=DEVICE))
    with pytest.raises(InputError, match="2-D"):
        quantize_act_fp8(torch.ones(128, device=DEVICE))
    with pytest.raises(InputError, match="bfloat16, float16 or float32"):
        quantize_act_fp8(torch.ones(2, 128, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 128), (5, 384), (33, 1024)])
def test_swiglu_quantize_is_quantised_swiglu(dtype, m, k):
    """swiglu_quantize_fp8(gate, up) on the two halves of one [M, 2K] product (rows strided): against
    quantize_groups(F.silu(gate) * up) computed by torch in the same dtype, code for code but where
    silu's exp differs in its last bit (a code or a group scale a step apart: at most 1 in 1000; the
    interpreter's float32 -> bf16 cast truncates, a few in 100), and every dequantised value against
    the fp64 SwiGLU within e4m3 rounding and the two roundings to the dtype (relative, or half the
    dtype's smallest subnormal)."""
    gen = generator(m * k + 3)
    both = varied(gen, m, 2 * k, 1)
    if dtype == torch.float16:
        both = both.clamp(-200, 200)   # (silu(x) * y stays finite in fp16)
    both = both.to(dtype)
    gate, up = both[:, :k], both[:, k:]
    values, scales = swiglu_quantize_fp8(gate, up)
    ref_values, ref_scales = quantize_groups(torch.nn.functional.silu(gate) * up)
    assert values.shape == (m, k) and values.dtype == FP8_DTYPE and scales.shape == (m, k // FP8_GROUP)
    agreement = 0.999 if ON_GPU or dtype != torch.bfloat16 else 0.9
    assert (values.view(torch.uint8) == ref_values.view(torch.uint8)).float().mean() >= agreement
    assert (scales == ref_scales).float().mean() >= agreement
    g, u = gate.double(), up.double()
    truth = g * torch.sigmoid(g) * u
    got = values.double() * scales.double().repeat_interleave(FP8_GROUP, 1)
    rounding = ROUNDING.get(dtype, 2.0**-23)
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    bound = (E4M3_ROUNDING + 2 * rounding) * truth.abs() + subnormal * (u.abs() + 1) \
        + E4M3_SUBNORMAL_STEP * scales.double().repeat_interleave(FP8_GROUP, 1)
    assert ((got - truth).abs() <= bound).all()


def test_swiglu_quantize_rejects_bad_input():
    gate = torch.ones(2, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(InputError, match="up must be a torch.bfloat16 tensor of gate's shape"):
        swiglu_quantize_fp8(gate, torch.ones(2, 128, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(InputError, match="up must be"):
        swiglu_quantize_fp8(gate, gate.float())
    with pytest.raises(InputError, match="unit stride"):
        swiglu_quantize_fp8(gate, torch.ones(256, 2, dtype=torch.bfloat16, device=DEVICE).T)
    with pytest.raises(InputError, match="multiple of 128"):
        swiglu_quantize_fp8(gate[:, :100], gate[:, :100])


# ----------------------------------------------------------------------------------------------
# fp8 GEMM
# ----------------------------------------------------------------------------------------------

CONFIGS = {
    "default": lambda m: None,
    "prefill": lambda m: PREFILL_CONFIG,
    "decode": decode_config,
    "stream": lambda m: StreamConfig(),
}


@pytest.mark.parametrize("config, m, n, k", [
    (c, m, n, k) for m in (1, 3, 64, 300) for c in CONFIGS for n, k in ((576, 384), (200, 320))
    if (c != "decode" or m <= 128) and (c != "stream" or m <= STREAM_MAX_M) and (m < 300 or n == 200)])
def test_fp8_gemm_matches_dequantised_product(config, m, n, k):
    """Ragged N (576 rows = 5 weight blocks, 200 = 2), K = 320: two and a half k blocks. The decode
    launch is for M <= 128, the stream kernel for M <= 16; M = 300 (3 tiles, the last ragged) runs on
    the smaller shape (CPU time)."""
    gen = generator(m * 1000 + n + k)
    a_fp8, a_scales = random_activations(gen, m, k)
    w_fp8, w_scales = random_weight(gen, n, k)
    out = poisoned((m, n), torch.float32)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=CONFIGS[config](m), out=out)
    assert got is out
    check_gemm(got, *gemm_reference(a_fp8, a_scales, w_fp8, w_scales))


@pytest.mark.parametrize("m, n, k, config", [
    (1, 576, 7168, StreamConfig(split_k=1)),        # kv_a_proj at decode, one program per row block
    (16, 128, 7168, StreamConfig(split_k=5)),       # 56 k blocks in splits of 12, 12, 12, 12, 8
    (3, 200, 320, StreamConfig(block_n=32, split_k=3, k_step=1)),  # 2.5 k blocks, one per split; ragged N
    (7, 128, 1024, None),                           # wk-like: 2 row blocks, automatic split-K
    (16, 256, 384, StreamConfig(block_n=128, split_k=1, k_step=1, num_stages=5)),  # the launch before k_step
    # Two k blocks a stage: 9 k blocks in splits of 4, 4, 1 (the last stage of the last split half past K)
    (2, 192, 1152, StreamConfig(block_n=64, split_k=3, k_step=2)),
    (5, 320, 1088, StreamConfig(block_n=128, split_k=1, k_step=2)),  # 8.5 k blocks: a partial last one
    (1, 200, 640, StreamConfig(block_n=32, split_k=2, k_step=2)),    # mma.sync rows, splits of 4 and 1
])
def test_stream_matches_dequantised_product(m, n, k, config):
    """The weight-streaming kernel (M <= 16) against the fp64 product, split-K off and on, with
    non-power-of-two weight scales."""
    gen = generator(m * 7 + n + k)
    a_fp8, a_scales = random_activations(gen, m, k)
    w_fp8, w_scales = random_weight(gen, n, k, rescale=True)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=config,
                   out=poisoned((m, n), torch.float32))
    check_gemm(got, *gemm_reference(a_fp8, a_scales, w_fp8, w_scales))


@pytest.mark.parametrize("m, groups, r, k, config", [
    (1, 4, 256, 384, None),                         # decode: the stream kernel, every group in one launch
    (3, 2, 128, 1024, StreamConfig(split_k=3)),     # split-K inside each group's k blocks
    (2, 3, 128, 256, StreamConfig(block_n=64, split_k=1)),
    (20, 2, 128, 512, None),                        # past the stream kernel: one product per group
])
def test_grouped_product_is_block_diagonal(m, groups, r, k, config):
    """groups = G (V4's wo_a): out[:, gR:(g+1)R] = a[:, gK:(g+1)K] . b[gR:(g+1)R]^T, against the fp64
    product of each group's slices; the output poisoned first."""
    gen = generator(m * 31 + groups + r + k)
    a_fp8, a_scales = random_activations(gen, m, groups * k)
    w_fp8, w_scales = random_weight(gen, groups * r, k, rescale=True)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=config, groups=groups,
                   out=poisoned((m, groups * r), torch.float32))
    kb = k // FP8_GROUP
    parts = [gemm_reference(a_fp8[:, g * k:(g + 1) * k], a_scales[:, g * kb:(g + 1) * kb], w_fp8[g * r:(g + 1) * r],
                            w_scales[g * r // FP8_GROUP:(g + 1) * r // FP8_GROUP]) for g in range(groups)]
    check_gemm(got, torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1))
    # Not the plain product of a's first K columns: each group reads its own.
    plain = fp8_gemm(a_fp8[:, :k].contiguous(), a_scales[:, :kb].contiguous(), w_fp8, w_scales, torch.float32)
    assert not torch.allclose(got[:, r:], plain[:, r:])


def test_grouped_product_rejects_bad_groups():
    gen = generator(5)
    a_fp8, a_scales = random_activations(gen, 1, 512)
    w_fp8, w_scales = random_weight(gen, 256, 256)
    for groups, match in ((3, "3 groups of b's K = 256 need 768 columns"), (0, "groups must be a positive int")):
        with pytest.raises(InputError, match=match):
            fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, groups=groups)
    w_odd, w_odd_scales = random_weight(gen, 192, 256)  # 2 groups of 96 rows: not whole 128-row blocks
    with pytest.raises(InputError, match="multiples of 128"):
        fp8_gemm(a_fp8, a_scales, w_odd, w_odd_scales, groups=2)


def test_stream_split_k_is_deterministic():
    """Split-K partials are summed in split order by whichever program finishes last: repeated calls
    agree bit for bit (the arrival counters are back at zero after each launch), and the sum is the
    unsplit one within fp32 reordering."""
    gen = generator(11)
    a_fp8, a_scales = random_activations(gen, 4, 2048)
    w_fp8, w_scales = random_weight(gen, 192, 2048)
    split = [fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=StreamConfig(split_k=8))
             for _ in range(2)]
    assert torch.equal(split[0], split[1])
    ref, magnitude = gemm_reference(a_fp8, a_scales, w_fp8, w_scales)
    check_gemm(split[0], ref, magnitude)
    whole = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=StreamConfig(split_k=1))
    assert ((split[0] - whole).abs() <= 2 * GEMM_ELEMENT_TOL * magnitude).all()


@pytest.mark.parametrize("n, k, splits", [
    (7168, 16384, 2),      # o_proj: 112 row blocks of 64 x 2 = 224 programs, one wave (3 splits = 336: two)
    (36864, 7168, 4),      # gate + up fused: 576 row blocks, more than a wave unsplit
    (7168, 18432, 7),      # down_proj: 784 programs of 22 k blocks
    (2240, 7168, 7),       # q_a + wk + kv_a fused: 35 row blocks, 8 k blocks a program
    (32768, 1536, 1),      # q_b + wq_b fused: 512 row blocks, unsplit
])
def test_stream_auto_split_fills_whole_waves(monkeypatch, n, k, splits):
    """Automatic split-K on an H200 (132 SMs) for V3.2's decode GEMMs at M = 1 with the default launch
    (64-row programs, 2 k blocks a stage): the split whose waves of resident programs (2 per SM) are
    estimated to finish first, each split an even number of k blocks."""
    monkeypatch.setattr(fp8_gemm_module, "num_sms", lambda device, interpreted: 132)
    per_split = fp8_gemm_module._stream_k_blocks_per_split(StreamConfig(), 1, k, -(-n // 64), torch.device("cuda"))
    assert per_split % 2 == 0
    assert -(-(k // 128) // per_split) == splits


def test_default_path():
    """Up to 16 tokens stream the weight (the default call is the stream kernel's, bit for bit); more
    go to _scaled_mm where uses_scaled_mm says so (sm_90 with block-wise scales), else the tile kernel."""
    device = torch.device(DEVICE)
    assert [default_path(m, 576, 7168, device) for m in (1, 16)] == ["stream", "stream"]
    for m in (17, 4096):
        assert default_path(m, 576, 7168, device) == ("scaled_mm" if uses_scaled_mm(m, 576, 7168, device) else "tiles")
    assert not uses_scaled_mm(16, 576, 7168, device)
    assert not uses_scaled_mm(4096, 576, 7168 - 128, device), "ceil(K / 128) must be a multiple of 4"
    assert not uses_scaled_mm(4096, 200, 7168, device), "N must be a multiple of 16"
    if not ON_GPU:
        assert default_path(4096, 576, 7168, device) == "tiles"
    gen = generator(12)
    a_fp8, a_scales = random_activations(gen, STREAM_MAX_M, 256)
    w_fp8, w_scales = random_weight(gen, 128, 256)
    assert torch.equal(fp8_gemm(a_fp8, a_scales, w_fp8, w_scales),
                       fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, config=StreamConfig()))


@pytest.mark.skipif(not ON_GPU, reason="torch._scaled_mm runs on CUDA GPUs only")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_path_matches_tile_kernel(out_dtype):
    """The default path at M = 300 on sm_90: _scaled_mm for 288 rows, the stream kernel for the last
    12; equal to the fp64 product and to the Triton tile kernel within the fp8 accumulation
    tolerance (plus one rounding of each to the output dtype)."""
    m, n, k = 300, 576, 7168
    if not uses_scaled_mm(m, n, k, torch.device(DEVICE), out_dtype):
        pytest.skip("torch._scaled_mm with block-wise scales does not run here (needs sm_90, CUDA >= 12.9)")
    gen = generator(300)
    a_fp8, a_scales = random_activations(gen, m, k)
    w_fp8, w_scales = random_weight(gen, n, k, rescale=True)
    rounding = ROUNDING.get(out_dtype, 0.0)
    ref, magnitude = gemm_reference(a_fp8, a_scales, w_fp8, w_scales)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, out_dtype, out=poisoned((m, n), out_dtype))
    check_gemm(got, ref, magnitude, rounding=rounding)
    tiles = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, out_dtype, config=default_config(m))
    bound = 2 * GEMM_ELEMENT_TOL * magnitude + 2 * rounding * ref.abs()
    assert ((got.double() - tiles.double()).abs() <= bound).all()


@pytest.mark.parametrize("config", [decode_config(64), PREFILL_CONFIG])
def test_fp8_gemm_model_k(config):
    """K = 7168 (56 k blocks, hidden size of V3.2) with non-power-of-two weight scales; the decode
    launch splits K over programs (auto split-K) and sums the partials."""
    gen = generator(7168)
    a_fp8, a_scales = random_activations(gen, 64, 7168)
    w_fp8, w_scales = random_weight(gen, 128, 7168, rescale=True)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=config,
                   out=poisoned((64, 128), torch.float32))
    check_gemm(got, *gemm_reference(a_fp8, a_scales, w_fp8, w_scales))


def test_fp8_gemm_explicit_split_k():
    """8 k blocks in 3 splits of 3, 3 and 2 (the last split runs out of k blocks early)."""
    gen = generator(3)
    a_fp8, a_scales = random_activations(gen, 5, 1024)
    w_fp8, w_scales = random_weight(gen, 192, 1024)
    config = Fp8GemmConfig(block_m=16, block_n=64, swap_ab=True, split_k=3, group_m=1, num_warps=4, num_stages=3)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, torch.float32, config=config,
                   out=poisoned((5, 192), torch.float32))
    check_gemm(got, *gemm_reference(a_fp8, a_scales, w_fp8, w_scales))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [70, 4])
def test_fp8_gemm_16_bit_output_into_strided_out(out_dtype, m):
    """Rounded once to the output dtype; a preallocated non-contiguous out (a column window of a
    NaN buffer) is written exactly in its window (M = 70: the tile kernel; M = 4: the stream kernel)."""
    gen = generator(16 + m)
    a_fp8, a_scales = random_activations(gen, m, 256)
    w_fp8, w_scales = random_weight(gen, 144, 256)
    buffer = poisoned((m, 150), out_dtype)
    got = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, out_dtype, out=buffer[:, 3:147])
    assert got.dtype == out_dtype
    check_gemm(got, *gemm_reference(a_fp8, a_scales, w_fp8, w_scales), rounding=ROUNDING[out_dtype])
    assert buffer[:, :3].isnan().all() and buffer[:, 147:].isnan().all(), "wrote outside out"
    default = fp8_gemm(a_fp8, a_scales, w_fp8, w_scales)
    assert default.dtype == torch.bfloat16 and default.shape == (m, 144)


def test_fp8_gemm_empty_and_bad_input():
    gen = generator(0)
    a_fp8, a_scales = random_activations(gen, 4, 256)
    w_fp8, w_scales = random_weight(gen, 128, 256)
    assert fp8_gemm(a_fp8[:0], a_scales[:0], w_fp8, w_scales).shape == (0, 128)
    with pytest.raises(InputError, match="multiple of 16"):
        fp8_gemm(a_fp8[:, :120], a_scales, w_fp8[:, :120], w_scales)
    with pytest.raises(InputError, match="K differs"):
        fp8_gemm(a_fp8, a_scales, w_fp8[:, :128], w_scales[:, :1])
    with pytest.raises(InputError, match="b_scales"):
        fp8_gemm(a_fp8, a_scales, w_fp8, w_scales.T.contiguous())
    with pytest.raises(InputError, match="a_scales"):
        fp8_gemm(a_fp8, a_scales.double(), w_fp8, w_scales)
    with pytest.raises(InputError, match="float8_e4m3fn"):
        fp8_gemm(a_fp8.float(), a_scales, w_fp8, w_scales)
    with pytest.raises(InputError, match="out must be"):
        fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, out=torch.zeros(4, 128, device=DEVICE))
    with pytest.raises(InputError, match="block_n"):
        fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, config=StreamConfig(block_n=256))
    with pytest.raises(InputError, match="k_step must be 1 or 2"):
        fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, config=StreamConfig(k_step=4))
    with pytest.raises(InputError, match="M <= 16"):
        a17, a17_scales = random_activations(gen, 17, 256)
        fp8_gemm(a17, a17_scales, w_fp8, w_scales, config=StreamConfig())
    with pytest.raises(InputError, match="config must be"):
        fp8_gemm(a_fp8, a_scales, w_fp8, w_scales, config="stream")


# ----------------------------------------------------------------------------------------------
# fused kv_b head projections
# ----------------------------------------------------------------------------------------------

HEAD_DIMS = {"tiny": (4, 64, 128), "v32": (2, 128, 128)}    # heads, qk_nope_head_dim, v_head_dim
LATENT = 512


def kv_b_weight(gen, heads, nope, v_dim):
    """kv_b_proj.weight [H * (nope + v), 512] fp8 with non-power-of-two block scales, and its fp64
    dequantised [H, nope + v, 512] view."""
    w_fp8, scales = random_weight(gen, heads * (nope + v_dim), LATENT, rescale=True)
    return w_fp8, scales, dequantize_block_fp8(w_fp8, scales, dtype=torch.float64).view(heads, nope + v_dim, LATENT)


@pytest.mark.parametrize("programs_per_sm", [0, head_proj.PROGRAMS_PER_SM])   # 0: the most heads a program
@pytest.mark.parametrize("tokens", [1, 19, 70, 300])
@pytest.mark.parametrize("dims", list(HEAD_DIMS))
def test_value_proj_fp8(dims, tokens, programs_per_sm, monkeypatch):
    """o = o_lat . W_v^T per head, written as e4m3 + power-of-two scales per 128 values: the scales
    are the rule's scales of the exact product, the values its e4m3 rounding; an all-zero o_lat row
    gives zeros with the smallest (finite) scale. At prefill (more than 64 tokens) a program takes several
    heads, one after the other (as many as the launch rule gives, and the most it allows)."""
    monkeypatch.setattr(head_proj, "PROGRAMS_PER_SM", programs_per_sm)
    head_proj._PLANS.clear()
    heads, nope, v_dim = HEAD_DIMS[dims]
    gen = generator(tokens * 10 + heads)
    w_fp8, w_scales, w = kv_b_weight(gen, heads, nope, v_dim)
    o_lat = varied(gen, tokens * heads, LATENT, 1).view(tokens, heads, LATENT).bfloat16()
    o_lat[tokens // 2, heads - 1] = 0.0
    out = (torch.full((tokens, heads * v_dim), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE),
           poisoned((tokens, heads * v_dim // FP8_GROUP), torch.float32))
    values, scales = mla_value_proj_fp8(o_lat, w_fp8, w_scales, nope, v_dim, out=out)
    assert values is out[0] and scales is out[1]

    ref = torch.einsum("thc,hjc->thj", o_lat.double(), w[:, nope:]).reshape(tokens, heads * v_dim)
    magnitude = torch.einsum("thc,hjc->thj", o_lat.double().abs(), w[:, nope:].abs()).reshape(ref.shape)
    got = dequantize_groups(values, scales)
    assert torch.isfinite(got).all() and torch.isfinite(scales).all(), "every value and scale written"
    ref_scales = pow2_scale(ref.float().unflatten(-1, (-1, FP8_GROUP)).abs().amax(-1), ACT_MIN_SCALE)
    assert torch.equal(scales, ref_scales)
    group_scale = scales.double().repeat_interleave(FP8_GROUP, -1)
    bound = (E4M3_ROUNDING * ref.abs() + E4M3_SUBNORMAL_STEP / 2 * group_scale
             + HEAD_ELEMENT_TOL * magnitude * (1 + E4M3_ROUNDING))
    excess = (got - ref).abs() - bound
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the e4m3 rounding bound"
    zero = slice((heads - 1) * v_dim, heads * v_dim)
    assert (got[tokens // 2, zero] == 0).all()
    assert (scales[tokens // 2, zero.start // FP8_GROUP:] == 2.0**ACT_MIN_EXPONENT).all()
    if tokens > 64 and programs_per_sm == 0:
        (plan,) = head_proj._PLANS.values()
        assert plan.args[2]["HEADS"] == heads, "the prefill launch took every head in one program"


@pytest.mark.parametrize("tokens", [1, 70, 300])   # prefill: token tiles of 64, the last partial
@pytest.mark.parametrize("dims", list(HEAD_DIMS))
def test_query_absorb(dims, tokens):
    """q_lat = q_nope . W_k per head from a view q[..., :nope] of the full query (no copy), rounded
    once to bf16."""
    heads, nope, v_dim = HEAD_DIMS[dims]
    gen = generator(tokens * 20 + heads)
    w_fp8, w_scales, w = kv_b_weight(gen, heads, nope, v_dim)
    q = varied(gen, tokens * heads, nope + 64, 1).view(tokens, heads, nope + 64).bfloat16()
    q_nope = q[..., :nope]
    out = poisoned((tokens, heads, LATENT), torch.bfloat16)
    got = mla_query_absorb(q_nope, w_fp8, w_scales, nope, v_dim, out=out)
    assert got is out and torch.isfinite(got).all()
    ref = torch.einsum("thn,hnc->thc", q_nope.double(), w[:, :nope])
    magnitude = torch.einsum("thn,hnc->thc", q_nope.double().abs(), w[:, :nope].abs())
    excess = (got.double() - ref).abs() - BF16_ROUNDING * ref.abs() - HEAD_ELEMENT_TOL * magnitude
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the bf16 rounding bound"


@pytest.mark.parametrize("tokens", [1, 70, 300])
def test_query_absorb_with_rope_writes_the_whole_absorbed_query(tokens):
    """rope=(q_rope, cos, sin): out [T, H, 512 + 64] is the absorption (as without rope, bit for bit) and
    then q_rope rotated in interleaved pairs (apply_rope's fp64 reference to bf16 rounding), from views
    of the full query; every element written."""
    heads, nope, v_dim = HEAD_DIMS["v32"]
    gen = generator(tokens * 30 + 7)
    w_fp8, w_scales, _ = kv_b_weight(gen, heads, nope, v_dim)
    q = varied(gen, tokens * heads, nope + 64, 1).view(tokens, heads, nope + 64).bfloat16()
    theta = torch.rand(tokens, 32, generator=gen, device=DEVICE, dtype=torch.float64) * 6.3
    cos, sin = theta.cos().float(), theta.sin().float()
    out = poisoned((tokens, heads, LATENT + 64), torch.bfloat16)
    got = mla_query_absorb(q[..., :nope], w_fp8, w_scales, nope, v_dim, (q[..., nope:], cos, sin), out=out)
    assert got is out and torch.isfinite(got).all()
    assert torch.equal(got[..., :LATENT], mla_query_absorb(q[..., :nope], w_fp8, w_scales, nope, v_dim))
    ref = apply_rope_interleaved(q[..., nope:].double(), cos.double()[:, None], sin.double()[:, None])
    excess = (got[..., LATENT:].double() - ref).abs() - BF16_ROUNDING * ref.abs()
    assert excess.max() <= 1e-6, f"off by {excess.max():.3g} beyond the bf16 rounding bound"
    with pytest.raises(InputError, match=r"rope must be \(q_rope"):
        mla_query_absorb(q[..., :nope], w_fp8, w_scales, nope, v_dim, (q[..., nope:], cos[:, :16], sin))


def test_head_proj_rejects_unsupported():
    gen = generator(1)
    heads, nope, v_dim = HEAD_DIMS["tiny"]
    w_fp8, w_scales, _ = kv_b_weight(gen, heads, nope, v_dim)
    o_lat = torch.randn((2, heads, LATENT), generator=gen, device=DEVICE).bfloat16()
    with pytest.raises(InputError, match="whole scale groups"):
        mla_value_proj_fp8(o_lat, w_fp8, w_scales, nope + 64, v_dim - 64)
    with pytest.raises(InputError, match="multiple of 16"):
        mla_value_proj_fp8(o_lat, w_fp8, w_scales, nope + 8, v_dim - 8)
    with pytest.raises(InputError, match="H = 4"):
        mla_value_proj_fp8(o_lat[:, :3], w_fp8, w_scales, nope, v_dim)
    with pytest.raises(InputError, match="weight_scale_inv"):
        mla_value_proj_fp8(o_lat, w_fp8, w_scales[:-1], nope, v_dim)
    with pytest.raises(InputError, match="bfloat16 or float16"):
        mla_query_absorb(o_lat[..., :nope].float(), w_fp8, w_scales, nope, v_dim)


# ----------------------------------------------------------------------------------------------
# Fp8Linear
# ----------------------------------------------------------------------------------------------

def test_fp8_linear_takes_checkpoint_tensors_and_both_inputs():
    """load_state_dict takes weight / weight_scale_inv as stored; a float input and its
    pre-quantised pair give the same result, within bf16 rounding of the fp64 product."""
    gen = generator(5)
    w_fp8, w_scales = random_weight(gen, 576, 256)
    layer = Fp8Linear(256, 576, device=DEVICE)
    layer.load_state_dict({"weight": w_fp8, "weight_scale_inv": w_scales})
    x = varied(gen, 6, 256, 1).view(2, 3, 256).bfloat16()
    y = layer(x)
    assert y.shape == (2, 3, 576) and y.dtype == torch.bfloat16
    x_fp8, x_scales = quantize_groups(x)
    assert torch.equal(layer((x_fp8, x_scales)), y)
    ref, magnitude = gemm_reference(x_fp8.view(6, 256), x_scales.view(6, 2), w_fp8, w_scales)
    check_gemm(y.view(6, 576), ref, magnitude, rounding=BF16_ROUNDING)


def test_value_proj_feeds_o_proj():
    """The fused value projection's output is o_proj's input as it is: o_proj(fp8 pair) equals the
    fp8 GEMM of the same pair dequantised, with no bf16 round trip in between."""
    heads, nope, v_dim = HEAD_DIMS["tiny"]
    gen = generator(6)
    w_fp8, w_scales, _ = kv_b_weight(gen, heads, nope, v_dim)
    o_lat = varied(gen, 3 * heads, LATENT, 1).view(3, heads, LATENT).bfloat16()
    o_proj = Fp8Linear(heads * v_dim, 256, device=DEVICE)
    o_weight, o_scales = random_weight(gen, 256, heads * v_dim)
    o_proj.load_state_dict({"weight": o_weight, "weight_scale_inv": o_scales})
    pair = mla_value_proj_fp8(o_lat, w_fp8, w_scales, nope, v_dim)
    y = o_proj(pair)
    ref, magnitude = gemm_reference(*pair, o_weight, o_scales)
    check_gemm(y, ref, magnitude, rounding=BF16_ROUNDING)
