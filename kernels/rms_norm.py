"""RMSNorm in one launch: what a decode step's norms cost in kernels (9 small torch ops each before).

y[m, :] = x[m, :] · rsqrt(mean(x[m, :]²) + eps) · weight, computed in fp32 and rounded to x's dtype
(DeepSeek's RMSNorm, as ``minirt.models.deepseek_v32.layers.RMSNorm`` and the eager reference define it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_xm, stride_om, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(out_ptr + row * stride_om + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """
    RMSNorm of every row: out[m] = x[m] · rsqrt(mean(x[m]²) + eps) · weight, in fp32, rounded to x's dtype.

    Args:
        x: [M, N] bfloat16, float16 or float32 with unit stride along N (any row stride: e.g. a
            column slice of a fused projection's output). N up to 65536.
        weight: [N], any float dtype (read as fp32).
        eps: added to the mean square, a float >= 0.
        out: keyword-only, optional preallocated [M, N] of x's dtype with unit stride along N; every
            element is overwritten.

    Returns:
        [M, N] of x's dtype (``out`` when given). M = 0 gives an empty result. The sum of squares
        runs in a different order than torch's mean: results agree to fp32 rounding before the
        final cast.

    Raises:
        minirt.errors.InputError: wrong ranks, dtypes, shapes or strides, or a device the kernels cannot use.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"x must be a 2-D bfloat16, float16 or float32 tensor [M, N], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    m, n = x.shape
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (n,) or not weight.is_floating_point():
        raise InputError(f"weight must be a float tensor [{n}], got {tuple(getattr(weight, 'shape', ()))}")
    if not 1 <= n <= 65536 or (n > 1 and x.stride(1) != 1):
        raise InputError(f"x needs 1 <= N <= 65536 and unit stride along N, got shape {tuple(x.shape)}, strides {x.stride()}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype or \
            (n > 1 and out.stride(1) != 1):
        raise InputError(f"out must be a [{m}, {n}] {x.dtype} tensor with unit stride along N")
    check_device({"x": x, "weight": weight, "out": out})
    if m:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(m,)](x, weight, out, n, x.stride(0), out.stride(0), float(eps), BLOCK=block,
                               num_warps=min(16, max(1, block // 512)))
    return out
