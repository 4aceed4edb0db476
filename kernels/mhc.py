"""DeepSeek-V4's mHC (manifold-constrained hyper-connections) mixing, fused, in fp32: the mixing weights,
Sinkhorn and the collapse of a sub-layer's input (``hc_pre``), then the new residual state (``hc_post``).

    m     = (fn · flat X) · rsqrt(mean(flat X²) + eps)            X [N, hc, D], fn [(2 + hc)·hc, hc·D]
    pre   = σ(m[:hc]·scale[0] + base[:hc]) + hc_eps
    post  = 2·σ(m[hc:2hc]·scale[1] + base[hc:2hc])
    comb  = softmax_rows(m[2hc:]·scale[2] + base[2hc:]) + hc_eps, viewed [hc, hc] (comb[j, k] = m[2hc + hc·j + k]),
            then columns normalised, then (iters − 1) times rows and columns (each divided by its sum + hc_eps)
    collapsed = Σ_j pre[j]·X[j]                                   (hc_pre's outputs: collapsed, post, comb)
    X'[k] = post[k]·F + Σ_j comb[j, k]·X[j]                        (hc_post)

Launch shapes. m's reduction runs over hc·D (V4: 16384) columns against a 1.5 MB fn: one program a token
reading all of it (the first version) left decode latency-bound on a few SMs and made prefill read fn once
a token. ``hc_pre`` is two launches: ``_hc_pre_partial_kernel`` reduces a block of rows over a slice of the
columns (blocks of up to 64 rows through tl.dot from 16 tokens, so fn is read once a block; one row a
program below), the columns split across programs until the GPU is full (partial sums of fn·x and x² per
split, no atomics); ``_hc_pre_finish_kernel`` adds the splits in a fixed order, computes the mixing weights
and collapses a slice of D per program. ``hc_post`` takes a slice of D per program, as many slices as fill
the GPU. Static shapes, no host sync: graph-capturable. Interpreted, a program takes a block of rows
(``rows_per_program``) and every row is computed on its own whatever the block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import INTERPRET, check_device, num_sms, rows_per_program

_BLOCK = 256   # columns per step
# Programs a launch should have to keep every SM busy with loads in flight, per SM: below this many token
# blocks hc_pre splits its reduction's columns, and hc_post (and the finish) split D.
_PROGRAMS_PER_SM = 4
# Fewest columns of flat X a split reduces (one step of _BLOCK): fewer would make its partial sums' traffic
# (N · 25 floats a split) rival the fn slice it reads.
_MIN_SPLIT_COLUMNS = _BLOCK
# From this many tokens the compiled reduction takes blocks of up to _DOT_ROWS rows through tl.dot,
# _DOT_BLOCK columns a step.
_DOT_MIN_TOKENS = 16
_DOT_ROWS = 64
_DOT_BLOCK = 64


@triton.jit
def _reduce_columns(x_rows, in_rows, fn_ptr, k_lo, M: tl.constexpr, K: tl.constexpr, K_SLICE: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr):
    """fn · x and Σ x² of ROWS rows (x_rows: their flat X) over columns [k_lo, k_lo + K_SLICE) ∩ [0, K):
    (m [ROWS, M padded to a power of two] (0 past M), sumsq [ROWS]), fp32. DOT: the products through
    tl.dot in three tf32 passes (fp32-accurate; ROWS >= 16), else as broadcast products summed per step."""
    MP: tl.constexpr = triton.next_power_of_2(M)
    outputs = tl.arange(0, MP)
    acc = tl.zeros([ROWS, MP], dtype=tl.float32)
    sumsq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in range(0, K_SLICE, BLOCK):
        cols = k_lo + k0 + tl.arange(0, BLOCK)
        valid = cols < K
        x = tl.load(x_rows[:, None] + cols[None, :], mask=in_rows[:, None] & valid[None, :], other=0.0)
        sumsq += x * x
        w = tl.load(fn_ptr + outputs[:, None] * K + cols[None, :], mask=(outputs < M)[:, None] & valid[None, :],
                    other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
        else:
            acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
    return acc, tl.sum(sumsq, axis=1)


@triton.jit
def _hc_pre_partial_kernel(x_ptr, fn_ptr, part_ptr, n_rows, D: tl.constexpr, HC: tl.constexpr, M: tl.constexpr,
                           SPLITS: tl.constexpr, K_SLICE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                           DOT: tl.constexpr):
    # part [N, SPLITS, M + 1]: a row's sums of fn·x (M = (2 + HC)·HC outputs, hc_head's HC), then of x², over
    # split program_id(1)'s columns.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    split = tl.program_id(1)
    m, sumsq = _reduce_columns(x_ptr + rows * (HC * D), in_rows, fn_ptr, split * K_SLICE, M, HC * D, K_SLICE, ROWS,
                               BLOCK, DOT)
    part_rows = part_ptr + (rows * SPLITS + split) * (M + 1)
    outputs = tl.arange(0, triton.next_power_of_2(M))
    tl.store(part_rows[:, None] + outputs[None, :], m, mask=in_rows[:, None] & (outputs < M)[None, :])
    tl.store(part_rows + M, sumsq, mask=in_rows)


@triton.jit
def _hc_pre_finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr, n_rows, eps,
                          hc_eps, D: tl.constexpr, ITERS: tl.constexpr, HC: tl.constexpr, SPLITS: tl.constexpr,
                          D_SLICE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD: tl.constexpr):
    # The splits' sums are added in one order by every program of a row; each recomputes the mixing weights
    # (25·SPLITS floats and a 4×4 Sinkhorn: cheaper than a third launch), the first stores post and comb, and
    # program_id(1) collapses its slice [d_lo, d_lo + D_SLICE) ∩ [0, D). HEAD (hc_head): pre only.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    W: tl.constexpr = (HC if HEAD else (2 + HC) * HC) + 1
    part_rows = part_ptr + rows[:, None, None] * (SPLITS * W) + tl.arange(0, SPLITS)[None, :, None] * W
    in3 = in_rows[:, None, None]
    streams = tl.arange(0, HC)
    pairs = tl.arange(0, HC * HC)
    acc_pre = tl.sum(tl.load(part_rows + streams[None, None, :], mask=in3, other=0.0), axis=1)
    sumsq = tl.sum(tl.sum(tl.load(part_rows + W - 1, mask=in3, other=0.0), axis=2), axis=1)
    K: tl.constexpr = HC * D
    r = 1.0 / tl.sqrt(sumsq / K + eps)
    pre = tl.sigmoid(acc_pre * r[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + streams)[None, :]) + hc_eps
    d_split = tl.program_id(1)
    if not HEAD:
        acc_post = tl.sum(tl.load(part_rows + HC + streams[None, None, :], mask=in3, other=0.0), axis=1)
        acc_comb = tl.sum(tl.load(part_rows + 2 * HC + pairs[None, None, :], mask=in3, other=0.0), axis=1)
        s_post, s_comb = tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        post = 2.0 * tl.sigmoid(acc_post * r[:, None] * s_post + tl.load(base_ptr + HC + streams)[None, :])
        logits = tl.reshape(acc_comb * r[:, None] * s_comb + tl.load(base_ptr + 2 * HC + pairs)[None, :],
                            (ROWS, HC, HC))
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        mix_rows = in_rows & (d_split == 0)
        tl.store(post_ptr + rows[:, None] * HC + streams[None, :], post, mask=mix_rows[:, None])
        tl.store(comb_ptr + rows[:, None] * HC * HC + pairs[None, :], tl.reshape(comb, (ROWS, HC * HC)),
                 mask=mix_rows[:, None])
    x_rows = x_ptr + rows * K
    for d0 in range(0, D_SLICE, BLOCK):
        cols = d_split * D_SLICE + d0 + tl.arange(0, BLOCK)
        valid = cols < D
        x = tl.load(x_rows[:, None, None] + streams[None, :, None] * D + cols[None, None, :],
                    mask=in_rows[:, None, None] & valid[None, None, :], other=0.0)
        tl.store(collapsed_ptr + rows[:, None] * D + cols[None, :], tl.sum(pre[:, :, None] * x, axis=1),
                 mask=in_rows[:, None] & valid[None, :])


@triton.jit
def _hc_post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, n_rows, D: tl.constexpr, HC: tl.constexpr,
                    D_SLICE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # program_id(1): the slice of D, [d_lo, d_lo + D_SLICE) ∩ [0, D), this program writes.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    streams = tl.arange(0, HC)
    d_lo = tl.program_id(1) * D_SLICE
    post = tl.load(post_ptr + rows[:, None] * HC + streams[None, :], mask=in_rows[:, None], other=0.0)
    for d0 in range(0, D_SLICE, BLOCK):
        cols = d_lo + d0 + tl.arange(0, BLOCK)
        valid = cols < D
        f = tl.load(f_ptr + rows[:, None] * D + cols[None, :], mask=in_rows[:, None] & valid[None, :],
                    other=0.0).to(tl.float32)
        mixed = post[:, :, None] * f[:, None, :]   # [ROWS, k, BLOCK], plus Σ_j comb[j, k] X[j]
        for j in tl.static_range(HC):
            comb_j = tl.load(comb_ptr + rows[:, None] * HC * HC + j * HC + streams[None, :], mask=in_rows[:, None],
                             other=0.0)
            x_j = tl.load(x_ptr + rows[:, None] * HC * D + j * D + cols[None, :],
                          mask=in_rows[:, None] & valid[None, :], other=0.0)
            mixed += comb_j[:, :, None] * x_j[:, None, :]
        tl.store(out_ptr + rows[:, None, None] * HC * D + streams[None, :, None] * D + cols[None, None, :], mixed,
                 mask=in_rows[:, None, None] & valid[None, None, :])


def _d_slice(D: int, row_programs: int, device: torch.device, block: int = _BLOCK) -> int:
    """Columns of D a program takes (a multiple of block): all of them when row_programs (programs along
    the rows) fill the GPU, else slices enough for _PROGRAMS_PER_SM programs per SM."""
    blocks = triton.cdiv(D, block)
    slices = min(blocks, triton.cdiv(_PROGRAMS_PER_SM * num_sms(device, 2), row_programs))
    return triton.cdiv(blocks, max(1, slices)) * block


def hc_pre_splits(N: int, rows: int, hc: int, D: int, device: torch.device) -> int:
    """The column splits of hc_pre's reduction for N tokens, rows a program (a power of two): 1 when the
    token blocks fill the GPU, else as many as give _PROGRAMS_PER_SM programs per SM, each at least
    _MIN_SPLIT_COLUMNS columns. Interpreted, as for one row a program (the bits must not depend on rows)."""
    programs = N if INTERPRET else triton.cdiv(N, rows)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms(device, 2), programs)
    splits = max(1, min(wanted, hc * D // _MIN_SPLIT_COLUMNS))
    return 1 << (splits.bit_length() - 1)


def _pre_tile(N: int, hc: int) -> tuple[int, int, bool]:
    """(rows a program, columns a step, tl.dot) of hc_pre's reduction for N tokens. Compiled: with at least
    _DOT_MIN_TOKENS tokens, blocks of up to _DOT_ROWS rows through tl.dot (fn is read once a block, not once
    a token); else one row a program. Interpreted: rows_per_program's, broadcast products."""
    if INTERPRET:
        return rows_per_program(N, triton.next_power_of_2((2 + hc) * hc) * _BLOCK), _BLOCK, False
    if N >= _DOT_MIN_TOKENS:
        return min(_DOT_ROWS, triton.next_power_of_2(N)), _DOT_BLOCK, True
    return 1, _BLOCK, False


def _launch_hc_pre(X, fn, base, scale, collapsed, post, comb, eps: float, hc_eps: float, iters: int, rows: int,
                   block: int, dot: bool, splits: int) -> None:
    """hc_pre's two launches on checked inputs (N >= 1), the reduction in a given launch shape (rows a
    program, columns a step, tl.dot, column splits: benchmarks time each); the finish takes one row a
    program compiled, rows_per_program's interpreted. post None: hc_head's (fn [hc, hc·D], pre only)."""
    N, hc, D = X.shape
    k_slice = triton.cdiv(triton.cdiv(hc * D, splits), block) * block
    m = fn.shape[0]
    part = X.new_empty(N, splits, m + 1)
    _hc_pre_partial_kernel[(triton.cdiv(N, rows), splits)](X, fn, part, N, D=D, HC=hc, M=m, SPLITS=splits,
                                                           K_SLICE=k_slice, ROWS=rows, BLOCK=block, DOT=dot)
    finish_rows = rows_per_program(N, hc * _BLOCK * splits)
    d_slice = _d_slice(D, triton.cdiv(N, finish_rows), X.device)
    _hc_pre_finish_kernel[(triton.cdiv(N, finish_rows), triton.cdiv(D, d_slice))](
        X, part, base, scale, collapsed, collapsed if post is None else post, collapsed if comb is None else comb, N,
        eps, hc_eps, D=D, ITERS=iters, HC=hc, SPLITS=splits, D_SLICE=d_slice, ROWS=finish_rows, BLOCK=_BLOCK,
        HEAD=post is None)


def _check_streams(X) -> tuple[int, int, int]:
    """(N, hc, D) of a residual state X [N, hc, D] float32, contiguous, hc a power of two, or InputError."""
    if not isinstance(X, torch.Tensor) or X.dim() != 3:
        raise InputError(f"X must be a float32 tensor [N, hc, D], got {tuple(getattr(X, 'shape', ()))}")
    N, hc, D = X.shape
    if hc < 1 or hc & (hc - 1):
        raise InputError(f"hc must be a power of two, got {hc}")
    _check("X", X, (N, hc, D))
    return N, hc, D


def _check(name: str, t, shape: tuple, dtypes: tuple = (torch.float32,)) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous():
        raise InputError(f"{name} must be a contiguous {' or '.join(str(d)[6:] for d in dtypes)} tensor {list(shape)}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float, hc_eps: float,
           sinkhorn_iters: int, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    mHC's mixing weights and the collapsed sub-layer input (module docstring), in two launches (the
    reduction's partial sums, then the rest).

    Args:
        X: [N, hc, D] float32, contiguous, the residual state (hc a power of two; V4: 4).
        fn: [(2 + hc)·hc, hc·D], base: [(2 + hc)·hc], scale: [3], float32 (``hc_attn_*`` / ``hc_ffn_*``).
        eps: the input RMSNorm's epsilon (rms_norm_eps); hc_eps: mHC's; sinkhorn_iters >= 1.
        splits: column splits of the reduction, a power of two; None: hc_pre_splits'. A split past the
            last column adds zeros.

    Returns:
        (collapsed [N, D], post [N, hc], comb [N, hc, hc]), float32, every element written. Sync-free.

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes, devices or splits.
    """
    N, hc, D = _check_streams(X)
    if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise InputError(f"sinkhorn_iters must be an int >= 1, got {sinkhorn_iters!r}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1
                               or splits & (splits - 1)):
        raise InputError(f"splits must be a power of two or None, got {splits!r}")
    _check("fn", fn, ((2 + hc) * hc, hc * D))
    _check("base", base, ((2 + hc) * hc,))
    _check("scale", scale, (3,))
    check_device({"X": X, "fn": fn, "base": base, "scale": scale})
    collapsed = X.new_empty(N, D)
    post, comb = X.new_empty(N, hc), X.new_empty(N, hc, hc)
    if N:
        rows, block, dot = _pre_tile(N, hc)
        _launch_hc_pre(X, fn, base, scale, collapsed, post, comb, float(eps), float(hc_eps), sinkhorn_iters, rows,
                       block, dot, hc_pre_splits(N, rows, hc, D, X.device) if splits is None else splits)
    return collapsed, post, comb


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
            hc_eps: float) -> torch.Tensor:
    """
    mHC's final collapse before the model's norm and head: ``Σ_j pre[j]·X[j]`` with
    ``pre = σ((fn · flat X)·rsqrt(mean(flat X²) + eps)·scale + base) + hc_eps`` (``reference.hc_head``), in
    hc_pre's two launches (its reduction with hc outputs, the finish without post and comb).

    Args:
        X: [N, hc, D] float32, contiguous (hc a power of two); fn: [hc, hc·D], base: [hc], scale: [1],
            float32 (``hc_head_*``). eps: rms_norm_eps; hc_eps: mHC's.

    Returns:
        [N, D] float32, every element written. Sync-free.

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes or devices.
    """
    N, hc, D = _check_streams(X)
    _check("fn", fn, (hc, hc * D))
    _check("base", base, (hc,))
    _check("scale", scale, (1,))
    check_device({"X": X, "fn": fn, "base": base, "scale": scale})
    collapsed = X.new_empty(N, D)
    if N:
        rows, block, dot = _pre_tile(N, hc)
        if dot:  # tl.dot needs 16 outputs, the head has hc: one row a program (the logits' few rows)
            rows, block, dot = 1, _BLOCK, False
        _launch_hc_pre(X, fn, base, scale, collapsed, None, None, float(eps), float(hc_eps), 1, rows, block, dot,
                       hc_pre_splits(N, rows, hc, D, X.device))
    return collapsed


def hc_post(F: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """
    mHC's new residual state ``X'[k] = post[k]·F + Σ_j comb[j, k]·X[j]`` (combᵀ · X), in one launch (D split
    across programs when the tokens alone do not fill the GPU).

    Args:
        F: [N, D] float32 or bfloat16, the sub-layer's output (read as fp32); X: [N, hc, D] float32;
            post: [N, hc] and comb [N, hc, hc] float32 (hc_pre's). All contiguous.

    Returns:
        [N, hc, D] float32, a new tensor, every element written.

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes or devices.
    """
    N, hc, D = _check_streams(X)
    _check("F", F, (N, D), (torch.float32, torch.bfloat16))
    _check("post", post, (N, hc))
    _check("comb", comb, (N, hc, hc))
    check_device({"F": F, "X": X, "post": post, "comb": comb})
    out = torch.empty_like(X)
    if N:
        rows = rows_per_program(N, hc * _BLOCK)
        _launch_hc_post(F, X, post, comb, out, rows, _d_slice(D, triton.cdiv(N, rows), X.device))
    return out


def _launch_hc_post(F, X, post, comb, out, rows: int, d_slice: int) -> None:
    """hc_post's kernel on checked inputs (N >= 1), d_slice columns of D a program (benchmarks time each)."""
    N, hc, D = X.shape
    _hc_post_kernel[(triton.cdiv(N, rows), triton.cdiv(D, d_slice))](
        F, X, post, comb, out, N, D=D, HC=hc, D_SLICE=d_slice, ROWS=rows, BLOCK=_BLOCK)
