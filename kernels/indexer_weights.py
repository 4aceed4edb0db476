"""The V3.2 indexer's head weights, w = scale · x · weights_projᵀ in fp32, in one launch at decode sizes.

DeepSeek's indexer computes ``weights_proj(x.float()) · n_heads^-0.5 · head_dim^-0.5`` in fp32. In torch a
decode step spends four launches a layer on it (x's fp32 copy, a cuBLAS GEMV of two kernels, the
scaling); here one program per (token, head) reads its head's row and reduces over the hidden
size. Above ``DECODE_MAX_TOKENS`` tokens (prefill chunks) torch's fp32 GEMM runs it: there every row of
the weight is reused by many tokens, which a GEMM does and this kernel would not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device
from ._launch import Kept, cdiv, described, launch, per_signature

DECODE_MAX_TOKENS = 16
# One head a program (V3.2: 64 programs a token), 1024 hidden values a loop step, 8 warps: 2.5 µs a launch at
# T 1 on an H100 (64 heads x 7168), against 4.3 with 2 heads, 512 values and 4 warps, and 7.3 for torch's
# copy, GEMV and scaling (CUDA-graph replays; scratch sweep over 1-4 heads, 512-2048 values, 2-8 warps).
_BLOCK_H = 1
_BLOCK_K = 1024


@triton.jit(do_not_specialize=["n_heads"])
def _head_weights_kernel(x_ptr, w_ptr, out_ptr, n_heads, stride_xt, stride_wh, stride_ot, scale, HIDDEN: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < n_heads
    acc = tl.zeros((BLOCK_H, BLOCK_K), tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):  # (a constexpr bound: the interpreter's loops need one)
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < HIDDEN
        x = tl.load(x_ptr + t * stride_xt + cols, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + heads.to(tl.int64)[:, None] * stride_wh + cols[None, :],
                    mask=h_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(out_ptr + t * stride_ot + heads, tl.sum(acc, axis=1) * scale, mask=h_mask)


def indexer_weights(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """
    The lightning indexer's per-head weights: w[t, h] = scale · Σ_d x[t, d] · weight[h, d], in fp32.

    Args:
        x: [T, D] bfloat16, float16 or float32 with unit stride along D (the normed layer input).
        weight: [H, D] float (``indexer.weights_proj.weight``; read as fp32), unit stride along D.
        scale: a float (DeepSeek: n_heads^-0.5 · head_dim^-0.5).

    Returns:
        [T, H] float32, contiguous. T <= DECODE_MAX_TOKENS: one Triton launch (each program sums its
        head's products in its own order); more tokens: ``F.linear(x.float(), weight.float()) * scale``.
        The two agree to fp32 rounding of the sums. T = 0 gives an empty result.

    Raises:
        minirt.errors.InputError: wrong ranks, dtypes, shapes or strides, or a device the kernels cannot use.
    """
    kept = per_signature(_WEIGHTS, lambda: (described(x), described(weight)), lambda: _check(x, weight) or Kept())
    t = x.shape[0]
    if t > DECODE_MAX_TOKENS:
        return F.linear(x.float(), weight.float()) * scale
    out = torch.empty(t, weight.shape[0], dtype=torch.float32, device=x.device)
    if kept.args is None:
        n_heads = weight.shape[0]
        kept.args = ((t, cdiv(n_heads, _BLOCK_H)), t * n_heads > 0,
                     (n_heads, x.stride(0), weight.stride(0), out.stride(0)),
                     dict(HIDDEN=x.shape[1], BLOCK_H=_BLOCK_H, BLOCK_K=_BLOCK_K, num_warps=8))
    grid, launched, integers, constexprs = kept.args
    if launched:
        launch(_head_weights_kernel, grid, (x, weight, out, *integers, float(scale)), constexprs, kept.compiled)
    return out


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> its Kept: a
# signature seen before passed the checks.
_WEIGHTS: dict = {}


def _check(x, weight) -> None:
    """indexer_weights' input checks (InputError)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or \
            x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or (x.shape[1] > 1 and x.stride(1) != 1):
        raise InputError(f"x must be a bfloat16, float16 or float32 tensor [T, D] with unit stride along D, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    d = x.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != d or \
            not weight.is_floating_point() or (d > 1 and weight.stride(1) != 1):
        raise InputError(f"weight must be a float tensor [H, {d}] with unit stride along D, got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    check_device({"x": x, "weight": weight})
