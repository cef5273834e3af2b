"""moe.topk_sum_and_topk_group_idx: one kernel; the token count, group count, group size and
both top-k values are run-time values."""

from kernels_tl.schema import Int, Op, Out, Param, Randn, Sample, Schema, Tensor


def _sample(name, tokens, num_groups, num_experts_per_group, num_topk_sum, num_topk_groups):
    return Sample(name, tokens, [Randn(["T", num_groups, num_experts_per_group], "float32"), num_topk_sum,
                                 num_topk_groups])


SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="moe",
            name="topk_sum_and_topk_group_idx",
            params=[Param("scores", Tensor(["float32"], 3)), Param("num_topk_sum", Int()),
                    Param("num_topk_groups", Int())],
            outs=[Out("out", dtype="'int64'", shape="[scores.shape[0], num_topk_groups]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.moe.topk_sum_and_topk_group_idx",
            samples=[
                # DeepSeek-V3: 256 experts in 8 groups of 32, the best 4 groups by their top-2 sums
                _sample("decode", 128, 8, 32, 2, 4),
                _sample("prefill", 8192, 8, 32, 2, 4),
                # TileKernels' benchmark shape (8001 tokens, 256 experts in 8 groups)
                _sample("upstream", 8001, 8, 32, 2, 4),
                # TileKernels' test shapes: 72 experts in 4 groups (group score = the max), ...
                _sample("72 experts in 4 groups, top-1 sum", 4001, 4, 18, 1, 2),
                # ... 12 groups (not a power of two: 16 lanes per token, 4 of them idle), ...
                _sample("72 experts in 12 groups", 4001, 12, 6, 2, 4),
                # ... and 16 groups of 16
                _sample("256 experts in 16 groups, top-1 sum", 1000, 16, 16, 1, 4),
                # a warp per token, every group ranked
                _sample("32 groups, all ranked", 1000, 32, 8, 2, 32),
                # a row of 35 floats: 4-byte loads (no 16-byte vectors)
                _sample("5 groups of 7", 1000, 5, 7, 2, 5),
                # one expert per group: the group score is the score
                _sample("24 groups of 1", 1000, 24, 1, 1, 6),
                # rows longer than the staging tile: one token per block, two passes
                _sample("8 groups of 640", 300, 8, 640, 2, 3),
            ],
            doc=(
                "topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups) -> int64 [num_tokens, "
                "num_topk_groups]: each group's score is its largest score (num_topk_sum 1) or the float32 sum of its "
                "two largest (2); the indices of the num_topk_groups best groups, best first, equal group scores "
                "(-0.0 == +0.0) smaller index first, NaN above +inf.  scores: float32 [num_tokens, num_groups, "
                "num_experts_per_group], contiguous; num_groups <= 32; num_topk_sum in {1, 2}, <= "
                "num_experts_per_group; 1 <= num_topk_groups <= num_groups."
            ),
        ),
    ],
)
