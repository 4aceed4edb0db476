"""The runtime: the first N layers (dense and MoE) of a DeepSeek-V3.2 checkpoint, an fp8 paged cache, prefill in
bounded chunks and decode through the Triton kernels. ``minirt.load`` builds one."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .backend import check_prompts, check_tokens
from .cache import PagedCache
from .config import ModelConfig
from .context import KVStash, PrefillTrace, decode_context, prefill_context
from .errors import ConfigError, InputError, NumericalError
from .formats import CACHE_BLOCK_SIZE, KV_LATENT_DIM, KV_ROPE_DIM
from .layers import Transformer
from .rope import rope_cos_sin

DECODE_HEADROOM = 256        # decode steps a cache the engine sizes itself leaves room for
DEFAULT_PREFILL_CHUNK = 2048  # prompt tokens per prefill step: bounds the [chunk, context] indexer scores


def check_prefill_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"prefill chunk must be a positive whole number of tokens, got {chunk!r}")
    return chunk


def plan_chunks(lengths: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """The prompts packed back to back, cut into steps of at most ``chunk`` tokens: per step its
    segments (sequence, first position, length), in token order."""
    steps, current, room = [], [], chunk
    for seq, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(room, n - start)
            current.append((seq, start, take))
            start, room = start + take, room - take
            if room == 0:
                steps.append(current)
                current, room = [], chunk
    if current:
        steps.append(current)
    return steps


class Engine:
    """Kernel runtime. ``prefill`` starts a batch of prompts (different lengths allowed), ``decode``
    appends one token to every sequence; both return next-token logits [b, vocab] fp32.

    Prefill runs in steps of at most ``prefill_chunk`` tokens; each step's indexer scores the keys
    written so far and its attention reads the prompt's bf16 latents so far, so any chunk size gives
    the same numbers, and transient memory follows the chunk, not the prompt. On CUDA a decode step is
    captured once per batch size as a CUDA graph and replayed; ``use_cuda_graph = False`` runs every
    step eagerly. A step whose logits hold a NaN or ±Inf raises NumericalError naming the first module
    (embedding, layer i, final norm, lm_head) whose output was non-finite."""

    backend = "triton"

    def __init__(self, cfg: ModelConfig, model: Transformer, device: torch.device, dtype: torch.dtype,
                 indexer_precision: str = "exact", prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.cfg, self.model, self.device, self.dtype = cfg, model, device, dtype
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
        if self.cache is None or not (self._sized_by_user or self.cache.has_room(lens)):
            self._allocate_cache(len(prompts), max(lens) + DECODE_HEADROOM)
        self.cache.check_room(lens)
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

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor] | None = None,
               expert_override: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """Append tokens [b] (one per sequence of the last prefill) and return logits [b, vocab].
        ``topk_override``: per layer [b, k] positions that replace the indexer's choice;
        ``expert_override``: per layer None or (weights, expert ids) [b, k] that replace a MoE layer's
        routing (both run the step eagerly)."""
        ids = check_tokens(tokens, self.cfg.vocab_size, "decode")
        b = len(self._lens) if self.cache is not None else 0
        if b == 0 or len(ids) != b:
            raise InputError(f"decode needs one token per prefilled sequence ({b}), got {len(ids)}")
        tokens = torch.tensor(ids, device=self.device)
        self._advance_lens()
        if topk_override is not None or expert_override is not None or not self.use_cuda_graph:
            logits, finite = self._decode_step(tokens, topk_override, expert_override), None
        else:
            logits, finite = self._decode_graphed(tokens)
            logits = logits.clone()  # the graph's output buffer: the next replay overwrites it

        def rerun() -> torch.Tensor:  # the same step again: it rewrites the slot it wrote
            self.cache.seq_lens[: tokens.shape[0]] -= 1
            return self._decode_step(tokens, topk_override, expert_override)

        self._check_finite(logits, "decode", rerun, finite)
        return logits

    @torch.inference_mode()
    def decode_queued(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode`` for a loop that keeps its tokens on the device (``minirt.generate``): the step is
        queued, not waited for. tokens: [b] int64 on the engine's device, ids the caller vouches for
        (sampled from this engine's logits: not read back to be checked). Returns (logits [b, vocab]
        fp32, finite: a 0-d bool tensor, whether every logit is finite), both still being computed.
        On CUDA the logits are the decode graph's output buffer: read them (queue the work that does)
        before the next decode call. The caller reads ``finite`` once the step is done and, when it is
        False, calls ``raise_non_finite``."""
        b = len(self._lens) if self.cache is not None else 0
        if not (isinstance(tokens, torch.Tensor) and tokens.shape == (b,) and b and tokens.dtype == torch.int64
                and tokens.device.type == self.device.type):
            got = f"{tokens.dtype} {tuple(tokens.shape)} on {tokens.device}" if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise InputError(f"decode_queued needs int64 tokens [{b}] (one per prefilled sequence) on "
                             f"{self.device}, got {got}")
        self._advance_lens()
        logits, finite = self._decode_graphed(tokens) if self.use_cuda_graph else (self._decode_step(tokens), None)
        return logits, torch.isfinite(logits).all() if finite is None else finite

    def raise_non_finite(self, tokens: torch.Tensor, later_steps: int = 0) -> None:
        """NumericalError for the decode step ``decode_queued(tokens)`` whose logits were not finite,
        naming the first module whose output is not (the step rerun eagerly, ``later_steps`` steps
        queued after it rolled back first)."""
        def rerun() -> torch.Tensor:
            self.cache.seq_lens[: tokens.shape[0]] -= later_steps + 1
            return self._decode_step(tokens)

        self._check_finite(None, "decode", rerun, torch.tensor(False))

    def _advance_lens(self) -> None:
        lens = [n + 1 for n in self._lens]
        self.cache.check_room(lens)
        self._lens = lens

    def _check_finite(self, logits: torch.Tensor, stage: str, rerun, finite: torch.Tensor | None = None) -> None:
        """NumericalError when ``logits`` hold a NaN or ±Inf. On the normal path this costs one reduction
        (``finite``, when the CUDA graph computed it already) and one host read, which the caller's
        sampling needs anyway; only on failure ``rerun()`` repeats the step with a check after every
        module, to name the first whose output was non-finite."""
        if bool(torch.isfinite(logits).all() if finite is None else finite):
            return
        m = self.model
        modules = [("the embedding (model.embed_tokens)", m.model.embed_tokens)]
        modules += [(f"layer {i} (model.layers.{i})", layer) for i, layer in enumerate(m.model.layers)]
        modules += [("the final norm (model.norm)", m.model.norm), ("lm_head", m.lm_head)]
        flagged = set()

        def check(name: str):
            def hook(module, args, out):
                if not bool(torch.isfinite(out).all()):
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

    def _decode_graphed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, whether all are finite: a bool tensor the graph computes, None on the capturing call).
        The logits are the graph's output buffer, rewritten by the next replay."""
        b = tokens.shape[0]
        if b not in self._graphs:
            # The first step runs eagerly on a side stream (it compiles the kernels and warms cuBLAS),
            # then the same step is captured; capturing executes nothing, so the cache is untouched.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._decode_step(tokens)
            torch.cuda.current_stream().wait_stream(side)
            graph, static_tokens = torch.cuda.CUDAGraph(), tokens.clone()
            with torch.cuda.graph(graph):
                static_logits = self._decode_step(static_tokens)
                static_finite = torch.isfinite(static_logits).all()
            self._graphs[b] = (graph, static_tokens, static_logits, static_finite)
            return logits, None
        graph, static_tokens, static_logits, static_finite = self._graphs[b]
        static_tokens.copy_(tokens)
        graph.replay()
        return static_logits, static_finite


def build_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], num_layers: int, device: torch.device,
                 dtype: torch.dtype, indexer_precision: str = "exact", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 fp8_weights: bool = False) -> Engine:
    """An Engine from a config and HF-named weights already on ``device``: dequantised, or with
    ``fp8_weights`` the block-fp8 linear weights as stored with their ``_scale_inv`` partners
    (``load_checkpoint(..., fp8_as_stored=True)``). Parameters are cast to ``dtype``; fp8 weights and
    their scales stay as stored."""
    for key, need in (("kv_lora_rank", KV_LATENT_DIM), ("qk_rope_head_dim", KV_ROPE_DIM)):
        if getattr(cfg, key) != need:
            raise ConfigError(f"key '{key}' is {getattr(cfg, key)}: the Triton kernels and the fp8 cache layout "
                              f"need {key} = {need} (d_qk 576); backend='reference' runs any dims")
    if cfg.quantization is None and any(cfg.is_moe_layer(i) for i in range(num_layers)):
        raise ConfigError("the MoE kernels run block-fp8 experts, and this checkpoint stores its experts unquantised "
                          "(no quantization_config): backend='reference' runs it")
    with torch.device("meta"):
        model = Transformer(cfg, num_layers, indexer_precision, fp8_weights)
    wanted = model.state_dict().keys()
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise InputError(f"weights lack {len(missing)} tensors, e.g. '{missing[0]}'")
    params = dict(model.named_parameters()).keys()
    model.load_state_dict({k: weights[k].to(device, dtype if k in params else None) for k in wanted}, assign=True)
    model.fuse_projections()
    return Engine(cfg, model.eval(), device, dtype, indexer_precision, prefill_chunk)
