"""What minirt's API and CLI call for a DeepSeek-V4 checkpoint: ``load`` (a Backend) and ``info_rows``."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from rich.filesize import decimal

from ...backend import ReferenceEngine
from ...errors import InputError
from ...parallel import SINGLE, TensorParallel
from .cache import cache_bytes_per_token, fixed_bytes_per_seq
from .checkpoint import load_checkpoint, plan_load
from .config import DeepseekV4Config
from .engine import PREFILL_CHUNK, EngineV4, build_engine_v4
from .parallel import check_tensor_parallel
from .reference import ReferenceModelV4


def load(path: str | Path, layers: int | None, device: torch.device, backend: str, progress=None,
         prefill_chunk: int | None = None, *, dtype: torch.dtype | None = None, indexer_precision: str = "exact",
         weights: str | None = None, tp: TensorParallel = SINGLE) -> EngineV4 | ReferenceEngine:
    """The first ``layers`` layers (None: all) of the V4 checkpoint at ``path`` as a Backend: backend "triton"
    the kernel runtime :class:`EngineV4` (fp8 / fp4 weights as stored, prefill steps of ``prefill_chunk``
    tokens, default :data:`.engine.PREFILL_CHUNK`), "reference" the eager fp32 :class:`ReferenceModelV4` behind
    ``minirt.backend.ReferenceEngine``. InputError for V3.2's options: a ``dtype``, ``indexer_precision``
    other than "exact", ``weights`` "bf16". ``tp``: this process's place in the tensor-parallel group
    (``minirt.parallel``; :func:`check_tensor_parallel`), which the kernel runtime loads its shards for
    (:mod:`.parallel`); the reference loads the whole model on every rank."""
    if dtype is not None or indexer_precision != "exact" or weights == "bf16":
        raise InputError(f"DeepSeek-V4 runs fp8 weights, bf16 activations and an exact indexer: dtype={dtype}, "
                         f"indexer_precision={indexer_precision!r} / weights={weights!r} apply to DeepSeek-V3.2 only")
    if backend == "reference":
        cfg, weights = load_checkpoint(path, layers, device=device, dtype=torch.float32, progress=progress,
                                       as_stored="experts")
        return ReferenceEngine(ReferenceModelV4(cfg, weights, layers, torch.float32, device))
    from ...config import load_config  # minirt.config names the families: imported late

    check_tensor_parallel(load_config(Path(path) / "config.json"), tp)
    cfg, weights = load_checkpoint(path, layers, device=device, dtype=torch.bfloat16, progress=progress, as_stored=True,
                                   tp=tp)
    return build_engine_v4(cfg, weights, layers or cfg.num_hidden_layers, device,
                           PREFILL_CHUNK if prefill_chunk is None else prefill_chunk, tp)


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
        *cache_rows(cfg, plan.num_layers),
    ]


def cache_rows(cfg: DeepseekV4Config, num_layers: int) -> list[tuple[str, str]]:
    """``minirt info``'s cache rows: bytes per token of context per layer kind, the fixed bytes per sequence
    (window, compressor state), and the total per token over the loaded layers."""
    per_token = cache_bytes_per_token(cfg)
    kinds = cfg.layer_kinds[:num_layers]
    rows = [(f"cache {k.name} layer", f"{per_token[k.name]:.1f} B/token + {decimal(fixed_bytes_per_seq(cfg, k))}/sequence")
            for k in sorted(set(kinds))]
    total = sum(per_token[k.name] for k in kinds)
    return rows + [(f"cache, {num_layers} layers", f"{total:.1f} B/token, {decimal(int(total * (1 << 20)))} at 1M tokens")]


def check_generate_fits(cfg: DeepseekV4Config, num_layers: int, batch: int, prompt_len: int, max_new_tokens: int,
                        device) -> None:
    """Nothing to refuse before loading: the loader checks that the weights fit (``load_checkpoint``) and
    the engine that the caches do when it allocates them (``V4Cache``), each with a DeviceError naming
    both sizes."""


def check_verify_fits(cfg: DeepseekV4Config, num_layers: int, prompt_len: int, decode_steps: int, device) -> None:
    """As :func:`check_generate_fits`: the runtime's and then the reference's weights (fp32, the routed
    experts as stored) are each checked when they load; the reference's activations are not estimated."""
