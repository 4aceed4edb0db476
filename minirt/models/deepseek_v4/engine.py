"""The DeepSeek-V4 kernel runtime: :class:`EngineV4`, what ``minirt.load`` returns for a V4 checkpoint.

It shares :class:`minirt.runtime.KernelRuntime` with V3.2's engine (``decode``'s checks, its CUDA-graph
capture and replay, ``plan_chunks``) and brings V4's own caches (:class:`.cache.V4Cache`),
step context (:class:`.layers.V4Step`) and layers (:class:`.layers.V4Layer`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...backend import check_prompts
from ...context import KVStash, PrefillTrace, Segment
from ...runtime import KernelRuntime, check_prefill_chunk, plan_chunks
from ...errors import ConfigError, InputError, NumericalError
from ...parallel import SINGLE, TensorParallel, VocabParallelEmbedding, VocabParallelHead
from .cache import V4Cache
from .config import DeepseekV4Config, LayerKind
from ...kernels import mhc
from ...kernels.finite import all_finite
from ...kernels.rms_norm import rms_norm
from ...kernels.v4_step_indices import decode_step_indices
from .layers import V4Layer, V4Step
from .reference import rope_cos_sin

# Prompt tokens per prefill step by default. Larger than V3.2's 2048: the fp4 experts' prefill GEMMs decode
# an expert's weights once per tile of 128 of its tokens, so at 2048 tokens (48 a tile on average, top 6 of
# 256) a step pays a whole tile's decode for under half a tile of tokens; the indexer's score block is
# bounded by its own row blocks (.layers.SCORE_ROWS), not by the chunk.
PREFILL_CHUNK = 8192


class EngineV4(KernelRuntime):
    """Kernel runtime for the first ``len(layers)`` DeepSeek-V4 layers. ``prefill`` starts a batch of
    prompts (different lengths allowed) in steps of at most ``prefill_chunk`` tokens, ``decode`` appends
    one token per sequence; both return next-token logits [b, vocab] fp32.

    A prefill step attends the prefill's bf16 keys and compressed entries (kept for the whole prefill),
    and carries each compressor's partial window to the next step in its fp32 state, so any chunk size
    gives the same numbers. Decode reads the fp8 MODEL1 caches; on CUDA a step is captured once per batch
    size as a CUDA graph and replayed (``use_cuda_graph = False`` runs every step eagerly).

    ``tp`` (``minirt.parallel``): the layers hold this rank's heads and experts, the embedding and head its
    rows of the vocabulary (``top``'s ``embed.weight`` / ``head.weight`` [vocab / N, D]); inputs and
    logits are whole, the same on every rank."""

    backend = "triton"
    weights = "fp8"

    def __init__(self, cfg: DeepseekV4Config, layers: torch.nn.ModuleList, top: dict[str, torch.Tensor],
                 device: torch.device, prefill_chunk: int = PREFILL_CHUNK, tp: TensorParallel = SINGLE):
        self.cfg, self.layers, self.device, self.dtype, self.tp = cfg, layers, device, torch.bfloat16, tp
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        for module, name in ((self.embed, "embed.weight"), (self.head, "head.weight")):
            module.weight = torch.nn.Parameter(top[name].to(torch.bfloat16), requires_grad=False)
        self.norm = top["norm.weight"].float()
        self.hc_head = tuple(top[f"hc_head_{k}"].float() for k in ("fn", "base", "scale"))
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.num_layers = len(layers)
        self.use_cuda_graph = device.type == "cuda"
        self.cache: V4Cache | None = None
        self._sized_by_user = False

    def setup_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate the window, compressed and indexer caches and the compressor states for ``max_batch``
        sequences of up to ``max_seq_len`` tokens. Without this call, prefill sizes (and regrows) them."""
        self._allocate_cache(max_batch, max_seq_len)
        self._sized_by_user = True

    def _allocate_cache(self, max_batch: int, max_seq_len: int) -> None:
        self.cache = None  # free the old cache before the new one is allocated
        self.cache = V4Cache(self.cfg, self.num_layers, max_batch, max_seq_len, self.device)
        positions = torch.arange(max_seq_len, device=self.device)
        self._rope = {family: rope_cos_sin(self.cfg, kind, positions, torch.float32)
                      for family, kind in (("main", LayerKind.SWA), ("compress", LayerKind.CSA))}
        # What steps slice rather than compute: a decode step's rows (sequences 0 .. b−1), their first
        # compressed-cache row per kind and HCA's entry ids.
        rows = torch.arange(max_batch, device=self.device)
        self._decode_rows = {"seq": rows}
        for kind in {k for k in self.cfg.layer_kinds[: self.num_layers] if k != LayerKind.SWA}:
            per_seq = self.cache.entries_per_seq(kind)
            self._decode_rows[("first", kind)] = (rows * per_seq).to(torch.int32)
            if kind == LayerKind.HCA:
                self._decode_rows["hca_ids"] = torch.arange(max_batch * per_seq, dtype=torch.int32,
                                                            device=self.device).view(max_batch, per_seq)
        self._lens: list[int] = []
        self._graphs = {}

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Next-token logits [N, vocab] fp32 of residual states X [N, hc, D] (hc_head's collapse, then the norm
        to bf16, then the head)."""
        eps = self.cfg.rms_norm_eps
        y = mhc.hc_head(X.contiguous(), *self.hc_head, eps=eps, hc_eps=self.cfg.hc_eps)
        return self.head(rms_norm(y, self.norm, eps, out_dtype=torch.bfloat16, round_to_bf16=True)).float()

    def _run(self, step: V4Step) -> torch.Tensor:
        X = torch.empty(step.tokens.shape[0], self.cfg.hc_mult, self.cfg.hidden_size, device=self.device)
        X.copy_(self.embed(step.tokens)[:, None])  # the embedding in every stream, cast to fp32 in one copy
        for layer in self.layers:
            X = layer(X, step)
        return X

    def _step(self, tokens, positions, seq, window_slots, **prefill) -> V4Step:
        return V4Step(tokens, positions, seq, self._rope, self.cache, window_slots, **prefill)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False,
                trace: PrefillTrace | None = None, topk_override: Sequence[torch.Tensor | None] | None = None,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Run prompts (lists of token ids) through the model, filling the caches from position 0.

        Returns logits of each prompt's last token [b, vocab], or with ``all_logits`` of every token,
        packed prompt after prompt [sum(len), vocab]. ``trace`` records per layer the residual state
        after it and (CSA) the top-k entry ids. ``topk_override``: per layer None or [sum(len), k] entry ids
        (−1 = none) that replace the CSA indexer's choice (to compare numerics with identical top-k).
        ``progress(done, total)``: called with the prompt tokens run so far, before the first step and after each.
        """
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        lens = [len(p) for p in prompts]
        self._fit_cache(lens)
        self.cache.seq_lens.zero_()
        dev, W = self.device, self.cfg.sliding_window
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        stash = KVStash(lens, dev)
        kinds = self.cfg.layer_kinds[: self.num_layers]
        entry_stash = {k.ratio: KVStash([n // k.ratio + 1 for n in lens], dev) for k in kinds if k != LayerKind.SWA}
        for i, kind in enumerate(kinds):   # a layer's keys and entries adjacent: its attention reads them in place
            if kind != LayerKind.SWA:
                stash.allocate_before(entry_stash[kind.ratio], i, self.cfg.head_dim)
        logits, first = [], 0
        if progress is not None:
            progress(0, len(tokens))
        for plan in plan_chunks(lens, self.prefill_chunk):
            segments, offset = [], 0
            for seq, start, n in plan:
                segments.append(Segment(seq, start, n, offset))
                offset += n
            last = first + offset
            positions = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(dev)
            seq = torch.cat([torch.full((s.length,), s.seq) for s in segments]).to(dev)
            keep = torch.cat([torch.arange(s.start, s.end) >= s.end - W for s in segments]).to(dev)
            window_slots = torch.where(keep, seq * W + positions % W, -1)
            override = None if topk_override is None else [None if t is None else t[first:last] for t in topk_override]
            step = self._step(tokens[first:last], positions, seq, window_slots, segments=segments, stash=stash,
                              window_rows=torch.tensor(stash.base, device=dev)[seq] + positions,
                              entry_stash=entry_stash,
                              entry_base={m: torch.tensor(s.base, device=dev)[seq] for m, s in entry_stash.items()},
                              topk_override=override, trace=trace)
            X = self._run(step)
            if not all_logits:  # only the last token of each prompt that ends in this step
                X = X[[s.offset + s.length - 1 for s in segments if s.end == lens[s.seq]]]
            logits.append(self.logits(X))
            first = last
            if progress is not None:
                progress(last, len(tokens))
        logits = torch.cat(logits)
        self._check_finite(logits, "prefill", None)
        self.cache.seq_lens[: len(lens)] = torch.tensor(lens, device=dev)
        self._lens = lens
        return logits

    def _check_finite(self, logits: torch.Tensor, stage: str, rerun, finite: torch.Tensor | None = None) -> None:
        """NumericalError when ``logits`` hold a NaN or ±Inf (one reduction and one host read)."""
        if not bool(all_finite(logits) if finite is None else finite):
            raise NumericalError.in_logits(stage, None)

    def _decode_step(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor | None] | None = None,
                     expert_override=None) -> torch.Tensor:
        """The decode step proper: static shapes, no host sync (so it can be graph-captured).
        ``expert_override`` (V3.2's routing override) is not offered by V4's MoE layers."""
        if expert_override is not None:
            raise InputError("expert_override is not supported by the DeepSeek-V4 runtime")
        b, kinds = tokens.shape[0], set(self.cfg.layer_kinds[: self.num_layers])
        index = decode_step_indices(self.cache.seq_lens, b, self.cfg.sliding_window,  # seq_lens advanced too
                                    LayerKind.CSA.ratio if LayerKind.CSA in kinds else 0,
                                    LayerKind.HCA.ratio if LayerKind.HCA in kinds else 0)
        rows = {key: t[:b] for key, t in self._decode_rows.items()}
        shared = {"window": index["window"], **{key: t for key, t in rows.items() if isinstance(key, tuple)}}
        if "last_visible" in index:
            shared["last_visible"] = index["last_visible"]
        if "hca_ids" in rows:
            shared[("entries", LayerKind.HCA)] = (rows["hca_ids"], index["hca_lengths"])
        step = self._step(tokens, index["positions"], rows["seq"], index["window_slots"], topk_override=topk_override,
                          shared=shared)
        return self.logits(self._run(step))


def build_engine_v4(cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], num_layers: int, device: torch.device,
                    prefill_chunk: int = PREFILL_CHUNK, tp: TensorParallel = SINGLE) -> EngineV4:
    """An EngineV4 from a config and DeepSeek-named tensors on ``device`` as stored
    (``load_checkpoint(..., as_stored=True)``: fp8 / fp4 weights with their ``.scale`` entries); with
    ``tp``, this rank's parts of them (``load_checkpoint(..., as_stored=True, tp=tp)``)."""
    if cfg.quantization is None:
        raise ConfigError("the V4 kernel runtime runs fp8 checkpoints (fp8 linears, fp4 or fp8 experts); this one "
                          "stores no quantization_config: use backend='reference'")
    for key, need in (("head_dim", 512), ("qk_rope_head_dim", 64)):
        if getattr(cfg, key) != need:
            raise ConfigError(f"key '{key}' is {getattr(cfg, key)}: the MODEL1 cache and kernels need {key} = {need}; "
                              "backend='reference' runs any dims")
    missing = [n for n in ("embed.weight", "head.weight", "norm.weight") if n not in weights]
    if missing:
        raise InputError(f"weights lack '{missing[0]}'")
    layers = torch.nn.ModuleList()
    for i in range(num_layers):
        prefix = f"layers.{i}."
        layers.append(V4Layer({n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}, cfg, i, tp))
    return EngineV4(cfg, layers, weights, device, prefill_chunk, tp)

