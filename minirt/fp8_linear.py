"""A linear layer whose weight stays block fp8 on the device, as DeepSeek checkpoints store it."""
from __future__ import annotations

import torch
from torch import nn

from .blockfp8 import block_scale_shape
from .errors import InputError
from .formats import FP8_DTYPE
from .kernels.ops import fp8_gemm_op as fp8_gemm, quantize_act_fp8_op as quantize_act_fp8  # custom ops: compilable


class Fp8Linear(nn.Module):
    """y = x W^T without bias, W kept as stored: buffers ``weight`` (float8_e4m3fn [out, in]) and
    ``weight_scale_inv`` (float32 [ceil(out / 128), ceil(in / 128)], W = weight * scale per 128 x 128
    block), named like the checkpoint tensors so that ``load_state_dict`` takes them as they are.

    forward(x): x is either a float tensor [..., in] (bf16/fp16/fp32; quantised per token and per 128
    values by quantize_act_fp8, in a multiple of 128) or a pre-quantised pair (x_fp8 [..., in]
    float8_e4m3fn, scales [..., in / 128] float32), e.g. what mla_value_proj_fp8 writes. Returns
    bfloat16 [..., out] from the block-scaled fp8 GEMM (fp8_gemm). Buffers start as zeros with unit
    scales until a checkpoint is loaded.
    """

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(block_scale_shape((out_features, in_features)),
                                                            dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(x, tuple):
            x_fp8, scales = x
            if not isinstance(x_fp8, torch.Tensor) or not isinstance(scales, torch.Tensor) \
                    or x_fp8.shape[:-1] != scales.shape[:-1]:
                raise InputError("a pre-quantised input is a pair of tensors (x_fp8 [..., in], scales [..., in / 128])")
            lead = x_fp8.shape[:-1]
            x_fp8, scales = x_fp8.reshape(-1, x_fp8.shape[-1]), scales.reshape(-1, scales.shape[-1])
        else:
            lead = x.shape[:-1]
            x_fp8, scales = quantize_act_fp8(x.reshape(-1, x.shape[-1]))
        if x_fp8.shape[-1] != self.in_features:
            raise InputError(f"Fp8Linear({self.in_features} -> {self.out_features}) got inputs with "
                             f"{x_fp8.shape[-1]} features")
        return fp8_gemm(x_fp8, scales, self.weight, self.weight_scale_inv).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp8 128x128 blocks"
