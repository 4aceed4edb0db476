"""What both backends offer, and the input checks they share.

``minirt.load`` returns a kernel :class:`minirt.models.deepseek_v32.engine.Engine` (``backend="triton"``) or the eager
:class:`minirt.models.deepseek_v32.reference.ReferenceEngine` (``backend="reference"``); the CLI, ``generate`` and ``verify``
use either through this interface alone.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from .config import ModelConfig
from .errors import InputError


class Backend(Protocol):
    backend: str               # "triton" or "reference"
    cfg: ModelConfig
    device: torch.device
    num_layers: int

    def setup_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Room for ``max_batch`` sequences of ``max_seq_len`` tokens (the reference keeps none)."""

    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False) -> torch.Tensor:
        """Start one sequence per prompt: next-token logits [b, vocab] fp32 (every token's with all_logits)."""

    def decode(self, tokens) -> torch.Tensor:
        """Append one token per sequence: logits [b, vocab] fp32."""


def check_tokens(tokens, vocab_size: int, what: str = "tokens") -> list[int]:
    """Token ids as Python ints, or InputError: integers only (an int tensor, or ints), in [0, vocab)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InputError(f"{what}: token ids must be integers, got a {tokens.dtype} tensor")
        tokens = tokens.reshape(-1).tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InputError(f"{what}: expected a sequence of token ids, got {type(tokens).__name__} {tokens!r:.40}")
    ids = list(tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InputError(f"{what}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise InputError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints, or InputError: a non-empty sequence of non-empty token-id sequences
    (``[[1, 2, 3]]``, not ``[1, 2, 3]``), every id in [0, vocab)."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise InputError(f"prompts must be a list of prompts, each a list of token ids, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("no prompts given")
    if any(isinstance(p, numbers.Integral) for p in prompts):
        raise InputError(f"prompts must be a list of prompts, each a list of token ids: [{list(prompts)!r:.40}], "
                         f"not {list(prompts)!r:.40}")
    out = [check_tokens(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    for i, p in enumerate(out):
        if not p:
            raise InputError(f"prompt {i} is empty")
    return out
