"""engram.fused_weight: one kernel; the weights' shape is a run-time value."""

from kernels_tl.schema import Op, Out, Param, Randn, Sample, Schema, Tensor

SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="engram",
            name="fused_weight",
            params=[Param("weight_hidden", Tensor(["bfloat16"], 2)),
                    Param("weight_embed", Tensor(["bfloat16"], 2))],
            outs=[Out("weight_fused", dtype="'float32'", shape="list(weight_hidden.shape)")],
            returns=["weight_fused"],
            reference="tile_kernels_aot.torch.engram.fused_weight",
            samples=[
                Sample("upstream: hc=4, hidden=7168", 1, [Randn([4, 7168], "bfloat16"), Randn([4, 7168], "bfloat16")]),
                Sample("upstream: hc=4, hidden=2048", 1, [Randn([4, 2048], "bfloat16"), Randn([4, 2048], "bfloat16")]),
                Sample("hc=4, hidden=4096", 1, [Randn([4, 4096], "bfloat16"), Randn([4, 4096], "bfloat16")]),
                Sample("hc=2, hidden=1024", 1, [Randn([2, 1024], "bfloat16"), Randn([2, 1024], "bfloat16")]),
            ],
            token_dim=None,
            doc=("fused_weight(weight_hidden, weight_embed) -> weight_fused [hc_mult, hidden] float32 = "
                 "float(weight_hidden) * float(weight_embed) (exact).  Both weights: bfloat16 [hc_mult, hidden], "
                 "contiguous, hidden a multiple of 8."),
        ),
    ],
)
