"""Runtime building blocks as ``nn.Module``s, one per concept, named like the Hugging Face tensors.

A layer's ``state_dict`` keys are the checkpoint's names without ``model.layers.{i}.``, so another
project can build a layer from a ``ModelConfig`` and load it straight from a DeepSeek state dict::

    layer = DecoderLayer(cfg)
    layer.load_state_dict({k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items()
                           if k.startswith(f"model.layers.{i}.")})

The attention runs in the absorbed (MQA) form over the 576-wide latent (512 normalised latent + 64
roped key), the form the sparse kernels take: prefill through ``sparse_mla_prefill`` on bf16 latents,
decode through ``mla_decode_fp8`` on the fp8 paged cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerCache
from .config import ModelConfig
from .errors import InputError
from .formats import FP8_GROUP, quantize_groups
from .kernels import indexer_topk, lightning_indexer_scores, mla_decode_fp8, sparse_mla_prefill, write_kv_fp8
from .rope import apply_rope_half, apply_rope_interleaved


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class LightningIndexer(nn.Module):
    """V3.2's lightning indexer: picks, for each query token, the ``index_topk`` keys MLA attends to.

    score[t, s] = Σ_h relu(q[t, h] · k[s]) · w[t, h], with w = weights_proj(x) · H^-0.5 · D^-0.5.
    Rope is half-split (non-interleaved) on the first ``qk_rope_head_dim`` dims; k_norm is a LayerNorm
    with bias. ``precision="exact"`` scores in fp32; ``precision="fp8"`` follows the official path
    (Hadamard rotation, then fp8 e4m3 q and k with one power-of-two scale per 128 values).
    """

    def __init__(self, cfg: ModelConfig, precision: str = "exact"):
        super().__init__()
        if precision not in ("exact", "fp8"):
            raise InputError(f"indexer precision must be 'exact' or 'fp8', got {precision!r}")
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.precision = precision
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pe, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope_half(pe, cos, sin), rest], dim=-1)

    def _to_scoring_precision(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.precision == "exact":
            return x
        return fp8_fake_quant(hadamard_rotate(x))

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> indexer keys [T, head_dim] fp32, as cached (fp8 values in fp8 mode)."""
        k = F.layer_norm(self.wk(x).float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps)
        return self._to_scoring_precision(self._rope(k, cos, sin))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden], qr [T, q_lora_rank] (q_a_layernorm output) -> q [T, H, D] fp32, w [T, H] fp32."""
        q = self.wq_b(qr).float().view(-1, self.n_heads, self.head_dim)
        q = self._to_scoring_precision(self._rope(q, cos[:, None], sin[:, None]))
        w = F.linear(x.float(), self.weights_proj.weight.float()) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, w

    def prefill_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """One prompt's causal top-k through the Triton scores kernel: q [n, H, D], w [n, H], k [n, D]
        (fp32, from ``queries`` / ``keys``) -> key positions [n, index_topk] int32, −1 padded."""
        scores = lightning_indexer_scores(q, k, w, torch.arange(k.shape[0], device=k.device))
        return indexer_topk(scores, self.topk)

    @staticmethod
    def scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [..., T, H, D], w [..., T, H], k [..., S, D] -> scores [..., T, S] fp32 (torch: the decode
        step uses it, as it must stay free of host syncs for CUDA-graph capture)."""
        logits = torch.einsum("...thd,...sd->...ths", q, k).relu_()
        return torch.einsum("...ths,...th->...ts", logits, w)

    def select(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """scores [..., T, S], valid [..., T, S] bool -> top-k key positions [..., T, index_topk] int32.

        Row t keeps min(index_topk, #valid) keys; the rest of the row is −1. Ties go to the earlier
        position, as in the reference (several keys can score exactly 0 when every head's relu clips).
        """
        scores = scores.masked_fill(~valid, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        idx = torch.where(torch.isneginf(values[..., :k]), -1, order[..., :k]).to(torch.int32)
        if k < self.topk:
            idx = F.pad(idx, (0, self.topk - k), value=-1)
        return idx


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) -> x · H_D / sqrt(D): orthonormal, so dot products are unchanged;
    it spreads outliers across dims before the fp8 cast (the official indexer's rotate_activation)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise InputError(f"Hadamard rotation needs a power-of-two dim, got {d}")
    h = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ (h * d**-0.5)


def fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Round x [..., D] to e4m3 with one power-of-two scale per 128 values (``formats.quantize_groups``);
    returns the dequantised fp32 values (what an fp8 dot with per-group scales computes, up to
    accumulation order)."""
    values, scale = quantize_groups(x)
    return (values.float().unflatten(-1, (-1, FP8_GROUP)) * scale[..., None]).flatten(-2)


class MLAAttention(nn.Module):
    """Multi-head latent attention with q-LoRA and kv-LoRA, computed in the absorbed form.

    ``project`` gives the absorbed query [T, H, kv_lora_rank + rope] and the latent cache entry
    (normalised latent [T, kv_lora_rank], roped k_rope [T, rope]); ``output`` maps the attention
    output over the latent [T, H, kv_lora_rank] back to the hidden size. MLA rope is interleaved on the
    last ``qk_rope_head_dim`` dims of each head.
    """

    def __init__(self, cfg: ModelConfig, indexer_precision: str = "exact"):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, self.n_heads * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = _linear(self.n_heads * self.v_dim, cfg.hidden_size)
        self.indexer = LightningIndexer(cfg, indexer_precision) if cfg.is_v32 else None

    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> (q_absorbed [T, H, 576], latent [T, 512], k_rope [T, 64], qr [T, q_lora_rank])."""
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rope = self.q_b_proj(qr).view(-1, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        q_rope = apply_rope_interleaved(q_rope, cos[:, None], sin[:, None])
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        latent = self.kv_a_layernorm(latent)
        k_rope = apply_rope_interleaved(k_rope, cos, sin)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, self._kv_b()[:, : self.nope])
        return torch.cat([q_latent, q_rope], dim=-1), latent, k_rope, qr

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """o_latent [T, H, kv_lora_rank] -> [T, hidden]."""
        o = torch.einsum("thc,hvc->thv", o_latent.to(self.kv_b_proj.weight.dtype), self._kv_b()[:, self.nope :])
        return self.o_proj(o.flatten(1))

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int],
                cache: LayerCache | None = None, slots: torch.Tensor | None = None,
                topk_override: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal sparse attention over packed prompts.

        x [N, hidden] (the normed layer input) holds ``len(seq_lens)`` prompts back to back, N =
        sum(seq_lens); cos/sin [N, rope/2] at each token's position within its prompt. With ``cache``,
        the tokens' latents go to ``slots`` [N] of the fp8 cache and their indexer keys likewise.
        topk_override [N, k] (positions within each prompt, −1 = none) replaces the indexer's choice.
        Returns (out [N, hidden], topk [N, k] int32 positions within each prompt, −1 padded).
        """
        q_abs, latent, k_rope, qr = self.project(x, cos, sin)
        if cache is not None:
            write_kv_fp8(cache.kv, latent, k_rope.to(torch.bfloat16), slots)
        if self.indexer is not None:
            index_keys = self.indexer.keys(x, cos, sin)
            index_q, index_w = self.indexer.queries(x, qr, cos, sin)
            if cache is not None:
                cache.index_keys[slots] = index_keys
        topk, start = [], 0
        for n in seq_lens:
            rows = slice(start, start + n)
            if topk_override is not None:
                topk.append(topk_override[rows].to(torch.int32))
            elif self.indexer is not None:
                topk.append(self.indexer.prefill_topk(index_q[rows], index_w[rows], index_keys[rows]))
            else:  # V3: dense causal attention is top-k over every earlier position
                pos = torch.arange(n, device=x.device, dtype=torch.int32)
                topk.append(torch.where(pos[None, :] <= pos[:, None], pos, -1))
            start += n
        width = max(t.shape[-1] for t in topk)
        topk = torch.cat([F.pad(t, (0, width - t.shape[-1]), value=-1) for t in topk])
        # The kernel indexes the packed kv rows: shift each prompt's positions by its start.
        starts = torch.repeat_interleave(
            torch.tensor([0, *seq_lens[:-1]], device=x.device).cumsum(0), torch.tensor(seq_lens, device=x.device))
        rows = torch.where(topk >= 0, topk + starts[:, None].to(torch.int32), -1)
        kv = torch.cat([latent, k_rope], dim=-1)[:, None].to(torch.bfloat16)
        o_latent, _, _ = sparse_mla_prefill(q_abs.to(torch.bfloat16), kv, rows[:, None], self.softmax_scale,
                                            d_v=self.kv_lora_rank)
        return self.output(o_latent), topk

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               cache: LayerCache, block_table: torch.Tensor, slots: torch.Tensor, block_size: int,
               topk_override: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per sequence over the fp8 paged cache.

        x [b, hidden] (normed), cos/sin [b, rope/2] at ``positions`` [b]; the new tokens are written
        to ``slots`` [b] first, so each attends to itself. block_table [b, max_blocks] int32.
        topk_override [b, k] (positions, −1 = none) replaces the indexer's choice. Returns out [b, hidden].
        The indexer scores every position the block table can hold (masked past ``positions``): shapes
        stay static and nothing waits on the GPU, so a whole decode step can be captured in a CUDA graph.
        """
        q_abs, latent, k_rope, qr = self.project(x, cos, sin)
        write_kv_fp8(cache.kv, latent, k_rope.to(torch.bfloat16), slots)
        b = x.shape[0]
        pos = torch.arange(block_table.shape[1] * block_size, device=x.device)
        if self.indexer is not None:
            cache.index_keys[slots] = self.indexer.keys(x, cos, sin)
        if topk_override is not None:
            topk = topk_override.to(torch.int32)[:, None]
        elif self.indexer is not None:
            index_q, index_w = self.indexer.queries(x, qr, cos, sin)
            key_slots = block_table[:, pos // block_size].long() * block_size + pos % block_size
            scores = self.indexer.scores(index_q[:, None], index_w[:, None], cache.index_keys[key_slots])
            topk = self.indexer.select(scores, (pos <= positions[:, None])[:, None])
        else:
            topk = torch.where(pos <= positions[:, None], pos, -1).to(torch.int32)[:, None]
        o_latent, _ = mla_decode_fp8(q_abs[:, None].to(torch.bfloat16), cache.kv, block_table, topk,
                                     self.softmax_scale, d_v=self.kv_lora_rank)
        return self.output(o_latent.view(b, self.n_heads, self.kv_lora_rank))


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(·)). The attention call itself lives in the engine, which
    owns the caches; see ``minirt.engine``."""

    def __init__(self, cfg: ModelConfig, indexer_precision: str = "exact"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, indexer_precision)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg)
