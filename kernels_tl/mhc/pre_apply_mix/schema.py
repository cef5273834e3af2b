"""mhc.mhc_pre_apply_mix: one kernel per mhc_mult; the token count and hidden size are run-time values."""

from kernels_tl.mhc.stream_samples import UPSTREAM_PRE_APPLY_MIX, samples, stream_mix, streams
from kernels_tl.schema import Op, Out, Param, Schema, Tensor

SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_apply_mix",
            params=[Param("x", Tensor(["bfloat16"], 3)), Param("mix", Tensor(["float32"], 3))],
            outs=[Out("out", dtype="'bfloat16'", shape="[x.shape[0], x.shape[2]]", positional=True)],
            returns=["out"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_apply_mix",
            samples=samples(lambda h: [streams(h), stream_mix()], UPSTREAM_PRE_APPLY_MIX),
            doc=("mhc_pre_apply_mix(x, mix, out=None) -> [num_tokens, H] bf16: sum_m mix[t, m, 0] * x[t, m], "
                 "each product rounded to float32, summed in stream order, rounded once.  x: bf16 "
                 "[num_tokens, M, H], H % 8 == 0; mix: float32 [num_tokens, M, 1]."),
        ),
    ],
)
