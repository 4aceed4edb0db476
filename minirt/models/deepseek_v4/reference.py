"""Eager reference (the oracle) for DeepSeek-V4 layers, in plain fp32 torch, independent of the kernels.

One sequence of T tokens at positions 0..T-1, dense masks, exact math. Per layer, on the residual state
X [T, hc, D] (the embedding copied into hc = 4 streams):

    collapsed, post, comb = hc_pre(X)                 mHC: mixing weights from X, Sinkhorn on comb
    X = post · attention(attn_norm(collapsed)) + combᵀ · X
    collapsed, post, comb = hc_pre(X)                 (the ffn's own mHC parameters)
    X = post · moe(ffn_norm(collapsed)) + combᵀ · X
    logits = head(norm(hc_head(X)))

Attention (:func:`attention_block`): q = per-head unweighted RMSNorm of wq_b(q_norm(wq_a x)), one shared
K = V vector kv = kv_norm(wkv x), both roped on their LAST qk_rope_head_dim dims (interleaved pairs);
keys are the sliding window (the last ``sliding_window`` tokens, self included) plus, on CSA layers,
the indexer's top-k compressed entries and, on HCA layers, every visible compressed entry (entry w is
visible to query t iff w < (t+1) // ratio). One softmax over all keys with a per-head sink logit in the
denominator; the output's rope dims get the inverse rotation at the query's position, then the grouped
output projection (wo_a per head group, wo_b). SWA layers rope at ``rope_theta``; CSA / HCA layers (q, kv,
compressor, indexer) at ``compress_rope_theta`` with YaRN frequencies, no magnitude factor.

MoE (:func:`moe`): scores sqrt(softplus(x · gateᵀ)); experts by top-k of scores + bias (the bias only
selects) or, on the first num_hash_layers layers, by the frozen ``tid2eid[token]`` table; weights the
selected scores, renormalised, times routed_scaling_factor; SwiGLU experts with
``silu(min(x·W1ᵀ, L)) · clamp(x·W3ᵀ, −L, L)``; plus the shared expert.

Not modelled: the fp8 / fp4 fake quantisation of DeepSeek's inference code (kv and compressed entries,
the indexer's Hadamard-rotated q / k), as transformers' ``deepseek_v4`` does not model it either.
Weights use DeepSeek's names; the functions take a layer's weights by names relative to ``layers.{i}.``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...config import YarnScaling
from ...errors import CheckpointError, InputError
from ...norms import rmsnorm
from ...rope import apply_rope_interleaved, rope_inv_freq
from .checkpoint import dequantize_stored, keeps_stored, scale_name, stored_layout, tensor_specs
from .config import DeepseekV4Config, LayerKind


@dataclass(frozen=True)
class _Rope:
    """What ``rope.rope_inv_freq`` reads from a config."""

    rope_theta: float
    rope_scaling: YarnScaling | None


def rope_cos_sin(cfg: DeepseekV4Config, kind: LayerKind, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[len(positions), qk_rope_head_dim / 2]`` of a layer of ``kind``: plain RoPE at rope_theta
    for SWA layers, ``compress_rope_theta`` with YaRN frequencies (magnitude factor 1) for CSA / HCA."""
    params = (_Rope(cfg.rope_theta, None) if kind == LayerKind.SWA
              else _Rope(cfg.compress_rope_theta, cfg.rope_scaling))
    angles = positions.to(torch.float64)[:, None] * rope_inv_freq(params, cfg.qk_rope_head_dim).to(positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[T, *heads, d]`` with its last ``2 · cos.shape[-1]`` dims roped (interleaved pairs)."""
    rope = 2 * cos.shape[-1]
    return torch.cat((x[..., :-rope], apply_rope_interleaved(x[..., -rope:], cos, sin)), dim=-1)


def unweighted_rmsnorm(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim (V4's per-head q norm and mHC's input norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------
# mHC


def hc_pre(X: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: DeepseekV4Config) -> tuple[Tensor, Tensor, Tensor]:
    """mHC's mixing weights of X ``[T, hc, D]`` and the collapsed sub-layer input.

    ``m = fn · rmsnorm(flat X)`` (no weight) ``[T, (2 + hc)·hc]`` split into pre, post, comb;
    ``pre = σ(m_pre·scale[0] + base_pre) + hc_eps``, ``post = 2σ(m_post·scale[1] + base_post)``,
    ``comb = softmax_rows(m_comb·scale[2] + base_comb) + hc_eps`` (comb[j, k] = m[2hc + hc·j + k]), then
    Sinkhorn: columns normalised, then hc_sinkhorn_iters − 1 times rows and columns.
    Returns (collapsed ``Σ_j pre_j X_j`` [T, D], post [T, hc], comb [T, hc, hc]).
    """
    T, hc, _ = X.shape
    m = F.linear(unweighted_rmsnorm(X.flatten(1), cfg.rms_norm_eps), fn)
    m_pre, m_post, m_comb = m.split([hc, hc, hc * hc], dim=-1)
    b_pre, b_post, b_comb = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + cfg.hc_eps
    post = 2 * torch.sigmoid(m_post * scale[1] + b_post)
    comb = torch.softmax((m_comb * scale[2] + b_comb).view(T, hc, hc), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return torch.einsum("tj,tjd->td", pre, X), post, comb


def hc_post(out: Tensor, X: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """New residual state ``X'[k] = post[k] · out + Σ_j comb[j, k] · X[j]`` (combᵀ · X): out [T, D], X [T, hc, D]."""
    return post[..., None] * out[:, None] + torch.einsum("tjk,tjd->tkd", comb, X)


def hc_head(X: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: DeepseekV4Config) -> Tensor:
    """The final collapse ``Σ_j pre_j X_j`` [T, D] with ``pre = σ(fn · rmsnorm(flat X) · scale + base) + hc_eps``."""
    m = F.linear(unweighted_rmsnorm(X.flatten(1), cfg.rms_norm_eps), fn)
    pre = torch.sigmoid(m * scale + base) + cfg.hc_eps
    return torch.einsum("tj,tjd->td", pre, X)


# ---------------------------------------------------------------------------------------------------
# Attention


def compress(x: Tensor, w: Mapping[str, Tensor], prefix: str, ratio: int, dim: int, cfg: DeepseekV4Config,
             cos: Tensor, sin: Tensor) -> Tensor:
    """The compressed entries ``[T // ratio, dim]`` of x ``[T, D]`` (complete windows only).

    ``kv = wkv·x``, ``score = wgate·x + ape[t mod ratio]``. HCA (``wkv`` [dim, D]): entry w is the per-channel
    softmax(score)-weighted sum over tokens ratio·w .. ratio·w + ratio − 1. CSA (``wkv`` [2·dim, D],
    overlapping windows): 2·ratio slots, the previous window's tokens with the FIRST halves of kv / score,
    then the window's own with the SECOND halves (window 0: no previous slots). Then ``norm`` and rope on the
    last dims at the window's first position ratio·w (cos / sin ``[T // ratio, rope / 2]``).
    """
    n = x.shape[0] // ratio
    if n == 0:
        return x.new_zeros(0, dim)
    kv = F.linear(x[: n * ratio], w[prefix + "wkv.weight"]).view(n, ratio, -1)
    score = F.linear(x[: n * ratio], w[prefix + "wgate.weight"]).view(n, ratio, -1) + w[prefix + "ape"]
    if kv.shape[-1] == 2 * dim:
        previous_kv = F.pad(kv[:-1, :, :dim], (0, 0, 0, 0, 1, 0))
        previous_score = F.pad(score[:-1, :, :dim], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        kv = torch.cat((previous_kv, kv[..., dim:]), dim=1)
        score = torch.cat((previous_score, score[..., dim:]), dim=1)
    entries = (kv * score.softmax(dim=1)).sum(dim=1)
    return rope_tail(rmsnorm(entries, w[prefix + "norm.weight"], cfg.rms_norm_eps), cos, sin)


def visible_entries(T: int, n: int, ratio: int, device: torch.device | str) -> Tensor:
    """``[T, n]`` bool: compressed entry w is visible to query t iff w < (t + 1) // ratio."""
    return torch.arange(n, device=device) < (torch.arange(1, T + 1, device=device) // ratio)[:, None]


def indexer_topk(x: Tensor, qr: Tensor, w: Mapping[str, Tensor], cfg: DeepseekV4Config, cos: Tensor, sin: Tensor,
                 entry_cos: Tensor, entry_sin: Tensor) -> tuple[Tensor, Tensor]:
    """CSA's lightning indexer: (scores ``[T, n]`` with −inf where invisible, top-k ``[T, min(index_topk, n)]``
    int64 entry ids, best first, −1 where fewer entries are visible).

    Keys: the indexer's own overlapping compressor at index_head_dim. Queries ``q = indexer.wq_b · qr``
    per head, roped on their last dims at t (no norm). ``I[t, s] = Σ_h wp[t, h] · d^-½ · h^-½ ·
    relu(q[t, h] · k[s])`` with ``wp = weights_proj · x``.
    """
    T = x.shape[0]
    heads, dim, ratio = cfg.index_n_heads, cfg.index_head_dim, LayerKind.CSA.ratio
    keys = compress(x, w, "attn.indexer.compressor.", ratio, dim, cfg, entry_cos, entry_sin)
    q = rope_tail(F.linear(qr, w["attn.indexer.wq_b.weight"]).view(T, heads, dim), cos, sin)
    head_weights = F.linear(x, w["attn.indexer.weights_proj.weight"]) * (dim**-0.5 * heads**-0.5)
    scores = torch.einsum("th,ths->ts", head_weights, torch.einsum("thd,sd->ths", q, keys).relu())
    visible = visible_entries(T, keys.shape[0], ratio, x.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(cfg.index_topk, keys.shape[0]), dim=-1).indices
    return scores, top.masked_fill(~visible.gather(1, top), -1)


def sink_attention(q: Tensor, keys: Tensor, mask: Tensor, sink: Tensor, sm_scale: float) -> Tensor:
    """``o[t, h] = Σ_s e^{z_ts} k_s / (Σ_s e^{z_ts} + e^{sink_h})`` with ``z = sm_scale · q·k`` over the
    allowed keys (K = V): q [T, H, d], keys [S, d], mask [T, S] bool, sink [H] (any value: +inf gives 0,
    −inf no sink). A row with no allowed key gives 0. Computed as FlashMLA does: the sink-free softmax
    output times ``σ(lse − sink)``, the share the keys keep against the sink."""
    z = (torch.einsum("thd,sd->hts", q, keys) * sm_scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(z, -1, keepdim=True)
    keep = torch.sigmoid(lse - sink[:, None, None])
    p = torch.where(mask[None], (z - lse).exp() * keep, 0.0)  # where, not a product: empty rows hold NaN
    return torch.einsum("hts,sd->thd", p, keys)


def attention_block(x: Tensor, w: Mapping[str, Tensor], cfg: DeepseekV4Config, kind: LayerKind) -> tuple[Tensor, Tensor | None]:
    """One layer's attention on x ``[T, D]`` (attn_norm applied): (output ``[T, D]``, the CSA top-k
    ``[T, k]`` or None)."""
    T, H, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    positions = torch.arange(T, device=x.device)
    cos, sin = rope_cos_sin(cfg, kind, positions, x.dtype)
    qr = rmsnorm(F.linear(x, w["attn.wq_a.weight"]), w["attn.q_norm.weight"], cfg.rms_norm_eps)
    q = rope_tail(unweighted_rmsnorm(F.linear(qr, w["attn.wq_b.weight"]).view(T, H, hd), cfg.rms_norm_eps), cos, sin)
    kv = rope_tail(rmsnorm(F.linear(x, w["attn.wkv.weight"]), w["attn.kv_norm.weight"], cfg.rms_norm_eps), cos, sin)

    past = positions[:, None] - positions[None, :]
    keys, mask, topk = kv, (past >= 0) & (past < cfg.sliding_window), None
    if kind != LayerKind.SWA:
        n = T // kind.ratio
        entry_cos, entry_sin = rope_cos_sin(cfg, kind, torch.arange(n, device=x.device) * kind.ratio, x.dtype)
        entries = compress(x, w, "attn.compressor.", kind.ratio, hd, cfg, entry_cos, entry_sin)
        visible = visible_entries(T, n, kind.ratio, x.device)
        if kind == LayerKind.CSA:
            _, topk = indexer_topk(x, qr, w, cfg, cos, sin, entry_cos, entry_sin)
            selected = torch.zeros(T, n + 1, dtype=torch.bool, device=x.device)
            selected.scatter_(1, torch.where(topk >= 0, topk, n), True)  # −1 lands in the spare last column
            visible = visible & selected[:, :n]
        keys, mask = torch.cat((kv, entries)), torch.cat((mask, visible), dim=1)

    o = sink_attention(q, keys, mask, w["attn.attn_sink"], cfg.sm_scale)
    o = rope_tail(o, cos, -sin)  # K = V carried the keys' rope: rotate back by the query's angle
    g = cfg.o_groups
    wo_a = w["attn.wo_a.weight"].view(g, cfg.o_lora_rank, -1)
    z = torch.einsum("tgi,gri->tgr", o.reshape(T, g, -1), wo_a)
    return F.linear(z.flatten(1), w["attn.wo_b.weight"]), topk


# ---------------------------------------------------------------------------------------------------
# MoE


def swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, limit: float) -> Tensor:
    """``w2 · (silu(min(w1·x, limit)) · clamp(w3·x, −limit, limit))``."""
    return F.linear(F.silu(F.linear(x, w1).clamp(max=limit)) * F.linear(x, w3).clamp(-limit, limit), w2)


def route(x: Tensor, tokens: Tensor, w: Mapping[str, Tensor], cfg: DeepseekV4Config, layer: int) -> tuple[Tensor, Tensor]:
    """(expert ids ``[T, k]`` int64, their weights ``[T, k]``) of x ``[T, D]``: scores
    ``sqrt(softplus(x · gateᵀ))``; ids ``tid2eid[token]`` on hash layers, else the top-k of scores + bias
    (ties to the lower id); weights the ids' scores, divided by their sum, times routed_scaling_factor."""
    scores = F.softplus(F.linear(x, w["ffn.gate.weight"])).sqrt()
    if cfg.is_hash_layer(layer):
        ids = w["ffn.gate.tid2eid"][tokens]
    else:
        biased = scores + w["ffn.gate.bias"]
        ids = biased.sort(dim=-1, descending=True, stable=True).indices[:, : cfg.num_experts_per_tok]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def moe(x: Tensor, ids: Tensor, weights: Tensor, w: Mapping[str, Tensor], cfg: DeepseekV4Config) -> Tensor:
    """The MoE FFN of x ``[T, D]`` (ffn_norm applied): the experts ``ids`` ``[T, k]`` weighted by ``weights``
    (:func:`route`'s), plus the shared expert."""
    out = swiglu(x, *(w[f"ffn.shared_experts.w{k}.weight"] for k in (1, 2, 3)), cfg.swiglu_limit)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        expert = swiglu(x[rows], *(_expert_weight(w, f"ffn.experts.{e}.w{k}.weight", x.dtype) for k in (1, 2, 3)),
                        cfg.swiglu_limit)
        out = out.index_add(0, rows, expert * weights[rows, slot, None])
    return out


def _expert_weight(w: Mapping[str, Tensor], name: str, dtype: torch.dtype) -> Tensor:
    """A routed expert's weight in ``dtype``: as given, or dequantised here when it is held as stored."""
    scale = w.get(scale_name(name))
    return w[name] if scale is None else dequantize_stored(w[name], scale, dtype)


# ---------------------------------------------------------------------------------------------------
# Model


@dataclass
class ReferenceOutputV4:
    """What :meth:`ReferenceModelV4.forward` computes for T tokens: logits ``[T, vocab]``; per layer the
    residual state after it ``[T, hc, D]``, the attention output ``[T, D]``, the CSA top-k ``[T, k]``
    (None on SWA / HCA layers) and the routed experts ``[T, num_experts_per_tok]``."""

    logits: Tensor
    hidden_states: list[Tensor]
    attn_outputs: list[Tensor]
    topk_indices: list[Tensor | None]
    expert_ids: list[Tensor]


class ReferenceModelV4:
    """The first ``num_layers`` DeepSeek-V4 layers, then hc_head, norm and head, in plain torch.

    weights: DeepSeek name → tensor (dequantised, as ``deepseek_v4.checkpoint.load_checkpoint`` returns),
    at least those of ``tensor_specs(cfg, num_layers)``; float ones are copied to ``dtype`` on ``device``.
    Routed experts may come as stored with their ``.scale`` (``load_checkpoint(..., as_stored="experts")``):
    they stay so, and each is dequantised when a token is routed to it (the same values, in a quarter of the
    memory or less: 20.2 GB of weights for V4-Flash's 4-layer preset against 109.6 dequantised).
    """

    def __init__(self, cfg: DeepseekV4Config, weights: Mapping[str, Tensor], num_layers: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
        if not dtype.is_floating_point:
            raise InputError(f"dtype must be a floating-point dtype, got {dtype}")
        self.cfg, self.num_layers, self.dtype, self.device = cfg, num_layers, dtype, torch.device(device)
        self.weights: dict[str, Tensor] = {}
        for name, spec in tensor_specs(cfg, num_layers).items():
            if name not in weights:
                raise CheckpointError(f"tensor '{name}' is missing")
            stored = keeps_stored(name, spec, "experts") and scale_name(name) in weights
            layout = stored_layout(name, spec) if stored else {name: (None, spec.shape)}
            for part, (_, shape) in layout.items():
                t = weights[part]
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"tensor '{part}' has shape {tuple(t.shape)}, expected {shape}")
                self.weights[part] = t.to(self.device) if stored else \
                    t.to(self.device, torch.int64 if spec.fmt == "int64" else dtype)

    def layer_weights(self, i: int) -> dict[str, Tensor]:
        """Layer i's weights by their names relative to ``layers.{i}.``."""
        prefix = f"layers.{i}."
        return {name[len(prefix):]: t for name, t in self.weights.items() if name.startswith(prefix)}

    def forward(self, tokens: Tensor) -> ReferenceOutputV4:
        """Run tokens ``[T]`` (int, positions 0..T-1) through the model."""
        cfg, top = self.cfg, self.weights
        if tokens.ndim != 1 or tokens.numel() == 0 or tokens.dtype.is_floating_point:
            raise InputError(f"tokens must be a non-empty 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise InputError(f"token ids must lie in [0, {cfg.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
        tokens = tokens.to(self.device)
        out = ReferenceOutputV4(None, [], [], [], [])
        X = top["embed.weight"][tokens][:, None].expand(-1, cfg.hc_mult, -1)
        for i, kind in enumerate(cfg.layer_kinds[: self.num_layers]):
            w = self.layer_weights(i)
            collapsed, post, comb = hc_pre(X, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], cfg)
            attn, topk = attention_block(rmsnorm(collapsed, w["attn_norm.weight"], cfg.rms_norm_eps), w, cfg, kind)
            X = hc_post(attn, X, post, comb)
            collapsed, post, comb = hc_pre(X, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], cfg)
            x = rmsnorm(collapsed, w["ffn_norm.weight"], cfg.rms_norm_eps)
            ids, weights = route(x, tokens, w, cfg, i)
            X = hc_post(moe(x, ids, weights, w, cfg), X, post, comb)
            out.hidden_states.append(X)
            out.attn_outputs.append(attn)
            out.topk_indices.append(topk)
            out.expert_ids.append(ids)
        y = hc_head(X, top["hc_head_fn"], top["hc_head_base"], top["hc_head_scale"], cfg)
        out.logits = F.linear(rmsnorm(y, top["norm.weight"], cfg.rms_norm_eps), top["head.weight"])
        return out
