"""The ``minirt`` command line: init, info, generate, verify.

Errors on bad input print one line on stderr and exit with code 2 (``--debug`` shows the traceback).
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .errors import MinirtError

app = typer.Typer(
    help="minirt: run the first dense layers of a DeepSeek-V3.2 checkpoint with sparse-MLA Triton kernels, "
    "and check them against an eager reference.\n\n"
    "Start with `minirt generate` (no arguments: a tiny synthetic checkpoint is made under weights/) "
    "and `minirt verify`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
_state = {"debug": False}

WeightsArg = Annotated[Optional[Path], typer.Argument(
    help="Hugging Face checkpoint directory (config.json + safetensors). Default: the tiny synthetic one.",
    show_default=False)]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", "-l", help="Load the first N layers (default: all dense layers).")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when available).")]


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False):
    _state["debug"] = debug


def _errors_to_exit_code(fn):
    """MinirtError → 'minirt: error: …' on stderr, exit 2; everything else propagates."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MinirtError as e:
            if _state["debug"]:
                raise
            print(f"minirt: error: {e}", file=sys.stderr)
            raise typer.Exit(2) from None
    return wrapper


class _ProgressBar:
    """A rich progress bar behind the ``progress(done, total, name)`` callback the loaders take."""

    def __init__(self, what: str):
        # Only on a terminal: a transient bar still leaves a blank line on a redirected stderr.
        self.bar = Progress(TextColumn(f"{what} " + "{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
        self.task = None

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task(name, total=total)
        self.bar.update(self.task, completed=done, description=name[-48:])


@app.command()
@_errors_to_exit_code
def init(
    out: Annotated[Path, typer.Argument(help="Directory to write (must be empty or absent; see --force).")] = Path("weights/tiny"),
    preset: Annotated[str, typer.Option(help="tiny: seconds on CPU, real head dims (576/512). v32: real DeepSeek-V3.2 dims, several GB.")] = "tiny",
    layers: LayersOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of every tensor's generator.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty directory.")] = False,
    device: Annotated[str, typer.Option(help="Where to generate the tensors (cuda is faster for v32).")] = "cpu",
):
    """Write a deterministic synthetic checkpoint in the real Hugging Face layout (fp8 block-quantised)."""
    from .synthetic import write_synthetic_checkpoint

    with _ProgressBar("writing") as bar:
        path = write_synthetic_checkpoint(out, preset=preset, seed=seed, num_layers=layers, force=force,
                                          device=device, progress=bar)
    console.print(f"wrote {preset} checkpoint to {path}")


@app.command()
@_errors_to_exit_code
def info(weights: WeightsArg = None, layers: LayersOpt = None):
    """Show a checkpoint's config and what loading N layers would read (shards, parameters, bytes)."""
    from . import default_checkpoint
    from .checkpoint import plan_load

    plan = plan_load(weights or default_checkpoint(), layers)
    cfg = plan.config
    out = Console()
    t = Table(title=str(plan.path), show_header=False)
    for key, value in [
        ("model_type", cfg.model_type), ("layers (dense / total)", f"{cfg.num_dense_layers} / {cfg.num_hidden_layers}"),
        ("hidden / heads", f"{cfg.hidden_size} / {cfg.num_attention_heads}"),
        ("q_lora / kv_lora", f"{cfg.q_lora_rank} / {cfg.kv_lora_rank}"),
        ("qk nope / rope / v", f"{cfg.qk_nope_head_dim} / {cfg.qk_rope_head_dim} / {cfg.v_head_dim}"),
        ("indexer heads × dim, top-k", f"{cfg.index_n_heads} × {cfg.index_head_dim}, {cfg.index_topk}" if cfg.is_v32 else "none (V3)"),
        ("softmax scale", f"{cfg.sm_scale:.6f}"),
        ("quantization", f"fp8 e4m3, blocks {cfg.quantization.weight_block_size}" if cfg.quantization else "none"),
        ("layers to load", str(plan.num_layers)),
        ("shards to open", ", ".join(f.name for f in plan.shard_files)),
        ("tensors / parameters", f"{len(plan.tensor_names)} / {plan.num_parameters:,}"),
        ("bytes to read", f"{plan.num_bytes:,}"),
    ]:
        t.add_row(key, value)
    out.print(t)


def _load(weights, layers, device, backend, indexer_precision="exact"):
    from . import load

    with _ProgressBar("loading") as bar:
        return load(weights, layers=layers, device=device, backend=backend, indexer_precision=indexer_precision,
                    progress=bar)


@app.command()
@_errors_to_exit_code
def generate(
    weights: WeightsArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Text prompt (needs tokenizer.json in the checkpoint).")] = None,
    tokens: Annotated[Optional[str], typer.Option(help="Prompt as comma-separated token ids, e.g. 1,2,3.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    seed: int = 0,
    batch: Annotated[int, typer.Option(help="Run the prompt this many times as one batch (throughput).")] = 1,
    layers: LayersOpt = None,
    device: DeviceOpt = None,
    backend: Annotated[str, typer.Option(help="triton (kernels, fp8 cache) or reference (eager oracle).")] = "triton",
    indexer_precision: Annotated[str, typer.Option(help="exact (fp32 scores) or fp8 (official Hadamard + fp8).")] = "exact",
):
    """Generate text (or token ids) and report prefill and decode tokens/s."""
    from . import default_checkpoint
    from .errors import InputError
    from .generate import generate as run_generate
    from .sampling import SamplingParams
    from .tokenizer import load_tokenizer

    path = weights or default_checkpoint()
    tokenizer = load_tokenizer(path)
    if prompt is not None and tokens is not None:
        raise InputError("give either --prompt or --tokens, not both")
    if tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens must be comma-separated integers, got {tokens!r}") from None
    else:
        if tokenizer is None:
            raise InputError(f"{path} has no tokenizer.json: pass the prompt as --tokens 1,2,3")
        if prompt == "":
            raise InputError("the prompt is empty")
        ids = tokenizer.encode(prompt if prompt is not None else "The quick brown fox")
    if batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}")
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    engine = _load(path, layers, device, backend, indexer_precision)
    eos = engine.cfg.eos_token_id
    out = Console(highlight=False)

    as_text = tokenizer is not None and tokens is None  # token ids in, token ids out

    def stream(seq: int, token: int) -> None:
        if seq == 0:
            out.print(tokenizer.decode([token]) if as_text else f"{token} ", end="")

    if as_text:
        out.print(tokenizer.decode(ids), end="", style="dim")
    result = run_generate(engine, [ids] * batch, max_new_tokens, sampling, eos, stream)
    out.print()
    console.print(f"prefill: {result.prefill_tokens} tokens, {result.prefill_tokens_per_s:,.1f} tok/s | "
                  f"decode: {result.decode_steps} steps × {batch}, {result.decode_tokens_per_s:,.1f} tok/s "
                  f"({engine.backend}, {engine.device})")


@app.command()
@_errors_to_exit_code
def verify(
    weights: WeightsArg = None,
    layers: LayersOpt = None,
    device: DeviceOpt = None,
    prompt_len: Annotated[Optional[int], typer.Option(help="Prompt tokens (default: 2·index_topk + 8, so top-k is sparse).")] = None,
    decode_steps: Annotated[int, typer.Option(help="Decode steps after the prompt.")] = 8,
    seed: int = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
):
    """Run the kernel runtime and the eager reference on the same tokens and compare them.

    Exit 0 when every row is within its tolerance (README: "verify tolerances"), 1 otherwise."""
    from . import default_checkpoint
    from .verify import run_verify

    path = weights or default_checkpoint()
    engine = _load(path, layers, device, "triton")
    oracle = _load(path, engine.num_layers, str(engine.device), "reference")
    cfg = engine.cfg
    if prompt_len is None:
        prompt_len = 2 * (cfg.index_topk or 32) + 8
    report = run_verify(engine, oracle, prompt_len, decode_steps, seed)
    if as_json:
        print(report.to_json())
    else:
        t = Table(title=f"minirt verify: {prompt_len} prompt tokens + {decode_steps} decode steps, {engine.device}")
        for col in ("check", "value", "limit", ""):
            t.add_column(col)
        for c in report.checks:
            t.add_row(c.name, f"{c.value:.3e}", f"{'≤' if c.kind == 'max' else '≥'} {c.limit:g}",
                      "[green]ok[/]" if c.ok else "[red]FAIL[/]")
        Console().print(t)
    if not report.ok:
        names = ", ".join(c.name for c in report.failures())
        print(f"minirt: verify failed: {names} outside tolerance", file=sys.stderr)
        raise typer.Exit(1)

