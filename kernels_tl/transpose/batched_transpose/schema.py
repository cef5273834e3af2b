"""transpose.transpose and transpose.batched_transpose: one kernel per dtype; batch, rows,
columns and strides are run-time values."""

from kernels_tl.schema import Op, Out, Param, Randn, Sample, Schema, Tensor

DTYPES = ["bfloat16", "float32", "float8_e4m3fn"]

SCHEMA = Schema(
    static=("dtype",),
    ops=[
        Op(
            module="transpose",
            name="batched_transpose",
            params=[Param("x", Tensor(DTYPES, 3, contiguous=False))],
            outs=[Out("out", dtype="x.dtype", shape="[x.shape[0], x.shape[2], x.shape[1]]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.transpose.batched_transpose",
            samples=[
                Sample("decode", 128, [Randn([8, "T", 7168], "bfloat16")]),
                Sample("upstream e4m3", 8064, [Randn([8, "T", 7168], "float8_e4m3fn")]),
                Sample("fp32", 256, [Randn([3, "T", 320], "float32")]),
            ],
            doc=("batched_transpose(x) -> [B, N, M]: out[b, j, i] = x[b, i, j].  x: [B, M, N] bfloat16, float32 or "
                 "float8_e4m3fn, M and N multiples of 64, x.stride(-1) == 1, row and batch strides (and the data "
                 "pointer) multiples of 4 elements; the result is contiguous."),
            token_dim=None,
            token_multiple=64,
        ),
        Op(
            module="transpose",
            name="transpose",
            params=[Param("x", Tensor(DTYPES, 2, contiguous=False))],
            outs=[Out("out", dtype="x.dtype", shape="[x.shape[1], x.shape[0]]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.transpose.transpose",
            samples=[
                Sample("decode", 128, [Randn(["T", 4096], "bfloat16")]),
                Sample("prefill", 8192, [Randn(["T", 4096], "bfloat16")]),
                Sample("upstream bf16", 8064, [Randn(["T", 7168], "bfloat16")]),
                Sample("upstream e4m3", 8064, [Randn(["T", 7168], "float8_e4m3fn")]),
                Sample("fp32", 512, [Randn(["T", 768], "float32")]),
            ],
            doc=("transpose(x) -> [N, M]: out[j, i] = x[i, j].  x: [M, N] bfloat16, float32 or float8_e4m3fn, M and N "
                 "multiples of 64, x.stride(-1) == 1, row stride (and the data pointer) multiples of 4 elements; the "
                 "result is contiguous."),
            token_dim=None,
            token_multiple=64,
        ),
    ],
)
