"""The ``minirt`` command line: init, info, download, generate, verify.

Errors on bad input print one line on stderr and exit with code 2 (``--debug`` adds the traceback).
Arguments are checked before any weights are loaded.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.spinner import Spinner
from rich.table import Column, Table

from . import default_weights_dir
from .download import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S
from .errors import InputError, MinirtError, excerpt

DEFAULT_PROMPT = "The quick brown fox"


def _weights_dir_text() -> str:
    """default_weights_dir() for the help texts; an empty MINIRT_WEIGHTS is an error only where it is used."""
    try:
        return str(default_weights_dir())
    except MinirtError:
        return "$MINIRT_WEIGHTS"


TINY_DIR = f"{_weights_dir_text()}/tiny"


class _OneLineErrors(typer.core.TyperGroup):
    """Every error as one line ``minirt: error: ...`` on stderr, exit 2: click's usage errors (a value
    that is not a number, an unknown option; typer would draw a box), MinirtErrors raised while the
    arguments are parsed, and stdout refusing the output (a full disk: ENOSPC; see _GuardedStdout)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        stdout, sys.stdout = sys.stdout, _GuardedStdout(sys.stdout)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
            sys.stdout.flush()
        except typer.TyperException as e:  # click's usage errors, as typer ships them
            if type(e).__name__ == "NoArgsIsHelpError":  # no arguments: the help is printed already
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{' '.join(['minirt', *ctx.command_path.split()[1:]])} --help`)" if ctx is not None else ""
            sys.exit(_fail(" ".join(e.format_message().split())[:300] + hint))
        except typer.Abort:
            sys.exit(_fail("aborted"))
        except MinirtError as e:
            sys.exit(_fail(str(e)))
        finally:
            sys.stdout = stdout
        sys.exit(code or 0)


def _fail(message: str) -> int:
    print(f"minirt: error: {message}", file=sys.stderr)
    return 2


class _GuardedStdout:
    """sys.stdout while a command runs: a write the operating system refuses (a full disk, a closed
    pipe) becomes a WriteError, and the stream is pointed at /dev/null so that the interpreter's last
    flush at exit does not fail once more."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _guard(self, call, *args):
        from .errors import WriteError

        try:
            return call(*args)
        except OSError as e:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):  # a stdout without a file descriptor
                pass
            raise WriteError(f"cannot write the output to stdout ({e.strerror or e})") from None


def _path(text: str) -> Path:
    """A path argument: an empty one is an error (Path would read it as the current directory)."""
    if text == "":
        raise typer.BadParameter("the path is empty")
    return Path(text)


app = typer.Typer(
    cls=_OneLineErrors,
    help="minirt: run the layers of a DeepSeek-V3.2 or DeepSeek-V4 checkpoint (dense and MoE) with sparse-MLA "
    "Triton kernels, and check them against an eager reference.\n\n"
    f"Start with `minirt generate` and `minirt verify`: without a checkpoint argument every command uses the "
    f"tiny synthetic one (random weights) in {TINY_DIR}, written on first use. The real model's layers: "
    "`minirt download deepseek-ai/DeepSeek-V3.2 --layers 3 --dry-run` (README: \"Running DeepSeek-V3.2's layers\").",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's paragraph is reflowed to the terminal, not cut where its lines end
)
console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)  # paths may hold [brackets]
_state = {"debug": False}

WeightsArg = Annotated[Optional[Path], typer.Argument(
    help=f"Hugging Face checkpoint directory (config.json + safetensors). Default: the tiny synthetic one in {TINY_DIR}.",
    show_default=False, parser=_path)]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", "-l", help="Load the first N layers, dense and MoE (default: all).")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when available).")]
WeightsOpt = Annotated[Optional[str], typer.Option(
    "--weights", metavar="fp8|bf16", show_default=False,
    help="fp8 (the checkpoint's block-fp8 weights, fp8 GEMMs) or bf16 (dequantised at load). Default: fp8 for an "
    "fp8 checkpoint on a GPU with fp8 tensor cores (sm_90+), else bf16.")]
PrefillChunkOpt = Annotated[Optional[str], typer.Option(
    "--prefill-chunk", metavar="N", show_default=False,
    help="Prompt tokens per prefill step (default 2048; 8192 for DeepSeek-V4): bounds prefill's memory, not its "
    "results.")]
TpOpt = Annotated[Optional[int], typer.Option(
    "--tp", metavar="N", show_default=False,
    help="Tensor + expert parallelism over N processes: run under `torchrun --nproc-per-node N -m minirt ...` "
    "(NCCL on GPUs, gloo on the CPU); only rank 0 prints.")]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"minirt {version('minirt')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("minirt (not installed)")
        raise typer.Exit()


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error too.")] = False,
          version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False):
    _state["debug"] = debug


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, as Ctrl-C's KeyboardInterrupt is: the same clean-up runs
    (a checkpoint being written is removed), then exit 143."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _errors_to_exit_code(fn):
    """MinirtError → 'minirt: error: …' on stderr (after the traceback with --debug), exit 2; SIGTERM
    is handled as Ctrl-C (exit 130) is, with exit 143."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()  # only it may set a signal handler
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
        try:
            return fn(*args, **kwargs)
        except MinirtError as e:
            if os.environ.get("RANK", "0") == "0":  # under torchrun (--tp) rank 0 speaks for all
                if _state["debug"]:
                    traceback.print_exc()
                print(f"minirt: error: {e}", file=sys.stderr)
            raise typer.Exit(2) from None
        except Terminated:
            raise typer.Exit(128 + signal.SIGTERM) from None
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
    return wrapper


def _count(n: int, noun: str) -> str:
    """'1 step', '2 steps' (plural by an s)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _check_layers(layers: int | None) -> None:
    if layers is not None and layers < 1:
        raise InputError(f"--layers must be a whole number >= 1, got {layers}")


def _whole_number(text: str | None, option: str, minimum: int) -> int | None:
    """An option's text as an int >= minimum, or InputError naming the option (typer's own error is a box)."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*[+-]?\d+\s*", text) or int(text) < minimum:
        raise InputError(f"{option} must be a whole number >= {minimum}, got {excerpt(text)}")
    return int(text)


def _duration(seconds: float) -> str:
    minutes, hours = seconds / 60, seconds / 3600
    return f"{hours:.1f} h" if hours >= 1 else f"{minutes:.0f} min" if minutes >= 1 else f"{seconds:.0f} s"


class _ProgressBar:
    """A rich progress bar (sizes in kB/MB/GB) behind the ``progress(done, total, name)`` callback of the
    loader, the synthetic writer and the downloader; shown on a terminal only, from the first call on,
    on one line of the terminal's width (the tensor name is cut to fit).

    ``order``: names in the order the loader reads them. The loader reports a tensor once it is read, so
    the bar then names the next one: the tensor in flight. The bar ends when the work is done; ``then``
    names the phase that follows until the block ends (a spinner, e.g. "building the engine")."""

    def __init__(self, what: str, order: list[str] | None = None, then: str | None = None):
        # Only on a terminal: a transient bar still leaves a blank line on a redirected stderr.
        name = TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis"))
        self.bar = Progress(TextColumn(what), BarColumn(bar_width=20), DownloadColumn(), TimeRemainingColumn(),
                            name, console=console, transient=True, disable=not console.is_terminal)
        self.next_name = {} if order is None else dict(zip(order, order[1:]))
        self.then, self.phase = then, None
        self.task = self.done = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()
        if self.phase is not None:
            self.phase.stop()

    def _stop(self):
        if self.task is not None and not self.done:
            self.done = True
            self.bar.stop()

    def description(self, name: str) -> str:
        return self.next_name.get(name, name)[-48:]

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.done:
            return
        if self.task is None:
            self.task = self.bar.add_task(self.description(name), total=total, completed=done)
            self.bar.start()
        else:
            self.bar.update(self.task, completed=done, total=total, description=self.description(name))
        if done >= total:  # finished: stop() draws it once more, then the next phase (if any) says what it is
            self._stop()
            if self.then is not None and console.is_terminal:
                self.phase = Live(Spinner("dots", self.then), console=console, transient=True)
                self.phase.start()


def _checkpoint(weights: Path | None):
    """(directory, config) of the checkpoint argument, or the tiny default (written on first use); a
    path that is not a checkpoint directory is an error that says so, before anything else is read."""
    from . import default_checkpoint
    from .shards import check_checkpoint_dir
    from .config import load_config

    if weights is None:
        from .synthetic import DirectoryNotEmpty

        tiny = default_weights_dir() / "tiny"  # an empty MINIRT_WEIGHTS: its one-line error, here
        if not tiny.exists() or (tiny.is_dir() and not any(tiny.iterdir())):
            console.print(f"writing the tiny default checkpoint (random weights) to {tiny}, once: every command "
                          "without a checkpoint argument uses it")
        try:
            with _ProgressBar("writing the tiny default checkpoint") as bar:
                path = default_checkpoint(progress=bar)
        except DirectoryNotEmpty as e:
            raise InputError(f"{e.path} holds other files, not the tiny default checkpoint: move them away, or "
                             "replace them with `minirt init --force`") from None
    else:
        path = weights
        check_checkpoint_dir(path)
    return path, load_config(path / "config.json")


@app.command()
@_errors_to_exit_code
def init(
    out: Annotated[Optional[Path], typer.Argument(
        help=f"Directory to write (empty or absent; see --force). Default: {_weights_dir_text()}/PRESET, the "
        "tiny one being what every command uses without a checkpoint argument.", show_default=False,
        parser=_path)] = None,
    preset: Annotated[str, typer.Option(metavar="tiny|v32|v4-tiny|v4-flash", help="tiny: seconds on CPU, real head dims (576/512). v32: real DeepSeek-V3.2 dims, several GB. "
                                           "v4-tiny: 4 DeepSeek-V4 layers, seconds on CPU. v4-flash: V4-Flash's first 4 layers, about 16 GB.")] = "tiny",
    layers: Annotated[Optional[int], typer.Option("--layers", "-l", help="Number of layers to write, the preset's dense ones first, then MoE (default: the preset's, tiny 4 = 2 dense + 2 MoE, v32 3 dense).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every tensor's generator.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty directory.")] = False,
    device: Annotated[str, typer.Option(help="Where to generate the tensors (cuda is faster for v32).")] = "cpu",
):
    """Write a deterministic synthetic checkpoint (random weights) in the real layout: V3.2's Hugging Face names
    with fp8 weights and 128×128 scales, or V4's DeepSeek-native names with ue8m0 scales and fp4 experts.

    Done already (the same preset, layers, seed and device there, complete): says so and exits 0."""
    from .synthetic import is_synthetic_checkpoint, write_synthetic_checkpoint

    from .synthetic import FAMILY_PRESETS, PRESETS, DirectoryNotEmpty

    _choice(preset, "--preset", (*PRESETS, *FAMILY_PRESETS))
    _check_layers(layers)
    out = out if out is not None else default_weights_dir() / preset
    if not force and is_synthetic_checkpoint(out, preset, seed, layers, device):
        console.print(f"{preset} checkpoint (seed {seed}) already complete in {out.resolve()}; --force rewrites it")
        return
    if os.path.ismount(out):  # the checkpoint is renamed into place, and nothing replaces a mount point
        raise InputError(f"{out} is a mount point, which a checkpoint written elsewhere cannot be renamed onto: "
                         f"write into a directory inside it, e.g. minirt init {out / preset}")
    try:
        with _ProgressBar("writing") as bar:
            path = write_synthetic_checkpoint(out, preset=preset, seed=seed, num_layers=layers, force=force,
                                              device=device, progress=bar)
    except DirectoryNotEmpty as e:
        raise InputError(f"{e.path} is not empty; --force replaces it") from None
    console.print(f"wrote {preset} checkpoint to {path}")


@app.command()
@_errors_to_exit_code
def info(weights: WeightsArg = None, layers: LayersOpt = None):
    """Show a checkpoint's config, and what loading N layers takes: shards, disk, memory, cache per token.

    Needs only config.json and the index: shards not downloaded yet are listed with an estimate of their size."""
    from .models import family_of

    _check_layers(layers)
    path, cfg = _checkpoint(weights)
    _print_rows(path, family_of(cfg).info_rows(path, cfg, layers))


def _print_rows(path: Path, rows: list[tuple[str, str]]) -> None:
    out = Console(highlight=False, markup=False)
    out.print(str(path))
    t = Table(show_header=False)
    for key, value in rows:
        t.add_row(key, value)
    out.print(t)


@app.command()
@_errors_to_exit_code
def download(
    repo_id: Annotated[str, typer.Argument(help="Hugging Face repository, e.g. deepseek-ai/DeepSeek-V3.2.", show_default=False)],
    out: Annotated[Optional[Path], typer.Argument(help=f"Directory to fill. Default: {_weights_dir_text()}/NAME (NAME: the repository's).",
                                                  show_default=False, parser=_path)] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", "-l", help="Fetch what the first N layers need (default: all dense layers).")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default: main).")] = None,
    endpoint: Annotated[Optional[str], typer.Option(help="Hub URL (default: $HF_ENDPOINT, else https://huggingface.co).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Fetch config, index and tokenizer only; print the shards, disk and memory.")] = False,
    timeout: Annotated[float, typer.Option(metavar="SECONDS", help="How long a connection or a read may wait.")] = DEFAULT_TIMEOUT_S,
    retries: Annotated[int, typer.Option(help="Network failures (timeouts, dropped connections, HTTP 408/429/5xx) "
                                              "tolerated per file before giving up.")] = DEFAULT_RETRIES,
):
    """Fetch config.json, the index, tokenizer.json and only the shards the first N layers need from the hub.

    Those shards hold layers 0..N-1, the embedding, the final norm and lm_head. It prints the shards, the disk
    and the memory first (--dry-run: only that); a rerun skips the files already complete."""
    from huggingface_hub.utils import logging as hub_logging

    from .download import download_checkpoint, repo_name

    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id.rstrip("/")):
        raise InputError(f"{excerpt(repo_id)} is not a repository id: expected OWNER/NAME, e.g. deepseek-ai/DeepSeek-V3.2")
    _check_layers(layers)
    hub_logging.set_verbosity_error()  # its retry warnings; a failure ends in one error line of ours
    out = out if out is not None else default_weights_dir() / repo_name(repo_id)
    new_dirs = [d for d in (out, *out.parents) if not d.exists()]
    try:
        with _ProgressBar("downloading") as bar:
            plan = download_checkpoint(repo_id, out, layers, revision=revision, endpoint=endpoint, dry_run=dry_run,
                                       progress=bar, report=console.print, timeout_s=timeout, retries=retries)
    except BaseException:
        _remove_if_nothing_fetched(new_dirs)
        raise
    n = plan.shards.num_layers
    if dry_run:
        console.print(f"dry run: nothing more fetched; without --dry-run the shards go to {out}")
    else:
        console.print(f"ready: minirt generate {out} --layers {n}   ·   minirt verify {out} --layers {n}")


def _remove_if_nothing_fetched(new_dirs: list[Path]) -> None:
    """Remove the directories a failed download created when they hold no fetched file (only the hub's
    bookkeeping under .cache, or nothing): a rerun would skip a file already complete, so those stay."""
    import shutil

    if not new_dirs:
        return
    top = new_dirs[-1]  # the outermost directory this run created
    fetched = [f for f in top.rglob("*") if f.is_file() and ".cache" not in f.relative_to(top).parts]
    if not fetched:
        shutil.rmtree(top, ignore_errors=True)


def _tensor_parallel(tp: int | None, cfg):
    """The process group of --tp, initialised from torchrun's environment (None without --tp), after
    the checks that need none; from here on the ranks other than 0 print nothing."""
    from .models import family_of
    from .parallel import TensorParallel, init_from_env

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp is None:
        if world > 1:
            raise InputError(f"started as {world} processes (torchrun): pass --tp {world}")
        return None
    family_of(cfg).check_tensor_parallel(cfg, TensorParallel(0, tp))
    group = init_from_env(tp)
    if group.rank != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the life of this rank's process)
    return group


def _load(path, layers, device, backend, indexer_precision="exact", prefill_chunk=None, weights=None, tp=None):
    from . import load
    from .config import load_config
    from .models import family_of

    order = list(family_of(load_config(path)).plan_load(path, layers).specs)  # the loader's reading order, for the bar's tensor in flight
    with _ProgressBar(f"loading ({backend})", order, then=f"building the {backend} engine") as bar:
        return load(path, layers=layers, device=device, backend=backend, indexer_precision=indexer_precision,
                    prefill_chunk=prefill_chunk, weights=weights, progress=bar, tp=tp)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls, DEL; tab and newline stay


def escape_controls(text: str) -> str:
    """Control characters as visible escapes (``\\x1b``), so generated text cannot drive the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@contextlib.contextmanager
def _interrupts_deferred():
    """Ctrl-C and SIGTERM (both raised as KeyboardInterrupt, see Terminated) held back for the block:
    the interrupt comes after it, not inside it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _TextOut:
    """Generated text on stdout as it arrives: on a terminal with control characters escaped (and the
    prompt dimmed), elsewhere the exact text."""

    def __init__(self):
        self.terminal = sys.stdout.isatty()
        self.rich = Console(highlight=False, markup=False, soft_wrap=True, emoji=False)

    def write(self, text: str, dim: bool = False) -> None:
        if self.terminal:
            self.rich.print(escape_controls(text), style="dim" if dim else None, end="")
        else:
            sys.stdout.write(text)
        sys.stdout.flush()


class _LongRunNote:
    """Once work has run a few seconds and the rest would take over a minute, say so on stderr, once:
    ``note(done)`` with the units done so far (the first call starts the clock)."""

    AFTER_S, OVER_S = 3.0, 60.0

    def __init__(self, total: int, what: str = "tokens"):
        self.total, self.what, self.said = total, what, False
        self.start = self.first = None  # time and count of the first call

    def __call__(self, done: int, interrupting_text: bool = False) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start, self.first = now, done
            return
        elapsed = now - self.start
        if self.said or elapsed < self.AFTER_S or done <= self.first:
            return
        rate = (done - self.first) / elapsed
        left = (self.total - done) / rate
        if left > self.OVER_S:
            self.said = True
            sep = "\n" if interrupting_text else ""
            print(f"{sep}minirt: {self.total - done:,} more {self.what} at {rate:.2f} tok/s take about {_duration(left)}; "
                  "Ctrl-C stops", file=sys.stderr, flush=True)


def _stop_line(reasons: list[str], tokens: list[list[int]], max_new_tokens: int, eos: int | None) -> str:
    from .generate import STOP_EOS

    at_eos = sum(r == STOP_EOS for r in reasons)
    eos_text = f"the end-of-sequence token (id {eos})"
    if len(reasons) == 1:
        if at_eos:
            return f"stopped: {eos_text} after {len(tokens[0])} of at most {max_new_tokens} tokens"
        return f"stopped: {_count(max_new_tokens, 'token')}, the --max-new-tokens limit"
    return (f"stopped: {at_eos} of {len(reasons)} sequences at {eos_text}, {len(reasons) - at_eos} at "
            f"--max-new-tokens ({max_new_tokens})")


@app.command()
@_errors_to_exit_code
def generate(
    weights: WeightsArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", show_default=False,
                                                  help=f"Text prompt (needs tokenizer.json in the checkpoint). Default: {DEFAULT_PROMPT!r}.")] = None,
    tokens: Annotated[Optional[str], typer.Option(help="Prompt as comma-separated token ids, e.g. 1,2,3 (then token ids come out).")] = None,
    max_new_tokens: Annotated[str, typer.Option("--max-new-tokens", "-n", metavar="N",
                                                help="Tokens to generate at most; fewer when the end-of-sequence token comes.")] = "32",
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the sampling generator (with --temperature > 0).")] = 0,
    batch: Annotated[int, typer.Option(help="Run the prompt this many times as one batch (throughput).")] = 1,
    layers: LayersOpt = None,
    device: DeviceOpt = None,
    backend: Annotated[str, typer.Option(metavar="triton|reference",
                                         help="triton (kernels, fp8 cache) or reference (eager oracle).")] = "triton",
    indexer_precision: Annotated[str, typer.Option(metavar="exact|fp8",
                                                   help="exact (fp32 scores) or fp8 (official Hadamard + fp8).")] = "exact",
    prefill_chunk: PrefillChunkOpt = None,
    weights_format: WeightsOpt = None,
    warm_up: Annotated[str, typer.Option(
        "--warm-up", metavar="auto|yes|no",
        help="Run the prompt once untimed first, so the figures leave out Triton's compilation and the CUDA-graph "
        "capture (seconds on a GPU). auto: yes with the triton backend on a GPU.")] = "auto",
    tp: TpOpt = None,
):
    """Generate text (or token ids) and report why it stopped and the prefill and decode tokens/s.

    The text goes to stdout (control characters escaped on a terminal; with --batch above 1 each sequence on
    its own line, labelled), everything else to stderr."""
    import torch

    from .backend import check_tokens
    from .device import resolve_device
    from .generate import check_generation_length
    from .generate import generate as run_generate
    from .generate import warm_up as run_warm_up
    from .models import family_of
    from .sampling import SamplingParams
    from .tokenizer import IncrementalDecoder, load_tokenizer

    if prompt is not None and tokens is not None:
        raise InputError("give either --prompt or --tokens, not both")
    n = _whole_number(max_new_tokens, "--max-new-tokens", 1)
    chunk = _whole_number(prefill_chunk, "--prefill-chunk", 1)
    if batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}")
    _check_layers(layers)
    _choice(backend, "--backend", ("triton", "reference"))
    _choice(indexer_precision, "--indexer-precision", ("exact", "fp8"))
    _choice(weights_format, "--weights", ("fp8", "bf16"))
    _choice(warm_up, "--warm-up", ("auto", "yes", "no"))
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    if tokens is not None:
        ids = _token_ids(tokens)
    path, cfg = _checkpoint(weights)
    tokenizer = load_tokenizer(path)
    if tokens is None:
        if tokenizer is None:
            raise InputError(f"{path} has no tokenizer.json: pass the prompt as --tokens 1,2,3")
        if prompt == "":
            raise InputError("the prompt is empty")
        ids = tokenizer.encode(prompt if prompt is not None else DEFAULT_PROMPT)
    check_tokens(ids, cfg.vocab_size, "--tokens" if tokens is not None else "--prompt")
    check_generation_length(cfg, len(ids), n)
    group = _tensor_parallel(tp, cfg)
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    num_layers = layers if layers is not None else cfg.num_hidden_layers  # what the loader loads by default
    if backend == "triton" and group is None:  # (a rank's share: the loader checks its weights fit)
        family_of(cfg).check_generate_fits(cfg, num_layers, batch, len(ids), n, dev)
    engine = _load(path, layers, device, backend, indexer_precision, chunk, weights_format, tp)

    out = _TextOut()
    as_text = tokenizer is not None and tokens is None  # token ids in, token ids out
    detok = IncrementalDecoder(tokenizer) if as_text else None
    produced: list[list[int]] = [[] for _ in range(batch)]
    note = _LongRunNote(n)
    prefill_note = _LongRunNote(batch * len(ids), "prompt tokens")
    streaming = batch == 1  # a batch's sequences are printed one per line once done

    def stream(seq: int, token: int) -> None:
        printed = seq == 0 and streaming
        # An interrupt between the append and the write would count a token never printed.
        with _interrupts_deferred() if printed else contextlib.nullcontext():
            produced[seq].append(token)
            if printed:
                out.write(detok.push(token) if as_text else f"{' ' if len(produced[0]) > 1 else ''}{token}")
        if seq == 0:
            note(len(produced[0]), interrupting_text=streaming and out.terminal and console.is_terminal)

    def show_sequences() -> None:
        if streaming:
            out.write((detok.flush() if as_text else "") + "\n")
            return
        for i, new in enumerate(produced):
            out.write(f"sequence {i}: ", dim=True)
            if as_text:
                out.write(tokenizer.decode(ids), dim=True)
            out.write((tokenizer.decode(new) if as_text else " ".join(map(str, new))) + "\n")

    warm = warm_up == "yes" or (warm_up == "auto" and engine.backend == "triton" and engine.device.type == "cuda")
    try:
        warm_seconds = None
        if warm:
            with Live(Spinner("dots", "warm-up: compiling the kernels, capturing the decode graph"), console=console,
                      transient=True) if console.is_terminal else contextlib.nullcontext():
                warm_seconds = run_warm_up(engine, [ids] * batch, n)
        if as_text and streaming:
            out.write(tokenizer.decode(ids), dim=True)
        result = run_generate(engine, [ids] * batch, n, sampling, cfg.eos_token_id, stream,
                              on_prefill=(lambda done, total: prefill_note(done)) if engine.backend == "triton" else None)
    except KeyboardInterrupt:
        show_sequences()
        each = " per sequence" if batch > 1 else ""
        console.print(f"stopped: interrupted after {_count(len(produced[0]), 'token')}{each} of at most {n}")
        raise
    show_sequences()
    console.print(_stop_line(result.stop_reasons, result.tokens, n, cfg.eos_token_id))
    if warm_seconds is not None:
        console.print(f"warm-up: {warm_seconds:.2f} s, not in the figures below (Triton compiles the kernels on their "
                      "first call; the first decode step of a batch size captures its CUDA graph)")
    where = f"({engine.backend}, {engine.device})"
    console.print(f"prefill: {_count(result.prefill_tokens, 'token')}, {result.prefill_tokens_per_s:,.1f} tok/s "
                  f"in {result.prefill_seconds:.2f} s {where}")
    if result.decode_steps:
        console.print(f"decode: {_count(result.decode_steps, 'step')} × batch {batch} = {_count(result.decode_tokens, 'token')}, "
                      f"{result.decode_tokens_per_s:,.1f} tok/s with sampling and streaming; the engine's steps alone "
                      f"{result.decode_steps_per_s:,.1f} steps/s")
    else:
        console.print("decode: no step (each sequence's one token came from prefill)")
    if engine.backend == "triton" and engine.device.type == "cpu":
        console.print("cpu: the Triton kernels run in the interpreter (exact, but far slower than on a GPU)")
    elif warm_seconds is None and engine.device.type == "cuda" and engine.backend == "triton":
        console.print("note: with --warm-up no these figures include the kernels' compilation and the graph capture")


def _choice(value: str | None, option: str, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise InputError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


def _token_ids(text: str) -> list[int]:
    """--tokens as ints; the error shows an excerpt of a long list and the first item that is no int."""
    items = text.split(",")
    for i, item in enumerate(items):
        if not re.fullmatch(r"\s*[+-]?\d{1,30}\s*", item):
            where = f"; item {i + 1} of {len(items)} is {excerpt(item)}" if len(text) > 60 else ""
            raise InputError(f"--tokens must be comma-separated integers, got {excerpt(text)}{where}")
    return [int(t) for t in items]


def _weights_in_memory(engine) -> str:
    """What the runtime's weights are in memory: 'fp8 weights' as stored, else the dtype they were
    dequantised to (fp32 on the CPU)."""
    if engine.weights == "fp8":
        return "fp8 weights as stored"
    held = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(engine.dtype)]
    return f"{held} weights, dequantised at load" if engine.cfg.quantization else f"{held} weights"


class _VerifyStages:
    """verify's stage on a spinner, with its elapsed time and, in the runtime's prefills, the prompt
    tokens done and the time left; off a terminal a long stage says once how long it will take."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.live, self.name = prompt_len, None, ""
        self.started = time.perf_counter()
        self.note = _LongRunNote(prompt_len, "prompt tokens")

    def __call__(self, name: str) -> None:
        self.name, self.started = name, time.perf_counter()
        self.note = _LongRunNote(self.prompt_len, "prompt tokens")
        self._show("")

    def prefill(self, done: int, total: int) -> None:
        self.note(done)
        elapsed = time.perf_counter() - self.started
        left = f", about {_duration(elapsed / done * (total - done))} left" if done and done < total else ""
        self._show(f": {done:,}/{total:,} prompt tokens{left}")

    def _show(self, detail: str) -> None:
        if self.live is not None:
            self.live.update(Spinner("dots", f"verify: {self.name}{detail}"), refresh=True)


@app.command()
@_errors_to_exit_code
def verify(
    weights: WeightsArg = None,
    layers: LayersOpt = None,
    device: DeviceOpt = None,
    prompt_len: Annotated[Optional[int], typer.Option(help="Prompt tokens (default: 2·index_topk + 8, so top-k is sparse).")] = None,
    decode_steps: Annotated[int, typer.Option(help="Decode steps after the prompt.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the random prompt tokens.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    prefill_chunk: PrefillChunkOpt = None,
    weights_format: WeightsOpt = None,
    tp: TpOpt = None,
):
    """Run the kernel runtime and the eager reference on the same random tokens and compare them.

    Exit 0 when every row is within its tolerance (README: "verify tolerances"), 1 otherwise. Refuses (exit 2)
    a length past max_position_embeddings or one whose eager reference would not fit in memory."""
    import torch

    from .device import resolve_device
    from .models import family_of
    from .sampling import check_seed

    chunk = _whole_number(prefill_chunk, "--prefill-chunk", 1)
    _check_layers(layers)
    _choice(weights_format, "--weights", ("fp8", "bf16"))
    path, cfg = _checkpoint(weights)
    family = family_of(cfg)
    if _tensor_parallel(tp, cfg) is not None and device is None:  # every rank checks against its own reference
        from .parallel import local_device

        device = str(local_device())
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    num_layers = layers if layers is not None else cfg.num_hidden_layers
    family.tensor_specs(cfg, num_layers)  # more layers than the model has: the loader's error, now
    if prompt_len is None:
        prompt_len = family.default_prompt_len(cfg)
    if prompt_len < 1 or decode_steps < 0:
        raise InputError(f"need --prompt-len >= 1 and --decode-steps >= 0, got {prompt_len}, {decode_steps}")
    check_seed(seed)
    total = prompt_len + decode_steps
    if total > cfg.max_position_embeddings:
        raise InputError(f"--prompt-len ({prompt_len}) + --decode-steps ({decode_steps}) = {total} tokens exceeds the "
                         f"model's max_position_embeddings ({cfg.max_position_embeddings})")
    family.check_verify_fits(cfg, num_layers, prompt_len, decode_steps, dev)

    engine = _load(path, num_layers, str(dev), "triton", prefill_chunk=chunk, weights=weights_format, tp=tp)
    oracle = _load(path, num_layers, str(dev), "reference")
    stage = _VerifyStages(prompt_len)
    with Live(console=console, transient=True) as live:  # the stage now running, redrawn at once
        stage.live = live
        report = family.run_verify(engine, oracle, prompt_len, decode_steps, seed, progress=stage,
                            on_prefill=stage.prefill)
    failures = report.failures()
    if as_json:
        print(report.to_json())
    else:
        out = Console(highlight=False, soft_wrap=True)
        out.print(f"minirt verify {escape(str(path))}: the runtime ({_weights_in_memory(engine)}) against the eager "
                  f"fp32 reference, {_count(engine.num_layers, 'layer')}, {_count(prompt_len, 'prompt token')} + "
                  f"{_count(decode_steps, 'decode step')}, {engine.device}")
        t = Table()
        for col, justify in (("check", "left"), ("value", "right"), ("limit", "left"), ("result", "left")):
            t.add_column(col, justify=justify)
        for c in report.checks:
            t.add_row(c.name, f"{c.value:.3e}", f"{'≤' if c.kind == 'max' else '≥'} {c.limit:g}",
                      "[green]ok[/]" if c.ok else "[red]FAIL[/]")
        out.print(t)
        if failures:
            out.print(f"[red]FAIL[/]: {len(failures)} of {len(report.checks)} checks outside tolerance: "
                      + ", ".join(c.name for c in failures))
        else:
            out.print(f"[green]PASS[/]: all {len(report.checks)} checks within tolerance")
    if failures:
        if as_json:
            print(f"minirt: verify failed: {', '.join(c.name for c in failures)} outside tolerance", file=sys.stderr)
        raise typer.Exit(1)
