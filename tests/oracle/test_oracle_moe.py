"""MoE references against TileKernels 1.0.0's own torch references.

Every function with an upstream torch reference (``tile_kernels.torch``) is
compared on fresh seeded random inputs over upstream's test dimensions
(expert counts, top-k, group layouts, hidden sizes, alignments).  Token counts
are upstream's 4001 where a case is cheap and a few hundred where the hidden
size makes it heavy (the CI machine has 2 cores); the dims a kernel would
specialise on are all covered.

Exactness (see the per-test comments):

* bit-exact: topk_gate, topk_sum_and_topk_group_idx, group_count, aux_fi,
  mask_indices_by_tp, inplace_unique_group_indices, normalize_weight,
  expand_to_fused(_with_sf) (values and strides), top2_sum_gate indices;
* top2_sum_gate weights: relative error <= (2K + 2) * 2^-24 (upstream's
  reference sums the K selected scores with ``torch.sum``, ours accumulates
  left to right from 1e-20 like the kernel);
* reduce_fused: bit-exact once the oracle's FMA is exact (upstream's reference
  routes ``a * b + c`` through ``torch.compile`` to get the GPU's fused
  multiply-add; on the CPU inductor does not fuse, so the unmodified oracle
  rounds twice; that case is checked with a tolerance).

get_fused_mapping has no upstream reference: its properties are tested in
tests/cpu/test_ref_moe.py.
"""

import importlib
import inspect
import zlib

import pytest

tile_kernels = pytest.importorskip("tile_kernels")

import torch  # noqa: E402
import tile_kernels.moe as tk_moe  # noqa: E402
import tile_kernels.torch as tk_ref  # noqa: E402
from tile_kernels.moe.scoring import ScoringFunc as TkScoringFunc  # noqa: E402

from tile_kernels_aot.torch import moe as ref  # noqa: E402

# (``tile_kernels.torch.reduce_fused`` the attribute is the function, which
# shadows the submodule of the same name)
tk_reduce_module = importlib.import_module("tile_kernels.torch.reduce_fused")

PUBLIC = [
    "topk_gate", "top2_sum_gate", "topk_sum_and_topk_group_idx", "group_count", "aux_fi",
    "mask_indices_by_tp", "inplace_unique_group_indices", "normalize_weight", "get_fused_mapping",
    "expand_to_fused", "expand_to_fused_with_sf", "reduce_fused",
]
HIDDEN_SIZES = [576, 2048, 2560, 3072, 4096, 6144, 7168]
NUM_TOKENS = 4001


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _assert_same(a: torch.Tensor, b: torch.Tensor, check_stride: bool = True):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if check_stride:
        assert a.stride() == b.stride(), (a.stride(), b.stride())
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    else:
        assert torch.equal(a, b)


def _moe_params():
    """Upstream's routing test grid: (num_topk, experts per rank, num_ep_ranks)."""
    out = []
    for num_topk in (2, 6, 8, 9):
        for num_experts in (72, 256):
            for num_ep_ranks in (8, 64):
                if num_experts % num_ep_ranks == 0:
                    out.append((num_topk, num_experts // num_ep_ranks, num_ep_ranks))
    return out


def _topk_idx(num_send_tokens, num_topk, num_experts, num_ep_ranks, gen):
    """Routing like upstream's generator: top-k over all ranks' experts, the
    other ranks' experts become -1, rows routed nowhere here are dropped."""
    scores = torch.rand((num_send_tokens * num_ep_ranks, num_experts * num_ep_ranks), generator=gen)
    idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices
    idx[idx >= num_experts] = -1
    return idx[(idx >= 0).any(dim=1)].contiguous()


# --------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_matches_upstream(name):
    assert _params(getattr(ref, name)) == _params(getattr(tk_moe, name))


def test_scoring_func_matches_upstream():
    assert [(m.name, m.value, str(m)) for m in ref.ScoringFunc] == [(m.name, m.value, str(m)) for m in TkScoringFunc]
    for m in TkScoringFunc:
        assert ref.ScoringFunc.from_str(str(m)) == m.value
    with pytest.raises(ValueError):
        ref.ScoringFunc.from_str("relu")


# --------------------------------------------------------------------------
# gates
# --------------------------------------------------------------------------

EXPERT_CONFIGS = [(72, 6), (32, 6), (64, 6), (96, 6), (16, 6), (36, 6), (108, 6), (128, 6), (144, 6), (256, 8)]


@pytest.mark.parametrize("num_experts,num_topk", EXPERT_CONFIGS)
@pytest.mark.parametrize("ties", [False, True])
def test_topk_gate(num_experts, num_topk, ties):
    # upstream tests topk_gate against stable_topk; bit-exact
    gen = _gen("topk_gate", num_experts, num_topk, ties)
    if ties:
        # few distinct values, both signed zeros: exercises "ties to the smaller index"
        scores = torch.randint(-2, 3, (NUM_TOKENS, num_experts), generator=gen).float() * 0.25
        zero = scores == 0
        scores[zero & (torch.rand(scores.shape, generator=gen) < 0.5)] = -0.0
    else:
        scores = torch.randn((NUM_TOKENS, num_experts), generator=gen)
    _assert_same(ref.topk_gate(scores, num_topk), tk_ref.stable_topk(scores, num_topk))


GROUP_PARAMS = [  # upstream's grid: the groups divide the experts
    (e, g, s, k) for e in (72, 256) for g in (4, 8, 12, 16) if e % g == 0 for s in (1, 2) for k in (2, 4)
]


@pytest.mark.parametrize("num_experts,num_groups,num_topk_sum,num_topk_groups", GROUP_PARAMS)
def test_topk_sum_and_topk_group_idx(num_experts, num_groups, num_topk_sum, num_topk_groups):
    gen = _gen("topk_sum", num_experts, num_groups, num_topk_sum, num_topk_groups)
    shape = (NUM_TOKENS, num_groups, num_experts // num_groups)
    scores = torch.randn(shape, generator=gen)
    _assert_same(ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups),
                 tk_ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups))
    # group-score ties: rank the smaller group first
    scores = torch.randint(0, 3, shape, generator=gen).float()
    _assert_same(ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups),
                 tk_ref.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups))


# upstream's configs: (num_groups, num_topk_groups, num_routed_experts, num_shared_experts, num_topk)
TOP2_CONFIGS = [
    (0, 0, 72, 1, 6), (0, 0, 32, 2, 6), (0, 0, 64, 2, 6), (0, 0, 96, 2, 6), (0, 0, 16, 2, 6),
    (0, 0, 36, 2, 6), (0, 0, 108, 2, 6), (0, 0, 128, 2, 6), (0, 0, 144, 2, 6),
    (8, 8, 256, 2, 8), (8, 4, 256, 2, 8),
]


def _top2_kwargs(num_tokens, num_padded, num_routed, num_shared, num_topk, use_shared, fix_routing, gen):
    num_extra = 32
    mask = None
    if num_padded:
        mask = torch.ones(num_tokens + num_padded, dtype=torch.bool)
        mask[torch.randperm(num_tokens + num_padded, generator=gen)[:num_padded]] = False
    to_physical_map = logical_count = fix_routing_mask = None
    unmapped = torch.randint(0, num_routed, (num_tokens + num_padded, num_topk), generator=gen)
    if use_shared:
        # random replicas (upstream uses identity replicas: this covers more)
        to_physical_map = torch.randint(0, num_routed + num_extra, (num_routed + num_shared, num_extra + 1), generator=gen, dtype=torch.int32)
        logical_count = torch.randint(1, num_extra + 2, (num_routed + num_shared,), generator=gen, dtype=torch.int32)
    if fix_routing:
        fix_routing_mask = torch.rand(num_tokens + num_padded, generator=gen) < 0.5
    return dict(mask=mask, fix_routing_mask=fix_routing_mask, to_physical_map=to_physical_map,
                logical_count=logical_count, unmapped_topk_idx=unmapped)


def _clone_kwargs(kwargs):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


@pytest.mark.parametrize("config", TOP2_CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_top2_sum_gate(config, scoring_func):
    num_groups, num_topk_groups, num_routed, num_shared, num_topk = config
    num_tokens = 129
    routed_scaling_factor = 1.5
    num_ep_ranks, num_tp_ranks, ep_rank = 4, 2, 1
    shared_valid = num_topk % num_shared == 0 and num_routed % (num_topk // num_shared) == 0
    gen = _gen("top2", config, scoring_func)
    for num_padded in (0, 10):
        for tp_rank in range(num_tp_ranks):
            for use_shared in ((False, True) if shared_valid else (False,)):
                for fix_routing in (False, True):
                    logits = torch.randn((num_tokens + num_padded, num_routed), generator=gen)
                    bias = torch.randn(num_routed, generator=gen)
                    kwargs = _top2_kwargs(num_tokens, num_padded, num_routed, num_shared, num_topk, use_shared, fix_routing, gen)
                    kwargs_ref = _clone_kwargs(kwargs)
                    args = (logits, bias, num_topk, num_topk_groups, num_groups, use_shared, num_shared,
                            routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func)
                    idx, weights = ref.top2_sum_gate(*args, **kwargs)
                    idx_tk, weights_tk = tk_ref.top2_sum_gate(*args, **kwargs_ref)
                    _assert_same(idx, idx_tk)
                    _assert_same(kwargs["unmapped_topk_idx"], kwargs_ref["unmapped_topk_idx"])
                    assert weights.dtype == torch.float32 and weights.shape == weights_tk.shape
                    # The denominators are sums of the same K positive float32 terms in
                    # different orders (relative gap <= 2(K-1)u, u = 2^-24), then one
                    # division and one multiply each (<= 2u more per side).
                    torch.testing.assert_close(weights, weights_tk, rtol=(2 * num_topk + 2) * 2.0**-24, atol=0)


# --------------------------------------------------------------------------
# counting, masking, normalisation
# --------------------------------------------------------------------------

MOE_PARAMS = _moe_params()
_MOE_IDS = [f"k{k}-e{e}-ep{ep}" for k, e, ep in MOE_PARAMS]


def _routing(tag, num_topk, num_experts, num_ep_ranks):
    # upstream sends 4001 tokens from every rank; we route 4001 in all
    num_send_tokens = NUM_TOKENS // num_ep_ranks
    return _topk_idx(num_send_tokens, num_topk, num_experts, num_ep_ranks, _gen(tag, num_topk, num_experts, num_ep_ranks))


@pytest.mark.parametrize("num_topk,num_experts,num_ep_ranks", MOE_PARAMS, ids=_MOE_IDS)
def test_group_count_and_aux_fi(num_topk, num_experts, num_ep_ranks):
    topk_idx = _routing("count", num_topk, num_experts, num_ep_ranks)
    _assert_same(ref.group_count(topk_idx, num_experts), tk_ref.group_count(topk_idx, num_experts))
    for num_aux_topk in (1, num_topk):
        # both: float32(count * E) / float32(T * K), one true division: bit-exact
        _assert_same(ref.aux_fi(topk_idx, num_experts, num_aux_topk), tk_ref.aux_fi(topk_idx, num_experts, num_aux_topk))


@pytest.mark.parametrize("num_topk,num_experts,num_ep_ranks", MOE_PARAMS, ids=_MOE_IDS)
@pytest.mark.parametrize("num_tp_ranks", [2, 4, 8])
def test_mask_indices_by_tp(num_topk, num_experts, num_ep_ranks, num_tp_ranks):
    assert num_ep_ranks % num_tp_ranks == 0
    topk_idx = _routing("tp", num_topk, num_experts, num_ep_ranks)
    n = num_experts * num_ep_ranks
    # the global (pre-masking) indices, as a router produces them
    global_idx = torch.where(topk_idx >= 0, topk_idx + num_experts * (torch.arange(topk_idx.shape[0]) % num_ep_ranks).unsqueeze(1), -1)
    for indices in (topk_idx, global_idx, global_idx.to(torch.int32)):
        for tp_rank in range(num_tp_ranks):
            _assert_same(ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks),
                         tk_ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks))


UNIQUE_PARAMS = [  # upstream's grid: the groups divide all ranks' experts
    (k, e, ep, g) for k, e, ep in MOE_PARAMS for g in (8, 16, 72) if e * ep % g == 0
]


@pytest.mark.parametrize("num_topk,num_experts,num_ep_ranks,num_groups", UNIQUE_PARAMS)
def test_inplace_unique_group_indices(num_topk, num_experts, num_ep_ranks, num_groups):
    topk_idx = _routing("unique", num_topk, num_experts, num_ep_ranks)
    group_indices = torch.where(topk_idx >= 0, topk_idx // (num_experts * num_ep_ranks // num_groups), -1)
    ours, theirs = group_indices.clone(), group_indices.clone()
    assert ref.inplace_unique_group_indices(ours, num_groups) is None
    assert tk_ref.inplace_unique_group_indices(theirs, num_groups) is None
    _assert_same(ours, theirs)
    ordered = group_indices.sort(dim=1).values
    num_duplicates = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).sum()
    assert (ours != group_indices).sum() == num_duplicates


@pytest.mark.parametrize("num_topk", [1, 2, 6, 7, 8, 9])
def test_normalize_weight(num_topk):
    weights = torch.rand((NUM_TOKENS, num_topk), generator=_gen("norm", num_topk))
    denominator, normalized = ref.normalize_weight(weights)
    denominator_tk, normalized_tk = tk_ref.normalize_weight(weights)
    _assert_same(denominator, denominator_tk)
    _assert_same(normalized, normalized_tk)


# --------------------------------------------------------------------------
# fused layout
# --------------------------------------------------------------------------

LAYOUT_PARAMS = [(k, e, ep) for k, e, ep in MOE_PARAMS if k in (2, 9)]
_LAYOUT_IDS = [f"k{k}-e{e}-ep{ep}" for k, e, ep in LAYOUT_PARAMS]


def _layout(tag, num_topk, num_experts, num_ep_ranks, num_send_tokens, alignment=16):
    topk_idx = _topk_idx(num_send_tokens, num_topk, num_experts, num_ep_ranks, _gen(tag, num_topk, num_experts, num_ep_ranks))
    mapping = ref.get_fused_mapping(topk_idx, num_experts, 0, alignment)
    return topk_idx, mapping


@pytest.mark.parametrize("num_topk,num_experts,num_ep_ranks", LAYOUT_PARAMS, ids=_LAYOUT_IDS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_expand_to_fused(num_topk, num_experts, num_ep_ranks, hidden):
    topk_idx, mapping = _layout("expand", num_topk, num_experts, num_ep_ranks, 16)
    pos_to_expert, token_topk_to_pos = mapping[0], mapping[3]
    x = torch.randn((topk_idx.shape[0], hidden), generator=_gen("x", hidden)).to(torch.bfloat16)
    _assert_same(ref.expand_to_fused(x, token_topk_to_pos, pos_to_expert),
                 tk_ref.expand_to_fused(x, token_topk_to_pos, pos_to_expert))


@pytest.mark.parametrize("num_topk,num_experts,num_ep_ranks", LAYOUT_PARAMS[:2], ids=_LAYOUT_IDS[:2])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_per_channels", [32, 128])
@pytest.mark.parametrize("sf_kind", ["fp32-row", "fp32-col", "ue8m0-col"])
def test_expand_to_fused_with_sf(num_topk, num_experts, num_ep_ranks, hidden, num_per_channels, sf_kind):
    topk_idx, mapping = _layout("expand_sf", num_topk, num_experts, num_ep_ranks, 8)
    pos_to_expert, token_topk_to_pos = mapping[0], mapping[3]
    gen = _gen("x_sf", hidden, num_per_channels, sf_kind)
    num_tokens = topk_idx.shape[0]
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.float8_e4m3fn)
    hidden_sf = -(-hidden // num_per_channels)
    if sf_kind == "ue8m0-col":
        sf = torch.randint(-2**31, 2**31 - 1, (num_tokens, -(-hidden_sf // 4)), generator=gen, dtype=torch.int32)
    else:
        sf = torch.rand((num_tokens, hidden_sf), generator=gen) + 0.5
    col_major = sf_kind.endswith("col")
    out, out_sf = ref.expand_to_fused_with_sf((x, sf), num_per_channels, token_topk_to_pos, pos_to_expert, col_major)
    out_tk, out_sf_tk = tk_ref.expand_to_fused_with_sf((x, sf), num_per_channels, token_topk_to_pos, pos_to_expert, col_major)
    _assert_same(out, out_tk)
    _assert_same(out_sf, out_sf_tk)  # strides too: TMA-aligned column-major
    # the padding of the column-major buffer agrees as well (zero in both)
    if col_major:
        width = out_sf.stride(1)
        _assert_same(out_sf.T.as_strided((out_sf.shape[1], width), (width, 1)),
                     out_sf_tk.T.as_strided((out_sf.shape[1], width), (width, 1)))


def _exact_fma(a, b, c):
    """A correctly rounded float32 ``a * b + c``, written independently of the
    reference's: round the float64 sum (the product is exact in float64) and,
    where that sum is exactly a float32 midpoint, let the sign of the float64
    rounding error (two-sum) pick the side."""
    a64, b64, c64 = torch.broadcast_tensors(a.double(), b.double(), c.double())
    prod = a64 * b64
    total = prod + c64
    virtual = total - prod
    err = (prod - (total - virtual)) + (c64 - virtual)
    nearest = total.float()
    up = total > nearest.double()
    other = torch.nextafter(nearest, torch.where(up, float("inf"), float("-inf")).float())
    midpoint = (nearest.double() + other.double()) / 2
    tie = (total != nearest.double()) & (total == midpoint) & (err != 0)
    return torch.where(tie & ((err > 0) == up), other, nearest)


@pytest.mark.parametrize("hidden", [h for h in HIDDEN_SIZES if h % 256 == 0])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fp8_out", [False, True], ids=["same", "e4m3"])
def test_reduce_fused(monkeypatch, hidden, in_dtype, fp8_out):
    # Upstream's reference asks torch.compile for an FMA (what the kernel
    # does); on the CPU inductor emits a separate multiply and add.  Give the
    # oracle an exact FMA so it computes what it computes on the GPU.
    monkeypatch.setattr(tk_reduce_module, "elementwise_fma", _exact_fma)
    num_topk, num_experts, num_ep_ranks = 6, 32, 8
    topk_idx = _topk_idx(3, num_topk, num_experts, num_ep_ranks, _gen("reduce", hidden))
    token_topk_to_pos = ref.get_fused_mapping(topk_idx, num_experts, 0, 1)[3]
    num_tokens = topk_idx.shape[0]
    num_expanded = num_tokens * num_topk
    gen = _gen("reduce-data", hidden, in_dtype, fp8_out)
    x = torch.randn((num_expanded, hidden), generator=gen).to(in_dtype)
    fp8_format = "e4m3" if fp8_out else ""
    for with_weights in (False, True):
        for with_x_sf in (False, True):
            weights = torch.rand((num_tokens, num_topk), generator=gen) if with_weights else None
            x_in = (x, torch.randn(num_expanded, generator=gen)) if with_x_sf else x
            sf = torch.randn(1, generator=gen) if fp8_out else None
            _assert_same(ref.reduce_fused(x_in, weights, token_topk_to_pos, fp8_format, sf),
                         tk_reduce_module.reduce_fused(x_in, weights, token_topk_to_pos, fp8_format, sf))


def test_reduce_fused_unpatched_oracle_within_rounding():
    # The oracle exactly as shipped (multiply and add rounded separately on the
    # CPU).  Each of the <= K steps differs by at most one float32 rounding of
    # the running sum, so |ours - theirs| <= K * 2^-23 * sum_k |x * s|.
    num_topk, num_experts, num_ep_ranks, hidden = 6, 32, 8, 2048
    topk_idx = _topk_idx(8, num_topk, num_experts, num_ep_ranks, _gen("reduce-unpatched"))
    token_topk_to_pos = ref.get_fused_mapping(topk_idx, num_experts, 0, 1)[3]
    num_tokens = topk_idx.shape[0]
    gen = _gen("reduce-unpatched-data")
    x = torch.randn((num_tokens * num_topk, hidden), generator=gen)
    weights = torch.rand((num_tokens, num_topk), generator=gen)
    ours = ref.reduce_fused(x, weights, token_topk_to_pos)
    theirs = tk_ref.reduce_fused(x, weights, token_topk_to_pos)
    pos = token_topk_to_pos.long()
    magnitude = (x[pos.clamp(min=0)].abs() * (weights * (pos >= 0)).unsqueeze(-1)).sum(dim=1)
    assert torch.all((ours - theirs).abs() <= num_topk * 2.0**-23 * magnitude)
    assert not torch.equal(ours, theirs)  # the two roundings really differ somewhere
