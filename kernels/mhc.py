"""DeepSeek-V4's mHC (manifold-constrained hyper-connections) mixing, fused: one launch for the mixing
weights, Sinkhorn and the collapse of a sub-layer's input (``hc_pre``), one for the new residual state
(``hc_post``). One program per token (compiled; interpreted, per block of tokens); everything in fp32.

    m     = (fn · flat X) · rsqrt(mean(flat X²) + eps)            X [N, hc, D], fn [(2 + hc)·hc, hc·D]
    pre   = σ(m[:hc]·scale[0] + base[:hc]) + hc_eps
    post  = 2·σ(m[hc:2hc]·scale[1] + base[hc:2hc])
    comb  = softmax_rows(m[2hc:]·scale[2] + base[2hc:]) + hc_eps, viewed [hc, hc] (comb[j, k] = m[2hc + hc·j + k]),
            then columns normalised, then (iters − 1) times rows and columns (each divided by its sum + hc_eps)
    collapsed = Σ_j pre[j]·X[j]                                   (hc_pre's outputs: collapsed, post, comb)
    X'[k] = post[k]·F + Σ_j comb[j, k]·X[j]                        (hc_post)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, rows_per_program

_BLOCK = 256   # columns per step


@triton.jit
def _hc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr, n_rows, eps, hc_eps,
                   D: tl.constexpr, ITERS: tl.constexpr, HC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # D is a compile-time constant (one model's hidden size): the interpreter loops over constant bounds only.
    # A program takes ROWS tokens (rows_per_program), each reduced on its own.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    K: tl.constexpr = HC * D  # one row of flat X
    x_rows = x_ptr + rows * K
    streams = tl.arange(0, HC)
    pairs = tl.arange(0, HC * HC)
    acc_pre = tl.zeros([ROWS, HC], dtype=tl.float32)
    acc_post = tl.zeros([ROWS, HC], dtype=tl.float32)
    acc_comb = tl.zeros([ROWS, HC * HC], dtype=tl.float32)
    sumsq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        valid = cols < K
        x = tl.load(x_rows[:, None] + cols[None, :], mask=in_rows[:, None] & valid[None, :], other=0.0)
        sumsq += x * x
        fn_pre = tl.load(fn_ptr + streams[:, None] * K + cols[None, :], mask=valid[None, :], other=0.0)
        acc_pre += tl.sum(fn_pre[None, :, :] * x[:, None, :], axis=2)
        fn_post = tl.load(fn_ptr + (HC + streams[:, None]) * K + cols[None, :], mask=valid[None, :], other=0.0)
        acc_post += tl.sum(fn_post[None, :, :] * x[:, None, :], axis=2)
        fn_comb = tl.load(fn_ptr + (2 * HC + pairs[:, None]) * K + cols[None, :], mask=valid[None, :], other=0.0)
        acc_comb += tl.sum(fn_comb[None, :, :] * x[:, None, :], axis=2)
    r = 1.0 / tl.sqrt(tl.sum(sumsq, axis=1) / K + eps)
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(acc_pre * r[:, None] * s_pre + tl.load(base_ptr + streams)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * r[:, None] * s_post + tl.load(base_ptr + HC + streams)[None, :])
    logits = tl.reshape(acc_comb * r[:, None] * s_comb + tl.load(base_ptr + 2 * HC + pairs)[None, :], (ROWS, HC, HC))
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(post_ptr + rows[:, None] * HC + streams[None, :], post, mask=in_rows[:, None])
    tl.store(comb_ptr + rows[:, None] * HC * HC + pairs[None, :], tl.reshape(comb, (ROWS, HC * HC)),
             mask=in_rows[:, None])
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        valid = cols < D
        x = tl.load(x_rows[:, None, None] + streams[None, :, None] * D + cols[None, None, :],
                    mask=in_rows[:, None, None] & valid[None, None, :], other=0.0)
        tl.store(collapsed_ptr + rows[:, None] * D + cols[None, :], tl.sum(pre[:, :, None] * x, axis=1),
                 mask=in_rows[:, None] & valid[None, :])


@triton.jit
def _hc_post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, n_rows, D: tl.constexpr, HC: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    streams = tl.arange(0, HC)
    post = tl.load(post_ptr + rows[:, None] * HC + streams[None, :], mask=in_rows[:, None], other=0.0)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        valid = cols < D
        f = tl.load(f_ptr + rows[:, None] * D + cols[None, :], mask=in_rows[:, None] & valid[None, :], other=0.0)
        mixed = post[:, :, None] * f[:, None, :]   # [ROWS, k, BLOCK], plus Σ_j comb[j, k] X[j]
        for j in tl.static_range(HC):
            comb_j = tl.load(comb_ptr + rows[:, None] * HC * HC + j * HC + streams[None, :], mask=in_rows[:, None],
                             other=0.0)
            x_j = tl.load(x_ptr + rows[:, None] * HC * D + j * D + cols[None, :],
                          mask=in_rows[:, None] & valid[None, :], other=0.0)
            mixed += comb_j[:, :, None] * x_j[:, None, :]
        tl.store(out_ptr + rows[:, None, None] * HC * D + streams[None, :, None] * D + cols[None, None, :], mixed,
                 mask=in_rows[:, None, None] & valid[None, None, :])


def _check(name: str, t, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
        raise InputError(f"{name} must be a contiguous float32 tensor {list(shape)}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float, hc_eps: float,
           sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    mHC's mixing weights and the collapsed sub-layer input (module docstring), in one launch.

    Args:
        X: [N, hc, D] float32, contiguous, the residual state (hc a power of two; V4: 4).
        fn: [(2 + hc)·hc, hc·D], base: [(2 + hc)·hc], scale: [3], float32 (``hc_attn_*`` / ``hc_ffn_*``).
        eps: the input RMSNorm's epsilon (rms_norm_eps); hc_eps: mHC's; sinkhorn_iters >= 1.

    Returns:
        (collapsed [N, D], post [N, hc], comb [N, hc, hc]), float32, every element written. Sync-free.

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes or devices.
    """
    if not isinstance(X, torch.Tensor) or X.dim() != 3:
        raise InputError(f"X must be a float32 tensor [N, hc, D], got {tuple(getattr(X, 'shape', ()))}")
    N, hc, D = X.shape
    if hc < 1 or hc & (hc - 1) or isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) \
            or sinkhorn_iters < 1:
        raise InputError(f"hc must be a power of two and sinkhorn_iters >= 1, got {hc}, {sinkhorn_iters!r}")
    _check("X", X, (N, hc, D))
    _check("fn", fn, ((2 + hc) * hc, hc * D))
    _check("base", base, ((2 + hc) * hc,))
    _check("scale", scale, (3,))
    check_device({"X": X, "fn": fn, "base": base, "scale": scale})
    collapsed = X.new_empty(N, D)
    post, comb = X.new_empty(N, hc), X.new_empty(N, hc, hc)
    if N:
        rows = rows_per_program(N, (2 + hc) * hc * _BLOCK)
        _hc_pre_kernel[(triton.cdiv(N, rows),)](X, fn, base, scale, collapsed, post, comb, N, float(eps),
                                                float(hc_eps), D=D, ITERS=sinkhorn_iters, HC=hc, ROWS=rows,
                                                BLOCK=_BLOCK)
    return collapsed, post, comb


def hc_post(F: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """
    mHC's new residual state ``X'[k] = post[k]·F + Σ_j comb[j, k]·X[j]`` (combᵀ · X), in one launch.

    Args:
        F: [N, D] float32, the sub-layer's output; X: [N, hc, D] float32; post: [N, hc] and comb [N, hc, hc]
            float32 (hc_pre's). All contiguous.

    Returns:
        [N, hc, D] float32, a new tensor, every element written.

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes or devices.
    """
    if not isinstance(X, torch.Tensor) or X.dim() != 3:
        raise InputError(f"X must be a float32 tensor [N, hc, D], got {tuple(getattr(X, 'shape', ()))}")
    N, hc, D = X.shape
    if hc < 1 or hc & (hc - 1):
        raise InputError(f"hc must be a power of two, got {hc}")
    _check("F", F, (N, D))
    _check("X", X, (N, hc, D))
    _check("post", post, (N, hc))
    _check("comb", comb, (N, hc, hc))
    check_device({"F": F, "X": X, "post": post, "comb": comb})
    out = torch.empty_like(X)
    if N:
        rows = rows_per_program(N, hc * _BLOCK)
        _hc_post_kernel[(triton.cdiv(N, rows),)](F, X, post, comb, out, N, D=D, HC=hc, ROWS=rows, BLOCK=_BLOCK)
    return out
