"""Paged caches: the fp8 latent KV cache (FlashMLA's 656-byte V32 layout) and the indexer key cache
(132-byte fp8 keys in the fp8 indexer mode, fp32 keys in the exact mode), both addressed by
slot = block · block_size + offset through one block table per sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import ModelConfig
from ...errors import InputError
from ...formats import CACHE_BLOCK_SIZE, INDEX_KEY_BYTES, KV_TOKEN_BYTES
from ...kernels import new_index_cache, new_kv_cache
from ...runtime import CacheCapacity, check_cache_fits


def cache_bytes_per_token(cfg: ModelConfig, num_layers: int, indexer_precision: str = "exact") -> int:
    """Cache bytes one token takes in ``num_layers`` layers: the 656-byte fp8 latent, plus (V3.2) its
    indexer key: 132 bytes in the fp8 indexer mode, fp32 (4 · index_head_dim) in the exact mode."""
    index_key = 0 if not cfg.is_v32 else INDEX_KEY_BYTES if indexer_precision == "fp8" else 4 * cfg.index_head_dim
    return num_layers * (KV_TOKEN_BYTES + index_key)


@dataclass
class LayerCache:
    """One layer's cache. kv: [num_blocks, block_size, 1, 656] uint8 (fp8 latent + scales + bf16 rope).
    index_keys (None for V3 layers): the indexer keys as ``paged_indexer_scores`` reads them, uint8
    [num_blocks, block_size, 1, 132] in the fp8 mode, fp32 [num_blocks, block_size, index_head_dim]
    in the exact mode."""

    kv: torch.Tensor
    index_keys: torch.Tensor | None


class PagedCache(CacheCapacity):
    """Caches of ``num_layers`` layers for up to ``max_batch`` sequences of ``max_seq_len`` tokens.

    indexer_precision: "exact" or "fp8", the format of the indexer keys (as the layers' indexer).
    Blocks are handed out at construction: sequence b owns blocks
    ``block_table[b] = [b · blocks_per_seq, ...)``; the kernels only ever see the table, so any other
    allocation policy would work unchanged. ``seq_lens[b]`` counts the tokens written for sequence b.
    Raises DeviceError when the caches would not fit in the device's free memory.
    """

    def __init__(self, cfg: ModelConfig, num_layers: int, max_batch: int, max_seq_len: int,
                 block_size: int = CACHE_BLOCK_SIZE, device: torch.device | str = "cpu",
                 indexer_precision: str = "exact"):
        if max_batch < 1 or max_seq_len < 1:
            raise InputError(f"cache needs max_batch >= 1 and max_seq_len >= 1, got {max_batch}, {max_seq_len}")
        self.block_size, self.max_batch, self.max_seq_len = block_size, max_batch, max_seq_len
        blocks_per_seq = -(-max_seq_len // block_size)
        self.num_blocks = num_blocks = max_batch * blocks_per_seq
        check_cache_fits(num_blocks * block_size * cache_bytes_per_token(cfg, num_layers, indexer_precision),
                         max_batch, max_seq_len, device)
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).view(max_batch, blocks_per_seq)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int64, device=device)

        def index_keys():
            if not cfg.is_v32:
                return None
            if indexer_precision == "fp8":
                return new_index_cache(num_blocks, block_size, device=device)
            return torch.zeros(num_blocks, block_size, cfg.index_head_dim, device=device)

        self.layers = [LayerCache(new_kv_cache(num_blocks, block_size, device=device), index_keys())
                       for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold (whole blocks: at least max_seq_len)."""
        return self.block_table.shape[1] * self.block_size

    def slots(self, batch_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slot ids int64 of tokens at ``positions`` of sequences ``batch_index`` (any broadcastable
        shapes): the one place that maps (sequence, position) to a cache slot."""
        block = self.block_table[batch_index, positions // self.block_size].long()
        return block * self.block_size + positions % self.block_size

