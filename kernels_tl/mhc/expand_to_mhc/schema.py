"""mhc.expand_to_mhc: one kernel per mhc_mult; the token count and hidden size are run-time values."""

from kernels_tl.mhc.stream_samples import M, hidden, samples
from kernels_tl.schema import Int, Op, Out, Param, Schema, Tensor

SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="expand_to_mhc",
            params=[Param("hidden", Tensor(["bfloat16"], 2)), Param("mhc_mult", Int())],
            outs=[Out("out", dtype="'bfloat16'", shape="[hidden.shape[0], mhc_mult, hidden.shape[1]]",
                      positional=True)],
            returns=["out"],
            reference="tile_kernels_aot.torch.mhc.expand_to_mhc",
            samples=samples(lambda h: [hidden(h), M]),
            doc=("expand_to_mhc(hidden, mhc_mult, out=None) -> [num_tokens, mhc_mult, H] bf16: "
                 "out[t, m] = hidden[t] for every stream m (bit copies).  hidden: bf16 [num_tokens, H], "
                 "H % 8 == 0 (the modeling package flattens leading dims)."),
        ),
    ],
)
