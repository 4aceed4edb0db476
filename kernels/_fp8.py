"""minirt.formats' power-of-two fp8 scale rule and the e4m3 encoding as Triton helpers, for every kernel
that quantises: the latent cache writer (kv_cache_fp8, KV rule), and with the ACT rule the activation
quantiser (fp8_gemm), the MLA value projection's fp8 output (mla_head_proj_fp8) and the indexer key
cache writer (indexer_cache).

A kernel passes the rule as the exponent of its smallest scale: ceil(log2(max(r, min_scale))) is
max(ceil(log2(r)), ceil(log2(min_scale))), so the kernels clamp the exponent instead of the ratio.
"""
import struct

import torch
import triton
import triton.language as tl

from minirt.errors import InputError
from minirt.formats import ACT_MIN_SCALE, E4M3_MAX, FP8_DTYPE, FP8_GROUP, ceil_log2

# The smallest scale exponent of the ACT rule, -22 (the KV rule's is formats.KV_MIN_SCALE_EXPONENT, -13).
ACT_MIN_EXPONENT = int(ceil_log2(torch.tensor(ACT_MIN_SCALE, dtype=torch.float32)))

# E4M3_MAX = 1.m * 2^(E - 127) as float32 fields; amax / E4M3_MAX needs both for an exact ceil(log2).
_E4M3_MAX_BITS = struct.unpack("<I", struct.pack("<f", E4M3_MAX))[0]
_MAX_EXP_FIELD = tl.constexpr(_E4M3_MAX_BITS >> 23)
_MAX_MANTISSA = tl.constexpr(_E4M3_MAX_BITS & 0x7FFFFF)
_E4M3_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def pow2_scale(amax, MIN_EXPONENT: tl.constexpr):
    """(scale, 1 / scale) of groups with largest magnitude amax (float32 >= 0, any shape): scale =
    2^ceil(log2(max(amax / 448, 2^MIN_EXPONENT))) (formats.pow2_scale), both float32 and exact.

    The exponent comes from the bits of amax = 1.f * 2^(E - 127): amax / 448 = (1.f / 1.75) * 2^(E - 135),
    whose ceil(log2) is E - 135, plus one when 1.f > 1.75; zero and denormal amax fall to the minimum.
    Scale and reciprocal are built from the exponent bits (x * 2^-e equals x / 2^e exactly)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - _MAX_EXP_FIELD + ((bits & 0x7FFFFF) > _MAX_MANTISSA).to(tl.int32)
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return scale, inv_scale


@triton.jit
def e4m3_bits(x):
    """Saturating round-to-nearest-even float8_e4m3fn encoding of float32 x (as int32 0..255): the code
    of clamp(x, -448, 448).

    Done with integer arithmetic because the Triton 3.6 interpreter's float8 cast is wrong
    (it truncates and mis-handles mantissa carries); the result equals torch's float8_e4m3fn cast of
    the clamped value (tests check the writers bit-exactly, interpreted and on an H200).
    """
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 (|x| >= 2^-6): round the 23-bit mantissa to 3 bits (ties to even, carries into
    # the exponent), then rebias the exponent from 127 to 7.
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal e4m3 (|x| < 2^-6, steps of 2^-9): float32 addition of 2^14 (ulp 2^-9) rounds to
    # nearest-even; the bit distance from 2^14 is the count of 2^-9 steps (8 = smallest normal).
    subnormal = ((magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
                 - 0x46800000)
    return tl.where(magnitude < 0x3C800000, subnormal, normal) | sign   # 0x3C800000 = 2^-6


@triton.jit
def pow2_quantize_rows(x, MIN_EXPONENT: tl.constexpr):
    """x float32 [R, G], each row one group -> (e4m3 codes int32 [R, G], float32 scales [R]):
    formats.quantize_groups' values clamp(x / scale, -448, 448) and pow2_scale's scales."""
    scale, inv_scale = pow2_scale(tl.max(tl.abs(x), 1), MIN_EXPONENT)
    return e4m3_bits(x * inv_scale[:, None]), scale


def check_fp8_out(fp8_out, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's ``fp8_out`` for an output of ``shape`` [..., N] -> (codes viewed as uint8, scales):
    (codes [..., N] float8_e4m3fn, scales [..., N / 128] float32), unit last strides, N a multiple of 128.
    Raises InputError otherwise."""
    codes, scales = fp8_out if isinstance(fp8_out, tuple) and len(fp8_out) == 2 else (None, None)
    n = shape[-1]
    if n % FP8_GROUP or not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor) \
            or codes.dtype != FP8_DTYPE or codes.shape != shape or scales.dtype != torch.float32 \
            or tuple(scales.shape) != (*shape[:-1], n // FP8_GROUP) or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise InputError(f"fp8_out must be (codes {tuple(shape)} float8_e4m3fn, scales [..., N / {FP8_GROUP}] "
                         f"float32) with unit last strides, for rows of N a multiple of {FP8_GROUP}")
    return codes.view(torch.uint8), scales
