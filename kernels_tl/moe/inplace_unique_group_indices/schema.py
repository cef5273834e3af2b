"""moe.inplace_unique_group_indices: one kernel; the token count and top-k are run-time values."""

from kernels_tl.schema import Int, Op, Param, Randint, Sample, Schema, Tensor

SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="moe",
            name="inplace_unique_group_indices",
            params=[Param("group_indices", Tensor(["int64"], 2, mutable=True)), Param("num_groups", Int())],
            outs=[],
            returns=[],
            reference="tile_kernels_aot.torch.moe.inplace_unique_group_indices",
            samples=[
                Sample("decode", 128, [Randint(["T", 8], "int64", -1, 8), 8]),
                Sample("prefill", 8192, [Randint(["T", 8], "int64", -1, 8), 8]),
                # TileKernels' benchmark shape (72 experts over 8 EP ranks, top-8 of 8 groups)
                Sample("upstream", 21876, [Randint(["T", 8], "int64", -1, 8), 8]),
                Sample("top-9, 128 groups", 1001, [Randint(["T", 9], "int64", -1, 128), 128]),
                Sample("top-6, entries below -1", 1000, [Randint(["T", 6], "int64", -3, 5), 16]),
                # top-k past the 8 entries kept in registers, values up to the last of 128 groups (TileKernels'
                # kernel asserts on values >= align(num_groups, 64); this one compares values, so it has no such limit)
                Sample("top-20, 128 groups", 500, [Randint(["T", 20], "int64", 100, 128), 128]),
            ],
            doc=(
                "inplace_unique_group_indices(group_indices, num_groups) -> None: in every row, an entry >= 0 equal to "
                "an entry to its left becomes -1 (the leftmost occurrence stays; negative entries stay), in place.  "
                "group_indices: int64 [num_tokens, num_topk], contiguous; 1 <= num_groups <= 128."
            ),
        ),
    ],
)
