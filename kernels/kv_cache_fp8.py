"""fp8 paged latent KV cache in FlashMLA's V32 layout ("FP8 with scale"): 656 bytes per token.

Byte layout of one token (little-endian, as FlashMLA and vLLM store DeepSeek-V3.2's MLA cache):

    [0, 512)    512 float8_e4m3fn   latent / SCALE, four tiles of 128 values
    [512, 528)    4 float32         SCALE of each tile, a power of two
    [528, 656)   64 bfloat16        k_rope, copied bit-exactly (not quantised)

SCALE = 2^ceil(log2(max(amax / 448, 1e-4))), amax = max |latent| over the tile, evaluated exactly
(no rounding of the log2), so amax <= 448 * SCALE and the smallest scale is 2^-13. The stored value
is clamp(latent / SCALE, -448, 448) rounded to nearest-even e4m3; dequantisation is fp8 * SCALE,
which is exact in bfloat16 and float32. (The rule and the layout live in minirt.formats: KV_*,
quantize_groups with KV_MIN_SCALE.)

The cache is paged: ``[num_blocks, block_size, 1, 656]`` uint8; the slot of the token at offset o
of block n is ``n * block_size + o``. A block table ``[batch, max_blocks_per_seq]`` int32 maps a
sequence's logical position p to block ``table[b, p // block_size]``, offset ``p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from minirt import formats
from minirt.errors import InputError

from ._common import (check_device, check_slots, check_tensors, flat_of, paged_slot, rms_normed, rotated,
                      rounded_to_bf16, rows_of, writable_slot)
from ._fp8 import pow2_quantize_rows
from ._launch import cdiv, described, launch, per_signature

# The layout and the scale rule in the form @triton.jit code reads (here and in sparse_mla_decode).
D_LAT = tl.constexpr(formats.KV_LATENT_DIM)
D_ROPE = tl.constexpr(formats.KV_ROPE_DIM)
TILES = tl.constexpr(formats.KV_NUM_TILES)
TILE = tl.constexpr(formats.FP8_GROUP)
TOKEN_BYTES = tl.constexpr(formats.KV_TOKEN_BYTES)
SCALES_AT = tl.constexpr(formats.KV_SCALES_AT)
ROPE_AT = tl.constexpr(formats.KV_ROPE_AT)
MIN_SCALE_EXPONENT = tl.constexpr(formats.KV_MIN_SCALE_EXPONENT)


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------

def quantize_kv_fp8(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """
    Pack tokens into the 656-byte V32 cache format (torch reference of write_kv_fp8).

    Args:
        latent: [..., 512], bfloat16, float16 or float32, finite. The normalised MLA latent.
        k_rope: [..., 64], bfloat16, same leading shape. The roped key part, stored bit-exactly.

    Returns:
        [..., 656] uint8, laid out as described in this module's docstring.

    Raises:
        minirt.errors.InputError: wrong dtype, last dim or mismatched leading shape/device.
    """
    _check_token_inputs(latent, k_rope)
    values, scales = formats.quantize_groups(latent, formats.KV_MIN_SCALE)
    return torch.cat([values.view(torch.uint8), scales.contiguous().view(torch.uint8),
                      k_rope.contiguous().view(torch.uint8)], dim=-1)


def dequantize_kv_fp8(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """
    Unpack V32 cache bytes into [latent | k_rope] rows (torch reference of the decode kernel's loads).

    Args:
        packed: [..., 656] uint8 (any leading shape, e.g. a whole paged cache
            [num_blocks, block_size, 1, 656]).
        dtype: result dtype, bfloat16 or float32. Both are exact: fp8 * 2^e and the rope values are
            representable in either.

    Returns:
        [..., 576] of ``dtype``: [..., :512] = fp8 * scale of its tile, [..., 512:] = k_rope.

    Raises:
        minirt.errors.InputError: packed is not uint8 with last dim 656, or dtype unsupported.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() < 1 \
            or packed.shape[-1] != formats.KV_TOKEN_BYTES:
        raise InputError(f"packed must be a uint8 tensor [..., {formats.KV_TOKEN_BYTES}], got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise InputError(f"dtype must be bfloat16 or float32, got {dtype}")
    packed = packed.contiguous()
    values = packed[..., :formats.KV_LATENT_DIM].view(formats.FP8_DTYPE).float()
    scales = packed[..., formats.KV_SCALES_AT:formats.KV_ROPE_AT].view(torch.float32)
    latent = (values.unflatten(-1, (formats.KV_NUM_TILES, formats.FP8_GROUP)) * scales.unsqueeze(-1)).flatten(-2)
    k_rope = packed[..., formats.KV_ROPE_AT:].view(torch.bfloat16)
    return torch.cat([latent.to(dtype), k_rope.to(dtype)], dim=-1)


def _check_token_inputs(latent, k_rope, roped: bool = False) -> None:
    """latent and k_rope of one leading shape and device; k_rope bfloat16 (stored bit-exactly) unless the
    writer ropes it (``roped``: any float dtype)."""
    check_tensors({"latent": latent, "k_rope": k_rope})
    for name, t, dim in (("latent", latent, formats.KV_LATENT_DIM), ("k_rope", k_rope, formats.KV_ROPE_DIM)):
        if t.dim() < 1 or t.shape[-1] != dim:
            raise InputError(f"{name} must have last dim {dim}, got shape {tuple(t.shape)}")
    if latent.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"latent must be bfloat16, float16 or float32, got {latent.dtype}")
    if k_rope.dtype not in ((torch.bfloat16, torch.float16, torch.float32) if roped else (torch.bfloat16,)):
        wanted = "bfloat16, float16 or float32" if roped else "bfloat16 (it is stored bit-exactly)"
        raise InputError(f"k_rope must be {wanted}, got {k_rope.dtype}")
    if latent.shape[:-1] != k_rope.shape[:-1]:
        raise InputError(f"latent {tuple(latent.shape)} and k_rope {tuple(k_rope.shape)} "
                         "differ in their leading dims")
    if latent.device != k_rope.device:
        raise InputError(f"latent is on {latent.device} but k_rope on {k_rope.device}")


# ----------------------------------------------------------------------------------------------
# paged cache geometry
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheGeometry:
    """Shape facts of a paged cache that the kernels need; block_stride is in bytes."""

    num_blocks: int
    block_size: int
    block_stride: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def cache_geometry(kv_cache: torch.Tensor) -> CacheGeometry:
    """Validate a paged V32 cache ``[num_blocks, block_size, 1, 656]`` uint8 and describe it.

    The tokens of a block must be packed (token stride 656 bytes, byte stride 1); the block stride
    may be larger (a view of a bigger cache), but must be a multiple of 16 bytes, and the data
    pointer 16-byte aligned, so that the kernels' vector loads of the float32 scales and the
    bfloat16 rope values stay aligned. Raises minirt.errors.InputError otherwise.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise InputError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise InputError(f"kv_cache must be uint8 (656-byte V32 tokens), got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != formats.KV_TOKEN_BYTES:
        raise InputError(f"kv_cache must have shape [num_blocks, block_size, 1, {formats.KV_TOKEN_BYTES}], "
                         f"got {tuple(kv_cache.shape)}")
    num_blocks, block_size = kv_cache.shape[:2]
    if block_size < 1:
        raise InputError("kv_cache block_size must be >= 1")
    if kv_cache.stride(3) != 1 or (block_size > 1 and kv_cache.stride(1) != formats.KV_TOKEN_BYTES):
        raise InputError(f"the tokens of a kv_cache block must be packed (strides [*, "
                         f"{formats.KV_TOKEN_BYTES}, *, 1]), got strides {kv_cache.stride()}")
    block_stride = kv_cache.stride(0) if num_blocks > 1 else block_size * formats.KV_TOKEN_BYTES
    if block_stride % 16 != 0 or kv_cache.data_ptr() % 16 != 0:
        raise InputError(f"kv_cache block stride ({block_stride} bytes) and data pointer must be "
                         "multiples of 16 bytes")
    if num_blocks * block_size >= 2 ** 31:
        raise InputError(f"kv_cache has {num_blocks * block_size} slots; slot ids are int32")
    return CacheGeometry(num_blocks, block_size, block_stride)


def new_kv_cache(num_blocks: int, block_size: int = formats.CACHE_BLOCK_SIZE,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """
    Allocate a zeroed paged fp8 latent cache for one layer.

    Args:
        num_blocks: number of pages (>= 1).
        block_size: tokens per page (>= 1); default minirt.formats.CACHE_BLOCK_SIZE (64, as FlashMLA).
        device: where to allocate.

    Returns:
        [num_blocks, block_size, 1, 656] uint8, all bytes 0 (dequantises to zeros).
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    return torch.zeros(num_blocks, block_size, 1, formats.KV_TOKEN_BYTES, dtype=torch.uint8, device=device)


# ----------------------------------------------------------------------------------------------
# positions -> slots
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_per_row", "max_blocks", "block_size", "num_blocks", "stride_table_b"])
def _positions_to_slots_kernel(pos_ptr, table_ptr, slot_ptr, n_per_row, max_blocks, block_size,
                               num_blocks, stride_table_b, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_per_row
    pos = tl.load(pos_ptr + row * n_per_row + cols, mask=in_row, other=-1)
    slot = paged_slot(table_ptr + row * stride_table_b, pos, in_row, max_blocks, block_size, num_blocks)
    tl.store(slot_ptr + row * n_per_row + cols, slot.to(tl.int32), mask=in_row)


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
    """
    Map sequences' logical token positions to cache slot ids (one Triton launch).

    slot = block_table[b, p // block_size] * block_size + p % block_size for position p of
    sequence b. The result is -1 where p < 0, p >= max_blocks_per_seq * block_size (outside the
    table), or the table entry is outside [0, num_blocks) (e.g. -1 for an unallocated page).

    Args:
        positions: [b, ...] int32 or int64, logical positions (any trailing shape, e.g. the
            indexer's top-k [b, s_q, topk] or new tokens' [b, s_q]).
        block_table: [b, max_blocks_per_seq] int32, page ids of each sequence.
        kv_cache: the paged cache the slots address (gives block_size and num_blocks).

    Returns:
        int32 tensor shaped like positions, contiguous.

    Raises:
        minirt.errors.InputError: wrong dtypes/shapes, mismatched batch or devices.
    """
    grid, copies, integers, compiled = per_signature(
        _MAPPINGS, lambda: (described(positions), described(block_table), described(kv_cache)),
        lambda: _mapping(positions, block_table, kv_cache))
    slots = torch.empty(*positions.shape, dtype=torch.int32, device=positions.device)
    if grid is not None:
        # (The kernel reads the positions and writes the slots as [b, n] rows, the table with unit column stride.)
        launch(_positions_to_slots_kernel, grid, (positions.contiguous() if copies[0] else positions,
                                                  block_table.contiguous() if copies[1] else block_table, slots,
                                                  *integers), dict(BLOCK=_SLOTS_BLOCK), compiled)
    return slots


_SLOTS_BLOCK = 256   # positions a program of positions_to_slots maps


def _mapping(positions, block_table, kv_cache) -> tuple:
    """What positions_to_slots derives from a call signature, after its checks: (grid, or None without
    positions; whether positions / block_table are copied; the kernel's integers; its compiled kernels)."""
    geometry = _checked_mapping(positions, block_table, kv_cache)
    batch, n_per_row = positions.shape[0], positions.numel() // max(1, positions.shape[0])
    copies = (not positions.is_contiguous(), block_table.stride(1) != 1)
    table_row_stride = block_table.shape[1] if copies[1] else block_table.stride(0)
    grid = (batch, cdiv(n_per_row, _SLOTS_BLOCK)) if positions.numel() else None
    return grid, copies, (n_per_row, block_table.shape[1], geometry.block_size, geometry.num_blocks,
                          table_row_stride), {}


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> _mapping's
# result: a signature seen before passed the checks.
_MAPPINGS: dict = {}


def _checked_mapping(positions, block_table, kv_cache) -> CacheGeometry:
    """positions_to_slots' input checks (InputError); the cache's geometry."""
    geometry = cache_geometry(kv_cache)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) \
            or positions.dim() < 1:
        raise InputError("positions must be an int32 or int64 tensor [b, ...]")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
            or block_table.dim() != 2:
        raise InputError("block_table must be an int32 tensor [b, max_blocks_per_seq]")
    if block_table.shape[0] != positions.shape[0]:
        raise InputError(f"block_table has {block_table.shape[0]} rows but positions has batch "
                         f"{positions.shape[0]}")
    check_device({"positions": positions, "block_table": block_table, "kv_cache": kv_cache})
    return geometry


# ----------------------------------------------------------------------------------------------
# writer
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["block_size", "num_slots", "block_stride", "stride_latent", "stride_rope", "stride_cos",
                               "stride_sin"])
def _write_kv_fp8_kernel(cache_ptr, latent_ptr, rope_ptr, slot_ptr, norm_ptr, cos_ptr, sin_ptr, block_size, num_slots,
                         block_stride, stride_latent, stride_rope, stride_cos, stride_sin, eps, NORM: tl.constexpr,
                         ROPE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot, valid = writable_slot(slot_ptr, token, num_slots)
    row = cache_ptr + (slot // block_size) * block_stride + (slot % block_size) * TOKEN_BYTES

    tiles = tl.arange(0, TILES)
    cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    latent = tl.load(latent_ptr + token * stride_latent + cols).to(tl.float32)
    if NORM:  # rms_norm's values (the same [tiles, 128] sums), rounded to the latent's dtype as it rounds them
        latent = rms_normed(latent, tl.load(norm_ptr + cols).to(tl.float32), D_LAT, eps)
        latent = latent.to(latent_ptr.dtype.element_ty).to(tl.float32)
    # One tile per row, one scale per tile (formats.quantize_groups with KV_MIN_SCALE).
    codes, scale = pow2_quantize_rows(latent, MIN_SCALE_EXPONENT)
    tl.store(row + cols, codes.to(tl.uint8), mask=valid)
    tl.store((row + SCALES_AT).to(tl.pointer_type(tl.float32)) + tiles, scale, mask=valid)
    rope_row = (row + ROPE_AT).to(tl.pointer_type(tl.int16))
    if ROPE:  # interleaved pairs rotated in fp32 (apply_rope's), rounded to nearest bfloat16 (also interpreted)
        pair = tl.arange(0, D_ROPE // 2)
        cos = tl.load(cos_ptr + token * stride_cos + pair).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_sin + pair).to(tl.float32)
        a = tl.load(rope_ptr + token * stride_rope + 2 * pair).to(tl.float32)
        b = tl.load(rope_ptr + token * stride_rope + 2 * pair + 1).to(tl.float32)
        a, b = rotated(a, b, cos, sin)
        tl.store(rope_row + 2 * pair, rounded_to_bf16(a).to(tl.bfloat16).to(tl.int16, bitcast=True), mask=valid)
        tl.store(rope_row + 2 * pair + 1, rounded_to_bf16(b).to(tl.bfloat16).to(tl.int16, bitcast=True), mask=valid)
    else:  # copied bit-exactly (read as int16)
        rope_cols = tl.arange(0, D_ROPE)
        tl.store(rope_row + rope_cols, tl.load(rope_ptr + token * stride_rope + rope_cols), mask=valid)


def write_kv_fp8(kv_cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slots: torch.Tensor, *,
                 norm: Optional[tuple[torch.Tensor, float]] = None,
                 rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """
    Quantise new tokens and scatter them into their cache slots, in place, in one launch; optionally the
    latent's RMSNorm and k_rope's rope first (a decode step's kv_a output straight to the cache).

    Byte-identical to quantize_kv_fp8(latent, k_rope) written at kv_cache.view(-1, 656)[slots] (with
    ``norm`` / ``rope``: of the normed latent and the rotated k_rope).

    Args:
        kv_cache: [num_blocks, block_size, 1, 656] uint8 paged cache (see cache_geometry).
        latent: [..., 512], bfloat16, float16 or float32, finite; last dim contiguous.
        k_rope: [..., 64], same leading shape; last dim contiguous. bfloat16 (stored bit-exactly), or with
            ``rope`` any float dtype.
        slots: [...] int32 or int64, same leading shape: slot id of each token. Slots outside
            [0, num_blocks * block_size) (e.g. -1 for padding tokens) are skipped. Two tokens
            with the same slot leave one of them, unspecified which.
        norm: keyword-only, optional (weight [512] of any float dtype, eps float >= 0): the latent stored
            is ``rms_norm(latent, weight, eps)`` (its values bit for bit: fp32, rounded to latent's dtype).
        rope: keyword-only, optional (cos, sin) [..., 32] float (latent's leading shape, unit last stride):
            the k_rope stored is ``apply_rope(k_rope, cos, sin, 64, interleaved=True)`` rounded to the nearest
            bfloat16 (products may fuse: its values to fp32 rounding).

    Raises:
        minirt.errors.InputError: wrong dtype/shape/device.
    """
    weight, eps = norm if isinstance(norm, tuple) and len(norm) == 2 else (None, None)
    cos, sin = rope if isinstance(rope, tuple) and len(rope) == 2 else (None, None)
    geometry, compiled = per_signature(
        _WRITES, lambda: (described(kv_cache), described(latent), described(k_rope), described(slots),
                          None if norm is None else (norm.__class__, len(norm), described(weight)),
                          None if rope is None else (rope.__class__, len(rope), described(cos), described(sin))),
        lambda: (_checked_write(kv_cache, latent, k_rope, slots, norm, rope), {}))
    latent = rows_of(latent, formats.KV_LATENT_DIM)
    k_rope = rows_of(k_rope, formats.KV_ROPE_DIM)
    if rope is None:
        k_rope = k_rope.view(torch.int16)
    else:
        cos, sin = rows_of(cos, formats.KV_ROPE_DIM // 2), rows_of(sin, formats.KV_ROPE_DIM // 2)
    slots = flat_of(slots)
    if slots.numel() == 0:
        return
    launch(_write_kv_fp8_kernel, (slots.numel(),), (
        kv_cache, latent, k_rope, slots, latent if weight is None else weight, latent if cos is None else cos,
        latent if sin is None else sin, geometry.block_size, geometry.num_slots, geometry.block_stride,
        latent.stride(0), k_rope.stride(0), 0 if cos is None else cos.stride(0), 0 if sin is None else sin.stride(0),
        0.0 if eps is None else float(eps)), dict(NORM=norm is not None, ROPE=rope is not None), compiled)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> (the cache's
# geometry, the writer's compiled kernel): a signature seen before passed the checks.
_WRITES: dict = {}


def _checked_write(kv_cache, latent, k_rope, slots, norm, rope) -> CacheGeometry:
    """write_kv_fp8's input checks (InputError); the cache's geometry."""
    geometry = cache_geometry(kv_cache)
    _check_token_inputs(latent, k_rope, rope is not None)
    check_slots(slots, latent.shape[:-1])
    extra = {}
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) == 2 and isinstance(norm[0], torch.Tensor) and
                tuple(norm[0].shape) == (formats.KV_LATENT_DIM,) and norm[0].is_floating_point() and
                isinstance(norm[1], (int, float)) and not isinstance(norm[1], bool) and norm[1] >= 0):
            raise InputError(f"norm must be (weight [{formats.KV_LATENT_DIM}] float tensor, eps float >= 0)")
        extra["norm weight"] = norm[0]
    if rope is not None:
        shape = (*latent.shape[:-1], formats.KV_ROPE_DIM // 2)
        if not (isinstance(rope, tuple) and len(rope) == 2 and all(
                isinstance(t, torch.Tensor) and t.shape == shape and t.is_floating_point() and t.stride(-1) == 1
                for t in rope)):
            raise InputError(f"rope must be (cos, sin), float tensors {list(shape)} with unit last stride")
        extra.update(cos=rope[0], sin=rope[1])
    check_device({"latent": latent, "k_rope": k_rope, "slots": slots, "kv_cache": kv_cache, **extra})
    return geometry
