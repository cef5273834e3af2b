"""moe.topk_gate: one kernel per size class (``max_experts``, a multiple of 32 up to 512, serving
``max_experts - 31 .. max_experts`` experts); the token count, expert count and top-k are run-time values."""

from kernels_tl.schema import Int, Op, Out, Param, Randn, Sample, Schema, Tensor

SCHEMA = Schema(
    static=("max_experts",),
    ops=[
        Op(
            module="moe",
            name="topk_gate",
            params=[Param("scores", Tensor(["float32"], 2)), Param("num_topk", Int())],
            outs=[Out("out", dtype="'int64'", shape="[scores.shape[0], num_topk]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.moe.topk_gate",
            samples=[
                Sample("decode", 128, [Randn(["T", 256], "float32"), 8]),
                Sample("prefill", 8192, [Randn(["T", 256], "float32"), 8]),
                Sample("upstream", 8001, [Randn(["T", 256], "float32"), 8]),
                Sample("72 experts", 1000, [Randn(["T", 72], "float32"), 6]),
                Sample("1 expert", 1000, [Randn(["T", 1], "float32"), 1]),
                Sample("16 experts, top-4", 1000, [Randn(["T", 16], "float32"), 4]),
                Sample("36 experts, 4 in the last slot", 1000, [Randn(["T", 36], "float32"), 6]),
                Sample("Qwen3-MoE: 128 experts", 8192, [Randn(["T", 128], "float32"), 8]),
                Sample("512 experts, top-10", 4096, [Randn(["T", 512], "float32"), 10]),
            ],
            doc=(
                "topk_gate(scores, num_topk) -> int64 [num_tokens, num_topk]: the indices of each row's num_topk "
                "largest scores, largest first, equal scores (-0.0 == +0.0) smaller index first, NaN above +inf.  "
                "scores: float32 [num_tokens, num_experts], contiguous; 1 <= num_experts <= 512; "
                "1 <= num_topk <= num_experts."
            ),
        ),
    ],
)
