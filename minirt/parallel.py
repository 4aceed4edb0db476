"""Tensor and expert parallelism over a ``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU).

With N ranks (``TensorParallel``), every rank holds the whole residual stream and:

- attention: its ``H / N`` heads (``q_b_proj`` and ``kv_b_proj`` rows, ``o_proj`` columns); the latent
  cache and the lightning indexer are replicated (MLA has one KV head), ``o_proj``'s partial sums are
  all-reduced: one all-reduce per attention;
- a dense MLP: its ``1 / N`` of the intermediate width (``gate`` / ``up`` rows, ``down`` columns), all-reduced;
- a MoE layer (expert parallelism): its ``E / N`` routed experts. Each rank routes its ``1 / N`` of the
  step's tokens, sends each of them, with the slots that chose that rank's experts, to every rank
  (``all_to_all_single`` of fixed size: no host sync, CUDA-graph capturable), computes the slots that
  reached its experts, sends the partial sums back (a second ``all_to_all_single``), adds them and the
  replicated shared experts, and all-gathers the tokens;
- the embedding and lm_head: its ``V / N`` rows of the vocabulary (lookups all-reduced, logits all-gathered).

Each rank reads only its rows / columns / experts from the checkpoint: which part of each tensor a rank
holds is the family's (``minirt.models.deepseek_v32.parallel``, ``minirt.models.deepseek_v4.parallel``).
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, InputError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` in [0, ``world``), the ``group``
    (None: the default group). ``SINGLE`` (world 1) makes every collective the identity."""

    rank: int = 0
    world: int = 1
    group: object = None

    def __post_init__(self):
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise InputError(f"tp must be a whole number >= 1, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise InputError(f"rank {self.rank!r} is outside [0, {self.world})")

    @classmethod
    def current(cls, tp: int) -> "TensorParallel":
        """The view of the initialised default process group for ``tp`` ranks; ``SINGLE`` for tp 1 (this
        process alone, even inside a group). InputError when ``tp`` is not a whole number >= 1, when
        tp > 1 and no process group is initialised (run under torchrun), or when the group's world
        size is not ``tp``."""
        if TensorParallel(0, tp).world == 1:
            return SINGLE
        if not (dist.is_available() and dist.is_initialized()):
            raise InputError(f"tp={tp} needs an initialised torch.distributed process group of {tp} processes "
                             f"(run under: torchrun --nproc-per-node {tp} -m minirt ... --tp {tp})")
        if dist.get_world_size() != tp:
            raise InputError(f"tp={tp}, but the process group has {dist.get_world_size()} process(es): "
                             "start as many processes as --tp says")
        return cls(dist.get_rank(), tp)

    def share(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of ``n`` items; ConfigError unless N divides n."""
        if n % self.world:
            raise ConfigError(f"tensor parallelism over {self.world} ranks needs {what} ({n}) divisible by {self.world}")
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x itself is returned)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x, in rank order."""
        if self.world == 1:
            return x[None]
        out = x.new_empty(self.world * x.numel())
        _all_gather_single(out, x.contiguous().flatten(), group=self.group)
        return out.view(self.world, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [world, ...]: row d goes to rank d; returns [world, ...] whose row s came from rank s."""
        if self.world == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out


SINGLE = TensorParallel()
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10


def init_from_env(tp: int) -> TensorParallel:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT) for ``tp`` ranks: NCCL when CUDA is available (each rank on ``cuda:LOCAL_RANK``),
    else gloo. A group already initialised is used as it is. InputError when the environment names no
    group (not started by torchrun) or a world size other than ``tp``."""
    TensorParallel(0, tp)  # a valid tp
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            if tp == 1:
                return SINGLE
            raise InputError(f"--tp {tp} needs {tp} processes in a process group: run "
                             f"torchrun --nproc-per-node {tp} -m minirt ... --tp {tp}")
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise InputError(f"--tp {tp}, but torchrun started {world} process(es) (--nproc-per-node {world})")
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(dist.destroy_process_group)
    return TensorParallel.current(tp)


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)))


# ---------------------------------------------------------------------------------------------------------------
# Which part of each checkpoint tensor a rank holds


@dataclass(frozen=True)
class Shard:
    """Elements [start, stop) along ``dim`` (0: rows, 1: columns) of a stored tensor."""

    dim: int
    start: int
    stop: int

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shard's shape, out of the full tensor's."""
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(full))

    def in_blocks(self, block: tuple[int, int], name: str) -> "Shard":
        """The same shard of the tensor's ``_scale_inv`` (one value per block): ConfigError unless the
        shard starts and ends on block boundaries (weights="bf16" dequantises and has no such need)."""
        b = block[self.dim]
        if self.start % b or self.stop % b:
            raise ConfigError(f"{name}: this rank's {'rows' if self.dim == 0 else 'columns'} [{self.start}, "
                              f"{self.stop}) cut fp8 blocks of {b}: load with weights='bf16', or a --tp that keeps "
                              f"whole blocks")
        return Shard(self.dim, self.start // b, -(-self.stop // b))


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary-parallel embedding and lm_head


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding's lookup with this rank's rows [start, stop) of the vocabulary: ``weight``
    [vocab / N, hidden]. forward(tokens [N] int) -> [N, hidden] in weight's dtype, the same on every
    rank: each rank writes the tokens it holds (zeros elsewhere) and the ranks' rows are all-reduced
    (one non-zero term each: exact)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.stop = tp.share(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:  # every row is this rank's: the lookup alone (one launch, not eight)
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(rows)


class VocabParallelHead(nn.Module):
    """lm_head with this rank's rows of the vocabulary: ``weight`` [vocab / N, hidden].
    forward(h [N, hidden]) -> logits [N, vocab] in h's dtype, all-gathered (the same on every rank)."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        start, stop = tp.share(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(stop - start, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        parts = self.tp.all_gather(F.linear(h, self.weight))  # [N ranks, tokens, vocab / N]
        return parts.permute(1, 0, 2).flatten(1)


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism: dispatch and combine


def expert_parallel_moe(x: torch.Tensor, gate: nn.Module, experts: nn.Module, shared: nn.Module | None,
                        routing: tuple[torch.Tensor, torch.Tensor] | None, n_experts: int,
                        tp: TensorParallel) -> torch.Tensor:
    """A MoE layer over N ranks, each holding ``experts`` = its E / N routed experts (global ids
    [rank · E/N, (rank + 1) · E/N)); every rank passes the same x [T, hidden] and gets the same
    [T, hidden] (x's dtype): Σ_k w_k · expert_k(x) + shared(x).

    Rank r routes tokens [r·P, (r+1)·P) (P = ceil(T / N), the last rank's share padded with slots of no
    expert) with ``gate`` (or the given global ``routing`` (weights [T, k], expert ids [T, k]) rows),
    and sends each token to every rank d with the slots that chose d's experts (others −1, which
    ``experts`` skips): one ``all_to_all_single`` of the tokens [N, P, hidden], one of the slots'
    ids and weights. Each rank computes what reached its experts, sends the partial sums back (the
    combine ``all_to_all_single``), adds the N partials in fp32 and its shared experts, and the
    shares are all-gathered. Fixed shapes, no host sync: a decode step stays CUDA-graph capturable."""
    n, per = tp.world, -(-x.shape[0] // tp.world)
    mine = slice(tp.rank * per, (tp.rank + 1) * per)
    xs = F.pad(x, (0, 0, 0, n * per - x.shape[0]))[mine]  # [P, hidden]: this rank's tokens (zeros past T)
    if routing is None:
        weights, ids = gate(xs)
    else:
        weights, ids = (F.pad(t, (0, 0, 0, n * per - t.shape[0]), value=-1 if i else 0)[mine]
                        for i, t in enumerate(routing))
    ids = ids.to(torch.int32)
    ids = torch.where(torch.arange(per, device=x.device)[:, None] + tp.rank * per < x.shape[0], ids, -1)
    local = n_experts // n
    dest = torch.arange(n, device=x.device, dtype=torch.int32)[:, None, None]
    send_ids = torch.where((ids >= 0) & (ids // local == dest), ids - dest * local, -1)  # [N, P, k]
    # ids (int32) and weights (fp32) travel in one message: the ids' bits viewed as fp32, never computed on.
    meta = torch.cat([send_ids.view(torch.float32), weights.float().expand(n, -1, -1)], dim=-1)
    recv_x = tp.all_to_all(xs.expand(n, -1, -1))
    recv_ids, recv_w = tp.all_to_all(meta).split(ids.shape[1], dim=-1)
    partial = experts(recv_x.flatten(0, 1), recv_ids.contiguous().view(torch.int32).flatten(0, 1),
                      recv_w.flatten(0, 1).contiguous())
    out = tp.all_to_all(partial.view(n, per, -1)).float().sum(0).to(x.dtype)
    if shared is not None:
        out = out + shared(xs).to(x.dtype)
    return tp.all_gather(out).flatten(0, 1)[: x.shape[0]]
