"""Autoregressive generation over either backend: prefill once, then one decode step per new token."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .sampling import SamplingParams, sample


STOP_EOS, STOP_LENGTH = "eos", "length"


@dataclass
class GenerationResult:
    """tokens: the new tokens of each prompt (the first comes from prefill, each later one from a decode
    step), ending with eos when it was sampled; stop_reasons: per prompt why it stopped, ``"eos"`` (the
    end-of-sequence token was sampled) or ``"length"`` (max_new_tokens reached)."""

    tokens: list[list[int]]
    prefill_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    stop_reasons: list[str]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second by decode steps, summed over the batch."""
        n = self.decode_steps * len(self.tokens)
        return n / self.decode_seconds if self.decode_seconds else float("nan")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_generation_length(cfg, longest_prompt: int, max_new_tokens: int) -> None:
    """InputError unless 1 <= max_new_tokens and the longest prompt plus max_new_tokens fits in the
    model's ``max_position_embeddings`` (the CLI checks this before it loads any weights)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if longest_prompt + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")


def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             eos_token_id: int | None = None,
             on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` for each prompt; a sequence stops after it emits ``eos_token_id``.

    ``on_token(sequence_index, token)`` is called for every new token as soon as it is sampled (streaming).
    The cache is sized for the longest prompt plus ``max_new_tokens``; more than the model's
    ``max_position_embeddings`` in total is an InputError. The result says why each sequence stopped
    (``GenerationResult.stop_reasons``).
    """
    longest = max((len(p) for p in prompts), default=0)
    check_generation_length(engine.cfg, longest, max_new_tokens)
    device = engine.device
    generator = torch.Generator().manual_seed(sampling.seed)
    engine.setup_cache(len(prompts), longest + max_new_tokens)
    _sync(device)
    start = time.perf_counter()
    logits = engine.prefill(prompts)
    next_tokens = sample(logits, sampling, generator)
    _sync(device)
    prefill_seconds = time.perf_counter() - start

    out: list[list[int]] = [[] for _ in prompts]
    stop: list[str | None] = [None] * len(prompts)
    steps, start = 0, time.perf_counter()
    while True:
        for i, t in enumerate(next_tokens.tolist()):
            if stop[i] is not None:
                continue
            out[i].append(t)
            if on_token is not None:
                on_token(i, t)
            if t == eos_token_id:
                stop[i] = STOP_EOS
            elif len(out[i]) >= max_new_tokens:
                stop[i] = STOP_LENGTH
        if all(reason is not None for reason in stop):
            break
        next_tokens = sample(engine.decode(next_tokens), sampling, generator)
        steps += 1
    _sync(device)
    return GenerationResult(out, sum(len(p) for p in prompts), prefill_seconds, steps, time.perf_counter() - start, stop)
