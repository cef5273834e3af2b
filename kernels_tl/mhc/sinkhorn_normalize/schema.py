"""mhc.sinkhorn_normalize: one kernel per matrix size n (static); tokens, repeat and eps are run-time values."""

from kernels_tl.schema import Float, Int, Op, Out, Param, Randn, Sample, Schema, Tensor


def _x():
    return Randn(["T", 4, 4], "float32")


SCHEMA = Schema(
    static=("n",),
    ops=[
        Op(
            module="mhc",
            name="sinkhorn_normalize",
            params=[Param("x", Tensor(["float32"], 3)),
                    Param("repeat", Int(), 10),
                    Param("eps", Float(), 1e-6)],
            outs=[Out("out", dtype="'float32'", shape="list(x.shape)")],
            returns=["out"],
            reference="tile_kernels_aot.torch.mhc.sinkhorn_normalize",
            samples=[
                Sample("decode", 128, [_x()]),
                Sample("prefill", 8192, [_x()]),
                # upstream's test: (n0, n1) = (2, 4096) tokens, repeat 20
                Sample("upstream n=2x4096, repeat=20", 8192, [_x(), 20, 1e-6]),
                Sample("3 tokens, repeat=20", 3, [_x(), 20, 1e-6]),
                Sample("repeat=1", 1000, [_x(), 1, 1e-6]),
                Sample("repeat=3, eps=1e-3", 777, [_x(), 3, 1e-3]),
            ],
            doc=("sinkhorn_normalize(x, repeat=10, eps=1e-6) -> out: per token, y = softmax(x, -1) + eps, "
                 "y /= colsum + eps, then repeat - 1 times y /= rowsum + eps; y /= colsum + eps (float32, "
                 "sums left to right, true divisions).  x: float32 [num_tokens, n, n], contiguous."),
        ),
    ],
)
