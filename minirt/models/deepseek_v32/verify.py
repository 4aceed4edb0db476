"""End-to-end check of the kernel runtime against the eager reference on the same tokens.

Errors are relative norms ‖runtime − reference‖ / ‖reference‖ over whole tensors. The limits (README,
"verify tolerances") come from the runtime's deliberate roundings: bf16 kernel operands (2^-8 relative
per element), the fp8 e4m3 latent cache in decode (2^-4 worst case per element), and on the GPU bf16
weights and activations.
"""
from __future__ import annotations

import torch

from collections.abc import Callable

from ...context import PrefillTrace
from .context import prefill_context
from .engine import Engine
from ...errors import InputError
from ...report import Check, VerifyReport, rel_err, top1_agreement, topk_overlap
from ...backend import ReferenceEngine

# name → (limit, "max" = error must stay at or below, "min" = agreement must reach).
TOLERANCES = {
    "hidden": (3e-2, "max"),
    "topk_overlap": (0.9, "min"),
    "attention_same_topk": (2e-2, "max"),
    "prefill_logits": (3e-2, "max"),
    "decode_logits": (1e-1, "max"),
    # The runtime's top-1 within the position's logit error of the reference's best (top1_agreement): the
    # error rows bound that error, so this row holds whatever the weights (tiny, bf16 path: 0.988).
    "top1_agreement": (0.95, "min"),
}
# With fp8 weights every GEMM input is an e4m3 activation (one power-of-two scale per 128 values, as
# DeepSeek computes): ≈3.6% rms rounding of each, through several GEMMs in series per layer (measured
# on the tiny preset: hidden 4-6%, logits 6%).
FP8_WEIGHTS_TOLERANCES = TOLERANCES | {
    "hidden": (1e-1, "max"),
    "attention_same_topk": (1e-1, "max"),
    "prefill_logits": (1e-1, "max"),
    "decode_logits": (1.5e-1, "max"),
}

# The rows of MoE layers, whatever the weights. The router on the reference's input computes the same
# fp32 logits: only last-ulp near-ties may differ. The experts quantise their inputs and the SwiGLU
# output to e4m3 (≈3.6% rms each, two GEMMs in series; measured 3.8% on the tiny preset).
MOE_ROW_TOLERANCES = {
    "router_agreement": (0.99, "min"),
    "moe_same_routing": (1e-1, "max"),
}
# With bf16 weights, each MoE layer still adds its experts' e4m3 rounding to the residual stream
# (measured on the tiny preset: hidden 1.9% and logits 1.9% after one MoE layer on the reference's
# routing, 2.8% after two; decode logits 4.6%).
MOE_TOLERANCES = {
    "hidden": (6e-2, "max"),
    "prefill_logits": (6e-2, "max"),
    "decode_logits": (1e-1, "max"),
}


def default_prompt_len(cfg) -> int:
    """Twice the indexer's top-k and more (32 for V3), so the top-k is sparse."""
    return 2 * (cfg.index_topk or 32) + 8


def expert_agreement(expert_ids: torch.Tensor, ref_ids: torch.Tensor) -> float:
    """Mean over tokens of |chosen ∩ reference-chosen| / k, for expert ids [T, k] (order ignored)."""
    ids, ref_ids = expert_ids.long().cpu(), ref_ids.long().cpu()
    return float((ids[:, :, None] == ref_ids[:, None, :]).any(-1).float().mean())


def tolerances(engine: Engine) -> dict[str, tuple[float, str]]:
    """The tolerance table for this engine's weights ("bf16" or "fp8"), with the MoE rows when it runs
    MoE layers (``MOE_ROW_TOLERANCES``; with bf16 weights the experts' fp8 rounding also widens the
    error rows, ``MOE_TOLERANCES``)."""
    table = FP8_WEIGHTS_TOLERANCES if engine.weights == "fp8" else TOLERANCES
    if not any(engine.cfg.is_moe_layer(i) for i in range(engine.num_layers)):
        return table
    return table | MOE_ROW_TOLERANCES | ({} if engine.weights == "fp8" else MOE_TOLERANCES)


def run_verify(engine: Engine, oracle: ReferenceEngine, prompt_len: int, decode_steps: int, seed: int = 0,
               progress: Callable[[str], None] | None = None,
               on_prefill: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Random tokens (seeded): prefill ``prompt_len`` of them, then decode ``decode_steps`` more one by
    one, on the kernel engine and the eager oracle (``minirt.load(..., backend="reference")``).

    The runtime runs twice. Once attending exactly the reference's top-k in every layer (prefill and
        logits = [engine.prefill([tokens[:P].tolist()], all_logits=True, trace=trace,
                                 **(overrides(slice(0, P)) if forced else {}))]
    """
    if prompt_len < 1 or decode_steps < 0:
        raise InputError(f"need prompt_len >= 1 and decode_steps >= 0, got {prompt_len}, {decode_steps}")
    if getattr(oracle, "backend", None) != "reference" or getattr(engine, "backend", None) != "triton":
        raise InputError("run_verify(engine, oracle, ...) takes a triton engine and a reference oracle "
                         "(minirt.load(..., backend='reference'))")
    if engine.num_layers != oracle.num_layers or engine.cfg != oracle.cfg:
        raise InputError(f"engine and oracle must load the same checkpoint and layers: the engine has "
                         f"{engine.num_layers} layer(s), the oracle {oracle.num_layers}"
                         + ("" if engine.cfg == oracle.cfg else ", and their configs differ"))
    say = progress or (lambda stage: None)
    table = tolerances(engine)

    def _check(name: str, value: float) -> Check:
        limit, kind = table[name.split("[")[0]]
        return Check(name, value, limit, kind)

    cfg, reference = engine.cfg, oracle.model
    total = prompt_len + decode_steps
    tokens = torch.randint(0, cfg.vocab_size, (total,), generator=torch.Generator().manual_seed(seed))
    say(f"eager reference over {total} tokens")
    ref = reference.forward(tokens)
    P, layers = prompt_len, range(engine.num_layers)
    ref_topk = ref.topk_indices

    def routing(i: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor] | None:
        if ref.expert_ids[i] is None:
            return None
        return ref.expert_weights[i][rows].to(engine.device), ref.expert_ids[i][rows].to(engine.device)

    def overrides(rows: slice) -> dict:
        """The reference's top-k and routing of these token rows, as the engine's override arguments."""
        return {"topk_override": None if dense else [ref_topk[i][rows] for i in layers],
                "expert_override": [routing(i, rows) for i in layers] if moe else None}

    def run(forced: bool, trace: PrefillTrace | None = None) -> torch.Tensor:
        engine.setup_cache(1, total)
        logits = [engine.prefill([tokens[:P].tolist()], all_logits=True, trace=trace, progress=on_prefill,
                                 **(overrides(slice(0, P)) if forced else {}))]
        for t in range(P, total):
            logits.append(engine.decode(tokens[t : t + 1], **(overrides(slice(t, t + 1)) if forced else {})))
        return torch.cat(logits)

    dense = ref_topk[0] is None
    moe = any(ids is not None for ids in ref.expert_ids)
    forced_trace, free_trace = PrefillTrace(), PrefillTrace()
    chooses = not dense or moe  # the runtime picks keys or experts itself: run it forced, then free
    say("runtime on the reference's top-k" + (" and routing" if moe else ""))
    forced_logits = run(forced=chooses, trace=forced_trace)
    if chooses:
        say("runtime with its own indexer" + (" and router" if moe else ""))
    free_logits = run(forced=False, trace=free_trace) if chooses else forced_logits

    checks = []
    layer_input = reference.weights["model.embed_tokens.weight"][tokens.to(reference.device)]
    for i in layers:
        checks.append(_check(f"hidden[{i}]", rel_err(forced_trace.hidden_states[i], ref.hidden_states[i][:P])))
        if not dense:
            say(f"layer {i} attention on the reference's input and top-k")
            checks.append(_check(f"topk_overlap[{i}]", topk_overlap(free_trace.topk[i], ref_topk[i][:P])))
            attn = _attention_same_topk(engine, i, layer_input[:P], ref_topk[i][:P])
            checks.append(_check(f"attention_same_topk[{i}]", rel_err(attn, ref.attn_outputs[i][:P])))
        if ref.moe_inputs[i] is not None:
            say(f"layer {i} MoE on the reference's input")
            expert_ids, moe_out = _moe_same_input(engine, i, ref.moe_inputs[i],
                                                  (ref.expert_weights[i], ref.expert_ids[i]))
            checks.append(_check(f"router_agreement[{i}]", expert_agreement(expert_ids, ref.expert_ids[i])))
            checks.append(_check(f"moe_same_routing[{i}]", rel_err(moe_out, ref.moe_outputs[i])))
        layer_input = ref.hidden_states[i]
    checks.append(_check("prefill_logits", rel_err(forced_logits[:P], ref.logits[:P])))
    if decode_steps:
        checks.append(_check("decode_logits", rel_err(forced_logits[P:], ref.logits[P:])))
    checks.append(_check("top1_agreement", top1_agreement(free_logits, ref.logits)))
    return VerifyReport(checks, prompt_len, decode_steps)


@torch.inference_mode()
def _attention_same_topk(engine: Engine, layer_index: int, layer_input: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """Layer ``layer_index``'s attention output [T, hidden] fp32 for one sequence's residual input
    [T, hidden], attending exactly the given top-k positions [T, k] (no cache)."""
    layer = engine.model.model.layers[layer_index]
    x = layer.input_layernorm(layer_input.to(engine.device, engine.dtype))
    ctx = prefill_context(engine.cfg, [x.shape[0]], topk_override={layer_index: topk.to(engine.device)},
                          device=engine.device)
    return layer.self_attn(x, ctx).float()


@torch.inference_mode()
def _moe_same_input(engine: Engine, layer_index: int, moe_input: torch.Tensor,
                    routing: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE layer ``layer_index`` on the reference's normalised FFN input [T, hidden]: (the expert ids
    its router picks [T, k], computed on the fp32 input as the router computes its logits; the FFN
    output [T, hidden] fp32 on the given routing (weights, expert ids))."""
    mlp = engine.model.model.layers[layer_index].mlp
    _, expert_ids = mlp.gate(moe_input.to(engine.device, torch.float32))
    weights, ids = (t.to(engine.device) for t in routing)
    return expert_ids, mlp(moe_input.to(engine.device, engine.dtype), routing=(weights, ids)).float()
