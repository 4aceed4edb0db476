"""The step context: everything a forward pass needs besides the activations.

The engine builds one per prefill chunk (:func:`prefill_context`) or decode step (:func:`decode_context`);
``DecoderLayer.forward(x, ctx)`` and ``Transformer.forward(tokens, ctx)`` read it. A project that lifts
a layer builds the same context for its own tokens. A prefill step's segments, its stash of bf16
latents and its trace: :mod:`minirt.context`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...config import ModelConfig
from ...context import KVStash, PrefillTrace, Segment
from ...kernels.decode_positions import decode_positions
from ...rope import rope_cos_sin
from .cache import PagedCache


@dataclass
class StepContext:
    """What one forward step needs besides the activations x [N, hidden].

    positions [N] int64: each token's position in its sequence; cos / sin [N, rope / 2] fp32 at those
    positions. cache: the paged caches the new tokens are written to (``slots`` [N] int64) and, in
    decode, read from (``block_table`` [b, max_blocks] int32 of the step's sequences); None runs
    without a cache (prefill only; the indexer then has no keys, so ``topk_override`` must be given).
    segments / stash: a prefill step (None: a decode step with one token per sequence, positions =
    cached lengths). topk_override: per layer None or [N, k] positions (−1 = none) that replace the
    indexer's choice. expert_override: per layer None or (weights [N, k] fp32, expert ids [N, k]) that
    replace a MoE layer's routing. trace: where a prefill records per-layer intermediates.
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache: PagedCache | None = None
    slots: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    segments: list[Segment] | None = None
    stash: KVStash | None = None
    stash_rows: torch.Tensor | None = None
    topk_override: Sequence[torch.Tensor | None] | None = None
    trace: PrefillTrace | None = None
    expert_override: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @property
    def is_prefill(self) -> bool:
        return self.segments is not None


def prefill_context(cfg: ModelConfig, lengths: Sequence[int], *, starts: Sequence[int] | None = None,
                    seqs: Sequence[int] | None = None, cache: PagedCache | None = None,
                    stash: KVStash | None = None, topk_override=None, trace: PrefillTrace | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    device: torch.device | str | None = None, expert_override=None) -> StepContext:
    """Context of a prefill step over segments packed back to back: ``lengths[j]`` tokens of sequence
    ``seqs[j]`` (default j) from position ``starts[j]`` (default 0).

    stash: the prefill's KVStash (default: a new one for whole prompts of ``lengths``); a chunked
    prefill passes the same stash to every chunk. rope: precomputed (cos, sin) tables indexed by
    position (default: computed for these positions). device: default the cache's, else the CPU.
    """
    starts = list(starts) if starts is not None else [0] * len(lengths)
    seqs = list(seqs) if seqs is not None else list(range(len(lengths)))
    device = torch.device(device) if device is not None else (
        cache.block_table.device if cache is not None else torch.device("cpu"))
    if stash is None:
        stash = KVStash([s + n for s, n in zip(starts, lengths)], device)
    segments, offset = [], 0
    for seq, start, n in zip(seqs, starts, lengths):
        segments.append(Segment(seq, start, n, offset))
        offset += n
    positions = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(device)
    seq_index = torch.repeat_interleave(torch.tensor(seqs), torch.tensor(list(lengths))).to(device)
    base = torch.tensor(stash.base, device=device)
    cos, sin = (rope[0][positions], rope[1][positions]) if rope is not None else \
        rope_cos_sin(cfg, positions, cfg.qk_rope_head_dim)
    return StepContext(positions, cos, sin, cache=cache,
                       slots=cache.slots(seq_index, positions) if cache is not None else None,
                       segments=segments, stash=stash, stash_rows=base[seq_index] + positions,
                       topk_override=topk_override, trace=trace, expert_override=expert_override)


def decode_context(cfg: ModelConfig, cache: PagedCache, batch: int,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, topk_override=None,
                   expert_override=None) -> StepContext:
    """Context of a decode step: one new token for each of the cache's first ``batch`` sequences, at
    position ``cache.seq_lens`` (the caller advances seq_lens after the step, as the engine does).
    rope: (cos, sin) tables indexed by position, covering the cache's capacity; with them the context
    is built from device tensors alone, without a host synchronisation (CUDA-graph capturable).
    Default: computed for these positions."""
    if rope is not None:  # positions, angles and slots in one launch
        positions, cos, sin, slots = decode_positions(cache.seq_lens[:batch], cache.block_table[:batch],
                                                      cache.block_size, cache.num_blocks, *rope)
    else:
        positions = cache.seq_lens[:batch].clone()
        cos, sin = rope_cos_sin(cfg, positions, cfg.qk_rope_head_dim)
        slots = cache.slots(torch.arange(batch, device=positions.device), positions)
    return StepContext(positions, cos, sin, cache=cache, slots=slots, block_table=cache.block_table[:batch],
                       topk_override=topk_override, expert_override=expert_override)
