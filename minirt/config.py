"""Model configuration parsed from a Hugging Face DeepSeek-V3 / V3.2 ``config.json``.

Both rope spellings are accepted: the legacy ``rope_scaling`` (with ``type`` or ``rope_type``) plus a
top-level ``rope_theta``, and transformers v5's ``rope_parameters`` (which carries ``rope_theta``).
A config is V3.2 ("DSA", with the lightning indexer) when it has ``index_topk``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

MODEL_TYPES = ("deepseek_v3", "deepseek_v32")


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class Fp8Quantization:
    weight_block_size: tuple[int, int]
    scale_fmt: str | None = None  # "ue8m0" in V3.2: scales are powers of two


SCORING_FUNCS = ("sigmoid",)
TOPK_METHODS = ("noaux_tc",)


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek-V3 / V3.2 routed experts (the config.json keys of the same names).

    Each token picks ``num_experts_per_tok`` of ``n_routed_experts`` SwiGLU experts (width
    ``moe_intermediate_size``): sigmoid scores, ``e_score_correction_bias`` added for the choice only,
    restricted to the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of its
    two best); the chosen scores, renormalised to sum 1 when ``norm_topk_prob``, times
    ``routed_scaling_factor``, weight the experts' outputs. ``n_shared_experts`` experts' worth of a
    dense SwiGLU (width n_shared · moe_intermediate_size) runs on every token beside them.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    first_k_dense_replace: int
    rope_scaling: YarnScaling | None = None
    quantization: Fp8Quantization | None = None
    # V3.2 lightning indexer; None for V3.
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of experts (layers >= first_k_dense_replace, every moe_layer_freq-th); None without MoE layers.
    moe: MoeConfig | None = None

    @property
    def is_v32(self) -> bool:
        return self.index_topk is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """(nope + rope)^-0.5, times mscale² under YaRN (mscale = 0.1·mscale_all_dim·ln(factor) + 1)."""
        scale = self.qk_head_dim**-0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim and y.factor > 1:
            mscale = 0.1 * y.mscale_all_dim * math.log(y.factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def num_dense_layers(self) -> int:
        """Leading layers with a dense SwiGLU MLP (``first_k_dense_replace``, at most every layer)."""
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's FFN is MoE: i >= first_k_dense_replace and i % moe_layer_freq == 0."""
        return self.moe is not None and i >= self.first_k_dense_replace and i % self.moe.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse ``path`` (config.json, or a directory holding one): a regular file of at most
        ``files.MAX_CONFIG_BYTES``; ConfigError naming the file otherwise."""
        return _parse_file(path, _parse)

    def to_dict(self) -> dict[str, Any]:
        """The config.json a checkpoint writer stores (legacy rope spelling, read by every version)."""
        d = {k: v for k, v in asdict(self).items()
             if k not in ("rope_scaling", "quantization", "moe") and v is not None}
        if self.moe is not None:
            d |= asdict(self.moe)
        return d | rope_and_quantization_json(self.rope_scaling, self.quantization)


def rope_and_quantization_json(rope_scaling: YarnScaling | None, quantization) -> dict[str, Any]:
    """The config.json keys every family's ``to_dict`` writes for a YaRN rope (the legacy ``rope_scaling``
    spelling, read by every version) and an fp8 ``quantization_config`` (a dataclass: its fields that are set)."""
    d: dict[str, Any] = {}
    if rope_scaling is not None:
        d["rope_scaling"] = {"type": "yarn", **asdict(rope_scaling)}
    if quantization is not None:
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(quantization).items() if v is not None}
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", **fields}
    return d


_MAY_BE_ZERO = ("first_k_dense_replace", "bos_token_id", "eos_token_id", "mscale", "mscale_all_dim",
                "n_shared_experts")

# What the model family allows: generous multiples of DeepSeek-V3.2's values (in the comments), so that
# a hand-edited or hostile config.json cannot make minirt allocate without bound ([T, index_topk]
# top-k tables, one entry per layer, rope tables) while every real config passes.
INT_LIMITS = {
    "vocab_size": 1 << 20,                         # 129,280
    "hidden_size": 1 << 16,                        # 7,168
    "intermediate_size": 1 << 18,                  # 18,432
    "num_hidden_layers": 1024,                     # 61
    "num_attention_heads": 1024,                   # 128
    "q_lora_rank": 1 << 14,                        # 1,536
    "kv_lora_rank": 1 << 14,                       # 512
    "qk_nope_head_dim": 1024,                      # 128
    "qk_rope_head_dim": 1024,                      # 64
    "v_head_dim": 1024,                            # 128
    "max_position_embeddings": 1 << 24,            # 163,840
    "original_max_position_embeddings": 1 << 24,   # 4,096
    "first_k_dense_replace": 1024,                 # 3
    "index_n_heads": 1024,                         # 64
    "index_head_dim": 1024,                        # 128
    "index_topk": 1 << 14,                         # 2,048
    "bos_token_id": 1 << 20,                       # the vocabulary bounds these further
    "eos_token_id": 1 << 20,
}
# (lowest, highest, whether the lowest is allowed) of the float keys. rope_theta is a logarithm's base
# (YaRN divides by ln theta); a YaRN factor below 1 is no extension; mscale enters as 0.1·mscale·ln(factor).
FLOAT_RANGES = {
    "rope_theta": (1.0, 1e12, False),      # 10,000
    "rms_norm_eps": (0.0, 1.0, False),     # 1e-6
    "factor": (1.0, 1e4, True),            # 40
    "beta_fast": (0.0, 1e4, False),        # 32
    "beta_slow": (0.0, 1e4, False),        # 1
    "mscale": (0.0, 100.0, True),          # 1
    "mscale_all_dim": (0.0, 100.0, True),  # 1
}


def _number(value: int | float) -> str:
    """A number for a message: an int of thousands of digits as its power of two (str() refuses it)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}about 2^{value.bit_length()}"
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _get(raw: dict, key: str, kind: type, default: Any = ...) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise ConfigError(f"missing required key '{key}'")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 1e300 else math.inf
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"key '{key}' must be {kind.__name__}, got {value!r:.80}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"key '{key}' must be finite, got {value}")
    if key in FLOAT_RANGES:
        low, high, low_allowed = FLOAT_RANGES[key]
        if not (low <= value if low_allowed else low < value) or value > high:
            raise ConfigError(f"key '{key}' is {value:g}, outside the range {'[' if low_allowed else '('}{low:g}, "
                              f"{high:g}] the DeepSeek-V3/V3.2 family allows")
    elif value <= 0 and key not in _MAY_BE_ZERO:
        raise ConfigError(f"key '{key}' must be positive, got {_number(value)}")
    if key in INT_LIMITS and value > INT_LIMITS[key]:
        raise ConfigError(f"key '{key}' is {_number(value)}, more than the {INT_LIMITS[key]:,} the DeepSeek-V3/V3.2 "
                          "family allows")
    return value


def _parse_rope(raw: dict) -> tuple[float, YarnScaling | None]:
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = raw.get("rope_scaling"), "rope_scaling"
    theta_src = params if isinstance(params, dict) and "rope_theta" in params else raw
    theta = _get(theta_src, "rope_theta", float, 10000.0)
    if params is None:
        return theta, None
    if not isinstance(params, dict):
        raise ConfigError(f"key '{key}' must be an object, got {params!r:.80}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"key '{key}.rope_type': unsupported rope type {rope_type!r:.80} (expected 'yarn' or 'default')")
    try:
        yarn = YarnScaling(
            factor=_get(params, "factor", float),
            original_max_position_embeddings=_get(params, "original_max_position_embeddings", int),
            beta_fast=_get(params, "beta_fast", float, 32.0),
            beta_slow=_get(params, "beta_slow", float, 1.0),
            mscale=_get(params, "mscale", float, 1.0),
            mscale_all_dim=_get(params, "mscale_all_dim", float, 0.0),
        )
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None
    return theta, yarn


MAX_BLOCK = 4096  # DeepSeek-V3.2: 128 x 128
SCALE_FORMATS = (None, "ue8m0")  # ue8m0: every block scale is a power of two (an 8-bit exponent)


def _parse_quantization(raw: dict) -> Fp8Quantization | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError("key 'quantization_config' must be an object")
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"key 'quantization_config.quant_method': only 'fp8' is supported, got {q.get('quant_method')!r:.80}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"key 'quantization_config.fmt': only 'e4m3' is supported, got {q.get('fmt')!r:.80}")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        raise ConfigError(f"key 'quantization_config.weight_block_size' must be two ints in [1, {MAX_BLOCK}], "
                          f"got {block!r:.80}")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise ConfigError(f"key 'quantization_config.scale_fmt' must be absent or 'ue8m0', got {scale_fmt!r:.80}")
    return Fp8Quantization(weight_block_size=(block[0], block[1]), scale_fmt=scale_fmt)


def _parse_moe(raw: dict, has_moe_layers: bool) -> MoeConfig | None:
    """The MoE keys, required when some layer is MoE (num_hidden_layers > first_k_dense_replace); None
    when no layer is and n_routed_experts is absent."""
    if not has_moe_layers and raw.get("n_routed_experts") is None:
        return None
    norm = raw.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"key 'norm_topk_prob' must be a bool, got {norm!r}")
    names = {key: raw.get(key, default) for key, default in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))}
    for key, value in names.items():
        if not isinstance(value, str):
            raise ConfigError(f"key '{key}' must be str, got {value!r}")
    moe = MoeConfig(
        n_routed_experts=_get(raw, "n_routed_experts", int),
        num_experts_per_tok=_get(raw, "num_experts_per_tok", int),
        moe_intermediate_size=_get(raw, "moe_intermediate_size", int),
        n_shared_experts=_get(raw, "n_shared_experts", int, 0),
        n_group=_get(raw, "n_group", int, 1),
        topk_group=_get(raw, "topk_group", int, 1),
        norm_topk_prob=norm,
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        scoring_func=names["scoring_func"],
        topk_method=names["topk_method"],
        moe_layer_freq=_get(raw, "moe_layer_freq", int, 1),
    )
    _check_moe(moe)
    return moe


def _check_moe(moe: MoeConfig) -> None:
    if moe.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"key 'scoring_func': {moe.scoring_func!r} is not supported (expected one of "
                          f"{', '.join(SCORING_FUNCS)})")
    if moe.topk_method not in TOPK_METHODS:
        raise ConfigError(f"key 'topk_method': {moe.topk_method!r} is not supported (expected one of "
                          f"{', '.join(TOPK_METHODS)})")
    experts, groups = moe.n_routed_experts, moe.n_group
    if experts % groups:
        raise ConfigError(f"key 'n_group' ({groups}) must divide n_routed_experts ({experts})")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(f"key 'n_group' ({groups}): a group scores its two best experts, so it needs at least 2 "
                          f"of the {experts} experts")
    if moe.topk_group > groups:
        raise ConfigError(f"key 'topk_group' ({moe.topk_group}) must be at most n_group ({groups})")
    eligible = moe.topk_group * (experts // groups)
    if moe.num_experts_per_tok > eligible:
        raise ConfigError(f"key 'num_experts_per_tok' ({moe.num_experts_per_tok}) must be at most the "
                          f"{eligible} experts of the topk_group ({moe.topk_group}) groups kept")


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("missing required key 'model_type'")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"key 'model_type': unknown model type {model_type!r:.80} (expected one of {', '.join(MODEL_TYPES)}; "
                          "deepseek_v4 configs are read by minirt.config.load_config)")
    theta, yarn = _parse_rope(raw)
    has_indexer = raw.get("index_topk") is not None
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=_get(raw, "vocab_size", int),
        hidden_size=_get(raw, "hidden_size", int),
        intermediate_size=_get(raw, "intermediate_size", int),
        num_hidden_layers=_get(raw, "num_hidden_layers", int),
        num_attention_heads=_get(raw, "num_attention_heads", int),
        q_lora_rank=_get(raw, "q_lora_rank", int),
        kv_lora_rank=_get(raw, "kv_lora_rank", int),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim", int),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int),
        v_head_dim=_get(raw, "v_head_dim", int),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_get(raw, "max_position_embeddings", int, 4096),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, 0),
        rope_scaling=yarn,
        quantization=_parse_quantization(raw),
        index_n_heads=_get(raw, "index_n_heads", int) if has_indexer else None,
        index_head_dim=_get(raw, "index_head_dim", int) if has_indexer else None,
        index_topk=_get(raw, "index_topk", int) if has_indexer else None,
        bos_token_id=_get(raw, "bos_token_id", int, None),
        eos_token_id=_get(raw, "eos_token_id", int, None),
        moe=_parse_moe(raw, _get(raw, "num_hidden_layers", int) > _get(raw, "first_k_dense_replace", int, 0)),
    )
    _check_consistency(cfg)
    return cfg


def _check_consistency(cfg: ModelConfig) -> None:
    if cfg.model_type == "deepseek_v32" and not cfg.is_v32:
        raise ConfigError("key 'index_topk': model_type 'deepseek_v32' needs the indexer keys (index_topk, index_n_heads, index_head_dim)")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"key 'qk_rope_head_dim' must be even, got {cfg.qk_rope_head_dim}")
    if cfg.is_v32 and cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ConfigError(
            f"key 'index_head_dim' ({cfg.index_head_dim}) must be at least qk_rope_head_dim ({cfg.qk_rope_head_dim}): "
            "the indexer ropes its first qk_rope_head_dim dims"
        )
    if cfg.first_k_dense_replace < 0:
        raise ConfigError(f"key 'first_k_dense_replace' must be >= 0, got {cfg.first_k_dense_replace}")
    if cfg.moe is not None and cfg.quantization is not None:
        block = cfg.quantization.weight_block_size
        for key, dim in (("moe_intermediate_size", cfg.moe.moe_intermediate_size), ("hidden_size", cfg.hidden_size)):
            if dim % block[0] or dim % block[1]:
                raise ConfigError(f"key '{key}' ({dim}) must be a multiple of the fp8 block {list(block)}: the "
                                  "experts' gate and up projections are stacked block by block")
    for key in ("bos_token_id", "eos_token_id"):
        tok = getattr(cfg, key)
        if tok is not None and not 0 <= tok < cfg.vocab_size:
            raise ConfigError(f"key '{key}' ({tok}) must be in [0, vocab_size={cfg.vocab_size})")


def _parse_file(path: str | Path, parse):
    """``parse(raw)`` of the JSON object in ``path`` (a config.json or its directory, a regular file of at
    most ``files.MAX_CONFIG_BYTES``); ConfigErrors name the file."""
    from .files import MAX_CONFIG_BYTES, read_json, shown

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = read_json(path, "config.json", MAX_CONFIG_BYTES, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{shown(path)}: expected a JSON object")
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{shown(path)}: {e}") from None


def parse_config(raw: dict[str, Any]):
    """The config of ``raw`` (a parsed config.json) in its model family's class: ``ModelConfig`` for
    DeepSeek-V3 / V3.2, ``models.deepseek_v4.DeepseekV4Config`` for ``model_type: deepseek_v4``."""
    if raw.get("model_type") == "deepseek_v4":
        from .models.deepseek_v4.config import DeepseekV4Config

        return DeepseekV4Config.from_dict(raw)
    return _parse(raw)


def load_config(path: str | Path):
    """:func:`parse_config` of the config.json at ``path`` (the file or its checkpoint directory)."""
    return _parse_file(path, parse_config)
