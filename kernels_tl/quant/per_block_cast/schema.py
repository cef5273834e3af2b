"""quant.per_block_cast and its two variants: one kernel per (input dtype, format, tile rows);
the tile width (block_size[1]), token count, hidden size, scale-factor layout and round_sf
are run-time values."""

from kernels_tl.schema import Bool, IntTuple, Op, Out, Param, Rand, Randn, Sample, Schema, Str, Tensor

# the outputs' layout (host.h: data_output, sf_output): e4m3 bytes, or e2m1 packed two per
# int8; the factor grid [ceil(T / bm), ceil(H / bk)] fp32, or packed UE8M0 words int32
# [rows, ceil(cols / 4)]; with use_tma_aligned_col_major_sf column-major, the row dim padded
# to 4 (stride 1 when empty)
DIMS = [("T", "x.shape[0]"), ("H", "x.shape[1]"), ("rows", "ceil_div(T, block_size[0])"),
        ("cols", "ceil_div(H, block_size[1])"), ("sf_cols", "ceil_div(cols, 4) if use_packed_ue8m0 else cols")]
OUT = Out("out", dtype="'float8_e4m3fn' if fmt == 'e4m3' else 'int8'", shape="[T, H if fmt == 'e4m3' else H // 2]")
OUT_SF = Out("out_sf", dtype="'int32' if use_packed_ue8m0 else 'float32'", shape="[rows, sf_cols]",
             strides="[1, sym_max(align_up(rows, 4), 1)] if use_tma_aligned_col_major_sf else None")
FORMS = ["use_tma_aligned_col_major_sf", "round_sf", "use_packed_ue8m0"]


def _params(with_sf: bool) -> list:
    params = [
        Param("x", Tensor(["bfloat16", "float32"], 2)),
        Param("fmt", Str(["e4m3", "e2m1"])),
        Param("block_size", IntTuple(2)),
    ]
    if with_sf:
        params.append(Param("sf", Tensor(["float32"], 2, contiguous=False)))
    return params + [Param(name, Bool(), False) for name in FORMS]


def _forms(tma: bool, round_sf: bool, packed: bool) -> dict:
    return dict(zip(FORMS, (tma, round_sf, packed)))


X = Randn(["T", 7168], "bfloat16")
ROUND = _forms(False, True, False)  # upstream's benchmark form
PACKED = _forms(True, True, True)  # upstream's other tested form


def _samples(*extra) -> list:
    return [
        Sample("decode", 128, [X, "e4m3", (128, 128)], ROUND),
        Sample("prefill", 8192, [X, "e4m3", (128, 128)], ROUND),
        Sample("upstream: 128x128", 8001, [X, "e4m3", (128, 128)], ROUND),
        Sample("upstream: 32x32", 8001, [X, "e4m3", (32, 32)], ROUND),
        Sample("128x128, packed UE8M0, partial last word", 300, [Randn(["T", 576], "bfloat16"), "e4m3", (128, 128)], PACKED),
        Sample("32x32, packed UE8M0", 1000, [Randn(["T", 2560], "bfloat16"), "e4m3", (32, 32)], PACKED),
        Sample("fp32 to e2m1, 32x128, fp32 column-major", 1000, [Randn(["T", 2560], "float32"), "e2m1", (32, 128)],
               _forms(True, False, False)),
        Sample("fp32 to e4m3, 128x128 (512 threads), plain fp32", 1000, [Randn(["T", 4096], "float32"), "e4m3", (128, 128)]),
        Sample("bf16 to e2m1, 128x32, partial tiles", 300, [Randn(["T", 576], "bfloat16"), "e2m1", (128, 32)], PACKED),
        Sample("fp32 to e2m1, 32x32, power-of-two", 77, [Randn(["T", 1024], "float32"), "e2m1", (32, 32)], ROUND),
        *extra,
    ]


def _given(hidden: int, block: tuple) -> Rand:
    """Positive row-major float32 factors over the sample's tile grid."""
    return Rand([f"T/{block[0]}", -(-hidden // block[1])], "float32", 0.001, 0.05)


SCHEMA = Schema(
    static=("in_dtype", "fmt", "block_m"),
    ops=[
        Op(
            module="quant",
            name="per_block_cast",
            params=_params(with_sf=False),
            outs=[OUT, OUT_SF],
            returns=["out", "out_sf"],
            reference="tile_kernels_aot.torch.quant.per_block_cast",
            samples=_samples(
                Sample("fp32 column-major, no rounding, 32x32", 1000, [Randn(["T", 3072], "bfloat16"), "e4m3", (32, 32)],
                       _forms(True, False, False)),
            ),
            dims=DIMS,
            token_dim=None,  # a factor spans block_size[0] rows: rows are not independent
            doc="Quantize x [T, H] (bf16/fp32, contiguous, H % 64 == 0) to e4m3 or packed e2m1 with one scale "
                "factor per block_size = (bm, bk) tile (each 32 or 128); returns (out, out_sf).",
        ),
        Op(
            module="quant",
            name="per_block_cast_with_sf_only",
            params=_params(with_sf=False),
            outs=[OUT_SF],
            returns=["out_sf"],
            reference="tile_kernels_aot.torch.quant.per_block_cast_with_sf_only",
            samples=_samples(),
            dims=DIMS,
            token_dim=None,  # a factor spans block_size[0] rows: rows are not independent
            doc="The out_sf of per_block_cast alone (x is read, nothing else is written).",
        ),
        Op(
            module="quant",
            name="per_block_cast_with_precomputed_sf",
            params=_params(with_sf=True),
            outs=[OUT],
            returns=["out"],
            reference="tile_kernels_aot.torch.quant.per_block_cast_with_precomputed_sf",
            samples=[
                Sample("decode", 128, [X, "e4m3", (128, 128), _given(7168, (128, 128))]),
                Sample("prefill", 8192, [X, "e4m3", (128, 128), _given(7168, (128, 128))]),
                Sample("upstream: 32x32", 8001, [X, "e4m3", (32, 32), _given(7168, (32, 32))]),
                Sample("fp32 to e2m1, 128x32, partial tiles", 300,
                       [Randn(["T", 576], "float32"), "e2m1", (128, 32), _given(576, (128, 32))]),
                # a small call: blocks of 8 rows (2 per row lane), the last one partial
                Sample("32x32, 77 tokens", 77,
                       [Randn(["T", 1024], "bfloat16"), "e4m3", (32, 32), _given(1024, (32, 32))]),
            ],
            dims=DIMS,
            token_dim=None,  # a factor spans block_size[0] rows: rows are not independent
            doc="Quantize x with given row-major float32 factors sf [ceil(T / bm), ceil(H / bk)]: "
                "out = encode(x * (1 / sf)).",
        ),
    ],
)
