"""quant.per_token_cast and its two variants: one kernel per (input dtype, format, group size);
the token count, hidden size, row stride, scale-factor layout and round_sf are run-time values."""

from kernels_tl.schema import Bool, Int, IntTuple, Op, Out, Param, QuantizedTensor, Randn, Sample, Schema, Str, Tensor

# the outputs' layout (host.h: data_output, sf_output): e4m3 bytes, or e2m1 packed two per
# int8; fp32 factors [T, groups], or packed UE8M0 words int32 [T, ceil(groups / 4)]; with
# use_tma_aligned_col_major_sf column-major, the token dim padded to 4 (stride 1 when empty)
DIMS = [("T", "x.shape[0]"), ("H", "x.shape[1]"), ("groups", "ceil_div(H, num_per_channels)"),
        ("sf_cols", "ceil_div(groups, 4) if use_packed_ue8m0 else groups")]
OUT = Out("out", dtype="'float8_e4m3fn' if fmt == 'e4m3' else 'int8'", shape="[T, H if fmt == 'e4m3' else H // 2]")
OUT_SF = Out("out_sf", dtype="'int32' if use_packed_ue8m0 else 'float32'", shape="[T, sf_cols]",
             strides="[1, sym_max(align_up(T, 4), 1)] if use_tma_aligned_col_major_sf else None")


def _params(with_sf: bool) -> list:
    params = [
        # a pre-quantized (data, sf) pair is upstream's x_block_size path: refused by this build
        Param("x", QuantizedTensor(["float8_e4m3fn", "int8"], ["float32", "int32"], 2,
                                   plain_dtypes=["bfloat16", "float32"], contiguous=False)),
        # e5m6 is upstream's per_token_cast_to_e5m6 path: refused by this build
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
        Sample("fp32 to e2m1, group 32", 1000, [Randn(["T", 2048], "float32"), "e2m1", 32]),
        *extra,
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
            samples=_samples(Sample("one group per row", 300, [Randn(["T", 7168], "bfloat16"), "e4m3", 7168])),
            dims=DIMS,
            doc="Quantize x [T, H] (bf16/fp32) to e4m3 or packed e2m1 with one scale factor per group of "
                "num_per_channels channels of a row; returns (out, out_sf).",
        ),
        Op(
            module="quant",
            name="per_token_cast_with_sf_only",
            params=_params(with_sf=False),
            outs=[OUT_SF],
            returns=["out_sf"],
            reference="tile_kernels_aot.torch.quant.per_token_cast_with_sf_only",
            samples=_samples(),
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
            ],
            dims=DIMS,
            doc="Quantize x with given row-major float32 factors sf [T, groups]: out = encode(x * (1 / sf)).",
        ),
    ],
)
