"""The routed experts of a MoE layer: tokens permuted by expert, grouped fp8 GEMMs with SwiGLU fused
into the first, and the weighted combine back to token order.

moe_experts(x, expert_ids, weights, experts) runs, all on the device and of static shapes (no host
sync: CUDA-graph capturable):

1. plan (torch ops): the T * top_k (token, slot) assignments sorted by expert (stable: token order
   within an expert); each expert's rows padded to whole tiles of BLOCK_M rows in one buffer of at
   most min(T * top_k, ceil(T * top_k / BLOCK_M) + E) tiles, each tile's expert in a table (E past
   the last tile: those programs do nothing);
2. gather: each row's token quantised to fp8 with 1 x 128 power-of-two scales (the activation rule
   of fp8_gemm.quantize_act_fp8, through the same Triton helper), padding rows zero;
3. gate/up: per tile, [BLOCK_M, D] x w13[e]^T for a gate block and its up block (w13 = cat(w1, w3)
   along the output dim), then silu(g) * u (V4's clamp optional) quantised to fp8 per 128 columns:
   the down GEMM's input is written directly, never in bf16;
4. down: per tile, h x w2[e]^T to bf16 rows;
5. combine: out[t] = sum over slots j (in slot order, fp32) of weights[t, j] * y[row of (t, j)].

Weights come in two formats (ExpertWeights): block fp8 (e4m3 with fp32 128 x 128 block scales,
V3.2 / V4-Flash-Base) multiplied on fp8 tensor cores with every 128-wide k block promoted into
fp32 (as fp8_gemm), and fp4 (e2m1 with e8m0 scales per 32 inputs, V4-Flash / Pro) decoded to bf16
in registers (exact) and multiplied with the fp8 activations converted to bf16 (exact).

Two launch shapes: prefill (many tokens per expert) 128-row tiles of tokens against 128 weight
rows; decode (a few tokens per expert) the weight rows on the MMA's wide side and the tiles'
16 tokens on its narrow side (swap_ab), so each active expert's weights are read once per 16 of
its tokens and inactive experts not at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minirt.errors import InputError
from minirt.formats import FP8_DTYPE, FP8_GROUP

from ._common import INTERPRET, check_device
from ._fp8 import ACT_MIN_EXPONENT, pow2_quantize_rows

BLOCK_K = FP8_GROUP          # one k block = one activation scale group = one fp8 weight block column
FP4_GROUP = 32               # inputs per e8m0 scale of an fp4 weight
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
        w13_scales: [E, 2I, D / 32] uint8, e8m0 exponents (scale 2^(byte - 127)) per 32 inputs.
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


def _stack(name: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-expert 2-D tensors stacked to [E, ...] of ``dtype``: float32 converts any float dtype (scales),
    a 1-byte dtype reinterprets any 1-byte dtype (int8 codes, e8m0 bytes)."""
    if len(tensors) == 0:
        raise InputError(f"{name}: no experts given")
    stacked = []
    for e, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != tensors[0].shape \
                or (t.element_size() != 1 if dtype != torch.float32 else not t.is_floating_point()):
            raise InputError(f"{name}[{e}] must be a 2-D {'float' if dtype == torch.float32 else '1-byte'} tensor "
                             f"of expert 0's shape {tuple(getattr(tensors[0], 'shape', ()))}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        stacked.append(t.float() if dtype == torch.float32 else t.view(dtype))
    return torch.stack(stacked)


def expert_weights_fp8(w1, w1_scales, w3, w3_scales, w2, w2_scales) -> ExpertWeights:
    """
    ExpertWeights in block fp8 from per-expert checkpoint tensors (each a sequence of E tensors, in
    expert order): w1 / w3 [I, D] float8_e4m3fn with scales [I / 128, D / 128], w2 [D, I] with
    scales [D / 128, I / 128]. Scales of any float dtype (V4's float8_e8m0fnu included) are converted
    to float32. Raises InputError (naming the expert) on a wrong shape or dtype.
    """
    return _experts("fp8", w1, w1_scales, w3, w3_scales, w2, w2_scales, FP8_DTYPE, torch.float32)


def expert_weights_fp4(w1, w1_scales, w3, w3_scales, w2, w2_scales) -> ExpertWeights:
    """
    ExpertWeights in fp4 from per-expert checkpoint tensors (each a sequence of E tensors): w1 / w3
    [I, D / 2] int8 or uint8 (packed e2m1, the low nibble element 2i) with e8m0 scales [I, D / 32]
    (float8_e8m0fnu or uint8 bytes), w2 [D, I / 2] with scales [D, I / 32]. The bytes are kept as
    they are. Raises InputError on a wrong shape or element size.
    """
    return _experts("fp4", w1, w1_scales, w3, w3_scales, w2, w2_scales, torch.uint8, torch.uint8)


def _experts(fmt, w1, w1_scales, w3, w3_scales, w2, w2_scales, dtype, scale_dtype) -> ExpertWeights:
    """Stack and concatenate per-expert tensors into ExpertWeights (which validates the result)."""
    w13 = torch.cat([_stack("w1", w1, dtype), _stack("w3", w3, dtype)], 1)
    s13 = torch.cat([_stack("w1_scales", w1_scales, scale_dtype), _stack("w3_scales", w3_scales, scale_dtype)], 1)
    return ExpertWeights(fmt, w13, s13, _stack("w2", w2, dtype), _stack("w2_scales", w2_scales, scale_dtype))


@dataclass(frozen=True)
class MoeConfig:
    """Launch shape of moe_experts' grouped GEMMs. block_m: token rows per tile (every expert's rows
    padded to whole tiles); block_n: weight rows per program (128: one activation scale group of the
    SwiGLU output); swap_ab: weight rows on the MMA's M side and tokens on its N side (decode)."""

    block_m: int = 128
    block_n: int = 128
    swap_ab: bool = False
    num_warps: int = 8
    num_stages: int = 3


PREFILL_CONFIG = MoeConfig()
DECODE_CONFIG = MoeConfig(block_m=16, swap_ab=True, num_warps=4, num_stages=4)
# Assignments per expert (on average) up to which the decode shape runs: a 16-token tile then holds
# most of an expert's tokens, and 128-row tiles would be mostly padding.
DECODE_MAX_PER_EXPERT = 16


def default_config(n_assignments: int, n_experts: int) -> MoeConfig:
    """DECODE_CONFIG while T * top_k <= DECODE_MAX_PER_EXPERT * E, PREFILL_CONFIG above."""
    return DECODE_CONFIG if n_assignments <= DECODE_MAX_PER_EXPERT * n_experts else PREFILL_CONFIG


def max_tiles(n_assignments: int, n_experts: int, block_m: int) -> int:
    """Tiles the plan may need: each active expert's rows round up to whole tiles, and no more tiles
    than assignments."""
    return min(n_assignments, triton.cdiv(n_assignments, block_m) + n_experts)


def _plan(expert_ids: torch.Tensor, n_experts: int, block_m: int):
    """(row_token [tiles * block_m] int32: each row's token, -1 for padding; tile_expert [tiles] int32,
    E past the used tiles; row_of_slot [T * top_k] int32: each assignment's row, -1 for skipped
    slots). Torch ops of static shapes, no host sync."""
    n_tokens, top_k = expert_ids.shape
    n_slots = n_tokens * top_k
    device = expert_ids.device
    tiles = max_tiles(n_slots, n_experts, block_m)
    flat = expert_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)     # skipped slots sort last
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices                               # slots, by expert
    first_sorted = torch.cumsum(counts, 0) - counts                             # each expert's first sorted position
    expert_tiles = (counts + block_m - 1) // block_m
    expert_tiles[n_experts] = 0
    tile_end = torch.cumsum(expert_tiles, 0)
    first_row = (tile_end - expert_tiles) * block_m
    tile_expert = torch.searchsorted(tile_end[:n_experts], torch.arange(tiles, device=device), right=True)
    sorted_expert = flat[order]
    rows = first_row[sorted_expert] + torch.arange(n_slots, device=device) - first_sorted[sorted_expert]
    skipped = sorted_expert == n_experts
    row_of_slot = torch.empty(n_slots, dtype=torch.int32, device=device)
    row_of_slot.scatter_(0, order, torch.where(skipped, -1, rows).to(torch.int32))
    # Skipped slots write to a spare row past the end, cut off after.
    row_token = torch.full((tiles * block_m + 1,), -1, dtype=torch.int32, device=device)
    row_token.scatter_(0, torch.where(skipped, tiles * block_m, rows), (order // top_k).to(torch.int32))
    return row_token[:-1], tile_expert.to(torch.int32), row_of_slot


@triton.jit
def _gather_quantize_kernel(x_ptr, row_token_ptr, q_ptr, scale_ptr, stride_xt,
                            D: tl.constexpr, GROUPS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    # Program (row, group block): the row's token's GROUPS x 128 columns, quantised; padding rows zero.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    token = tl.load(row_token_ptr + row).to(tl.int64)
    mask = groups < D // BLOCK_K
    cols = groups[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    x = tl.load(x_ptr + token * stride_xt + cols, mask=mask[:, None] & (token >= 0), other=0.0).to(tl.float32)
    codes, scale = pow2_quantize_rows(x, MIN_EXPONENT)
    tl.store(q_ptr + row * D + cols, codes.to(tl.uint8), mask=mask[:, None])
    tl.store(scale_ptr + row * (D // BLOCK_K) + groups, scale, mask=mask)


@triton.jit
def _e2m1_values(packed, SCALE_BYTES):
    """packed [N, K / 2] uint8 (two e2m1 codes a byte, the low nibble first), SCALE_BYTES [N, K / 32]
    uint8 e8m0 -> [N, K] float32 code value x 2^(byte - 127), exact (a byte of 0 reads as 0)."""
    codes = tl.join(packed & 0xF, packed >> 4).reshape(packed.shape[0], 2 * packed.shape[1]).to(tl.int32)
    magnitude = codes & 7
    # e2m1 magnitude code m = (exponent e, mantissa bit b): 2^(e-1) x (1 + b/2) for e > 0, b/2 for e = 0;
    # the first as float32 bits (exponent e + 126, b the top mantissa bit).
    normal = ((magnitude << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(magnitude < 2, magnitude.to(tl.float32) * 0.5, normal)
    value = tl.where((codes & 8) != 0, -value, value)
    scale = (SCALE_BYTES.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    n, k = value.shape
    return (value.reshape(n, k // 32, 32) * scale[:, :, None]).reshape(n, k)


@triton.jit
def _weight_block(b_desc, b_scale_ptr, row, kb, FP4: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """Rows [row, row + BLOCK_N) x k block kb of a stacked weight ([E * N, K], experts' rows one after
    another): fp8 as stored (the caller applies its block scale), or fp4 decoded with its scales
    ([E * N, K / 32] bytes), in bf16 (float32 when interpreted)."""
    if FP4:
        packed = b_desc.load([row, kb * (BLOCK_K // 2)])
        rows = row + tl.arange(0, BLOCK_N)
        scale_bytes = tl.load(b_scale_ptr + rows.to(tl.int64)[:, None] * (K // FP4_GROUP)
                              + kb * (BLOCK_K // FP4_GROUP) + tl.arange(0, BLOCK_K // FP4_GROUP)[None, :])
        w = _e2m1_values(packed, scale_bytes)
        return w if INTERPRETED else w.to(tl.bfloat16)
    else:
        w = b_desc.load([row, kb * BLOCK_K])
        return w.to(tl.float32) if INTERPRETED else w


@triton.jit
def _block_scale(b_scale_ptr, row, kb, FP4: tl.constexpr, K: tl.constexpr):
    """The fp8 block scale of weight rows [row, row + BLOCK_N) (inside one 128-row block: the scales are
    [E * N / 128, K / 128]) at k block kb; 1 for fp4, whose scales _weight_block applied."""
    if FP4:
        return 1.0
    else:
        return tl.load(b_scale_ptr + (row // BLOCK_K).to(tl.int64) * (K // BLOCK_K) + kb)


@triton.jit
def _block_product(a, w, a_scale, b_scale, SWAP_AB: tl.constexpr):
    """One k block's product (fp32 accumulation within the block), times its scales (promotion):
    [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when SWAP_AB."""
    if SWAP_AB:
        return tl.dot(w, tl.trans(a)) * (a_scale * b_scale)[None, :]
    else:
        return tl.dot(a, tl.trans(w)) * (a_scale * b_scale)[:, None]


@triton.jit
def _grouped_gemm_kernel(
    a_desc, a_scale_ptr, b_desc, b_scale_ptr, tile_expert_ptr, out_ptr, out_scale_ptr, limit,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, FP4: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Program (tile, column block), tile-major: the column blocks of one tile (one expert's weight)
    # run side by side. a: [tiles * BLOCK_M, K] fp8 rows with [., K / 128] scales; the weight has N
    # rows an expert. SWIGLU (N = 2 N_OUT, gate rows then up rows): gate rows [c, c + BLOCK_N) and
    # the matching up rows, silu(g) * u stored as fp8 codes with one scale per row (BLOCK_N = 128);
    # otherwise rows [c, c + BLOCK_N) (N = N_OUT) stored as bf16.
    pid = tl.program_id(0)
    tile = pid // (N_OUT // BLOCK_N)
    col = (pid % (N_OUT // BLOCK_N)) * BLOCK_N
    expert = tl.load(tile_expert_ptr + tile)
    if expert < E:
        gate_row = expert * N + col
        up_row = gate_row + N_OUT
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * (K // BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K // BLOCK_K):
            a = a_desc.load([tile * BLOCK_M, kb * BLOCK_K])
            # fp8 x fp8 on fp8 tensor cores; fp8 x fp4 in bf16 (both converted exactly).
            a = a.to(tl.float32) if INTERPRETED else (a.to(tl.bfloat16) if FP4 else a)
            a_scale = tl.load(a_scale_rows + kb)
            w = _weight_block(b_desc, b_scale_ptr, gate_row, kb, FP4, K, BLOCK_N, INTERPRETED)
            acc += _block_product(a, w, a_scale, _block_scale(b_scale_ptr, gate_row, kb, FP4, K), SWAP_AB)
            if SWIGLU:
                w = _weight_block(b_desc, b_scale_ptr, up_row, kb, FP4, K, BLOCK_N, INTERPRETED)
                acc_up += _block_product(a, w, a_scale, _block_scale(b_scale_ptr, up_row, kb, FP4, K), SWAP_AB)
        if SWAP_AB:
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        offs_n = col + tl.arange(0, BLOCK_N)
        out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * N_OUT + offs_n[None, :]
        if SWIGLU:
            if HAS_LIMIT:    # V4: silu(min(g, limit)) * clamp(u, -limit, limit)
                acc = tl.minimum(acc, limit)
                acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            h = acc / (1.0 + tl.exp(-acc)) * acc_up
            codes, scale = pow2_quantize_rows(h, ACT_MIN_EXPONENT)
            tl.store(out_rows, codes.to(tl.uint8))
            tl.store(out_scale_ptr + offs_m.to(tl.int64) * (N_OUT // BLOCK_K) + col // BLOCK_K, scale)
        else:
            tl.store(out_rows, acc.to(tl.bfloat16))


@triton.jit
def _combine_kernel(y_ptr, row_of_slot_ptr, weights_ptr, out_ptr, stride_ot,
                    D: tl.constexpr, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (token, column block): the weighted sum of its slots' expert rows, in slot order.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_slot_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j)
        y = tl.load(y_ptr + row * D + cols, mask=(row >= 0) & (cols < D), other=0.0)
        acc += tl.where(row >= 0, weight, 0.0) * y.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < D)


_GATHER_GROUPS = 8       # 128-column groups per gather program
_COMBINE_BLOCK = 1024    # output columns per combine program


def _grouped_gemm(a, a_scales, weight, scales, tile_expert, out, out_scales, *, fp4: bool, swiglu: bool,
                  limit: Optional[float], n_experts: int, config: MoeConfig) -> None:
    """One grouped GEMM launch over every tile (see _grouped_gemm_kernel); weight [E, N, K(/2)]."""
    n, k_stored = weight.shape[1], weight.shape[2]
    k = 2 * k_stored if fp4 else k_stored
    n_out = n // 2 if swiglu else n
    stacked = weight.view(n_experts * n, k_stored)
    b_block = [config.block_n, BLOCK_K // 2 if fp4 else BLOCK_K]
    _grouped_gemm_kernel[(tile_expert.numel() * (n_out // config.block_n),)](
        TensorDescriptor.from_tensor(a, [config.block_m, BLOCK_K]), a_scales,
        TensorDescriptor.from_tensor(stacked, b_block), scales, tile_expert, out,
        out if out_scales is None else out_scales, 0.0 if limit is None else float(limit),
        E=n_experts, N=n, K=k, N_OUT=n_out, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        SWAP_AB=config.swap_ab, FP4=fp4, SWIGLU=swiglu, HAS_LIMIT=limit is not None, INTERPRETED=INTERPRET,
        num_warps=config.num_warps, num_stages=config.num_stages)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, *,
                swiglu_limit: Optional[float] = None, config: Optional[MoeConfig] = None) -> torch.Tensor:
    """
    The routed experts' weighted sum of a MoE layer:

        out[t] = sum_j weights[t, j] * W2[e] . swiglu(W1[e] . x[t], W3[e] . x[t]),  e = expert_ids[t, j]

    swiglu(g, u) = silu(g) * u, or with swiglu_limit L (DeepSeek-V4) silu(min(g, L)) * clamp(u, -L, L).
    x is quantised to fp8 per token and 128 columns (fp8_gemm.quantize_act_fp8's rule, bit for bit)
    and so is the SwiGLU output before W2 (DeepSeek's act_quant on the expert's intermediate); each
    128-wide k block of a product is accumulated in fp32 with its scales applied (promotion). fp4
    weights are decoded to bf16 exactly (e2m1 value x 2^(e8m0 - 127)). Expert outputs are rounded to
    bf16 per expert, then summed over the slots in slot order in fp32 (deterministic).

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
        config: keyword-only launch shape; None: default_config (DECODE_CONFIG for at most 16
            assignments per expert on average, else PREFILL_CONFIG).

    Returns:
        [T, D] bfloat16, every element written. T = 0 gives an empty tensor.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, a bad config, tensors on different devices
            or on one the kernels cannot use.
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
    if config is None:
        config = default_config(n_tokens * top_k, n_experts)
    elif not isinstance(config, MoeConfig) or config.block_n != BLOCK_K or config.block_m not in (16, 32, 64, 128):
        raise InputError(f"config must be a MoeConfig with block_n {BLOCK_K} and block_m 16, 32, 64 or 128, got {config!r}")
    check_device({"x": x, "expert_ids": expert_ids, "weights": weights, "experts.w13": experts.w13})
    out = torch.empty((n_tokens, d), dtype=torch.bfloat16, device=x.device)
    if n_tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    fp4 = experts.format == "fp4"
    row_token, tile_expert, row_of_slot = _plan(expert_ids, n_experts, config.block_m)
    rows = row_token.numel()
    x_fp8 = torch.empty((rows, d), dtype=FP8_DTYPE, device=x.device)
    x_scales = torch.empty((rows, d // BLOCK_K), dtype=torch.float32, device=x.device)
    _gather_quantize_kernel[(rows, triton.cdiv(d // BLOCK_K, _GATHER_GROUPS))](
        x, row_token, x_fp8.view(torch.uint8), x_scales, x.stride(0),
        D=d, GROUPS=_GATHER_GROUPS, MIN_EXPONENT=ACT_MIN_EXPONENT)
    h = torch.empty((rows, i), dtype=FP8_DTYPE, device=x.device)
    h_scales = torch.empty((rows, i // BLOCK_K), dtype=torch.float32, device=x.device)
    _grouped_gemm(x_fp8, x_scales, experts.w13, experts.w13_scales, tile_expert, h.view(torch.uint8), h_scales,
                  fp4=fp4, swiglu=True, limit=swiglu_limit, n_experts=n_experts, config=config)
    y = torch.empty((rows, d), dtype=torch.bfloat16, device=x.device)
    _grouped_gemm(h, h_scales, experts.w2, experts.w2_scales, tile_expert, y, None,
                  fp4=fp4, swiglu=False, limit=None, n_experts=n_experts, config=config)
    _combine_kernel[(n_tokens, triton.cdiv(d, _COMBINE_BLOCK))](
        y, row_of_slot, weights.contiguous(), out, out.stride(0), D=d, TOP_K=top_k, BLOCK_D=_COMBINE_BLOCK)
    return out
