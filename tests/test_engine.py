"""The runtime (kernels + fp8 paged cache) against the eager reference, on the tiny preset."""
import pytest
import torch
from conftest import DEVICE

import minirt
from minirt.context import PrefillTrace
from minirt.errors import DeviceError, InputError, NumericalError
from minirt.generate import generate
from minirt.sampling import SamplingParams, sample
from minirt.models.deepseek_v32.verify import FP8_WEIGHTS_TOLERANCES, TOLERANCES, run_verify, tolerances
from minirt.report import rel_err, top1_agreement


@pytest.fixture(scope="module")
def tiny(tiny_master):
    return tiny_master


@pytest.fixture(scope="module")
def engine(tiny):
    return minirt.load(tiny, device=DEVICE)


@pytest.fixture(scope="module")
def oracle(tiny):
    return minirt.load(tiny, device=DEVICE, backend="reference")


@pytest.fixture(scope="module")
def reference(oracle):
    return oracle.model


def random_prompt(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_verify_passes_on_tiny(engine, oracle):
    topk = engine.cfg.index_topk
    report = run_verify(engine, oracle, prompt_len=2 * topk + 5, decode_steps=4, seed=3)
    assert report.ok, report.to_json()
    names = {c.name.split("[")[0] for c in report.checks}
    assert names == set(TOLERANCES)


def test_verify_fails_when_one_weight_is_perturbed(tiny, oracle):
    engine = minirt.load(tiny, device=DEVICE, weights="bf16")
    w = engine.model.model.layers[1].self_attn.kv_b_proj.weight
    with torch.no_grad():
        w.add_(0.2 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w))
    report = run_verify(engine, oracle, prompt_len=40, decode_steps=2, seed=0)
    assert not report.ok
    failed = {c.name for c in report.failures()}
    assert "attention_same_topk[1]" in failed


def test_bf16_engine_keeps_the_indexer_weights_it_runs_in_fp32_as_stored(tiny):
    """k_norm and weights_proj run in fp32: loaded so (k_norm's stored fp32 values, not rounded to the
    engine's bf16), so no step converts them; the other projections take the engine's dtype."""
    from safetensors.torch import load_file

    stored = {}
    for shard in sorted(tiny.glob("*.safetensors")):
        stored.update(load_file(shard))
    engine = minirt.load(tiny, device=DEVICE, dtype=torch.bfloat16, weights="bf16")
    for i, layer in enumerate(engine.model.model.layers):
        indexer, prefix = layer.self_attn.indexer, f"model.layers.{i}.self_attn.indexer."
        for name, got in (("k_norm.weight", indexer.k_norm.weight), ("k_norm.bias", indexer.k_norm.bias),
                          ("weights_proj.weight", indexer.weights_proj.weight)):
            assert got.dtype == torch.float32, name
            assert torch.equal(got.cpu(), stored[prefix + name].float()), name
        assert stored[prefix + "k_norm.weight"].dtype == torch.float32
        assert not torch.equal(stored[prefix + "k_norm.weight"].bfloat16().float(), stored[prefix + "k_norm.weight"])
        assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_decode_steps_match_full_sequence_logits(engine, reference):
    vocab, layers = engine.cfg.vocab_size, range(engine.num_layers)
    seq = random_prompt(50, vocab, seed=5)
    ref = reference.forward(torch.tensor(seq))
    # Attend the reference's top-k, so the comparison measures numerics, not near-tie flips.
    engine.setup_cache(1, len(seq))
    logits = [engine.prefill([seq[:40]], topk_override=[ref.topk_indices[i][:40] for i in layers])]
    for t in range(40, 50):
        logits.append(engine.decode(torch.tensor([seq[t]]), topk_override=[ref.topk_indices[i][t : t + 1] for i in layers]))
    got = torch.cat(logits)  # positions 39 .. 49
    assert rel_err(got, ref.logits[39:]) < tolerances(engine)["decode_logits"][0]
    # Free-running (own indexer over the cached keys), greedy choices still agree.
    engine.setup_cache(1, len(seq))
    free = [engine.prefill([seq[:40]])] + [engine.decode(torch.tensor([seq[t]])) for t in range(40, 50)]
    assert top1_agreement(torch.cat(free), ref.logits[39:]) >= tolerances(engine)["top1_agreement"][0]


def test_short_prompt_attends_every_earlier_token(engine, reference):
    n = engine.cfg.index_topk  # no longer than index_topk: sparse attention is dense causal attention
    seq = random_prompt(n, engine.cfg.vocab_size, seed=7)
    trace = PrefillTrace()
    engine.setup_cache(1, n)
    logits = engine.prefill([seq], all_logits=True, trace=trace)
    for topk in trace.topk:
        for t, row in enumerate(topk.tolist()):
            assert sorted(i for i in row if i >= 0) == list(range(t + 1))
    assert rel_err(logits, reference.forward(torch.tensor(seq)).logits) < tolerances(engine)["prefill_logits"][0]


def test_batch_of_different_lengths_equals_each_prompt_alone(engine):
    vocab = engine.cfg.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (45, 9, 70)]
    steps = [random_prompt(3, vocab, seed=100 + i) for i in range(len(prompts))]

    def run(batch):
        engine.setup_cache(len(batch), 80)
        out = [engine.prefill([prompts[i] for i in batch])]
        for k in range(3):
            out.append(engine.decode(torch.tensor([steps[i][k] for i in batch])))
        return torch.stack(out, dim=1)  # [b, 4, vocab]

    together = run([0, 1, 2])
    for i in range(3):
        alone = run([i])[0]
        # Same math; only summation order differs with the batch shape (and a latent an ulp from an
        # fp8 rounding boundary can round the other way). Mixing up sequences would give O(1) errors.
        assert rel_err(together[i], alone) < 2e-3


def test_generate_is_deterministic(engine):
    prompt = random_prompt(20, engine.cfg.vocab_size, seed=11)
    greedy = [generate(engine, [prompt], 6).tokens for _ in range(2)]
    assert greedy[0] == greedy[1] and len(greedy[0][0]) == 6
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=4)
    sampled = [generate(engine, [prompt], 6, params).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]
    other = generate(engine, [prompt], 6, SamplingParams(temperature=5.0, seed=5)).tokens
    assert other != sampled[0]  # the seed matters (6 tokens from ~500 at high temperature)


def test_generate_equals_a_step_by_step_loop(engine):
    # generate queues each step before it reads the last tokens back; the tokens must be what the plain
    # loop (decode, sample, read) gives, sequence by sequence, with one seeded generator across the batch.
    prompts = [random_prompt(n, engine.cfg.vocab_size, seed=n) for n in (14, 9)]
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    generator = torch.Generator().manual_seed(params.seed)
    engine.setup_cache(2, 14 + 4)
    tokens = sample(engine.prefill(prompts), params, generator)
    expected = [tokens.tolist()]
    for _ in range(3):
        tokens = sample(engine.decode(tokens), params, generator)
        expected.append(tokens.tolist())
    result = generate(engine, prompts, 4, params)
    assert result.tokens == [list(seq) for seq in zip(*expected)]
    assert result.decode_steps == 3 and result.decode_step_seconds > 0


def test_non_finite_decode_in_generate_names_the_layer(tiny_master):
    engine = minirt.load(tiny_master, device=DEVICE)
    weight = engine.model.model.layers[1].post_attention_layernorm.weight

    def overflow_after_the_first_token(seq, token):  # the steps queued after this one overflow
        weight.data.fill_(3e38)

    with pytest.raises(NumericalError, match=r"decode produced .* layer 1 \(model\.layers\.1\)"):
        generate(engine, [[1, 2, 3]], 5, on_token=overflow_after_the_first_token)


def test_generate_stops_on_eos(engine):
    prompt = random_prompt(10, engine.cfg.vocab_size, seed=12)
    first = generate(engine, [prompt], 3).tokens[0]
    stopped = generate(engine, [prompt], 3, eos_token_id=first[0]).tokens[0]
    assert stopped == first[:1]


def test_reference_backend_same_api(tiny, engine):
    ref_engine = minirt.load(tiny, device=DEVICE, backend="reference")
    prompt = random_prompt(12, engine.cfg.vocab_size, seed=13)
    a, b = ref_engine.prefill([prompt]), engine.prefill([prompt])
    assert rel_err(b, a) < tolerances(engine)["prefill_logits"][0]


@pytest.mark.parametrize("prompts", [[], [[]], [[0, -1]], [[10**9]]])
def test_bad_prompts_rejected_before_compute(engine, prompts):
    with pytest.raises(InputError):
        engine.prefill(prompts)


def test_cache_capacity_error_names_numbers(engine):
    engine.setup_cache(1, 8)
    with pytest.raises(InputError, match="needs 9 cached tokens.*holds 8"):
        engine.prefill([list(range(9))])


def test_generate_beyond_max_positions_names_the_numbers(engine):
    limit = engine.cfg.max_position_embeddings
    with pytest.raises(InputError, match=rf"prompt \(3 tokens\) \+ max_new_tokens \({limit}\) exceeds .*\({limit}\)"):
        generate(engine, [[1, 2, 3]], limit)


def test_decode_past_cache_capacity_names_the_numbers(engine):
    engine.setup_cache(1, 5)
    engine.prefill([[1, 2, 3, 4]])
    engine.decode(torch.tensor([5]))
    with pytest.raises(InputError, match="needs 6 cached tokens.*holds 5"):
        engine.decode(torch.tensor([6]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs exist only on the GPU")
def test_cuda_graph_decode_equals_eager(engine):
    prompts = [random_prompt(n, engine.cfg.vocab_size, seed=n) for n in (50, 17)]
    steps = torch.tensor(random_prompt(10, engine.cfg.vocab_size, seed=99)).view(5, 2)

    def run(graphed):
        engine.use_cuda_graph = graphed
        engine.setup_cache(2, 64)
        out = [engine.prefill(prompts)] + [engine.decode(t) for t in steps]
        return torch.stack(out)

    eager, graphed = run(False), run(True)
    assert len(engine._graphs) == 1  # captured once, replayed for the later steps
    assert rel_err(graphed, eager) < 1e-6


@pytest.mark.parametrize("chunk", [3, 64])
def test_chunked_prefill_equals_unchunked(tiny, engine, chunk):
    """Steps of `chunk` tokens (a prompt split across steps, several prompts in one step) attend the
    same keys as one step over everything: the same top-k sets, the same logits to float tolerance.
    (Matmuls round differently with the number of rows: that can swap two keys whose scores are an ulp
    apart within a row, and move a value across a bf16 rounding boundary of the kernels' operands, as
    in test_batch_of_different_lengths_equals_each_prompt_alone. Attending other keys would give O(1)
    errors.)"""
    vocab = engine.cfg.vocab_size
    prompts = [random_prompt(n, vocab, seed=200 + n) for n in (45, 9, 70)]
    chunked = minirt.load(tiny, device=DEVICE, prefill_chunk=chunk)
    outputs = {}
    for name, e in (("whole", engine), ("chunked", chunked)):
        trace = PrefillTrace()
        e.setup_cache(3, 80)
        logits = e.prefill(prompts, all_logits=True, trace=trace)
        steps = [e.decode(torch.tensor([p[-1] for p in prompts])) for _ in range(2)]
        outputs[name] = (trace, logits, torch.stack(steps))
    (whole_trace, whole_logits, whole_steps), (trace, logits, steps) = outputs["whole"], outputs["chunked"]
    assert chunked.prefill_chunk == chunk != engine.prefill_chunk
    for got, want in zip(trace.topk, whole_trace.topk):
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert rel_err(logits, whole_logits) < 2e-3
    assert rel_err(steps, whole_steps) < 2e-3


@pytest.mark.parametrize("chunk", [0, -3, 2.5, "8", True])
def test_bad_prefill_chunk_is_refused_before_loading(chunk):
    with pytest.raises(InputError, match="prefill chunk must be a positive whole number"):
        minirt.load("/no/such/checkpoint", prefill_chunk=chunk)


def test_a_cache_the_engine_sized_grows_for_a_longer_prompt(tiny):
    engine = minirt.load(tiny, device=DEVICE)
    engine.prefill([[1, 2, 3]])
    long_prompt = random_prompt(engine.cache.max_seq_len + 5, engine.cfg.vocab_size, seed=3)
    assert engine.prefill([long_prompt, [4, 5]]).shape == (2, engine.cfg.vocab_size)
    assert engine.decode(torch.tensor([6, 7])).shape == (2, engine.cfg.vocab_size)
    engine.setup_cache(1, 8)  # a capacity the user set is a limit
    with pytest.raises(InputError, match="holds 8"):
        engine.prefill([long_prompt])


def test_verify_passes_with_fp8_weights_kept_as_stored(tiny, oracle):
    engine = minirt.load(tiny, device=DEVICE, weights="fp8")
    linears = [m for m in engine.model.modules() if hasattr(m, "weight_scale_inv")]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    report = run_verify(engine, oracle, prompt_len=2 * engine.cfg.index_topk + 5, decode_steps=3, seed=3)
    assert report.ok, report.to_json()
    assert report.checks[0].name == "hidden[0]" and report.checks[0].limit == FP8_WEIGHTS_TOLERANCES["hidden"][0]


def test_unknown_weights_mode_is_refused(tiny):
    with pytest.raises(InputError, match="weights must be"):
        minirt.load(tiny, device=DEVICE, weights="int4")


def test_top1_agreement_forgives_a_swap_within_the_logit_error_only():
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(3, 1000, generator=g, dtype=torch.float64)
    ref[:, 7], ref[:, 8] = 10.0, 9.99  # two near-equal leaders
    ref[:, 9] = 5.0  # far below them
    noise = 0.05 * torch.randn(3, 1000, generator=g, dtype=torch.float64)
    got = ref + noise
    got[0, 7], got[0, 8] = 9.9, 10.1  # swaps the near-tie: within the error
    got[1, 9] = 11.0  # picks a token the reference ranks 5 below its best: a disagreement
    assert top1_agreement(got, ref) == pytest.approx(2 / 3)
    assert top1_agreement(ref, ref) == 1.0


def test_a_cache_past_free_memory_is_refused_before_allocating(engine):
    with pytest.raises(DeviceError, match=r"a cache for 100000 x 10,000,000 tokens needs .* is free"):
        engine.setup_cache(100_000, 10_000_000)
    engine.setup_cache(1, 8)  # the engine still works
    assert engine.prefill([[1, 2, 3]]).shape == (1, engine.cfg.vocab_size)
