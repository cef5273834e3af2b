"""quant.unpack_from_e2m1fn_x2: one kernel per output dtype (float32, bfloat16, float16); the
shape, leading dims and row stride are run-time values."""

from kernels_tl.schema import Dtype, Op, Out, Param, Randint, Sample, Schema, Tensor, TorchDtype

OUT_DTYPES = ["float32", "bfloat16", "float16"]


def packed(*shape, dtype="int8"):
    """Random packed bytes (every byte value, so every nibble pair, appears in a few thousand)."""
    low, high = (-128, 128) if dtype == "int8" else (0, 256)
    return Randint(list(shape), dtype, low, high)


SCHEMA = Schema(
    static=("out_dtype",),
    ops=[
        Op(
            module="quant",
            name="unpack_from_e2m1fn_x2",
            params=[Param("x", Tensor(["int8", "uint8"], 1, contiguous=False, leading=True)),
                    Param("out_dtype", Dtype(OUT_DTYPES), "float32")],
            outs=[Out("out", dtype="out_dtype", shape="list(x.shape[:-1]) + [x.shape[-1] * 2]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.quant.unpack_from_e2m1fn_x2",
            samples=[
                # a decode step's e2m1 activations (hidden 7168 packed in 3584 bytes), to float32
                Sample("decode", 128, [packed("T", 3584)]),
                Sample("prefill", 8192, [packed("T", 3584)]),
                Sample("uint8 to bfloat16", 1000, [packed("T", 3584, dtype="uint8"), TorchDtype("bfloat16")]),
                Sample("int8 to float16", 777, [packed("T", 2048), TorchDtype("float16")]),
                Sample("float32 given by keyword", 300, [packed("T", 512, dtype="uint8")],
                       {"out_dtype": TorchDtype("float32")}),
                Sample("3-D [T, 4, 448] uint8 to bfloat16", 500, [packed("T", 4, 448, dtype="uint8"),
                                                                  TorchDtype("bfloat16")]),
                # odd row lengths: the flat contiguous view's last chunk is partial
                Sample("odd L 1001 to float32", 333, [packed("T", 1001)]),
                Sample("odd L 77 uint8 to float16", 129, [packed("T", 77, dtype="uint8"), TorchDtype("float16")]),
                Sample("1-D [T] to bfloat16", 4099, [packed("T"), TorchDtype("bfloat16")]),
            ],
            wrapper="tile_kernels_aot.wrappers.unpack_from_e2m1fn_x2",
            doc="Decode packed FP4 (E2M1) bytes x (int8 or uint8 [..., L], low nibble first) to out_dtype "
                "(torch.float32, torch.bfloat16 or torch.float16) [..., 2L]; nibble 8 is -0.0.",
        ),
    ],
)
