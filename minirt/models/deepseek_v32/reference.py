"""Eager reference model (the oracle) for DeepSeek-V3 / V3.2 layers, dense and MoE, in plain torch.

One sequence, one dtype throughout (fp32 by default, fp64 for tight comparisons), dense ``[T, T]``
attention with explicit boolean masks. Read next to DeepSeek's published math:

    h   = x + o_proj(MLA(rmsnorm(x)))            per decoder layer
    out = h + down(silu(gate(h')) · up(h')),     h' = rmsnorm(h)   (dense layers)
    out = h + Σ_k w_k · expert_k(h') + shared(h')                  (MoE layers)
    logits = lm_head(rmsnorm(out of the last layer))

MoE (:func:`route_experts`, :func:`moe`): the router's sigmoid scores plus the selection-only bias,
group-limited top-k (ties to the lower index), weights renormalised and scaled; each expert a SwiGLU
dequantised from its block-fp8 weights when it is used.

MLA (:func:`mla_projections`, :func:`mla_attention`): per head ``q = [q_nope | q_rope]``, a shared
latent ``c`` (the KV cache) and a shared ``k_rope``; ``k_nope, v = kv_b_proj(c)``;
``score = sm_scale · (q_nope·k_nope + q_rope·k_rope)``, masked causal AND (V3.2) to the lightning
indexer's top-k keys (:func:`lightning_indexer`, :func:`select_topk`).

Exact math: the indexer's Hadamard rotation (a no-op on dot products) and the fp8 rounding of the
official kernels are not applied. Weights use Hugging Face names; the functions take a layer's
weights by their names relative to ``model.layers.{i}.``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...blockfp8 import dequantize_block_fp8
from .checkpoint import SCALE_SUFFIX, stacked_expert_name, stacked_expert_specs, stacked_scale_shape, tensor_specs
from ...config import ModelConfig, MoeConfig
from ...errors import CheckpointError, InputError
from ...norms import rmsnorm
from ...rope import apply_rope_half, apply_rope_interleaved, rope_cos_sin

# The official indexer builds its k LayerNorm with the default eps, not the config's rms_norm_eps.
INDEXER_LAYERNORM_EPS = 1e-6


def mlp(x: Tensor, w: Mapping[str, Tensor], prefix: str = "mlp") -> Tensor:
    """Dense SwiGLU MLP ``down_proj(silu(gate_proj(x)) · up_proj(x))`` of the weights ``{prefix}.*``
    (``mlp``, or a MoE layer's ``mlp.shared_experts``); x ``[T, hidden]`` → ``[T, hidden]``."""
    gate = F.silu(F.linear(x, w[f"{prefix}.gate_proj.weight"]))
    return F.linear(gate * F.linear(x, w[f"{prefix}.up_proj.weight"]), w[f"{prefix}.down_proj.weight"])


def route_experts(x: Tensor, gate_weight: Tensor, bias: Tensor, moe: MoeConfig) -> tuple[Tensor, Tensor]:
    """V3 / V3.2 ``noaux_tc`` routing of x ``[T, hidden]`` with the router ``gate_weight [E, hidden]``
    and ``bias [E]`` (``e_score_correction_bias``), in x's dtype.

    scores = sigmoid(x · gateᵀ); choice = scores + bias (the bias only chooses). With n_group > 1
    each group of E / n_group consecutive experts scores the sum of its two best choices and only the
    topk_group best groups stay eligible. The num_experts_per_tok best choices win, ties to the lower
    index (stable sorts), best first. Returns (weights ``[T, k]``: the winners' unbiased scores,
    divided by their sum when norm_topk_prob, times routed_scaling_factor; expert ids ``[T, k]`` int64).
    """
    T, E = x.shape[0], moe.n_routed_experts
    scores = F.linear(x, gate_weight.to(x.dtype)).sigmoid()
    choice = scores + bias.to(x.dtype)
    if moe.n_group > 1:
        grouped = choice.view(T, moe.n_group, E // moe.n_group)
        group_scores = grouped.sort(dim=-1, descending=True).values[..., :2].sum(-1)
        kept = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : moe.topk_group]
        eligible = torch.zeros(T, moe.n_group, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(E // moe.n_group, dim=1), float("-inf"))
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, : moe.num_experts_per_tok]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * moe.routed_scaling_factor, ids


def expert_weight(w: Mapping[str, Tensor], name: str, expert: int, block: tuple[int, int] | None,
                  dtype: torch.dtype) -> Tensor:
    """Expert ``expert``'s slice of the stacked ``w[name]`` (``mlp.experts.gate_up_proj.weight`` or
    ``mlp.experts.down_proj.weight``), dequantised with its ``_scale_inv`` when stored fp8, in dtype."""
    if w[name].dtype.is_floating_point and w[name].element_size() > 1:
        return w[name][expert].to(dtype)
    return dequantize_block_fp8(w[name][expert], w[name + SCALE_SUFFIX][expert], block, dtype)


def moe(x: Tensor, w: Mapping[str, Tensor], cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """A MoE layer's FFN on x ``[T, hidden]`` (post-attention-normalised), from a layer's weights ``w``
    (the router, the stacked experts of ``checkpoint.stacked_expert_specs``, the shared experts).

    Returns (out ``[T, hidden]`` = Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) + shared(x[t]), weights
    ``[T, k]``, ids ``[T, k]``; :func:`route_experts`). Each expert used is dequantised once, in x's dtype.
    """
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    weights, ids = route_experts(x, w["mlp.gate.weight"], w["mlp.gate.e_score_correction_bias"], cfg.moe)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = expert_weight(w, "mlp.experts.gate_up_proj.weight", e, block, x.dtype)
        gate, up = F.linear(x[rows], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, expert_weight(w, "mlp.experts.down_proj.weight", e, block, x.dtype))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if cfg.moe.n_shared_experts:
        out = out + mlp(x, w, "mlp.shared_experts")
    return out, weights, ids


@dataclass
class MlaProjections:
    """What MLA attention consumes, for one sequence of T tokens and H heads.

    q_nope ``[T, H, qk_nope]``; q_rope ``[T, H, qk_rope]`` (roped, interleaved); q_latent
    ``[T, q_lora_rank]`` (the normalised q latent, also the indexer's input); kv_latent
    ``[T, kv_lora_rank]`` (normalised; the latent KV cache); k_rope ``[T, qk_rope]`` (roped, interleaved,
    shared by all heads).
    """

    q_nope: Tensor
    q_rope: Tensor
    q_latent: Tensor
    kv_latent: Tensor
    k_rope: Tensor


def mla_projections(x: Tensor, w: Mapping[str, Tensor], cfg: ModelConfig, cos: Tensor, sin: Tensor) -> MlaProjections:
    """MLA's low-rank projections of x ``[T, hidden]`` (already input-normalised); cos/sin ``[T, qk_rope/2]``.

    ``q = q_b_proj(rmsnorm(q_a_proj(x)))`` split per head into ``[nope | rope]`` (rope LAST);
    ``kv_a_proj_with_mqa(x) = [latent | k_rope]``; the latent is RMS-normalised, the rope parts roped
    with the interleaved pairing.
    """
    T = x.shape[0]
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_latent = rmsnorm(F.linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = F.linear(q_latent, w["self_attn.q_b_proj.weight"]).view(T, cfg.num_attention_heads, nope + rope)
    kv_latent, k_rope = F.linear(x, w["self_attn.kv_a_proj_with_mqa.weight"]).split([cfg.kv_lora_rank, rope], dim=-1)
    return MlaProjections(
        q_nope=q[..., :nope],
        q_rope=apply_rope_interleaved(q[..., nope:], cos, sin),
        q_latent=q_latent,
        kv_latent=rmsnorm(kv_latent, w["self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps),
        k_rope=apply_rope_interleaved(k_rope, cos, sin),
    )


def causal_mask(T: int, device: torch.device | str = "cpu") -> Tensor:
    """``[T, T]`` bool, True where key s may be seen by query t (s ≤ t)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def lightning_indexer(
    x: Tensor, q_latent: Tensor, w: Mapping[str, Tensor], cfg: ModelConfig, cos: Tensor, sin: Tensor
) -> Tensor:
    """V3.2 lightning indexer scores ``[T, T]`` (query t, key s), −inf where s > t.

    x ``[T, hidden]`` (input-normalised), q_latent ``[T, q_lora_rank]`` (:class:`MlaProjections`),
    cos/sin ``[T, qk_rope/2]``. ``q = wq_b(q_latent)`` → ``[T, n_heads, head_dim]``;
    ``k = LayerNorm(wk(x))`` (weight and bias) → ``[T, head_dim]``; both roped with the HALF pairing on
    their FIRST ``qk_rope_head_dim`` dims; ``w = weights_proj(x) · n_heads^-0.5 · head_dim^-0.5``;
    ``score[t, s] = Σ_h relu(q[t, h] · k[s]) · w[t, h]``.
    """
    T = x.shape[0]
    n_heads, head_dim, rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = F.linear(q_latent, w["self_attn.indexer.wq_b.weight"]).view(T, n_heads, head_dim)
    k = F.layer_norm(
        F.linear(x, w["self_attn.indexer.wk.weight"]), (head_dim,),
        w["self_attn.indexer.k_norm.weight"], w["self_attn.indexer.k_norm.bias"], INDEXER_LAYERNORM_EPS,
    )
    q = torch.cat((apply_rope_half(q[..., :rope], cos, sin), q[..., rope:]), dim=-1)
    k = torch.cat((apply_rope_half(k[..., :rope], cos, sin), k[..., rope:]), dim=-1)
    head_weights = F.linear(x, w["self_attn.indexer.weights_proj.weight"]) * (n_heads**-0.5 * head_dim**-0.5)
    # One head at a time keeps memory at [T, T] instead of [T, n_heads, T].
    scores = torch.zeros(T, T, dtype=x.dtype, device=x.device)
    for h in range(n_heads):
        scores += (q[:, h] @ k.T).relu() * head_weights[:, h, None]
    return scores.masked_fill(~causal_mask(T, x.device), float("-inf"))


def select_topk(index_scores: Tensor, topk: int) -> Tensor:
    """Per query row, the keys of the ``min(topk, t + 1)`` highest causal scores, best first.

    index_scores ``[T, T]`` with −inf for s > t (:func:`lightning_indexer`). Returns int64
    ``[T, topk]``, padded with −1. Ties go to the earlier position (a stable sort), so that runtimes
    agree on rows where several keys score exactly 0 (every head's relu clipped).
    """
    T = index_scores.shape[0]
    k = min(topk, T)
    selected = index_scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    # Row t has only t + 1 causal keys: the columns after them picked masked (−inf) keys.
    count = torch.arange(T, device=selected.device)[:, None] + 1
    selected = selected.masked_fill(torch.arange(k, device=selected.device) >= count, -1)
    return F.pad(selected, (0, topk - k), value=-1)


def attention_mask(topk_indices: Tensor | None, T: int, device: torch.device | str = "cpu") -> Tensor:
    """``[T, T]`` bool: causal, AND (when given) restricted to ``topk_indices [T, k]``.

    Negative indices are padding; indices ≥ T raise :class:`InputError`.
    """
    causal = causal_mask(T, device)
    if topk_indices is None:
        return causal
    if topk_indices.ndim != 2 or topk_indices.shape[0] != T or topk_indices.dtype.is_floating_point or topk_indices.dtype == torch.bool:
        raise InputError(f"top-k indices must be an integer [T={T}, k] tensor, got {topk_indices.dtype} {tuple(topk_indices.shape)}")
    if topk_indices.numel() and int(topk_indices.max()) >= T:
        raise InputError(f"top-k index {int(topk_indices.max())} is out of range for {T} tokens")
    topk_indices = topk_indices.to(device=device, dtype=torch.long)
    valid = topk_indices >= 0
    selected = torch.zeros(T, T + 1, dtype=torch.bool, device=device)
    # Padding scatters into the spare last column, dropped below.
    selected.scatter_(1, torch.where(valid, topk_indices, T), True)
    return causal & selected[:, :T]


def mla_attention(
    p: MlaProjections, kv_b_weight: Tensor, cfg: ModelConfig, mask: Tensor, absorbed: bool = False
) -> Tensor:
    """Masked MLA attention: ``[T, H, v_head]`` (per-head outputs, before ``o_proj``).

    kv_b_weight ``[H · (qk_nope + v_head), kv_lora_rank]``; mask ``[T, T]`` bool (query, key).
    ``absorbed=False``: expand the latent into per-head ``k_nope, v = kv_b_proj(kv_latent)``.
    ``absorbed=True`` (MQA form of decode kernels): fold ``W_k = W[:, :nope]`` into the query
    (``q_lat = q_nope · W_k``, ``[T, H, kv_lora_rank]``), attend over ``[kv_latent | k_rope]``, then
    apply ``W_v = W[:, nope:]`` to the attended latent. Same scale in both: ``cfg.sm_scale``.
    A query with no allowed key gets a zero output (as the sparse kernels do).
    """
    T, H = p.q_nope.shape[:2]
    nope = cfg.qk_nope_head_dim
    w_kv = kv_b_weight.reshape(H, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    w_k, w_v = w_kv[:, :nope], w_kv[:, nope:]
    rope_scores = torch.einsum("thr,sr->hts", p.q_rope, p.k_rope)
    if absorbed:
        q_lat = torch.einsum("thn,hnc->thc", p.q_nope, w_k)
        scores = torch.einsum("thc,sc->hts", q_lat, p.kv_latent) + rope_scores
    else:
        k_nope = torch.einsum("sc,hnc->shn", p.kv_latent, w_k)
        scores = torch.einsum("thn,shn->hts", p.q_nope, k_nope) + rope_scores
    scores = (scores * cfg.sm_scale).masked_fill(~mask, float("-inf"))
    probs = torch.where(mask.any(-1, keepdim=True), scores.softmax(-1), 0.0)
    if absorbed:
        o_lat = torch.einsum("hts,sc->thc", probs, p.kv_latent)
        return torch.einsum("thc,hvc->thv", o_lat, w_v)
    v = torch.einsum("sc,hvc->shv", p.kv_latent, w_v)
    return torch.einsum("hts,shv->thv", probs, v)


@dataclass
class ReferenceOutput:
    """Everything :meth:`ReferenceModel.forward` computes, for a sequence of T tokens (model dtype).

    logits ``[T, vocab]``; hidden_states: per layer the residual stream after it ``[T, hidden]``;
    topk_indices: per layer the sparse selection used ``[T, k]`` int64 (−1 padded; k = index_topk
    unless overridden), None for dense-attention (V3) layers; attn_outputs: per layer the ``o_proj``
    output ``[T, hidden]``; index_scores: per layer the indexer scores ``[T, T]`` (−inf for s > t),
    None for V3. Per MoE layer (None for dense ones): moe_inputs the FFN's normalised input
    ``[T, hidden]``, moe_outputs its output ``[T, hidden]``, expert_ids ``[T, k]`` int64 and
    expert_weights ``[T, k]`` (:func:`moe`).
    """

    logits: Tensor
    hidden_states: list[Tensor]
    topk_indices: list[Tensor | None]
    attn_outputs: list[Tensor]
    index_scores: list[Tensor | None]
    moe_inputs: list[Tensor | None]
    moe_outputs: list[Tensor | None]
    expert_ids: list[Tensor | None]
    expert_weights: list[Tensor | None]


class ReferenceModel:
    """The first ``num_layers`` decoder layers (dense and MoE) of a DeepSeek-V3/V3.2 model, then the
    final norm and lm_head, in plain torch.

    weights: HF name → tensor as ``checkpoint.load_checkpoint`` returns them (dequantised; any float
    dtype), at least those of ``checkpoint.tensor_specs``, but a MoE layer's routed experts stacked
    (``checkpoint.stacked_expert_specs``, fp8 with their ``_scale_inv`` or float); they are copied to
    ``dtype`` on ``device``, the fp8 experts kept as stored (each is dequantised when used).
    ``num_layers`` defaults to every layer (``cfg.num_hidden_layers``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Tensor],
        num_layers: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_layers is None:
            num_layers = cfg.num_hidden_layers
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise InputError(f"num_layers={num_layers}: the model has {cfg.num_hidden_layers} layers (num_hidden_layers)")
        if not dtype.is_floating_point:
            raise InputError(f"dtype must be a floating-point dtype, got {dtype}")
        self.cfg, self.num_layers, self.dtype, self.device = cfg, num_layers, dtype, torch.device(device)
        self.weights: dict[str, Tensor] = {}
        expected = {name: spec.shape for name, spec in tensor_specs(cfg, num_layers).items()
                    if stacked_expert_name(name) is None}
        block = cfg.quantization.weight_block_size if cfg.quantization else None
        for i in range(num_layers):
            for name, spec in stacked_expert_specs(cfg, i).items():
                expected[name] = spec.shape
                if spec.quantized and weights.get(name, torch.empty(0)).dtype == torch.float8_e4m3fn:
                    expected[name + SCALE_SUFFIX] = stacked_scale_shape(spec, block)
        for name, shape in expected.items():
            if name not in weights:
                raise CheckpointError(f"tensor '{name}' is missing")
            tensor = weights[name]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {shape}")
            keep = tensor.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIX)  # fp8 experts as stored
            self.weights[name] = tensor.to(device=self.device, dtype=None if keep else dtype)

    def layer_weights(self, i: int) -> dict[str, Tensor]:
        """Layer i's weights by their names relative to ``model.layers.{i}.``."""
        prefix = f"model.layers.{i}."
        return {name[len(prefix):]: t for name, t in self.weights.items() if name.startswith(prefix)}

    def forward(
        self, tokens: Tensor, *, absorbed: bool = False, topk_override: Sequence[Tensor | None] | None = None
    ) -> ReferenceOutput:
        """Run tokens ``[T]`` (int, positions 0..T-1) through the model.

        absorbed: use the MQA (absorbed) form of MLA attention. topk_override: per layer None (use the
        indexer's selection; dense causal for V3) or integer ``[T, k]`` key indices (−1 = padding) that
        replace the selection; the causal mask still applies. The indexer scores are still reported.
        """
        cfg = self.cfg
        if tokens.ndim != 1 or tokens.numel() == 0 or tokens.dtype.is_floating_point:
            raise InputError(f"tokens must be a non-empty 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise InputError(f"token ids must lie in [0, {cfg.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
        if topk_override is not None and len(topk_override) != self.num_layers:
            raise InputError(f"topk_override has {len(topk_override)} entries, the model runs {self.num_layers} layers")
        tokens = tokens.to(self.device)
        T = tokens.shape[0]
        cos, sin = rope_cos_sin(cfg, torch.arange(T, device=self.device), cfg.qk_rope_head_dim, dtype=self.dtype)
        hidden_states, topk_indices, attn_outputs, index_scores = [], [], [], []
        moe_inputs, moe_outputs, expert_ids, expert_weights = [], [], [], []

        h = self.weights["model.embed_tokens.weight"][tokens]
        for i in range(self.num_layers):
            w = self.layer_weights(i)
            x = rmsnorm(h, w["input_layernorm.weight"], cfg.rms_norm_eps)
            p = mla_projections(x, w, cfg, cos, sin)
            scores = lightning_indexer(x, p.q_latent, w, cfg, cos, sin) if cfg.is_v32 else None
            topk = topk_override[i] if topk_override is not None else None
            if topk is None and scores is not None:
                topk = select_topk(scores, cfg.index_topk)
            o = mla_attention(p, w["self_attn.kv_b_proj.weight"], cfg, attention_mask(topk, T, self.device), absorbed)
            attn = F.linear(o.flatten(1), w["self_attn.o_proj.weight"])
            h = h + attn
            x = rmsnorm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
            is_moe = cfg.is_moe_layer(i)
            ffn, routed_weights, routed_ids = moe(x, w, cfg) if is_moe else (mlp(x, w), None, None)
            h = h + ffn
            moe_inputs.append(x if is_moe else None)
            moe_outputs.append(ffn if is_moe else None)
            expert_weights.append(routed_weights)
            expert_ids.append(routed_ids)
            hidden_states.append(h)
            topk_indices.append(None if topk is None else topk.to(self.device, torch.long))
            attn_outputs.append(attn)
            index_scores.append(scores)

        logits = F.linear(rmsnorm(h, self.weights["model.norm.weight"], cfg.rms_norm_eps), self.weights["lm_head.weight"])
        return ReferenceOutput(logits, hidden_states, topk_indices, attn_outputs, index_scores, moe_inputs,
                               moe_outputs, expert_ids, expert_weights)


def forward_peak_bytes(cfg: ModelConfig, num_layers: int, num_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """Estimated peak bytes of what :meth:`ReferenceModel.forward` (``absorbed=False``) allocates for
    ``num_tokens`` tokens, weights not included; ``verify`` checks it against the free memory first.

    Counted, with T = num_tokens, e = dtype's item size and H heads:

    * kept in the ``ReferenceOutput`` per layer: hidden state and attention output ``[T, hidden]``; V3.2
      also the indexer scores ``[T, T]`` and the top-k ``[T, index_topk]`` int64;
    * the fullest moment of one layer, the largest of:
      :func:`mla_attention`: four ``[H, T, T]`` tensors alive at once (rope scores, masked scores and the
      softmax with its zero-row ``where``; scaled scores before that) plus ``[T, T]`` bool masks;
      :func:`select_topk`: the stable sort's values ``[T, T]`` and int64 indices;
      :func:`lightning_indexer`: the running ``[T, T]`` sum, a head's product and its relu;
    * the layer's ``[T, width]`` projections and MLP activations, and the final ``[T, vocab]`` logits;
    * per MoE layer the FFN's kept input, output and routing, and (transient) one expert dequantised.

    The ``[H, T, T]`` term dominates from a few hundred tokens on (128 heads: 2 KiB · T²).
    """
    T, e, H = num_tokens, dtype.itemsize, cfg.num_attention_heads
    square = T * T
    kept = 2 * T * cfg.hidden_size * e
    if cfg.is_v32:
        kept += square * e + T * cfg.index_topk * 8
    attention = 4 * H * square * e + 2 * square
    stage = attention
    if cfg.is_v32:
        stage = max(attention, square * (e + 8), 2 * square * e + 2 * square)
    widths = (H * (cfg.qk_head_dim + cfg.qk_nope_head_dim + cfg.v_head_dim)  # q, k_nope, v
              + cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim + 3 * cfg.hidden_size
              + 3 * cfg.intermediate_size)
    if cfg.is_v32:
        widths += cfg.index_n_heads * cfg.index_head_dim
    layer = stage + T * widths * e
    logits = T * cfg.vocab_size * e
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(num_layers))
    if moe_layers:  # kept: the FFN's input, output and routing; transient: one expert dequantised (fp32 + copy)
        k, width = cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size
        kept_moe = 2 * T * cfg.hidden_size * e + T * k * (8 + e)
        layer += 2 * 3 * width * cfg.hidden_size * 4 + T * cfg.moe.n_routed_experts * 3 * e
        return num_layers * kept + moe_layers * kept_moe + max(layer, logits)
    return num_layers * kept + max(layer, logits)
