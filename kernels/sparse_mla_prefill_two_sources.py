"""Sparse MLA prefill over two key sources in one softmax (DeepSeek-V4: each query's sliding-window keys
and its selected compressed entries), on top of sparse_mla_prefill.

Design: the two sources are gathered into one bf16 buffer (their concatenation) and the two index lists
into one list per query, each list's used entries first (the window's, then the compressed ones, shifted
past the window rows), so one topk_length cuts every row's unused tail; then sparse_mla_prefill runs
unchanged, with both of its kernels (the portable one and the sm90 Gluon one, whose producer follows one
index stream). vLLM's V4 prefill does the same (it dequantises both caches into one buffer for
FlashMLA's flash_mla_sparse_fwd). Reading both sources in the kernels instead would save only the copy:
(s_kv + s_extra) rows of d_qk bf16 values and s_q * (topk + extra_topk) indices, against attention work of
s_q * h_q * (topk + extra_topk) * 2 * (d_qk + d_v) FLOP (V4-Flash, a 4096-token chunk, 128 + 512 keys per
query over 4096 window rows and 16384 compressed entries: a 21 MB copy against 0.34 TFLOP);
scripts/bench_prefill.py measures the gather's share.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from minirt.errors import InputError

from ._common import check_device, check_tensor, check_tensors
from .sparse_mla_prefill import PrefillConfig, sparse_mla_prefill


def combine_sources(kv: torch.Tensor, indices: torch.Tensor, extra_kv: torch.Tensor, extra_indices: torch.Tensor,
                    topk_length: Optional[torch.Tensor] = None, extra_topk_length: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """
    One key buffer and one index list per query that mean the same as the two sources.

    Args:
        kv: [s_kv, 1, d_qk], extra_kv: [s_extra, 1, d_qk], one dtype.
        indices: [s_q, 1, topk], extra_indices: [s_q, 1, extra_topk], int32 rows of kv / extra_kv; values
            outside [0, s_kv) / [0, s_extra) are invalid.
        topk_length, extra_topk_length: optional [s_q] int32: row i uses indices[i, 0, :topk_length[i]]
            (clamped to [0, topk]), likewise for the extra list.

    Returns:
        (kv_all [s_kv + s_extra, 1, d_qk]: kv then extra_kv (a copy),
         indices_all [s_q, 1, topk + extra_topk] int32: row i's used window entries, then its used extra
         entries + s_kv, then -1; invalid entries as -1 (never shifted into the other source's rows),
         topk_length_all [s_q] int32 (the used count, or None when neither length is given)).
    """
    s_kv, topk, extra_topk = kv.shape[0], indices.shape[2], extra_indices.shape[2]
    s_q, width = indices.shape[0], topk + extra_topk
    main = indices[:, 0].long()
    main = torch.where((main >= 0) & (main < s_kv), main, -1)
    extra = extra_indices[:, 0].long()
    extra = torch.where((extra >= 0) & (extra < extra_kv.shape[0]), extra + s_kv, -1)

    def used(lengths, n):
        return torch.full((s_q,), n, device=kv.device) if lengths is None else lengths.long().clamp(0, n)
    n_main, n_extra = used(topk_length, topk), used(extra_topk_length, extra_topk)
    pos = torch.arange(width, device=kv.device)[None, :].expand(s_q, width)
    extra_pos = pos - n_main[:, None]
    # One -1 column past each list stands in for the positions that take nothing from it.
    main_pick = F.pad(main, (0, 1), value=-1).gather(1, pos.clamp(max=topk))
    extra_pick = F.pad(extra, (0, 1), value=-1).gather(
        1, torch.where((extra_pos >= 0) & (extra_pos < n_extra[:, None]), extra_pos, extra_topk))
    combined = torch.where(pos < n_main[:, None], main_pick, extra_pick).to(torch.int32).view(s_q, 1, width)
    lengths = None if topk_length is None and extra_topk_length is None else (n_main + n_extra).to(torch.int32)
    return torch.cat([kv, extra_kv], 0), combined, lengths


def sparse_mla_prefill_two_sources(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    extra_kv: torch.Tensor,
    extra_indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    config: Optional[PrefillConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Sparse MLA prefill where each query attends to keys of two sources in one softmax: FlashMLA's
    flash_mla_sparse_fwd over the concatenation of the sources and of their index lists (DeepSeek-V4:
    kv = the window keys, extra_kv = the compressed entries, both bf16 K = V rows; d_qk = d_v = 512).

    Args:
        q: [s_q, h_q, d_qk], bfloat16.
        kv: [s_kv, 1, d_qk] and extra_kv: [s_extra, 1, d_qk], q.dtype.
        indices: [s_q, 1, topk] and extra_indices: [s_q, 1, extra_topk], int32 rows of kv and of extra_kv.
            Values outside [0, s_kv) (resp. [0, s_extra)) are invalid and skipped (any value); duplicates
            count twice.
        sm_scale, d_v, attn_sink: as in sparse_mla_prefill.
        topk_length, extra_topk_length: optional [s_q] int32: row i uses indices[i, 0, :topk_length[i]]
            and extra_indices[i, 0, :extra_topk_length[i]] (each clamped to its width).
        out, config: keyword-only, optional, as in sparse_mla_prefill (preallocated results; a launch shape).

    Returns:
        (out [s_q, h_q, d_v] q.dtype, max_logits [s_q, h_q] float32, lse [s_q, h_q] float32), as
        sparse_mla_prefill over both sources: lse without the sink; a row with no valid index in either
        list gets out 0, lse +inf, max_logits -inf.

    Raises:
        minirt.errors.InputError: the checks of sparse_mla_prefill, extra_kv not like kv (rank, d_qk,
            dtype), extra_indices not int32 [s_q, 1, extra_topk], a length not int32 [s_q].
    """
    check_tensors({"q": q, "kv": kv, "indices": indices, "extra_kv": extra_kv, "extra_indices": extra_indices})
    if kv.dim() != 3 or extra_kv.dim() != 3 or extra_kv.shape[1:] != kv.shape[1:] or extra_kv.dtype != kv.dtype:
        raise InputError(f"extra_kv must be a {kv.dtype} tensor [s_extra, {', '.join(map(str, kv.shape[1:]))}] like "
                         f"kv, got {extra_kv.dtype} {tuple(extra_kv.shape)}")
    s_q = q.shape[0] if q.dim() == 3 else None
    for name, t in (("indices", indices), ("extra_indices", extra_indices)):
        if t.dim() != 3 or t.dtype != torch.int32 or t.shape[:2] != (s_q, 1):
            raise InputError(f"{name} must be an int32 tensor [s_q={s_q}, 1, topk], got {t.dtype} {tuple(t.shape)}")
    tensors = {}
    check_tensor(tensors, "topk_length", topk_length, torch.int32, (s_q,), optional=True)
    check_tensor(tensors, "extra_topk_length", extra_topk_length, torch.int32, (s_q,), optional=True)
    check_device({"q": q, "kv": kv, "indices": indices, "extra_kv": extra_kv, "extra_indices": extra_indices,
                  **tensors})
    kv_all, indices_all, lengths = combine_sources(kv, indices, extra_kv, extra_indices, topk_length,
                                                   extra_topk_length)
    return sparse_mla_prefill(q, kv_all, indices_all, sm_scale, d_v, attn_sink, lengths, out=out, config=config)
