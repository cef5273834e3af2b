"""mhc.expand_to_mhc_bwd: one kernel per mhc_mult; the token count and hidden size are run-time values."""

from kernels_tl.mhc.stream_samples import samples, streams
from kernels_tl.schema import Op, Out, Param, Schema, Tensor

SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="expand_to_mhc_bwd",
            params=[Param("out_grad", Tensor(["bfloat16"], 3))],
            outs=[Out("hidden_grad", dtype="'bfloat16'", shape="[out_grad.shape[0], out_grad.shape[2]]")],
            returns=["hidden_grad"],
            reference="tile_kernels_aot.torch.mhc.expand_to_mhc_bwd",
            samples=samples(lambda h: [streams(h)]),
            doc=("expand_to_mhc_bwd(out_grad) -> [num_tokens, H] bf16: sum_m out_grad[t, m], accumulated in "
                 "float32 from 0 in stream order and rounded once.  out_grad: bf16 [num_tokens, M, H], H % 8 == 0."),
        ),
    ],
)
