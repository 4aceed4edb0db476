"""The public kernels as torch custom ops (``torch.ops.minirt.*``), so ``torch.compile`` traces through
them as single opaque nodes (no graph break) and CUDA graphs capture them like any ATen op.

Each op has the signature and semantics of the Python function it wraps (see that function's
docstring); the registered fake implementation gives output shapes and dtypes without running a kernel.
"""
from typing import Optional

import torch

from .kv_cache_fp8 import write_kv_fp8
from .kv_cache_model1 import write_kv_model1
from .moe_experts import ExpertWeights, moe_experts
from .moe_routing import route_hash, route_topk
from .sparse_mla_decode import sparse_mla_decode_fp8
from .sparse_mla_prefill import sparse_mla_prefill
from .sparse_mla_prefill_two_sources import sparse_mla_prefill_two_sources


@torch.library.custom_op("minirt::sparse_mla_prefill", mutates_args=())
def sparse_mla_prefill_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                          attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_prefill`` as a custom op: (out, max_logits, lse)."""
    return sparse_mla_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


@sparse_mla_prefill_op.register_fake
def _(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    s_q, h_q, _ = q.shape
    stats = q.new_empty(s_q, h_q, dtype=torch.float32)
    return q.new_empty(s_q, h_q, d_v), stats, torch.empty_like(stats)


@torch.library.custom_op("minirt::sparse_mla_decode_fp8", mutates_args=())
def sparse_mla_decode_fp8_op(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                             topk_length: Optional[torch.Tensor] = None, extra_kv_cache: Optional[torch.Tensor] = None,
                             extra_indices: Optional[torch.Tensor] = None,
                             extra_topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_decode_fp8`` as a custom op (either cache layout): (out, lse)."""
    return sparse_mla_decode_fp8(q, kv_cache, indices, sm_scale, d_v, attn_sink, topk_length, extra_kv_cache,
                                 extra_indices, extra_topk_length)


@sparse_mla_decode_fp8_op.register_fake
def _(q, kv_cache, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, extra_kv_cache=None,
      extra_indices=None, extra_topk_length=None):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, d_v), q.new_empty(b, h_q, s_q, dtype=torch.float32)


@torch.library.custom_op("minirt::write_kv_fp8", mutates_args=("kv_cache",))
def write_kv_fp8_op(kv_cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slots: torch.Tensor) -> None:
    """``minirt.kernels.write_kv_fp8`` as a custom op (writes kv_cache in place)."""
    write_kv_fp8(kv_cache, latent, k_rope, slots)


@write_kv_fp8_op.register_fake
def _(kv_cache, latent, k_rope, slots):
    return None


@torch.library.custom_op("minirt::write_kv_model1", mutates_args=("kv_cache",))
def write_kv_model1_op(kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """``minirt.kernels.write_kv_model1`` as a custom op (writes the MODEL1 cache in place)."""
    write_kv_model1(kv_cache, kv, slots)


@write_kv_model1_op.register_fake
def _(kv_cache, kv, slots):
    return None


@torch.library.custom_op("minirt::sparse_mla_prefill_two_sources", mutates_args=())
def sparse_mla_prefill_two_sources_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                      extra_kv: torch.Tensor, extra_indices: torch.Tensor, sm_scale: float,
                                      d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                                      topk_length: Optional[torch.Tensor] = None,
                                      extra_topk_length: Optional[torch.Tensor] = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``minirt.kernels.sparse_mla_prefill_two_sources`` as a custom op: (out, max_logits, lse)."""
    return sparse_mla_prefill_two_sources(q, kv, indices, extra_kv, extra_indices, sm_scale, d_v, attn_sink,
                                          topk_length, extra_topk_length)


@sparse_mla_prefill_two_sources_op.register_fake
def _(q, kv, indices, extra_kv, extra_indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
      extra_topk_length=None):
    s_q, h_q, _ = q.shape
    stats = q.new_empty(s_q, h_q, dtype=torch.float32)
    return q.new_empty(s_q, h_q, d_v), stats, torch.empty_like(stats)


@torch.library.custom_op("minirt::route_topk", mutates_args=())
def route_topk_op(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, scoring: str, n_group: int = 1,
                  topk_group: int = 1, normalize: bool = True, scaling: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.route_topk`` as a custom op: (weights, expert_ids)."""
    return route_topk(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                      normalize=normalize, scaling=scaling)


@route_topk_op.register_fake
def _(logits, bias, top_k, scoring, n_group=1, topk_group=1, normalize=True, scaling=1.0):
    return (logits.new_empty(logits.shape[0], top_k),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.int32))


@torch.library.custom_op("minirt::route_hash", mutates_args=())
def route_hash_op(logits: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor, scoring: str,
                  normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``minirt.kernels.route_hash`` as a custom op: (weights, expert_ids)."""
    return route_hash(logits, tid2eid, token_ids, scoring=scoring, normalize=normalize, scaling=scaling)


@route_hash_op.register_fake
def _(logits, tid2eid, token_ids, scoring, normalize=True, scaling=1.0):
    return (logits.new_empty(logits.shape[0], tid2eid.shape[1]),
            logits.new_empty(logits.shape[0], tid2eid.shape[1], dtype=torch.int32))


@torch.library.custom_op("minirt::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor, format: str,
                   swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """``minirt.kernels.moe_experts`` as a custom op, the ExpertWeights passed as its format and four
    tensors."""
    experts = ExpertWeights(format, w13, w13_scales, w2, w2_scales)
    return moe_experts(x, expert_ids, weights, experts, swiglu_limit=swiglu_limit)


@moe_experts_op.register_fake
def _(x, expert_ids, weights, w13, w13_scales, w2, w2_scales, format, swiglu_limit=None):
    return x.new_empty(x.shape[0], w2.shape[1], dtype=torch.bfloat16)
