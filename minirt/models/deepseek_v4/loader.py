"""What minirt's API and CLI call for a DeepSeek-V4 checkpoint: ``load`` (a Backend) and ``info_rows``."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from rich.filesize import decimal

from ...errors import InputError
from ...reference import ReferenceEngine
from .checkpoint import load_checkpoint, plan_load
from .config import DeepseekV4Config
from .reference import ReferenceModelV4

RUNTIME_MISSING = "the kernel runtime for DeepSeek-V4 is not in minirt yet"


def load(path: str | Path, layers: int | None, device: torch.device, backend: str, progress=None) -> ReferenceEngine:
    """The first ``layers`` layers (None: all) of the V4 checkpoint at ``path`` as a Backend: the eager fp32
    :class:`ReferenceModelV4` behind ``minirt.reference.ReferenceEngine``. backend "triton" raises
    InputError (no V4 kernel runtime yet)."""
    if backend != "reference":
        raise InputError(f"{RUNTIME_MISSING}: load V4 checkpoints with backend='reference' (CLI: --backend reference)")
    cfg, weights = load_checkpoint(path, layers, device=device, dtype=torch.float32, progress=progress)
    return ReferenceEngine(ReferenceModelV4(cfg, weights, layers, torch.float32, device))


def info_rows(path: Path, cfg: DeepseekV4Config, layers: int | None) -> list[tuple[str, str]]:
    """``minirt info``'s rows for a V4 checkpoint: the config, and what loading ``layers`` layers reads."""
    plan = plan_load(path, layers)
    kinds = cfg.layer_kinds
    counts = Counter(k.name for k in kinds)
    q = cfg.quantization
    return [
        ("model_type", cfg.model_type),
        ("layers", f"{cfg.num_hidden_layers} ({', '.join(f'{n} {k}' for k, n in counts.items())}; "
                   f"{cfg.num_nextn_predict_layers} MTP, not loaded)"),
        ("layer kinds", " ".join(k.name for k in kinds[:16]) + (" ..." if len(kinds) > 16 else "")),
        ("hidden / heads × head_dim", f"{cfg.hidden_size} / {cfg.num_attention_heads} × {cfg.head_dim} "
                                      f"({cfg.nope_head_dim} + {cfg.qk_rope_head_dim} rope)"),
        ("q_lora / output groups × rank", f"{cfg.q_lora_rank} / {cfg.o_groups} × {cfg.o_lora_rank}"),
        ("window / indexer", f"{cfg.sliding_window} / {cfg.index_n_heads} × {cfg.index_head_dim}, top-{cfg.index_topk}"),
        ("mHC", f"{cfg.hc_mult} streams, {cfg.hc_sinkhorn_iters} Sinkhorn iterations"),
        ("MoE", f"{cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok}, width {cfg.moe_intermediate_size}, "
                f"first {cfg.num_hash_layers} hash-routed"),
        ("quantization", f"fp8 e4m3 + ue8m0 128×128, experts {q.expert_dtype}" if q else "none"),
        ("softmax scale", f"{cfg.sm_scale:.6f}"),
        ("max positions", f"{cfg.max_position_embeddings:,}"),
        ("layers to load", str(plan.num_layers)),
        ("shards to open", f"{', '.join(s.name for s in plan.shard_files)} ({len(plan.shard_files)})"),
        ("tensors / bytes to read", f"{len(plan.tensor_names)} / {decimal(plan.num_bytes)}"),
        ("parameters", f"{plan.num_parameters:,}"),
        ("runtime", f"eager reference only ({RUNTIME_MISSING})"),
    ]
