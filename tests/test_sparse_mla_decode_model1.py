"""sparse_mla_decode_fp8 over MODEL1 caches (DeepSeek-V4: a window cache plus an extra, compressed one)
against an fp64 reference written here from FlashMLA's documented semantics (flash_mla_with_kvcache,
d_qk 512): both index lists gathered from their caches and concatenated, one masked softmax, lse without
the sink, out scaled by 1 / (1 + exp(sink - lse)), rows without a valid index out 0 and lse +inf.

Caches are built with FlashMLA's quantisation rule (test_model1_cache.flashmla_rule) and read back by the
reference from their raw bytes. Every byte no used valid index points to (unused entries, pad bytes, page
tails) is 0xFF: NaN as e4m3, ue8m0 and bf16. Outputs are NaN-poisoned before each call. The kernels run
for real: compiled on a GPU (through every kernel path, conftest.kernel_path), interpreted on the CPU.
"""
import math

import pytest
import torch

from conftest import DEVICE
from minirt import formats
from minirt.errors import InputError
from minirt.kernels import new_kv_cache, new_model1_cache, sparse_mla_decode_fp8
from test_model1_cache import flashmla_rule
from test_sparse_mla_decode import INT32_MAX, INT32_MIN, check, random_indices

pytestmark = pytest.mark.usefixtures("kernel_path")

ON_GPU = DEVICE == "cuda"
SM_SCALE = 512 ** -0.5


class Source:
    """One MODEL1 cache and its index list: page bytes built on the CPU, poisoned where unused."""

    def __init__(self, num_blocks, block_size, topk, b, s_q, seed, p_invalid=0.3, page_pad=0):
        g = torch.Generator().manual_seed(seed)
        self.block_size, self.num_slots = block_size, num_blocks * block_size
        kv = torch.randn(num_blocks, block_size, 512, generator=g)
        kv *= torch.exp2(torch.randint(-2, 3, (num_blocks, block_size, 1), generator=g).float())
        pages = flashmla_rule(kv.to(torch.bfloat16))
        self.page_bytes = pages.shape[1] + page_pad
        self.pages = torch.full((num_blocks, self.page_bytes), 0xFF, dtype=torch.uint8)
        self.pages[:, :pages.shape[1]] = pages
        self.pages[:, block_size * 576:block_size * 584].view(num_blocks, block_size, 8)[..., 7] = 0xFF   # pad bytes
        self.indices = random_indices(b, s_q, topk, self.num_slots, seed, p_invalid)
        self.lengths = None

    def set_lengths(self, lengths):
        self.lengths = torch.tensor(lengths, dtype=torch.int32)

    def used(self):
        """[b, s_q, topk] mask of the entries the semantics read: valid slot, position below the length."""
        valid = (self.indices >= 0) & (self.indices < self.num_slots)
        if self.lengths is not None:
            valid &= torch.arange(self.indices.shape[2])[None, None, :] < self.lengths.long()[:, None, None]
        return valid

    def poison_unused(self):
        touched = torch.zeros(self.num_slots, dtype=torch.bool)
        touched[self.indices[self.used()].long()] = True
        page, offset = (~touched).nonzero()[:, 0] // self.block_size, (~touched).nonzero()[:, 0] % self.block_size
        n, B = self.pages.shape[0], self.block_size
        self.pages[:, :B * 576].view(n, B, 576)[page, offset] = 0xFF
        self.pages[:, B * 576:B * 584].view(n, B, 8)[page, offset] = 0xFF

    def entries(self):
        """Every slot's K = V vector [num_slots, 512] float64, from the raw page bytes."""
        n, B = self.pages.shape[0], self.block_size
        data = self.pages[:, :B * 576].reshape(n * B, 576)
        scales = self.pages[:, B * 576:B * 584].reshape(n * B, 8)[:, :7].contiguous()
        nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).double().view(-1, 7, 64)
        nope = nope * scales.view(torch.float8_e8m0fnu).double()[..., None]
        rope = data[:, 448:].contiguous().view(torch.bfloat16).double()
        return torch.cat([nope.flatten(1), rope], 1)

    def device_args(self):
        """(cache view [num_blocks, B, 1, 584], indices, lengths) on DEVICE."""
        buf = self.pages.to(DEVICE)
        cache = buf.as_strided((buf.shape[0], self.block_size, 1, 584), (self.page_bytes, 584, 584, 1))
        lengths = None if self.lengths is None else self.lengths.to(DEVICE)
        return cache, self.indices.to(DEVICE), lengths


def reference(q, sources, sm_scale, attn_sink=None):
    """fp64 FlashMLA semantics over the concatenated sources: out [b,s,h,512], lse [b,h,s], empty [b,h,s],
    dot magnitude [b,h,s], spread sum_j p_j |v_j| [b,s,h,512] (test_sparse_mla_decode.check's input)."""
    ks, valids = [], []
    for src in sources:
        used = src.used()
        kv = src.entries()
        ks.append(torch.where(used[..., None], kv[torch.where(used, src.indices, 0).long()], 0.0))
        valids.append(used)
    k, valid = torch.cat(ks, 2), torch.cat(valids, 2)                          # [b, s, t, 512]
    q64 = q.cpu().double()
    logits = torch.einsum("bshd,bstd->bsht", q64, k) * sm_scale
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    magnitude = (torch.einsum("bshd,bstd->bsht", q64.abs(), k.abs()) * sm_scale).amax(-1)
    lse = torch.logsumexp(logits, -1)
    empty = ~valid.any(-1)[:, :, None].expand_as(lse)
    lse_finite = torch.where(empty, 0.0, lse)
    p = torch.exp(logits - lse_finite[..., None])
    out, spread = torch.einsum("bsht,bstd->bshd", p, k), torch.einsum("bsht,bstd->bshd", p, k.abs())
    if attn_sink is not None:
        factor = 1.0 / (1.0 + torch.exp(attn_sink.cpu().double()[None, None, :] - lse_finite))[..., None]
        out, spread = out * factor, spread * factor
    lse = torch.where(empty, math.inf, lse)
    return out, lse.transpose(1, 2), empty.transpose(1, 2), magnitude.transpose(1, 2), spread


def decode(q, main, extra=None, attn_sink=None, **kwargs):
    """Run the kernel on the sources into NaN-poisoned preallocated outputs."""
    b, s_q, h_q, _ = q.shape
    out = torch.full((b, s_q, h_q, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((b, h_q, s_q), math.nan, dtype=torch.float32, device=DEVICE)
    cache, indices, lengths = main.device_args()
    if extra is not None:
        e_cache, e_indices, e_lengths = extra.device_args()
        kwargs.update(extra_kv_cache=e_cache, extra_indices=e_indices, extra_topk_length=e_lengths)
    got = sparse_mla_decode_fp8(q, cache, indices, SM_SCALE, 512, attn_sink=attn_sink, topk_length=lengths,
                                out=out, lse=lse, **kwargs)
    assert got[0] is out and got[1] is lse
    return out, lse


def random_q(b, s_q, h_q, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s_q, h_q, 512, generator=g) * 2).to(torch.bfloat16).to(DEVICE)


def random_sink(h_q, seed):
    """Sinks around the logits' scale, the first two heads -inf (no effect) and +inf (out 0)."""
    sink = torch.randn(h_q, generator=torch.Generator().manual_seed(seed)) * 2
    sink[0] = -math.inf
    if h_q > 1:
        sink[1] = math.inf
    return sink.to(DEVICE)


CASES = [  # b, s_q, h_q, (topk, page), (extra_topk, extra page) or None, num_splits, lengths, extra lengths
    (2, 1, 8, (40, 64), None, 1, [40, 9], None),
    (1, 3, 16, (24, 2), (40, 64), 2, [30], [17]),        # lengths past topk and inside
    (2, 1, 32, (16, 256), (70, 2), None, None, [0, 70]),  # the HCA shape: per-row extra length
    (1, 1, 64, (20, 256), (48, 64), 3, None, None),
    (1, 1, 128, (8, 64), (24, 2), 2, [0], None),         # only the extra list in use
]


@pytest.mark.parametrize("b,s_q,h_q,main_shape,extra_shape,num_splits,lengths,extra_lengths", CASES)
def test_matches_reference(b, s_q, h_q, main_shape, extra_shape, num_splits, lengths, extra_lengths):
    seed = 100 * h_q + b
    topk, page = main_shape
    main = Source(max(1, 96 // page), page, topk, b, s_q, seed, page_pad=32 * (h_q % 3))
    extra = None if extra_shape is None else Source(max(1, 96 // extra_shape[1]), extra_shape[1], extra_shape[0],
                                                    b, s_q, seed + 1)
    if lengths is not None:
        main.set_lengths(lengths)
    if extra_lengths is not None:
        extra.set_lengths(extra_lengths)
    sources = [main] + ([extra] if extra else [])
    for src in sources:
        src.poison_unused()
    q, sink = random_q(b, s_q, h_q, seed), random_sink(h_q, seed)
    got = decode(q, main, extra, sink, num_splits=num_splits)
    ref = reference(q, sources, SM_SCALE, sink)
    check(got, ref)
    assert (got[0][:, :, 1].cpu() == 0).all() and torch.isfinite(got[1][:, 1][~ref[2][:, 1]]).all()   # sink +inf


def test_empty_rows_garbage_indices_and_zero_lengths():
    b, s_q, h_q = 3, 2, 16
    main, extra = Source(2, 64, 32, b, s_q, 7), Source(8, 2, 24, b, s_q, 8)
    main.indices[0, 1] = -1                                                  # row (0, 1): nothing in either
    extra.indices[0, 1] = torch.tensor([INT32_MIN, INT32_MAX, 16, -1] * 6, dtype=torch.int32)
    main.indices[1, 0] = torch.tensor([INT32_MAX, 128, -7, INT32_MIN] * 8, dtype=torch.int32)   # only extra
    main.set_lengths([32, 40, 0])                                            # sequence 2: nothing used ...
    extra.set_lengths([24, 10, 0])                                           # ... in either list
    for src in (main, extra):
        src.poison_unused()
    q = random_q(b, s_q, h_q, 7)
    sink = torch.full((h_q,), -math.inf, device=DEVICE)
    sink[1::2] = 0.5
    for num_splits in (1, 2):
        got = decode(q, main, extra, sink, num_splits=num_splits)
        ref = reference(q, [main, extra], SM_SCALE, sink)
        assert ref[2][0, :, 1].all() and ref[2][2].all() and not ref[2][1, :, 0].any()
        check(got, ref)


def test_duplicates_count_twice():
    """One slot repeated n times in the window list and m times in the extra list (of another cache):
    p is uniform over n + m copies, so out is the two entries' average weighted n : m and lse
    log(n e^s1 + m e^s2)."""
    main, extra = Source(1, 64, 12, 1, 1, 9, p_invalid=0.0), Source(4, 2, 5, 1, 1, 10, p_invalid=0.0)
    main.indices[:] = 5
    main.indices[0, 0, 9:] = -1          # 9 copies
    extra.indices[:] = 6                 # 5 copies
    for src in (main, extra):
        src.poison_unused()
    q = random_q(1, 1, 8, 9) * 0.05
    got = decode(q, main, extra)
    ref = reference(q, [main, extra], SM_SCALE)
    check(got, ref)
    k1, k2 = main.entries()[5], extra.entries()[6]
    s1, s2 = (q.cpu().double()[0, 0] @ k1) * SM_SCALE, (q.cpu().double()[0, 0] @ k2) * SM_SCALE
    lse = torch.log(9 * torch.exp(s1) + 5 * torch.exp(s2))
    assert torch.allclose(got[1].cpu()[0, :, 0].double(), lse, rtol=1e-5, atol=1e-5)


def test_custom_op_takes_the_extra_cache():
    main, extra = Source(1, 16, 8, 1, 1, 11), Source(4, 2, 8, 1, 1, 12)
    main.set_lengths([5])
    extra.set_lengths([8])
    (cache, indices, lengths), (e_cache, e_indices, e_lengths) = main.device_args(), extra.device_args()
    q = random_q(1, 1, 8, 11)
    args = (q, cache, indices, SM_SCALE, 512, None, lengths, e_cache, e_indices, e_lengths)
    # (test_schema, which runs the op many times, takes ~20 s interpreted; test_ops checks the op's schema.)
    torch.library.opcheck(torch.ops.minirt.sparse_mla_decode_fp8, args, test_utils=("test_faketensor",))
    out, lse = torch.ops.minirt.sparse_mla_decode_fp8(*args)
    check((out, lse), reference(q, [main, extra], SM_SCALE))


def test_bad_inputs_raise_input_error():
    cache, extra = new_model1_cache(2, 4, DEVICE), new_model1_cache(3, 2, DEVICE)
    q = random_q(1, 2, 8, 0)
    idx = torch.zeros(1, 2, 8, dtype=torch.int32, device=DEVICE)
    lengths = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bad_calls = [  # (arguments replaced, the name the message must give)
        (dict(kv_cache=cache.view(torch.int8)), "kv_cache"),
        (dict(kv_cache=torch.zeros(2, 4, 1, 600, dtype=torch.uint8, device=DEVICE)), "kv_cache"),
        (dict(kv_cache=torch.zeros(2, 4, 584, dtype=torch.uint8, device=DEVICE)), "kv_cache"),
        (dict(q=random_q(1, 2, 8, 0).float()), "q"),
        (dict(q=torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16, device=DEVICE)), "q"),
        (dict(q=torch.zeros(1, 2, 0, 512, dtype=torch.bfloat16, device=DEVICE)), "h_q"),
        (dict(d_v=448), "d_v"),
        (dict(indices=idx.long()), "indices"),
        (dict(indices=idx[:, :1]), "indices"),
        (dict(topk_length=torch.zeros(2, dtype=torch.int32, device=DEVICE)), "topk_length"),
        (dict(extra_kv_cache=extra), "extra_indices"),
        (dict(extra_indices=idx), "extra_kv_cache"),
        (dict(extra_topk_length=lengths), "extra_topk_length"),
        (dict(extra_kv_cache=new_kv_cache(2, 4, DEVICE), extra_indices=idx), "extra_kv_cache"),
        (dict(extra_kv_cache=extra.view(torch.int8), extra_indices=idx), "extra_kv_cache"),
        (dict(extra_kv_cache=extra, extra_indices=idx.long()), "extra_indices"),
        (dict(extra_kv_cache=extra, extra_indices=torch.zeros(1, 3, 8, dtype=torch.int32, device=DEVICE)),
         "extra_indices"),
        (dict(extra_kv_cache=extra, extra_indices=idx,
              extra_topk_length=torch.zeros(3, dtype=torch.int32, device=DEVICE)), "extra_topk_length"),
        (dict(extra_kv_cache=extra, extra_indices=idx, extra_topk_length=lengths.long()), "extra_topk_length"),
        (dict(kv_cache=new_kv_cache(2, 4, DEVICE), q=torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16, device=DEVICE),
              extra_kv_cache=extra, extra_indices=idx), "MODEL1"),
    ]
    for bad, name in bad_calls:
        args = dict(q=q, kv_cache=cache, indices=idx, sm_scale=SM_SCALE)
        args.update(bad)
        with pytest.raises(InputError, match=name):
            sparse_mla_decode_fp8(**args)


@pytest.mark.skipif(not ON_GPU, reason="production shapes only on the GPU; the CPU runs the small cases above")
@pytest.mark.parametrize("h_q,extra_topk,extra_page,extra_lengths", [(64, 512, 64, False), (128, 1024, 64, False),
                                                                     (64, 1024, 2, True), (16, 512, 64, False)])
def test_v4_shapes_gpu(h_q, extra_topk, extra_page, extra_lengths):
    """V4's layers: a window of 128 in 256-entry pages plus the compressed entries (CSA: 64-entry pages;
    HCA: 2-entry pages, a per-row count), default splits."""
    b, s_q = 4, 2
    main = Source(8, 256, 128, b, s_q, h_q, p_invalid=0.05)
    extra = Source(4096 // extra_page, extra_page, extra_topk, b, s_q, h_q + 1, p_invalid=0.05)
    if extra_lengths:
        extra.set_lengths([extra_topk, 0, 300, 1])
    for src in (main, extra):
        src.poison_unused()
    q, sink = random_q(b, s_q, h_q, h_q), random_sink(h_q, h_q)
    check(decode(q, main, extra, sink), reference(q, [main, extra], SM_SCALE, sink))


def test_model1_page_layout_constants():
    """The geometry the kernels index by (FlashMLA: data at page + i * 576, scales at page + B * 576 + i * 8)."""
    assert (formats.MODEL1_DATA_BYTES, formats.MODEL1_SCALE_BYTES, formats.MODEL1_ENTRY_BYTES) == (576, 8, 584)
    assert [formats.model1_page_bytes(B) for B in (2, 64, 256)] == [1728, 37440, 149760]
