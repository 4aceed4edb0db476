"""Rope in one launch: rotate the first dims of every head by its token's angles, copy the rest.

Two layouts of the rotated pairs: interleaved ``(x[2i], x[2i+1])`` (MLA) and half-split
``(x[i], x[i + r/2])`` (the V3.2 indexer), as ``minirt.rope.apply_rope_interleaved`` /
``apply_rope_half`` define them (those are the eager reference's; this kernel is the runtime's).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
                 ROPE: tl.constexpr, DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h[:, None] < heads
    x_rows = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    out_rows = out_ptr + (t * heads + h[:, None].to(tl.int64)) * DIM
    pair = tl.arange(0, ROPE // 2)
    if INTERLEAVED:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, pair + ROPE // 2
    cos = tl.load(cos_ptr + t * stride_ct + pair)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + pair)[None, :].to(tl.float32)
    a = tl.load(x_rows + first[None, :], mask=h_mask).to(tl.float32)
    b = tl.load(x_rows + second[None, :], mask=h_mask).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_rows + first[None, :], (a * cos - b * sin).to(dtype), mask=h_mask)
    tl.store(out_rows + second[None, :], (a * sin + b * cos).to(dtype), mask=h_mask)
    if DIM > ROPE:  # the dims after the rotated ones: copied (cast to out's dtype)
        rest = ROPE + tl.arange(0, BLOCK_D)
        mask = h_mask & (rest[None, :] < DIM)
        tl.store(out_rows + rest[None, :], tl.load(x_rows + rest[None, :], mask=mask).to(dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int, interleaved: bool,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """
    Rotate dims [0, rope_dims) of every head of every token by that token's angles, in fp32; the
    dims after them are copied.

    Args:
        x: [T, D] or [T, H, D] bfloat16, float16 or float32, unit stride along D (any token and head
            strides: e.g. the rope slice of a projection's output).
        cos, sin: [T, rope_dims / 2], any float dtype (read as fp32; ``rope_cos_sin``'s tables at
            the tokens' positions), unit last stride.
        rope_dims: the rotated dims, even, a power of two, <= D.
        interleaved: True: pairs (x[2i], x[2i+1]) (MLA); False: (x[i], x[i + rope_dims / 2]) (the
            indexer).
        out_dtype: the result's dtype (default x's).

    Returns:
        A new contiguous tensor of x's shape: first' = first·cos − second·sin, second' =
        first·sin + second·cos per pair (the compiler may fuse a product into the subtraction: the
        torch functions' values to fp32 rounding).

    Raises:
        minirt.errors.InputError: wrong ranks, shapes, dtypes or strides, or a device the kernels cannot use.
    """
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or \
            x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"x must be a bfloat16, float16 or float32 tensor [T, D] or [T, H, D], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t, d = x.shape[0], x.shape[-1]
    if not (2 <= rope_dims <= d and rope_dims & (rope_dims - 1) == 0) or x.stride(-1) != 1:
        raise InputError(f"rope_dims must be an even power of two <= D = {d} and x needs unit stride along D; "
                         f"got rope_dims {rope_dims}, strides {x.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (t, rope_dims // 2) or \
                not table.is_floating_point() or (rope_dims > 2 and table.stride(1) != 1):
            raise InputError(f"{name} must be a float tensor [{t}, {rope_dims // 2}] with unit last stride, got "
                             f"{tuple(getattr(table, 'shape', ()))}")
    check_device({"x": x, "cos": cos, "sin": sin})
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    if t and heads:
        block_h = min(triton.next_power_of_2(heads), 16)
        _rope_kernel[(t, triton.cdiv(heads, block_h))](
            x, cos, sin, out, heads, x.stride(0), x.stride(1) if x.dim() == 3 else 0, cos.stride(0), sin.stride(0),
            ROPE=rope_dims, DIM=d, INTERLEAVED=interleaved, BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(max(d - rope_dims, 1)), num_warps=4)
    return out
