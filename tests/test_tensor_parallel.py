"""Tensor + expert parallelism (minirt.parallel) over 2 gloo processes on the CPU: the same logits as one
process, prefill and decode, on the tiny preset's dense and MoE layers and on v4-tiny's SWA / CSA / HCA
layers; each rank's slices of the checkpoint; and the bad-input errors."""
import os

import pytest
import torch
import torch.multiprocessing as mp
from typer.testing import CliRunner

import minirt
from minirt.context import PrefillTrace
from minirt.cli import app
from minirt.errors import InputError

PROMPTS = [[1, 2, 3], [4, 5]]              # 5 tokens: the MoE's token shares are padded (3 + 2)
DECODE_TOKENS = [[10, 11], [12, 13]]       # fixed, so both runs decode the same tokens


def run(engine) -> dict[str, torch.Tensor]:
    """Prefill logits [2, vocab] and each decode step's [2, vocab] ("logits", stacked), and the residual
    stream of the prefill's tokens after each layer ("hidden", [layers, 5, hidden])."""
    trace = PrefillTrace()
    logits = [engine.prefill(PROMPTS, trace=trace)]
    logits += [engine.decode(torch.tensor(t)) for t in DECODE_TOKENS]
    return {"logits": torch.cat(logits), "hidden": torch.stack(trace.hidden_states)}


def _rank(rank: int, world: int, init_file: str, checkpoint: str, out_dir: str, runner=run, args=()) -> None:
    """One rank of the group: saves ``runner(engine, *args)`` as rank{rank}.pt in out_dir."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(runner(minirt.load(checkpoint, device="cpu", tp=world), *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_moe3(tmp_path_factory):
    """tiny's 2 dense layers and its first MoE layer."""
    from minirt.synthetic import write_synthetic_checkpoint
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("tp") / "tiny", preset="tiny", seed=5, num_layers=3)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_two_ranks_match_one_process(tiny_moe3, tmp_path):
    """Heads, MLP width, vocabulary and experts split over 2 ranks (each reading only its shards):
    every rank's outputs equal the other's bit for bit and one process's to float tolerance. The dense
    layers differ in summation order only, which can flip the bf16 rounding of a kernel input (the
    attention kernels take bf16 queries); the MoE layer's routed experts return a bf16 partial sum per
    rank (one bf16 rounding more than one process's), hence the looser bound after it."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), str(tiny_moe3), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    single = run(minirt.load(tiny_moe3, device="cpu"))  # meanwhile
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0, f"a rank failed (exit code {p.exitcode})"
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for key in ("logits", "hidden"):
        assert torch.equal(rank0[key], rank1[key])
        assert rank0[key].shape == single[key].shape and torch.isfinite(rank0[key]).all()
    for layer in (0, 1):  # dense
        assert rel_err(rank0["hidden"][layer], single["hidden"][layer]) < 3e-4, layer
    assert rel_err(rank0["hidden"][2], single["hidden"][2]) < 1e-2
    assert rel_err(rank0["logits"][:2], single["logits"][:2]) < 1e-2   # prefill
    assert rel_err(rank0["logits"][2:], single["logits"][2:]) < 1e-2   # decode


def test_load_tp_bad_input(tiny_moe3):
    """tp outside a process group, tp < 1, a tp not dividing the heads: InputError naming it."""
    with pytest.raises(InputError, match="process group"):
        minirt.load(tiny_moe3, device="cpu", tp=2)
    with pytest.raises(InputError, match="tp must be a whole number >= 1"):
        minirt.load(tiny_moe3, device="cpu", tp=0)
    from minirt.config import ModelConfig
    from minirt.models.deepseek_v32.parallel import check_tensor_parallel
    from minirt.parallel import TensorParallel
    with pytest.raises(InputError, match="tp=3 does not divide the 4 attention heads"):
        check_tensor_parallel(ModelConfig.from_file(tiny_moe3), TensorParallel(0, 3))


@pytest.mark.parametrize("command", ["generate", "verify"])
@pytest.mark.parametrize("args, world_size, message", [
    (["--tp", "2"], None, "torchrun --nproc-per-node 2"),                  # no process group
    (["--tp", "2"], "3", "torchrun started 3 process(es)"),              # world size != --tp
    ([], "2", "pass --tp 2"),
    (["--tp", "3"], None, "tp=3 does not divide the 4 attention heads"),
])
def test_cli_tp_bad_input_is_one_line_exit_2(tiny_moe3, monkeypatch, command, args, world_size, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    extra = ["--tokens", "1,2", "-n", "1"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, str(tiny_moe3), "--device", "cpu", *extra, *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("minirt: error:") and len(result.output.strip().splitlines()) == 1, result.output
    assert message in result.output


@pytest.mark.parametrize("fp8_as_stored", [False, True])
def test_each_rank_loads_its_shard(tiny_moe3, fp8_as_stored):
    """load_checkpoint(tp=...) gives a rank exactly its rows / columns / experts of the whole tensors
    (their block scales too, when kept fp8), and nothing else; the loader needs no process group.
    Rank 1 of 2: its shards start inside the tensors (a dequantised row shard reads from a whole
    scale block)."""
    from minirt.models.deepseek_v32.checkpoint import SCALE_SUFFIX, load_checkpoint
    from minirt.models.deepseek_v32.parallel import expert_range, weight_shard
    from minirt.parallel import TensorParallel

    cfg, whole = load_checkpoint(tiny_moe3, fp8_as_stored=fp8_as_stored)
    tp = TensorParallel(1, 2)
    _, mine = load_checkpoint(tiny_moe3, fp8_as_stored=fp8_as_stored, tp=tp)
    assert mine.keys() == whole.keys()
    experts = expert_range(cfg, tp)
    assert experts == range(8, 16)
    kinds = set()
    for name, t in mine.items():
        shard = weight_shard(cfg, name.removesuffix(SCALE_SUFFIX), tp)
        expect = whole[name]
        if ".mlp.experts." in name:
            expect, kind = expect[experts.start : experts.stop], "experts"
        elif shard is not None:
            block = 128 if name.endswith(SCALE_SUFFIX) else 1
            expect = expect.narrow(shard.dim, shard.start // block, (shard.stop - shard.start) // block)
            kind = f"dim {shard.dim}"
        else:
            kind = "whole"
        kinds.add(kind)
        assert t.dtype == expect.dtype and torch.equal(t.view(torch.uint8), expect.contiguous().view(torch.uint8)), name
    assert kinds == {"experts", "dim 0", "dim 1", "whole"}


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4: heads, output groups, experts and vocabulary over 2 ranks

V4_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13]]  # 13 tokens: the MoE's token shares are padded


def run_v4(engine, moe_input: torch.Tensor) -> dict[str, torch.Tensor]:
    """Prefill and one decode step's logits ("logits" [4, vocab]), layer 0's attention output ("attn0"),
    and the last layer's MoE on a fixed input ("moe": its inputs are the same in every run)."""
    trace = PrefillTrace()
    logits = [engine.prefill(V4_PROMPTS, trace=trace), engine.decode(torch.tensor([20, 21]))]
    moe = engine.layers[-1].ffn(moe_input, torch.arange(moe_input.shape[0]))
    return {"logits": torch.cat(logits), "attn0": trace._joined("attn")[0], "moe": moe,
            "tp_world": torch.tensor(engine.tp.world)}


@pytest.fixture(scope="module")
def v4_tiny3(tmp_path_factory):
    """v4-tiny's SWA, CSA and HCA layers (the first two hash-routed, the third top-k)."""
    from minirt.synthetic import write_synthetic_checkpoint
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("tp") / "v4", preset="v4-tiny", seed=5, num_layers=3)


def test_v4_two_ranks_match_one_process(v4_tiny3, tmp_path):
    """DeepSeek-V4 over 2 ranks (4 of the 8 heads, 1 of the 2 output groups, 4 of the 8 experts, half the
    vocabulary each, read from the checkpoint's slices): both ranks give the same bits, and one process's
    numbers up to roundings. Layer 0's attention (the same inputs in both runs) differs by the bf16
    rounding of each rank's ``wo_b`` partial sum, the MoE on a fixed input by that of each rank's routed
    sum; the logits further by the fp8 quantisation of the activations, which turns those roundings into
    flipped fp8 steps downstream (~2 % here)."""
    moe_input = torch.randn(13, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), str(v4_tiny3), str(tmp_path), run_v4,
                                             (moe_input,))) for r in range(2)]
    for p in procs:
        p.start()
    single = run_v4(minirt.load(v4_tiny3, device="cpu"), moe_input)  # meanwhile
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0, f"a rank failed (exit code {p.exitcode})"
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for key in single:
        assert torch.equal(rank0[key], rank1[key]), key
        assert rank0[key].shape == single[key].shape and torch.isfinite(rank0[key]).all(), key
    assert (int(rank0["tp_world"]), int(single["tp_world"])) == (2, 1)  # the engine knows its group
    assert rel_err(rank0["attn0"], single["attn0"]) < 5e-3
    assert rel_err(rank0["moe"], single["moe"]) < 5e-3
    assert rel_err(rank0["logits"][:2], single["logits"][:2]) < 0.1   # prefill
    assert rel_err(rank0["logits"][2:], single["logits"][2:]) < 0.1   # decode


def test_v4_each_rank_loads_its_slices(v4_tiny3):
    """load_checkpoint(tp=...) gives rank 1 of 2 exactly its rows / columns of the split weights (their
    fp8 block scales in whole blocks), only its routed experts, and every other tensor whole."""
    from minirt.models.deepseek_v4.checkpoint import layer_memory_bytes, load_checkpoint, plan_load
    from minirt.models.deepseek_v4.parallel import expert_range, weight_shard
    from minirt.parallel import TensorParallel

    tp = TensorParallel(1, 2)
    cfg, whole = load_checkpoint(v4_tiny3, as_stored=True, dtype=torch.bfloat16)
    _, mine = load_checkpoint(v4_tiny3, as_stored=True, dtype=torch.bfloat16, tp=tp)
    assert expert_range(cfg, tp) == range(4, 8)
    routed = [n for n in whole if ".ffn.experts." in n]  # layers.{i}.ffn.experts.{e}.w*
    assert mine.keys() == whole.keys() - {n for n in routed if int(n.split(".")[4]) < 4}
    kinds = set()
    for name, t in mine.items():
        weight = name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name
        shard = weight_shard(cfg, weight, tp)
        expect = whole[name]
        if shard is not None:
            block = 128 if name.endswith(".scale") else 1
            expect = expect.narrow(shard.dim, shard.start // block, (shard.stop - shard.start) // block)
        kinds.add("whole" if shard is None else f"dim {shard.dim}")
        assert t.dtype == expect.dtype and torch.equal(t.view(torch.uint8), expect.contiguous().view(torch.uint8)), name
    assert kinds == {"dim 0", "dim 1", "whole"}
    assert mine["layers.0.attn.attn_sink"].shape == (4,) and mine["head.weight"].shape == (256, 256)
    top, layers = layer_memory_bytes(plan_load(v4_tiny3), torch.bfloat16, True, tp)  # what the fit check counts
    held = [sum(t.nbytes for n, t in mine.items() if n.startswith(f"layers.{i}.")) for i in range(3)]
    assert layers == held and top == sum(t.nbytes for t in mine.values()) - sum(held)


def test_v4_check_tensor_parallel(v4_tiny3):
    """v4-tiny (8 heads, 2 output groups, 8 experts): tp 2 passes; tp 3 cuts the heads (InputError, what
    the CLI's --tp reports), tp 4 the output groups (ConfigError)."""
    from minirt.config import load_config
    from minirt.errors import ConfigError
    from minirt.models import family_of
    from minirt.parallel import TensorParallel

    cfg = load_config(v4_tiny3 / "config.json")
    check = family_of(cfg).check_tensor_parallel
    check(cfg, TensorParallel(0, 2))
    with pytest.raises(InputError, match="tp=3 does not divide the 8 attention heads"):
        check(cfg, TensorParallel(0, 3))
    with pytest.raises(ConfigError, match=r"o_groups \(2\) divisible by 4"):
        check(cfg, TensorParallel(0, 4))
