"""quant.swiglu_forward_and_per_token_cast: one kernel per (input dtype, scale-factor format,
row mode, plain); the token count, hidden size and the options' values are run-time values.
``plain`` configs have the option flags compiled out: calls without optional inputs run them;
``plain = 2`` is the clamp-counting kernel (bf16, groups of 128), ``plain = 3`` the routed
kernel (bf16, groups of 128, pos_to_expert alone, packed UE8M0), ``plain = 4`` the routed kernel
counting its clamps (a positive bf16 clamp value), launched twice (the rows, then the sum of
their counts through the scratch ``row_counts``), see kernel.py."""

from kernels_tl.schema import Bool, Float, Int, Op, Out, Param, Rand, Randint, Randn, Routed, Routing, Sample, Schema, Str, Tensor


def _moe_sample(name: str, tokens: int, hidden: int, **options) -> Sample:
    """A routed call: positions map to (token, k) pairs of 4-way top-k, some rows skipped."""
    return Sample(name, tokens, [Randn(["T", 2 * hidden], "bfloat16"), "e4m3", 128], {
        "pos_to_token_topk": Randint(["T"], "int32", -1, 4 * tokens),
        "topk_weights": Rand([tokens, 4], "float32"),
        "pos_to_expert": Randint(["T"], "int32", -1, 8),
        **options,
    })


def _upstream_moe_sample(name: str, **options) -> Sample:
    """TileKernels' MoE benchmark: 4001 tokens per rank over 8 EP ranks routed top-8 among 72
    experts, the 9 local experts' rows in a fused layout aligned to 16 (padding rows skipped
    through pos_to_expert), hidden 1024, packed UE8M0 factors column-major."""
    return Sample(name, 8 * 4001, [Randn(["P", 2 * 1024], "bfloat16"), "e4m3", 128], {
        "pos_to_expert": Routed("pos_to_expert"), "use_tma_aligned_col_major_sf": True, "round_sf": True,
        "use_packed_ue8m0": True, **options,
    }, routing=Routing(num_topk=8, num_experts=9, alignment=16, ep_ranks=8, exact=True))


SCHEMA = Schema(
    static=("in_dtype", "sf_format", "max_row_hidden", "plain"),
    ops=[
        Op(
            module="quant",
            name="swiglu_forward_and_per_token_cast",
            params=[
                Param("x", Tensor(["bfloat16", "float32"], 2)),
                Param("fmt", Str(["e4m3"])),
                Param("num_per_channels", Int()),
                Param("pos_to_token_topk", Tensor(["int32"], 1, optional=True), None),
                Param("topk_weights", Tensor(["float32"], 2, optional=True), None),
                Param("pos_to_expert", Tensor(["int32"], 1, optional=True), None),
                Param("use_tma_aligned_col_major_sf", Bool(), False),
                Param("round_sf", Bool(), False),
                Param("use_packed_ue8m0", Bool(), False),
                Param("swiglu_clamp_value", Float(optional=True), None),
                Param("clamped_count", Tensor(["int64"], 1, optional=True, mutable=True), None),
                Param("sf_clamp_min", Float(optional=True), None),
            ],
            # host.h outputs(): e4m3 [T, hidden]; fp32 or packed UE8M0 (int32) factors, row-major
            # or column-major with the token dim padded to 4
            dims=[("T", "x.shape[0]"), ("hidden", "x.shape[1] // 2"),
                  ("sf_cols", "ceil_div(hidden // num_per_channels, 4) if use_packed_ue8m0 else hidden // num_per_channels")],
            outs=[Out("out", dtype="'float8_e4m3fn'", shape="[T, hidden]"),
                  Out("out_sf", dtype="'int32' if use_packed_ue8m0 else 'float32'", shape="[T, sf_cols]",
                      strides="[1, align_up(T, 4)] if use_tma_aligned_col_major_sf else None")],
            returns=["out", "out_sf"],
            # the counted routed kernel (plain = 4; host.h, which also asks for a positive bf16 clamp
            # value): a warp's packed counts per row and 512 channels, written by launch 0 and summed
            # by launch 1; the other calls allocate none
            scratch=[Out("row_counts", dtype="'int32'",
                         shape=("[T * ceil_div(hidden, 512)] if clamped_count is not None and pos_to_expert is not None"
                                " and pos_to_token_topk is None and use_packed_ue8m0 and num_per_channels == 128"
                                " and x.element_size() == 2 else [0]"))],
            launches=True,
            reference="tile_kernels_aot.torch.swiglu.swiglu_forward_and_per_token_cast",
            samples=[
                Sample("decode", 128, [Randn(["T", 4096], "bfloat16"), "e4m3", 128]),
                Sample("prefill", 8192, [Randn(["T", 4096], "bfloat16"), "e4m3", 128]),
                _moe_sample("MoE, packed UE8M0", 2000, 1024, use_tma_aligned_col_major_sf=True, round_sf=True,
                            use_packed_ue8m0=True),
                _moe_sample("MoE, clamp 0.5", 2000, 1024, swiglu_clamp_value=0.5),
                _upstream_moe_sample("upstream MoE, packed UE8M0"),
                _upstream_moe_sample("upstream MoE, packed UE8M0, clamp 0.5", swiglu_clamp_value=0.5,
                                     clamped_count=Randint([3], "int64", 0, 1)),
                # the counted routed kernel (plain = 4) with padding lanes (hidden 640: 5 groups in 2
                # grid columns), skipped rows and counters that start non-zero
                Sample("MoE, packed UE8M0, clamp 2 counted, hidden 640", 1000,
                       [Randn(["T", 2 * 640], "bfloat16"), "e4m3", 128], {
                           "pos_to_expert": Randint(["T"], "int32", -1, 8), "use_tma_aligned_col_major_sf": True,
                           "round_sf": True, "use_packed_ue8m0": True, "swiglu_clamp_value": 2.0,
                           "clamped_count": Randint([3], "int64", 0, 1000)}),
                # the counted kernel (plain = 2): the select clamps (0.3 is no bf16 value) with
                # weights, about 22 row blocks per block; the IEEE-divide copy (c <= -64) with
                # padding lanes (hidden 640: 5 groups in 2 grid columns); the packed clamps with
                # weights and row-major fp32 factors; counters that start non-zero
                _moe_sample("MoE, weights, clamp 0.3 counted, hidden 7168", 8192, 7168, use_tma_aligned_col_major_sf=True,
                            round_sf=True, use_packed_ue8m0=True, swiglu_clamp_value=0.3,
                            clamped_count=Randint([3], "int64", 0, 1000)),
                _moe_sample("MoE, clamp -70 counted, hidden 640", 1000, 640, use_tma_aligned_col_major_sf=True,
                            round_sf=True, use_packed_ue8m0=True, swiglu_clamp_value=-70.0,
                            clamped_count=Randint([3], "int64", 0, 1000)),
                _moe_sample("MoE, weights, clamp 2 counted, fp32 sf", 2000, 1024, swiglu_clamp_value=2.0,
                            clamped_count=Randint([3], "int64", 0, 1000)),
                # the counted kernel with column-major fp32 factors rounded to powers of two
                # (round_sf at run time) and the packed clamps
                _moe_sample("MoE, weights, clamp 0.5 counted, column-major rounded sf", 2000, 1024,
                            use_tma_aligned_col_major_sf=True, round_sf=True, swiglu_clamp_value=0.5,
                            clamped_count=Randint([3], "int64", 0, 1000)),
                # a clamp below the -88.5 floor of the bf16 gates, gates reaching below it: the
                # counts of l > c are taken on the raw gates (one group per row: the plain = 0
                # row kernel's IEEE copy; groups of 128: the counted kernel's)
                Sample("one group per row, clamp -100 counted", 300,
                       [Rand(["T", 2 * 1024], "bfloat16", -130.0, 30.0), "e4m3", 1024],
                       {"swiglu_clamp_value": -100.0, "clamped_count": Randint([3], "int64", 0, 1000)}),
                Sample("MoE, clamp -100 counted", 1000, [Rand(["T", 2 * 1024], "bfloat16", -130.0, 30.0), "e4m3", 128], {
                    "pos_to_expert": Randint(["T"], "int32", -1, 8), "swiglu_clamp_value": -100.0,
                    "clamped_count": Randint([3], "int64", 0, 1000)}),
                Sample("one group per row", 300, [Randn(["T", 2 * 7168], "bfloat16"), "e4m3", 7168]),
                Sample("fp32, column-major sf", 500, [Randn(["T", 2048], "float32"), "e4m3", 128],
                       {"use_tma_aligned_col_major_sf": True}),
            ],
            doc=("SwiGLU forward fused with a per-token FP8 (e4m3) cast: returns (out, out_sf). "
                 "See tile_kernels_aot.torch.swiglu.swiglu_forward_and_per_token_cast for the exact "
                 "arithmetic. Rows with pos_to_expert < 0 are written as zero bytes (out and sf)."),
        ),
    ],
)
