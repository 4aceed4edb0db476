"""Rope in one launch: rotate the first dims of every head by its token's angles, copy the rest
(optionally each row layer-normed first: the V3.2 indexer's key epilogue in one launch).

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

from ._common import check_device, rotated
from ._fp8 import ACT_MIN_EXPONENT, check_fp8_out, pow2_quantize_rows
from ._launch import Kept, cdiv, described, described_tuple, launch, per_signature


@triton.jit
def _layer_normed(v, cols, mean, rstd, w_ptr, b_ptr, LAYER_NORM: tl.constexpr):
    """fp32 v [rows, cols] normalised by its rows' (mean, rstd) and times the weight plus the bias at
    columns ``cols`` when LAYER_NORM; v itself otherwise."""
    if LAYER_NORM:
        w = tl.load(w_ptr + cols).to(tl.float32)
        b = tl.load(b_ptr + cols).to(tl.float32)
        v = (v - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
    return v


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows_ptr, w_ptr, b_ptr, m_ptr, codes_ptr, scales_ptr, heads,
                 n_out_rows, stride_xt, stride_xh, stride_ct, stride_st, stride_ot, eps, ROPE: tl.constexpr,
                 DIM: tl.constexpr, INTERLEAVED: tl.constexpr, LAYER_NORM: tl.constexpr, SCATTER: tl.constexpr,
                 ROTATE: tl.constexpr, FP8: tl.constexpr, MIN_EXPONENT: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_ROW: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h[:, None] < heads
    x_rows = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    dest = t
    if SCATTER:  # token t's result goes to out's row rows[t]; none outside [0, n_out_rows)
        dest = tl.load(rows_ptr + t).to(tl.int64)
        h_mask = h_mask & (dest >= 0) & (dest < n_out_rows)
        dest = tl.where(dest >= 0, dest, 0)
    out_rows = out_ptr + dest * stride_ot + h[:, None].to(tl.int64) * DIM
    mean = tl.zeros((BLOCK_H,), tl.float32)
    rstd = tl.full((BLOCK_H,), 1.0, tl.float32)
    if LAYER_NORM:  # each head's row statistics first; the pieces below are normalised as they load
        cols = tl.arange(0, BLOCK_ROW)
        in_row = cols[None, :] < DIM
        row = tl.load(x_rows + cols[None, :], mask=h_mask & in_row, other=0.0).to(tl.float32)
        mean = tl.sum(row, axis=1) / DIM
        centred = tl.where(in_row, row - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / DIM + eps)
    pair = tl.arange(0, ROPE // 2)
    if INTERLEAVED:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, pair + ROPE // 2
    cos = tl.load(cos_ptr + t * stride_ct + pair)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + pair)[None, :].to(tl.float32)
    a = _layer_normed(tl.load(x_rows + first[None, :], mask=h_mask, other=0.0).to(tl.float32), first, mean, rstd,
                      w_ptr, b_ptr, LAYER_NORM)
    b = _layer_normed(tl.load(x_rows + second[None, :], mask=h_mask, other=0.0).to(tl.float32), second, mean, rstd,
                      w_ptr, b_ptr, LAYER_NORM)
    dtype = out_ptr.dtype.element_ty
    a, b = rotated(a, b, cos, sin)
    # The dims after the rotated ones: copied (normalised first with LAYER_NORM).
    rest = ROPE + tl.arange(0, BLOCK_D)
    rest_mask = h_mask & (rest[None, :] < DIM)
    v = _layer_normed(tl.load(x_rows + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32),
                      tl.minimum(rest, DIM - 1), mean, rstd, w_ptr, b_ptr, LAYER_NORM)
    if ROTATE:  # the whole row times the matrix (fp32 products): the pieces' rows of it, one MMA each
        cols = tl.arange(0, BLOCK_ROW)
        y = tl.dot(a, tl.load(m_ptr + first[:, None] * DIM + cols[None, :]), input_precision="ieee")
        y += tl.dot(b, tl.load(m_ptr + second[:, None] * DIM + cols[None, :]), input_precision="ieee")
        if DIM > ROPE:
            y += tl.dot(tl.where(rest_mask, v, 0.0), tl.load(m_ptr + tl.minimum(rest, DIM - 1)[:, None] * DIM +
                                                              cols[None, :], mask=rest[:, None] < DIM, other=0.0),
                        input_precision="ieee")
        y = y.to(dtype)
        tl.store(out_rows + cols[None, :], y, mask=h_mask)
        if FP8:  # the stored rows quantised per 128 columns: quantize_act_fp8's codes and scales
            G: tl.constexpr = BLOCK_ROW // 128
            codes, scale = pow2_quantize_rows(tl.reshape(y.to(tl.float32), (BLOCK_H * G, 128)), MIN_EXPONENT)
            row_ids = t * heads + h[:, None].to(tl.int64)
            tl.store(codes_ptr + row_ids * DIM + cols[None, :], tl.reshape(codes, (BLOCK_H, BLOCK_ROW)).to(tl.uint8),
                     mask=h_mask)
            groups = tl.arange(0, G)[None, :]
            tl.store(scales_ptr + row_ids * G + groups, tl.reshape(scale, (BLOCK_H, G)), mask=h_mask)
    else:
        tl.store(out_rows + first[None, :], a.to(dtype), mask=h_mask)
        tl.store(out_rows + second[None, :], b.to(dtype), mask=h_mask)
        if DIM > ROPE:
            tl.store(out_rows + rest[None, :], v.to(dtype), mask=rest_mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int, interleaved: bool,
               out_dtype: Optional[torch.dtype] = None, *,
               layer_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
               scatter: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rotation: Optional[torch.Tensor] = None,
               fp8_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """
    Rotate dims [0, rope_dims) of every head of every token by that token's angles, in fp32; the
    dims after them are copied. With ``layer_norm`` every head's row is first layer-normed (the V3.2
    indexer's keys: its k_norm, then rope).

    Args:
        x: [T, D] or [T, H, D] bfloat16, float16 or float32, unit stride along D (any token and head
            strides: e.g. the rope slice of a projection's output).
        cos, sin: [T, rope_dims / 2], any float dtype (read as fp32; ``rope_cos_sin``'s tables at
            the tokens' positions), unit last stride.
        rope_dims: the rotated dims, even, a power of two, <= D.
        interleaved: True: pairs (x[2i], x[2i+1]) (MLA); False: (x[i], x[i + rope_dims / 2]) (the
            indexer).
        out_dtype: the result's dtype (default x's).
        layer_norm: keyword-only, optional (weight [D], bias [D], eps) of any float dtype (read as fp32):
            each row x[t, h] becomes (x − mean) · rsqrt(var + eps) · weight + bias over its D dims (var
            biased, as ``torch.nn.functional.layer_norm``), in fp32, before the rotation.
        scatter: keyword-only, optional (out [R, D] with unit stride along D, rows [T] int32 / int64), x 2-D:
            token t's result goes to out[rows[t]] (out's dtype; out_dtype ignored) instead of a new tensor; rows
            outside [0, R) (e.g. -1) are skipped. Two tokens with one row leave one of them, unspecified which.
            (The V3.2 indexer's exact keys straight into their cache slots.)
        rotation: keyword-only, optional [D, D] float32 contiguous matrix M: each row's result (after its rope)
            becomes row · M in fp32 (V3.2's fp8 indexer: its Hadamard rotation, ``hadamard_matrix``);
            D a power of two, rope_dims / 2 at least 16 and D - rope_dims 0 or at least 16.
        fp8_out: keyword-only, optional (codes of x's shape float8_e4m3fn, scales [..., D / 128] float32), both
            contiguous, with ``rotation`` and without ``scatter``, D a multiple of 128: also written, the stored
            result quantised per 128 values as ``quantize_act_fp8`` quantises it (the fp8 indexer's queries).

    Returns:
        ``out`` given ``scatter``; else a new contiguous tensor of x's shape: first' = first·cos − second·sin, second' =
        first·sin + second·cos per pair (the compiler may fuse a product into the subtraction: the
        torch functions' values to fp32 rounding).

    Raises:
        minirt.errors.InputError: wrong ranks, shapes, dtypes or strides, or a device the kernels cannot use.
    """
    weight, bias, eps = layer_norm if isinstance(layer_norm, tuple) and len(layer_norm) == 3 else (None, None, None)
    out, rows = scatter if isinstance(scatter, tuple) and len(scatter) == 2 else (None, None)
    codes, scales = fp8_out if isinstance(fp8_out, tuple) and len(fp8_out) == 2 else (None, None)
    kept = per_signature(_ROPES, lambda: (
        described(x), described(cos), described(sin), rope_dims.__class__, rope_dims, interleaved, out_dtype,
        None if layer_norm is None else (layer_norm.__class__, len(layer_norm), described(weight), described(bias)),
        None if scatter is None else (scatter.__class__, len(scatter), described(out), described(rows)),
        described(rotation), described_tuple(fp8_out)),
        lambda: _check(x, cos, sin, rope_dims, layer_norm, scatter, rotation, fp8_out) or Kept())
    if scatter is None:
        out = torch.empty(*x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if kept.args is None:
        t, d = x.shape[0], x.shape[-1]
        heads = x.shape[1] if x.dim() == 3 else 1
        block_h = 16 if rotation is not None else min(triton.next_power_of_2(heads), 16)  # (MMA rows: 16)
        kept.args = ((t, cdiv(heads, block_h)), t * heads > 0, (
            heads, out.shape[0], x.stride(0), x.stride(1) if x.dim() == 3 else 0, cos.stride(0), sin.stride(0),
            out.stride(0)), dict(
            ROPE=rope_dims, DIM=d, INTERLEAVED=interleaved, LAYER_NORM=layer_norm is not None,
            SCATTER=scatter is not None, ROTATE=rotation is not None, FP8=fp8_out is not None,
            MIN_EXPONENT=ACT_MIN_EXPONENT, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(max(d - rope_dims, 1)),
            BLOCK_ROW=triton.next_power_of_2(d), num_warps=4))
    grid, launched, integers, constexprs = kept.args
    if launched:  # (unused pointers: x, never read with their flags off)
        launch(_rope_kernel, grid, (x, cos, sin, out, x if rows is None else rows, x if weight is None else weight,
                                    x if bias is None else bias, x if rotation is None else rotation,
                                    x if codes is None else codes.view(torch.uint8), x if scales is None else scales,
                                    *integers, 0.0 if eps is None else float(eps)), constexprs, kept.compiled)
    return out


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment, the other arguments
# but eps) -> its Kept: a signature seen before passed the checks.
_ROPES: dict = {}


def _check(x, cos, sin, rope_dims, layer_norm, scatter, rotation, fp8_out) -> None:
    """apply_rope's input checks (InputError)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or \
            x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"x must be a bfloat16, float16 or float32 tensor [T, D] or [T, H, D], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t, d = x.shape[0], x.shape[-1]
    if isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or \
            not (2 <= rope_dims <= d and rope_dims & (rope_dims - 1) == 0) or x.stride(-1) != 1:
        raise InputError(f"rope_dims must be an even power of two <= D = {d} and x needs unit stride along D; "
                         f"got rope_dims {rope_dims}, strides {x.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (t, rope_dims // 2) or \
                not table.is_floating_point() or (rope_dims > 2 and table.stride(1) != 1):
            raise InputError(f"{name} must be a float tensor [{t}, {rope_dims // 2}] with unit last stride, got "
                             f"{tuple(getattr(table, 'shape', ()))}")
    weight, bias, _ = layer_norm if isinstance(layer_norm, tuple) and len(layer_norm) == 3 else (None, None, None)
    if layer_norm is not None and not all(isinstance(v, torch.Tensor) and tuple(v.shape) == (d,) and
                                          v.is_floating_point() for v in (weight, bias)):
        raise InputError(f"layer_norm must be (weight [{d}], bias [{d}], eps), float tensors and a float")
    out, rows = scatter if isinstance(scatter, tuple) and len(scatter) == 2 else (None, None)
    if scatter is not None and not (
            x.dim() == 2 and isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == d and
            out.dtype in (torch.bfloat16, torch.float16, torch.float32) and (d == 1 or out.stride(1) == 1) and
            isinstance(rows, torch.Tensor) and tuple(rows.shape) == (t,) and rows.dtype in (torch.int32, torch.int64)):
        raise InputError(f"scatter must be (out [R, {d}] float with unit stride along D, rows [{t}] int32 / int64) "
                         f"with 2-D x")
    if rotation is not None and not (
            isinstance(rotation, torch.Tensor) and rotation.dtype == torch.float32 and tuple(rotation.shape) == (d, d)
            and rotation.is_contiguous() and d & (d - 1) == 0 and rope_dims >= 32 and d - rope_dims in (0, *range(16, d))):
        raise InputError(f"rotation must be a contiguous float32 [{d}, {d}] tensor, D a power of two, rope_dims / 2 "
                         f"at least 16 and D - rope_dims 0 or at least 16 (the MMAs' sizes); got {getattr(rotation, 'dtype', type(rotation).__name__)} "
                         f"{tuple(getattr(rotation, 'shape', ()))}, rope_dims {rope_dims}")
    codes, scales = check_fp8_out(fp8_out, x.shape) if fp8_out is not None else (None, None)
    if fp8_out is not None and not (rotation is not None and scatter is None and codes.is_contiguous() and
                                    scales.is_contiguous()):
        raise InputError("fp8_out must be contiguous, with rotation and without scatter")
    check_device({"x": x, "cos": cos, "sin": sin, **({"weight": weight, "bias": bias} if layer_norm else {}),
                  **({"out": out, "rows": rows} if scatter is not None else {}),
                  **({"rotation": rotation} if rotation is not None else {}),
                  **({"codes": codes, "scales": scales} if fp8_out is not None else {})})
