"""DeepSeek-V4 checkpoints in DeepSeek's native layout, and loading their first N layers.

Names (``tensor_specs``): per layer ``layers.{i}.`` + ``attn_norm`` / ``ffn_norm``, the mHC mappings
``hc_attn_{fn,base,scale}`` / ``hc_ffn_*``, ``attn.*`` (``wq_a``, ``q_norm``, ``wq_b``, ``wkv``,
``kv_norm``, ``wo_a``, ``wo_b``, ``attn_sink``; CSA / HCA: ``compressor.*``; CSA: ``indexer.*``), and the
MoE ``ffn.gate.*``, ``ffn.experts.{e}.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``; at the top
``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_{fn,base,scale}``. The MTP module
(``mtp.*``) is never read.

Stored formats (:class:`V4TensorSpec.fmt`): "fp8" e4m3 weights with a ``<module>.scale`` of ue8m0 128×128
block scales; "fp4" experts (e2m1 packed in int8 [out, in/2], ``.scale`` [out, in/32]); "bf16" norms,
embeddings, head, router and the compressor / indexer projections; "fp32" mHC parameters, sinks, the
compressors' ``ape`` and the router bias; "int64" ``tid2eid``. Loading reuses ``minirt.shards``'s
index and header reading and finite checks; only the shards holding the requested tensors are opened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ...blockfp8 import FP8_DTYPE, block_scale_shape, dequantize_block_fp8
from ...device import resolve_device
from ...shards import (UNQUANTIZED_DTYPES, LoadPlan, Progress, check_finite, check_load_dtype, check_weights_fit, load_tensor,
                       locate_tensors, open_shards)
from ...errors import CheckpointError, InputError
from ...parallel import SINGLE, TensorParallel
from .config import FP4_BLOCK, DeepseekV4Config, LayerKind, MODEL_TYPE
from .parallel import holds, weight_shard
from .quant import E8M0_DTYPE, check_pow2_scales, dequantize_fp4

SCALE_DTYPES = (E8M0_DTYPE, torch.float32)  # fp32 scales: V4-Flash-Base's fp8 experts
TOP_LEVEL = ("embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


@dataclass(frozen=True)
class V4TensorSpec:
    """One weight's logical shape ([out, in] for linear weights) and stored format: "fp8", "fp4",
    "bf16", "fp32" or "int64"."""

    shape: tuple[int, ...]
    fmt: str


def scale_name(name: str) -> str:
    """``layers.0.attn.wq_a.weight`` → ``layers.0.attn.wq_a.scale``."""
    return name.removesuffix(".weight") + ".scale"


def stored_layout(name: str, spec: V4TensorSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The stored tensors of weight ``name`` → (dtype as released, shape): the weight, and its ``.scale``
    for fp8 / fp4."""
    if spec.fmt == "fp8":
        return {name: (FP8_DTYPE, spec.shape), scale_name(name): (E8M0_DTYPE, block_scale_shape(spec.shape, (128, 128)))}
    if spec.fmt == "fp4":
        out, inp = spec.shape
        return {name: (torch.int8, (out, inp // 2)), scale_name(name): (E8M0_DTYPE, (out, inp // FP4_BLOCK))}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}[spec.fmt]
    return {name: (dtype, spec.shape)}


def keeps_stored(name: str, spec: V4TensorSpec, as_stored: bool | str) -> bool:
    """Whether :func:`load_checkpoint` keeps weight ``name`` as stored: every fp8 / fp4 weight with
    ``as_stored=True``, only the routed experts' with ``as_stored="experts"``."""
    if spec.fmt not in ("fp8", "fp4") or not as_stored:
        return False
    return as_stored is True or ".ffn.experts." in name


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight as stored (e4m3 with 128×128 block scales, or packed e2m1 int8 with per-32 scales) → ``dtype``."""
    if weight.dtype == torch.int8:
        return dequantize_fp4(weight, scale, dtype)
    return dequantize_block_fp8(weight, scale.float(), (128, 128), torch.float32).to(dtype)


def _check_num_layers(cfg: DeepseekV4Config, num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise InputError(f"num_layers must be a positive int, got {num_layers!r}")
    if num_layers > cfg.num_hidden_layers:
        raise CheckpointError(f"asked for {num_layers} layers, but the checkpoint has {cfg.num_hidden_layers} "
                              "(num_hidden_layers; the MTP layers are not loaded)")


def layer_specs(cfg: DeepseekV4Config, i: int) -> dict[str, V4TensorSpec]:
    """Layer ``i``'s weights by their names relative to ``layers.{i}.``."""
    D, H, hd, q_lora = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    quant = cfg.quantization
    linear = "fp8" if quant else "bf16"
    expert = (quant.expert_dtype if quant else "bf16")

    def spec(fmt: str, *shape: int) -> V4TensorSpec:
        return V4TensorSpec(shape, fmt)

    hc = {f"hc_{part}_{k}": spec("fp32", *shape) for part in ("attn", "ffn")
          for k, shape in (("fn", (cfg.hc_dim, cfg.hc_mult * D)), ("base", (cfg.hc_dim,)), ("scale", (3,)))}
    w = {
        "attn_norm.weight": spec("bf16", D),
        "ffn_norm.weight": spec("bf16", D),
        **hc,
        "attn.wq_a.weight": spec(linear, q_lora, D),
        "attn.q_norm.weight": spec("bf16", q_lora),
        "attn.wq_b.weight": spec(linear, H * hd, q_lora),
        "attn.wkv.weight": spec(linear, hd, D),
        "attn.kv_norm.weight": spec("bf16", hd),
        "attn.wo_a.weight": spec(linear, cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
        "attn.wo_b.weight": spec(linear, D, cfg.o_groups * cfg.o_lora_rank),
        "attn.attn_sink": spec("fp32", H),
    }
    kind = cfg.layer_kinds[i]
    if kind != LayerKind.SWA:
        coff = 2 if kind == LayerKind.CSA else 1  # CSA's overlapping windows carry two halves
        w |= {
            "attn.compressor.wkv.weight": spec("bf16", coff * hd, D),
            "attn.compressor.wgate.weight": spec("bf16", coff * hd, D),
            "attn.compressor.ape": spec("fp32", kind.ratio, coff * hd),
            "attn.compressor.norm.weight": spec("bf16", hd),
        }
    if kind == LayerKind.CSA:
        ihd = cfg.index_head_dim
        w |= {
            "attn.indexer.wq_b.weight": spec(linear, cfg.index_n_heads * ihd, q_lora),
            "attn.indexer.weights_proj.weight": spec("bf16", cfg.index_n_heads, D),
            "attn.indexer.compressor.wkv.weight": spec("bf16", 2 * ihd, D),
            "attn.indexer.compressor.wgate.weight": spec("bf16", 2 * ihd, D),
            "attn.indexer.compressor.ape": spec("fp32", kind.ratio, 2 * ihd),
            "attn.indexer.compressor.norm.weight": spec("bf16", ihd),
        }
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    w["ffn.gate.weight"] = spec("bf16", E, D)
    if cfg.is_hash_layer(i):
        w["ffn.gate.tid2eid"] = spec("int64", cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        w["ffn.gate.bias"] = spec("fp32", E)
    for e in range(E):
        w |= {f"ffn.experts.{e}.w1.weight": spec(expert, inter, D), f"ffn.experts.{e}.w3.weight": spec(expert, inter, D),
              f"ffn.experts.{e}.w2.weight": spec(expert, D, inter)}
    w |= {"ffn.shared_experts.w1.weight": spec(linear, inter, D), "ffn.shared_experts.w3.weight": spec(linear, inter, D),
          "ffn.shared_experts.w2.weight": spec(linear, D, inter)}
    return w


def tensor_specs(cfg: DeepseekV4Config, num_layers: int) -> dict[str, V4TensorSpec]:
    """The checkpoint layout: name → V4TensorSpec for layers 0..num_layers-1 (``layers.{i}.*``, see
    :func:`layer_specs`) and the top-level tensors (``TOP_LEVEL``). InputError for num_layers < 1,
    CheckpointError past ``num_hidden_layers``."""
    _check_num_layers(cfg, num_layers)
    D, V = cfg.hidden_size, cfg.vocab_size
    specs = {"embed.weight": V4TensorSpec((V, D), "bf16")}
    for i in range(num_layers):
        specs |= {f"layers.{i}.{name}": spec for name, spec in layer_specs(cfg, i).items()}
    specs |= {
        "norm.weight": V4TensorSpec((D,), "bf16"),
        "head.weight": V4TensorSpec((V, D), "bf16"),
        "hc_head_fn": V4TensorSpec((cfg.hc_mult, cfg.hc_mult * D), "fp32"),
        "hc_head_base": V4TensorSpec((cfg.hc_mult,), "fp32"),
        "hc_head_scale": V4TensorSpec((1,), "fp32"),
    }
    return specs


def _accepted_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Stored dtypes the loader takes where the release has ``dtype``: scales e8m0 or fp32, float
    tensors any of bf16 / fp16 / fp32, tid2eid int64 or int32."""
    if dtype == E8M0_DTYPE:
        return SCALE_DTYPES
    if dtype in UNQUANTIZED_DTYPES:
        return UNQUANTIZED_DTYPES
    if dtype == torch.int64:
        return (torch.int64, torch.int32)
    return (dtype,)


def plan_load(path: str | Path, num_layers: int | None = None) -> LoadPlan:
    """Plan loading the first ``num_layers`` layers (None: all) of the V4 checkpoint directory ``path``
    from config.json, the index and the headers of the shards needed: every tensor mapped to an existing
    shard, present there with an accepted dtype and the expected shape. ConfigError for a bad config,
    CheckpointError naming the tensor for everything else."""
    from ...config import load_config

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = load_config(path / "config.json")
    if not isinstance(cfg, DeepseekV4Config):
        raise CheckpointError(f"{path}: model_type {cfg.model_type!r} is not {MODEL_TYPE!r}")
    num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
    specs = tensor_specs(cfg, num_layers)
    expected = {n: (_accepted_dtypes(dtype), shape) for name, spec in specs.items()
                for n, (dtype, shape) in stored_layout(name, spec).items()}
    stored, shard_files = locate_tensors(path, expected)
    return LoadPlan(path, cfg, num_layers, specs, stored, shard_files,
                      num_parameters=sum(math.prod(s.shape) for s in specs.values()),
                      num_bytes=sum(t.nbytes for t in stored.values()))


def _check_tid2eid(t: torch.Tensor, name: str, num_experts: int) -> None:
    bad = (t < 0) | (t >= num_experts)
    if bad.any():
        index = int(bad.flatten().to(torch.uint8).argmax())
        raise CheckpointError(f"tensor {name}: expert id {int(t.flatten()[index])} at flat index {index} is outside "
                              f"[0, n_routed_experts={num_experts})")


def layer_memory_bytes(plan: LoadPlan, dtype: torch.dtype, as_stored: bool | str,
                       tp: TensorParallel = SINGLE) -> tuple[int, list[int]]:
    """(bytes outside the layers, [bytes of layer i]) that :func:`load_checkpoint` holds for ``plan``:
    fp8 / fp4 weights with their scales as stored (:func:`keeps_stored`) or dequantised to ``dtype``,
    ``tid2eid`` int64, every other weight in ``dtype``; with ``tp``, rank ``tp.rank``'s experts and slices only."""
    top, layers = 0, [0] * plan.num_layers
    for name, spec in plan.specs.items():
        if not holds(plan.config, name, tp):
            continue
        if keeps_stored(name, spec, as_stored):
            size = sum(plan.stored[n].nbytes for n in stored_layout(name, spec))
        else:
            size = math.prod(spec.shape) * (8 if spec.fmt == "int64" else dtype.itemsize)
        shard = weight_shard(plan.config, name, tp)
        if shard is not None:  # a slice of whole scale blocks: the same fraction of the scales
            size = size * (shard.stop - shard.start) // spec.shape[shard.dim]
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += size
        else:
            top += size
    return top, layers


def load_checkpoint(
    path: str | Path,
    num_layers: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    as_stored: bool | str = False,
    tp: TensorParallel = SINGLE,
) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """Load the first ``num_layers`` layers (None: all) and the top-level tensors of a V4 checkpoint,
    dequantised: returns (config, {name: tensor}) with the :func:`tensor_specs` names and shapes, float
    weights in ``dtype`` and ``ffn.gate.tid2eid`` int64, on ``device``; no ``.scale`` entries.
    With ``as_stored`` the fp8 / fp4 weights stay as stored instead (float8_e4m3fn, or int8 packed fp4),
    each with its ``.scale`` entry (:func:`scale_name`) as released (float8_e8m0fnu), checked as powers of two;
    with ``as_stored="experts"`` only the routed experts' (what the fp32 reference keeps, a quarter or less of
    their dequantised bytes: :func:`dequantize_stored` when it uses them).

    Opens only the shards :func:`plan_load` lists, after checking that the weights fit in ``device``'s free
    memory (:func:`layer_memory_bytes`; DeviceError naming both sizes and the largest layer count that
    fits). Refused with a CheckpointError naming the tensor: a stored NaN / ±Inf, a scale that is not a
    positive power of two (ue8m0: zero, NaN, 3.0, ...), a ``tid2eid`` entry outside [0, n_routed_experts),
    a value that overflows ``dtype``.
    ``progress(done, total, name)`` is called after each weight with bytes read so far and in total.
    ``tp`` (``minirt.parallel``): only this rank's part of each split weight (``.parallel.weight_shard``,
    its fp8 ``.scale`` in whole 128×128 blocks) and only its routed experts (``.parallel.expert_range``),
    which is what the memory check counts.
    """
    check_load_dtype(dtype)
    device = resolve_device(device)
    plan = plan_load(path, num_layers)
    check_weights_fit(plan, device, *layer_memory_bytes(plan, dtype, as_stored, tp))
    weights: dict[str, torch.Tensor] = {}
    done = 0
    with open_shards(plan) as files:
        cpu = torch.device("cpu")
        for name, spec in plan.specs.items():
            if not holds(plan.config, name, tp):
                continue
            names = list(stored_layout(name, spec))
            shard = weight_shard(plan.config, name, tp)
            shards = [shard, shard.in_blocks((128, 128), name)] if shard and spec.fmt == "fp8" else [shard] * len(names)
            raw = [load_tensor(files[plan.stored[n].shard], plan.stored[n], n, cpu, plan.stored[n].dtype, shard=sh)
                   for n, sh in zip(names, shards)]
            if spec.fmt in ("fp8", "fp4"):
                check_pow2_scales(raw[1], names[1])
            if keeps_stored(name, spec, as_stored):
                weights[name], weights[names[1]] = (t.to(device, copy=True) for t in raw)  # own, aligned storage
            elif spec.fmt in ("fp8", "fp4"):
                weights[name] = dequantize_stored(raw[0], raw[1]).to(device=device, dtype=dtype)
                check_finite(weights[name], name, plan.stored[name].shard, f"value after conversion to {dtype}")
            elif spec.fmt == "int64":
                _check_tid2eid(raw[0], name, plan.config.n_routed_experts)
                weights[name] = raw[0].to(device=device, dtype=torch.int64)
            else:
                weights[name] = raw[0].to(device=device, dtype=dtype)
                check_finite(weights[name], name, plan.stored[name].shard, f"value after conversion to {dtype}")
            done += sum(plan.stored[n].nbytes for n in names)
            if progress is not None:
                progress(done, plan.num_bytes, name)
    return plan.config, weights
