"""RMSNorm in one launch: what a decode step's norms cost in kernels (9 small torch ops each before).

y[m, :] = x[m, :] · rsqrt(mean(x[m, :]²) + eps) · weight, computed in fp32 and rounded to x's dtype or
another (DeepSeek's RMSNorm, as ``minirt.models.deepseek_v32.layers.RMSNorm`` and the eager reference define
it; V4's norms to bf16 values held in fp32 with ``round_to_bf16``). The same launch can add the residual
first (``add_rms_norm``: a layer's ``h = x + attn``, then the norm of h) and quantise y for the next fp8
GEMM (``fp8_out``): three launches of a decode step in one.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError
from minirt.formats import FP8_GROUP

from ._common import check_device, rms_normed, rounded_to_bf16
from ._fp8 import ACT_MIN_EXPONENT, check_fp8_out, pow2_quantize_rows
from ._launch import Kept, described, described_tuple, launch, per_signature


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, codes_ptr, scales_ptr, n, stride_xm, stride_dm,
                     stride_hm, stride_om, stride_cm, stride_sm, eps, ROWS: tl.constexpr, COLS: tl.constexpr,
                     ADD: tl.constexpr, ROUND_BF16: tl.constexpr, FP8: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    # Program = one row of x, held as a [ROWS, COLS] tile: with FP8 each tile row is one quantisation group.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    mask = cols < n
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # h = x + delta rounded to h's dtype as torch rounds it (to nearest, also when interpreted)
        x += tl.load(delta_ptr + row * stride_dm + cols, mask=mask, other=0.0).to(tl.float32)
        if sum_ptr.dtype.element_ty == tl.bfloat16:
            x = rounded_to_bf16(x)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_hm + cols, x, mask=mask)
        x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = rms_normed(x, w, n, eps)
    if ROUND_BF16:  # to the nearest bf16 before the store's cast (the interpreter's own cast truncates)
        y = rounded_to_bf16(y)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + cols, y, mask=mask)
    if FP8:  # the stored y quantised per tile row (COLS = 128 columns): quantize_act_fp8's codes and scales
        codes, scale = pow2_quantize_rows(y.to(tl.float32), MIN_EXPONENT)
        tl.store(codes_ptr + row * stride_cm + cols, codes.to(tl.uint8), mask=mask)
        groups = tl.arange(0, ROWS)
        tl.store(scales_ptr + row * stride_sm + groups, scale, mask=groups < n // COLS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None, round_to_bf16: bool = False,
             fp8_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """
    RMSNorm of every row: out[m] = x[m] · rsqrt(mean(x[m]²) + eps) · weight, in fp32, rounded to out's
    dtype (x's by default).

    Args:
        x: [M, N] bfloat16, float16 or float32 with unit stride along N (any row stride: e.g. a
            column slice of a fused projection's output). N up to 65536.
        weight: [N], any float dtype (read as fp32).
        eps: added to the mean square, a float >= 0.
        out: keyword-only, optional preallocated [M, N] bfloat16, float16 or float32 (any of the three,
            not only x's) with unit stride along N; every element is overwritten.
        out_dtype: keyword-only, the result's dtype when ``out`` is not given: bfloat16, float16 or
            float32, default x's; ignored when ``out`` is given.
        round_to_bf16: keyword-only; the normed values rounded to the nearest bfloat16 (ties to even)
            before they are stored in out's dtype: an fp32 out holds bf16 values (which fp8 quantisers
            and fp32 GEMMs read with no cast), a bf16 out rounds to nearest when interpreted as on the
            GPU (the interpreter's own cast truncates), a float16 out gets the bf16 value rounded again.
        fp8_out: keyword-only, optional (codes [M, N] float8_e4m3fn, scales [M, N / 128] float32) with
            unit last strides, N a multiple of 128: also written, the stored result (what out holds:
            the rounded values with ``round_to_bf16``) quantised for an fp8 GEMM bit for bit as
            ``quantize_act_fp8`` quantises it.

    Returns:
        [M, N] of out's dtype (``out`` when given). M = 0 gives an empty result. The sum of squares
        runs in a different order than torch's mean: results agree to fp32 rounding before the
        final rounding(s).

    Raises:
        minirt.errors.InputError: wrong ranks, dtypes, shapes or strides, or a device the kernels cannot use.
    """
    kept = per_signature(_NORMS, lambda: (described(x), None, described(weight), described(out),
                                          described_tuple(fp8_out), out_dtype, bool(round_to_bf16)),
                         lambda: _check(x, None, weight, out, fp8_out, out_dtype) or Kept())
    if out is None:
        out = torch.empty(*x.shape, dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, None, weight, eps, None, out, fp8_out, kept, bool(round_to_bf16))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 fp8_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """
    A residual add and the RMSNorm of its result in one launch: h = x + delta (in fp32, rounded to
    x's dtype to nearest, as torch's ``x + delta`` of one dtype), y = ``rms_norm(h, weight, eps)``.

    Args:
        x, delta: [M, N] of one dtype (bfloat16, float16 or float32) with unit stride along N (any
            row strides). N up to 65536.
        weight, eps, fp8_out: as in ``rms_norm`` (fp8_out quantises y).

    Returns:
        (h, y): new contiguous [M, N] tensors of x's dtype. M = 0 gives empty results.

    Raises:
        minirt.errors.InputError: as ``rms_norm``; delta of another shape or dtype than x.
    """
    kept = per_signature(_NORMS, lambda: (described(x), described(delta), described(weight), None,
                                          described_tuple(fp8_out), None, False),
                         lambda: _check(x, delta, weight, None, fp8_out) or Kept())
    # (empty_like: the cheapest allocation call on the host, ~1.3 µs against ~1.5 for sizes as ints.)
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, delta, weight, eps, h, y, fp8_out, kept)
    return h, y


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment, out_dtype,
# round_to_bf16) -> its Kept: a signature seen before passed the checks.
_NORMS: dict = {}


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, delta, weight, out, fp8_out, out_dtype=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _FLOATS:
        raise InputError(f"x must be a 2-D bfloat16, float16 or float32 tensor [M, N], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    m, n = x.shape
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (n,) or not weight.is_floating_point():
        raise InputError(f"weight must be a float tensor [{n}], got {tuple(getattr(weight, 'shape', ()))}")
    if not 1 <= n <= 65536 or (n > 1 and x.stride(1) != 1):
        raise InputError(f"x needs 1 <= N <= 65536 and unit stride along N, got shape {tuple(x.shape)}, strides {x.stride()}")
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype not in _FLOATS
                            or (n > 1 and out.stride(1) != 1)):
        raise InputError(f"out must be a [{m}, {n}] bfloat16, float16 or float32 tensor with unit stride along N, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    if out is None and out_dtype is not None and out_dtype not in _FLOATS:
        raise InputError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    if delta is not None and (not isinstance(delta, torch.Tensor) or delta.shape != x.shape or delta.dtype != x.dtype
                              or (n > 1 and delta.stride(1) != 1)):
        raise InputError(f"delta must be a {x.dtype} tensor {list(x.shape)} with unit stride along N, got "
                         f"{getattr(delta, 'dtype', type(delta).__name__)} {list(getattr(delta, 'shape', ()))}")
    codes, scales = check_fp8_out(fp8_out, x.shape) if fp8_out is not None else (None, None)
    check_device({"x": x, "weight": weight, **({"out": out} if out is not None else {}),
                  **({"delta": delta} if delta is not None else {}),
                  **({"codes": codes, "scales": scales} if fp8_out is not None else {})})


def _launch(x, delta, weight, eps, h, out, fp8_out, kept: Kept, round_to_bf16: bool = False) -> None:
    """The kernel on checked inputs into out (and h, the sum, with delta; fp8_out with the quantiser; the
    normed values rounded to bf16 first with round_to_bf16); kept: the call signature's Kept."""
    codes, scales = (fp8_out[0].view(torch.uint8), fp8_out[1]) if fp8_out is not None else (out, out)  # FP8 off: unread
    if kept.args is None:
        m, n = x.shape
        block = triton.next_power_of_2(n)
        cols = min(block, FP8_GROUP)
        kept.args = ((m,), (n, x.stride(0), 0 if delta is None else delta.stride(0), 0 if h is None else h.stride(0),
                            out.stride(0), codes.stride(0), scales.stride(0)),
                     dict(ROWS=block // cols, COLS=cols, ADD=delta is not None, ROUND_BF16=round_to_bf16,
                          FP8=fp8_out is not None,
                          MIN_EXPONENT=ACT_MIN_EXPONENT, num_warps=min(16, max(1, block // 512))))
    grid, integers, constexprs = kept.args
    if grid[0]:
        launch(_rms_norm_kernel, grid, (x, x if delta is None else delta, weight, out if h is None else h, out, codes,
                                        scales, *integers, float(eps)), constexprs, kept.compiled)
