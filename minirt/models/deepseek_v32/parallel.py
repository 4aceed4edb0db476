"""Which part of each DeepSeek-V3 / V3.2 checkpoint tensor a tensor-parallel rank holds (``minirt.parallel``'s
collectives run it): its heads of attention, its share of a dense MLP's width and of the vocabulary, its
routed experts."""
from __future__ import annotations

import re

from ...errors import InputError
from ...parallel import Shard, TensorParallel

_HEAD_ROWS = re.compile(r"model\.layers\.\d+\.self_attn\.(q_b_proj|kv_b_proj)\.weight")
_HEAD_COLS = re.compile(r"model\.layers\.\d+\.self_attn\.o_proj\.weight")
_MLP_ROWS = re.compile(r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj)\.weight")  # a dense layer's (not shared experts')
_MLP_COLS = re.compile(r"model\.layers\.\d+\.mlp\.down_proj\.weight")


def weight_shard(cfg, name: str, tp: TensorParallel) -> Shard | None:
    """The part of DeepSeek-V3 / V3.2 weight ``name`` (an HF name, shapes as ``tensor_specs``) that rank
    ``tp.rank`` holds, or None when every rank holds all of it (norms, q_a / kv_a, the indexer, the
    router, shared experts). Heads split attention; ranks split a dense MLP's width and the vocabulary.
    Routed experts: ``expert_range``. ConfigError when ``tp.world`` does not divide the split dim."""
    if tp.world == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Shard(0, *tp.share(cfg.vocab_size, "vocab_size"))
    heads = tp.share(cfg.num_attention_heads, "num_attention_heads")
    if _HEAD_ROWS.fullmatch(name):
        per_head = cfg.qk_head_dim if "q_b_proj" in name else cfg.qk_nope_head_dim + cfg.v_head_dim
        return Shard(0, heads[0] * per_head, heads[1] * per_head)
    if _HEAD_COLS.fullmatch(name):
        return Shard(1, heads[0] * cfg.v_head_dim, heads[1] * cfg.v_head_dim)
    for pattern, dim in ((_MLP_ROWS, 0), (_MLP_COLS, 1)):
        if pattern.fullmatch(name):
            return Shard(dim, *tp.share(cfg.intermediate_size, "intermediate_size"))
    return None


def expert_range(cfg, tp: TensorParallel) -> range:
    """The routed experts rank ``tp.rank`` holds (a contiguous 1/N of ``n_routed_experts``)."""
    if cfg.moe is None:
        return range(0)
    return range(*tp.share(cfg.moe.n_routed_experts, "n_routed_experts"))


def check_tensor_parallel(cfg, tp: TensorParallel) -> None:
    """InputError unless ``tp.world`` divides the attention heads (what --tp splits first); ConfigError
    for the other split dims (vocabulary, dense MLP width, routed experts)."""
    if cfg.num_attention_heads % tp.world:
        raise InputError(f"tp={tp.world} does not divide the {cfg.num_attention_heads} attention heads "
                         f"(num_attention_heads): use a divisor of it")
    tp.share(cfg.vocab_size, "vocab_size")
    tp.share(cfg.intermediate_size, "intermediate_size")
    expert_range(cfg, tp)
