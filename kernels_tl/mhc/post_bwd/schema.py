"""mhc.mhc_post_bwd: one kernel per mhc_mult; the token count and hidden size are run-time values."""

from kernels_tl.mhc.stream_samples import (BF16_GEMM, HIDDEN_SUM, UPSTREAM_POST, comb_mix, hidden, samples, stream_mix,
                                           streams)
from kernels_tl.schema import Bool, Op, Out, Param, Sample, Schema, Tensor


def _args(h: int, fuse_grad_acc: bool = False) -> list:
    return [hidden(h), streams(h), stream_mix(), comb_mix(), streams(h), fuse_grad_acc]


SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_post_bwd",
            params=[
                Param("x", Tensor(["bfloat16"], 2)),
                Param("residual", Tensor(["bfloat16"], 3)),
                Param("post_layer_mix", Tensor(["float32"], 3)),
                Param("comb_res_mix", Tensor(["float32"], 3)),
                Param("d_o", Tensor(["bfloat16"], 3)),
                Param("fuse_grad_acc", Bool(), True),
            ],
            outs=[Out("d_x", dtype="'bfloat16'", shape="list(x.shape)"),
                  Out("d_residual", dtype="'bfloat16'", shape="list(residual.shape)"),
                  Out("d_post_layer_mix", dtype="'float32'", shape="list(post_layer_mix.shape)"),
                  Out("d_comb_res_mix", dtype="'float32'", shape="list(comb_res_mix.shape)")],
            returns=["d_x", "d_residual", "d_post_layer_mix", "d_comb_res_mix"],
            reference="tile_kernels_aot.torch.mhc.mhc_post_bwd",
            samples=samples(_args, UPSTREAM_POST, [Sample("fuse_grad_acc (default)", 1000, _args(2560, True)[:-1])]),
            tolerance={"d_residual": BF16_GEMM, "d_post_layer_mix": HIDDEN_SUM, "d_comb_res_mix": HIDDEN_SUM},
            doc=("mhc_post_bwd(x, residual, post_layer_mix, comb_res_mix, d_o, fuse_grad_acc=True) -> (d_x, d_residual, "
                 "d_post_layer_mix, d_comb_res_mix), shaped and typed like x, residual, post_layer_mix, comb_res_mix: "
                 "with g = d_o in float32, d_x = sum_n post[n] g[n], d_residual[m] = sum_n comb[m, n] g[n], "
                 "d_post[n] = sum_h x g[n], d_comb[m, n] = sum_h residual[m] g[n].  fuse_grad_acc is accepted for "
                 "upstream's signature; the kernel does not attach d_residual to residual's storage (the reference "
                 "and the modeling package's call path do).  H % 8 == 0."),
        ),
    ],
)
