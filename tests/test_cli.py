"""The command line, end to end through typer's runner: outputs, exit codes, one-line errors."""
import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import minirt
from minirt.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = runner.invoke(app, ["init", str(out), "--preset", "tiny", "--seed", "2", "--layers", "2"])  # the dense ones
    assert result.exit_code == 0, result.output
    return out


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("init", "info", "generate", "verify"):
        assert command in result.output


def test_init_refuses_non_empty_dir_without_force(tiny):
    result = runner.invoke(app, ["init", str(tiny)])
    assert result.exit_code == 2
    assert "minirt: error:" in result.output and "Traceback" not in result.output
    assert runner.invoke(app, ["init", str(tiny), "--seed", "2", "--layers", "2", "--force"]).exit_code == 0


def test_info_reports_shards_and_parameters(tiny):
    result = runner.invoke(app, ["info", str(tiny), "--layers", "1"])
    assert result.exit_code == 0, result.output
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {index[n] for n in index if not n.startswith("model.layers.1.")}
    for shard in needed:
        assert shard in result.output


def test_info_refuses_moe_layers(tiny):
    result = runner.invoke(app, ["info", str(tiny), "--layers", "3"])
    assert result.exit_code == 2
    assert "at most 2" in result.output


def test_generate_text_streams_and_reports_speed(tiny):
    result = runner.invoke(app, ["generate", str(tiny), "--prompt", "hello", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert re.search(r"prefill: \d+ tokens, [\d,.]+ tok/s", result.output)
    assert "decode: 3 steps" in result.output


def test_generate_token_ids_equal_library_greedy(tiny):
    result = runner.invoke(app, ["generate", str(tiny), "--tokens", "5,6,7", "-n", "3"])
    assert result.exit_code == 0, result.output
    engine = minirt.load(tiny)
    engine.setup_cache(1, 8)
    expected = [int(engine.prefill([[5, 6, 7]]).argmax())]
    for _ in range(2):
        expected.append(int(engine.decode(torch.tensor(expected[-1:])).argmax()))
    assert " ".join(map(str, expected)) in result.output


@pytest.mark.parametrize("args, message", [
    (["--tokens", "1,x"], "comma-separated integers"),
    (["--tokens", "1,999999"], "outside the vocabulary"),
    (["--prompt", ""], "empty"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
])
def test_generate_bad_input_is_one_line_exit_2(tiny, args, message):
    result = runner.invoke(app, ["generate", str(tiny), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("minirt: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in result.output


def test_verify_json_ok(tiny):
    result = runner.invoke(app, ["verify", str(tiny), "--json", "--prompt-len", "40", "--decode-steps", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["ok"] and all(c["ok"] for c in report["checks"])


def test_verify_exits_non_zero_on_mismatch(tiny, monkeypatch):
    real_load = minirt.load

    def perturbed_load(*args, **kwargs):
        engine = real_load(*args, **kwargs)
        if engine.backend == "reference":  # verify loads the oracle through minirt.load too
            return engine
        o_proj = engine.model.model.layers[0].self_attn.o_proj
        w = getattr(o_proj, "weight_scale_inv", o_proj.weight)  # fp8 weights: scale their block scales
        with torch.no_grad():
            w.mul_(1.5)
        return engine

    monkeypatch.setattr(minirt, "load", perturbed_load)
    result = runner.invoke(app, ["verify", str(tiny), "--prompt-len", "40", "--decode-steps", "1"])
    assert result.exit_code == 1
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("FAIL: ") and "hidden[0]" in verdict


def test_missing_checkpoint_is_one_line_exit_2(tmp_path: Path):
    result = runner.invoke(app, ["info", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.output.startswith("minirt: error:")
