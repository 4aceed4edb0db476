"""The DeepSeek-V3.2 kernel runtime: the first N layers (dense and MoE) of a checkpoint, an fp8 paged cache,
prefill in bounded chunks and decode through the Triton kernels (``decode``'s checks and CUDA graphs:
:class:`minirt.runtime.KernelRuntime`). ``minirt.load`` builds one."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...backend import check_prompts
from .cache import PagedCache
from .checkpoint import tensor_specs
from ...config import ModelConfig
from ...context import KVStash, PrefillTrace
from .context import decode_context, prefill_context
from ...errors import ConfigError, InputError, NumericalError
from ...formats import CACHE_BLOCK_SIZE, KV_LATENT_DIM, KV_ROPE_DIM
from ...kernels.finite import all_finite
from .layers import Transformer
from ...rope import rope_cos_sin
from ...runtime import KernelRuntime, check_prefill_chunk, plan_chunks
from ...parallel import SINGLE, TensorParallel

PREFILL_CHUNK = 2048  # prompt tokens per prefill step by default: bounds the [chunk, context] indexer scores


class Engine(KernelRuntime):
    """Kernel runtime. ``prefill`` starts a batch of prompts (different lengths allowed), ``decode``
    appends one token to every sequence; both return next-token logits [b, vocab] fp32.

    Prefill runs in steps of at most ``prefill_chunk`` tokens; each step's indexer scores the keys
    written so far and its attention reads the prompt's bf16 latents so far, so any chunk size gives
    the same numbers, and transient memory follows the chunk, not the prompt. On CUDA a decode step is
    captured once per batch size as a CUDA graph and replayed; ``use_cuda_graph = False`` runs every
    step eagerly. A step whose logits hold a NaN or ±Inf raises NumericalError naming the first module
    (embedding, layer i, final norm, lm_head) whose output was non-finite. ``tp``: the group the model
    is split over (``minirt.parallel``; world 1 when it is not)."""

    backend = "triton"

    def __init__(self, cfg: ModelConfig, model: Transformer, device: torch.device, dtype: torch.dtype,
                 indexer_precision: str = "exact", prefill_chunk: int = PREFILL_CHUNK,
                 tp: TensorParallel = SINGLE):
        self.cfg, self.model, self.device, self.dtype, self.tp = cfg, model, device, dtype, tp
        self.indexer_precision = indexer_precision
        self.weights = "fp8" if model.model.layers[0].self_attn.fp8_weights else "bf16"
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.num_layers = len(model.model.layers)
        self.use_cuda_graph = device.type == "cuda"
        self.cache: PagedCache | None = None
        self._sized_by_user = False

    def setup_cache(self, max_batch: int, max_seq_len: int, block_size: int = CACHE_BLOCK_SIZE) -> None:
        """Allocate the fp8 latent cache and indexer key cache (capacity per sequence: max_seq_len).
        Without this call, prefill sizes (and regrows) a cache itself. A cache of these sizes already
        there is kept, with the decode steps' CUDA graphs captured on it (a warm-up's survive)."""
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"setup_cache: {name} must be a whole number >= 1, got {value!r}")
        cache = self.cache
        if not (cache is not None and (cache.max_batch, cache.max_seq_len, cache.block_size) ==
                (max_batch, max_seq_len, block_size)):
            self._allocate_cache(max_batch, max_seq_len, block_size)
        else:  # no sequence in it any more
            cache.seq_lens.zero_()
            self._lens = []
        self._sized_by_user = True

    def _allocate_cache(self, max_batch: int, max_seq_len: int, block_size: int = CACHE_BLOCK_SIZE) -> None:
        self.cache = None  # free the old cache before the new one is allocated
        self.cache = PagedCache(self.cfg, self.num_layers, max_batch, max_seq_len, block_size, self.device,
                                self.indexer_precision)
        positions = torch.arange(self.cache.capacity, device=self.device)
        self._rope = rope_cos_sin(self.cfg, positions, self.cfg.qk_rope_head_dim, dtype=torch.float32)
        self._lens: list[int] = []  # host copy of cache.seq_lens, so checks need no GPU sync
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False,
                trace: PrefillTrace | None = None, topk_override: Sequence[torch.Tensor] | None = None,
                progress: Callable[[int, int], None] | None = None,
                expert_override: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """Run prompts (lists of token ids) through the model, filling the cache from position 0.

        Returns logits of each prompt's last token [b, vocab], or with ``all_logits`` of every token,
        packed prompt after prompt [sum(len), vocab]. Without ``setup_cache`` first, the engine sizes
        the cache for the prompts plus ``DECODE_HEADROOM`` decode steps (and regrows it for a later,
        longer prefill). ``topk_override``: per layer [sum(len), k] positions that replace the
        indexer's choice (to compare numerics with identical top-k). ``expert_override``: per layer None
        or (weights, expert ids) [sum(len), k] that replace a MoE layer's routing (likewise).
        ``progress(done, total)``, if given, is called with prompt tokens done and in all, before the
        first step and after each.
        """
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        lens = [len(p) for p in prompts]
        self._fit_cache(lens)
        tokens = torch.tensor([t for p in prompts for t in p], device=self.device)

        def run(trace: PrefillTrace | None, progress) -> torch.Tensor:
            stash = KVStash(lens, self.device)
            logits, first = [], 0
            if progress is not None:
                progress(0, len(tokens))
            for step in plan_chunks(lens, self.prefill_chunk):
                seqs, starts, counts = zip(*step)
                last = first + sum(counts)
                ctx = prefill_context(self.cfg, counts, starts=starts, seqs=seqs, cache=self.cache, stash=stash,
                                      rope=self._rope, trace=trace, device=self.device,
                                      topk_override=None if topk_override is None else
                                      [t[first:last] for t in topk_override],
                                      expert_override=None if expert_override is None else
                                      [None if r is None else (r[0][first:last], r[1][first:last])
                                       for r in expert_override])
                h = self.model(tokens[first:last], ctx)
                if not all_logits:  # only the last token of each prompt that ends in this step
                    ends = [s.offset + s.length - 1 for s in ctx.segments if s.end == lens[s.seq]]
                    h = h[ends]
                logits.append(self.model.logits(h))
                first = last
                if progress is not None:
                    progress(last, len(tokens))
            return torch.cat(logits)

        logits = run(trace, progress)
        self._check_finite(logits, "prefill", lambda: run(None, None))  # a rerun rewrites the same cache slots
        self.cache.seq_lens.zero_()
        self.cache.seq_lens[: len(lens)] = torch.tensor(lens, device=self.device)
        self._lens = lens
        return logits

    def _check_finite(self, logits: torch.Tensor, stage: str, rerun, finite: torch.Tensor | None = None) -> None:
        """NumericalError when ``logits`` hold a NaN or ±Inf. On the normal path this costs one reduction
        (``finite``, when the CUDA graph computed it already) and one host read, which the caller's
        sampling needs anyway; only on failure ``rerun()`` repeats the step with a check after every
        module, to name the first whose output was non-finite."""
        if bool(all_finite(logits) if finite is None else finite):
            return
        m = self.model
        modules = [("the embedding (model.embed_tokens)", m.model.embed_tokens)]
        modules += [(f"layer {i} (model.layers.{i})", layer) for i, layer in enumerate(m.model.layers)]
        modules += [("the final norm (model.norm)", m.model.norm), ("lm_head", m.lm_head)]
        flagged = set()

        def check(name: str):
            def hook(module, args, out):  # (a layer may return its residual and MLP output apart)
                if not all(bool(torch.isfinite(o).all()) for o in (out if isinstance(out, tuple) else (out,))):
                    flagged.add(name)
            return hook

        hooks = [module.register_forward_hook(check(name)) for name, module in modules]
        try:
            rerun()
        finally:
            for h in hooks:
                h.remove()
        raise NumericalError.in_logits(stage, next((name for name, _ in modules if name in flagged), None))

    def _decode_step(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor] | None = None,
                     expert_override=None) -> torch.Tensor:
        """The decode step proper: static shapes, no host sync (so it can be graph-captured)."""
        ctx = decode_context(self.cfg, self.cache, tokens.shape[0], self._rope, topk_override, expert_override)
        h = self.model(tokens, ctx)
        self.cache.seq_lens[: tokens.shape[0]] += 1
        return self.model.logits(h)


def build_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], num_layers: int, device: torch.device,
                 dtype: torch.dtype, indexer_precision: str = "exact", prefill_chunk: int = PREFILL_CHUNK,
                 fp8_weights: bool = False, tp: TensorParallel = SINGLE) -> Engine:
    """An Engine from a config and HF-named weights already on ``device``: dequantised, or with
    ``fp8_weights`` the block-fp8 linear weights as stored with their ``_scale_inv`` partners
    (``load_checkpoint(..., fp8_as_stored=True)``). Parameters are cast to ``dtype`` but those the
    loader keeps float32 (``TensorSpec.fp32``: the indexer's k_norm and weights_proj, which run in
    fp32); fp8 weights and their scales stay as stored. ``tp``: the weights are this rank's shards
    (``load_checkpoint(..., tp=tp)``); every rank builds its engine and then calls ``prefill`` /
    ``decode`` with the same arguments (their collectives pair up), and every rank gets the same logits."""
    for key, need in (("kv_lora_rank", KV_LATENT_DIM), ("qk_rope_head_dim", KV_ROPE_DIM)):
        if getattr(cfg, key) != need:
            raise ConfigError(f"key '{key}' is {getattr(cfg, key)}: the Triton kernels and the fp8 cache layout "
                              f"need {key} = {need} (d_qk 576); backend='reference' runs any dims")
    if cfg.quantization is None and any(cfg.is_moe_layer(i) for i in range(num_layers)):
        raise ConfigError("the MoE kernels run block-fp8 experts, and this checkpoint stores its experts unquantised "
                          "(no quantization_config): backend='reference' runs it")
    with torch.device("meta"):
        model = Transformer(cfg, num_layers, indexer_precision, fp8_weights, tp)
    wanted = model.state_dict().keys()
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise InputError(f"weights lack {len(missing)} tensors, e.g. '{missing[0]}'")
    fp32 = {name for name, spec in tensor_specs(cfg, num_layers).items() if spec.fp32}
    cast = {name: dtype for name, _ in model.named_parameters() if name not in fp32}
    model.load_state_dict({k: weights[k].to(device, cast.get(k)) for k in wanted}, assign=True)
    model.fuse_projections()
    return Engine(cfg, model.eval(), device, dtype, indexer_precision, prefill_chunk, tp)
