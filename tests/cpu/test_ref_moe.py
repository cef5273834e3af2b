"""Defining properties of the moe references (no TileKernels needed).

Each reference is checked against a slow, obviously-correct per-element
Python definition written here (float32 arithmetic done on Python floats and
rounded with ``struct``: for one +, -, * or / of two float32 numbers the
double result rounds to the correct float32), and ``get_fused_mapping``,
which has no upstream reference, against the properties of its layout.
Inputs are seeded random data with plenty of ties, unrouted slots (-1) and
raw bit patterns where values are only moved.
"""

import struct
import zlib
from collections import Counter
from fractions import Fraction

import pytest
import torch

from tile_kernels_aot.torch import moe
from tile_kernels_aot.torch.moe import _fma_f32

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def f32_exact(v: Fraction) -> float:
    """Round an exact rational to the nearest float32 (ties to even)."""
    if v == 0:
        return 0.0
    sign, v = (-1 if v < 0 else 1), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    quantum = Fraction(2) ** max(e - 23, -149)
    return sign * float(round(v / quantum) * quantum)  # round() on Fraction: ties to even


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _random_routing(num_tokens, num_topk, num_experts, gen, unrouted=0.25):
    """Distinct experts per row, some slots -1."""
    idx = torch.rand((num_tokens, num_experts), generator=gen).argsort(dim=1)[:, :num_topk].contiguous()
    idx[torch.rand(idx.shape, generator=gen) < unrouted] = -1
    return idx


def _ranked(values, candidates, count):
    """The ``count`` best candidates: descending value, ties to smaller index."""
    return sorted(candidates, key=lambda i: (-values[i], i))[:count]


# --------------------------------------------------------------------------
# topk_gate
# --------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,num_topk", [(16, 6), (72, 6), (256, 8), (9, 9), (32, 1)])
def test_topk_gate_definition(num_experts, num_topk):
    gen = _gen("topk_gate", num_experts, num_topk)
    scores = torch.randn((48, num_experts), generator=gen)
    # a third of the rows: few distinct values with both signed zeros
    ties = torch.randint(-2, 3, (16, num_experts), generator=gen).float()
    ties[(ties == 0) & (torch.rand(ties.shape, generator=gen) < 0.5)] = -0.0
    scores[::3] = ties
    out = moe.topk_gate(scores, num_topk)
    assert out.dtype == torch.int64 and out.shape == (48, num_topk) and out.is_contiguous()
    for t, row in enumerate(scores.tolist()):
        assert out[t].tolist() == _ranked(row, range(num_experts), num_topk)


def test_topk_gate_empty_and_errors():
    assert moe.topk_gate(torch.empty((0, 64)), 4).shape == (0, 4)
    scores = torch.randn(8, 64)
    with pytest.raises(TypeError):
        moe.topk_gate(scores.double(), 4)
    with pytest.raises(ValueError):
        moe.topk_gate(scores, 65)
    with pytest.raises(ValueError):
        moe.topk_gate(scores, 0)
    with pytest.raises(ValueError):
        moe.topk_gate(scores[:, ::2], 4)
    with pytest.raises(ValueError):
        moe.topk_gate(scores.view(2, 4, 64), 4)


# --------------------------------------------------------------------------
# topk_sum_and_topk_group_idx, scoring, top2_sum_gate
# --------------------------------------------------------------------------


def _group_score(values, num_topk_sum):
    best = sorted(values, reverse=True)
    return best[0] if num_topk_sum == 1 else f32(best[0] + best[1])


@pytest.mark.parametrize("num_groups,per_group", [(4, 18), (8, 32), (12, 6), (16, 16)])
@pytest.mark.parametrize("num_topk_sum", [1, 2])
def test_topk_sum_and_topk_group_idx_definition(num_groups, per_group, num_topk_sum):
    gen = _gen("group", num_groups, per_group, num_topk_sum)
    scores = torch.randn((40, num_groups, per_group), generator=gen)
    scores[::2] = torch.randint(0, 3, (20, num_groups, per_group), generator=gen).float()  # group ties
    for num_topk_groups in (1, 2, 4):
        out = moe.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups)
        assert out.dtype == torch.int64 and out.shape == (40, num_topk_groups)
        for t in range(40):
            group_scores = [_group_score(g, num_topk_sum) for g in scores[t].tolist()]
            assert out[t].tolist() == _ranked(group_scores, range(num_groups), num_topk_groups)


def test_topk_sum_and_topk_group_idx_errors():
    scores = torch.randn(4, 8, 4)
    for bad in [dict(num_topk_sum=3, num_topk_groups=2), dict(num_topk_sum=2, num_topk_groups=9)]:
        with pytest.raises(ValueError):
            moe.topk_sum_and_topk_group_idx(scores, **bad)
    with pytest.raises(ValueError):
        moe.topk_sum_and_topk_group_idx(torch.randn(4, 33, 2), 1, 2)
    with pytest.raises(TypeError):
        moe.topk_sum_and_topk_group_idx(scores.half(), 1, 2)


def test_apply_scoring_func_formulas():
    x = torch.randn((16, 64), generator=_gen("scoring")) * 8
    x[0, :8] = torch.tensor([19.5, 20.0, 20.5, 25.0, -30.0, 0.0, 1e-3, -1e-3])
    x64 = x.double()
    expected = {
        "sigmoid": 1 / (1 + torch.exp(-x64)),
        "sqrtsoftplus": torch.where(x64 > 20, x64, torch.log1p(torch.exp(x64))).sqrt(),
        "softmax": torch.exp(x64 - x64.amax(1, keepdim=True)) / torch.exp(x64 - x64.amax(1, keepdim=True)).sum(1, keepdim=True),
        "identity": x64,
    }
    for name, want in expected.items():
        got = moe.apply_scoring_func(x, name)
        assert got.dtype == torch.float32
        # float32 transcendental functions: a few ulps; softmax also inherits the
        # rounding of x - max (relative error ~ |x - max| * 2^-24 after exp)
        rtol = 1e-5 if name == "softmax" else 1e-6
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-30)
        assert torch.equal(got, moe.apply_scoring_func(x, moe.ScoringFunc.from_str(name)))
    assert [str(m) for m in moe.ScoringFunc] == ["sigmoid", "sqrtsoftplus", "softmax", "identity"]
    assert [m.value for m in moe.ScoringFunc] == [0, 1, 2, 3]


def _slow_top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared, num_shared,
                        scaling, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func,
                        mask, fix_routing_mask, to_physical_map, logical_count, unmapped):
    """Per-token definition (see the docstring of moe.top2_sum_gate)."""
    num_tokens, num_experts = logits.shape
    num_shared = num_shared if use_shared else 0
    num_extra = to_physical_map.shape[1] - 1 if to_physical_map is not None else 0
    scores = moe.apply_scoring_func(logits, scoring_func).tolist()  # elementwise, tested above
    key_base = logits.tolist() if scoring_func == "softmax" else scores
    bias_l = bias.tolist()
    per_rank = (num_experts + num_extra) // num_ep_ranks
    idx_out = [[-1] * (num_topk + num_shared) for _ in range(num_tokens)]
    w_out = [[0.0] * (num_topk + num_shared) for _ in range(num_tokens)]
    unmapped_out = unmapped.tolist() if unmapped is not None else None
    for t in range(num_tokens):
        if mask is not None and not mask[t]:
            if unmapped_out is not None:
                unmapped_out[t] = [-1] * num_topk
            continue
        if fix_routing_mask is not None and fix_routing_mask[t]:
            chosen = unmapped[t].tolist()
        else:
            keys = [f32(k + b) for k, b in zip(key_base[t], bias_l)]
            candidates = range(num_experts)
            if num_groups != num_topk_groups:
                per_group = num_experts // num_groups
                group_scores = [_group_score(keys[g * per_group:(g + 1) * per_group], 2) for g in range(num_groups)]
                best = set(_ranked(group_scores, range(num_groups), num_topk_groups))
                candidates = [e for e in range(num_experts) if e // per_group in best]
            chosen = _ranked(keys, candidates, num_topk)
        if unmapped_out is not None:
            unmapped_out[t] = list(chosen)
        picked = [scores[t][e] for e in chosen]
        denominator = f32(1e-20)
        for p in picked:
            denominator = f32(denominator + p)
        weights = [f32(f32(p / denominator) * f32(scaling)) for p in picked] + [1.0] * num_shared
        logical = list(chosen) + [num_experts + j for j in range(num_shared)]
        for slot, expert in enumerate(logical):
            if to_physical_map is not None:
                replica = (ep_rank + t * 23333) % int(logical_count[expert])
                expert = int(to_physical_map[expert, replica])
            rank = expert // per_rank
            if rank % num_tp_ranks != tp_rank:
                expert = -1
            else:
                expert = (rank // num_tp_ranks) * per_rank + expert % per_rank
            idx_out[t][slot] = expert
            w_out[t][slot] = weights[slot]
    return torch.tensor(idx_out, dtype=torch.int64), torch.tensor(w_out, dtype=torch.float32), unmapped_out


# (num_groups, num_topk_groups, num_routed_experts, num_shared_experts, num_topk)
TOP2_CASES = [
    (0, 0, 72, 1, 6, "sigmoid", False),
    (0, 0, 36, 2, 6, "sqrtsoftplus", True),
    (8, 8, 256, 2, 8, "softmax", True),
    (8, 4, 256, 2, 8, "sigmoid", True),
    (8, 4, 256, 1, 8, "softmax", False),
    (4, 2, 64, 2, 4, "sqrtsoftplus", True),
]


@pytest.mark.parametrize("case", TOP2_CASES, ids=lambda c: "-".join(map(str, c)))
def test_top2_sum_gate_definition(case):
    num_groups, num_topk_groups, num_routed, num_shared, num_topk, scoring_func, use_shared = case
    gen = _gen("top2", case)
    num_tokens, num_extra = 40, 8
    num_ep_ranks, num_tp_ranks = 4, 2
    for variant in range(4):
        logits = torch.randn((num_tokens, num_routed), generator=gen)
        if variant == 1:
            logits = torch.randint(-2, 3, logits.shape, generator=gen).float()  # score ties
        bias = torch.randn(num_routed, generator=gen) * 0.1
        mask = torch.rand(num_tokens, generator=gen) < 0.8 if variant >= 2 else None
        fix = torch.rand(num_tokens, generator=gen) < 0.5 if variant == 3 else None
        unmapped = torch.randint(0, num_routed, (num_tokens, num_topk), generator=gen)
        to_physical_map = logical_count = None
        if use_shared or variant == 2:
            to_physical_map = torch.randint(0, num_routed + num_extra, (num_routed + (num_shared if use_shared else 0), num_extra + 1), generator=gen, dtype=torch.int32)
            logical_count = torch.randint(1, num_extra + 2, (to_physical_map.shape[0],), generator=gen, dtype=torch.int32)
        tp_rank, ep_rank = variant % 2, variant
        args = (logits, bias, num_topk, num_topk_groups, num_groups, use_shared, num_shared, 1.5,
                ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func)
        unmapped_in = unmapped.clone()
        idx, weights = moe.top2_sum_gate(*args, mask=mask, fix_routing_mask=fix, to_physical_map=to_physical_map,
                                         logical_count=logical_count, unmapped_topk_idx=unmapped)
        want_idx, want_w, want_unmapped = _slow_top2_sum_gate(*args, mask, fix, to_physical_map, logical_count, unmapped_in)
        assert idx.dtype == torch.int64 and weights.dtype == torch.float32
        assert idx.is_contiguous() and weights.is_contiguous()
        assert torch.equal(idx, want_idx)
        assert torch.equal(_bits(weights), _bits(want_w))
        assert unmapped.tolist() == want_unmapped  # updated in place


def test_top2_sum_gate_shapes_and_errors():
    logits, bias = torch.randn(5, 64), torch.randn(64)
    base = (logits, bias, 6, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")
    idx, w = moe.top2_sum_gate(*base)
    assert idx.shape == w.shape == (5, 6) and (idx >= 0).all()
    assert torch.allclose(w.sum(1), torch.ones(5))
    idx, w = moe.top2_sum_gate(torch.empty(0, 64), *base[1:])
    assert idx.shape == (0, 6) and w.shape == (0, 6)

    def call(*changes, **kwargs):
        args = list(base)
        for pos, value in changes:
            args[pos] = value
        return moe.top2_sum_gate(*args, **kwargs)

    with pytest.raises(ValueError):
        call((12, "identity"))
    with pytest.raises(ValueError):
        call((3, 2))  # num_topk_groups without num_groups
    with pytest.raises(ValueError):
        call(fix_routing_mask=torch.ones(5, dtype=torch.bool))  # needs unmapped_topk_idx
    with pytest.raises(ValueError):
        call((5, True), (6, 2))  # shared experts need extra replicas
    with pytest.raises(TypeError):
        call((0, logits.double()))
    with pytest.raises(ValueError):
        call(unmapped_topk_idx=torch.zeros(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError):  # 6 experts wanted from 1 group of 4
        call((3, 1), (4, 16))


# --------------------------------------------------------------------------
# counting, masking, normalisation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,num_topk", [(9, 2), (32, 6), (256, 8), (72, 9)])
def test_group_count_and_aux_fi_definition(num_experts, num_topk):
    gen = _gen("count", num_experts, num_topk)
    topk_idx = _random_routing(301, num_topk, num_experts, gen)
    topk_idx[3] = -1
    counts = Counter(v for v in topk_idx.flatten().tolist() if v >= 0)
    out = moe.group_count(topk_idx, num_experts)
    assert out.dtype == torch.int32 and out.tolist() == [counts[e] for e in range(num_experts)]
    for num_aux_topk in (1, num_topk):
        fi = moe.aux_fi(topk_idx, num_experts, num_aux_topk)
        want = [f32(f32(counts[e] * num_experts) / f32(301 * num_aux_topk)) for e in range(num_experts)]
        assert fi.dtype == torch.float32 and fi.tolist() == want
    with pytest.raises(ValueError):
        moe.group_count(topk_idx, num_experts - 1)
    with pytest.raises(ValueError):
        moe.aux_fi(topk_idx, num_experts - 1, num_topk)
    empty = torch.empty((0, num_topk), dtype=torch.int64)
    assert moe.group_count(empty, num_experts).tolist() == [0] * num_experts
    assert moe.aux_fi(empty, num_experts, num_topk).tolist() == [0.0] * num_experts


@pytest.mark.parametrize("per_gpu,num_ep_ranks,num_tp_ranks", [(9, 8, 2), (4, 64, 8), (32, 8, 4), (5, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_mask_indices_by_tp_definition(per_gpu, num_ep_ranks, num_tp_ranks, dtype):
    n = per_gpu * num_ep_ranks
    gen = _gen("tp", per_gpu, num_ep_ranks, num_tp_ranks)
    indices = torch.randint(-1, n, (97, 7), generator=gen).to(dtype)
    for tp_rank in range(num_tp_ranks):
        out = moe.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
        assert out.dtype == dtype and out.shape == indices.shape
        for got, i in zip(out.flatten().tolist(), indices.flatten().tolist()):
            rank, offset = divmod(i, per_gpu)
            if i < 0 or rank % num_tp_ranks != tp_rank:
                assert got == -1
            else:  # DP group rank // T, local slot offset
                assert got == (rank // num_tp_ranks) * per_gpu + offset


@pytest.mark.parametrize("num_groups,num_topk", [(8, 6), (16, 9), (72, 8), (128, 4)])
def test_inplace_unique_group_indices_definition(num_groups, num_topk):
    gen = _gen("unique", num_groups, num_topk)
    group_indices = torch.randint(-1, min(num_groups, 10), (200, num_topk), generator=gen)
    before = group_indices.tolist()
    data_ptr = group_indices.data_ptr()
    assert moe.inplace_unique_group_indices(group_indices, num_groups) is None
    assert group_indices.data_ptr() == data_ptr
    for row_before, row_after in zip(before, group_indices.tolist()):
        seen, want = set(), []
        for g in row_before:
            want.append(-1 if g >= 0 and g in seen else g)
            seen.add(g)
        assert row_after == want
    with pytest.raises(ValueError):
        moe.inplace_unique_group_indices(group_indices, 129)
    with pytest.raises(TypeError):
        moe.inplace_unique_group_indices(group_indices.int(), num_groups)


@pytest.mark.parametrize("num_topk", [1, 2, 6, 9])
def test_normalize_weight_definition(num_topk):
    weights = torch.rand((64, num_topk), generator=_gen("norm", num_topk))
    weights[0] = 0.0  # the 1e-20 keeps this row finite
    denominator, normalized = moe.normalize_weight(weights)
    for t, row in enumerate(weights.tolist()):
        d = f32(1e-20)
        for w in row:
            d = f32(d + w)
        assert denominator[t].item() == d
        assert normalized[t].tolist() == [f32(w / d) for w in row]


# --------------------------------------------------------------------------
# get_fused_mapping: the layout's properties
# --------------------------------------------------------------------------


def _check_mapping(topk_idx, num_experts, alignment, result, num_expanded_tokens=None):
    (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
     expert_start, expert_end, num_tokens_per_expert, count_list) = result
    num_tokens, num_topk = topk_idx.shape
    for t in result[:7]:
        assert t.dtype == torch.int32
    counts = Counter(v for v in topk_idx.flatten().tolist() if v >= 0)
    aligned = [-(-counts[e] // alignment) * alignment for e in range(num_experts)]
    starts = [sum(aligned[:e]) for e in range(num_experts)]
    total = sum(aligned)
    # counts, alignment and ranges add up
    assert num_tokens_per_expert.tolist() == aligned
    assert expert_start.tolist() == starts
    assert expert_end.tolist() == [s + a for s, a in zip(starts, aligned)]
    assert all(s % alignment == 0 for s in starts)
    size = total if num_expanded_tokens is None else num_expanded_tokens
    assert pos_to_expert.shape == pos_to_token.shape == pos_to_token_topk.shape == (size,)
    assert token_topk_to_pos.shape == (num_tokens, num_topk) and token_topk_to_pos.is_contiguous()
    # every routed (token, k) has exactly one row, inside its expert's range,
    # and the rows point back at it; unrouted pairs have none
    rows_used = {}
    p2e, p2t, p2tk = pos_to_expert.tolist(), pos_to_token.tolist(), pos_to_token_topk.tolist()
    for t in range(num_tokens):
        for k in range(num_topk):
            e, pos = int(topk_idx[t, k]), int(token_topk_to_pos[t, k])
            if e < 0:
                assert pos == -1
                continue
            assert starts[e] <= pos < starts[e] + counts[e]
            assert pos not in rows_used
            rows_used[pos] = (t, k)
            assert (p2e[pos], p2t[pos], p2tk[pos]) == (e, t, t * num_topk + k)
    # every other row is padding
    for pos in range(size):
        if pos not in rows_used:
            assert (p2e[pos], p2t[pos], p2tk[pos]) == (-1, -1, -1)
    # this reference's order inside an expert: ascending flat index t * K + k
    for e in range(num_experts):
        block = p2tk[starts[e]:starts[e] + counts[e]]
        assert block == sorted(block)
    return count_list


@pytest.mark.parametrize("num_experts,num_topk", [(1, 1), (9, 2), (32, 6), (72, 8), (256, 9)])
@pytest.mark.parametrize("alignment", [1, 16, 64, 128])
def test_get_fused_mapping_properties(num_experts, num_topk, alignment):
    gen = _gen("mapping", num_experts, num_topk, alignment)
    topk_idx = _random_routing(150, num_topk, num_experts, gen)
    topk_idx[7] = -1  # a token routed nowhere
    result = moe.get_fused_mapping(topk_idx, num_experts, 0, alignment)
    count_list = _check_mapping(topk_idx, num_experts, alignment, result)
    assert count_list == result[6].tolist()  # synced
    # a caller-sized buffer: trailing rows are padding, nothing synced
    total = sum(count_list)
    result = moe.get_fused_mapping(topk_idx, num_experts, total + 5, alignment)
    assert _check_mapping(topk_idx, num_experts, alignment, result, total + 5) == []
    result = moe.get_fused_mapping(topk_idx, num_experts, total, alignment, force_no_sync=True)
    assert _check_mapping(topk_idx, num_experts, alignment, result, total) == []


def test_get_fused_mapping_edge_cases():
    empty = torch.empty((0, 4), dtype=torch.int64)
    result = moe.get_fused_mapping(empty, 8, 0, 16)
    assert _check_mapping(empty, 8, 16, result) == [0] * 8
    unrouted = torch.full((5, 3), -1, dtype=torch.int64)
    result = moe.get_fused_mapping(unrouted, 8, 0, 16, force_no_sync=True)
    assert _check_mapping(unrouted, 8, 16, result, 0) == []
    routed = torch.tensor([[0, 3], [3, -1]])
    with pytest.raises(ValueError):
        moe.get_fused_mapping(routed, 4, 0, 16, force_no_sync=True)  # no room
    with pytest.raises(ValueError):
        moe.get_fused_mapping(routed, 4, 31, 16)  # needs 32 rows
    with pytest.raises(ValueError):
        moe.get_fused_mapping(routed, 3, 0, 16)  # expert 3 out of range
    with pytest.raises(TypeError):
        moe.get_fused_mapping(routed.int(), 4, 0, 16)


# --------------------------------------------------------------------------
# expand_to_fused, expand_to_fused_with_sf
# --------------------------------------------------------------------------


def _random_bits(shape, dtype, gen):
    info = torch.iinfo(_BITS[torch.empty((), dtype=dtype).element_size()])
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=_BITS[torch.empty((), dtype=dtype).element_size()]).view(dtype)


def _layout(seed, num_tokens=60, num_topk=6, num_experts=12, alignment=16):
    gen = _gen("layout", seed)
    topk_idx = _random_routing(num_tokens, num_topk, num_experts, gen)
    mapping = moe.get_fused_mapping(topk_idx, num_experts, 0, alignment)
    return mapping[0], mapping[3], gen


def _check_expanded(out, src, token_topk_to_pos, pos_to_expert):
    filled = set()
    for t, row in enumerate(token_topk_to_pos.tolist()):
        for pos in row:
            if pos >= 0:
                assert torch.equal(_bits(out[pos]), _bits(src[t]))
                filled.add(pos)
    for pos, e in enumerate(pos_to_expert.tolist()):
        if e < 0:
            assert pos not in filled and not _bits(out[pos]).any()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_expand_to_fused_definition(dtype):
    pos_to_expert, token_topk_to_pos, gen = _layout(str(dtype))
    x = _random_bits((60, 320), dtype, gen)
    out = moe.expand_to_fused(x, token_topk_to_pos, pos_to_expert)
    assert out.dtype == dtype and out.shape == (pos_to_expert.shape[0], 320) and out.is_contiguous()
    _check_expanded(out, x, token_topk_to_pos, pos_to_expert)
    with pytest.raises(ValueError):
        moe.expand_to_fused(x[:-1], token_topk_to_pos, pos_to_expert)


@pytest.mark.parametrize("num_per_channels", [32, 128])
@pytest.mark.parametrize("sf_kind", ["fp32-row", "fp32-col", "ue8m0-col"])
def test_expand_to_fused_with_sf_definition(num_per_channels, sf_kind):
    pos_to_expert, token_topk_to_pos, gen = _layout(f"{num_per_channels}{sf_kind}", num_tokens=41)
    hidden = 576
    x = _random_bits((41, hidden), torch.float8_e4m3fn, gen)
    hidden_sf = -(-hidden // num_per_channels)
    col_major = sf_kind.endswith("col")
    if sf_kind == "ue8m0-col":
        sf = _random_bits((41, -(-hidden_sf // 4)), torch.int32, gen)
    else:
        sf = _random_bits((41, hidden_sf), torch.float32, gen)
    out, out_sf = moe.expand_to_fused_with_sf((x, sf), num_per_channels, token_topk_to_pos, pos_to_expert, col_major)
    num_expanded = pos_to_expert.shape[0]
    assert out.dtype == x.dtype and out.shape == (num_expanded, hidden) and out.is_contiguous()
    assert out_sf.dtype == sf.dtype and out_sf.shape == (num_expanded, sf.shape[1])
    if col_major:
        assert out_sf.stride() == (1, -(-num_expanded // 4) * 4)
    else:
        assert out_sf.stride() == (sf.shape[1], 1)
    _check_expanded(out, x, token_topk_to_pos, pos_to_expert)
    _check_expanded(out_sf, sf, token_topk_to_pos, pos_to_expert)


def test_expand_to_fused_with_sf_errors():
    pos_to_expert, token_topk_to_pos, gen = _layout("errors", num_tokens=8)
    x = torch.zeros((8, 256), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):  # packed UE8M0 needs the column-major layout
        moe.expand_to_fused_with_sf((x, torch.zeros((8, 1), dtype=torch.int32)), 128, token_topk_to_pos, pos_to_expert)
    with pytest.raises(ValueError):  # 256 / 128 = 2 scale factors per row
        moe.expand_to_fused_with_sf((x, torch.zeros((8, 3))), 128, token_topk_to_pos, pos_to_expert)
    with pytest.raises(ValueError):
        moe.expand_to_fused_with_sf((x, torch.zeros((8, 4))), 64, token_topk_to_pos, pos_to_expert)
    with pytest.raises(TypeError):
        moe.expand_to_fused_with_sf((x, torch.zeros((8, 2), dtype=torch.float64)), 128, token_topk_to_pos, pos_to_expert)


# --------------------------------------------------------------------------
# reduce_fused and its FMA
# --------------------------------------------------------------------------


def test_fma_is_correctly_rounded():
    gen = _gen("fma")
    a = torch.randn(3000, generator=gen)
    b = torch.rand(3000, generator=gen)
    c = torch.randn(3000, generator=gen) * 4
    # constructed double-rounding traps: a * b = half an ulp of c, minus a hair
    n = 300
    c[:n] = (1 + torch.randint(0, 2**22, (n,), generator=gen).double() * 2 ** -22 + 2 ** -23).float()  # odd mantissa
    a[:n] = 2.0 ** -24 * (1 + 2.0 ** -23)
    b[:n] = (1 - 2.0 ** -23) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    a[n:2 * n] = torch.randn(n, generator=gen) * 2.0 ** -130  # subnormal results
    b[n:2 * n] = torch.rand(n, generator=gen)
    c[n:2 * n] = torch.randn(n, generator=gen) * 2.0 ** -140
    got = _fma_f32(a, b, c)
    want = [f32_exact(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.dtype == torch.float32
    assert got.tolist() == want
    assert not torch.equal(a * b + c, got)  # the traps do trip a separate multiply and add


def _slow_reduce(x, x_sf, weights, token_topk_to_pos, sf, out_dtype):
    num_tokens, num_topk = token_topk_to_pos.shape
    rows = x.float().tolist()
    out = []
    for t in range(num_tokens):
        acc = [0.0] * x.shape[1]
        for k in range(num_topk):
            pos = int(token_topk_to_pos[t, k])
            if pos < 0:
                continue
            s = float(weights[t, k]) if weights is not None else 1.0
            if x_sf is not None:
                s = f32(s * float(x_sf[pos]))
            acc = [f32_exact(Fraction(v) * Fraction(s) + Fraction(a)) for v, a in zip(rows[pos], acc)]
        if sf is not None:
            acc = [f32(a * float(sf[0])) for a in acc]
        out.append(acc)
    result = torch.tensor(out, dtype=torch.float32)
    if out_dtype == torch.float8_e4m3fn:
        result = result.clamp(-448, 448)
    return result.to(out_dtype)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_reduce_fused_definition(in_dtype, fp8_out):
    gen = _gen("reduce", in_dtype, fp8_out)
    num_tokens, num_topk, num_experts, hidden = 7, 4, 6, 256
    topk_idx = _random_routing(num_tokens, num_topk, num_experts, gen)
    token_topk_to_pos = moe.get_fused_mapping(topk_idx, num_experts, 0, 1)[3]
    num_expanded = int(token_topk_to_pos.max()) + 1
    x = (torch.randn((num_expanded, hidden), generator=gen) * 3).to(in_dtype)
    fp8_format = "e4m3" if fp8_out else ""
    for with_weights in (False, True):
        for with_x_sf in (False, True):
            weights = torch.rand((num_tokens, num_topk), generator=gen) if with_weights else None
            x_sf = torch.randn(num_expanded, generator=gen) if with_x_sf else None
            sf = torch.randn(1, generator=gen) * 8 if fp8_out else None  # large enough to saturate some
            got = moe.reduce_fused((x, x_sf) if with_x_sf else x, weights, token_topk_to_pos, fp8_format, sf)
            want = _slow_reduce(x, x_sf, weights, token_topk_to_pos, sf, torch.float8_e4m3fn if fp8_out else in_dtype)
            assert got.dtype == want.dtype and got.shape == (num_tokens, hidden) and got.is_contiguous()
            assert torch.equal(_bits(got), _bits(want))


def test_reduce_fused_out_saturation_and_errors():
    token_topk_to_pos = torch.tensor([[0, 1], [-1, 2], [-1, -1]], dtype=torch.int32)
    x = torch.randn((3, 256), generator=_gen("reduce-misc"))
    out = torch.full((3, 256), float("nan"))
    assert moe.reduce_fused(x, None, token_topk_to_pos, out=out) is out
    assert torch.equal(out[0], x[0] + x[1]) and torch.equal(out[1], x[2]) and not out[2].any()
    big = moe.reduce_fused(x * 1e4, None, token_topk_to_pos, "e4m3", torch.ones(1))
    assert big.dtype == torch.float8_e4m3fn and big.float().abs().max() == 448 and not big.float().isnan().any()
    assert moe.reduce_fused(x, None, torch.empty((0, 2), dtype=torch.int32)).shape == (0, 256)
    with pytest.raises(ValueError):
        moe.reduce_fused(x[:, :200], None, token_topk_to_pos)  # hidden % 256
    with pytest.raises(ValueError):
        moe.reduce_fused(x, None, token_topk_to_pos, "", torch.ones(1))  # sf needs fp8 output
    with pytest.raises(ValueError):
        moe.reduce_fused(x, None, token_topk_to_pos, "e5m2")
