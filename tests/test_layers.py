"""Runtime layer pieces the engine tests do not isolate: the indexer's official fp8 scoring path, the
projections that share an input fused into one GEMM."""
import pytest
import torch

import minirt
from conftest import DEVICE
from minirt.blockfp8 import quantize_block_fp8
from minirt.context import PrefillTrace
from minirt.errors import InputError
from minirt.fp8_linear import Fp8Linear
from minirt.kernels.fp8_gemm import StreamConfig, fp8_gemm, quantize_act_fp8
from minirt.models.deepseek_v32.layers import FusedProjection, hadamard_matrix
from minirt.rope import rope_cos_sin
from minirt.report import rel_err, topk_overlap


def test_hadamard_rotation_is_orthonormal():
    x, y = torch.randn(2, 5, 128, dtype=torch.float64).unbind(0)
    h = hadamard_matrix(128, torch.device("cpu"))
    assert h.dtype == torch.float32 and torch.equal(h.abs(), torch.full_like(h, 128**-0.5))
    hx, hy = x @ h.double(), y @ h.double()
    torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1))  # dot products unchanged
    assert not torch.allclose(hx, x)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(96, torch.device("cpu"))


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
    rotated = q @ hadamard_matrix(q.shape[-1], q.device)
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


def _fp8_parts(rows: list[int], k: int, seed: int) -> list[Fp8Linear]:
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for n in rows:
        # Magnitudes that differ per 128-row block, so a block scale stacked on the wrong rows shows.
        w = torch.randn(n, k, generator=gen) * torch.exp2(torch.arange(n) // 128 - 2.0)[:, None]
        part = Fp8Linear(k, n, device=DEVICE)
        part.weight, part.weight_scale_inv = (t.to(DEVICE) for t in quantize_block_fp8(w))
        parts.append(part)
    return parts


def test_fused_fp8_projection_is_each_part_row_for_row():
    rows, k = [256, 128, 192], 256  # the last part ends in a partial 128-row scale block (as kv_a's 576)
    parts = _fp8_parts(rows, k, seed=0)
    alone = [p(torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16))
             for p in parts]
    originals = [(p.weight.clone(), p.weight_scale_inv.clone()) for p in parts]
    fused = FusedProjection(parts)
    for p, (w, s) in zip(parts, originals):  # the parts read the stacked rows, with the same values
        assert torch.equal(p.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(p.weight_scale_inv, s)
        assert p.weight.untyped_storage().data_ptr() == fused.proj.weight.untyped_storage().data_ptr()
    assert not dict(fused.state_dict())  # nothing of its own in a state dict
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    got = fused(x)
    assert [t.shape for t in got] == [(3, n) for n in rows]
    # Same launch (no split-K), same bits: the GEMM computes every output row on its own.
    x_fp8, x_scales = quantize_act_fp8(x)
    one_launch = StreamConfig(split_k=1)
    fused_out = fp8_gemm(x_fp8, x_scales, fused.proj.weight, fused.proj.weight_scale_inv, config=one_launch)
    for part, piece in zip(parts, fused_out.split(rows, dim=-1)):
        assert torch.equal(piece, fp8_gemm(x_fp8, x_scales, part.weight, part.weight_scale_inv, config=one_launch))
    # The default launch splits K by the fused width: the fp32 sums may associate differently.
    for a, b in zip(got, alone):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3 * b.float().abs().max().item())


def test_fused_projection_refuses_parts_that_do_not_stack():
    with pytest.raises(InputError, match=r"all but the last need a multiple of 128"):
        FusedProjection(_fp8_parts([192, 128], 128, seed=2))
    with pytest.raises(InputError, match="all Fp8Linear or all bias-free nn.Linear"):
        FusedProjection([torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(256, 64, bias=False)])


@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_engine_runs_fused_projections_with_the_checkpoint_state_dict(tiny_master, weights):
    engine = minirt.load(tiny_master, device=DEVICE, weights=weights)
    layer = engine.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.fused_x.sizes == [attn.q_a_proj.out_features, attn.indexer.wk.out_features,
                                  attn.kv_a_proj_with_mqa.out_features]
    assert attn.fused_qr.sizes == [attn.q_b_proj.out_features, attn.indexer.wq_b.out_features]
    assert mlp.fused_gate_up is not None
    keys = set(engine.model.state_dict())
    assert "model.layers.0.self_attn.indexer.wk.weight" in keys and not any("fused" in k for k in keys)
    x = torch.randn(5, engine.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE, engine.dtype)
    cos, sin = rope_cos_sin(engine.cfg, torch.arange(5, device=DEVICE), engine.cfg.qk_rope_head_dim)
    with torch.inference_mode():
        fused = attn.project(x, cos, sin)
        attn.fused_x = attn.fused_qr = None
        try:
            alone = attn.project(x, cos, sin)
        finally:
            attn.fuse_projections()  # restacks the (view) weights: the same values
    # On the CPU these small GEMMs run unsplit either way: the same bits. A GPU's split-K follows the width.
    for a, b in zip(fused, alone):
        assert rel_err(a, b) == 0 if DEVICE == "cpu" else rel_err(a, b) < 1e-2


@pytest.mark.parametrize("weights", ["fp8", "bf16"])
@torch.no_grad()
def test_a_layer_adds_the_previous_mlp_output_in_its_input_norm(tiny_master, weights):
    """forward(x, ctx, delta, unsummed=True) sums to forward(x + delta) bit for bit (the input norm's add is
    torch's add), and its parts are the layer's residual after attention and its MLP output."""
    from minirt.context import KVStash
    from minirt.models.deepseek_v32.context import prefill_context
    engine = minirt.load(tiny_master, layers=1, device=DEVICE, weights=weights)
    cfg, layer = engine.cfg, engine.model.model.layers[0]
    engine.setup_cache(1, 16)
    gen = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(2, 6, cfg.hidden_size, generator=gen) * torch.tensor([1.0, 0.3])[:, None, None]).to(
        DEVICE, engine.dtype).unbind(0)

    def ctx():
        return prefill_context(cfg, [6], cache=engine.cache, stash=KVStash([6], DEVICE), rope=engine._rope, device=DEVICE)

    whole = layer(x + delta, ctx())
    h, mlp_out = layer(x, ctx(), delta, unsummed=True)
    assert torch.equal(h + mlp_out, whole) and torch.equal(layer(x, ctx(), delta), whole)
    h0, mlp0 = layer(x + delta, ctx(), unsummed=True)
    assert torch.equal(h0, h) and torch.equal(mlp0, mlp_out) and mlp_out.abs().sum() > 0
    with pytest.raises(InputError, match="delta must be"):
        layer(x, ctx(), delta[:3])
