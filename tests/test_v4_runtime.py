"""The DeepSeek-V4 kernel runtime (EngineV4) against the eager reference, through the CLI: ``minirt verify``
on v4-tiny over a prompt longer than one prefill chunk and than the 128-token window (so the window ring
wraps, the HCA compressor completes a 128-token window and its state crosses chunks), then decode steps
reading the fp8 MODEL1 caches. Runs on CUDA when available, else on the CPU under the Triton interpreter."""
import json

import pytest
from typer.testing import CliRunner

from minirt.cli import app
from minirt.synthetic import write_synthetic_checkpoint

from conftest import DEVICE


@pytest.fixture(scope="module")
def v4_tiny(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("v4rt") / "v4-tiny", preset="v4-tiny", seed=0)


def test_verify_v4_tiny_across_chunks_and_window(v4_tiny):
    # Three layers: SWA, CSA, HCA (every cache kind); 132 tokens in chunks of 64 (three prefill steps, the
    # last one completing the first HCA window), then two decode steps.
    args = ["verify", str(v4_tiny), "--layers", "3", "--prompt-len", "132", "--prefill-chunk", "64",
            "--decode-steps", "2", "--device", DEVICE, "--json"]
    result = CliRunner().invoke(app, args)
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"hidden[0]", "hidden[1]", "hidden[2]", "attention[0]", "attention[1]", "attention[2]",
                           "topk_overlap[1]", "prefill_logits", "decode_logits", "top1_agreement"}
    assert result.exit_code == 0, [c for c in report["checks"] if not c["ok"]]
    assert all(c["ok"] for c in report["checks"])
    # Not vacuous: the runtime's numbers differ from the reference's by its roundings, and by no more.
    assert 0 < checks["hidden[0]"]["value"] < 0.1 and checks["topk_overlap[1]"]["value"] > 0.8
