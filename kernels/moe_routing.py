"""MoE routers as one sync-free Triton kernel each: scores, expert selection and combine weights.

- ``route_topk``: DeepSeek-V3 / V3.2 (sigmoid scores, group-limited) and V4 (sqrt(softplus) scores, no
  groups) top-k routing with the selection-only bias (``e_score_correction_bias``);
- ``route_hash``: V4's hash layers, experts looked up in the frozen ``tid2eid`` table by token id;
  ``check_tid2eid`` validates that table once, at load.

Selection is an argmax repeated top_k times over the biased scores of a row, each pick the highest
score and among equal scores the lowest expert index; a picked expert leaves the row. Groups are
chosen the same way from their scores. Both kernels launch one program per block of tokens and read
nothing from the host, so they can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minirt.errors import InputError

from ._common import INTERPRET, check_device, check_tensor

SCORINGS = ("sigmoid", "sqrtsoftplus")
_SCORE_CODES = {name: i for i, name in enumerate(SCORINGS)}
# torch's softplus returns x itself above this (beta 1): log1p(exp(x)) equals x in fp32 there.
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
_TOKENS_PER_PROGRAM = 4


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    # Compiled, libdevice's expf, which torch's CUDA kernels call (tl.exp is ex2.approx); the
    # interpreter has no libdevice.
    if INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log1p(y, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        # Kahan's log1p from log: exact where 1 + y rounds to 1, else log(u) corrected by y / (u - 1).
        u = 1.0 + y
        return tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, tl.where(u == 1.0, 1.0, u - 1.0)))
    else:
        return libdevice.log1p(y)


@triton.jit
def _scores(logits, SCORING: tl.constexpr, INTERPRETED: tl.constexpr):
    """torch's formulas, IEEE division and square root: sigmoid 1 / (1 + exp(-x)); sqrtsoftplus
    sqrt(x > 20 ? x : log1p(exp(x)))."""
    if SCORING == 0:
        return tl.div_rn(1.0, 1.0 + _exp(-logits, INTERPRETED))
    else:
        softplus = tl.where(logits > _SOFTPLUS_THRESHOLD, logits,
                            _log1p(_exp(tl.minimum(logits, _SOFTPLUS_THRESHOLD), INTERPRETED), INTERPRETED))
        return tl.sqrt_rn(softplus)


@triton.jit
def _argmax_low(values, cols, NO_COL: tl.constexpr):
    """Per row of values [R, C]: (max, the lowest column index holding it)."""
    best = tl.max(values, 1)
    return best, tl.min(tl.where(values == best[:, None], cols[None, :], NO_COL), 1)


@triton.jit
def _store_routes(weights_ptr, ids_ptr, picked, ids, rows, row_mask, slots, TOP_K: tl.constexpr,
                  NORMALIZE: tl.constexpr, scaling):
    """Store one block of rows: ids [R, K_PAD] int32 and picked [R, K_PAD] (their unbiased scores, 0
    past TOP_K) as weights, normalised to sum 1 when NORMALIZE (a row summing to 0 stays 0), times scaling."""
    if NORMALIZE:
        total = tl.sum(picked, 1)
        picked = tl.div_rn(picked, tl.where(total == 0.0, 1.0, total)[:, None])
    offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + offsets, ids, mask=mask)
    tl.store(weights_ptr + offsets, picked * scaling, mask=mask)


@triton.jit(do_not_specialize=["n_tokens", "scaling"])
def _route_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, n_tokens, stride_lt, scaling,
                       E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                       BLOCK_T: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_tokens
    cols = tl.arange(0, E_PAD)
    col_mask = cols < E
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :],
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    scores = _scores(logits, SCORING, INTERPRETED)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    choice = tl.where(col_mask[None, :], choice, float("-inf"))

    if N_GROUP > 1:
        # A group's score is the sum of its two best biased scores; the TOPK_GROUP best groups stay.
        group_of = cols // (E // N_GROUP)
        groups = tl.arange(0, G_PAD)
        group_scores = tl.full((BLOCK_T, G_PAD), float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.where((group_of == g)[None, :], choice, float("-inf"))
            first, first_col = _argmax_low(in_group, cols, E_PAD)
            second = tl.max(tl.where(cols[None, :] == first_col[:, None], float("-inf"), in_group), 1)
            group_scores = tl.where(groups[None, :] == g, (first + second)[:, None], group_scores)
        kept = tl.zeros((BLOCK_T, E_PAD), tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, best_group = _argmax_low(group_scores, groups, G_PAD)
            kept = kept | (group_of[None, :] == best_group[:, None])
            group_scores = tl.where(groups[None, :] == best_group[:, None], float("-inf"), group_scores)
        choice = tl.where(kept, choice, float("-inf"))

    slots = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    picked = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    taken = tl.zeros((BLOCK_T, E_PAD), tl.int1)
    for k in tl.static_range(TOP_K):
        best_choice = tl.max(tl.where(taken, float("-inf"), choice), 1)
        best = tl.min(tl.where((choice == best_choice[:, None]) & ~taken, cols[None, :], E_PAD), 1)
        hit = cols[None, :] == best[:, None]
        ids = tl.where(slots[None, :] == k, best[:, None], ids)
        picked = tl.where(slots[None, :] == k, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], picked)
        taken = taken | hit
    _store_routes(weights_ptr, ids_ptr, picked, ids, rows, row_mask, slots, TOP_K, NORMALIZE, scaling)


@triton.jit(do_not_specialize=["n_tokens", "vocab", "scaling"])
def _route_hash_kernel(logits_ptr, tid2eid_ptr, token_ids_ptr, weights_ptr, ids_ptr, n_tokens, vocab,
                       stride_lt, stride_tv, scaling, E: tl.constexpr, TOP_K: tl.constexpr,
                       K_PAD: tl.constexpr, SCORING: tl.constexpr, NORMALIZE: tl.constexpr,
                       BLOCK_T: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_tokens
    slots = tl.arange(0, K_PAD)
    tokens = tl.load(token_ids_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    token_ok = (tokens >= 0) & (tokens < vocab)
    slot_ok = (token_ok & row_mask)[:, None] & (slots[None, :] < TOP_K)
    ids = tl.load(tid2eid_ptr + tokens[:, None] * stride_tv + slots[None, :], mask=slot_ok, other=-1)
    # Neither an out-of-range token id nor an out-of-range table entry is dereferenced: the slot gets
    # expert -1 and weight 0 (moe_experts skips it).
    valid = slot_ok & (ids >= 0) & (ids < E)
    ids = tl.where(valid, ids, -1).to(tl.int32)
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + ids, mask=valid, other=0.0)
    picked = tl.where(valid, _scores(logits, SCORING, INTERPRETED), 0.0)
    _store_routes(weights_ptr, ids_ptr, picked, ids, rows, row_mask, slots, TOP_K, NORMALIZE, scaling)


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        raise InputError(f"logits must be a float32 tensor [T, E], got {getattr(logits, 'dtype', type(logits).__name__)}"
                         f" {tuple(getattr(logits, 'shape', ()))}")


def _check_scoring(scoring, top_k: int, n_experts: int) -> None:
    if scoring not in SCORINGS:
        raise InputError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise InputError(f"top_k must be an int in [1, {n_experts}] (the number of experts), got {top_k!r}")


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_tokens = logits.shape[0]
    return (torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device),
            torch.empty(n_tokens, top_k, dtype=torch.int32, device=logits.device))


def route_topk(logits: torch.Tensor, bias: Optional[torch.Tensor], *, top_k: int, scoring: str,
               n_group: int = 1, topk_group: int = 1, normalize: bool = True,
               scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Top-k MoE routing (DeepSeek-V3 / V3.2 ``noaux_tc``, DeepSeek-V4's top-k layers), in one launch.

    Per token t: scores s = sigmoid(logits[t]) ("sigmoid", V3 / V3.2) or sqrt(softplus(logits[t]))
    ("sqrtsoftplus", V4; softplus(x) = x above 20, as torch's); the choice c = s + bias (bias only
    chooses). With n_group > 1 the E experts form n_group consecutive groups of E / n_group, each
    scored by the sum of its two largest c; the topk_group best groups are kept and the experts of
    the others cannot be chosen. Then top_k experts are picked one at a time, each the largest c
    left, ties going to the lower expert index (groups likewise, to the lower group index); the same
    set and order as a stable descending sort of c. weights = s at the picked experts (unbiased),
    divided by their sum when normalize (no epsilon; a sum of exactly 0 leaves zeros), times scaling.

    Sync-free and of static shapes (CUDA-graph capturable). Scores use torch's formulas with
    libdevice exp / log1p and IEEE division and square root, so selection agrees bit for bit with a
    torch reference on the same logits unless two choices are within the scores' last-ulp
    differences; equal logits are equal scores and always break to the lower index. (libdevice
    flushes subnormal results: a sqrtsoftplus score of logits below about -87 is 0.)

    Args:
        logits: [T, E] float32, the router logits x . gate^T (computed by the caller in fp32), finite;
            unit stride along E (other layouts are copied).
        bias: [E] float32 (``e_score_correction_bias``) or None.
        top_k: experts per token, 1 <= top_k <= topk_group * E / n_group.
        scoring: "sigmoid" or "sqrtsoftplus".
        n_group, topk_group: group-limited selection (V3.2: 8 and 4); n_group must divide E into
            groups of at least 2; 1 and 1 (default) select from all experts.
        normalize: weights renormalised to sum 1 (``norm_topk_prob``).
        scaling: multiplies the weights (``routed_scaling_factor``).

    Returns:
        weights: [T, top_k] float32, in pick order (descending choice).
        expert_ids: [T, top_k] int32 in [0, E), distinct per token.
        T = 0 gives empty tensors.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, an unknown scoring, top_k or groups out of
            range, tensors on a device the kernels cannot use.
    """
    _check_logits(logits)
    n_tokens, n_experts = logits.shape
    _check_scoring(scoring, top_k, n_experts)
    tensors = {"logits": logits}
    check_tensor(tensors, "bias", bias, torch.float32, (n_experts,), optional=True)
    if not isinstance(n_group, int) or n_group < 1 or n_experts % n_group \
            or (n_group > 1 and n_experts // n_group < 2):
        raise InputError(f"n_group must divide E = {n_experts} into groups of at least 2 experts, got {n_group!r}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise InputError(f"topk_group must be an int in [1, n_group = {n_group}], got {topk_group!r}")
    if n_group > 1 and top_k > topk_group * (n_experts // n_group):
        raise InputError(f"top_k = {top_k} exceeds the {topk_group * (n_experts // n_group)} experts of the "
                         f"topk_group = {topk_group} kept groups")
    check_device(tensors)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights, expert_ids = _outputs(logits, top_k)
    if n_tokens:
        _route_topk_kernel[(triton.cdiv(n_tokens, _TOKENS_PER_PROGRAM),)](
            logits, logits if bias is None else bias.contiguous(), weights, expert_ids, n_tokens,
            logits.stride(0), float(scaling),
            E=n_experts, E_PAD=triton.next_power_of_2(n_experts), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
            TOPK_GROUP=topk_group if n_group > 1 else 1, SCORING=_SCORE_CODES[scoring],
            HAS_BIAS=bias is not None, NORMALIZE=bool(normalize), BLOCK_T=_TOKENS_PER_PROGRAM,
            INTERPRETED=INTERPRET)
    return weights, expert_ids


def check_tid2eid(tid2eid: torch.Tensor, n_experts: int, name: str = "tid2eid") -> None:
    """
    Validate a hash layer's token-to-experts table (``ffn.gate.tid2eid``) once, at load (one
    synchronising reduction).

    Args:
        tid2eid: [V, top_k] int32 or int64, each entry an expert index.
        n_experts: E, the routed experts.
        name: the tensor's name in messages (the checkpoint's, e.g. "layers.0.ffn.gate.tid2eid").

    Raises:
        minirt.errors.InputError: not a 2-D integer tensor, or an entry outside [0, E) (the message
            names the tensor, the first bad row and its value).
    """
    if not isinstance(tid2eid, torch.Tensor) or tid2eid.dtype not in (torch.int32, torch.int64) \
            or tid2eid.dim() != 2:
        raise InputError(f"{name} must be an int32 or int64 tensor [V, top_k], got "
                         f"{getattr(tid2eid, 'dtype', type(tid2eid).__name__)} {tuple(getattr(tid2eid, 'shape', ()))}")
    bad = ((tid2eid < 0) | (tid2eid >= n_experts)).nonzero()
    if bad.numel():
        row, col = bad[0].tolist()
        raise InputError(f"{name}[{row}, {col}] = {int(tid2eid[row, col])} is not an expert index in [0, {n_experts})")


def route_hash(logits: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor, *, scoring: str,
               normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Hash routing (DeepSeek-V4's first ``num_hash_layers`` layers), in one launch: expert_ids[t] =
    tid2eid[token_ids[t]]; weights = the scores (as route_topk's ``scoring``) of logits[t] at those
    experts, in table order, divided by their sum when normalize, times scaling. No bias.

    Sync-free and of static shapes. Nothing out of range is dereferenced: a token id outside [0, V)
    or a table entry outside [0, E) (check_tid2eid rejects those at load) gives that slot expert -1
    and weight 0, which moe_experts skips.

    Args:
        logits: [T, E] float32, the router logits (finite).
        tid2eid: [V, top_k] int32 or int64, validated by check_tid2eid.
        token_ids: [T] int32 or int64, the tokens being routed.
        scoring: "sigmoid" or "sqrtsoftplus" (V4).
        normalize, scaling: as route_topk.

    Returns:
        weights: [T, top_k] float32; expert_ids: [T, top_k] int32.

    Raises:
        minirt.errors.InputError: wrong dtypes or shapes, an unknown scoring, tensors on a device the
            kernels cannot use.
    """
    _check_logits(logits)
    n_tokens, n_experts = logits.shape
    if not isinstance(tid2eid, torch.Tensor) or tid2eid.dtype not in (torch.int32, torch.int64) \
            or tid2eid.dim() != 2:
        raise InputError(f"tid2eid must be an int32 or int64 tensor [V, top_k], got "
                         f"{getattr(tid2eid, 'dtype', type(tid2eid).__name__)} {tuple(getattr(tid2eid, 'shape', ()))}")
    top_k = tid2eid.shape[1]
    _check_scoring(scoring, top_k, n_experts)
    tensors = {"logits": logits, "tid2eid": tid2eid}
    check_tensor(tensors, "token_ids", token_ids, (torch.int32, torch.int64), (n_tokens,))
    check_device(tensors)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if tid2eid.stride(1) != 1:
        tid2eid = tid2eid.contiguous()
    weights, expert_ids = _outputs(logits, top_k)
    if n_tokens:
        _route_hash_kernel[(triton.cdiv(n_tokens, _TOKENS_PER_PROGRAM),)](
            logits, tid2eid, token_ids.contiguous(), weights, expert_ids, n_tokens, tid2eid.shape[0],
            logits.stride(0), tid2eid.stride(0), float(scaling),
            E=n_experts, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), SCORING=_SCORE_CODES[scoring],
            NORMALIZE=bool(normalize), BLOCK_T=_TOKENS_PER_PROGRAM, INTERPRETED=INTERPRET)
    return weights, expert_ids
