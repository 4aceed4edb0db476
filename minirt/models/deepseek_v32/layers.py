"""Runtime building blocks as ``nn.Module``s, one per concept, named like the Hugging Face tensors.

A layer's ``state_dict`` keys are the checkpoint's names without ``model.layers.{i}.``, so another
project can build a layer from a ``ModelConfig`` and load it straight from a DeepSeek state dict::

    layer = DecoderLayer(cfg)
    layer.load_state_dict({k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items()
                           if k.startswith(f"model.layers.{i}.")})

Every module runs ``forward(x, ctx)`` with a :class:`minirt.models.deepseek_v32.context.StepContext` (positions, rope,
caches, the prefill's segments or a decode step's block table). The attention runs in the absorbed
(MQA) form over the 576-wide latent (512 normalised latent + 64 roped key), the form the sparse kernels
take: prefill through ``sparse_mla_prefill`` on the bf16 latents of the prompt so far, decode through
``mla_decode_fp8`` on the fp8 paged cache.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from .context import StepContext
from ...errors import InputError
from ...fp8_linear import Fp8Linear
# The kernels as torch custom ops (same signatures), so torch.compile(layer, fullgraph=True) traces a layer.
from ...kernels.ops import (add_rms_norm_fp8_op as add_rms_norm_fp8, add_rms_norm_op as add_rms_norm,
                          apply_rope_op as apply_rope, apply_rope_fp8_op as apply_rope_fp8,
                          apply_rope_scatter_op as apply_rope_scatter,
                          decode_topk_op as decode_topk, indexer_topk_op as indexer_topk,
                          indexer_weights_op as indexer_weights, mla_decode_fp8_op as mla_decode_fp8,
                          mla_query_absorb_op as mla_query_absorb, mla_value_proj_fp8_op as mla_value_proj_fp8,
                          paged_indexer_scores_op as paged_indexer_scores,
                          rms_norm_fp8_op as rms_norm_fp8, rms_norm_op as rms_norm,
                          sparse_mla_decode_fp8_op as sparse_mla_decode_fp8, sparse_mla_prefill_op as sparse_mla_prefill,
                          swiglu_quantize_fp8_op as swiglu_quantize_fp8,
                          write_index_keys_op as write_index_keys, write_kv_fp8_op as write_kv_fp8)
from ...blockfp8 import DEFAULT_BLOCK, block_scale_shape
from ...formats import FP8_DTYPE
from ...kernels import ExpertWeights, moe_experts, route_topk
from ...parallel import SINGLE, TensorParallel, VocabParallelEmbedding, VocabParallelHead, expert_parallel_moe


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · weight over the last dim, in fp32, rounded to x's dtype (one
    ``rms_norm`` launch: a row slice of a fused projection's output goes in as it is).

    ``quantized(x)`` also returns the result's fp8 quantisation for the next fp8 GEMM, and
    ``after_add(x, delta, fp8)`` norms the residual sum x + delta: one launch each (``add_rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def quantized(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [N, dim] -> (y [N, dim], (codes, scales)): y = forward(x) and its quantisation (what
        ``Fp8Linear`` would quantise y to, bit for bit), in one launch."""
        y, codes, scales = rms_norm_fp8(x, self.weight, self.eps)
        return y, (codes, scales)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor, fp8: bool = False):
        """x, delta [N, dim] -> (h, y, y_fp8): h = x + delta in x's dtype, y = forward(h), y_fp8 its
        quantisation (``quantized``) with ``fp8``, else None; one launch."""
        if fp8:
            h, y, codes, scales = add_rms_norm_fp8(x, delta.to(x.dtype), self.weight, self.eps)
            return h, y, (codes, scales)
        return *add_rms_norm(x, delta.to(x.dtype), self.weight, self.eps), None


def _linear(d_in: int, d_out: int, fp8: bool = False) -> nn.Module:
    """A bias-free projection: block-fp8 weights as stored (``Fp8Linear``) or a plain float ``nn.Linear``."""
    return Fp8Linear(d_in, d_out) if fp8 else nn.Linear(d_in, d_out, bias=False)


class FusedProjection(nn.Module):
    """Projections of one input run as one GEMM: forward(x [..., in]) -> a tuple of each part's output
    [..., out_i] (views of one [..., sum out_i] product), the same values the parts give one by one
    up to the GEMM's fp32 summation order (its split-K follows the fused width).

    parts: bias-free projections of one input width, all ``Fp8Linear`` (block-fp8: every part but the
    last a whole number of 128-row scale blocks, so the block scales stack by rows) or all
    ``nn.Linear`` of one dtype. Their weights are stacked by rows into this module's buffers, and each
    part's weight (and scales) become views of its rows: no second copy, and the parts' state-dict
    entries stay what they were (these buffers are not persistent). Raises InputError for parts that
    do not stack.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        fp8 = isinstance(parts[0], Fp8Linear)
        kinds = {(isinstance(p, Fp8Linear), p.weight.shape[1], p.weight.dtype, p.weight.device) for p in parts}
        if len(kinds) != 1 or not (fp8 or all(isinstance(p, nn.Linear) and p.bias is None for p in parts)):
            raise InputError("FusedProjection: the parts must be all Fp8Linear or all bias-free nn.Linear, of one input "
                             f"width, dtype and device; got {sorted(map(str, kinds))}")
        self.sizes = [p.weight.shape[0] for p in parts]
        if fp8 and any(n % DEFAULT_BLOCK[0] for n in self.sizes[:-1]):
            raise InputError(f"FusedProjection: block-fp8 parts of {self.sizes} rows: all but the last need a "
                             f"multiple of {DEFAULT_BLOCK[0]} (the scale blocks' rows)")
        self.proj = Fp8Linear(parts[0].weight.shape[1], sum(self.sizes), device="meta") if fp8 else None
        for name in ("weight", "weight_scale_inv") if fp8 else ("weight",):
            stacked = torch.cat([getattr(p, name) for p in parts])
            (self.proj if fp8 else self).register_buffer(name, stacked, persistent=False)
            rows = 0
            for p in parts:
                n = getattr(p, name).shape[0]
                view = stacked[rows : rows + n]
                setattr(p, name, view if name in p._buffers else nn.Parameter(view, requires_grad=False))
                rows += n

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x) if self.proj is not None else F.linear(x, self.weight)
        return y.split(self.sizes, dim=-1)


class LightningIndexer(nn.Module):
    """V3.2's lightning indexer: picks, for each query token, the ``index_topk`` keys MLA attends to.

    score[t, s] = Σ_h relu(q[t, h] · k[s]) · w[t, h], with w = weights_proj(x) · H^-0.5 · D^-0.5.
    Rope is half-split (non-interleaved) on the first ``qk_rope_head_dim`` dims; k_norm is a LayerNorm
    with bias. ``precision="exact"`` scores fp32 q and keys (what the reference computes);
    ``precision="fp8"`` follows the official path: Hadamard rotation, then e4m3 q (one power-of-two
    scale per head, folded into w) and keys (one per token, in the 132-byte key cache).
    """

    def __init__(self, cfg: ModelConfig, precision: str = "exact", fp8_weights: bool = False):
        super().__init__()
        if precision not in ("exact", "fp8"):
            raise InputError(f"indexer precision must be 'exact' or 'fp8', got {precision!r}")
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.index_topk = cfg.index_topk
        self.precision = precision
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fp8_weights)
        self.wk = _linear(cfg.hidden_size, self.head_dim, fp8_weights)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads)

    def write_keys(self, key_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k: torch.Tensor | None = None) -> None:
        """The keys of x [T, hidden] to ``slots`` [T] of the layer's key cache (``LayerCache.index_keys``):
        k_norm (in fp32), rope, then exact: fp32, written by the rope launch itself; fp8: the rotation and the
        cache's e4m3 quantisation (``write_index_keys``). Slots outside the cache are skipped. k: wk(x) when
        computed already (the attention's fused projection)."""
        k, norm = self.wk(x) if k is None else k, self.k_norm
        if self.precision == "exact":
            apply_rope_scatter(k, cos, sin, self.rope_dim, False, key_cache.view(-1, self.head_dim), slots,
                               norm.weight, norm.bias, norm.eps)
        else:  # the rotation in the rope launch
            write_index_keys(key_cache, apply_rope(k, cos, sin, self.rope_dim, False, torch.float32, norm.weight,
                                                   norm.bias, norm.eps, hadamard_matrix(self.head_dim, k.device)),
                             slots)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q: torch.Tensor | None = None):
        """x [T, hidden], qr [T, q_lora_rank] (q_a_layernorm output) -> q [T, H, D], w [T, H] fp32:
        fp32 q (exact), or e4m3 q with each head's scale folded into w (fp8). q: wq_b(qr) [T, H * D]
        when computed already (the attention's fused projection)."""
        q = (self.wq_b(qr) if q is None else q).view(-1, self.n_heads, self.head_dim)
        w = indexer_weights(x, self.weights_proj.weight, self.n_heads**-0.5 * self.head_dim**-0.5)
        if self.precision == "fp8":  # rope, rotation and quantisation in one launch
            _, q, q_scale = apply_rope_fp8(q, cos, sin, self.rope_dim, False, hadamard_matrix(self.head_dim, q.device))
            return q, w * q_scale.view(-1, self.n_heads)
        return apply_rope(q, cos, sin, self.rope_dim, False, torch.float32), w

    def select(self, q: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
               limit: torch.Tensor, n_keys: int | None = None, as_slots: bool = False) -> torch.Tensor:
        """Top-k key positions [b, t, index_topk] int32 (−1 padded) of queries q [b, t, H, D] with
        weights w [b, t, H] over the paged key cache: position s of sequence b is a candidate when
        s <= limit[b, t]; ties go to the earlier position (``paged_indexer_scores``,
        ``indexer_topk``). n_keys: the width scored (default the block table's capacity). One query
        per sequence (decode) selects through ``decode_topk`` (the same result, its long rows split
        over many programs); ``as_slots`` (decode only) gives the positions' cache slots instead, through
        the block table in the same launch (the latent cache shares the key cache's pages)."""
        scores = paged_indexer_scores(q, w, key_cache, block_table, limit, n_keys=n_keys)
        if q.shape[1] != 1:
            if as_slots:
                raise InputError("select(as_slots=True) takes one query per sequence (decode)")
            return indexer_topk(scores, self.index_topk)
        if as_slots:
            return decode_topk(scores, self.index_topk, block_table, key_cache.shape[1], key_cache.shape[0])
        return decode_topk(scores, self.index_topk)


@functools.lru_cache(maxsize=8)
def hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    """H_d / sqrt(d) float32 [d, d] (Sylvester's construction, d a power of two): x · it rotates rows x
    [..., d] orthonormally (dot products unchanged), spreading outliers across dims before the fp8 cast
    (the official indexer's rotate_activation; ``apply_rope(..., rotation=)`` applies it after the rope).
    Built once per (d, device): a decode step replays it from a CUDA graph instead of rebuilding it."""
    if d < 1 or d & (d - 1):
        raise InputError(f"Hadamard rotation needs a power-of-two dim, got {d}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * d**-0.5


class MLAAttention(nn.Module):
    """Multi-head latent attention with q-LoRA and kv-LoRA, computed in the absorbed form.

    ``project`` gives the absorbed query [T, H, kv_lora_rank + rope] and the latent cache entry
    (normalised latent [T, kv_lora_rank], roped k_rope [T, rope]); ``output`` maps the attention
    output over the latent [T, H, kv_lora_rank] back to the hidden size. MLA rope is interleaved on the
    last ``qk_rope_head_dim`` dims of each head. ``layer_index`` picks this layer's cache, stash and
    top-k override out of the step context. ``fp8_weights``: the projections keep the checkpoint's
    block-fp8 weights (``Fp8Linear``); kv_b's per-head products run on its stored fp8 weight and the
    value projection hands o_proj its fp8 input directly. ``tp``: this rank's H / N heads
    (``minirt.parallel``); o_proj's partial sums are all-reduced. ``fuse_projections()``, once the
    weights are loaded, runs the projections that share an input as one GEMM each.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int = 0, indexer_precision: str = "exact",
                 fp8_weights: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_index, self.fp8_weights, self.tp = layer_index, fp8_weights, tp
        self.n_heads = cfg.num_attention_heads // tp.world
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.sm_scale = cfg.sm_scale
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank, fp8_weights)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, self.n_heads * (self.nope + self.rope), fp8_weights)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope, fp8_weights)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), fp8_weights)
        self.o_proj = _linear(self.n_heads * self.v_dim, cfg.hidden_size, fp8_weights)
        self.indexer = LightningIndexer(cfg, indexer_precision, fp8_weights) if cfg.is_v32 else None
        self.fused_x = self.fused_qr = None

    def _x_projections(self) -> list[nn.Module]:
        """The projections of the layer input x, the one that is not 128-row blocks (kv_a: 576) last."""
        wk = [self.indexer.wk] if self.indexer is not None else []
        return [self.q_a_proj, *wk, self.kv_a_proj_with_mqa]

    def _qr_projections(self) -> list[nn.Module]:
        return [self.q_b_proj] + ([self.indexer.wq_b] if self.indexer is not None else [])

    def fuse_projections(self) -> None:
        """Run q_a, the indexer's wk and kv_a (all of x) as one GEMM, and q_b with the indexer's wq_b
        (both of qr) as another (``FusedProjection``: the weights become views of the stacked ones;
        the state dict is unchanged). Call once the weights are loaded, on their device."""
        self.fused_x, self.fused_qr = FusedProjection(self._x_projections()), FusedProjection(self._qr_projections())

    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [T, hidden] -> (q_absorbed [T, H, 576], latent [T, 512], k_rope [T, 64], qr [T, q_lora_rank],
        index_k, index_q): latent and k_rope as kv_a gives them (before kv_a_layernorm and rope: the cache
        writer applies both), the indexer's projections wk(x) [T, index_head_dim] and wq_b(qr)
        [T, index_n_heads * index_head_dim] as they come out of the GEMMs (None without an indexer).
        x_fp8: x's quantisation for the fp8 projections (``RMSNorm.quantized``), or None."""
        x_in = x if x_fp8 is None else x_fp8
        if self.fused_x is not None:
            q_a, *index_k, kv_a = self.fused_x(x_in)
        else:
            q_a, *index_k, kv_a = [p(x_in) for p in self._x_projections()]
        if self.fp8_weights:  # qr's norm writes the fp8 operand of its projections too
            qr, qr_in = self.q_a_layernorm.quantized(q_a)
        else:
            qr = qr_in = self.q_a_layernorm(q_a)
        if self.fused_qr is not None:
            q, *index_q = self.fused_qr(qr_in)
        else:
            q, *index_q = [p(qr_in) for p in self._qr_projections()]
        q_nope, q_rope = q.view(-1, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope], -1)
        if self.fp8_weights:  # the absorbed q_nope and the roped q_rope side by side, in one launch
            q_abs = mla_query_absorb(q_nope.to(torch.bfloat16), self.kv_b_proj.weight, self.kv_b_proj.weight_scale_inv,
                                     self.nope, self.v_dim, q_rope.to(torch.bfloat16), cos.float(), sin.float())
        else:
            q_latent = torch.einsum("thn,hnc->thc", q_nope, self._kv_b()[:, : self.nope])
            q_abs = torch.cat([q_latent, apply_rope(q_rope, cos, sin, self.rope, True)], dim=-1)
        return q_abs, latent, k_rope, qr, index_k[0] if index_k else None, index_q[0] if index_q else None

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """o_latent [T, H, kv_lora_rank] -> [T, hidden] (summed over the ranks' heads)."""
        if self.fp8_weights:
            out = self.o_proj(mla_value_proj_fp8(o_latent.to(torch.bfloat16), self.kv_b_proj.weight,
                                                 self.kv_b_proj.weight_scale_inv, self.nope, self.v_dim))
        else:
            o = torch.einsum("thc,hvc->thv", o_latent.to(self.kv_b_proj.weight.dtype), self._kv_b()[:, self.nope :])
            out = self.o_proj(o.flatten(1))
        return self.tp.all_reduce(out)

    def forward(self, x: torch.Tensor, ctx: StepContext, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """x [N, hidden] (the normed layer input) -> attention output [N, hidden]. x_fp8: x's
        quantisation for the fp8 projections (``RMSNorm.quantized``), or None (quantised here).

        The new tokens' latents go to ``ctx.slots`` of this layer's fp8 cache and their indexer keys to
        the key cache (when ``ctx.cache`` is set). Prefill: causal sparse attention of each segment's
        tokens over its sequence so far (bf16 latents of ``ctx.stash``). Decode: one token per
        sequence over the fp8 paged cache. The top-k positions come from ``ctx.topk_override`` for
        this layer when given, else from the indexer (V3.2) or every earlier position (V3).
        """
        q_abs, latent, k_rope, qr, index_k, index_q = self.project(x, ctx.cos, ctx.sin, x_fp8)
        cache = ctx.cache.layers[self.layer_index] if ctx.cache is not None else None
        if cache is not None:  # the latent's norm and k_rope's rope in the writer's launch
            write_kv_fp8(cache.kv, latent, k_rope, ctx.slots, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                         ctx.cos, ctx.sin)
            if self.indexer is not None:
                self.indexer.write_keys(cache.index_keys, ctx.slots, x, ctx.cos, ctx.sin, index_k)
        override = ctx.topk_override[self.layer_index] if ctx.topk_override is not None else None
        if ctx.is_prefill:
            o_latent = self._prefill(q_abs, latent, k_rope, x, qr, index_q, ctx, override)
        else:
            o_latent = self._decode(q_abs, x, qr, index_q, ctx, override)
        return self.output(o_latent)

    def _prefill(self, q_abs, latent, k_rope, x, qr, index_q, ctx: StepContext, override) -> torch.Tensor:
        stash = ctx.stash.layer(self.layer_index, self.kv_lora_rank + self.rope)
        k_rope = apply_rope(k_rope, ctx.cos, ctx.sin, self.rope, True)
        stash[ctx.stash_rows, 0] = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1).to(torch.bfloat16)
        if override is not None:
            topk = override.to(device=x.device, dtype=torch.int32)
        else:
            topk = self._prefill_topk(x, qr, index_q, ctx)
        if ctx.trace is not None:
            ctx.trace.record("topk", self.layer_index, topk)
        # The kernel indexes stash rows: shift each token's positions by its sequence's first row.
        first_row = (ctx.stash_rows - ctx.positions).to(torch.int32)
        rows = torch.where(topk >= 0, topk + first_row[:, None], -1)
        o_latent, _, _ = sparse_mla_prefill(q_abs.to(torch.bfloat16), stash, rows[:, None], self.sm_scale,
                                            d_v=self.kv_lora_rank)
        return o_latent

    def _prefill_topk(self, x, qr, index_q, ctx: StepContext) -> torch.Tensor:
        """Top-k positions [N, k] of a prefill step, segment by segment, −1 padded."""
        if self.indexer is None:  # V3: dense causal attention is top-k over every earlier position
            pos = torch.arange(max(s.end for s in ctx.segments), device=x.device, dtype=torch.int32)
            return torch.where(pos <= ctx.positions[:, None], pos, -1)
        if ctx.cache is None:
            raise InputError("the indexer scores the keys in the cache: build the context with a cache, "
                             "or give topk_override")
        index_q, index_w = self.indexer.queries(x, qr, ctx.cos, ctx.sin, index_q)
        keys = ctx.cache.layers[self.layer_index].index_keys
        topk = []
        for seg in ctx.segments:  # one sequence each: scored over its keys up to the segment's end
            rows = slice(seg.offset, seg.offset + seg.length)
            topk.append(self.indexer.select(index_q[None, rows], index_w[None, rows], keys,
                                            ctx.cache.block_table[seg.seq : seg.seq + 1],
                                            ctx.positions[None, rows], n_keys=seg.end)[0])
        return torch.cat(topk)

    def _decode(self, q_abs, x, qr, index_q, ctx: StepContext, override) -> torch.Tensor:
        """One query token per sequence of ``ctx.block_table``. The indexer reads each sequence's keys
        up to its position only, with static shapes (the block table's width) and no host sync, so a
        whole decode step can be captured in a CUDA graph."""
        b, cache = x.shape[0], ctx.cache.layers[self.layer_index]
        q = q_abs[:, None].to(torch.bfloat16)
        if self.indexer is not None and override is None:  # the indexer selects cache slots directly
            index_q, index_w = self.indexer.queries(x, qr, ctx.cos, ctx.sin, index_q)
            slots = self.indexer.select(index_q[:, None], index_w[:, None], cache.index_keys, ctx.block_table,
                                        ctx.positions[:, None], as_slots=True)
            o_latent, _ = sparse_mla_decode_fp8(q, cache.kv, slots, self.sm_scale, d_v=self.kv_lora_rank)
        else:  # positions: the override's, or (V3) every earlier one
            if override is not None:
                topk = override.to(torch.int32)[:, None]
            else:
                pos = torch.arange(ctx.block_table.shape[1] * ctx.cache.block_size, device=x.device)
                topk = torch.where(pos <= ctx.positions[:, None], pos, -1).to(torch.int32)[:, None]
            o_latent, _ = mla_decode_fp8(q, cache.kv, ctx.block_table, topk, self.sm_scale, d_v=self.kv_lora_rank)
        return o_latent.view(b, self.n_heads, self.kv_lora_rank)


class DenseMLP(nn.Module):
    """SwiGLU down(silu(gate(x)) · up(x)) of width ``intermediate_size`` (default the config's: a
    dense layer's MLP; a MoE layer's shared experts pass theirs). ``tp``: this rank's 1 / N of the
    width, the down projection's partial sums all-reduced. ``fuse_projections()``, once the weights are
    loaded, runs gate and up as one GEMM."""

    def __init__(self, cfg: ModelConfig, fp8_weights: bool = False, intermediate_size: int | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        width = (cfg.intermediate_size if intermediate_size is None else intermediate_size) // tp.world
        self.gate_proj = _linear(cfg.hidden_size, width, fp8_weights)
        self.up_proj = _linear(cfg.hidden_size, width, fp8_weights)
        self.down_proj = _linear(width, cfg.hidden_size, fp8_weights)
        self.fused_gate_up = None

    def fuse_projections(self) -> None:
        self.fused_gate_up = FusedProjection([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; x_fp8: x's quantisation for fp8 gate and up projections
        (``RMSNorm.quantized``), or None."""
        x_in = x if x_fp8 is None else x_fp8
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x_in)
        else:
            gate, up = self.gate_proj(x_in), self.up_proj(x_in)
        if isinstance(self.down_proj, Fp8Linear):   # silu(gate) · up quantised for it in one launch
            width = gate.shape[-1]
            pair = swiglu_quantize_fp8(gate.reshape(-1, width), up.reshape(-1, width))
            return self.tp.all_reduce(self.down_proj(pair).view(*gate.shape[:-1], -1))
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class TopkRouter(nn.Module):
    """DeepSeek-V3 / V3.2's router (``mlp.gate``): buffers ``weight`` [E, hidden] and
    ``e_score_correction_bias`` [E], float32 (the loader keeps them so).

    forward(x [T, hidden], any float dtype) -> (weights [T, k] fp32, expert ids [T, k] int32): the
    logits x · weightᵀ in fp32, then ``route_topk`` (sigmoid scores, the bias for the choice only,
    group-limited top-k with ties to the lower index, renormalised, scaled). Sync-free.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = cfg.moe
        self.register_buffer("weight", torch.zeros(self.moe.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.moe.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        return route_topk(F.linear(x.float(), self.weight.float()), self.e_score_correction_bias.float(),
                          top_k=moe.num_experts_per_tok, scoring=moe.scoring_func, n_group=moe.n_group,
                          topk_group=moe.topk_group, normalize=moe.norm_topk_prob, scaling=moe.routed_scaling_factor)


class StackedFp8Weight(nn.Module):
    """E block-fp8 weights stacked: buffers ``weight`` (float8_e4m3fn [E, out, in]) and
    ``weight_scale_inv`` (float32 [E, out / 128, in / 128]); zeros with unit scales until loaded."""

    def __init__(self, n_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(n_experts, out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale_inv",
                             torch.ones(n_experts, *block_scale_shape((out_features, in_features))))


class RoutedExperts(nn.Module):
    """E SwiGLU experts of width I in the MoE kernels' layout (``mlp.experts``, as the loader stacks
    them): ``gate_up_proj`` [E, 2I, hidden] (gate rows, then up rows) and ``down_proj`` [E, hidden, I].

    forward(x [T, hidden], expert_ids [T, k] int32, weights [T, k] fp32) -> [T, hidden] bf16:
    Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) (``moe_experts``; ``swiglu_limit`` clamps as V4 does).
    """

    def __init__(self, n_experts: int, hidden: int, width: int, swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = StackedFp8Weight(n_experts, 2 * width, hidden)
        self.down_proj = StackedFp8Weight(n_experts, hidden, width)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        experts = ExpertWeights("fp8", self.gate_up_proj.weight, self.gate_up_proj.weight_scale_inv,
                                self.down_proj.weight, self.down_proj.weight_scale_inv)
        return moe_experts(x.to(torch.bfloat16), expert_ids, weights, experts, swiglu_limit=self.swiglu_limit)


class MoE(nn.Module):
    """A mixture-of-experts FFN: out = Σ_k w_k · expert_k(x) + shared_experts(x).

    ``gate``: any module mapping x [T, hidden] to (weights [T, k] fp32, expert ids [T, k] int32), the
    V3 / V3.2 ``TopkRouter`` by default (``from_config``); another model family passes its own router
    and ``swiglu_limit``. ``shared_experts``: a module on every token, called as ``DenseMLP`` is
    (forward(x, x_fp8)), or None. forward(x [T, hidden], routing=None, x_fp8=None) -> [T, hidden] in
    x's dtype; ``routing`` = (weights, expert ids) replaces the gate's choice (to compare the experts'
    numerics on a reference's routing). No host sync (CUDA-graph capturable when the gate is). ``tp``
    (expert parallelism): ``experts`` holds this rank's ``n_experts / N`` of the ``n_experts`` routed
    experts; the tokens are dispatched and combined with ``all_to_all_single``
    (``minirt.parallel.expert_parallel_moe``), the shared experts replicated.
    """

    def __init__(self, gate: nn.Module, experts: RoutedExperts, shared_experts: nn.Module | None,
                 tp: TensorParallel = SINGLE, n_experts: int | None = None):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts
        self.tp, self.n_experts = tp, n_experts

    @classmethod
    def from_config(cls, cfg: ModelConfig, fp8_weights: bool = False, tp: TensorParallel = SINGLE) -> "MoE":
        """V3 / V3.2's MoE layer: the grouped top-k router, ``n_routed_experts`` fp8 experts (this rank's
        share of them under ``tp``) and ``n_shared_experts`` experts' worth of a dense SwiGLU (as fp8 or
        float linears, as ``fp8_weights``)."""
        moe = cfg.moe
        shared = DenseMLP(cfg, fp8_weights, moe.n_shared_experts * moe.moe_intermediate_size) \
            if moe.n_shared_experts else None
        return cls(TopkRouter(cfg), RoutedExperts(moe.n_routed_experts // tp.world, cfg.hidden_size,
                                                  moe.moe_intermediate_size), shared, tp, moe.n_routed_experts)

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x_fp8: x's quantisation for fp8 shared experts (``RMSNorm.quantized``), or None."""
        if self.tp.world > 1:
            return expert_parallel_moe(x, self.gate, self.experts, self.shared_experts, routing, self.n_experts,
                                       self.tp)
        weights, expert_ids = self.gate(x) if routing is None else routing
        out = self.experts(x, expert_ids.to(torch.int32), weights.float()).to(x.dtype)
        return out if self.shared_experts is None else out + self.shared_experts(x, x_fp8).to(x.dtype)


class DecoderLayer(nn.Module):
    """One decoder layer: x + attn(norm(x)), then + mlp(norm(·)), the MLP dense or, where
    ``cfg.is_moe_layer(layer_index)``, a ``MoE``. ``layer_index`` is its place in the model (which
    cache, stash and top-k override of the step context it uses); ``fp8_weights`` keeps the linear
    weights block-fp8 as the checkpoint stores them (routed experts always are). ``tp``: this rank's
    heads, MLP width or experts (``minirt.parallel``)."""

    def __init__(self, cfg: ModelConfig, layer_index: int = 0, indexer_precision: str = "exact",
                 fp8_weights: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_index, indexer_precision, fp8_weights, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE.from_config(cfg, fp8_weights, tp) if cfg.is_moe_layer(layer_index) \
            else DenseMLP(cfg, fp8_weights, tp=tp)

    def fuse_projections(self) -> None:
        """The attention's and the dense MLP's (a MoE layer's shared experts') projections that share
        an input as one GEMM each (``MLAAttention.fuse_projections``, ``DenseMLP.fuse_projections``),
        once the weights are loaded; the state dict is unchanged."""
        self.self_attn.fuse_projections()
        mlp = self.mlp.shared_experts if isinstance(self.mlp, MoE) else self.mlp
        if mlp is not None:
            mlp.fuse_projections()

    def forward(self, x: torch.Tensor, ctx: StepContext, delta: torch.Tensor | None = None, unsummed: bool = False):
        """x [N, hidden] float (the residual stream of a step's N tokens: a prefill step's segments back
        to back, or one token per sequence in a decode step) -> [N, hidden], x's dtype.

        delta: optional [N, hidden] of x's dtype, the previous layer's MLP output not yet added: the layer
        runs on x + delta, added in its input norm's launch (``RMSNorm.after_add``: bit for bit torch's add).
        unsummed: return (h, mlp_out), the residual after the attention and the MLP output, instead of their
        sum (``Transformer.forward`` hands mlp_out to the next layer as its delta: one launch a layer fewer).

        ctx: the step's ``StepContext`` (``minirt.models.deepseek_v32.context.prefill_context`` / ``decode_context``) with N
        positions. The layer writes the new tokens' latents and indexer keys to
        ``ctx.cache.layers[layer_index]`` and reads that cache (decode) or ``ctx.stash`` (prefill);
        ``ctx.topk_override[layer_index]``, when given, replaces the indexer's choice.

        Raises InputError when x is not [N, hidden] with N = ctx.positions' length, or when the context
        holds no cache or top-k override entry for ``layer_index``.
        """
        _check_layer_input(x, ctx, self.layer_index, self.input_layernorm.weight.shape[0])
        fp8 = self.self_attn.fp8_weights  # the norms write their fp8 GEMMs' operands too
        if delta is not None:
            x, normed, normed_fp8 = self.input_layernorm.after_add(x, delta, fp8)
        else:
            normed, normed_fp8 = self.input_layernorm.quantized(x) if fp8 else (self.input_layernorm(x), None)
        h, normed, normed_fp8 = self.post_attention_layernorm.after_add(x, self.self_attn(normed, ctx, normed_fp8), fp8)
        if isinstance(self.mlp, MoE):
            routing = ctx.expert_override[self.layer_index] if ctx.expert_override is not None else None
            mlp_out = self.mlp(normed, routing, normed_fp8)
        else:
            mlp_out = self.mlp(normed, normed_fp8)
        return (h, mlp_out) if unsummed else h + mlp_out


def _check_layer_input(x, ctx: StepContext, layer_index: int, hidden: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != hidden or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"layer input x must be a float tensor [N, {hidden}] (tokens, hidden), got {shape}")
    if x.shape[0] != ctx.positions.shape[0]:
        raise InputError(f"layer input x has {x.shape[0]} tokens, the step context {ctx.positions.shape[0]} positions")
    if ctx.cache is not None and layer_index >= len(ctx.cache.layers):
        raise InputError(f"layer_index {layer_index} has no cache: the context's cache holds {len(ctx.cache.layers)} "
                         f"layer(s) (build it with num_layers > {layer_index})")
    if ctx.topk_override is not None and layer_index >= len(ctx.topk_override):
        raise InputError(f"layer_index {layer_index} has no top-k override: topk_override holds "
                         f"{len(ctx.topk_override)} layer(s)")


class Transformer(nn.Module):
    """Embedding → decoder layers → norm → lm_head; parameter names are the checkpoint's names.
    ``tp``: every module holds this rank's shard (``minirt.parallel``); inputs and outputs are whole,
    the same on every rank."""

    def __init__(self, cfg: ModelConfig, num_layers: int, indexer_precision: str = "exact", fp8_weights: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp.world == 1 \
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i, indexer_precision, fp8_weights, tp)
                                          for i in range(num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if tp.world == 1 \
            else VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)

    def fuse_projections(self) -> None:
        """Every layer's ``DecoderLayer.fuse_projections`` (the engine calls it once the weights are loaded)."""
        for layer in self.model.layers:
            layer.fuse_projections()

    def forward(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """tokens [N] -> the last layer's residual stream [N, hidden]. Each layer's MLP output is added in
        the next layer's input norm (``DecoderLayer.forward``'s delta)."""
        h, delta = self.model.embed_tokens(tokens), None
        for layer in self.model.layers:
            h, delta = layer(h, ctx, delta, unsummed=True)
            if ctx.trace is not None:
                ctx.trace.record("hidden", layer.layer_index, (h + delta).float())
        return h if delta is None else h + delta

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Residual stream [N, hidden] -> next-token logits [N, vocab] fp32."""
        return self.lm_head(self.model.norm(h)).float()
