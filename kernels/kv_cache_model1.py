"""fp8 paged K = V cache in FlashMLA's MODEL1 layout (DeepSeek-V4): 584 logical bytes per entry.

One entry is a 512-value vector (448 "nope" values, then 64 roped values), stored as (minirt.formats
MODEL1_*):

    data record, 576 bytes:   [0, 448)  448 float8_e4m3fn   nope / SCALE_t, seven tiles t of 64 values
                              [448, 576) 64 bfloat16        rope values, copied bit-exactly
    scale record, 8 bytes:    [0, 7)    7 ue8m0             SCALE_t = 2^(byte - 127)
                              [7]       pad                 0

SCALE_t = 2^ceil(log2(max(amax_t / 448, 1e-4))) with amax_t = max |nope| over tile t, exact (the V32
cache's rule on 64-value tiles: formats.quantize_groups with KV_MIN_SCALE); the stored value is
clamp(nope / SCALE_t, -448, 448) rounded to nearest-even e4m3 (the clamp never acts: amax_t <= 448 *
SCALE_t). Dequantisation e4m3 * SCALE_t is exact in bfloat16 and float32.

A page of B entries holds the B data records first, then the B scale records; pages are
formats.model1_page_bytes(B) apart (B * 584 rounded up to a multiple of 576). Entry o of page n is
slot n * B + o. The tensor the kernels take is FlashMLA's ``[num_blocks, B, 1, 584]`` uint8 view of
the pages (stride(0) the page stride, stride(1) 584): its shape names the entry size, not where the
bytes are, so it is read only through this module and the decode kernel.

Public: quantize_kv_model1 / dequantize_kv_model1 (one entry's 584 logical bytes, torch reference),
new_model1_cache, model1_cache_from_entries / model1_cache_entries (whole pages, torch reference of
the layout), write_kv_model1 (the Triton writer), model1_cache_geometry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt import formats
from minirt.errors import InputError

from ._common import check_device, check_slots, check_tensors, flat_of, rows_of, rows_per_program
from ._fp8 import pow2_quantize_rows
from ._launch import cdiv, described, launch, per_signature
from .kv_cache_fp8 import CacheGeometry

# The layout in the form @triton.jit code reads (here and in sparse_mla_decode).
M1_TILE = tl.constexpr(formats.MODEL1_TILE)
M1_TILES = tl.constexpr(formats.MODEL1_NUM_TILES)
M1_NOPE = tl.constexpr(formats.MODEL1_NOPE_DIM)
M1_ROPE = tl.constexpr(formats.MODEL1_ROPE_DIM)
M1_DATA_BYTES = tl.constexpr(formats.MODEL1_DATA_BYTES)
M1_SCALE_BYTES = tl.constexpr(formats.MODEL1_SCALE_BYTES)
MIN_SCALE_EXPONENT = tl.constexpr(formats.KV_MIN_SCALE_EXPONENT)
UE8M0_BIAS = tl.constexpr(formats.UE8M0_BIAS)


# ----------------------------------------------------------------------------------------------
# torch reference: one entry
# ----------------------------------------------------------------------------------------------

def quantize_kv_model1(kv: torch.Tensor) -> torch.Tensor:
    """
    Quantise K = V vectors into MODEL1 entries (torch reference of write_kv_model1).

    Args:
        kv: [..., 512] bfloat16, finite: per entry the 448 nope values, then the 64 roped values.

    Returns:
        [..., 584] uint8: the entry's data record (448 e4m3, 64 bf16) then its scale record (7 ue8m0
        bytes, a 0 pad byte), as described in this module's docstring.

    Raises:
        minirt.errors.InputError: kv not a bfloat16 tensor with last dim 512.
    """
    _check_kv(kv)
    values, scales = formats.quantize_groups(kv[..., :formats.MODEL1_NOPE_DIM], formats.KV_MIN_SCALE,
                                             formats.MODEL1_TILE)
    # A power of two's exponent is its float32 exponent field: ue8m0 stores exactly that byte.
    exponents = (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    pad = torch.zeros_like(exponents[..., :1])
    return torch.cat([values.view(torch.uint8), kv[..., formats.MODEL1_NOPE_DIM:].contiguous().view(torch.uint8),
                      exponents, pad], dim=-1)


def dequantize_kv_model1(entries: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """
    Unpack MODEL1 entries into K = V vectors (torch reference of the decode kernel's loads).

    Args:
        entries: [..., 584] uint8 logical entries (quantize_kv_model1, model1_cache_entries).
        dtype: bfloat16 or float32; both are exact.

    Returns:
        [..., 512] of dtype: [..., :448] = e4m3 * 2^(scale byte - 127) of its tile, [..., 448:] = rope.

    Raises:
        minirt.errors.InputError: entries not uint8 with last dim 584, or dtype unsupported.
    """
    if not isinstance(entries, torch.Tensor) or entries.dtype != torch.uint8 or entries.dim() < 1 \
            or entries.shape[-1] != formats.MODEL1_ENTRY_BYTES:
        raise InputError(f"entries must be a uint8 tensor [..., {formats.MODEL1_ENTRY_BYTES}], got "
                         f"{getattr(entries, 'dtype', type(entries).__name__)} {tuple(getattr(entries, 'shape', ()))}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise InputError(f"dtype must be bfloat16 or float32, got {dtype}")
    nope_end, data_end = formats.MODEL1_NOPE_DIM, formats.MODEL1_DATA_BYTES
    values = entries[..., :nope_end].contiguous().view(formats.FP8_DTYPE).float()
    exponents = entries[..., data_end:data_end + formats.MODEL1_NUM_TILES].int() - formats.UE8M0_BIAS
    scales = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    nope = (values.unflatten(-1, (formats.MODEL1_NUM_TILES, formats.MODEL1_TILE)) * scales[..., None]).flatten(-2)
    rope = entries[..., nope_end:data_end].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(dtype), rope.to(dtype)], dim=-1)


def _check_kv(kv) -> None:
    check_tensors({"kv": kv})
    if kv.dim() < 1 or kv.shape[-1] != formats.MODEL1_DIM or kv.dtype != torch.bfloat16:
        raise InputError(f"kv must be a bfloat16 tensor [..., {formats.MODEL1_DIM}] (the rope part is stored "
                         f"bit-exactly), got {kv.dtype} {tuple(kv.shape)}")


# ----------------------------------------------------------------------------------------------
# paged cache
# ----------------------------------------------------------------------------------------------

def model1_cache_geometry(kv_cache: torch.Tensor, name: str = "kv_cache") -> CacheGeometry:
    """Validate a paged MODEL1 cache view ``[num_blocks, B, 1, 584]`` uint8 and describe it (block_stride:
    the page stride in bytes). Its entries must be 584 bytes apart (stride(1) = 584, stride(3) = 1), the
    pages at least B * 584 bytes apart (they may be further: a multiple of 576 as FlashMLA allocates, or
    a view of a bigger cache), the page stride and the data pointer multiples of 16 bytes (the kernels'
    vector loads). Raises minirt.errors.InputError naming ``name`` otherwise."""
    entry = formats.MODEL1_ENTRY_BYTES
    if not isinstance(kv_cache, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise InputError(f"{name} must be uint8 (MODEL1 {entry}-byte entries), got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != entry:
        raise InputError(f"{name} must have shape [num_blocks, block_size, 1, {entry}], got {tuple(kv_cache.shape)}")
    num_blocks, block_size = kv_cache.shape[:2]
    if block_size < 1:
        raise InputError(f"{name} block_size must be >= 1")
    if kv_cache.stride(3) != 1 or (block_size > 1 and kv_cache.stride(1) != entry):
        raise InputError(f"the entries of a {name} page must be {entry} bytes apart (strides [*, {entry}, *, 1]), "
                         f"got strides {kv_cache.stride()}")
    block_stride = kv_cache.stride(0) if num_blocks > 1 else block_size * entry
    if block_stride < block_size * entry:
        raise InputError(f"{name} pages must be at least block_size * {entry} = {block_size * entry} bytes apart, "
                         f"got stride {block_stride}")
    if block_stride % 16 != 0 or kv_cache.data_ptr() % 16 != 0:
        raise InputError(f"{name} page stride ({block_stride} bytes) and data pointer must be multiples of 16 bytes")
    if num_blocks * block_size >= 2 ** 31:
        raise InputError(f"{name} has {num_blocks * block_size} slots; slot ids are int32")
    return CacheGeometry(num_blocks, block_size, block_stride)


def _pages(kv_cache: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """The [num_blocks, B * 584] bytes of the pages behind a cache view (data records, then scale records)."""
    return kv_cache.as_strided((geometry.num_blocks, geometry.block_size * formats.MODEL1_ENTRY_BYTES),
                               (geometry.block_stride, 1))


def new_model1_cache(num_blocks: int, block_size: int = formats.CACHE_BLOCK_SIZE,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """
    Allocate a zeroed paged MODEL1 cache, FlashMLA's way.

    Args:
        num_blocks: number of pages (>= 1).
        block_size: entries per page (>= 1); V4 uses 256 for the window cache, 64 (CSA) or 2 (HCA) for
            the compressed one.
        device: where to allocate.

    Returns:
        The [num_blocks, block_size, 1, 584] uint8 view (strides [model1_page_bytes(block_size), 584,
        584, 1]) of num_blocks zeroed pages (zeros dequantise to zeros).
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    page = formats.model1_page_bytes(block_size)
    pages = torch.zeros(num_blocks, page, dtype=torch.uint8, device=device)
    entry = formats.MODEL1_ENTRY_BYTES
    return pages.as_strided((num_blocks, block_size, 1, entry), (page, entry, entry, 1))


def model1_cache_from_entries(entries: torch.Tensor) -> torch.Tensor:
    """
    Lay whole pages of entries out in the MODEL1 page layout (torch reference of the layout).

    Args:
        entries: [num_blocks, B, 584] uint8 logical entries (quantize_kv_model1).

    Returns:
        A new cache as new_model1_cache(num_blocks, B) returns it, holding these entries (slot n * B + o =
        entries[n, o]).
    """
    if not isinstance(entries, torch.Tensor) or entries.dtype != torch.uint8 or entries.dim() != 3 \
            or entries.shape[2] != formats.MODEL1_ENTRY_BYTES or entries.shape[0] < 1 or entries.shape[1] < 1:
        raise InputError(f"entries must be a uint8 tensor [num_blocks >= 1, B >= 1, {formats.MODEL1_ENTRY_BYTES}], "
                         f"got {getattr(entries, 'dtype', type(entries).__name__)} {tuple(getattr(entries, 'shape', ()))}")
    num_blocks, block_size, _ = entries.shape
    cache = new_model1_cache(num_blocks, block_size, entries.device)
    pages = _pages(cache, model1_cache_geometry(cache))
    data = formats.MODEL1_DATA_BYTES
    pages[:, :block_size * data] = entries[..., :data].reshape(num_blocks, -1)
    pages[:, block_size * data:] = entries[..., data:].reshape(num_blocks, -1)
    return cache


def model1_cache_entries(kv_cache: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """
    The logical entries of a MODEL1 cache view (a copy; the inverse of model1_cache_from_entries).

    Args:
        kv_cache: [num_blocks, B, 1, 584] uint8 MODEL1 cache view.
        slots: optional int32/int64 tensor (any shape) of slot ids, each in [0, num_blocks * B).

    Returns:
        uint8 [num_blocks, B, 584] (every entry), or [*slots.shape, 584] (the entries at slots; with
        dequantize_kv_model1, the gather of a bf16 K = V buffer).

    Raises:
        minirt.errors.InputError: a malformed cache, slots not an integer tensor on its device or out of range.
    """
    geometry = model1_cache_geometry(kv_cache)
    pages = _pages(kv_cache, geometry)
    n, b, data = geometry.num_blocks, geometry.block_size, formats.MODEL1_DATA_BYTES
    records = pages[:, :b * data].view(n, b, data), pages[:, b * data:].view(n, b, formats.MODEL1_SCALE_BYTES)
    if slots is None:
        return torch.cat(records, dim=-1)
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) \
            or slots.device != kv_cache.device:
        raise InputError(f"slots must be an int32/int64 tensor on {kv_cache.device}, got "
                         f"{getattr(slots, 'dtype', type(slots).__name__)} on {getattr(slots, 'device', None)}")
    if slots.numel() and (slots.min() < 0 or slots.max() >= geometry.num_slots):   # a host sync: a reference tool
        raise InputError(f"slots must lie in [0, {geometry.num_slots}), got [{slots.min()}, {slots.max()}]")
    page, offset = slots.long() // b, slots.long() % b
    return torch.cat([records[0][page, offset], records[1][page, offset]], dim=-1)


# ----------------------------------------------------------------------------------------------
# writer
# ----------------------------------------------------------------------------------------------

@triton.jit
def model1_entry_addresses(cache_ptr, slot, block_size, block_stride):
    """(data record, scale record) byte addresses of the entries at slot (any shape, valid slot ids)."""
    page = slot // block_size
    offset = slot - page * block_size
    page_ptr = cache_ptr + page.to(tl.int64) * block_stride
    return page_ptr + offset * M1_DATA_BYTES, page_ptr + block_size * M1_DATA_BYTES + offset * M1_SCALE_BYTES


@triton.jit(do_not_specialize=["n_entries", "block_size", "num_slots", "block_stride", "stride_kv"])
def _write_kv_model1_kernel(cache_ptr, kv_ptr, slot_ptr, n_entries, block_size, num_slots, block_stride, stride_kv,
                            ROWS: tl.constexpr):
    # Program: ROWS entries (rows_per_program). Each entry's nope tiles as the rows 0..6 of an [8, 64]
    # block (row 7 masked: the rope, stored as bits), the entries' blocks stacked.
    pieces = tl.arange(0, ROWS * 8)
    entry = tl.program_id(0).to(tl.int64) * ROWS + pieces // 8
    tiles = pieces % 8
    in_range = entry < n_entries
    slot = tl.load(slot_ptr + entry, mask=in_range, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    data, scales = model1_entry_addresses(cache_ptr, tl.where(valid, slot, 0), block_size, block_stride)
    cols = tiles[:, None] * M1_TILE + tl.arange(0, M1_TILE)[None, :]
    nope_tile = tiles < M1_TILES
    nope = tl.load(kv_ptr + entry[:, None] * stride_kv + cols, mask=(in_range & nope_tile)[:, None],
                   other=0.0).to(tl.float32)
    codes, scale = pow2_quantize_rows(nope, MIN_SCALE_EXPONENT)
    tl.store(data[:, None] + cols, codes.to(tl.uint8), mask=(valid & nope_tile)[:, None])
    # ue8m0 byte = the float32 exponent field of the power-of-two scale; the pad byte (tile 7) is 0.
    exponent = tl.where(nope_tile, scale.to(tl.int32, bitcast=True) >> 23, 0)
    tl.store(scales + tiles, exponent.to(tl.uint8), mask=valid)

    entries = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    slots = tl.load(slot_ptr + entries, mask=entries < n_entries, other=-1).to(tl.int64)
    entry_valid = (slots >= 0) & (slots < num_slots)
    entry_data, _ = model1_entry_addresses(cache_ptr, tl.where(entry_valid, slots, 0), block_size, block_stride)
    rope_cols = tl.arange(0, M1_ROPE)[None, :]
    rope = tl.load((kv_ptr + entries[:, None] * stride_kv).to(tl.pointer_type(tl.int16)) + M1_NOPE + rope_cols,
                   mask=(entries < n_entries)[:, None])
    tl.store((entry_data[:, None] + M1_NOPE).to(tl.pointer_type(tl.int16)) + rope_cols, rope,
             mask=entry_valid[:, None])


def write_kv_model1(kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """
    Quantise new entries and scatter them into their cache slots, in place, in one launch.

    Byte-identical to quantize_kv_model1(kv) written at those slots of model1_cache_entries(kv_cache).

    Args:
        kv_cache: [num_blocks, B, 1, 584] uint8 MODEL1 cache view (model1_cache_geometry).
        kv: [..., 512] bfloat16, finite (nope 448 | rope 64); last dim contiguous.
        slots: [...] int32 or int64, kv's leading shape: the slot (page * B + offset) of each entry. Slots
            outside [0, num_blocks * B) (e.g. -1 for padding) are skipped. Two entries with the same slot
            leave one of them, unspecified which.

    Raises:
        minirt.errors.InputError: wrong dtype/shape/device.
    """
    geometry, compiled = per_signature(_WRITES, lambda: (described(kv_cache), described(kv), described(slots)),
                                       lambda: (_checked_write(kv_cache, kv, slots), {}))
    kv = rows_of(kv, formats.MODEL1_DIM)
    slots = flat_of(slots)
    if slots.numel() == 0:
        return
    n = slots.numel()
    rows = rows_per_program(n, formats.MODEL1_DIM)
    launch(_write_kv_model1_kernel, (cdiv(n, rows),), (kv_cache, kv, slots, n, geometry.block_size, geometry.num_slots,
                                                      geometry.block_stride, kv.stride(0)), dict(ROWS=rows), compiled)


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment) -> (the cache's
# geometry, the writer's compiled kernel): a signature seen before passed the checks.
_WRITES: dict = {}


def _checked_write(kv_cache, kv, slots) -> CacheGeometry:
    """write_kv_model1's input checks (InputError); the cache's geometry."""
    geometry = model1_cache_geometry(kv_cache)
    _check_kv(kv)
    check_slots(slots, kv.shape[:-1])
    check_device({"kv": kv, "slots": slots, "kv_cache": kv_cache})
    return geometry
