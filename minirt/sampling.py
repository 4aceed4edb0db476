"""Next-token sampling: greedy, temperature, top-k, top-p, all from one seeded generator."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .errors import InputError


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 disable those filters; seed seeds the
    sampling generator. temperature: a finite real >= 0; top_k: an int >= 0; top_p: in (0, 1]; seed:
    an int in [0, 2^64). Anything else (NaN included) is an InputError."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (_is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature!r:.40}")
        if not (isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise InputError(f"top_k must be a whole number >= 0, got {self.top_k!r:.40}")
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r:.40}")
        check_seed(self.seed)


def check_seed(seed) -> int:
    """``seed`` if it can seed a torch.Generator (an int in [0, 2^64)), else InputError."""
    if not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED):
        raise InputError(f"seed must be a whole number in [0, 2^64), got {seed!r:.40}")
    return seed


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [b, vocab] (any float dtype) -> token ids [b] int64."""
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    # Sample on the CPU so one seed gives the same tokens on every device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
