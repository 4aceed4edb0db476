"""Read the leading layers of a Hugging Face DeepSeek-V3 / V3.2 checkpoint, dense and MoE.

Layout (see ``tensor_specs``): ``config.json`` plus either ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {tensor: shard}}``) with its shards, or one ``model.safetensors``.
Quantised checkpoints store each linear weight as float8_e4m3fn with a float32 ``<name>_scale_inv``
partner (see ``minirt.blockfp8``). Layers >= ``num_hidden_layers`` (the MTP module) are never read.
A MoE layer's routed experts are stored one tensor per expert and projection; the loader stacks them
(``stacked_expert_name``) into the layout the MoE kernels read, as stored (e4m3 with their block scales).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ...blockfp8 import FP8_DTYPE, block_scale_shape
from ...config import ModelConfig
from ...device import resolve_device
from ...errors import CheckpointError, InputError
from ...files import as_path
from ...shards import (UNQUANTIZED_DTYPES, LoadPlan, Progress, check_checkpoint_dir, check_load_dtype, check_weights_fit,
                       load_tensor, locate_tensors, open_shards)
from ...parallel import SINGLE, Shard, TensorParallel
from .parallel import expert_range, weight_shard

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape of one checkpoint weight, and whether it is stored as block fp8.

    A quantised weight ``name`` is stored float8_e4m3fn with a float32 partner ``name + "_scale_inv"``
    of shape ``block_scale_shape(shape, cfg.quantization.weight_block_size)``.
    """

    shape: tuple[int, ...]
    quantized: bool
    fp32: bool = False  # kept float32 whatever the load dtype (what runs in fp32: the router, the indexer's
                        # k_norm and weights_proj)


def _check_num_layers(cfg: ModelConfig, num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise InputError(f"num_layers must be a positive int, got {num_layers!r}")
    if num_layers > cfg.num_hidden_layers:
        raise CheckpointError(
            f"asked for {num_layers} layers, but the model has {cfg.num_hidden_layers} (num_hidden_layers): "
            f"load at most {cfg.num_hidden_layers} layer(s)"
        )


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stacked_expert_name(name: str) -> tuple[str, int, int] | None:
    """Where one expert's stored weight goes in its layer's stacked experts, or None for other tensors.

    ``model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight`` [I, D] → rows [0, I) / [I, 2I) of expert
    e of ``model.layers.{i}.mlp.experts.gate_up_proj.weight`` [E, 2I, D]; ``...{e}.down_proj.weight``
    [D, I] → expert e of ``model.layers.{i}.mlp.experts.down_proj.weight`` [E, D, I]. Their
    ``_scale_inv`` partners stack the same way (rows in blocks). Returns (stacked name, e, part) with
    part 0 for gate and down, 1 for up (the second half of the rows).
    """
    m = _EXPERT_NAME.fullmatch(name)
    if m is None:
        return None
    prefix, expert, proj = m.groups()
    stacked = f"{prefix}.down_proj.weight" if proj == "down_proj" else f"{prefix}.gate_up_proj.weight"
    return stacked, int(expert), int(proj == "up_proj")


def stacked_expert_specs(cfg: ModelConfig, layer: int, n_experts: int | None = None) -> dict[str, TensorSpec]:
    """MoE layer ``layer``'s stacked experts as the loader returns them: ``...mlp.experts.gate_up_proj.weight``
    [E, 2I, D] (gate rows, then up rows) and ``...mlp.experts.down_proj.weight`` [E, D, I], each with a
    float32 ``_scale_inv`` [E, rows / 128, cols / 128] when quantised; empty for a dense layer.
    E: ``n_experts`` (a rank's share), default ``n_routed_experts``."""
    if not cfg.is_moe_layer(layer):
        return {}
    moe, hidden, fp8 = cfg.moe, cfg.hidden_size, cfg.quantization is not None
    e = moe.n_routed_experts if n_experts is None else n_experts
    prefix = f"model.layers.{layer}.mlp.experts"
    return {f"{prefix}.gate_up_proj.weight": TensorSpec((e, 2 * moe.moe_intermediate_size, hidden), fp8),
            f"{prefix}.down_proj.weight": TensorSpec((e, hidden, moe.moe_intermediate_size), fp8)}


def stacked_scale_shape(spec: TensorSpec, block: tuple[int, int]) -> tuple[int, int, int]:
    """The ``_scale_inv`` shape of a stacked expert tensor [E, rows, cols]: [E, rows / b0, cols / b1]."""
    return (spec.shape[0], *block_scale_shape(spec.shape[1:], block))


def tensor_specs(cfg: ModelConfig, num_layers: int) -> dict[str, TensorSpec]:
    """The checkpoint layout: HF weight name → TensorSpec, for layers 0..num_layers-1 and the
    top-level tensors (``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``).

    Shapes are (out, in) for linear weights. Quantised (when ``cfg.quantization`` is set): every linear
    projection except embeddings, lm_head, norms, ``indexer.weights_proj``, ``indexer.k_norm`` and the
    MoE router (``mlp.gate.weight`` [E, hidden] and ``mlp.gate.e_score_correction_bias`` [E], kept
    fp32). A MoE layer (``cfg.is_moe_layer``) has, instead of the dense ``mlp.{gate,up,down}_proj``,
    the router, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` for e < n_routed_experts ([I, hidden],
    [I, hidden], [hidden, I] with I = moe_intermediate_size) and, with n_shared_experts > 0,
    ``mlp.shared_experts.{gate,up,down}_proj.weight`` (width n_shared_experts · I).
    ``_scale_inv`` partners are not listed. Raises InputError for num_layers < 1 and CheckpointError when
    num_layers exceeds ``cfg.num_hidden_layers``.
    """
    _check_num_layers(cfg, num_layers)
    fp8 = cfg.quantization is not None
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads

    def linear(out: int, inp: int) -> TensorSpec:
        return TensorSpec((out, inp), fp8)

    def plain(*shape: int) -> TensorSpec:
        return TensorSpec(shape, False)

    specs: dict[str, TensorSpec] = {"model.embed_tokens.weight": plain(cfg.vocab_size, hidden)}
    for i in range(num_layers):
        layer = {
            "input_layernorm.weight": plain(hidden),
            "post_attention_layernorm.weight": plain(hidden),
            "self_attn.q_a_proj.weight": linear(cfg.q_lora_rank, hidden),
            "self_attn.q_a_layernorm.weight": plain(cfg.q_lora_rank),
            "self_attn.q_b_proj.weight": linear(heads * cfg.qk_head_dim, cfg.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden),
            "self_attn.kv_a_layernorm.weight": plain(cfg.kv_lora_rank),
            "self_attn.kv_b_proj.weight": linear(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            "self_attn.o_proj.weight": linear(hidden, heads * cfg.v_head_dim),
        }
        layer |= _moe_specs(cfg, linear) if cfg.is_moe_layer(i) else _swiglu_specs("mlp", cfg.intermediate_size, hidden, linear)
        if cfg.is_v32:
            layer |= {
                "self_attn.indexer.wq_b.weight": linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                "self_attn.indexer.wk.weight": linear(cfg.index_head_dim, hidden),
                # These three run in fp32 (weights_proj is bf16 in the real checkpoint): loaded so, no step
                # converts them.
                "self_attn.indexer.k_norm.weight": TensorSpec((cfg.index_head_dim,), False, fp32=True),
                "self_attn.indexer.k_norm.bias": TensorSpec((cfg.index_head_dim,), False, fp32=True),
                "self_attn.indexer.weights_proj.weight": TensorSpec((cfg.index_n_heads, hidden), False, fp32=True),
            }
        specs |= {f"model.layers.{i}.{name}": spec for name, spec in layer.items()}
    specs["model.norm.weight"] = plain(hidden)
    specs["lm_head.weight"] = plain(cfg.vocab_size, hidden)
    return specs


def _swiglu_specs(prefix: str, width: int, hidden: int, linear) -> dict[str, TensorSpec]:
    return {f"{prefix}.gate_proj.weight": linear(width, hidden), f"{prefix}.up_proj.weight": linear(width, hidden),
            f"{prefix}.down_proj.weight": linear(hidden, width)}


def _moe_specs(cfg: ModelConfig, linear) -> dict[str, TensorSpec]:
    moe, hidden = cfg.moe, cfg.hidden_size
    specs = {"mlp.gate.weight": TensorSpec((moe.n_routed_experts, hidden), False, fp32=True),
             "mlp.gate.e_score_correction_bias": TensorSpec((moe.n_routed_experts,), False, fp32=True)}
    for e in range(moe.n_routed_experts):
        specs |= _swiglu_specs(f"mlp.experts.{e}", moe.moe_intermediate_size, hidden, linear)
    if moe.n_shared_experts:
        specs |= _swiglu_specs("mlp.shared_experts", moe.n_shared_experts * moe.moe_intermediate_size, hidden, linear)
    return specs


def plan_load(path: str | Path, num_layers: int | None = None) -> LoadPlan:
    """Plan loading the first ``num_layers`` layers (None: every layer, ``num_hidden_layers``) of the
    checkpoint directory ``path``, reading only config.json, the index and the headers of the shards needed.

    Checks that every needed tensor is mapped to an existing shard and present in its header with the
    expected dtype and shape (fp8 weights float8_e4m3fn with a float32 ``_scale_inv`` of the block grid
    shape; others bf16/fp16/fp32). Only regular files are read, and only files inside ``path`` (a
    shard name in the index may not be absolute or hold ``..``; a symlink in ``path`` may point
    anywhere). Raises InputError for an empty path, ConfigError for a bad config.json, CheckpointError
    (naming the tensor and shard or file) for everything else, including more layers than the model has.
    """
    path = as_path(path, "checkpoint path")
    check_checkpoint_dir(path)
    cfg = ModelConfig.from_file(path / "config.json")
    if num_layers is None:
        num_layers = cfg.num_hidden_layers
    specs = tensor_specs(cfg, num_layers)
    block = cfg.quantization.weight_block_size if cfg.quantization else None

    expected: dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = {}
    for name, spec in specs.items():
        if spec.quantized:
            expected[name] = ((FP8_DTYPE,), spec.shape)
            expected[name + SCALE_SUFFIX] = ((torch.float32,), block_scale_shape(spec.shape, block))
        else:
            expected[name] = (UNQUANTIZED_DTYPES, spec.shape)

    stored, shard_files = locate_tensors(path, expected)
    return LoadPlan(
        path=path,
        config=cfg,
        num_layers=num_layers,
        specs=specs,
        stored=stored,
        shard_files=shard_files,
        num_parameters=sum(math.prod(spec.shape) for spec in specs.values()),
        num_bytes=sum(t.nbytes for t in stored.values()),
    )


def _check_ue8m0(scale: torch.Tensor, name: str, shard: Path) -> None:
    """A ue8m0 block scale is a power of two (an 8-bit exponent): zero, negative or any other value
    means the file is not what its config says."""
    mantissa, _ = torch.frexp(scale)
    bad = ~((scale > 0) & (mantissa == 0.5))
    if bad.any():
        index = int(bad.flatten().to(torch.uint8).argmax())
        raise CheckpointError(f"tensor {name} in {shard.name}: block scale {scale.flatten()[index].item():g} at flat "
                              f"index {index} is not a positive power of two, as config.json's scale_fmt 'ue8m0' says")


def spec_memory_bytes(name: str, spec: TensorSpec, block: tuple[int, int] | None, dtype: torch.dtype,
                      fp8_as_stored: bool) -> int:
    """Bytes weight ``name`` takes once loaded: routed experts and, with ``fp8_as_stored``, every
    quantised weight as stored (e4m3 + float32 block scales); the router in float32; the rest in dtype."""
    n = math.prod(spec.shape)
    if spec.quantized and (fp8_as_stored or stacked_expert_name(name) is not None):
        return n + 4 * math.prod(block_scale_shape(spec.shape, block))
    return n * (4 if spec.fp32 else dtype.itemsize)


def layer_memory_bytes(cfg: ModelConfig, specs: dict[str, TensorSpec], dtype: torch.dtype,
                       fp8_as_stored: bool) -> tuple[int, list[int]]:
    """(bytes of the top-level tensors, bytes of each layer in order) that ``load_checkpoint`` holds
    for ``specs`` (``spec_memory_bytes``)."""
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    top, layers = 0, {}
    for name, spec in specs.items():
        size = spec_memory_bytes(name, spec, block, dtype, fp8_as_stored)
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            layers[i] = layers.get(i, 0) + size
        else:
            top += size
    return top, [layers[i] for i in sorted(layers)]


def expert_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of MoE layer ``layer``'s routed experts once loaded (as stored: e4m3 + float32 scales)."""
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    return sum(spec_memory_bytes(name, spec, block, torch.bfloat16, False) for name, spec in
               tensor_specs(cfg, layer + 1).items() if name.startswith(f"model.layers.{layer}.")
               and stacked_expert_name(name) is not None)


def weight_memory_bytes(cfg: ModelConfig, specs: dict[str, TensorSpec], dtype: torch.dtype, fp8_as_stored: bool) -> int:
    """Bytes of all the weights ``load_checkpoint`` holds for ``specs`` (``layer_memory_bytes`` summed)."""
    top, layers = layer_memory_bytes(cfg, specs, dtype, fp8_as_stored)
    return top + sum(layers)


def local_specs(cfg, specs: dict, tp: TensorParallel) -> dict:
    """``specs`` (name → TensorSpec, full shapes) with this rank's shapes, and only its experts' tensors
    (what ``load_checkpoint(..., tp=tp)`` holds: for its memory check)."""
    mine = expert_range(cfg, tp)
    out = {}
    for name, spec in specs.items():
        slot = stacked_expert_name(name)
        if slot is not None and slot[1] not in mine:
            continue
        shard = weight_shard(cfg, name, tp)
        out[name] = spec if shard is None else replace(spec, shape=shard.shape(spec.shape))
    return out


def _check_fits(plan: LoadPlan, device: torch.device, dtype: torch.dtype, fp8_as_stored: bool,
                specs: dict[str, TensorSpec] | None = None) -> None:
    """DeviceError, with both numbers and the largest layer count that fits, when the weights of
    ``plan`` (or ``specs``, a rank's share of them) exceed the free memory of ``device``: before
    anything is read."""
    check_weights_fit(plan, device, *layer_memory_bytes(plan.config, plan.specs if specs is None else specs, dtype,
                                                         fp8_as_stored))


def load_checkpoint(
    path: str | Path,
    num_layers: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    fp8_as_stored: bool = False,
    tp: TensorParallel = SINGLE,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load the first ``num_layers`` layers (None: every layer) plus embeddings, final norm and
    lm_head from the HF checkpoint directory ``path``.

    Opens only the shards holding those tensors (see ``plan_load`` for the layout checks) and first
    checks that the loaded weights fit in ``device``'s free memory (DeviceError naming both sizes and
    the largest layer count that fits). Every stored tensor, ``_scale_inv`` included, must be finite
    (NaN or ±Inf → CheckpointError naming the tensor, shard and first bad flat index), and a positive
    power of two where config.json's ``scale_fmt`` is ``ue8m0``; fp8 weights are dequantised
    (``blockfp8.dequantize_block_fp8``) and must stay finite in ``dtype``. Returns
    (config, {HF weight name: tensor}) with tensors of the TensorSpec shapes in ``dtype`` on ``device``
    (those of ``TensorSpec.fp32``, the MoE router's and the indexer's k_norm and weights_proj, in
    float32); no ``_scale_inv`` entries. With ``fp8_as_stored`` the fp8 weights are not dequantised: they
    come as stored (float8_e4m3fn) with their float32 ``<name>_scale_inv`` entries beside them. A MoE
    layer's routed experts always come as stored, stacked (``stacked_expert_specs``:
    ``...mlp.experts.gate_up_proj.weight`` [E, 2I, D] and ``...mlp.experts.down_proj.weight`` [E, D, I] with
    their ``_scale_inv``; in ``dtype`` for an unquantised checkpoint), copied in expert by expert so that no
    second copy is ever held. ``progress(done, total, name)``, if given, is called after each weight with
    bytes read so far and in total. ``tp`` (``minirt.parallel``): only this rank's part of each sharded
    weight (``weight_shard``; its ``_scale_inv`` likewise, in blocks, with ``fp8_as_stored``) and of the
    routed experts (``expert_range``, stacked from 0); the other experts are never read.
    """
    check_load_dtype(dtype)
    device = resolve_device(device)
    plan = plan_load(path, num_layers)
    cfg = plan.config
    _check_fits(plan, device, dtype, fp8_as_stored, local_specs(cfg, plan.specs, tp))
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    my_experts = expert_range(cfg, tp)
    stacked: dict[str, TensorSpec] = {}
    for i in range(plan.num_layers):
        stacked |= stacked_expert_specs(cfg, i, len(my_experts))

    weights: dict[str, torch.Tensor] = {}
    for name, spec in stacked.items():  # filled expert by expert below
        weights[name] = torch.empty(spec.shape, dtype=FP8_DTYPE if spec.quantized else dtype, device=device)
        if spec.quantized:
            weights[name + SCALE_SUFFIX] = torch.empty(stacked_scale_shape(spec, block), dtype=torch.float32,
                                                       device=device)
    done = 0
    with open_shards(plan) as files:

        def read(name: str, dtype: torch.dtype, scale_inv: torch.Tensor | None = None,
                 shard: Shard | None = None) -> torch.Tensor:
            stored = plan.stored[name]
            return load_tensor(files[stored.shard], stored, name, device, dtype, scale_inv, block, shard)

        for name, spec in plan.specs.items():
            names = (name, name + SCALE_SUFFIX) if spec.quantized else (name,)
            slot = stacked_expert_name(name)
            if slot is not None and slot[1] not in my_experts:  # another rank's expert
                done += sum(plan.stored[n].nbytes for n in names)
                continue
            shard = weight_shard(cfg, name, tp)
            scale = read(name + SCALE_SUFFIX, torch.float32) if spec.quantized else None
            if scale is not None and cfg.quantization.scale_fmt == "ue8m0":
                _check_ue8m0(scale, name + SCALE_SUFFIX, plan.stored[name + SCALE_SUFFIX].shard)
            if slot is not None:  # a routed expert: as stored, into its rows of the stacked tensors
                slot = (slot[0], slot[1] - my_experts.start, slot[2])
                _copy_expert(weights, slot, [read(name, FP8_DTYPE if spec.quantized else dtype)] +
                             ([scale] if scale is not None else []))
            elif scale is None:
                weights[name] = read(name, torch.float32 if spec.fp32 else dtype, shard=shard)
            elif fp8_as_stored:
                weights[name] = read(name, FP8_DTYPE, shard=shard)
                if shard is not None:
                    scale_shard = shard.in_blocks(block, name)
                    scale = scale.narrow(shard.dim, scale_shard.start, scale_shard.stop - scale_shard.start).clone()
                weights[name + SCALE_SUFFIX] = scale
            else:
                weights[name] = read(name, dtype, scale, shard)
            done += sum(plan.stored[n].nbytes for n in names)
            if progress is not None:
                progress(done, plan.num_bytes, name)
    return plan.config, weights


def _copy_expert(weights: dict[str, torch.Tensor], slot: tuple[str, int, int], raw: list[torch.Tensor]) -> None:
    """One expert's stored weight (and scale) into its rows of the stacked tensors (``stacked_expert_name``)."""
    stacked, expert, part = slot
    targets = [weights[stacked]] + ([weights[stacked + SCALE_SUFFIX]] if len(raw) == 2 else [])
    for target, t in zip(targets, raw):
        rows = t.shape[0]
        target[expert, part * rows : (part + 1) * rows].copy_(t)  # casts an unquantised expert to dtype
