"""The runtime: the first N dense layers of a DeepSeek-V3.2 checkpoint, an fp8 paged cache, prefill and
decode through the Triton kernels. ``minirt.load`` builds one; ``backend="reference"`` gives the eager
oracle behind the same ``prefill`` / ``decode`` calls."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .cache import PagedCache
from .config import ModelConfig
from .errors import ConfigError, InputError
from .layers import DecoderLayer, RMSNorm
from .reference import ReferenceModel
from .rope import rope_cos_sin


DECODE_HEADROOM = 256  # decode steps a cache allocated by prefill leaves room for


class Transformer(nn.Module):
    """Embedding → decoder layers → norm → lm_head; parameter names are the checkpoint's names."""

    def __init__(self, cfg: ModelConfig, num_layers: int, indexer_precision: str = "exact"):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, indexer_precision) for _ in range(num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


@dataclass
class PrefillTrace:
    """Per-layer intermediates of one prefill, for ``verify``: residual stream after each layer
    [N, hidden] and the top-k positions each layer attended [N, k]."""

    hidden_states: list[torch.Tensor] = field(default_factory=list)
    topk: list[torch.Tensor] = field(default_factory=list)


def check_tokens(tokens, vocab_size: int, what: str = "tokens") -> list[int]:
    """Token ids as Python ints, or InputError: integers only (an int tensor, or ints), in [0, vocab)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InputError(f"{what}: token ids must be integers, got a {tokens.dtype} tensor")
        tokens = tokens.reshape(-1).tolist()
    ids = list(tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InputError(f"{what}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise InputError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if len(prompts) == 0:
        raise InputError("no prompts given")
    out = [check_tokens(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    for i, p in enumerate(out):
        if not p:
            raise InputError(f"prompt {i} is empty")
    return out


class Engine:
    """Kernel runtime. ``prefill`` starts a batch of prompts (different lengths allowed), ``decode``
    appends one token to every sequence; both return next-token logits [b, vocab] fp32.

    On CUDA a decode step is captured once per batch size as a CUDA graph and replayed (one launch
    instead of dozens per layer); ``use_cuda_graph = False`` runs every step eagerly."""

    backend = "triton"

    def __init__(self, cfg: ModelConfig, model: Transformer, device: torch.device, dtype: torch.dtype):
        self.cfg, self.model, self.device, self.dtype = cfg, model, device, dtype
        self.num_layers = len(model.model.layers)
        self.use_cuda_graph = device.type == "cuda"
        self.cache: PagedCache | None = None

    def setup_cache(self, max_batch: int, max_seq_len: int, block_size: int = 64) -> None:
        """Allocate the fp8 latent cache and indexer key cache (capacity per sequence: max_seq_len)."""
        self.cache = PagedCache(self.cfg, self.num_layers, max_batch, max_seq_len, block_size, self.device)
        positions = torch.arange(self.cache.block_table.shape[1] * block_size, device=self.device)
        self._cos, self._sin = rope_cos_sin(self.cfg, positions, self.cfg.qk_rope_head_dim, dtype=torch.float32)
        self._lens: list[int] = []  # host copy of cache.seq_lens, so checks need no GPU sync
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h)).float()

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False,
                trace: PrefillTrace | None = None, topk_override: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Run prompts (lists of token ids) through the model, filling the cache from position 0.

        Returns logits of each prompt's last token [b, vocab], or with ``all_logits`` of every token,
        packed prompt after prompt [sum(len), vocab]. Without ``setup_cache`` first, allocates a cache
        for the prompts plus ``DECODE_HEADROOM`` decode steps. ``topk_override``: per layer
        [sum(len), k] positions that replace the indexer's choice (to compare numerics with identical
        top-k).
        """
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        lens = [len(p) for p in prompts]
        if self.cache is None:
            self.setup_cache(len(prompts), max(lens) + DECODE_HEADROOM)
        self.cache.check_room(lens)
        dev = self.device
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        batch_index = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        slots = self.cache.slots(batch_index, positions)
        cos, sin = self._cos[positions], self._sin[positions]
        h = self.model.model.embed_tokens(tokens)
        for i, (layer, layer_cache) in enumerate(zip(self.model.model.layers, self.cache.layers)):
            attn, topk = layer.self_attn.prefill(layer.input_layernorm(h), cos, sin, lens, layer_cache, slots,
                                                 None if topk_override is None else topk_override[i])
            h = h + attn
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if trace is not None:
                trace.hidden_states.append(h.float())
                trace.topk.append(topk)
        self.cache.seq_lens.zero_()
        self.cache.seq_lens[: len(lens)] = torch.tensor(lens, device=dev)
        self._lens = lens
        if not all_logits:
            h = h[torch.tensor(lens, device=dev).cumsum(0) - 1]
        return self._logits(h)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Append tokens [b] (one per sequence of the last prefill) and return logits [b, vocab].
        ``topk_override``: per layer [b, k] positions that replace the indexer's choice (eager)."""
        ids = check_tokens(tokens, self.cfg.vocab_size, "decode")
        b = len(self._lens) if self.cache is not None else 0
        if b == 0 or len(ids) != b:
            raise InputError(f"decode needs one token per prefilled sequence ({b}), got {len(ids)}")
        tokens = torch.tensor(ids, device=self.device)
        lens = [n + 1 for n in self._lens]
        self.cache.check_room(lens)
        self._lens = lens
        if topk_override is not None or not self.use_cuda_graph:
            return self._decode_step(tokens, topk_override)
        return self._decode_graphed(tokens)

    def _decode_step(self, tokens: torch.Tensor, topk_override: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The decode step proper: static shapes, no host sync (so it can be graph-captured)."""
        b = tokens.shape[0]
        positions = self.cache.seq_lens[:b].clone()
        slots = self.cache.slots(torch.arange(b, device=self.device), positions)
        block_table = self.cache.block_table[:b]
        cos, sin = self._cos[positions], self._sin[positions]
        h = self.model.model.embed_tokens(tokens)
        for i, (layer, layer_cache) in enumerate(zip(self.model.model.layers, self.cache.layers)):
            h = h + layer.self_attn.decode(layer.input_layernorm(h), cos, sin, positions, layer_cache, block_table,
                                           slots, self.cache.block_size,
                                           None if topk_override is None else topk_override[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.cache.seq_lens[:b] += 1
        return self._logits(h)

    def _decode_graphed(self, tokens: torch.Tensor) -> torch.Tensor:
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
            self._graphs[b] = (graph, static_tokens, static_logits)
            return logits
        graph, static_tokens, static_logits = self._graphs[b]
        static_tokens.copy_(tokens)
        graph.replay()
        return static_logits.clone()

    @torch.inference_mode()
    def attention_with_topk(self, layer_index: int, layer_input: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """One layer's attention output [T, hidden] for one sequence's residual input [T, hidden],
        attending exactly the given top-k positions [T, k] (for comparisons with identical top-k)."""
        layer = self.model.model.layers[layer_index]
        x = layer.input_layernorm(layer_input.to(self.device, self.dtype))
        cos, sin = rope_cos_sin(self.cfg, torch.arange(x.shape[0], device=self.device), self.cfg.qk_rope_head_dim)
        out, _ = layer.self_attn.prefill(x, cos, sin, [x.shape[0]], topk_override=topk.to(self.device))
        return out.float()


class ReferenceEngine:
    """The eager oracle behind the Engine's calls: every step recomputes whole sequences densely."""

    backend = "reference"

    def __init__(self, reference: ReferenceModel):
        self.reference, self.cfg = reference, reference.cfg
        self.sequences: list[list[int]] = []

    def setup_cache(self, max_batch: int, max_seq_len: int, block_size: int = 64) -> None:
        """No cache: kept so callers can treat both backends alike."""

    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False, trace=None) -> torch.Tensor:
        self.sequences = check_prompts(prompts, self.cfg.vocab_size)
        outs = [self.reference.forward(torch.tensor(p)).logits.float() for p in self.sequences]
        return torch.cat(outs) if all_logits else torch.stack([o[-1] for o in outs])

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = check_tokens(tokens, self.cfg.vocab_size, "decode")
        if not self.sequences or len(tokens) != len(self.sequences):
            raise InputError(f"decode needs one token per prefilled sequence ({len(self.sequences)}), got {len(tokens)}")
        for seq, t in zip(self.sequences, tokens):
            seq.append(t)
        return torch.stack([self.reference.forward(torch.tensor(s)).logits[-1].float() for s in self.sequences])


def build_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], num_layers: int, device: torch.device,
                 dtype: torch.dtype, indexer_precision: str = "exact") -> Engine:
    """An Engine from a config and HF-named weights (dequantised) already on ``device``."""
    for key, need in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64)):
        if getattr(cfg, key) != need:
            raise ConfigError(f"key '{key}' is {getattr(cfg, key)}: the Triton kernels and the fp8 cache layout "
                              f"need {key} = {need} (d_qk 576); backend='reference' runs any dims")
    with torch.device("meta"):
        model = Transformer(cfg, num_layers, indexer_precision)
    wanted = model.state_dict().keys()
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise InputError(f"weights lack {len(missing)} tensors, e.g. '{missing[0]}'")
    model.load_state_dict({k: weights[k].to(device, dtype) for k in wanted}, assign=True)
    return Engine(cfg, model.eval(), device, dtype)

