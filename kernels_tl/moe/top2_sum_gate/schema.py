"""moe.top2_sum_gate: one kernel per size class (``max_experts``, a multiple of 32 up to 512);
the token, expert, group and top-k counts, the scoring function, the options and the ranks
are run-time values."""

from kernels_tl.schema import Bool, Float, Int, Op, Out, Param, Randint, Randn, Sample, Schema, Str, Tensor

_SCORING = ["sigmoid", "sqrtsoftplus", "softmax", "identity"]  # ScoringFunc's values, in order


def _sample(name, tokens, experts, topk, topk_groups, groups, scoring, *, shared=0, scale=2.5, ranks=(0, 1, 0, 1),
            mask=False, fix=False, extra=None, unmapped=False):
    """One call: ``experts`` routed experts, ``ranks`` = (ep_rank, num_ep_ranks, tp_rank,
    num_tp_ranks); ``extra`` replica columns give a random ``to_physical_map`` (entries in
    ``[0, experts + extra)``) and replica counts in ``[1, extra + 1]``."""
    kwargs = {}
    if mask:
        kwargs["mask"] = Randint(["T"], "bool", 0, 2)
    if fix:
        kwargs["fix_routing_mask"] = Randint(["T"], "bool", 0, 2)
    if extra is not None:
        kwargs["to_physical_map"] = Randint([experts + shared, extra + 1], "int32", 0, experts + extra)
        kwargs["logical_count"] = Randint([experts + shared], "int32", 1, extra + 2)
    if fix or unmapped:
        # stored rows for the fixed tokens (-1 reads expert 0's score, like the reference)
        kwargs["unmapped_topk_idx"] = Randint(["T", topk], "int64", -1, experts)
    ep_rank, num_ep_ranks, tp_rank, num_tp_ranks = ranks
    return Sample(name, tokens, [Randn(["T", experts], "float32"), Randn([experts], "float32"), topk, topk_groups,
                                 groups, shared > 0, shared, scale, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                                 scoring], kwargs)


def _upstream(scoring, topk_groups):
    # TileKernels' benchmark: 32 tokens + 4 masked, 256 experts in 8 groups, top-8, two shared
    # experts through a replica map with 32 extra experts, EP 4 / TP 2 (rank 1), the stored rows
    return _sample(f"upstream {scoring}, {topk_groups} of 8 groups", 36, 256, 8, topk_groups, 8, scoring, shared=2,
                   scale=1.5, ranks=(0, 4, 1, 2), mask=True, extra=32, unmapped=True)


SCHEMA = Schema(
    static=("max_experts",),
    ops=[
        Op(
            module="moe",
            name="top2_sum_gate",
            params=[
                Param("logits", Tensor(["float32"], 2)),
                Param("bias", Tensor(["float32"], 1)),
                Param("num_topk", Int()),
                Param("num_topk_groups", Int()),
                Param("num_groups", Int()),
                Param("use_shared_as_routed", Bool()),
                Param("num_shared_experts", Int()),
                Param("routed_scaling_factor", Float()),
                Param("ep_rank", Int()),
                Param("num_ep_ranks", Int()),
                Param("tp_rank", Int()),
                Param("num_tp_ranks", Int()),
                Param("scoring_func", Str(_SCORING, enum=True)),
                Param("mask", Tensor(["bool"], 1, optional=True), None),
                Param("fix_routing_mask", Tensor(["bool"], 1, optional=True), None),
                Param("to_physical_map", Tensor(["int32"], 2, optional=True), None),
                Param("logical_count", Tensor(["int32"], 1, optional=True), None),
                Param("unmapped_topk_idx", Tensor(["int64"], 2, contiguous=False, optional=True, mutable=True), None),
            ],
            dims=[("slots", "num_topk + (num_shared_experts if use_shared_as_routed else 0)")],
            outs=[Out("topk_idx", dtype="'int64'", shape="[logits.shape[0], slots]"),
                  Out("topk_weights", dtype="'float32'", shape="[logits.shape[0], slots]")],
            returns=["topk_idx", "topk_weights"],
            reference="tile_kernels_aot.torch.moe.top2_sum_gate",
            # the row reads and the outputs (the masks, the stored rows and the replica entries
            # are a few bytes per token; the replica map is read only where it is picked)
            bytes="logits.nbytes + bias.nbytes + topk_idx.nbytes + topk_weights.nbytes",
            samples=[
                # DeepSeek-V3: 256 experts in 8 groups, the best 4 groups by their top-2 sums, top-8
                _sample("decode", 128, 256, 8, 4, 8, "sigmoid"),
                _sample("prefill", 8192, 256, 8, 4, 8, "sigmoid"),
                _upstream("sigmoid", 4),
                _upstream("sqrtsoftplus", 4),
                _upstream("softmax", 8),  # no group limit (num_groups == num_topk_groups)
                # DeepSeek-V4-like: sqrtsoftplus, no groups, replicas, EP 8 / TP 8
                _sample("sqrtsoftplus, 384 experts, EP 8 TP 8", 2000, 384, 6, 0, 0, "sqrtsoftplus", scale=1.5,
                        ranks=(5, 8, 5, 8), extra=16, unmapped=True),
                # softmax with a group limit: the keys are logits + bias
                _sample("softmax, 160 experts in 16 groups", 1000, 160, 6, 3, 16, "softmax", scale=1.0),
                # one group (no limit); 72 groups (no limit: num_groups == num_topk_groups)
                _sample("72 experts, 1 group, one shared expert", 1000, 72, 6, 1, 1, "sigmoid", shared=1, extra=8,
                        ranks=(3, 8, 1, 2)),
                _sample("288 experts in 72 groups", 1000, 288, 8, 72, 72, "sigmoid", ranks=(0, 8, 0, 1)),
                # groups of 9 experts (not a multiple of 4), the best 3 of 8
                _sample("72 experts in 8 groups", 1000, 72, 6, 3, 8, "sqrtsoftplus"),
                # odd expert counts: a partly filled last slot (36: 4 lanes, 108: 12)
                _sample("36 experts, softmax, shared", 1000, 36, 6, 0, 0, "softmax", shared=2, extra=4,
                        ranks=(1, 2, 0, 1)),
                _sample("108 experts in 4 groups", 1000, 108, 6, 2, 4, "sigmoid", shared=2, extra=12,
                        ranks=(2, 4, 1, 2), mask=True),
                # fewer experts than lanes: torch's softmax runs on 8 / 16 / 32 lanes
                _sample("8 experts, softmax", 1000, 8, 2, 0, 0, "softmax", shared=2, extra=2),
                _sample("12 experts, softmax", 1000, 12, 3, 0, 0, "softmax"),
                _sample("20 experts, softmax, top-9", 1000, 20, 9, 0, 0, "softmax"),
                # fixed routing (with masked tokens, negative stored entries)
                _sample("fix routing, 256 experts", 1000, 256, 8, 4, 8, "sigmoid", mask=True, fix=True),
                _sample("fix routing, softmax, replicas", 1000, 144, 8, 0, 0, "softmax", fix=True, extra=8,
                        ranks=(7, 8, 3, 4)),
                # the largest class, 16 groups of 32, top-9; and groups of 8 with TP 4
                _sample("512 experts in 16 groups, top-9", 1000, 512, 9, 4, 16, "sigmoid", ranks=(0, 16, 3, 4)),
                _sample("128 experts in 16 groups, TP 4", 1000, 128, 9, 8, 16, "sqrtsoftplus", ranks=(0, 8, 2, 4),
                        unmapped=True),
                # 384 experts in 12 groups of 32 (12: not a power of two)
                _sample("384 experts in 12 groups", 1000, 384, 8, 6, 12, "softmax", scale=1.5),
                # top-1, no scaling, one rank
                _sample("top-1", 1000, 64, 1, 0, 0, "sigmoid", scale=1.0),
            ],
            doc=(
                "top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, "
                "num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, "
                "mask=None, fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None) -> "
                "(topk_idx int64 [num_tokens, K + S], topk_weights float32 [num_tokens, K + S]): the DeepSeek-V3 router. "
                "Scores (sigmoid / sqrtsoftplus / softmax), group limit by the top-2 sums of score + bias (logits + bias "
                "for softmax), top-K keys (ties to the smaller expert) or the fixed rows of unmapped_topk_idx, weights "
                "s / (1e-20 + sum s) * routed_scaling_factor, shared experts E..E+S-1 with weight 1, logical -> "
                "physical replicas, then this TP rank's experts renumbered locally (others -1); unmapped_topk_idx is "
                "updated in place.  logits: float32 [num_tokens, E], contiguous, E % 4 == 0, E <= 512; K + S <= 32; "
                "see tile_kernels_aot.torch.moe.top2_sum_gate for the full contract."
            ),
        ),
    ],
)
