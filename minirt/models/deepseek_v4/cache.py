"""DeepSeek-V4's serving state for ``num_layers`` layers and up to ``max_batch`` sequences.

Per layer, by kind (:class:`LayerState`):

* every layer: the **window cache**, MODEL1 (584 bytes an entry), one page of ``sliding_window`` entries
  per sequence used as a ring: position p of sequence b lives at slot ``b · W + p mod W``, so it holds
  exactly the last W tokens, what the window attends.
* CSA / HCA: the **compressed cache**, MODEL1, one entry per ``ratio`` tokens: entry w of sequence b at slot
  ``b · entries_per_seq + w`` (pages of 64 entries for CSA, 2 for HCA); and the compressor's fp32
  partial-window state (:class:`CompressorState`).
* CSA: the indexer's **key cache**, fp32 ``[max_batch, entries_per_seq, index_head_dim]`` (exact keys:
  the indexer selects what the reference selects); and the indexer compressor's state.

Nothing here depends on a step's contents; the engine writes, the layers read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import formats
from ...runtime import CacheCapacity, check_cache_fits
from ...errors import InputError
from ...kernels import new_model1_cache
from .config import DeepseekV4Config, LayerKind

COMPRESSED_PAGE = {LayerKind.CSA: 64, LayerKind.HCA: 2}  # FlashMLA's / vLLM's pages: 256 tokens' entries


def entries_per_seq(max_seq_len: int, kind: LayerKind) -> int:
    """Compressed-cache entries a sequence of max_seq_len tokens may complete, rounded up to whole pages."""
    page = COMPRESSED_PAGE[kind]
    return -(-(max_seq_len // kind.ratio) // page) * page or page


class CompressorState:
    """A compressor's fp32 partial-window state per sequence: the (kv, score + ape) rows of the last
    ``rows`` positions, position p at ring row p mod rows; rows = 2 · ratio with overlapping windows (CSA:
    the previous window's first halves are still needed), else ratio. kv, score: [max_batch, rows, width]."""

    def __init__(self, max_batch: int, ratio: int, width: int, overlap: bool, device):
        self.ratio, self.rows = ratio, ratio * (2 if overlap else 1)
        self.kv = torch.zeros(max_batch, self.rows, width, device=device)
        self.score = torch.zeros(max_batch, self.rows, width, device=device)


@dataclass
class LayerState:
    """One layer's caches (None where its kind has none): window [max_batch, W, 1, 584] uint8 MODEL1;
    compressed [pages, page, 1, 584] uint8 MODEL1; compressor; index_keys fp32; index_compressor."""

    kind: LayerKind
    window: torch.Tensor
    compressed: torch.Tensor | None = None
    compressor: CompressorState | None = None
    index_keys: torch.Tensor | None = None
    index_compressor: CompressorState | None = None


def cache_bytes_per_token(cfg: DeepseekV4Config) -> dict[str, float]:
    """Cache bytes per token of context, per layer kind (long-context limit; the window's fixed
    W · 584 bytes per sequence and the compressors' fixed fp32 state are not per token): SWA 0 beyond the
    window, CSA 584 / 4 compressed + 4 · index_head_dim / 4 indexer key bytes, HCA 584 / 128."""
    entry = formats.MODEL1_ENTRY_BYTES
    csa = LayerKind.CSA.ratio
    return {"SWA": 0.0, "CSA": entry / csa + 4 * cfg.index_head_dim / csa, "HCA": entry / LayerKind.HCA.ratio}


def fixed_bytes_per_seq(cfg: DeepseekV4Config, kind: LayerKind) -> int:
    """Bytes a sequence holds in a layer of ``kind`` whatever its length: the window cache and the
    compressors' fp32 state."""
    window = cfg.sliding_window * formats.MODEL1_ENTRY_BYTES
    if kind == LayerKind.SWA:
        return window
    coff = 2 if kind == LayerKind.CSA else 1
    state = 2 * 4 * (coff * kind.ratio) * (coff * cfg.head_dim)
    if kind == LayerKind.CSA:
        state += 2 * 4 * (2 * kind.ratio) * (2 * cfg.index_head_dim)
    return window + state


class V4Cache(CacheCapacity):
    """The states of ``num_layers`` layers (kinds ``cfg.layer_kinds``) for up to ``max_batch`` sequences
    of up to ``max_seq_len`` tokens. ``seq_lens[b]`` counts the tokens written for sequence b."""

    def __init__(self, cfg: DeepseekV4Config, num_layers: int, max_batch: int, max_seq_len: int, device):
        if max_batch < 1 or max_seq_len < 1:
            raise InputError(f"cache needs max_batch >= 1 and max_seq_len >= 1, got {max_batch}, {max_seq_len}")
        kinds = cfg.layer_kinds[:num_layers]
        per_token = cache_bytes_per_token(cfg)
        check_cache_fits(int(sum(max_batch * (fixed_bytes_per_seq(cfg, k) + per_token[k.name] * max_seq_len)
                                 for k in kinds)), max_batch, max_seq_len, device)
        self.max_batch, self.max_seq_len, self.window = max_batch, max_seq_len, cfg.sliding_window
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.layers: list[LayerState] = []
        for kind in kinds:
            state = LayerState(kind, new_model1_cache(max_batch, cfg.sliding_window, device=device))
            if kind != LayerKind.SWA:
                n, page = entries_per_seq(max_seq_len, kind), COMPRESSED_PAGE[kind]
                state.compressed = new_model1_cache(max_batch * n // page, page, device=device)
                overlap = kind == LayerKind.CSA
                state.compressor = CompressorState(max_batch, kind.ratio, (2 if overlap else 1) * cfg.head_dim,
                                                   overlap, device)
            if kind == LayerKind.CSA:
                state.index_keys = torch.zeros(max_batch, entries_per_seq(max_seq_len, kind), cfg.index_head_dim,
                                               device=device)
                state.index_compressor = CompressorState(max_batch, kind.ratio, 2 * cfg.index_head_dim, True, device)
            self.layers.append(state)

    def entries_per_seq(self, kind: LayerKind) -> int:
        return entries_per_seq(self.max_seq_len, kind)

