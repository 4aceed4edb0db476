"""What minirt's API and CLI call for a DeepSeek-V3 / V3.2 checkpoint: ``load`` (a Backend) and ``info_rows``."""
from __future__ import annotations

from pathlib import Path

import torch
from rich.filesize import decimal

from ...backend import ReferenceEngine
from ...config import ModelConfig
from ...errors import InputError
from ...files import is_present
from ...parallel import SINGLE, TensorParallel
from .parallel import check_tensor_parallel
from .cache import cache_bytes_per_token
from .checkpoint import expert_bytes, load_checkpoint, plan_load
from .engine import PREFILL_CHUNK, Engine, build_engine
from .reference import ReferenceModel


def load(path: Path, layers: int | None, device: torch.device, backend: str, progress=None,
         prefill_chunk: int | None = None, *, dtype: torch.dtype | None = None, indexer_precision: str = "exact",
         weights: str | None = None, tp: TensorParallel = SINGLE) -> Engine | ReferenceEngine:
    """The first ``layers`` layers (None: all) of the checkpoint at ``path`` as a Backend (``minirt.load``
    checked the arguments): backend "reference" the eager fp32 :class:`ReferenceModel` behind
    ``minirt.backend.ReferenceEngine``, "triton" the kernel :class:`Engine` with ``weights`` "fp8" (as stored)
    or "bf16" (dequantised to ``dtype``; None: bf16 on cuda, fp32 on cpu). ``weights`` None: "fp8" for
    an fp8 checkpoint on a GPU with fp8 tensor cores (sm_90+), else "bf16". ``tp``: this process's
    place in the tensor-parallel group (``minirt.parallel``; ``check_tensor_parallel``), which it loads
    its shards for."""
    if backend == "reference":
        cfg, tensors = load_checkpoint(path, layers, device=device, dtype=torch.float32, progress=progress)
        return ReferenceEngine(ReferenceModel(cfg, tensors, layers, torch.float32, device))
    cfg = ModelConfig.from_file(path)
    check_tensor_parallel(cfg, tp)
    if weights is None:
        weights = "fp8" if cfg.quantization and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) >= (9, 0) else "bf16"
    if weights == "fp8" and cfg.quantization is None:
        raise InputError(f"{path} stores no fp8 weights: load it with weights='bf16'")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg, tensors = load_checkpoint(path, layers, device=device, dtype=dtype, progress=progress,
                                   fp8_as_stored=weights == "fp8", tp=tp)
    return build_engine(cfg, tensors, layers or cfg.num_hidden_layers, device, dtype, indexer_precision,
                        PREFILL_CHUNK if prefill_chunk is None else prefill_chunk, fp8_weights=weights == "fp8", tp=tp)


def info_rows(path: Path, cfg: ModelConfig, layers: int | None) -> list[tuple[str, str]]:
    """``minirt info``'s rows: the config, and what loading ``layers`` layers (None: all) reads and holds. Needs
    only config.json and the index: shards not downloaded yet are listed with an estimate of their size."""
    from ...download import memory_text, plan_shards  # download reads this family's layout

    shards = plan_shards(path, layers if layers is not None else cfg.num_hidden_layers)
    n = shards.num_layers
    missing = [s for s in shards.shards if not is_present(path / s)]  # a FIFO is there: plan_load refuses it
    on_disk = sum((path / s).stat().st_size for s in shards.shards if s not in missing)
    rows = [
        ("model_type", cfg.model_type), ("layers (dense / total)", f"{cfg.num_dense_layers} / {cfg.num_hidden_layers}"),
        ("hidden / heads", f"{cfg.hidden_size} / {cfg.num_attention_heads}"),
        ("q_lora / kv_lora", f"{cfg.q_lora_rank} / {cfg.kv_lora_rank}"),
        ("qk nope / rope / v", f"{cfg.qk_nope_head_dim} / {cfg.qk_rope_head_dim} / {cfg.v_head_dim}"),
        ("indexer heads × dim, top-k", f"{cfg.index_n_heads} × {cfg.index_head_dim}, {cfg.index_topk}" if cfg.is_v32 else "none (V3)"),
        ("softmax scale", f"{cfg.sm_scale:.6f}"),
        ("quantization", f"fp8 e4m3, blocks {cfg.quantization.weight_block_size}" if cfg.quantization else "none"),
        ("max positions", f"{cfg.max_position_embeddings:,}"),
        ("layers to load", str(n)),
        ("shards to open", f"{', '.join(shards.shards)} ({len(shards.shards)} of {shards.index_shards})"),
    ]
    if missing:
        each = shards.estimated_shard_bytes()
        estimate = f"; the {len(missing)} not here: about {decimal(each * len(missing))} more (the index's mean shard size)" if each else ""
        rows.append(("disk", f"{decimal(on_disk)} here{estimate}"))
        rows.append(("not downloaded", ", ".join(missing)))
    else:
        plan = plan_load(path, n)
        rows += [("disk (those shards)", decimal(on_disk)),
                 ("tensors / bytes to read", f"{len(plan.tensor_names)} / {decimal(plan.num_bytes)}")]
    rows += [
        ("parameters", f"{shards.num_parameters:,}"),
        ("memory for the weights", memory_text(shards)),
        ("cache per token", f"{cache_bytes_per_token(cfg, n, 'exact'):,} B (exact indexer) · "
                            f"{cache_bytes_per_token(cfg, n, 'fp8'):,} B (fp8 indexer)"),
    ]
    moe_layers = [i for i in range(n) if cfg.is_moe_layer(i)]
    if moe_layers:
        moe = cfg.moe
        rows += [("MoE layers loaded", f"{len(moe_layers)}: {', '.join(map(str, moe_layers))}"),
                 ("routed experts per MoE layer", f"{moe.n_routed_experts} × width {moe.moe_intermediate_size}, "
                  f"{moe.num_experts_per_tok} per token, {moe.n_shared_experts} shared: "
                  f"{decimal(expert_bytes(cfg, moe_layers[0]))} in memory (as stored)")]
    return rows
