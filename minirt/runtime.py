"""What every model family's kernel runtime shares: prompts cut into bounded prefill steps, a cache sized
by batch and length (:class:`CacheCapacity`), and :class:`KernelRuntime`'s ``decode``: its checks and the
step's CUDA-graph capture and replay. A family's engine brings its caches, layers and step proper."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rich.filesize import decimal

from .backend import check_tokens
from .device import available_memory
from .errors import DeviceError, InputError
from .kernels.finite import all_finite
from .parallel import SINGLE, TensorParallel

DECODE_HEADROOM = 256        # decode steps a cache the engine sizes itself leaves room for


def check_prefill_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"prefill chunk must be a positive whole number of tokens, got {chunk!r}")
    return chunk


def plan_chunks(lengths: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """The prompts packed back to back, cut into steps of at most ``chunk`` tokens: per step its
    segments (sequence, first position, length), in token order."""
    steps, current, room = [], [], chunk
    for seq, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(room, n - start)
            current.append((seq, start, take))
            start, room = start + take, room - take
            if room == 0:
                steps.append(current)
                current, room = [], chunk
    if current:
        steps.append(current)
    return steps


def check_cache_fits(nbytes: int, max_batch: int, max_seq_len: int, device: torch.device | str) -> None:
    """DeviceError, before anything is allocated, when a cache of ``nbytes`` for ``max_batch`` sequences
    of ``max_seq_len`` tokens exceeds what ``device`` can still allocate."""
    free = available_memory(torch.device(device))
    if nbytes > free:
        raise DeviceError(f"a cache for {max_batch} x {max_seq_len:,} tokens needs {decimal(nbytes)} on "
                          f"{torch.device(device).type}, {decimal(free)} is free: lower max_batch or max_seq_len")


class CacheCapacity:
    """Room for ``max_batch`` sequences of ``max_seq_len`` tokens: what every model family's cache is sized
    by, and what the engine checks a prefill's prompt lengths against."""

    max_batch: int
    max_seq_len: int

    def has_room(self, lengths: list[int]) -> bool:
        return len(lengths) <= self.max_batch and max(lengths) <= self.max_seq_len

    def check_room(self, lengths: list[int]) -> None:
        if len(lengths) > self.max_batch:
            raise InputError(f"batch of {len(lengths)} sequences exceeds the cache's max_batch {self.max_batch}")
        if max(lengths) > self.max_seq_len:
            raise InputError(
                f"a sequence needs {max(lengths)} cached tokens, the cache holds {self.max_seq_len} per sequence "
                "(raise max_seq_len, or shorten the prompt / max_new_tokens)"
            )


class KernelRuntime:
    """The part of a family's engine that is the same for every family. A subclass sets ``cfg``,
    ``device``, ``cache`` (a :class:`CacheCapacity` with ``seq_lens``), ``_lens`` (the host copy of
    ``cache.seq_lens``), ``_graphs`` (a dict, emptied with each new cache), ``_sized_by_user`` and
    ``use_cuda_graph``, and defines ``_allocate_cache(max_batch, max_seq_len)``,
    ``_decode_step(tokens, topk_override, expert_override)`` (static shapes, no host sync) and
    ``_check_finite(logits, stage, rerun, finite)``. ``tp``: the process group the model is split over
    (``minirt.parallel``; one process unless the family's loader was given one)."""

    tp: TensorParallel = SINGLE

    def _fit_cache(self, lens: list[int]) -> None:
        """A cache with room for sequences of ``lens`` tokens: the one ``setup_cache`` sized (InputError
        if they do not fit), else the current one if they fit, else a new one with ``DECODE_HEADROOM``
        decode steps of room."""
        if self.cache is None or not (self._sized_by_user or self.cache.has_room(lens)):
            self._allocate_cache(len(lens), max(lens) + DECODE_HEADROOM)
        self.cache.check_room(lens)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor] | None = None,
               expert_override: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """Append tokens [b] (one per sequence of the last prefill) and return logits [b, vocab].
        ``topk_override``: per layer [b, k] positions that replace the indexer's choice;
        ``expert_override``: per layer None or (weights, expert ids) [b, k] that replace a MoE layer's
        routing (both run the step eagerly)."""
        ids = check_tokens(tokens, self.cfg.vocab_size, "decode")
        b = len(self._lens) if self.cache is not None else 0
        if b == 0 or len(ids) != b:
            raise InputError(f"decode needs one token per prefilled sequence ({b}), got {len(ids)}")
        tokens = torch.tensor(ids, device=self.device)
        self._advance_lens()
        if topk_override is not None or expert_override is not None or not self.use_cuda_graph:
            logits, finite = self._decode_step(tokens, topk_override, expert_override), None
        else:
            logits, finite = self._decode_graphed(tokens)
            logits = logits.clone()  # the graph's output buffer: the next replay overwrites it

        def rerun() -> torch.Tensor:  # the same step again: it rewrites the slot it wrote
            self.cache.seq_lens[: tokens.shape[0]] -= 1
            return self._decode_step(tokens, topk_override, expert_override)

        self._check_finite(logits, "decode", rerun, finite)
        return logits

    @torch.inference_mode()
    def decode_queued(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode`` for a loop that keeps its tokens on the device (``minirt.generate``): the step is
        queued, not waited for. tokens: [b] int64 on the engine's device, ids the caller vouches for
        (sampled from this engine's logits: not read back to be checked). Returns (logits [b, vocab]
        fp32, finite: a 0-d bool tensor, whether every logit is finite), both still being computed.
        On CUDA the logits are the decode graph's output buffer: read them (queue the work that does)
        before the next decode call. The caller reads ``finite`` once the step is done and, when it is
        False, calls ``raise_non_finite``."""
        b = len(self._lens) if self.cache is not None else 0
        if not (isinstance(tokens, torch.Tensor) and tokens.shape == (b,) and b and tokens.dtype == torch.int64
                and tokens.device.type == self.device.type):
            got = f"{tokens.dtype} {tuple(tokens.shape)} on {tokens.device}" if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise InputError(f"decode_queued needs int64 tokens [{b}] (one per prefilled sequence) on "
                             f"{self.device}, got {got}")
        self._advance_lens()
        logits, finite = self._decode_graphed(tokens) if self.use_cuda_graph else (self._decode_step(tokens), None)
        return logits, all_finite(logits) if finite is None else finite

    def raise_non_finite(self, tokens: torch.Tensor, later_steps: int = 0) -> None:
        """NumericalError for the decode step ``decode_queued(tokens)`` whose logits were not finite,
        naming the first module whose output is not (the step rerun eagerly, ``later_steps`` steps
        queued after it rolled back first)."""
        def rerun() -> torch.Tensor:
            self.cache.seq_lens[: tokens.shape[0]] -= later_steps + 1
            return self._decode_step(tokens)

        self._check_finite(None, "decode", rerun, torch.tensor(False))

    def _advance_lens(self) -> None:
        lens = [n + 1 for n in self._lens]
        self.cache.check_room(lens)
        self._lens = lens

    def _decode_graphed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, whether all are finite: a bool tensor the graph computes, None on the capturing call)."""
        b = tokens.shape[0]
        if b not in self._graphs:
            # The first step runs eagerly on a side stream (it compiles the kernels and warms cuBLAS),
            # then the same step is captured; capturing executes nothing, so the cache is untouched.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._decode_step(tokens)
            torch.cuda.current_stream().wait_stream(side)
            graph, static_tokens = torch.cuda.CUDAGraph(), tokens.clone()
            with torch.cuda.graph(graph):
                static_logits = self._decode_step(static_tokens)
                static_finite = all_finite(static_logits)
            self._graphs[b] = (graph, static_tokens, static_logits, static_finite)
            return logits, None
        graph, static_tokens, static_logits, static_finite = self._graphs[b]
        static_tokens.copy_(tokens)
        graph.replay()
        return static_logits, static_finite
