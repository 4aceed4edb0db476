"""RMS norm and rope on the last dims in one launch: DeepSeek-V4's q / kv / compressed-entry epilogue.

V4 normalises a row (per head for q, with or without a weight) and then ropes its LAST ``rope`` dims
(interleaved pairs, ``minirt.rope.apply_rope_interleaved``) at the token's position; the attention
output gets the inverse rotation. In torch that is ~15 ops and a concatenated copy per call (the
eager reference's ``rmsnorm`` / ``unweighted_rmsnorm`` / ``rope_tail``); here it is one kernel reading
the cos / sin tables by position, so no gathered table either.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, rotated, rounded_to_bf16, rows_per_program


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, n_rows, heads, stride_xt, stride_xh,
                      stride_ot, stride_oh, stride_c, stride_s, eps, DIM: tl.constexpr, ROPE: tl.constexpr,
                      NORM: tl.constexpr, WEIGHT: tl.constexpr, INVERSE: tl.constexpr, WRITE_HEAD: tl.constexpr,
                      ROUND_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    t, h = rows // heads, rows % heads
    x_rows = x_ptr + t * stride_xt + h * stride_xh
    out_rows = out_ptr + t * stride_ot + h * stride_oh
    dtype = out_ptr.dtype.element_ty
    scale = tl.full((BLOCK_R,), 1.0, tl.float32)
    if NORM:
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols[None, :] < DIM)
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)
        y = x * scale[:, None]
        if WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=cols < DIM, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            y = rounded_to_bf16(y)
        tl.store(out_rows[:, None] + cols[None, :], y.to(dtype), mask=mask & (cols[None, :] < DIM - ROPE))
    elif WRITE_HEAD and DIM > ROPE:  # not in place: the dims before the rotated ones are copied
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols[None, :] < DIM - ROPE)
        head = tl.load(x_rows[:, None] + cols[None, :], mask=mask)
        if ROUND_BF16:
            head = rounded_to_bf16(head.to(tl.float32))
        tl.store(out_rows[:, None] + cols[None, :], head.to(dtype), mask=mask)
    if ROPE > 0:  # the pairs as [rows, ROPE / 2, 2] tiles: contiguous (vector) loads and stores
        pair = tl.arange(0, ROPE // 2)
        tail = (DIM - ROPE + 2 * pair)[None, :, None] + tl.arange(0, 2)[None, None, :]
        pos = tl.load(pos_ptr + t, mask=row_mask, other=0).to(tl.int64)
        cos = tl.load(cos_ptr + pos[:, None] * stride_c + pair[None, :], mask=row_mask[:, None]).to(tl.float32)
        sin = tl.load(sin_ptr + pos[:, None] * stride_s + pair[None, :], mask=row_mask[:, None]).to(tl.float32)
        if INVERSE:
            sin = -sin
        mask = row_mask[:, None, None]
        x = tl.load(x_rows[:, None, None] + tail, mask=mask).to(tl.float32) * scale[:, None, None]
        if WEIGHT:
            x = x * tl.load(w_ptr + tail).to(tl.float32)
        a, b = tl.split(x)
        a, b = rotated(a, b, cos, sin)
        y = tl.join(a, b)
        if ROUND_BF16:
            y = rounded_to_bf16(y)
        tl.store(out_rows[:, None, None] + tail, y.to(dtype), mask=mask)


def norm_rope(x: torch.Tensor, *, eps: Optional[float] = None, weight: Optional[torch.Tensor] = None,
              cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
              positions: Optional[torch.Tensor] = None, inverse: bool = False,
              out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
              round_to_bf16: bool = False) -> torch.Tensor:
    """
    Per row (each head of each token): an optional RMS norm over the whole row, then rope on its LAST
    ``2 · cos.shape[1]`` dims (interleaved pairs) at the token's position; all in fp32.

    Args:
        x: [T, D] or [T, H, D] bfloat16, float16 or float32, unit stride along D (any token / head
            strides: e.g. a column slice of a fused projection's output). D up to 16384.
        eps: None: no norm; else ``y = x · rsqrt(mean(x²) + eps)`` (times ``weight`` when given).
        weight: optional [D] float (read as fp32), only with ``eps``.
        cos, sin: optional rope tables [P, r / 2] fp32 by position (``reference.rope_cos_sin``), unit
            last stride, r even, a power of two, <= D; both or neither (no rope).
        positions: [T] int32 / int64, the tokens' rows of the tables, each in [0, P) (not checked on
            the device); needed with the tables.
        inverse: rotate by the negated angles (the attention output's inverse rope).
        out_dtype: the result's dtype (default x's); ignored when ``out`` is given.
        out: keyword-only, optional preallocated result of x's shape, unit stride along D, any dtype of
            the three; it may be x itself: then without a norm only the rotated dims are written.
        round_to_bf16: keyword-only; the results rounded to the nearest bfloat16 (ties to even) before they
            are stored in out's dtype: fp32 out holds bf16 values, which fp8 quantisers and fp32 GEMMs read
            with no cast; bf16 out rounds interpreted as on the GPU (the interpreter's own cast truncates).

    Returns:
        ``out`` or a new contiguous tensor of x's shape: the norm's values rounded to its dtype, the
        rotated pairs ``(a·cos − b·sin, a·sin + b·cos)`` of the normed values. The sum of squares runs
        in another order than torch's mean and products may fuse: the eager functions' values to fp32
        rounding. T = 0 gives an empty result.

    Raises:
        minirt.errors.InputError: wrong ranks, shapes, dtypes or strides, or a device the kernels cannot use.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.dtype not in floats:
        raise InputError(f"x must be a bfloat16, float16 or float32 tensor [T, D] or [T, H, D], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if not 1 <= d <= 16384 or x.stride(-1) != 1:
        raise InputError(f"x needs 1 <= D <= 16384 and unit stride along D, got shape {tuple(x.shape)}, strides {x.stride()}")
    if weight is not None and (eps is None or not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (d,)
                               or not weight.is_floating_point()):
        raise InputError(f"weight must be a float tensor [{d}] and comes with eps, got "
                         f"{tuple(getattr(weight, 'shape', ()))} with eps {eps}")
    rope = 0
    if (cos is None) != (sin is None) or (cos is not None and positions is None):
        raise InputError("rope needs cos, sin and positions together")
    if cos is not None:
        rope = 2 * cos.shape[-1] if cos.dim() == 2 else 0
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 2 or 2 * table.shape[1] != rope or table.shape[0] != cos.shape[0] or \
                    not table.is_floating_point() or table.stride(1) != 1:
                raise InputError(f"{name} must be a float table [P, r / 2] with unit last stride like cos, got "
                                 f"{tuple(table.shape)}")
        if not (2 <= rope <= d and rope & (rope - 1) == 0):
            raise InputError(f"the rotated dims must be an even power of two <= D = {d}, got {rope}")
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (t,) or \
                positions.dtype not in (torch.int32, torch.int64):
            raise InputError(f"positions must be an int32 / int64 tensor [{t}], got "
                             f"{getattr(positions, 'dtype', None)} {tuple(getattr(positions, 'shape', ()))}")
    if out is None:
        out = torch.empty(*x.shape, dtype=out_dtype or x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype not in floats or out.stride(-1) != 1:
        raise InputError(f"out must be a float tensor {tuple(x.shape)} with unit stride along D")
    check_device({"x": x, "out": out, **({"weight": weight} if weight is not None else {}),
                  **({"cos": cos, "sin": sin, "positions": positions} if rope else {})})
    n_rows = t * heads
    if n_rows:
        block_d = triton.next_power_of_2(d)
        block_r = rows_per_program(n_rows, block_d)
        dummy = out  # never read: the flags off
        o_strides = (out.stride(0), out.stride(1) if out.dim() == 3 else 0)
        _norm_rope_kernel[(triton.cdiv(n_rows, block_r),)](
            x, weight if weight is not None else dummy, cos if rope else dummy, sin if rope else dummy,
            positions if rope else dummy, out, n_rows, heads, x.stride(0), x.stride(1) if x.dim() == 3 else 0,
            *o_strides, cos.stride(0) if rope else 0, sin.stride(0) if rope else 0,
            float(eps) if eps is not None else 0.0, DIM=d, ROPE=rope, NORM=eps is not None,
            WEIGHT=weight is not None, INVERSE=inverse,
            WRITE_HEAD=not (out.data_ptr() == x.data_ptr() and out.stride() == x.stride()),
            ROUND_BF16=bool(round_to_bf16), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=min(8, max(1, block_d // 256)))
    return out
