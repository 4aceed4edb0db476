"""The routed experts at decode sizes: one program per (assignment, block of weight rows), streaming
the rows once with wide loads and multiplying them with FMAs (no tensor cores: a product has one
token). moe_experts takes this path for at most one assignment per four experts (uses_per_assignment).

Two launches, each over every (token, slot) assignment t * top_k + j of the batch:

1. gate/up: rows [r, r + ROWS) of W1[e] and of W3[e] (one [2 ROWS, chunk] tile a step) against the
   token's activations, quantised in the program (fp8_gemm.quantize_act_fp8's rule, the same Triton
   helper), then silu(g) * u (V4's clamp optional) stored in float32, [T * top_k, I];
2. down: rows [r, r + ROWS) of W2[e] against that row of h, quantised per 128 columns in the program
   (as the grouped GEMM's epilogue quantises it: the same helper on the same float32 values), to
   bf16 y [T * top_k, D], and each slot's y row (the slot itself, or -1 if skipped) for
   moe_experts' combine.

Each k block of 128 inputs is summed in float32 and scaled by its activation scale and (fp8) its
128 x 128 weight block scale or (fp4) per 32 inputs by 2^(e8m0 - 127), as the grouped GEMMs do; the
sums are the same but in another order (no MMA), so results agree with them to float32 rounding
(a bf16 ulp now and then). An assignment whose expert id is outside [0, E) does nothing: its
weights are never read and its rows of h and y are left unwritten (the combine skips them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.formats import FP8_GROUP

from ._common import INTERPRET
from ._fp8 import ACT_MIN_EXPONENT, e4m3_bits, pow2_quantize_rows, pow2_scale

_BLOCK_K = tl.constexpr(FP8_GROUP)
_FP4_GROUP = tl.constexpr(32)          # inputs per e8m0 scale (ExpertWeights' fp4 format)
_ACT_MIN_EXPONENT = tl.constexpr(ACT_MIN_EXPONENT)
# fp4 products are formed as (2^-126 e2m1) x (2^64 a): e2m1 codes become float32 by placing their
# bits (_e2m1_tiny), activations are shifted up so that every product is a normal float32 (exact),
# and each 32-input sum is multiplied back by 2^(s - 127 + 62), the float32 of exponent field s + 62.
_ACT_SHIFT = tl.constexpr(2.0 ** 64)
_NIBBLE_FIELDS = tl.constexpr(0x01C00000)     # float32 bits 22-24: the low exponent bits and top mantissa bit
_SIGN = tl.constexpr(-2 ** 31)                # float32 bit 31, as an int32
_FACTOR_FIELD_OFFSET = tl.constexpr(62)

# Average assignments per expert up to which moe_experts takes this path. Each assignment reads its
# expert's weights, so an expert chosen by n tokens is read n times (by the grouped GEMMs once per 16
# tokens): at 1/4 assignment per expert ~1.13 reads per active expert. The grouped GEMMs read
# V3.2's fp8 experts at ~4.2 TB/s from 16 tokens (128 assignments of 256 experts) on; below that
# few programs leave them at 1.2 TB/s and less.
MAX_PER_EXPERT = 0.25
# Launch shape: W1 rows (and as many W3 rows) per program, W2 rows per program, and k blocks a step
# (or the largest power of two below that dividing K / 128). On the GPU: thousands of programs of
# 56-72 registers (sm_90a, no spills; 8 or more resident per SM), each loading 4-16 KB of weights a
# step, keep enough bytes in flight. Interpreted, a program costs milliseconds of Python whatever
# its size: fewer, larger ones.
GATE_UP_ROWS, DOWN_ROWS, STEP_BLOCKS = (64, 64, 4) if INTERPRET else (16, 16, 4)
NUM_WARPS = 4


def uses_per_assignment(n_assignments: int, n_experts: int) -> bool:
    """Whether moe_experts (config None) takes this path: T * top_k <= MAX_PER_EXPERT * E (E / 4)."""
    return n_assignments <= MAX_PER_EXPERT * n_experts


@triton.jit
def _e4m3_value(codes):
    """float32 values of e4m3 codes (int32 0..255)."""
    return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_tiny(packed):
    """2^-126 times the e2m1 values of the low and the high nibbles of packed bytes (int32, sign-extended
    from int8), each nibble's fields (bit 3 sign, bits 1-2 exponent, bit 0 mantissa) placed in a
    float32's sign, exponent and top mantissa bit (subnormal for exponent 0). The high nibble's sign
    is the byte's: shifted with the sign extension, one mask places all its fields."""
    low = ((packed << 22) & _NIBBLE_FIELDS) | ((packed << 28) & _SIGN)
    return low.to(tl.float32, bitcast=True), ((packed << 18) & (_NIBBLE_FIELDS | _SIGN)).to(tl.float32, bitcast=True)


@triton.jit
def _dot_rows(a_ptr, w_ptr, w_scale_ptr, rows, K: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
              FP4: tl.constexpr):
    """float32 [R]: for each weight row of ``rows`` (int64 [R], rows of a stacked [*, K] weight), the sum
    over the k blocks of (a quantised per 128, . w) with the block's scales; a: K values at a_ptr
    (any float dtype). KB k blocks a step."""
    acc = tl.zeros((R,), dtype=tl.float32)
    CHUNK: tl.constexpr = KB * _BLOCK_K
    for k0 in range(0, K, CHUNK):
        if FP4:
            # Byte i of a row holds inputs 2i (low nibble) and 2i + 1: the activations split likewise.
            pairs = tl.arange(0, CHUNK // 2)
            a_even, a_odd = tl.split(tl.reshape(tl.load(a_ptr + k0 + tl.arange(0, CHUNK)).to(tl.float32),
                                                (CHUNK // 2, 2)))
            a_even = tl.reshape(a_even, (KB, _BLOCK_K // 2))
            a_odd = tl.reshape(a_odd, (KB, _BLOCK_K // 2))
            a_scale, a_inv = pow2_scale(tl.maximum(tl.max(tl.abs(a_even), 1), tl.max(tl.abs(a_odd), 1)),
                                        _ACT_MIN_EXPONENT)
            a_even = tl.reshape(_e4m3_value(e4m3_bits(a_even * a_inv[:, None])) * _ACT_SHIFT, (CHUNK // 2,))
            a_odd = tl.reshape(_e4m3_value(e4m3_bits(a_odd * a_inv[:, None])) * _ACT_SHIFT, (CHUNK // 2,))
            w_even, w_odd = _e2m1_tiny(tl.load(w_ptr + rows[:, None] * (K // 2) + k0 // 2 + pairs[None, :]).to(tl.int32))
            products = w_even * a_even[None, :] + w_odd * a_odd[None, :]
            groups = tl.sum(tl.reshape(products, (R, CHUNK // _FP4_GROUP, _FP4_GROUP // 2)), 2)
            scale_bytes = tl.load(w_scale_ptr + rows[:, None] * (K // _FP4_GROUP) + k0 // _FP4_GROUP
                                  + tl.arange(0, CHUNK // _FP4_GROUP)[None, :]).to(tl.int32)
            factors = ((scale_bytes + _FACTOR_FIELD_OFFSET) << 23).to(tl.float32, bitcast=True)
            blocks = tl.sum(tl.reshape(groups * factors, (R, KB, _BLOCK_K // _FP4_GROUP)), 2)
        else:
            a = tl.reshape(tl.load(a_ptr + k0 + tl.arange(0, CHUNK)).to(tl.float32), (KB, _BLOCK_K))
            codes, a_scale = pow2_quantize_rows(a, _ACT_MIN_EXPONENT)
            w = tl.load(w_ptr + rows[:, None] * K + k0 + tl.arange(0, CHUNK)[None, :]).to(tl.float32)
            blocks = tl.sum(tl.reshape(w, (R, KB, _BLOCK_K)) * _e4m3_value(codes)[None, :, :], 2)
            w_scales = tl.load(w_scale_ptr + (rows // _BLOCK_K)[:, None] * (K // _BLOCK_K) + k0 // _BLOCK_K
                               + tl.arange(0, KB)[None, :])
            blocks = blocks * w_scales
        acc += tl.sum(blocks * a_scale[None, :], 1)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, stride_xt, ids_ptr, w_ptr, w_scale_ptr, h_ptr, limit,
                    E: tl.constexpr, D: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                    ROWS: tl.constexpr, KB: tl.constexpr, FP4: tl.constexpr, HAS_LIMIT: tl.constexpr):
    # Program (assignment, block of ROWS columns of h): gate rows [c, c + ROWS) and the matching up
    # rows of its expert, one [2 ROWS] product.
    slot = tl.program_id(0)
    col = tl.program_id(1) * ROWS
    expert = tl.load(ids_ptr + slot)
    if (expert >= 0) & (expert < E):
        token = (slot // TOP_K).to(tl.int64)
        half = tl.arange(0, 2 * ROWS) // ROWS
        rows = expert.to(tl.int64) * (2 * I) + half * I + col + tl.arange(0, 2 * ROWS) % ROWS
        acc = _dot_rows(x_ptr + token * stride_xt, w_ptr, w_scale_ptr, rows, D, 2 * ROWS, KB, FP4)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, ROWS)), (1, 0)))
        if HAS_LIMIT:    # V4: silu(min(g, limit)) * clamp(u, -limit, limit)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + slot.to(tl.int64) * I + col + tl.arange(0, ROWS), h)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w_ptr, w_scale_ptr, y_ptr, row_of_slot_ptr,
                 E: tl.constexpr, D: tl.constexpr, I: tl.constexpr, ROWS: tl.constexpr, KB: tl.constexpr,
                 FP4: tl.constexpr):
    # Program (assignment, block of ROWS output columns): rows [c, c + ROWS) of its expert's W2.
    slot = tl.program_id(0)
    col = tl.program_id(1) * ROWS
    expert = tl.load(ids_ptr + slot)
    valid = (expert >= 0) & (expert < E)
    if valid:
        rows = expert.to(tl.int64) * D + col + tl.arange(0, ROWS)
        y = _dot_rows(h_ptr + slot.to(tl.int64) * I, w_ptr, w_scale_ptr, rows, I, ROWS, KB, FP4)
        tl.store(y_ptr + slot.to(tl.int64) * D + col + tl.arange(0, ROWS), y.to(tl.bfloat16))
    if tl.program_id(1) == 0:
        tl.store(row_of_slot_ptr + slot, tl.where(valid, slot, -1))


def expert_rows_per_assignment(x: torch.Tensor, expert_ids: torch.Tensor, experts,
                               swiglu_limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Every assignment's expert output, for moe_experts' combine (its inputs already validated).

    Args:
        x: [T, D] bfloat16, float16 or float32, unit stride along D.
        expert_ids: [T, top_k] int32 or int64; ids outside [0, E) are skipped.
        experts: ExpertWeights (fp8 or fp4) of hidden size D.
        swiglu_limit: V4's clamp, or None.

    Returns:
        (y [T * top_k, D] bfloat16: row t * top_k + j the expert output of slot j of token t, rows of
        skipped slots unwritten; row_of_slot [T * top_k] int32: the slot's y row, -1 if skipped).
    """
    n_tokens, top_k = expert_ids.shape
    n_slots = n_tokens * top_k
    d, i, n_experts = experts.hidden_size, experts.intermediate_size, experts.n_experts
    fp4 = experts.format == "fp4"
    ids = expert_ids.reshape(-1).contiguous()

    def step(k):    # k blocks a step: the largest power of two up to STEP_BLOCKS that divides them
        return max(kb for kb in (1, 2, 4, 8, 16) if kb <= STEP_BLOCKS and (k // FP8_GROUP) % kb == 0)

    h = torch.empty((n_slots, i), dtype=torch.float32, device=x.device)
    y = torch.empty((n_slots, d), dtype=torch.bfloat16, device=x.device)
    row_of_slot = torch.empty(n_slots, dtype=torch.int32, device=x.device)
    codes = (lambda w: w.view(torch.int8)) if fp4 else (lambda w: w)   # fp4 bytes read sign-extended (_e2m1_tiny)
    _gate_up_kernel[(n_slots, i // GATE_UP_ROWS)](
        x, x.stride(0), ids, codes(experts.w13), experts.w13_scales, h,
        0.0 if swiglu_limit is None else float(swiglu_limit), E=n_experts, D=d, I=i, TOP_K=top_k,
        ROWS=GATE_UP_ROWS, KB=step(d), FP4=fp4, HAS_LIMIT=swiglu_limit is not None, num_warps=NUM_WARPS)
    _down_kernel[(n_slots, d // DOWN_ROWS)](
        h, ids, codes(experts.w2), experts.w2_scales, y, row_of_slot, E=n_experts, D=d, I=i,
        ROWS=DOWN_ROWS, KB=step(i), FP4=fp4, num_warps=NUM_WARPS)
    return y, row_of_slot
