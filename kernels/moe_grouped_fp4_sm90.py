"""Hopper (sm_90) fast path of moe_experts' fp4 grouped GEMMs at prefill (fp4_fold), written in Gluon.

The same products as moe_experts' Triton kernel with PREFILL_CONFIG_FP4 (expert-sorted rows in 128-row
tiles of one expert; each 128-input k block of a weight row folded to e4m3 relative to the row's largest
e8m0 scale of the block, exact while its four scales span at most 2^FOLD_SPREAD; the block's product
times 2^(top - 133) per weight row and the activations' scale per row, promoted into fp32), on programs of
128 rows x 256 weight rows (a column block's gate and up rows, SwiGLU fused and quantised to fp8 per 128
columns, or 256 rows of the down product, bf16 out).

Why: the Triton kernel decodes the packed weights to e4m3 in registers, stores them to shared memory
and waits for the MMA in one partition: the decode's instructions, not the tensor cores, bound it
(V4-Flash's 4096-token GEMMs at 214-253 TFLOP/s on an H200). Here the decode has warps of its own:

- a producer warp TMA-loads each k block: the activation tile's two 64-column halves (even inputs, then
  odd: the activations' columns are split, _split_columns) and the gate and up rows' packed bytes;
- a decoder warpgroup reads each stage's packed bytes and its rows' scale bytes (loaded a k block ahead),
  writes the low and high nibbles as folded e4m3 (_fp4.FOLD_PTX) into MMA operand buffers and each row's
  2^(top - 133) beside them, releases the gate rows and the up rows each on its own barrier, and marks
  the tile for the bf16 pass (unfolded_ptr) when any row of any k block spans more than 2^FOLD_SPREAD
  (that tile's output here is then overwritten by the Triton kernel's second pass);
- two consumer warpgroups, 64 of the rows each, multiply (even and odd halves into one product) and
  promote on their own pace, in 64-column quarters so that the four fp32 accumulators, a product and its
  column factors fit in registers, and release the stage.

Gluon has no interpreter: this kernel runs only on sm_90 GPUs; elsewhere moe_experts runs the Triton
kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minirt.formats import FP8_GROUP

from ._common import swiglu
from ._fp8 import ACT_MIN_EXPONENT, e4m3_bits, pow2_scale
from ._fp4 import FOLD_PTX, FOLD_SPREAD, FP4_GROUP
from .moe_grouped_sm90 import fits, program_tile

BLOCK_M = 128                # rows of a tile
BLOCK_K = FP8_GROUP          # inputs of a k block (one activation scale group)
STAGES = 3                   # k blocks in flight (16 + 16 + 32 KB of shared memory each, and 1 KB of factors)
_BLOCK_M = gl.constexpr(BLOCK_M)
_BLOCK_K = gl.constexpr(BLOCK_K)
_HALF = gl.constexpr(BLOCK_K // 2)     # 64: rows a consumer, columns a quarter, inputs (bytes) a half k block
_GROUPS = gl.constexpr(BLOCK_K // FP4_GROUP)
_FP4_GROUP = gl.constexpr(FP4_GROUP)
_FOLD_SPREAD = gl.constexpr(FOLD_SPREAD)
_FOLD_PTX = gl.constexpr(FOLD_PTX)
_ACT_MIN_EXPONENT = gl.constexpr(ACT_MIN_EXPONENT)
# A consumer warpgroup's [64, 64] products and accumulators.
ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
ROW_L = gl.constexpr(gl.SliceLayout(1, ACC_L.value))
COL_L = gl.constexpr(gl.SliceLayout(0, ACC_L.value))
# The decoder's [128 rows, 4 groups, 16 bytes]: a thread 16 bytes of one scale group of one row.
PACKED3_L = gl.constexpr(gl.BlockedLayout([1, 1, 16], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
SCALES_L = gl.constexpr(gl.SliceLayout(2, PACKED3_L.value))
FACTORS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


def takes(device: torch.device, format: str, hidden_size: int, intermediate_size: int) -> bool:
    """Whether moe_experts' fp4_fold products run here: fp4 experts that moe_grouped_sm90.fits()."""
    return format == "fp4" and fits(device, hidden_size, intermediate_size)


@gluon.jit
def _producer(a_desc, p_desc, smem, row0, w_row, SECOND: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr):
    """Every k block's TMA loads (the activation rows' even and odd halves, the packed bytes of weight rows
    [w_row, + 128) and [w_row + SECOND, + 128)) into its stage once both consumers have released it."""
    a_smem, packed, decoded, factors, loaded, ready, free = smem
    for kb in range(KB):
        stage = kb % STAGES
        # A fresh barrier counts as released: its phase "-1" is complete.
        mbarrier.wait(free.index(stage), ((kb // STAGES) & 1) ^ 1)
        bar = loaded.index(stage)
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + 2 * p_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, kb * _BLOCK_K], bar, a_smem.index(2 * stage))
        tma.async_copy_global_to_shared(a_desc, [row0, kb * _BLOCK_K + _HALF], bar, a_smem.index(2 * stage + 1))
        tma.async_copy_global_to_shared(p_desc, [w_row, kb * _HALF], bar, packed.index(2 * stage))
        tma.async_copy_global_to_shared(p_desc, [w_row + SECOND, kb * _HALF], bar, packed.index(2 * stage + 1))


@gluon.jit
def _decoder(smem, scale_ptr, unfolded_ptr, tile_col, w_row, SECOND: gl.constexpr, K: gl.constexpr,
             KB: gl.constexpr, SWIGLU: gl.constexpr, STAGES: gl.constexpr):
    """Each loaded stage's weight rows folded to e4m3 for the consumers (low nibbles: even inputs, high:
    odd), with their rows' 2^(top - 133); the tile marked in unfolded_ptr if any row's scales of a k block
    span more than 2^FOLD_SPREAD."""
    a_smem, packed, decoded, factors, loaded, ready, free = smem
    rows = gl.arange(0, 2 * _HALF, gl.SliceLayout(1, SCALES_L))
    groups = gl.arange(0, _GROUPS, gl.SliceLayout(0, SCALES_L))
    zeros3 = gl.zeros([2 * _HALF, _GROUPS, _FP4_GROUP // 2], gl.uint8, PACKED3_L)
    spread = gl.zeros([2 * _HALF], gl.int32, gl.SliceLayout(1, SCALES_L))
    # The scale bytes of both parts' rows, a k block ahead: their load's latency (global memory) is hidden
    # behind the previous block's decode instead of starting it.
    scales0 = scale_ptr + ((w_row + rows).to(gl.int64) * (K // _FP4_GROUP))[:, None] + groups[None, :]
    scales1 = scales0 + SECOND * (K // _FP4_GROUP)
    ahead0 = gl.load(scales0)
    ahead1 = gl.load(scales1)
    for kb in range(KB):
        stage = kb % STAGES
        now0, now1 = ahead0, ahead1
        following = gl.minimum(kb + 1, KB - 1) * _GROUPS   # (the last block's again at the end)
        ahead0 = gl.load(scales0 + following)
        ahead1 = gl.load(scales1 + following)
        mbarrier.wait(loaded.index(stage), (kb // STAGES) & 1)
        for part in gl.static_range(2):
            scales = (now0 if part == 0 else now1).to(gl.int32)
            top = gl.max(scales, 1)
            spread = gl.maximum(spread, top - gl.min(scales, 1))
            offsets = ((scales - top[:, None] + _FOLD_SPREAD) << 3).to(gl.uint8)
            offsets = gl.reshape(gl.expand_dims(offsets, 2) + zeros3, [2 * _HALF, _HALF])
            codes = packed.index(2 * stage + part).load(offsets.type.layout)
            low, high = gl.inline_asm_elementwise(_FOLD_PTX, "=r,=r,r,r", [codes, offsets],
                                                  dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
            decoded.index(4 * stage + 2 * part).store(low.to(gl.float8e4nv, bitcast=True))
            decoded.index(4 * stage + 2 * part + 1).store(high.to(gl.float8e4nv, bitcast=True))
            # 2^(top - 133): the e4m3 values are 2^(s - top + 6) times the e2m1 ones.
            factors.index(2 * stage + part).store(((top - 6) << 23).to(gl.float32, bitcast=True))
            # Each part released on its own: the consumers' first two quarters start under the second's decode.
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(2 * stage + part))
    # Each thread with a row that does not fold marks the block (the same value: no reduction needed).
    marks = unfolded_ptr + tile_col + gl.zeros_like(spread)
    gl.store(marks, gl.full_like(spread, 1), mask=spread > _FOLD_SPREAD)
    if not SWIGLU:   # the down product's program: both of its 128-column blocks
        gl.store(marks + 1, gl.full_like(spread, 1), mask=spread > _FOLD_SPREAD)


@gluon.jit
def _quarter(product, a_lo, a_hi, lo, hi, cols0, acc, a_scale, factors):
    """acc + the k block's product of the consumer's rows with 64 weight rows (both input halves), times
    a_scale per row and its factors per column."""
    product = warpgroup_mma(a_lo, lo.slice(cols0, _HALF).permute((1, 0)), product, use_acc=False, is_async=True)
    product = warpgroup_mma(a_hi, hi.slice(cols0, _HALF).permute((1, 0)), product, is_async=True)
    product = warpgroup_mma_wait(0, deps=(product,))
    column = factors.slice(cols0, _HALF).load(COL_L)
    acc += product * column[None, :] * a_scale[:, None]
    # Keeps the promotion before the next MMA's issue (as moe_grouped_sm90: else the product's registers
    # stay alive under it).
    return product, warpgroup_mma_wait(0, deps=(acc,))


@gluon.jit
def _consumer(smem, a_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, ROWS0: gl.constexpr,
              KB: gl.constexpr, N_OUT: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
              STAGES: gl.constexpr):
    """Rows row0 + ROWS0 .. + 63 of the tile: the four 64-column quarters of the two 128-row weight blocks,
    k block by k block, each promoted into its fp32 accumulator; then the epilogue of those rows."""
    a_smem, packed, decoded, factors, loaded, ready, free = smem
    rows = row0 + ROWS0 + gl.arange(0, _HALF, ROW_L)
    a_scales = a_scale_ptr + rows.to(gl.int64) * KB
    acc0 = gl.zeros([_HALF, _HALF], gl.float32, ACC_L)   # first block's columns 0-63
    acc1 = gl.zeros([_HALF, _HALF], gl.float32, ACC_L)   # first block's columns 64-127
    acc2 = gl.zeros([_HALF, _HALF], gl.float32, ACC_L)   # second block's columns 0-63
    acc3 = gl.zeros([_HALF, _HALF], gl.float32, ACC_L)   # second block's columns 64-127
    product = gl.zeros([_HALF, _HALF], gl.float32, ACC_L)
    for kb in range(KB):
        a_scale = gl.load(a_scales + kb)
        stage = kb % STAGES
        # The activations came by TMA (loaded), the weights from the decoder (ready, a part at a time).
        mbarrier.wait(loaded.index(stage), (kb // STAGES) & 1)
        mbarrier.wait(ready.index(2 * stage), (kb // STAGES) & 1)
        a_lo = a_smem.index(2 * stage).slice(ROWS0, _HALF)
        a_hi = a_smem.index(2 * stage + 1).slice(ROWS0, _HALF)
        lo, hi = decoded.index(4 * stage), decoded.index(4 * stage + 1)
        product, acc0 = _quarter(product, a_lo, a_hi, lo, hi, 0, acc0, a_scale, factors.index(2 * stage))
        product, acc1 = _quarter(product, a_lo, a_hi, lo, hi, _HALF, acc1, a_scale, factors.index(2 * stage))
        mbarrier.wait(ready.index(2 * stage + 1), (kb // STAGES) & 1)
        lo, hi = decoded.index(4 * stage + 2), decoded.index(4 * stage + 3)
        product, acc2 = _quarter(product, a_lo, a_hi, lo, hi, 0, acc2, a_scale, factors.index(2 * stage + 1))
        product, acc3 = _quarter(product, a_lo, a_hi, lo, hi, _HALF, acc3, a_scale, factors.index(2 * stage + 1))
        mbarrier.arrive(free.index(stage))

    if SWIGLU:
        # silu(gate) * up over the block's 128 columns, one power-of-two scale a row; its codes stored with
        # the columns split (even columns, then odd: the down product's fp4 activations), as the Triton kernel.
        h0 = swiglu(acc0, acc2, limit, HAS_LIMIT)
        h1 = swiglu(acc1, acc3, limit, HAS_LIMIT)
        scale, inv_scale = pow2_scale(gl.maximum(gl.max(gl.abs(h0), 1), gl.max(gl.abs(h1), 1)), _ACT_MIN_EXPONENT)
        out_rows = out_ptr + rows.to(gl.int64)[:, None] * N_OUT + col
        quarter = gl.arange(0, _HALF, COL_L)
        for q in gl.static_range(2):
            h = h0 if q == 0 else h1
            within = q * _HALF + quarter
            stored = (within % 2) * _HALF + within // 2
            gl.store(out_rows + stored[None, :], e4m3_bits(h * inv_scale[:, None]).to(gl.uint8))
        gl.store(out_scale_ptr + rows.to(gl.int64) * (N_OUT // _BLOCK_K) + col // _BLOCK_K, scale)
    else:
        out_rows = out_ptr + rows.to(gl.int64)[:, None] * N_OUT + col + gl.arange(0, _HALF, COL_L)[None, :]
        gl.store(out_rows, acc0.to(gl.bfloat16))
        gl.store(out_rows + _HALF, acc1.to(gl.bfloat16))
        gl.store(out_rows + 2 * _HALF, acc2.to(gl.bfloat16))
        gl.store(out_rows + 3 * _HALF, acc3.to(gl.bfloat16))


@gluon.jit
def _grouped_fp4_sm90_kernel(a_desc, a_scale_ptr, p_desc, scale_ptr, tile_expert_ptr, out_ptr, out_scale_ptr,
                             unfolded_ptr, limit, E: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                             N_OUT: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
                             STAGES: gl.constexpr):
    # Programs as moe_grouped_sm90's. unfolded_ptr is indexed as the Triton kernel's (tile x 128-column
    # blocks): a program of the down product (two blocks) marks both.
    SECOND: gl.constexpr = N_OUT if SWIGLU else _BLOCK_K          # from the first 128 weight rows to the second
    KB: gl.constexpr = K // _BLOCK_K
    tile, row0, col, expert, w_row = program_tile(tile_expert_ptr, N, N_OUT, SWIGLU)
    if expert < E:
        tile_col = tile * (N_OUT // _BLOCK_K) + col // _BLOCK_K
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, _BLOCK_M, _HALF], a_desc.layout)
        packed = gl.allocate_shared_memory(p_desc.dtype, [2 * STAGES, _BLOCK_K, _HALF], p_desc.layout)
        decoded = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, _BLOCK_K, _HALF], a_desc.layout)
        factors = gl.allocate_shared_memory(gl.float32, [2 * STAGES, _BLOCK_K], FACTORS_SMEM)
        loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())   # a part each
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(loaded.index(i), count=1)
            mbarrier.init(ready.index(2 * i), count=1)
            mbarrier.init(ready.index(2 * i + 1), count=1)
            mbarrier.init(free.index(i), count=2)   # one arrive a consumer
        smem = (a_smem, packed, decoded, factors, loaded, ready, free)
        gl.warp_specialize([
            (_consumer, (smem, a_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, 0, KB, N_OUT, SWIGLU,
                         HAS_LIMIT, STAGES)),
            (_consumer, (smem, a_scale_ptr, out_ptr, out_scale_ptr, limit, row0, col, _HALF, KB, N_OUT, SWIGLU,
                         HAS_LIMIT, STAGES)),
            (_decoder, (smem, scale_ptr, unfolded_ptr, tile_col, w_row, SECOND, K, KB, SWIGLU, STAGES)),
            (_producer, (a_desc, p_desc, smem, row0, w_row, SECOND, KB, STAGES)),
        ], [4, 4, 1], [184, 112, 40])


def grouped_fp4(a: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                tile_expert: torch.Tensor, out: torch.Tensor, out_scales, unfolded: torch.Tensor, *, swiglu: bool,
                limit) -> None:
    """The first pass of moe_experts' fp4_fold grouped GEMM (moe_experts._grouped_gemm's contract): a
    [tiles * 128, K] fp8 rows sorted by expert, each k block's columns split (even inputs, then odd), with
    a_scales [tiles * 128, K / 128] float32 (powers of two); weight [E, N, K / 2] uint8, two e2m1 codes a
    byte (the low nibble the even input), with scales [E, N, K / 32] uint8 (e8m0); tile_expert [tiles]
    int32 (E: an unused tile). swiglu: N = 2 N_OUT (gate rows, then up), out [rows, N_OUT] uint8 e4m3 codes
    of silu(g) * u (V4's clamp with limit), its columns split likewise, with out_scales [rows, N_OUT / 128];
    else out [rows, N] bfloat16. unfolded [tiles * N_OUT / 128] int32, zeroed: set where a 128-column block's
    weight rows do not fold (its output here is not the product: the Triton kernel's second pass
    recomputes those blocks)."""
    n_experts, n, k_bytes = weight.shape
    k = 2 * k_bytes
    n_out = n // 2 if swiglu else n
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K // 2], gl.float8e4nv)
    p_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_K // 2], gl.uint8)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K // 2], a_layout)
    p_desc = TensorDescriptor.from_tensor(weight.view(n_experts * n, k_bytes), [BLOCK_K, BLOCK_K // 2], p_layout)
    cols = BLOCK_K if swiglu else 2 * BLOCK_K
    _grouped_fp4_sm90_kernel[(tile_expert.numel() * (n_out // cols),)](
        a_desc, a_scales, p_desc, scales, tile_expert, out, out if out_scales is None else out_scales, unfolded,
        0.0 if limit is None else float(limit),
        E=n_experts, N=n, K=k, N_OUT=n_out, SWIGLU=swiglu, HAS_LIMIT=limit is not None, STAGES=STAGES, num_warps=4)
