"""compressor_decode (V4's compressor at decode, one launch) against an fp64 torch oracle built from the
same ring: rows stored, windows pooled only where they complete, normed, roped at their first position;
tokens that complete no window leave zeros and slot −1 (by token) or nothing (by sequence and window)."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels.compressor_decode import compressor_decode
from minirt.models.deepseek_v4.reference import rope_tail
from minirt.report import rel_err


def oracle(kv, gate, ape, ring_kv, ring_score, positions, seq, weight, eps, cos, sin, dim):
    """(rings after the step, entries [b, dim] fp64 or None per token) computed in fp64 torch."""
    m, overlap = ape.shape[0], kv.shape[1] == 2 * dim
    rows = ring_kv.shape[1]
    ring_kv, ring_score = ring_kv.double().clone(), ring_score.double().clone()
    entries = []
    for i, (p, s) in enumerate(zip(positions.tolist(), seq.tolist())):
        ring_kv[s, p % rows] = kv[i].double()
        ring_score[s, p % rows] = (gate[i] + ape[p % m]).double()
        if (p + 1) % m:
            entries.append(None)
            continue
        w = p // m
        cur = [(w * m + j) % rows for j in range(m)]
        k, sc = ring_kv[s, cur], ring_score[s, cur]
        if overlap:
            k, sc = k[:, dim:], sc[:, dim:]
            if w > 0:
                prev = [((w - 1) * m + j) % rows for j in range(m)]
                k, sc = torch.cat((ring_kv[s, prev, :dim], k)), torch.cat((ring_score[s, prev, :dim], sc))
        pooled = (k * sc.softmax(0)).sum(0)
        y = pooled * torch.rsqrt(pooled.pow(2).mean() + eps) * weight.double()
        entries.append(rope_tail(y[None], cos[w * m][None].double(), sin[w * m][None].double())[0])
    return ring_kv, ring_score, entries


@pytest.mark.parametrize("m, dim, overlap, by_token", [(4, 128, True, False), (4, 512, True, True),
                                                       (128, 512, False, True)])
def test_compressor_decode_matches_the_oracle(m, dim, overlap, by_token):
    gen = torch.Generator().manual_seed(m + dim)
    B, width, rows = 4, dim * (2 if overlap else 1), m * (2 if overlap else 1)
    # sequences 2, 0, 3: completing window 0 (no previous one), completing a later window, mid-window
    positions, seq = torch.tensor([m - 1, 5 * m - 1, 3 * m + 1]), torch.tensor([2, 0, 3])
    kv, gate = (torch.randn(3, width, generator=gen) for _ in range(2))
    ape = torch.randn(m, width, generator=gen)
    ring_kv, ring_score = (torch.randn(B, rows, width, generator=gen) for _ in range(2))
    weight = 1 + 0.5 * torch.randn(dim, generator=gen)
    angles = torch.rand(6 * m, 32, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    exp_kv, exp_score, expected = oracle(kv, gate, ape, ring_kv, ring_score, positions, seq, weight, 1e-6, cos, sin, dim)
    dev = [t.to(DEVICE) for t in (kv, gate, ape, ring_kv, ring_score, positions, seq, weight, cos, sin)]
    if by_token:
        out = torch.full((3, dim), float("nan"), device=DEVICE)
        slots = compressor_decode(*dev[:8], 1e-6, *dev[8:], out, slots_per_seq=7)
        assert slots.tolist() == [2 * 7 + 0, 0 * 7 + 4, -1]
        assert torch.equal(out[2].cpu(), torch.zeros(dim))
    else:
        out = torch.full((B, 6, dim), float("nan"), device=DEVICE)
        assert compressor_decode(*dev[:8], 1e-6, *dev[8:], out) is None
        written = {(2, 0): 0, (0, 4): 1}
        for s in range(B):
            for w in range(6):
                assert torch.isnan(out[s, w]).all() == ((s, w) not in written)
        out = out[[2, 0], [0, 4]]
    for i in range(2):
        assert rel_err(out[i], expected[i]) < 1e-6
    assert rel_err(dev[3], exp_kv) < 1e-7 and rel_err(dev[4], exp_score) < 1e-7


def test_compressor_decode_refuses_bad_input():
    kv = torch.randn(1, 256, device=DEVICE)
    ring = torch.zeros(2, 8, 256, device=DEVICE)
    args = (kv, kv, torch.zeros(4, 256, device=DEVICE), ring, ring.clone(), torch.tensor([3], device=DEVICE),
            torch.tensor([0], device=DEVICE), torch.ones(128, device=DEVICE), 1e-6, torch.ones(8, 32, device=DEVICE),
            torch.zeros(8, 32, device=DEVICE))
    with pytest.raises(InputError, match="inconsistent shapes"):
        compressor_decode(*args, torch.zeros(1, 64, device=DEVICE))
    with pytest.raises(InputError, match="int64 positions"):
        compressor_decode(*args[:5], args[5].int(), *args[6:], torch.zeros(1, 128, device=DEVICE))
