"""Which part of each DeepSeek-V4 checkpoint tensor a tensor-parallel rank holds (``minirt.parallel``'s
collectives run it).

With N ranks every rank holds the whole residual stream (the mHC streams) and:

- attention: its ``H / N`` query heads (``wq_b`` rows, ``attn_sink`` entries) and the ``o_groups / N``
  output groups those heads feed (``wo_a`` rows, ``wo_b`` columns; ``wo_b``'s partial sums are
  all-reduced: one all-reduce per attention). ``wq_a``, the single KV head (``wkv``), the compressors
  and the CSA indexer are replicated;
- MoE: its ``E / N`` routed experts (``minirt.parallel.expert_parallel_moe``, routed on every rank: the
  hash layers route by token id); the shared expert replicated;
- the embedding and head: its ``V / N`` rows of the vocabulary.
"""
from __future__ import annotations

import re

from ...errors import ConfigError, InputError
from ...parallel import Shard, TensorParallel
from .config import DeepseekV4Config

_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.w[123]\.weight")
_HEAD_ROWS = re.compile(r"layers\.\d+\.attn\.(wq_b\.weight|attn_sink)")
_GROUP_ROWS = re.compile(r"layers\.\d+\.attn\.wo_a\.weight")
_GROUP_COLS = re.compile(r"layers\.\d+\.attn\.wo_b\.weight")


def weight_shard(cfg: DeepseekV4Config, name: str, tp: TensorParallel) -> Shard | None:
    """The part of V4 weight ``name`` (a ``tensor_specs`` name, logical shape) rank ``tp.rank`` holds, or
    None when it holds all of it (replicated tensors, and routed experts: :func:`expert_range`).
    ConfigError when ``tp.world`` does not divide the split dim."""
    if tp.world == 1:
        return None
    if name in ("embed.weight", "head.weight"):
        return Shard(0, *tp.share(cfg.vocab_size, "vocab_size"))
    if _HEAD_ROWS.fullmatch(name):
        start, stop = tp.share(cfg.num_attention_heads, "num_attention_heads")
        per_head = 1 if name.endswith("attn_sink") else cfg.head_dim
        return Shard(0, start * per_head, stop * per_head)
    for pattern, dim in ((_GROUP_ROWS, 0), (_GROUP_COLS, 1)):
        if pattern.fullmatch(name):
            start, stop = tp.share(cfg.o_groups, "o_groups")
            return Shard(dim, start * cfg.o_lora_rank, stop * cfg.o_lora_rank)
    return None


def expert_range(cfg: DeepseekV4Config, tp: TensorParallel) -> range:
    """The routed experts rank ``tp.rank`` holds: a contiguous 1/N of ``n_routed_experts``."""
    return range(*tp.share(cfg.n_routed_experts, "n_routed_experts"))


def holds(cfg: DeepseekV4Config, name: str, tp: TensorParallel) -> bool:
    """Whether rank ``tp.rank`` loads weight ``name`` at all (False: another rank's routed expert)."""
    expert = _EXPERT.fullmatch(name)
    return expert is None or int(expert.group(1)) in expert_range(cfg, tp)


def check_tensor_parallel(cfg: DeepseekV4Config, tp: TensorParallel) -> None:
    """InputError unless ``tp.world`` divides the attention heads (what --tp splits first); ConfigError
    for the other split dims (``o_groups``, ``n_routed_experts``, ``vocab_size``) and, for an fp8
    checkpoint, when a rank's ``wq_b`` rows or ``wo_a`` rows / ``wo_b`` columns would cut the 128×128
    scale blocks."""
    if cfg.num_attention_heads % tp.world:
        raise InputError(f"tp={tp.world} does not divide the {cfg.num_attention_heads} attention heads "
                         f"(num_attention_heads): use a divisor of it")
    tp.share(cfg.o_groups, "o_groups")
    tp.share(cfg.n_routed_experts, "n_routed_experts")
    tp.share(cfg.vocab_size, "vocab_size")
    if cfg.quantization is not None:
        for what, n in (("heads × head_dim", cfg.num_attention_heads * cfg.head_dim),
                        ("o_groups × o_lora_rank", cfg.o_groups * cfg.o_lora_rank)):
            if n // tp.world % 128:
                raise ConfigError(f"tensor parallelism over {tp.world} ranks gives each rank {n // tp.world} of the "
                                  f"{n} {what} rows, which cuts the fp8 128×128 scale blocks")
