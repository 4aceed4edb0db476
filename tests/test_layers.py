"""Runtime layer pieces the engine tests do not isolate: the indexer's official fp8 scoring path."""
import pytest
import torch

import minirt
from conftest import DEVICE
from minirt.context import PrefillTrace
from minirt.models.deepseek_v32.layers import hadamard_rotate
from minirt.rope import rope_cos_sin
from minirt.report import topk_overlap


def test_hadamard_rotation_is_orthonormal():
    x, y = torch.randn(2, 5, 128, dtype=torch.float64).unbind(0)
    hx, hy = hadamard_rotate(x), hadamard_rotate(y)
    torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1))  # dot products unchanged
    assert not torch.allclose(hx, x)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(3, 96))


def test_fp8_indexer_queries_are_e4m3_with_head_scales_folded_into_the_weights(tiny_master):
    """fp8 mode: q is the Hadamard-rotated exact q rounded to e4m3 with one power-of-two scale per head,
    and that scale multiplies the head weight, so q_fp8 · scale = w_fp8 / w_exact · q_fp8 ≈ H(q)."""
    engines = {p: minirt.load(tiny_master, device=DEVICE, indexer_precision=p) for p in ("exact", "fp8")}
    x = torch.randn(6, engines["exact"].cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE, engines["exact"].dtype)
    outs = {}
    for precision, engine in engines.items():
        attn = engine.model.model.layers[0].self_attn
        cos, sin = rope_cos_sin(engine.cfg, torch.arange(6, device=DEVICE), engine.cfg.qk_rope_head_dim)
        qr = attn.q_a_layernorm(attn.q_a_proj(x))
        outs[precision] = attn.indexer.queries(x, qr, cos, sin)
    (q, w), (q8, w8) = outs["exact"], outs["fp8"]
    assert q8.dtype == torch.float8_e4m3fn and q.dtype == w.dtype == w8.dtype == torch.float32
    scale = w8 / w
    assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))  # powers of two
    rotated = hadamard_rotate(q)
    assert (q8.float().abs().amax(-1) <= 448).all()
    err = (q8.float() * scale[..., None] - rotated).abs()
    assert (err <= torch.maximum(rotated.abs() * 2**-4, scale[..., None] * 2**-10)).all()
    assert err.max() > 0  # it is rounded, not the exact q


def test_fp8_indexer_selects_nearly_the_exact_top_k(tiny_master):
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    traces = {}
    for precision in ("exact", "fp8"):
        engine = minirt.load(tiny_master, device=DEVICE, indexer_precision=precision)
        traces[precision] = PrefillTrace()
        engine.prefill([prompt], trace=traces[precision])
    overlaps = [topk_overlap(f, e) for f, e in zip(traces["fp8"].topk, traces["exact"].topk)]
    # fp8 rounding moves near-ties only: most of every row's selection is shared, but not all of it.
    assert all(0.85 <= o < 1.0 for o in overlaps), overlaps
