"""The per-head projections of absorbed MLA through the fp8 ``kv_b_proj`` weight as checkpoints store it.

``kv_b_proj.weight`` is [H * (nope + v), C] float8_e4m3fn (C = kv_lora_rank = 512) with 128 x 128
block scales; head h owns rows h * (nope + v) + [0, nope) (W_k[h], the key up-projection) and
h * (nope + v) + nope + [0, v) (W_v[h], the value up-projection). Absorbed MLA applies them per head:

- query absorption: q_lat[t, h, c] = sum_n q_nope[t, h, n] * W_k[h, n, c]        (mla_query_absorb)
- value up-projection: o[t, h, j] = sum_c o_lat[t, h, c] * W_v[h, j, c]       (mla_value_proj_fp8)

One kernel serves both (TRANSPOSED: the weight read as W_v[h]^T). The weight is never dequantised to
memory: each fp8 tile is converted to the activations' 16-bit type in registers (exact), multiplied
on tensor cores with fp32 accumulation, and its block scales are applied per reduction chunk, so any
fp32 scales (not only powers of two) give the exact dequantised product up to fp32 rounding. The value
projection writes its result directly as e4m3 with one power-of-two scale per 128 values (the
activation format fp8_gemm consumes: o_proj's input without a bf16 round trip).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from minirt.blockfp8 import DEFAULT_BLOCK, block_scale_shape
from minirt.errors import InputError
from minirt.formats import FP8_DTYPE, FP8_GROUP

from ._common import INTERPRET, check_device, num_sms, rotated
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows
from ._launch import Kept, cdiv, described, described_tuple, launch, per_signature

WEIGHT_BLOCK = DEFAULT_BLOCK[0]
BLOCK_O = FP8_GROUP      # output columns per tile: one activation group of the quantised output
PROGRAMS_PER_SM = 1      # the value projection's prefill: the fewest programs an SM (heads a program: up to 8)


# Strides stay specialised (divisibility by 16 lets the loads and stores vectorise); n_tokens only masks.
@triton.jit(do_not_specialize=["n_tokens"])
def _mla_head_proj_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, rope_ptr, cos_ptr, sin_ptr,
    n_tokens, stride_xt, stride_xh, stride_w, stride_wsr, stride_wsc, stride_ot, stride_oh, stride_ost,
    stride_rt, stride_rh, stride_ct, stride_st,
    HEAD_ROWS: tl.constexpr, ROW_OFFSET: tl.constexpr, REDUCE: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    TRANSPOSED: tl.constexpr, QUANTIZE_OUT: tl.constexpr, ROPE: tl.constexpr, ROPE_AT: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, N_TILES_O: tl.constexpr, HEADS: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Program: BLOCK_T tokens x HEADS heads x BLOCK_O output columns, one loop over (head, reduction
    # chunk), so that one head's loads are issued under the previous head's MMAs and store. Each chunk
    # lies inside one 128-block of the weight along the reduction, so that the block scales vary only
    # along the output columns. The N_TILES_O programs of one token tile and heads are consecutive:
    # they read the same x tile (the query absorption's four 128-column tiles of the latent), which
    # then comes from L2, not memory.
    tl.static_assert(ROPE == 0 or HEADS == 1)
    N_CHUNKS: tl.constexpr = REDUCE // CHUNK
    tile_t = tl.program_id(0) // N_TILES_O
    tile_o = tl.program_id(0) % N_TILES_O
    first_head = tl.program_id(1) * HEADS
    offs_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n_tokens
    t64 = offs_t.to(tl.int64)[:, None]
    offs_o = tile_o * BLOCK_O + tl.arange(0, BLOCK_O)

    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    for step in range(HEADS * N_CHUNKS):
        c = step % N_CHUNKS
        head = first_head + step // N_CHUNKS
        row0 = head * HEAD_ROWS + ROW_OFFSET
        offs_r = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + t64 * stride_xt + head.to(tl.int64) * stride_xh + offs_r[None, :],
                    mask=t_mask[:, None], other=0.0)
        if TRANSPOSED:   # W_v[h]^T: weight row row0 + o, column r (loaded row-major, then transposed)
            w_rows = row0 + offs_o
            w = tl.trans(tl.load(w_ptr + w_rows.to(tl.int64)[:, None] * stride_w + offs_r[None, :]))
            scale = tl.load(w_scale_ptr + (w_rows // SCALE_BLOCK) * stride_wsr
                            + (c * CHUNK // SCALE_BLOCK) * stride_wsc)
        else:            # W_k[h]: weight row row0 + r, column o
            w = tl.load(w_ptr + (row0 + offs_r).to(tl.int64)[:, None] * stride_w + offs_o[None, :])
            scale = tl.load(w_scale_ptr + ((row0 + c * CHUNK) // SCALE_BLOCK) * stride_wsr
                            + (offs_o // SCALE_BLOCK) * stride_wsc)
        if INTERPRETED:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)    # e4m3 values are exact in bf16 and fp16
        acc += tl.dot(x, w) * scale[None, :]

        if c == N_CHUNKS - 1:   # the head's reduction is complete: store it, start the next head's
            out_cols = head.to(tl.int64) * stride_oh + offs_o[None, :]
            if QUANTIZE_OUT:
                codes, group_scale = pow2_quantize_rows(acc, MIN_EXPONENT)
                tl.store(out_ptr + t64 * stride_ot + out_cols, codes.to(tl.uint8), mask=t_mask[:, None])
                group = (head * stride_oh + tile_o * BLOCK_O) // BLOCK_O
                tl.store(out_scale_ptr + offs_t.to(tl.int64) * stride_ost + group, group_scale, mask=t_mask)
            else:
                tl.store(out_ptr + t64 * stride_ot + out_cols, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])
            acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    if ROPE > 0:
        if tile_o == 0:  # the query's rope part, rotated (interleaved pairs) into columns ROPE_AT + [0, ROPE)
            pair = tl.arange(0, ROPE // 2)
            rope_rows = rope_ptr + t64 * stride_rt + first_head.to(tl.int64) * stride_rh
            a = tl.load(rope_rows + 2 * pair[None, :], mask=t_mask[:, None]).to(tl.float32)
            b = tl.load(rope_rows + 2 * pair[None, :] + 1, mask=t_mask[:, None]).to(tl.float32)
            cos = tl.load(cos_ptr + t64 * stride_ct + pair[None, :], mask=t_mask[:, None]).to(tl.float32)
            sin = tl.load(sin_ptr + t64 * stride_st + pair[None, :], mask=t_mask[:, None]).to(tl.float32)
            pairs_out = out_ptr + t64 * stride_ot + first_head.to(tl.int64) * stride_oh + ROPE_AT + 2 * pair[None, :]
            a, b = rotated(a, b, cos, sin)
            dtype = out_ptr.dtype.element_ty
            tl.store(pairs_out, a.to(dtype), mask=t_mask[:, None])
            tl.store(pairs_out + 1, b.to(dtype), mask=t_mask[:, None])


def _check_inputs(name: str, x: torch.Tensor, kv_b_weight: torch.Tensor, kv_b_scale: torch.Tensor,
                  nope: int, v_dim: int, transposed: bool) -> None:
    """x is o_lat [T, H, C] (transposed: the value projection) or q_nope [T, H, nope]."""
    for arg, value in (("qk_nope_head_dim", nope), ("v_head_dim", v_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16:
            raise InputError(f"{arg} must be a positive multiple of 16, got {value!r}")
    if not isinstance(kv_b_weight, torch.Tensor) or kv_b_weight.dtype != FP8_DTYPE or kv_b_weight.dim() != 2:
        raise InputError("kv_b_weight must be the 2-D float8_e4m3fn kv_b_proj.weight [H * (nope + v), C]")
    rows, latent = kv_b_weight.shape
    if rows % (nope + v_dim) or latent % BLOCK_O:
        raise InputError(f"kv_b_weight {list(kv_b_weight.shape)}: rows must be H * (nope + v) = H * "
                         f"{nope + v_dim} and C a multiple of {BLOCK_O}")
    n_heads = rows // (nope + v_dim)
    scale_shape = block_scale_shape(kv_b_weight.shape)
    if not isinstance(kv_b_scale, torch.Tensor) or kv_b_scale.dtype != torch.float32 \
            or tuple(kv_b_scale.shape) != scale_shape:
        raise InputError(f"kv_b_scale must be the float32 weight_scale_inv of shape {list(scale_shape)}")
    if kv_b_weight.stride(1) != 1:
        raise InputError("kv_b_weight must have unit stride along its columns")
    reduce = latent if transposed else nope
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (n_heads, reduce):
        raise InputError(f"{name} must be [T, H, {reduce}] with H = {n_heads} (from kv_b_weight), got "
                         f"{list(getattr(x, 'shape', ()))}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"{name} must be bfloat16 or float16, got {x.dtype}")


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment, the integers, out) -> its
# Kept: a signature seen before passed the checks.
_PLANS: dict = {}


def _launch(x, kv_b_weight, kv_b_scale, nope, v_dim, transposed, out, out_scales, kept: Kept, rope=None):
    """x [T, H, reduce] (last dim contiguous) -> out (and out_scales when quantising; with rope = (q_rope,
    cos, sin) the rotated q_rope after the latent columns); checked; kept: the call signature's Kept."""
    quantize = out_scales is not None
    q_rope, cos, sin = rope if rope is not None else (x, x, x)  # never read without rope
    if kept.args is None:
        n_tokens, n_heads, reduce = x.shape
        n_out = v_dim if transposed else kv_b_weight.shape[1]
        # Reduction chunks must not cross a 128-block of the weight along the reduction: the largest
        # power of two <= 128 dividing the reduction's start offsets (head row starts for W_k) and length.
        starts = reduce if transposed else math.gcd(nope + v_dim, reduce)
        chunk = min(WEIGHT_BLOCK, starts & -starts)
        # Prefill: 128 tokens over two warpgroups, the query absorption's 64 on one (latency-bound at a
        # quarter of memory speed: four programs an SM instead of two keep more loads in flight, 6-9% faster
        # on an H100); decode (few tokens): the smallest tile the MMA takes.
        prefill = n_tokens > 64
        block_t = (128 if transposed else 64) if prefill else max(16, 1 << (n_tokens - 1).bit_length())
        n_tiles_o, token_tiles = n_out // BLOCK_O, cdiv(n_tokens, block_t)
        # The value projection's prefill: heads a program while PROGRAMS_PER_SM programs an SM remain (its
        # four chunks a head then pipeline across heads; the query absorption's one chunk a head ran slower
        # so: one head a program).
        heads = 1
        if transposed and prefill:
            programs = PROGRAMS_PER_SM * num_sms(x.device, 4)
            heads = max(g for g in (1, 2, 4, 8) if n_heads % g == 0 and token_tiles * n_heads // g >= programs
                        or g == 1)
        integers = (n_tokens, x.stride(0), x.stride(1), kv_b_weight.stride(0), kv_b_scale.stride(0),
                    kv_b_scale.stride(1), out.stride(0), n_out if quantize else out.stride(1),
                    out_scales.stride(0) if quantize else 0, *((q_rope.stride(0), q_rope.stride(1), cos.stride(0),
                                                               sin.stride(0)) if rope is not None else (0,) * 4))
        constexprs = dict(
            HEAD_ROWS=nope + v_dim, ROW_OFFSET=nope if transposed else 0, REDUCE=reduce, CHUNK=chunk,
            BLOCK_T=block_t, BLOCK_O=BLOCK_O, SCALE_BLOCK=WEIGHT_BLOCK, TRANSPOSED=transposed,
            QUANTIZE_OUT=quantize, ROPE=q_rope.shape[-1] if rope is not None else 0, ROPE_AT=n_out,
            MIN_EXPONENT=ACT_MIN_EXPONENT, N_TILES_O=n_tiles_o, HEADS=heads, INTERPRETED=INTERPRET,
            num_warps=4 if prefill and not transposed else 8, num_stages=3)   # (8 warps at decode: on an
        # H100, V3.2's absorption 7.3 us a call against 7.9 with 4, the value projection 7.7 against 8.5)
        kept.args = ((token_tiles * n_tiles_o, n_heads // heads), integers, constexprs)
    grid, integers, constexprs = kept.args
    launch(_mla_head_proj_kernel, grid, (x, kv_b_weight, kv_b_scale, out.view(torch.uint8) if quantize else out,
                                         out_scales if quantize else out, q_rope, cos, sin, *integers), constexprs,
           kept.compiled)


def mla_value_proj_fp8(
    o_lat: torch.Tensor,
    kv_b_weight: torch.Tensor,
    kv_b_scale: torch.Tensor,
    qk_nope_head_dim: int,
    v_head_dim: int,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    MLA value up-projection from the latent attention output, written directly as fp8 activations:

        o[t, h, j] = sum_c o_lat[t, h, c] * W_v[h, j, c],   W_v[h, j, c] = kv_b_weight[h * (nope + v) + nope + j, c]
                                                            * kv_b_scale[(h * (nope + v) + nope + j) // 128, c // 128]

    accumulated in fp32, then quantised per token and per 128 consecutive values of the flattened
    [H * v] row exactly as quantize_act_fp8 / formats.quantize_groups quantise (power-of-two scales,
    ACT_MIN_SCALE: an all-zero group gets scale 2^-22, never 0/0). The result is o_proj's input in
    the format fp8_gemm takes.

    Args:
        o_lat: [T, H, C] bfloat16 or float16, the attention output over the latent (C =
            kv_lora_rank, a multiple of 128; 512 for DeepSeek); last dim contiguous.
        kv_b_weight: [H * (nope + v), C] float8_e4m3fn, kv_b_proj.weight as stored (unit column
            stride; any row stride).
        kv_b_scale: [ceil(H * (nope + v) / 128), C / 128] float32, its weight_scale_inv (any
            strides, any positive values).
        qk_nope_head_dim, v_head_dim: nope and v. Both multiples of 16, and v a multiple of 128 (one
            or more whole scale groups per head). W_v rows need not start on a 128-row block
            (tiny preset: nope 64): each row reads its own block's scale.
        out: keyword-only, optional preallocated (o_fp8, scales) with the shapes below, contiguous;
            every element is overwritten.

    Returns:
        o_fp8: [T, H * v] float8_e4m3fn; o[t, h, j] ~= o_fp8[t, h * v + j] * scales[t, (h * v + j) // 128].
        scales: [T, H * v / 128] float32, powers of two.

    Raises:
        minirt.errors.InputError: shapes or dtypes that do not match the above, or tensors on a
            device the kernels cannot use.
    """
    kept = per_signature(_PLANS, lambda: (
        described(o_lat), described(kv_b_weight), described(kv_b_scale), qk_nope_head_dim.__class__, qk_nope_head_dim,
        v_head_dim.__class__, v_head_dim, True, described_tuple(out)),
        lambda: _check_value_proj(o_lat, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, out) or Kept())
    n_tokens, n_heads, _ = o_lat.shape
    if out is None:
        width = n_heads * v_head_dim
        out = (torch.empty(n_tokens, width, dtype=FP8_DTYPE, device=o_lat.device),
               torch.empty(n_tokens, width // FP8_GROUP, dtype=torch.float32, device=o_lat.device))
    if o_lat.stride(2) != 1:
        o_lat = o_lat.contiguous()
    if n_tokens > 0:
        _launch(o_lat, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, True, out[0], out[1], kept)
    return out


def _check_value_proj(o_lat, kv_b_weight, kv_b_scale, nope, v_dim, out) -> None:
    """mla_value_proj_fp8's input checks (InputError)."""
    _check_inputs("o_lat", o_lat, kv_b_weight, kv_b_scale, nope, v_dim, transposed=True)
    if v_dim % FP8_GROUP:
        raise InputError(f"v_head_dim must be a multiple of {FP8_GROUP} (whole scale groups per head), "
                         f"got {v_dim}")
    n_tokens, n_heads, _ = o_lat.shape
    width = n_heads * v_dim
    tensors = {"o_lat": o_lat, "kv_b_weight": kv_b_weight, "kv_b_scale": kv_b_scale}
    if out is not None:
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
                and out[0].dtype == FP8_DTYPE and tuple(out[0].shape) == (n_tokens, width)
                and out[1].dtype == torch.float32 and tuple(out[1].shape) == (n_tokens, width // FP8_GROUP)
                and out[0].is_contiguous() and out[1].is_contiguous()):
            raise InputError(f"out must be a tuple of contiguous tensors (float8_e4m3fn [{n_tokens}, {width}], "
                             f"float32 [{n_tokens}, {width // FP8_GROUP}])")
        tensors |= {"out": out[0], "out_scales": out[1]}
    check_device(tensors)


def mla_query_absorb(
    q_nope: torch.Tensor,
    kv_b_weight: torch.Tensor,
    kv_b_scale: torch.Tensor,
    qk_nope_head_dim: int,
    v_head_dim: int,
    rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """
    MLA query absorption through the fp8 key up-projection:

        q_lat[t, h, c] = sum_n q_nope[t, h, n] * W_k[h, n, c],   W_k[h, n, c] = kv_b_weight[h * (nope + v) + n, c]
                                                                * kv_b_scale[(h * (nope + v) + n) // 128, c // 128]

    with fp32 accumulation, rounded once to q_nope's dtype. With ``rope`` the same launch also writes
    the query's rope part rotated after it: the absorbed query [T, H, C + r] the sparse MLA kernels take.

    Args:
        q_nope: [T, H, nope] bfloat16 or float16, last dim contiguous (a view q[..., :nope] of the
            [T, H, nope + rope] query works without a copy).
        kv_b_weight, kv_b_scale: as in mla_value_proj_fp8.
        qk_nope_head_dim, v_head_dim: nope and v, multiples of 16. The W_k rows of a head may start
            mid-block (e.g. nope 64, v 128): the reduction is split where the 128-row blocks change.
        rope: optional (q_rope [T, H, r] of q_nope's dtype, last dim contiguous (a view of the query);
            cos, sin [T, r / 2] float32, unit last stride: the tables at the tokens' positions), r even,
            a power of two: q_rope rotated in interleaved pairs (x[2i], x[2i+1]) as ``apply_rope(q_rope,
            cos, sin, r, True)`` rotates it (in fp32, rounded to the dtype), written to columns C + [0, r).
        out: keyword-only, optional preallocated [T, H, C] ([T, H, C + r] with rope) of q_nope's dtype
            with unit last stride; every element is overwritten.

    Returns:
        q_lat: [T, H, C] ([T, H, C + r] with rope: q_lat, then the rotated q_rope), q_nope's dtype.

    Raises:
        minirt.errors.InputError: shapes or dtypes that do not match the above, or tensors on a
            device the kernels cannot use.
    """
    kept = per_signature(_PLANS, lambda: (
        described(q_nope), described(kv_b_weight), described(kv_b_scale), qk_nope_head_dim.__class__,
        qk_nope_head_dim, v_head_dim.__class__, v_head_dim, False, described(out),
        described_tuple(rope)),
        lambda: _check_absorb(q_nope, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, rope, out) or Kept())
    n_tokens, n_heads, _ = q_nope.shape
    if out is None:
        width = kv_b_weight.shape[1] + (rope[0].shape[-1] if rope is not None else 0)
        out = torch.empty(n_tokens, n_heads, width, dtype=q_nope.dtype, device=q_nope.device)
    if q_nope.stride(2) != 1:
        q_nope = q_nope.contiguous()
    if n_tokens > 0:
        _launch(q_nope, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, False, out, None, kept, rope)
    return out


def _check_absorb(q_nope, kv_b_weight, kv_b_scale, nope, v_dim, rope, out) -> None:
    """mla_query_absorb's input checks (InputError)."""
    _check_inputs("q_nope", q_nope, kv_b_weight, kv_b_scale, nope, v_dim, transposed=False)
    n_tokens, n_heads, _ = q_nope.shape
    shape = (n_tokens, n_heads, kv_b_weight.shape[1])
    tensors = {"q_nope": q_nope, "kv_b_weight": kv_b_weight, "kv_b_scale": kv_b_scale}
    if rope is not None:
        q_rope, cos, sin = rope if isinstance(rope, tuple) and len(rope) == 3 else (None,) * 3
        r = q_rope.shape[-1] if isinstance(q_rope, torch.Tensor) and q_rope.dim() == 3 else 0
        if not (r >= 2 and r & (r - 1) == 0 and tuple(q_rope.shape[:2]) == (n_tokens, n_heads)
                and q_rope.dtype == q_nope.dtype and q_rope.stride(2) == 1) or not all(
                isinstance(table, torch.Tensor) and table.dtype == torch.float32 and
                tuple(table.shape) == (n_tokens, r // 2) and table.stride(1) == 1 for table in (cos, sin)):
            raise InputError(f"rope must be (q_rope [{n_tokens}, {n_heads}, r] {q_nope.dtype} with unit last stride, "
                             f"r an even power of two; cos, sin [{n_tokens}, r / 2] float32 with unit last stride)")
        shape = (n_tokens, n_heads, kv_b_weight.shape[1] + r)
        tensors |= {"q_rope": q_rope, "cos": cos, "sin": sin}
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != q_nope.dtype or tuple(out.shape) != shape \
                or out.stride(2) != 1:
            raise InputError(f"out must be a {q_nope.dtype} tensor of shape {list(shape)} with unit last stride")
        tensors["out"] = out
    check_device(tensors)
