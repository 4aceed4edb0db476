"""Shared switches and checks of the Triton kernels."""
import os

from ..errors import InputError

# Triton picks interpreter vs compiler when a @triton.jit function is defined, from this variable.
# The interpreter's bf16 tl.dot returns garbage (raw bits) and its bf16 elementwise math is unreliable,
# so kernels upcast operands to fp32 when interpreted; compiled code keeps bf16 tensor-core dots.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
