"""mhc.mhc_head_compute_mix_bwd: one kernel per mhc_mult (static); the token count is a run-time value."""

from kernels_tl.schema import Op, Out, Param, Randn, Sample, Schema, Tensor


def _args(mult=4):
    return [Randn(["T", mult], "float32"), Randn(["T", mult], "float32"), Randn([1], "float32"),
            Randn([mult], "float32")]


SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_head_compute_mix_bwd",
            params=[Param("output_mix_grad", Tensor(["float32"], 2)),
                    Param("input_mix", Tensor(["float32"], 2)),
                    Param("mhc_scale", Tensor(["float32"], 1)),
                    Param("mhc_base", Tensor(["float32"], 1))],
            outs=[Out("input_mix_grad", dtype="'float32'", shape="list(input_mix.shape)"),
                  Out("mhc_scale_grad", dtype="'float32'", shape="[1]"),
                  Out("mhc_base_grad", dtype="'float32'", shape="[input_mix.shape[1]]")],
            returns=["input_mix_grad", "mhc_scale_grad", "mhc_base_grad"],
            reference="tile_kernels_aot.torch.mhc.mhc_head_compute_mix_bwd",
            samples=[
                Sample("decode", 128, _args()),
                Sample("prefill", 8192, _args()),
                Sample("3 rounds of lanes, tail", 5000, _args()),
                Sample("one token", 1, _args()),
                Sample("no tokens", 0, _args()),
            ],
            token_dim=None,  # the scale and base gradients sum over every token
            doc=("mhc_head_compute_mix_bwd(output_mix_grad, input_mix, mhc_scale, mhc_base) -> (input_mix_grad, "
                 "mhc_scale_grad [1], mhc_base_grad [M]): g_z = g * (1 - sg) * sg with sg = sigmoid(input_mix * "
                 "scale + base); input_mix_grad = g_z * scale; base grad = sum_t g_z; scale grad = sum g_z * "
                 "input_mix (sums over tokens in the reference's fixed lane order)."),
        ),
    ],
)
