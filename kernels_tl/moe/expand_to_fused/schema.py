"""moe.expand_to_fused and moe.expand_to_fused_with_sf: one kernel (a byte copy) for every dtype,
hidden size, top-k and scale-factor layout; every dim is a run-time value."""

from kernels_tl.schema import (Bool, Int, Op, Out, Param, QuantizedTensor, Randint, Randn, Routed, Routing, Sample,
                               Schema, Tensor)

# the kernel moves bytes: any dtype whose rows are whole 16-byte vectors
DATA_DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"]
POSITIONS = [Routed("token_topk_to_pos"), Routed("pos_to_expert")]

# Routings: DeepSeek-V3-like top-8 over 32 local experts, every slot routed; upstream's
# benchmark layout (4001 tokens per rank x 8 EP ranks, 72 or 256 experts over 8 ranks: the
# tokens with at least one local expert, about 1.47 of 8 slots routed, rows sized exactly)
DENSE = Routing(num_topk=8, num_experts=32)
UPSTREAM_9 = Routing(num_topk=8, num_experts=9, unrouted=0.8165, exact=True)
UPSTREAM_32 = Routing(num_topk=8, num_experts=32, unrouted=0.816, exact=True)
# the MoE layer's no-sync mapping (tile_kernels_aot.moe_layer): 256 experts, alignment 16, rows
# sized at the bound, so at decode most rows (3840 of 4864) are padding
LAYER = Routing(num_topk=8, num_experts=256, alignment=16)


def _x(hidden: int, dtype: str = "bfloat16"):
    return Randn(["T", hidden], dtype)


def _q(hidden: int, sf_cols: int, packed: bool = False):
    """An e4m3 (data, sf) pair: fp32 factors, or packed UE8M0 words (any bits: they are copied)."""
    sf = Randint(["T", sf_cols], "int32", -2**31, 2**31 - 1) if packed else Randn(["T", sf_cols], "float32")
    return (Randn(["T", hidden], "float8_e4m3fn"), sf)


EXPAND = Op(
    module="moe",
    name="expand_to_fused",
    params=[
        Param("x", Tensor(DATA_DTYPES, 2)),
        Param("token_topk_to_pos", Tensor(["int32"], 2)),
        Param("pos_to_expert", Tensor(["int32"], 1)),
    ],
    outs=[Out("out", dtype="x.dtype", shape="[pos_to_expert.shape[0], x.shape[1]]")],
    returns=["out"],
    reference="tile_kernels_aot.torch.moe.expand_to_fused",
    samples=[
        Sample("decode", 128, [_x(7168), *POSITIONS], routing=DENSE),
        Sample("prefill", 8192, [_x(7168), *POSITIONS], routing=DENSE),
        Sample("upstream: 9 experts", 21804, [_x(7168), *POSITIONS], routing=UPSTREAM_9),
        Sample("upstream: 32 experts", 21744, [_x(7168), *POSITIONS], routing=UPSTREAM_32),
        Sample("alignment 128, unrouted, e4m3", 3000, [_x(2048, "float8_e4m3fn"), *POSITIONS],
               routing=Routing(num_topk=6, num_experts=16, alignment=128, unrouted=0.3)),
        Sample("top-9, alignment 16, fp32", 1000, [_x(4096, "float32"), *POSITIONS],
               routing=Routing(num_topk=9, num_experts=36, alignment=16, unrouted=0.1)),
        Sample("top-1, hidden 576", 2000, [_x(576), *POSITIONS],
               routing=Routing(num_topk=1, num_experts=8, alignment=4)),
        # 8 lanes of up to 5 vectors (36 vectors), 4 tokens per warp
        Sample("hidden 576 e4m3, many tokens", 20000, [_x(576, "float8_e4m3fn"), *POSITIONS],
               routing=Routing(num_topk=2, num_experts=8, alignment=32, unrouted=0.3)),
        # 96 lanes (3 warps) per token, 2 tokens per block and its last warp idle
        Sample("hidden 6144, 2 tokens per block", 256, [_x(6144), *POSITIONS],
               routing=Routing(num_topk=4, num_experts=16, alignment=8, unrouted=0.2)),
        # a row longer than a block at one vector per lane: the flat index (tokens across blocks)
        Sample("few tokens, flat index", 16, [_x(7168), *POSITIONS], routing=DENSE),
        # the mostly-padding layout: 4 pieces per row dealt over 267 padding blocks beside 128 copy
        # blocks (one wave), most rows zeroed
        Sample("MoE layer decode: 256 experts, mostly padding rows", 128, [_x(7168), *POSITIONS], routing=LAYER),
    ],
    token_dim=None,  # the output's rows are fused rows, not tokens
    doc=("expand_to_fused(x, token_topk_to_pos, pos_to_expert) -> out [num_expanded_tokens, hidden] of x.dtype: "
         "out[token_topk_to_pos[t, k]] = x[t] for every routed pair (bit copies), zero rows where "
         "pos_to_expert < 0.  The mapping must be consistent (get_fused_mapping's): rows that are neither "
         "padding nor the target of a pair are left unwritten."),
)

EXPAND_WITH_SF = Op(
    module="moe",
    name="expand_to_fused_with_sf",
    params=[
        Param("x", QuantizedTensor(DATA_DTYPES, ["float32", "int32"], 2)),
        Param("num_per_channels", Int()),
        Param("token_topk_to_pos", Tensor(["int32"], 2)),
        Param("pos_to_expert", Tensor(["int32"], 1)),
        Param("use_tma_aligned_col_major_sf", Bool(), False),
    ],
    dims=[("NE", "pos_to_expert.shape[0]")],
    outs=[Out("out", dtype="x.dtype", shape="[NE, x.shape[1]]"),
          # row-major, or a transposed view of a [sf_cols, align(NE, 4)] buffer (stride 1 when empty)
          Out("out_sf", dtype="x_sf.dtype", shape="[NE, x_sf.shape[1]]",
              strides="[1, sym_max(align_up(NE, 4), 1)] if use_tma_aligned_col_major_sf else None")],
    returns=["out", "out_sf"],
    reference="tile_kernels_aot.torch.moe.expand_to_fused_with_sf",
    samples=[
        Sample("decode", 128, [_q(7168, 56), 128, *POSITIONS], routing=DENSE),
        Sample("prefill", 8192, [_q(7168, 56), 128, *POSITIONS], routing=DENSE),
        Sample("upstream: 9 experts", 21913, [_q(7168, 56), 128, *POSITIONS], routing=UPSTREAM_9),
        Sample("upstream: 32 experts", 21861, [_q(7168, 56), 128, *POSITIONS], routing=UPSTREAM_32),
        Sample("column-major fp32, group 32, alignment 128", 3000, [_q(4096, 128), 32, *POSITIONS],
               {"use_tma_aligned_col_major_sf": True},
               routing=Routing(num_topk=8, num_experts=16, alignment=128, unrouted=0.2)),
        Sample("packed UE8M0, group 32", 2000, [_q(7168, 56, packed=True), 32, *POSITIONS],
               {"use_tma_aligned_col_major_sf": True},
               routing=Routing(num_topk=8, num_experts=32, alignment=64, unrouted=0.1)),
        Sample("hidden 576, 5 factors, top-9", 1000, [_q(576, 5), 128, *POSITIONS],
               routing=Routing(num_topk=9, num_experts=72, alignment=8, unrouted=0.3)),
        # 8 lanes of up to 5 vectors, a factor per lane, 4 tokens per warp, column-major
        Sample("hidden 576, 5 factors, many tokens", 20000, [_q(576, 5), 128, *POSITIONS],
               {"use_tma_aligned_col_major_sf": True},
               routing=Routing(num_topk=2, num_experts=8, alignment=32, unrouted=0.3)),
        # 448 lanes of one vector over two blocks (the flat index), the factors on the first 56
        Sample("few tokens, flat index", 8, [_q(7168, 56), 128, *POSITIONS], routing=DENSE),
        # the mostly-padding layout: 2 pieces per row (and the factors with the first) over 267
        # padding blocks, most rows zeroed
        Sample("MoE layer decode: 256 experts, mostly padding rows", 128, [_q(7168, 56), 128, *POSITIONS],
               routing=LAYER),
    ],
    token_dim=None,  # the outputs' rows are fused rows, not tokens
    doc=("expand_to_fused_with_sf((data, sf), num_per_channels, token_topk_to_pos, pos_to_expert, "
         "use_tma_aligned_col_major_sf=False) -> (out, out_sf): expand_to_fused of the data and of its "
         "scale-factor rows (fp32 [T, ceil(H / num_per_channels)], or packed UE8M0 int32 [T, ceil(ceil(H / "
         "num_per_channels) / 4)] with the column-major layout), padding rows zero.  out_sf is row-major, or "
         "column-major with strides (1, align(num_expanded_tokens, 4))."),
)

SCHEMA = Schema(static=(), ops=[EXPAND, EXPAND_WITH_SF])
