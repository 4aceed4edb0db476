"""Read the leading layers of a Hugging Face DeepSeek-V3 / V3.2 checkpoint, dense and MoE.

Layout (see ``tensor_specs``): ``config.json`` plus either ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {tensor: shard}}``) with its shards, or one ``model.safetensors``.
Quantised checkpoints store each linear weight as float8_e4m3fn with a float32 ``<name>_scale_inv``
partner (see ``minirt.blockfp8``). Layers >= ``num_hidden_layers`` (the MTP module) are never read.
A MoE layer's routed experts are stored one tensor per expert and projection; the loader stacks them
(``stacked_expert_name``) into the layout the MoE kernels read, as stored (e4m3 with their block scales).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.filesize import decimal  # sizes in kB / MB / GB, as disks are sold

from .blockfp8 import FP8_DTYPE, block_scale_shape, dequantize_block_fp8
from .config import ModelConfig
from .errors import CheckpointError, DeviceError, InputError, excerpt
from .parallel import SINGLE, Shard, TensorParallel, expert_range, local_specs, weight_shard
from .files import (MAX_HEADER_BYTES, MAX_INDEX_BYTES, as_path, is_present, member, open_regular, os_reason, read_json,
                    shown, stat_regular)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"

# safetensors header dtype strings → torch dtypes (the ones a DeepSeek checkpoint can hold).
SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's ue8m0 weight scales
    "I8": torch.int8,                 # DeepSeek-V4's packed fp4 experts
    "I64": torch.int64,               # DeepSeek-V4's tid2eid routing table
}
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape of one checkpoint weight, and whether it is stored as block fp8.

    A quantised weight ``name`` is stored float8_e4m3fn with a float32 partner ``name + "_scale_inv"``
    of shape ``block_scale_shape(shape, cfg.quantization.weight_block_size)``.
    """

    shape: tuple[int, ...]
    quantized: bool
    fp32: bool = False  # kept float32 whatever the load dtype (the router's weight and bias)


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
                "self_attn.indexer.k_norm.weight": plain(cfg.index_head_dim),
                "self_attn.indexer.k_norm.bias": plain(cfg.index_head_dim),
                # bf16 in the real checkpoint: the indexer weights run in fp32.
                "self_attn.indexer.weights_proj.weight": plain(cfg.index_n_heads, hidden),
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


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # the file offset of its first data byte


def _is_size(value) -> bool:
    """A JSON non-negative integer (not a bool, which json also gives as an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """Parse and validate a safetensors file's header without reading tensor data.

    Returns tensor name → StoredTensor. Raises CheckpointError naming the file for a missing, not
    regular (a FIFO, a device) or truncated file, a header length beyond the file or beyond
    ``files.MAX_HEADER_BYTES`` (100 MB, the safetensors library's own cap), a header that is not a JSON object, an entry
    that is not ``{"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}``, a
    ``__metadata__`` that is not an object of strings, an unsupported dtype, a byte range that
    disagrees with dtype × shape, tensor data past the end of the file, or byte ranges that overlap,
    leave a hole or do not cover the data area exactly (the safetensors format forbids all three, and
    the safetensors library refuses such files when they are opened).
    """
    path = Path(path)
    f, st = open_regular(path, "safetensors file", CheckpointError)
    size = st.st_size
    try:
        with f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt safetensors file: header length {header_len:,} exceeds the "
                                      f"{MAX_HEADER_BYTES:,} bytes safetensors allows")
            if header_len > size - 8:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file: header length {header_len} exceeds the "
                    f"{size - 8} bytes after the length field"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise CheckpointError(f"{path}: corrupt safetensors header (JSON nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not an object of strings)")
    data_size = size - 8 - header_len
    tensors: dict[str, StoredTensor] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_str = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(dtype_str, str) and isinstance(shape, list) and all(_is_size(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {shown(name)}: {entry!r:.200}")
        dtype = SAFETENSORS_DTYPES.get(dtype_str)
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {shown(name)} has dtype {dtype_str:.40}, not one of {', '.join(SAFETENSORS_DTYPES)}"
            )
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if begin > end or end - begin != nbytes:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {shown(name)} byte range {[begin, end]} does not hold "
                f"{dtype_str} {shape} ({nbytes} bytes)"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {shown(name)} ends at data byte {end}, "
                f"but the file holds only {data_size} data bytes"
            )
        tensors[name] = StoredTensor(path, dtype, tuple(shape), nbytes, 8 + header_len + begin)
        ranges.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {shown(name)} starts at data byte {begin}, but the "
                f"tensors before it end at byte {covered} ({'overlap' if begin < covered else 'hole'})"
            )
        covered = end
    if covered != data_size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file: data bytes {covered}..{data_size} belong to no tensor"
        )
    return tensors


@dataclass(frozen=True)
class LoadPlan:
    """What ``load_checkpoint`` will read, worked out from config.json, the index and shard headers.

    ``specs``: weight name → TensorSpec (the layout); ``stored``: every tensor to read (weights and
    ``_scale_inv`` partners) → StoredTensor; ``shard_files``: only the shards holding them, sorted;
    ``num_parameters``: elements of the weights (scales not counted); ``num_bytes``: bytes to read.
    """

    path: Path
    config: ModelConfig
    num_layers: int
    specs: dict[str, TensorSpec]
    stored: dict[str, StoredTensor]
    shard_files: tuple[Path, ...]
    num_parameters: int
    num_bytes: int

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Names of the stored tensors to read, weights and scales."""
        return tuple(self.stored)


def read_weight_map(path: Path) -> tuple[str, dict[str, str]]:
    """(file the map comes from, tensor name → shard file name): the index, else the single file's header.

    The index is a regular file of at most ``files.MAX_INDEX_BYTES``; every shard name in it must name
    a file inside ``path`` (no absolute name, no ``..``): CheckpointError otherwise."""
    index_path = path / INDEX_FILE
    if is_present(index_path):
        index = read_json(index_path, INDEX_FILE, MAX_INDEX_BYTES, CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' of tensor name → shard file")
        for shard in set(weight_map.values()):
            member(path, shard, str(index_path), CheckpointError)
        return INDEX_FILE, weight_map
    single = path / SINGLE_FILE
    if is_present(single):
        return SINGLE_FILE, {name: SINGLE_FILE for name in read_safetensors_header(single)}
    raise CheckpointError(f"{path}: no {INDEX_FILE} or {SINGLE_FILE} found")


def check_checkpoint_dir(path: Path) -> None:
    """CheckpointError unless ``path`` is a directory (symlinks followed) with a regular config.json,
    saying what is there instead (nothing, a file, a symlink loop, a FIFO as config.json, ...)."""
    what = "(a checkpoint is a directory with config.json and safetensors shards)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown(path)}: no such directory {what}") from None
    except OSError as e:
        raise CheckpointError(f"{os_reason(e, path, 'checkpoint directory')} {what}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{shown(path)}: not a checkpoint directory {what}")
    stat_regular(path / "config.json", "config.json", CheckpointError,
                 missing=f"{shown(path)}: not a checkpoint directory (no config.json)")


def _check_stored(name: str, stored: StoredTensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if stored.dtype not in dtypes:
        raise CheckpointError(
            f"tensor {name} in {stored.shard.name}: dtype {stored.dtype} is wrong, expected "
            + " or ".join(str(d) for d in dtypes)
        )
    if stored.shape != shape:
        raise CheckpointError(
            f"tensor {name} in {stored.shard.name}: shape {list(stored.shape)} is wrong, expected {list(shape)}"
        )


def locate_tensors(
    path: Path, expected: dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]]
) -> tuple[dict[str, StoredTensor], tuple[Path, ...]]:
    """Find each tensor of ``expected`` (stored name → (accepted dtypes, shape)) in the checkpoint directory
    ``path`` through its index (or single file), reading only the headers of the shards holding them.
    Returns (stored name → StoredTensor, those shards sorted). CheckpointError naming the tensor: not in
    the map, mapped to a missing shard, absent from its shard, or of another dtype or shape."""
    map_file, weight_map = read_weight_map(path)
    shard_of: dict[str, Path] = {}
    for name in expected:
        if name not in weight_map:
            raise CheckpointError(f"{path}: tensor {name} is missing (not in {map_file})")
        shard = path / weight_map[name]
        stat_regular(shard, f"shard of tensor {name}", CheckpointError,
                     missing=f"{path}: tensor {name} is mapped to shard {weight_map[name]}, which does not exist")
        shard_of[name] = shard

    shard_files = tuple(sorted(set(shard_of.values())))
    headers = {shard: read_safetensors_header(shard) for shard in shard_files}
    stored: dict[str, StoredTensor] = {}
    for name, (dtypes, shape) in expected.items():
        shard = shard_of[name]
        if name not in headers[shard]:
            raise CheckpointError(f"tensor {name} is missing from shard {shard.name} (the index maps it there)")
        stored[name] = headers[shard][name]
        _check_stored(name, stored[name], dtypes, shape)
    return stored, shard_files


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


def _first_nonfinite(t: torch.Tensor) -> int | None:
    """Flat index of the first NaN or ±Inf in t, or None. float8_e4m3fn has NaN (0x7F / 0xFF) but no Inf."""
    bad = (t.view(torch.uint8) & 0x7F) == 0x7F if t.dtype == FP8_DTYPE else ~torch.isfinite(t)
    if not bad.any():
        return None
    return int(bad.flatten().to(torch.uint8).argmax())  # argmax returns the first of equal maxima


def _check_finite(t: torch.Tensor, name: str, shard: Path, what: str = "value", first: int = 0) -> None:
    """CheckpointError naming the first NaN or ±Inf of t; ``first``: the flat index of t's first element
    in the whole tensor (t may be a row range of it)."""
    index = _first_nonfinite(t)
    if index is not None:
        value = t.flatten()[index].float().item()
        raise CheckpointError(f"tensor {name} in {shard.name}: non-finite {what} ({value}) at flat index {first + index}")


READ_CHUNK_BYTES = 16 << 20  # stored bytes read, checked and converted at a time (its temporaries: ~5x)


def _read_rows(file, stored: StoredTensor, name: str, first_row: int, rows: int) -> torch.Tensor:
    """Rows [first_row, first_row + rows) of a stored tensor (along its leading dim; a 0-d tensor is
    one row), read from its open shard into a new CPU tensor of the stored dtype."""
    row_bytes = stored.nbytes // stored.shape[0] if stored.shape else stored.nbytes
    data = torch.empty(rows * row_bytes, dtype=torch.uint8)
    try:
        file.seek(stored.offset + first_row * row_bytes)
        got = file.readinto(memoryview(data.numpy()))
    except OSError as e:
        raise CheckpointError(f"{stored.shard}: cannot read tensor {name} ({e.strerror or e})") from None
    if got != data.numel():
        raise CheckpointError(f"{stored.shard}: cannot read tensor {name} (the file ends early)")
    return data.view(stored.dtype).view(rows, *stored.shape[1:]) if stored.shape else data.view(stored.dtype)[0]


def _load_tensor(file, stored: StoredTensor, name: str, device: torch.device, dtype: torch.dtype,
                 scale_inv: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                 shard: Shard | None = None) -> torch.Tensor:
    """One stored tensor as a new ``dtype`` tensor on ``device``, dequantised with ``scale_inv`` (its
    block scales, whole) when given; with ``shard`` only those rows or columns of it. It is read,
    checked finite (before and after the cast) and converted ``READ_CHUNK_BYTES`` of stored data at a
    time, straight into the result: loading holds the result and one chunk, never a second full-size
    copy (nor a memory map of the shard). A row shard reads only its rows (from the first whole scale
    block when dequantised); a column shard reads the rows chunk by chunk and keeps its columns."""
    out = torch.empty(stored.shape if shard is None else shard.shape(stored.shape), dtype=dtype, device=device)
    rows = stored.shape[0] if stored.shape else 1
    if rows == 0:
        return out
    first, last = (shard.start, shard.stop) if shard is not None and shard.dim == 0 else (0, rows)
    step = max(1, READ_CHUNK_BYTES // max(1, stored.nbytes // rows))
    if scale_inv is not None:
        step = max(block[0], step // block[0] * block[0])  # whole scale blocks per chunk
        first, last = first // block[0] * block[0], min(rows, -(-last // block[0]) * block[0])
    per_row = math.prod(stored.shape[1:])
    for start in range(first, last, step):
        n = min(step, last - start)
        raw = _read_rows(file, stored, name, start, n)
        _check_finite(raw, name, stored.shard, first=start * per_row)
        raw = raw.to(device)
        if scale_inv is not None:
            value = dequantize_block_fp8(raw, scale_inv[start // block[0] : -(-(start + n) // block[0])], block, dtype)
        else:
            value = raw.to(dtype)
        if value.dtype != stored.dtype:
            _check_finite(value, name, stored.shard, f"value after conversion to {dtype}", first=start * per_row)
        if shard is not None and shard.dim == 1:
            value = value[:, shard.start : shard.stop]
        if shard is not None and shard.dim == 0:  # the rows of this chunk inside the shard
            lo, hi = max(start, shard.start), min(start + n, shard.stop)
            out[lo - shard.start : hi - shard.start].copy_(value[lo - start : hi - start])
        elif stored.shape:
            out[start : start + n].copy_(value)
        else:
            out.copy_(value)
    return out


DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """torch.device(device) of type cpu or cuda; InputError if unparsable or of another type (xpu, meta,
    ...: minirt runs on neither), DeviceError if it is CUDA and none (or no such index) is available."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"not a torch device: {excerpt(device)}") from None
    if device.type not in DEVICE_TYPES:
        raise InputError(f"device {excerpt(str(device))}: minirt runs on {' or '.join(DEVICE_TYPES)} only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device``: CUDA's free memory, or the CPU's available RAM
    (MemAvailable in /proc/meminfo; elsewhere free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def _check_fits(plan: LoadPlan, device: torch.device, dtype: torch.dtype, fp8_as_stored: bool,
                specs: dict[str, TensorSpec] | None = None) -> None:
    """DeviceError, with both numbers and the largest layer count that fits, when the weights of
    ``plan`` (or ``specs``, a rank's share of them) exceed the free memory of ``device``: before
    anything is read."""
    top, layers = layer_memory_bytes(plan.config, plan.specs if specs is None else specs, dtype, fp8_as_stored)
    need, free = top + sum(layers), available_memory(device)
    if need <= free:
        return
    fits, total = 0, top
    while fits < len(layers) and total + layers[fits] <= free:
        total += layers[fits]
        fits += 1
    advice = f"at most {fits} layer(s) fit (--layers {fits})" if fits else "not even one layer fits"
    raise DeviceError(f"{plan.num_layers} layer(s) of {plan.path} need {decimal(need)} of weights on {device.type}, "
                      f"{decimal(free)} is free: {advice}")


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
    (the MoE router's in float32); no ``_scale_inv`` entries. With ``fp8_as_stored`` the fp8 weights
    are not dequantised: they come as stored (float8_e4m3fn) with their float32 ``<name>_scale_inv``
    entries beside them. A MoE layer's routed experts always come as stored, stacked
    (``stacked_expert_specs``: ``...mlp.experts.gate_up_proj.weight`` [E, 2I, D] and
    ``...mlp.experts.down_proj.weight`` [E, D, I] with their ``_scale_inv``; in ``dtype`` for an
    unquantised checkpoint), copied in expert by expert so that no second copy is ever held.
    ``progress(done, total, name)``, if given, is called after each weight with bytes read so far and
    in total. ``tp`` (``minirt.parallel``): only this rank's part of each sharded weight
    (``weight_shard``; its ``_scale_inv`` likewise, in blocks, with ``fp8_as_stored``) and of the
    routed experts (``expert_range``, stacked from 0); the other experts are never read.
    """
    if dtype not in UNQUANTIZED_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(map(str, UNQUANTIZED_DTYPES))}, got {dtype!r}")
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
    with contextlib.ExitStack() as stack:
        files = {}
        for shard in plan.shard_files:
            try:
                files[shard] = stack.enter_context(open(shard, "rb", buffering=0))
            except OSError as e:
                raise CheckpointError(f"{shard}: cannot open safetensors file ({e.strerror or e})") from None

        def read(name: str, dtype: torch.dtype, scale_inv: torch.Tensor | None = None,
                 shard: Shard | None = None) -> torch.Tensor:
            stored = plan.stored[name]
            return _load_tensor(files[stored.shard], stored, name, device, dtype, scale_inv, block, shard)

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
