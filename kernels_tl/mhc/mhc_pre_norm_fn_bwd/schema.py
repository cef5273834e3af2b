"""mhc.mhc_pre_norm_fn_bwd_mul: one kernel per (mhc_mult, cluster); the token count, K = mhc_mult * hidden (a
multiple of 32) and whether a gradient is accumulated into are run-time values."""

from kernels_tl.mhc.stream_samples import BF16_GEMM, HIDDEN_SUM
from kernels_tl.schema import Op, Out, Param, Randn, Sample, Schema, Tensor

M = 4  # mhc_mult of every sample (TileKernels' tests use 4 only)
M3 = M * (M + 2)


def _args(hidden: int, accumulate: bool = False) -> list:
    args = [Randn(["T", M3], "float32"), Randn(["T"], "float32"), Randn(["T", M, hidden], "bfloat16"),
            Randn([M3, M * hidden], "float32")]
    return args + ([Randn(["T", M, hidden], "bfloat16")] if accumulate else [])


# TileKernels 1.0.0 tests/mhc/test_norm_fn.py: n1 in {4096, 8192} x hidden {1280, 2560, 7168}.
# The host's cluster size (host.h pick_cluster, 132 SMs): 1 at decode, 1000 x 2048 / 4096, 77 and
# one token; 2 at 4096 / 8192 x 7168; 4 at 1000 / 4096 / 8192 x 2560; 8 at 4096 / 8192 x 1280 and
# 4100 x 1280 (a partial last tile)
_SAMPLES = [
    Sample("decode", 128, _args(7168)),
    Sample("prefill", 8192, _args(7168)),
    *[Sample(f"hidden {h}", 1000, _args(h)) for h in (2048, 2560, 4096)],
    *[Sample(f"upstream: {n} tokens, hidden {h}", n, _args(h)) for n in (4096, 8192) for h in (1280, 2560, 7168)],
    Sample("accumulate into x_grad: decode", 128, _args(7168, True)),
    Sample("accumulate into x_grad: prefill", 8192, _args(2560, True)),
    Sample("partial tile: 77 tokens, hidden 2560", 77, _args(2560)),
    Sample("partial tile, accumulate: 4100 tokens, hidden 1280", 4100, _args(1280, True)),
    Sample("one token, hidden 1024", 1, _args(1024, True)),
]

SCHEMA = Schema(
    static=("mhc_mult", "cluster"),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_norm_fn_bwd_mul",
            params=[
                Param("out_mul_grad", Tensor(["float32"], 2)),
                Param("sqrsum_grad", Tensor(["float32"], 1)),
                Param("residual", Tensor(["bfloat16"], 3)),
                Param("mhc_fn", Tensor(["float32"], 2)),
                Param("x_grad", Tensor(["bfloat16"], 3, optional=True), None),
            ],
            outs=[Out("x_grad_out", dtype="'bfloat16'", shape="list(residual.shape)"),
                  Out("fn_grad", dtype="'float32'", shape="list(mhc_fn.shape)")],
            returns=["x_grad_out", "fn_grad"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_norm_fn_bwd_mul",
            samples=_SAMPLES,
            # the reference's products are cuBLAS matmuls (their order unspecified); the kernel's
            # order is fixed (kernel.py, docs/ops.md)
            tolerance={"x_grad_out": BF16_GEMM, "fn_grad": HIDDEN_SUM},
            token_dim=None,  # fn_grad sums over every token
            doc=("mhc_pre_norm_fn_bwd_mul(out_mul_grad, sqrsum_grad, residual, mhc_fn, x_grad=None) -> (x_grad "
                 "[num_tokens, M, H] bf16, fn_grad [M3, M * H] float32): with x = residual as [num_tokens, K], "
                 "x_grad = out_mul_grad @ mhc_fn + 2 * x * sqrsum_grad (+ the given x_grad, float32, one rounding), "
                 "fn_grad = out_mul_grad.T @ x, float32 in a fixed order (docs/ops.md).  out_mul_grad: float32 "
                 "[num_tokens, M3]; sqrsum_grad: float32 [num_tokens]; mhc_fn: float32 [M3, K], M3 = M * (M + 2); "
                 "K a multiple of 32.  The given x_grad is read, not modified (keyword x_grad_out= to write into one)."),
        ),
    ],
)
