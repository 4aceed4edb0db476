"""``minirt verify``'s report, and the measures every family's rows are made of: relative norms
‖runtime − reference‖ / ‖reference‖ over whole tensors, and the overlap of top-k selections."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch


@dataclass
class Check:
    name: str
    value: float
    limit: float
    kind: str  # "max" or "min"

    @property
    def ok(self) -> bool:
        return self.value <= self.limit if self.kind == "max" else self.value >= self.limit


@dataclass
class VerifyReport:
    checks: list[Check]
    prompt_len: int
    decode_steps: int

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "prompt_len": self.prompt_len, "decode_steps": self.decode_steps,
                           "checks": [asdict(c) | {"ok": c.ok} for c in self.checks]}, indent=2)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((x.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def top1_agreement(logits: torch.Tensor, ref_logits: torch.Tensor, sigmas: float = 3.0) -> float:
    """Fraction of positions (rows of logits [T, vocab]) where the runtime's top-1 token is the reference's,
    or one the reference scores within ``sigmas`` times that position's rms logit error of its best.

    A synthetic model's logits are flat (its top two of 129k tokens differ by about 0.2 of their spread),
    so a few-percent logit error swaps near-equal top tokens; such a swap counts as agreement, a pick the
    reference ranks clearly lower does not. The logit error itself is bounded by the logits rows."""
    x, ref = logits.double().cpu(), ref_logits.double().cpu()
    err = (x - ref).pow(2).mean(-1).sqrt()
    picked = ref.gather(-1, x.argmax(-1, keepdim=True)).squeeze(-1)
    return float((picked >= ref.max(-1).values - sigmas * err).double().mean())


def topk_overlap(topk: torch.Tensor, ref_topk: torch.Tensor) -> float:
    """Mean over rows of |selected ∩ reference-selected| / |reference-selected| (−1 entries ignored)."""
    scores = []
    for row, ref_row in zip(topk.tolist(), ref_topk.tolist()):
        ref_set = {i for i in ref_row if i >= 0}
        scores.append(len(ref_set & {i for i in row if i >= 0}) / len(ref_set))
    return sum(scores) / len(scores)
