"""The step context: everything a forward pass needs besides the activations.

The engine builds one per prefill chunk (:func:`prefill_context`) or decode step (:func:`decode_context`);
``DecoderLayer.forward(x, ctx)`` and ``Transformer.forward(tokens, ctx)`` read it. A project that lifts
a layer builds the same context for its own tokens.

A prefill step holds *segments*: runs of consecutive positions of one sequence each, packed back to back
in the step's tokens. Their bf16 latents are kept in a :class:`KVStash` for the whole prefill, so a
later chunk attends the exact bf16 keys of the earlier ones (chunked and unchunked prefill compute the
same numbers); the fp8 paged cache is what decode reads.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .models.deepseek_v32.cache import PagedCache
from .config import ModelConfig
from .rope import rope_cos_sin


@dataclass(frozen=True)
class Segment:
    """Positions [start, start + length) of sequence ``seq`` (its cache row), at rows
    [offset, offset + length) of the step's tokens."""

    seq: int
    start: int
    length: int
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.length


class KVStash:
    """The bf16 attention keys/values ``[latent | k_rope]`` of every token of one prefill, per layer:
    what the sparse prefill kernel attends. Rows: sequence i's position p is row ``base[i] + p``;
    a layer's tensor is allocated on first use."""

    def __init__(self, lengths: Sequence[int], device: torch.device | str):
        self.base = [0]
        for n in lengths[:-1]:
            self.base.append(self.base[-1] + n)
        self.rows, self.device = sum(lengths), torch.device(device)
        self._layers: dict[int, torch.Tensor] = {}

    def layer(self, index: int, width: int) -> torch.Tensor:
        """Layer ``index``'s stash [rows, 1, width] bf16 (the kernel's kv layout, h_kv = 1)."""
        if index not in self._layers:
            self._layers[index] = torch.empty(self.rows, 1, width, dtype=torch.bfloat16, device=self.device)
        return self._layers[index]


@dataclass
class PrefillTrace:
    """Per-layer intermediates of one prefill, for ``verify``: ``hidden_states[i]`` the residual
    stream after layer i [N, hidden] fp32 and ``topk[i]`` the positions layer i attended [N, k], over
    all prompt tokens packed (the pieces of every chunk joined in order; top-k pieces narrower than the
    widest, as dense V3 steps are, padded with −1)."""

    _pieces: dict = field(default_factory=lambda: defaultdict(list))

    def record(self, kind: str, layer: int, value: torch.Tensor) -> None:
        self._pieces[kind, layer].append(value)

    def _joined(self, kind: str) -> list[torch.Tensor]:
        layers = sorted(i for k, i in self._pieces if k == kind)
        pieces = [self._pieces[kind, i] for i in layers]
        width = [max(p.shape[-1] for p in ps) for ps in pieces]
        return [torch.cat([torch.nn.functional.pad(p, (0, w - p.shape[-1]), value=-1) for p in ps])
                for ps, w in zip(pieces, width)]

    @property
    def hidden_states(self) -> list[torch.Tensor]:
        return self._joined("hidden")

    @property
    def topk(self) -> list[torch.Tensor]:
        return self._joined("topk")


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
    positions = cache.seq_lens[:batch].clone()
    rows = torch.arange(batch, device=positions.device)
    cos, sin = (rope[0][positions], rope[1][positions]) if rope is not None else \
        rope_cos_sin(cfg, positions, cfg.qk_rope_head_dim)
    return StepContext(positions, cos, sin, cache=cache,
                       slots=cache.slots(rows, positions), block_table=cache.block_table[:batch],
                       topk_override=topk_override, expert_override=expert_override)
