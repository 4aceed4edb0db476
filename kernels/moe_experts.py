"""The routed experts of a MoE layer: tokens permuted by expert, grouped fp8 GEMMs with SwiGLU fused
into the first, and the weighted combine back to token order.

moe_experts(x, expert_ids, weights, experts) runs, all on the device and of static shapes (no host
sync: CUDA-graph capturable):

1. plan (two small kernels): the T * top_k (token, slot) assignments grouped by expert, each expert's
   rows padded to whole tiles of BLOCK_M rows in one buffer of at most
   min(T * top_k, ceil(T * top_k / BLOCK_M) + E) tiles, each tile's expert in a table (E past the
   last tile: those programs do nothing);
2. gather: each row's token quantised to fp8 with 1 x 128 power-of-two scales (the activation rule
   of fp8_gemm.quantize_act_fp8, through the same Triton helper), padding rows zero;
3. gate/up: per tile, [BLOCK_M, D] x w13[e]^T for a gate block and its up block (w13 = cat(w1, w3)
   along the output dim), then silu(g) * u (V4's clamp optional) quantised to fp8 per 128 columns:
   the down GEMM's input is written directly, never in bf16;
4. down: per tile, h x w2[e]^T to bf16 rows;
5. combine: out[t] = sum over slots j (in slot order, fp32) of weights[t, j] * y[row of (t, j)].

Weights come in two formats (ExpertWeights): block fp8 (e4m3 with fp32 128 x 128 block scales,
V3.2 / V4-Flash-Base) multiplied on fp8 tensor cores with every 128-wide k block promoted into
fp32 (as fp8_gemm), and fp4 (e2m1 with e8m0 scales per 32 inputs, V4-Flash / Pro) decoded in
registers: by default at prefill (MoeConfig.fp4_fold) to e4m3 with each 128-input block's four
scales folded into the codes (exact while they span at most 2^11 in a weight row; output tiles
over wider blocks are decoded to bf16 by a second launch) and multiplied on fp8 tensor cores a k block at a time; else
to bf16 (exact) and multiplied with the fp8 activations converted to bf16 (exact), or
(MoeConfig.fp4_e4m3) to e4m3 multiplied 32 inputs at a time.

Two launch shapes: prefill (many tokens per expert) tiles of 64 (fp8) or 128 (fp4) tokens against
128 weight rows; decode (a few tokens per expert) the weight rows on the MMA's wide side and the tiles'
16 tokens on its narrow side (swap_ab), so each active expert's weights are read once per 16 of
its tokens and inactive experts not at all; launches of fewer programs than the GPU has SMs
(a few experts' tiles) split K, the last split of each tile adding the partials in split order.
On sm_90, the prefill shape's two products of fp8 experts run in the Gluon kernel of moe_grouped_sm90
instead: 128-row tiles against 256 weight rows (less L2 traffic a FLOP), the same products and promotion.
Results do not depend on the order in which an expert's rows are placed (each row is computed on its
own), so they are deterministic although the plan places rows with atomics.

At few assignments per expert (config None; moe_decode.uses_per_assignment), steps 1-4
give way to moe_decode: one program per (assignment, block of weight rows) streams the rows (fp8:
FMAs; fp4: fp8 tensor cores), the activations quantised by the same rule, then the combine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minirt.errors import InputError
from minirt.formats import FP8_DTYPE, FP8_GROUP

from ._common import (INTERPRET, arrival_counters, check_device, num_sms, rows_per_program, swiglu,
                      wait_for_inputs)
from ._fp4 import FOLD_PTX, FOLD_SPREAD, FP4_GROUP
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows
from .fp8_gemm import _capability
from . import moe_grouped_fp4_sm90, moe_grouped_sm90
from .moe_decode import expert_rows_per_assignment, uses_per_assignment

BLOCK_K = FP8_GROUP          # one k block = one activation scale group = one fp8 weight block column
# The same as @triton.jit code reads them (its globals must be constexprs).
_BLOCK_K = tl.constexpr(BLOCK_K)
_FP4_GROUP = tl.constexpr(FP4_GROUP)
_ACT_MIN_EXPONENT = tl.constexpr(ACT_MIN_EXPONENT)
FORMATS = ("fp8", "fp4")


@dataclass(frozen=True)
class ExpertWeights:
    """
    The routed experts of one MoE layer, stacked (E experts, hidden size D, expert width I; D and I
    multiples of 128). Validated when built; use expert_weights_fp8 / expert_weights_fp4 to stack
    per-expert checkpoint tensors.

    format "fp8" (block fp8, V3.2 / V4-Flash-Base):
        w13: [E, 2I, D] float8_e4m3fn, cat(w1, w3) along the output dim (gate rows, then up rows).
        w13_scales: [E, 2I / 128, D / 128] float32, the 128 x 128 block scales (weight_scale_inv,
            or V4's ue8m0 ``.scale`` converted to float32).
        w2: [E, D, I] float8_e4m3fn; w2_scales: [E, D / 128, I / 128] float32.
    format "fp4" (V4-Flash / Pro experts):
        w13: [E, 2I, D / 2] uint8, e2m1 codes packed two per byte, the low nibble element 2i.
        w13_scales: [E, 2I, D / 32] uint8, e8m0 exponents (scale 2^(byte - 127)) per 32 inputs;
            exact for bytes 66..192 (scales 2^-61 .. 2^65), smaller ones read as (nearly) 0, larger
            ones (and e8m0's NaN, 255) are not supported.
        w2: [E, D, I / 2] uint8; w2_scales: [E, D, I / 32] uint8.
    All four tensors contiguous and on one device.
    """

    format: str
    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor

    def __post_init__(self):
        if self.format not in FORMATS:
            raise InputError(f"ExpertWeights.format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        for name in ("w13", "w13_scales", "w2", "w2_scales"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise InputError(f"ExpertWeights.{name} must be a 3-D tensor, got "
                                 f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
            if not t.is_contiguous():
                raise InputError(f"ExpertWeights.{name} must be contiguous")
        e, d, i = self.n_experts, self.hidden_size, self.intermediate_size
        if d % BLOCK_K or i % BLOCK_K or e < 1:
            raise InputError(f"experts need D and I multiples of {BLOCK_K} and E >= 1, got E = {e}, D = {d}, "
                             f"I = {i} (w13 {tuple(self.w13.shape)}, w2 {tuple(self.w2.shape)})")
        if self.format == "fp8":
            expected = {"w13": (FP8_DTYPE, (e, 2 * i, d)), "w2": (FP8_DTYPE, (e, d, i)),
                        "w13_scales": (torch.float32, (e, 2 * i // BLOCK_K, d // BLOCK_K)),
                        "w2_scales": (torch.float32, (e, d // BLOCK_K, i // BLOCK_K))}
        else:
            expected = {"w13": (torch.uint8, (e, 2 * i, d // 2)), "w2": (torch.uint8, (e, d, i // 2)),
                        "w13_scales": (torch.uint8, (e, 2 * i, d // FP4_GROUP)),
                        "w2_scales": (torch.uint8, (e, d, i // FP4_GROUP))}
        for name, (dtype, shape) in expected.items():
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise InputError(f"ExpertWeights({self.format}).{name} must be {dtype} {list(shape)}, got "
                                 f"{t.dtype} {list(t.shape)}")
        if len({t.device for t in (self.w13, self.w13_scales, self.w2, self.w2_scales)}) != 1:
            raise InputError("ExpertWeights' tensors must be on one device")

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def to(self, device) -> "ExpertWeights":
        """The same experts with every tensor on ``device``."""
        return ExpertWeights(self.format, *(t.to(device) for t in (self.w13, self.w13_scales, self.w2, self.w2_scales)))

    @property
    def nbytes(self) -> int:
        """Bytes of the four tensors (all experts; one expert's share is nbytes / n_experts)."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w13_scales, self.w2, self.w2_scales))

    @staticmethod
    def bytes_per_expert(format: str, hidden_size: int, intermediate_size: int) -> int:
        """Bytes one expert takes in ExpertWeights of this format and shape, without building it (for
        memory checks before loading): fp8 3 D I codes + fp32 block scales; fp4 3 D I / 2 code bytes +
        one scale byte per 32 inputs."""
        d, i = hidden_size, intermediate_size
        if format == "fp8":
            return 3 * d * i + 4 * 3 * (d // BLOCK_K) * (i // BLOCK_K)
        if format == "fp4":
            return 3 * d * i // 2 + 3 * d * i // FP4_GROUP
        raise InputError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")


def _check_experts(name: str, tensors: Sequence[torch.Tensor], scales: bool) -> None:
    """Raise InputError unless tensors is a non-empty sequence of 2-D tensors of one shape, of a float
    dtype (scales) or a 1-byte one (codes), naming the first bad one."""
    if not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise InputError(f"{name}: expected a sequence of per-expert tensors, got {type(tensors).__name__}")
    for e, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != tensors[0].shape \
                or (not t.is_floating_point() if scales else t.element_size() != 1):
            raise InputError(f"{name}[{e}] must be a 2-D {'float' if scales else '1-byte'} tensor of expert 0's "
                             f"shape {tuple(getattr(tensors[0], 'shape', ()))}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _stacked(parts: Sequence[tuple[str, Sequence[torch.Tensor]]], dtype: torch.dtype, device) -> torch.Tensor:
    """Per-expert tensors [E] x [n_p, k] of each part p (name, tensors), concatenated along dim 1
    and stacked into one [E, sum n_p, k] ``dtype`` tensor on ``device``, filled expert by expert (no
    second full copy): float32 converts float scales, a 1-byte dtype reinterprets 1-byte codes."""
    scales = dtype == torch.float32
    for name, tensors in parts:
        _check_experts(name, tensors, scales)
    n_experts = len(parts[0][1])
    if any(len(tensors) != n_experts for _, tensors in parts):
        raise InputError(f"{', '.join(name for name, _ in parts)}: different numbers of experts "
                         f"({', '.join(str(len(t)) for _, t in parts)})")
    widths = [tensors[0].shape[1] for _, tensors in parts]
    if len(set(widths)) != 1:
        raise InputError(f"{', '.join(name for name, _ in parts)}: different input widths {widths}")
    out = torch.empty(n_experts, sum(t[0].shape[0] for _, t in parts), widths[0], dtype=dtype, device=device)
    for e in range(n_experts):
        row = 0
        for _, tensors in parts:
            t = tensors[e] if scales else tensors[e].view(dtype)
            out[e, row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
    return out


def expert_weights_fp8(w1, w1_scales, w3, w3_scales, w2, w2_scales, device=None) -> ExpertWeights:
    """
    ExpertWeights in block fp8 from per-expert checkpoint tensors (each a sequence of E tensors, in
    expert order, on any device): w1 / w3 [I, D] float8_e4m3fn with scales [I / 128, D / 128], w2
    [D, I] with scales [D / 128, I / 128]. Scales of any float dtype (V4's float8_e8m0fnu included)
    are converted to float32. The result is built on ``device`` (default: w1[0]'s), expert by expert.
    Raises InputError (naming the tensor and expert) on a wrong shape or dtype.
    """
    return _experts("fp8", w1, w1_scales, w3, w3_scales, w2, w2_scales, FP8_DTYPE, torch.float32, device)


def expert_weights_fp4(w1, w1_scales, w3, w3_scales, w2, w2_scales, device=None) -> ExpertWeights:
    """
    ExpertWeights in fp4 from per-expert checkpoint tensors (each a sequence of E tensors): w1 / w3
    [I, D / 2] int8 or uint8 (packed e2m1, the low nibble element 2i) with e8m0 scales [I, D / 32]
    (float8_e8m0fnu or uint8 bytes), w2 [D, I / 2] with scales [D, I / 32]. The bytes are kept as
    they are; the result is built on ``device`` (default: w1[0]'s). Raises InputError on a wrong
    shape or element size.
    """
    return _experts("fp4", w1, w1_scales, w3, w3_scales, w2, w2_scales, torch.uint8, torch.uint8, device)


def _experts(fmt, w1, w1_scales, w3, w3_scales, w2, w2_scales, dtype, scale_dtype, device) -> ExpertWeights:
    """Stack and concatenate per-expert tensors into ExpertWeights (which validates the result)."""
    _check_experts("w1", w1, False)
    device = w1[0].device if device is None else device
    return ExpertWeights(fmt, _stacked([("w1", w1), ("w3", w3)], dtype, device),
                         _stacked([("w1_scales", w1_scales), ("w3_scales", w3_scales)], scale_dtype, device),
                         _stacked([("w2", w2)], dtype, device), _stacked([("w2_scales", w2_scales)], scale_dtype, device))


@dataclass(frozen=True)
class MoeConfig:
    """Launch shape of moe_experts' grouped GEMMs. block_m: token rows per tile (every expert's rows
    padded to whole tiles); block_n: weight rows per program (128: one activation scale group of the
    SwiGLU output); swap_ab: weight rows on the MMA's M side and tokens on its N side (decode);
    split_k: at most this many programs per output tile, each over an equal share of the k blocks
    (the most that divide them), the last to finish summing the fp32 partials in split order; None
    picks it (_splits); fp4_e4m3: fp4 weights decoded to e4m3 (e2m1 x 2^-6, exact) and multiplied on
    fp8 tensor cores 32 inputs at a time, each 32-wide product scaled by its e8m0 scales in fp32
    (else: decoded to bf16 with their scales and multiplied in bf16, 64 inputs at a time); fp4_fold:
    fp4 weights decoded to e4m3 with each 128-input block's four e8m0 scales folded into the codes
    relative to the block's largest (exact while a weight row's four span at most 2^FOLD_SPREAD)
    and multiplied on fp8 tensor cores a whole k block at a time, the row's largest scale applied in
    fp32 per k block; the output tiles whose weight rows span more in any k block are computed by
    a second launch that decodes to bf16."""

    block_m: int = 64
    block_n: int = 128
    swap_ab: bool = False
    split_k: Optional[int] = None
    num_warps: int = 8
    num_stages: int = 4
    fp4_e4m3: bool = False
    fp4_fold: bool = False


# Prefill, fp8 weights: 64-row tiles over two warpgroups (each 64 x 64 of the gate and of the up
# block); 64 rows also pad each expert's rows by half as much. Registers of the gate/up kernel
# (sm_90a, ptxas of triton 3.6, D 7168): 146 at 64 rows; 128-row tiles spill (255 and 70 spill
# instructions at 3 or 4 stages). fp4 weights: the decode's instructions, not the tensor cores,
# bound the time (SASS instructions a thread per 128-input k block of the gate/up loop: about 1370
# for a 64-row tile through bf16, 850 for a 128-row one folded to e4m3), and each tile decodes the
# weights anew: 128-row tiles of folded weights (fp4_fold; 232 registers, no spills, D 4096).
PREFILL_CONFIG = MoeConfig()
PREFILL_CONFIG_FP4 = MoeConfig(block_m=128, num_stages=3, fp4_fold=True)
DECODE_CONFIG = MoeConfig(block_m=16, swap_ab=True, num_warps=4, num_stages=4)
# Split-K (automatic) aims at this many programs per SM, each keeping >= SPLIT_MIN_K_BLOCKS k blocks.
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_MIN_K_BLOCKS = 4
# Assignments per expert (on average) up to which the decode shape runs: a 16-token tile then holds
# most of an expert's tokens, and 64-row tiles would be mostly padding.
DECODE_MAX_PER_EXPERT = 16


def default_config(n_assignments: int, n_experts: int, format: str = "fp8") -> MoeConfig:
    """DECODE_CONFIG while T * top_k <= DECODE_MAX_PER_EXPERT * E, above PREFILL_CONFIG for fp8
    experts and PREFILL_CONFIG_FP4 for fp4 ones (ExpertWeights.format)."""
    if n_assignments <= DECODE_MAX_PER_EXPERT * n_experts:
        return DECODE_CONFIG
    return PREFILL_CONFIG_FP4 if format == "fp4" else PREFILL_CONFIG


def max_tiles(n_assignments: int, n_experts: int, block_m: int) -> int:
    """Tiles the plan may need: each active expert's rows round up to whole tiles, and no more tiles
    than assignments."""
    return min(n_assignments, triton.cdiv(n_assignments, block_m) + n_experts)


@triton.jit
def _rank_kernel(ids_ptr, counts_ptr, rank_ptr, n_slots, E: tl.constexpr, BLOCK: tl.constexpr):
    # Each valid slot takes the next row of its expert (atomics: the order of an expert's rows varies
    # from run to run, its rows' values do not: every row is computed on its own).
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    experts = tl.load(ids_ptr + slots, mask=slots < n_slots, other=-1)
    valid = (experts >= 0) & (experts < E)
    rank = tl.atomic_add(counts_ptr + tl.where(valid, experts, 0), 1, mask=valid)
    tl.store(rank_ptr + slots, rank, mask=valid)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, rank_ptr, row_of_slot_ptr, row_token_ptr, tile_expert_ptr, n_slots,
                  n_tiles, E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK: tl.constexpr):
    # Every program derives the tile layout from the counts (E values): expert e's tiles are
    # [tile_end[e] - tiles[e], tile_end[e]). It places BLOCK slots and names the expert of BLOCK tiles.
    experts_all = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts_all, mask=experts_all < E, other=0)
    tile_end = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, 0)
    first_row = (tile_end - (counts + BLOCK_M - 1) // BLOCK_M) * BLOCK_M

    start = tl.program_id(0) * BLOCK
    slots = start + tl.arange(0, BLOCK)
    experts = tl.load(ids_ptr + slots, mask=slots < n_slots, other=-1)
    valid = (experts >= 0) & (experts < E)
    rank = tl.load(rank_ptr + slots, mask=valid, other=0)
    # first_row[expert] as a masked sum (a gather from a register tensor).
    expert_row = tl.sum(tl.where(experts_all[None, :] == experts[:, None], first_row[None, :], 0), 1)
    rows = tl.where(valid, expert_row + rank, -1)
    tl.store(row_of_slot_ptr + slots, rows, mask=slots < n_slots)
    tl.store(row_token_ptr + rows, slots // TOP_K, mask=valid)

    tiles = start + tl.arange(0, BLOCK)
    # The expert of tile j: the number of experts whose tiles end at or before j (E past the last).
    tile_expert = tl.sum((tile_end[None, :] <= tiles[:, None]) & (experts_all[None, :] < E), 1)
    tl.store(tile_expert_ptr + tiles, tile_expert.to(tl.int32), mask=tiles < n_tiles)


_PLAN_BLOCK = 128


def _plan(expert_ids: torch.Tensor, n_experts: int, block_m: int):
    """(row_token [tiles * block_m] int32: each row's token, -1 for padding; tile_expert [tiles] int32,
    E past the used tiles; row_of_slot [T * top_k] int32: each assignment's row, -1 for skipped
    slots), tiles = max_tiles(...). Four launches of static shapes, no host sync."""
    n_tokens, top_k = expert_ids.shape
    n_slots = n_tokens * top_k
    device = expert_ids.device
    tiles = max_tiles(n_slots, n_experts, block_m)
    ids = expert_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    counts = torch.zeros(n_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n_slots, dtype=torch.int32, device=device)
    row_of_slot = torch.empty(n_slots, dtype=torch.int32, device=device)
    row_token = torch.full((tiles * block_m,), -1, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    _rank_kernel[(triton.cdiv(n_slots, _PLAN_BLOCK),)](ids, counts, rank, n_slots, E=n_experts, BLOCK=_PLAN_BLOCK)
    _place_kernel[(triton.cdiv(max(n_slots, tiles), _PLAN_BLOCK),)](
        ids, counts, rank, row_of_slot, row_token, tile_expert, n_slots, tiles, E=n_experts,
        E_PAD=triton.next_power_of_2(n_experts), TOP_K=top_k, BLOCK_M=block_m, BLOCK=_PLAN_BLOCK)
    return row_token, tile_expert, row_of_slot


@triton.jit
def _split_columns(cols, SPLIT: tl.constexpr):
    """Where column c of a 128-wide k block is stored: in place, or (SPLIT, the fp4 experts' inputs)
    its even columns first, then its odd ones: the two nibbles of a packed weight byte then meet
    two separate 64-wide halves of the activations, and no nibble has to move."""
    if SPLIT:
        within = cols % _BLOCK_K
        return cols - within + (within % 2) * (_BLOCK_K // 2) + within // 2
    else:
        return cols


@triton.jit
def _gather_quantize_kernel(x_ptr, row_token_ptr, q_ptr, scale_ptr, n_rows, stride_xt,
                            D: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr):
    # Program (row block, group block): each of ROWS rows' token's GROUPS x 128 columns (one group per
    # tile row), quantised; padding rows zero.
    tile = tl.arange(0, ROWS * GROUPS)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tile // GROUPS
    groups = tl.program_id(1) * GROUPS + tile % GROUPS
    mask = (rows < n_rows) & (groups < D // _BLOCK_K)
    token = tl.load(row_token_ptr + rows, mask=mask, other=-1).to(tl.int64)
    cols = groups[:, None] * _BLOCK_K + tl.arange(0, _BLOCK_K)[None, :]
    x = tl.load(x_ptr + token[:, None] * stride_xt + cols, mask=(mask & (token >= 0))[:, None], other=0.0)
    codes, scale = pow2_quantize_rows(x.to(tl.float32), _ACT_MIN_EXPONENT)
    tl.store(q_ptr + rows[:, None] * D + _split_columns(cols, SPLIT), codes.to(tl.uint8), mask=mask[:, None])
    tl.store(scale_ptr + rows * (D // _BLOCK_K) + groups, scale, mask=mask)


@triton.jit
def _e2m1_scaled(codes, factors):
    """e2m1 codes (int32 0..15: sign bit 8, magnitude = exponent e (2 bits), mantissa bit b) x factors.

    The code's fields are placed in a float32 (sign; exponent field e; b the top mantissa bit): for
    e > 0 that reads 2^(e-127) (1 + b/2), for e = 0 the subnormal b 2^-127, both the e2m1 value times
    2^-126. The kernels' fp32 multiplies keep subnormals (mul.f32, no .ftz), so one multiply by
    factors = 2^126 x the scale (or a power of two less) makes the value exact."""
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * factors


@triton.jit
def _e2m1_as_e4m3(packed):
    """Packed e2m1 bytes [R, C] (low nibble element 2i) -> [R, 2C] e4m3 of 2^-6 times their values,
    in input order. The code's magnitude bits (exponent e, mantissa b) become the e4m3 exponent's
    low bits and its top mantissa bit: 2^(e-7) (1 + b/2) for e > 0, the subnormal b 2^-7 for e = 0,
    both the e2m1 value times 2^-6 (exact)."""
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (packed.shape[0], 2 * packed.shape[1]))
    return (((codes & 7) << 2) | ((codes & 8) << 4)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


_FOLD_SPREAD = tl.constexpr(FOLD_SPREAD)
_FOLD_PTX = tl.constexpr(FOLD_PTX)


@triton.jit
def _e2m1_code_folded(codes, offsets):
    """e2m1 codes (int32 0..15) -> the e4m3 codes (int32) of their values x 2^-5 with offsets (int32,
    multiples of 8 up to 88) added to the exponent field of the nonzero ones: 2^(offset / 8 - 5) x
    the value. Magnitude m = 2e + b: value 2^-6 (0x08) for m = 1, else exponent field e + 1, top
    mantissa bit b ((m << 2) + 8)."""
    magnitude = codes & 7
    code = tl.where(magnitude >= 2, (magnitude << 2) + 8, magnitude << 3)
    return (code + tl.where(magnitude > 0, offsets, 0)) | ((codes & 8) << 4)


@triton.jit
def _e2m1_folded(packed, offsets, INTERPRETED: tl.constexpr):
    """Packed e2m1 bytes (uint8 [R, C], low nibble element 2i) and exponent offsets (uint8 [R, C],
    8 (s - top + FOLD_SPREAD) of each byte's 32-input group) -> (low nibbles, high nibbles) as e4m3
    of their values x 2^(s - top + 6) ([R, C] each; float32 of the same values interpreted). On the
    GPU one inline-PTX block per 4 bytes (_FOLD_PTX: a few instructions per value, where Triton's
    elementwise form needs about ten); interpreted, the same codes from _e2m1_code_folded."""
    if INTERPRETED:
        codes = packed.to(tl.int32)
        low = _e2m1_code_folded(codes & 0xF, offsets.to(tl.int32))
        high = _e2m1_code_folded(codes >> 4, offsets.to(tl.int32))
        return (low.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
                high.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32))
    else:
        low, high = tl.inline_asm_elementwise(_FOLD_PTX, "=r,=r,r,r", [packed, offsets],
                                              dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        return low.to(tl.float8e4nv, bitcast=True), high.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp4_foldable(b_scale_ptr, row, K: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Whether every weight row [row, row + BLOCK_N)'s four e8m0 scales of each k block span at most
    2^FOLD_SPREAD (fp4_fold is exact there); CHUNK k blocks' scales a load (CHUNK divides K / 128)."""
    groups: tl.constexpr = _BLOCK_K // _FP4_GROUP
    scale_rows = b_scale_ptr + (row + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * (K // _FP4_GROUP) \
        + tl.arange(0, CHUNK * groups)[None, :]
    spread = tl.zeros((BLOCK_N, CHUNK), dtype=tl.int32)
    for c in range(0, K // _BLOCK_K // CHUNK):
        s = tl.reshape(tl.load(scale_rows + c * (CHUNK * groups)).to(tl.int32), (BLOCK_N, CHUNK, groups))
        spread = tl.maximum(spread, tl.max(s, 2) - tl.min(s, 2))
    return tl.max(tl.max(spread, 1), 0) <= _FOLD_SPREAD


# The fp4 weights are decoded to 2^-FP4_SHIFT times their value (then multiplied back after each k
# block's product): with scale bytes s (2^(s - 127)) that keeps the bf16 copies normal for s in
# [66, 192] (scales 2^-61 .. 2^65; checkpoints have ~2^-8), where the factor 2^(s - 127 + 126 - 64)
# is a float32 built from its exponent field s + 62.
_FP4_SHIFT = tl.constexpr(64)
_FP4_UNSHIFT = tl.constexpr(2.0 ** 64)


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr):
    """acc + a . w^T ([BLOCK_M, BLOCK_N]), or acc + w . a^T when SWAP_AB."""
    if SWAP_AB:
        return tl.dot(w, tl.trans(a), acc)
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _k_block(acc, a_desc, a_row, a_scale, b_desc, b_scale_ptr, row, kb, FP4: tl.constexpr, FP4_E4M3: tl.constexpr,
             FOLD: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc plus k block kb of a rows [a_row, + BLOCK_M) times weight rows [row, row + BLOCK_N) of a stacked
    weight (experts' rows one after another), with its scales (promotion: one fp32 product per k
    block). fp8: the 128 x 128 block scale ([E * N / 128, K / 128], one per tile); fp4 ([E * N, K / 2]
    bytes, scales [E * N, K / 32]): the low nibbles (even inputs) against the activations' first
    64 columns, the high ones against the last 64 (_split_columns), both decoded and scaled to bf16
    and multiplied with the fp8 activations converted to bf16 (all exact); FP4_E4M3: each 32-input
    group decoded to e4m3 (_e2m1_as_e4m3) against the activations' 32 columns in input order, on fp8
    tensor cores, its product times 2^6 x its e8m0 scale per weight row; FOLD (fp4, split columns as
    the bf16 path): both nibble halves decoded to e4m3 with their scales folded in (_e2m1_folded)
    and multiplied on fp8 tensor cores, the product times 2^(top - 133) per weight row (top its
    largest scale byte of the block)."""
    zeros = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    op_dtype: tl.constexpr = tl.float32 if INTERPRETED else tl.bfloat16
    if FP4_E4M3:
        scale_rows = b_scale_ptr + (row + tl.arange(0, BLOCK_N)).to(tl.int64) * (K // _FP4_GROUP)
        for g in tl.static_range(_BLOCK_K // _FP4_GROUP):
            k = kb * _BLOCK_K + g * _FP4_GROUP
            a = a_desc.load([a_row, k])
            w = _e2m1_as_e4m3(b_desc.load([row, k // 2]))
            if INTERPRETED:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            # 2^6 x 2^(s - 127) as a float32 from its exponent field s + 6 (exact for s <= 248).
            factors = ((tl.load(scale_rows + k // _FP4_GROUP).to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)
            # Each group scaled straight into acc (a per-k-block product would be one more live tile).
            group = _mma(a, w, zeros, SWAP_AB)
            if SWAP_AB:
                acc += group * factors[:, None] * a_scale[None, :]
            else:
                acc += group * factors[None, :] * a_scale[:, None]
    else:
        if FP4:
            half: tl.constexpr = _BLOCK_K // 2
            groups: tl.constexpr = _BLOCK_K // _FP4_GROUP
            a_even = a_desc.load([a_row, kb * _BLOCK_K])
            a_odd = a_desc.load([a_row, kb * _BLOCK_K + half])
            packed = b_desc.load([row, kb * half])
            rows = row + tl.arange(0, BLOCK_N)
            scale_bytes = tl.load(b_scale_ptr + rows.to(tl.int64)[:, None] * (K // _FP4_GROUP)
                                  + kb * groups + tl.arange(0, groups)[None, :]).to(tl.int32)
            if FOLD:
                top = tl.max(scale_bytes, 1)
                factors = ((scale_bytes - top[:, None] + _FOLD_SPREAD) << 3).to(tl.uint8)
            else:
                packed = packed.to(tl.int32)
                factors = ((scale_bytes + (126 - _FP4_SHIFT)) << 23).to(tl.float32, bitcast=True)
                a_even = a_even.to(op_dtype)
                a_odd = a_odd.to(op_dtype)
            # Input 2i and 2i + 1 share the scale of group 2i // 32 = i // 16.
            factors = tl.reshape(tl.broadcast_to(factors[:, :, None], (BLOCK_N, groups, _FP4_GROUP // 2)),
                                 (BLOCK_N, half))
            if FOLD:
                w_even, w_odd = _e2m1_folded(packed, factors, INTERPRETED)
                if INTERPRETED:
                    a_even = a_even.to(tl.float32)
                    a_odd = a_odd.to(tl.float32)
            else:
                w_even = _e2m1_scaled(packed & 0xF, factors).to(op_dtype)
                w_odd = _e2m1_scaled(packed >> 4, factors).to(op_dtype)
            product = _mma(a_odd, w_odd, _mma(a_even, w_even, zeros, SWAP_AB), SWAP_AB)
            if FOLD:
                # 2^(top - 133) (the e4m3 values are 2^(s - top + 6) times the e2m1 ones), per weight row.
                row_scale = ((top - 6) << 23).to(tl.float32, bitcast=True)
                if SWAP_AB:
                    product = product * row_scale[:, None]
                else:
                    product = product * row_scale[None, :]
                scale = a_scale
            else:
                scale = a_scale * _FP4_UNSHIFT
        else:
            a = a_desc.load([a_row, kb * _BLOCK_K])
            w = b_desc.load([row, kb * _BLOCK_K])
            if INTERPRETED:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            product = _mma(a, w, zeros, SWAP_AB)
            scale = a_scale * tl.load(b_scale_ptr + (row // _BLOCK_K).to(tl.int64) * (K // _BLOCK_K) + kb)
        if SWAP_AB:
            acc += product * scale[None, :]
        else:
            acc += product * scale[:, None]
    return acc


@triton.jit
def _store_tile(acc, acc_up, out_ptr, out_scale_ptr, offs_m, col, limit, N_OUT: tl.constexpr,
                BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT_COLS: tl.constexpr, SWIGLU: tl.constexpr,
                HAS_LIMIT: tl.constexpr):
    """The epilogue of one output tile: bf16 rows, or (SWIGLU) silu(g) * u as fp8 codes with one scale
    per row (BLOCK_N = 128), its columns split (SPLIT_COLS) as the down product's bf16-decoded fp4
    weight wants them."""
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    offs_n = col + tl.arange(0, BLOCK_N)
    out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * N_OUT
    if SWIGLU:
        h = swiglu(acc, acc_up, limit, HAS_LIMIT)
        codes, scale = pow2_quantize_rows(h, _ACT_MIN_EXPONENT)
        tl.store(out_rows + _split_columns(offs_n, SPLIT_COLS)[None, :], codes.to(tl.uint8))
        tl.store(out_scale_ptr + offs_m.to(tl.int64) * (N_OUT // _BLOCK_K) + col // _BLOCK_K, scale)
    else:
        tl.store(out_rows + offs_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _k_blocks(a_desc, a_row, a_scale_rows, b_desc, b_scale_ptr, gate_row, first_kb, n_kb: tl.constexpr, FP4: tl.constexpr,
              FP4_E4M3: tl.constexpr, FOLD: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, SWIGLU: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """(acc, acc_up): k blocks [first_kb, first_kb + n_kb) of a tile's products with weight rows
    [gate_row, + BLOCK_N) and (SWIGLU) the up rows N_OUT further (_k_block), float32."""
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, n_kb):
        kb = first_kb + i
        a_scale = tl.load(a_scale_rows + kb)
        acc = _k_block(acc, a_desc, a_row, a_scale, b_desc, b_scale_ptr, gate_row, kb, FP4, FP4_E4M3, FOLD,
                       K, BLOCK_M, BLOCK_N, SWAP_AB, INTERPRETED)
        if SWIGLU:
            acc_up = _k_block(acc_up, a_desc, a_row, a_scale, b_desc, b_scale_ptr, gate_row + N_OUT, kb,
                              FP4, FP4_E4M3, FOLD, K, BLOCK_M, BLOCK_N, SWAP_AB, INTERPRETED)
    return acc, acc_up


@triton.jit
def _grouped_gemm_kernel(
    a_desc, a_scale_ptr, b_desc, b_scale_ptr, tile_expert_ptr, out_ptr, out_scale_ptr, partial_ptr,
    arrivals_ptr, unfolded_ptr, limit,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SWAP_AB: tl.constexpr,
    FP4: tl.constexpr, FP4_E4M3: tl.constexpr, FOLD_PASS: tl.constexpr, FOLD_CHUNK: tl.constexpr,
    SPLIT_COLS: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Program (tile, column block, split), tile-major: the column blocks of one tile (one expert's
    # weight) run side by side. a: [tiles * BLOCK_M, K] fp8 rows with [., K / 128] scales; the weight
    # has N rows an expert. SWIGLU (N = 2 N_OUT, gate rows then up rows): gate rows [c, c + BLOCK_N)
    # and the matching up rows; otherwise rows [c, c + BLOCK_N) (N = N_OUT). Split s of SPLITS takes
    # k blocks [s, s + 1) x K / 128 / SPLITS. FOLD_PASS (fp4_fold) 1: the tiles whose weight rows
    # fold over all of K (_fp4_foldable; every split decides alike), the others marked in
    # unfolded_ptr [tiles x column blocks] and skipped; 2: the marked ones alone, decoded to bf16
    # (a launch of its own: the bf16 loop's registers would make the folded one spill).
    pid = tl.program_id(0)
    split = pid % SPLITS
    tile_col = pid // SPLITS
    tile = tile_col // (N_OUT // BLOCK_N)
    col = (tile_col % (N_OUT // BLOCK_N)) * BLOCK_N
    expert = tl.load(tile_expert_ptr + tile)
    gate_row = expert * N + col
    run = expert < E
    if FOLD_PASS == 1:
        foldable = expert < 0
        if run:
            foldable = _fp4_foldable(b_scale_ptr, gate_row, K, BLOCK_N, FOLD_CHUNK)
            if SWIGLU:
                foldable = foldable & _fp4_foldable(b_scale_ptr, gate_row + N_OUT, K, BLOCK_N, FOLD_CHUNK)
            tl.store(unfolded_ptr + tile_col, 1, mask=foldable == 0)
        run = foldable
    elif FOLD_PASS == 2:
        if run:
            run = tl.load(unfolded_ptr + tile_col) != 0
    if run:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * (K // _BLOCK_K)
        per_split: tl.constexpr = K // _BLOCK_K // SPLITS
        acc, acc_up = _k_blocks(a_desc, tile * BLOCK_M, a_scale_rows, b_desc, b_scale_ptr, gate_row,
                                split * per_split, per_split, FP4, FP4_E4M3, FOLD_PASS == 1, K, N_OUT, BLOCK_M,
                                BLOCK_N, SWAP_AB, SWIGLU, INTERPRETED)
        if SPLITS == 1:
            _store_tile(acc, acc_up, out_ptr, out_scale_ptr, offs_m, col, limit, N_OUT, BLOCK_N, SWAP_AB,
                        SPLIT_COLS, SWIGLU, HAS_LIMIT)
        else:
            # partial_ptr: [tiles x column blocks, SPLITS, 2 (gate / up, or the product alone), tile] float32. Every split stores its
            # partial sums and counts itself in; the last of its tile adds them in split order (the
            # same sums whichever finishes last), runs the epilogue and resets the counter.
            tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
            rows = tl.arange(0, BLOCK_N if SWAP_AB else BLOCK_M)
            cols = tl.arange(0, BLOCK_M if SWAP_AB else BLOCK_N)
            offsets = rows[:, None] * (BLOCK_M if SWAP_AB else BLOCK_N) + cols[None, :]
            partials = partial_ptr + tile_col.to(tl.int64) * (SPLITS * 2 * tile_elems) + offsets
            tl.store(partials + split * 2 * tile_elems, acc)
            if SWIGLU:
                tl.store(partials + (split * 2 + 1) * tile_elems, acc_up)
            # All threads' stores precede the (acq_rel, gpu scope) count, one atomic per program.
            tl.debug_barrier()
            if tl.atomic_add(arrivals_ptr + tile_col, 1) == SPLITS - 1:
                acc = tl.zeros_like(acc)
                acc_up = tl.zeros_like(acc_up)
                for s in range(0, SPLITS):
                    # .cg: from L2, where the other programs' partials are, never a stale L1 line.
                    acc += tl.load(partials + s * 2 * tile_elems, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(partials + (s * 2 + 1) * tile_elems, cache_modifier=".cg")
                tl.store(arrivals_ptr + tile_col, 0)
                _store_tile(acc, acc_up, out_ptr, out_scale_ptr, offs_m, col, limit, N_OUT, BLOCK_N, SWAP_AB,
                            SPLIT_COLS, SWIGLU, HAS_LIMIT)


@triton.jit
def _combine_kernel(y_ptr, row_of_slot_ptr, weights_ptr, shared_ptr, out_ptr, n_tokens, stride_ot,
                    D: tl.constexpr, TOP_K: tl.constexpr, TOKENS: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_SHARED: tl.constexpr):
    # Program (token block, column block): per token the weighted sum of its slots' expert rows, in slot
    # order, then its shared expert row (weight 1).
    wait_for_inputs()
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (tokens < n_tokens)[:, None] & (cols < D)[None, :]
    acc = tl.zeros((TOKENS, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_slot_ptr + tokens * TOP_K + j, mask=tokens < n_tokens, other=-1).to(tl.int64)
        weight = tl.load(weights_ptr + tokens * TOP_K + j, mask=tokens < n_tokens, other=0.0)
        y = tl.load(y_ptr + row[:, None] * D + cols[None, :], mask=mask & (row >= 0)[:, None], other=0.0)
        acc += tl.where(row >= 0, weight, 0.0)[:, None] * y.to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tokens[:, None] * D + cols[None, :], mask=mask).to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


_GATHER_GROUPS = 8       # 128-column groups per gather program
_FOLD_CHUNK_BLOCKS = 8   # at most this many k blocks' fp4 scales a load in the fold check
_COMBINE_BLOCK = 1024    # output columns per combine program


def _gather_quantize(x: torch.Tensor, row_token: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of x named by row_token (-1: a zero row), quantised: ([rows, D] fp8, [rows, D / 128]),
    the columns of each 128 block even then odd when split (fp4 experts)."""
    rows, d = row_token.numel(), x.shape[1]
    x_fp8 = torch.empty(rows, d, dtype=FP8_DTYPE, device=x.device)
    x_scales = torch.empty(rows, d // BLOCK_K, dtype=torch.float32, device=x.device)
    per_program = rows_per_program(rows, _GATHER_GROUPS * BLOCK_K)
    _gather_quantize_kernel[(triton.cdiv(rows, per_program), triton.cdiv(d // BLOCK_K, _GATHER_GROUPS))](
        x, row_token, x_fp8.view(torch.uint8), x_scales, rows, x.stride(0),
        D=d, ROWS=per_program, GROUPS=_GATHER_GROUPS, SPLIT=split)
    return x_fp8, x_scales


def _splits(programs: int, n_k_blocks: int, device: torch.device, split_k: Optional[int]) -> int:
    """Splits of the k blocks: the most that divide them evenly up to split_k, or (None) up to
    SPLIT_PROGRAMS_PER_SM programs per SM keeping >= SPLIT_MIN_K_BLOCKS k blocks each (decode
    launches of a few experts' tiles; prefill has enough programs and never splits)."""
    if split_k is None:
        split_k = min(triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms(device, 4), programs),
                      n_k_blocks // SPLIT_MIN_K_BLOCKS)
    return max(s for s in range(1, max(1, split_k) + 1) if n_k_blocks % s == 0)


def _folded_fp4_sm90(a, a_scales, weight, scales, tile_expert, out, out_scales, *, swiglu: bool,
                     limit: Optional[float], n_experts: int, config: MoeConfig) -> None:
    """fp4_fold's grouped GEMM on sm_90 (_grouped_gemm's contract, fp4 weights): the folded products in the
    Gluon kernel (moe_grouped_fp4_sm90), then the Triton kernel's bf16 pass over only the 128-column blocks it
    marked (rows whose scales span more than 2^FOLD_SPREAD)."""
    n_out = weight.shape[1] // 2 if swiglu else weight.shape[1]
    marks = torch.zeros(tile_expert.numel() * n_out // BLOCK_K, dtype=torch.int32, device=a.device)
    moe_grouped_fp4_sm90.grouped_fp4(a, a_scales, weight, scales, tile_expert, out, out_scales, marks, swiglu=swiglu,
                                     limit=limit)
    _grouped_gemm(a, a_scales, weight, scales, tile_expert, out, out_scales, fp4=True, swiglu=swiglu, limit=limit,
                  n_experts=n_experts, config=config, unfolded=marks)


def _grouped_gemm(a, a_scales, weight, scales, tile_expert, out, out_scales, *, fp4: bool, swiglu: bool,
                  limit: Optional[float], n_experts: int, config: MoeConfig, unfolded=None) -> None:
    """One grouped GEMM launch over every tile (see _grouped_gemm_kernel); weight [E, N, K(/2)]. unfolded
    (fp4_fold): the marks of a first pass already run (moe_grouped_fp4_sm90): only the marked blocks' bf16
    pass runs."""
    n, k_stored = weight.shape[1], weight.shape[2]
    k = 2 * k_stored if fp4 else k_stored
    n_out = n // 2 if swiglu else n
    stacked = weight.view(n_experts * n, k_stored)
    # fp4: packed bytes, and the activations' k blocks loaded in halves (_split_columns), or
    # (fp4_e4m3) 32 inputs at a time.
    e4m3 = fp4 and config.fp4_e4m3
    a_block_k = FP4_GROUP if e4m3 else BLOCK_K // 2 if fp4 else BLOCK_K
    b_block_k = FP4_GROUP // 2 if e4m3 else a_block_k
    tile_cols = tile_expert.numel() * (n_out // config.block_n)
    splits = _splits(tile_cols, k // BLOCK_K, a.device, config.split_k)
    partials = arrivals = out      # unread placeholders without split-K
    if splits > 1:
        partials = torch.empty(tile_cols, splits, 2, config.block_m * config.block_n, dtype=torch.float32,
                               device=a.device)
        arrivals = arrival_counters(a.device, tile_cols)
    fold = fp4 and config.fp4_fold
    passes = (1, 2) if fold and unfolded is None else (2,) if fold else (0,)
    if fold and unfolded is None:
        unfolded = torch.zeros(tile_cols, dtype=torch.int32, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, a_block_k])
    b_desc = TensorDescriptor.from_tensor(stacked, [config.block_n, b_block_k])
    for fold_pass in passes:
        _grouped_gemm_kernel[(tile_cols * splits,)](
            a_desc, a_scales, b_desc, scales, tile_expert, out, out if out_scales is None else out_scales, partials,
            arrivals, out if unfolded is None else unfolded, 0.0 if limit is None else float(limit),
            E=n_experts, N=n, K=k, N_OUT=n_out, BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLITS=splits,
            SWAP_AB=config.swap_ab, FP4=fp4, FP4_E4M3=e4m3, FOLD_PASS=fold_pass,
            FOLD_CHUNK=math.gcd(k // BLOCK_K, _FOLD_CHUNK_BLOCKS), SPLIT_COLS=fp4 and not e4m3,
            SWIGLU=swiglu, HAS_LIMIT=limit is not None, INTERPRETED=INTERPRET,
            num_warps=config.num_warps, num_stages=config.num_stages)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, *,
                swiglu_limit: Optional[float] = None, config: Optional[MoeConfig] = None,
                shared: Optional[ExpertWeights] = None) -> torch.Tensor:
    """
    The routed experts' weighted sum of a MoE layer, and its shared expert if given:

        out[t] = sum_j weights[t, j] * W2[e] . swiglu(W1[e] . x[t], W3[e] . x[t]),  e = expert_ids[t, j]
                 + shared's W2 . swiglu(W1 . x[t], W3 . x[t])

    swiglu(g, u) = silu(g) * u, or with swiglu_limit L (DeepSeek-V4) silu(min(g, L)) * clamp(u, -L, L).
    x is quantised to fp8 per token and 128 columns (fp8_gemm.quantize_act_fp8's rule, bit for bit)
    and so is the SwiGLU output before W2 (DeepSeek's act_quant on the expert's intermediate); each
    128-wide k block of a product is accumulated in fp32 with its scales applied (promotion). fp4
    weights are decoded exactly: with config.fp4_fold (the prefill default) to e4m3 holding the
    e2m1 value x 2^(s - top + 6) (s its e8m0 byte, top the largest of its row's four in the k
    block, at most 11 above s, else that output tile is decoded to bf16), the row's 2^(top - 133) applied
    per k block; otherwise to bf16 (e2m1 value x 2^(e8m0 - 127), held as 2^-64 times that and
    multiplied back per k block), or with config.fp4_e4m3 to e4m3 (2^-6 times the e2m1 value)
    with each 32-input product scaled in fp32. Expert outputs are rounded to bf16 per expert, then summed over
    the slots in slot order in fp32. Deterministic: the same inputs give the same bits.

    Sync-free and of static shapes (CUDA-graph capturable): the permutation by expert runs on the
    device with buffers sized for the worst case (max_tiles), the programs of unused tiles exit.
    A slot whose expert id is outside [0, E) (route_hash's -1) is skipped: it adds nothing and is
    never dereferenced. A token with no valid slot gets 0.

    Args:
        x: [T, D] bfloat16 (float16, float32 accepted), the layer's normed input; unit stride along D.
        expert_ids: [T, top_k] int32 or int64, from route_topk / route_hash.
        weights: [T, top_k] float32, the combine weights (any values; scaling already applied).
        experts: ExpertWeights (fp8 or fp4) with hidden size D.
        swiglu_limit: keyword-only, V4's clamp L (10.0), or None.
        config: keyword-only launch shape of the grouped GEMMs; None: moe_decode's per-assignment
            products while T * top_k <= E / 4 (fp8) or 1.5 E (fp4), or is 1 (moe_decode.uses_per_assignment),
            else default_config (DECODE_CONFIG for at most 16 assignments per expert on average, else PREFILL_CONFIG,
            or PREFILL_CONFIG_FP4 for fp4 experts). PREFILL_CONFIG's products of fp8 experts run in the
            Gluon kernel of moe_grouped_sm90 on sm_90 GPUs (128-row tiles, the same products and promotion).
        shared: keyword-only, None or an fp8 ExpertWeights of one expert with the same hidden and intermediate
            sizes (DeepSeek-V4's shared expert). At T 1 on the per-assignment path its programs run in the
            routed experts' launches (fp4 experts: its e4m3 weights on the same tensor-core products), else
            in its own grouped GEMMs (which read it once, where per-assignment products would read it T times).

    Returns:
        [T, D] bfloat16, every element written. T = 0 gives an empty tensor.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, a bad config, tensors on different devices
            or on one the kernels cannot use (CPU without TRITON_INTERPRET=1; GPUs before sm_90).
    """
    if not isinstance(experts, ExpertWeights):
        raise InputError(f"experts must be an ExpertWeights, got {type(experts).__name__}")
    d, i, n_experts = experts.hidden_size, experts.intermediate_size, experts.n_experts
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
            or x.dim() != 2 or x.shape[1] != d:
        raise InputError(f"x must be a bfloat16, float16 or float32 tensor [T, {d}], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    n_tokens = x.shape[0]
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dtype not in (torch.int32, torch.int64) \
            or expert_ids.dim() != 2 or expert_ids.shape[0] != n_tokens or expert_ids.shape[1] < 1:
        raise InputError(f"expert_ids must be an int32 or int64 tensor [{n_tokens}, top_k], got "
                         f"{getattr(expert_ids, 'dtype', type(expert_ids).__name__)} "
                         f"{tuple(getattr(expert_ids, 'shape', ()))}")
    top_k = expert_ids.shape[1]
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or tuple(weights.shape) != (n_tokens, top_k):
        raise InputError(f"weights must be a float32 tensor [{n_tokens}, {top_k}], got "
                         f"{getattr(weights, 'dtype', type(weights).__name__)} {tuple(getattr(weights, 'shape', ()))}")
    if shared is not None and not (isinstance(shared, ExpertWeights) and shared.format == "fp8"
                                   and shared.n_experts == 1 and shared.hidden_size == d
                                   and shared.intermediate_size == i):
        got = (f"{shared.format}, {shared.n_experts} experts, hidden size {shared.hidden_size}, intermediate size "
               f"{shared.intermediate_size}" if isinstance(shared, ExpertWeights) else type(shared).__name__)
        raise InputError(f"shared must be None or an fp8 ExpertWeights of 1 expert, hidden size {d} and "
                         f"intermediate size {i}, got {got}")
    per_assignment = config is None and uses_per_assignment(n_tokens * top_k, n_experts, experts.format)
    if config is None:
        config = default_config(n_tokens * top_k, n_experts, experts.format)
    elif not isinstance(config, MoeConfig) or config.block_n != BLOCK_K or config.block_m not in (16, 32, 64, 128) \
            or (config.fp4_e4m3 and config.fp4_fold):
        raise InputError(f"config must be a MoeConfig with block_n {BLOCK_K}, block_m 16, 32, 64 or 128 and at most "
                         f"one of fp4_e4m3 and fp4_fold, got {config!r}")
    check_device({"x": x, "expert_ids": expert_ids, "weights": weights, "experts.w13": experts.w13,
                  **({"shared.w13": shared.w13} if shared is not None else {})})
    if x.device.type == "cuda" and _capability(x.device) < (9, 0):
        raise InputError("moe_experts needs an sm_90 (Hopper) or newer GPU: fp8 tensor cores and TMA")
    out = torch.empty(n_tokens, d, dtype=torch.bfloat16, device=x.device)
    if n_tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if per_assignment and shared is not None and uses_per_assignment(n_tokens, 1, shared.format):
        # One token: the shared expert's programs join the routed ones' launches.
        y, row_of_slot = expert_rows_per_assignment(x, expert_ids, experts, swiglu_limit, shared)
        return _combine(y, row_of_slot, weights, out, y[:n_tokens])
    if shared is not None:   # more tokens: its own grouped GEMMs read it once (per assignment: once a token)
        shared = moe_experts(x, torch.zeros(n_tokens, 1, dtype=torch.int32, device=x.device),
                             torch.ones(n_tokens, 1, device=x.device), shared, swiglu_limit=swiglu_limit)
    if per_assignment:
        y, row_of_slot = expert_rows_per_assignment(x, expert_ids, experts, swiglu_limit)
        return _combine(y, row_of_slot, weights, out, shared)
    fp4 = experts.format == "fp4"
    sm90 = config is PREFILL_CONFIG and moe_grouped_sm90.takes(x.device, experts.format, d, i)
    fp4_sm90 = config is PREFILL_CONFIG_FP4 and moe_grouped_fp4_sm90.takes(x.device, experts.format, d, i)
    row_token, tile_expert, row_of_slot = _plan(expert_ids, n_experts,
                                                moe_grouped_sm90.BLOCK_M if sm90 else config.block_m)
    x_fp8, x_scales = _gather_quantize(x, row_token, fp4 and not config.fp4_e4m3)
    rows = row_token.numel()
    h = torch.empty(rows, i, dtype=FP8_DTYPE, device=x.device)
    h_scales = torch.empty(rows, i // BLOCK_K, dtype=torch.float32, device=x.device)
    y = torch.empty(rows, d, dtype=torch.bfloat16, device=x.device)
    if sm90:
        moe_grouped_sm90.grouped_fp8(x_fp8, x_scales, experts.w13, experts.w13_scales, tile_expert,
                                     h.view(torch.uint8), h_scales, swiglu=True, limit=swiglu_limit)
        moe_grouped_sm90.grouped_fp8(h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None, swiglu=False,
                                     limit=None)
    else:
        grouped = _folded_fp4_sm90 if fp4_sm90 else partial(_grouped_gemm, fp4=fp4)
        grouped(x_fp8, x_scales, experts.w13, experts.w13_scales, tile_expert, h.view(torch.uint8), h_scales,
                swiglu=True, limit=swiglu_limit, n_experts=n_experts, config=config)
        grouped(h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None, swiglu=False, limit=None,
                n_experts=n_experts, config=config)
    return _combine(y, row_of_slot, weights, out, shared)


def _combine(y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
             shared_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [T, D] = the weighted sums of each token's slots' rows of y (_combine_kernel), plus shared_rows
    [T, D] bfloat16 (contiguous) if given."""
    n_tokens, top_k = weights.shape
    tokens = rows_per_program(n_tokens, _COMBINE_BLOCK)
    _combine_kernel[(triton.cdiv(n_tokens, tokens), triton.cdiv(out.shape[1], _COMBINE_BLOCK))](
        y, row_of_slot, weights.contiguous(), y if shared_rows is None else shared_rows, out, n_tokens,
        out.stride(0), D=out.shape[1], TOP_K=top_k, TOKENS=tokens, BLOCK_D=_COMBINE_BLOCK,
        HAS_SHARED=shared_rows is not None, launch_pdl=True)
    return out
