"""The kernels as torch custom ops: schema and fake implementations are right (opcheck), and
torch.compile traces through them without a graph break, giving the eager result."""
import pytest
import torch
from conftest import DEVICE

import minirt.kernels  # noqa: F401  (registers torch.ops.minirt.*)
from minirt.kernels import new_kv_cache

# Inductor's C++ backend would add minutes of compile time on CPU; aot_eager still traces the graph.
COMPILE_BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"


def prefill_inputs(gen):
    s_q, h_q, s_kv, topk = 3, 4, 40, 24
    q = torch.randn(s_q, h_q, 576, generator=gen).to(DEVICE, torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, generator=gen).to(DEVICE, torch.bfloat16)
    indices = torch.randint(-4, s_kv + 4, (s_q, 1, topk), generator=gen, dtype=torch.int32).to(DEVICE)
    return q, kv, indices


def decode_inputs(gen):
    b, s_q, h_q, topk, block_size, blocks = 2, 1, 4, 20, 16, 4
    cache = new_kv_cache(blocks, block_size, device=DEVICE)
    slots = torch.arange(blocks * block_size, device=DEVICE)
    latent = torch.randn(slots.numel(), 512, generator=gen).to(DEVICE, torch.bfloat16)
    k_rope = torch.randn(slots.numel(), 64, generator=gen).to(DEVICE, torch.bfloat16)
    torch.ops.minirt.write_kv_fp8(cache, latent, k_rope, slots)
    q = torch.randn(b, s_q, h_q, 576, generator=gen).to(DEVICE, torch.bfloat16)
    indices = torch.randint(-2, blocks * block_size + 2, (b, s_q, topk), generator=gen, dtype=torch.int32).to(DEVICE)
    return q, cache, indices


def test_opcheck_prefill():
    q, kv, indices = prefill_inputs(torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.minirt.sparse_mla_prefill, (q, kv, indices, 0.1, 512),
                          test_utils=("test_schema", "test_faketensor"))


def test_opcheck_decode_and_writer():
    gen = torch.Generator().manual_seed(1)
    q, cache, indices = decode_inputs(gen)
    torch.library.opcheck(torch.ops.minirt.sparse_mla_decode_fp8, (q, cache, indices, 0.1, 512),
                          test_utils=("test_schema", "test_faketensor"))
    latent = torch.randn(3, 512, generator=gen).to(DEVICE, torch.bfloat16)
    k_rope = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([5, -1, 9], device=DEVICE)
    torch.library.opcheck(torch.ops.minirt.write_kv_fp8, (cache, latent, k_rope, slots),
                          test_utils=("test_schema", "test_faketensor"))
    angles = torch.rand(3, 32, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.minirt.write_kv_fp8,
                          (cache, latent, k_rope, slots, torch.rand(512, generator=gen).to(DEVICE), 1e-6, angles,
                           angles), test_utils=("test_schema", "test_faketensor"))


def test_compiled_call_equals_eager():
    gen = torch.Generator().manual_seed(2)
    q, kv, indices = prefill_inputs(gen)
    q_dec, cache, dec_indices = decode_inputs(gen)

    def attend(q, kv, indices, q_dec, cache, dec_indices):
        out, _, lse = torch.ops.minirt.sparse_mla_prefill(q * 0.5, kv, indices, 0.1, 512)
        dec, dec_lse = torch.ops.minirt.sparse_mla_decode_fp8(q_dec, cache, dec_indices, 0.1, 512)
        return out.float().sum(-1) + lse.nan_to_num(posinf=0.0), dec.float() * 2, dec_lse

    args = (q, kv, indices, q_dec, cache, dec_indices)
    compiled = torch.compile(attend, backend=COMPILE_BACKEND, fullgraph=True)  # fullgraph: a break fails
    for got, want in zip(compiled(*args), attend(*args)):
        assert torch.equal(got, want)


def test_opcheck_decode_topk():
    scores = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.library.opcheck(torch.ops.minirt.decode_topk, (scores, 40), test_utils=("test_schema", "test_faketensor"))
