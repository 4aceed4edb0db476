"""A first run, tried as a new user would: each defect of what the command line and the Python API
show a newcomer on a CPU machine, through the real entry points (``python -m minirt`` in a subprocess,
typer's runner in-process where that is enough, the public Python API)."""
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from test_cli_defects import SGR, _env, no_loading, run  # noqa: F401  (no_loading: a fixture)
from typer.testing import CliRunner

import minirt
from minirt.models.deepseek_v32.checkpoint import plan_load
from minirt.cli import app
from minirt.context import KVStash
from minirt.models.deepseek_v32.context import decode_context, prefill_context
from minirt.errors import InputError
from minirt.generate import generate
from minirt.models.deepseek_v32.layers import DecoderLayer
from minirt.sampling import SamplingParams

runner = CliRunner()

# Inductor's C++ backend would add minutes of compile time on CPU; aot_eager still traces the graph
# through every op's fake implementation.
COMPILE_BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def memory_limit(limit: int):
    """A preexec_fn capping a child's data segment (heap and anonymous maps) at ``limit`` bytes, so a
    regression fails that child instead of the machine."""
    return lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


# torch.compile of a whole layer ------------------------------------------------------------------------


@torch.no_grad()
def test_a_whole_decoder_layer_compiles_with_fullgraph(tiny_master):
    engine = minirt.load(tiny_master, layers=1, device=DEVICE, indexer_precision="fp8")  # every kernel of a layer
    cfg, layer = engine.cfg, engine.model.model.layers[0]
    engine.setup_cache(1, 16)
    T = 8  # the indexer still scores and selects (every position: T < index_topk); the interpreter is slow
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE, engine.dtype)

    def prefill_ctx():
        return prefill_context(cfg, [T], cache=engine.cache, stash=KVStash([T], DEVICE), rope=engine._rope,
                               device=DEVICE)

    eager = layer(x, prefill_ctx())
    compiled = torch.compile(layer, fullgraph=True, backend=COMPILE_BACKEND, dynamic=False)
    out = compiled(x, prefill_ctx())
    assert torch.isfinite(out).all()
    assert float((out.float() - eager.float()).norm() / eager.float().norm()) < 1e-2
    engine.cache.seq_lens[:1] = T
    step = decode_context(cfg, engine.cache, 1, engine._rope)
    eager_step = layer(x[:1], step)  # writes position T; the compiled step rewrites the same slot
    compiled_step = compiled(x[:1], decode_context(cfg, engine.cache, 1, engine._rope))
    assert compiled_step.shape == (1, cfg.hidden_size) and torch.isfinite(compiled_step).all()
    # One token: where Inductor fuses the bf16 elementwise ops between kernels (rounding once, not per op),
    # a few e4m3 activation roundings of the fp8 GEMMs flip (2^-4 each); measured 1.2% on the H200.
    assert float((compiled_step.float() - eager_step.float()).norm() / eager_step.float().norm()) < 3e-2


def test_opcheck_the_ops_the_layers_call():
    from minirt.kernels import new_index_cache

    gen, check = torch.Generator().manual_seed(3), ("test_schema", "test_faketensor")
    cache = new_index_cache(2, 16, device=DEVICE)
    keys = torch.randn(5, 128, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 3, 17, -1, 30], device=DEVICE)
    torch.library.opcheck(torch.ops.minirt.write_index_keys, (cache, keys, slots), test_utils=check)
    torch.library.opcheck(torch.ops.minirt.quantize_act_fp8, (torch.randn(3, 256, generator=gen).to(DEVICE),),
                          test_utils=check)
    exact_keys = torch.randn(2, 16, 128, generator=gen).to(DEVICE)  # the exact cache: fp32 keys in pages
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
    limit = torch.tensor([[20, 31]], device=DEVICE)
    q = torch.randn(1, 2, 2, 128, generator=gen).to(DEVICE)
    args = (q, torch.rand(1, 2, 2, generator=gen).to(DEVICE), exact_keys, table, limit)
    torch.library.opcheck(torch.ops.minirt.paged_indexer_scores, args, test_utils=check)
    scores = torch.ops.minirt.paged_indexer_scores(*args)
    torch.library.opcheck(torch.ops.minirt.indexer_topk, (scores, 8), test_utils=check)


# The Python API raises MinirtError subclasses ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_master):
    return minirt.load(tiny_master, device=DEVICE)


def test_prefill_of_a_flat_token_list_names_the_expected_nesting(tiny_engine):
    with pytest.raises(InputError, match=r"list of prompts, each a list of token ids"):
        tiny_engine.prefill([1, 2, 3])


def test_verify_with_engines_of_different_layer_counts_is_an_input_error(tiny_master):
    from minirt.models.deepseek_v32.verify import run_verify

    engine = minirt.load(tiny_master, layers=1, device=DEVICE)
    oracle = minirt.load(tiny_master, layers=2, device=DEVICE, backend="reference")
    with pytest.raises(InputError, match="the engine has 1 layer.*the oracle 2"):
        run_verify(engine, oracle, 8, 1)


def test_a_layer_past_the_cache_or_a_batched_input_is_an_input_error(tiny_master):
    engine = minirt.load(tiny_master, layers=1, device=DEVICE)
    engine.setup_cache(1, 16)
    layer = DecoderLayer(engine.cfg, layer_index=1).to(DEVICE)
    ctx = prefill_context(engine.cfg, [4], cache=engine.cache, device=DEVICE)
    with pytest.raises(InputError, match="layer_index 1 has no cache.*holds 1 layer"):
        layer(torch.randn(4, engine.cfg.hidden_size, device=DEVICE), ctx)
    first = DecoderLayer(engine.cfg, layer_index=0).to(DEVICE)
    with pytest.raises(InputError, match=r"x must be a float tensor \[N, 256\].*got \(1, 4, 256\)"):
        first(torch.randn(1, 4, engine.cfg.hidden_size, device=DEVICE), ctx)
    assert DecoderLayer.forward.__doc__ and "[N, hidden]" in DecoderLayer.forward.__doc__


# 1. Loading holds one copy of the weights --------------------------------------------------------------


PEAK_SCRIPT = """
import sys, minirt
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
minirt.load(sys.argv[2], device="cpu")  # imports, thread pools and the interpreter stay out of the peak
open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident size (VmHWM)
base = status("VmRSS")
engine = minirt.load(sys.argv[1], device="cpu", backend=sys.argv[3])
weights = engine.model.parameters() if sys.argv[3] == "triton" else engine.model.weights.values()
print(status("VmHWM") - base, sum(w.numel() * w.element_size() for w in weights))
"""


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """One layer with a 32k vocabulary at hidden 1024: about 340 MB of fp32 weights, most of them in
    the two bf16 [vocab, hidden] tensors."""
    import dataclasses

    from minirt import synthetic

    tiny = synthetic.PRESETS["tiny"]
    cfg = dataclasses.replace(tiny.config, vocab_size=32768, hidden_size=1024, intermediate_size=2048,
                              num_hidden_layers=1, first_k_dense_replace=1)
    synthetic.PRESETS["wide"] = dataclasses.replace(tiny, config=cfg)
    try:
        return synthetic.write_synthetic_checkpoint(tmp_path_factory.mktemp("wide") / "wide", preset="wide")
    finally:
        del synthetic.PRESETS["wide"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to measure peak memory")
def test_loading_peaks_at_one_copy_of_the_weights(wide_checkpoint, tiny_master):
    # Both backends load through checkpoint.load_checkpoint; the runtime's is the one a user meets first.
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(wide_checkpoint), str(tiny_master), "triton"],
                            capture_output=True, text=True, timeout=300, preexec_fn=memory_limit(3 << 30))
    assert result.returncode == 0, result.stderr
    peak, weights = map(int, result.stdout.split())
    assert weights > 300e6
    # Beyond the weights: a few 16 MiB read chunks and their casts (the allocator keeps some), about
    # 150 MB whatever the checkpoint's size; a second full copy would be 300 MB more.
    assert peak - weights < 200e6, f"loading {weights / 1e6:.0f} MB of weights peaked at {peak / 1e6:.0f} MB"


# 2, 12. generate: a batch's every sequence; token ids without a trailing space; plurals -------------------


def test_generate_batch_prints_every_sequence_as_the_api_returns_them(tiny_master):
    result = runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1,2,3", "--batch", "2", "-n", "6",
                                 "--temperature", "1", "--seed", "3", "--backend", "reference", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    oracle = minirt.load(tiny_master, backend="reference", device="cpu")
    expected = generate(oracle, [[1, 2, 3]] * 2, 6, SamplingParams(temperature=1.0, seed=3), oracle.cfg.eos_token_id)
    assert expected.tokens[0] != expected.tokens[1]
    assert result.stdout == "".join(f"sequence {i}: {' '.join(map(str, t))}\n" for i, t in enumerate(expected.tokens))


def test_generate_token_ids_plurals_and_strict_token_list(tiny_master):
    result = runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1,2,3", "-n", "2", "--backend", "reference",
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"\d+ \d+\n", result.stdout)  # no trailing space
    assert "decode: 1 step × batch 1 = 1 token, " in result.stderr
    one = runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1", "-n", "1", "--backend", "reference",
                              "--device", "cpu"])
    assert one.exit_code == 0 and "stopped: 1 token, the --max-new-tokens limit\n" in one.stderr
    bad = runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1,,2"])
    assert bad.exit_code == 2 and bad.stderr == "minirt: error: --tokens must be comma-separated integers, got '1,,2'\n"


# 10. verify says what is in memory ----------------------------------------------------------------------


def test_verify_says_the_weights_are_fp32_in_memory_on_the_cpu(tiny_master, monkeypatch):
    import minirt.models.deepseek_v32
    import minirt.report

    def checked(engine, *args, **kwargs):  # the comparison itself is tested elsewhere: the header here
        assert next(engine.model.parameters()).dtype == torch.float32
        return minirt.report.VerifyReport([], 40, 1)

    monkeypatch.setattr(minirt.models.deepseek_v32, "run_verify", checked)
    result = runner.invoke(app, ["verify", str(tiny_master), "--layers", "1", "--prompt-len", "40", "--decode-steps",
                                 "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "the runtime (fp32 weights, dequantised at load) against the eager fp32 reference, 1 layer, " \
           "40 prompt tokens + 1 decode step, cpu" in result.stdout


# 5. messages speak the command line's language ----------------------------------------------------------


def test_command_line_errors_name_command_line_options(tmp_path, tiny_master, monkeypatch, no_loading):
    import minirt.cli

    busy = tmp_path / "weights" / "tiny"
    busy.mkdir(parents=True)
    (busy / "notes.txt").write_text("mine")
    monkeypatch.setenv("MINIRT_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setattr(minirt.cli, "TINY_DIR", busy)
    lines = {
        "generate": runner.invoke(app, ["generate"]).stderr,
        "init": runner.invoke(app, ["init", str(busy)]).stderr,
        "layers": runner.invoke(app, ["init", str(tmp_path / "new"), "--layers", "0"]).stderr,
        "tokens": runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1,999999"]).stderr,
    }
    assert lines["generate"] == f"minirt: error: {busy} holds other files, not the tiny default checkpoint: move them " \
                                "away, or replace them with `minirt init --force`\n"
    assert lines["init"] == f"minirt: error: {busy} is not empty; --force replaces it\n"
    assert lines["layers"] == "minirt: error: --layers must be a whole number >= 1, got 0\n"
    assert lines["tokens"] == "minirt: error: --tokens: token id 999999 is outside the vocabulary [0, 512)\n"
    assert not any(word in text for text in lines.values() for word in ("force=True", "num_layers", "prompt 0"))


def test_writing_the_default_checkpoint_says_so_off_a_terminal(tmp_path, monkeypatch):
    import minirt.cli

    monkeypatch.setenv("MINIRT_WEIGHTS", str(tmp_path))
    monkeypatch.setattr(minirt.cli, "TINY_DIR", tmp_path / "tiny")
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"writing the tiny default checkpoint (random weights) to {tmp_path / 'tiny'}, once")


# 7. download checks its arguments before the network and leaves nothing behind ---------------------------


@pytest.mark.parametrize("args, message", [
    (["notarepo"], "'notarepo' is not a repository id: expected OWNER/NAME, e.g. deepseek-ai/DeepSeek-V3.2"),
    (["deepseek-ai/DeepSeek-V3.2", "--layers", "0"], "--layers must be a whole number >= 1, got 0"),
    (["deepseek-ai/DeepSeek-V3.2", "--layers", "-2"], "--layers must be a whole number >= 1, got -2"),
])
def test_download_refuses_bad_arguments_before_the_network(tmp_path, monkeypatch, args, message):
    import minirt.download

    monkeypatch.setattr(minirt.download, "download_checkpoint", lambda *a, **k: pytest.fail("network reached"))
    result = runner.invoke(app, ["download", *args[:1], str(tmp_path / "out"), *args[1:]])
    assert result.exit_code == 2 and result.stderr == f"minirt: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_a_failed_download_leaves_no_directory(tmp_path, monkeypatch):
    import minirt.download

    def unreachable(repo_id, out_dir, *args, **kwargs):
        (Path(out_dir) / ".cache" / "huggingface").mkdir(parents=True)  # the hub client's bookkeeping
        raise minirt.download.DownloadError("cannot reach the hub")

    monkeypatch.setattr(minirt.download, "download_checkpoint", unreachable)
    result = runner.invoke(app, ["download", "someone/model", str(tmp_path / "weights" / "model")])
    assert result.exit_code == 2 and result.stderr == "minirt: error: cannot reach the hub\n"
    assert list(tmp_path.iterdir()) == []


# 3, 6. init: SIGTERM cleans up as Ctrl-C does; stale temporaries; two at once; a mount point -------------


SLOW_INIT = """
import sys, time
import minirt.synthetic as synthetic
write = synthetic._write_files
def write_then_wait(tmp, *args):
    write(tmp, *args)
    print("written", flush=True)
    time.sleep(120)
synthetic._write_files = write_then_wait
from minirt.cli import app
app(prog_name="minirt")
"""


def test_sigterm_during_init_leaves_no_temporary(tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_INIT, "init", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline() == "written\n"  # the temporary directory is full now
        assert [p.name for p in tmp_path.iterdir()][0].startswith(".ckpt.tmp-")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, proc.stderr.read()
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []


def test_init_clears_the_temporaries_of_earlier_killed_writes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".ckpt.tmp-{dead.pid}-0123456789ab", tmp_path / ".ckpt.tmp-0123456789ab"]
    alive = tmp_path / f".ckpt.tmp-{os.getpid()}-abcdefabcdef"  # a write running now (this process)
    for d in (*stale, alive):
        d.mkdir()
        (d / "model-00001-of-000004.safetensors").write_bytes(b"partial")
    result = runner.invoke(app, ["init", str(tmp_path / "ckpt"), "--layers", "1"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "ckpt"])


def test_two_inits_into_one_directory_both_succeed(tmp_path):
    out = tmp_path / "ckpt"
    procs = [subprocess.Popen([sys.executable, "-m", "minirt", "init", str(out), "--layers", "1"],
                              stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert all(code == 0 for code, _ in results), results
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and plan_load(out).num_layers == 1


def test_init_into_a_mount_point_says_why_not(tmp_path, monkeypatch):
    mount = tmp_path / "disk"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real_ismount(p))
    result = runner.invoke(app, ["init", str(mount)])
    assert result.exit_code == 2
    assert result.stderr == f"minirt: error: {mount} is a mount point, which a checkpoint written elsewhere cannot be " \
                            f"renamed onto: write into a directory inside it, e.g. minirt init {mount / 'tiny'}\n"


# 11. Ctrl-C in generate ends the line and counts the tokens ----------------------------------------------


def test_ctrl_c_in_generate_ends_the_line_and_says_how_many_tokens(tiny_master):
    proc = subprocess.Popen([sys.executable, "-m", "minirt", "generate", str(tiny_master), "--tokens", "1,2,3",
                             "-n", "100000", "--backend", "reference", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            # as a terminal's Ctrl-C finds it: a background job inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)  # the first token is out: generation runs
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    text = (first + stdout).decode()
    assert text.endswith("\n") and not text.endswith(" \n")
    count = len(text.split())
    assert re.search(rf"^stopped: interrupted after {count} tokens? of at most 100000$", stderr.decode(), re.M), stderr


# 12, #27.2. The progress bar fits 80 columns and ends with the work; the next phase says what it is ------


def test_loading_bar_fits_80_columns_and_the_next_phase_is_named(tiny_master):
    result = run("generate", str(tiny_master), "--tokens", "1,2", "-n", "1", tty=("stderr",), columns=80)
    assert result.returncode == 0, result.stderr
    frames = [SGR.sub("", f) for f in re.split(r"[\r\n]", result.stderr) if "loading" in f or "building" in f]
    assert any("loading (triton)" in f for f in frames) and any("building the triton engine" in f for f in frames)
    assert all(len(f) <= 80 for f in frames), max(frames, key=len)
    total = f"{plan_load(tiny_master).num_bytes / 1e6:.1f}/{plan_load(tiny_master).num_bytes / 1e6:.1f} MB"
    assert sum(total in f for f in frames) <= 2  # the finished bar: drawn once (and erased), not redrawn


# 4, #27.1, #27.3. Long work says how long; warm-up apart from the figures; what the decode figure counts -


def test_generate_notes_a_long_prefill_and_keeps_the_warm_up_apart(tiny_master, monkeypatch):
    import minirt.cli

    monkeypatch.setattr(minirt.cli._LongRunNote, "AFTER_S", 0.0)  # any rest is "long" here
    monkeypatch.setattr(minirt.cli._LongRunNote, "OVER_S", 0.0)
    result = runner.invoke(app, ["generate", str(tiny_master), "--tokens", "1,2,3", "-n", "3", "--prefill-chunk", "1",
                                 "--warm-up", "yes", "--device", DEVICE])
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert re.search(r"^minirt: [12] more prompt tokens at [\d.]+ tok/s take about \d+ s; Ctrl-C stops$", err, re.M), err
    assert re.search(r"^warm-up: [\d.]+ s, not in the figures below \(Triton compiles the kernels", err, re.M), err
    assert re.search(r"decode: 2 steps × batch 1 = 2 tokens, [\d,.]+ tok/s with sampling and streaming; the engine's "
                     r"steps alone [\d,.]+ steps/s", err), err


def test_generate_refuses_a_batch_that_cannot_fit_before_loading(tiny_master, no_loading):
    result = runner.invoke(app, ["generate", str(tiny_master), "--batch", "100000000", "--tokens", "1,2,3", "-n", "4"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert re.fullmatch(r"minirt: error: generate --batch 100000000 over 3 \+ 4 tokens needs about [\d.]+ [kMGTP]B on "
                        r"\w+ \(weights, cache, prefill latents\), [\d.]+ [kMGT]B is available: at most --batch \d+ fits",
                        line), line


# 12. --help lists a choice option's choices -------------------------------------------------------------


def test_help_lists_the_choices_of_choice_options():
    flat = lambda command: re.sub(r"\s+", " ", runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output)
    assert "--preset tiny|v32" in flat("init")
    for option, choices in (("--backend", "triton|reference"), ("--indexer-precision", "exact|fp8"),
                            ("--weights", "fp8|bf16"), ("--warm-up", "auto|yes|no")):
        assert f"{option} {choices}" in flat("generate"), option
    assert "--weights fp8|bf16" in flat("verify")
    verify_help = runner.invoke(app, ["verify", "--help"], env={"COLUMNS": "200"}).output
    assert "Refuses (exit 2) a length past max_position_embeddings" in verify_help  # a paragraph, not cut lines
    bad = runner.invoke(app, ["generate", "--backend", "cuda"])
    assert bad.exit_code == 2 and bad.stderr == "minirt: error: --backend must be one of triton, reference, got 'cuda'\n"


# 13, #27.4. The README: the CPU build before the install command; what a first run costs -----------------


def test_readme_puts_the_cpu_build_first_and_says_what_a_first_run_costs():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert readme.index("--index-url https://download.pytorch.org/whl/cpu") < readme.index("-e . && minirt generate")
    assert re.search(r"whole suite takes about \S+ minutes on a 2-core machine", readme)
    costs = readme[readme.index("### What a first run costs"):readme.index("Arguments are checked before")]
    gpu, cpu = (next(row for row in costs.splitlines() if row.startswith(f"| {m} |")) for m in ("GPU", "CPU"))
    assert "compiles every kernel" in gpu and "CUDA graph" in gpu and "warm-up" in gpu
    assert "interpreter" in cpu
    assert "fp32 in memory on the CPU" in readme  # weights="bf16" there
