"""ModelConfig parsing of HF DeepSeek-V3 / V3.2 config.json files."""
import copy
import json
import math

import pytest

from minirt.config import ModelConfig
from minirt.errors import ConfigError

# The published DeepSeek-V3.2 config.json (values as in the Hugging Face repository).
REAL_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def real_v32() -> dict:
    return copy.deepcopy(REAL_V32)


def to_v5_rope(raw: dict) -> dict:
    """The same config as transformers v5 writes it: rope_theta moves into rope_parameters."""
    raw = copy.deepcopy(raw)
    legacy = raw.pop("rope_scaling")
    params = {k: v for k, v in legacy.items() if k != "type"}
    raw["rope_parameters"] = {"rope_type": legacy["type"], "rope_theta": raw.pop("rope_theta"), **params}
    return raw


def test_real_v32_config_parses(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(REAL_V32))
    cfg = ModelConfig.from_file(tmp_path)  # a directory resolves to its config.json
    assert cfg.model_type == "deepseek_v32" and cfg.is_v32
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (128, 64, 128, 192)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers) == (18432, 129280, 61)
    assert (cfg.first_k_dense_replace, cfg.num_dense_layers) == (3, 3)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.rms_norm_eps, cfg.rope_theta) == (0, 1, 1e-6, 10000.0)
    y = cfg.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim) == (
        40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert cfg.quantization.weight_block_size == (128, 128) and cfg.quantization.scale_fmt == "ue8m0"
    # 0.135234 is the value quoted for V3.2; the formula is DeepSeek's YaRN mscale².
    assert cfg.sm_scale == pytest.approx(0.135234, abs=1e-6)
    assert cfg.sm_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_v3_config_without_indexer_or_yarn():
    raw = real_v32()
    raw["model_type"] = "deepseek_v3"
    for key in ("index_topk", "index_n_heads", "index_head_dim", "rope_scaling", "quantization_config"):
        del raw[key]
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.is_v32 and cfg.index_topk is None
    assert cfg.rope_scaling is None and cfg.quantization is None
    assert cfg.sm_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_legacy_and_v5_rope_spellings_agree(type_key):
    base = real_v32()
    base["rope_theta"] = 12345.0  # not the default, so a dropped theta shows
    v5 = to_v5_rope(base)
    legacy = copy.deepcopy(base)
    legacy["rope_scaling"][type_key] = legacy["rope_scaling"].pop("type")
    assert "rope_scaling" not in v5 and "rope_theta" not in v5
    a, b = ModelConfig.from_dict(legacy), ModelConfig.from_dict(v5)
    assert a == b
    assert a.rope_theta == 12345.0 and a.rope_scaling.factor == 40.0 and a.rope_scaling.mscale_all_dim == 1.0


def test_default_rope_type_means_no_scaling():
    raw = to_v5_rope(real_v32())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling is None and cfg.rope_theta == 5e5


def test_to_dict_round_trips():
    cfg = ModelConfig.from_dict(real_v32())
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


REQUIRED_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "index_n_heads", "index_head_dim", "model_type"]


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_key_is_named(key):
    raw = real_v32()
    del raw[key]
    with pytest.raises(ConfigError, match=f"'{key}'"):
        ModelConfig.from_dict(raw)


def test_missing_yarn_factor_is_named():
    raw = real_v32()
    del raw["rope_scaling"]["factor"]
    with pytest.raises(ConfigError, match="rope_scaling.*'factor'"):
        ModelConfig.from_dict(raw)


def test_unknown_model_type():
    raw = real_v32()
    raw["model_type"] = "llama"
    with pytest.raises(ConfigError, match="'model_type'.*llama"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "key, value",
    [
        ("index_head_dim", 32),  # smaller than the 64 rope dims the indexer rotates
        ("qk_rope_head_dim", 63),  # rope pairs need an even count
        ("bos_token_id", 129280),  # outside the vocabulary
        ("eos_token_id", -1),
        ("hidden_size", 0),
        ("kv_lora_rank", "512"),  # wrong type
        ("num_attention_heads", True),
    ],
)
def test_inconsistent_or_invalid_dims_name_the_key(key, value):
    raw = real_v32()
    raw[key] = value
    with pytest.raises(ConfigError, match=f"'{key}'"):
        ModelConfig.from_dict(raw)


def test_v32_model_type_needs_indexer_keys():
    raw = real_v32()
    del raw["index_topk"]
    with pytest.raises(ConfigError, match="'index_topk'"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("quant, key", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_bad_quantization_config_is_named(quant, key):
    raw = real_v32()
    raw["quantization_config"] = quant
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(raw)


def test_unsupported_rope_type_is_named():
    raw = real_v32()
    raw["rope_scaling"]["type"] = "linear"
    with pytest.raises(ConfigError, match="rope_scaling.*linear"):
        ModelConfig.from_dict(raw)


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_file(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=str(bad)):
        ModelConfig.from_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_file(bad)
    raw = real_v32()
    del raw["hidden_size"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"{bad}.*'hidden_size'"):
        ModelConfig.from_file(bad)
