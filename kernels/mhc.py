"""DeepSeek-V4's mHC (manifold-constrained hyper-connections) mixing, fused: one launch for the mixing
weights, Sinkhorn and the collapse of a sub-layer's input (``hc_pre``), one for the new residual state
(``hc_post``). One program per token; everything in fp32.

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

from ._common import check_device


@triton.jit
def _hc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr, eps, hc_eps,
                   D: tl.constexpr, ITERS: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
    # D is a compile-time constant (one model's hidden size): the interpreter loops over constant bounds only.
    row = tl.program_id(0).to(tl.int64)
    K: tl.constexpr = HC * D  # one row of flat X
    x_row = x_ptr + row * K
    streams = tl.arange(0, HC)
    pairs = tl.arange(0, HC * HC)
    acc_pre = tl.zeros([HC], dtype=tl.float32)
    acc_post = tl.zeros([HC], dtype=tl.float32)
    acc_comb = tl.zeros([HC * HC], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        valid = cols < K
        x = tl.load(x_row + cols, mask=valid, other=0.0)
        sumsq += x * x
        acc_pre += tl.sum(tl.load(fn_ptr + streams[:, None] * K + cols[None, :], mask=valid[None, :], other=0.0)
                          * x[None, :], axis=1)
        acc_post += tl.sum(tl.load(fn_ptr + (HC + streams[:, None]) * K + cols[None, :], mask=valid[None, :],
                                   other=0.0) * x[None, :], axis=1)
        acc_comb += tl.sum(tl.load(fn_ptr + (2 * HC + pairs[:, None]) * K + cols[None, :], mask=valid[None, :],
                                   other=0.0) * x[None, :], axis=1)
    r = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(acc_pre * r * s_pre + tl.load(base_ptr + streams)) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * r * s_post + tl.load(base_ptr + HC + streams))
    logits = tl.reshape(acc_comb * r * s_comb + tl.load(base_ptr + 2 * HC + pairs), (HC, HC))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + row * HC + streams, post)
    tl.store(comb_ptr + row * HC * HC + pairs, tl.reshape(comb, (HC * HC,)))
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        valid = cols < D
        x = tl.load(x_row + streams[:, None] * D + cols[None, :], mask=valid[None, :], other=0.0)
        tl.store(collapsed_ptr + row * D + cols, tl.sum(pre[:, None] * x, axis=0), mask=valid)


@triton.jit
def _hc_post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    streams = tl.arange(0, HC)
    post = tl.load(post_ptr + row * HC + streams)
    comb = tl.load(comb_ptr + row * HC * HC + streams[:, None] * HC + streams[None, :])  # [j, k]
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        valid = cols < D
        f = tl.load(f_ptr + row * D + cols, mask=valid, other=0.0)
        x = tl.load(x_ptr + row * HC * D + streams[:, None] * D + cols[None, :], mask=valid[None, :], other=0.0)
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [k, BLOCK]: Σ_j comb[j, k] X[j]
        tl.store(out_ptr + row * HC * D + streams[:, None] * D + cols[None, :], post[:, None] * f[None, :] + mixed,
                 mask=valid[None, :])


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
        _hc_pre_kernel[(N,)](X, fn, base, scale, collapsed, post, comb, float(eps), float(hc_eps), D=D,
                             ITERS=sinkhorn_iters, HC=hc, BLOCK=256)
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
        _hc_post_kernel[(N,)](F, X, post, comb, out, D=D, HC=hc, BLOCK=256)
    return out
