"""``minirt download`` against a local HTTP server that serves a synthetic checkpoint in the Hugging Face
hub's URL layout (``/{repo}/resolve/{revision}/{file}``, HEAD with X-Repo-Commit / ETag / Content-Length,
GET with Range, 404 + X-Error-Code), through the real entry point with ``--endpoint``."""
import collections
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from minirt.models.deepseek_v32.checkpoint import plan_load
from minirt.shards import INDEX_FILE
from minirt.download import download_checkpoint, plan_shards
from minirt.errors import WriteError

REPO = "acme/tiny-v32"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Serves ``root``'s files as repository ``repo``; records (method, file) of every request."""

    def __init__(self, root: Path, repo: str = REPO):
        self.root, self.requests = root, []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.serve(body=False)

            def do_GET(self):
                self.serve(body=True)

            def serve(self, body: bool):
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path)
                if match is None or match.group(1) != repo:
                    return self.refuse("RepoNotFound")
                name = match.group(3)
                hub.requests.append((self.command, name))
                path = hub.root / name
                if not path.is_file():
                    return self.refuse("EntryNotFound")
                data = path.read_bytes()
                start = 0
                if body and (r := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
                    start = int(r.group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if body:
                    self.wfile.write(data[start:])

            def refuse(self, code: str):
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fetched(self) -> set[str]:
        return {name for method, name in self.requests if method == "GET"}


@pytest.fixture(scope="module")
def hub(tiny_master):
    server = Hub(tiny_master)
    yield server
    server.server.shutdown()


def minirt(*args, cwd=None, **env):
    """``python -m minirt ARGS`` with huggingface_hub's state kept in ``cwd`` and the hub given by the test."""
    env = {**{k: v for k, v in os.environ.items() if k != "HF_ENDPOINT"}, "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(Path(cwd or ".").resolve() / "hf-home"), **env}
    return subprocess.run([sys.executable, "-m", "minirt", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_download_fetches_only_the_shards_of_the_layers_asked_for_and_resumes(hub, tiny_master, tmp_path):
    out = tmp_path / "ckpt"
    one_layer = set(plan_shards(tiny_master, 1).shards)
    every = {p.name for p in tiny_master.glob("*.safetensors")}
    assert one_layer < every  # the test can tell a selective download from a full one

    result = minirt("download", REPO, str(out), "--layers", "1", "--endpoint", hub.url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert hub.fetched() == {"config.json", INDEX_FILE, "tokenizer.json"} | one_layer
    for name in hub.fetched():
        assert (out / name).read_bytes() == (tiny_master / name).read_bytes()
    assert plan_load(out, 1).shard_files == tuple(out / s for s in sorted(one_layer))
    assert f"{len(one_layer)} of the {len(every)} shard(s)" in result.stderr
    assert f"minirt generate {out} --layers 1" in result.stderr

    # A rerun after an interruption: the shard lost is fetched again, the complete one is not.
    lost = sorted(one_layer)[-1]
    (out / lost).unlink()
    hub.requests.clear()
    again = minirt("download", REPO, str(out), "--layers", "1", "--endpoint", hub.url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert hub.fetched() & one_layer == {lost}
    assert f"{len(one_layer) - 1} already here" in again.stderr


def test_download_dry_run_says_disk_and_memory_and_fetches_no_shard(hub, tiny_master, tmp_path):
    out = tmp_path / "plan"
    hub.requests.clear()
    result = minirt("download", REPO, str(out), "--dry-run", "--endpoint", hub.url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not hub.fetched() & {p.name for p in tiny_master.glob("*.safetensors")}
    plan = plan_shards(tiny_master)
    shard_bytes = sum((tiny_master / s).stat().st_size for s in plan.shards)
    assert f"disk: {shard_bytes / 1e6:.1f} MB for those shards" in result.stderr
    assert f"memory: {plan.num_parameters:,} parameters" in result.stderr

    # info on the half-downloaded directory: the same shards, marked as not here yet.
    info = minirt("info", str(out), cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "not downloaded" in info.stdout and all(s in info.stdout for s in plan.shards)


@pytest.mark.parametrize("repo, message", [(REPO + "-missing", "no such repository"),
                                           ("not a repo id", "not a repository id")])
def test_download_bad_repository_is_one_line_exit_2(hub, tmp_path, repo, message):
    result = minirt("download", repo, str(tmp_path / "x"), "--endpoint", hub.url, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("minirt: error:") and message in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_readme_walkthrough_commands_run_as_written(tmp_path):
    """The README's DeepSeek-V3.2 steps 1 and 2, word for word, against a hub serving a 3-layer synthetic
    checkpoint as deepseek-ai/DeepSeek-V3.2 (HF_ENDPOINT), with the default location in tmp_path."""
    from minirt.synthetic import write_synthetic_checkpoint

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Running DeepSeek-V3.2's layers"):]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)[:2]
    commands = [line.split("#")[0].split() for block in blocks for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["minirt", "download"], ["minirt", "info"], ["minirt", "download"]]
    served = write_synthetic_checkpoint(tmp_path / "served", preset="tiny", num_layers=3)
    hub = Hub(served, repo="deepseek-ai/DeepSeek-V3.2")
    try:
        for command in commands:
            result = minirt(*command[1:], cwd=tmp_path, HF_ENDPOINT=hub.url, MINIRT_WEIGHTS=str(tmp_path / "weights"))
            assert result.returncode == 0, (command, result.stderr)
    finally:
        hub.server.shutdown()
    assert plan_load(tmp_path / "weights" / "DeepSeek-V3.2", 3).num_layers == 3


def test_download_refuses_when_the_disk_is_too_small(hub, tiny_master, tmp_path, monkeypatch):
    full = collections.namedtuple("usage", "total used free")(10**9, 10**9 - 200_000, 200_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    hub.requests.clear()
    with pytest.raises(WriteError, match=r"the shards still to fetch take [\d.]+ MB, the disk has 200.0 kB free"):
        download_checkpoint(REPO, tmp_path / "x", endpoint=hub.url)
    assert not hub.fetched() & {p.name for p in tiny_master.glob("*.safetensors")}
