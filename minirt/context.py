"""What every family's step context is made of besides its caches (V3.2's
:class:`minirt.models.deepseek_v32.context.StepContext`, V4's :class:`minirt.models.deepseek_v4.layers.V4Step`).

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
    a layer's tensor is allocated on first use, or beside another stash's by ``allocate_before``."""

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

    def allocate_before(self, then: "KVStash", index: int, width: int) -> None:
        """Allocate layer ``index`` of this stash and of ``then`` as one buffer [rows + then.rows, 1, width],
        this stash's rows first: a kernel taking both as one key buffer (``sparse_mla_prefill_two_sources``)
        then reads them in place instead of copying them together. Neither may have the layer yet."""
        if index in self._layers or index in then._layers:
            raise ValueError(f"layer {index} is already allocated")
        joint = torch.empty(self.rows + then.rows, 1, width, dtype=torch.bfloat16, device=self.device)
        self._layers[index], then._layers[index] = joint[: self.rows], joint[self.rows:]


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
