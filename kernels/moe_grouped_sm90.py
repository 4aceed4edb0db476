"""Hopper (sm_90) fast path of moe_experts' fp8 grouped GEMMs at prefill, written in Gluon.

Same products as moe_experts' Triton kernel with PREFILL_CONFIG (64-row tiles of expert-sorted rows, one
expert a tile, 128 x 128 block scales promoted per 128-wide k block in fp32), for fp8 experts. One
program = one 64-row tile x 256 weight rows: the gate and up rows of 128 output columns (SwiGLU fused,
the result quantised to fp8 per 128 columns) or 256 rows of the down product (bf16 out). Eight warps:
each warpgroup owns one 128-row half of the weight tile.

Why it is faster than the Triton kernel: the product of each k block must be scaled before it joins the
fp32 accumulator, and Triton waits for a k block's MMA before that promotion, so the tensor cores idle
during it. Here k block j + 1's MMA is issued (asynchronously) before block j's promotion, which then
runs on the CUDA cores while the tensor cores work; TMA keeps STAGES k blocks of both operands in
flight. Registers: the accumulator, the promoted product and the one in flight, 64 each a thread.

Gluon has no interpreter: this kernel runs only on sm_90 GPUs. moe_experts takes it there for fp8 experts
with its default prefill config (uses_sm90_kernel); the CPU interpreter and other GPUs run the Triton
kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minirt.formats import FP8_GROUP

from ._common import INTERPRET, is_sm90
from ._fp8 import ACT_MIN_EXPONENT, e4m3_bits, pow2_scale

BLOCK_M = 64                 # rows of a tile (moe_experts' PREFILL_CONFIG.block_m)
BLOCK_K = FP8_GROUP          # one k block = one activation scale group = one weight block column
STAGES = 3                   # k blocks in flight (3 x 40 KB of shared memory, and the epilogue's 64 KB)
_BLOCK_M = gl.constexpr(BLOCK_M)
_BLOCK_K = gl.constexpr(BLOCK_K)
_ACT_MIN_EXPONENT = gl.constexpr(ACT_MIN_EXPONENT)
# [64, 256] products: warpgroup 0 the first 128 weight rows' columns, warpgroup 1 the second's.
ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 32]))
ROW_L = gl.constexpr(gl.SliceLayout(1, ACC_L.value))
COL_L = gl.constexpr(gl.SliceLayout(0, ACC_L.value))
# The epilogue's [64, 128] halves: a row's 128 columns over 16 threads of a warp, 8 contiguous a thread.
HALF_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]))
EPI_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))


def uses_sm90_kernel(device: torch.device, fp4: bool, block_m: int, splits: int, n_out: int, k: int,
                     swiglu: bool) -> bool:
    """Whether a grouped GEMM launch of moe_experts runs here: fp8 experts, 64-row tiles, no split-K, whole
    column blocks, an even number of k blocks (the loop takes two at a time), on sm_90."""
    return not INTERPRET and not fp4 and block_m == BLOCK_M and splits == 1 \
        and n_out % (BLOCK_K if swiglu else 2 * BLOCK_K) == 0 and k % (2 * BLOCK_K) == 0 \
        and device.type == "cuda" and is_sm90(device)


@gluon.jit
def _load_k_block(a_desc, b_desc, a_smem, b_smem, ready, kb, row0, w_row, SECOND: gl.constexpr,
                  STAGES: gl.constexpr):
    """Issue the TMA loads of k block kb: 64 activation rows, the weight's rows [w_row, + 128) and
    [w_row + SECOND, + 128), into stage kb % STAGES; its ready barrier counts their bytes."""
    stage = kb % STAGES
    bar = ready.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row0, kb * _BLOCK_K], bar, a_smem.index(stage))
    b = b_smem.index(stage)
    tma.async_copy_global_to_shared(b_desc, [w_row, kb * _BLOCK_K], bar, b.slice(0, _BLOCK_K))
    tma.async_copy_global_to_shared(b_desc, [w_row + SECOND, kb * _BLOCK_K], bar, b.slice(_BLOCK_K, _BLOCK_K))


@gluon.jit
def _mma_k_block(a_smem, b_smem, ready, kb, storage, STAGES: gl.constexpr):
    """Wait for k block kb's operands and issue its [64, 256] product, asynchronously (its token), into the
    registers of storage (a [64, 256] float32 tensor no longer needed: its values are not read)."""
    stage = kb % STAGES
    mbarrier.wait(ready.index(stage), (kb // STAGES) & 1)
    return warpgroup_mma(a_smem.index(stage), b_smem.index(stage).permute((1, 0)), storage, use_acc=False,
                         is_async=True)


@gluon.jit
def _next_k_block(a_desc, b_desc, a_smem, b_smem, ready, pending, spare, acc, a_scales, b_scales_first,
                  b_scales_second, second, kb, row0, w_row, SECOND: gl.constexpr, KB: gl.constexpr,
                  STAGES: gl.constexpr):
    """(k block kb + 1's product in flight, in spare's registers; kb's product, the next spare; acc with k
    block kb's promoted). Block kb - 1's stage is free (its MMA was waited for), so it is refilled STAGES - 1
    blocks ahead; then block kb's product is waited for, block kb + 1's issued, and block kb's scaled into
    acc on the CUDA cores while it runs."""
    if kb + STAGES - 1 < KB:
        _load_k_block(a_desc, b_desc, a_smem, b_smem, ready, kb + STAGES - 1, row0, w_row, SECOND, STAGES)
    # acc passes through the wait so that block kb - 1's promotion stays before it: sunk past the next
    # MMA, it would keep the registers that MMA reuses alive, and the copies would serialise the MMAs.
    product, acc = warpgroup_mma_wait(0, deps=(pending, acc))
    pending = _mma_k_block(a_smem, b_smem, ready, kb + 1, spare, STAGES)
    acc += product * _block_scales(a_scales, b_scales_first, b_scales_second, second, kb)
    return pending, product, acc


@gluon.jit
def _block_scales(a_scales, b_scales_first, b_scales_second, second, kb):
    """[64, 256] float32: k block kb's activation scale per row times the weight's block scale of each
    column's 128-row half."""
    b_scale = gl.where(second, gl.load(b_scales_second + kb), gl.load(b_scales_first + kb))
    return gl.load(a_scales + kb)[:, None] * b_scale[None, :]


@gluon.jit
def _grouped_fp8_sm90_kernel(a_desc, a_scale_ptr, b_desc, b_scale_ptr, tile_expert_ptr, out_ptr, out_scale_ptr,
                             limit, E: gl.constexpr, N: gl.constexpr, K: gl.constexpr, N_OUT: gl.constexpr,
                             SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr):
    # Program (tile, column block), column blocks fastest: the programs of one tile share its activations.
    COLS: gl.constexpr = _BLOCK_K if SWIGLU else 2 * _BLOCK_K     # output columns a program
    SECOND: gl.constexpr = N_OUT if SWIGLU else _BLOCK_K          # from the first 128 weight rows to the second
    KB: gl.constexpr = K // _BLOCK_K
    pid = gl.program_id(0)
    tile = pid // (N_OUT // COLS)
    col = pid % (N_OUT // COLS) * COLS
    expert = gl.load(tile_expert_ptr + tile)
    if expert < E:
        row0 = tile * _BLOCK_M
        w_row = expert * N + col
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BLOCK_M, _BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 2 * _BLOCK_K, _BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for kb in gl.static_range(STAGES - 1):
            _load_k_block(a_desc, b_desc, a_smem, b_smem, ready, kb, row0, w_row, SECOND, STAGES)

        rows = row0 + gl.arange(0, _BLOCK_M, ROW_L)
        a_scales = a_scale_ptr + rows.to(gl.int64) * KB
        second = gl.arange(0, 2 * _BLOCK_K, COL_L) >= _BLOCK_K
        b_scales_first = b_scale_ptr + (w_row // _BLOCK_K).to(gl.int64) * KB
        b_scales_second = b_scale_ptr + ((w_row + SECOND) // _BLOCK_K).to(gl.int64) * KB
        acc = gl.zeros([_BLOCK_M, 2 * _BLOCK_K], gl.float32, ACC_L)
        pending = _mma_k_block(a_smem, b_smem, ready, 0, gl.zeros_like(acc), STAGES)
        spare = gl.zeros_like(acc)
        # Two k blocks an iteration: each product is computed into the registers of the one before last
        # (spare), so the product in flight across the loop's back edge always sits in the same registers.
        # Copying an in-flight accumulator would make ptxas serialise every MMA.
        for kb in range(0, KB - 2, 2):
            pending, spare, acc = _next_k_block(a_desc, b_desc, a_smem, b_smem, ready, pending, spare, acc, a_scales,
                                                b_scales_first, b_scales_second, second, kb, row0, w_row, SECOND, KB,
                                                STAGES)
            pending, spare, acc = _next_k_block(a_desc, b_desc, a_smem, b_smem, ready, pending, spare, acc, a_scales,
                                                b_scales_first, b_scales_second, second, kb + 1, row0, w_row, SECOND,
                                                KB, STAGES)
        pending, spare, acc = _next_k_block(a_desc, b_desc, a_smem, b_smem, ready, pending, spare, acc, a_scales,
                                            b_scales_first, b_scales_second, second, KB - 2, row0, w_row, SECOND, KB,
                                            STAGES)
        product = warpgroup_mma_wait(0, deps=(pending,))
        acc += product * _block_scales(a_scales, b_scales_first, b_scales_second, second, KB - 1)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        if SWIGLU:
            # Gate and up of a column sit in different warpgroups: meet through shared memory.
            exchange = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, 2 * _BLOCK_K], EPI_SMEM)
            exchange.store(acc)
            gl.thread_barrier()
            g = exchange.slice(0, _BLOCK_K, dim=1).load(HALF_L)
            u = exchange.slice(_BLOCK_K, _BLOCK_K, dim=1).load(HALF_L)
            if HAS_LIMIT:    # V4: silu(min(g, limit)) * clamp(u, -limit, limit)
                g = gl.minimum(g, limit)
                u = gl.minimum(gl.maximum(u, -limit), limit)
            h = g / (1.0 + gl.exp(-g)) * u
            scale, inv_scale = pow2_scale(gl.max(gl.abs(h), 1), _ACT_MIN_EXPONENT)
            codes = e4m3_bits(h * inv_scale[:, None]).to(gl.uint8)
            out_rows = row0 + gl.arange(0, _BLOCK_M, gl.SliceLayout(1, HALF_L))
            out_cols = col + gl.arange(0, _BLOCK_K, gl.SliceLayout(0, HALF_L))
            gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * N_OUT + out_cols[None, :], codes)
            gl.store(out_scale_ptr + out_rows.to(gl.int64) * (N_OUT // _BLOCK_K) + col // _BLOCK_K, scale)
        else:
            out_cols = col + gl.arange(0, 2 * _BLOCK_K, COL_L)
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * N_OUT + out_cols[None, :], acc.to(gl.bfloat16))


def grouped_fp8(a: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                tile_expert: torch.Tensor, out: torch.Tensor, out_scales, *, swiglu: bool, limit) -> None:
    """One grouped GEMM launch over every 64-row tile (moe_experts._grouped_gemm's contract, fp8 experts):
    a [tiles * 64, K] fp8 rows sorted by expert with a_scales [tiles * 64, K / 128] float32; weight
    [E, N, K] fp8 with scales [E, N / 128, K / 128] float32; tile_expert [tiles] int32 (E: unused tile).
    swiglu: N = 2 N_OUT (gate rows, then up), out [rows, N_OUT] uint8 e4m3 codes of silu(g) * u
    (V4's clamp with limit) with out_scales [rows, N_OUT / 128]; else out [rows, N] bfloat16."""
    n_experts, n, k = weight.shape
    n_out = n // 2 if swiglu else n
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_K], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(weight.view(n_experts * n, k), [BLOCK_K, BLOCK_K], b_layout)
    cols = BLOCK_K if swiglu else 2 * BLOCK_K
    grid = (tile_expert.numel() * (n_out // cols),)
    _grouped_fp8_sm90_kernel[grid](
        a_desc, a_scales, b_desc, scales, tile_expert, out, out if out_scales is None else out_scales,
        0.0 if limit is None else float(limit),
        E=n_experts, N=n, K=k, N_OUT=n_out, SWIGLU=swiglu, HAS_LIMIT=limit is not None, STAGES=STAGES, num_warps=8)
