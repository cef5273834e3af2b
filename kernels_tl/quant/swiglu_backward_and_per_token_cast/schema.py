"""quant.swiglu_backward_and_per_token_cast: one kernel per scale group (32 or 128 channels);
the row count, hidden size, top-k layout, clamp and round_sf are run-time values."""

from kernels_tl.schema import (Bool, Float, Int, Op, Out, Param, QuantizedTensor, Rand, Randn, Routed, Routing,
                               Sample, Schema, Tensor)


def _sample(name: str, tokens: int, hidden: int, group: int, routing: Routing, **options) -> Sample:
    """A call on the fused layout of ``routing``: ``P`` expanded rows (padding rows included),
    an e4m3 input with positive factors, a bf16 gradient, the top-k weights."""
    x = (Randn(["P", 2 * hidden], "float8_e4m3fn"), Rand(["P", 2 * hidden // group], "float32", 0.25, 2.0))
    return Sample(name, tokens, [x, Randn(["P", hidden], "bfloat16"), Rand(["T", routing.num_topk], "float32"),
                                 Routed("pos_to_token_topk"), Routed("token_topk_to_pos"), group], options,
                  routing=routing)


TOP8_OF_9 = Routing(num_topk=8, num_experts=9, alignment=128)  # upstream's benchmark routing
TOP4_OF_16 = Routing(num_topk=4, num_experts=16, alignment=16, unrouted=0.1)
# every pair unrouted, the layout sized exactly: no rows at all, weight_grad all zeros
NONE_ROUTED = Routing(num_topk=4, num_experts=16, alignment=16, unrouted=1.0, exact=True)

SCHEMA = Schema(
    static=("group",),
    ops=[
        Op(
            module="quant",
            name="swiglu_backward_and_per_token_cast",
            params=[
                Param("x", QuantizedTensor(["float8_e4m3fn"], ["float32"], 2)),
                Param("grad_out", Tensor(["bfloat16"], 2)),
                Param("weight", Tensor(["float32"], 2)),
                Param("pos_to_token_topk", Tensor(["int32"], 1)),
                Param("token_topk_to_pos", Tensor(["int32"], 2)),
                Param("num_per_channels", Int()),
                Param("round_sf", Bool(), False),
                Param("swiglu_clamp_value", Float(optional=True), None),
            ],
            # host.h outputs(): every output dense, rows of x's
            dims=[("P", "x.shape[0]"), ("hidden", "x.shape[1] // 2")],
            outs=[Out("out", dtype="'bfloat16'", shape="[P, hidden]"),
                  Out("x_grad_fp8", dtype="'float8_e4m3fn'", shape="[P, 2 * hidden]"),
                  Out("x_grad_sf", dtype="'float32'", shape="[P, 2 * hidden // num_per_channels]"),
                  Out("x_grad", dtype="'bfloat16'", shape="[P, 2 * hidden]"),
                  Out("weight_grad", dtype="'float32'", shape="list(weight.shape)")],
            returns=["out", ["x_grad_fp8", "x_grad_sf"], "x_grad", "weight_grad"],
            reference="tile_kernels_aot.torch.swiglu.swiglu_backward_and_per_token_cast",
            samples=[
                _sample("decode", 128, 2048, 128, TOP4_OF_16),
                _sample("prefill", 8192, 2048, 128, TOP4_OF_16),
                # TileKernels' benchmark: hidden 7168, 9 experts, top-8, groups of 128
                _sample("upstream: hidden 7168, 9 experts, top-8", 2720, 7168, 128, TOP8_OF_9),
                _sample("upstream: clamp 0.5", 2720, 7168, 128, TOP8_OF_9, swiglu_clamp_value=0.5),
                _sample("groups of 32, round_sf, hidden 576", 500, 576, 32, TOP4_OF_16, round_sf=True),
                _sample("groups of 128, round_sf, clamp 2, hidden 2560", 300, 2560, 128, TOP4_OF_16,
                        round_sf=True, swiglu_clamp_value=2.0),
                _sample("no rows, weight_grad zeros", 64, 2048, 128, NONE_ROUTED),
            ],
            token_dim=None,  # rows are fused positions of a routing; weight_grad is per token
            doc=("SwiGLU backward from an e4m3 (data, sf) input with the top-k routing weights, fused with a "
                 "per-token e4m3 cast of the input gradient: returns (out, (x_grad_fp8, x_grad_sf), x_grad, "
                 "weight_grad). See tile_kernels_aot.torch.swiglu.swiglu_backward_and_per_token_cast."),
        ),
    ],
)
