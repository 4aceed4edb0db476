"""Block-scaled fp8 GEMM (DeepSeek / DeepGEMM semantics) and the activation quantiser feeding it.

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

fp8_gemm runs one of three implementations (default_path):

- "stream", M <= STREAM_MAX_M (decode): a Triton kernel bound by the weight's bytes. Each program
  streams a block of weight rows over a range of k blocks through a software pipeline, the few
  tokens padded to the MMA's narrow side; split-K spreads short weights over every SM and the last
  program of a row block sums the partial products in split order (one launch, deterministic).
- "scaled_mm", larger M on sm_90 where torch._scaled_mm takes DeepSeek's block-wise scales
  (uses_scaled_mm): cuBLASLt's block-scaled fp8 GEMM for the rows up to a multiple of 16, the
  stream kernel for the remaining few.
- "tiles": the Triton tile kernel (TMA, wgmma) everywhere else: other GPUs, shapes _scaled_mm
  refuses, the CPU interpreter; also what an explicit Fp8GemmConfig forces.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minirt.blockfp8 import DEFAULT_BLOCK, block_scale_shape, dequantize_block_fp8, quantize_block_fp8
from minirt.errors import InputError
from minirt.formats import FP8_DTYPE, FP8_GROUP, quantize_groups

from ._common import INTERPRET, arrival_counters, check_device, num_sms, rows_per_program, silu
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows
from ._launch import Kept, cdiv, described, launch, per_signature

# One k block of the product = one activation group = one weight block column (all 128 wide).
BLOCK_K = FP8_GROUP
assert DEFAULT_BLOCK == (BLOCK_K, BLOCK_K)
# Activation quantiser: groups per program (a [GROUPS, 128] tile of one row).
_QUANT_GROUPS = 8


@triton.jit(do_not_specialize=["n_rows", "n_groups"])
def _quantize_act_kernel(x_ptr, up_ptr, q_ptr, scale_ptr, n_rows, n_groups, stride_xm, stride_um, stride_qm, stride_sm,
                         ROWS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                         SWIGLU: tl.constexpr):
    # Program (row block, group block): ROWS rows x GROUPS groups, one group per tile row. SWIGLU: x is
    # the gate, and what is quantised is silu(x) * up, each rounded to x's dtype as torch rounds them.
    tile = tl.arange(0, ROWS * GROUPS)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tile // GROUPS
    groups = tl.program_id(1) * GROUPS + tile % GROUPS
    mask = (rows < n_rows) & (groups < n_groups)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols, mask=mask[:, None], other=0.0)
    if SWIGLU:
        up = tl.load(up_ptr + rows[:, None] * stride_um + cols, mask=mask[:, None], other=0.0).to(tl.float32)
        x = (silu(x.to(tl.float32)).to(x.dtype).to(tl.float32) * up).to(x.dtype)
    codes, scale = pow2_quantize_rows(x.to(tl.float32), MIN_EXPONENT)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols, codes.to(tl.uint8), mask=mask[:, None])
    tl.store(scale_ptr + rows * stride_sm + groups, scale, mask=mask)


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
    kept = per_signature(_QUANTISATIONS, lambda: described(x), lambda: _check_act(x) or Kept())
    return _quantize(x, None, kept)


def swiglu_quantize_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The SwiGLU of a dense MLP, quantised for its down projection in one launch:
    quantize_act_fp8(F.silu(gate) * up), with silu(gate) and the product each rounded to gate's dtype
    as torch rounds them (silu's exp may differ from torch's in its last bit).

    Args:
        gate, up: [M, K] of one dtype (bfloat16, float16 or float32) and shape, finite, K a multiple
            of 128, last dims contiguous (e.g. the two halves of a fused gate + up product).

    Returns:
        (x_fp8 [M, K] float8_e4m3fn, scales [M, K / 128] float32), as quantize_act_fp8 returns them.

    Raises:
        minirt.errors.InputError: gate as quantize_act_fp8 refuses x; up of another shape or dtype.
    """
    kept = per_signature(_QUANTISATIONS, lambda: (described(gate), described(up)),
                         lambda: _check_swiglu(gate, up) or Kept())
    return _quantize(gate, up, kept)


def _quantize(x, up, kept: Kept) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act_fp8(x) (up None) or swiglu_quantize_fp8(x, up), checked; kept: the call signature's Kept."""
    if kept.args is None:
        copy = x.stride(1) != 1
        m, k = x.shape
        n_groups = k // FP8_GROUP
        rows = rows_per_program(m, _QUANT_GROUPS * FP8_GROUP)
        kept.args = (copy, (m, n_groups), x.numel() > 0, (cdiv(m, rows), cdiv(n_groups, _QUANT_GROUPS)), (
            m, n_groups, k if copy else x.stride(0), 0 if up is None else up.stride(0), k, n_groups), dict(
            ROWS=rows, GROUPS=_QUANT_GROUPS, GROUP=FP8_GROUP, MIN_EXPONENT=ACT_MIN_EXPONENT, SWIGLU=up is not None))
    copy, scale_shape, launched, grid, integers, constexprs = kept.args
    if copy:
        x = x.contiguous()
    x_fp8 = torch.empty(*x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(*scale_shape, dtype=torch.float32, device=x.device)
    if launched:
        launch(_quantize_act_kernel, grid, (x, x if up is None else up, x_fp8.view(torch.uint8), scales, *integers),
               constexprs, kept.compiled)
    return x_fp8, scales


# Call signature of quantize_act_fp8 (x's class, dtype, shape, strides, device, alignment) or of
# swiglu_quantize_fp8 (gate's and up's) -> its Kept (args: the launch): a signature seen before passed the checks.
_QUANTISATIONS: dict = {}


def _check_swiglu(gate, up) -> None:
    _check_act(gate)
    if not isinstance(up, torch.Tensor) or up.shape != gate.shape or up.dtype != gate.dtype:
        raise InputError(f"up must be a {gate.dtype} tensor of gate's shape {list(gate.shape)}, got "
                         f"{getattr(up, 'dtype', type(up).__name__)} {list(getattr(up, 'shape', ()))}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise InputError("gate and up must have unit stride along their last dim")
    check_device({"gate": gate, "up": up})


def _check_act(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InputError(f"x must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[1] % FP8_GROUP:
        raise InputError(f"K = {x.shape[1]} must be a multiple of {FP8_GROUP} (one scale per {FP8_GROUP} values)")
    check_device({"x": x})


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch shape of fp8_gemm's tile kernel (an explicit one forces that kernel).

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
    """The tile kernel's small-M launch (M <= 128 where the stream kernel and _scaled_mm do not run):
    b . a^T with 64 weight rows per program (one warpgroup's MMA M) and the M tokens (rounded up to a
    power of two, >= 16) as the MMA's N; split-K fills the SMs."""
    if not 1 <= m <= 128:
        raise InputError(f"decode_config is for M in [1, 128], got {m}")
    return Fp8GemmConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=64, swap_ab=True,
                         group_m=1, num_warps=4, num_stages=6)


# Interpreted, the tile kernel's time goes by programs and ops, not by elements (_common.rows_per_program):
# a few large tiles, unsplit.
INTERPRETED_CONFIG = Fp8GemmConfig(block_m=128, block_n=512, split_k=1)


def default_config(m: int) -> Fp8GemmConfig:
    """The tile kernel's launch for M tokens: decode_config(m) for M <= 128, PREFILL_CONFIG above;
    interpreted, INTERPRETED_CONFIG."""
    if INTERPRET:
        return INTERPRETED_CONFIG
    return decode_config(m) if m <= 128 else PREFILL_CONFIG


@dataclass(frozen=True)
class StreamConfig:
    """Launch shape of fp8_gemm's weight-streaming kernel (M <= STREAM_MAX_M; an explicit one forces it).

    block_n: weight rows per program, 16, 32, 64 or 128 (inside one 128-row scale block); 64 and
    128 run Hopper's fp8 wgmma (64 rows per instruction), 16 and 32 mma.sync on fp16 copies.
    split_k: programs per block of rows, each over a contiguous range of k blocks; the last one to
    finish sums the fp32 partials in split order. None picks the split whose waves of
    STREAM_PROGRAMS_PER_SM resident programs per SM are estimated to finish first (short weights
    such as the fused q_a / wk / kv_a projection: many splits; long ones: few full waves), 1 never
    splits.
    num_stages: software pipeline depth: num_stages - 1 stages of weight rows in flight per program.
    k_step: k blocks each stage loads, 1 or 2 (2: every weight row's two adjacent 128-byte pieces
    requested together; a split then holds an even number of k blocks). The same sums in the same
    order either way.
    Default: 64 rows x 256 bytes = 16 KB a stage, 3 stages (60 KB of shared memory with the
    activations'). Rows of 256 bytes read faster than 128: on an H100 a plain read of a weight in
    16 KB tiles ran at 2740-2890 GB/s in tiles of 128 rows x 128 bytes and 2900-2970 in 64 x 256,
    and V3.2's decode GEMMs (M 1) went from 0.674 to 0.641 ms a step (128 rows, 1 k block, 5
    stages before), V4-Flash's from 0.234 to 0.207 (docs/perf/gemm.md). 16 KB a stage also gives
    each iteration ~1 us at full bandwidth, the time the next stage's scales have to arrive (they
    are loaded one iteration ahead).
    """

    block_n: int = 64
    split_k: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 3
    k_step: int = 2


STREAM_CONFIG = StreamConfig()
# The stream kernel's MMA takes the tokens as its narrow (N) side, padded to 16 rows: up to 16 tokens
# stream the weight once. More would read it once per 16 tokens; _scaled_mm (or the tile kernel) then
# does better.
STREAM_MAX_M = 16
# Automatic split-K counts this many resident programs per SM (each takes num_stages x k_step x
# (block_n + 16) x 128 bytes of shared memory, 60 KB by default) and picks the split whose waves of
# resident programs finish first: a launch of 336 programs on 264 slots (V3.2's o_proj in 64-row
# blocks at 3 splits) takes two full program times, one of 224 (2 splits) one and a bit. It keeps
# >= 2 k blocks per program and the fp32 partials' traffic (splits x N x M values, 8 bytes each:
# written once, read once) <= 1/8 of the weight's N x K bytes; a program's fixed cost (scales,
# pipeline fill, partial store) is counted as _STREAM_PROGRAM_OVERHEAD k blocks.
STREAM_PROGRAMS_PER_SM = 2
_STREAM_MIN_K_BLOCKS = 2
_STREAM_PARTIAL_SHARE = 8
_STREAM_PROGRAM_OVERHEAD = 2
# _scaled_mm gets M in multiples of 16: its 1x128 activation scales are read column-major, and
# 16-byte aligned columns need M % 4 == 0 (it raised RuntimeError at M = 1 on the H200, ran at 64).
SCALED_MM_ROWS = 16


@triton.jit
def _stream_tiles(a_rows, b_rows, cols, m_mask, n_mask, K, first, n_blocks, J: tl.constexpr, BLOCK: tl.constexpr):
    """The weight and activation tiles of block J of an iteration whose first k block is the split's block
    ``first``, at columns cols: zeros past K or past the split's n_blocks."""
    k_mask = (cols + J * BLOCK < K) & (first + J < n_blocks)
    w = tl.load(b_rows + J * BLOCK + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                eviction_policy="evict_first")
    a = tl.load(a_rows + J * BLOCK + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    return w, a


@triton.jit
def _stream_scales(a_scale_rows, b_scale_row, kb, OFFSET: tl.constexpr, live, m_mask, stride_sak, stride_sbk):
    """The scales (the tokens', the weight row block's) of k block kb + OFFSET, 0 where not live."""
    a_scale = tl.load(a_scale_rows + (kb + OFFSET) * stride_sak, mask=m_mask & live, other=0.0)
    b_scale = tl.load(b_scale_row + (kb + OFFSET) * stride_sbk, mask=live, other=0.0)
    return a_scale, b_scale


@triton.jit
def _stream_add(acc, w, a, scale, INTERPRETED: tl.constexpr):
    """acc plus one k block's product: one MMA chain (b . a^T: weight rows x tokens), scaled into fp32 (promotion)."""
    if INTERPRETED:
        w = w.to(tl.float32)
        a = a.to(tl.float32)
    return acc + tl.dot(w, tl.trans(a)) * scale[None, :]


@triton.jit(do_not_specialize=["M", "N", "n_k_blocks", "k_blocks_per_split", "group_rows"])
def _fp8_stream_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, partial_ptr, arrivals_ptr,
    M, N, K, n_k_blocks, k_blocks_per_split, group_rows,
    stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr, SPLIT_K: tl.constexpr,
    INTERPRETED: tl.constexpr, INTERPRETED_ITERS: tl.constexpr, INTERPRETED_SPLITS: tl.constexpr,
):
    # Program (tile_n, split) of a (tiles, splits) grid: weight rows [tile_n * BLOCK_N, +BLOCK_N) (one 128-row scale block), k
    # blocks [split * k_blocks_per_split, ...), all M (<= BLOCK_M) tokens. K is specialised (a multiple
    # of 16), so the k masks are constant over 16 bytes and the weight loads stay 16-byte vectors.
    # Grouped (fp8_gemm's groups): the rows of group g = row // group_rows read a's columns [g K, g K + K).
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    group = tile_n * BLOCK_N // group_rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + group * K + offs_m[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    a_scale_rows = a_scale_ptr + group * n_k_blocks * stride_sak + offs_m * stride_sam
    b_scale_row = b_scale_ptr + (tile_n * BLOCK_N // BLOCK) * stride_sbn

    # STEP (1 or 2) k blocks an iteration: with 2, each weight row's two adjacent 128-byte pieces are
    # requested together (DRAM reads them at a higher rate than 128-byte pieces of twice the rows).
    kb_start = split * k_blocks_per_split
    n_blocks = tl.minimum(k_blocks_per_split, n_k_blocks - kb_start)
    n_iters = tl.cdiv(n_blocks, STEP)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The scales of the next k blocks are loaded one iteration ahead: the pipeliner prefetches only
    # the MMA operands, and a scale load waited on in its own iteration would hold back the next
    # weight load by its latency every k block.
    # (A split has at least one k block: its first block's scales need no mask.)
    a_scale = tl.load(a_scale_rows + kb_start * stride_sak, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_row + kb_start * stride_sbk)
    if STEP == 2:
        a_scale2, b_scale2 = _stream_scales(a_scale_rows, b_scale_row, kb_start, 1, n_blocks > 1, m_mask,
                                            stride_sak, stride_sbk)
    # The interpreter cannot loop to a runtime bound: it runs INTERPRETED_ITERS iterations, and the
    # k blocks past the split's last add zeros (their k columns and scales are masked).
    for i in range(0, INTERPRETED_ITERS if INTERPRETED else n_iters):
        # Every tile load of the iteration is issued before the next scales' loads and the MMAs.
        kb = kb_start + i * STEP
        cols = kb * BLOCK + offs_k
        w, a = _stream_tiles(a_rows, b_rows, cols, m_mask, n_mask, K, i * STEP, n_blocks, 0, BLOCK)
        if STEP == 2:
            # (A split's k blocks are even but for the last split's: its missing block is past K.)
            w2, a2 = _stream_tiles(a_rows, b_rows, cols, m_mask, n_mask, K, i * STEP, n_blocks, 1, BLOCK)
        scale = a_scale * b_scale
        if STEP == 2:
            scale2 = a_scale2 * b_scale2
        a_scale, b_scale = _stream_scales(a_scale_rows, b_scale_row, kb, STEP, (i + 1) * STEP < n_blocks, m_mask,
                                          stride_sak, stride_sbk)
        if STEP == 2:
            a_scale2, b_scale2 = _stream_scales(a_scale_rows, b_scale_row, kb, STEP + 1, (i + 1) * STEP + 1 < n_blocks,
                                                m_mask, stride_sak, stride_sbk)
        acc = _stream_add(acc, w, a, scale, INTERPRETED)
        if STEP == 2:
            acc = _stream_add(acc, w2, a2, scale2, INTERPRETED)

    out_tile = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_m.to(tl.int64)[None, :] * stride_om
    out_mask = n_mask[:, None] & m_mask[None, :]
    if not SPLIT_K:
        tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial_ptr: [splits, tiles * BLOCK_N, M] float32. Every program stores its partial, then
        # counts itself in; the last of its row block adds the partials in split order (the same
        # sums whichever program finishes last) and resets the counter for the next launch.
        splits = tl.num_programs(1)
        split_stride = tl.num_programs(0) * BLOCK_N * M
        partial_tile = partial_ptr + offs_n[:, None] * M + offs_m[None, :]
        tl.store(partial_tile + split * split_stride, acc, mask=m_mask[None, :])
        # All threads' stores precede the (acq_rel, gpu scope) count; the count is one atomic per
        # program, issued by one thread.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile_n, 1)
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, INTERPRETED_SPLITS if INTERPRETED else splits):
                # .cg: read from L2, where the other programs' partials are, never a stale L1 line.
                total += tl.load(partial_tile + s * split_stride, mask=m_mask[None, :], other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_tile, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(arrivals_ptr + tile_n, 0)


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
    a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * stride_sam
    b_scale_rows = b_scale_ptr + (offs_n // BLOCK) * stride_sbn
    # The scales of the next k block are loaded one iteration ahead (as in the stream kernel: loaded
    # and used in one iteration, their latency came before every next TMA load was issued).
    a_scale = tl.load(a_scale_rows + kb_start * stride_sak, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_rows + kb_start * stride_sbk, mask=n_mask, other=0.0)
    # The interpreter cannot loop to a runtime bound: it runs k_blocks_per_split iterations, and the
    # ones past the last k block add zeros (the descriptors fill out-of-bounds tiles with zeros and
    # the scale loads are masked to 0).
    for i in range(0, INTERPRETED_ITERS if INTERPRETED else n_iters):
        kb = kb_start + i
        a = a_desc.load([tile_m * BLOCK_M, kb * BLOCK])
        b = b_desc.load([tile_n * BLOCK_N, kb * BLOCK])
        scale_a, scale_b = a_scale, b_scale
        has_next = i + 1 < n_iters
        a_scale = tl.load(a_scale_rows + (kb + 1) * stride_sak, mask=m_mask & has_next, other=0.0)
        b_scale = tl.load(b_scale_rows + (kb + 1) * stride_sbk, mask=n_mask & has_next, other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # One k block per MMA chain, scaled into the fp32 accumulator (promotion).
        if SWAP_AB:
            acc += tl.dot(b, tl.trans(a)) * scale_b[:, None] * scale_a[None, :]
        else:
            acc += tl.dot(a, tl.trans(b)) * scale_a[:, None] * scale_b[None, :]

    out_rows = out_ptr + split.to(tl.int64) * stride_os
    if SWAP_AB:
        ptrs = out_rows + offs_n.to(tl.int64)[:, None] * stride_on + offs_m.to(tl.int64)[None, :] * stride_om
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        ptrs = out_rows + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _k_blocks_per_split(config: Fp8GemmConfig, tiles: int, n_k_blocks: int, device: torch.device) -> int:
    """k blocks per program: all of them unless split-K is asked for (split_k > 1) or chosen (None:
    enough splits to give every SM a program, each split keeping >= 4 k blocks to pipeline)."""
    split = config.split_k
    if split is None:
        split = max(1, min(cdiv(num_sms(device, 4), tiles), n_k_blocks // 4))
    return cdiv(n_k_blocks, max(1, min(split, n_k_blocks)))


# (Searched once per call signature: _stream keeps the result in the signature's Kept.)
def _stream_k_blocks_per_split(config: StreamConfig, m: int, k: int, tiles: int, device: torch.device) -> int:
    """k blocks per stream program: config.split_k splits, or (None) the split that minimises the
    estimated time, rounds x (k blocks per program + _STREAM_PROGRAM_OVERHEAD), where rounds =
    ceil(programs / (STREAM_PROGRAMS_PER_SM x SMs)) counts the waves of resident programs, within the
    limits set out at STREAM_PROGRAMS_PER_SM (the fewest splits among equal estimates)."""
    n_k_blocks = cdiv(k, BLOCK_K)
    split = config.split_k
    if split is None:
        slots = STREAM_PROGRAMS_PER_SM * num_sms(device, 4)
        most = max(1, min(n_k_blocks // _STREAM_MIN_K_BLOCKS, k // (_STREAM_PARTIAL_SHARE * 8 * m)))

        def estimate(splits: int) -> tuple[int, int]:
            per_split = cdiv(n_k_blocks, splits)
            per_split += per_split % config.k_step
            programs = tiles * cdiv(n_k_blocks, per_split)
            return cdiv(programs, slots) * (per_split + _STREAM_PROGRAM_OVERHEAD), splits

        split = min(range(1, most + 1), key=estimate)
    per_split = cdiv(n_k_blocks, max(1, min(split, n_k_blocks)))
    return per_split + per_split % config.k_step


def _stream(a, a_scales, b, b_scales, out, config: StreamConfig, kept: Kept, groups: int = 1) -> None:
    """out = the product by the stream kernel; a [M <= STREAM_MAX_M, groups * K] and b [N, K] with unit
    stride along K (groups: fp8_gemm's); kept: the call signature's Kept (args: the launch, derived at
    its first call)."""
    if kept.args is None:
        m, (n, k) = a.shape[0], b.shape
        tiles = cdiv(n, config.block_n)
        per_split = _stream_k_blocks_per_split(config, m, k, tiles, a.device)
        n_k_blocks = cdiv(k, BLOCK_K)
        splits = cdiv(n_k_blocks, per_split)
        kept.args = ((tiles, splits), (splits, tiles * config.block_n, m) if splits > 1 else None, tiles, (
            m, n, k, n_k_blocks, per_split, n // groups,
            a.stride(0), b.stride(0), a_scales.stride(0), a_scales.stride(1), b_scales.stride(0),
            b_scales.stride(1), out.stride(0), out.stride(1)), dict(
            BLOCK_M=STREAM_MAX_M, BLOCK_N=config.block_n, BLOCK=BLOCK_K, STEP=config.k_step, SPLIT_K=splits > 1,
            INTERPRETED=INTERPRET, INTERPRETED_ITERS=cdiv(per_split, config.k_step) if INTERPRET else 0,
            INTERPRETED_SPLITS=splits if INTERPRET else 0,
            num_warps=config.num_warps, num_stages=config.num_stages))
    grid, partials_shape, tiles, integers, constexprs = kept.args
    partials = arrivals = out      # unread placeholders without split-K
    if partials_shape is not None:
        partials = torch.empty(partials_shape, dtype=torch.float32, device=a.device)
        arrivals = arrival_counters(a.device, tiles)
    launch(_fp8_stream_kernel, grid, (a, a_scales, b, b_scales, out, partials, arrivals, *integers), constexprs,
           kept.compiled)


def _tiles(a, a_scales, b, b_scales, out, config: Fp8GemmConfig) -> None:
    """out = the product by the tile kernel; a and b TMA-ready (not _copied)."""
    (m, k), n = a.shape, b.shape[0]
    n_k_blocks = cdiv(k, BLOCK_K)
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    per_split = _k_blocks_per_split(config, tiles, n_k_blocks, a.device)
    splits = cdiv(n_k_blocks, per_split)
    dest = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    dest_strides = (0, *out.stride()) if splits == 1 else dest.stride()
    _fp8_gemm_kernel[(tiles, splits)](
        TensorDescriptor.from_tensor(a, [config.block_m, BLOCK_K]),
        TensorDescriptor.from_tensor(b, [config.block_n, BLOCK_K]),
        a_scales, b_scales, dest,
        m, n, n_k_blocks, per_split,
        a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1),
        *dest_strides,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK=BLOCK_K, GROUP_M=config.group_m,
        SWAP_AB=config.swap_ab, INTERPRETED=INTERPRET, INTERPRETED_ITERS=per_split if INTERPRET else 0,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        out.copy_(dest.sum(0))


def scaled_mm_blockwise(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        out: torch.Tensor) -> None:
    """
    out = a . b^T by torch._scaled_mm with DeepSeek's block-wise scales (fp8_gemm's "scaled_mm" path;
    no checks: fp8_gemm and uses_scaled_mm make them).

    Args:
        a: [M, K] float8_e4m3fn with 16-byte aligned rows, unit stride along K; M % 16 == 0.
        a_scales: [M, K / 128] float32, passed to cuBLASLt outer-dim-major (column-major, copied).
        b: [N, K] float8_e4m3fn, the weight as stored (b.t() is the column-major mat2), N % 16 == 0.
        b_scales: [N / 128, K / 128] float32, the 128x128 block scales as stored (row-major: the
            transpose of mat2's), K / 128 a multiple of 4.
        out: [M, N] bfloat16, float16 or float32, written (through a copy unless contiguous).
    """
    args = (a, b.t(), a_scales.t().contiguous().t(), b_scales.contiguous().t())
    if out.is_contiguous():
        torch._scaled_mm(*args, out_dtype=out.dtype, out=out)
    else:
        out.copy_(torch._scaled_mm(*args, out_dtype=out.dtype))


@functools.lru_cache(maxsize=None)
def _scaled_mm_agrees(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes DeepSeek's block-wise scales on this device (cuBLASLt has them
    on sm_90 only, from CUDA 12.9) and computes fp8_gemm's product with them. Tried once, with a
    synchronising check: a ragged weight with non-power-of-two block scales, so a build that reads
    the scales otherwise (inverted, transposed) is off by O(1)."""
    if _capability(device) != (9, 0):
        return False
    gen = torch.Generator(device).manual_seed(0)
    m, n, k = SCALED_MM_ROWS, 144, 512
    group_exponents = torch.randint(-4, 4, (m, k // FP8_GROUP), generator=gen, device=device)
    a, a_scales = quantize_groups(torch.randn(m, k, generator=gen, device=device)
                                  * torch.exp2(group_exponents.float()).repeat_interleave(FP8_GROUP, 1))
    b, b_scales = quantize_block_fp8(torch.randn(n, k, generator=gen, device=device))
    b_scales = b_scales * (1 + torch.rand(b_scales.shape, generator=gen, device=device))
    ref = (a.float().unflatten(1, (-1, FP8_GROUP)) * a_scales[..., None]).flatten(1) \
        @ dequantize_block_fp8(b, b_scales).T
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    try:
        scaled_mm_blockwise(a, a_scales, b, b_scales, out)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return False
    return ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def uses_scaled_mm(m: int, n: int, k: int, device: torch.device, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether fp8_gemm's default dispatch runs torch._scaled_mm for a [M, K] x [N, K] product: M past
    the stream kernel's, N a multiple of 16 and K of 512 (_scaled_mm's checks: N and K multiples of 16;
    the 128x128 scales' rows, ceil(K / 128) floats, 16-byte aligned), compiled on a device where
    _scaled_mm's block-wise scales work (_scaled_mm_agrees: sm_90)."""
    return (m > STREAM_MAX_M and n % 16 == 0 and k % (4 * BLOCK_K) == 0 and not INTERPRET
            and device.type == "cuda" and _scaled_mm_agrees(device, out_dtype))


def default_path(m: int, n: int, k: int, device: torch.device, out_dtype: torch.dtype = torch.bfloat16) -> str:
    """The implementation fp8_gemm runs without an explicit config: "stream" (M <= STREAM_MAX_M),
    "scaled_mm" (uses_scaled_mm; the last M % 16 rows by the stream kernel) or "tiles"."""
    if m <= STREAM_MAX_M:
        return "stream"
    return "scaled_mm" if uses_scaled_mm(m, n, k, device, out_dtype) else "tiles"


def _check_operand(name: str, t: torch.Tensor, scales: torch.Tensor, scale_shape: tuple[int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE or t.dim() != 2:
        raise InputError(f"{name} must be a 2-D {FP8_DTYPE} tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 \
            or tuple(scales.shape) != scale_shape:
        raise InputError(f"{name}_scales must be a float32 tensor of shape {list(scale_shape)}, got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {list(getattr(scales, 'shape', ()))}")


def _copied(t: torch.Tensor) -> bool:
    """Whether fp8_gemm copies operand t first: unless t has unit stride along K and a 16-byte aligned base
    and row stride (as TMA and cuBLASLt need and 16-byte vector loads want)."""
    return t.stride(1) != 1 or t.stride(0) % 16 != 0 or t.data_ptr() % 16 != 0


def fp8_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: Optional[Union[Fp8GemmConfig, StreamConfig]] = None,
    out: Optional[torch.Tensor] = None,
    groups: int = 1,
) -> torch.Tensor:
    """
    Block-scaled fp8 matrix product a . b^T with the weight as checkpoints store it:

        out[m, n] = sum_kb (a[m, kb-block] . b[n, kb-block]) * a_scales[m, kb] * b_scales[n // 128, kb]

    over the 128-wide k blocks kb, each block's fp8 product accumulated in fp32 with its scales
    applied before it is added (DeepGEMM's promotion; compiled, the products run on Hopper fp8
    tensor cores, whose in-MMA accumulation then spans at most 128 products).

    Which implementation runs (default_path): M <= STREAM_MAX_M (16), the weight-streaming Triton
    kernel (decode: bound by the weight's bytes); larger M on sm_90 with a torch whose _scaled_mm
    takes block-wise scales, N % 16 == 0 and K % 512 == 0 (uses_scaled_mm), torch._scaled_mm
    (cuBLASLt) for the first M - M % 16 rows and the stream kernel for the rest; otherwise the Triton
    tile kernel. All compute the formula above; they differ only in fp32 summation order and in
    the MMA's internal accumulation (see the tests' tolerances).

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
        config: keyword-only. None: default_path's choice. A StreamConfig forces the stream kernel
            (M <= STREAM_MAX_M only), an Fp8GemmConfig the tile kernel (PREFILL_CONFIG,
            decode_config(M), default_config(M)) with that launch shape.
        out: keyword-only, optional preallocated [M, N] tensor of out_dtype (any strides); every
            element is overwritten.
        groups: keyword-only, G >= 1: a block-diagonal product (DeepSeek-V4's grouped wo_a): a is
            [M, G * K] with a_scales [M, G * K / 128], b [N, K] holds G groups of N / G rows, and
            out[:, gR:(g+1)R] = a[:, gK:(g+1)K] . b[gR:(g+1)R]^T (R = N / G). Needs K and R multiples
            of 128. The stream kernel runs every group in one launch; the other paths one per group.

    a and b need unit stride along K and 16-byte aligned rows; otherwise they are copied first.
    Split-K: the stream kernel splits K when its row blocks are fewer than the SMs want (the last
    program of a row block adds the fp32 partials in split order; per-stream counters in device
    memory); the tile kernel when its output tiles are fewer than the SMs or config.split_k > 1
    (a [splits, M, N] float32 workspace summed afterwards). Both are deterministic. The first
    product of an out_dtype with M > 16 on an sm_90 device checks once that _scaled_mm computes this
    formula (a small product, synchronising).

    Returns:
        [M, N] tensor of out_dtype (``out`` when given). M = 0 or N = 0 gives an empty result.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, K not a multiple of 16, mismatched scale
            shapes, a bad ``out`` or ``config`` (a StreamConfig with M > 16), or tensors on a device
            the kernels cannot use (CPU without TRITON_INTERPRET=1; CUDA GPUs before sm_90).
    """
    kept = per_signature(_GEMMS, lambda: (
        described(a), described(a_scales), described(b), described(b_scales), described(out), out_dtype,
        config.__class__, config, groups), lambda: _check_gemm(a, a_scales, b, b_scales, out_dtype, config, out, groups)
        or Kept(_gemm_plan(a, b, out_dtype, config, groups)))
    (m, k), n = a.shape, b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    config, copies = kept.value
    if copies[0]:
        a = a.contiguous()
    if copies[1]:
        b = b.contiguous()
    if isinstance(config, StreamConfig):
        _stream(a, a_scales, b, b_scales, out, config, kept, groups)
    elif groups > 1:  # the tile kernel and _scaled_mm take no grouped operands: one product per group
        r, k = n // groups, b.shape[1]
        kb = k // BLOCK_K
        for g in range(groups):
            fp8_gemm(a[:, g * k:(g + 1) * k], a_scales[:, g * kb:(g + 1) * kb], b[g * r:(g + 1) * r],
                     b_scales[g * r // BLOCK_K:(g + 1) * r // BLOCK_K], out_dtype, config=config,
                     out=out[:, g * r:(g + 1) * r])
    elif isinstance(config, Fp8GemmConfig):
        _tiles(a, a_scales, b, b_scales, out, config)
    else:
        rows = m - m % SCALED_MM_ROWS
        scaled_mm_blockwise(a[:rows], a_scales[:rows], b, b_scales, out[:rows])
        if rows < m:
            _stream(a[rows:], a_scales[rows:], b, b_scales, out[rows:], STREAM_CONFIG, kept)
    return out


def _gemm_plan(a, b, out_dtype, config, groups: int = 1) -> tuple:
    """What fp8_gemm keeps for a checked call signature: (the implementation's config: a StreamConfig, an
    Fp8GemmConfig, or None for scaled_mm (default_path, of one group's product); whether a and b are
    copied first (_copied))."""
    m, (n, k) = a.shape[0], b.shape
    if config is None:
        path = default_path(m, n // groups, k, a.device, out_dtype)
        config = STREAM_CONFIG if path == "stream" else default_config(m) if path == "tiles" else None
    return config, (_copied(a), _copied(b))


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment; out_dtype; config)
# -> its Kept (value: _gemm_plan's; args: the stream launch): a signature seen before passed the checks.
_GEMMS: dict = {}


def _check_gemm(a, a_scales, b, b_scales, out_dtype, config, out, groups: int = 1) -> None:
    """fp8_gemm's input checks (InputError)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 2:
        raise InputError("a and b must be 2-D tensors [M, K] and [N, K]")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise InputError(f"groups must be a positive int, got {groups!r}")
    (m, k_a), (n, k) = a.shape, b.shape
    if k_a != groups * k:
        raise InputError(f"a is [M, K] = {list(a.shape)} but b is [N, K] = {list(b.shape)}: K differs" if groups == 1
                         else f"a is {list(a.shape)}: {groups} groups of b's K = {k} need {groups * k} columns")
    if k % 16:
        raise InputError(f"K = {k} must be a multiple of 16 (the fp8 rows must be 16-byte aligned)")
    if groups > 1 and (k % BLOCK_K or n % (groups * BLOCK_K)):
        raise InputError(f"{groups} groups need K ({k}) and N / groups (N = {n}) multiples of {BLOCK_K}")
    n_k_blocks = cdiv(k, BLOCK_K)
    _check_operand("a", a, a_scales, (m, groups * n_k_blocks))
    _check_operand("b", b, b_scales, block_scale_shape(b.shape))
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if isinstance(config, StreamConfig):
        if m > STREAM_MAX_M:
            raise InputError(f"the stream kernel (StreamConfig) takes M <= {STREAM_MAX_M}, got M = {m}")
        if config.block_n not in (16, 32, 64, 128):
            raise InputError(f"StreamConfig.block_n must be 16, 32, 64 or 128, got {config.block_n}")
        if config.k_step not in (1, 2):
            raise InputError(f"StreamConfig.k_step must be 1 or 2, got {config.k_step}")
    elif config is not None and not isinstance(config, Fp8GemmConfig):
        raise InputError(f"config must be an Fp8GemmConfig, a StreamConfig or None, got {type(config).__name__}")
    tensors = {"a": a, "a_scales": a_scales, "b": b, "b_scales": b_scales}
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (m, n):
            raise InputError(f"out must be a {out_dtype} tensor of shape [{m}, {n}]")
        tensors["out"] = out
    check_device(tensors)
    if a.device.type == "cuda" and _capability(a.device) < (9, 0):
        raise InputError("fp8_gemm needs an sm_90 (Hopper) or newer GPU: fp8 tensor cores and TMA")

