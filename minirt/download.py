"""``minirt download``: from a Hugging Face repository, only the files minirt reads for its first N layers.

That is config.json, ``model.safetensors.index.json``, tokenizer.json (when the repository has one) and
the shards holding the tensors of layers 0..N-1, the embedding, the final norm and lm_head: for
DeepSeek-V3.2 a few of its 163 shards. The files go straight into the target directory (huggingface_hub's
``local_dir`` mode, which keeps its bookkeeping in ``DIR/.cache/huggingface``): a rerun skips the files
already complete and fetches the others, and an interrupted file starts again. The hub is
``endpoint`` when given, else ``HF_ENDPOINT``, else huggingface.co; ``HF_TOKEN`` is used when set.
"""
from __future__ import annotations

import contextlib
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.filesize import decimal  # sizes in kB / MB / GB, as disks are sold

from .blockfp8 import block_scale_shape
from .models.deepseek_v32.checkpoint import SCALE_SUFFIX, plan_load, tensor_specs
from .shards import INDEX_FILE, Progress, read_weight_map
from .config import ModelConfig
from .errors import CheckpointError, InputError, MinirtError, WriteError, excerpt
from .files import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, MAX_TOKENIZER_BYTES, as_path, is_present, read_json, shown
from .tokenizer import TOKENIZER_FILE

CONFIG_FILE = "config.json"


class DownloadError(MinirtError):
    """The hub could not be reached, or has no such repository, revision or file."""


@dataclass(frozen=True)
class ShardPlan:
    """Which shards hold what loading ``num_layers`` layers reads, from config.json and the index alone
    (no shard needs to be present): ``shards`` file names, sorted; ``index_shards`` how many shards the
    whole checkpoint has; ``index_total_size`` the index's ``metadata.total_size`` (bytes of all tensors)
    or None; ``num_parameters`` the weights' elements (scales not counted); ``fp8_weight_bytes`` the
    loaded weights with the linear ones kept in fp8 as stored (``minirt.load(weights="fp8")``: e4m3 and
    their block scales, the rest bf16), None for a checkpoint without fp8 weights."""

    config: ModelConfig
    num_layers: int
    shards: tuple[str, ...]
    index_shards: int
    index_total_size: int | None
    num_parameters: int
    fp8_weight_bytes: int | None

    def memory_bytes(self, itemsize: int) -> int:
        """Bytes of the loaded weights at ``itemsize`` bytes per parameter (2: bf16 on cuda, 4: fp32)."""
        return self.num_parameters * itemsize

    def estimated_shard_bytes(self) -> int | None:
        """Mean shard size by the index (total_size / shards): the disk a shard not yet here will take."""
        return None if self.index_total_size is None else self.index_total_size // self.index_shards


def plan_shards(path: str | Path, num_layers: int | None = None) -> ShardPlan:
    """The shards of checkpoint directory ``path`` that loading its first ``num_layers`` dense layers
    (None: all) opens, from config.json and ``model.safetensors.index.json`` (or the single
    ``model.safetensors``). Raises ConfigError / CheckpointError as ``checkpoint.plan_load`` does: for a
    bad config, MoE layers asked for, or a needed tensor the index does not map."""
    path = Path(path)
    cfg = ModelConfig.from_file(path / CONFIG_FILE)
    num_layers = cfg.num_dense_layers if num_layers is None else num_layers
    specs = tensor_specs(cfg, num_layers)
    map_file, weight_map = read_weight_map(path)
    needed = [n + suffix for n, spec in specs.items() for suffix in (("", SCALE_SUFFIX) if spec.quantized else ("",))]
    for name in needed:
        if name not in weight_map:
            raise CheckpointError(f"{path}: tensor {name} is missing (not in {map_file})")
    total_size = None
    if map_file == INDEX_FILE:
        index = read_json(path / INDEX_FILE, INDEX_FILE, MAX_INDEX_BYTES, CheckpointError)
        metadata = index.get("metadata") if isinstance(index, dict) else None
        size = metadata.get("total_size") if isinstance(metadata, dict) else None
        total_size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    fp8_bytes = None
    if cfg.quantization is not None:
        block = cfg.quantization.weight_block_size
        fp8_bytes = sum(math.prod(spec.shape) + 4 * math.prod(block_scale_shape(spec.shape, block)) if spec.quantized
                        else 2 * math.prod(spec.shape) for spec in specs.values())
    return ShardPlan(cfg, num_layers, tuple(sorted({weight_map[n] for n in needed})), len(set(weight_map.values())),
                     total_size, sum(math.prod(spec.shape) for spec in specs.values()), fp8_bytes)


def _hub_error(e: Exception, repo_id: str, filename: str, endpoint: str) -> MinirtError:
    """One line for what huggingface_hub raised fetching ``filename``."""
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, HFValidationError):
        return InputError(f"{excerpt(repo_id)} is not a repository id of the form owner/name")
    if isinstance(e, GatedRepoError):
        return DownloadError(f"{repo_id} on {endpoint} is gated: accept its terms on the hub and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return DownloadError(f"{repo_id}: no such repository on {endpoint} (or it is private: set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return DownloadError(f"{repo_id}: no such revision on {endpoint}")
    if isinstance(e, RemoteEntryNotFoundError):
        return DownloadError(f"{repo_id} on {endpoint} has no file {filename}")
    if isinstance(e, _RetryBudgetSpent):
        return DownloadError(f"{repo_id}/{filename} from {endpoint}: {e}")
    if isinstance(e, LocalEntryNotFoundError):  # what the client raises when the hub did not give the file
        status = _http_status(e)
        if status is not None:
            return DownloadError(f"{endpoint} answered HTTP {status} for {repo_id}/{filename} (the hub, not the network: "
                                 "try again later)")
        return DownloadError(f"cannot reach {endpoint} to fetch {repo_id}/{filename} (network down, or a wrong "
                             "--endpoint / HF_ENDPOINT)")
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, OSError) and e.errno is not None:  # the local disk, not the hub
        return WriteError(f"{filename}: cannot write it ({e.strerror or reason})")
    return DownloadError(f"{repo_id}/{filename} from {endpoint}: {reason}")


def _http_status(e: BaseException) -> int | None:
    """The HTTP status of the hub's answer somewhere in the chain of causes of ``e``, or None (no answer)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if getattr(response, "status_code", None) is not None:
            return response.status_code
        e = e.__cause__ or e.__context__
    return None


class _RetryBudgetSpent(Exception):
    """The network failed more times than the retry budget allows (not an httpx error, so the hub
    client's own retry loops let it through)."""


RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)


def _budget_client_factory(timeout_s: float, budget: dict):
    """An httpx client factory for huggingface_hub whose every request waits at most ``timeout_s`` for a
    connection and for each read (the client's own retries wait 60 s), and whose failures (timeouts,
    refused or dropped connections, HTTP 408 / 429 / 5xx) are counted in ``budget["failures"]``: past
    ``budget["retries"]`` of them a request raises _RetryBudgetSpent. Retry-After headers are dropped,
    so a hub cannot make the client sleep for as long as it says."""
    import httpx2  # huggingface_hub's HTTP client

    network_errors = (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)

    def fail(what: str) -> None:
        budget["failures"] += 1
        if budget["failures"] > budget["retries"]:
            raise _RetryBudgetSpent(f"{what}, {budget['failures']} time(s) (--retries {budget['retries']}, "
                                    f"--timeout {timeout_s:g} s)")

    class BudgetStream(httpx2.SyncByteStream):
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            try:
                yield from self.inner
            except network_errors as e:
                fail(f"the connection failed while reading ({type(e).__name__})")
                raise

        def close(self):
            self.inner.close()

    class BudgetTransport(httpx2.BaseTransport):
        def __init__(self):
            self.inner = httpx2.HTTPTransport()

        def handle_request(self, request):
            request.extensions["timeout"] = httpx2.Timeout(timeout_s).as_dict()
            try:
                response = self.inner.handle_request(request)
            except network_errors as e:
                fail(f"no answer within {timeout_s:g} s ({type(e).__name__})")
                raise
            if response.status_code in RETRYABLE_STATUS:
                for header in ("Retry-After", "RateLimit", "RateLimit-Policy"):
                    response.headers.pop(header, None)
                try:
                    fail(f"the hub answered HTTP {response.status_code}")
                except _RetryBudgetSpent:
                    response.close()
                    raise
            response.stream = BudgetStream(response.stream)
            return response

        def close(self):
            self.inner.close()

    return lambda: httpx2.Client(transport=BudgetTransport(), follow_redirects=True)


@contextlib.contextmanager
def _network_budget(timeout_s: float, retries: int):
    """huggingface_hub's requests under ``_budget_client_factory`` and its log warnings silenced (the
    errors come back as exceptions) for the block; yields the budget, whose failures the caller resets
    per file."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http as hub_http  # the factory in use has no public getter
    from huggingface_hub.utils import logging as hub_logging

    budget = {"failures": 0, "retries": retries}
    verbosity, factory = hub_logging.get_verbosity(), hub_http._GLOBAL_CLIENT_FACTORY
    hub_logging.set_verbosity_error()
    set_client_factory(_budget_client_factory(timeout_s, budget))
    try:
        yield budget
    finally:
        set_client_factory(factory)
        hub_logging.set_verbosity(verbosity)


def _silent_bar(report: Callable[[int], None] | None):
    """A tqdm class for huggingface_hub that shows nothing and hands each byte count to ``report``."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class SilentBar(hub_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if report is not None and n:
                report(n)
            return super().update(n)

    return SilentBar


@dataclass(frozen=True)
class DownloadPlan:
    """What ``download_checkpoint`` fetched or, with ``dry_run``, would fetch: the shard plan, each needed
    shard's size on the hub, and which of them were already complete in the directory."""

    shards: ShardPlan
    sizes: dict[str, int]
    present: tuple[str, ...]

    @property
    def bytes_to_fetch(self) -> int:
        return sum(size for name, size in self.sizes.items() if name not in self.present)


DEFAULT_TIMEOUT_S = 10.0  # seconds a connection or a read may wait
DEFAULT_RETRIES = 2       # network failures tolerated per file


def repo_name(repo_id: str) -> str:
    """The name part of a hub repository id (``owner/name`` → ``name``), or InputError when ``repo_id``
    is not one (huggingface_hub's rules: no ``..``, no spaces, at most one ``/``)."""
    from huggingface_hub.utils import validate_repo_id
    from huggingface_hub.errors import HFValidationError

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise InputError(f"{excerpt(repo_id)} is not a repository id of the form owner/name") from None
    return repo_id.split("/")[-1]


def _check_network_budget(timeout_s, retries) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
        raise InputError(f"timeout must be a number of seconds in (0, 3600], got {timeout_s!r:.40}")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise InputError(f"retries must be a whole number in [0, 100], got {retries!r:.40}")


def download_checkpoint(repo_id: str, out_dir: str | Path, num_layers: int | None = None, *, revision: str | None = None,
                        endpoint: str | None = None, dry_run: bool = False, progress: Progress | None = None,
                        report: Callable[[str], None] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                        retries: int = DEFAULT_RETRIES) -> DownloadPlan:
    """Fetch what loading the first ``num_layers`` dense layers (None: all) of hub repository ``repo_id``
    reads into ``out_dir``: config.json, ``model.safetensors.index.json``, tokenizer.json if there is
    one, then only the shards holding those layers, the embedding, the final norm and lm_head.

    The arguments are checked before ``out_dir`` is created; a directory this call created is removed
    again when it fails before a shard is complete. Each connection and read waits at most
    ``timeout_s`` seconds, and each file tolerates ``retries`` network failures (timeouts, dropped
    connections, HTTP 408 / 429 / 5xx). config.json, the index and tokenizer.json larger than minirt
    reads (``files.MAX_*_BYTES``) are refused before they are fetched. Before any shard: asks the hub
    each shard's size, says the plan through ``report(lines)``, and refuses (WriteError) when the disk
    has less room than the shards still to fetch; ``dry_run`` stops there. ``progress(done, total,
    name)`` is called as shard bytes arrive (total: the bytes to fetch; name: the shard in flight). At
    the end the directory is checked as ``minirt.load`` would (``checkpoint.plan_load``). Raises
    DownloadError (hub unreachable or failing; no such repository, revision or file; no index),
    InputError (bad repository id, path, timeout or retries), ConfigError / CheckpointError (what
    arrived is unusable, or ``num_layers`` reaches MoE layers), WriteError (the disk).
    """
    from huggingface_hub import constants

    repo_name(repo_id)
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise InputError(f"num_layers must be a positive int, got {num_layers!r:.40}")
    out_dir = as_path(out_dir, "the output directory")
    _check_network_budget(timeout_s, retries)
    if endpoint is not None and not re.fullmatch(r"https?://[^\s]+", endpoint):
        raise InputError(f"endpoint must be an http:// or https:// URL, got {excerpt(endpoint)}")
    hub = endpoint or constants.ENDPOINT
    created = not is_present(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{shown(out_dir)}: cannot create the directory ({e.strerror or e})") from None
    shards_done: list[str] = []
    try:
        with _network_budget(timeout_s, retries) as budget:
            return _download(repo_id, out_dir, num_layers, revision, endpoint, hub, dry_run, progress,
                             report or (lambda lines: None), budget, shards_done)
    except BaseException:
        if created and not shards_done:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _download(repo_id, out_dir: Path, num_layers, revision, endpoint, hub: str, dry_run: bool, progress, say,
              budget: dict, shards_done: list[str]) -> DownloadPlan:
    """download_checkpoint's work, once the arguments are checked and out_dir exists; appends each shard
    fetched to ``shards_done``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError

    def size_on_hub(filename: str) -> int:
        budget["failures"] = 0
        try:
            return get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint),
                                            retry_on_errors=True).size or 0
        except Exception as e:
            raise _hub_error(e, repo_id, filename, hub) from e

    def fetch(filename: str, required: bool = True, on_bytes: Callable[[int], None] | None = None,
              limit: int | None = None) -> bool:
        """False when an optional file is not in the repository; ``limit``: the most bytes it may have."""
        budget["failures"] = 0
        try:
            if limit is not None:
                size = get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint),
                                            retry_on_errors=True).size
                if (size or 0) > limit:
                    raise CheckpointError(f"{repo_id}/{filename} on {hub} is {size:,} bytes, more than the {limit:,} "
                                          "minirt reads")
            hf_hub_download(repo_id, filename, revision=revision, local_dir=out_dir, endpoint=endpoint,
                            tqdm_class=_silent_bar(on_bytes))
        except RemoteEntryNotFoundError as e:
            if required:
                raise _hub_error(e, repo_id, filename, hub) from e
            return False
        except MinirtError:
            raise
        except Exception as e:  # the client's own errors, httpx's, the disk's: one line each
            raise _hub_error(e, repo_id, filename, hub) from e
        return True

    fetch(CONFIG_FILE, limit=MAX_CONFIG_BYTES)
    if not fetch(INDEX_FILE, required=False, limit=MAX_INDEX_BYTES):
        raise DownloadError(f"{repo_id} has no {INDEX_FILE}, from which minirt download picks the shards; fetch a "
                            "single-file checkpoint whole with huggingface_hub (`hf download`)")
    tokenizer = fetch(TOKENIZER_FILE, required=False, limit=MAX_TOKENIZER_BYTES)
    say(f"fetched {CONFIG_FILE}, {INDEX_FILE}" + (f", {TOKENIZER_FILE}" if tokenizer else
                                                  f" (no {TOKENIZER_FILE}: give prompts as --tokens)"))
    shards = plan_shards(out_dir, num_layers)
    sizes = {name: size_on_hub(name) for name in shards.shards}
    present = tuple(n for n in shards.shards if (out_dir / n).is_file() and (out_dir / n).stat().st_size == sizes[n])
    plan = DownloadPlan(shards, sizes, present)
    free = shutil.disk_usage(out_dir).free
    say(describe_plan(plan, free))
    if plan.bytes_to_fetch > free:
        raise WriteError(f"{out_dir}: the shards still to fetch take {decimal(plan.bytes_to_fetch)}, the disk has "
                         f"{decimal(free)} free")
    if dry_run:
        return plan

    done = 0
    for name in shards.shards:  # the client checks the ones already here against the hub and keeps them
        before = done

        def on_bytes(n: int, name: str = name) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, plan.bytes_to_fetch, name)

        fetch(name, on_bytes=on_bytes)
        shards_done.append(name)
        say(f"fetched {name} ({decimal(sizes[name])})" if done > before else f"{name} was already complete")
    plan_load(out_dir, shards.num_layers)
    return plan


def describe_plan(plan: DownloadPlan, free_bytes: int) -> str:
    """The plan in a few lines: shards and their disk, what is already here, the memory to load them."""
    s = plan.shards
    here = f", {len(plan.present)} already here" if plan.present else ""
    return "\n".join([
        f"{'layer 0' if s.num_layers == 1 else f'layers 0-{s.num_layers - 1}'}, the embedding, the final norm and "
        f"lm_head are in {len(s.shards)} of the "
        f"{s.index_shards} shard(s): {', '.join(s.shards)}",
        f"disk: {decimal(sum(plan.sizes.values()))} for those shards{here}; {decimal(plan.bytes_to_fetch)} to fetch, "
        f"{decimal(free_bytes)} free",
        f"memory: {s.num_parameters:,} parameters: {memory_text(s)}",
    ])


def memory_text(s: ShardPlan) -> str:
    """The loaded weights' memory in each format: fp8 (cuda sm_90+, its default there), bf16, fp32."""
    fp8 = f"{decimal(s.fp8_weight_bytes)} fp8 (cuda sm_90+) · " if s.fp8_weight_bytes is not None else ""
    return (f"{fp8}{decimal(s.memory_bytes(2))} bf16 (cuda) · {decimal(s.memory_bytes(4))} fp32 (cpu, and the "
            "eager reference; verify holds it too)")
