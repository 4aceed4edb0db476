"""A first run, tried as a new user would: each defect of what the command line and the Python API
show a newcomer on a CPU machine, through the real entry points (``python -m minirt`` in a subprocess,
typer's runner in-process where that is enough, the public Python API)."""
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import minirt
from minirt.context import KVStash, decode_context, prefill_context
from minirt.errors import InputError
from minirt.layers import DecoderLayer

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
    engine = minirt.load(tiny_master, device=DEVICE, indexer_precision="fp8")  # every kernel of a layer
    cfg, layer = engine.cfg, engine.model.model.layers[1]
    engine.setup_cache(1, 48)
    T = 40  # past index_topk (32): the indexer's choice matters
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE, engine.dtype)

    def prefill_ctx():
        return prefill_context(cfg, [T], cache=engine.cache, stash=KVStash([T], DEVICE), rope=engine._rope,
                               device=DEVICE)

    eager = layer(x, prefill_ctx())
    compiled = torch.compile(layer, fullgraph=True, backend=COMPILE_BACKEND)
    out = compiled(x, prefill_ctx())
    assert torch.isfinite(out).all()
    assert float((out.float() - eager.float()).norm() / eager.float().norm()) < 1e-2
    engine.cache.seq_lens[:1] = T
    step = decode_context(cfg, engine.cache, 1, engine._rope)
    eager_step = layer(x[:1], step)  # writes position T; the compiled step rewrites the same slot
    compiled_step = compiled(x[:1], decode_context(cfg, engine.cache, 1, engine._rope))
    assert compiled_step.shape == (1, cfg.hidden_size) and torch.isfinite(compiled_step).all()
    assert float((compiled_step.float() - eager_step.float()).norm() / eager_step.float().norm()) < 1e-2


# The Python API raises MinirtError subclasses ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_master):
    return minirt.load(tiny_master, device=DEVICE)


def test_prefill_of_a_flat_token_list_names_the_expected_nesting(tiny_engine):
    with pytest.raises(InputError, match=r"list of prompts, each a list of token ids"):
        tiny_engine.prefill([1, 2, 3])


def test_verify_with_engines_of_different_layer_counts_is_an_input_error(tiny_master):
    from minirt.verify import run_verify

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
