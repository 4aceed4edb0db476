"""DeepSeek-V4's weight formats: block fp8 with ue8m0 scales, and packed fp4 (e2m1) experts.

- fp8: a [out, in] weight stored float8_e4m3fn with a ``.scale`` [ceil(out/128), ceil(in/128)] in
  float8_e8m0fnu (a bare exponent: value 2^(byte − 127)); ``W = w · scale[i // 128, j // 128]``
  (``minirt.blockfp8`` does the block product).
- fp4: a [out, in] weight stored int8 [out, in/2], two e2m1 values a byte, element 2i in the LOW nibble;
  nibble bit 3 is the sign, bits 0-2 index the magnitudes ``FP4_VALUES``; ``.scale`` [out, in/32] e8m0,
  one per 32 consecutive inputs.

Scales must be finite positive powers of two (what ue8m0 can hold); :func:`check_pow2_scales` says
which entry is not.
"""
from __future__ import annotations

import torch

from ...blockfp8 import quantize_block_fp8
from ...formats import ceil_log2
from ...errors import CheckpointError, InputError
from .config import FP4_BLOCK

E8M0_DTYPE = torch.float8_e8m0fnu
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by their 3 low bits
FP4_MAX = 6.0


def check_pow2_scales(scale: torch.Tensor, name: str) -> None:
    """CheckpointError naming ``name`` and the first bad flat index unless every value of ``scale``
    (float8_e8m0fnu or float32) is a finite, positive power of two. e8m0's 0xFF byte is NaN."""
    s = scale.float()
    mantissa, _ = torch.frexp(s)
    bad = ~(torch.isfinite(s) & (s > 0) & (mantissa == 0.5))
    if bad.any():
        index = int(bad.flatten().to(torch.uint8).argmax())
        raise CheckpointError(
            f"tensor {name}: scale {s.flatten()[index].item()} at flat index {index} is not a positive power of two "
            "(scale_fmt ue8m0)"
        )


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in/2] int8 (two e2m1 values a byte, low nibble first) and [out, in/32] scales → [out, in] ``dtype``.
    InputError if the shapes do not pair up."""
    if packed.dtype != torch.int8 or packed.ndim != 2 or tuple(scale.shape) != (packed.shape[0], 2 * packed.shape[1] // FP4_BLOCK) \
            or (2 * packed.shape[1]) % FP4_BLOCK:
        raise InputError(f"dequantize_fp4: expected int8 [out, in/2] values and [out, in/{FP4_BLOCK}] scales, got "
                         f"{packed.dtype} {tuple(packed.shape)} and {tuple(scale.shape)}")
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=packed.device)
    nibbles = torch.stack((packed & 0xF, (packed >> 4) & 0xF), dim=-1).flatten(-2).long()
    values = table[nibbles]
    out = values.view(packed.shape[0], -1, FP4_BLOCK) * scale.float().to(packed.device)[..., None]
    return out.flatten(1).to(dtype)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (int8 [out, in/2] packed e2m1, float8_e8m0fnu [out, in/32] scales), the inverse of
    :func:`dequantize_fp4`: per 32 inputs ``scale = 2^ceil(log2(amax / 6))`` (2^-126 for an all-zero
    block), values rounded to the nearest e2m1 magnitude (ties to the smaller)."""
    groups = w.float().unflatten(-1, (-1, FP4_BLOCK))
    ratio = (groups.abs().amax(-1) / FP4_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.ldexp(torch.ones_like(ratio), ceil_log2(ratio))
    scaled = (groups / scale[..., None]).clamp(-FP4_MAX, FP4_MAX)
    table = torch.tensor(FP4_VALUES, device=w.device)
    code = torch.bucketize(scaled.abs(), (table[1:] + table[:-1]) / 2)
    code = (code | ((scaled < 0) & (code > 0)).long() << 3).flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(E8M0_DTYPE)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (float8_e4m3fn weight, float8_e8m0fnu block scales): ``blockfp8``'s rule, whose
    scales are powers of two already, stored as V4 stores them."""
    w_fp8, scale = quantize_block_fp8(w, block)
    return w_fp8, scale.to(E8M0_DTYPE)
