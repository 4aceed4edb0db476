"""Gluon building blocks of the Hopper (sm_90) MLA attention kernels (sparse_mla_prefill_sm90 and
sparse_mla_decode_sm90): layouts, the query tile in shared memory, and one attention step.

A program attends 64 query heads (one wgmma M tile) with 8 warps = two warpgroups, over chunks of
64 keys whose 512 latent + 64 rope columns sit in shared memory. For the scores S = Q.K^T
[heads, keys] the warpgroups split the keys; for O = P.V [heads, 512] they split the columns. (The
alternative, both warpgroups computing all of S, avoids the cross-warpgroup row max / sum / P
exchange but doubles the score MMAs: 11% slower on an H200, docs/perf/prefill.md.)
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from minirt import formats

BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
D_LAT = gl.constexpr(formats.KV_LATENT_DIM)
D_ROPE = gl.constexpr(formats.KV_ROPE_DIM)
NUM_WARPS = gl.constexpr(8)
LOG2E = gl.constexpr(formats.LOG2E)
LN2 = gl.constexpr(formats.LN2)

S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
# Register layouts of [rows, 512] and [rows, 64] copies: 16-byte vectors along the contiguous dim.
LAT_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]))
ROPE_L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0]))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))    # per-head vectors of the softmax
COL_S = gl.constexpr(gl.SliceLayout(0, S_LAYOUT.value))    # per-key vectors of the scores
ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))    # per-head vectors of the output


@gluon.jit
def load_q(q_base, stride_h, head0, h_q, q_lat_smem, q_rope_smem, HAS_ROPE: gl.constexpr = True):
    """Heads head0..head0+63 of one query row (q_base points at its head 0, 512 latent then 64 rope
    values per head) into the two shared-memory tiles; heads >= h_q become zero rows. Without
    HAS_ROPE (d_qk 512) only the latent tile is loaded."""
    h_lat = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, LAT_L))
    q_lat_smem.store(gl.load(q_base + h_lat[:, None] * stride_h + gl.arange(0, D_LAT, gl.SliceLayout(0, LAT_L))[None, :],
                             mask=(h_lat < h_q)[:, None], other=0.0))
    if HAS_ROPE:
        _load_q_rope(q_base, stride_h, head0, h_q, q_rope_smem)


@gluon.jit
def _load_q_rope(q_base, stride_h, head0, h_q, q_rope_smem):
    h_rope = head0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ROPE_L))
    q_rope_smem.store(gl.load(q_base + h_rope[:, None] * stride_h + D_LAT
                              + gl.arange(0, D_ROPE, gl.SliceLayout(0, ROPE_L))[None, :],
                              mask=(h_rope < h_q)[:, None], other=0.0))


@gluon.jit
def chunk_indices(row_ptr, stride, start, end, LAYOUT: gl.constexpr):
    """The 64 int32 indices row_ptr[(start + j) * stride] of one chunk in a 1-D layout; -1 at and past
    `end`. A chunk's indices are loaded once per layout that needs them (an L1 hit after the first):
    cheaper than a layout conversion, which goes through shared memory and barriers."""
    offs = start + gl.arange(0, BLOCK_N, LAYOUT)
    return gl.load(row_ptr + offs * stride, mask=offs < end, other=-1)


@gluon.jit
def attend_chunk(q_lat_smem, q_rope_smem, k_lat_smem, k_rope_smem, valid, sm_scale_log2, m_i, l_i, acc,
                 HAS_ROPE: gl.constexpr = True):
    """One online-softmax step over a chunk of 64 keys in shared memory (k_lat doubles as V; without
    HAS_ROPE the scores are q_lat . k_lat alone and the rope tiles are not read: d_qk 512).

    valid [64] (COL_S): keys to attend; the others get probability 0. m_i (running max of the scores
    scaled by sm_scale_log2, i.e. in base 2; -inf before any valid key), l_i (ROW_S) and acc [64, 512]
    (O_LAYOUT) are updated and returned. m_ref replaces a -inf running max by 0 in every subtraction,
    so a fully masked chunk gives alpha = exp2(-inf) = 0 and p = 0, never exp2(-inf - -inf) = NaN."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_lat_smem, k_lat_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    if HAS_ROPE:
        s = warpgroup_mma(q_rope_smem, k_rope_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    # P is rounded to the operand dtype for the tensor cores, as in FlashMLA.
    p_op = gl.convert_layout(p.to(k_lat_smem.dtype), P_LAYOUT)
    acc = warpgroup_mma(p_op, k_lat_smem, acc * gl.convert_layout(alpha, ROW_O)[:, None], is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return m_new, l_i, acc
