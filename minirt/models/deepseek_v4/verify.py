"""``minirt verify`` for DeepSeek-V4: the kernel runtime (:class:`.engine.EngineV4`) against the eager fp32
:class:`.reference.ReferenceModelV4` on the same random tokens.

Rows (relative norms ‖runtime − reference‖ / ‖reference‖ over whole tensors, as V3.2's, :mod:`minirt.report`):
``hidden[i]`` the residual state [T, hc, D] after layer i and ``attention[i]`` its attention output, with
the runtime attending the reference's CSA top-k (numerics, not near-tie flips); ``topk_overlap[i]`` (CSA
layers) the runtime's own indexer selection against the reference's; ``prefill_logits`` and
``decode_logits`` (forced top-k); ``top1_agreement`` of the free run over every position.

Tolerances (:data:`TOLERANCES`), from the runtime's deliberate roundings: every GEMM input is an fp8
e4m3 activation with one power-of-two scale per 128 values (≈3.6% rms per GEMM, several GEMMs in series
per layer: q_a → q_b, kv, wo_a → wo_b, and the experts' two), the MoE's expert outputs in bf16, the
attention's bf16 operands (2^-8) and, in decode, the fp8 MODEL1 caches (448 values of each entry e4m3
with a power-of-two scale per 64). One layer's attention on the reference's own input is within 5-6%
of the reference (v4-tiny, every kind); the residual state carries each layer's error into the next, so
the hidden error grows with depth (v4-tiny, 12 tokens: 5.6%, 6.9%, 15%, 21% after layers 0-3; logits
19% over 140 tokens), hence limits of 30%: an error of the maths (a rope on the wrong dims, comb not
transposed, a window off by one) gives errors near 100%. The indexer keys are exact fp32, but its input
carries the upstream error, so near-tied entries may swap: the overlap limit allows a few swaps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...context import PrefillTrace
from ...errors import InputError
from ...backend import ReferenceEngine
from ...report import Check, VerifyReport, rel_err, top1_agreement, topk_overlap
from .config import LayerKind
from .engine import EngineV4

# name → (limit, "max" = error must stay at or below, "min" = agreement must reach).
TOLERANCES = {
    "hidden": (3e-1, "max"),
    "attention": (3e-1, "max"),
    "topk_overlap": (0.8, "min"),
    "prefill_logits": (3e-1, "max"),
    "decode_logits": (3e-1, "max"),
    "top1_agreement": (0.6, "min"),
}


def default_prompt_len(cfg) -> int:
    """Longer than the window and than one HCA window, so every cache and compressor path runs."""
    return max(cfg.sliding_window, LayerKind.HCA.ratio) + 4


def run_verify(engine: EngineV4, oracle: ReferenceEngine, prompt_len: int, decode_steps: int, seed: int = 0,
               progress: Callable[[str], None] | None = None,
               on_prefill: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Random tokens (seeded): prefill ``prompt_len`` of them, then decode ``decode_steps`` more one by one,
    on the runtime (twice: attending the reference's CSA top-k, then with its own indexer) and on the
    oracle (``minirt.load(..., backend="reference")``, one forward over all tokens). ``progress(stage)``
    is called as each stage starts, ``on_prefill(done, total)`` as each prefill step ends."""
    if prompt_len < 1 or decode_steps < 0:
        raise InputError(f"need prompt_len >= 1 and decode_steps >= 0, got {prompt_len}, {decode_steps}")
    say = progress or (lambda stage: None)
    cfg, total, P = engine.cfg, prompt_len + decode_steps, prompt_len
    tokens = torch.randint(0, cfg.vocab_size, (total,), generator=torch.Generator().manual_seed(seed))
    say(f"eager reference over {total} tokens")
    ref = oracle.model.forward(tokens)
    layers = range(engine.num_layers)
    csa = [i for i in layers if cfg.layer_kinds[i] == LayerKind.CSA]

    def run(forced: bool, trace: PrefillTrace) -> torch.Tensor:
        def override(rows: slice):
            return [ref.topk_indices[i][rows] if i in csa else None for i in layers] if forced else None
        engine.setup_cache(1, total)
        logits = [engine.prefill([tokens[:P].tolist()], all_logits=True, trace=trace, progress=on_prefill,
                                 topk_override=override(slice(0, P)))]
        for t in range(P, total):
            logits.append(engine.decode(tokens[t: t + 1], topk_override=override(slice(t, t + 1))))
        return torch.cat(logits)

    forced_trace, free_trace = PrefillTrace(), PrefillTrace()
    say("runtime on the reference's top-k")
    forced_logits = run(True, forced_trace)
    if csa:
        say("runtime with its own indexer")
    free_logits = run(False, free_trace) if csa else forced_logits

    checks = []

    def check(name: str, value: float) -> None:
        limit, kind = TOLERANCES[name.split("[")[0]]
        checks.append(Check(name, value, limit, kind))

    attn = forced_trace._joined("attn")
    free_topk = {i: t for i, t in zip(sorted(csa), free_trace.topk)}
    for i in layers:
        check(f"hidden[{i}]", rel_err(forced_trace.hidden_states[i], ref.hidden_states[i][:P]))
        check(f"attention[{i}]", rel_err(attn[i], ref.attn_outputs[i][:P]))
        if i in csa:
            ref_topk, ok = ref.topk_indices[i][:P], (ref.topk_indices[i][:P] >= 0).any(-1)
            check(f"topk_overlap[{i}]", topk_overlap(free_topk[i][ok.to(free_topk[i].device)].cpu(), ref_topk[ok]))
    check("prefill_logits", rel_err(forced_logits[:P], ref.logits[:P]))
    if decode_steps:
        check("decode_logits", rel_err(forced_logits[P:], ref.logits[P:]))
    check("top1_agreement", top1_agreement(free_logits, ref.logits))
    return VerifyReport(checks, prompt_len, decode_steps)
