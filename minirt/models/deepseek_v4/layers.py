"""DeepSeek-V4 layers in the kernels' form: what :class:`~.engine.EngineV4` runs per prefill chunk and
decode step (the maths is :mod:`.reference`'s; the numbers differ by the kernels' roundings only).

Per layer (:class:`V4Layer`), on the residual state X [N, hc, D] fp32:

* mHC pre / post (Sinkhorn), fused: one launch each (``minirt.kernels.mhc``), fp32; each sub-layer's input
  norm one ``rms_norm`` launch writing bf16 values in fp32 (and, for the attention, their fp8 operand);
* attention (:class:`Attention`): fp8 projections (``Fp8Linear`` on the stored e4m3 weights, the ue8m0
  scales as float32; those of one input stacked into one GEMM), q_a's norm one ``rms_norm`` launch (with
  wq_b's fp8 operand), each other norm and rope one ``norm_rope`` launch, kv written to the MODEL1 window
  cache; CSA / HCA: the :class:`Compressor` turns each completed window into a compressed entry inside the
  step (its fp32 partial-window state carried across chunks and steps; at decode one ``compressor_decode``
  launch), written to the MODEL1 compressed cache; CSA: the :class:`Indexer`'s keys (fp32, exact) and top-k
  by ``lightning_indexer_scores`` and ``indexer_topk`` (decode: ``decode_topk``). Prefill attends the
  prefill's bf16 keys and entries with ``sparse_mla_prefill(_two_sources)``; decode reads both fp8 caches
  with ``sparse_mla_decode_fp8`` (window + extra cache in one softmax, the sink in the denominator). Then
  the inverse rope and the grouped output projection.
* MoE (:class:`MoE`): ``route_hash`` / ``route_topk`` and ``moe_experts`` (fp4 routed experts; the shared
  expert as a one-expert fp8 ``moe_experts`` call, every token weight 1); ``hc_post`` adds the two outputs.

Over a tensor-parallel group (``tp``, :mod:`.parallel`) a layer holds its rank's heads and output groups
(``wo_b``'s partial sums all-reduced) and its routed experts (``expert_parallel_moe``).

A decode step has static shapes and no host synchronisation (CUDA-graph capturable); its index tensors
come with it (one ``decode_step_indices`` launch, per-cache tables); prefill steps plan their segments on
the host.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...context import KVStash, PrefillTrace, Segment
from ...errors import ConfigError
from ...formats import quantized_like
from ...fp8_linear import Fp8Linear
from ...kernels import (decode_topk, indexer_topk, lightning_indexer_scores, sparse_mla_decode_fp8, sparse_mla_prefill,
                        sparse_mla_prefill_two_sources, write_kv_model1)
from ...kernels import mhc
from ...kernels.compressor_decode import compressor_decode
from ...kernels.fp8_gemm import fp8_gemm, quantize_act_fp8
from ...kernels.moe_experts import ExpertWeights, expert_weights_fp4, expert_weights_fp8, moe_experts
from ...kernels.moe_routing import route_hash, route_topk
from ...kernels.norm_rope import norm_rope
from ...kernels.rms_norm import rms_norm
from ...kernels.v4_step_indices import offset_entry_ids
from ...parallel import SINGLE, TensorParallel, expert_parallel_moe
from .cache import CompressorState, LayerState, V4Cache
from .checkpoint import scale_name
from .config import DeepseekV4Config, LayerKind
from .parallel import expert_range


# Prefill tokens per block of indexer scores: bounds the [rows, context / 4] fp32 score block (2 GiB at
# V4's 1,048,576 tokens) whatever the prefill chunk.
SCORE_ROWS = 2048


def rope_family(kind: LayerKind) -> str:
    """Which rope a layer of ``kind`` uses: "main" (SWA) or "compress" (CSA / HCA)."""
    return "main" if kind == LayerKind.SWA else "compress"


@dataclass
class V4Step:
    """What a prefill chunk or decode step needs besides the activations (N tokens).

    tokens, positions, seq [N] int64: token ids, positions, cache rows. rope_table: family → (cos, sin)
    [positions, 32] fp32 tables by position (the kernels read them at the tokens' and entries'
    positions). window_slots [N] int64: the window-ring slot each token's kv goes to (−1: not written, a later token of its
    segment takes the slot). Prefill only: segments (host), stash (the prefill's bf16 kv rows), window_rows
    [N] (stash rows), entry_stash / entry_base (per ratio: the prefill's bf16 compressed entries and each
    token's sequence's first row). topk_override: per layer None or [N, k] entry ids replacing the
    indexer's choice. trace: per-layer intermediates of a prefill. shared: what every layer (of a kind)
    derives from the step alike (:meth:`once`); a decode step's come with it from the engine ("window",
    ("first", kind), ("entries", HCA), "last_visible": ``decode_step_indices`` and per-cache tables).
    """

    tokens: Tensor
    positions: Tensor
    seq: Tensor
    rope_table: dict[str, tuple[Tensor, Tensor]]
    cache: V4Cache
    window_slots: Tensor
    segments: list[Segment] | None = None
    stash: KVStash | None = None
    window_rows: Tensor | None = None
    entry_stash: dict[int, KVStash] | None = None
    entry_base: dict[int, Tensor] | None = None
    topk_override: list[Tensor | None] | None = None
    trace: PrefillTrace | None = None
    shared: dict = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return self.segments is not None

    def once(self, key, make: Callable[[], object]):
        """``make()``, computed by the step's first layer that asks for ``key`` and reused by the others
        (the window's indices, the entries' lengths: the same tensors in every layer)."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]


def rmsnorm_bf16(x: Tensor, weight: Tensor, eps: float, fp8: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """``minirt.norms.rmsnorm`` of x [N, d] fp32 rounded to bf16, in one launch (``rms_norm``): ([N, d] fp32
    holding bf16 values, the sub-layers' input: their fp8 quantisers and fp32 GEMMs read it with no cast;
    with ``fp8`` also its quantisation (codes, scales) for an fp8 GEMM, else None)."""
    fp8_out = quantized_like(x) if fp8 else None
    return rms_norm(x, weight, eps, out_dtype=torch.float32, round_to_bf16=True, fp8_out=fp8_out), fp8_out


def fp8_linear(weight: Tensor, scale: Tensor) -> Fp8Linear:
    """An Fp8Linear on a stored e4m3 weight [out, in] and its ue8m0 128×128 block scales (as float32)."""
    linear = Fp8Linear(weight.shape[1], weight.shape[0], device="meta")
    linear.weight, linear.weight_scale_inv = weight, scale.float()
    return linear


def _linear(w: Mapping[str, Tensor], name: str) -> Fp8Linear:
    return fp8_linear(w[name], w[scale_name(name)])


# ---------------------------------------------------------------------------------------------------
# Compressor and indexer


def _stack_rows(parts: list[tuple[object, str]]) -> tuple[Tensor, list[int]]:
    """Weights [out_i, in] of one input (attribute ``name`` of each ``owner``) stacked by rows, so that
    their products run as one GEMM; each owner's attribute becomes a view of its rows (one copy in
    memory). Returns (stacked [Σ out_i, in], the sizes out_i)."""
    stacked = torch.cat([getattr(owner, name) for owner, name in parts])
    sizes, row = [], 0
    for owner, name in parts:
        n = getattr(owner, name).shape[0]
        setattr(owner, name, stacked[row: row + n])
        sizes.append(n)
        row += n
    return stacked, sizes


class Compressor(nn.Module):
    """One compressor (``prefix``: ``attn.compressor.`` or ``attn.indexer.compressor.``): per token the
    fp32 rows ``kv = wkv·x``, ``score = wgate·x + ape[p mod ratio]``; per completed window w the entry
    ``rope(norm(Σ softmax(score) · kv))`` at position ratio · w, over the window's tokens (with ``overlap``,
    CSA: the previous window's first halves, then the window's second halves), as ``dtype``.

    Its callers run the products ``wkv·x`` / ``wgate·x`` (fp32, in one GEMM with the layer's other fp32
    projections of x) and hand them to :meth:`decode` / :meth:`prefill`."""

    def __init__(self, w: Mapping[str, Tensor], prefix: str, ratio: int, dim: int, overlap: bool, eps: float,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ratio, self.dim, self.overlap, self.eps, self.dtype = ratio, dim, overlap, eps, dtype
        self.wkv, self.wgate = w[prefix + "wkv.weight"].float(), w[prefix + "wgate.weight"].float()
        self.ape, self.norm = w[prefix + "ape"].float(), w[prefix + "norm.weight"].float()

    def _pool(self, kv: Tensor, score: Tensor, prev_kv: Tensor | None, prev_score: Tensor | None) -> Tensor:
        """Pooled windows [n, dim] from their rows [n, ratio, width] (and the previous windows')."""
        if self.overlap:
            d = self.dim
            kv = torch.cat((prev_kv[..., :d], kv[..., d:]), dim=1)
            score = torch.cat((prev_score[..., :d], score[..., d:]), dim=1)
        return (kv * score.softmax(dim=1)).sum(dim=1)

    def _finish(self, pooled: Tensor, windows: Tensor, table: tuple[Tensor, Tensor]) -> Tensor:
        return norm_rope(pooled, eps=self.eps, weight=self.norm, cos=table[0], sin=table[1],
                         positions=windows * self.ratio, out_dtype=self.dtype)

    def decode(self, kv: Tensor, gate: Tensor, step: V4Step, state: CompressorState, table, out: Tensor,
               slots_per_seq: int | None = None) -> Tensor | None:
        """One token per sequence, kv / gate [b, width] fp32 its products ``wkv·x`` / ``wgate·x``: store its
        rows in the ring and, where its window completes, write the entry (``compressor_decode``, one
        launch): out [b, dim] by token (zeros where none completes; with ``slots_per_seq`` the slots
        ``seq · slots_per_seq + window`` or −1 are returned) or [B, n, dim] at [seq, window]."""
        return compressor_decode(kv, gate, self.ape, state.kv, state.score, step.positions, step.seq, self.norm,
                                 self.eps, table[0], table[1], out, slots_per_seq=slots_per_seq)

    def prefill(self, kv: Tensor, gate: Tensor, step: V4Step, state: CompressorState,
                table) -> list[tuple[Segment, int, Tensor]]:
        """A prefill step's segments, kv / gate [N, width] fp32 its tokens' products: per segment (segment,
        first window id, entries [n, dim] of dtype) of the windows that complete in it (n may be 0), the
        earlier positions' rows read from the ring; the ring then holds each segment's last positions."""
        m, R, device = self.ratio, state.rows, kv.device
        score = gate + self.ape[step.positions % m]
        out = []
        for seg in step.segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            first = max(0, m * (seg.start // m) - (m if self.overlap else 0))
            seg_kv, seg_score = kv[rows], score[rows]
            if first < seg.start:  # the ring's rows of the windows this segment completes (no copy without)
                past = torch.arange(first, seg.start, device=device) % R
                seg_kv = torch.cat((state.kv[seg.seq, past], seg_kv))
                seg_score = torch.cat((state.score[seg.seq, past], seg_score))
            lo, hi = seg.start // m, seg.end // m  # windows lo .. hi-1 complete in this segment
            n = hi - lo
            if n > 0:
                cur = slice(m * lo - first, m * hi - first)
                prev_kv = prev_score = None
                if self.overlap:
                    if lo == 0:  # window 0 has no previous window: its slots weigh 0
                        seg_kv = torch.cat((seg_kv.new_zeros(m, seg_kv.shape[1]), seg_kv))
                        seg_score = torch.cat((seg_score.new_full((m, seg_score.shape[1]), float("-inf")), seg_score))
                        first -= m
                        cur = slice(m * lo - first, m * hi - first)
                    prev = slice(m * (lo - 1) - first, m * (hi - 1) - first)
                    prev_kv, prev_score = seg_kv[prev].view(n, m, -1), seg_score[prev].view(n, m, -1)
                pooled = self._pool(seg_kv[cur].view(n, m, -1), seg_score[cur].view(n, m, -1), prev_kv, prev_score)
                out.append((seg, lo, self._finish(pooled, torch.arange(lo, hi, device=device), table)))
            keep = min(seg.length, R)
            ring = torch.arange(seg.end - keep, seg.end, device=device) % R
            state.kv[seg.seq, ring] = kv[seg.offset + seg.length - keep: seg.offset + seg.length]
            state.score[seg.seq, ring] = score[seg.offset + seg.length - keep: seg.offset + seg.length]
        return out


class Indexer(nn.Module):
    """CSA's lightning indexer: keys from its own compressor (fp32 key cache), queries
    ``rope(indexer.wq_b · qr)`` per head, ``I[t, s] = Σ_h wp[t, h] · d^-½ · h^-½ · relu(q[t, h] · k[s])`` over
    the visible entries (s < (t + 1) // 4), top ``index_topk`` entry ids (−1 past the visible ones).
    Its products of x (the compressor's, ``weights_proj``) and of qr (``wq_b``) run in the attention's
    fused GEMMs."""

    def __init__(self, w: Mapping[str, Tensor], cfg: DeepseekV4Config):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.weights_proj = w["attn.indexer.weights_proj.weight"].float() * (self.dim**-0.5 * self.heads**-0.5)
        self.compressor = Compressor(w, "attn.indexer.compressor.", LayerKind.CSA.ratio, self.dim, True,
                                     cfg.rms_norm_eps)

    def forward(self, kv: Tensor, gate: Tensor, head_weights: Tensor, q: Tensor, step: V4Step,
                state: LayerState) -> Tensor:
        """Write this step's completed keys and select: [N, index_topk] int32 entry ids. kv, gate: the
        compressor's products of x; head_weights [N, heads] fp32: ``weights_proj · x`` (scaled); q
        [N, heads · dim]: ``wq_b · qr``."""
        table = step.rope_table["compress"]
        if step.is_prefill:
            for seg, lo, keys in self.compressor.prefill(kv, gate, step, state.index_compressor, table):
                state.index_keys[seg.seq, lo: lo + keys.shape[0]] = keys
        else:
            self.compressor.decode(kv, gate, step, state.index_compressor, table, state.index_keys)
        N = q.shape[0]
        q = norm_rope(q.view(N, self.heads, self.dim), cos=table[0], sin=table[1], positions=step.positions,
                      out_dtype=torch.float32)
        last_visible = step.once("last_visible", lambda: (step.positions + 1) // LayerKind.CSA.ratio - 1)
        if not step.is_prefill:  # decode rows are the cache's first b sequences, in order
            b = N
            scores = lightning_indexer_scores(q[:, None], state.index_keys[:b], head_weights[:, None],
                                              last_visible[:, None])
            # One long row a sequence (up to 262,144 entries at 1M tokens): decode_topk spreads each over
            # many programs, where indexer_topk's torch.topk takes one block a row.
            return decode_topk(scores[:, 0], self.topk)
        picks = []
        for seg in step.segments:  # in blocks of SCORE_ROWS tokens, each over the keys visible to its last
            for lo in range(0, seg.length, SCORE_ROWS):
                hi = min(lo + SCORE_ROWS, seg.length)
                rows = slice(seg.offset + lo, seg.offset + hi)
                keys = state.index_keys[seg.seq, : max(1, (seg.start + hi) // LayerKind.CSA.ratio)]
                scores = lightning_indexer_scores(q[rows], keys, head_weights[rows], last_visible[rows])
                picks.append(indexer_topk(scores, self.topk))
        return torch.cat(picks)


# ---------------------------------------------------------------------------------------------------
# Attention


def _stacked_fp8(w: Mapping[str, Tensor], names: list[str]) -> tuple[Fp8Linear, list[int]]:
    """One Fp8Linear on the stored e4m3 weights ``names`` of one input, stacked by rows (every part but the
    last a whole number of 128-row scale blocks, so the block scales stack too), and the parts' sizes."""
    sizes = [w[n].shape[0] for n in names]
    if any(n % 128 for n in sizes[:-1]):
        raise ConfigError(f"projections of {sizes} rows do not stack by 128-row scale blocks")
    return (fp8_linear(torch.cat([w[n] for n in names]), torch.cat([w[scale_name(n)] for n in names])), sizes)


class Attention(nn.Module):
    """One layer's attention of ``kind`` on x [N, D] fp32 holding bf16 values (attn_norm applied): [N, D] fp32. ``tp``: ``w``
    holds this rank's heads and output groups; the output is summed over the ranks.

    Its projections of one input run as one GEMM each: ``wq_a`` and ``wkv`` of x (fp8), ``wq_b`` and the
    indexer's ``wq_b`` of qr (fp8), and, fp32, the compressors' ``wkv`` / ``wgate`` and the indexer's
    ``weights_proj`` of x."""

    def __init__(self, w: Mapping[str, Tensor], cfg: DeepseekV4Config, index: int, kind: LayerKind,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.index, self.kind, self.rope, self.tp = cfg, index, kind, rope_family(kind), tp
        self.heads = cfg.num_attention_heads // tp.world
        self.wq_a_wkv, self.x_sizes = _stacked_fp8(w, ["attn.wq_a.weight", "attn.wkv.weight"])
        self.wq_b, _ = _stacked_fp8(w, ["attn.wq_b.weight"] + (["attn.indexer.wq_b.weight"] if kind == LayerKind.CSA
                                                                else []))
        self.q_norm, self.kv_norm = w["attn.q_norm.weight"].float(), w["attn.kv_norm.weight"].float()
        self.o_groups = cfg.o_groups // tp.world
        self.wo_a = _linear(w, "attn.wo_a.weight")  # the groups' rows stacked: [groups · r, H · hd / groups]
        self.wo_b = _linear(w, "attn.wo_b.weight")
        self.sink = w["attn.attn_sink"].float()
        self.compressor = (Compressor(w, "attn.compressor.", kind.ratio, cfg.head_dim, kind == LayerKind.CSA,
                                      cfg.rms_norm_eps, torch.bfloat16) if kind != LayerKind.SWA else None)
        self.indexer = Indexer(w, cfg) if kind == LayerKind.CSA else None
        if self.compressor is not None:
            parts = [(self.compressor, "wkv"), (self.compressor, "wgate")]
            if self.indexer is not None:
                parts += [(self.indexer.compressor, "wkv"), (self.indexer.compressor, "wgate"),
                          (self.indexer, "weights_proj")]
            self.x_fp32, self.x_fp32_sizes = _stack_rows(parts)

    def forward(self, x: Tensor, x_fp8: tuple[Tensor, Tensor] | None, step: V4Step) -> Tensor:
        """x_fp8: x's quantisation for the fp8 projections (``rmsnorm_bf16``'s), or None (quantised here)."""
        cfg, N = self.cfg, x.shape[0]
        eps, H, hd = cfg.rms_norm_eps, self.heads, cfg.head_dim
        cos, sin = step.rope_table[self.rope]
        rope = dict(cos=cos, sin=sin, positions=step.positions)
        q_a, kv = self.wq_a_wkv(x if x_fp8 is None else x_fp8).split(self.x_sizes, dim=-1)
        qr_fp8 = quantized_like(q_a)  # qr only feeds wq_b: its norm writes the GEMM's fp8 operand too
        rms_norm(q_a, self.q_norm, eps, out_dtype=torch.float32, fp8_out=qr_fp8)
        q_all = self.wq_b(qr_fp8)
        q = norm_rope(q_all[:, : H * hd].view(N, H, hd), eps=eps, **rope)
        kv = norm_rope(kv, eps=eps, weight=self.kv_norm, **rope)
        state = step.cache.layers[self.index]
        write_kv_model1(state.window, kv, step.window_slots)
        topk = None
        if self.compressor is not None:
            rows = F.linear(x, self.x_fp32).split(self.x_fp32_sizes, dim=-1)
            self._write_entries(rows[0], rows[1], step, state)
        if self.kind == LayerKind.CSA:
            topk = self._topk(rows[2:], q_all[:, H * hd:], step, state)
            if step.trace is not None:
                step.trace.record("topk", self.index, topk)
        o = (self._prefill_attention(q, kv, step, topk) if step.is_prefill
             else self._decode_attention(q, step, state, topk))
        norm_rope(o, inverse=True, out=o, **rope)  # K = V carried the keys' rope: rotated back, in place
        z_fp8, z_scales = quantize_act_fp8(self._wo_a(o.view(N, -1)))
        out = self.tp.all_reduce(fp8_gemm(z_fp8, z_scales, self.wo_b.weight, self.wo_b.weight_scale_inv, torch.float32))
        if step.trace is not None:
            step.trace.record("attn", self.index, out)
        return out

    def _wo_a(self, o: Tensor) -> Tensor:
        """The grouped projection of o [N, H · hd] bf16: [N, groups · o_lora_rank] bf16, group g's rows of
        the output from group g's columns of o (fp8_gemm's ``groups``: one launch at decode), o quantised
        once (its 128-value blocks do not cross the groups)."""
        o_fp8, scales = quantize_act_fp8(o)
        return fp8_gemm(o_fp8, scales, self.wo_a.weight, self.wo_a.weight_scale_inv, groups=self.o_groups)

    def _topk(self, rows, q, step: V4Step, state: LayerState) -> Tensor:
        """[N, index_topk] int32 entry ids: the indexer's (its keys written either way), or the override."""
        chosen = self.indexer(*rows, q, step, state)
        override = step.topk_override[self.index] if step.topk_override is not None else None
        if override is None:
            return chosen
        override = override.to(chosen.device, torch.int32)[:, : chosen.shape[1]]
        return F.pad(override, (0, chosen.shape[1] - override.shape[1]), value=-1)

    def _write_entries(self, kv: Tensor, gate: Tensor, step: V4Step, state: LayerState) -> None:
        """Pool the windows completed in this step into the compressed cache (and the prefill's stash)."""
        table, per_seq = step.rope_table["compress"], step.cache.entries_per_seq(self.kind)
        if not step.is_prefill:
            entries = torch.empty(kv.shape[0], self.cfg.head_dim, dtype=torch.bfloat16, device=kv.device)
            slots = self.compressor.decode(kv, gate, step, state.compressor, table, entries, per_seq)
            write_kv_model1(state.compressed, entries, slots)
            return
        stash = step.entry_stash[self.kind.ratio]
        rows = stash.layer(self.index, self.cfg.head_dim)
        for seg, lo, entries in self.compressor.prefill(kv, gate, step, state.compressor, table):
            ids = torch.arange(lo, lo + entries.shape[0], device=kv.device)
            write_kv_model1(state.compressed, entries, seg.seq * per_seq + ids)
            rows[stash.base[seg.seq] + ids, 0] = entries

    def _extra(self, step: V4Step, topk: Tensor | None, first: Tensor, width: int) -> tuple[Tensor, Tensor | None]:
        """(extra indices [N, k] int32 = first + entry id, lengths [N] int32 or None) of the compressed entries
        each token attends: CSA its top-k, HCA every visible entry (``width`` columns, lengths (t+1) // 128;
        the same in every HCA layer of the step: a decode step's come with it). first [N] int32."""
        if self.kind == LayerKind.CSA:
            return offset_entry_ids(topk, first), None
        return step.once(("entries", self.kind), lambda: (
            first[:, None] + torch.arange(width, dtype=torch.int32, device=first.device),
            ((step.positions + 1) // self.kind.ratio).to(torch.int32)))

    def _prefill_attention(self, q: Tensor, kv: Tensor, step: V4Step, topk: Tensor | None) -> Tensor:
        cfg, W = self.cfg, self.cfg.sliding_window
        keys = step.stash.layer(self.index, cfg.head_dim)
        keys[step.window_rows, 0] = kv
        window = step.once("window", lambda: self._prefill_window(step, W))
        if self.kind == LayerKind.SWA:
            return sparse_mla_prefill(q, keys, window, cfg.sm_scale, cfg.head_dim, self.sink)[0]
        width = max(1, max(seg.end // self.kind.ratio for seg in step.segments))
        first = step.once(("first", self.kind), lambda: step.entry_base[self.kind.ratio].to(torch.int32))
        extra, lengths = self._extra(step, topk, first, width)
        entries = step.entry_stash[self.kind.ratio].layer(self.index, cfg.head_dim)
        return sparse_mla_prefill_two_sources(q, keys, window, entries, extra[:, None], cfg.sm_scale, cfg.head_dim,
                                              self.sink, None, lengths)[0]

    @staticmethod
    def _prefill_window(step: V4Step, W: int) -> Tensor:
        """[N, 1, W] int32: the stash rows of each token's last W positions (−1 before its sequence's start)."""
        back = torch.arange(W, device=step.positions.device)
        window = torch.where(step.positions[:, None] >= back, step.window_rows[:, None] - back, -1)
        return window.to(torch.int32)[:, None]

    def _decode_attention(self, q: Tensor, step: V4Step, state: LayerState, topk: Tensor | None) -> Tensor:
        window = step.shared["window"]  # the decode step's indices: made by the engine (decode_step_indices)
        extra = {}
        if self.kind != LayerKind.SWA:
            ids, lengths = self._extra(step, topk, step.shared[("first", self.kind)], 0)
            extra = dict(extra_kv_cache=state.compressed, extra_indices=ids[:, None], extra_topk_length=lengths)
        o, _ = sparse_mla_decode_fp8(q[:, None], state.window, window, self.cfg.sm_scale, self.cfg.head_dim,
                                     attn_sink=self.sink, **extra)
        return o[:, 0]


# ---------------------------------------------------------------------------------------------------
# MoE


class MoE(nn.Module):
    """The MoE FFN on x [N, D] (ffn_norm applied; fp32 holding bf16 values, or bf16): [N, D] bf16 = routed
    experts + shared expert, summed in fp32 and rounded once. ``tp``: ``w`` holds this rank's routed
    experts (``expert_range``); every rank routes every token and ``expert_parallel_moe`` dispatches them
    (its sum of the ranks' partials is rounded to bf16)."""

    def __init__(self, w: Mapping[str, Tensor], cfg: DeepseekV4Config, index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.hash, self.tp = cfg, cfg.is_hash_layer(index), tp
        self.gate = w["ffn.gate.weight"].float()
        self.tid2eid = w["ffn.gate.tid2eid"] if self.hash else None
        self.bias = None if self.hash else w["ffn.gate.bias"].float()
        experts, fmt = expert_range(cfg, tp), cfg.quantization.expert_dtype
        parts = [[w[f"ffn.experts.{e}.{k}.weight"] for e in experts] for k in ("w1", "w3", "w2")]
        scales = [[w[scale_name(f"ffn.experts.{e}.{k}.weight")] for e in experts] for k in ("w1", "w3", "w2")]
        stack = expert_weights_fp4 if fmt == "fp4" else expert_weights_fp8
        self.experts: ExpertWeights = stack(parts[0], scales[0], parts[1], scales[1], parts[2], scales[2])
        shared = [w[f"ffn.shared_experts.{k}.weight"] for k in ("w1", "w3", "w2")]
        shared_scales = [w[scale_name(f"ffn.shared_experts.{k}.weight")] for k in ("w1", "w3", "w2")]
        self.shared = expert_weights_fp8([shared[0]], [shared_scales[0]], [shared[1]], [shared_scales[1]],
                                         [shared[2]], [shared_scales[2]])

    def forward(self, x: Tensor, tokens: Tensor) -> Tensor:
        """[N, D] bf16: the routed experts' weighted sum plus the shared expert (one ``moe_experts`` call; over
        ``tp``, ``expert_parallel_moe``)."""
        cfg = self.cfg
        logits = F.linear(x if x.dtype == torch.float32 else x.float(), self.gate)
        route = dict(scoring=cfg.scoring_func, normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
        if self.hash:
            weights, ids = route_hash(logits, self.tid2eid, tokens, **route)
        else:
            weights, ids = route_topk(logits, self.bias, top_k=cfg.num_experts_per_tok, **route)
        if self.tp.world > 1:  # dispatched in bf16, as the ranks' partials are summed
            return expert_parallel_moe(x.to(torch.bfloat16), None, self._routed, self._shared, (weights, ids),
                                       cfg.n_routed_experts, self.tp)
        return moe_experts(x, ids, weights, self.experts, swiglu_limit=cfg.swiglu_limit, shared=self.shared)

    def _routed(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """[T, D] bf16: this rank's experts' weighted sum (slots of other experts: id -1, skipped)."""
        return moe_experts(x, ids, weights, self.experts, swiglu_limit=self.cfg.swiglu_limit)

    def _shared(self, x: Tensor) -> Tensor:
        """[T, D] bf16: the shared expert (every token weight 1)."""
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
        return moe_experts(x, ids, torch.ones(x.shape[0], 1, device=x.device), self.shared,
                           swiglu_limit=self.cfg.swiglu_limit)


class V4Layer(nn.Module):
    """One DeepSeek-V4 layer on X [N, hc, D] fp32 (contiguous): ``X = post · attn(attn_norm(Σ pre X)) + combᵀ X``,
    then the same with the MoE.
    ``w``: the layer's tensors by names relative to ``layers.{index}.``, fp8 / fp4 as stored with their
    ``.scale`` entries (``load_checkpoint(..., as_stored=True)``); with ``tp``, this rank's parts of them
    (``load_checkpoint(..., tp=tp)``)."""

    def __init__(self, w: Mapping[str, Tensor], cfg: DeepseekV4Config, index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.index, self.kind = cfg, index, cfg.layer_kinds[index]
        self.hc = {part: tuple(w[f"hc_{part}_{k}"].float() for k in ("fn", "base", "scale")) for part in ("attn", "ffn")}
        self.attn_norm, self.ffn_norm = w["attn_norm.weight"].float(), w["ffn_norm.weight"].float()
        self.attn = Attention(w, cfg, index, self.kind, tp)
        self.ffn = MoE(w, cfg, index, tp)

    def forward(self, X: Tensor, step: V4Step) -> Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        mix = dict(eps=eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
        collapsed, post, comb = mhc.hc_pre(X, *self.hc["attn"], **mix)
        X = mhc.hc_post(self.attn(*rmsnorm_bf16(collapsed, self.attn_norm, eps, fp8=True), step), X, post, comb)
        collapsed, post, comb = mhc.hc_pre(X, *self.hc["ffn"], **mix)
        x, _ = rmsnorm_bf16(collapsed, self.ffn_norm, eps)
        X = mhc.hc_post(self.ffn(x, step.tokens), X, post, comb)
        if step.trace is not None:
            step.trace.record("hidden", self.index, X)
        return X
