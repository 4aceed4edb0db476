"""Hopper (sm_90) fast path of moe_experts' fp8 grouped GEMMs at prefill, written in Gluon.

The same products as moe_experts' Triton kernel (expert-sorted rows in tiles of one expert, 128 x 128
block scales), on 128-row tiles: one program = 128 rows x 256 weight rows, the gate and up rows of 128
output columns (SwiGLU fused, the result quantised to fp8 per 128 columns) or 256 rows of the down
product (bf16 out). Warp-specialised: a producer partition TMA-loads each k block into a ring of STAGES
stages; two consumer warpgroups, 64 of the rows each, multiply and promote on their own pace and release a
stage once their products on it are done.

Why: a 64-row tile reads 40 KB from L2 per k block for 4.2 MFLOP, and both the Triton kernel and a
Gluon one on those tiles were bound by that traffic (docs/perf/moe.md); 128 x 256 tiles read 48 KB for
8.4 MFLOP. Their two fp32 accumulators take 128 registers a thread, which leaves room for one k block's
product, not two: each warpgroup multiplies the gate (first) half, promotes it (acc += product x
a_scale x w_scale, the Triton kernel's rule), then the up half. The tensor cores stay busy because the
two warpgroups share nothing but the stages and drift apart: one promotes while the other's MMA runs. (Holding each accumulator in units
of its k block's scale instead, so that the MMAs add into it directly, fits the registers too but leaves
the whole K sum to the fp8 MMA's reduced-precision accumulation: 1.5e-2 relative error at V3.2's D.)

Gluon has no interpreter: this kernel runs only on sm_90 GPUs; elsewhere moe_experts runs the Triton
kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minirt.formats import FP8_GROUP

from ._common import INTERPRET, is_sm90, swiglu
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows

BLOCK_M = 128                # rows of a tile
BLOCK_K = FP8_GROUP          # one k block = one activation scale group = one weight block column
STAGES = 4                   # k blocks in flight (48 KB of shared memory each)
_BLOCK_M = gl.constexpr(BLOCK_M)
_BLOCK_K = gl.constexpr(BLOCK_K)
_HALF_M = gl.constexpr(BLOCK_M // 2)
_ACT_MIN_EXPONENT = gl.constexpr(ACT_MIN_EXPONENT)
# A consumer warpgroup's [64, 128] accumulators.
ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
ROW_L = gl.constexpr(gl.SliceLayout(1, ACC_L.value))
COL_L = gl.constexpr(gl.SliceLayout(0, ACC_L.value))
CODES_L = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))


def fits(device: torch.device, hidden_size: int, intermediate_size: int) -> bool:
    """Whether the Gluon grouped GEMMs (this module's, moe_grouped_fp4_sm90's) take these experts' products:
    D a multiple of 256 and D, I at least 256, on sm_90."""
    return not INTERPRET and hidden_size % (2 * BLOCK_K) == 0 and min(hidden_size, intermediate_size) >= 2 * BLOCK_K \
        and device.type == "cuda" and is_sm90(device)


def takes(device: torch.device, format: str, hidden_size: int, intermediate_size: int) -> bool:
    """Whether moe_experts' prefill products run here: fp8 experts that fit()."""
    return format == "fp8" and fits(device, hidden_size, intermediate_size)


@gluon.jit
def _producer(a_desc, b_desc, smem, row0, w_row, SECOND: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr):
    """Every k block's TMA loads (128 activation rows, the weight's rows [w_row, + 128) and [w_row + SECOND,
    + 128)) into its stage once both consumers have released it."""
    a_smem, b_smem, ready, free = smem
    for kb in range(KB):
        stage = kb % STAGES
        # A fresh barrier counts as released: its phase "-1" is complete.
        mbarrier.wait(free.index(stage), ((kb // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, kb * _BLOCK_K], bar, a_smem.index(stage))
        tma.async_copy_global_to_shared(b_desc, [w_row, kb * _BLOCK_K], bar, b_smem.index(2 * stage))
        tma.async_copy_global_to_shared(b_desc, [w_row + SECOND, kb * _BLOCK_K], bar, b_smem.index(2 * stage + 1))


@gluon.jit
def _consumer(smem, a_scale_ptr, b_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, w_row, ROWS0: gl.constexpr,
              SECOND: gl.constexpr, KB: gl.constexpr, N_OUT: gl.constexpr, SWIGLU: gl.constexpr,
              HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr):
    """Rows row0 + ROWS0 .. + 63 of the tile: both 128-column products, k block by k block, each promoted
    into its fp32 accumulator with its block scales; then the epilogue of those rows."""
    a_smem, b_smem, ready, free = smem
    rows = row0 + ROWS0 + gl.arange(0, _HALF_M, ROW_L)
    a_scales = a_scale_ptr + rows.to(gl.int64) * KB
    first_scales = b_scale_ptr + (w_row // _BLOCK_K).to(gl.int64) * KB
    second_scales = b_scale_ptr + ((w_row + SECOND) // _BLOCK_K).to(gl.int64) * KB
    acc = gl.zeros([_HALF_M, _BLOCK_K], gl.float32, ACC_L)       # the first 128 weight rows' columns
    acc2 = gl.zeros([_HALF_M, _BLOCK_K], gl.float32, ACC_L)      # the second's
    product = gl.zeros([_HALF_M, _BLOCK_K], gl.float32, ACC_L)   # registers for each k block's products
    for kb in range(KB):
        a_scale = gl.load(a_scales + kb)
        stage = kb % STAGES
        mbarrier.wait(ready.index(stage), (kb // STAGES) & 1)
        a = a_smem.index(stage).slice(ROWS0, _HALF_M)
        product = warpgroup_mma(a, b_smem.index(2 * stage).permute((1, 0)), product, use_acc=False, is_async=True)
        product = warpgroup_mma_wait(0, deps=(product,))
        acc += product * (a_scale * gl.load(first_scales + kb))[:, None]
        # A wait with nothing in flight, through which acc passes: it keeps the promotion above before the
        # next MMA's issue. Sunk past it, the promotion would keep the product's registers alive while the
        # MMA writes them, and the copies would take registers the loop does not have (spills).
        acc = warpgroup_mma_wait(0, deps=(acc,))
        product = warpgroup_mma(a, b_smem.index(2 * stage + 1).permute((1, 0)), product, use_acc=False,
                                is_async=True)
        product = warpgroup_mma_wait(0, deps=(product,))
        mbarrier.arrive(free.index(stage))
        acc2 += product * (a_scale * gl.load(second_scales + kb))[:, None]
        acc2 = warpgroup_mma_wait(0, deps=(acc2,))

    if SWIGLU:
        codes, scale = pow2_quantize_rows(swiglu(acc, acc2, limit, HAS_LIMIT), _ACT_MIN_EXPONENT)
        # A row's codes through shared memory, 16 contiguous bytes a thread (from the MMA layout: 2).
        codes = gl.convert_layout(codes.to(gl.uint8), CODES_L)
        code_rows = row0 + ROWS0 + gl.arange(0, _HALF_M, gl.SliceLayout(1, CODES_L))
        code_cols = col + gl.arange(0, _BLOCK_K, gl.SliceLayout(0, CODES_L))
        gl.store(out_ptr + code_rows.to(gl.int64)[:, None] * N_OUT + code_cols[None, :], codes)
        gl.store(out_scale_ptr + rows.to(gl.int64) * (N_OUT // _BLOCK_K) + col // _BLOCK_K, scale)
    else:
        cols = col + gl.arange(0, _BLOCK_K, COL_L)
        out_rows = out_ptr + rows.to(gl.int64)[:, None] * N_OUT + cols[None, :]
        gl.store(out_rows, acc.to(gl.bfloat16))
        gl.store(out_rows + _BLOCK_K, acc2.to(gl.bfloat16))


@gluon.jit
def program_tile(tile_expert_ptr, N: gl.constexpr, N_OUT: gl.constexpr, SWIGLU: gl.constexpr):
    """This program's (tile, its first row, first output column, expert, the expert's first weight row of
    the column block) in a grid over (tile, column block), column blocks fastest so that the programs of one
    tile share its activations; a column block: 128 outputs with SwiGLU (its gate and up rows), else 256."""
    COLS: gl.constexpr = _BLOCK_K if SWIGLU else 2 * _BLOCK_K
    pid = gl.program_id(0)
    tile = pid // (N_OUT // COLS)
    col = pid % (N_OUT // COLS) * COLS
    expert = gl.load(tile_expert_ptr + tile)
    return tile, tile * _BLOCK_M, col, expert, expert * N + col


@gluon.jit
def _grouped_fp8_sm90_kernel(a_desc, a_scale_ptr, b_desc, b_scale_ptr, tile_expert_ptr, out_ptr, out_scale_ptr,
                             limit, E: gl.constexpr, N: gl.constexpr, K: gl.constexpr, N_OUT: gl.constexpr,
                             SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr):
    SECOND: gl.constexpr = N_OUT if SWIGLU else _BLOCK_K          # from the first 128 weight rows to the second
    KB: gl.constexpr = K // _BLOCK_K
    _, row0, col, expert, w_row = program_tile(tile_expert_ptr, N, N_OUT, SWIGLU)
    if expert < E:
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BLOCK_M, _BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, _BLOCK_K, _BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)   # one arrive a consumer
        smem = (a_smem, b_smem, ready, free)
        # The argument tuples are written out in the call: a tuple bound to a name first would turn its
        # constexprs into tensors.
        gl.warp_specialize([
            (_consumer, (smem, a_scale_ptr, b_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, w_row, 0, SECOND,
                         KB, N_OUT, SWIGLU, HAS_LIMIT, STAGES)),
            (_consumer, (smem, a_scale_ptr, b_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, w_row, _HALF_M,
                         SECOND, KB, N_OUT, SWIGLU, HAS_LIMIT, STAGES)),
            (_producer, (a_desc, b_desc, smem, row0, w_row, SECOND, KB, STAGES)),
        ], [4, 4], [232, 40])


def grouped_fp8(a: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                tile_expert: torch.Tensor, out: torch.Tensor, out_scales, *, swiglu: bool, limit) -> None:
    """One grouped GEMM launch over every 128-row tile (moe_experts._grouped_gemm's contract, fp8 experts):
    a [tiles * 128, K] fp8 rows sorted by expert with a_scales [tiles * 128, K / 128] float32 (powers of
    two); weight [E, N, K] fp8 with scales [E, N / 128, K / 128] float32; tile_expert [tiles] int32 (E: an
    unused tile). swiglu: N = 2 N_OUT (gate rows, then up), out [rows, N_OUT] uint8 e4m3 codes of
    silu(g) * u (V4's clamp with limit) with out_scales [rows, N_OUT / 128]; else out [rows, N] bfloat16."""
    n_experts, n, k = weight.shape
    n_out = n // 2 if swiglu else n
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_K], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(weight.view(n_experts * n, k), [BLOCK_K, BLOCK_K], b_layout)
    cols = BLOCK_K if swiglu else 2 * BLOCK_K
    _grouped_fp8_sm90_kernel[(tile_expert.numel() * (n_out // cols),)](
        a_desc, a_scales, b_desc, scales, tile_expert, out, out if out_scales is None else out_scales,
        0.0 if limit is None else float(limit),
        E=n_experts, N=n, K=k, N_OUT=n_out, SWIGLU=swiglu, HAS_LIMIT=limit is not None, STAGES=STAGES, num_warps=4)
