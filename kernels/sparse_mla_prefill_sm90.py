"""Hopper (sm_90) fast path of sparse_mla_prefill, written in Gluon (Triton's explicit-layout dialect).

Same semantics as the portable Triton kernel in sparse_mla_prefill.py, for d_v 512 and d_qk 576 (V3.2:
512 latent + 64 rope) or 512 (V4: the rope sits inside the 512 columns, so K and V are the same
columns). A tile = one query token x 64 heads; a program takes tiles in turn (one program an SM at a
time: as many as SMs, or where rows have unequal topk_length programs of two tiles, one a tile where
tiles are few: grid_programs), and is warp-specialised into three warpgroups that meet at mbarriers, so
the tensor cores keep working while a warpgroup runs its softmax:

- the producer gathers a tile's q rows first, then the key rows of two 64-key blocks (A, B) per
  step, all with cp.async, the keys in four pieces (A left, A right, B right, B left: left = latent
  columns 0..255, right = 256..511 plus the rope), each refilled as soon as its readers release it;
- consumer 0 computes the scores of block A, consumer 1 those of block B (64 x 64 each, all of d_qk);
- for O = P.V each consumer owns 256 of the 512 output columns and multiplies both blocks' P: its own
  from registers, the other's through shared memory. The running max is chained: consumer 0's max
  (old max and block A) goes to consumer 1, whose max (and block B) comes back as the step's max.

So consumer 1's score MMAs run during consumer 0's softmax, and each one's P.V during the other's
exchange. Between tiles, the producer loads the next tile's q as soon as both consumers' last scores are
done, and block A's pieces while the consumers store the output (staged in block B's buffers). The
schedule within a tile is FlashMLA's sm90 sparse prefill (csrc/sm90/prefill/sparse/phase1.cuh), written
here in Gluon from its description. What decides the speed in Gluon is register pressure: the three
partitions share 512 registers per thread slot (consumer 0 / consumer 1 / producer: 232 / 192 / 80 here),
and nothing may spill (docs/perf/prefill.md: 222 TFLOP/s with spills, 439 without).

Gluon has no interpreter: this kernel runs only on sm_90 GPUs. sparse_mla_prefill dispatches to it
there (uses_sm90_kernel) and to the portable kernel everywhere else (CPU interpreter, other GPUs, other
head dims, an explicit PrefillConfig).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from minirt import formats

from ._common import is_sm90, num_sms
from ._launch import cdiv, launch as launch_compiled

BLOCK_H = gl.constexpr(64)                        # heads per program: one wgmma M tile
BLOCK_N = gl.constexpr(64)                        # keys per block; a step takes two blocks
HALF = gl.constexpr(formats.KV_LATENT_DIM // 2)   # latent columns per piece and per consumer's output
D_ROPE = gl.constexpr(formats.KV_ROPE_DIM)
LOG2E = gl.constexpr(formats.LOG2E)
LN2 = gl.constexpr(formats.LN2)
# The running max starts finite: exp2(start - start) = 1, never exp2(-inf - -inf) = NaN, so a fully
# masked block needs no guard; masked scores are -inf and weigh 0. (No real logit in base 2 is below.)
NO_MAX = gl.constexpr(-1.0e30)
# Tiles a program takes where rows have unequal topk_length (at least one program an SM): few enough that
# the hardware, dealing each next program to the SM that ends first, evens out the programs' ends.
TILES_PER_PROGRAM_UNEQUAL = 2
# Below this many tiles an SM, rows of unequal topk_length get one program a tile: programs of two would
# leave their last wave on a few SMs (at 333 tiles, 35 of 167 programs).
MIN_TILES_PER_SM_UNEQUAL = 8

# Every partition has 4 warps (one warpgroup).
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L.value, k_width=2))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_L.value))   # per-head vectors of the softmax
COL_S = gl.constexpr(gl.SliceLayout(0, S_L.value))   # per-key vectors of the scores
ROW_O = gl.constexpr(gl.SliceLayout(1, O_L.value))   # per-head vectors of the output
# Register layouts of copies, 16-byte vectors along the contiguous dim: HALF_L a warp a row of 256 values;
# SEGMENT_L 8 threads a row's 64-value segment, 4 rows a warp (the key gathers: a thread holds 4 of a
# block's row addresses instead of 16, 1.03-1.13x; and the rope's [rows, 64] copies).
HALF_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
SEGMENT_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
VEC_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
VEC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
OUT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

# Buffers of blocks A and B. A piece is (buffer, half), half 0 = left, 1 = right; its ready and free
# barriers sit at slot 2 * buffer + half.
A = gl.constexpr(0)
B = gl.constexpr(1)
LEFT = gl.constexpr(0)
RIGHT = gl.constexpr(1)
# Exchanges between the consumers: max of consumer 0 / 1, P of block A / B stored, row sums; and the
# producer's kv row indices of a step (two slots: steps alternate).
M0, M1, PA, PB, L0, L1, ROWS = (gl.constexpr(i) for i in range(7))
# q in shared memory (the producer's cp.async copies of it have landed), after the two ROWS slots; q's
# buffers free again (both consumers' last scores of a tile are done).
Q_READY = gl.constexpr(8)
Q_FREE = gl.constexpr(9)


@gluon.jit(do_not_specialize=["s_kv", "h_q", "topk", "n_head_blocks", "n_tiles"])
def _sparse_mla_prefill_sm90_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, attn_sink_ptr,
    out_ptr, max_logits_ptr, lse_ptr,
    s_kv, h_q, topk, n_head_blocks, n_tiles, sm_scale_log2,
    stride_q_s, stride_q_h, stride_kv_s, stride_idx_s, stride_idx_k, stride_tl_s, stride_sink_h,
    stride_o_s, stride_o_h, stride_o_d, stride_ml_s, stride_ml_h, stride_lse_s, stride_lse_h,
    HAS_TOPK_LENGTH: gl.constexpr, HAS_ATTN_SINK: gl.constexpr, HAS_ROPE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype)
    TILE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
    # Shared memory, 226 KiB at d_qk 576: q (72), two key blocks (144), P of block B (8). P of block
    # A lives in block A's rope tile, free once A's scores are done (FlashMLA does the same). q is
    # [2, ...] and [1, ...] so that the loops can index it with an opaque zero (see opaque_zero).
    q_halves = gl.allocate_shared_memory(dtype, [2, BLOCK_H, HALF], HALF_SMEM)
    k_left = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], HALF_SMEM)
    k_right = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], HALF_SMEM)
    p_b = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], TILE_SMEM)
    if HAS_ROPE:
        q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], TILE_SMEM)
        k_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_ROPE], TILE_SMEM)
        p_a = p_b          # unused: P of block A lives in its rope tile
    else:
        q_rope = k_left    # unused placeholders: every use sits under HAS_ROPE
        k_rope = k_left
        p_a = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], TILE_SMEM)
    row_max = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC_SMEM)
    row_sums = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SMEM)
    key_rows = gl.allocate_shared_memory(gl.int32, [4, BLOCK_N], VEC_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [10, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        # Every producer thread arrives once its own copies have landed (cp.async's noinc arrive).
        mbarrier.init(ready.index(i), count=128)
        mbarrier.init(free.index(i), count=1)
    for i in gl.static_range(8):
        mbarrier.init(sync.index(i), count=1)
    mbarrier.init(sync.index(Q_READY), count=128)
    mbarrier.init(sync.index(Q_FREE), count=2)   # one arrive a consumer

    smem = (q_halves, q_rope, k_left, k_right, k_rope, p_a, p_b, row_max, row_sums, key_rows, ready, free, sync)
    tiles = (n_tiles, n_head_blocks, topk, topk_length_ptr, stride_tl_s)
    # The tuples are written out in the call: a tuple bound to a name first would turn its
    # constexprs into tensors.
    gl.warp_specialize([
        (_consumer_a, (smem, tiles, attn_sink_ptr, out_ptr, s_kv, h_q, sm_scale_log2, stride_sink_h,
                       stride_o_s, stride_o_h, stride_o_d, HAS_TOPK_LENGTH, HAS_ATTN_SINK, HAS_ROPE)),
        (_consumer_b, (smem, tiles, attn_sink_ptr, out_ptr, max_logits_ptr, lse_ptr, s_kv, h_q,
                       sm_scale_log2, stride_sink_h, stride_o_s, stride_o_h, stride_o_d, stride_ml_s, stride_ml_h,
                       stride_lse_s, stride_lse_h, HAS_TOPK_LENGTH, HAS_ATTN_SINK, HAS_ROPE)),
        (_producer, (smem, tiles, q_ptr, stride_q_s, stride_q_h, h_q, kv_ptr, indices_ptr, s_kv, stride_kv_s,
                     stride_idx_s, stride_idx_k, HAS_TOPK_LENGTH, HAS_ROPE)),
    ], [4, 4], [192, 80])


@gluon.jit
def _tile_count(tiles):
    """How many tiles this program takes: tiles program_id, program_id + programs, ... below n_tiles."""
    return gl.cdiv(tiles[0] - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _tile(it, tiles, HAS_TOPK_LENGTH: gl.constexpr):
    """(token, head0, n_keys, n_steps) of the program's tile `it` (its tiles: program_id + it * programs):
    its query token, its first head, its valid top-k entries and its steps of two key blocks."""
    n_tiles, n_head_blocks, topk, topk_length_ptr, stride_tl_s = tiles
    tile = gl.program_id(0) + it * gl.num_programs(0)
    token = (tile // n_head_blocks).to(gl.int64)
    head0 = (tile % n_head_blocks) * BLOCK_H
    n_keys = topk
    if HAS_TOPK_LENGTH:
        n_keys = gl.minimum(gl.maximum(gl.load(topk_length_ptr + token * stride_tl_s), 0), topk)
    return token, head0, n_keys, gl.cdiv(n_keys, 2 * BLOCK_N)


@gluon.jit
def load_q(q_row, stride_q_h, head0, h_q, q_halves, q_rope, HAS_ROPE: gl.constexpr):
    """Heads head0.. of one query row (q_row: its head 0; latent | rope contiguous per head) into
    q_halves [2, heads, 256] and, HAS_ROPE, q_rope [1, heads, 64], fenced for the tensor cores; heads >= h_q
    become zero rows."""
    _load_q_half(q_row, stride_q_h, head0, h_q, 0, q_halves.index(0))
    _load_q_half(q_row, stride_q_h, head0, h_q, HALF, q_halves.index(1))
    if HAS_ROPE:
        h = head0 + gl.arange(0, q_rope.shape[1], gl.SliceLayout(1, SEGMENT_L))
        q_rope.index(0).store(gl.load(q_row + h[:, None] * stride_q_h + 2 * HALF
                                      + gl.arange(0, D_ROPE, gl.SliceLayout(0, SEGMENT_L))[None, :],
                                      mask=(h < h_q)[:, None], other=0.0))
    fence_async_shared()


@gluon.jit
def _load_q_half(q_row, stride_q_h, head0, h_q, col0, dst):
    """Latent columns col0..col0+255 of heads head0.. into dst [heads, 256]; heads >= h_q become zero rows."""
    h = head0 + gl.arange(0, dst.shape[0], gl.SliceLayout(1, HALF_L))
    dst.store(gl.load(q_row + h[:, None] * stride_q_h + col0 + gl.arange(0, HALF, gl.SliceLayout(0, HALF_L))[None, :],
                      mask=(h < h_q)[:, None], other=0.0))


@gluon.jit
def _block_indices(idx_row, stride_idx_k, block, n_keys, LAYOUT: gl.constexpr):
    """The 64 kv row indices of key block `block` of a token's top-k (idx_row: its first) in a 1-D layout;
    -1 at and past n_keys."""
    offs = block * BLOCK_N + gl.arange(0, BLOCK_N, LAYOUT)
    return gl.load(idx_row + offs * stride_idx_k, mask=offs < n_keys, other=-1)


@gluon.jit
def _producer(smem, tiles, q_ptr, stride_q_s, stride_q_h, h_q, kv_ptr, indices_ptr, s_kv, stride_kv_s, stride_idx_s,
              stride_idx_k, HAS_TOPK_LENGTH: gl.constexpr, HAS_ROPE: gl.constexpr):
    """Per tile: gather its q rows, then the kv rows of blocks A and B of each step, piece by piece, each
    into its buffer once the consumers have released it (block A first: its right piece, released last, is
    on consumer 0's path to its next scores). Invalid rows are never read: the masked copies zero-fill.
    Barrier phases count steps over all of the program's tiles (done: the steps of its tiles before)."""
    q_halves, q_rope, k_left, k_right, k_rope, p_a, p_b, row_max, row_sums, key_rows, ready, free, sync = smem
    done = 0
    for it in range(_tile_count(tiles)):
        token, head0, n_keys, n_steps = _tile(it, tiles, HAS_TOPK_LENGTH)
        idx_row = indices_ptr + token * stride_idx_s
        rows_a = _block_indices(idx_row, stride_idx_k, 0, n_keys, VEC_L)
        rows_b = _block_indices(idx_row, stride_idx_k, 1, n_keys, VEC_L)
        # q with the same copies as the keys, once the last tile's scores are done with its buffers (its
        # latency then overlaps that tile's last P.V and output).
        mbarrier.wait(sync.index(Q_FREE), (it & 1) ^ 1)   # a fresh barrier counts as released
        _gather_q(q_ptr + token * stride_q_s, stride_q_h, head0, h_q, q_halves, q_rope, sync.index(Q_READY), HAS_ROPE)
        for step in range(n_steps):
            g = done + step
            parity = (g & 1) ^ 1
            slot = g & 1
            # The step's kv row indices, for the consumers' masks and this partition's gathers; double-
            # buffered by step: slot `slot` was last read two steps ago, and this producer passed the
            # barriers of the step between, which both consumers' masking precedes.
            key_rows.index(2 * slot).store(rows_a)
            key_rows.index(2 * slot + 1).store(rows_b)
            publish_done(sync.index(ROWS + slot))
            # The next step's indices load behind this step's gathers (loaded just before their use,
            # their latency stalled every gather).
            rows_a = _block_indices(idx_row, stride_idx_k, 2 * step + 2, n_keys, VEC_L)
            rows_b = _block_indices(idx_row, stride_idx_k, 2 * step + 3, n_keys, VEC_L)
            mbarrier.wait(free.index(2 * A + LEFT), parity)
            _gather(kv_ptr, stride_kv_s, s_kv, key_rows.index(2 * slot), 0, k_left.index(A), k_rope, A, False,
                    ready.index(2 * A + LEFT))
            mbarrier.wait(free.index(2 * A + RIGHT), parity)
            _gather(kv_ptr, stride_kv_s, s_kv, key_rows.index(2 * slot), HALF, k_right.index(A), k_rope, A, HAS_ROPE,
                    ready.index(2 * A + RIGHT))
            mbarrier.wait(free.index(2 * B + RIGHT), parity)
            _gather(kv_ptr, stride_kv_s, s_kv, key_rows.index(2 * slot + 1), HALF, k_right.index(B), k_rope, B,
                    HAS_ROPE, ready.index(2 * B + RIGHT))
            mbarrier.wait(free.index(2 * B + LEFT), parity)
            _gather(kv_ptr, stride_kv_s, s_kv, key_rows.index(2 * slot + 1), 0, k_left.index(B), k_rope, B, False,
                    ready.index(2 * B + LEFT))
        done += n_steps


@gluon.jit
def _gather(kv_ptr, stride_kv_s, s_kv, block_rows, col0, dst, k_rope, buf, WITH_ROPE: gl.constexpr, ready_bar):
    """cp.async latent columns col0..col0+255 of the kv rows block_rows (shared, one key block) into
    dst (and their rope columns into k_rope[buf] when WITH_ROPE), then have ready_bar count this
    thread's arrival once its copies have landed. Invalid rows are never read: masked copies zero-fill."""
    rows = block_rows.load(gl.SliceLayout(1, SEGMENT_L))
    valid = (rows >= 0) & (rows < s_kv)
    src = kv_ptr + gl.where(valid, rows, 0).to(gl.int64) * stride_kv_s + col0
    cp.async_copy_global_to_shared(dst, src[:, None] + gl.arange(0, HALF, gl.SliceLayout(0, SEGMENT_L))[None, :],
                                   mask=valid[:, None])
    if WITH_ROPE:
        # The same rows in the same layout: the latent copy's addresses, moved to the rope columns.
        rope = src + (2 * HALF - col0)
        cp.async_copy_global_to_shared(k_rope.index(buf),
                                       rope[:, None] + gl.arange(0, D_ROPE, gl.SliceLayout(0, SEGMENT_L))[None, :],
                                       mask=valid[:, None])
    cp.mbarrier_arrive(ready_bar, increment_count=False)


@gluon.jit
def _gather_q(q_row, stride_q_h, head0, h_q, q_halves, q_rope, bar, HAS_ROPE: gl.constexpr):
    """cp.async heads head0.. of one query row (latent | rope contiguous per head) into q_halves [2, heads, 256]
    and, HAS_ROPE, q_rope [1, heads, 64], then have bar count this thread's arrival once they have landed;
    heads >= h_q become zero rows (masked copies zero-fill, their addresses clamped to head 0)."""
    h = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, HALF_L))
    rows = q_row + gl.where(h < h_q, h, 0).to(gl.int64)[:, None] * stride_q_h
    cols = gl.arange(0, HALF, gl.SliceLayout(0, HALF_L))[None, :]
    cp.async_copy_global_to_shared(q_halves.index(0), rows + cols, mask=(h < h_q)[:, None])
    cp.async_copy_global_to_shared(q_halves.index(1), rows + HALF + cols, mask=(h < h_q)[:, None])
    if HAS_ROPE:
        h = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, SEGMENT_L))
        rows = q_row + gl.where(h < h_q, h, 0).to(gl.int64)[:, None] * stride_q_h + 2 * HALF
        rope_cols = gl.arange(0, D_ROPE, gl.SliceLayout(0, SEGMENT_L))[None, :]
        cp.async_copy_global_to_shared(q_rope.index(0), rows + rope_cols, mask=(h < h_q)[:, None])
    cp.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def wait_piece(ready, slot, parity):
    """Wait until a piece has landed; cp.async writes through the generic proxy, wgmma reads through
    the async one, hence the fence."""
    mbarrier.wait(ready.index(slot), parity)
    fence_async_shared()


@gluon.jit
def score_piece(q, k, s, first: gl.constexpr):
    return warpgroup_mma(q, k.permute((1, 0)), s, use_acc=not first, is_async=True)


@gluon.jit
def _masked_scores(s, key_rows, sync, step, role: gl.constexpr, s_kv, sm_scale_log2):
    """Scores in base 2 (times sm_scale_log2), -inf where the key's kv row index (from the producer,
    role: block A 0, B 1) is invalid. Read from shared memory: loaded here, the indices would hold 16
    addresses per thread."""
    mbarrier.wait(sync.index(ROWS + (step & 1)), (step >> 1) & 1)
    rows = key_rows.index(2 * (step & 1) + role).load(COL_S)
    return gl.where(((rows >= 0) & (rows < s_kv))[None, :], s * sm_scale_log2, float("-inf"))


@gluon.jit
def publish_done(bar):
    """Signal bar once every warp of this partition has passed here (with its shared-memory stores:
    the arrive releases them to the partition that waits)."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def publish(buf, value, bar):
    """Store an MMA operand for the other consumer and signal bar: the fence hands the stores over to
    the tensor cores' (async) proxy. Only operands need it: it also waits for this thread's
    outstanding memory operations."""
    buf.store(value)
    fence_async_shared()
    publish_done(bar)


@gluon.jit
def _consumer_a(smem, tiles, attn_sink_ptr, out_ptr, s_kv, h_q, sm_scale_log2, stride_sink_h, stride_o_s, stride_o_h,
                stride_o_d, HAS_TOPK_LENGTH: gl.constexpr, HAS_ATTN_SINK: gl.constexpr, HAS_ROPE: gl.constexpr):
    """Per tile: scores of block A; output columns 0..255."""
    q_halves, q_rope, k_left, k_right, k_rope, p_a, p_b, row_max, row_sums, key_rows, ready, free, sync = smem
    done = 0      # steps of the program's tiles before (barrier phases count steps over all tiles)
    summed = 0    # tiles before with steps (the row sums' exchanges)
    for it in range(_tile_count(tiles)):
        token, head0, n_keys, n_steps = _tile(it, tiles, HAS_TOPK_LENGTH)
        m_i = gl.full([BLOCK_H], NO_MAX, gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        wait_piece(sync, Q_READY, it & 1)
        if n_steps > 0:
            s = _scores_a(q_halves, q_rope, k_left, k_right, k_rope, ready, s, done & 1, opaque_zero(done), HAS_ROPE)
            s = warpgroup_mma_wait(0, deps=(s,))
        for step in range(n_steps):
            g = done + step
            parity = g & 1
            a = opaque_zero(g)     # buffer A (0), and B (a + 1)
            b = a + 1
            # The tile's last scores are done: q's buffers go to the next tile's q.
            mbarrier.arrive(sync.index(Q_FREE), pred=step + 1 == n_steps)
            s = _masked_scores(s, key_rows, sync, g, 0, s_kv, sm_scale_log2)
            m_a = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_a)
            p = gl.exp2(s - m_a[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            row_max.store(m_a)
            publish_done(sync.index(M0))
            # P is rounded to the operand dtype for the tensor cores, as in FlashMLA.
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(p_b.dtype), P_L), k_left.index(a), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(free.index(2 * A + LEFT))

            # Consumer 1 folds block B into the max; P of A moves to that max and goes to consumer 1.
            mbarrier.wait(sync.index(M1), parity)
            m_ab = row_max.load(ROW_S)
            rescale = gl.exp2(m_a - m_ab)
            m_i = m_ab
            publish(_p_a_tile(p_a, k_rope, a, HAS_ROPE), (p * rescale[:, None]).to(p_b.dtype), sync.index(PA))
            l_i = l_i * rescale
            acc = acc * gl.convert_layout(rescale, ROW_O)[:, None]
            mbarrier.wait(sync.index(PB), parity)
            # (Each branch issues P.V itself: a value of a runtime branch must keep its type, and an
            # issued MMA's result is not yet a tensor.)
            if step + 1 < n_steps:
                # The next step's scores are issued behind this P.V, block B's left piece released as soon
                # as the P.V is done (with the left score MMA pending), before block A's right piece has
                # arrived: the producer refills B's left piece for consumer 1's next scores while A's right
                # one lands.
                acc = warpgroup_mma(p_b, k_left.index(b), acc, is_async=True)
                wait_piece(ready, 2 * A + LEFT, parity ^ 1)
                s = score_piece(q_halves.index(a), k_left.index(a), s, True)
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(free.index(2 * B + LEFT))
                s = _scores_a_right(q_halves, q_rope, k_right, k_rope, ready, s, parity ^ 1, a, HAS_ROPE)
                s = warpgroup_mma_wait(0, deps=(s,))
            else:
                # (Block B's left piece stays held: the output is staged there.)
                acc = warpgroup_mma(p_b, k_left.index(b), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
        out_row = out_ptr + token * stride_o_s
        if n_steps > 0:
            l_i = _total_row_sums(l_i, row_sums, sync, summed & 1, 0)
            store_out(acc, m_i, l_i, 0, k_left.index(B), attn_sink_ptr, stride_sink_h, out_row, stride_o_h,
                      stride_o_d, head0, h_q, HAS_ATTN_SINK, False)
            publish_done(free.index(2 * B + LEFT))
            summed += 1
        else:
            mbarrier.arrive(sync.index(Q_FREE))
            store_zeros(out_row, stride_o_h, stride_o_d, 0, head0, h_q)
        done += n_steps


@gluon.jit
def opaque_zero(step):
    """0 for every real step (< 2^30), but not a constant to the compiler. Buffer indices built on it
    keep the wgmma descriptors inside the loop: with constant indices they are loop-invariant, hoisted
    out of it, and ~100 of them spill (a consumer at 208 registers spilled 235 times)."""
    return step >> 30


@gluon.jit
def _scores_a(q_halves, q_rope, k_left, k_right, k_rope, ready, s, parity, a, HAS_ROPE: gl.constexpr):
    """Issue the score MMAs of block A (left piece first: the producer fills it first)."""
    wait_piece(ready, 2 * A + LEFT, parity)
    s = score_piece(q_halves.index(a), k_left.index(a), s, True)
    return _scores_a_right(q_halves, q_rope, k_right, k_rope, ready, s, parity, a, HAS_ROPE)


@gluon.jit
def _scores_a_right(q_halves, q_rope, k_right, k_rope, ready, s, parity, a, HAS_ROPE: gl.constexpr):
    """Issue the score MMAs of block A's right piece (and rope), accumulating into s."""
    wait_piece(ready, 2 * A + RIGHT, parity)
    s = score_piece(q_halves.index(a + 1), k_right.index(a), s, False)
    if HAS_ROPE:
        s = score_piece(q_rope.index(a), k_rope.index(a), s, False)
    return s


@gluon.jit
def _p_a_tile(p_a, k_rope, a, HAS_ROPE: gl.constexpr):
    """Where P of block A goes: block A's rope tile (its scores are done) when there is one."""
    if HAS_ROPE:
        return k_rope.index(a)
    else:
        return p_a


@gluon.jit
def _consumer_b(smem, tiles, attn_sink_ptr, out_ptr, max_logits_ptr, lse_ptr, s_kv, h_q, sm_scale_log2, stride_sink_h,
                stride_o_s, stride_o_h, stride_o_d, stride_ml_s, stride_ml_h, stride_lse_s, stride_lse_h,
                HAS_TOPK_LENGTH: gl.constexpr, HAS_ATTN_SINK: gl.constexpr, HAS_ROPE: gl.constexpr):
    """Per tile: scores of block B; output columns 256..511; writes max_logits and lse."""
    q_halves, q_rope, k_left, k_right, k_rope, p_a, p_b, row_max, row_sums, key_rows, ready, free, sync = smem
    done = 0      # as in _consumer_a
    summed = 0
    for it in range(_tile_count(tiles)):
        token, head0, n_keys, n_steps = _tile(it, tiles, HAS_TOPK_LENGTH)
        m_i = gl.full([BLOCK_H], NO_MAX, gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_L)
        wait_piece(sync, Q_READY, it & 1)
        for step in range(n_steps):
            g = done + step
            parity = g & 1
            a = opaque_zero(g)     # buffer A (0), and B (a + 1)
            b = a + 1
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
            wait_piece(ready, 2 * B + RIGHT, parity)
            s = score_piece(q_halves.index(b), k_right.index(b), s, True)
            if HAS_ROPE:
                s = score_piece(q_rope.index(a), k_rope.index(b), s, False)
            wait_piece(ready, 2 * B + LEFT, parity)
            s = score_piece(q_halves.index(a), k_left.index(b), s, False)
            s = warpgroup_mma_wait(0, deps=(s,))
            # The tile's last scores are done: q's buffers go to the next tile's q.
            mbarrier.arrive(sync.index(Q_FREE), pred=step + 1 == n_steps)
            s = _masked_scores(s, key_rows, sync, g, 1, s_kv, sm_scale_log2)

            # Consumer 0's max covers the old max and block A; block B completes the step's max.
            mbarrier.wait(sync.index(M0), parity)
            m_ab = gl.maximum(row_max.load(ROW_S), gl.max(s, 1))
            alpha = gl.exp2(m_i - m_ab)
            m_i = m_ab
            p = gl.exp2(s - m_ab[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            row_max.store(m_ab)
            publish_done(sync.index(M1))
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            p_op = p.to(p_b.dtype)
            acc = warpgroup_mma(gl.convert_layout(p_op, P_L), k_right.index(b), acc, is_async=True)
            # P of block B is stored while consumer 0's P of block A is awaited; handed over after.
            p_b.store(p_op)
            mbarrier.wait(sync.index(PA), parity)
            acc = warpgroup_mma(_p_a_tile(p_a, k_rope, a, HAS_ROPE), k_right.index(a), acc, is_async=True)
            fence_async_shared()
            publish_done(sync.index(PB))
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # (Block B's right piece of a tile's last step stays held: the output is staged there.)
            mbarrier.arrive(free.index(2 * B + RIGHT), pred=step + 1 < n_steps)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(free.index(2 * A + RIGHT))
        out_row = out_ptr + token * stride_o_s
        if n_steps > 0:
            l_i = _total_row_sums(l_i, row_sums, sync, summed & 1, 1)
            store_out(acc, m_i, l_i, HALF, k_right.index(B), attn_sink_ptr, stride_sink_h, out_row, stride_o_h,
                      stride_o_d, head0, h_q, HAS_ATTN_SINK, False)
            publish_done(free.index(2 * B + RIGHT))
            summed += 1
        else:
            mbarrier.arrive(sync.index(Q_FREE))
            store_zeros(out_row, stride_o_h, stride_o_d, HALF, head0, h_q)
        # l_i == 0: no valid key (out 0, lse +inf, max_logits -inf), as in the portable kernel.
        store_lse(m_i, l_i, lse_ptr + token * stride_lse_s, stride_lse_h, head0, h_q, False)
        offs_h = head0 + gl.arange(0, BLOCK_H, ROW_S)
        gl.store(max_logits_ptr + token * stride_ml_s + offs_h * stride_ml_h,
                 gl.where(l_i > 0.0, m_i * LN2, float("-inf")), mask=offs_h < h_q)
        done += n_steps


@gluon.jit
def store_lse(m_i, l_i, lse_row, stride_lse_h, head0, h_q, PARTIAL: gl.constexpr):
    """lse_row[h] for heads head0.. (< h_q) from the running max (base 2) and row sum: the natural log,
    +inf for rows without a valid key; PARTIAL (a top-k split's partial result): base 2, -inf."""
    has_keys = l_i > 0.0
    offs_h = head0 + gl.arange(0, m_i.shape[0], m_i.type.layout)
    lse2 = m_i + gl.log2(gl.where(has_keys, l_i, 1.0))
    if PARTIAL:
        lse = gl.where(has_keys, lse2, float("-inf"))
    else:
        lse = gl.where(has_keys, lse2 * LN2, float("inf"))
    gl.store(lse_row + offs_h * stride_lse_h, lse, mask=offs_h < h_q)


@gluon.jit
def _total_row_sums(l_i, row_sums, sync, parity, me: gl.constexpr):
    """Both consumers' row sums added (both are relative to the same final max); parity: the exchange's
    phase (0 for a program's first)."""
    row_sums.index(me).store(l_i)
    publish_done(sync.index(L0 + me))
    mbarrier.wait(sync.index(L1 - me), parity)
    return l_i + row_sums.index(1 - me).load(ROW_S)


@gluon.jit
def inverse_denominators(m_i, l_i, sink_ptr, stride_sink_h, head0, h_q, has_sink, PARTIAL: gl.constexpr):
    """Per head head0.. (m_i's layout): 1 / (row sum + the sink's weight), 0 for heads without a valid
    key. PARTIAL (a top-k split's partial result): no sink (the merge applies it). has_sink: constexpr
    or runtime flag."""
    has_keys = l_i > 0.0
    denom = gl.where(has_keys, l_i, 1.0)
    if not PARTIAL:
        if has_sink:
            offs_h = head0 + gl.arange(0, m_i.shape[0], m_i.type.layout)
            denom += gl.exp2(gl.load(sink_ptr + offs_h * stride_sink_h, mask=offs_h < h_q, other=0.0) * LOG2E - m_i)
    return gl.where(has_keys, 1.0 / denom, 0.0)


@gluon.jit
def store_out(acc, m_i, l_i, col0, staging, sink_ptr, stride_sink_h, out_row, stride_o_h, stride_o_d, head0, h_q,
              has_sink, PARTIAL: gl.constexpr):
    """out_row[h, col0:col0+256] = acc / (row sum + the sink's weight) for heads head0.. (< h_q); 0 for
    rows without a valid key. PARTIAL (a top-k split's partial result): no sink. has_sink: constexpr
    or runtime flag. Staged through shared memory (staging: a free buffer of at least 64 x 256 of
    out's dtype): stored from the MMA layout directly, each thread would hold 128 addresses."""
    inv = inverse_denominators(m_i, l_i, sink_ptr, stride_sink_h, head0, h_q, has_sink, PARTIAL)
    out = acc * gl.convert_layout(inv, ROW_O)[:, None]
    dtype: gl.constexpr = out_row.dtype.element_ty
    buf = staging._reinterpret(dtype, [BLOCK_H, HALF], OUT_SMEM)
    buf.store(out.to(dtype))
    gl.thread_barrier()
    offs_h = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, HALF_L))
    offs_d = col0 + gl.arange(0, HALF, gl.SliceLayout(0, HALF_L))
    gl.store(out_row + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d, buf.load(HALF_L),
             mask=(offs_h < h_q)[:, None])


@gluon.jit
def store_zeros(out_row, stride_o_h, stride_o_d, col0, head0, h_q):
    """out_row[h, col0:col0+256] = 0 for heads head0.. (< h_q): a tile without a valid key."""
    store_rows(gl.zeros([BLOCK_H, HALF], out_row.dtype.element_ty, HALF_L), out_row, stride_o_h, stride_o_d, col0,
               head0, h_q)


@gluon.jit
def store_rows(values, out_row, stride_o_h, stride_o_d, col0, head0, h_q):
    """out_row[h, col0:col0+256] = values[h - head0] for heads head0.. (< h_q); values [heads, 256] in HALF_L."""
    offs_h = head0 + gl.arange(0, values.shape[0], gl.SliceLayout(1, HALF_L))
    offs_d = col0 + gl.arange(0, HALF, gl.SliceLayout(0, HALF_L))
    gl.store(out_row + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d, values,
             mask=(offs_h < h_q)[:, None])


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether this kernel takes the call: an sm_90 GPU, d_v 512 with d_qk 576 or 512, and q / kv rows
    that are contiguous and 16-byte aligned (the copies move 16-byte vectors)."""
    return (q.is_cuda and is_sm90(q.device)
            and q.shape[2] in (2 * HALF + D_ROPE, 2 * HALF) and d_v == 2 * HALF
            and q.stride(2) == 1 and kv.stride(2) == 1
            and all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (q, kv))
            and q.stride(1) * q.element_size() % 16 == 0)


def grid_programs(n_tiles: int, n_sms: int, unequal: bool) -> int:
    """Programs of a launch of n_tiles tiles, one an SM at a time (its shared memory takes the SM's), each
    taking tiles in turn: rows of one length a persistent grid (one program an SM); rows that may differ
    (unequal: topk_length given) programs of TILES_PER_PROGRAM_UNEQUAL tiles, or one a tile below
    MIN_TILES_PER_SM_UNEQUAL tiles an SM."""
    if not unequal:
        return min(n_tiles, n_sms)
    if n_tiles < MIN_TILES_PER_SM_UNEQUAL * n_sms:
        return n_tiles
    return max(n_sms, cdiv(n_tiles, TILES_PER_PROGRAM_UNEQUAL))


def launch(q, kv, indices, sm_scale_log2, attn_sink, topk_length, out, kept):
    """Run the kernel on inputs checked by sparse_mla_prefill; out = (o, max_logits, lse), written;
    kept: the call signature's minirt.kernels._launch.Kept."""
    o, max_logits, lse = out
    # Unused optional pointers still need a tensor argument; the constexpr flags keep them unread.
    sink = attn_sink if attn_sink is not None else lse
    lengths = topk_length if topk_length is not None else indices
    if kept.args is None:
        s_q, h_q, d_qk = q.shape
        n_head_blocks = cdiv(h_q, BLOCK_H.value)
        n_tiles = s_q * n_head_blocks
        programs = grid_programs(n_tiles, num_sms(q.device, 4), topk_length is not None)
        kept.args = ((programs,), (kv.shape[0], h_q, indices.shape[2], n_head_blocks, n_tiles), (
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), indices.stride(2), lengths.stride(0),
            sink.stride(0), o.stride(0), o.stride(1), o.stride(2), max_logits.stride(0), max_logits.stride(1),
            lse.stride(0), lse.stride(1)), dict(
            HAS_TOPK_LENGTH=topk_length is not None, HAS_ATTN_SINK=attn_sink is not None, HAS_ROPE=d_qk > 2 * HALF,
            num_warps=4, maxnreg=168))
    grid, sizes, strides, constexprs = kept.args
    launch_compiled(_sparse_mla_prefill_sm90_kernel, grid, (q, kv, indices, lengths, sink, o, max_logits, lse, *sizes,
                                                            sm_scale_log2, *strides), constexprs, kept.compiled)
    return o, max_logits, lse
