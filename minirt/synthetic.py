"""Synthetic DeepSeek-V3.2 checkpoints in the real Hugging Face layout (``minirt init``).

The files mirror the published DeepSeek-V3.2 checkpoint: ``config.json``, sharded safetensors named
``model-XXXXX-of-NNNNNN.safetensors`` plus ``model.safetensors.index.json``; linear weights block fp8
(float8_e4m3fn + float32 ``weight_scale_inv``, power-of-two scales); embeddings, lm_head and
``indexer.weights_proj`` bf16; norm weights and ``indexer.k_norm`` float32. The layout comes from
``checkpoint.tensor_specs``, so writer and reader cannot disagree.

Values are random but deterministic: each tensor is drawn from its own generator, seeded from the
global seed and a CRC32 of the tensor name, in fixed-size row chunks (a given seed, preset and device
type always give the same bytes; CPU and CUDA generators differ). Tensors are generated, quantised and
written chunk by chunk (about 64 MiB of float32 each), so the v32 preset (4.3 GB for one layer) peaks at
a few hundred MB of memory.
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import json
import math
import os
import re
import shutil
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .blockfp8 import FP8_DTYPE, block_scale_shape, quantize_block_fp8
from .models.deepseek_v32.checkpoint import SCALE_SUFFIX, TensorSpec, plan_load, tensor_specs
from .device import resolve_device
from .shards import INDEX_FILE, Progress
from .config import INT_LIMITS, Fp8Quantization, ModelConfig, MoeConfig, YarnScaling
from .errors import InputError, MinirtError, WriteError
from .files import as_path
from .tokenizer import TOKENIZER_FILE

BOS_TOKEN, EOS_TOKEN = "<bos>", "<eos>"
CHUNK_ELEMENTS = 1 << 24  # rows per generated chunk ≈ this / columns (64 MiB of float32)
GENERATOR_KEY = "minirt_synthetic"  # in the index's metadata: what wrote the checkpoint (preset, seed, device)

_SAFETENSORS_DTYPE_NAMES = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32",
                            torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.int64: "I64"}


@dataclass(frozen=True)
class Preset:
    """A synthetic model: its config, the config.json keys minirt does not parse but the real file has,
    and whether a byte-level tokenizer.json is shipped (ids 0..255 = bytes, then <bos>, <eos>)."""

    config: ModelConfig
    extra_config: dict[str, Any]
    tokenizer: bool
    description: str


_V32_YARN = YarnScaling(
    factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)
_V32_FP8 = Fp8Quantization(weight_block_size=(128, 128), scale_fmt="ue8m0")


def _extra_config(cfg: ModelConfig) -> dict[str, Any]:
    """Keys of the real DeepSeek-V3.2 config.json that ModelConfig does not model."""
    return {
        "architectures": ["DeepseekV32ForCausalLM" if cfg.is_v32 else "DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "num_key_value_heads": cfg.num_attention_heads,
        "num_nextn_predict_layers": 0,  # no MTP layer is written
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.44.2",
        "use_cache": True,
    }


def _make_presets() -> dict[str, Preset]:
    tiny = ModelConfig(
        model_type="deepseek_v32",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=128,
        kv_lora_rank=512,  # the real latent and rope dims: kernels need d_qk 576, d_v 512
        qk_nope_head_dim=64,  # differs from v_head_dim so a swapped split shows
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        first_k_dense_replace=2,
        rope_scaling=_V32_YARN,
        quantization=_V32_FP8,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=32,  # below typical prompt lengths, so the sparse path is exercised
        bos_token_id=256,
        eos_token_id=257,
        # 2 MoE layers after the 2 dense ones: few, small experts (CPU tests stay fast), V3.2's routing
        # shape (groups of 4, the best 2 groups kept) and scale.
        moe=MoeConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_shared_experts=1,
                      n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    )
    v32 = ModelConfig(
        model_type="deepseek_v32",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=3,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        first_k_dense_replace=3,
        rope_scaling=_V32_YARN,
        quantization=_V32_FP8,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        bos_token_id=0,
        eos_token_id=1,
        moe=MoeConfig(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                      n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
    )
    return {
        "tiny": Preset(tiny, _extra_config(tiny), tokenizer=True,
                       description="2 dense + 2 MoE V3.2 layers, hidden 256, 4 heads, real latent dims, 16 experts "
                                   "of width 128; seconds on CPU"),
        "v32": Preset(v32, _extra_config(v32), tokenizer=False,
                      description="DeepSeek-V3.2 at real size: its 3 dense layers (several GB), and with --layers "
                                  "N > 3 MoE layers of 256 experts after them (11 GB each)"),
    }


PRESETS: dict[str, Preset] = _make_presets()
# Presets of the other model families → the module writing them (``preset_config``, ``write_files``, ``plan_load``).
FAMILY_PRESETS = {"v4-tiny": "minirt.models.deepseek_v4.synthetic", "v4-flash": "minirt.models.deepseek_v4.synthetic"}


def _family(preset: str):
    import importlib

    return importlib.import_module(FAMILY_PRESETS[preset])


def preset_config(preset: str = "tiny", num_layers: int | None = None) -> ModelConfig:
    """The ModelConfig ``write_synthetic_checkpoint`` writes: the preset's, with num_hidden_layers set to
    ``num_layers`` when it is given (the preset's dense layers first, at most num_layers of them; MoE
    layers after them)."""
    if preset in FAMILY_PRESETS:
        return _family(preset).preset_config(preset, num_layers)
    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, *FAMILY_PRESETS])}")
    cfg = PRESETS[preset].config
    if num_layers is None:
        return cfg
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise InputError(f"num_layers must be a positive int, got {num_layers!r:.40}")
    if num_layers > INT_LIMITS["num_hidden_layers"]:
        raise InputError(f"num_layers is {num_layers:,}, more than the {INT_LIMITS['num_hidden_layers']:,} layers the "
                         "DeepSeek-V3/V3.2 family allows")
    return dataclasses.replace(cfg, num_hidden_layers=num_layers,
                               first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))


# ---------------------------------------------------------------------------------------------------
# Values


def _tensor_seed(seed: int, name: str) -> int:
    """Seed of tensor ``name``'s generator: a CRC32 of seed and name, stable across runs and Python
    versions (unlike hash()). 32 bits because the CPU generator (mt19937) ignores higher seed bits."""
    return zlib.crc32(f"{seed}/{name}".encode())


def _init_mean_std(name: str, spec: TensorSpec) -> tuple[float, float]:
    """Mean and std of a tensor's values, chosen so activations keep an O(1) scale through the layers:
    linear weights N(0, 1/fan_in) (unit-RMS inputs give unit-RMS outputs, attention logits of std ≈ 2
    after the softmax scale), embeddings N(0, 1), norm weights 1 + small noise, the k_norm bias small,
    the router's score bias N(0, 0.05²) (it moves choices between sigmoid scores ≈ 0.5 ± 0.2)."""
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name.endswith(".e_score_correction_bias"):
        return 0.0, 0.05
    if len(spec.shape) == 1:
        return (0.0, 0.02) if name.endswith(".bias") else (1.0, 0.05)
    return 0.0, spec.shape[1] ** -0.5


def _row_chunks(name: str, spec: TensorSpec, seed: int, device: torch.device, row_align: int,
                mean_std: tuple[float, float] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 rows) chunks of tensor ``name``'s values, each a multiple of row_align rows
    (the fp8 block height) except the last; one chunk for a 1-D tensor. Values N(mean, std²) with
    ``mean_std``, default ``_init_mean_std``'s."""
    generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    mean, std = mean_std or _init_mean_std(name, spec)
    rows = spec.shape[0]
    cols = spec.shape[1] if len(spec.shape) == 2 else None
    step = rows if cols is None else max(row_align, CHUNK_ELEMENTS // cols // row_align * row_align)
    for start in range(0, rows, step):
        shape = (min(step, rows - start),) + (() if cols is None else (cols,))
        yield start, torch.randn(shape, generator=generator, device=device).mul_(std).add_(mean)


def _stored_layout(specs: dict[str, TensorSpec], block: tuple[int, int] | None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Stored tensor name → (dtype, shape) as in the real checkpoint: fp8 + float32 scale_inv for
    quantised weights, float32 for 1-D tensors (norms, k_norm), bf16 for the other 2-D tensors."""
    layout = {}
    for name, spec in specs.items():
        if spec.quantized:
            layout[name] = (FP8_DTYPE, spec.shape)
            layout[name + SCALE_SUFFIX] = (torch.float32, block_scale_shape(spec.shape, block))
        else:
            layout[name] = (torch.float32 if len(spec.shape) == 1 else torch.bfloat16, spec.shape)
    return layout


# ---------------------------------------------------------------------------------------------------
# Files


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


class _SafetensorsWriter:
    """A safetensors file whose tensor list is fixed up front; data is written row range by row range.

    Tensors are ordered by descending item size, then name (as the safetensors library does, so each
    tensor starts aligned to its item size). A context manager: leaving the block without an error
    checks that every byte of every tensor was written.
    """

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self._entries: dict[str, tuple[int, int]] = {}  # name → (data offset, bytes per row)
        self._missing: dict[str, int] = {}
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in sorted(layout, key=lambda n: (-layout[n][0].itemsize, n)):
            dtype, shape = layout[name]
            nbytes = _nbytes(dtype, shape)
            header[name] = {"dtype": _SAFETENSORS_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._entries[name] = (offset, nbytes // shape[0])
            self._missing[name] = nbytes
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._data_start = 8 + len(raw)
        self.path = path
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write_rows(self, name: str, first_row: int, rows: torch.Tensor) -> int:
        """Write ``rows`` (a leading-dim slice of tensor ``name``, in its stored dtype) from row first_row
        on; returns the number of bytes written."""
        offset, row_bytes = self._entries[name]
        data = rows.detach().contiguous().cpu().view(torch.uint8).numpy()
        self._file.seek(self._data_start + offset + first_row * row_bytes)
        self._file.write(data)
        self._missing[name] -= data.nbytes
        return data.nbytes

    def __enter__(self) -> "_SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        unwritten = [name for name, left in self._missing.items() if left != 0]
        if exc_type is None and unwritten:
            raise RuntimeError(f"{self.path}: tensors not fully written: {unwritten}")


def _shard_groups(specs: dict[str, TensorSpec], num_layers: int) -> list[list[str]]:
    """Weights per shard: embeddings first (as in the real checkpoint), then one shard per layer, then the
    final norm and lm_head, so loading fewer layers opens fewer shards."""
    groups = [["model.embed_tokens.weight"]]
    groups += [[n for n in specs if n.startswith(f"model.layers.{i}.")] for i in range(num_layers)]
    groups.append(["model.norm.weight", "lm_head.weight"])
    return groups


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the rest to U+0100 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_tokenizer(bos_token_id: int, eos_token_id: int):
    """A ``tokenizers.Tokenizer``: token id b (0..255) is byte b, then ``<bos>`` and ``<eos>`` as special
    tokens, which must get ids 256 and 257 (passed in to check against the config). ``encode`` prepends
    <bos>; ``decode`` drops specials by default and joins bytes as UTF-8."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    ids = (tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN))
    if ids != (bos_token_id, eos_token_id):
        raise InputError(f"byte-level tokenizer gives <bos>, <eos> ids {ids}, config says {(bos_token_id, eos_token_id)}")
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_token_id)])
    return tokenizer


class DirectoryNotEmpty(InputError):
    """The output directory holds files and force is off (``path``: that directory)."""

    def __init__(self, path: Path):
        super().__init__(f"{path} is not empty; force=True replaces it")
        self.path = path


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise DirectoryNotEmpty(out_dir)


def _checkpoint_bytes(preset: str, cfg: ModelConfig) -> int:
    """The bytes of the tensors the checkpoint of ``preset`` at ``cfg`` stores."""
    if preset in FAMILY_PRESETS:
        return _family(preset).checkpoint_bytes(cfg)
    specs = tensor_specs(cfg, cfg.num_hidden_layers)
    return sum(_nbytes(*v) for v in _stored_layout(specs, cfg.quantization.weight_block_size).values())


def _check_disk(out_dir: Path, preset: str, cfg: ModelConfig) -> None:
    """WriteError, with both sizes, when the checkpoint would not fit on the disk that is to hold it."""
    need = _checkpoint_bytes(preset, cfg)
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if need > free:
        raise WriteError(f"{out_dir}: the checkpoint takes {need:,} bytes, the disk there has {free:,} free")


def _os_reason(e: OSError) -> str:
    """'No space left on device', with the path the operating system refused when it names one."""
    reason = e.strerror or str(e)
    return f"{reason}: {e.filename}" if e.filename else reason


def _temporary_dir(out_dir: Path) -> Path:
    """A new temporary directory name beside out_dir, naming this process: ``.NAME.tmp-PID-RANDOM``."""
    return out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Remove the temporary directories beside out_dir that an earlier write left (killed before it
    could clean up): those of a process no longer running, and those of the older ``.NAME.tmp-RANDOM``
    form, which named no process. A concurrent write's own temporary stays."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.tmp-(?:(\d+)-)?[0-9a-f]{{12}}(?:\.old)?")
    for path in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.tmp-*"):
        match = pattern.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        if match.group(1) is not None and _process_exists(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process: leave its directory alone
    return True


def _generator_record(preset: str, seed: int, device: torch.device) -> dict[str, Any]:
    return {"preset": preset, "seed": seed, "device": device.type}  # the bytes depend on the device type


def _write_files(tmp: Path, preset_name: str, cfg: ModelConfig, seed: int, device: torch.device,
                 progress: Progress | None) -> None:
    if preset_name in FAMILY_PRESETS:
        return _family(preset_name).write_files(tmp, preset_name, cfg, seed, device, progress)
    preset = PRESETS[preset_name]
    num_layers = cfg.num_hidden_layers
    specs = tensor_specs(cfg, num_layers)
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    layout = _stored_layout(specs, block)
    total = sum(_nbytes(*v) for v in layout.values())

    config = {**preset.extra_config, **cfg.to_dict()}
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    groups = _shard_groups(specs, num_layers)
    weight_map: dict[str, str] = {}
    done = 0
    for k, names in enumerate(groups, start=1):
        shard_name = f"model-{k:05d}-of-{len(groups):06d}.safetensors"  # the real checkpoint's spelling
        shard_layout = {n: v for n, v in layout.items() if n.removesuffix(SCALE_SUFFIX) in names}
        with _SafetensorsWriter(tmp / shard_name, shard_layout) as writer:
            for name in names:
                spec = specs[name]
                for first_row, rows in _row_chunks(name, spec, seed, device, block[0] if block else 1):
                    if spec.quantized:
                        w_fp8, scale_inv = quantize_block_fp8(rows, block)
                        done += writer.write_rows(name, first_row, w_fp8)
                        done += writer.write_rows(name + SCALE_SUFFIX, first_row // block[0], scale_inv)
                    else:
                        done += writer.write_rows(name, first_row, rows.to(layout[name][0]))
                    if progress is not None:
                        progress(done, total, name)
        weight_map |= {n: shard_name for n in shard_layout}

    metadata = {"total_size": total, GENERATOR_KEY: _generator_record(preset_name, seed, device)}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if preset.tokenizer:
        byte_level_tokenizer(cfg.bos_token_id, cfg.eos_token_id).save(str(tmp / TOKENIZER_FILE))


def write_synthetic_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    num_layers: int | None = None,
    force: bool = False,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
) -> Path:
    """Write a synthetic checkpoint of ``preset`` (see PRESETS) into ``out_dir``; returns its absolute path.

    num_layers: number of layers, default the preset's (tiny 4: 2 dense + 2 MoE; v32 3 dense); the
    config's num_hidden_layers is set to it (``preset_config``: the dense layers first, then MoE). device: where values are generated
    and quantised ("cuda" speeds up v32; output differs from "cpu" but is deterministic per device type).
    Written atomically: into a temporary directory next to out_dir, renamed into place when complete,
    removed on any failure (Ctrl-C included); a temporary directory an earlier, killed write left is removed
    first. Two processes writing the same checkpoint at once both succeed: the second finds the first's
    complete checkpoint in place and keeps it. Directories and files get the usual permissions (the umask's).
    The index's metadata records preset, seed and device type (``GENERATOR_KEY``, read by
    ``is_synthetic_checkpoint``).
    Raises InputError for an unknown preset, a bad num_layers (not an int in [1, 1024]), an empty
    out_dir, or an out_dir that is a file or a non-empty directory (unless force=True, which replaces
    it); WriteError before anything is written when the disk has less room than the checkpoint takes,
    and when the operating system refuses a write (out_dir's parent is a file, no space left, ...). ``progress(done, total,
    name)``, if given, is called after each chunk written with bytes written so far and in total.
    """
    cfg = preset_config(preset, num_layers)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be an int, got {seed!r}")
    device = resolve_device(device)
    out_dir = as_path(out_dir, "the output directory").resolve()  # "." needs a parent to hold the temporary
    try:
        _check_out_dir(out_dir, force)
        _check_disk(out_dir, preset, cfg)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(out_dir)
        # mkdir, not tempfile.mkdtemp: mkdtemp's mode 0700 would become the checkpoint's; this gets the umask's.
        tmp = _temporary_dir(out_dir)
        tmp.mkdir()
    except OSError as e:
        raise WriteError(f"{out_dir}: cannot create the checkpoint there ({_os_reason(e)})") from e
    def written_meanwhile() -> bool:  # by a concurrent write of the same checkpoint
        return not force and is_synthetic_checkpoint(out_dir, preset, seed, num_layers, device)

    try:
        _write_files(tmp, preset, cfg, seed, device, progress)
        if written_meanwhile():
            shutil.rmtree(tmp, ignore_errors=True)
            return out_dir
        _check_out_dir(out_dir, force)
        if out_dir.exists():
            # Move the old directory aside first so a failed rename can put it back.
            old = tmp.with_name(tmp.name + ".old")
            out_dir.rename(old)
            try:
                tmp.rename(out_dir)
            except BaseException:
                old.rename(out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)  # the new checkpoint is complete: a leftover is no failure
        else:
            tmp.rename(out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and written_meanwhile():  # the other write's rename came first
            return out_dir
        if isinstance(e, OSError) and e.errno == errno.EBUSY and os.path.ismount(out_dir):
            raise WriteError(f"{out_dir} is a mount point: the checkpoint is written beside it and renamed into "
                             f"place, which cannot replace a mount point; write into a directory inside it "
                             f"({out_dir / preset})") from e
        if isinstance(e, OSError):  # disk full, permissions, ...: a one-line error, not a traceback
            raise WriteError(f"{out_dir}: writing the checkpoint failed ({_os_reason(e)}); "
                             f"{out_dir} is left as it was") from e
        raise
    return out_dir


def is_synthetic_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, num_layers: int | None = None,
                            device: str | torch.device = "cpu") -> bool:
    """Whether ``out_dir`` already holds the complete checkpoint ``write_synthetic_checkpoint`` would write
    with these arguments: the same config, a generator record of the same preset, seed and device type,
    and every shard present with valid headers (``checkpoint.plan_load``). Tensor data is not read."""
    cfg = preset_config(preset, num_layers)
    out_dir = Path(out_dir)
    try:
        plan = (_family(preset).plan_load if preset in FAMILY_PRESETS else plan_load)(out_dir)
        index = json.loads((out_dir / INDEX_FILE).read_text())
    except (MinirtError, OSError, ValueError):
        return False
    record = index.get("metadata", {}).get(GENERATOR_KEY) if isinstance(index, dict) else None
    return plan.config == cfg and record == _generator_record(preset, seed, resolve_device(device))
