"""indexer_weights (one launch at decode sizes, torch's GEMM above) against an fp64 product, fresh random rows."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import indexer_weights
from minirt.kernels.indexer_weights import DECODE_MAX_TOKENS
from minirt.report import rel_err


@pytest.mark.parametrize("tokens, heads, hidden", [(1, 64, 7168), (DECODE_MAX_TOKENS, 5, 1000),
                                                   (DECODE_MAX_TOKENS + 1, 64, 256)])
def test_indexer_weights_match_fp64(tokens, heads, hidden):
    """w = scale · x · weightᵀ from bf16 x (a column slice: row stride wider than the row) and an fp32 weight;
    head counts and widths that are not multiples of the kernel's blocks; both paths."""
    gen = torch.Generator().manual_seed(tokens * heads + hidden)
    x = torch.randn(tokens, hidden + 64, generator=gen).to(DEVICE, torch.bfloat16)[:, 64:]
    weight = torch.randn(heads, hidden, generator=gen).to(DEVICE) * hidden**-0.5
    scale = heads**-0.5 * 128**-0.5
    w = indexer_weights(x, weight, scale)
    assert w.shape == (tokens, heads) and w.dtype == torch.float32 and torch.isfinite(w).all()
    expected = x.double() @ weight.double().T * scale
    for t in range(tokens):
        assert rel_err(w[t], expected[t]) < 1e-6


def test_indexer_weights_refuse_bad_input_and_take_no_tokens():
    x = torch.randn(2, 128, device=DEVICE)
    with pytest.raises(InputError, match=r"weight must be a float tensor \[H, 128\]"):
        indexer_weights(x, torch.randn(4, 64, device=DEVICE), 1.0)
    with pytest.raises(InputError, match="x must be"):
        indexer_weights(x[0], torch.randn(4, 128, device=DEVICE), 1.0)
    assert indexer_weights(x[:0], torch.randn(4, 128, device=DEVICE), 1.0).shape == (0, 4)


def test_indexer_weights_op_schema_and_fake():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16)
    torch.library.opcheck(torch.ops.minirt.indexer_weights, (x, torch.randn(8, 256, generator=gen).to(DEVICE), 0.125))
