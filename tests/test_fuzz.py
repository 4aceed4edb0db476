"""Property-based fuzzing of bad input: the sparse-MLA kernels under garbage top-k indices (against an
fp64 torch reference written here), and the safetensors header reader under corrupted shard files.

Kernel fuzzing runs the real Triton kernels (interpreted on the CPU, so shapes stay tiny); every call
writes into NaN-poisoned preallocated outputs, and every kv row / cache slot that no used valid index
points to, plus the memory on either side of kv / the cache, holds NaN or Inf: a read of a masked index
would show up as NaN in the output, an out-of-bounds read as NaN or a crash.
"""
import json
import shutil
import math
import struct
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from conftest import DEVICE
from minirt.models.deepseek_v32.checkpoint import load_checkpoint
from minirt.shards import INDEX_FILE, read_safetensors_header
from minirt.errors import CheckpointError
from minirt.kernels import dequantize_kv_fp8, mla_decode_fp8, quantize_kv_fp8, sparse_mla_decode_fp8, sparse_mla_prefill
from minirt.kernels.sparse_mla_decode import DecodeConfig

ON_GPU = DEVICE == "cuda"
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
D_QK, D_V = 576, 512
SM_SCALE = 0.1352 * 192**-0.5 * 2


def bits_as_int32(bits: int) -> int:
    return bits - 2**32 if bits >= 2**31 else bits


# float32 NaN / Inf bit patterns read as int32: what a top-k that hands over float scores gives.
FLOAT_BIT_PATTERNS = [bits_as_int32(b) for b in (0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000)]

# Tolerances as in tests/test_sparse_mla_prefill.py and test_sparse_mla_decode.py: out within
# OUT_ATOL + OUT_RTOL * |ref| (fp32 accumulation, bf16/fp16 output rounding), plus on the GPU the
# rounding of the softmax weights P to 16 bits for the tensor-core P.V dot, bounded by u_P * sum_j w_j |v_j|
# (the interpreter keeps P in fp32). lse / max_logits: relative 2/65536 plus the fp32 rounding of a
# 576-term dot, 2^-18 * sm_scale * max_j sum_d |q_d k_jd|.
OUT_ATOL, OUT_RTOL = 8e-4, 3 / 128
P_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11} if ON_GPU else {torch.bfloat16: 0.0, torch.float16: 0.0}
STAT_RTOL, STAT_DOT_ULPS = 2 / 65536, 2.0**-18

# Kernel examples per run: 1050 in all. Measured on a 2-core CPU (interpreter): 30 s prefill, 38 s decode
# by slot, 12 s decode by position, 2 s for the header examples; 82 s for the file.
PREFILL_EXAMPLES, DECODE_SLOT_EXAMPLES, DECODE_POSITION_EXAMPLES = 450, 450, 150
HEADER_EXAMPLES = 300
KERNEL_SETTINGS = dict(deadline=None, derandomize=False,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------------
# Index patterns


def index_values(num_valid: int):
    """(valid, invalid) strategies for indices into num_valid rows: invalid mixes -1, other negatives,
    values >= num_valid, the int32 extremes and float bit patterns."""
    valid = st.integers(0, num_valid - 1)
    invalid = st.one_of(
        st.just(-1),
        st.integers(INT32_MIN, -2),
        st.integers(num_valid, INT32_MAX),
        st.sampled_from([INT32_MIN, INT32_MAX, num_valid, *FLOAT_BIT_PATTERNS]),
    )
    return valid, invalid


@st.composite
def index_rows(draw, rows: int, topk: int, num_valid: int) -> list[list[int]]:
    """rows x topk indices, each row of one kind: mixed, empty (nothing valid), all valid, or band
    (valid only in [a, b): whole leading and trailing chunks masked)."""
    valid, invalid = index_values(num_valid)
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["mixed", "empty", "all_valid", "band"]))
        if kind == "band":
            a, b = sorted(draw(st.lists(st.integers(0, topk), min_size=2, max_size=2)))
            row = (draw(st.lists(invalid, min_size=a, max_size=a)) + draw(st.lists(valid, min_size=b - a, max_size=b - a))
                   + draw(st.lists(invalid, min_size=topk - b, max_size=topk - b)))
        else:
            element = {"mixed": st.one_of(valid, invalid), "empty": invalid, "all_valid": valid}[kind]
            row = draw(st.lists(element, min_size=topk, max_size=topk))
        out.append(row)
    return out


def used_lengths(n: int, topk: int):
    """None, or n topk_length values: in range, beyond it on either side, or int32 extremes."""
    length = st.one_of(st.integers(-2, topk + 2), st.sampled_from([INT32_MIN, INT32_MAX]))
    return st.none() | st.lists(length, min_size=n, max_size=n)


# ---------------------------------------------------------------------------------------------------
# Reference and checks


def attention_reference(q, kv, indices, sm_scale, used_len=None):
    """fp64 sparse attention. q [n, h, 576]; kv [s_kv, 576] (rows no used valid index points to may be
    NaN); indices [n, topk] any int32, valid iff 0 <= i < s_kv; used_len [n] or None: entries at or past
    used_len[r] (clamped to [0, topk]) are unused. Returns out [n, h, 512], lse [n, h] (+inf for a row
    without a valid index), max_logits [n, h] (-inf there), the row-empty mask [n], the dot magnitude
    sm_scale * max_j sum_d |q_d k_jd| [n, h] and sum_j w_j |v_j| [n, h, 512]."""
    idx = indices.cpu().long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if used_len is not None:
        valid &= torch.arange(idx.shape[1])[None, :] < used_len.cpu().long().clamp(0, idx.shape[1])[:, None]
    k = kv.cpu().double()[torch.where(valid, idx, 0)]
    k = torch.where(valid[..., None], k, 0.0)                     # where() drops the NaN of masked rows
    q64 = q.cpu().double()
    logits = (torch.einsum("nhd,ntd->nht", q64, k) * sm_scale).masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)
    empty = ~valid.any(-1)
    weights = torch.exp(logits - torch.where(empty[:, None], 0.0, lse)[..., None])
    out = torch.einsum("nht,ntd->nhd", weights, k[..., :D_V])
    spread = torch.einsum("nht,ntd->nhd", weights, k[..., :D_V].abs())
    magnitude = (torch.einsum("nhd,ntd->nht", q64.abs(), k.abs()) * sm_scale).amax(-1)
    lse = torch.where(empty[:, None], math.inf, lse)
    return out, lse, logits.amax(-1), empty, magnitude, spread


def check(out, lse, ref, dtype, max_logits=None):
    """out [n, h, 512], lse [n, h], max_logits [n, h] against attention_reference's result."""
    r_out, r_lse, r_max, empty, magnitude, spread = ref
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in out or lse (poison not overwritten, or read)"
    excess = (out - r_out).abs() - (OUT_ATOL + OUT_RTOL * r_out.abs() + P_ROUNDING[dtype] * spread)
    assert excess.max() <= 0, f"out off by {excess.max():.3g} beyond tolerance"
    assert (out[empty] == 0).all() and (lse[empty] == math.inf).all(), "rows without a valid index: out 0, lse +inf"
    stats = [("lse", lse, r_lse)]
    if max_logits is not None:
        max_logits = max_logits.cpu().double()
        assert not max_logits.isnan().any() and (max_logits[empty] == -math.inf).all()
        stats.append(("max_logits", max_logits, r_max))
    for name, got, want in stats:
        err = (got - want).abs()[~empty]
        tol = (STAT_RTOL * want.abs() + STAT_DOT_ULPS * magnitude)[~empty]
        assert (err <= tol).all(), f"{name} off by {(err - tol).max():.3g} beyond tolerance"


def unreferenced(num_rows: int, indices: torch.Tensor, used_len=None) -> torch.Tensor:
    """Mask [num_rows] of rows that no used valid index points to."""
    idx = indices.cpu().long().reshape(len(indices), -1)
    used = (idx >= 0) & (idx < num_rows)
    if used_len is not None:
        used &= torch.arange(idx.shape[1])[None, :] < used_len.cpu().long().clamp(0, idx.shape[1])[:, None]
    mask = torch.ones(num_rows, dtype=torch.bool)
    mask[idx[used]] = False
    return mask


# ---------------------------------------------------------------------------------------------------
# sparse_mla_prefill


@st.composite
def prefill_cases(draw):
    s_q, s_kv = draw(st.integers(1, 3)), draw(st.integers(1, 64))
    # topk past 64 spans several of the kernel's 64-key chunks, so whole chunks are masked.
    topk = draw(st.one_of(st.integers(1, 40), st.integers(65, 160)))
    return dict(s_q=s_q, h_q=draw(st.integers(1, 4)), s_kv=s_kv, topk=topk,
                indices=draw(index_rows(s_q, topk, s_kv)), topk_length=draw(used_lengths(s_q, topk)),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])), seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=PREFILL_EXAMPLES, **KERNEL_SETTINGS)
@given(prefill_cases())
def test_prefill_garbage_indices_match_reference(case):
    s_q, h_q, s_kv, topk, dtype = case["s_q"], case["h_q"], case["s_kv"], case["topk"], case["dtype"]
    gen = torch.Generator().manual_seed(case["seed"])
    indices = torch.tensor(case["indices"], dtype=torch.int32).view(s_q, 1, topk)
    topk_length = None if case["topk_length"] is None else torch.tensor(case["topk_length"], dtype=torch.int32)
    q = torch.randn((s_q, h_q, D_QK), generator=gen).to(dtype)
    clean_kv = torch.randn((s_kv, D_QK), generator=gen).to(dtype)
    # kv sits between a NaN row and an Inf row; its unreferenced rows alternate NaN, +Inf, -Inf.
    buffer = torch.empty((s_kv + 2, 1, D_QK), dtype=dtype)
    buffer[0], buffer[-1], buffer[1:-1, 0] = math.nan, math.inf, clean_kv
    poison = unreferenced(s_kv, indices[:, 0], topk_length).nonzero()[:, 0]
    buffer[1 + poison] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)[poison % 3][:, None, None]
    out = (torch.full((s_q, h_q, D_V), math.nan, dtype=dtype, device=DEVICE),
           torch.full((s_q, h_q), math.nan, device=DEVICE), torch.full((s_q, h_q), math.nan, device=DEVICE))
    buffer = buffer.to(DEVICE)

    got = sparse_mla_prefill(q.to(DEVICE), buffer[1:-1], indices.to(DEVICE), SM_SCALE,
                             topk_length=None if topk_length is None else topk_length.to(DEVICE), out=out)

    assert all(g is o for g, o in zip(got, out))
    check(got[0], got[2], attention_reference(q, clean_kv, indices[:, 0], SM_SCALE, topk_length), dtype, got[1])


# ---------------------------------------------------------------------------------------------------
# sparse_mla_decode_fp8 (slot ids) and mla_decode_fp8 (positions through a block table)


def poisoned_cache(num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """[num_blocks + 2, block_size, 1, 656] random V32 tokens; the first and last block all 0xFF bytes
    (NaN as fp8, float32 and bf16): the cache is the view [1:-1]."""
    n = (num_blocks + 2) * block_size
    latent = torch.randn(n, 512, generator=gen) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=gen).float())
    backing = quantize_kv_fp8(latent, torch.randn(n, 64, generator=gen).to(torch.bfloat16))
    backing = backing.view(num_blocks + 2, block_size, 1, 656)
    backing[0], backing[-1] = 0xFF, 0xFF
    return backing


def decode_reference(q, cache, slots, used_len=None):
    """attention_reference on the dequantised cache, before its unreferenced slots are poisoned.
    q [b, s_q, h, 576], slots [b, s_q, topk], used_len [b] -> results per row n = b * s_q."""
    b, s_q, h, _ = q.shape
    kv = dequantize_kv_fp8(cache.cpu().reshape(-1, 656), torch.float32)
    per_row = None if used_len is None else used_len.repeat_interleave(s_q)
    return attention_reference(q.reshape(b * s_q, h, D_QK), kv, slots.reshape(b * s_q, -1), SM_SCALE, per_row)


def poison_unreferenced_slots(cache: torch.Tensor, slots: torch.Tensor, used_len=None) -> None:
    flat = cache.view(-1, 656)
    per_row = None if used_len is None else used_len.repeat_interleave(slots.shape[1])
    flat[unreferenced(flat.shape[0], slots.reshape(-1, slots.shape[-1]), per_row)] = 0xFF


@st.composite
def cache_shapes(draw):
    """(num_blocks, block_size) with at most 64 slots."""
    block_size = draw(st.sampled_from([1, 3, 16, 64]))
    return draw(st.integers(1, max(1, 64 // block_size))), block_size


@st.composite
def decode_slot_cases(draw):
    b, s_q = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    num_blocks, block_size = draw(cache_shapes())
    topk = draw(st.integers(1, 40))
    # block_n 16 with up to 3 splits: several chunks and splits per row, whole ones masked.
    config = draw(st.none() | st.builds(DecodeConfig, block_h=st.just(16), block_n=st.sampled_from([16, 32, 64]),
                                        num_warps=st.just(4)))
    return dict(b=b, s_q=s_q, h_q=draw(st.integers(1, 4)), num_blocks=num_blocks, block_size=block_size, topk=topk,
                indices=draw(index_rows(b * s_q, topk, num_blocks * block_size)),
                topk_length=draw(used_lengths(b, topk)), config=config, num_splits=draw(st.integers(1, 3)),
                seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=DECODE_SLOT_EXAMPLES, **KERNEL_SETTINGS)
@given(decode_slot_cases())
def test_decode_garbage_slots_match_reference(case):
    b, s_q, h_q, topk = case["b"], case["s_q"], case["h_q"], case["topk"]
    gen = torch.Generator().manual_seed(case["seed"])
    backing = poisoned_cache(case["num_blocks"], case["block_size"], gen)
    slots = torch.tensor(case["indices"], dtype=torch.int32).view(b, s_q, topk)
    topk_length = None if case["topk_length"] is None else torch.tensor(case["topk_length"], dtype=torch.int32)
    q = (torch.randn((b, s_q, h_q, D_QK), generator=gen) * 1.5).to(torch.bfloat16)
    ref = decode_reference(q, backing[1:-1], slots, topk_length)
    poison_unreferenced_slots(backing[1:-1], slots, topk_length)
    out = torch.full((b, s_q, h_q, D_V), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((b, h_q, s_q), math.nan, device=DEVICE)

    got = sparse_mla_decode_fp8(q.to(DEVICE), backing.to(DEVICE)[1:-1], slots.to(DEVICE), SM_SCALE,
                                topk_length=None if topk_length is None else topk_length.to(DEVICE),
                                num_splits=case["num_splits"], config=case["config"], out=out, lse=lse)

    assert got[0] is out and got[1] is lse
    check(out.reshape(b * s_q, h_q, D_V), lse.transpose(1, 2).reshape(b * s_q, h_q), ref, torch.bfloat16)


@st.composite
def decode_position_cases(draw):
    b, s_q = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    num_blocks, block_size = draw(cache_shapes())
    blocks_per_seq, topk = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    page, bad_page = index_values(num_blocks)
    return dict(b=b, s_q=s_q, h_q=draw(st.integers(1, 4)), num_blocks=num_blocks, block_size=block_size, topk=topk,
                table=draw(st.lists(st.lists(page | bad_page, min_size=blocks_per_seq, max_size=blocks_per_seq),
                                    min_size=b, max_size=b)),
                positions=draw(index_rows(b * s_q, topk, blocks_per_seq * block_size)),
                seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=DECODE_POSITION_EXAMPLES, **KERNEL_SETTINGS)
@given(decode_position_cases())
def test_decode_garbage_positions_and_block_table_match_reference(case):
    """mla_decode_fp8 allocates its outputs (no out= to poison); garbage reaches it both as positions
    and as block-table entries."""
    b, s_q, h_q, topk, block_size = case["b"], case["s_q"], case["h_q"], case["topk"], case["block_size"]
    gen = torch.Generator().manual_seed(case["seed"])
    backing = poisoned_cache(case["num_blocks"], block_size, gen)
    table = torch.tensor(case["table"], dtype=torch.int32)
    positions = torch.tensor(case["positions"], dtype=torch.int64).view(b, s_q, topk)
    # slot of position p of sequence i: table[i, p // block_size] * block_size + p % block_size, when p
    # lies within the table and that entry is a page of the cache; else none (-1).
    in_table = (positions >= 0) & (positions < table.shape[1] * block_size)
    pages = table.long()[torch.arange(b)[:, None, None], torch.where(in_table, positions, 0) // block_size]
    valid = in_table & (pages >= 0) & (pages < case["num_blocks"])
    slots = torch.where(valid, pages * block_size + positions % block_size, -1)
    q = (torch.randn((b, s_q, h_q, D_QK), generator=gen) * 1.5).to(torch.bfloat16)
    ref = decode_reference(q, backing[1:-1], slots)
    poison_unreferenced_slots(backing[1:-1], slots)

    out, lse = mla_decode_fp8(q.to(DEVICE), backing.to(DEVICE)[1:-1], table.to(DEVICE),
                              positions.to(torch.int32).to(DEVICE), SM_SCALE)

    check(out.reshape(b * s_q, h_q, D_V), lse.transpose(1, 2).reshape(b * s_q, h_q), ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# Safetensors header reader


@pytest.fixture(scope="module")
def checkpoint(tiny_master, tmp_path_factory):
    """A copy of the tiny checkpoint whose layer-0 shard (the header with the most entries) gets corrupted."""
    ckpt = shutil.copytree(tiny_master, tmp_path_factory.mktemp("fuzz") / "tiny")
    shard = ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    data = shard.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    return ckpt, shard, data, json.loads(data[8:8 + header_len])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


@st.composite
def mutated_headers(draw, header: dict, data_size: int) -> dict:
    """The real header with 1-3 entries changed: dtype, shape or offsets replaced by plausible or random
    values, offsets copied from another tensor (overlap), an entry deleted, added or made random JSON."""
    header = json.loads(json.dumps(header))
    names = sorted(n for n in header if n != "__metadata__")
    size = st.one_of(st.integers(-3, data_size + 3), st.integers(-2**64, 2**64))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        entry = header.get(name)
        change = draw(st.sampled_from(["dtype", "shape", "offsets", "overlap", "delete", "add", "random", "metadata"]))
        if change == "dtype" and isinstance(entry, dict):
            entry["dtype"] = draw(st.sampled_from(["F8_E4M3", "BF16", "F16", "F32", "F64", "I64", "BOOL", "f32", ""])
                                  | json_values)
        elif change == "shape" and isinstance(entry, dict):
            entry["shape"] = draw(st.lists(size, max_size=3) | json_values)
        elif change == "offsets" and isinstance(entry, dict):
            entry["data_offsets"] = draw(st.lists(size, min_size=0, max_size=3) | json_values)
        elif change == "overlap" and isinstance(entry, dict):
            other = header.get(draw(st.sampled_from(names)))
            if isinstance(other, dict) and "data_offsets" in other:   # (whatever JSON an earlier change left)
                entry["data_offsets"] = json.loads(json.dumps(other["data_offsets"]))
        elif change == "delete":
            header.pop(name, None)
        elif change == "add":
            header[draw(st.text(max_size=8))] = dict(entry) if isinstance(entry, dict) else draw(json_values)
        elif change == "random":
            header[name] = draw(json_values)
        elif change == "metadata":
            header["__metadata__"] = draw(json_values)
    return header


@st.composite
def corrupted_files(draw, original: bytes, header: dict) -> bytes:
    (header_len,) = struct.unpack("<Q", original[:8])
    rest = original[8 + header_len:]
    kind = draw(st.sampled_from(["prefix", "huge_length", "truncated", "garbage", "json", "mutated"]))
    if kind == "prefix":                     # random 8-byte header length
        return draw(st.binary(min_size=8, max_size=8)) + original[8:]
    if kind == "huge_length":                # longer than the file, up to 2^64 - 1
        return struct.pack("<Q", draw(st.integers(len(original) - 7, 2**64 - 1))) + original[8:]
    if kind == "truncated":
        return original[:draw(st.integers(0, len(original) - 1))]
    if kind == "garbage":                    # random bytes as the header
        raw = draw(st.binary(max_size=header_len + 64))
    elif kind == "json":                     # valid JSON, any shape
        raw = json.dumps(draw(json_values)).encode()
    else:
        raw = json.dumps(draw(mutated_headers(header, len(rest)))).encode()
    return struct.pack("<Q", len(raw)) + raw + rest


@settings(max_examples=HEADER_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_corrupted_header_gives_checkpoint_error_naming_the_file(checkpoint, data):
    """The only outcomes: success, or a CheckpointError naming the shard. Never another exception type,
    never an allocation sized by a corrupted length or shape."""
    ckpt, shard, original, header = checkpoint
    corrupted = data.draw(corrupted_files(original, header))
    shard.write_bytes(corrupted)
    try:
        tracemalloc.start()
        try:
            parsed = read_safetensors_header(shard)
        except CheckpointError as e:
            assert str(shard) in str(e)
            event("header rejected")
            parsed = None
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 16 * len(corrupted) + 2**20, f"reading the header allocated {peak} bytes"
        if parsed is None:
            return
        # What the reader accepts, the safetensors library opens, with the same tensors.
        with safe_open(str(shard), framework="pt") as f:
            assert set(f.keys()) == set(parsed)
            for name, stored in parsed.items():
                tensor = f.get_tensor(name)
                assert (tensor.dtype, tuple(tensor.shape)) == (stored.dtype, stored.shape)
        try:
            load_checkpoint(ckpt, num_layers=1)
            event("header accepted, checkpoint loaded")
        except CheckpointError as e:
            assert shard.name in str(e)
            event("header accepted, checkpoint rejected")
    finally:
        shard.write_bytes(original)
