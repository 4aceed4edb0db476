"""The routed experts at decode sizes: one program per (assignment, block of weight rows), streaming
the rows once. moe_experts takes this path for at most one assignment per four experts
(uses_per_assignment).

Over every (token, slot) assignment t * top_k + j of the batch:

1. gate/up: rows [r, r + ROWS) of W1[e] and of W3[e] (one [2 ROWS, chunk] tile a step) against the
   token's activations quantised per 128 (fp8_gemm.quantize_act_fp8's rule, the same Triton
   helper), then silu(g) * u (V4's clamp optional) stored in float32, [T * top_k, I];
2. down: rows [r, r + ROWS) of W2[e] against that row of h, quantised per 128 columns (as the
   grouped GEMM's epilogue quantises it: the same helper on the same float32 values), to bf16 y
   [T * top_k, D], and each slot's y row (-1 if skipped) for moe_experts' combine.

A shared expert (V4's, one fp8 expert) may join both launches: its T rows of h and y come first, its
programs before the assignments'. The launches (and moe_experts' combine after them) use programmatic
dependent launch: each kernel may start while the one before ends, waits for its inputs first and lets the
next one launch once that wait returns; at one token the down programs and fp4's gate/up programs (an
operand launch between them and the routing), before waiting, ask L2 for the first bytes of their weight
rows (the expert ids they read then are the routing's, finished two launches back).

fp8 weights (V3.2): FMAs in float32 (no tensor cores: a product has one token), the activations
quantised in the program; each k block of 128 inputs summed in float32 and scaled by its activation
scale and its 128 x 128 weight block scale. fp4 weights (V4): on fp8 tensor cores (_dot_rows_fp4):
a launch before each product quantises its activations (x per token, h per slot) into block-diagonal
e4m3 operands (_fp4_operand_kernel), the weights' e2m1 codes become e4m3 in registers (four bytes
per 7 integer instructions), and one [rows, 256] x [256, 16] product gives each row's sums of 16
groups of 32 inputs at once, each scaled by 2^6 x its e8m0 scale and its activation scale. The
products are exact either way and only the order (and, fp4, the tensor cores' accumulation) of the
sums differs from the grouped GEMMs: results agree with them to float32 rounding (a bf16 ulp now
and then). An assignment whose expert id is outside [0, E) does nothing: its weights are never read
and its rows of h and y are left unwritten (the combine skips them; fp4: its h operand row is
computed from those unwritten values and never read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.formats import FP8_GROUP

from ._common import INTERPRET, flat_of, launch_dependents, prefetch_to_l2, swiglu, wait_for_inputs
from ._fp8 import ACT_MIN_EXPONENT, e4m3_bits, pow2_quantize_rows, pow2_scale

_BLOCK_K = tl.constexpr(FP8_GROUP)
_FP4_GROUP = tl.constexpr(32)          # inputs per e8m0 scale (ExpertWeights' fp4 format)
_ACT_MIN_EXPONENT = tl.constexpr(ACT_MIN_EXPONENT)

# Average assignments per expert up to which moe_experts takes this path, per weight format. Each
# assignment reads its expert's weights, so an expert chosen by n tokens is read n times (by the
# grouped GEMMs once per 16 tokens). fp8: at 1/4 assignment per expert ~1.13 reads per active expert;
# the grouped GEMMs read V3.2's fp8 experts at ~4.2 TB/s from 16 tokens (128 assignments of 256
# experts) on, below that few programs leave them at 1.2 TB/s and less. fp4 (V4-Flash on an H200):
# this path took 0.34 ms at T 16 and 1.25 ms at T 64 (1.5 assignments per expert), the grouped
# GEMMs' decode shape 0.84 and 2.06 ms. A single assignment always takes it: it reads its expert once, as
# the grouped GEMMs would, over many more programs (V4's shared expert, one fp8 expert of 25 MB a layer,
# took 0.080 ms for its four layers' at b 1 in the grouped GEMMs on an H100: 1.26 TB/s).
MAX_PER_EXPERT = {"fp8": 0.25, "fp4": 1.5}
# Launch shape: W1 rows (and as many W3 rows) per program, W2 rows per program, and k blocks a step
# (or the largest power of two below that dividing K / 128). fp8 on the GPU: thousands of programs of
# 56-72 registers (sm_90a, no spills; 8 or more resident per SM), each loading 4-16 KB of weights a
# step, keep enough bytes in flight. fp4: 64 weight rows a program (a warpgroup's MMA rows; 32 gate
# and 32 up rows): V4-Flash at T 1 gives 384 programs of each product, whose loads the Triton
# pipeliner keeps in flight (on an H200, 64 / 128 W2 rows or 32 gate rows / 128 W2 rows were up to
# 5% slower at T 1, 16 and 64). Interpreted, a program costs milliseconds of Python whatever its
# size: fewer, larger ones.
GATE_UP_ROWS, DOWN_ROWS, STEP_BLOCKS = (64, 64, 4) if INTERPRET else (16, 16, 4)
FP4_GATE_UP_ROWS, FP4_DOWN_ROWS = 32, 64
NUM_WARPS = 4
# Bytes of each weight row a program asks L2 for before it waits for the previous kernel, at one token
# (V4-Flash's launches then have 448 programs, about one wave): their first steps' weights arrive while that
# kernel ends and this one launches. On an H100 (CUDA-graph replays, one process): V4-Flash's b 1 layer
# 65.0 us without, 62.8 at 256 bytes, 63.3 at 512, 65.9 at 1024; at 16 and 64 tokens (many waves of
# programs) it only competed with the streaming (b 64: 1302 us without, 1314 at 256), so they take none.
PREFETCH_BYTES = 256


def uses_per_assignment(n_assignments: int, n_experts: int, fmt: str) -> bool:
    """Whether moe_experts (config None) takes this path for experts of format fmt ("fp8" or "fp4"):
    T * top_k <= MAX_PER_EXPERT[fmt] * E (fp8 E / 4, fp4 1.5 E), or a single assignment."""
    return n_assignments <= max(1.0, MAX_PER_EXPERT[fmt] * n_experts)


@triton.jit
def _e4m3_value(codes):
    """float32 values of e4m3 codes (int32 0..255)."""
    return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


# fp4 products on fp8 tensor cores: each byte's two e2m1 codes become e4m3 codes of 2^-6 times their
# values (exact: magnitude bits e, b to the e4m3 exponent's low bits and top mantissa bit, sign to
# bit 7), four bytes a word in 7 integer instructions; the activations of a chunk's 32-input groups
# fill the columns of a block-diagonal [inputs, 16] e4m3 matrix, so that one product gives every
# weight row's 16 group sums at once, each then scaled by 2^6 x its e8m0 scale and its activation scale.
_FP4_COLUMNS = tl.constexpr(16)       # N of the product: the groups of a chunk (at most 16), zero-padded
_E2M1_AS_E4M3_ASM = tl.constexpr("""{
.reg .b32 t, u;
shl.b32 t, $2, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, $2, 2;
and.b32 u, u, 0x1C1C1C1C;
or.b32 $0, t, u;
shr.b32 u, $2, 2;
and.b32 u, u, 0x1C1C1C1C;
and.b32 t, $2, 0x80808080;
or.b32 $1, t, u;
}""")


@triton.jit
def _e2m1_pairs_as_e4m3(packed, INTERPRETED: tl.constexpr):
    """Packed e2m1 bytes (uint8, any shape; low nibble the even input) -> (e4m3 of the low nibbles,
    e4m3 of the high ones) as uint8 codes of 2^-6 times their values. Compiled: four bytes per
    instruction (the bit operations never cross a byte); interpreted: the same per byte."""
    if INTERPRETED:
        p = packed.to(tl.int32)
        low = ((p << 4) & 0x80) | ((p << 2) & 0x1C)
        high = (p & 0x80) | ((p >> 2) & 0x1C)
        return low.to(tl.uint8), high.to(tl.uint8)
    else:
        return tl.inline_asm_elementwise(_E2M1_AS_E4M3_ASM, "=r,=r,r", [packed],
                                         dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)


@triton.jit
def _fp4_operand_kernel(a_ptr, stride_a, out_ptr, scale_ptr, K: tl.constexpr, KB: tl.constexpr):
    """Program (row, chunk of KB * 128 inputs): the row's activations quantised per 128 (the fp8 path's
    rule) as the chunk's two block-diagonal e4m3 operands, even inputs then odd ones, each stored
    [16, CHUNK / 2] (column g, rows 16g .. 16g + 15: group g's codes; zero elsewhere and in columns
    >= CHUNK / 32), and each column's activation scale (0 past the groups)."""
    wait_for_inputs()
    launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    CHUNK: tl.constexpr = KB * _BLOCK_K
    a = tl.load(a_ptr + row * stride_a + chunk * CHUNK + tl.arange(0, CHUNK)).to(tl.float32)
    a_even, a_odd = tl.split(tl.reshape(a, (CHUNK // 2, 2)))
    a_even = tl.reshape(a_even, (KB, _BLOCK_K // 2))
    a_odd = tl.reshape(a_odd, (KB, _BLOCK_K // 2))
    a_scale, a_inv = pow2_scale(tl.maximum(tl.max(tl.abs(a_even), 1), tl.max(tl.abs(a_odd), 1)),
                                _ACT_MIN_EXPONENT)
    column = tl.arange(0, _FP4_COLUMNS)
    in_column = (tl.arange(0, CHUNK // 2) // (_FP4_GROUP // 2))[None, :] == column[:, None]
    out = out_ptr + (row * (K // CHUNK) + chunk) * (2 * _FP4_COLUMNS * (CHUNK // 2)) \
        + column[:, None] * (CHUNK // 2) + tl.arange(0, CHUNK // 2)[None, :]
    for parity in tl.static_range(2):
        codes = tl.reshape(e4m3_bits((a_odd if parity else a_even) * a_inv[:, None]), (CHUNK // 2,))
        tl.store(out + parity * (_FP4_COLUMNS * (CHUNK // 2)), tl.where(in_column, codes[None, :], 0).to(tl.uint8))
    column_scale = tl.sum(tl.where(column[None, :] // (_BLOCK_K // _FP4_GROUP) == tl.arange(0, KB)[:, None],
                                   a_scale[:, None], 0.0), 0)
    tl.store(scale_ptr + (row * (K // CHUNK) + chunk) * _FP4_COLUMNS + column, column_scale)


@triton.jit
def _dot_rows_tc(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, K: tl.constexpr, R: tl.constexpr,
                 KB: tl.constexpr, E2M1: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 [R]: _dot_rows on fp8 tensor cores, the activations a row's _fp4_operand_kernel operands (a_ptr)
    and column scales: a chunk's even and odd inputs each one [R, CHUNK / 2] x [CHUNK / 2, 16] product.
    E2M1: fp4 weights ([*, K / 2] packed bytes, e8m0 scale bytes [*, K / 32]); else block-fp8 weights
    ([*, K] e4m3, float32 128 x 128 block scales: an fp8 shared expert in an fp4 launch), a chunk in two
    parts of as many bytes as an fp4 chunk (the registers of one)."""
    CHUNK: tl.constexpr = KB * _BLOCK_K
    PARTS: tl.constexpr = 1 if E2M1 else 2
    PAIRS: tl.constexpr = CHUNK // (2 * PARTS)      # (even, odd) input pairs a part
    OP_DTYPE: tl.constexpr = tl.float32 if INTERPRETED else tl.float8e4nv
    column = tl.arange(0, _FP4_COLUMNS)
    in_chunk = (column < CHUNK // _FP4_GROUP)[None, :]
    acc = tl.zeros((R,), dtype=tl.float32)
    for c in range(0, K // CHUNK * PARTS):
        chunk = c // PARTS
        part = c % PARTS
        if E2M1:
            packed = tl.load(w_ptr + rows[:, None] * (K // 2) + chunk * PAIRS + tl.arange(0, PAIRS)[None, :])
            w_even, w_odd = _e2m1_pairs_as_e4m3(packed, INTERPRETED)
            scale_bytes = tl.load(w_scale_ptr + rows[:, None] * (K // _FP4_GROUP) + chunk * (CHUNK // _FP4_GROUP)
                                  + column[None, :], mask=in_chunk, other=0).to(tl.int32)
            # 2^6 x 2^(s - 127) as a float32 from its exponent field s + 6 (the codes hold 2^-6 x the values).
            w_factors = ((scale_bytes + 6) << 23).to(tl.float32, bitcast=True)
        else:
            codes = tl.load(w_ptr + rows[:, None] * K + c * (2 * PAIRS) + tl.arange(0, 2 * PAIRS)[None, :])
            w_even, w_odd = tl.split(tl.reshape(codes, (R, PAIRS, 2)))
            w_factors = tl.load(w_scale_ptr + (rows // _BLOCK_K)[:, None] * (K // _BLOCK_K) + chunk * KB
                                + (column // (_BLOCK_K // _FP4_GROUP))[None, :], mask=in_chunk, other=0.0)
        operand = (a_ptr + chunk * (2 * _FP4_COLUMNS * (CHUNK // 2)) + column[:, None] * (CHUNK // 2) + part * PAIRS
                   + tl.arange(0, PAIRS)[None, :])
        a_even = tl.load(operand).to(tl.float8e4nv, bitcast=True)
        a_odd = tl.load(operand + _FP4_COLUMNS * (CHUNK // 2)).to(tl.float8e4nv, bitcast=True)
        sums = tl.dot(w_odd.to(tl.float8e4nv, bitcast=True).to(OP_DTYPE), tl.trans(a_odd.to(OP_DTYPE)),
                      tl.dot(w_even.to(tl.float8e4nv, bitcast=True).to(OP_DTYPE), tl.trans(a_even.to(OP_DTYPE))))
        acc += tl.sum(sums * w_factors * tl.load(a_scale_ptr + chunk * _FP4_COLUMNS + column)[None, :], 1)
    return acc


@triton.jit
def _dot_rows(a_ptr, w_ptr, w_scale_ptr, rows, K: tl.constexpr, R: tl.constexpr, KB: tl.constexpr):
    """float32 [R]: for each weight row of ``rows`` (int64 [R], rows of a stacked [*, K] block-fp8
    weight), the sum over the k blocks of (a quantised per 128, . w) with the block's scales; a: K
    values at a_ptr (any float dtype). KB k blocks a step."""
    acc = tl.zeros((R,), dtype=tl.float32)
    CHUNK: tl.constexpr = KB * _BLOCK_K
    for k0 in range(0, K, CHUNK):
        a = tl.reshape(tl.load(a_ptr + k0 + tl.arange(0, CHUNK)).to(tl.float32), (KB, _BLOCK_K))
        codes, a_scale = pow2_quantize_rows(a, _ACT_MIN_EXPONENT)
        w = tl.load(w_ptr + rows[:, None] * K + k0 + tl.arange(0, CHUNK)[None, :]).to(tl.float32)
        blocks = tl.sum(tl.reshape(w, (R, KB, _BLOCK_K)) * _e4m3_value(codes)[None, :, :], 2)
        w_scales = tl.load(w_scale_ptr + (rows // _BLOCK_K)[:, None] * (K // _BLOCK_K) + k0 // _BLOCK_K
                           + tl.arange(0, KB)[None, :])
        acc += tl.sum(blocks * w_scales * a_scale[None, :], 1)
    return acc


@triton.jit
def _dot_rows_of(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, K: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
                 TC: tl.constexpr, E2M1: tl.constexpr, INTERPRETED: tl.constexpr):
    """A launch's products: on tensor cores (TC: an fp4 launch, whose activations are operands) or FMAs."""
    if TC:
        return _dot_rows_tc(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, K, R, KB, E2M1, INTERPRETED)
    else:
        return _dot_rows(a_ptr, w_ptr, w_scale_ptr, rows, K, R, KB)


@triton.jit
def _swiglu_rows(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, first_row, col, h_ptr, limit, D: tl.constexpr,
                 I: tl.constexpr, ROWS: tl.constexpr, KB: tl.constexpr, TC: tl.constexpr, E2M1: tl.constexpr,
                 HAS_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """h[col, col + ROWS) of one token and expert (its W13 from row first_row): gate rows and the matching
    up rows, one [2 ROWS] product, then swiglu (V4's clamp with HAS_LIMIT)."""
    half = tl.arange(0, 2 * ROWS) // ROWS
    rows = first_row + half * I + col + tl.arange(0, 2 * ROWS) % ROWS
    acc = _dot_rows_of(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, rows, D, 2 * ROWS, KB, TC, E2M1, INTERPRETED)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, ROWS)), (1, 0)))
    tl.store(h_ptr + col + tl.arange(0, ROWS), swiglu(gate, up, limit, HAS_LIMIT))


@triton.jit
def _prefetch_rows(w_ptr, rows, ROW_BYTES: tl.constexpr, BYTES: tl.constexpr, valid):
    """Into L2 without waiting: the first BYTES bytes of each of rows (int64 [R]) of a byte matrix [*, ROW_BYTES]
    at w_ptr, if valid."""
    lines = tl.arange(0, BYTES // 128) * 128
    # (rows >= 0 always holds: it gives the mask its [R, lines] shape.)
    prefetch_to_l2(w_ptr + rows[:, None] * ROW_BYTES + lines[None, :],
                   (rows >= 0)[:, None] & (lines < ROW_BYTES)[None, :] & valid)


@triton.jit
def _gate_up_kernel(x_ptr, stride_xt, x_scale_ptr, ids_ptr, w_ptr, w_scale_ptr, shared_ptr, shared_scale_ptr, h_ptr,
                    limit, n_shared, E: tl.constexpr, D: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                    ROWS: tl.constexpr, KB: tl.constexpr, FP4: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    HAS_SHARED: tl.constexpr, PREFETCH: tl.constexpr, INTERPRETED: tl.constexpr):
    # Program (row r of h, block of ROWS columns): rows r < n_shared (HAS_SHARED) the shared expert on token r
    # (first: its programs read the most), then assignment r - n_shared. PREFETCH > 0: before waiting for the
    # previous kernel, the first PREFETCH bytes of each weight row into L2 (expert ids: the routing's, done
    # before the previous kernel's wait returned, which came before this launch: fp4's operand launch).
    r = tl.program_id(0)
    col = tl.program_id(1) * ROWS
    if PREFETCH > 0:
        gate_up = tl.arange(0, 2 * ROWS) // ROWS * I + col + tl.arange(0, 2 * ROWS) % ROWS
        if HAS_SHARED and r < n_shared:
            _prefetch_rows(shared_ptr, gate_up.to(tl.int64), D, PREFETCH, r < n_shared)
        else:
            expert = tl.load(ids_ptr + r - n_shared, cache_modifier=".cg")
            _prefetch_rows(w_ptr, expert.to(tl.int64) * (2 * I) + gate_up, D // 2 if FP4 else D, PREFETCH,
                           (expert >= 0) & (expert < E))
    wait_for_inputs()
    launch_dependents()
    x_scales = D // (KB * _BLOCK_K) * _FP4_COLUMNS    # a token's operand column scales (fp4 launches)
    h_row = h_ptr + r.to(tl.int64) * I
    if HAS_SHARED and r < n_shared:
        token = r.to(tl.int64)
        _swiglu_rows(x_ptr + token * stride_xt, x_scale_ptr + token * x_scales, shared_ptr, shared_scale_ptr, 0, col,
                     h_row, limit, D, I, ROWS, KB, FP4, False, HAS_LIMIT, INTERPRETED)
    else:
        slot = r - n_shared
        expert = tl.load(ids_ptr + slot)
        if (expert >= 0) & (expert < E):
            token = (slot // TOP_K).to(tl.int64)
            _swiglu_rows(x_ptr + token * stride_xt, x_scale_ptr + token * x_scales, w_ptr, w_scale_ptr,
                         expert.to(tl.int64) * (2 * I), col, h_row, limit, D, I, ROWS, KB, FP4, FP4, HAS_LIMIT,
                         INTERPRETED)


@triton.jit
def _down_kernel(h_ptr, stride_h, h_scale_ptr, ids_ptr, w_ptr, w_scale_ptr, shared_ptr, shared_scale_ptr, y_ptr,
                 row_of_slot_ptr, n_shared, E: tl.constexpr, D: tl.constexpr, I: tl.constexpr, ROWS: tl.constexpr,
                 KB: tl.constexpr, FP4: tl.constexpr, HAS_SHARED: tl.constexpr, PREFETCH: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    # Program (row r of h and y, block of ROWS output columns): rows [c, c + ROWS) of the shared expert's W2
    # (r < n_shared, HAS_SHARED) or of assignment r - n_shared's expert's. PREFETCH > 0: as in _gate_up_kernel
    # (the gate/up launch came between the routing and this one's previous launch).
    r = tl.program_id(0)
    col = tl.program_id(1) * ROWS
    if PREFETCH > 0:
        if HAS_SHARED and r < n_shared:
            _prefetch_rows(shared_ptr, (col + tl.arange(0, ROWS)).to(tl.int64), I, PREFETCH, r < n_shared)
        else:
            expert = tl.load(ids_ptr + r - n_shared, cache_modifier=".cg")
            _prefetch_rows(w_ptr, expert.to(tl.int64) * D + col + tl.arange(0, ROWS), I // 2 if FP4 else I, PREFETCH,
                           (expert >= 0) & (expert < E))
    wait_for_inputs()
    launch_dependents()
    h_row = h_ptr + r.to(tl.int64) * stride_h
    h_scales = h_scale_ptr + r.to(tl.int64) * (I // (KB * _BLOCK_K) * _FP4_COLUMNS)
    y_row = y_ptr + r.to(tl.int64) * D + col + tl.arange(0, ROWS)
    if HAS_SHARED and r < n_shared:
        y = _dot_rows_of(h_row, h_scales, shared_ptr, shared_scale_ptr, col + tl.arange(0, ROWS).to(tl.int64), I,
                         ROWS, KB, FP4, False, INTERPRETED)
        tl.store(y_row, y.to(tl.bfloat16))
    else:
        slot = r - n_shared
        expert = tl.load(ids_ptr + slot)
        valid = (expert >= 0) & (expert < E)
        if valid:
            y = _dot_rows_of(h_row, h_scales, w_ptr, w_scale_ptr, expert.to(tl.int64) * D + col + tl.arange(0, ROWS),
                             I, ROWS, KB, FP4, FP4, INTERPRETED)
            tl.store(y_row, y.to(tl.bfloat16))
        if tl.program_id(1) == 0:
            tl.store(row_of_slot_ptr + slot, tl.where(valid, r, -1))


def expert_rows_per_assignment(x: torch.Tensor, expert_ids: torch.Tensor, experts, swiglu_limit: float | None,
                               shared=None) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Every assignment's expert output (and the shared expert's), for moe_experts' combine (its inputs already
    validated).

    Args:
        x: [T, D] bfloat16, float16 or float32, unit stride along D.
        expert_ids: [T, top_k] int32 or int64; ids outside [0, E) are skipped.
        experts: ExpertWeights (fp8 or fp4) of hidden size D.
        swiglu_limit: V4's clamp, or None.
        shared: None, or an fp8 ExpertWeights of one expert of the same sizes, run on every token in the same
            launches (V4's shared expert: its programs beside the routed ones').

    Returns:
        (y [S + T * top_k, D] bfloat16, S = T with shared else 0: rows [0, S) the shared expert's output per
        token, row S + t * top_k + j the expert output of slot j of token t, rows of skipped slots unwritten;
        row_of_slot [T * top_k] int32: the slot's y row, -1 if skipped).
    """
    n_tokens, top_k = expert_ids.shape
    n_shared = n_tokens if shared is not None else 0
    n_rows = n_shared + n_tokens * top_k
    d, i, n_experts = experts.hidden_size, experts.intermediate_size, experts.n_experts
    fp4 = experts.format == "fp4"
    ids = flat_of(expert_ids)
    shared = shared if shared is not None else experts    # (no shared rows: never read)

    def step(k):    # k blocks a step: the largest power of two up to STEP_BLOCKS that divides them
        return max(kb for kb in (1, 2, 4, 8, 16) if kb <= STEP_BLOCKS and (k // FP8_GROUP) % kb == 0)

    h = torch.empty(n_rows, i, dtype=torch.float32, device=x.device)
    y = torch.empty(n_rows, d, dtype=torch.bfloat16, device=x.device)
    row_of_slot = torch.empty(n_tokens * top_k, dtype=torch.int32, device=x.device)
    gate_up_rows, down_rows = (FP4_GATE_UP_ROWS, FP4_DOWN_ROWS) if fp4 else (GATE_UP_ROWS, DOWN_ROWS)
    prefetch = PREFETCH_BYTES if n_tokens == 1 else 0

    def operands(a, k):   # the products' activations: (values or fp4 operands, row stride, column scales)
        if not fp4:
            return a, a.stride(0), a
        kb = step(k)
        out = torch.empty(a.shape[0], 16 * k, dtype=torch.uint8, device=a.device)
        scales = torch.empty(a.shape[0], k // (FP8_GROUP * kb) * 16, dtype=torch.float32, device=a.device)
        _fp4_operand_kernel[(a.shape[0], k // (FP8_GROUP * kb))](a, a.stride(0), out, scales, K=k, KB=kb,
                                                                 num_warps=NUM_WARPS, launch_pdl=True)
        return out, out.stride(0), scales

    _gate_up_kernel[(n_rows, i // gate_up_rows)](
        *operands(x, d), ids, experts.w13, experts.w13_scales, shared.w13, shared.w13_scales, h,
        0.0 if swiglu_limit is None else float(swiglu_limit), n_shared, E=n_experts, D=d, I=i, TOP_K=top_k,
        ROWS=gate_up_rows, KB=step(d), FP4=fp4, HAS_LIMIT=swiglu_limit is not None, HAS_SHARED=n_shared > 0,
        PREFETCH=prefetch if fp4 else 0, INTERPRETED=INTERPRET, num_warps=NUM_WARPS, launch_pdl=True)
    _down_kernel[(n_rows, d // down_rows)](
        *operands(h, i), ids, experts.w2, experts.w2_scales, shared.w2, shared.w2_scales, y, row_of_slot, n_shared,
        E=n_experts, D=d, I=i, ROWS=down_rows, KB=step(i), FP4=fp4, HAS_SHARED=n_shared > 0, PREFETCH=prefetch,
        INTERPRETED=INTERPRET, num_warps=NUM_WARPS, launch_pdl=True)
    return y, row_of_slot
