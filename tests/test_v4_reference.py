"""The DeepSeek-V4 eager reference: agreement with transformers' deepseek_v4 on the v4-tiny checkpoint,
and the properties it must have on its own (causality, Sinkhorn, sinks, routing, the load API)."""
import json

import pytest
import torch
from safetensors.torch import save_file

import minirt
from minirt.errors import CheckpointError
from minirt.models.deepseek_v4 import LayerKind, ReferenceModelV4, load_checkpoint
from minirt.models.deepseek_v4.reference import hc_post, hc_pre, sink_attention, visible_entries
from minirt.synthetic import write_synthetic_checkpoint

PROMPT = 300  # > 2 windows of 128: HCA entries (one per 128 tokens) and CSA entries past index_topk


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("v4ref") / "v4-tiny", preset="v4-tiny", seed=3)


@pytest.fixture(scope="module")
def loaded(v4):
    return load_checkpoint(v4)


@pytest.fixture(scope="module")
def model(loaded):
    return ReferenceModelV4(*loaded)


def tokens(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ours(model):
    """The reference's forward of the PROMPT tokens (seed 0)."""
    return model.forward(tokens(PROMPT))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_matches_transformers_deepseek_v4(v4, loaded, ours, tmp_path, transformers):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    cfg, weights = loaded
    # The same checkpoint dequantised to fp32 under DeepSeek's names: transformers renames them itself.
    raw = json.loads((v4 / "config.json").read_text())
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    # use_kernels=False: transformers' own torch code (5.25 defaults to Hub kernels, which need the network).
    hf, info = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True,
                                                     use_kernels=False)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention", "compressed_sparse_attention"]
    assert hf.config.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]

    ids = tokens(PROMPT)
    with torch.no_grad():
        theirs = hf.eval()(ids[None], use_cache=False).logits[0]
    assert rel(ours.logits, theirs) <= 1e-4
    assert rel(ours.logits[-1], theirs[-1]) <= 1e-4
    # The prompt exercised the compressed paths: sparse CSA selections and visible HCA entries.
    csa = ours.topk_indices[1]
    assert csa.shape == (PROMPT, cfg.index_topk) and (csa[-1] >= 0).all() and (csa[:3] == -1).all()
    assert cfg.layer_kinds[2] == LayerKind.HCA and PROMPT // 128 == 2


def test_prefix_logits_do_not_see_later_tokens(model, ours):
    head = model.forward(tokens(PROMPT)[:130]).logits  # mid-window for both ratios, past the window and one HCA entry
    assert rel(head, ours.logits[:130]) < 1e-5


def test_sinkhorn_comb_is_doubly_stochastic_and_applied_transposed(model):
    cfg = model.cfg
    w = model.layer_weights(1)
    X = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    collapsed, post, comb = hc_pre(X, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], cfg)
    assert torch.allclose(comb.sum(-1), torch.ones(5, cfg.hc_mult), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(5, cfg.hc_mult), atol=1e-3)
    assert not torch.allclose(comb, comb.transpose(1, 2), atol=1e-3)  # the direction matters
    assert ((post > 0) & (post < 2)).all() and collapsed.shape == (5, cfg.hidden_size)
    out = torch.randn(5, cfg.hidden_size)
    new = hc_post(out, X, post, comb)
    for k in range(cfg.hc_mult):
        expect = post[:, k, None] * out + sum(comb[:, j, k, None] * X[:, j] for j in range(cfg.hc_mult))
        assert torch.allclose(new[:, k], expect, atol=1e-5)


def test_sink_attention_semantics():
    g = torch.Generator().manual_seed(4)
    q, keys = torch.randn(3, 2, 8, generator=g), torch.randn(5, 8, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool).tril()
    sink = torch.tensor([0.3, -1.2])
    out = sink_attention(q, keys, mask, sink, 0.5)
    logits = (torch.einsum("thd,sd->ths", q, keys) * 0.5).masked_fill(~mask[:, None], float("-inf"))
    p = torch.cat((logits, sink.expand(3, 2)[..., None]), -1).softmax(-1)[..., :-1]  # the sink has no value
    assert torch.allclose(out, torch.einsum("ths,sd->thd", p, keys), atol=1e-6)
    assert torch.equal(sink_attention(q, keys, mask, torch.full((2,), float("inf")), 0.5), torch.zeros(3, 2, 8))
    none = sink_attention(q, keys, torch.zeros(3, 5, dtype=torch.bool), sink, 0.5)
    assert torch.equal(none, torch.zeros(3, 2, 8))


def test_compressed_entry_visibility():
    seen = visible_entries(12, 3, 4, "cpu")
    assert seen[:3].sum() == 0 and seen[3].tolist() == [True, False, False]
    assert seen[7].tolist() == [True, True, False] and seen[11].all()


def test_routing_hash_and_topk(model, ours):
    cfg, out = model.cfg, ours
    assert torch.equal(out.expert_ids[0], model.weights["layers.0.ffn.gate.tid2eid"][tokens(PROMPT)])
    w = model.layer_weights(2)
    assert not cfg.is_hash_layer(2)
    chosen = out.expert_ids[2]
    assert chosen.shape == (PROMPT, cfg.num_experts_per_tok)
    assert (chosen[:, 0] != chosen[:, 1]).all() and int(chosen.max()) < cfg.n_routed_experts
    assert "ffn.gate.bias" in w and "ffn.gate.tid2eid" not in w


def test_load_api_serves_the_reference(v4, loaded):
    engine = minirt.load(v4, layers=1, backend="reference", device="cpu")
    assert engine.backend == "reference" and engine.num_layers == 1
    ids = tokens(20, seed=6)
    expect = ReferenceModelV4(*loaded, num_layers=1).forward(ids).logits[-1]
    assert torch.equal(engine.prefill([ids.tolist()])[0], expect)


def test_experts_kept_as_stored_give_the_same_outputs_in_less_memory(v4, model, ours):
    """load_checkpoint(as_stored="experts"): the routed experts stay packed (fp4 int8 + e8m0 scales) in the
    reference, dequantised when used: every layer's output equal to the dequantised reference's, in
    under a third of its expert bytes."""
    cfg, weights = load_checkpoint(v4, as_stored="experts")
    stored = ReferenceModelV4(cfg, weights)
    expert = "layers.2.ffn.experts.5.w1.weight"
    assert stored.weights[expert].dtype == torch.int8 and expert.replace("weight", "scale") in stored.weights
    assert "layers.2.attn.wq_a.scale" not in stored.weights and stored.weights["layers.2.attn.wq_a.weight"].dtype == torch.float32
    out = stored.forward(tokens(PROMPT))
    for got, want in zip([*out.hidden_states, out.logits], [*ours.hidden_states, ours.logits]):
        assert torch.equal(got, want)

    def expert_bytes(m):
        return sum(t.numel() * t.element_size() for n, t in m.weights.items() if ".ffn.experts." in n)
    assert expert_bytes(stored) * 3 < expert_bytes(model)
    weights[expert] = weights[expert][:, 1:]
    with pytest.raises(CheckpointError, match="experts.5.w1.weight' has shape"):
        ReferenceModelV4(cfg, weights)
