"""Launching a compiled Triton or Gluon kernel again without Triton's per-call dispatch.

``kernel[grid](*args, **kwargs)`` binds every argument, specialises each (a tensor's dtype and 16-byte
alignment, an integer's being 1 or a multiple of 16), turns the result into a cache key, looks the
compiled kernel up and builds its launch metadata: tens of µs of host time for the decode kernels' 32-42
arguments, as long as some of the kernels take on the GPU. A launch site whose own cache key already
decides all of that (dtypes, shapes, strides, alignment, constexprs) keeps the compiled kernel of its
first launch and calls its launcher directly.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

def described(t):
    """A tensor argument's part of a launch site's call signature: all that input checks and Triton's
    specialisation read (class, dtype, shape, strides, device, 16-byte alignment); None for None."""
    return None if t is None else (t.__class__, t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16)


def described_tuple(ts):
    """A tuple of tensor arguments' part of a launch site's call signature (e.g. an ``out`` pair): its class,
    length and each tensor's described(); None for None."""
    return None if ts is None else (ts.__class__, len(ts), *map(described, ts))


MAX_SIGNATURES = 1024   # signatures a launch site keeps (then it starts over)


def per_signature(kept: dict, signature, derive):
    """What a launch site keeps for a call signature: kept[signature()], or, for a signature not seen
    before, derive() (the site's input checks, raising on bad input, and whatever it derives from them),
    kept under it. signature: a callable giving the call's signature (described() of its tensors, its other
    arguments); bad arguments (not tensors, not hashable, of the wrong rank) may make it raise anything,
    and then derive() runs and nothing is kept (the checks say what is wrong)."""
    try:
        key = signature()
        value = kept.get(key)
    except Exception:   # noqa: BLE001 (whatever it is, the checks name it)
        key = value = None
    if value is None:
        value = derive()
        if key is not None:
            if len(kept) >= MAX_SIGNATURES:
                kept.clear()
            kept[key] = value
    return value


class Kept:
    """What a launch site keeps for one call signature besides that its inputs passed the checks: its launch's
    arguments that the signature fixes (args: the grid, integers, constexprs; None until the signature's
    first launch derives them from that call's tensors: every later call's tensors have the same shapes and
    strides) and the compiled kernels (compiled, launch's cache)."""

    __slots__ = ("value", "args", "compiled")

    def __init__(self, value=None):
        self.value = value   # whatever else the site derived from the signature
        self.args = None
        self.compiled = {}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)   # (triton.cdiv is a constexpr function: ~2 µs a call from the host)


def _hooked(runtime) -> bool:
    """Whether launch hooks are set (a HookChain with calls, or anything else assigned in its place)."""
    return bool(getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True))


_current = []   # [get_current_device, get_current_stream] of the active driver, bound at the first direct launch


def _direct(handle):
    """(launch function, its leading arguments after the stream) of a compiled kernel: its launcher's C
    function itself when the kernel needs no global or profile scratch (else the launcher, which
    allocates them per launch)."""
    launcher = handle.run
    if getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0:
        return launcher.launch, (handle.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                                 handle.packed_metadata, None, None, None)
    return launcher, (handle.function, handle.packed_metadata, None, None, None)


def launch(kernel, grid: tuple, args: tuple, kwargs: dict, compiled: dict) -> None:
    """Run kernel[grid](*args, **kwargs).

    compiled: the caller's dict for one specialisation of its launches (the same dtypes, shapes, strides,
    alignment and kwargs each time); it keeps each kernel's compiled form after its first launch, and
    later launches of that kernel go straight to the compiled kernel's launcher. A kernel object that is
    not a JITFunction (the interpreter's, a test's stand-in) always takes kernel[grid], and so does any
    launch while Triton's launch hooks (a profiler's) are set."""
    entry = compiled.get(id(kernel))
    if entry is not None and entry[0] is kernel and not _hooked(knobs.runtime):
        _, run, leading, constexprs, tensors_at = entry
        # Tensors as their addresses: the launcher then skips its per-tensor driver query of the pointer
        # (cuPointerGetAttribute, ~0.2 µs each); the call signature has already fixed their device.
        args = list(args)
        for i in tensors_at:
            args[i] = args[i].data_ptr()
        device, stream = _current
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream(device()), *leading,
            *args, *constexprs)
        return
    handle = kernel[grid](*args, **kwargs)
    if isinstance(kernel, JITFunction) and handle is not None:
        if not _current:
            _current.extend((driver.active.get_current_device, driver.active.get_current_stream))
        # The launcher takes every parameter in order, the constexprs included (it skips their values).
        constexprs = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[len(args):])
        tensors_at = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        compiled[id(kernel)] = (kernel, *_direct(handle), constexprs, tensors_at)
