"""Reading a safetensors checkpoint directory, whatever the model family: its weight map (the index, or
the single file's header), validated shard headers, locating the tensors a layout expects, and reading
one stored tensor in bounded chunks with finite checks. A family's ``checkpoint`` module says which
tensors it expects (its layout) and how they become weights.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rich.filesize import decimal  # sizes in kB / MB / GB, as disks are sold

from .blockfp8 import FP8_DTYPE, dequantize_block_fp8
from .device import available_memory
from .errors import CheckpointError, DeviceError, InputError
from .parallel import Shard
from .files import MAX_HEADER_BYTES, MAX_INDEX_BYTES, is_present, member, open_regular, os_reason, read_json, shown, stat_regular

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
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
    """What a family's ``load_checkpoint`` will read, worked out from config.json, the index and shard headers.

    ``config``: the family's parsed config; ``specs``: weight name → the family's tensor spec (its layout);
    ``stored``: every tensor to read (weights and their scales) → StoredTensor; ``shard_files``: only the
    shards holding them, sorted; ``num_parameters``: elements of the weights (scales not counted);
    ``num_bytes``: bytes to read.
    """

    path: Path
    config: Any
    num_layers: int
    specs: dict[str, Any]
    stored: dict[str, StoredTensor]
    shard_files: tuple[Path, ...]
    num_parameters: int
    num_bytes: int

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Names of the stored tensors to read, weights and scales."""
        return tuple(self.stored)


def check_weights_fit(plan: LoadPlan, device: torch.device, top: int, layers: list[int]) -> None:
    """DeviceError, with both numbers and the largest layer count that fits, when the weights ``plan``
    would hold (``top`` bytes outside the layers plus ``layers[i]`` bytes for layer i) exceed the free
    memory of ``device``: before anything is read."""
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


def check_load_dtype(dtype: torch.dtype) -> None:
    """InputError unless ``dtype`` is one a loader can return weights in (``UNQUANTIZED_DTYPES``)."""
    if dtype not in UNQUANTIZED_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(map(str, UNQUANTIZED_DTYPES))}, got {dtype!r}")


@contextlib.contextmanager
def open_shards(plan: LoadPlan):
    """The plan's shards open for unbuffered reading, {shard path: file}, all closed on leaving; CheckpointError
    naming a shard that cannot be opened."""
    with contextlib.ExitStack() as stack:
        files = {}
        for shard in plan.shard_files:
            try:
                files[shard] = stack.enter_context(open(shard, "rb", buffering=0))
            except OSError as e:
                raise CheckpointError(f"{shard}: cannot open safetensors file ({e.strerror or e})") from None
        yield files


def _first_nonfinite(t: torch.Tensor) -> int | None:
    """Flat index of the first NaN or ±Inf in t, or None. float8_e4m3fn has NaN (0x7F / 0xFF) but no Inf."""
    bad = (t.view(torch.uint8) & 0x7F) == 0x7F if t.dtype == FP8_DTYPE else ~torch.isfinite(t)
    if not bad.any():
        return None
    return int(bad.flatten().to(torch.uint8).argmax())  # argmax returns the first of equal maxima


def check_finite(t: torch.Tensor, name: str, shard: Path, what: str = "value", first: int = 0) -> None:
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


def load_tensor(file, stored: StoredTensor, name: str, device: torch.device, dtype: torch.dtype,
                scale_inv: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                shard: Shard | None = None) -> torch.Tensor:
    """One stored tensor as a new ``dtype`` tensor on ``device``, dequantised with ``scale_inv`` (its
    block scales, whole) when given; with ``shard`` (``minirt.parallel``) only those rows or columns of
    it. It is read, checked finite (before and after the cast) and converted ``READ_CHUNK_BYTES`` of
    stored data at a time, straight into the result: loading holds the result and one chunk, never a
    second full-size copy (nor a memory map of the shard). A row shard reads only its rows (from the
    first whole scale block when dequantised); a column shard reads the rows chunk by chunk and keeps
    its columns."""
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
        check_finite(raw, name, stored.shard, first=start * per_row)
        raw = raw.to(device)
        if scale_inv is not None:
            value = dequantize_block_fp8(raw, scale_inv[start // block[0] : -(-(start + n) // block[0])], block, dtype)
        else:
            value = raw.to(dtype)
        if value.dtype != stored.dtype:
            check_finite(value, name, stored.shard, f"value after conversion to {dtype}", first=start * per_row)
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
