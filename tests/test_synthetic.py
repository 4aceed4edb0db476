"""The synthetic checkpoint writer (``minirt init``): layout, determinism, atomicity, value ranges."""
import json
import re

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

import minirt.synthetic as synthetic
from minirt.models.deepseek_v32.checkpoint import load_checkpoint, plan_load
from minirt.shards import INDEX_FILE
from minirt.config import ModelConfig
from minirt.errors import InputError
from minirt.synthetic import PRESETS, preset_config, write_synthetic_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic") / "tiny", preset="tiny", seed=42)


def all_bytes(ckpt):
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}


def test_tiny_preset_dims():
    cfg = preset_config("tiny")
    assert cfg.model_type == "deepseek_v32" and cfg.is_v32
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)  # kernels: d_qk 576, d_v 512
    assert cfg.index_topk < 64 and cfg.index_head_dim >= cfg.qk_rope_head_dim
    assert cfg.vocab_size >= 258 and (cfg.num_dense_layers, cfg.num_hidden_layers) == (2, 4)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.mscale_all_dim == 1
    assert cfg.quantization.weight_block_size == (128, 128) and cfg.quantization.scale_fmt == "ue8m0"


def test_v32_preset_has_the_real_dims():
    cfg = preset_config("v32")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.intermediate_size, cfg.vocab_size) == (18432, 129280)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.num_hidden_layers == cfg.first_k_dense_replace == 3
    assert cfg.sm_scale == pytest.approx(0.135234, abs=1e-6)
    one = preset_config("v32", num_layers=1)
    assert one.num_hidden_layers == one.first_k_dense_replace == 1
    five = preset_config("v32", num_layers=5)  # 3 dense layers, then 2 MoE layers at real size
    assert (five.num_hidden_layers, five.first_k_dense_replace) == (5, 3)
    assert not PRESETS["v32"].tokenizer and PRESETS["tiny"].tokenizer


def test_files_follow_the_real_layout(tiny):
    names = sorted(p.name for p in tiny.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert names == sorted(["config.json", INDEX_FILE, "tokenizer.json", *shards])
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-{k:05d}-of-{len(shards):06d}\.safetensors", s) for k, s in enumerate(shards, 1))
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV32ForCausalLM"] and raw["n_routed_experts"] > 0
    assert ModelConfig.from_dict(raw) == preset_config("tiny")
    index = json.loads((tiny / INDEX_FILE).read_text())
    sizes = {}
    for shard in shards:
        with safe_open(str(tiny / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                sizes[name] = t.numel() * t.element_size()
    assert set(index["weight_map"]) == set(sizes)
    assert index["metadata"]["total_size"] == sum(sizes.values())


def test_scales_are_powers_of_two(tiny):
    for shard in tiny.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in (n for n in f.keys() if n.endswith("_scale_inv")):
                s = f.get_tensor(name)
                assert (s > 0).all() and torch.equal(torch.exp2(torch.log2(s).round()), s), name


def test_same_seed_same_bytes_other_seed_other_values(tiny, tmp_path):
    again = write_synthetic_checkpoint(tmp_path / "again", preset="tiny", seed=42)
    assert all_bytes(again) == all_bytes(tiny)
    other = write_synthetic_checkpoint(tmp_path / "other", preset="tiny", seed=43)
    a, b = all_bytes(tiny), all_bytes(other)
    assert a["config.json"] == b["config.json"]
    assert all(a[n] != b[n] for n in a if n.endswith(".safetensors"))
    # Within one checkpoint, same-shaped tensors get different values (per-name seeds).
    _, w = load_checkpoint(tiny)
    assert not torch.equal(w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.1.mlp.gate_proj.weight"])


def test_chunked_generation_gives_a_valid_checkpoint(tmp_path, monkeypatch):
    # v32 generates big tensors in row chunks; force chunks of 128 rows here (576-row kv_a: 4 + a partial).
    monkeypatch.setattr(synthetic, "CHUNK_ELEMENTS", 128 * 256)
    ckpt = write_synthetic_checkpoint(tmp_path / "chunked", preset="tiny", seed=42, num_layers=1)
    _, w = load_checkpoint(ckpt)  # validates every header, dtype, shape and value
    for name, t in w.items():
        if name.endswith("_proj.weight") and ".indexer." not in name:
            fan_in = t.shape[1]
            assert t.std().item() == pytest.approx(fan_in**-0.5, rel=0.1), name


def test_num_layers_override_and_progress(tmp_path):
    calls = []
    ckpt = write_synthetic_checkpoint(tmp_path / "one", preset="tiny", seed=0, num_layers=1,
                                      progress=lambda done, total, name: calls.append((done, total, name)))
    total_size = json.loads((ckpt / INDEX_FILE).read_text())["metadata"]["total_size"]
    dones = [c[0] for c in calls]
    assert dones == sorted(dones) and dones[-1] == total_size and {c[1] for c in calls} == {total_size}
    plan = plan_load(ckpt)
    assert {c[2] for c in calls} == set(plan.specs)
    assert plan.num_layers == 1 and plan.config.num_hidden_layers == 1
    assert not any(n.startswith("model.layers.1.") for n in plan.tensor_names)
    with pytest.raises(InputError, match="num_layers"):
        write_synthetic_checkpoint(tmp_path / "zero", num_layers=0)


def test_refuses_non_empty_dir_without_force(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(InputError, match="not empty.*force"):
        write_synthetic_checkpoint(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind
    write_synthetic_checkpoint(out, force=True, num_layers=1)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_empty_dir_is_fine_and_a_file_is_not(tmp_path):
    (tmp_path / "empty").mkdir()
    write_synthetic_checkpoint(tmp_path / "empty", num_layers=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        write_synthetic_checkpoint(tmp_path / "file", force=True)


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = synthetic.quantize_block_fp8

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:  # fail mid-way, with several shards already written
            raise RuntimeError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "quantize_block_fp8", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        write_synthetic_checkpoint(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_unknown_preset_and_bad_seed(tmp_path):
    with pytest.raises(InputError, match="unknown preset 'huge'.*tiny"):
        write_synthetic_checkpoint(tmp_path / "x", preset="huge")
    with pytest.raises(InputError, match="seed"):
        write_synthetic_checkpoint(tmp_path / "x", seed="1")


def test_byte_level_tokenizer(tiny):
    cfg = ModelConfig.from_file(tiny)
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = "Grüße, 世界! \n\t" + "".join(chr(c) for c in torch.randint(32, 0x2FFF, (40,), generator=torch.Generator().manual_seed(3)).tolist())
    ids = tok.encode(text).ids
    assert ids == [cfg.bos_token_id] + list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.token_to_id("<eos>") == cfg.eos_token_id
    assert max(tok.get_vocab().values()) < cfg.vocab_size


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_activations_stay_in_a_realistic_range(tiny):
    """Layer-0 MLA scores of the tiny model (rope omitted: a rotation keeps norms) are neither one-hot
    nor uniform, and lm_head logits differ across the vocabulary."""
    cfg, w = load_checkpoint(tiny)
    g = torch.Generator().manual_seed(0)
    T, H = 64, cfg.num_attention_heads
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    x = w["model.embed_tokens.weight"][torch.randint(0, cfg.vocab_size, (T,), generator=g)]
    p = "model.layers.0."
    h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    q_lat = rms_norm(h @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (q_lat @ w[p + "self_attn.q_b_proj.weight"].T).view(T, H, nope + rope)
    kv = h @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    latent = rms_norm(kv[:, : cfg.kv_lora_rank], w[p + "self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps)
    kv_b = (latent @ w[p + "self_attn.kv_b_proj.weight"].T).view(T, H, nope + v)
    k = torch.cat([kv_b[..., :nope], kv[:, None, cfg.kv_lora_rank:].expand(T, H, rope)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * cfg.sm_scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)[:, T // 2:]  # rows with ≥ 32 keys
    top = probs.max(-1).values
    assert 1.0 < scores[:, causal].std().item() < 4.0
    assert 0.1 < top.mean().item() < 0.8, "softmax is one-hot or uniform"
    logits = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
    assert torch.isfinite(logits).all() and 0.5 < logits.std(-1).mean().item() < 2.0
