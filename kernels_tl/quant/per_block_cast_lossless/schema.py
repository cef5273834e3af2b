"""quant.per_block_cast_lossless: one kernel per output tile height (1, 32, 128); the output tile
width, token count, hidden and both scale-factor layouts are run-time values."""

from kernels_tl.schema import Bool, Exp2, IntTuple, Op, Out, Param, QuantizedTensor, Randint, Sample, Schema, Str

# x is the data of the (data, sf) pair (the custom op takes x and x_sf)
DIMS = [("T", "x.shape[0]"), ("H", "2 * x.shape[1]"), ("rows", "ceil_div(T, out_block_size[0])"),
        ("cols", "ceil_div(H, out_block_size[1])"), ("sf_cols", "ceil_div(cols, 4) if use_packed_ue8m0 else cols")]
FORMS = ["use_tma_aligned_col_major_sf", "round_sf", "use_packed_ue8m0"]


def _input(hidden: int, packed: bool = False):
    """FP4 data (any bytes are codes) and power-of-two factors over (1, 32) tiles whose exponents
    span at most 11 binades (the lossless range): fp32, or packed UE8M0 words whose byte 0 varies
    in [0x74, 0x7F] and bytes 1-3 are 0x7A."""
    data = Randint(["T", hidden // 2], "int8", -128, 128)
    if packed:
        return (data, Randint(["T", -(-hidden // 128)], "int32", 0x7A7A7A74, 0x7A7A7A80))
    return (data, Exp2(["T", hidden // 32], "float32", -20, -9))


def _forms(tma: bool, packed: bool) -> dict:
    return dict(zip(FORMS, (tma, True, packed)))


X = _input(7168)

SCHEMA = Schema(
    static=("block_m",),
    ops=[
        Op(
            module="quant",
            name="per_block_cast_lossless",
            params=[
                Param("x", QuantizedTensor(["int8"], ["float32", "int32"], 2)),
                Param("fmt", Str(["e4m3"])),
                Param("x_block_size", IntTuple(2)),
                Param("out_block_size", IntTuple(2)),
                *[Param(name, Bool(), False) for name in FORMS],
            ],
            outs=[
                Out("out", dtype="'float8_e4m3fn'", shape="[T, H]"),
                Out("out_sf", dtype="'int32' if use_packed_ue8m0 else 'float32'", shape="[rows, sf_cols]",
                    strides="[1, sym_max(align_up(rows, 4), 1)] if use_tma_aligned_col_major_sf else None"),
            ],
            returns=["out", "out_sf"],
            reference="tile_kernels_aot.torch.quant.per_block_cast_lossless",
            samples=[
                Sample("decode", 128, [X, "e4m3", (1, 32), (1, 128)], _forms(False, False)),
                Sample("prefill", 8192, [X, "e4m3", (1, 32), (1, 128)], _forms(False, False)),
                Sample("upstream: (1, 32) -> (1, 128)", 8001, [X, "e4m3", (1, 32), (1, 128)], _forms(False, False)),
                Sample("(1, 32) -> (128, 128), packed UE8M0", 8001, [X, "e4m3", (1, 32), (128, 128)], _forms(True, True)),
                Sample("(1, 32) -> (32, 32), fp32 column-major", 1000, [_input(2560), "e4m3", (1, 32), (32, 32)],
                       _forms(True, False)),
                Sample("packed input, (1, 32) -> (128, 128), partial tiles", 300,
                       [_input(576, packed=True), "e4m3", (1, 32), (128, 128)], _forms(False, False)),
                Sample("packed input, (1, 32) -> (1, 64), packed output", 77,
                       [_input(1024, packed=True), "e4m3", (1, 32), (1, 64)], _forms(True, True)),
            ],
            dims=DIMS,
            doc="Re-express FP4 (e2m1, int8 [T, H/2]) with power-of-two factors over (1, 32) tiles as FP8 e4m3 "
                "over out_block_size tiles, exactly; returns (out, out_sf).",
        ),
    ],
)
