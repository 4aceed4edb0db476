"""decode_positions (one launch) against the torch expressions it replaces: the positions, the rope tables'
rows and the cache slots of a decode step, with pages in shuffled order, unallocated pages and a full table."""
import pytest
import torch

from conftest import DEVICE
from minirt.errors import InputError
from minirt.kernels import decode_positions


@pytest.mark.parametrize("batch", [1, 19])
def test_decode_positions_match_torch(batch):
    gen = torch.Generator().manual_seed(batch)
    block_size, max_blocks = 64, 6
    table = torch.randperm(batch * max_blocks, generator=gen).view(batch, max_blocks).to(torch.int32)
    table[batch // 2, 3:] = -1                                     # pages not allocated
    table[0, 1] = batch * max_blocks                               # a page past the cache
    seq_lens = torch.randint(0, max_blocks * block_size, (batch,), generator=gen)
    seq_lens[batch // 2] = 3 * block_size + 5                      # on an unallocated page
    seq_lens[-1] = max_blocks * block_size                         # past the table (P covers it)
    cos_table, sin_table = torch.rand(2, max_blocks * block_size + 1, 32, generator=gen)
    seq_lens[0] = block_size + 7                                   # on it
    positions, cos, sin, slots = decode_positions(seq_lens.to(DEVICE), table.to(DEVICE), block_size, batch * max_blocks,
                                                  cos_table.to(DEVICE), sin_table.to(DEVICE))
    assert positions.dtype == slots.dtype == torch.int64 and cos.dtype == torch.float32
    assert torch.equal(positions.cpu(), seq_lens)
    assert torch.equal(cos.cpu(), cos_table[seq_lens]) and torch.equal(sin.cpu(), sin_table[seq_lens])
    expected = []
    for b, p in enumerate(seq_lens.tolist()):
        page = table[b, p // block_size].item() if p < max_blocks * block_size else -1
        expected.append(page * block_size + p % block_size if 0 <= page < batch * max_blocks else -1)
    assert slots.cpu().tolist() == expected
    assert expected[0] == expected[batch // 2] == expected[-1] == -1


def test_decode_positions_refuse_bad_input():
    seq_lens = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    cos = torch.rand(16, 32, device=DEVICE)
    with pytest.raises(InputError, match=r"block_table must be an int32 tensor \[2, max_blocks\]"):
        decode_positions(seq_lens, table[:1], 64, 8, cos, cos)
    with pytest.raises(InputError, match="sin_table must be a float table"):
        decode_positions(seq_lens, table, 64, 8, cos, cos[:, :16])
    with pytest.raises(InputError, match="block_size must be a positive int"):
        decode_positions(seq_lens, table, 0, 8, cos, cos)
    with pytest.raises(InputError, match="num_blocks must be a positive int"):
        decode_positions(seq_lens, table, 64, 0, cos, cos)
