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
    decode_step_seconds: float = float("nan")  # the decode steps alone (device time on CUDA); decode_seconds: the loop

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps, over the batch (each sequence's first token comes from prefill)."""
        return self.decode_steps * len(self.tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second of the decode loop (engine steps, sampling, streaming), summed over
        the batch."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")

    @property
    def decode_steps_per_s(self) -> float:
        """Engine decode steps per second, the step alone (one token for every sequence each)."""
        return self.decode_steps / self.decode_step_seconds if self.decode_step_seconds else float("nan")


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


def warm_up(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Run the prefill of ``prompts`` and two greedy decode steps once, untimed, on the cache
    ``generate(engine, prompts, max_new_tokens)`` then uses (``setup_cache`` keeps a cache of the same
    sizes): the first calls compile the Triton kernels on a GPU and the first decode step captures
    the batch's CUDA graph, so ``generate``'s figures then measure the runtime alone. Returns its
    seconds."""
    longest = max((len(p) for p in prompts), default=0)
    check_generation_length(engine.cfg, longest, max_new_tokens)
    engine.setup_cache(len(prompts), longest + max_new_tokens)
    _sync(engine.device)
    start = time.perf_counter()
    tokens = engine.prefill(prompts).argmax(-1)
    for _ in range(min(2, max_new_tokens - 1)):
        tokens = engine.decode(tokens).argmax(-1)
    _sync(engine.device)
    return time.perf_counter() - start


class _TokensToHost:
    """One step's sampled tokens and its finiteness flag on their way to the host. On CUDA: copies into
    pinned memory queued behind the step and an event, so reading them waits for that step alone,
    not for one queued after it."""

    def __init__(self, batch: int, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.tokens = torch.empty(batch, dtype=torch.int64, pin_memory=True)
            self.finite = torch.ones(1, dtype=torch.bool, pin_memory=True)
            self.done = torch.cuda.Event()

    def start(self, tokens: torch.Tensor, finite: torch.Tensor | None) -> None:
        """finite: None when the logits were checked already (prefill, the reference backend)."""
        if not self.cuda:
            self.pending = tokens, finite
            return
        self.tokens.copy_(tokens, non_blocking=True)
        if finite is None:
            self.finite.fill_(True)
        else:
            self.finite.copy_(finite.reshape(1), non_blocking=True)
        self.done.record()

    def read(self) -> tuple[list[int], bool]:
        if not self.cuda:
            tokens, finite = self.pending
            return tokens.tolist(), finite is None or bool(finite)
        self.done.synchronize()
        return self.tokens.tolist(), bool(self.finite[0])


class _StepClock:
    """Seconds of the decode steps alone: device time between events around each step on CUDA, the
    host's clock elsewhere (where a step runs synchronously)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_seconds: list[float] = []

    def __enter__(self):
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            self.host_seconds.append(-time.perf_counter())

    def __exit__(self, *exc):
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.host_seconds[-1] += time.perf_counter()

    def seconds(self, steps: int) -> float:
        """Of the first ``steps`` steps (after a device sync)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.events[:steps]) * 1e-3
        return sum(self.host_seconds[:steps])


def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             eos_token_id: int | None = None, on_token: Callable[[int, int], None] | None = None,
             on_prefill: Callable[[int, int], None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` for each prompt; a sequence stops after it emits ``eos_token_id``.

    ``on_token(sequence_index, token)`` is called for every new token (streaming), while the device
    runs the next decode step: the kernel engines take each step's tokens on the device
    (``Engine.decode_queued``; greedy sampling stays there too), so the host's work on one token
    (this callback: detokenising, printing) overlaps the next step. When every sequence stops at
    ``eos_token_id``, the one step queued past it is discarded. The cache is sized for the longest
    prompt plus ``max_new_tokens``; more than the model's ``max_position_embeddings`` in total is an
    InputError. The result says why each sequence stopped (``GenerationResult.stop_reasons``).
    ``on_prefill(done, total)``: prompt tokens prefilled so far (the triton backend's chunks;
    ``Engine.prefill``'s progress). The first calls on a GPU include Triton's compilation and the
    CUDA-graph capture: ``warm_up`` first keeps them out of the figures.
    """
    longest = max((len(p) for p in prompts), default=0)
    check_generation_length(engine.cfg, longest, max_new_tokens)
    device = engine.device
    generator = torch.Generator().manual_seed(sampling.seed)
    engine.setup_cache(len(prompts), longest + max_new_tokens)
    _sync(device)
    start = time.perf_counter()
    logits = engine.prefill(prompts, progress=on_prefill) if on_prefill is not None else engine.prefill(prompts)
    next_tokens = sample(logits, sampling, generator)
    _sync(device)
    prefill_seconds = time.perf_counter() - start

    out: list[list[int]] = [[] for _ in prompts]
    stop: list[str | None] = [None] * len(prompts)
    queue = getattr(engine, "decode_queued", None)  # the reference backend runs (and checks) each step at once
    to_host, clock = _TokensToHost(len(prompts), device), _StepClock(device)
    to_host.start(next_tokens, None)  # the prefill's logits were checked already
    last_input = None  # the input of the step whose tokens to_host holds
    steps, start = 0, time.perf_counter()
    while True:
        # Queue the next step before reading the last tokens back; it is discarded if they end every sequence.
        step_input, queued = next_tokens, steps < max_new_tokens - 1
        if queued:
            with clock:
                logits, finite = queue(step_input) if queue is not None else (engine.decode(step_input), None)
        tokens, last_finite = to_host.read()
        if not last_finite:
            engine.raise_non_finite(last_input, later_steps=int(queued))
        for i, t in enumerate(tokens):
            if stop[i] is not None:
                continue
            out[i].append(t)
            if on_token is not None:
                on_token(i, t)
            if t == eos_token_id:
                stop[i] = STOP_EOS
            elif len(out[i]) >= max_new_tokens:
                stop[i] = STOP_LENGTH
        if not queued or all(reason is not None for reason in stop):
            break
        if sampling.temperature and finite is not None and not bool(finite):  # sampled on the host: check first
            engine.raise_non_finite(step_input)
        next_tokens, last_input = sample(logits, sampling, generator), step_input
        to_host.start(next_tokens, finite)
        steps += 1
    _sync(device)
    return GenerationResult(out, sum(len(p) for p in prompts), prefill_seconds, steps, time.perf_counter() - start,
                            stop, clock.seconds(steps))
