"""Reference implementations of the ``moe`` family (MoE routing and layout).

Every public function keeps the signature of TileKernels 1.0.0's kernel API
(``tile_kernels.moe.<name>``) and returns what it returns.  Where the
TileKernels wrapper asserts, these raise ``ValueError`` (shapes, values,
layouts) or ``TypeError`` (dtypes) naming the operator and the argument.

Conventions shared by the family:

* ``topk_idx`` rows hold expert indices; ``-1`` marks an unrouted slot.
* "Ties to the smaller index": whenever two candidates (experts or groups)
  have equal scores, the one with the smaller index ranks first; ``-0.0``
  and ``+0.0`` are equal.  Every selection here is a stable descending sort.
* The *fused* (expert-major) layout: routed ``(token, k)`` pairs are packed
  into one buffer of ``num_expanded_tokens`` rows, grouped by expert in
  ascending expert order; expert ``e`` owns rows
  ``[expert_start[e], expert_end[e])``, a block whose length is the number of
  pairs routed to ``e`` rounded up to ``alignment``; its first rows hold the
  pairs, the rest are padding (``pos_to_expert == -1``).

The references are vectorized PyTorch, run on any device and never hard-code
one.  They are the specification the compiled kernels are tested against.
"""

from enum import IntEnum
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = [
    "ScoringFunc",
    "apply_scoring_func",
    "topk_gate",
    "top2_sum_gate",
    "topk_sum_and_topk_group_idx",
    "group_count",
    "aux_fi",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "normalize_weight",
    "get_fused_mapping",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "reduce_fused",
]

# A quantized tensor: ``(data, scale_factors)``, as in TileKernels.
QuantTensor = tuple[torch.Tensor, torch.Tensor]

# Multiplier TileKernels uses to spread tokens over the duplicates of an
# expert (logical -> physical expert map in ``top2_sum_gate``).
_DUPLICATE_HASH_MULTIPLIER = 23333

# Largest finite float8_e4m3fn value; the kernels convert with saturation.
_E4M3_MAX = 448.0


# --------------------------------------------------------------------------
# small private helpers
# --------------------------------------------------------------------------


def _require(cond: bool, op: str, message: str, exc: type = ValueError) -> None:
    if not cond:
        raise exc(f"{op}: {message}")


def _require_dtype(t: torch.Tensor, dtypes, op: str, name: str) -> None:
    if not isinstance(dtypes, (tuple, list)):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {expected}, got {t.dtype}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _descending_stable_order(values: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest entries of each row, largest first,
    equal values in ascending index order (int64, contiguous)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return order[..., :count].contiguous()


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` on float32 tensors with a single rounding, like a GPU FMA.

    ``b`` may broadcast against ``a`` and ``c`` (which share one shape).  The
    product of two float32 numbers is exact in float64, so the float64 sum is
    the exact result rounded once; rounding it again to float32 is already the
    correctly rounded FMA, except when the float64 sum lands exactly halfway
    between two float32 numbers while the exact result does not: there the
    (exactly computed, two-sum) error of the float64 sum decides the direction.
    """
    a64, b64, c64 = a.double(), b.double(), c.double()
    total = torch.addcmul(c64, a64, b64)  # fused or not, the same: a64 * b64 is exact
    result = total.float()

    # Is ``total`` a float32 midpoint?  For |total| >= 2^-126 (float32
    # normal range) its 29 float64 mantissa bits below float32 precision read
    # exactly 1000...0; below that, it is an odd multiple of 2^-150.
    magnitude = total.abs()
    tie = ((total.view(torch.int64) & 0x1FFFFFFF) == 0x10000000) & (magnitude >= 2.0**-126)
    tiny = magnitude < 2.0**-126
    scaled = total[tiny] * 2.0**150  # exact: a power-of-two scaling
    tie[tiny] = (scaled == scaled.trunc()) & (scaled.abs().remainder(2.0) == 1.0)

    where = tie.nonzero(as_tuple=True)
    if where[0].numel() > 0:
        prod = a64.expand_as(total)[where] * b64.expand_as(total)[where]
        addend = c64.expand_as(total)[where]
        tied = total[where]
        # two-sum: err is exactly (prod + addend) - tied
        addend_part = tied - prod
        prod_part = tied - addend_part
        err = (prod - prod_part) + (addend - addend_part)
        rounded = result[where]
        wrong_way = (err != 0) & ((err > 0) == (rounded.double() < tied))
        toward = torch.where(err > 0, float("inf"), float("-inf")).to(rounded.dtype)
        result[where] = torch.where(wrong_way, torch.nextafter(rounded, toward), rounded)
    return result


# --------------------------------------------------------------------------
# scoring functions
# --------------------------------------------------------------------------


class ScoringFunc(IntEnum):
    """Scoring functions of the routing gates (values match TileKernels)."""

    SIGMOID = 0
    SQRTSOFTPLUS = 1
    SOFTMAX = 2
    IDENTITY = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def from_str(cls, label: str) -> "ScoringFunc":
        try:
            return cls[label.upper()]
        except KeyError:
            raise ValueError(f"{label} is not a valid {cls.__name__}") from None


def apply_scoring_func(logits: torch.Tensor, scoring_func: Union[str, ScoringFunc]) -> torch.Tensor:
    """Turn router logits into expert scores.

    Args:
        logits: ``[num_tokens, num_experts]`` float32.
        scoring_func: ``'sigmoid'``, ``'sqrtsoftplus'``, ``'softmax'`` or
            ``'identity'`` (or a :class:`ScoringFunc`).

    Returns:
        float32 tensor of the same shape:

        * sigmoid: ``1 / (1 + exp(-x))``;
        * sqrtsoftplus: ``sqrt(softplus(x))`` with ``softplus(x) = x`` for
          ``x > 20`` and ``log1p(exp(x))`` otherwise;
        * softmax: ``exp(x - max_row) / sum_row(exp(x - max_row))`` over the
          experts of each token;
        * identity: ``x``.
    """
    func = scoring_func if isinstance(scoring_func, ScoringFunc) else ScoringFunc.from_str(scoring_func)
    if func == ScoringFunc.SIGMOID:
        return torch.sigmoid(logits)
    if func == ScoringFunc.SQRTSOFTPLUS:
        return F.softplus(logits, beta=1.0, threshold=20.0).sqrt()
    if func == ScoringFunc.SOFTMAX:
        return torch.softmax(logits, dim=-1)
    return logits.clone()


# --------------------------------------------------------------------------
# gates
# --------------------------------------------------------------------------


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of the ``num_topk`` highest-scoring experts of every token.

    Args:
        scores: ``[num_tokens, num_experts]`` float32, contiguous.  Scores
            must not be NaN, and each row needs at least ``num_topk`` entries
            above ``-inf`` (the kernel repeats an index otherwise).
        num_topk: ``1 <= num_topk <= num_experts``.

    Returns:
        ``[num_tokens, num_topk]`` int64, contiguous: row ``t`` lists expert
        indices by descending ``scores[t]``; equal scores rank the smaller
        index first (``-0.0 == +0.0``).
    """
    op = "topk_gate"
    _require(scores.dim() == 2, op, f"scores must be 2-D [num_tokens, num_experts], got shape {tuple(scores.shape)}")
    _require_dtype(scores, torch.float32, op, "scores")
    _require(scores.is_contiguous(), op, "scores must be contiguous")
    num_experts = scores.shape[1]
    _require(1 <= num_topk <= num_experts, op, f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    return _descending_stable_order(scores, num_topk)


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """Rank expert groups by the sum of their best ``num_topk_sum`` scores.

    Args:
        scores: ``[num_tokens, num_groups, num_experts_per_group]`` float32,
            contiguous, ``num_groups <= 32``.
        num_topk_sum: 1 or 2 (``<= num_experts_per_group``): the group score is
            its largest score, or the sum of its two largest (one float32 add).
        num_topk_groups: ``<= num_groups``.

    Returns:
        ``[num_tokens, num_topk_groups]`` int64: the indices of the best groups
        by descending group score, equal group scores ranking the smaller
        group index first.
    """
    op = "topk_sum_and_topk_group_idx"
    _require(scores.dim() == 3, op, f"scores must be 3-D [num_tokens, num_groups, num_experts_per_group], got shape {tuple(scores.shape)}")
    _require_dtype(scores, torch.float32, op, "scores")
    _require(scores.is_contiguous(), op, "scores must be contiguous")
    _, num_groups, num_experts_per_group = scores.shape
    _require(num_topk_sum in (1, 2), op, f"num_topk_sum must be 1 or 2, got {num_topk_sum}")
    _require(num_topk_sum <= num_experts_per_group, op, f"num_topk_sum ({num_topk_sum}) must be <= num_experts_per_group ({num_experts_per_group})")
    _require(num_groups <= 32, op, f"num_groups must be <= 32, got {num_groups}")
    _require(1 <= num_topk_groups <= num_groups, op, f"num_topk_groups must be in [1, num_groups={num_groups}], got {num_topk_groups}")
    return _group_ranking(scores, num_topk_sum, num_topk_groups)


def _group_ranking(grouped: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    best = torch.topk(grouped, num_topk_sum, dim=-1, sorted=True).values
    group_scores = best[..., 0] if num_topk_sum == 1 else best[..., 0] + best[..., 1]
    return _descending_stable_order(group_scores, num_topk_groups)


def top2_sum_gate(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_topk_groups: int,
    num_groups: int,
    use_shared_as_routed: bool,
    num_shared_experts: int,
    routed_scaling_factor: float,
    ep_rank: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
    scoring_func: str,
    mask: Optional[torch.Tensor] = None,
    fix_routing_mask: Optional[torch.Tensor] = None,
    to_physical_map: Optional[torch.Tensor] = None,
    logical_count: Optional[torch.Tensor] = None,
    unmapped_topk_idx: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style router: score, group-limit, top-k, normalise, place.

    Shapes: ``T = num_tokens``, ``E = num_routed_experts``, ``K = num_topk``,
    ``S = num_shared_experts if use_shared_as_routed else 0``.

    Args:
        logits: ``[T, E]`` float32, contiguous, finite; ``E % 4 == 0``.
        bias: ``[E]`` float32, contiguous (the load-balancing bias).
        num_topk: ``K <= min(E, 32)``.
        num_topk_groups, num_groups: both 0 (no grouping) or
            ``1 <= num_topk_groups <= num_groups <= 32``, ``E % num_groups ==
            0`` and at most 32 experts per group.  Equal values disable the
            group limit.
        use_shared_as_routed, num_shared_experts: when set, ``S`` (1 or 2)
            shared experts, logical indices ``E .. E+S-1``, are appended to
            every token with weight 1.0; needs ``K % S == 0``,
            ``E % (K // S) == 0`` and ``to_physical_map`` with at least ``S``
            extra columns.
        routed_scaling_factor: multiplies the normalised routed weights.
        ep_rank, num_ep_ranks, tp_rank, num_tp_ranks: parallel layout, see
            step 7 below.
        scoring_func: ``'sigmoid'``, ``'sqrtsoftplus'`` or ``'softmax'``.
        mask: optional ``[T]`` bool; ``False`` rows are not routed: their
            outputs are ``-1`` / ``0.0`` and their ``unmapped_topk_idx`` row
            becomes ``-1``.
        fix_routing_mask: optional ``[T]`` bool, contiguous (needs
            ``unmapped_topk_idx``); ``True`` rows reuse the experts already in
            ``unmapped_topk_idx`` instead of selecting.
        to_physical_map: optional ``[E + S, D + 1]`` int32, contiguous:
            logical expert -> its physical replicas (``D`` extra experts).
        logical_count: ``[E + S]`` int32, replicas in use per logical expert
            (given iff ``to_physical_map`` is).
        unmapped_topk_idx: optional ``[T, K]`` int64 with unit inner stride;
            updated in place with the selected logical experts.

    Math, per routed token ``t`` (global row index):

    1. ``s = score(logits[t])`` (:func:`apply_scoring_func`); the ranking key
       is ``s + bias``, except for softmax where it is ``logits[t] + bias``.
    2. Group limit: groups ranked by the sum of their two best keys
       (:func:`topk_sum_and_topk_group_idx`); experts outside the best
       ``num_topk_groups`` groups are excluded.
    3. ``idx`` = the ``K`` best keys, ties to the smaller index (or, for a
       fix-routing row, ``unmapped_topk_idx[t]``).  ``unmapped_topk_idx[t] =
       idx``.
    4. ``w_k = s[idx_k] / (1e-20 + s[idx_0] + ... + s[idx_{K-1}]) *
       routed_scaling_factor``, the denominator accumulated left to right in
       float32.
    5. Shared experts ``E + j`` are appended with weight 1.0.
    6. With ``to_physical_map``: ``idx = to_physical_map[idx, (ep_rank + t *
       23333) % logical_count[idx]]`` (int64 arithmetic).
    7. ``idx = mask_indices_by_tp(idx, E + D, num_ep_ranks, tp_rank,
       num_tp_ranks)``: experts of other TP ranks become ``-1``, the rest are
       renumbered locally.

    Returns:
        ``(topk_idx, topk_weights)``: ``[T, K + S]`` int64 and ``[T, K + S]``
        float32 (routed slots first, in selection order, then shared slots).
    """
    op = "top2_sum_gate"
    _require(logits.dim() == 2, op, f"logits must be 2-D [num_tokens, num_routed_experts], got shape {tuple(logits.shape)}")
    _require_dtype(logits, torch.float32, op, "logits")
    _require(logits.is_contiguous(), op, "logits must be contiguous")
    _require(bias.dim() == 1, op, f"bias must be 1-D, got shape {tuple(bias.shape)}")
    _require_dtype(bias, torch.float32, op, "bias")
    _require(bias.is_contiguous(), op, "bias must be contiguous")
    num_tokens, num_routed_experts = logits.shape
    _require(bias.shape[0] == num_routed_experts, op, f"bias must have {num_routed_experts} entries, got {bias.shape[0]}")
    if mask is not None:
        _require_dtype(mask, torch.bool, op, "mask")
        _require(mask.numel() == num_tokens, op, f"mask must have {num_tokens} entries, got {mask.numel()}")
    _require((to_physical_map is None) == (logical_count is None), op, "to_physical_map and logical_count must be given together")
    _require((num_groups == 0) == (num_topk_groups == 0), op, f"num_groups ({num_groups}) and num_topk_groups ({num_topk_groups}) must be both zero or both non-zero")
    _require(1 <= num_topk <= min(num_routed_experts, 32), op, f"num_topk must be in [1, min(num_routed_experts={num_routed_experts}, 32)], got {num_topk}")
    _require(num_topk_groups <= num_groups, op, f"num_topk_groups ({num_topk_groups}) must be <= num_groups ({num_groups})")
    _require(num_routed_experts % 4 == 0, op, f"num_routed_experts must be a multiple of 4, got {num_routed_experts}")
    if num_groups != 0:
        _require(num_routed_experts % num_groups == 0, op, f"num_routed_experts ({num_routed_experts}) must be divisible by num_groups ({num_groups})")
    grouped = num_groups != num_topk_groups
    if grouped:
        _require(num_groups <= 32, op, f"num_groups must be <= 32, got {num_groups}")
        _require(num_routed_experts <= 32 * num_groups, op, f"at most 32 experts per group, got {num_routed_experts // num_groups}")
        _require(num_topk <= num_topk_groups * (num_routed_experts // num_groups), op, f"num_topk ({num_topk}) must be <= the experts of the {num_topk_groups} selected groups")
    scoring = ScoringFunc.from_str(scoring_func)
    _require(scoring != ScoringFunc.IDENTITY, op, "scoring_func 'identity' is not supported")

    if not use_shared_as_routed:
        num_shared_experts = 0
    else:
        _require(num_shared_experts in (1, 2), op, f"num_shared_experts must be 1 or 2 when use_shared_as_routed, got {num_shared_experts}")
        _require(num_topk % num_shared_experts == 0, op, f"num_topk ({num_topk}) must be divisible by num_shared_experts ({num_shared_experts})")
        _require(num_routed_experts % (num_topk // num_shared_experts) == 0, op, f"num_routed_experts ({num_routed_experts}) must be divisible by num_topk // num_shared_experts ({num_topk // num_shared_experts})")
    num_logical_experts = num_routed_experts + num_shared_experts

    num_extra_experts = 0
    if to_physical_map is not None:
        _require(to_physical_map.dim() == 2, op, f"to_physical_map must be 2-D, got shape {tuple(to_physical_map.shape)}")
        _require_dtype(to_physical_map, torch.int32, op, "to_physical_map")
        _require(to_physical_map.is_contiguous(), op, "to_physical_map must be contiguous")
        _require(to_physical_map.shape[0] == num_logical_experts, op, f"to_physical_map must have {num_logical_experts} rows, got {to_physical_map.shape[0]}")
        _require(logical_count.dim() == 1, op, f"logical_count must be 1-D, got shape {tuple(logical_count.shape)}")
        _require_dtype(logical_count, torch.int32, op, "logical_count")
        _require(logical_count.is_contiguous(), op, "logical_count must be contiguous")
        _require(logical_count.shape[0] == num_logical_experts, op, f"logical_count must have {num_logical_experts} entries, got {logical_count.shape[0]}")
        num_extra_experts = to_physical_map.shape[1] - 1
    _require(num_shared_experts <= num_extra_experts, op, f"num_shared_experts ({num_shared_experts}) needs as many extra experts in to_physical_map (has {num_extra_experts})")
    if unmapped_topk_idx is not None:
        _require(unmapped_topk_idx.dim() == 2, op, "unmapped_topk_idx must be 2-D")
        _require_dtype(unmapped_topk_idx, torch.int64, op, "unmapped_topk_idx")
        _require(tuple(unmapped_topk_idx.shape) == (num_tokens, num_topk), op, f"unmapped_topk_idx must have shape {(num_tokens, num_topk)}, got {tuple(unmapped_topk_idx.shape)}")
        _require(unmapped_topk_idx.stride(1) == 1, op, "unmapped_topk_idx must have unit stride in its last dimension")
    if fix_routing_mask is not None:
        _require(unmapped_topk_idx is not None, op, "fix_routing_mask needs unmapped_topk_idx")
        _require_dtype(fix_routing_mask, torch.bool, op, "fix_routing_mask")
        _require(fix_routing_mask.is_contiguous(), op, "fix_routing_mask must be contiguous")
        _require(fix_routing_mask.dim() == 1 and fix_routing_mask.shape[0] == num_tokens, op, f"fix_routing_mask must have shape ({num_tokens},), got {tuple(fix_routing_mask.shape)}")

    device = logits.device
    num_slots = num_topk + num_shared_experts
    if num_tokens == 0:
        return (torch.empty((0, num_slots), dtype=torch.int64, device=device),
                torch.empty((0, num_slots), dtype=torch.float32, device=device))

    # 1. scores and ranking keys
    scores = apply_scoring_func(logits, scoring)
    keys = (logits if scoring == ScoringFunc.SOFTMAX else scores) + bias

    # 2. group limit: experts outside the selected groups can never win
    if grouped:
        per_group = num_routed_experts // num_groups
        best_groups = _group_ranking(keys.view(num_tokens, num_groups, per_group), 2, num_topk_groups)
        allowed = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=device)
        allowed.scatter_(1, best_groups, True)
        allowed = allowed.repeat_interleave(per_group, dim=1)
        keys = keys.masked_fill(~allowed, float("-inf"))

    # 3. selection (or the fixed routing already stored)
    selected = _descending_stable_order(keys, num_topk)
    if fix_routing_mask is not None:
        selected = torch.where(fix_routing_mask.unsqueeze(1), unmapped_topk_idx, selected)
    routed = mask.reshape(-1) if mask is not None else torch.ones(num_tokens, dtype=torch.bool, device=device)
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(torch.where(routed.unsqueeze(1), selected, -1))

    # 4. weights: selected scores over their sum (left to right from 1e-20)
    picked = scores.gather(1, selected.clamp(min=0))
    denominator = torch.full((num_tokens,), 1e-20, dtype=torch.float32, device=device)
    for k in range(num_topk):
        denominator = denominator + picked[:, k]
    weights = picked / denominator.unsqueeze(1) * routed_scaling_factor

    # 5. shared experts
    if num_shared_experts > 0:
        shared = torch.arange(num_routed_experts, num_logical_experts, dtype=torch.int64, device=device)
        selected = torch.cat([selected, shared.expand(num_tokens, -1)], dim=1)
        weights = torch.cat([weights, torch.ones((num_tokens, num_shared_experts), dtype=torch.float32, device=device)], dim=1)

    # 6. logical -> physical replica, spread by token index
    if to_physical_map is not None:
        logical = selected.clamp(min=0)
        token = torch.arange(num_tokens, dtype=torch.int64, device=device).unsqueeze(1)
        replica = (ep_rank + token * _DUPLICATE_HASH_MULTIPLIER) % logical_count.long()[logical]
        selected = torch.where(selected >= 0, to_physical_map.long()[logical, replica], selected)

    # 7. keep this TP rank's experts, renumbered locally
    topk_idx = mask_indices_by_tp(selected, num_routed_experts + num_extra_experts, num_ep_ranks, tp_rank, num_tp_ranks)

    topk_idx = torch.where(routed.unsqueeze(1), topk_idx, -1).contiguous()
    topk_weights = torch.where(routed.unsqueeze(1), weights, 0.0).contiguous()
    return topk_idx, topk_weights


# --------------------------------------------------------------------------
# counting, masking, normalisation
# --------------------------------------------------------------------------


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """How many entries of ``group_idx`` name each group.

    Args:
        group_idx: ``[num_tokens, num_topk]`` int64, contiguous; entries in
            ``[-1, num_groups)``, ``-1`` not counted.
        num_groups: number of groups (experts).

    Returns:
        ``[num_groups]`` int32: ``out[g] = #{(t, k): group_idx[t, k] == g}``.
    """
    op = "group_count"
    _require(group_idx.dim() == 2, op, f"group_idx must be 2-D [num_tokens, num_topk], got shape {tuple(group_idx.shape)}")
    _require(group_idx.is_contiguous(), op, "group_idx must be contiguous")
    _require_dtype(group_idx, torch.int64, op, "group_idx")
    flat = group_idx.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=num_groups)
    _require(counts.numel() == num_groups, op, f"group_idx entries must be < num_groups ({num_groups})")
    return counts.to(torch.int32)


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """Per-expert load fraction ``f_i`` of the auxiliary balance loss.

    Args:
        topk_idx: ``[num_tokens, num_topk]`` int64, contiguous; entries in
            ``[-1, num_experts)``, ``-1`` not counted.
        num_experts: number of experts ``E``.
        num_aux_topk: the ``K`` of the loss.

    Returns:
        ``[E]`` float32: ``f[e] = float32(count[e] * E) / float32(num_tokens *
        K)`` (one IEEE division; both integers are exact in float32 for
        realistic sizes), 0 for unused experts and for ``num_tokens == 0``.
    """
    op = "aux_fi"
    _require(topk_idx.dim() == 2, op, f"topk_idx must be 2-D [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
    _require(topk_idx.is_contiguous(), op, "topk_idx must be contiguous")
    _require_dtype(topk_idx, torch.int64, op, "topk_idx")
    num_tokens = topk_idx.shape[0]
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    flat = topk_idx.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    _require(counts.numel() == num_experts, op, f"topk_idx entries must be < num_experts ({num_experts})")
    numerator = (counts * num_experts).to(torch.float32)
    # A tensor divisor keeps this a true division on every device (a Python
    # scalar divisor may be turned into a multiplication by its reciprocal).
    denominator = torch.full_like(numerator, float(num_tokens * num_aux_topk))
    return numerator / denominator


def mask_indices_by_tp(indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int) -> torch.Tensor:
    """Keep the experts owned by one TP rank and renumber them locally.

    ``n`` experts are split evenly over ``num_ep_ranks`` ranks
    (``per_gpu = n // num_ep_ranks`` each); rank ``r`` is TP rank
    ``r % num_tp_ranks`` of DP group ``r // num_tp_ranks``.

    Args:
        indices: ``[num_tokens, num_topk]`` integer tensor (int64 or int32),
            ``-1`` (any negative) for no expert.
        n, num_ep_ranks, tp_rank, num_tp_ranks: as above.

    Returns:
        Same shape and dtype: ``-1`` where the input is negative or its rank
        ``i // per_gpu`` is not TP rank ``tp_rank``; otherwise, with ``v = i -
        tp_rank * per_gpu``, ``v - (v // (per_gpu * num_tp_ranks)) * (per_gpu *
        (num_tp_ranks - 1))`` (so DP group ``d``'s experts of this TP rank map
        to ``[d * per_gpu, (d + 1) * per_gpu)``).
    """
    per_gpu = n // num_ep_ranks
    per_dp = per_gpu * num_tp_ranks
    valid = indices >= 0
    safe = torch.where(valid, indices, 0)
    on_rank = ((safe // per_gpu) % num_tp_ranks) == tp_rank
    local = safe - tp_rank * per_gpu
    local = local - (local // per_dp) * (per_dp - per_gpu)
    keep = valid & on_rank & (local >= 0)
    return torch.where(keep, local, torch.full_like(indices, -1))


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """Replace repeated group indices of a row by ``-1``, in place.

    Args:
        group_indices: ``[num_tokens, num_topk]`` int64; entries ``< 0`` are
            left alone, others must be ``< align(num_groups, 64)``.
        num_groups: ``<= 128``.

    Effect: for every row, an entry equal to a non-negative entry to its left
    becomes ``-1`` (the leftmost occurrence is kept).  Returns ``None``, like
    TileKernels.
    """
    op = "inplace_unique_group_indices"
    _require(group_indices.dim() == 2, op, f"group_indices must be 2-D [num_tokens, num_topk], got shape {tuple(group_indices.shape)}")
    _require_dtype(group_indices, torch.int64, op, "group_indices")
    _require(num_groups <= 128, op, f"num_groups must be <= 128, got {num_groups}")
    num_topk = group_indices.shape[1]
    same = group_indices.unsqueeze(2) == group_indices.unsqueeze(1)  # [t, k, j]
    earlier = torch.ones((num_topk, num_topk), dtype=torch.bool, device=group_indices.device).tril(diagonal=-1)
    repeated = (same & earlier).any(dim=2) & (group_indices >= 0)
    group_indices.masked_fill_(repeated, -1)
    return None


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise each token's top-k weights to sum to one.

    Args:
        topk_weights: ``[num_tokens, num_topk]`` float32, contiguous.

    Returns:
        ``(denominator, normalized_weights)``: ``[num_tokens]`` float32 with
        ``d = 1e-20 + w_0 + w_1 + ... + w_{K-1}`` accumulated left to right in
        float32, and ``[num_tokens, num_topk]`` float32 ``w_k / d``.
    """
    op = "normalize_weight"
    _require(topk_weights.dim() == 2, op, f"topk_weights must be 2-D [num_tokens, num_topk], got shape {tuple(topk_weights.shape)}")
    _require_dtype(topk_weights, torch.float32, op, "topk_weights")
    _require(topk_weights.is_contiguous(), op, "topk_weights must be contiguous")
    num_tokens, num_topk = topk_weights.shape
    denominator = torch.full((num_tokens,), 1e-20, dtype=torch.float32, device=topk_weights.device)
    for k in range(num_topk):
        denominator = denominator + topk_weights[:, k]
    return denominator, topk_weights / denominator.unsqueeze(1)


# --------------------------------------------------------------------------
# fused (expert-major) layout
# --------------------------------------------------------------------------


def get_fused_mapping(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Place every routed ``(token, k)`` pair in the expert-major fused layout.

    Let ``c[e]`` be the number of entries of ``topk_idx`` equal to ``e`` and
    ``a[e] = ceil(c[e] / alignment) * alignment``.  Expert ``e`` owns rows
    ``[start[e], start[e] + a[e])`` with ``start`` the exclusive prefix sum of
    ``a``; its pairs fill the first ``c[e]`` rows, the rest is padding.  Within
    an expert this reference orders pairs by flat index ``t * num_topk + k``
    (the kernel's order within an expert depends on the SM count and is not
    part of the contract; everything else is).

    Args:
        topk_idx: ``[num_tokens, num_topk]`` int64, contiguous; entries in
            ``[0, num_experts)`` or ``-1`` (unrouted; any negative is treated
            so here).
        num_experts: number of experts.
        num_expanded_tokens: rows of the fused buffer, at least ``sum(a)``
            (rows past ``sum(a)`` are padding).  ``0`` with ``force_no_sync``
            False means "exactly ``sum(a)``", learnt with a host sync.
        alignment: per-expert block alignment (>= 1).
        force_no_sync: keep ``num_expanded_tokens == 0`` literally.

    Returns:
        ``(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
        expert_start, expert_end, num_tokens_per_expert,
        num_tokens_per_expert_list)``: the first three ``[num_expanded_tokens]``
        int32 (expert, token ``t``, flat index ``t * num_topk + k`` of each
        row, ``-1`` on padding rows); ``[num_tokens, num_topk]`` int32 (row of
        each pair, ``-1`` where unrouted); ``[num_experts]`` int32 ``start``,
        ``start + a`` and ``a`` (aligned counts); and ``a`` as a Python list
        when it was synced (``num_expanded_tokens == 0`` and not
        ``force_no_sync``), else ``[]``.
    """
    op = "get_fused_mapping"
    _require(topk_idx.dim() == 2, op, f"topk_idx must be 2-D [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
    _require_dtype(topk_idx, torch.int64, op, "topk_idx")
    _require(topk_idx.is_contiguous(), op, "topk_idx must be contiguous")
    _require(alignment >= 1, op, f"alignment must be >= 1, got {alignment}")
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device

    flat = topk_idx.reshape(-1)
    routed = flat >= 0
    _require(num_tokens * num_topk == 0 or int(flat.max()) < num_experts, op, f"topk_idx entries must be < num_experts ({num_experts})")
    counts = torch.bincount(flat[routed], minlength=num_experts)
    aligned = (counts + alignment - 1) // alignment * alignment
    end = torch.cumsum(aligned, dim=0)
    start = end - aligned
    count_start = torch.cumsum(counts, dim=0) - counts

    should_sync = num_expanded_tokens == 0 and not force_no_sync
    aligned_list: list[int] = []
    if should_sync:
        aligned_list = aligned.tolist()
        num_expanded_tokens = sum(aligned_list)
    total = int(end[-1]) if num_experts > 0 else 0
    _require(total <= num_expanded_tokens, op, f"num_expanded_tokens ({num_expanded_tokens}) is smaller than the fused layout needs ({total})")

    # Sort pairs by expert (unrouted last), keeping flat order within an expert.
    key = torch.where(routed, flat, num_experts)
    order = torch.sort(key, stable=True).indices
    num_routed = int(routed.sum())
    pair = order[:num_routed]
    expert = flat[pair]
    rank_in_expert = torch.arange(num_routed, device=device) - count_start[expert]
    pos = start[expert] + rank_in_expert

    pos_to_expert = torch.full((num_expanded_tokens,), -1, dtype=torch.int32, device=device)
    pos_to_token = torch.full((num_expanded_tokens,), -1, dtype=torch.int32, device=device)
    pos_to_token_topk = torch.full((num_expanded_tokens,), -1, dtype=torch.int32, device=device)
    pos_to_expert[pos] = expert.to(torch.int32)
    pos_to_token[pos] = (pair // num_topk).to(torch.int32)
    pos_to_token_topk[pos] = pair.to(torch.int32)
    token_topk_to_pos = torch.full((num_tokens * num_topk,), -1, dtype=torch.int32, device=device)
    token_topk_to_pos[pair] = pos.to(torch.int32)

    return (
        pos_to_expert,
        pos_to_token,
        pos_to_token_topk,
        token_topk_to_pos.view(num_tokens, num_topk),
        start.to(torch.int32),
        end.to(torch.int32),
        aligned.to(torch.int32),
        aligned_list,
    )


def _check_fused_positions(op: str, num_tokens: int, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> None:
    _require(token_topk_to_pos.dim() == 2, op, f"token_topk_to_pos must be 2-D [num_tokens, num_topk], got shape {tuple(token_topk_to_pos.shape)}")
    _require(token_topk_to_pos.is_contiguous(), op, "token_topk_to_pos must be contiguous")
    _require(token_topk_to_pos.shape[0] == num_tokens, op, f"token_topk_to_pos must have {num_tokens} rows (one per token), got {token_topk_to_pos.shape[0]}")
    _require(pos_to_expert.dim() == 1, op, f"pos_to_expert must be 1-D, got shape {tuple(pos_to_expert.shape)}")


def _scatter_rows(out: torch.Tensor, src: torch.Tensor, token_topk_to_pos: torch.Tensor) -> None:
    """``out[token_topk_to_pos[t, k]] = src[t]`` for every routed pair."""
    num_topk = token_topk_to_pos.shape[1]
    pos = token_topk_to_pos.reshape(-1).long()
    routed = pos >= 0
    token = torch.arange(pos.numel(), device=pos.device) // num_topk
    out[pos[routed]] = src[token[routed]]


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Copy each token's row to every fused row it is routed to.

    Args:
        x: ``[num_tokens, hidden]``, contiguous, any dtype (bf16 / fp8 / fp32).
        token_topk_to_pos: ``[num_tokens, num_topk]`` int32 from
            :func:`get_fused_mapping` (``-1`` = unrouted).
        pos_to_expert: ``[num_expanded_tokens]`` int32; rows with ``-1`` are
            padding.

    Returns:
        ``[num_expanded_tokens, hidden]`` of ``x.dtype``, contiguous:
        ``out[token_topk_to_pos[t, k]] = x[t]``, padding rows zero (bitwise
        copies, no conversion).  The mapping must be consistent (every row
        whose ``pos_to_expert >= 0`` is the target of exactly one pair, no
        pair targets a padding row): the kernel leaves unreferenced non-padding
        rows unwritten.
    """
    op = "expand_to_fused"
    _require(x.dim() == 2, op, f"x must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    _require(x.is_contiguous(), op, "x must be contiguous")
    _check_fused_positions(op, x.shape[0], token_topk_to_pos, pos_to_expert)
    out = torch.zeros((pos_to_expert.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _scatter_rows(out, x, token_topk_to_pos)
    return out


def expand_to_fused_with_sf(
    x: QuantTensor,
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expand_to_fused` for a quantized tensor and its scale factors.

    Args:
        x: ``(data, sf)``: ``data`` ``[num_tokens, hidden]`` contiguous (any
            dtype, normally float8_e4m3fn); ``sf`` ``[num_tokens, hidden_sf]``
            contiguous (row-major), either float32 with ``hidden_sf =
            ceil(hidden / num_per_channels)`` or int32 packed UE8M0 (four
            exponents per int32) with ``hidden_sf = ceil(ceil(hidden /
            num_per_channels) / 4)``, which requires
            ``use_tma_aligned_col_major_sf``.
        num_per_channels: 32 or 128 (channels per scale factor).
        token_topk_to_pos, pos_to_expert: as in :func:`expand_to_fused`.
        use_tma_aligned_col_major_sf: lay the output scale factors out
            column-major with the token dimension padded to a multiple of 4.

    Returns:
        ``(out, out_sf)``: ``out`` as :func:`expand_to_fused`; ``out_sf``
        ``[num_expanded_tokens, hidden_sf]`` of ``sf.dtype`` with
        ``out_sf[token_topk_to_pos[t, k]] = sf[t]`` and zero on padding rows;
        strides ``(hidden_sf, 1)``, or with ``use_tma_aligned_col_major_sf``
        ``(1, align(num_expanded_tokens, 4))`` (a transposed view of a
        ``[hidden_sf, align(num_expanded_tokens, 4)]`` buffer whose extra
        columns are zero here and unspecified in the kernel).
    """
    op = "expand_to_fused_with_sf"
    data, sf = x
    _require(data.dim() == 2, op, f"x data must be 2-D [num_tokens, hidden], got shape {tuple(data.shape)}")
    _require(data.is_contiguous(), op, "x data must be contiguous")
    _require(sf.dim() == 2, op, f"x sf must be 2-D [num_tokens, hidden_sf], got shape {tuple(sf.shape)}")
    _require(sf.is_contiguous(), op, "x sf must be contiguous (row-major)")
    _require_dtype(sf, (torch.float32, torch.int32), op, "x sf")
    _require(num_per_channels in (32, 128), op, f"num_per_channels must be 32 or 128, got {num_per_channels}")
    _require(pos_to_expert.is_contiguous(), op, "pos_to_expert must be contiguous")
    num_tokens, hidden = data.shape
    _check_fused_positions(op, num_tokens, token_topk_to_pos, pos_to_expert)
    _require(sf.shape[0] == num_tokens, op, f"x sf must have {num_tokens} rows, got {sf.shape[0]}")
    hidden_sf = _ceil_div(hidden, num_per_channels)
    if sf.dtype == torch.int32:
        _require(use_tma_aligned_col_major_sf, op, "packed UE8M0 (int32) scale factors need use_tma_aligned_col_major_sf=True")
        hidden_sf = _ceil_div(hidden_sf, 4)
    _require(sf.shape[1] == hidden_sf, op, f"x sf must have {hidden_sf} columns for hidden={hidden}, num_per_channels={num_per_channels}, got {sf.shape[1]}")

    num_expanded_tokens = pos_to_expert.shape[0]
    out = expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    if use_tma_aligned_col_major_sf:
        buffer = torch.zeros((hidden_sf, _round_up(num_expanded_tokens, 4)), dtype=sf.dtype, device=sf.device)
        out_sf = buffer[:, :num_expanded_tokens].T
    else:
        out_sf = torch.zeros((num_expanded_tokens, hidden_sf), dtype=sf.dtype, device=sf.device)
    _scatter_rows(out_sf, sf, token_topk_to_pos)
    return out, out_sf


def reduce_fused(
    x: Union[torch.Tensor, QuantTensor],
    topk_weights: Optional[torch.Tensor],
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weighted sum of each token's fused rows back into token order.

    Args:
        x: ``[num_expanded_tokens, hidden]`` (float32 or bfloat16),
            ``hidden % 256 == 0``; or ``(x, x_sf)`` with ``x_sf``
            ``[num_expanded_tokens]`` float32 per-row scales.
        topk_weights: optional ``[num_tokens, num_topk]`` float32.
        token_topk_to_pos: ``[num_tokens, num_topk]`` int32 (``-1`` =
            unrouted).
        fp8_format: ``''`` (output in ``x.dtype``) or ``'e4m3'``
            (float8_e4m3fn output, saturating to +-448).
        sf: optional ``[1]`` float32 output scale, only with ``'e4m3'``.
        out: optional ``[num_tokens, hidden]`` output to write into.

    Math, in float32 per token ``t``: ``acc = 0``; for ``k = 0 .. num_topk-1``
    with ``p = token_topk_to_pos[t, k] >= 0``: ``s = topk_weights[t, k]`` (1
    without weights), ``s = s * x_sf[p]`` (with ``x_sf``), then ``acc =
    fma(float32(x[p]), s, acc)`` (one rounding, as on the GPU).  Finally
    ``acc = acc * sf[0]`` (with ``sf``) and ``acc`` is rounded to the output
    dtype (round to nearest even).

    Returns:
        ``[num_tokens, hidden]`` (``out`` when given).
    """
    op = "reduce_fused"
    if isinstance(x, (tuple, list)):
        x, x_sf = x
    else:
        x_sf = None
    _require(x.dim() == 2, op, f"x must be 2-D [num_expanded_tokens, hidden], got shape {tuple(x.shape)}")
    _require(token_topk_to_pos.dim() == 2, op, f"token_topk_to_pos must be 2-D [num_tokens, num_topk], got shape {tuple(token_topk_to_pos.shape)}")
    num_expanded_tokens, hidden = x.shape
    num_tokens, num_topk = token_topk_to_pos.shape
    _require(hidden % 256 == 0, op, f"hidden must be a multiple of 256, got {hidden}")
    if fp8_format == "":
        out_dtype = x.dtype
        _require(sf is None, op, "sf is only supported with fp8 output (fp8_format='e4m3')")
    else:
        _require(fp8_format == "e4m3", op, f"fp8_format must be '' or 'e4m3', got {fp8_format!r}")
        out_dtype = torch.float8_e4m3fn
    if topk_weights is not None:
        _require(tuple(topk_weights.shape) == (num_tokens, num_topk), op, f"topk_weights must have shape {(num_tokens, num_topk)}, got {tuple(topk_weights.shape)}")
        _require_dtype(topk_weights, torch.float32, op, "topk_weights")
    if x_sf is not None:
        _require_dtype(x_sf, torch.float32, op, "x_sf")
        _require(x_sf.shape[0] == num_expanded_tokens, op, f"x_sf must have {num_expanded_tokens} entries, got {x_sf.shape[0]}")
    if out is not None:
        _require(tuple(out.shape) == (num_tokens, hidden), op, f"out must have shape {(num_tokens, hidden)}, got {tuple(out.shape)}")

    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    for k in range(num_topk):
        pos = token_topk_to_pos[:, k].long()
        routed = pos >= 0
        safe_pos = pos.clamp(min=0)
        scale = topk_weights[:, k] if topk_weights is not None else torch.ones(num_tokens, dtype=torch.float32, device=x.device)
        if x_sf is not None:
            scale = scale * x_sf[safe_pos]
        rows = x[safe_pos].float()
        acc = torch.where(routed.unsqueeze(1), _fma_f32(rows, scale.unsqueeze(1), acc), acc)
    if sf is not None:
        acc = acc * sf.reshape(-1)[:1]
    if out_dtype == torch.float8_e4m3fn:
        acc = acc.clamp(-_E4M3_MAX, _E4M3_MAX)
    result = acc.to(out_dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
