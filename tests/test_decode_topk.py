"""decode_topk against a stable descending torch.sort (the first topk indices, -inf and padding -1) and
against indexer_topk, on rows of exact ties (both zeros, infinities, denormals), ties straddling the
k-th score across many tiles, masked rows and rows shorter than topk.

Runs the real Triton kernels: compiled with CUDA tensors on a GPU, under TRITON_INTERPRET=1 on the CPU.
"""
import importlib
import math

import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels._launch import launch
from minirt.kernels.decode_topk import decode_topk
from minirt.kernels.lightning_indexer import indexer_topk
from test_lightning_indexer import assert_sync_free_and_replayed, stable_topk_reference, tied_scores

# The module (minirt.kernels re-exports the function under the module's name).
dt = importlib.import_module("minirt.kernels.decode_topk")

ON_GPU = DEVICE == "cuda"


@pytest.fixture(autouse=True, params=["one program a row", "programs of TILE keys"])
def selection(request, monkeypatch):
    """Every test through both selections: one program a row (_row_select_kernel) for rows up to 8,192
    keys, past the default ROW_PROGRAM_KEYS (every row here but the GPU's 163,840, whose row would not fit
    one program's registers: tiles then); then every row through the histogram passes over programs of
    TILE keys."""
    monkeypatch.setattr(dt, "ROW_PROGRAM_KEYS", 8192 if request.param == "one program a row" else 0)
    monkeypatch.setattr(dt, "_KEPT", {})   # (a signature keeps the selection of its first call)


@pytest.mark.parametrize("n_keys, kernel", [(300, "_row_select_kernel"), (301, "_histogram_kernel")])
def test_rows_up_to_row_program_keys_take_one_program(monkeypatch, n_keys, kernel):
    """Rows of at most ROW_PROGRAM_KEYS keys are selected by one program a row, longer ones by tiles."""
    monkeypatch.setattr(dt, "ROW_PROGRAM_KEYS", 300)
    launched = []
    monkeypatch.setattr(dt, "launch", lambda k, *args: launched.append(k) or launch(k, *args))
    scores = torch.randn(2, n_keys, generator=torch.Generator(DEVICE).manual_seed(3), device=DEVICE)
    assert torch.equal(decode_topk(scores, 40), stable_topk_reference(scores, 40))
    assert getattr(dt, kernel) in launched and dt._rank_kernel in launched


@pytest.mark.parametrize("shape, topk", [
    ((6, 300), 40), ((6, 300), 300), ((6, 50), 64), ((2, 3, 129), 1), ((4, 2048), 2048 - 5), ((3, 4500), 2048),
])
def test_matches_stable_sort_on_ties(shape, topk):
    gen = torch.Generator(DEVICE).manual_seed(shape[-1] + topk)
    scores = tied_scores(gen, shape)
    got = decode_topk(scores, topk)
    assert got.dtype == torch.int32 and got.shape == (*shape[:-1], topk)
    assert torch.equal(got, stable_topk_reference(scores, topk))
    assert torch.equal(got, indexer_topk(scores, topk))


def test_boundary_ties_across_tiles():
    """The k-th score is held by many keys in several tiles: the lowest indices of it are taken
    (the first rank program's scan). Row 0: every score equal; row 1: distinct scores above a tied level
    that spans all tiles; row 2: the tied level taken whole (exactly topk - above keys hold it)."""
    n_keys, topk = 2 * dt.TILE + 300, 700
    gen = torch.Generator(DEVICE).manual_seed(5)
    scores = torch.full((3, n_keys), 1.5, device=DEVICE)
    scores[1] = torch.where(torch.rand(n_keys, generator=gen, device=DEVICE) < 0.1,
                            2 + torch.rand(n_keys, generator=gen, device=DEVICE), 1.5)
    scores[2] = torch.randn(n_keys, generator=gen, device=DEVICE) - 10
    scores[2, torch.randperm(n_keys, generator=gen, device=DEVICE)[:topk]] = 0.25
    got = decode_topk(scores, topk)
    assert torch.equal(got, stable_topk_reference(scores, topk))
    assert torch.equal(got[0], torch.arange(topk, device=DEVICE, dtype=torch.int32))


def test_kth_score_shares_its_top_bytes():
    """Scores whose order images differ only in their low 16 bits (row 0: 1 + i * 2^-23, the third pass
    alone separates them) or share only their top byte (row 1: 1 + j / 128 plus such steps, the second
    pass and the third); row 2 spans sign and exponents around the k-th score (the first pass)."""
    n_keys, topk = 2 * dt.TILE + 100, 700
    gen = torch.Generator(DEVICE).manual_seed(11)
    steps = torch.randperm(n_keys, generator=gen, device=DEVICE).float()
    scores = torch.empty((3, n_keys), device=DEVICE)
    scores[0] = 1 + steps * 2.0**-23
    coarse = torch.randint(0, 128, (n_keys,), generator=gen, device=DEVICE).float()
    scores[1] = 1 + coarse / 128 + (steps % 4096) * 2.0**-23
    scores[2] = torch.randn(n_keys, generator=gen, device=DEVICE) * torch.exp2(
        torch.randint(-20, 20, (n_keys,), generator=gen, device=DEVICE).float())
    got = decode_topk(scores, topk)
    assert torch.equal(got, stable_topk_reference(scores, topk))


@pytest.mark.parametrize("n_valid", [0, 1, 699, 700, 701, 3000])
def test_masked_rows_and_padding(n_valid):
    """Random scores with all but n_valid keys at -inf (a decode row's positions past the query): fewer
    valid keys than topk pad with -1; the -inf keys are never selected."""
    n_keys, topk = dt.TILE + 1000, 700
    gen = torch.Generator(DEVICE).manual_seed(n_valid)
    scores = torch.randn(2, n_keys, generator=gen, device=DEVICE)
    scores[0, n_valid:] = -math.inf
    scores[1, torch.randperm(n_keys, generator=gen, device=DEVICE)[n_valid:]] = -math.inf
    got = decode_topk(scores, topk)
    assert torch.equal(got, stable_topk_reference(scores, topk))
    assert ((got >= 0).sum(1) == min(n_valid, topk)).all()


def test_topk_beyond_width_and_empty():
    gen = torch.Generator(DEVICE).manual_seed(9)
    scores = torch.randn(3, 100, generator=gen, device=DEVICE)
    assert torch.equal(decode_topk(scores, 130), stable_topk_reference(scores, 130))
    assert decode_topk(scores[:0], 4).shape == (0, 4)
    assert torch.equal(decode_topk(scores[:, :0], 4), torch.full((3, 4), -1, dtype=torch.int32, device=DEVICE))


def test_large_topk_runs_indexer_topk():
    gen = torch.Generator(DEVICE).manual_seed(4)
    scores = torch.randn(2, dt.MAX_TOPK + 50, generator=gen, device=DEVICE)
    topk = dt.MAX_TOPK + 1
    assert torch.equal(decode_topk(scores, topk), stable_topk_reference(scores, topk))


@pytest.mark.parametrize("scores, topk, message", [
    (torch.zeros(3, 8, dtype=torch.float64), 2, "float32"),
    (torch.zeros(3, 8), 0, "positive int"),
    (torch.zeros(3, 8), True, "positive int"),
])
def test_bad_input(scores, topk, message):
    with pytest.raises(InputError, match=message):
        decode_topk(scores.to(DEVICE), topk)


def test_pages_give_the_selections_cache_slots():
    """pages: each selected position mapped through its row's block table (shuffled pages, an unallocated
    page, a page outside the cache, positions past the table) equals positions_to_slots' mapping of the
    plain selection; row 1's boundary ties go through the tie scan."""
    n_keys, topk, block_size, num_blocks = 2 * dt.TILE + 100, 300, 64, 200
    gen = torch.Generator(DEVICE).manual_seed(9)
    scores = torch.randn(3, 1, n_keys, generator=gen, device=DEVICE)
    scores[1, 0] = 1.5                                                     # every score tied
    max_blocks = (n_keys - 500) // block_size                              # the last ~500 keys past the table
    table = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: 3 * max_blocks].view(3, max_blocks)
    table = table.to(torch.int32)
    table[0, ::5] = -1                                                     # unallocated pages
    table[2, ::7] = num_blocks + 3                                         # outside the cache
    scores[:, :, max_blocks * block_size:][..., :100] += 10                # 100 past the table: selected first
    got = decode_topk(scores, topk, pages=(table, block_size, num_blocks))
    positions = decode_topk(scores, topk).long()
    page = table.long().gather(1, (positions[:, 0] // block_size).clamp(max=max_blocks - 1))
    inside = (positions[:, 0] >= 0) & (positions[:, 0] < max_blocks * block_size) & (page >= 0) & (page < num_blocks)
    expected = torch.where(inside, page * block_size + positions[:, 0] % block_size, -1)
    assert got.dtype == torch.int32 and torch.equal(got[:, 0].long(), expected)
    assert (got == -1).any() and (got >= 0).sum() > topk
    with pytest.raises(InputError, match="pages must be"):
        decode_topk(scores, topk, pages=(table[:2], block_size, num_blocks))
    with pytest.raises(InputError, match="pages needs topk"):
        decode_topk(scores, dt.MAX_TOPK + 1, pages=(table, block_size, num_blocks))
    torch.library.opcheck(torch.ops.minirt.decode_topk, (scores, topk, table, block_size, num_blocks),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not ON_GPU, reason="V3.2's decode shape (163,840 keys); the interpreter would take minutes")
def test_decode_shape_sync_free_and_graph_capturable():
    """16 rows of 163,840 scores (positions past each row's limit -inf), top 2048: equal to the stable
    sort, no host synchronisation, and a captured graph replays on new scores."""
    gen = torch.Generator(DEVICE).manual_seed(12)
    shape, topk = (16, 163840), 2048
    limits = torch.randint(1, shape[1], (shape[0], 1), generator=gen, device=DEVICE)
    positions = torch.arange(shape[1], device=DEVICE)

    def fresh():
        s = torch.randn(shape, generator=gen, device=DEVICE).abs()
        return s.masked_fill(positions > limits, -math.inf)

    scores = fresh()
    assert torch.equal(decode_topk(scores, topk), stable_topk_reference(scores, topk))
    assert_sync_free_and_replayed(decode_topk, scores, topk, fresh)
