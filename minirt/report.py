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


def topk_overlap(topk: torch.Tensor, ref_topk: torch.Tensor) -> float:
    """Mean over rows of |selected ∩ reference-selected| / |reference-selected| (−1 entries ignored)."""
    scores = []
    for row, ref_row in zip(topk.tolist(), ref_topk.tolist()):
        ref_set = {i for i in ref_row if i >= 0}
        scores.append(len(ref_set & {i for i in row if i >= 0}) / len(ref_set))
    return sum(scores) / len(scores)
