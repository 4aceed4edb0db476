"""Runtime layer pieces the engine tests do not isolate: the indexer's official fp8 scoring path."""
import pytest
import torch

import minirt
from minirt.context import PrefillTrace
from minirt.layers import fp8_fake_quant, hadamard_rotate
from minirt.verify import topk_overlap


def test_hadamard_rotation_is_orthonormal():
    x, y = torch.randn(2, 5, 128, dtype=torch.float64).unbind(0)
    hx, hy = hadamard_rotate(x), hadamard_rotate(y)
    torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1))  # dot products unchanged
    assert not torch.allclose(hx, x)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(3, 96))


def test_fp8_fake_quant_rounds_to_e4m3_with_power_of_two_block_scales():
    x = torch.randn(4, 256, dtype=torch.float32) * torch.logspace(-3, 3, 4)[:, None]
    q = fp8_fake_quant(x)
    blocks, q_blocks = x.unflatten(-1, (2, 128)), q.unflatten(-1, (2, 128))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)))
    codes = q_blocks / scale
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # exactly representable
    assert codes.abs().max() <= 448
    # e4m3: 3 mantissa bits → half-ulp 2^-4 relative; subnormals (below 2^-6) step 2^-9.
    assert ((q - x).abs() <= torch.maximum(x.abs() * 2**-4, (scale * 2**-10).repeat_interleave(128, -1).flatten(-2))).all()


def test_fp8_indexer_selects_nearly_the_exact_top_k(tiny_master):
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    traces = {}
    for precision in ("exact", "fp8"):
        engine = minirt.load(tiny_master, indexer_precision=precision)
        traces[precision] = PrefillTrace()
        engine.prefill([prompt], trace=traces[precision])
    overlaps = [topk_overlap(f, e) for f, e in zip(traces["fp8"].topk, traces["exact"].topk)]
    # fp8 rounding moves near-ties only: most of every row's selection is shared, but not all of it.
    assert all(0.85 <= o < 1.0 for o in overlaps), overlaps
