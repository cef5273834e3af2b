"""moe.group_count and moe.aux_fi: one kernel (a histogram of expert indices) for both; the
expert count (1 to 1024), token count and top-k are run-time values.  Up to 8192 entries one
launch of one block; above, two launches (counting blocks into the scratch rows, then the
reduce)."""

from kernels_tl.schema import Int, Op, Out, Param, Randint, Sample, Schema, Tensor

INDICES = Tensor(["int64"], 2)
# The split form's per-block counts, int32 [counting blocks, bins] (host.h: plan_histogram sizes
# it from the entry count and the SM count; no rows for one launch).  Scratch: never returned.
PARTIAL = Out("partial", dtype="'int32'", shape="[counting_blocks, num_groups]")


def _idx(num_experts: int, num_topk: int = 8) -> Randint:
    """Expert indices in [-1, num_experts): -1 (no expert) occurs too."""
    return Randint(["T", num_topk], "int64", -1, num_experts)


# decode, prefill, then upstream's benchmark: 4001 tokens per rank routed top-8 over 256 (or 72)
# experts on 8 EP ranks, the rows with an expert of this rank kept (about 21184 x 8 over 32
# local experts; 64 ranks: about 30711 x 8 over 4), then the extremes of the bin count
# (1, and 1024 both in one launch and split: 32 reduce blocks), an odd top-k, the one-launch
# limit (4096 entries) and one entry past it (5 counting blocks of 832, a short last one), the
# counting grid at its cap on a 132-SM part (135168 entries: 132 blocks of 1024) and 8 entries
# past it (32-entry rounding: 129 blocks, the last with 8 entries), and counting blocks of more
# than one tile (4096 entries) on 132- and 144-block grids.
_SHAPES = [
    ("decode", 128, 256, 8),
    ("prefill", 8192, 256, 8),
    ("upstream: 256 experts / 8 EP ranks", 21184, 32, 8),
    ("upstream: 256 experts / 64 EP ranks", 30711, 4, 8),
    ("upstream: 72 experts / 8 EP ranks, top-6", 18088, 9, 6),
    ("1024 experts", 3000, 1024, 8),
    ("1024 experts, one launch", 500, 1024, 8),
    ("1 expert, top-9", 1000, 1, 9),
    ("one-launch limit (4096 entries)", 512, 64, 8),
    ("one entry past the one-launch limit", 4097, 64, 1),
    ("132 counting blocks of 1024 entries", 16896, 256, 8),
    ("8 entries past 132 x 1024", 16897, 256, 8),
    ("two tiles per counting block", 80000, 64, 8),
]

SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="moe",
            name="group_count",
            params=[Param("group_idx", INDICES), Param("num_groups", Int())],
            outs=[Out("out", dtype="'int32'", shape="[num_groups]")],
            returns=["out"],
            scratch=[PARTIAL],
            launches=True,
            reference="tile_kernels_aot.torch.moe.group_count",
            samples=[Sample(name, tokens, [_idx(experts, topk), experts]) for name, tokens, experts, topk in _SHAPES],
            token_dim=None,  # one histogram over all tokens
            doc=(
                "group_count(group_idx, num_groups) -> int32 [num_groups]: how many entries of group_idx name each "
                "group; -1 (any negative) entries are not counted, entries >= num_groups are skipped (the reference "
                "raises).  group_idx: int64 [num_tokens, num_topk], contiguous; 0 <= num_groups <= 1024."
            ),
        ),
        Op(
            module="moe",
            name="aux_fi",
            params=[Param("topk_idx", INDICES), Param("num_experts", Int()), Param("num_aux_topk", Int())],
            outs=[Out("out", dtype="'float32'", shape="[num_experts]")],
            returns=["out"],
            scratch=[PARTIAL],
            launches=True,
            reference="tile_kernels_aot.torch.moe.aux_fi",
            samples=[Sample(name, tokens, [_idx(experts, topk), experts, topk]) for name, tokens, experts, topk in _SHAPES]
            + [Sample("upstream: num_aux_topk 1", 21184, [_idx(32), 32, 1])],
            token_dim=None,  # one histogram over all tokens
            doc=(
                "aux_fi(topk_idx, num_experts, num_aux_topk) -> float32 [num_experts]: float32(count[e] * num_experts) "
                "/ float32(num_tokens * num_aux_topk) (one IEEE division), 0 when num_tokens == 0; counts as "
                "group_count's.  topk_idx: int64 [num_tokens, num_topk], contiguous; 0 <= num_experts <= 1024."
            ),
        ),
    ],
)
