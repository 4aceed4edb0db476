"""One home for minirt's fp8 formats: the e4m3 range, the power-of-two scale rule, the byte layouts of
the caches, and two math constants the kernels share. Every module that quantises, packs or unpacks
imports these instead of restating them.

Scale rule (DeepSeek's ``ue8m0`` scales): a group of values with largest magnitude ``amax`` is stored as
``clamp(x / s, -448, 448)`` in e4m3 with ``s = 2^ceil(log2(max(amax / 448, min_scale)))``, a power of
two, so dequantisation ``e4m3 · s`` is exact in bf16 and fp32. ``min_scale`` keeps an all-zero group
finite (never 0/0); it differs by format, as in the formats minirt matches:

- activations and indexer q/k (DeepSeek ``act_quant``, vLLM's indexer cache): amax clamped at 1e-4,
  i.e. ``ACT_MIN_SCALE = 1e-4 / 448``;
- the V32 latent cache and the MODEL1 cache (FlashMLA): ``KV_MIN_SCALE = 1e-4`` (smallest scale 2^-13);
- checkpoint weights (``blockfp8``): the smallest normal float32.
"""
from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0                       # largest finite float8_e4m3fn; torch's cast does not saturate
FP8_GROUP = 128                        # values per scale: activations, indexer q/k, cache tiles
ACT_MIN_SCALE = 1e-4 / E4M3_MAX

# FlashMLA's V32 latent cache token, 656 bytes:
#   [0, 512) 512 e4m3 latent values (4 tiles of 128) | [512, 528) 4 fp32 tile scales | [528, 656) 64 bf16 rope
KV_LATENT_DIM = 512
KV_ROPE_DIM = 64
KV_NUM_TILES = KV_LATENT_DIM // FP8_GROUP
KV_SCALES_AT = KV_LATENT_DIM
KV_ROPE_AT = KV_SCALES_AT + 4 * KV_NUM_TILES
KV_TOKEN_BYTES = KV_ROPE_AT + 2 * KV_ROPE_DIM
KV_MIN_SCALE = 1e-4
KV_MIN_SCALE_EXPONENT = -13            # ceil(log2(KV_MIN_SCALE))

CACHE_BLOCK_SIZE = 64                  # tokens per page of every paged cache

# FlashMLA's MODEL1 (DeepSeek-V4) cache entry: one 512-value K = V vector in 584 logical bytes,
#   data record (576 bytes): [0, 448) 448 e4m3 nope values (7 tiles of 64) | [448, 576) 64 bf16 rope
#   scale record (8 bytes):  7 ue8m0 tile scales (value 2^(byte - 127)) | 1 pad byte (0)
# Scale rule: KV_MIN_SCALE, as the V32 cache, per 64-value tile. A page of B entries holds the B data
# records first, then the B scale records, its stride rounded up to a multiple of 576 bytes; callers
# pass the [num_blocks, B, 1, 584] view of it (stride(0) the padded page, stride(1) 584), which names
# the logical entry size, not where the bytes are.
MODEL1_DIM = 512
MODEL1_NOPE_DIM = 448
MODEL1_ROPE_DIM = MODEL1_DIM - MODEL1_NOPE_DIM
MODEL1_TILE = 64
MODEL1_NUM_TILES = MODEL1_NOPE_DIM // MODEL1_TILE
MODEL1_DATA_BYTES = MODEL1_NOPE_DIM + 2 * MODEL1_ROPE_DIM
MODEL1_SCALE_BYTES = MODEL1_NUM_TILES + 1
MODEL1_ENTRY_BYTES = MODEL1_DATA_BYTES + MODEL1_SCALE_BYTES
MODEL1_PAGE_ALIGN = 576
UE8M0_BIAS = 127                       # ue8m0 byte = log2(scale) + 127

# The indexer key cache in fp8 mode (DeepSeek's inference code, vLLM): per token 128 e4m3 values and
# one fp32 power-of-two scale (ACT_MIN_SCALE rule), 132 bytes.
INDEX_KEY_DIM = 128
INDEX_KEY_BYTES = INDEX_KEY_DIM + 4

LOG2E = math.log2(math.e)              # exp(x) = exp2(x · LOG2E): the kernels' softmax runs in base 2
LN2 = math.log(2.0)                    # natural-log lse = base-2 lse · LN2


def model1_page_bytes(block_size: int) -> int:
    """Bytes of one MODEL1 page of block_size entries: block_size * 584, rounded up to a multiple of 576."""
    return -(-block_size * MODEL1_ENTRY_BYTES // MODEL1_PAGE_ALIGN) * MODEL1_PAGE_ALIGN


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) of positive float32 values, as an int tensor (x = m·2^e with m in [0.5, 1)
    by frexp; torch.log2 can round 2^k·(1 + 2^-23) down to k)."""
    mantissa, exponent = torch.frexp(x)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def pow2_scale(amax: torch.Tensor, min_scale: float) -> torch.Tensor:
    """The scale of groups with largest magnitude ``amax`` (float32, any shape):
    ``2^ceil(log2(max(amax / 448, min_scale)))``, float32, exact."""
    ratio = torch.clamp_min(amax.float() / E4M3_MAX, min_scale)
    return torch.ldexp(torch.ones_like(ratio), ceil_log2(ratio))


def quantize_groups(x: torch.Tensor, min_scale: float = ACT_MIN_SCALE, group: int = FP8_GROUP):
    """x [..., D] (D a multiple of ``group``) -> (e4m3 values [..., D], float32 scales [..., D / group]),
    one power-of-two scale per ``group`` consecutive values. The torch form of the rule every fp8
    kernel of minirt implements."""
    groups = x.float().unflatten(-1, (-1, group))
    scale = pow2_scale(groups.abs().amax(-1), min_scale)
    values = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return values.flatten(-2), scale


def quantized_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (codes [..., K] e4m3, scales [..., K / 128] float32) on x's device: the buffers of x
    [..., K]'s quantisation as ``quantize_groups`` lays it out (a norm or rope kernel's ``fp8_out``)."""
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((*x.shape[:-1], x.shape[-1] // FP8_GROUP), device=x.device))
