"""Weight block fp8 (e4m3) quantisation, as stored in DeepSeek-V3 / V3.2 checkpoints.

A weight ``W`` of shape [out, in] is stored as ``Wq`` (float8_e4m3fn, same shape) and ``scale_inv``
(float32, [ceil(out / bo), ceil(in / bi)] for a block (bo, bi), normally (128, 128)), with
``W[i, j] = Wq[i, j] * scale_inv[i // bo, j // bi]``. Edge blocks are partial (576 rows → 5 row blocks).
"""
from __future__ import annotations

import torch

from .errors import InputError
from .formats import E4M3_MAX, FP8_DTYPE, pow2_scale

DEFAULT_BLOCK = (128, 128)


def block_scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the ``scale_inv`` of a [out, in] weight: (ceil(out / block[0]), ceil(in / block[1]))."""
    if len(shape) != 2:
        raise InputError(f"block fp8 weights are 2-D [out, in], got shape {tuple(shape)}")
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _mul_blocks_(t: torch.Tensor, factors: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """In place: ``t[i, j] *= factors[i // block[0], j // block[1]]`` (t float32 [out, in])."""
    rows, cols = t.shape
    block_rows = block[0]
    factor_cols = factors.repeat_interleave(block[1], dim=1)[:, :cols]  # [row_blocks, cols], small
    full = rows // block_rows
    # Through a [full, block_rows, cols] view: no second [out, in] temporary.
    t[: full * block_rows].view(full, block_rows, cols).mul_(factor_cols[:full, None, :])
    if rows % block_rows:
        t[full * block_rows :].mul_(factor_cols[full])
    return t


def dequantize_block_fp8(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise a block fp8 weight: ``W[i, j] = w_fp8[i, j] * scale_inv[i // block[0], j // block[1]]``.

    w_fp8: [out, in] float8_e4m3fn. scale_inv: [ceil(out / block[0]), ceil(in / block[1])], any float
    dtype (computed in float32). Returns [out, in] in ``dtype`` on w_fp8's device. The product is exact
    in float32 for power-of-two scales; the cast to ``dtype`` rounds if ``dtype`` is narrower.
    Raises InputError on a wrong dtype or a scale shape that does not match.
    """
    if w_fp8.dtype != FP8_DTYPE:
        raise InputError(f"dequantize_block_fp8: weight must be {FP8_DTYPE}, got {w_fp8.dtype}")
    expected = block_scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise InputError(
            f"dequantize_block_fp8: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(w_fp8.shape)} with block {tuple(block)}: expected {expected}"
        )
    out = _mul_blocks_(w_fp8.to(torch.float32), scale_inv.to(device=w_fp8.device, dtype=torch.float32), block)
    return out.to(dtype)


def quantize_block_fp8(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a [out, in] weight to block fp8 with power-of-two (ue8m0) scales.

    Per block: ``scale = 2^ceil(log2(max(amax / 448, tiny)))`` (tiny = smallest normal float32, so an
    all-zero block gets a finite scale), ``w_fp8 = clamp(w / scale, -448, 448)`` cast to float8_e4m3fn
    (clamped first: the cast is not guaranteed to saturate), ``scale_inv = scale``.
    Returns (w_fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out / block[0]), ceil(in / block[1])]
    float32), on w's device. Per element, ``|w - dequant| <= max(2^-4 |w|, 2^-10 scale)``: e4m3 keeps 3
    mantissa bits (normals) and steps of 2^-9 below 2^-6 (subnormals).
    Raises InputError for a non-2-D, non-floating or non-finite ``w``.
    """
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise InputError(f"quantize_block_fp8: weight must be a float tensor, got {w.dtype}")
    row_blocks, col_blocks = block_scale_shape(w.shape, block)
    w = w.to(torch.float32)
    if not torch.isfinite(w).all():
        raise InputError("quantize_block_fp8: weight has NaN or Inf values")
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, col_blocks * block[1] - cols, 0, row_blocks * block[0] - rows))
    amax = padded.view(row_blocks, block[0], col_blocks, block[1]).amax(dim=(1, 3))
    scale_inv = pow2_scale(amax, torch.finfo(torch.float32).tiny)
    # Multiplying by 2^-k rounds exactly like dividing by 2^k (both are normal powers of two).
    scaled = _mul_blocks_(w.clone(), scale_inv.reciprocal(), block)
    w_fp8 = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return w_fp8, scale_inv
