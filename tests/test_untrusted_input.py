"""A checkpoint, its config and the command line are untrusted input (issue #26): no file name escapes the
checkpoint directory, no size from a file or an argument allocates without a bound, nothing blocks on a
FIFO or a silent hub, and every bad input is one line ``minirt: error: ...`` and exit 2 (the Python API:
a MinirtError with the same message), never a traceback or a wrong result with exit 0.

The cases that would exhaust memory or hang on a regression run in one child process under a memory
limit (RLIMIT_AS) with a timeout per case (SIGALRM), so that a regression fails here instead of taking
the machine down; the others run in-process through typer's runner, as tests/test_hardening.py does.
"""
import errno
import http.server
import json
import math
import os
import re
import resource
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import minirt
from minirt.models.deepseek_v32.checkpoint import load_checkpoint, plan_load
from minirt.device import resolve_device
from minirt.shards import INDEX_FILE
from minirt.cli import app
from minirt.config import ModelConfig
from minirt.download import download_checkpoint
from minirt.errors import CheckpointError, ConfigError, DeviceError, InputError, MinirtError, NumericalError, WriteError
from minirt.sampling import SamplingParams
from minirt.synthetic import PRESETS, write_synthetic_checkpoint
from minirt.tokenizer import load_tokenizer
from conftest import DEVICE
from test_cli_defects import _env, no_loading, one_error_line  # noqa: F401 (no_loading is a fixture)
from test_download import REPO, Hub
from test_hardening import runner, shard_of

CHILD_MEMORY = 3 << 30  # private writable memory of a child (RLIMIT_DATA, not RLIMIT_AS: CUDA builds map GBs of
                        # libraries and reserve address space they never touch); the tiny model needs far less
CASE_SECONDS = 60       # per case in the child; every case passes in a few seconds


def error_line(result) -> str:
    """The one error line of a CliRunner result with exit code 2 (and nothing on stdout)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minirt: error: "), result.stderr
    return lines[0]


def edit_config(ckpt: Path, **changes) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (raw[section] if section else raw)[field] = value
    (ckpt / "config.json").write_text(json.dumps(raw))


def edit_tensor(ckpt: Path, name: str, edit) -> Path:
    shard = shard_of(ckpt, name)
    with safe_open(str(shard), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def remap(ckpt: Path, shard: Path, new_name: str) -> None:
    """Point every tensor of ``shard`` at ``new_name`` in the index."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"] = {t: new_name if s == shard.name else s for t, s in index["weight_map"].items()}
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


# ---------------------------------------------------------------------------------------------------
# Memory bombs and hangs: one child process, memory-limited, a timeout per case.

CHILD = r"""
import json, os, signal, sys, traceback
from typer.testing import CliRunner
from minirt.cli import app

class Timeout(BaseException):
    pass

def alarm(signum, frame):
    raise Timeout()

signal.signal(signal.SIGALRM, alarm)
results = {}
for case in json.loads(sys.argv[1]):
    os.chdir(case["cwd"])
    signal.alarm(case["seconds"])
    try:
        if "argv" in case:
            r = CliRunner().invoke(app, case["argv"], env=case.get("env"))
            exc = r.exception if not isinstance(r.exception, SystemExit) else None
            results[case["id"]] = {"exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                                   "exception": None if exc is None else "".join(traceback.format_exception(exc))}
        else:
            try:
                exec(case["code"], {})
                results[case["id"]] = {"raised": None}
            except Exception as e:
                results[case["id"]] = {"raised": type(e).__name__, "message": str(e), "mro": [c.__name__ for c in type(e).__mro__]}
    except Timeout:
        results[case["id"]] = {"timeout": True}
    finally:
        signal.alarm(0)
print(json.dumps(results))
"""


def limit_memory():
    resource.setrlimit(resource.RLIMIT_DATA, (CHILD_MEMORY, CHILD_MEMORY))


def sparse_file(path: Path, size: int, head: bytes = b"") -> None:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole."""
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)


class Silent:
    """A hub that accepts connections (the kernel's backlog does) and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"


class Failing:
    """A hub that answers every request with HTTP ``status``; counts the requests."""

    def __init__(self, status: int):
        self.requests = 0
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self):
                hub.requests += 1
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.send_header("Retry-After", "100000")  # a hub may not make the client sleep this long
                self.end_headers()

            do_GET = do_HEAD = answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def bomb_and_hang_cases(tiny_master, root: Path, hubs) -> list[dict]:
    """(the child's case list, what each case must show), built on copies of the tiny checkpoint."""

    def ckpt(name: str) -> Path:
        return shutil.copytree(tiny_master, root / name)

    cases = []

    def cli(case_id, argv, cwd=None, env=None):
        cases.append({"id": case_id, "argv": [str(a) for a in argv], "cwd": str(cwd or root), "env": env,
                      "seconds": CASE_SECONDS})

    def api(case_id, code):
        cases.append({"id": case_id, "code": code, "cwd": str(root), "seconds": CASE_SECONDS})

    c = ckpt("topk")
    edit_config(c, index_topk=10**9)
    cli("index_topk 1e9", ["generate", c, "--tokens", "1,2", "-n", "1"])
    c = ckpt("header")
    shard = shard_of(c, "lm_head.weight")
    sparse_file(shard, 16 << 30, (16 << 30).to_bytes(8, "little"))  # a header declared 16 GiB long
    cli("16 GiB header", ["info", c])
    c = ckpt("config16")
    sparse_file(c / "config.json", 16 << 30, b'{"model_type": "deepseek_v32", "pad": "')
    cli("16 GiB config.json", ["info", c])
    c = ckpt("zero")
    (c / "config.json").unlink()
    (c / "config.json").symlink_to("/dev/zero")
    cli("/dev/zero as config.json", ["info", c])
    cli("--batch 1e7", ["generate", tiny_master, "--tokens", "1,2", "-n", "1", "--batch", "10000000"])
    cli("init --layers 1e8", ["init", root / "huge", "--layers", "100000000"])
    for name, where in (("config.json", "config.json"), ("index", INDEX_FILE), ("shard", "model-00002-of-000004.safetensors")):
        c = ckpt(f"fifo-{name}")
        (c / where).unlink()
        os.mkfifo(c / where)
        cli(f"FIFO as {name}: info", ["info", c])
    c = ckpt("fifo-tokenizer")
    (c / "tokenizer.json").unlink()
    os.mkfifo(c / "tokenizer.json")
    cli("FIFO as tokenizer.json: generate", ["generate", c, "-n", "1"])
    c = root / "fifo-config.json"  # made above
    cli("FIFO as config.json: init", ["init", c])
    api("FIFO as config.json: minirt.load", f"import minirt; minirt.load({str(c)!r}, device='cpu')")
    api("FIFO as config.json: ModelConfig.from_file",
        f"from minirt.config import ModelConfig; ModelConfig.from_file({str(c)!r})")
    silent, failing = hubs
    cli("silent hub", ["download", REPO, root / "dl-silent", "--endpoint", silent.url, "--timeout", "0.5",
                       "--retries", "1"], env={"HF_HOME": str(root / "hf-home")})
    cli("hub answering 500", ["download", REPO, root / "dl-500", "--endpoint", failing.url, "--timeout", "2",
                              "--retries", "2"], env={"HF_HOME": str(root / "hf-home")})
    return cases


EXPECTED = {
    # case id: pattern the one error line must match
    "index_topk 1e9": r"key 'index_topk' is 1,000,000,000, more than the 16,384 the DeepSeek-V3/V3.2 family allows",
    "16 GiB header": r"header length 17,179,869,184 exceeds the 100,000,000 bytes safetensors allows",
    "16 GiB config.json": r"config\.json: config\.json is 17,179,869,184 bytes, more than the 1,000,000 allowed",
    "/dev/zero as config.json": r"config\.json: config\.json is a character device, not a regular file",
    "--batch 1e7": r"generate --batch 10000000 over \d+ \+ \d+ tokens needs about [\d.]+ [kMGTP]B on \w+ \(weights, cache, prefill latents\), [\d.]+ [kMGTP]?B is available",
    "init --layers 1e8": r"num_layers is 100,000,000, more than the 1,024 layers the DeepSeek-V3/V3.2 family allows",
    "FIFO as config.json: info": r"config\.json: config\.json is a FIFO, not a regular file",
    "FIFO as index: info": re.escape(INDEX_FILE) + r": model\.safetensors\.index\.json is a FIFO, not a regular file",
    "FIFO as shard: info": r"model-00002-of-000004\.safetensors: shard of tensor model\.layers\.0\.\S+ is a FIFO, not a regular file",
    "FIFO as tokenizer.json: generate": r"tokenizer\.json: tokenizer\.json is a FIFO, not a regular file",
    "FIFO as config.json: init": r"is not empty; --force replaces it",
    "silent hub": r"acme/tiny-v32/config\.json from http://127\.0\.0\.1:\d+: no answer within 0\.5 s \(\w+\), 2 time\(s\) "
                  r"\(--retries 1, --timeout 0\.5 s\)",
    "hub answering 500": r"the hub answered HTTP 500, 3 time\(s\) \(--retries 2, --timeout 2 s\)",
}
API_EXPECTED = {
    "FIFO as config.json: minirt.load": ("ConfigError", r"config\.json: config\.json is a FIFO, not a regular file"),
    "FIFO as config.json: ModelConfig.from_file": ("ConfigError", r"config\.json: config\.json is a FIFO, not a regular file"),
}


@pytest.fixture(scope="module")
def child(tiny_master, tmp_path_factory):
    """Runs every bomb-and-hang case in one memory-limited child; returns (results, root, hubs)."""
    root = tmp_path_factory.mktemp("untrusted")
    silent, failing = Silent(), Failing(500)
    cases = bomb_and_hang_cases(tiny_master, root, (silent, failing))
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                              env=_env(HF_HUB_DISABLE_TELEMETRY="1"), preexec_fn=limit_memory,
                              timeout=CASE_SECONDS * len(cases))
    finally:
        silent.sock.close()
        failing.server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), root, failing


@pytest.mark.parametrize("case", EXPECTED)
def test_bomb_or_hang_is_one_line_exit_2(child, case):
    results, root, _ = child
    r = results[case]
    assert not r.get("timeout"), f"{case}: still running after {CASE_SECONDS} s"
    assert r["exception"] is None, r["exception"]
    assert r["exit"] == 2 and r["stdout"] == "", r
    lines = r["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("minirt: error: "), r["stderr"]
    assert re.search(EXPECTED[case], lines[0]), lines[0]
    assert "does not exist" not in lines[0] and "not found" not in lines[0]


@pytest.mark.parametrize("case", API_EXPECTED)
def test_api_on_a_fifo_raises_instead_of_blocking(child, case):
    results, _, _ = child
    r = results[case]
    assert not r.get("timeout"), f"{case}: still blocked after {CASE_SECONDS} s"
    kind, pattern = API_EXPECTED[case]
    assert r["raised"] == kind and "MinirtError" in r["mro"], r
    assert re.search(pattern, r["message"]), r["message"]


def test_nothing_is_left_behind_by_refused_init_and_failed_downloads(child):
    _, root, failing = child
    assert not (root / "huge").exists() and not list(root.glob(".huge*"))
    assert not (root / "dl-silent").exists() and not (root / "dl-500").exists()
    assert failing.requests == 3  # the first try and the 2 retries, then no more


# ---------------------------------------------------------------------------------------------------
# Path traversal: a name in the index may not leave the checkpoint directory; a symlink in it may.


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_shard_name_outside_the_checkpoint_is_refused(tiny, tmp_path, escape):
    shard = shard_of(tiny, "lm_head.weight")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(shard, outside / "evil.safetensors")
    remap(tiny, shard, "../outside/evil.safetensors" if escape == "relative" else str(outside / "evil.safetensors"))
    with pytest.raises(CheckpointError, match="not a file name inside") as error:
        plan_load(tiny)
    line = error_line(runner.invoke(app, ["info", str(tiny)]))
    assert line == f"minirt: error: {error.value}"
    error_line(runner.invoke(app, ["generate", str(tiny), "--tokens", "1,2", "-n", "1"]))


def test_a_symlink_inside_the_checkpoint_may_point_elsewhere(tiny, tmp_path):
    shard = shard_of(tiny, "lm_head.weight")
    moved = shutil.move(shard, tmp_path / "blob")
    shard.symlink_to(moved)  # as a Hugging Face cache snapshot links into blobs/
    assert plan_load(tiny).shard_files[-1] == shard


# ---------------------------------------------------------------------------------------------------
# Sizes from a file or an argument: config dims against what the family allows, the disk for init.

OUT_OF_FAMILY = {
    "vocab_size": 1 << 21, "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_hidden_layers": 10**8,
    "num_attention_heads": 4096, "q_lora_rank": 1 << 15, "kv_lora_rank": 1 << 15, "qk_nope_head_dim": 2048,
    "v_head_dim": 2048, "max_position_embeddings": 1 << 25, "first_k_dense_replace": 10**9, "index_n_heads": 4096,
    "index_head_dim": 2048, "index_topk": 10**9, "rope_scaling__original_max_position_embeddings": 1 << 25,
    "rope_theta": 1.0, "rms_norm_eps": 2.0, "rope_scaling__factor": 0.5, "rope_scaling__beta_fast": 1e5,
    "rope_scaling__mscale_all_dim": 1e200, "rope_scaling__mscale": -1.0,
}


@pytest.mark.parametrize("key", OUT_OF_FAMILY)
def test_config_value_outside_the_family_names_key_and_bound(key):
    raw = PRESETS["v32"].config.to_dict()
    ModelConfig.from_dict(raw)  # the real dims pass
    section, _, field = key.rpartition("__")
    (raw[section] if section else raw)[field] = OUT_OF_FAMILY[key]
    with pytest.raises(ConfigError, match=rf"key '{field}' is .*(more than the [\d,]+|outside the range \S+, \S+\]) "
                                          "the DeepSeek-V3/V3.2 family allows"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("theta", [1.0, 5e-324])
def test_rope_theta_that_breaks_yarn_is_one_line_before_loading(tiny, theta, no_loading):
    edit_config(tiny, rope_theta=theta)
    line = error_line(runner.invoke(app, ["generate", str(tiny), "--tokens", "1,2", "-n", "1"]))
    assert "key 'rope_theta'" in line and "outside the range (1, 1e+12]" in line


def test_init_refuses_a_checkpoint_larger_than_the_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    with pytest.raises(WriteError, match=r"the checkpoint takes [\d,]+ bytes, the disk there has 1,000,000 free"):
        write_synthetic_checkpoint(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# Empty paths are errors, and arguments are checked before any directory is made.


@pytest.mark.parametrize("argv", [["init", ""], ["download", REPO, ""], ["info", ""], ["generate", "", "-n", "1"],
                                  ["download", "not a repo!!"]], ids=["init", "download", "info", "generate", "bad repo"])
def test_empty_path_or_bad_repo_writes_nothing(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    line = error_line(runner.invoke(app, argv, env={"MINIRT_WEIGHTS": str(tmp_path / "weights")}))
    assert "the path is empty" in line or "is not a repository id" in line
    assert list(tmp_path.iterdir()) == []


def test_empty_minirt_weights_is_an_error_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert error_line(runner.invoke(app, ["info"], env={"MINIRT_WEIGHTS": ""})) == \
        "minirt: error: MINIRT_WEIGHTS is an empty path"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("call", [lambda: write_synthetic_checkpoint(""), lambda: minirt.load(""),
                                  lambda: plan_load(""), lambda: download_checkpoint(REPO, "")],
                         ids=["write_synthetic_checkpoint", "load", "plan_load", "download_checkpoint"])
def test_api_refuses_an_empty_path(tmp_path, monkeypatch, call):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="is an empty path"):
        call()
    assert list(tmp_path.iterdir()) == []


def test_failed_download_removes_the_directory_it_made(tiny_master, tmp_path):
    hub = Hub(tiny_master)
    try:
        with pytest.raises(MinirtError, match="no such repository"):
            download_checkpoint(REPO + "-missing", tmp_path / "out", endpoint=hub.url)
    finally:
        hub.server.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_download_help_states_the_network_defaults():
    flat = re.sub(r"[\s│]+", " ", runner.invoke(app, ["download", "--help"]).output)
    assert re.search(r"--timeout SECONDS How long a connection or a read may wait\. \[default: 10\.0\]", flat), flat
    assert re.search(r"--retries \S+ Network failures .* tolerated per file before giving up\. \[default: 2\]", flat)


# ---------------------------------------------------------------------------------------------------
# One line instead of a traceback.


def every_number_option():
    """(command, option) for every int and float option of every command."""
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            # typer >= 0.2x vendors click and names the type bare_type(); older ones keep click's param.type
            kind = param.bare_type() if hasattr(param, "bare_type") else param.type
            if param.param_type_name == "option" and (str(kind) in ("int", "float")
                                                      or getattr(kind, "name", None) in ("integer", "float")):
                yield name, param.opts[0]


@pytest.mark.parametrize("command, option", list(every_number_option()))
def test_non_number_option_value_is_one_line(tiny_master, command, option, no_loading):
    argv = [command, REPO] if command == "download" else [command, str(tiny_master)]
    line = error_line(runner.invoke(app, [*argv, option, "ten"]))
    assert line.startswith(f"minirt: error: Invalid value for '{option}'") and line.endswith(f"(see `minirt {command} --help`)")


BAD_OPTIONS = {
    "--temperature nan": (["generate", "--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    "--temperature inf": (["generate", "--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    "generate --seed 2**70": (["generate", "--seed", str(2**70)], "seed must be a whole number in [0, 2^64)"),
    "verify --seed 2**70": (["verify", "--seed", str(2**70)], "seed must be a whole number in [0, 2^64)"),
    "generate --device xpu": (["generate", "--device", "xpu"], "device 'xpu': minirt runs on cpu or cuda only"),
    "verify --device meta": (["verify", "--device", "meta"], "device 'meta': minirt runs on cpu or cuda only"),
    "init --device meta": (["init", "{tmp}/new", "--device", "meta"], "device 'meta': minirt runs on cpu or cuda only"),
}


@pytest.mark.parametrize("argv, message", BAD_OPTIONS.values(), ids=BAD_OPTIONS)
def test_bad_option_value_is_one_line_before_loading(tiny_master, tmp_path, argv, message, no_loading):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] != "init":
        argv.insert(1, str(tiny_master))
    assert message in error_line(runner.invoke(app, [*argv, "--tokens", "1,2"] if argv[0] == "generate" else argv))
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("params", [dict(temperature=math.nan), dict(temperature=math.inf), dict(seed=2**70),
                                    dict(seed=-1), dict(top_k=1.5), dict(top_p=math.nan)])
def test_sampling_params_refuse_what_the_sampler_cannot_use(params):
    with pytest.raises(InputError, match=next(iter(params))):
        SamplingParams(**params)


@pytest.mark.parametrize("device", ["xpu", "meta", "mps"])
def test_devices_other_than_cpu_and_cuda_are_input_errors(tiny_master, device):
    with pytest.raises(InputError, match=f"device '{device}': minirt runs on cpu or cuda only"):
        resolve_device(device)
    with pytest.raises(InputError):
        minirt.load(tiny_master, device=device)


def test_prompt_that_is_not_utf8_is_one_line(tiny_master):
    # What Python makes of argv bytes that are not UTF-8: lone surrogates (surrogateescape).
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    line = error_line(runner.invoke(app, ["generate", str(tiny_master), "--prompt", prompt, "-n", "1"]))
    assert line == "minirt: error: the prompt is not valid UTF-8 (undecodable byte at character 3 of 6)"


def test_tokenizer_that_cannot_encode_is_one_line(tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0}))  # no unknown token: any other word fails
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tiny / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="the tokenizer cannot encode the prompt") as error:
        load_tokenizer(tiny).encode("zebra")
    assert error_line(runner.invoke(app, ["generate", str(tiny), "--prompt", "zebra", "-n", "1"])) == \
        f"minirt: error: {error.value}"


def test_shard_name_too_long_for_the_file_system_is_one_line(tiny):
    remap(tiny, shard_of(tiny, "lm_head.weight"), "x" * 300 + ".safetensors")
    with pytest.raises(CheckpointError, match=r"names file 'xxx.*\(312 characters\), longer than the 255 bytes a file "
                                              "name may have") as error:
        plan_load(tiny)
    line = error_line(runner.invoke(app, ["info", str(tiny)]))
    assert line == f"minirt: error: {error.value}" and len(line) < 400


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line(tiny_master):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "minirt", "info", str(tiny_master)], stdout=full,
                                stderr=subprocess.PIPE, text=True, env=_env(), preexec_fn=limit_memory, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "minirt: error: cannot write the output to stdout (No space left on device)\n"


# ---------------------------------------------------------------------------------------------------
# Wrong results: non-finite logits are an error naming the first layer; ue8m0 scales are checked.


def huge_layer_1_norm(ckpt: Path) -> None:
    # Finite in the file (3e38 < float32 max), but layer 1's activations overflow.
    edit_tensor(ckpt, "model.layers.1.input_layernorm.weight", lambda t: t.fill_(3e38))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_non_finite_logits_name_the_first_layer(tiny, backend):
    huge_layer_1_norm(tiny)
    with pytest.raises(NumericalError, match=r"prefill produced non-finite logits \(NaN or Inf\): the first "
                                             r"non-finite output is that of layer 1 \(model\.layers\.1\)"):
        minirt.load(tiny, device=DEVICE, backend=backend).prefill([[1, 2]])


def test_non_finite_logits_are_one_line_in_generate(tiny):
    huge_layer_1_norm(tiny)
    line = error_line(runner.invoke(app, ["generate", str(tiny), "--tokens", "1,2", "-n", "2", "--device", DEVICE]))
    assert "layer 1 (model.layers.1)" in line


def test_non_finite_logits_in_decode_name_the_layer(tiny_master):
    # On a GPU the second step replays the CUDA graph the first one captured: the check is in the graph.
    engine = minirt.load(tiny_master, device=DEVICE)
    logits = engine.decode(engine.prefill([[1, 2, 3]]).argmax(-1))
    engine.model.model.layers[1].post_attention_layernorm.weight.data.fill_(3e38)
    with pytest.raises(NumericalError, match=r"decode produced .* layer 1 \(model\.layers\.1\)"):
        engine.decode(logits.argmax(-1))


@pytest.mark.parametrize("scale", [0.0, -0.5, 0.3])
def test_ue8m0_scale_that_is_no_power_of_two_is_refused(tiny, scale):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    shard = edit_tensor(tiny, name, lambda t: t.view(-1).__setitem__(3, scale))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} in {shard.name}: block scale {scale:g} at "
                                              r"flat index 3 is not a positive power of two, as config\.json's "
                                              "scale_fmt 'ue8m0' says"):
        load_checkpoint(tiny)


def test_scale_that_is_no_power_of_two_loads_without_ue8m0(tiny):
    edit_tensor(tiny, "model.layers.0.mlp.up_proj.weight_scale_inv", lambda t: t.view(-1).__setitem__(3, 0.3))
    raw = json.loads((tiny / "config.json").read_text())
    del raw["quantization_config"]["scale_fmt"]  # without ue8m0, any positive finite scale is a scale
    (tiny / "config.json").write_text(json.dumps(raw))
    _, weights = load_checkpoint(tiny, 1)
    assert torch.isfinite(weights["model.layers.0.mlp.up_proj.weight"]).all()


# ---------------------------------------------------------------------------------------------------
# Messages: short excerpts of long arguments; what is there, not "does not exist".


def test_long_tokens_argument_is_excerpted(tiny_master, no_loading):
    ids = ["7"] * 60_000
    ids[30_000] = "x" * 1000
    line = error_line(runner.invoke(app, ["generate", str(tiny_master), "--tokens", ",".join(ids)]))
    assert line.startswith("minirt: error: --tokens must be comma-separated integers, got '7,7,7")
    assert re.search(r"\(120,998 characters\); item 30001 of 60000 is 'x{30}'…", line) and len(line) < 300


def test_symlink_loop_is_named_as_one(tiny, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "is a symlink loop" in error_line(runner.invoke(app, ["info", str(loop)]))
    remap(tiny, shard_of(tiny, "lm_head.weight"), "loop.safetensors")
    (tiny / "loop.safetensors").symlink_to(tiny / "loop.safetensors")
    with pytest.raises(CheckpointError, match="loop.safetensors: shard of tensor .* is a symlink loop"):
        plan_load(tiny)


def test_weights_larger_than_the_memory_are_refused_before_reading(tiny, monkeypatch):
    import minirt.shards as shards

    monkeypatch.setattr(shards, "available_memory", lambda device: 1_000_000)
    read = []
    with pytest.raises(DeviceError, match=r"2 layer\(s\) of .* need [\d.]+ [kMG]B of weights on cpu, 1.0 MB is free"):
        load_checkpoint(tiny, progress=lambda done, total, name: read.append(name))
    assert read == []
