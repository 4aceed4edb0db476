"""Triton kernels of minirt (imported as ``minirt.kernels``)."""
