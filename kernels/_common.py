"""Shared switches, checks and Triton helpers of the kernels."""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.driver import driver

from .. import formats
from ..errors import InputError

# Triton picks interpreter vs compiler when a @triton.jit function is defined, from this variable.
# The interpreter's bf16 tl.dot returns garbage (raw bits) and its bf16 elementwise math is unreliable,
# so kernels upcast operands to fp32 when interpreted; compiled code keeps bf16 tensor-core dots.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The interpreter runs a launch's programs one after another and each op of a program costs tens to hundreds
# of µs of Python whatever its block size: a row-wise kernel takes many rows per program when interpreted
# (up to this many elements per op), one row per program when compiled (as many programs as rows).
INTERPRETED_BLOCK_ELEMENTS = 1 << 18


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, interpreted: int) -> int:
    """The GPU's SM count; off a GPU (the interpreter) `interpreted`: launchers that size their grids by it
    then run a few programs, enough to exercise their split paths."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return interpreted


# Programmatic dependent launch (PDL): a kernel launched with launch_pdl=True may start while the previous
# kernel on the stream still runs (its launch and first instructions overlap that kernel's tail); it must
# call wait_for_inputs() before reading or writing anything. CUDA graphs keep the dependency as a
# programmatic edge.
_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def wait_for_inputs():
    """Wait until the previous kernel on the stream has finished and its writes are visible (a kernel launched
    with launch_pdl=True may have started before; otherwise, and interpreted, a no-op)."""
    if not _INTERPRET:
        gdc_wait()


@triton.jit
def launch_dependents():
    """Let the next kernel on the stream, if launched with launch_pdl=True, start now (it waits for this one's
    writes in its wait_for_inputs(); otherwise, and interpreted, a no-op)."""
    if not _INTERPRET:
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """Ask L2 to fetch the 128-byte lines holding ptrs where mask, without waiting for them (interpreted:
    nothing)."""
    if not _INTERPRET:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                                  "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# int32 counters per (device, stream) for kernels whose programs count themselves in (the last one to arrive
# finishes the launch: fp8_gemm's split-K sums, all_finite's verdict): zero between launches, each kernel
# resetting those it used before it ends. Launches on one stream run in order, so kernels on it may share
# them; on two streams they could overlap, so each stream has its own.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters, zero, for a kernel launched on ``device``'s current stream."""
    # (The raw stream handle, as Triton's launcher queries it: torch.cuda.current_stream builds a Stream
    # object, a few µs of host time a call.)
    stream = driver.active.get_current_stream(device.index if device.index is not None else
                                              torch.cuda.current_device()) if device.type == "cuda" else 0
    counters = _COUNTERS.get((device, stream))
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = counters
    return counters


def rows_per_program(n_rows: int, row_elements: int) -> int:
    """Rows one program of a row-wise kernel takes: 1 compiled; interpreted, the power of two that covers
    n_rows, at most INTERPRETED_BLOCK_ELEMENTS // row_elements (row_elements: its widest op's elements a row)."""
    if not INTERPRET:
        return 1
    most = max(1, INTERPRETED_BLOCK_ELEMENTS // max(1, row_elements))
    return min(triton.next_power_of_2(max(1, n_rows)), 1 << (most.bit_length() - 1))


# minirt.formats' constants in the form @triton.jit code reads (its globals must be constexprs); host code
# uses minirt.formats itself (a constexpr argument would be compiled in, not passed).
LOG2E = tl.constexpr(formats.LOG2E)
LN2 = tl.constexpr(formats.LN2)


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """Whether device is an sm_90 (Hopper) GPU (queried once: the query takes µs)."""
    return torch.cuda.get_device_capability(device)[0] == 9


def check_device(tensors: dict) -> None:
    """Raise InputError unless every tensor (name → tensor) is on one device the kernels can run on:
    CUDA when compiled, or the CPU under the interpreter."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise InputError("all tensors must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))
    device = devices.pop()
    if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
        raise InputError(f"tensors are on {device}; the kernels need CUDA tensors (or CPU tensors with "
                         "TRITON_INTERPRET=1 set before minirt.kernels is imported)")


def check_tensors(tensors: dict) -> None:
    """Raise InputError unless every value (name → value) is a torch.Tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_tensor(tensors: dict, name: str, t, dtypes, shape: tuple, *, optional: bool = False) -> None:
    """Raise InputError unless t is a tensor of shape ``shape`` and a dtype in ``dtypes`` (one dtype or a
    tuple), or None when ``optional``; a tensor is added to ``tensors`` (name → tensor, for check_device)."""
    if t is None and optional:
        return
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must be a {' or '.join(map(str, dtypes))} tensor of shape {list(shape)}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    tensors[name] = t


def check_slots(slots, leading: tuple) -> None:
    """Raise InputError unless ``slots`` is an int32 / int64 tensor of shape ``leading``: a cache writer's
    slot per written row (its inputs' leading shape)."""
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) \
            or slots.shape != leading:
        raise InputError(f"slots must be an int32/int64 tensor of shape {tuple(leading)}, got "
                         f"{getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")


def rows_of(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [..., width] as rows [N, width] with unit column stride (t itself when it is such rows, a copy
    only where needed)."""
    if t.dim() != 2 or t.stride(1) != 1:   # (a reshape costs ~1 µs of host time even when it changes nothing)
        t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


def flat_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor (t itself when it is one, a copy only where needed)."""
    return t if t.dim() == 1 and t.stride(0) == 1 else t.reshape(-1).contiguous()


@triton.jit
def bf16_nearest(x):
    """The bfloat16 nearest to each finite float32 x (ties to even), as a float32: the bits rounded
    at bit 16. The hardware's cvt.rn.bf16 in integer operations, which the interpreter evaluates
    exactly (its own float32 -> bfloat16 cast does not round to nearest)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def rounded_to_bf16(y):
    """fp32 y rounded to the nearest bf16 value (ties to even), as fp32 (``bf16_nearest``); NaN stays NaN."""
    return tl.where(y == y, bf16_nearest(y), y)


@triton.jit
def rms_normed(x, w, n, eps):
    """RMSNorm of one row held as an fp32 tile x (zeros where masked off; any 2-D shape, n its valid
    values), times the fp32 weight tile w: x · rsqrt(mean(x²) + eps) · w in fp32. One sum order for every
    kernel that norms a row (``rms_norm``, ``write_kv_fp8``'s), so their results agree bit for bit."""
    return x * (1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / n + eps)) * w


@triton.jit
def rotated(a, b, cos, sin):
    """Rope on fp32 pairs (a, b) by angles (cos, sin): (a·cos − b·sin, a·sin + b·cos)."""
    return a * cos - b * sin, a * sin + b * cos


@triton.jit
def paged_slot(table_row_ptr, pos, mask, max_blocks, block_size, num_blocks):
    """Cache slot ids (int64) of logical positions ``pos`` through a block-table row (``table_row_ptr`` per
    position, unit column stride): page · block_size + offset, or -1 where ``mask`` is off, the position is
    outside [0, max_blocks · block_size) or its page outside [0, num_blocks) (-1: unallocated). 64-bit
    arithmetic: garbage positions or pages never wrap into a valid slot, and are never dereferenced."""
    pos = pos.to(tl.int64)
    in_table = mask & (pos >= 0) & (pos < max_blocks.to(tl.int64) * block_size)
    page = tl.load(table_row_ptr + tl.where(in_table, pos // block_size, 0), mask=in_table, other=-1).to(tl.int64)
    return tl.where(in_table & (page >= 0) & (page < num_blocks), page * block_size + pos % block_size, -1)


@triton.jit
def writable_slot(slot_ptr, row, num_slots):
    """(slot, valid) of a cache writer's row ``row``: its slot id int64, 0 where it is outside
    [0, num_slots) (valid False: the row's stores are masked off, never out of bounds)."""
    slot = tl.load(slot_ptr + row).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    return tl.where(valid, slot, 0), valid


def check_config(config, config_type: type) -> None:
    """Raise InputError unless config is None or a config_type (a launcher's launch shape)."""
    if config is not None and not isinstance(config, config_type):
        raise InputError(f"config must be a {config_type.__name__} or None, got {type(config).__name__}")


# The portable attention kernels' (sparse_mla_prefill, sparse_mla_decode) shared online softmax, in base 2.

@triton.jit
def softmax_step(scores, valid, sm_scale_log2, v, m_i, l_i, acc):
    """One online-softmax step over a chunk of keys: scores [H, N] = q.k (unscaled), valid [N] the keys
    to attend (the others get probability 0), v [N, D] their values in the P.V operand dtype.

    m_i [H] (running max of the base-2 scaled scores, -inf before any valid key), l_i [H] (running sum)
    and acc [H, D] are updated and returned. NaN guard: m_ref replaces a -inf running max by 0 in every
    subtraction, so a fully masked chunk gives alpha = exp2(-inf) = 0 and p = 0, never
    exp2(-inf - -inf) = NaN."""
    s = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the operand dtype for the tensor cores, as in FlashMLA.
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def softmax_rows(m_i, l_i):
    """The end of softmax_step's loop, per row: has_keys (a valid key was seen: then l_i >= 1, its max
    term being exp2(0); l_i == 0 otherwise), l_safe (l_i, or 1 for rows without keys, so that they
    divide by and take the log of 1, never 0) and the base-2 lse (-inf for rows without keys)."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse2 = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    return has_keys, l_safe, lse2


@triton.jit
def silu(x):
    """x · sigmoid(x) in x's (float32) precision."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """A MoE expert's silu(gate) * up in float32; HAS_LIMIT (DeepSeek-V4's clamp):
    silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return silu(gate) * up
