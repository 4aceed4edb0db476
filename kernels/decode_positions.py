"""A V3.2 decode step's positions, rope angles and cache slots in one launch.

Each sequence decodes one token at its cached length: its position, the rope tables' rows there and the
paged cache slot it is written to. In torch that is about ten small launches a step (the positions'
copy, two table gathers, the block-table lookup and its integer arithmetic); here one program does a
block of sequences.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.errors import InputError

from ._common import check_device, paged_slot
from ._launch import Kept, cdiv, described, launch, per_signature

_BLOCK_B = 16   # sequences a program


@triton.jit(do_not_specialize=["batch", "max_blocks", "block_size", "num_blocks", "stride_table", "stride_cos",
                               "stride_sin"])
def _decode_positions_kernel(seq_lens_ptr, table_ptr, cos_table_ptr, sin_table_ptr, pos_ptr, cos_ptr, sin_ptr,
                             slot_ptr, batch, max_blocks, block_size, num_blocks, stride_table, stride_cos, stride_sin,
                             PAIRS: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    in_batch = rows < batch
    pos = tl.load(seq_lens_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    tl.store(pos_ptr + rows, pos, mask=in_batch)
    # The slot through the block table; -1 (skipped by the cache writers) past the table or on an unallocated page.
    slot = paged_slot(table_ptr + rows.to(tl.int64) * stride_table, pos, in_batch, max_blocks, block_size, num_blocks)
    tl.store(slot_ptr + rows, slot, mask=in_batch)
    pair = tl.arange(0, PAIRS)
    at = tl.where(in_batch, pos, 0)[:, None]
    out = rows.to(tl.int64)[:, None] * PAIRS + pair[None, :]
    tl.store(cos_ptr + out, tl.load(cos_table_ptr + at * stride_cos + pair[None, :], mask=in_batch[:, None])
             .to(tl.float32), mask=in_batch[:, None])
    tl.store(sin_ptr + out, tl.load(sin_table_ptr + at * stride_sin + pair[None, :], mask=in_batch[:, None])
             .to(tl.float32), mask=in_batch[:, None])


def decode_positions(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, num_blocks: int,
                     cos_table: torch.Tensor, sin_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    For each of b sequences decoding one token at its cached length: the token's position, the rope
    tables' rows at it and its cache slot, in one launch (no host synchronisation: CUDA-graph capturable).

    Args:
        seq_lens: [b] int32 or int64, the tokens each sequence holds (the new token's position).
        block_table: [b, max_blocks] int32, page ids of each sequence (-1: unallocated), unit column stride.
        block_size: tokens a page, a positive int.
        num_blocks: the cache's pages, a positive int (a table entry outside [0, num_blocks): unallocated).
        cos_table, sin_table: [P, r / 2] float rope tables by position (read as fp32), unit last stride;
            every seq_lens[i] must be < P (not checked on the device).

    Returns:
        positions [b] int64 (seq_lens' values), cos and sin [b, r / 2] float32 (the tables' rows at them),
        slots [b] int64: block_table[i, p // block_size] · block_size + p % block_size, or -1 where p is
        past the table or its page is unallocated or outside the cache (the cache writers skip such slots).

    Raises:
        minirt.errors.InputError: wrong dtypes, shapes or strides, or a device the kernels cannot use.
    """
    kept = per_signature(_STEPS, lambda: (described(seq_lens), described(block_table), block_size.__class__, block_size,
                                          num_blocks.__class__, num_blocks, described(cos_table), described(sin_table)),
                         lambda: _check(seq_lens, block_table, block_size, num_blocks, cos_table, sin_table) or Kept())
    b, pairs = seq_lens.shape[0], cos_table.shape[1]
    positions = torch.empty(b, dtype=torch.int64, device=seq_lens.device)
    slots = torch.empty(b, dtype=torch.int64, device=seq_lens.device)
    cos, sin = (torch.empty(b, pairs, device=seq_lens.device) for _ in range(2))
    if kept.args is None:
        kept.args = ((cdiv(b, _BLOCK_B),), (b, block_table.shape[1], block_size, num_blocks,
                                            block_table.stride(0), cos_table.stride(0), sin_table.stride(0)),
                     dict(PAIRS=pairs, BLOCK_B=_BLOCK_B, num_warps=1))
    grid, integers, constexprs = kept.args
    if b:
        launch(_decode_positions_kernel, grid, (seq_lens, block_table, cos_table, sin_table, positions, cos, sin, slots,
                                                *integers), constexprs, kept.compiled)
    return positions, cos, sin, slots


# Call signature (the tensors' classes, dtypes, shapes, strides, devices and alignment, block_size, num_blocks) -> its
# Kept: a signature seen before passed the checks.
_STEPS: dict = {}


def _check(seq_lens, block_table, block_size, num_blocks, cos_table, sin_table) -> None:
    """decode_positions' input checks (InputError)."""
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or \
            seq_lens.dtype not in (torch.int32, torch.int64):
        raise InputError(f"seq_lens must be an int32 / int64 tensor [b], got "
                         f"{getattr(seq_lens, 'dtype', type(seq_lens).__name__)} "
                         f"{tuple(getattr(seq_lens, 'shape', ()))}")
    b = seq_lens.shape[0]
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != b or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise InputError(f"block_table must be an int32 tensor [{b}, max_blocks] with unit column stride")
    for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point() or \
                table.shape != cos_table.shape or table.stride(1) != 1 or table.shape[1] & (table.shape[1] - 1):
            raise InputError(f"{name} must be a float table [P, r / 2] like cos_table, r / 2 a power of two, "
                             f"unit last stride; got {tuple(getattr(table, 'shape', ()))}")
    check_device({"seq_lens": seq_lens, "block_table": block_table, "cos_table": cos_table, "sin_table": sin_table})
