"""moe.normalize_weight: one kernel; the token count and top-k are run-time values."""

from kernels_tl.schema import Op, Out, Param, Rand, Sample, Schema, Tensor

SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="moe",
            name="normalize_weight",
            params=[Param("topk_weights", Tensor(["float32"], 2))],
            outs=[Out("denominator", dtype="'float32'", shape="[topk_weights.shape[0]]"),
                  Out("normalized", dtype="'float32'", shape="list(topk_weights.shape)")],
            returns=["denominator", "normalized"],
            reference="tile_kernels_aot.torch.moe.normalize_weight",
            samples=[
                Sample("decode", 128, [Rand(["T", 8], "float32")]),
                Sample("prefill", 8192, [Rand(["T", 8], "float32")]),
                Sample("upstream", 21876, [Rand(["T", 8], "float32")]),
                Sample("top-1", 1000, [Rand(["T", 1], "float32")]),
                Sample("top-9, signed", 1000, [Rand(["T", 9], "float32", -1.0, 1.0)]),
            ],
            doc=("normalize_weight(topk_weights) -> (denominator, normalized): denominator [num_tokens] float32 = "
                 "1e-20 + w_0 + ... + w_{k-1} (float32, left to right), normalized [num_tokens, num_topk] float32 = "
                 "w / denominator.  topk_weights: float32 [num_tokens, num_topk], contiguous."),
        ),
    ],
)
