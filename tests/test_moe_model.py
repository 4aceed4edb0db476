"""MoE layers in the model: config keys, the checkpoint layout and loader, the synthetic presets, the
eager reference against transformers' DeepseekV32, the runtime's MoE module, and verify's MoE rows."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import minirt
import minirt.models.deepseek_v32.checkpoint as checkpoint
import minirt.shards as shards
from minirt.blockfp8 import dequantize_block_fp8
from minirt.models.deepseek_v32.checkpoint import expert_bytes, load_checkpoint, stacked_expert_specs, tensor_specs
from minirt.shards import INDEX_FILE
from minirt.cli import app
from minirt.config import ModelConfig
from minirt.models.deepseek_v32.engine import build_engine
from minirt.errors import ConfigError, DeviceError
from minirt.models.deepseek_v32.reference import ReferenceModel, expert_weight, moe, route_experts
from minirt.synthetic import preset_config, write_synthetic_checkpoint

from conftest import DEVICE

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The tiny preset as written by default: 2 dense layers, then 2 MoE layers (16 experts, top 4)."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("moe") / "tiny", preset="tiny", seed=7)


def test_config_reads_the_moe_keys():
    raw = preset_config("tiny").to_dict()
    cfg = ModelConfig.from_dict(raw)
    assert cfg.moe == preset_config("tiny").moe
    assert (cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok, cfg.moe.n_group, cfg.moe.topk_group) == (16, 4, 4, 2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    every_other = ModelConfig.from_dict(raw | {"moe_layer_freq": 2, "num_hidden_layers": 6})
    assert [every_other.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    # A dense-only config without the keys has no MoE part.
    dense = {k: v for k, v in raw.items() if k not in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")}
    assert ModelConfig.from_dict(dense | {"num_hidden_layers": 2}).moe is None


@pytest.mark.parametrize("change, message", [
    ({"n_routed_experts": None}, "missing required key 'n_routed_experts'"),
    ({"n_group": 3}, r"'n_group' \(3\) must divide n_routed_experts \(16\)"),
    ({"topk_group": 5}, r"'topk_group' \(5\) must be at most n_group \(4\)"),
    ({"num_experts_per_tok": 9}, r"'num_experts_per_tok' \(9\) must be at most the 8 experts"),
    ({"scoring_func": "softmax"}, "'scoring_func': 'softmax' is not supported"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be a bool"),
    ({"moe_intermediate_size": 96}, r"'moe_intermediate_size' \(96\) must be a multiple of the fp8 block"),
])
def test_config_refuses_bad_moe_keys(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(preset_config("tiny").to_dict() | change)


def test_v32_layout_with_moe_layers_at_real_size():
    cfg = preset_config("v32", num_layers=5)
    specs = tensor_specs(cfg, 5)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False] * 3 + [True] * 2
    assert "model.layers.2.mlp.gate_proj.weight" in specs and "model.layers.3.mlp.gate_proj.weight" not in specs
    experts = [n for n in specs if n.startswith("model.layers.3.mlp.experts.")]
    assert len(experts) == 256 * 3
    assert specs["model.layers.4.mlp.experts.255.gate_proj.weight"].shape == (2048, 7168)
    assert specs["model.layers.4.mlp.experts.0.down_proj.weight"].shape == (7168, 2048)
    assert specs["model.layers.3.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    router = specs["model.layers.3.mlp.gate.weight"]
    assert router.shape == (256, 7168) and not router.quantized and router.fp32
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"].shape == (256,)
    stacked = stacked_expert_specs(cfg, 3)
    assert stacked["model.layers.3.mlp.experts.gate_up_proj.weight"].shape == (256, 4096, 7168)
    assert stacked["model.layers.3.mlp.experts.down_proj.weight"].shape == (256, 7168, 2048)
    # e4m3 bytes plus float32 scales of [16, 56] (gate, up) and [56, 16] (down), per expert.
    assert expert_bytes(cfg, 3) == 256 * (3 * 2048 * 7168 + 4 * 3 * 16 * 56)


def test_loader_stacks_the_experts_as_stored(tiny_moe):
    cfg, w = load_checkpoint(tiny_moe, fp8_as_stored=True)
    index = json.loads((tiny_moe / INDEX_FILE).read_text())["weight_map"]
    width = cfg.moe.moe_intermediate_size
    stacked = w["model.layers.3.mlp.experts.gate_up_proj.weight"]
    assert stacked.dtype == torch.float8_e4m3fn and stacked.shape == (16, 2 * width, 256)
    for e in (0, 9, 15):
        prefix = f"model.layers.3.mlp.experts.{e}"
        with safe_open(str(tiny_moe / index[f"{prefix}.up_proj.weight"]), framework="pt") as f:
            up, up_scale = f.get_tensor(f"{prefix}.up_proj.weight"), f.get_tensor(f"{prefix}.up_proj.weight_scale_inv")
            down = f.get_tensor(f"{prefix}.down_proj.weight")
        assert torch.equal(stacked[e, width:].view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(w["model.layers.3.mlp.experts.gate_up_proj.weight_scale_inv"][e, width // 128:], up_scale)
        assert torch.equal(w["model.layers.3.mlp.experts.down_proj.weight"][e].view(torch.uint8), down.view(torch.uint8))
    assert w["model.layers.2.mlp.gate.weight"].dtype == torch.float32  # stored bf16, kept fp32
    assert not any(".experts.0." in n for n in w)  # only the stacked tensors


def test_load_refuses_layers_that_do_not_fit(tiny_moe, monkeypatch):
    top, layers = checkpoint.layer_memory_bytes(preset_config("tiny"), tensor_specs(preset_config("tiny"), 4),
                                                torch.float32, False)
    free = top + sum(layers[:3]) + 1
    monkeypatch.setattr(shards, "available_memory", lambda device: free)
    with pytest.raises(DeviceError, match=r"4 layer\(s\) .* need .* of weights on cpu, .* is free: at most 3 layer"):
        load_checkpoint(tiny_moe)
    _, w = load_checkpoint(tiny_moe, num_layers=3)
    assert "model.layers.2.mlp.experts.down_proj.weight" in w


def _rewrite_shard_of(ckpt, name, edit):
    """Rewrite the shard holding tensor ``name`` with ``edit(tensors)`` applied (the index unchanged)."""
    shard = ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"][name]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _drop_from_index(ckpt, name):
    index = json.loads((ckpt / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


@pytest.mark.parametrize("damage, args, message", [
    (None, ["info", "{ckpt}", "--layers", "5"], "asked for 5 layers, but the model has 4 (num_hidden_layers): load at most 4"),
    (lambda ckpt: _drop_from_index(ckpt, "model.layers.3.mlp.experts.11.up_proj.weight"), ["info", "{ckpt}"],
     "tensor model.layers.3.mlp.experts.11.up_proj.weight is missing"),
    (lambda ckpt: _rewrite_shard_of(ckpt, "model.layers.2.mlp.gate.weight", lambda t: t.update(
        {"model.layers.2.mlp.gate.weight": torch.zeros(15, 256, dtype=torch.bfloat16)})),
     ["generate", "{ckpt}", "--tokens", "1,2", "-n", "1"],
     "tensor model.layers.2.mlp.gate.weight in model-00004-of-000006.safetensors: shape [15, 256] is wrong, "
     "expected [16, 256]"),
])
def test_bad_moe_checkpoints_get_one_line_errors(tiny_moe, tmp_path, damage, args, message):
    ckpt = shutil.copytree(tiny_moe, tmp_path / "ckpt")
    if damage is not None:
        damage(ckpt)
    result = runner.invoke(app, [a.format(ckpt=ckpt) for a in args])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("minirt: error: ")
    assert message in result.output


def test_info_prints_the_experts_bytes(tiny_moe):
    result = runner.invoke(app, ["info", str(tiny_moe)])
    assert result.exit_code == 0, result.output
    assert "MoE layers loaded" in result.output and "2: 2, 3" in result.output
    # 16 experts × (3 × 128 × 256 e4m3 + 4 × (2 + 2 + 2) scales) = 1,573,248 bytes.
    assert "16 × width 128, 4 per token, 1 shared: 1.6 MB" in result.output


def test_reference_router_follows_the_grouped_rule():
    torch.manual_seed(0)
    cfg = preset_config("tiny").moe
    x, gate, bias = torch.randn(64, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64), \
        torch.randn(16, dtype=torch.float64) * 0.1
    weights, ids = route_experts(x, gate, bias, cfg)
    scores = torch.sigmoid(x @ gate.T)
    for t in range(64):
        choice = (scores[t] + bias).tolist()
        groups = sorted(range(4), key=lambda g: -sum(sorted(choice[4 * g : 4 * g + 4])[-2:]))[:2]
        eligible = [e for e in range(16) if e // 4 in groups]
        best = sorted(eligible, key=lambda e: -choice[e])[:4]
        assert ids[t].tolist() == best
        picked = scores[t, best]
        torch.testing.assert_close(weights[t], picked / picked.sum() * 2.5)


def test_reference_matches_transformers_deepseek_v32(tiny_moe, transformers):
    cfg, w = load_checkpoint(tiny_moe, dtype=torch.float32)
    hf_cfg = transformers.DeepseekV32Config.from_pretrained(tiny_moe)
    hf_cfg._attn_implementation = "eager"
    assert hf_cfg.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    model = transformers.DeepseekV32ForCausalLM(hf_cfg).float().eval()
    block = cfg.quantization.weight_block_size
    state = {}
    for name, t in w.items():
        if ".mlp.experts." in name:  # transformers stacks the experts the same way, dequantised
            if not name.endswith("_scale_inv"):
                state[name.removesuffix(".weight")] = torch.stack(
                    [expert_weight(w, name, e, block, torch.float32) for e in range(t.shape[0])])
        else:
            state[name] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    routed = {}
    for i in (2, 3):
        model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, i=i: routed.__setitem__(i, out[2]))
    # As many tokens as index_topk: every layer attends every earlier key in both (no top-k near-ties).
    tokens = torch.randint(0, cfg.vocab_size, (cfg.index_topk,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = model(tokens[None]).logits[0]
    ref = ReferenceModel(cfg, w).forward(tokens)
    for i in (2, 3):
        assert torch.equal(routed[i].sort(-1).values, ref.expert_ids[i].sort(-1).values)
    assert ((hf_logits - ref.logits).norm() / ref.logits.norm()).item() < 1e-5


@pytest.mark.parametrize("tokens", [1, 12])
def test_runtime_moe_matches_the_reference(tiny_moe, tokens):
    """The runtime's MoE FFN (router and fp8 experts) against the reference's on the same input."""
    cfg, w = load_checkpoint(tiny_moe, num_layers=3, device=DEVICE, dtype=torch.float32, fp8_as_stored=True)
    engine = build_engine(cfg, w, 3, torch.device(DEVICE), torch.float32, fp8_weights=True)
    mlp = engine.model.model.layers[2].mlp
    layer = {n.removeprefix("model.layers.2."): t for n, t in w.items() if n.startswith("model.layers.2.")}
    for name in ("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"):
        layer[f"mlp.{name}.weight"] = dequantize_block_fp8(
            layer[f"mlp.{name}.weight"], layer[f"mlp.{name}.weight_scale_inv"])
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    ref_out, ref_weights, ref_ids = moe(x, layer, cfg)
    weights, ids = mlp.gate(x)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())  # same fp32 logits, same picks and order
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    out = mlp(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    err = ((out.double() - ref_out.double()).norm() / ref_out.double().norm()).item()
    assert 1e-3 < err < 0.08, err  # e4m3 activations (fp8 GEMMs), not exact; not a copy of the reference


def test_verify_passes_on_tiny_with_a_moe_layer(tiny_moe):
    # 2 dense layers + the first MoE layer, a short prompt: the interpreter runs every kernel.
    result = runner.invoke(app, ["verify", str(tiny_moe), "--layers", "3", "--prompt-len", "16",
                                 "--decode-steps", "2", "--json", "--device", DEVICE])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    rows = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and rows["router_agreement[2]"]["value"] >= 0.99
    assert 0 < rows["moe_same_routing[2]"]["value"] <= 0.1 and "router_agreement[1]" not in rows


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graphed_decode_equals_eager_decode_with_moe_layers(tiny_moe):
    engine = minirt.load(tiny_moe, device="cuda")  # 2 dense + 2 MoE layers, fp8 weights on sm_90
    prompts = [list(range(1, 51)), list(range(100, 117))]
    steps = torch.arange(300, 310).view(5, 2)

    def run(graphed):
        engine.use_cuda_graph = graphed
        engine.setup_cache(2, 64)
        return torch.stack([engine.prefill(prompts)] + [engine.decode(t) for t in steps])

    eager, graphed = run(False), run(True)
    assert len(engine._graphs) == 1  # captured once (routing and experts sync-free), replayed after
    assert ((graphed - eager).norm() / eager.norm()).item() < 1e-6
