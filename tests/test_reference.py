"""Tests of the eager reference model and the rope helpers.

Expected values come from independent code written here: complex-number rope, a per-head loop MLA,
an explicit indexer, and YaRN frequencies from the closed form with hand-derived correction ranges.
"""
import dataclasses
import math

import pytest
import torch

from minirt.config import ModelConfig, YarnScaling
from minirt.errors import CheckpointError, InputError
from minirt.models.deepseek_v32.reference import ReferenceModel, attention_mask, select_topk
from minirt.rope import apply_rope_half, apply_rope_interleaved, rope_cos_sin, rope_inv_freq

THETA = 10000.0
# qk_rope 16 with original context 256: correction dims 16·ln(256/(2π·r))/(2 ln 1e4) are 0.21 (r=32)
# and 3.22 (r=1), so the YaRN ramp runs over pairs [0, 4] (floor / ceil).
SMALL_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0)
SMALL_YARN_RANGE = (0, 4)


def small_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="deepseek_v32", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=24, rms_norm_eps=1e-6, rope_theta=THETA, max_position_embeddings=256 * 40,
        first_k_dense_replace=2, rope_scaling=SMALL_YARN, index_n_heads=4, index_head_dim=32, index_topk=8,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def dense_v3(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, model_type="deepseek_v3", index_n_heads=None, index_head_dim=None, index_topk=None)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under HF names for every layer of cfg; projections scaled by fan_in^-0.5."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads

    def proj(out_features, in_features):
        return torch.randn(out_features, in_features, generator=g) * in_features**-0.5

    def norm(dim):
        return 1.0 + 0.2 * torch.randn(dim, generator=g)

    w = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, hidden, generator=g),
        "model.norm.weight": norm(hidden),
        "lm_head.weight": proj(cfg.vocab_size, hidden),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_a_proj.weight": proj(cfg.q_lora_rank, hidden),
            p + "self_attn.q_a_layernorm.weight": norm(cfg.q_lora_rank),
            p + "self_attn.q_b_proj.weight": proj(heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": proj(cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden),
            p + "self_attn.kv_a_layernorm.weight": norm(cfg.kv_lora_rank),
            p + "self_attn.kv_b_proj.weight": proj(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            p + "self_attn.o_proj.weight": proj(hidden, heads * cfg.v_head_dim),
            p + "mlp.gate_proj.weight": proj(cfg.intermediate_size, hidden),
            p + "mlp.up_proj.weight": proj(cfg.intermediate_size, hidden),
            p + "mlp.down_proj.weight": proj(hidden, cfg.intermediate_size),
        }
        if cfg.index_topk is not None:
            w |= {
                p + "self_attn.indexer.wq_b.weight": proj(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                p + "self_attn.indexer.wk.weight": proj(cfg.index_head_dim, hidden),
                p + "self_attn.indexer.k_norm.weight": norm(cfg.index_head_dim),
                p + "self_attn.indexer.k_norm.bias": 0.2 * torch.randn(cfg.index_head_dim, generator=g),
                p + "self_attn.indexer.weights_proj.weight": proj(cfg.index_n_heads, hidden),
            }
    return w


def random_tokens(cfg: ModelConfig, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


# ---- independent implementations -------------------------------------------------------------------

def closed_form_inv_freq(dim: int, factor: float | None = None, ramp_range: tuple[int, int] | None = None) -> torch.Tensor:
    """theta^(-2i/dim), blended towards /factor by clamp((i - low) / (high - low), 0, 1)."""
    inv = torch.tensor([THETA ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    if factor is None:
        return inv
    low, high = ramp_range
    ramp = torch.tensor([min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)], dtype=torch.float64)
    return inv * (1 - ramp) + inv / factor * ramp


def complex_rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [..., d] as complex numbers x[2i] + i·x[2i+1], multiplied by e^(i·angle)."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous()) * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(z).flatten(-2)


def complex_rope_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [..., d] as complex numbers x[i] + i·x[i + d/2], multiplied by e^(i·angle); back as [re | im]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1)


def small_angles(cfg: ModelConfig, T: int) -> torch.Tensor:
    """[T, rope/2] float64 angles of SMALL_YARN configs."""
    inv = closed_form_inv_freq(cfg.qk_rope_head_dim, SMALL_YARN.factor, SMALL_YARN_RANGE)
    return torch.arange(T, dtype=torch.float64)[:, None] * inv


def as_float64(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.double() for name, t in w.items()}


def plain_rmsnorm(x, weight, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def naive_layer_inputs(cfg, w, layer_input, layer):
    """(x, q latent) of one layer in float64: the input-normalised residual and rmsnorm(q_a_proj(x))."""
    p = f"model.layers.{layer}."
    w, layer_input = as_float64(w), layer_input.double()
    x = plain_rmsnorm(layer_input, w[p + "input_layernorm.weight"])
    return x, plain_rmsnorm(x @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"])


def naive_mla(cfg, w, layer_input, layer, allowed) -> torch.Tensor:
    """o_proj output [T, hidden] of one layer's MLA, per head and query, with allowed [T, T] bool."""
    p = f"model.layers.{layer}.self_attn."
    x, q_latent = naive_layer_inputs(cfg, w, layer_input, layer)
    w = as_float64(w)
    T, H = x.shape[0], cfg.num_attention_heads
    nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    angles = small_angles(cfg, T)
    q = (q_latent @ w[p + "q_b_proj.weight"].T).view(T, H, nope + rope)
    kv_a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    latent = plain_rmsnorm(kv_a[:, : cfg.kv_lora_rank], w[p + "kv_a_layernorm.weight"])
    k_rope = complex_rope_interleaved(kv_a[:, cfg.kv_lora_rank:], angles)
    kv = (latent @ w[p + "kv_b_proj.weight"].T).view(T, H, nope + v_dim)
    mscale = 0.1 * math.log(SMALL_YARN.factor) + 1
    scale = (nope + rope) ** -0.5 * mscale**2
    out = torch.zeros(T, H, v_dim, dtype=torch.float64)
    for h in range(H):
        q_rope = complex_rope_interleaved(q[:, h, nope:], angles)
        for t in range(T):
            keys = allowed[t].nonzero().flatten()
            if keys.numel() == 0:
                continue
            logits = scale * (kv[keys, h, :nope] @ q[t, h, :nope] + k_rope[keys] @ q_rope[t])
            out[t, h] = torch.softmax(logits, 0) @ kv[keys, h, nope:]
    return out.flatten(1) @ w[p + "o_proj.weight"].T


def naive_index_scores(cfg, w, layer_input, layer) -> torch.Tensor:
    """[T, T] indexer scores of one layer, −inf above the diagonal."""
    p = f"model.layers.{layer}.self_attn.indexer."
    x, q_latent = naive_layer_inputs(cfg, w, layer_input, layer)
    w = as_float64(w)
    T, n, d, r = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    angles = small_angles(cfg, T)
    q = (q_latent @ w[p + "wq_b.weight"].T).view(T, n, d)
    k = x @ w[p + "wk.weight"].T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True) + 1e-6)
    k = k * w[p + "k_norm.weight"] + w[p + "k_norm.bias"]
    q = torch.cat((complex_rope_half(q[..., :r], angles[:, None, :]), q[..., r:]), dim=-1)
    k = torch.cat((complex_rope_half(k[..., :r], angles), k[..., r:]), dim=-1)
    head_weights = (x @ w[p + "weights_proj.weight"].T) / math.sqrt(n) / math.sqrt(d)
    scores = torch.full((T, T), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            scores[t, s] = sum(max(float(q[t, h] @ k[s]), 0.0) * float(head_weights[t, h]) for h in range(n))
    return scores


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def mask_from_indices(indices: torch.Tensor, T: int) -> torch.Tensor:
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for s in indices[t].tolist():
            if 0 <= s <= t:
                allowed[t, s] = True
    return allowed


# ---- rope ------------------------------------------------------------------------------------------

def test_inv_freq_without_yarn_is_theta_power():
    cfg = small_config(rope_scaling=None)
    assert rel_err(rope_inv_freq(cfg, 16), closed_form_inv_freq(16)) < 1e-14


@pytest.mark.parametrize(
    "dim, original, ramp_range",
    [
        # correction dims 64·ln(4096/(2π·r))/(2 ln 1e4): 10.47 (r=32), 22.51 (r=1) — DeepSeek-V3.2.
        (64, 4096, (10, 23)),
        # 16·ln(4096/(2π·r))/(2 ln 1e4): 2.62, 5.63.
        (16, 4096, (2, 6)),
        (16, 256, SMALL_YARN_RANGE),
    ],
)
def test_yarn_inv_freq_matches_closed_form(dim, original, ramp_range):
    yarn = dataclasses.replace(SMALL_YARN, original_max_position_embeddings=original)
    cfg = small_config(rope_scaling=yarn, qk_rope_head_dim=dim)
    expected = closed_form_inv_freq(dim, 40.0, ramp_range)
    assert rel_err(rope_inv_freq(cfg, dim), expected) < 1e-14
    # Far positions too: the tables must stay exact where fp32 angles would be off by ~1e-2 rad.
    positions = torch.tensor([0, 1, 4095, 163839])
    cos, sin = rope_cos_sin(cfg, positions, dim, dtype=torch.float64)
    angles = positions.double()[:, None] * expected
    assert rel_err(cos, angles.cos()) < 1e-12 and rel_err(sin, angles.sin()) < 1e-12


def test_sm_scale_v32():
    yarn = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    cfg = small_config(qk_nope_head_dim=128, qk_rope_head_dim=64, rope_scaling=yarn)
    assert cfg.sm_scale == pytest.approx(0.135234, abs=1e-6)


def test_rope_attention_factor_scales_cos_sin():
    positions = torch.arange(5)
    cos, sin = rope_cos_sin(small_config(), positions, 16)
    assert torch.allclose(cos**2 + sin**2, torch.ones(5, 8), atol=1e-6)
    yarn = dataclasses.replace(SMALL_YARN, mscale=2.0, mscale_all_dim=1.0)
    cos, sin = rope_cos_sin(small_config(rope_scaling=yarn), positions, 16)
    factor = (0.2 * math.log(40) + 1) / (0.1 * math.log(40) + 1)
    assert torch.allclose(cos**2 + sin**2, torch.full((5, 8), factor**2), rtol=1e-6)


def test_apply_rope_matches_complex_multiplication():
    cfg, T, H, d = small_config(), 11, 3, 16
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 10000, (T,), generator=g)
    x = torch.randn(T, H, d, generator=g, dtype=torch.float64)
    cos, sin = rope_cos_sin(cfg, positions, d, dtype=torch.float64)
    angles = positions.double()[:, None, None] * closed_form_inv_freq(d, 40.0, SMALL_YARN_RANGE)
    interleaved, half = apply_rope_interleaved(x, cos, sin), apply_rope_half(x, cos, sin)
    assert rel_err(interleaved, complex_rope_interleaved(x, angles)) < 1e-12
    assert rel_err(half, complex_rope_half(x, angles)) < 1e-12
    # The pairings are genuinely different rotations of the same vector.
    assert rel_err(interleaved, half) > 0.1
    # Without head dims (k_rope [T, d]) the tables apply row by row too.
    assert rel_err(apply_rope_interleaved(x[:, 0], cos, sin), complex_rope_interleaved(x[:, 0], angles[:, 0])) < 1e-12


@pytest.mark.parametrize("apply_rope", [apply_rope_interleaved, apply_rope_half])
def test_rope_scores_depend_only_on_relative_position(apply_rope):
    cfg, d = small_config(), 16
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, d, generator=g, dtype=torch.float64)

    def score(m, n):
        cos, sin = rope_cos_sin(cfg, torch.tensor([m, n]), d, dtype=torch.float64)
        rotated = apply_rope(torch.stack((q, k)), cos, sin)
        return float(rotated[0] @ rotated[1])

    assert score(7, 3) == pytest.approx(score(1007, 1003), rel=1e-9)
    assert score(7, 3) == pytest.approx(score(4, 0), rel=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)


def test_rope_rejects_mismatched_tables():
    cos, sin = rope_cos_sin(small_config(), torch.arange(4), 16)
    with pytest.raises(InputError):
        apply_rope_interleaved(torch.randn(4, 2, 12), cos, sin)
    with pytest.raises(InputError):
        apply_rope_half(torch.randn(4, 2, 15), cos, sin)
    with pytest.raises(InputError):
        rope_cos_sin(small_config(), torch.arange(4.0), 16)


# ---- reference model -------------------------------------------------------------------------------

def test_short_prompt_equals_dense_causal_attention():
    cfg = small_config(index_topk=16)
    w = random_weights(cfg)
    tokens = random_tokens(cfg, 12)
    sparse = ReferenceModel(cfg, w).forward(tokens)
    dense = ReferenceModel(dense_v3(cfg), w).forward(tokens)
    for layer, indices in enumerate(sparse.topk_indices):
        assert indices.shape == (12, 16)
        assert torch.equal(attention_mask(indices, 12), causal(12)), f"layer {layer} did not select every causal key"
    assert dense.topk_indices == [None, None] and dense.index_scores == [None, None]
    assert rel_err(sparse.logits, dense.logits) < 1e-6
    embedded = w["model.embed_tokens.weight"][tokens]
    assert rel_err(sparse.attn_outputs[0], naive_mla(cfg, w, embedded, 0, causal(12)).float()) < 1e-5
    assert rel_err(sparse.attn_outputs[1], naive_mla(cfg, w, sparse.hidden_states[0], 1, causal(12)).float()) < 1e-5


def test_long_prompt_attends_to_indexer_top_k():
    cfg = small_config(index_topk=5)
    w = random_weights(cfg)
    T = 14
    tokens = random_tokens(cfg, T)
    out = ReferenceModel(cfg, w, dtype=torch.float64).forward(tokens)
    embedded = w["model.embed_tokens.weight"][tokens]
    expected_scores = naive_index_scores(cfg, w, embedded, 0)
    assert rel_err(out.index_scores[0][causal(T)], expected_scores[causal(T)]) < 1e-10
    assert torch.isneginf(out.index_scores[0][~causal(T)]).all()
    expected_keys = mask_from_indices(expected_scores.topk(5, dim=-1).indices, T)
    assert torch.equal(attention_mask(out.topk_indices[0], T), expected_keys)
    sparse = naive_mla(cfg, w, embedded, 0, expected_keys)
    assert rel_err(out.attn_outputs[0], sparse) < 1e-10
    # The selection matters: dense causal attention gives a different output.
    assert rel_err(naive_mla(cfg, w, embedded, 0, causal(T)), sparse) > 1e-3


def test_topk_rows_are_causal_complete_and_best():
    cfg = small_config(index_topk=6)
    T = 15
    out = ReferenceModel(cfg, random_weights(cfg, seed=4)).forward(random_tokens(cfg, T, seed=5))
    for scores, indices in zip(out.index_scores, out.topk_indices):
        assert indices.shape == (T, 6) and indices.dtype == torch.int64
        for t in range(T):
            count = min(6, t + 1)
            chosen = indices[t, :count]
            assert (indices[t, count:] == -1).all()
            assert ((chosen >= 0) & (chosen <= t)).all() and chosen.unique().numel() == count
            rejected = [s for s in range(t + 1) if s not in chosen.tolist()]
            if rejected:
                assert scores[t, chosen].min() >= scores[t, rejected].max()


def test_select_topk_pads_short_rows():
    scores = torch.tensor([[1.0, -math.inf, -math.inf], [0.5, 2.0, -math.inf], [3.0, -1.0, 2.0]])
    expected = torch.tensor([[0, -1, -1, -1], [1, 0, -1, -1], [0, 2, 1, -1]])
    assert torch.equal(select_topk(scores, 4), expected)
    assert torch.equal(select_topk(scores, 2), expected[:, :2])


def test_later_tokens_do_not_change_earlier_logits():
    cfg = small_config(index_topk=4)
    model = ReferenceModel(cfg, random_weights(cfg, seed=6))
    tokens = random_tokens(cfg, 16, seed=7)
    changed = tokens.clone()
    changed[10:] = (tokens[10:] + 1 + torch.arange(6)) % cfg.vocab_size
    a, b = model.forward(tokens), model.forward(changed)
    assert rel_err(b.logits[:10], a.logits[:10]) < 1e-6
    assert torch.equal(a.topk_indices[1][:10], b.topk_indices[1][:10])
    assert rel_err(b.logits[10:], a.logits[10:]) > 1e-2


@pytest.mark.parametrize("v32", [True, False])
def test_absorbed_equals_expanded_attention(v32):
    cfg = small_config(index_topk=5) if v32 else dense_v3(small_config())
    w = random_weights(cfg, seed=8)
    tokens = random_tokens(cfg, 13, seed=9)
    model = ReferenceModel(cfg, w, dtype=torch.float64)
    expanded, absorbed = model.forward(tokens), model.forward(tokens, absorbed=True)
    for layer in range(2):
        assert rel_err(absorbed.attn_outputs[layer], expanded.attn_outputs[layer]) < 1e-12
    assert rel_err(absorbed.logits, expanded.logits) < 1e-12
    fp32 = ReferenceModel(cfg, w).forward(tokens, absorbed=True)
    assert fp32.logits.dtype == torch.float32 and rel_err(fp32.logits, expanded.logits.float()) < 1e-5


def test_topk_override_is_honoured():
    cfg = small_config(index_topk=5)
    w = random_weights(cfg, seed=10)
    T = 12
    tokens = random_tokens(cfg, T, seed=11)
    g = torch.Generator().manual_seed(12)
    override = torch.full((T, 3), -1, dtype=torch.long)
    for t in range(T):
        keys = torch.randperm(t + 1, generator=g)[:3]
        override[t, torch.randperm(3, generator=g)[: keys.numel()]] = keys
    override[4] = -1               # no key at all: the query's output is zero
    override[6, 0] = 9             # a future key: the causal mask still drops it
    model = ReferenceModel(cfg, w, dtype=torch.float64)
    out = model.forward(tokens, topk_override=[override, None])
    free = model.forward(tokens)
    assert torch.equal(out.topk_indices[0], override)
    assert torch.equal(out.topk_indices[1], select_topk(out.index_scores[1], 5))
    embedded = w["model.embed_tokens.weight"][tokens]
    assert rel_err(out.attn_outputs[0], naive_mla(cfg, w, embedded, 0, mask_from_indices(override, T))) < 1e-10
    assert out.attn_outputs[0][4].abs().max() == 0
    assert torch.equal(out.index_scores[0], free.index_scores[0])
    assert rel_err(out.logits, free.logits) > 1e-3


def test_bad_inputs_raise():
    cfg = small_config()
    w = random_weights(cfg)
    model = ReferenceModel(cfg, w)
    for tokens in (torch.tensor([1, cfg.vocab_size]), torch.tensor([-1]), torch.zeros(0, dtype=torch.long),
                   torch.tensor([[1, 2]]), torch.tensor([1.0])):
        with pytest.raises(InputError):
            model.forward(tokens)
    with pytest.raises(InputError):
        model.forward(torch.tensor([1, 2]), topk_override=[None])
    with pytest.raises(InputError):
        model.forward(torch.tensor([1, 2]), topk_override=[torch.tensor([[0], [2]]), None])
    with pytest.raises(InputError):
        ReferenceModel(cfg, w, num_layers=3)
    missing = dict(w)
    del missing["model.layers.1.self_attn.indexer.k_norm.bias"]
    with pytest.raises(CheckpointError, match="k_norm.bias"):
        ReferenceModel(cfg, missing)
    reshaped = dict(w, **{"model.layers.0.self_attn.kv_b_proj.weight": torch.randn(3, 3)})
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        ReferenceModel(cfg, reshaped)


def test_reference_runs_on_synthetic_tiny_checkpoint(tiny_master):
    from minirt.models.deepseek_v32.checkpoint import load_checkpoint

    cfg, weights = load_checkpoint(tiny_master)
    T = cfg.index_topk + 8  # longer than top-k: the sparse selection drops keys
    tokens = random_tokens(cfg, T, seed=13)
    model = ReferenceModel(cfg, weights)
    out = model.forward(tokens)
    assert out.logits.shape == (T, cfg.vocab_size) and torch.isfinite(out.logits).all()
    assert out.logits.std(dim=-1).min() > 0 and rel_err(out.logits[1:], out.logits[:-1]) > 1e-2
    assert all((indices[-1] >= 0).all() for indices in out.topk_indices)
    assert rel_err(model.forward(tokens, absorbed=True).logits, out.logits) < 1e-5
