"""The devices minirt runs on, and how much memory is left on one."""
from __future__ import annotations

import os

import torch

from .errors import DeviceError, InputError, excerpt


DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """torch.device(device) of type cpu or cuda; InputError if unparsable or of another type (xpu, meta,
    ...: minirt runs on neither), DeviceError if it is CUDA and none (or no such index) is available."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"not a torch device: {excerpt(device)}") from None
    if device.type not in DEVICE_TYPES:
        raise InputError(f"device {excerpt(str(device))}: minirt runs on {' or '.join(DEVICE_TYPES)} only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device``: CUDA's free memory, or the CPU's available RAM
    (MemAvailable in /proc/meminfo; elsewhere free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
