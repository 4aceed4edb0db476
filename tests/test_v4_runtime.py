"""The DeepSeek-V4 kernel runtime (EngineV4) against the eager reference, through the CLI: ``minirt verify``
on v4-tiny over a prompt longer than one prefill chunk and than the 128-token window (so the window ring
wraps, the HCA compressor completes a 128-token window and its state crosses chunks), then decode steps
reading the fp8 MODEL1 caches. Runs on CUDA when available, else on the CPU under the Triton interpreter."""
import importlib
import json
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import minirt
from minirt.cli import app
from minirt.errors import DeviceError
from minirt.context import Segment
from minirt.models.deepseek_v4.cache import CompressorState
from minirt.models.deepseek_v4.checkpoint import load_checkpoint
from minirt.models.deepseek_v4.config import LayerKind
from minirt.models.deepseek_v4.layers import Compressor
from minirt.models.deepseek_v4.reference import compress, rope_cos_sin
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
    # In a thread of its own: CPython 3.11 frees a frame-stack chunk whenever the stack drops back below
    # its start, and at pytest's depth the interpreter's calls crossed one at every op (40 s of mmap and
    # munmap, a third of this test's time); a new thread's stack starts empty.
    runs = []
    thread = threading.Thread(target=lambda: runs.append(CliRunner().invoke(app, args)))
    thread.start()
    thread.join()
    result = runs[0]
    assert "{" in result.output, result.output
    report = json.loads(result.output[result.output.index("{"):])
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"hidden[0]", "hidden[1]", "hidden[2]", "attention[0]", "attention[1]", "attention[2]",
                           "topk_overlap[1]", "prefill_logits", "decode_logits", "top1_agreement"}
    assert result.exit_code == 0, [c for c in report["checks"] if not c["ok"]]
    assert all(c["ok"] for c in report["checks"])
    # Not vacuous: the runtime's numbers differ from the reference's by its roundings, and by no more.
    assert 0 < checks["hidden[0]"]["value"] < 0.1 and checks["topk_overlap[1]"]["value"] > 0.8


@pytest.mark.parametrize("prefix, layer", [("attn.compressor.", 1), ("attn.indexer.compressor.", 1),
                                           ("attn.compressor.", 2)])
def test_compressor_state_across_chunks_and_decode(v4_tiny, prefix, layer):
    """The runtime's compressor emits, over prefill chunks of any length and then
    one decode token at a time, exactly the reference's entries: its fp32 ring carries each partial window
    (and CSA's previous window) across steps, and an entry appears in the step that completes its window."""
    cfg, w = load_checkpoint(v4_tiny, 3)
    kind = cfg.layer_kinds[layer]
    dim = cfg.index_head_dim if "indexer" in prefix else cfg.head_dim
    lw = {n[len(f"layers.{layer}."):]: t.to(DEVICE) for n, t in w.items() if n.startswith(f"layers.{layer}.")}
    comp = Compressor(lw, prefix, kind.ratio, dim, kind == LayerKind.CSA, cfg.rms_norm_eps)
    T, decoded = 300, 40
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    table = rope_cos_sin(cfg, kind, torch.arange(T, device=DEVICE), torch.float32)
    expect = compress(x, lw, prefix, kind.ratio, dim, cfg, table[0][:: kind.ratio][: T // kind.ratio],
                      table[1][:: kind.ratio][: T // kind.ratio])
    state = CompressorState(2, kind.ratio, comp.wkv.shape[0], kind == LayerKind.CSA, DEVICE)
    got = {}
    for start, end in ((0, 50), (50, 177), (177, T - decoded)):  # seq 1 of 2, chunks not window-aligned
        step = SimpleNamespace(positions=torch.arange(start, end, device=DEVICE), segments=[Segment(1, start, end - start, 0)])
        rows = F.linear(x[start:end], comp.wkv), F.linear(x[start:end], comp.wgate)
        for _, lo, entries in comp.prefill(*rows, step, state, table):
            got.update({lo + i: e for i, e in enumerate(entries)})
    for t in range(T - decoded, T):
        step = SimpleNamespace(positions=torch.tensor([t], device=DEVICE), seq=torch.tensor([1], device=DEVICE))
        entry = torch.full((1, dim), float("nan"), device=DEVICE)
        window = comp.decode(F.linear(x[t: t + 1], comp.wkv), F.linear(x[t: t + 1], comp.wgate), step, state, table,
                             entry, slots_per_seq=0)  # slot = window id, or -1
        assert (int(window) >= 0) == ((t + 1) % kind.ratio == 0)
        if int(window) >= 0:
            got[int(window)] = entry[0]
    assert sorted(got) == list(range(T // kind.ratio))
    torch.testing.assert_close(torch.stack([got[i] for i in sorted(got)]), expect, rtol=1e-5, atol=1e-5)


def test_v32_only_options_are_refused(v4_tiny):
    for args in (["--indexer-precision", "fp8"], ["--weights", "bf16"]):
        result = CliRunner().invoke(app, ["generate", str(v4_tiny), "--tokens", "1,2", "-n", "1", *args])
        line = result.stderr.strip()
        assert result.exit_code == 2 and line.startswith("minirt: error:") and "V3.2 only" in line and "\n" not in line


def test_a_cache_past_free_memory_is_refused_before_allocating(v4_tiny):
    engine = minirt.load(v4_tiny, device=DEVICE)
    with pytest.raises(DeviceError, match=r"a cache for 100000 x 10,000,000 tokens needs .* is free"):
        engine.setup_cache(100_000, 10_000_000)


def test_indexer_scores_in_row_blocks_select_as_one_block(v4_tiny, monkeypatch):
    """A prefill step's indexer scores its tokens in blocks of SCORE_ROWS rows (each over the keys visible to
    the block's last token), so a long chunk's score block stays bounded: blocks of 24 rows, not aligned to
    the chunk or the 4-token windows, select the same entries and give the same logits as one block."""
    from minirt.context import PrefillTrace
    from minirt.models.deepseek_v4 import layers

    engine = minirt.load(v4_tiny, layers=2, device=DEVICE, prefill_chunk=64)  # SWA, CSA
    prompt = [torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(3)).tolist()]
    runs = []
    for rows in (layers.SCORE_ROWS, 24):
        monkeypatch.setattr(layers, "SCORE_ROWS", rows)
        trace = PrefillTrace()
        runs.append((engine.prefill(prompt, all_logits=True, trace=trace), *trace.topk))  # CSA alone
    (logits, topk), (blocked_logits, blocked_topk) = runs
    assert topk.shape == (100, 16) and (topk[-1] >= 0).all()  # the last rows choose 16 of 25 entries
    assert torch.equal(blocked_topk, topk)
    assert torch.equal(blocked_logits, logits) and torch.isfinite(logits).all()


def test_prefill_attends_keys_and_entries_in_place(v4_tiny, monkeypatch):
    """A prefill's CSA and HCA layers keep the prompt's keys and the layer's compressed entries adjacent in one
    buffer, so their two-source attention reads both in place: no copy of every earlier token's keys a chunk
    (at 1,048,576 tokens 1 GiB a layer and chunk)."""
    two_sources = importlib.import_module("minirt.kernels.sparse_mla_prefill_two_sources")
    joined, real = [], two_sources._joined
    monkeypatch.setattr(two_sources, "_joined", lambda kv, extra_kv: joined.append(
        (kv, real(kv, extra_kv))) or joined[-1][1])
    engine = minirt.load(v4_tiny, layers=3, device=DEVICE, prefill_chunk=64)  # SWA, CSA, HCA
    engine.prefill([list(range(1, 100))])
    assert len(joined) == 4   # two chunks, two layers
    assert all(buffer.data_ptr() == kv.data_ptr() for kv, buffer in joined)
