"""sparse_mla_prefill_two_sources (DeepSeek-V4 prefill: window keys and compressed entries in one softmax)
against test_sparse_mla_prefill's fp64 reference over the two sources concatenated, built here the plain
way: extra rows after kv, extra indices shifted by s_kv, invalid entries and entries past a length -1.
Runs through every prefill kernel path (conftest.kernel_path); outputs NaN-poisoned; the sources' memory is
flanked by NaN/Inf rows.
"""
import math

import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import sparse_mla_prefill_two_sources
from minirt.kernels.sparse_mla_prefill_two_sources import combine_sources
from test_sparse_mla_prefill import INT32_MAX, INT32_MIN, check, kv_with_poisoned_neighbours, poisoned_outputs, reference

pytestmark = pytest.mark.usefixtures("kernel_path")


def random_list(s_q, topk, rows, gen):
    """Random row ids with invalid ones of every kind, among them ids valid in the other source once shifted
    (-1, rows, rows + 1)."""
    idx = torch.randint(0, rows, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    garbage = torch.tensor([-1, rows, rows + 1, INT32_MIN, INT32_MAX], dtype=torch.int32)
    pick = garbage[torch.randint(0, len(garbage), idx.shape, generator=gen)]
    return torch.where(torch.rand(idx.shape, generator=gen) < 0.3, pick, idx)


def plain_concatenation(kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length):
    """(kv_all, indices_all [s_q, 1, topk + extra_topk]): the same attention as one source, positions kept."""
    def used(idx, rows, lengths, shift):
        ok = (idx >= 0) & (idx < rows)
        if lengths is not None:
            ok &= torch.arange(idx.shape[2])[None, None, :] < lengths[:, None, None]
        return torch.where(ok, idx + shift, -1)
    s_kv = kv.shape[0]
    return torch.cat([kv, extra_kv]), torch.cat([used(indices, s_kv, topk_length, 0),
                                                 used(extra_indices, extra_kv.shape[0], extra_topk_length, s_kv)], 2)


@pytest.mark.parametrize("s_q,h_q,topk,extra_topk,lengths", [(5, 16, 24, 40, True), (3, 64, 33, 8, False),
                                                             (2, 128, 16, 16, True)])
def test_matches_reference_over_the_concatenation(s_q, h_q, topk, extra_topk, lengths):
    gen = torch.Generator().manual_seed(s_q * h_q)
    s_kv, s_extra = 50, 20
    q = torch.randn(s_q, h_q, 512, generator=gen).to(torch.bfloat16)
    kv = kv_with_poisoned_neighbours(s_kv, 512, torch.bfloat16, gen).cpu()
    extra_kv = kv_with_poisoned_neighbours(s_extra, 512, torch.bfloat16, gen).cpu()
    indices, extra_indices = random_list(s_q, topk, s_kv, gen), random_list(s_q, extra_topk, s_extra, gen)
    topk_length = extra_topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 5, (s_q,), generator=gen, dtype=torch.int32)
        extra_topk_length = torch.randint(0, extra_topk + 5, (s_q,), generator=gen, dtype=torch.int32)
        topk_length[0], extra_topk_length[0] = 0, 0                    # row 0: nothing
        topk_length[1], extra_topk_length[1] = 0, extra_topk               # row 1: the extra list alone
    sink = torch.randn(h_q, generator=gen)
    sink[0], sink[1] = -math.inf, math.inf
    out = poisoned_outputs(s_q, h_q, 512, torch.bfloat16)
    dev = [t if t is None else t.to(DEVICE) for t in (q, kv, indices, extra_kv, extra_indices, sink, topk_length,
                                                       extra_topk_length)]
    got = sparse_mla_prefill_two_sources(*dev[:5], 512 ** -0.5, 512, *dev[5:], out=out)
    assert all(g is o for g, o in zip(got, out))
    kv_all, indices_all = plain_concatenation(kv, indices, extra_kv, extra_indices, topk_length, extra_topk_length)
    ref = reference(q.double(), kv_all.double(), indices_all, 512 ** -0.5, 512, sink)
    check(tuple(t.cpu() for t in got), ref, torch.bfloat16)
    if lengths:
        assert ref[3][0].all() and not ref[3][1].any()


def test_combined_list_puts_used_entries_first():
    kv, extra_kv = torch.randn(4, 1, 8, device=DEVICE), torch.randn(3, 1, 8, device=DEVICE)
    indices = torch.tensor([[[2, -1, 5, 1]], [[0, 1, 2, 3]]], dtype=torch.int32, device=DEVICE)
    extra_indices = torch.tensor([[[3, 0, 2]], [[1, 1, -1]]], dtype=torch.int32, device=DEVICE)
    kv_all, combined, lengths = combine_sources(kv, indices, extra_kv, extra_indices,
                                                torch.tensor([3, 1], dtype=torch.int32, device=DEVICE),
                                                torch.tensor([9, 2], dtype=torch.int32, device=DEVICE))
    assert torch.equal(kv_all, torch.cat([kv, extra_kv]))
    assert combined.tolist() == [[[2, -1, -1, -1, 4, 6, -1]], [[0, 5, 5, -1, -1, -1, -1]]]
    assert lengths.tolist() == [6, 3]
    # Without lengths every entry is used; a list with a non-unit last stride reads as its values.
    strided = torch.tensor([[[2, 9, -1, 9, 5, 9, 1, 9]], [[0, 9, 1, 9, 2, 9, 3, 9]]], dtype=torch.int32,
                           device=DEVICE)[:, :, ::2]
    _, combined, lengths = combine_sources(kv, strided, extra_kv, extra_indices)
    assert lengths is None
    assert combined.tolist() == [[[2, -1, -1, 1, -1, 4, 6]], [[0, 1, 2, 3, 5, 5, -1]]]


def test_adjacent_sources_are_read_in_place():
    """Sources that are two slices of one buffer, extra_kv's rows right after kv's (as DeepSeek-V4's engine
    keeps a prefill's keys and a layer's entries), are used in place: combine_sources' buffer is a view of
    them and the attention equals that over separate copies bit for bit; slices with a gap between them or in
    the other order are copied."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(70, 1, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv, extra_kv = buf[:50], buf[50:]
    q = torch.randn(3, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    indices, extra_indices = random_list(3, 16, 50, gen).to(DEVICE), random_list(3, 8, 20, gen).to(DEVICE)
    kv_all = combine_sources(kv, indices, extra_kv, extra_indices)[0]
    assert kv_all.data_ptr() == buf.data_ptr() and kv_all.stride() == buf.stride() and torch.equal(kv_all, buf)
    in_place = sparse_mla_prefill_two_sources(q, kv, indices, extra_kv, extra_indices, 512 ** -0.5)
    copies = sparse_mla_prefill_two_sources(q, kv.clone(), indices, extra_kv.clone(), extra_indices, 512 ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(in_place, copies))
    for first, second in ((buf[:40], buf[50:]), (buf[50:], buf[:50])):
        joined = combine_sources(first, indices, second, extra_indices)[0]
        assert joined.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
        assert torch.equal(joined, torch.cat([first, second]))


def test_bad_inputs_raise_input_error():
    q = torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(8, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32, device=DEVICE)
    base = dict(q=q, kv=kv, indices=idx, extra_kv=kv, extra_indices=idx, sm_scale=0.1)
    for bad, name in ((dict(extra_kv=kv.float()), "extra_kv"), (dict(extra_kv=kv[:, :, :448]), "extra_kv"),
                      (dict(extra_indices=idx.long()), "extra_indices"), (dict(extra_indices=idx[:1]), "extra_indices"),
                      (dict(indices=idx[:, :, None]), "indices"),
                      (dict(topk_length=torch.zeros(3, dtype=torch.int32, device=DEVICE)), "topk_length"),
                      (dict(extra_topk_length=torch.zeros(2, device=DEVICE)), "extra_topk_length"),
                      (dict(d_v=1024), "d_v")):
        with pytest.raises(InputError, match=name):
            sparse_mla_prefill_two_sources(**{**base, **bad})


def test_custom_op_matches_the_function():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 16, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv, extra_kv = (torch.randn(n, 1, 512, generator=gen).to(torch.bfloat16).to(DEVICE) for n in (12, 6))
    indices, extra_indices = random_list(3, 8, 12, gen).to(DEVICE), random_list(3, 4, 6, gen).to(DEVICE)
    lengths = torch.tensor([8, 3, 0], dtype=torch.int32, device=DEVICE)
    args = (q, kv, indices, extra_kv, extra_indices, 0.05, 512, None, None, lengths)
    torch.library.opcheck(torch.ops.minirt.sparse_mla_prefill_two_sources, args, test_utils=("test_faketensor",))
    for got, want in zip(torch.ops.minirt.sparse_mla_prefill_two_sources(*args), sparse_mla_prefill_two_sources(*args)):
        assert torch.equal(got, want)
