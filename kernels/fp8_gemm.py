"""Block-scaled fp8 GEMM in Triton (DeepSeek / DeepGEMM semantics) and the activation quantiser feeding it.

Formats (minirt.formats, minirt.blockfp8):

- activations: [M, K] float8_e4m3fn with one float32 power-of-two scale per token and per 128 columns,
  [M, ceil(K / 128)] (the ``quantize_groups`` rule with ``ACT_MIN_SCALE``: DeepSeek's ``act_quant``
  with ``scale_fmt`` ue8m0);
- weights, as checkpoints store them: [N, K] float8_e4m3fn with one float32 scale per 128 x 128
  block, [ceil(N / 128), ceil(K / 128)] (``weight_scale_inv``).

out[m, n] = sum_kb (Aq[m, kb-block] . Bq[n, kb-block]) * a_scales[m, kb] * b_scales[n // 128, kb].
Each 128-wide k block's fp8 product is scaled and added into an fp32 accumulator of its own
("promotion": Hopper's fp8 MMA accumulates with reduced precision, so no MMA chain spans more than
one k block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minirt.blockfp8 import DEFAULT_BLOCK, block_scale_shape
from minirt.errors import InputError
from minirt.formats import FP8_DTYPE, FP8_GROUP

from ._common import INTERPRET, check_device
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows

# One k block of the product = one activation group = one weight block column (all 128 wide).
BLOCK_K = FP8_GROUP
assert DEFAULT_BLOCK == (BLOCK_K, BLOCK_K)
# Activation quantiser: groups per program (a [GROUPS, 128] tile of one row).
_QUANT_GROUPS = 8


@triton.jit(do_not_specialize=["n_groups"])
def _quantize_act_kernel(x_ptr, q_ptr, scale_ptr, n_groups, stride_xm, stride_qm, stride_sm,
                         GROUPS: tl.constexpr, GROUP: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    mask = groups < n_groups
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask[:, None], other=0.0).to(tl.float32)
    codes, scale = pow2_quantize_rows(x, MIN_EXPONENT)
    tl.store(q_ptr + row * stride_qm + cols, codes.to(tl.uint8), mask=mask[:, None])
    tl.store(scale_ptr + row * stride_sm + groups, scale, mask=mask)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Quantise activations to fp8 per token and per 128 columns, in one Triton launch.

    Bit-identical to ``minirt.formats.quantize_groups(x)`` (ACT_MIN_SCALE rule: scale =
    2^ceil(log2(max(amax / 448, 1e-4 / 448))), values clamp(x / scale, +-448) rounded to nearest-even
    e4m3), i.e. DeepSeek's act_quant with ue8m0 scales. An all-zero group gets the smallest scale
    (2^-22), never 0/0.

    Args:
        x: [M, K], bfloat16, float16 or float32, finite, K a multiple of 128; last dim contiguous
            (other strides are honoured, anything else is copied first).

    Returns:
        x_fp8: [M, K] float8_e4m3fn, contiguous.
        scales: [M, K / 128] float32, contiguous, powers of two; x ~= x_fp8 * scales (per group).

    Raises:
        minirt.errors.InputError: wrong rank, dtype, K, or a device the kernels cannot use.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InputError(f"x must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[1] % FP8_GROUP:
        raise InputError(f"K = {x.shape[1]} must be a multiple of {FP8_GROUP} (one scale per {FP8_GROUP} values)")
    check_device({"x": x})
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n_groups = k // FP8_GROUP
    x_fp8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if x.numel() > 0:
        _quantize_act_kernel[(m, triton.cdiv(n_groups, _QUANT_GROUPS))](
            x, x_fp8.view(torch.uint8), scales, n_groups, x.stride(0), k, n_groups,
            GROUPS=_QUANT_GROUPS, GROUP=FP8_GROUP, MIN_EXPONENT=ACT_MIN_EXPONENT)
    return x_fp8, scales


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch shape of fp8_gemm.

    block_m: token rows (of a) per program; block_n: output columns (weight rows) per program.
    swap_ab: the MMA runs as b . a^T, so the weight rows fill the MMA's 64-row side and a few tokens
    its narrow side (decode: M = 1..128). split_k: programs per output tile, each over a contiguous
    range of k blocks, summed afterwards in fp32; None picks enough to fill the GPU's SMs when the
    output tiles do not (e.g. the indexer's 128-row wk), 1 never splits. group_m: tile rows per L2
    swizzle group.
    """

    block_m: int = 128
    block_n: int = 128
    swap_ab: bool = False
    split_k: Optional[int] = None
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


# Prefill: 128 x 128 tiles over two warpgroups (64 x 128 each). The fp32 accumulator and one k
# block's product take 2 x 64 registers per thread; 128 x 256 tiles would need 256 and spill.
PREFILL_CONFIG = Fp8GemmConfig()


def decode_config(m: int) -> Fp8GemmConfig:
    """The small-M launch: b . a^T with 64 weight rows per program (one warpgroup's MMA M) and the M
    tokens (rounded up to a power of two, >= 16) as the MMA's N; split-K fills the SMs."""
    if not 1 <= m <= 128:
        raise InputError(f"decode_config is for M in [1, 128], got {m}")
    return Fp8GemmConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=64, swap_ab=True,
                         group_m=1, num_warps=4, num_stages=6)


def default_config(m: int) -> Fp8GemmConfig:
    """decode_config(m) for M <= 128, PREFILL_CONFIG above."""
    return decode_config(m) if m <= 128 else PREFILL_CONFIG


# Sizes only bound masks and loops; strides stay specialised so that stores vectorise.
@triton.jit(do_not_specialize=["M", "N", "n_k_blocks", "k_blocks_per_split"])
def _fp8_gemm_kernel(
    a_desc, b_desc, a_scale_ptr, b_scale_ptr, out_ptr,
    M, N, n_k_blocks, k_blocks_per_split,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    stride_os, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr, INTERPRETED_ITERS: tl.constexpr,
):
    # Program (pid, split): output tile pid (GROUP_M tile rows share their b tiles in L2), k blocks
    # [split * k_blocks_per_split, ...) of it.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * tiles_n
    first_m = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % group_width) % group_rows
    tile_n = (pid % group_width) // group_rows
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N

    kb_start = split * k_blocks_per_split
    n_iters = tl.minimum(k_blocks_per_split, n_k_blocks - kb_start)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The interpreter cannot loop to a runtime bound: it runs k_blocks_per_split iterations, and the
    # ones past the last k block add zeros (the descriptors fill out-of-bounds tiles with zeros and
    # the scale loads are masked to 0).
    for i in range(0, INTERPRETED_ITERS if INTERPRETED else n_iters):
        kb = kb_start + i
        k_valid = kb < n_k_blocks
        a = a_desc.load([tile_m * BLOCK_M, kb * BLOCK])
        b = b_desc.load([tile_n * BLOCK_N, kb * BLOCK])
        a_scale = tl.load(a_scale_ptr + offs_m.to(tl.int64) * stride_sam + kb * stride_sak,
                          mask=m_mask & k_valid, other=0.0)
        b_scale = tl.load(b_scale_ptr + (offs_n // BLOCK) * stride_sbn + kb * stride_sbk,
                          mask=n_mask & k_valid, other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # One k block per MMA chain, scaled into the fp32 accumulator (promotion).
        if SWAP_AB:
            acc += tl.dot(b, tl.trans(a)) * b_scale[:, None] * a_scale[None, :]
        else:
            acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]

    out_rows = out_ptr + split.to(tl.int64) * stride_os
    if SWAP_AB:
        ptrs = out_rows + offs_n.to(tl.int64)[:, None] * stride_on + offs_m.to(tl.int64)[None, :] * stride_om
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        ptrs = out_rows + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs per tile keep the split path exercised


def _k_blocks_per_split(config: Fp8GemmConfig, tiles: int, n_k_blocks: int, device: torch.device) -> int:
    """k blocks per program: all of them unless split-K is asked for (split_k > 1) or chosen (None:
    enough splits to give every SM a program, each split keeping >= 4 k blocks to pipeline)."""
    split = config.split_k
    if split is None:
        split = max(1, min(triton.cdiv(_num_sms(device), tiles), n_k_blocks // 4))
    return triton.cdiv(n_k_blocks, max(1, min(split, n_k_blocks)))


def _check_operand(name: str, t: torch.Tensor, scales: torch.Tensor, scale_shape: tuple[int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE or t.dim() != 2:
        raise InputError(f"{name} must be a 2-D {FP8_DTYPE} tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 \
            or tuple(scales.shape) != scale_shape:
        raise InputError(f"{name}_scales must be a float32 tensor of shape {list(scale_shape)}, got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {list(getattr(scales, 'shape', ()))}")


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t as a tensor-descriptor operand: unit stride along K, 16-byte aligned base and row stride
    (anything else is copied)."""
    if t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
        t = t.contiguous()
    return t


def fp8_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: Optional[Fp8GemmConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """
    Block-scaled fp8 matrix product a . b^T with the weight as checkpoints store it:

        out[m, n] = sum_kb (a[m, kb-block] . b[n, kb-block]) * a_scales[m, kb] * b_scales[n // 128, kb]

    over the 128-wide k blocks kb, each block's fp8 product accumulated in fp32 with its scales
    applied before it is added (DeepGEMM's promotion; compiled, the products run on Hopper fp8
    tensor cores, whose in-MMA accumulation then spans at most 128 products).

    Args:
        a: [M, K] float8_e4m3fn, the activations (quantize_act_fp8, or the fused MLA value
            projection). K must be a multiple of 16 (the tensor descriptors' 16-byte row stride);
            a K that is not a multiple of 128 ends in a partial k block.
        a_scales: [M, ceil(K / 128)] float32, one scale per token and k block (any strides).
        b: [N, K] float8_e4m3fn, the weight [out_features, in_features]; any N (the last 128-row
            block may be partial, e.g. 576 rows = 5 blocks).
        b_scales: [ceil(N / 128), ceil(K / 128)] float32, the checkpoint's weight_scale_inv (any
            strides).
        out_dtype: bfloat16 (default), float16 or float32.
        config: keyword-only, an explicit launch shape (Fp8GemmConfig; PREFILL_CONFIG,
            decode_config(M)); None picks default_config(M).
        out: keyword-only, optional preallocated [M, N] tensor of out_dtype (any strides); every
            element is overwritten.

    a and b need unit stride along K and 16-byte aligned rows; otherwise they are copied first.
    When the output tiles are fewer than the SMs (decode; few output columns) or config.split_k > 1,
    K is split over programs and their fp32 partial products are summed in a [splits, M, N] float32
    workspace, in a fixed order (deterministic).

    Returns:
        [M, N] tensor of out_dtype (``out`` when given). M = 0 or N = 0 gives an empty result.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, K not a multiple of 16, mismatched scale
            shapes, a bad ``out``, or tensors on a device the kernels cannot use (CPU without
            TRITON_INTERPRET=1; CUDA GPUs before sm_90).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 2:
        raise InputError("a and b must be 2-D tensors [M, K] and [N, K]")
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise InputError(f"a is [M, K] = {list(a.shape)} but b is [N, K] = {list(b.shape)}: K differs")
    if k % 16:
        raise InputError(f"K = {k} must be a multiple of 16 (the fp8 rows must be 16-byte aligned)")
    n_k_blocks = triton.cdiv(k, BLOCK_K)
    _check_operand("a", a, a_scales, (m, n_k_blocks))
    _check_operand("b", b, b_scales, block_scale_shape(b.shape))
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    tensors = {"a": a, "a_scales": a_scales, "b": b, "b_scales": b_scales}
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (m, n):
            raise InputError(f"out must be a {out_dtype} tensor of shape [{m}, {n}]")
        tensors["out"] = out
    check_device(tensors)
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) < (9, 0):
        raise InputError("fp8_gemm needs an sm_90 (Hopper) or newer GPU: fp8 tensor cores and TMA")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    cfg = config or default_config(m)
    a, b = _tma_ready(a), _tma_ready(b)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    per_split = _k_blocks_per_split(cfg, tiles, n_k_blocks, a.device)
    splits = triton.cdiv(n_k_blocks, per_split)
    dest = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    dest_strides = (0, *out.stride()) if splits == 1 else dest.stride()
    _fp8_gemm_kernel[(tiles, splits)](
        TensorDescriptor.from_tensor(a, [cfg.block_m, BLOCK_K]),
        TensorDescriptor.from_tensor(b, [cfg.block_n, BLOCK_K]),
        a_scales, b_scales, dest,
        m, n, n_k_blocks, per_split,
        a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1),
        *dest_strides,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK=BLOCK_K, GROUP_M=cfg.group_m,
        SWAP_AB=cfg.swap_ab, INTERPRETED=INTERPRET, INTERPRETED_ITERS=per_split if INTERPRET else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        out.copy_(dest.sum(0))
    return out
