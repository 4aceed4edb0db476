"""Hopper (sm_90) fast path of sparse_mla_decode_fp8 over the MODEL1 (DeepSeek-V4) cache, written in Gluon.

The V32 decode kernels' design and code (sparse_mla_decode_sm90 for 64 heads a program,
sparse_mla_decode_sm90_few_heads for h_q <= 32) over another cache format: the consumers are theirs (with
no rope tile: K = V is the entry's 512 columns, so the scores take two MMAs, not three), the producer is
their produce_blocks with this module's four format functions, and the launch geometry, split partials
and merge are theirs.

A MODEL1 entry (minirt.formats): 576 data bytes (448 e4m3 in 7 tiles of 64 | 64 bf16 rope) in the
page's first B x 576 bytes, its 8-byte scale record (7 ue8m0 bytes, value 2^(byte - 127), and a pad byte)
after them. Each 64-value tile is one 128-byte column block of the bf16 key tiles: tiles 0..3 fill the
left tile (columns 0..255); tiles 4..6 and the rope the right one (256..511). A piece (16 keys) is loaded
as words in 16-byte vectors (tile 6 alone, 64 bytes a key, in 8-byte ones) and dequantised with the V32
integer dequantisation (an ue8m0 byte shifted into a bf16 exponent is the tile's scale exactly).

Two key sources feed one online softmax. A row's keys are the used entries of the main list
(topk_length[b], clamped to [0, topk]) then those of the extra list (extra_topk_length), as one list; a
top-k split takes entries lo..hi of it, as in the portable kernel. Its keys are blocks of 64 of the main
list's entries in that range, then of the extra list's, each list's last block padded with invalid ids
(a block holds keys of one cache). The producer replaces every invalid id (negative, past its cache,
past its length) by -1 before the consumers see it, and never dereferences one (its words come from its
cache's slot 0, with scales and rope 0).

Gluon has no interpreter: this kernel runs only on sm_90 GPUs (sparse_mla_decode_fp8 dispatches to it
for MODEL1 caches there, uses_sm90_kernel); the portable kernel runs everywhere else.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from minirt import formats

from ._launch import launch as launch_compiled
from .sparse_mla_decode_sm90 import (PIECE, ROPE_W, allocate_blocks, allocate_q, consumer_0, consumer_1,
                                     piece_words, produce_blocks, store_dequantised)
from .sparse_mla_decode_sm90_few_heads import consumer_t
from .sparse_mla_prefill_sm90 import BLOCK_H, BLOCK_N, D_ROPE, VEC_L, VEC_SMEM

NUM_WARPS = 4   # warps of the default partition; the others have 4 as well
DATA_BYTES = gl.constexpr(formats.MODEL1_DATA_BYTES)     # an entry's data record: 448 e4m3 | 64 bf16
SCALE_BYTES = gl.constexpr(formats.MODEL1_SCALE_BYTES)   # its scale record: 7 ue8m0 | pad
TILE_WORDS = gl.constexpr(formats.MODEL1_TILE // 4)      # 32-bit words of a 64-value e4m3 tile
BLOCK_WORDS = gl.constexpr(formats.MODEL1_TILE // 2)     # of a 64-column bf16 block (a tile dequantised)
MID_AT = gl.constexpr(4 * TILE_WORDS.value)              # word of tile 4 in the data record
TAIL_AT = gl.constexpr(6 * TILE_WORDS.value)             # word of tile 6
ROPE_AT = gl.constexpr(formats.MODEL1_NOPE_DIM // 4)     # word of the rope
# Tiles 0..3 of a piece as words [keys, 4, 16]: 16 threads read a key's 256 bytes in 16-byte vectors.
LEFT_L = gl.constexpr(gl.BlockedLayout([1, 1, 4], [2, 4, 4], [4, 1, 1], [2, 1, 0]))
# Tiles 4, 5 as words [keys, 2, 16]: 8 threads read a key's 128 bytes in 16-byte vectors.
MID_L = gl.constexpr(gl.BlockedLayout([1, 1, 4], [4, 2, 4], [4, 1, 1], [2, 1, 0]))
# Tile 6 as words [keys, 16]: 8 threads read a key's 64 bytes in 8-byte vectors (16-byte ones would take
# 4 threads a key, 64 keys' worth of threads for a piece's 16).
TAIL_L = gl.constexpr(gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0]))
KEYS_LEFT = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, LEFT_L)))
KEYS_MID = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, MID_L)))
KEYS_TAIL = gl.constexpr(gl.SliceLayout(1, TAIL_L))
KEYS_ROPE = gl.constexpr(gl.SliceLayout(1, ROPE_W))
# Runtime integers of the MODEL1 decode kernels (this one, sparse_mla_decode's portable one): only compared
# or multiplied (see sparse_mla_decode_sm90.RUNTIME_ARGS; q's and out's row strides stay specialised for
# their 16-byte alignment).
RUNTIME_ARGS = [
    "s_q", "h_q", "n_head_blocks", "topk", "extra_topk", "split_len", "block_size", "num_slots", "block_stride_16",
    "extra_block_size", "extra_num_slots", "extra_block_stride_16", "has_topk_length", "has_extra_topk_length",
    "has_sink", "stride_i_b", "stride_i_s", "stride_ei_b", "stride_ei_s", "stride_l_split", "stride_l_b",
    "stride_l_s", "stride_l_h"]
NO_SLOT_LIMIT = gl.constexpr(2 ** 31 - 1)   # the consumers' slot bound: the producer has masked the ids


@gluon.jit(do_not_specialize=RUNTIME_ARGS)
def _sparse_decode_model1_kernel(
    q_ptr, cache_ptr, indices_ptr, topk_length_ptr, extra_cache_ptr, extra_indices_ptr, extra_topk_length_ptr,
    batch_order_ptr, sink_ptr, out_ptr, lse_ptr,
    s_q, h_q, n_head_blocks, topk, extra_topk, split_len,
    block_size, num_slots, block_stride_16, extra_block_size, extra_num_slots, extra_block_stride_16,
    sm_scale_log2, has_topk_length, has_extra_topk_length, has_sink,
    stride_q_b, stride_q_s, stride_q_h,
    stride_i_b, stride_i_s, stride_ei_b, stride_ei_s,
    stride_o_split, stride_o_b, stride_o_s, stride_o_h,
    stride_l_split, stride_l_b, stride_l_s, stride_l_h,
    SPLIT: gl.constexpr, H: gl.constexpr,
):
    b, s, head0, span, n_steps = _program_span(
        n_head_blocks, s_q, topk, extra_topk, split_len, num_slots, extra_num_slots, has_topk_length,
        has_extra_topk_length, topk_length_ptr, extra_topk_length_ptr, batch_order_ptr, H)
    main_lo, main_hi, extra_lo, extra_hi, n_main, n_extra = span
    # What the producer's format functions read: per list (its row of slot ids, its cache's slot count,
    # the split's used entries lo..hi, the cache's geometry for _entry_addresses), and the blocks of each.
    source = ((indices_ptr + b * stride_i_b + s * stride_i_s, num_slots, main_lo, main_hi,
               (cache_ptr, block_size, block_stride_16)),
              (extra_indices_ptr + b * stride_ei_b + s * stride_ei_s, extra_num_slots, extra_lo, extra_hi,
               (extra_cache_ptr, extra_block_size, extra_block_stride_16)),
              n_main, n_extra)
    q_row = q_ptr + b * stride_q_b + s * stride_q_s
    out_row = out_ptr + gl.program_id(1) * stride_o_split + b * stride_o_b + s * stride_o_s
    lse_row = lse_ptr + gl.program_id(1) * stride_l_split + b * stride_l_b + s * stride_l_s
    # Shared memory as in the V32 kernels (the rope tiles of allocate_blocks hold only P here, and q's
    # rope buffer is unused): 218 KiB at 64 heads, 190 at 32.
    q_halves, q_rope = allocate_q(H)
    if H == BLOCK_H:
        blocks = allocate_blocks(2)
        load_ids = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)
        rescale = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
        row_stats = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(done, count=1)
        gl.warp_specialize([
            (consumer_0, (blocks, p_ready, q_row, stride_q_h, q_halves, q_rope, rescale, row_stats, done,
                          NO_SLOT_LIMIT, n_steps, head0, h_q, sm_scale_log2, sink_ptr, out_row, stride_o_h, lse_row,
                          stride_l_h, has_sink, SPLIT, False)),
            (consumer_1, (blocks, p_ready, q_halves, rescale, row_stats, done, n_steps, head0, h_q, sink_ptr, out_row,
                          stride_o_h, has_sink, SPLIT)),
            (producer, (blocks, load_ids, source, n_steps, 0, 1)),
        ], [4, 4], [160, 136])
    else:
        blocks = allocate_blocks(1)
        p_t = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, H],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, H], gl.bfloat16))
        load_ids_0 = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)   # each producer's own
        load_ids_1 = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], VEC_SMEM)
        gl.warp_specialize([
            (consumer_t, (blocks, p_t, q_row, stride_q_h, q_halves, q_rope, NO_SLOT_LIMIT, n_steps, head0, h_q,
                          sm_scale_log2, sink_ptr, out_row, stride_o_h, lse_row, stride_l_h, has_sink, SPLIT, False)),
            (producer, (blocks, load_ids_0, source, n_steps, 0, 2)),
            (producer, (blocks, load_ids_1, source, n_steps, 1, 2)),
        ], [4, 4], [136, 136])


@gluon.jit
def _used(topk, has_length, length_ptr, num_slots):
    """Indices of a source that a query row uses: topk, or its length clamped to [0, topk]; none when
    the cache has no slot (the producer's stand-in slot 0 would not exist)."""
    n_used = topk
    if has_length:
        n_used = gl.minimum(gl.maximum(gl.load(length_ptr), 0), topk)
    if num_slots == 0:
        n_used = 0
    return n_used


@gluon.jit
def _program_span(n_head_blocks, s_q, topk, extra_topk, split_len, num_slots, extra_num_slots, has_topk_length,
                  has_extra_topk_length, topk_length_ptr, extra_topk_length_ptr, batch_order_ptr,
                  heads: gl.constexpr):
    """(sequence b, query row s, first head, span, n_steps) of this program (axis 0: query rows x head
    blocks of `heads`, axis 1: top-k splits of split_len entries of the row's used entries, main then
    extra, as one list). span: the split's entries main_lo..main_hi of the main list and
    extra_lo..extra_hi of the extra one, and their blocks of 64, n_main and n_extra; n_steps = n_main +
    n_extra. With a length, programs take the sequences longest first (batch_order)."""
    pid = gl.program_id(0)
    row = pid // n_head_blocks
    b = row // s_q
    if has_topk_length + has_extra_topk_length > 0:
        b = gl.load(batch_order_ptr + b)
    b = b.to(gl.int64)
    s = (row % s_q).to(gl.int64)
    head0 = (pid % n_head_blocks) * heads
    main_used = _used(topk, has_topk_length, topk_length_ptr + b, num_slots)
    extra_used = _used(extra_topk, has_extra_topk_length, extra_topk_length_ptr + b, extra_num_slots)
    lo = gl.program_id(1) * split_len
    main_hi = gl.minimum(lo + split_len, main_used)
    extra_lo = gl.maximum(lo - main_used, 0)
    extra_hi = gl.minimum(lo + split_len - main_used, extra_used)
    n_main = gl.cdiv(gl.maximum(main_hi - lo, 0), BLOCK_N)
    n_extra = gl.cdiv(gl.maximum(extra_hi - extra_lo, 0), BLOCK_N)
    return b, s, head0, (lo, main_hi, extra_lo, extra_hi, n_main, n_extra), n_main + n_extra


@gluon.jit
def _is_extra(source, step):
    """Whether block `step` of the program comes from the extra cache. Blocks past the program's (the
    producer's loads run ahead) take a list whose cache has slots: the extra one if the program uses it."""
    main, extra, n_main, n_extra = source
    return (step >= n_main) & (n_extra > 0)


@gluon.jit
def _list_ids(index_list, block):
    """The 64 slot ids of block `block` of one list's entries lo..hi, -1 for every invalid one."""
    idx_row, num_slots, lo, hi, geometry = index_list
    offs = lo + block * BLOCK_N + gl.arange(0, BLOCK_N, VEC_L)
    ids = gl.load(idx_row + offs, mask=offs < hi, other=-1)
    return gl.where((ids >= 0) & (ids < num_slots), ids, -1)


@gluon.jit
def step_ids(source, step):
    """The 64 slot ids of block `step` (VEC_L), -1 for every invalid one: negative, past its cache's
    slots, past its list's used entries or the split (so past the program's blocks). source: see the
    kernel."""
    main, extra, n_main, n_extra = source
    if _is_extra(source, step):
        ids = _list_ids(extra, step - n_main)
    else:
        ids = _list_ids(main, step)
    return ids


@gluon.jit
def piece_ids(load_ids, mine, part: gl.constexpr):
    """The slot ids of a quarter block (keys part*16.. of the producer's block `mine`) in the layouts of
    its loads (tiles 0..3, tiles 4..6, rope), read a piece ahead of their use (see the V32 piece_ids)."""
    ids = load_ids.index(mine & 1).slice(part * PIECE, PIECE)
    return ids.load(KEYS_LEFT), ids.load(KEYS_MID), ids.load(KEYS_ROPE)


@gluon.jit
def _entry_addresses(ids, geometry):
    """(address of each slot's data record, of its scale record, validity) for ids from step_ids
    (-1 invalid: it points at slot 0). geometry: (cache_ptr, block_size, block_stride_16: the page stride
    / 16)."""
    cache_ptr, block_size, block_stride_16 = geometry
    valid = ids >= 0
    ids = gl.where(valid, ids, 0).to(gl.uint32)   # (unsigned division: fewer instructions)
    page = ids // block_size.to(gl.uint32)
    entry = (ids - page * block_size.to(gl.uint32)).to(gl.int64)
    page_base = cache_ptr + page.to(gl.int64) * block_stride_16 * 16
    return (page_base + entry * DATA_BYTES, page_base + block_size.to(gl.int64) * DATA_BYTES + entry * SCALE_BYTES,
            valid)


@gluon.jit
def load_piece(source, step, ids):
    """Registers of a quarter block of block `step` (ids: from piece_ids), each a 32-bit word tensor:
    tiles 0..3 [16, 4, 16] and scale word 0 (their 4 ue8m0 bytes) [16], tiles 4, 5 [16, 2, 16], tile 6
    [16, 16], scale word 1 (tiles 4..6) [16], rope (bf16 pairs) [16, 32]. An invalid slot's id is never
    dereferenced: its tiles come from slot 0 unmasked (as in the V32 producer), its scales and rope
    read as 0, so it dequantises to 0."""
    main, extra, n_main, n_extra = source
    left_ids, mid_ids, rope_ids = ids
    if _is_extra(source, step):
        idx_row, num_slots, lo, hi, geometry = extra
    else:
        idx_row, num_slots, lo, hi, geometry = main
    data, scales, valid = _entry_addresses(left_ids, geometry)
    tile = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, LEFT_L)))
    word = gl.arange(0, TILE_WORDS, gl.SliceLayout(0, gl.SliceLayout(1, LEFT_L)))
    left = gl.load(data.to(gl.pointer_type(gl.int32))[:, None, None] + tile[None, :, None] * TILE_WORDS
                   + word[None, None, :])
    left_scales = gl.load(scales.to(gl.pointer_type(gl.int32)), mask=valid, other=0)
    data, scales, valid = _entry_addresses(mid_ids, geometry)
    data = data.to(gl.pointer_type(gl.int32))
    tile = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(2, MID_L)))
    word = gl.arange(0, TILE_WORDS, gl.SliceLayout(0, gl.SliceLayout(1, MID_L)))
    mid = gl.load(data[:, None, None] + MID_AT + tile[None, :, None] * TILE_WORDS + word[None, None, :])
    right_scales = gl.load(scales.to(gl.pointer_type(gl.int32)) + 1, mask=valid, other=0)
    tail = gl.load(gl.convert_layout(data, KEYS_TAIL)[:, None] + TAIL_AT
                   + gl.arange(0, TILE_WORDS, gl.SliceLayout(0, TAIL_L))[None, :])
    data, scales, valid = _entry_addresses(rope_ids, geometry)
    rope = gl.load(data.to(gl.pointer_type(gl.int32))[:, None] + ROPE_AT
                   + gl.arange(0, D_ROPE // 2, gl.SliceLayout(0, ROPE_W))[None, :], mask=valid[:, None], other=0)
    return left, left_scales, mid, right_scales, tail, rope


@gluon.jit
def _scale_pairs(scale_bytes):
    """ue8m0 scale bytes (int32, 0..255) -> the scales as bf16x2: the byte is a bf16's exponent field."""
    bits = scale_bytes << 7
    return bits | (bits << 16)


@gluon.jit
def fill(piece, blocks, buf, part: gl.constexpr):
    """Store a piece (load_piece) into rows part*16.. of buffer buf's left tile (tiles 0..3) and right
    tile (tiles 4..6 and the rope, one 128-byte column block each)."""
    k_left, k_right, k_rope, key_ids, ready, free = blocks
    left, left_scales, mid, right_scales, tail, rope = piece
    # (The scale bytes are taken apart here, at their first use: see the V32 fill.)
    shifts = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, LEFT_L))) * 8
    store_dequantised(left, _scale_pairs((left_scales[:, None] >> shifts[None, :]) & 0xFF),
                      piece_words(k_left.index(buf), part))
    right = piece_words(k_right.index(buf), part)
    shifts = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(2, MID_L))) * 8
    store_dequantised(mid, _scale_pairs((right_scales[:, None] >> shifts[None, :]) & 0xFF),
                      right.slice(0, 2 * BLOCK_WORDS, 1))
    store_dequantised(tail, _scale_pairs((gl.convert_layout(right_scales, KEYS_TAIL) >> 16) & 0xFF),
                      right.slice(2 * BLOCK_WORDS, BLOCK_WORDS, 1))
    right.slice(3 * BLOCK_WORDS, BLOCK_WORDS, 1).store(rope)


@gluon.jit
def producer(blocks, load_ids, source, n_steps, first, STRIDE: gl.constexpr):
    """produce_blocks of the MODEL1 cache; source: see the kernel."""
    produce_blocks(blocks, load_ids, source, n_steps, first, STRIDE, step_ids, piece_ids, load_piece, fill)


def launch(grid, args, split: bool, heads: int, compiled: dict) -> None:
    """Run the kernel on the runtime arguments that sparse_mla_decode_fp8 builds for both MODEL1 decode
    kernels (this one's parameters before SPLIT, in order) over grid (query rows x head blocks of `heads`,
    top-k splits); split: write partial results (fp32 out, base-2 lse) for sparse_mla_decode's merge
    kernel; heads: 64, or h_q <= 32 rounded up to 16 or 32 (sparse_mla_decode_sm90_few_heads.program_heads);
    compiled: the call signature's compiled kernels (minirt.kernels._launch.launch)."""
    # maxnreg as in the V32 kernels (12 warps x 168 registers fit the register file at launch).
    launch_compiled(_sparse_decode_model1_kernel, grid, args, dict(SPLIT=split, H=heads, num_warps=NUM_WARPS, maxnreg=168),
                    compiled)
