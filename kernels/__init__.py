"""Triton (and Gluon, on Hopper) kernels of minirt, imported as ``minirt.kernels``.

- ``sparse_mla_prefill``: NaN-safe sparse MLA prefill, FlashMLA ``flash_mla_sparse_fwd`` semantics;
  ``sparse_mla_prefill_two_sources``: the same over two key sources in one softmax (DeepSeek-V4's
  window keys and compressed entries).
- ``quantize_kv_fp8`` / ``dequantize_kv_fp8`` / ``write_kv_fp8`` / ``new_kv_cache``: the fp8 paged
  latent cache in FlashMLA's 656-byte V32 layout (the writer can norm the latent and rope its key part
  in its launch).
  ``decode_positions``: a V3.2 decode step's positions, rope angles and cache slots in one launch.
- ``quantize_kv_model1`` / ``dequantize_kv_model1`` / ``write_kv_model1`` / ``new_model1_cache`` /
  ``model1_cache_from_entries`` / ``model1_cache_entries``: the fp8 paged K = V cache in FlashMLA's
  584-byte MODEL1 (DeepSeek-V4) layout.
- ``sparse_mla_decode_fp8`` and its wrapper ``mla_decode_fp8``: absorbed-MQA sparse decode over the
  V32 cache, dequantising in registers; over a MODEL1 cache (plus an optional extra one, V4's window
  and compressed entries in one softmax) the same function.
- ``lightning_indexer_scores`` / ``indexer_topk``: V3.2's indexer scores (exact mode) and a top-k
  with ties going to the lower key index, free of host syncs; ``decode_topk``: the same top-k for a
  few long rows (decode), each row split over many programs.
- ``paged_indexer_scores`` and the fp8 indexer key cache (``new_index_cache``, ``write_index_keys``,
  ``quantize_index_keys``, ``dequantize_index_cache``): the indexer over a paged key cache, for
  decode steps and prefill chunks, reading only the positions each row may see.
  ``indexer_weights``: its per-head weights (the fp32 ``weights_proj`` product) in one launch at decode
  sizes.
- ``quantize_act_fp8`` / ``fp8_gemm``: block-scaled fp8 linear layers on the checkpoint's e4m3 weights
  (``swiglu_quantize_fp8``: a dense MLP's SwiGLU quantised for its down projection in one launch);
  ``mla_query_absorb`` / ``mla_value_proj_fp8``: MLA's per-head kv_b products on the stored fp8
  weight, the absorption writing the whole absorbed query (its rope part rotated beside it), the value
  projection o_proj's fp8 input directly.
- ``rms_norm`` / ``apply_rope``: RMSNorm of every row, rope on the first dims of every head (either
  pair layout, optionally after each row's layer norm, then a rotation matrix and an fp8 quantisation,
  optionally scattering its rows into a cache), one launch each (the runtime layers' norms and rope;
  V4's norms rounded to bf16); ``add_rms_norm``: a residual add and the norm of its sum in one launch;
  either norm can also quantise its result for an fp8 GEMM.
- ``all_finite``: whether a tensor holds no NaN or ±inf, as a device tensor in one launch (the decode
  step's check of its logits).
- ``route_topk`` / ``route_hash`` (and ``check_tid2eid``): MoE routing (V3.2's grouped sigmoid top-k,
  V4's sqrt-softplus top-k and hash layers), one sync-free launch each, ties to the lower expert.
- ``moe_experts`` on ``ExpertWeights`` (``expert_weights_fp8`` / ``expert_weights_fp4`` stack a
  checkpoint's experts): the routed experts' weighted sum, grouped fp8 GEMMs (fp8 or fp4 weights)
  with the permutation by expert on the device and SwiGLU fused, or at decode sizes (moe_decode)
  FMA products per assignment streaming its expert's rows once; CUDA-graph capturable.
- ``norm_rope.norm_rope`` / ``compressor_decode.compressor_decode``: DeepSeek-V4's RMS norm + rope on
  the last dims by position (q, kv, entries, the output's inverse rope) and its compressor at decode
  (ring write, window pooling, norm and rope), one launch each.
- ``mhc.hc_pre`` / ``mhc.hc_post``: DeepSeek-V4's mHC mixing (weights, Sinkhorn, collapse; the new
  residual state), one fused launch each.
- ``torch.ops.minirt.{sparse_mla_prefill, sparse_mla_prefill_two_sources, sparse_mla_decode_fp8,
  write_kv_fp8, write_kv_model1, route_topk, route_hash, moe_experts}``: the same as torch custom ops,
  for torch.compile (see ``ops``).

On sm_90 GPUs the two attention functions dispatch to Gluon kernels (``sparse_mla_prefill_sm90``;
for the V32 cache ``sparse_mla_decode_sm90``: warp-specialised, a producer filling key blocks and two
consumers meeting at mbarriers; the decode producer dequantises the fp8 cache;
``sparse_mla_decode_sm90_few_heads`` for up to 32 heads: keys on the MMAs' M side, one consumer, two
producers; for the MODEL1 cache ``sparse_mla_decode_model1_sm90``: both of these over its format) with
the same semantics; everywhere else the portable Triton kernels run.

Without a GPU the kernels run under the Triton interpreter; it must be chosen before any kernel is
defined, hence it is chosen here, first (``interpreter``: also when triton was imported before minirt).
"""
from .interpreter import choose_interpreter_without_gpu

choose_interpreter_without_gpu()

from .kv_cache_fp8 import dequantize_kv_fp8, new_kv_cache, positions_to_slots, quantize_kv_fp8, write_kv_fp8  # noqa: E402
from .decode_positions import decode_positions  # noqa: E402
from .kv_cache_model1 import (dequantize_kv_model1, model1_cache_entries, model1_cache_from_entries,  # noqa: E402
                              new_model1_cache, quantize_kv_model1, write_kv_model1)
from .sparse_mla_prefill import sparse_mla_prefill  # noqa: E402
from .sparse_mla_prefill_two_sources import sparse_mla_prefill_two_sources  # noqa: E402
from .lightning_indexer import indexer_topk, lightning_indexer_scores  # noqa: E402
from .decode_topk import decode_topk  # noqa: E402
from .sparse_mla_decode import mla_decode_fp8, sparse_mla_decode_fp8  # noqa: E402
from .indexer_cache import (dequantize_index_cache, new_index_cache, paged_indexer_scores,  # noqa: E402
                            quantize_index_keys, write_index_keys)
from .indexer_weights import indexer_weights  # noqa: E402
from .fp8_gemm import fp8_gemm, quantize_act_fp8, swiglu_quantize_fp8  # noqa: E402
from .mla_head_proj_fp8 import mla_query_absorb, mla_value_proj_fp8  # noqa: E402
from .rms_norm import add_rms_norm, rms_norm  # noqa: E402
from .finite import all_finite  # noqa: E402
from .rope import apply_rope  # noqa: E402
from .moe_routing import check_tid2eid, route_hash, route_topk  # noqa: E402
from .moe_experts import ExpertWeights, expert_weights_fp4, expert_weights_fp8, moe_experts  # noqa: E402
from . import ops  # noqa: E402,F401  (registers torch.ops.minirt.*)
