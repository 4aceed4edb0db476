"""Synthetic DeepSeek-V4 checkpoints in the released layout (``minirt init --preset v4-tiny | v4-flash``).

Files as released: ``config.json``, shards ``model-XXXXX-of-NNNNNN.safetensors`` (the embedding, then one
per layer, then the final norm, head and ``hc_head_*``) with ``model.safetensors.index.json``; tensors
named and stored as :mod:`.checkpoint` describes (e4m3 + e8m0 ``.scale``, packed fp4 experts in int8,
bf16, fp32, int64 ``tid2eid``). Every tensor is drawn from its own generator (seeded from the seed and
the tensor's name, as ``minirt.synthetic`` does), in row chunks, then quantised.

Presets: ``v4-tiny`` (V4's real 512-wide heads, 448 + 64 rope, real window, compress ratios, indexer and
mHC sizes; hidden 256, 8 heads, 8 experts; layers SWA, CSA, HCA, CSA, the first two hash-routed) and
``v4-flash`` (V4-Flash's dimensions, its first 4 layers: SWA, SWA, CSA, HCA; about 16 GB).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..deepseek_v32.checkpoint import TensorSpec
from ...shards import INDEX_FILE, Progress
from ...config import YarnScaling
from ...errors import InputError
from ...synthetic import (GENERATOR_KEY, Preset, _generator_record, _nbytes, _row_chunks, _SafetensorsWriter,
                          _tensor_seed, byte_level_tokenizer)
from ...tokenizer import TOKENIZER_FILE
from .checkpoint import TOP_LEVEL, V4TensorSpec, plan_load, scale_name, stored_layout, tensor_specs
from .config import DeepseekV4Config, V4Quantization
from .quant import quantize_fp4, quantize_fp8

__all__ = ["PRESETS", "preset_config", "write_files", "plan_load"]

_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
_EXTRA_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True,
}


def _make_presets() -> dict[str, Preset]:
    common = dict(
        model_type="deepseek_v4", head_dim=512, qk_rope_head_dim=64, sliding_window=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1048576, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=64, index_head_dim=128, n_shared_experts=1,
        routed_scaling_factor=1.5, swiglu_limit=10.0, num_nextn_predict_layers=1, rope_scaling=_YARN,
        quantization=V4Quantization(expert_dtype="fp4"),
    )
    tiny = DeepseekV4Config(
        vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, compress_ratios=(0, 4, 128, 4, 0),
        index_topk=16,  # below the entries of a few-hundred-token prompt, so the selection is sparse
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=2,
        bos_token_id=256, eos_token_id=257, **common,
    )
    flash = DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, compress_ratios=(0, 0, 4, 128, 0), index_topk=512,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6, num_hash_layers=3,
        bos_token_id=0, eos_token_id=1, **common,
    )
    return {
        "v4-tiny": Preset(tiny, _EXTRA_CONFIG, tokenizer=True,
                          description="4 DeepSeek-V4 layers (SWA, CSA, HCA, CSA; hash and top-k MoE), real head dims; seconds on CPU"),
        "v4-flash": Preset(flash, _EXTRA_CONFIG, tokenizer=False,
                           description="DeepSeek-V4-Flash's first 4 layers at real size (about 13 GB)"),
    }


PRESETS: dict[str, Preset] = _make_presets()


def preset_config(preset: str, num_layers: int | None = None) -> DeepseekV4Config:
    """The preset's config; with ``num_layers``, its first num_layers layers (their compress_ratios
    entries, then the MTP entries)."""
    cfg = PRESETS[preset].config
    if num_layers is None:
        return cfg
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_hidden_layers:
        raise InputError(f"num_layers must be an int in [1, {cfg.num_hidden_layers}] for preset {preset}, got {num_layers!r}")
    mtp = cfg.compress_ratios[cfg.num_hidden_layers:]
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, compress_ratios=cfg.compress_ratios[:num_layers] + mtp,
                               num_hash_layers=min(cfg.num_hash_layers, num_layers))


def _mean_std(name: str, spec: V4TensorSpec) -> tuple[float, float]:
    """Values that keep activations O(1) and reach V4's edge cases: linear weights N(0, 1/fan_in), the
    experts' w1 / w3 four times wider so SwiGLU's clamp at swiglu_limit is hit; norms 1 + noise; mHC
    projections N(0, 1/(hc·D)) so the mixing logits are O(1), their biases and scales O(1); sinks and
    the compressors' ape N(0, 1); the router bias small."""
    leaf = name.rsplit(".", 1)[-1] if "hc_" not in name else name.rsplit("_", 1)[-1]
    if name == "embed.weight":
        return 0.0, 1.0
    if name.endswith("norm.weight"):
        return 1.0, 0.05
    if "hc_" in name:
        return {"fn": (0.0, spec.shape[-1] ** -0.5), "base": (0.0, 0.5), "scale": (0.5, 0.1)}[leaf]
    if name.endswith(("attn_sink", ".ape")):
        return 0.0, 1.0
    if name.endswith("gate.bias"):
        return 0.0, 0.1
    wide = 4.0 if name.endswith(("w1.weight", "w3.weight")) else 1.0
    return 0.0, wide * spec.shape[1] ** -0.5


def _tid2eid(cfg: DeepseekV4Config, name: str, seed: int, device: torch.device) -> torch.Tensor:
    """Each token's experts: num_experts_per_tok distinct ids, drawn uniformly."""
    generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    keys = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=generator, device=device)
    return keys.argsort(-1)[:, : cfg.num_experts_per_tok].to(torch.int64)


def _shard_groups(specs: dict[str, V4TensorSpec], num_layers: int) -> list[list[str]]:
    """Weights per shard: the embedding, one shard per layer, then the final norm, head and hc_head."""
    groups = [["embed.weight"]] + [[n for n in specs if n.startswith(f"layers.{i}.")] for i in range(num_layers)]
    return groups + [[n for n in TOP_LEVEL if n != "embed.weight"]]


def checkpoint_bytes(cfg: DeepseekV4Config) -> int:
    """The bytes of the tensors a checkpoint of ``cfg`` stores (the disk it takes, headers aside)."""
    specs = tensor_specs(cfg, cfg.num_hidden_layers)
    return sum(_nbytes(*v) for name, spec in specs.items() for v in stored_layout(name, spec).values())


def write_files(tmp: Path, preset_name: str, cfg: DeepseekV4Config, seed: int, device: torch.device,
                progress: Progress | None) -> None:
    """Write the checkpoint files of ``cfg`` into the directory ``tmp`` (``minirt.synthetic`` renames it
    into place): config.json, the shards, the index (with the generator record), tokenizer.json for v4-tiny."""
    preset = PRESETS[preset_name]
    specs = tensor_specs(cfg, cfg.num_hidden_layers)
    total = checkpoint_bytes(cfg)
    config: dict[str, Any] = {**preset.extra_config, **cfg.to_dict()}
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    groups = _shard_groups(specs, cfg.num_hidden_layers)
    weight_map: dict[str, str] = {}
    done = 0
    for k, names in enumerate(groups, start=1):
        shard_name = f"model-{k:05d}-of-{len(groups):06d}.safetensors"
        shard_layout = {n: v for name in names for n, v in stored_layout(name, specs[name]).items()}
        with _SafetensorsWriter(tmp / shard_name, shard_layout) as writer:
            for name in names:
                spec = specs[name]
                if spec.fmt == "int64":
                    done += writer.write_rows(name, 0, _tid2eid(cfg, name, seed, device))
                    continue
                chunks = _row_chunks(name, TensorSpec(spec.shape, False), seed, device, 128, _mean_std(name, spec))
                for first_row, rows in chunks:
                    if spec.fmt == "fp8":
                        w, scale = quantize_fp8(rows, (128, 128))
                        done += writer.write_rows(scale_name(name), first_row // 128, scale)
                    elif spec.fmt == "fp4":
                        w, scale = quantize_fp4(rows)
                        done += writer.write_rows(scale_name(name), first_row, scale)
                    else:
                        w = rows.to(shard_layout[name][0])
                    done += writer.write_rows(name, first_row, w)
                    if progress is not None:
                        progress(done, total, name)
        weight_map |= {n: shard_name for n in shard_layout}

    metadata = {"total_size": total, GENERATOR_KEY: _generator_record(preset_name, seed, device)}
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))},
                                             indent=2) + "\n")
    if preset.tokenizer:
        byte_level_tokenizer(cfg.bos_token_id, cfg.eos_token_id).save(str(tmp / TOKENIZER_FILE))
