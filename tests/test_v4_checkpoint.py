"""DeepSeek-V4 checkpoints: the native layout (v4-flash's specs), the fp4 / ue8m0 formats, the synthetic
v4-tiny writer and the loader's refusals."""
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from minirt.shards import INDEX_FILE
from minirt.cli import app
from minirt.errors import CheckpointError, DeviceError
from minirt.models.deepseek_v4 import V4Quantization
from minirt.models.deepseek_v4.checkpoint import (dequantize_stored, layer_memory_bytes, load_checkpoint, plan_load,
                                                  stored_layout, tensor_specs)
from minirt.models.deepseek_v4.quant import check_pow2_scales, dequantize_fp4, quantize_fp4
from minirt.synthetic import is_synthetic_checkpoint, preset_config, write_synthetic_checkpoint

E8M0, FP8 = torch.float8_e8m0fnu, torch.float8_e4m3fn


@pytest.fixture(scope="module")
def v4_master(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("v4") / "v4-tiny", preset="v4-tiny", seed=7)


@pytest.fixture
def v4(v4_master, tmp_path):
    """A private copy a test may damage."""
    return shutil.copytree(v4_master, tmp_path / "v4")


def stored(cfg, layers=None):
    specs = tensor_specs(cfg, layers or cfg.num_hidden_layers)
    return {n: v for name, spec in specs.items() for n, v in stored_layout(name, spec).items()}


def test_v4_flash_layout_matches_the_release():
    cfg = preset_config("v4-flash")
    assert cfg.layer_kinds == (0, 0, 4, 128) and cfg.num_hash_layers == 3
    s = stored(cfg)
    expect = {  # (dtype, shape) as the released shard headers list them
        "layers.0.attn.wq_a.weight": (FP8, (1024, 4096)), "layers.0.attn.wq_a.scale": (E8M0, (8, 32)),
        "layers.0.attn.wq_b.weight": (FP8, (64 * 512, 1024)), "layers.0.attn.wkv.weight": (FP8, (512, 4096)),
        "layers.0.attn.wo_a.weight": (FP8, (8192, 4096)), "layers.0.attn.wo_a.scale": (E8M0, (64, 32)),
        "layers.0.attn.wo_b.weight": (FP8, (4096, 8192)), "layers.0.attn.attn_sink": (torch.float32, (64,)),
        "layers.0.hc_attn_fn": (torch.float32, (24, 16384)), "layers.0.hc_ffn_scale": (torch.float32, (3,)),
        "layers.0.ffn.gate.tid2eid": (torch.int64, (129280, 6)), "layers.0.ffn.gate.weight": (torch.bfloat16, (256, 4096)),
        "layers.0.ffn.experts.0.w1.weight": (torch.int8, (2048, 2048)),
        "layers.0.ffn.experts.0.w1.scale": (E8M0, (2048, 128)),
        "layers.0.ffn.experts.255.w2.weight": (torch.int8, (4096, 1024)),
        "layers.0.ffn.shared_experts.w2.scale": (E8M0, (32, 16)),
        "layers.2.attn.compressor.wkv.weight": (torch.bfloat16, (1024, 4096)),
        "layers.2.attn.compressor.ape": (torch.float32, (4, 1024)),
        "layers.2.attn.indexer.wq_b.weight": (FP8, (8192, 1024)),
        "layers.2.attn.indexer.weights_proj.weight": (torch.bfloat16, (64, 4096)),
        "layers.2.attn.indexer.compressor.wgate.weight": (torch.bfloat16, (256, 4096)),
        "layers.2.attn.indexer.compressor.ape": (torch.float32, (4, 256)),
        "layers.2.attn.indexer.compressor.norm.weight": (torch.bfloat16, (128,)),
        "layers.3.attn.compressor.wkv.weight": (torch.bfloat16, (512, 4096)),
        "layers.3.attn.compressor.ape": (torch.float32, (128, 512)),
        "layers.3.ffn.gate.bias": (torch.float32, (256,)),
        "embed.weight": (torch.bfloat16, (129280, 4096)), "head.weight": (torch.bfloat16, (129280, 4096)),
        "hc_head_fn": (torch.float32, (4, 16384)), "hc_head_scale": (torch.float32, (1,)),
    }
    assert {k: s[k] for k in expect} == expect
    absent = ["layers.0.attn.compressor.wkv.weight", "layers.3.attn.indexer.wq_b.weight", "layers.2.ffn.gate.bias",
              "layers.3.ffn.gate.tid2eid"]
    assert not any(k in s for k in absent)
    assert not any(k.startswith("mtp.") for k in s)
    gb = sum(torch.empty(0, dtype=d).element_size() * torch.Size(shape).numel() for d, shape in s.values()) / 1e9
    assert 16 < gb < 17  # fp4 experts 3.2 GB a layer, embed + head 2.1 GB


def test_fp8_experts_layout():
    """V4-Flash-Base ships fp8 experts: e4m3 with 128×128 block scales, like the other linear weights."""
    cfg = dataclasses.replace(preset_config("v4-flash"), quantization=V4Quantization(expert_dtype="fp8"))
    s = stored(cfg, 1)
    assert s["layers.0.ffn.experts.7.w1.weight"] == (FP8, (2048, 4096))
    assert s["layers.0.ffn.experts.7.w1.scale"] == (E8M0, (16, 32))
    assert s["layers.0.ffn.experts.7.w2.scale"] == (E8M0, (32, 16))


@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32])  # V4-Flash-Base's fp8 experts may carry fp32 scales
def test_dequantize_stored_fp8_blocks_and_fp4(scale_dtype):
    """A weight as stored, by its dtype: e4m3 times its 128×128 block's scale; packed e2m1 (int8) per 32."""
    values = (torch.arange(256 * 128, dtype=torch.float32).view(256, 128) % 13 - 6) / 2    # exact in e4m3
    scale = torch.tensor([[4.0], [0.25]]).to(scale_dtype)
    got = dequantize_stored(values.to(FP8), scale, torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.cat([values[:128] * 4, values[128:] / 4]).double())
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8).view(torch.int8)     # 32 values 0.5, 1.0, ...
    assert dequantize_stored(packed, torch.tensor([[2.0]]).to(E8M0)).tolist() == [[1.0, 2.0] * 16]


def test_fp4_nibble_order_and_values():
    block = [0x21, 0xF9, 0x7E] + [0] * 13  # 16 bytes: 32 values, one scale
    packed = torch.tensor([block * 2], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[1.0, 0.25]]).to(E8M0)
    w = dequantize_fp4(packed, scale)
    # low nibble first: 0x21 → (0.5, 1.0); 0xF9 → (-0.5, -6); 0x7E → (-4, 6)
    assert w[0, :6].tolist() == [0.5, 1.0, -0.5, -6.0, -4.0, 6.0]
    assert w[0, 32:38].tolist() == [0.125, 0.25, -0.125, -1.5, -1.0, 1.5]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    p, s = quantize_fp4(x)
    err = (dequantize_fp4(p, s) - x).abs() / s.float().repeat_interleave(32, 1)
    assert err.max() <= 1.0 + 1e-6  # within half the widest e2m1 step (2, between 4 and 6) of a block


def test_scale_check_names_the_tensor():
    check_pow2_scales(torch.tensor([2.0**-127, 1.0, 2.0**127]).to(E8M0), "fine")
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([1.0, 3.0]), torch.tensor([1.0, float("nan")]),
                torch.tensor([0, 255], dtype=torch.uint8).view(E8M0)):
        with pytest.raises(CheckpointError, match=r"tensor w\.scale: scale .* at flat index 1"):
            check_pow2_scales(bad, "w.scale")


def test_v4_tiny_writes_the_layout_and_loads(v4_master):
    cfg, weights = load_checkpoint(v4_master)
    assert cfg == preset_config("v4-tiny") and is_synthetic_checkpoint(v4_master, "v4-tiny", seed=7)
    index = json.loads((v4_master / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(stored(cfg))
    with safe_open(str(v4_master / index["layers.1.ffn.experts.3.w2.weight"]), "pt") as f:
        assert f.get_slice("layers.1.ffn.experts.3.w2.weight").get_dtype() == "I8"
        assert f.get_slice("layers.1.ffn.experts.3.w2.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.1.attn.wq_a.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.1.ffn.gate.tid2eid").get_dtype() == "I64"
    tid2eid = weights["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and int(tid2eid.min()) >= 0 and int(tid2eid.max()) < cfg.n_routed_experts
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
    for name, spec in tensor_specs(cfg, cfg.num_hidden_layers).items():
        t = weights[name]
        assert tuple(t.shape) == spec.shape and t.float().abs().sum() > 0, name
    assert weights["layers.0.attn.attn_sink"].std() > 0.3 and weights["layers.0.hc_attn_base"].std() > 0.1


def test_loader_opens_only_the_needed_shards(v4):
    plan = plan_load(v4, 1)
    names = {p.name for p in plan.shard_files}
    assert names == {"model-00001-of-000006.safetensors", "model-00002-of-000006.safetensors",
                     "model-00006-of-000006.safetensors"}
    for shard in ("model-00003-of-000006.safetensors", "model-00004-of-000006.safetensors"):
        (v4 / shard).unlink()  # layers 1 and 2: never opened for one layer
    index = json.loads((v4 / INDEX_FILE).read_text())
    index["weight_map"]["mtp.0.attn.wq_a.weight"] = "mtp.safetensors"  # a shard that does not exist: never read
    (v4 / INDEX_FILE).write_text(json.dumps(index))
    cfg, weights = load_checkpoint(v4, 1)
    assert not any(n.startswith(("layers.1.", "mtp.")) for n in weights) and "hc_head_fn" in weights
    with pytest.raises(CheckpointError, match="model-00003-of-000006.safetensors, which does not exist"):
        plan_load(v4, 2)


def _rewrite(path, name, change):
    """Rewrite tensor ``name`` in its shard with ``change(tensor)``."""
    from safetensors.torch import load_file, save_file

    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    shard = path / index[name]
    tensors = load_file(str(shard))
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(shard))


@pytest.mark.parametrize("name, change, message", [
    ("layers.0.attn.wkv.scale", lambda s: s.view(torch.uint8).index_fill_(0, torch.tensor([1]), 255).view(E8M0),
     r"tensor layers\.0\.attn\.wkv\.scale: scale nan at flat index 2"),
    ("layers.0.ffn.experts.1.w3.scale", lambda s: s.float().index_fill_(0, torch.tensor([0]), 3.0),
     r"tensor layers\.0\.ffn\.experts\.1\.w3\.scale: scale 3\.0 at flat index 0 is not a positive power of two"),
    ("layers.0.ffn.shared_experts.w1.scale", lambda s: s.float() * 0,
     r"tensor layers\.0\.ffn\.shared_experts\.w1\.scale: scale 0\.0"),
    ("layers.0.ffn.gate.tid2eid", lambda t: t.index_fill_(0, torch.tensor([5]), 8),
     r"tensor layers\.0\.ffn\.gate\.tid2eid: expert id 8 at flat index 10 is outside \[0, n_routed_experts=8\)"),
    ("layers.0.attn.wq_a.scale", lambda s: s.float()[:, :1].contiguous(),
     r"tensor layers\.0\.attn\.wq_a\.scale in .*: shape \[1, 1\] is wrong, expected \[1, 2\]"),
    ("layers.0.attn.wkv.weight", lambda w: w.to(torch.bfloat16),
     r"tensor layers\.0\.attn\.wkv\.weight in .*: dtype torch\.bfloat16 is wrong, expected torch\.float8_e4m3fn"),
])
def test_bad_tensors_are_refused_by_name(v4, name, change, message):
    _rewrite(v4, name, change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(v4, 1)


def test_cli_init_and_info(tmp_path, v4_master):
    runner = CliRunner()
    out = runner.invoke(app, ["info", str(v4_master), "--layers", "2"])
    assert out.exit_code == 0, out.output
    assert "deepseek_v4" in out.output and "SWA CSA HCA CSA" in out.output and "first 2" in out.output
    assert "cache CSA layer" in out.output and "274.0 B/token" in out.output  # 584 / 4 + 4 · 128 / 4
    result = runner.invoke(app, ["init", str(v4_master), "--preset", "v4-tiny", "--seed", "7"])
    assert result.exit_code == 0 and "already complete" in result.output


@pytest.mark.parametrize("dtype, as_stored", [(torch.bfloat16, True), (torch.float32, False)])
def test_memory_estimate_is_what_loading_holds(v4_master, dtype, as_stored):
    plan = plan_load(v4_master, 3)
    top, layers = layer_memory_bytes(plan, dtype, as_stored)
    _, weights = load_checkpoint(v4_master, 3, dtype=dtype, as_stored=as_stored)
    held = {i: 0 for i in range(3)} | {"top": 0}
    for name, t in weights.items():
        held[int(name.split(".")[1]) if name.startswith("layers.") else "top"] += t.numel() * t.element_size()
    assert (top, layers) == (held["top"], [held[i] for i in range(3)])


def test_weights_larger_than_the_memory_are_refused_before_reading(v4_master, monkeypatch):
    import minirt.shards as shards

    monkeypatch.setattr(shards, "available_memory", lambda device: 1_000_000)
    read = []
    with pytest.raises(DeviceError, match=r"4 layer\(s\) of .* need [\d.]+ [kMG]B of weights on cpu, 1.0 MB is free"):
        load_checkpoint(v4_master, progress=lambda done, total, name: read.append(name))
    assert read == []
