"""Rotary position embedding (RoPE) with DeepSeek's YaRN frequency scaling.

RoPE turns 2-D pairs of a vector's dims by the angle ``position · inv_freq[i]`` (pair ``i``). DeepSeek
uses two pairings of the same rotation:

- MLA (``q_rope`` / ``k_rope``, the LAST ``qk_rope_head_dim`` dims of a head): neighbours
  ``(x[2i], x[2i+1])`` — :func:`apply_rope_interleaved`;
- the V3.2 lightning indexer (the FIRST ``qk_rope_head_dim`` dims of a head): halves
  ``(x[i], x[i + d/2])`` — :func:`apply_rope_half`.

Both take the ``cos`` / ``sin`` tables of :func:`rope_cos_sin`, which already carry the YaRN attention
factor (1 for DeepSeek-V3/V3.2, whose ``mscale == mscale_all_dim``).

YaRN (DeepSeek ``precompute_freqs_cis``, transformers ``_compute_yarn_parameters`` with truncation):
dims that turn many times within the original context keep their trained frequency, slow dims are
interpolated (divided by ``factor``), and a linear ramp over the correction range ``[low, high]``
(from ``beta_fast`` / ``beta_slow`` and ``original_max_position_embeddings``) blends the two.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig, YarnScaling
from .errors import InputError


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 when ``factor <= 1``)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(yarn: YarnScaling, dim: int, base: float) -> tuple[int, int]:
    """Pair indices ``(low, high)`` between which YaRN ramps from trained to interpolated frequencies.

    A pair's "correction dim" for ``r`` rotations over the original context is
    ``dim · ln(L_orig / (2π r)) / (2 ln base)``; ``low`` is floor of it at ``beta_fast`` rotations,
    ``high`` the ceiling at ``beta_slow``, clamped to ``[0, dim - 1]``.
    """
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(yarn.beta_fast))
    high = math.ceil(correction_dim(yarn.beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(cfg: ModelConfig, dim: int) -> Tensor:
    """Inverse frequencies of the ``dim / 2`` pairs: ``[dim/2]`` float64 on the CPU.

    ``inv_freq[i] = theta^(-2i/dim)``; under YaRN blended with ``inv_freq[i] / factor`` by the linear
    ramp ``clamp((i - low) / (high - low), 0, 1)`` (0 keeps the trained frequency).
    Computed in float64: the tables are then exact to the output dtype even at positions ~1e5.
    """
    if dim <= 0 or dim % 2:
        raise InputError(f"rope dim must be a positive even number, got {dim}")
    pair = torch.arange(dim // 2, dtype=torch.float64)
    inv_freq = cfg.rope_theta ** (-2.0 * pair / dim)
    yarn = cfg.rope_scaling
    if yarn is None:
        return inv_freq
    low, high = yarn_correction_range(yarn, dim, cfg.rope_theta)
    # DeepSeek widens an empty range by 0.001 to avoid dividing by zero.
    width = high - low if high != low else 0.001
    ramp = ((pair - low) / width).clamp(0.0, 1.0)
    return inv_freq * (1.0 - ramp) + (inv_freq / yarn.factor) * ramp


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Factor multiplying cos and sin (transformers' YaRN ``attention_factor``); 1 without YaRN.

    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)``. DeepSeek-V3/V3.2 set ``mscale == mscale_all_dim == 1``, so this is 1 and the
    YaRN correction lives entirely in the softmax scale (``ModelConfig.sm_scale``).
    """
    yarn = cfg.rope_scaling
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def rope_cos_sin(
    cfg: ModelConfig, positions: Tensor, dim: int, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``positions[t] · inv_freq[i]``, times :func:`rope_attention_factor`.

    positions: integer tensor ``[T]`` (any shape ``[...]`` works). Returns ``(cos, sin)``, each
    ``[T, dim / 2]`` (``[..., dim / 2]``) in ``dtype`` on ``positions.device``.
    """
    if positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise InputError(f"positions must be an integer tensor, got {positions.dtype}")
    inv_freq = rope_inv_freq(cfg, dim).to(positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    factor = rope_attention_factor(cfg)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def _rotate(first: Tensor, second: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Turn the pairs ``(first[i], second[i])`` by the angles of ``cos``/``sin``; cos/sin ``[T, d/2]``
    gain singleton dims before their last so they broadcast over any head dims of ``first``."""
    if cos.shape != sin.shape:
        raise InputError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if cos.shape[-1] != first.shape[-1]:
        raise InputError(f"cos/sin have {cos.shape[-1]} angles, the rotated dims need {first.shape[-1]}")
    extra = first.ndim - cos.ndim
    if extra < 0:
        raise InputError(f"cos/sin {tuple(cos.shape)} have more dims than x {tuple(first.shape)}")
    cos = cos.reshape(*cos.shape[:-1], *([1] * extra), cos.shape[-1])
    sin = sin.reshape(cos.shape)
    return first * cos - second * sin, first * sin + second * cos


def _check_even(x: Tensor) -> int:
    if x.shape[-1] % 2:
        raise InputError(f"rope needs an even last dim, got {tuple(x.shape)}")
    return x.shape[-1] // 2


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the neighbour pairs ``(x[..., 2i], x[..., 2i+1])`` (MLA's layout).

    x: ``[T, *heads, d]``; cos, sin: ``[T, d/2]`` from :func:`rope_cos_sin`. Returns x's shape and
    dtype (computed in the promoted dtype of x and cos).
    """
    _check_even(x)
    even, odd = _rotate(x[..., 0::2], x[..., 1::2], cos, sin)
    return torch.stack((even, odd), dim=-1).flatten(-2).to(x.dtype)


def apply_rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the half pairs ``(x[..., i], x[..., i + d/2])`` (the V3.2 indexer's layout).

    x: ``[T, *heads, d]``; cos, sin: ``[T, d/2]`` from :func:`rope_cos_sin`. Returns x's shape and
    dtype (computed in the promoted dtype of x and cos).
    """
    half = _check_even(x)
    first, second = _rotate(x[..., :half], x[..., half:], cos, sin)
    return torch.cat((first, second), dim=-1).to(x.dtype)
