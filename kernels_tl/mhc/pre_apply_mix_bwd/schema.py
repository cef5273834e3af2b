"""mhc.mhc_pre_apply_mix_bwd: one kernel per mhc_mult; the token count, hidden size and whether a
gradient is accumulated into are run-time values."""

from kernels_tl.mhc.stream_samples import HIDDEN_SUM, UPSTREAM_PRE_APPLY_MIX, hidden, samples, stream_mix, streams
from kernels_tl.schema import Op, Out, Param, Sample, Schema, Tensor


def _args(h: int, accumulate: bool = False) -> list:
    return [hidden(h), streams(h), stream_mix()] + ([streams(h)] if accumulate else [])


SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_apply_mix_bwd",
            params=[
                Param("o_grad", Tensor(["bfloat16"], 2)),
                Param("x", Tensor(["bfloat16"], 3)),
                Param("mix", Tensor(["float32"], 3)),
                Param("x_grad", Tensor(["bfloat16"], 3, optional=True), None),
            ],
            outs=[Out("x_grad_out", dtype="'bfloat16'", shape="list(x.shape)"),
                  Out("mix_grad", dtype="'float32'", shape="list(mix.shape)")],
            returns=["x_grad_out", "mix_grad"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_apply_mix_bwd",
            samples=samples(_args, UPSTREAM_PRE_APPLY_MIX, [
                Sample("accumulate into x_grad: decode", 128, _args(7168, True)),
                Sample("accumulate into x_grad: prefill", 8192, _args(7168, True)),
                Sample("accumulate into x_grad: tails", 77, _args(1000, True)),
            ]),
            tolerance={"mix_grad": HIDDEN_SUM},
            doc=("mhc_pre_apply_mix_bwd(o_grad, x, mix, x_grad=None) -> (x_grad [num_tokens, M, H] bf16, mix_grad "
                 "[num_tokens, M, 1] float32): x_grad = mix * o_grad (+ the given x_grad, float32, one rounding), "
                 "mix_grad = sum_h o_grad * x (float32).  The given x_grad is read, not modified; the result is a new "
                 "tensor (keyword x_grad_out= to write into one).  H % 8 == 0."),
        ),
    ],
)
