"""all_finite: whether a tensor holds no NaN or ±inf, one launch whose programs count themselves in.

Oracle: torch.isfinite(x).all(). Runs the real Triton kernel (compiled on a GPU, interpreted on the CPU);
sizes span several programs (interpreted, a program takes up to 2^18 elements; compiled, 4096), and the
non-finite value sits in the first, a middle and the last program, in a partial last block.
"""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import all_finite

SIZES = [1, 4097, 600_001]   # one element; just past one compiled program; three interpreted programs


def random(n, dtype, seed):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(n, generator=g, device=DEVICE) * 1e4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_all_finite_finds_every_nan_and_inf(dtype, n):
    x = random(n, dtype, n)
    got = all_finite(x)
    assert got.shape == () and got.dtype == torch.bool and got.device == x.device and bool(got)
    for where in sorted({0, n // 2, n - 1}):
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[where] = bad
            assert bool(all_finite(y)) is False and not bool(torch.isfinite(y).all()), (where, bad)
            # The counters are back at zero after each launch: the next call sees only its own input.
            assert bool(all_finite(x)) is True


def test_all_finite_of_large_finite_values_and_other_shapes():
    big = torch.full((3, 5000), torch.finfo(torch.float32).max, device=DEVICE)
    big[1] = -big[1]
    assert bool(all_finite(big))
    assert bool(all_finite(big.T))                      # not contiguous: copied first
    assert bool(all_finite(torch.empty(0, 7, device=DEVICE)))
    assert bool(all_finite(torch.tensor(2.5, device=DEVICE)))
    half = torch.full((4, 4), 65504.0, dtype=torch.float16, device=DEVICE)
    assert bool(all_finite(half)) and not bool(all_finite(half * 2))   # fp16 overflow to inf


def test_all_finite_rejects_bad_input():
    with pytest.raises(InputError, match="float32, bfloat16 or float16"):
        all_finite(torch.ones(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(InputError, match="float32, bfloat16 or float16"):
        all_finite([1.0, 2.0])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_all_finite_in_a_cuda_graph():
    x = random(200_000, torch.float32, 1)
    all_finite(x)   # compiled first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verdict = all_finite(x)
    for value, expected in ((1.0, True), (float("nan"), False), (2.0, True), (float("inf"), False)):
        x[123_457] = value
        graph.replay()
        assert bool(verdict) is expected
