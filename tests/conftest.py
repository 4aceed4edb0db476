import os
import shutil

# The interpreter's numpy products are small (one tile a program): OpenBLAS's threads only spin between
# them (on a busy 2-core machine the tile GEMMs took 4x the CPU time). Read when numpy loads (with torch).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before any kernel
# module is imported (triton reads the variable when a @triton.jit function is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def force_portable_kernels(monkeypatch):
    """Make the public attention functions run the portable Triton kernels, not the Gluon ones."""
    import importlib
    for name, plans in (("sparse_mla_prefill", "_KEPT"), ("sparse_mla_decode", "_PLANS")):   # the modules
        module = importlib.import_module(f"minirt.kernels.{name}")
        monkeypatch.setattr(module, "uses_sm90_kernel", lambda *args, **kwargs: False)
        # (The kernel is chosen once per call signature: plans kept by earlier calls would keep their choice.)
        monkeypatch.setattr(module, plans, {})


@pytest.fixture(params=["sm90", "portable"] if DEVICE == "cuda" else ["portable"])
def kernel_path(request, monkeypatch):
    """Which attention kernel runs: on a GPU a test using this runs twice, through the kernel the
    public functions pick (the Gluon kernels on sm_90) and through the portable Triton kernels,
    forced. The CPU (interpreter) has only the portable kernels."""
    if request.param == "portable":
        force_portable_kernels(monkeypatch)
    return request.param


@pytest.fixture(scope="session")
def tiny_master(tmp_path_factory):
    """The tiny synthetic checkpoint's two dense layers, written once per session; tests only read it
    (tests/test_moe_model.py writes the preset's MoE layers too)."""
    from minirt.synthetic import write_synthetic_checkpoint
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("master") / "tiny", preset="tiny", seed=1234,
                                      num_layers=2)


@pytest.fixture
def tiny(tiny_master, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_master, tmp_path / "tiny")


@pytest.fixture
def transformers(monkeypatch):
    """The transformers package (a test dependency: the eager references are compared with its models).
    transformers probes for Hugging Face's ``kernels`` package at import; from the checkout's root that
    name is minirt's ``kernels/`` directory (installed as ``minirt.kernels`` only), so the probe is told
    there is none."""
    monkeypatch.setitem(__import__("sys").modules, "kernels", None)
    import transformers

    return transformers
