"""Block fp8 helpers and the HF checkpoint reader (against synthetic tiny checkpoints on disk)."""
import dataclasses
import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from minirt.blockfp8 import block_scale_shape, dequantize_block_fp8, quantize_block_fp8
from minirt.models.deepseek_v32.checkpoint import load_checkpoint, plan_load, tensor_specs
from minirt.shards import INDEX_FILE, read_safetensors_header
from minirt.config import ModelConfig
from minirt.errors import CheckpointError, InputError
from minirt.synthetic import preset_config

E4M3_MAX = 448.0


def reference_dequant(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """W[i, j] = Wq[i, j] * scale_inv[i // bo, j // bi], by explicit index arithmetic."""
    rows = torch.arange(w_fp8.shape[0]) // block[0]
    cols = torch.arange(w_fp8.shape[1]) // block[1]
    return w_fp8.float() * scale_inv.float()[rows][:, cols]


def random_weight(shape, seed, spread=True) -> torch.Tensor:
    """Normal values; with spread, each 128x128 block scaled by its own 10^U(-6, 6) so scales differ."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if spread:
        rb, cb = block_scale_shape(shape)
        mag = 10 ** (torch.rand((rb, cb), generator=g) * 12 - 6)
        w = w * mag[torch.arange(shape[0]) // 128][:, torch.arange(shape[1]) // 128]
    return w


# ---------------------------------------------------------------------------------------------------
# blockfp8


@pytest.mark.parametrize("shape", [(576, 300), (128, 128), (1, 1), (129, 257), (300, 7)])
def test_quantize_round_trip_within_e4m3_bound(shape):
    w = random_weight(shape, seed=shape[0] * 1000 + shape[1])
    w_fp8, scale_inv = quantize_block_fp8(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    # Power-of-two scales, the smallest that keeps the block's amax within ±448.
    assert torch.equal(torch.exp2(torch.log2(scale_inv).round()), scale_inv)
    ref_scale = reference_dequant(torch.ones(shape).to(torch.float8_e4m3fn), scale_inv)  # per-element scale
    amax = torch.zeros_like(scale_inv)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
    assert (amax <= E4M3_MAX * scale_inv).all() and (amax > E4M3_MAX * scale_inv / 2).all()
    # e4m3: 3 mantissa bits, so round-to-nearest errs by at most 2^-4 relative for normals
    # (|v| >= 2^-6); subnormals are spaced 2^-9, so at most 2^-10 absolute, in units of the scale.
    deq = dequantize_block_fp8(w_fp8, scale_inv)
    bound = torch.maximum(w.abs() * 2**-4, ref_scale * 2**-10)
    assert ((w - deq).abs() <= bound).all()
    # The bound is tight enough to mean something: errors do reach a good part of it.
    assert ((w - deq).abs() / bound).max() > 0.5 if w.numel() > 100 else True


def test_dequantize_matches_index_arithmetic_bit_exactly():
    g = torch.Generator().manual_seed(7)
    w_fp8 = (torch.randn((576, 333), generator=g) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand((5, 3), generator=g) * 3 + 0.01  # arbitrary (not power-of-two) scales too
    for dtype in (torch.float32, torch.bfloat16):
        out = dequantize_block_fp8(w_fp8, scale_inv, dtype=dtype)
        assert out.dtype == dtype and torch.equal(out, reference_dequant(w_fp8, scale_inv).to(dtype))
    # A non-default block: 576 rows / 64 = 9 row blocks, 333 columns / 100 → 4 column blocks.
    scale_inv = torch.rand((9, 4), generator=g) + 0.5
    assert torch.equal(dequantize_block_fp8(w_fp8, scale_inv, block=(64, 100)), reference_dequant(w_fp8, scale_inv, (64, 100)))


def test_ceil_division_block_counts():
    assert block_scale_shape((576, 7168)) == (5, 56)  # the real kv_a_proj_with_mqa
    assert block_scale_shape((129, 1)) == (2, 1)
    assert block_scale_shape((128, 256)) == (1, 2)
    w = random_weight((576, 130), seed=3, spread=False)
    # Rows 512..575 and columns 128..129 are partial blocks with their own scale.
    w[512:, :] *= 1000
    w[:, 128:] *= 1e-4
    _, scale_inv = quantize_block_fp8(w)
    assert scale_inv.shape == (5, 2)
    assert scale_inv[4, 0] > 100 * scale_inv[3, 0] and scale_inv[0, 1] < 1e-2 * scale_inv[0, 0]


def test_dequantize_rejects_wrong_scale_shape_and_dtype():
    w_fp8 = torch.randn(576, 256).to(torch.float8_e4m3fn)
    with pytest.raises(InputError, match=r"expected \(5, 2\)"):
        dequantize_block_fp8(w_fp8, torch.rand(4, 2))
    with pytest.raises(InputError, match="float8_e4m3fn"):
        dequantize_block_fp8(w_fp8.float(), torch.rand(5, 2))
    with pytest.raises(InputError, match="2-D"):
        dequantize_block_fp8(w_fp8.reshape(-1), torch.rand(5, 2))


def test_quantize_saturation_and_extremes():
    g = torch.Generator().manual_seed(11)
    w = torch.randn((256, 256), generator=g)
    w[0, 0] = 448.0 * 2**5  # amax exactly 448·2^5: scale 2^5, the value lands exactly on ±448
    w[130, 3] = -3e38  # near float32 max
    w[200, 200] = 1e-30  # tiny and huge values sharing a block with ordinary ones
    w[:128, 128:] = 0.0  # an all-zero block still gets a finite power-of-two scale
    w_fp8, scale_inv = quantize_block_fp8(w)
    deq = dequantize_block_fp8(w_fp8, scale_inv)
    assert torch.isfinite(deq).all()
    assert scale_inv[0, 0] == 2**5 and w_fp8[0, 0].float() == 448.0 and deq[0, 0] == w[0, 0]
    assert deq[130, 3] == pytest.approx(-3e38, rel=2**-4)
    assert (deq[:128, 128:] == 0).all() and scale_inv[0, 1] > 0 and torch.isfinite(scale_inv).all()
    assert (w_fp8.float().abs() <= E4M3_MAX).all()


def test_quantize_rejects_non_finite_and_non_float():
    w = torch.randn(128, 128)
    w[5, 9] = float("inf")
    with pytest.raises(InputError, match="NaN or Inf"):
        quantize_block_fp8(w)
    with pytest.raises(InputError, match="float"):
        quantize_block_fp8(torch.randint(0, 5, (128, 128)))


# ---------------------------------------------------------------------------------------------------
# tensor_specs against the published DeepSeek-V3.2 checkpoint


def test_v32_specs_match_the_real_checkpoint():
    cfg = preset_config("v32")
    specs = tensor_specs(cfg, 3)
    # (shape, scale_inv shape or None) as listed for deepseek-ai/DeepSeek-V3.2's safetensors.
    real = {
        "self_attn.q_a_proj.weight": ((1536, 7168), (12, 56)),
        "self_attn.q_b_proj.weight": ((24576, 1536), (192, 12)),
        "self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), (5, 56)),
        "self_attn.kv_b_proj.weight": ((32768, 512), (256, 4)),
        "self_attn.o_proj.weight": ((7168, 16384), (56, 128)),
        "self_attn.indexer.wq_b.weight": ((8192, 1536), (64, 12)),
        "self_attn.indexer.wk.weight": ((128, 7168), (1, 56)),
        "mlp.gate_proj.weight": ((18432, 7168), (144, 56)),
        "mlp.up_proj.weight": ((18432, 7168), (144, 56)),
        "mlp.down_proj.weight": ((7168, 18432), (56, 144)),
        "self_attn.indexer.weights_proj.weight": ((64, 7168), None),
        "self_attn.indexer.k_norm.weight": ((128,), None),
        "self_attn.indexer.k_norm.bias": ((128,), None),
        "self_attn.q_a_layernorm.weight": ((1536,), None),
        "self_attn.kv_a_layernorm.weight": ((512,), None),
        "input_layernorm.weight": ((7168,), None),
        "post_attention_layernorm.weight": ((7168,), None),
    }
    expected = {f"model.layers.{i}.{n}": v for i in range(3) for n, v in real.items()}
    expected |= {"model.embed_tokens.weight": ((129280, 7168), None), "lm_head.weight": ((129280, 7168), None),
                 "model.norm.weight": ((7168,), None)}
    assert set(specs) == set(expected)
    for name, (shape, scale_shape) in expected.items():
        assert specs[name].shape == shape, name
        assert specs[name].quantized == (scale_shape is not None), name
        if scale_shape is not None:
            assert block_scale_shape(shape) == scale_shape, name


def test_specs_for_unquantized_v3_have_no_indexer_and_no_fp8():
    cfg = dataclasses.replace(preset_config("tiny"), model_type="deepseek_v3", index_topk=None, index_n_heads=None,
                              index_head_dim=None, quantization=None)
    specs = tensor_specs(cfg, 2)
    assert not any(".indexer." in n for n in specs)
    assert not any(s.quantized for s in specs.values())
    assert len(specs) == 3 + 2 * 12


# ---------------------------------------------------------------------------------------------------
# Loader


def weight_map(ckpt):
    return json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]


def rewrite_shard(ckpt, name, edit):
    """Load the shard holding ``name``, let ``edit(tensors)`` change the dict, save it back."""
    shard = ckpt / weight_map(ckpt)[name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def expected_weights(ckpt, num_layers):
    """Independent of the loader: read every shard with safetensors and dequantise by index arithmetic."""
    specs = tensor_specs(ModelConfig.from_file(ckpt), num_layers)
    raw = {}
    for shard in {s for n, s in weight_map(ckpt).items() if n.removesuffix("_scale_inv") in specs}:
        raw |= load_file(ckpt / shard)
    out = {}
    for name in specs:
        scale = raw.get(name + "_scale_inv")
        out[name] = raw[name].float() if scale is None else reference_dequant(raw[name], scale)
    return out


def test_loader_round_trip_bit_exact(tiny):
    cfg, weights = load_checkpoint(tiny)
    assert cfg == ModelConfig.from_file(tiny) and cfg.num_dense_layers == 2
    expected = expected_weights(tiny, 2)
    assert weights.keys() == expected.keys()
    assert not any(k.endswith("_scale_inv") for k in weights)
    for name, w in weights.items():
        assert w.dtype == torch.float32 and w.device.type == "cpu"
        assert torch.equal(w, expected[name]), name
    # Half precision: the same values rounded once, but those that run in fp32 (the indexer's k_norm and
    # weights_proj here) exact in float32.
    _, half = load_checkpoint(tiny, dtype=torch.bfloat16)
    fp32 = [name for name, spec in tensor_specs(cfg, 2).items() if spec.fp32]
    assert sorted(fp32) == sorted(f"model.layers.{i}.self_attn.indexer.{n}" for i in range(2)
                                  for n in ("k_norm.weight", "k_norm.bias", "weights_proj.weight"))
    for name, w in half.items():
        want = expected[name] if name in fp32 else expected[name].to(torch.bfloat16)
        assert w.dtype == want.dtype and torch.equal(w, want), name


def test_stored_dtypes_follow_the_real_checkpoint(tiny):
    raw = {}
    for shard in set(weight_map(tiny).values()):
        raw |= load_file(tiny / shard)
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            expected = torch.float32
        elif name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith("weights_proj.weight"):
            expected = torch.bfloat16
        elif t.dim() == 1:  # norms and the indexer's k_norm
            expected = torch.float32
        else:
            expected = torch.float8_e4m3fn
            assert name + "_scale_inv" in raw
        assert t.dtype == expected, name


def test_plan_counts_and_progress(tiny):
    plan = plan_load(tiny, num_layers=1)
    needed = {tiny / s for n, s in weight_map(tiny).items() if not n.startswith("model.layers.1.")}
    assert set(plan.shard_files) == needed and len(needed) < len(set(weight_map(tiny).values()))
    on_disk = {}
    for shard in needed:
        on_disk |= load_file(shard)
    assert set(plan.tensor_names) == set(on_disk)
    assert plan.num_bytes == sum(t.numel() * t.element_size() for t in on_disk.values())
    assert plan.num_parameters == sum(t.numel() for n, t in on_disk.items() if not n.endswith("_scale_inv"))
    calls = []
    _, weights = load_checkpoint(tiny, num_layers=1, progress=lambda done, total, name: calls.append((done, total, name)))
    assert [c[2] for c in calls] == list(weights)
    dones = [c[0] for c in calls]
    assert dones == sorted(dones) and dones[-1] == plan.num_bytes and {c[1] for c in calls} == {plan.num_bytes}


def test_only_needed_shards_are_opened(tiny):
    layer1_shard = weight_map(tiny)["model.layers.1.self_attn.o_proj.weight"]
    assert all(s == layer1_shard for n, s in weight_map(tiny).items() if n.startswith("model.layers.1."))
    (tiny / layer1_shard).unlink()
    _, weights = load_checkpoint(tiny, num_layers=1)
    assert not any(n.startswith("model.layers.1.") for n in weights)
    expected = expected_weights(tiny, 1)
    assert all(torch.equal(weights[n], expected[n]) for n in expected)
    with pytest.raises(CheckpointError, match=rf"model\.layers\.1\..*{layer1_shard}.*does not exist"):
        load_checkpoint(tiny, num_layers=2)


def test_single_file_checkpoint(tiny):
    merged = {}
    for shard in set(weight_map(tiny).values()):
        merged |= load_file(tiny / shard)
        (tiny / shard).unlink()
    (tiny / INDEX_FILE).unlink()
    save_file(merged, tiny / "model.safetensors")
    _, weights = load_checkpoint(tiny)
    assert (tiny / "model.safetensors",) == plan_load(tiny).shard_files
    for name, w in weights.items():
        scale = merged.get(name + "_scale_inv")
        assert torch.equal(w, merged[name].float() if scale is None else reference_dequant(merged[name], scale))


def test_no_weights_at_all(tiny):
    (tiny / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        plan_load(tiny)


BAD_VALUES = [
    # (tensor, value): NaN in an fp8 weight, ±Inf in bf16/fp32 tensors, both in a scale.
    ("model.layers.0.self_attn.kv_b_proj.weight", float("nan")),
    ("model.embed_tokens.weight", float("inf")),
    ("model.layers.1.input_layernorm.weight", float("-inf")),
    ("model.layers.0.self_attn.indexer.weights_proj.weight", float("nan")),
    ("model.layers.1.mlp.down_proj.weight_scale_inv", float("inf")),
    ("model.layers.0.self_attn.q_b_proj.weight_scale_inv", float("nan")),
]


@pytest.mark.parametrize("name, value", BAD_VALUES)
def test_non_finite_values_rejected_by_name_and_index(tiny, name, value):
    index = {}

    def poison(tensors):
        t = tensors[name]
        index["flat"] = int(torch.randint(0, t.numel(), (1,), generator=torch.Generator().manual_seed(len(name))))
        flat = t.view(-1)
        if t.dtype == torch.float8_e4m3fn:  # e4m3fn has no Inf; NaN is the 0x7F bit pattern
            flat.view(torch.uint8)[index["flat"]] = 0x7F
        else:
            flat[index["flat"]] = value

    shard = rewrite_shard(tiny, name, poison)
    with pytest.raises(CheckpointError, match=rf"{name} in {shard.name}: non-finite .* flat index {index['flat']}\b"):
        load_checkpoint(tiny)


def test_dequantised_overflow_rejected(tiny):
    name = "model.layers.0.mlp.up_proj.weight"
    # Finite fp8 values and finite scales whose products overflow: |w| up to 448·2^110 ≈ 5.8e35 fits
    # float32 but not float16; 448·2^125 overflows float32 too.
    rewrite_shard(tiny, name + "_scale_inv", lambda t: t[name + "_scale_inv"].fill_(2.0**110))
    load_checkpoint(tiny, dtype=torch.float32)
    with pytest.raises(CheckpointError, match=rf"{name}.*after conversion to torch.float16"):
        load_checkpoint(tiny, dtype=torch.float16)
    rewrite_shard(tiny, name + "_scale_inv", lambda t: t[name + "_scale_inv"].fill_(2.0**125))
    with pytest.raises(CheckpointError, match=rf"{name}.*after conversion to torch.float32"):
        load_checkpoint(tiny, dtype=torch.float32)


def test_layers_beyond_the_model_refused_with_its_count(tiny):
    with pytest.raises(CheckpointError, match=r"asked for 3 layers, but the model has 2.*at most 2"):
        load_checkpoint(tiny, num_layers=3)
    _, weights = load_checkpoint(tiny)  # default: every layer
    assert {n.split(".")[2] for n in weights if n.startswith("model.layers.")} == {"0", "1"}


def test_layers_past_num_hidden_layers_are_never_loaded(tiny):
    # first_k_dense_replace beyond num_hidden_layers: layer 1 would be the MTP layer, never loaded.
    raw = json.loads((tiny / "config.json").read_text())
    raw |= {"num_hidden_layers": 1, "first_k_dense_replace": 3}
    (tiny / "config.json").write_text(json.dumps(raw))
    _, weights = load_checkpoint(tiny)
    assert not any(n.startswith("model.layers.1.") for n in weights)
    with pytest.raises(CheckpointError, match="at most 1"):
        plan_load(tiny, num_layers=2)


def test_bad_num_layers_and_dtype(tiny):
    with pytest.raises(InputError, match="num_layers"):
        plan_load(tiny, num_layers=0)
    with pytest.raises(InputError, match="dtype"):
        load_checkpoint(tiny, dtype=torch.int8)


def test_missing_tensor_in_index_is_named(tiny):
    name = "model.layers.0.self_attn.indexer.wk.weight_scale_inv"
    index = json.loads((tiny / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (tiny / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{name} is missing"):
        load_checkpoint(tiny)


def test_missing_tensor_in_shard_is_named_with_the_shard(tiny):
    name = "model.layers.1.self_attn.q_a_layernorm.weight"
    shard = rewrite_shard(tiny, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name} is missing from shard {shard.name}"):
        load_checkpoint(tiny)


def test_index_naming_a_missing_shard(tiny):
    name = "lm_head.weight"
    index = json.loads((tiny / INDEX_FILE).read_text())
    index["weight_map"][name] = "model-00009-of-000009.safetensors"
    (tiny / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{name} .*model-00009-of-000009.safetensors.*does not exist"):
        load_checkpoint(tiny)


def test_wrong_shape_is_named(tiny):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    rewrite_shard(tiny, name, lambda t: t.__setitem__(name, t[name][:512].contiguous()))
    with pytest.raises(CheckpointError, match=rf"{name} .*shape \[512, 256\] is wrong, expected \[576, 256\]"):
        load_checkpoint(tiny)


@pytest.mark.parametrize("name, dtype", [
    ("model.layers.0.mlp.gate_proj.weight", torch.bfloat16),  # should be fp8
    ("model.layers.0.mlp.gate_proj.weight_scale_inv", torch.bfloat16),  # should be float32
    ("model.norm.weight", torch.float8_e4m3fn),  # unquantised tensors are 16/32-bit floats
])
def test_wrong_dtype_is_named(tiny, name, dtype):
    rewrite_shard(tiny, name, lambda t: t.__setitem__(name, t[name].float().to(dtype)))
    with pytest.raises(CheckpointError, match=rf"{name} .*dtype {dtype} is wrong"):
        load_checkpoint(tiny)


def test_truncated_shard_names_the_file(tiny):
    shard = tiny / weight_map(tiny)["model.layers.0.mlp.up_proj.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated"):
        load_checkpoint(tiny)
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated"):
        load_checkpoint(tiny)


def test_header_longer_than_file_names_the_file(tiny):
    shard = tiny / weight_map(tiny)["lm_head.weight"]
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    with pytest.raises(CheckpointError, match=rf"{shard}: .*header length {len(data)} exceeds"):
        load_checkpoint(tiny)


def test_garbage_header_names_the_file(tiny):
    shard = tiny / weight_map(tiny)["model.embed_tokens.weight"]
    data = bytearray(shard.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    g = torch.Generator().manual_seed(5)
    data[8: 8 + header_len] = torch.randint(0, 256, (header_len,), generator=g, dtype=torch.uint8).numpy().tobytes()
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt safetensors header"):
        load_checkpoint(tiny)


def test_header_reader_on_a_valid_file(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "x.safetensors")
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert {n: (h.dtype, h.shape, h.nbytes) for n, h in header.items()} == {
        "a": (torch.float32, (3, 5), 60), "b": (torch.bfloat16, (7,), 14)}
