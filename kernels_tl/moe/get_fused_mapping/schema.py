"""moe.get_fused_mapping: two kernels, picked per call by the entry count (``path``: "blocks", a
plain grid of independent blocks, up to 4096 entries; "cooperative", above: one cooperative
launch whose blocks exchange per-block counts through a scratch buffer at a grid-wide barrier);
the token count, top-k, expert count (up to 1024), alignment and row count are run-time values.
The public function is a Python wrapper (``tile_kernels_aot.wrappers.get_fused_mapping``) that
adds the host sync of ``num_expanded_tokens == 0``; the kernel op itself never synchronizes."""

from kernels_tl.schema import Bool, Extent, Int, Op, Out, Param, Randint, Routed, Routing, Sample, Schema, Tensor

# The rows of the row outputs: num_expanded_tokens, or in sync mode (0, not force_no_sync)
# the most the layout can need, which the wrapper trims after the sync (TileKernels' bound).
_ROWS = ("num_expanded_tokens if num_expanded_tokens != 0 or force_no_sync else "
         "(topk_idx.shape[0] * topk_idx.shape[1] + (sym_max(alignment, 1) - 1) * num_experts)"
         " // sym_max(alignment, 1) * sym_max(alignment, 1)")


def _routed(name, tokens, num_topk, num_experts, alignment, rows="P", unrouted=0.0, exact=False, ep_ranks=1,
            **kwargs):
    """A call on a routing drawn as the serving path draws it (distinct experts per token, a
    share unrouted; with ep_ranks, the experts of one rank of expert parallelism), into ``rows``
    rows (an expression over T and P; "P": the most the layout can need, or with ``exact`` the
    rows this draw needs)."""
    return Sample(name, tokens, [Routed("topk_idx"), num_experts, rows if isinstance(rows, int) else Extent(rows), alignment],
                  routing=Routing(num_topk, num_experts, alignment, unrouted, exact=exact, ep_ranks=ep_ranks), **kwargs)


def _drawn(name, tokens, num_topk, num_experts, alignment, low, rows, high=None, **kwargs):
    """A call on uniform entries in [low, high) (high: num_experts): repeated experts within a
    token, and entries below 0 (all unrouted) when low < 0."""
    high = num_experts if high is None else high
    return Sample(name, tokens, [Randint(["T", num_topk], "int64", low, high), num_experts,
                                 rows if isinstance(rows, int) else Extent(rows), alignment], **kwargs)


# upstream's benchmark: tokens routed top-8 over 72 experts on 8 EP ranks as one rank sees them
# (about 21.8k tokens, 9 local experts, most entries -1), alignment 128, into TileKernels'
# sync-mode buffer: (T * 8 + 9 * 127) // 128 * 128 rows
_UPSTREAM_ROWS = "(T * 8 + 9 * 127) // 128 * 128"

SAMPLES = [
    _routed("decode", 128, 8, 256, 64),
    _routed("prefill", 8192, 8, 256, 64),
    _routed("upstream: 72 experts / 8 EP ranks, alignment 128", 21779, 8, 9, 128, _UPSTREAM_ROWS, ep_ranks=8),
    _routed("upstream, sync mode (num_expanded_tokens=0)", 21779, 8, 9, 128, 0, ep_ranks=8, host_sync=True),
    _routed("exact rows (no padding tail), 32 experts", 3000, 8, 32, 64, exact=True, unrouted=0.2),
    _routed("sync mode, 256 experts", 4096, 8, 256, 128, 0, host_sync=True),
    _routed("alignment 1, top-1, 16 experts", 4096, 1, 16, 1),
    _routed("384 experts, top-9, alignment 32", 4096, 9, 384, 32, unrouted=0.1),
    _routed("padding rows past the layout", 3000, 6, 72, 128, "P + 5000"),
    _routed("force_no_sync", 2000, 4, 32, 128, kwargs={"force_no_sync": True}),
    _routed("320000 entries, 64 experts", 40000, 8, 64, 16, unrouted=0.1),
    _drawn("1024 experts (the most), repeats and -1", 3000, 6, 1024, 16, -1, "T * 6 + 1024 * 15"),
    _drawn("negative entries, 36 experts, top-7", 3000, 7, 36, 16, -4, "T * 7 + 36 * 15"),
    _drawn("force_no_sync, nothing routed, 8 experts", 400, 8, 8, 16, -1, 0, high=0, kwargs={"force_no_sync": True}),
    # the blocks path (up to 4096 entries) at its limits, and the cooperative path with nothing routed
    _drawn("blocks path: 4096 entries (the most), 1024 experts, repeats and -1", 512, 8, 1024, 16, -1,
           "T * 8 + 1024 * 15"),
    _drawn("blocks path: top-40 (token advance past 32), negative entries", 102, 40, 36, 16, -4, "T * 40 + 36 * 15"),
    _routed("blocks path: exact rows (no padding tail)", 500, 8, 32, 64, exact=True, unrouted=0.2),
    _drawn("cooperative path, force_no_sync, no rows", 2000, 8, 8, 16, -1, 0, high=0,
           kwargs={"force_no_sync": True}),
    # 9000 entries: 94 blocks of 96 entries, one group of 32 in 3 warps of each, 29 empty warps
    _routed("cooperative path: most warps empty, long padding tail", 1500, 6, 32, 16, 200000, unrouted=0.1),
    # the cooperative path's own cases: every entry one expert (each chunk and warp boundary lies inside
    # its run); the fewest entries (4104: 65 blocks of 64, the last with 8); 8200 entries (86 blocks of
    # 96, the last with 40, 8 of them in its second warp); 1024 experts at 40000 x 8 entries (32 blocks,
    # the most at 1024 experts; warp pieces of 320 entries: two steps, the second re-read); 122880
    # entries over 4 experts (MAX_GRID blocks: 128 of 960 entries)
    _drawn("cooperative path: one expert takes every entry", 3000, 4, 3, 16, 1, "T * 4 + 3 * 15", high=2),
    _drawn("cooperative path: 4104 entries (the fewest), 40 experts", 513, 8, 40, 8, -1, "T * 8 + 40 * 7"),
    _drawn("cooperative path: 8200 entries, 40 experts, the last block's second warp", 1025, 8, 40, 8, -1,
           "T * 8 + 40 * 7"),
    _drawn("cooperative path: 1024 experts, two steps per warp", 40000, 8, 1024, 16, -1, "T * 8 + 1024 * 15"),
    _routed("cooperative path: the most blocks, 4 experts, top-2", 61440, 2, 4, 64, exact=True, unrouted=0.3),
    # the MoE layer's no-sync call (tile_kernels_aot.moe_layer at 8192 tokens): 128 blocks of 512
    # entries (32768 // 256 = 128, the grid's cap)
    _routed("MoE layer: 256 experts, alignment 16, no-sync rows at the bound", 8192, 8, 256, 16, "T * 8 + 256 * 15"),
]

SCHEMA = Schema(
    static=("path",),
    ops=[
        Op(
            module="moe",
            name="get_fused_mapping",
            params=[Param("topk_idx", Tensor(["int64"], 2)), Param("num_experts", Int()),
                    Param("num_expanded_tokens", Int()), Param("alignment", Int()),
                    Param("force_no_sync", Bool(), False)],
            outs=[Out("pos_to_expert", dtype="'int32'", shape="[rows]"),
                  Out("pos_to_token", dtype="'int32'", shape="[rows]"),
                  Out("pos_to_token_topk", dtype="'int32'", shape="[rows]"),
                  Out("token_topk_to_pos", dtype="'int32'", shape="list(topk_idx.shape)"),
                  Out("expert_start", dtype="'int32'", shape="[num_experts]"),
                  Out("expert_end", dtype="'int32'", shape="[num_experts]"),
                  Out("num_tokens_per_expert", dtype="'int32'", shape="[num_experts]")],
            # the cooperative path's per-block counts [expert][block] (host.h: num_experts x the grid's most
            # blocks; none for the blocks path), written before the grid-wide barrier, read after it
            scratch=[Out("scratch", dtype="'int32'",
                         shape="[num_experts * max(min(32768 // max(num_experts, 1), 128), 1) "
                               "if topk_idx.shape[0] * topk_idx.shape[1] > 4096 else 0]")],
            returns=["pos_to_expert", "pos_to_token", "pos_to_token_topk", "token_topk_to_pos", "expert_start",
                     "expert_end", "num_tokens_per_expert"],
            dims=[("rows", _ROWS)],
            reference="tile_kernels_aot.torch.moe.get_fused_mapping",
            wrapper="tile_kernels_aot.wrappers.get_fused_mapping",
            samples=SAMPLES,
            token_dim=None,  # a pair's row depends on every earlier token
            doc=(
                "get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync=False) -> "
                "(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end, "
                "num_tokens_per_expert, num_tokens_per_expert_list): every routed (token, k) pair placed in the "
                "expert-major fused layout, pairs of an expert in flat order t * num_topk + k; each expert's block "
                "is its count rounded up to alignment; padding rows hold -1.  topk_idx: int64 [num_tokens, num_topk], "
                "contiguous; entries outside [0, num_experts) are unrouted (the reference refuses entries >= "
                "num_experts).  num_experts <= 1024.  num_expanded_tokens == 0 (and not force_no_sync): the rows are "
                "exactly sum(aligned counts), learnt with one host sync, and the list holds the aligned counts; "
                "otherwise nothing synchronizes (CUDA-graph safe), the row outputs have num_expanded_tokens rows and "
                "the list is []; pairs whose row would be past them are not placed (token_topk_to_pos -1)."
            ),
        ),
    ],
)
