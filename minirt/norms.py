"""The RMS norm every family's eager reference (and V4's layers) compute in fp32."""
from __future__ import annotations

import torch
from torch import Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim; x ``[..., d]``, weight ``[d]``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
