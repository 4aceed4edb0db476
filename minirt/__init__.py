"""minirt: inference micro-runtime for DeepSeek-V3.2 (DSA) MLA layers.

    import minirt
    engine = minirt.load()                       # tiny synthetic checkpoint under weights/, cpu or cuda
    logits = engine.prefill([[1, 2, 3], [4, 5]])  # [2, vocab]: next-token logits of each prompt
    logits = engine.decode(logits.argmax(-1))     # one step on the fp8 paged cache

Kernels: ``minirt.kernels``. Layers for other projects, and the eager
reference (the oracle), per model family: ``minirt.models.deepseek_v32.layers`` / ``.reference``,
``minirt.models.deepseek_v4.layers`` / ``.reference``.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointError, ConfigError, DeviceError, InputError, MinirtError, WriteError

__all__ = ["load", "default_checkpoint", "default_weights_dir", "ModelConfig", "MinirtError", "ConfigError", "CheckpointError",
           "InputError", "DeviceError", "WriteError"]


def default_weights_dir() -> Path:
    """Where the embedded default checkpoint lives: $MINIRT_WEIGHTS, else the checkout's ``weights/``
    (an editable install), else ``~/.cache/minirt``."""
    if "MINIRT_WEIGHTS" in os.environ:
        from .files import as_path

        return as_path(os.environ["MINIRT_WEIGHTS"], "MINIRT_WEIGHTS")  # empty: an error, not the current directory
    repo_weights = Path(__file__).resolve().parent.parent / "weights"
    return repo_weights if repo_weights.is_dir() else Path.home() / ".cache" / "minirt"


def default_checkpoint(progress=None) -> Path:
    """The tiny synthetic checkpoint, written on first use."""
    from .synthetic import write_synthetic_checkpoint

    path = default_weights_dir() / "tiny"
    if not (path / "config.json").is_file():
        try:
            write_synthetic_checkpoint(path, preset="tiny", seed=0, progress=progress)
        except (InputError, WriteError):  # another process wrote it first (the write is an atomic rename)
            if not (path / "config.json").is_file():
                raise
    return path


def load(path: str | Path | None = None, layers: int | None = None, device: str | None = None,
         backend: str = "triton", dtype: torch.dtype | None = None, indexer_precision: str = "exact",
         prefill_chunk: int | None = None, weights: str | None = None, progress=None, tp: int | None = None):
    """Load the first ``layers`` layers of a checkpoint (None: all, ``num_hidden_layers``; dense and MoE)
    for inference; the weights must fit in the device's free memory (else DeviceError with the largest
    layer count that fits).

    path: HF checkpoint directory; None uses the tiny synthetic default (created once).
    device: "cuda" or "cpu"; None picks cuda when available. On the CPU the Triton kernels run under
    the interpreter (TRITON_INTERPRET=1, set automatically when torch sees no GPU).
    backend: "triton" (kernels, fp8 paged cache) or "reference" (the eager fp32 oracle). The checkpoint's
    model family (``minirt.models.family_of``) loads it; DeepSeek-V4 runs its fp8 weights as stored and an
    exact indexer, so ``dtype``, ``indexer_precision`` and ``weights`` apply to DeepSeek-V3 / V3.2.
    dtype: weights/activations of the triton backend; default bf16 on cuda, fp32 on cpu.
    indexer_precision: "exact" (fp32 scores, default: what the reference computes, so verify can
    compare top-k sets) or "fp8" (the official Hadamard + fp8 path; near-ties may flip).
    prefill_chunk: prompt tokens per prefill step of the triton backend (default: the family's, 2048 for
    DeepSeek-V3 / V3.2, 8192 for DeepSeek-V4); it bounds prefill's transient memory, not the results.
    weights: "fp8" keeps the checkpoint's block-fp8 linear weights as stored and computes with fp8
    GEMMs (activations quantised per token and 128 values), "bf16" dequantises them at load (to
    ``dtype``). Default: "fp8" for an fp8 checkpoint on a GPU with fp8 tensor cores (sm_90+), else
    "bf16". The reference backend always dequantises to fp32.
    tp: tensor parallelism over the ``tp`` processes of the initialised ``torch.distributed`` process
    group (``minirt.parallel``: attention heads, dense MLP width and vocabulary split, routed experts
    split as expert parallelism): every process calls ``load`` and then the engine's methods with the
    same arguments and gets the same logits; each reads only its shard of the checkpoint. device None
    is then ``cuda:LOCAL_RANK`` (or the CPU, with gloo). InputError when no process group is
    initialised, its size is not ``tp``, ``tp`` does not divide the attention heads, or with
    backend="reference" (the oracle is single-process). None or 1: one process.
    Returns a ``minirt.backend.Backend``: ``prefill(prompts)`` and ``decode(tokens)`` (see
    ``minirt.models.deepseek_v32.engine.Engine`` and ``minirt.backend.ReferenceEngine``).
    """
    from .config import load_config
    from .device import resolve_device
    from .files import as_path
    from .models import family_of
    from .parallel import TensorParallel, local_device
    from .runtime import check_prefill_chunk

    if backend not in ("triton", "reference"):
        raise InputError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and prefill_chunk is not None:
        prefill_chunk = check_prefill_chunk(prefill_chunk)
    if weights not in (None, "fp8", "bf16"):
        raise InputError(f"weights must be 'fp8' or 'bf16', got {weights!r}")
    group = TensorParallel.current(1 if tp is None else tp)
    if group.world > 1 and backend == "reference":
        raise InputError("the reference backend runs in one process: load it without tp")
    if group.world > 1 and device is None:
        device = str(local_device())
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    path = as_path(path, "checkpoint path") if path is not None else default_checkpoint(progress)
    return family_of(load_config(path)).load(path, layers, dev, backend, progress, prefill_chunk, dtype=dtype,
                                              indexer_precision=indexer_precision, weights=weights, tp=group)
