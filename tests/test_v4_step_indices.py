"""kernels/v4_step_indices.py (a V4 decode step's index arithmetic, the CSA entry ids' offset) against the
torch formulas they replace, on fresh random lengths and top-k ids."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels.v4_step_indices import decode_step_indices, offset_entry_ids


@pytest.mark.parametrize("batch, window, csa, hca", [(3, 128, 4, 128), (1, 8, 0, 0), (5, 6, 4, 0)])
def test_decode_step_indices_match_torch(batch, window, csa, hca):
    gen = torch.Generator().manual_seed(batch * window)
    lens = torch.randint(0, 3 * window, (batch + 2,), generator=gen)
    lens[0] = 0  # an empty sequence: no window slot visible yet
    lens[-3] = window - 1  # a short window or the last unwrapped position
    seq_lens = lens.clone().to(DEVICE)
    got = decode_step_indices(seq_lens, batch, window, csa, hca)
    p, s, j = lens[:batch], torch.arange(batch), torch.arange(window)
    assert torch.equal(seq_lens.cpu(), torch.cat((p + 1, lens[batch:])))  # advanced: only the step's rows
    assert torch.equal(got["positions"].cpu(), p)
    assert torch.equal(got["window_slots"].cpu(), s * window + p % window)
    expect = torch.where(p[:, None] >= j, s[:, None] * window + (p[:, None] - j) % window, -1).to(torch.int32)
    assert got["window"].dtype == torch.int32 and torch.equal(got["window"].cpu(), expect[:, None])
    assert ("last_visible" in got) == bool(csa) and ("hca_lengths" in got) == bool(hca)
    if csa:
        assert torch.equal(got["last_visible"].cpu(), (p + 1) // csa - 1)
    if hca:
        assert torch.equal(got["hca_lengths"].cpu(), ((p + 1) // hca).to(torch.int32))


@pytest.mark.parametrize("N, k", [(4, 16), (3, 20)])
def test_offset_entry_ids_match_torch(N, k):
    gen = torch.Generator().manual_seed(N * k)
    topk = torch.randint(-1, 50, (N, k), generator=gen, dtype=torch.int32)
    first = torch.randint(0, 1000, (N,), generator=gen, dtype=torch.int32)
    expect = torch.where(topk >= 0, topk + first[:, None], -1)
    out = torch.full((N, k), 7777, dtype=torch.int32, device=DEVICE)  # poisoned: every element must be written
    assert offset_entry_ids(topk.to(DEVICE), first.to(DEVICE), out) is out
    assert torch.equal(out.cpu(), expect)
    in_place = topk.to(DEVICE)
    offset_entry_ids(in_place, first.to(DEVICE), in_place)
    assert torch.equal(in_place.cpu(), expect)


def test_bad_inputs_are_refused():
    with pytest.raises(InputError, match="seq_lens must be"):
        decode_step_indices(torch.zeros(2, dtype=torch.int32, device=DEVICE), 2, 8)
    with pytest.raises(InputError, match="seq_lens must be"):
        decode_step_indices(torch.zeros(2, dtype=torch.int64, device=DEVICE), 3, 8)
    with pytest.raises(InputError, match="first must be"):
        offset_entry_ids(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), torch.zeros(3, dtype=torch.int32,
                                                                                          device=DEVICE))
