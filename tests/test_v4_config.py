"""DeepSeek-V4 config.json parsing: layer kinds from compress_ratios, the two ropes, validation, dispatch."""
import json

import pytest

from minirt.config import ModelConfig, load_config, parse_config
from minirt.errors import ConfigError
from minirt.models.deepseek_v4 import DeepseekV4Config, LayerKind
from minirt.synthetic import preset_config

# DeepSeek-V4-Flash's config.json as released (third-party transcriptions agree), the keys minirt reads.
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "num_hash_layers": 3,
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "swiglu_limit": 10.0, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "expert_dtype": "fp4"},
}


def test_flash_config_layer_kinds_and_fields():
    cfg = parse_config(FLASH)
    assert isinstance(cfg, DeepseekV4Config)
    kinds = cfg.layer_kinds
    assert len(kinds) == 43  # the trailing MTP entry is dropped
    assert kinds[:2] == (LayerKind.SWA, LayerKind.SWA)
    assert all(kinds[i] == LayerKind.CSA for i in range(2, 43, 2))
    assert all(kinds[i] == LayerKind.HCA for i in range(3, 42, 2))
    assert (cfg.nope_head_dim, cfg.hc_dim, cfg.sm_scale) == (448, 24, 512**-0.5)
    assert [cfg.is_hash_layer(i) for i in range(5)] == [True, True, True, False, False]
    assert cfg.rope_scaling.factor == 16 and cfg.rope_scaling.original_max_position_embeddings == 65536
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert cfg.quantization.expert_dtype == "fp4" and cfg.quantization.scale_fmt == "ue8m0"


def test_pro_pattern_is_read_not_defaulted():
    raw = dict(FLASH, num_hidden_layers=61, compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0])
    kinds = parse_config(raw).layer_kinds
    assert kinds[:3] == (LayerKind.HCA, LayerKind.HCA, LayerKind.CSA) and len(kinds) == 61


def test_round_trip_through_to_dict():
    cfg = preset_config("v4-tiny")
    assert DeepseekV4Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    flash = parse_config(FLASH)
    assert parse_config(flash.to_dict()) == flash


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [4]}, "has 43 entries, expected num_hidden_layers + num_nextn_predict_layers = 43 + 1"),
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [8] + [0]}, "'compress_ratios[42]' is 8"),
    ({"compress_ratios": None}, "missing required key 'compress_ratios'"),
    ({"compress_ratios": [0.0] * 44}, "must be a list of ints"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"o_groups": 7}, "o_groups"),
    ({"scoring_func": "sigmoid"}, "sqrt(softplus)"),
    ({"quantization_config": dict(FLASH["quantization_config"], scale_fmt=None)}, "scale_fmt"),
    ({"quantization_config": dict(FLASH["quantization_config"], expert_dtype="int4")}, "expert_dtype"),
    ({"hidden_size": 0}, "'hidden_size' must be positive"),
])
def test_bad_configs_get_one_line_config_errors(change, message):
    raw = {k: v for k, v in {**FLASH, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_config_dispatches_on_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    assert isinstance(load_config(tmp_path), DeepseekV4Config)
    v32 = preset_config("tiny").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(v32))
    assert isinstance(load_config(tmp_path), ModelConfig)
    (tmp_path / "config.json").write_text(json.dumps(dict(FLASH, compress_ratios=[4] * 44, num_hidden_layers=44)))
    with pytest.raises(ConfigError, match=r"config\.json: key 'compress_ratios' has 44 entries"):
        load_config(tmp_path)
