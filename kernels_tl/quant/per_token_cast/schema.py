"""quant.per_token_cast and its two variants: one kernel per (input dtype, format, group size);
the token count, hidden size, row stride, scale-factor layout and round_sf are run-time values.
A pre-quantized (data, sf) input (data float8_e4m3fn or int8) is its own kernel per (data dtype,
format), with the group size, x_block_size and the input's sf form at run time (static group 0)."""

from kernels_tl.schema import (Bool, Int, IntTuple, Op, Out, Param, Quantized, QuantizedTensor, Rand, Randn, Sample,
                               Schema, Str, Tensor)

# the outputs' layout (host.h: data_output, sf_output): e4m3 bytes, e2m1 packed two per int8,
# or e5m6 packed eight per 12 bytes (uint8); fp32 factors [T, groups], or packed UE8M0 words
# int32 [T, ceil(groups / 4)]; with use_tma_aligned_col_major_sf column-major, the token dim
# padded to 4 (stride 1 when empty).  H counts values: a pre-quantized int8 x holds two per byte.
DIMS = [("T", "x.shape[0]"), ("H", "x.shape[1] * (1 if x.dtype.is_floating_point else 2)"),
        ("groups", "ceil_div(H, num_per_channels)"),
        ("sf_cols", "ceil_div(groups, 4) if use_packed_ue8m0 else groups")]
OUT = Out("out", dtype="'float8_e4m3fn' if fmt == 'e4m3' else 'int8' if fmt == 'e2m1' else 'uint8'",
          shape="[T, H if fmt == 'e4m3' else H // 2 if fmt == 'e2m1' else H // 2 * 3]")
OUT_SF = Out("out_sf", dtype="'int32' if use_packed_ue8m0 else 'float32'", shape="[T, sf_cols]",
             strides="[1, sym_max(align_up(T, 4), 1)] if use_tma_aligned_col_major_sf else None")


def _params(with_sf: bool) -> list:
    params = [
        # a pre-quantized (data, sf) pair (per_token_cast only) takes x_block_size: the blocks of its sf
        Param("x", QuantizedTensor(["float8_e4m3fn", "int8"], ["float32", "int32"], 2,
                                   plain_dtypes=["bfloat16", "float32"], contiguous=False)),
        # e5m6: per_token_cast of a plain x with one group per row only
        Param("fmt", Str(["e4m3", "e2m1", "e5m6"])),
        Param("num_per_channels", Int()),
    ]
    if with_sf:
        params.append(Param("sf", Tensor(["float32"], 2, contiguous=False)))
    return params + [
        Param("x_block_size", IntTuple(2, optional=True), None),
        Param("use_tma_aligned_col_major_sf", Bool(), False),
        Param("round_sf", Bool(), False),
        Param("use_packed_ue8m0", Bool(), False),
    ]


def _samples(*extra) -> list:
    x = Randn(["T", 7168], "bfloat16")
    return [
        Sample("decode", 128, [x, "e4m3", 128]),
        Sample("prefill", 8192, [x, "e4m3", 128]),
        Sample("upstream: packed UE8M0, TMA-aligned", 8001, [x, "e4m3", 128],
               {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True}),
        Sample("upstream: fp32, packed UE8M0, TMA-aligned", 8001, [Randn(["T", 7168], "float32"), "e4m3", 128],
               {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True}),
        Sample("fp32 to e2m1, group 32", 1000, [Randn(["T", 2048], "float32"), "e2m1", 32]),
        Sample("group 16", 1000, [Randn(["T", 4096], "bfloat16"), "e4m3", 16]),
        Sample("group 16, e2m1, packed UE8M0", 1000, [Randn(["T", 2560], "bfloat16"), "e2m1", 16],
               {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True}),
        *extra,
    ]


# (data, sf) inputs: every input format x sf form, both x_block_size of upstream's test
_FORMS = {
    "fp32": {},
    "fp32 pow2": {"round_sf": True},
    "fp32 col-major": {"use_tma_aligned_col_major_sf": True},
    "packed UE8M0": {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True},
}


def _quantized_samples() -> list:
    samples = []
    for in_fmt in ("e4m3", "e2m1"):
        for form, flags in _FORMS.items():
            for block, fmt, npc in (((128, 128), "e4m3", 128), ((32, 32), "e2m1", 32)):
                samples.append(Sample(
                    f"pre-quantized {in_fmt}, {form} sf, block {block[0]}x{block[1]}, to {fmt} g{npc}", 1000,
                    [Quantized(["T", 3072], in_fmt, block, **flags), fmt, npc],
                    {"x_block_size": block, **flags}))
    samples += [
        Sample("pre-quantized e4m3 block 32x32 to e4m3 g128 (factors vary in a group)", 1000,
               [Quantized(["T", 2560], "e4m3", (32, 32), round_sf=True), "e4m3", 128],
               {"x_block_size": (32, 32), "round_sf": True}),
        Sample("pre-quantized e2m1 to e2m1 g16, hidden 576", 1000,
               [Quantized(["T", 576], "e2m1", (128, 128), round_sf=True), "e2m1", 16],
               {"x_block_size": (128, 128), "round_sf": True}),
        Sample("upstream: pre-quantized e4m3, packed UE8M0", 8001,
               [Quantized(["T", 7168], "e4m3", (128, 128), True, True, True), "e4m3", 128],
               {"x_block_size": (128, 128), "use_tma_aligned_col_major_sf": True, "round_sf": True,
                "use_packed_ue8m0": True}),
        Sample("upstream: pre-quantized e2m1, packed UE8M0", 8001,
               [Quantized(["T", 7168], "e2m1", (32, 32), True, True, True), "e2m1", 32],
               {"x_block_size": (32, 32), "use_tma_aligned_col_major_sf": True, "round_sf": True,
                "use_packed_ue8m0": True}),
    ]
    return samples


def _e5m6_samples() -> list:
    flags = {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True}
    return [
        Sample("upstream: e5m6", 8001, [Randn(["T", 7168], "bfloat16"), "e5m6", 7168], {"round_sf": True}),
        Sample("upstream: e5m6, packed UE8M0", 8001, [Randn(["T", 7168], "bfloat16"), "e5m6", 7168], flags),
        Sample("e5m6 fp32, hidden 576", 1000, [Randn(["T", 576], "float32"), "e5m6", 576]),
        Sample("e5m6 fp32, hidden 2056 (a multiple of 8 only), col-major", 300,
               [Randn(["T", 2056], "float32"), "e5m6", 2056], {"use_tma_aligned_col_major_sf": True}),
        # bf16 takes the short rounding only with a power-of-two factor inverse >= 1 (round_sf, amax <= MAX)
        Sample("e5m6 bf16, hidden 2056 (257 pieces), fp32 factors: general rounding", 300,
               [Randn(["T", 2056], "bfloat16"), "e5m6", 2056]),
        Sample("e5m6 bf16, |x| < 2e5, round_sf (factor inverse 1/4: general rounding)", 300,
               [Rand(["T", 1024], "bfloat16", -2e5, 2e5), "e5m6", 1024], {"round_sf": True}),
        Sample("e5m6 bf16, hidden 8 (one lane per row), round_sf", 1000, [Randn(["T", 8], "bfloat16"), "e5m6", 8],
               {"round_sf": True}),
        Sample("e5m6 bf16, hidden 200 (25 pieces), packed UE8M0", 301, [Randn(["T", 200], "bfloat16"), "e5m6", 200],
               flags),
    ]


SCHEMA = Schema(
    static=("in_dtype", "fmt", "group"),
    ops=[
        Op(
            module="quant",
            name="per_token_cast",
            params=_params(with_sf=False),
            outs=[OUT, OUT_SF],
            returns=["out", "out_sf"],
            reference="tile_kernels_aot.torch.quant.per_token_cast",
            samples=_samples(Sample("one group per row", 300, [Randn(["T", 7168], "bfloat16"), "e4m3", 7168]),
                             *_e5m6_samples(), *_quantized_samples()),
            dims=DIMS,
            doc="Quantize x [T, H] (bf16/fp32, or a pre-quantized (data, sf) pair with x_block_size) to e4m3, "
                "packed e2m1 or packed e5m6 with one scale factor per group of num_per_channels channels of a "
                "row; returns (out, out_sf).",
        ),
        Op(
            module="quant",
            name="per_token_cast_with_sf_only",
            params=_params(with_sf=False),
            outs=[OUT_SF],
            returns=["out_sf"],
            reference="tile_kernels_aot.torch.quant.per_token_cast_with_sf_only",
            # float32 in groups of 128 takes the warp layout here (8 groups per warp): a partial last
            # group and warp, fp32 factors row-major and column-major
            samples=_samples(
                Sample("fp32 g128, hidden 576 (a partial group)", 1000, [Randn(["T", 576], "float32"), "e4m3", 128]),
                Sample("fp32 to e2m1 g128, hidden 4224 (33 groups), col-major", 1001,
                       [Randn(["T", 4224], "float32"), "e2m1", 128], {"use_tma_aligned_col_major_sf": True}),
            ),
            dims=DIMS,
            doc="The out_sf of per_token_cast alone (x is read, nothing else is written).",
        ),
        Op(
            module="quant",
            name="per_token_cast_with_precomputed_sf",
            params=_params(with_sf=True),
            outs=[OUT],
            returns=["out"],
            reference="tile_kernels_aot.torch.quant.per_token_cast_with_precomputed_sf",
            samples=[
                Sample("decode", 128, [Randn(["T", 7168], "bfloat16"), "e4m3", 128, Randn(["T", 56], "float32")]),
                Sample("prefill", 8192, [Randn(["T", 7168], "bfloat16"), "e4m3", 128, Randn(["T", 56], "float32")]),
                Sample("fp32 to e2m1, group 32", 1000,
                       [Randn(["T", 2048], "float32"), "e2m1", 32, Randn(["T", 64], "float32")]),
                Sample("group 16", 1000, [Randn(["T", 2048], "bfloat16"), "e4m3", 16, Randn(["T", 128], "float32")]),
            ],
            dims=DIMS,
            doc="Quantize x with given row-major float32 factors sf [T, groups]: out = encode(x * (1 / sf)).",
        ),
    ],
)
