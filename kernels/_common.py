"""Shared switches for the Triton kernels."""
import os

# Triton picks interpreter vs compiler when a @triton.jit function is defined, from this variable.
# The interpreter's bf16 tl.dot returns garbage (raw bits) and its bf16 elementwise math is unreliable,
# so kernels upcast operands to fp32 when interpreted; compiled code keeps bf16 tensor-core dots.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
