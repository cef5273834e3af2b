"""mhc.mhc_pre_split_mixes: one kernel per mhc_mult (static); tokens and the two scalars are run-time values."""

from kernels_tl.schema import Float, Int, Op, Out, Param, Randn, Sample, Schema, Tensor


def _args(mult=4, post_mult=2.0, pre_eps=1e-6):
    m3 = mult * (mult + 2)
    return [Randn(["T", m3], "float32"), Randn([3], "float32"), Randn([m3], "float32"), mult, post_mult, pre_eps]


SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_split_mixes",
            params=[Param("input_mixes", Tensor(["float32"], 2)),
                    Param("mhc_scale", Tensor(["float32"], 1)),
                    Param("mhc_base", Tensor(["float32"], 1)),
                    Param("mhc_mult", Int()),
                    Param("mhc_post_mult_value", Float()),
                    Param("mhc_pre_eps", Float())],
            outs=[Out("pre_layer_mix", dtype="'float32'", shape="[input_mixes.shape[0], mhc_mult, 1]"),
                  Out("post_layer_mix", dtype="'float32'", shape="[input_mixes.shape[0], mhc_mult, 1]"),
                  Out("comb_res_mix", dtype="'float32'", shape="[input_mixes.shape[0], mhc_mult, mhc_mult]")],
            returns=["pre_layer_mix", "post_layer_mix", "comb_res_mix"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_split_mixes",
            samples=[
                Sample("decode", 128, _args()),
                Sample("prefill", 8192, _args()),
                Sample("upstream mhc_pre n=1x4096, post_mult=1", 4096, _args(post_mult=1.0)),
                Sample("pre_eps=1e-2, post_mult=0.5", 1001, _args(post_mult=0.5, pre_eps=1e-2)),
                Sample("three tokens", 3, _args()),
            ],
            doc=("mhc_pre_split_mixes(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps) "
                 "-> (pre [N, M, 1], post [N, M, 1], comb [N, M, M]): z = input_mixes * scale[group] + base; "
                 "pre = sigmoid(z[:M]) + pre_eps, post = sigmoid(z[M:2M]) * post_mult_value, comb = z[2M:].  "
                 "input_mixes: float32 [N, M * (M + 2)]; mhc_scale: float32 [3]; mhc_base: float32 [M * (M + 2)]."),
        ),
    ],
)
