"""quant.cast_back and quant.per_token_cast_back: one kernel per (input format, output dtype);
the token count, hidden size, block shape, scale-factor dtype (fp32 or packed UE8M0) and the
factors' strides are run-time values."""

from kernels_tl.schema import (Int, IntTuple, Op, Out, Param, QuantizedTensor, Rand, Randint, Randn, Sample, Schema,
                               Str)

# the data's logical width: e4m3 one code per byte, e2m1 two, e5m6 two per three bytes
DIMS = [("T", "x.shape[0]"),
        ("H", "x.shape[1] * 2 // 3 if x_special_fmt == 'e5m6' else x.shape[1] if x.dtype.is_floating_point "
              "else x.shape[1] * 2")]
OUT = Out("out", dtype="'bfloat16' if fmt == 'bf16' else 'float32'", shape="[T, H]")


def _x():
    return Param("x", QuantizedTensor(["float8_e4m3fn", "int8", "uint8"], ["float32", "int32"], 2))


FMT = Param("fmt", Str(["bf16", "fp32"]))
SPECIAL = Param("x_special_fmt", Str(["e5m6"], optional=True), None)

# Sample inputs.  Codes: e4m3 as randn values cast to e4m3 (no NaN code), or every byte
# (uint8 draws over the byte range viewed as e4m3, NaN codes 0x7F / 0xFF included: the
# reference propagates them, and the kernel decodes them to torch's own NaN bits); e2m1 and
# e5m6 as random bytes (every nibble is a value; e5m6 codes with exponent 31 are inf / NaN
# halves, widened like the reference's float16 -> float32).  Factors: fp32 uniform in
# [2^-10, 2); packed UE8M0 words of four random exponent bytes in [112, 143) (2^-15 .. 2^15),
# or every byte (0 = 0.0 and 0xFF = inf included) in the every-code sample.
H = 7168


def e4m3(hidden=H):
    return Randn(["T", hidden], "float8_e4m3fn")


def e4m3_every_code(hidden=H):
    return Randint(["T", hidden], "uint8", 0, 256, view="float8_e4m3fn")


def e2m1(hidden=H):
    return Randint(["T", hidden // 2], "int8", -128, 128)


def e5m6(hidden=H):
    return Randint(["T", hidden * 3 // 2], "uint8", 0, 256)


def fp32_sf(rows, cols, layout="row"):
    return Rand([rows, cols], "float32", 2.0**-10, 2.0, layout=layout)


def ue8m0_sf(rows, words, low=112, high=143):
    """Packed exponent words (four bytes in [low, high) each), TMA-aligned column-major (the
    form upstream's casts write them in)."""
    return Randint([rows, 4 * words], "uint8", low, high, layout="tma_col", view="int32")


def _cast_back_samples():
    g = "T"  # per-token factor rows
    return [
        Sample("decode", 128, [(e4m3(), fp32_sf(g, H // 128)), "bf16", (1, 128)]),
        Sample("prefill", 8192, [(e4m3(), fp32_sf(g, H // 128)), "bf16", (1, 128)]),
        Sample("upstream: per-token, g128", 8001, [(e4m3(), fp32_sf(g, H // 128)), "bf16", (1, 128)]),
        Sample("upstream: per-token, packed UE8M0, TMA-aligned", 8001,
               [(e4m3(), ue8m0_sf(g, H // 512)), "bf16", (1, 128)]),
        Sample("upstream: 128x128 blocks", 8001, [(e4m3(), fp32_sf("T/128", H // 128)), "bf16", (128, 128)]),
        Sample("upstream: e5m6, one group per row", 8001,
               [(e5m6(), fp32_sf(g, 1)), "bf16", (1, H)], {"x_special_fmt": "e5m6"}),
        Sample("upstream: e5m6, packed UE8M0, TMA-aligned", 8001,
               [(e5m6(), ue8m0_sf(g, 1)), "bf16", (1, H)], {"x_special_fmt": "e5m6"}),
        Sample("32x32 blocks, TMA-aligned fp32, to fp32", 1000,
               [(e4m3(2048), fp32_sf("T/32", 64, "tma_col")), "fp32", (32, 32)]),
        Sample("per-channel (128, 1), hidden 576", 300, [(e4m3(576), fp32_sf("T/128", 576)), "bf16", (128, 1)]),
        Sample("e2m1, g16, packed UE8M0", 777, [(e2m1(2560), ue8m0_sf(g, 40)), "bf16", (1, 16)]),
        Sample("e2m1, 128x32 blocks, to fp32", 500, [(e2m1(4096), fp32_sf("T/128", 128)), "fp32", (128, 32)]),
        Sample("e5m6, g64, TMA-aligned fp32, to fp32", 333,
               [(e5m6(1024), fp32_sf(g, 16, "tma_col")), "fp32", (1, 64)], {"x_special_fmt": "e5m6"}),
        Sample("every e4m3 code, every UE8M0 byte", 200,
               [(e4m3_every_code(3072), ue8m0_sf("T/32", 6, 0, 256)), "fp32", (32, 128)]),
    ]


def _per_token_samples():
    g = "T"
    return [
        Sample("decode", 128, [(e4m3(), fp32_sf(g, H // 128)), "bf16", 128]),
        Sample("prefill", 8192, [(e4m3(), fp32_sf(g, H // 128)), "bf16", 128]),
        Sample("upstream: packed UE8M0, TMA-aligned", 8001, [(e4m3(), ue8m0_sf(g, H // 512)), "bf16", 128]),
        Sample("e2m1, g32, to fp32", 1000, [(e2m1(2048), fp32_sf(g, 64)), "fp32", 32]),
        Sample("e5m6, one group per row, hidden 5120", 1000,
               [(e5m6(5120), fp32_sf(g, 1)), "bf16", 5120], {"x_special_fmt": "e5m6"}),
    ]


SCHEMA = Schema(
    static=("in_fmt", "out_dtype"),
    ops=[
        Op(
            module="quant",
            name="cast_back",
            params=[_x(), FMT, Param("x_block_size", IntTuple(2)), SPECIAL],
            outs=[OUT],
            returns=["out"],
            reference="tile_kernels_aot.torch.quant.cast_back",
            samples=_cast_back_samples(),
            dims=DIMS,
            # rows of the factor grid are blocks of bm tokens: a slice of the tokens is not a
            # slice of every argument
            token_dim=None,
            doc="Dequantize x = (data, sf) (e4m3, packed e2m1, or packed e5m6 with x_special_fmt='e5m6'; "
                "factors over x_block_size blocks, fp32 or packed UE8M0, any strides) to bf16 or fp32: "
                "out = round(float32(q) * sf).",
        ),
        Op(
            module="quant",
            name="per_token_cast_back",
            params=[_x(), FMT, Param("num_per_channels", Int()), SPECIAL],
            outs=[OUT],
            returns=["out"],
            reference="tile_kernels_aot.torch.quant.per_token_cast_back",
            samples=_per_token_samples(),
            dims=DIMS,
            doc="cast_back(x, fmt, (1, num_per_channels), x_special_fmt).",
        ),
    ],
)
