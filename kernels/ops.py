"""The kernels as torch custom ops (``torch.ops.minirt.*``), so ``torch.compile`` traces through them
as single opaque nodes (no graph break, ``fullgraph=True`` works) and CUDA graphs capture them like any
ATen op. ``minirt.models.deepseek_v32.layers`` and ``minirt.models.deepseek_v32.cache`` call the kernels through these ops, so a whole
``DecoderLayer`` compiles.

Each op has the signature and semantics of the Python function it wraps (see that function's
docstring), less the keyword-only ``out``/``config`` arguments; a function without those is registered
as it is (:func:`_registered`). The registered fake implementation gives output shapes and dtypes without
running a kernel (nor the wrapper's checks, which need real data pointers).
The ops are forward only, like the kernels: autograd falls through them, so their outputs never require
grad and no gradient flows back through them.
"""
from typing import Optional

import torch

from minirt.formats import FP8_DTYPE, FP8_GROUP, quantized_like

from .decode_topk import decode_topk
from .fp8_gemm import fp8_gemm, quantize_act_fp8, swiglu_quantize_fp8
from .indexer_cache import paged_indexer_scores, write_index_keys
from .indexer_weights import indexer_weights
from .kv_cache_fp8 import write_kv_fp8
from .kv_cache_model1 import write_kv_model1
from .moe_experts import ExpertWeights, moe_experts
from .moe_routing import route_hash, route_topk
from .lightning_indexer import indexer_topk
from .mla_head_proj_fp8 import mla_query_absorb, mla_value_proj_fp8
from .rms_norm import add_rms_norm, rms_norm
from .rope import apply_rope
from .sparse_mla_decode import mla_decode_fp8, sparse_mla_decode_fp8
from .sparse_mla_prefill import sparse_mla_prefill
from .sparse_mla_prefill_two_sources import sparse_mla_prefill_two_sources


_LIBRARY = torch.library.Library("minirt", "FRAGMENT")


def _registered(fn, mutates_args=()):
    """``fn`` as the op ``torch.ops.minirt.<its name less a trailing _op>``, its schema from its annotations.

    fn is the op's kernel on every device (CompositeExplicitAutograd) and autograd falls through to it: the
    kernels return new tensors that need no grad. (torch.library.custom_op puts a Python autograd layer and
    an output aliasing check in front of fn: ~8 µs of host time a call, as much as a decode launch.)"""
    name = fn.__name__.removesuffix("_op")
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    _LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
    return getattr(torch.ops.minirt, name)


def _fake(op):
    """A decorator registering its function as op's fake implementation (shapes and dtypes, no kernel)."""
    return lambda fake: torch.library.register_fake(op.default, fake, lib=_LIBRARY)


def _writes_in_place(*args):
    return None


def write_kv_fp8_op(kv_cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slots: torch.Tensor,
                    norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0, cos: Optional[torch.Tensor] = None,
                    sin: Optional[torch.Tensor] = None) -> None:
    """``minirt.kernels.write_kv_fp8`` as a custom op (writes kv_cache in place): norm_weight given,
    ``norm=(norm_weight, norm_eps)``; cos and sin given, ``rope=(cos, sin)``."""
    write_kv_fp8(kv_cache, latent, k_rope, slots, norm=None if norm_weight is None else (norm_weight, norm_eps),
                 rope=None if cos is None and sin is None else (cos, sin))


write_kv_fp8_op = _registered(write_kv_fp8_op, ("kv_cache",))
write_kv_model1_op = _registered(write_kv_model1, ("kv_cache",))  # writes the MODEL1 cache in place
write_index_keys_op = _registered(write_index_keys, ("cache",))   # writes the fp8 index cache in place
for _op in (write_kv_fp8_op, write_kv_model1_op, write_index_keys_op):
    _fake(_op)(_writes_in_place)
indexer_topk_op = _registered(indexer_topk)  # [..., topk] int32
quantize_act_fp8_op = _registered(quantize_act_fp8)  # (x_fp8 [M, K], scales [M, K / 128])
swiglu_quantize_fp8_op = _registered(swiglu_quantize_fp8)  # the same, of silu(gate) * up


@_registered
def decode_topk_op(scores: torch.Tensor, topk: int, block_table: Optional[torch.Tensor] = None, block_size: int = 1,
                   num_blocks: int = 1) -> torch.Tensor:
    """``minirt.kernels.decode_topk`` as a custom op: [..., topk] int32; block_table given,
    ``pages=(block_table, block_size, num_blocks)`` (cache slots)."""
    return decode_topk(scores, topk, pages=None if block_table is None else (block_table, block_size, num_blocks))


@_fake(indexer_topk_op)
@_fake(decode_topk_op)
def _(scores, topk, block_table=None, block_size=1, num_blocks=1):
    return scores.new_empty(*scores.shape[:-1], topk, dtype=torch.int32)


@_fake(quantize_act_fp8_op)
@_fake(swiglu_quantize_fp8_op)
def _(x, up=None):
    return quantized_like(x)


@_registered
def sparse_mla_prefill_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                          attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_prefill`` as a custom op: (out, max_logits, lse)."""
    return sparse_mla_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


@_fake(sparse_mla_prefill_op)
def _(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    s_q, h_q, _ = q.shape
    stats = q.new_empty(s_q, h_q, dtype=torch.float32)
    return q.new_empty(s_q, h_q, d_v), stats, torch.empty_like(stats)


@_registered
def sparse_mla_decode_fp8_op(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                             topk_length: Optional[torch.Tensor] = None, extra_kv_cache: Optional[torch.Tensor] = None,
                             extra_indices: Optional[torch.Tensor] = None,
                             extra_topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_decode_fp8`` as a custom op (either cache layout): (out, lse)."""
    return sparse_mla_decode_fp8(q, kv_cache, indices, sm_scale, d_v, attn_sink, topk_length, extra_kv_cache,
                                 extra_indices, extra_topk_length)


@_fake(sparse_mla_decode_fp8_op)
def _(q, kv_cache, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, extra_kv_cache=None,
      extra_indices=None, extra_topk_length=None):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, d_v), q.new_empty(b, h_q, s_q, dtype=torch.float32)


@_registered
def mla_decode_fp8_op(q_absorbed: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      topk_positions: torch.Tensor, sm_scale: float, d_v: int = 512,
                      attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.mla_decode_fp8`` as a custom op: (out, lse)."""
    return mla_decode_fp8(q_absorbed, kv_cache, block_table, topk_positions, sm_scale, d_v, attn_sink, topk_length)


@_fake(mla_decode_fp8_op)
def _(q_absorbed, kv_cache, block_table, topk_positions, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    b, s_q, h_q, _ = q_absorbed.shape
    return q_absorbed.new_empty(b, s_q, h_q, d_v), q_absorbed.new_empty(b, h_q, s_q, dtype=torch.float32)


@_registered
def sparse_mla_prefill_two_sources_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                      extra_kv: torch.Tensor, extra_indices: torch.Tensor, sm_scale: float,
                                      d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                                      topk_length: Optional[torch.Tensor] = None,
                                      extra_topk_length: Optional[torch.Tensor] = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_prefill_two_sources`` as a custom op: (out, max_logits, lse)."""
    return sparse_mla_prefill_two_sources(q, kv, indices, extra_kv, extra_indices, sm_scale, d_v, attn_sink,
                                          topk_length, extra_topk_length)


@_fake(sparse_mla_prefill_two_sources_op)
def _(q, kv, indices, extra_kv, extra_indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
      extra_topk_length=None):
    s_q, h_q, _ = q.shape
    stats = q.new_empty(s_q, h_q, dtype=torch.float32)
    return q.new_empty(s_q, h_q, d_v), stats, torch.empty_like(stats)


@_registered
def route_topk_op(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, scoring: str, n_group: int = 1,
                  topk_group: int = 1, normalize: bool = True, scaling: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.route_topk`` as a custom op: (weights, expert_ids)."""
    return route_topk(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                      normalize=normalize, scaling=scaling)


@_fake(route_topk_op)
def _(logits, bias, top_k, scoring, n_group=1, topk_group=1, normalize=True, scaling=1.0):
    return (logits.new_empty(logits.shape[0], top_k),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.int32))


@_registered
def route_hash_op(logits: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor, scoring: str,
                  normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.route_hash`` as a custom op: (weights, expert_ids)."""
    return route_hash(logits, tid2eid, token_ids, scoring=scoring, normalize=normalize, scaling=scaling)


@_fake(route_hash_op)
def _(logits, tid2eid, token_ids, scoring, normalize=True, scaling=1.0):
    return (logits.new_empty(logits.shape[0], tid2eid.shape[1]),
            logits.new_empty(logits.shape[0], tid2eid.shape[1], dtype=torch.int32))


@_registered
def moe_experts_op(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor, format: str,
                   swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """``minirt.kernels.moe_experts`` as a custom op, the ExpertWeights passed as its format and four
    tensors."""
    experts = ExpertWeights(format, w13, w13_scales, w2, w2_scales)
    return moe_experts(x, expert_ids, weights, experts, swiglu_limit=swiglu_limit)


@_fake(moe_experts_op)
def _(x, expert_ids, weights, w13, w13_scales, w2, w2_scales, format, swiglu_limit=None):
    return x.new_empty(x.shape[0], w2.shape[1], dtype=torch.bfloat16)


@_registered
def paged_indexer_scores_op(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                            limit: torch.Tensor, n_keys: Optional[int] = None) -> torch.Tensor:
    """``minirt.kernels.paged_indexer_scores`` as a custom op: scores [b, t, n_keys] float32."""
    return paged_indexer_scores(q, weights, cache, block_table, limit, n_keys=n_keys)


@_fake(paged_indexer_scores_op)
def _(q, weights, cache, block_table, limit, n_keys=None):
    width = n_keys if n_keys is not None else block_table.shape[1] * cache.shape[1]  # pages × block_size
    return q.new_empty(q.shape[0], q.shape[1], width, dtype=torch.float32)


@_registered
def apply_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int, interleaved: bool,
                  out_dtype: Optional[torch.dtype] = None, norm_weight: Optional[torch.Tensor] = None,
                  norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 0.0,
                  rotation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``minirt.kernels.apply_rope`` as a custom op: x's shape, out_dtype (default x's); norm_weight and
    norm_bias given: ``layer_norm=(norm_weight, norm_bias, norm_eps)``; rotation as apply_rope's."""
    layer_norm = (norm_weight, norm_bias, norm_eps) if norm_weight is not None or norm_bias is not None else None
    return apply_rope(x, cos, sin, rope_dims, interleaved, out_dtype, layer_norm=layer_norm, rotation=rotation)


@_fake(apply_rope_op)
def _(x, cos, sin, rope_dims, interleaved, out_dtype=None, norm_weight=None, norm_bias=None, norm_eps=0.0,
      rotation=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@_registered
def apply_rope_fp8_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int, interleaved: bool,
                      rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.apply_rope`` with ``rotation`` and ``fp8_out`` as a custom op: (out float32 of x's
    shape, codes float8_e4m3fn of x's shape, scales [..., D / 128] float32)."""
    codes, scales = quantized_like(x)
    return apply_rope(x, cos, sin, rope_dims, interleaved, torch.float32, rotation=rotation,
                      fp8_out=(codes, scales)), codes, scales


@_fake(apply_rope_fp8_op)
def _(x, cos, sin, rope_dims, interleaved, rotation):
    return (x.new_empty(x.shape, dtype=torch.float32), *quantized_like(x))


def apply_rope_scatter_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int, interleaved: bool,
                          out: torch.Tensor, rows: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                          norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 0.0) -> None:
    """``minirt.kernels.apply_rope`` with ``scatter=(out, rows)`` as a custom op (writes out in place)."""
    layer_norm = (norm_weight, norm_bias, norm_eps) if norm_weight is not None or norm_bias is not None else None
    apply_rope(x, cos, sin, rope_dims, interleaved, layer_norm=layer_norm, scatter=(out, rows))


apply_rope_scatter_op = _registered(apply_rope_scatter_op, ("out",))
_fake(apply_rope_scatter_op)(_writes_in_place)


indexer_weights_op = _registered(indexer_weights)  # [T, H] float32


@_fake(indexer_weights_op)
def _(x, weight, scale):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@_registered
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``minirt.kernels.rms_norm`` as a custom op: [M, N] of x's dtype."""
    return rms_norm(x, weight, eps)


@_fake(rms_norm_op)
def _(x, weight, eps):
    return x.new_empty(x.shape)


@_registered
def rms_norm_fp8_op(x: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.rms_norm`` with ``fp8_out`` as a custom op: (y [M, N] of x's dtype, codes, scales)."""
    codes, scales = quantized_like(x)
    return rms_norm(x, weight, eps, fp8_out=(codes, scales)), codes, scales


@_registered
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.add_rms_norm`` as a custom op: (h, y), [M, N] of x's dtype."""
    return add_rms_norm(x, delta, weight, eps)


@_registered
def add_rms_norm_fp8_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.add_rms_norm`` with ``fp8_out`` as a custom op: (h, y, codes, scales)."""
    codes, scales = quantized_like(x)
    return *add_rms_norm(x, delta, weight, eps, fp8_out=(codes, scales)), codes, scales


@_fake(rms_norm_fp8_op)
def _(x, weight, eps):
    return x.new_empty(x.shape), *quantized_like(x)


@_fake(add_rms_norm_op)
def _(x, delta, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@_fake(add_rms_norm_fp8_op)
def _(x, delta, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), *quantized_like(x)


@_registered
def fp8_gemm_op(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``minirt.kernels.fp8_gemm`` as a custom op: a · b^T [M, N] of out_dtype."""
    return fp8_gemm(a, a_scales, b, b_scales, out_dtype)


@_fake(fp8_gemm_op)
def _(a, a_scales, b, b_scales, out_dtype=torch.bfloat16):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@_registered
def mla_query_absorb_op(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, kv_b_scale: torch.Tensor,
                        qk_nope_head_dim: int, v_head_dim: int, q_rope: Optional[torch.Tensor] = None,
                        cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``minirt.kernels.mla_query_absorb`` as a custom op: q_lat [T, H, C] (q_rope, cos and sin given:
    ``rope=(q_rope, cos, sin)``, [T, H, C + r])."""
    rope = (q_rope, cos, sin) if q_rope is not None or cos is not None or sin is not None else None
    return mla_query_absorb(q_nope, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, rope)


@_fake(mla_query_absorb_op)
def _(q_nope, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim, q_rope=None, cos=None, sin=None):
    width = kv_b_weight.shape[1] + (q_rope.shape[-1] if q_rope is not None else 0)
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], width)


@_registered
def mla_value_proj_fp8_op(o_lat: torch.Tensor, kv_b_weight: torch.Tensor, kv_b_scale: torch.Tensor,
                          qk_nope_head_dim: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.mla_value_proj_fp8`` as a custom op: (o_fp8 [T, H * v], scales [T, H * v / 128])."""
    return mla_value_proj_fp8(o_lat, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim)


@_fake(mla_value_proj_fp8_op)
def _(o_lat, kv_b_weight, kv_b_scale, qk_nope_head_dim, v_head_dim):
    width = o_lat.shape[1] * v_head_dim
    return o_lat.new_empty(o_lat.shape[0], width, dtype=FP8_DTYPE), \
        o_lat.new_empty(o_lat.shape[0], width // FP8_GROUP, dtype=torch.float32)
