"""mhc.mhc_post and mhc.mhc_post_fwd (the same computation): one kernel per mhc_mult; the token
count and hidden size are run-time values."""

from kernels_tl.mhc.stream_samples import BF16_GEMM, UPSTREAM_POST, comb_mix, hidden, samples, stream_mix, streams
from kernels_tl.schema import Op, Out, Param, Schema, Tensor

PARAMS = [
    Param("x", Tensor(["bfloat16"], 2)),
    Param("residual", Tensor(["bfloat16"], 3)),
    Param("post_layer_mix", Tensor(["float32"], 3)),
    Param("comb_res_mix", Tensor(["float32"], 3)),
]
DOC = ("(x, residual, post_layer_mix, comb_res_mix, out=None) -> [num_tokens, M, H] bf16: out[t, n] = "
       "post_layer_mix[t, n, 0] * x[t] + sum_m comb_res_mix[t, m, n] * residual[t, m], in float32, rounded once.  "
       "x: bf16 [num_tokens, H], residual: bf16 [num_tokens, M, H], H % 8 == 0; post_layer_mix: float32 "
       "[num_tokens, M, 1]; comb_res_mix: float32 [num_tokens, M, M].")


def _op(name: str) -> Op:
    return Op(
        module="mhc",
        name=name,
        params=PARAMS,
        outs=[Out("out", dtype="'bfloat16'", shape="list(residual.shape)", positional=True)],
        returns=["out"],
        reference=f"tile_kernels_aot.torch.mhc.{name}",
        samples=samples(lambda h: [hidden(h), streams(h), stream_mix(), comb_mix()], UPSTREAM_POST if name == "mhc_post" else ()),
        tolerance={"out": BF16_GEMM},
        doc=name + DOC,
    )


SCHEMA = Schema(static=("mhc_mult",), ops=[_op("mhc_post"), _op("mhc_post_fwd")])
