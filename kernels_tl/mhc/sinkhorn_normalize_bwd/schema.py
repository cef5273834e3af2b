"""mhc.sinkhorn_normalize_bwd: one kernel per (n, max_repeat) (static); tokens, repeat <= max_repeat and eps are
run-time values."""

from kernels_tl.schema import Float, Int, Op, Out, Param, Randn, Sample, Schema, Tensor


def _args(*rest):
    return [Randn(["T", 4, 4], "float32"), Randn(["T", 4, 4], "float32"), *rest]


SCHEMA = Schema(
    static=("n", "max_repeat"),
    ops=[
        Op(
            module="mhc",
            name="sinkhorn_normalize_bwd",
            params=[Param("grad_output", Tensor(["float32"], 3)),
                    Param("x", Tensor(["float32"], 3)),
                    Param("repeat", Int(), 10),
                    Param("eps", Float(), 1e-6)],
            outs=[Out("grad_input", dtype="'float32'", shape="list(x.shape)")],
            returns=["grad_input"],
            reference="tile_kernels_aot.torch.mhc.sinkhorn_normalize_bwd",
            samples=[
                Sample("decode", 128, _args()),
                Sample("prefill", 8192, _args()),
                # upstream's test: (n0, n1) = (2, 4096) tokens, repeat 20
                Sample("upstream n=2x4096, repeat=20", 8192, _args(20, 1e-6)),
                Sample("3 tokens, repeat=20", 3, _args(20, 1e-6)),
                Sample("repeat=1", 1000, _args(1, 1e-6)),
                Sample("repeat=13, eps=1e-3", 777, _args(13, 1e-3)),
            ],
            doc=("sinkhorn_normalize_bwd(grad_output, x, repeat=10, eps=1e-6) -> grad_input: recompute the forward "
                 "steps, then g = (g - sum_axis(g * u) / (S + eps)) / (S + eps) backwards and (g - rowsum(g * p)) * p "
                 "through the softmax (float32, sums left to right).  grad_output, x: float32 [num_tokens, n, n]."),
        ),
    ],
)
