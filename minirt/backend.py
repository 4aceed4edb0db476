"""What both backends offer, and the input checks they share.

``minirt.load`` returns a family's kernel engine (``backend="triton"``, e.g.
:class:`minirt.models.deepseek_v32.engine.Engine`) or the eager :class:`ReferenceEngine` around the family's
reference model (``backend="reference"``); the CLI, ``generate`` and ``verify`` use either through this
interface alone.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from .config import ModelConfig
from .errors import InputError, NumericalError


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


class ReferenceEngine:
    """The eager oracle behind a kernel engine's calls (``minirt.load(backend="reference")``): every step
    recomputes whole sequences densely with ``model``, a family's reference model (``forward(tokens)``
    returning ``logits`` and per layer ``hidden_states``)."""

    backend = "reference"

    def __init__(self, model):
        self.model, self.cfg, self.device, self.num_layers = model, model.cfg, model.device, model.num_layers
        self.sequences: list[list[int]] = []

    def setup_cache(self, max_batch: int, max_seq_len: int) -> None:
        """No cache: kept so callers can treat both backends alike."""

    def _forward(self, tokens: list[int], stage: str):
        """The model's forward; NumericalError naming the first layer whose output is non-finite when
        the logits are."""
        out = self.model.forward(torch.tensor(tokens))
        if not bool(torch.isfinite(out.logits).all()):
            bad = [i for i, h in enumerate(out.hidden_states) if not bool(torch.isfinite(h).all())]
            raise NumericalError.in_logits(stage, f"layer {bad[0]} (model.layers.{bad[0]})" if bad
                                           else "the final norm (model.norm) or lm_head")
        return out

    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False) -> torch.Tensor:
        self.sequences = check_prompts(prompts, self.cfg.vocab_size)
        outs = [self._forward(p, "prefill").logits.float() for p in self.sequences]
        return torch.cat(outs) if all_logits else torch.stack([o[-1] for o in outs])

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = check_tokens(tokens, self.cfg.vocab_size, "decode")
        if not self.sequences or len(tokens) != len(self.sequences):
            raise InputError(f"decode needs one token per prefilled sequence ({len(self.sequences)}), got {len(tokens)}")
        for seq, t in zip(self.sequences, tokens):
            seq.append(t)
        return torch.stack([self._forward(s, "decode").logits[-1].float() for s in self.sequences])
