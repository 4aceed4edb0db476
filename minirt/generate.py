"""Autoregressive generation over either backend: prefill once, then one decode step per new token."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .sampling import SamplingParams, sample


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens of each prompt, stopping after eos
    prefill_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float

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


def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             eos_token_id: int | None = None,
             on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` for each prompt; a sequence stops after it emits ``eos_token_id``.

    ``on_token(sequence_index, token)`` is called for every new token as soon as it is sampled (streaming).
    The cache is sized for the longest prompt plus ``max_new_tokens``; more than the model's
    ``max_position_embeddings`` in total is an InputError.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > engine.cfg.max_position_embeddings:
        raise InputError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({engine.cfg.max_position_embeddings})")
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
    done = [False] * len(prompts)
    steps, start = 0, time.perf_counter()
    while True:
        for i, t in enumerate(next_tokens.tolist()):
            if done[i]:
                continue
            out[i].append(t)
            if on_token is not None:
                on_token(i, t)
            done[i] = t == eos_token_id or len(out[i]) >= max_new_tokens
        if all(done):
            break
        next_tokens = sample(engine.decode(next_tokens), sampling, generator)
        steps += 1
    _sync(device)
    return GenerationResult(out, sum(len(p) for p in prompts), prefill_seconds, steps, time.perf_counter() - start)
