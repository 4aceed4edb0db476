"""DeepSeek-V4 configuration parsed from its ``config.json`` (``model_type: deepseek_v4``).

The layer kinds come from ``compress_ratios`` (one entry per layer, then one per MTP layer, which minirt
ignores): 0 = sliding window only (SWA), 4 = compressed sparse attention (CSA, with the indexer),
128 = heavily compressed attention (HCA). Never from a default pattern: the released Flash and Pro
configs differ (Flash ``[0, 0, 4, 128, ...]``, Pro ``[128, 128, 4, 128, ...]``).

RoPE comes in two variants chosen per layer: SWA layers use plain RoPE at ``rope_theta``; CSA / HCA layers
(their q, kv, compressor and indexer) use ``compress_rope_theta`` with the YaRN frequencies of
``rope_scaling`` and no YaRN magnitude factor (neither on cos / sin nor on the softmax scale).
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

from ...config import YarnScaling, _get, _parse_rope, _parse_quantization as parse_fp8_quantization, rope_and_quantization_json
from ...errors import ConfigError

MODEL_TYPE = "deepseek_v4"
SCORING_FUNCS = ("sqrtsoftplus",)
EXPERT_DTYPES = ("fp4", "fp8")
FP4_BLOCK = 32  # fp4 experts: one e8m0 scale per 32 inputs


class LayerKind(enum.IntEnum):
    """A layer's attention, by its compress ratio (its ``compress_ratios`` entry)."""

    SWA = 0
    CSA = 4
    HCA = 128

    @property
    def ratio(self) -> int:
        """Tokens per compressed entry (0: no compressed entries)."""
        return int(self)


@dataclass(frozen=True)
class V4Quantization:
    """Block fp8 (e4m3) linear weights with power-of-two (``ue8m0``) scales named ``<module>.scale``;
    routed experts in ``expert_dtype``: "fp4" (e2m1 packed two per int8, one scale per 32 inputs) or "fp8"
    (like the other linear weights)."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"


@dataclass(frozen=True)
class DeepseekV4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int                  # d_qk = d_v: one 512-wide K = V vector, [nope | rope]
    qk_rope_head_dim: int          # rope on the LAST qk_rope_head_dim dims of every head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # as in config.json, MTP entries included
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0
    num_key_value_heads: int = 1
    rope_scaling: YarnScaling | None = None
    quantization: V4Quantization | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    # --- derived ----------------------------------------------------------------------------------

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The attention kind of each of the ``num_hidden_layers`` layers (MTP entries dropped)."""
        return tuple(LayerKind(r) for r in self.compress_ratios[: self.num_hidden_layers])

    def is_hash_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MoE routes by the frozen ``tid2eid[token]`` table (else by top-k)."""
        return layer < self.num_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """head_dim^-0.5: V4 applies no YaRN mscale to the softmax."""
        return self.head_dim**-0.5

    @property
    def hc_dim(self) -> int:
        """Outputs of an mHC mapping: pre (hc) + post (hc) + comb (hc × hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_dense_layers(self) -> int:
        """Every V4 layer is MoE; this is the number of layers the checkpoint's config describes."""
        return self.num_hidden_layers

    # --- I/O --------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV4Config":
        return _parse(raw)

    def to_dict(self) -> dict[str, Any]:
        """The config.json keys a checkpoint writer stores (the legacy rope spelling)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("rope_scaling", "quantization") and v is not None}
        d["compress_ratios"] = list(self.compress_ratios)
        return d | rope_and_quantization_json(self.rope_scaling, self.quantization)


_MAY_BE_ZERO = ("num_hash_layers", "num_nextn_predict_layers", "bos_token_id", "eos_token_id", "n_shared_experts")


def _int(raw: dict, key: str, default: Any = ...) -> int:
    """A positive int key (``_get``'s rule), or 0 for the keys that may be zero."""
    if key in _MAY_BE_ZERO and type(raw.get(key)) is int and raw[key] == 0:
        return 0
    return _get(raw, key, int, default)


def _parse_quantization(raw: dict) -> V4Quantization | None:
    """V3's fp8 quantization_config rules, plus V4's: 128×128 blocks, ue8m0 scales, an expert dtype."""
    q = parse_fp8_quantization(raw)
    if q is None:
        return None
    if q.weight_block_size != (128, 128):
        raise ConfigError(f"key 'quantization_config.weight_block_size' must be [128, 128] for DeepSeek-V4, "
                          f"got {list(q.weight_block_size)}")
    if q.scale_fmt != "ue8m0":
        raise ConfigError(f"key 'quantization_config.scale_fmt' must be 'ue8m0' for DeepSeek-V4, got {q.scale_fmt!r}")
    expert_dtype = raw["quantization_config"].get("expert_dtype", raw.get("expert_dtype", "fp8"))
    if expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"key 'quantization_config.expert_dtype' must be one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
    return V4Quantization((128, 128), "ue8m0", expert_dtype)


def _parse_ratios(raw: dict, num_layers: int, num_mtp: int) -> tuple[int, ...]:
    ratios = raw.get("compress_ratios")
    if ratios is None:
        raise ConfigError("missing required key 'compress_ratios' (one 0 / 4 / 128 entry per layer, then per MTP layer)")
    if not isinstance(ratios, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in ratios):
        raise ConfigError(f"key 'compress_ratios' must be a list of ints, got {ratios!r:.100}")
    if len(ratios) != num_layers + num_mtp:
        raise ConfigError(
            f"key 'compress_ratios' has {len(ratios)} entries, expected num_hidden_layers + num_nextn_predict_layers "
            f"= {num_layers} + {num_mtp}"
        )
    bad = [(i, r) for i, r in enumerate(ratios) if r not in tuple(LayerKind)]
    if bad:
        i, r = bad[0]
        raise ConfigError(f"key 'compress_ratios[{i}]' is {r}: expected 0 (window only), 4 (CSA) or 128 (HCA)")
    return tuple(ratios)


def _parse(raw: dict[str, Any]) -> DeepseekV4Config:
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"key 'model_type': expected {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    theta, yarn = _parse_rope(raw)
    num_layers = _int(raw, "num_hidden_layers")
    num_mtp = _int(raw, "num_nextn_predict_layers", 0)
    head_dim = _int(raw, "head_dim")
    if "qk_rope_head_dim" in raw:
        rope_dim = _int(raw, "qk_rope_head_dim")
    else:
        rope_dim = round(head_dim * _get(raw, "partial_rotary_factor", float, 64 / 512))
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"key 'scoring_func': DeepSeek-V4 scores experts by sqrt(softplus), got {scoring!r}")
    norm_topk = raw.get("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise ConfigError(f"key 'norm_topk_prob' must be a bool, got {norm_topk!r}")
    cfg = DeepseekV4Config(
        model_type=MODEL_TYPE,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=_int(raw, "hidden_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=_int(raw, "num_attention_heads"),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_int(raw, "q_lora_rank"),
        o_groups=_int(raw, "o_groups"),
        o_lora_rank=_int(raw, "o_lora_rank"),
        sliding_window=_int(raw, "sliding_window"),
        compress_ratios=_parse_ratios(raw, num_layers, num_mtp),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        compress_rope_theta=_get(raw, "compress_rope_theta", float),
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        hc_mult=_int(raw, "hc_mult"),
        hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters"),
        hc_eps=_get(raw, "hc_eps", float),
        index_n_heads=_int(raw, "index_n_heads"),
        index_head_dim=_int(raw, "index_head_dim"),
        index_topk=_int(raw, "index_topk"),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        n_routed_experts=_int(raw, "n_routed_experts"),
        n_shared_experts=_int(raw, "n_shared_experts", 1),
        num_experts_per_tok=_int(raw, "num_experts_per_tok"),
        num_hash_layers=_int(raw, "num_hash_layers", 0),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float),
        swiglu_limit=_get(raw, "swiglu_limit", float),
        scoring_func=scoring,
        norm_topk_prob=norm_topk,
        num_nextn_predict_layers=num_mtp,
        num_key_value_heads=_int(raw, "num_key_value_heads", 1),
        rope_scaling=yarn,
        quantization=_parse_quantization(raw),
        bos_token_id=_int(raw, "bos_token_id", None),
        eos_token_id=_int(raw, "eos_token_id", None),
    )
    _check_consistency(cfg)
    return cfg


def _check_consistency(cfg: DeepseekV4Config) -> None:
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"key '{key}' {what}")

    need(cfg.num_key_value_heads == 1, "num_key_value_heads", f"must be 1 (V4 attention has one shared K = V head), got {cfg.num_key_value_heads}")
    need(cfg.qk_rope_head_dim % 2 == 0 and cfg.qk_rope_head_dim < cfg.head_dim, "qk_rope_head_dim",
         f"must be even and below head_dim ({cfg.head_dim}), got {cfg.qk_rope_head_dim}")
    need(cfg.qk_rope_head_dim < cfg.index_head_dim, "index_head_dim",
         f"({cfg.index_head_dim}) must exceed qk_rope_head_dim ({cfg.qk_rope_head_dim}): the indexer ropes its last dims")
    need(cfg.num_attention_heads % cfg.o_groups == 0, "o_groups",
         f"({cfg.o_groups}) must divide num_attention_heads ({cfg.num_attention_heads})")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
         f"({cfg.num_experts_per_tok}) must not exceed n_routed_experts ({cfg.n_routed_experts})")
    need(cfg.n_shared_experts == 1, "n_shared_experts", f"must be 1 for DeepSeek-V4, got {cfg.n_shared_experts}")
    need(cfg.rope_scaling is None or cfg.rope_scaling.factor >= 1, "rope_scaling.factor", "must be at least 1")
    if cfg.quantization is not None:
        if cfg.quantization.expert_dtype == "fp4":
            need(cfg.hidden_size % FP4_BLOCK == 0 and cfg.moe_intermediate_size % FP4_BLOCK == 0, "moe_intermediate_size",
                 f"and hidden_size must be multiples of {FP4_BLOCK} for fp4 experts")
    for key in ("bos_token_id", "eos_token_id"):
        tok = getattr(cfg, key)
        need(tok is None or 0 <= tok < cfg.vocab_size, key, f"({tok}) must be in [0, vocab_size={cfg.vocab_size})")
    need(math.isfinite(cfg.hc_eps) and cfg.hc_eps > 0, "hc_eps", "must be positive")
