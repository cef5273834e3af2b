"""mhc.mhc_pre_split_mixes_bwd: two kernels per mhc_mult (static), picked per call by the token count
(``path``: "cluster", one launch, up to 128 tokens; "blocks", two launches, above); tokens and
post_mult_value are run-time values."""

from kernels_tl.schema import Float, Int, Op, Out, Param, Randn, Sample, Schema, Tensor


def _args(mult=4, post_mult=2.0):
    m3 = mult * (mult + 2)
    return [Randn(["T", mult, 1], "float32"), Randn(["T", mult, 1], "float32"), Randn(["T", mult, mult], "float32"),
            Randn(["T", m3], "float32"), Randn([3], "float32"), Randn([m3], "float32"), mult, post_mult]


SCHEMA = Schema(
    static=("mhc_mult", "path"),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_split_mixes_bwd",
            params=[Param("pre_layer_mix_grad", Tensor(["float32"], 3)),
                    Param("post_layer_mix_grad", Tensor(["float32"], 3)),
                    Param("comb_res_mix_grad", Tensor(["float32"], 3)),
                    Param("input_mixes", Tensor(["float32"], 2)),
                    Param("mhc_scale", Tensor(["float32"], 1)),
                    Param("mhc_base", Tensor(["float32"], 1)),
                    Param("mhc_mult", Int()),
                    Param("mhc_post_mult_value", Float())],
            outs=[Out("input_mixes_grad", dtype="'float32'", shape="list(input_mixes.shape)"),
                  Out("mhc_scale_grad", dtype="'float32'", shape="[3]"),
                  Out("mhc_base_grad", dtype="'float32'", shape="[input_mixes.shape[1]]")],
            # above 128 tokens (path "blocks") each block's partial sums (kernel.py: BLOCKS x 2 * M3),
            # written by the first launch, summed by the second
            scratch=[Out("scratch", dtype="'float32'",
                         shape="[128 * 2 * input_mixes.shape[1] if input_mixes.shape[0] > 128 else 0]")],
            launches=True,
            returns=["input_mixes_grad", "mhc_scale_grad", "mhc_base_grad"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_split_mixes_bwd",
            samples=[
                Sample("decode", 128, _args()),
                Sample("prefill", 8192, _args()),
                Sample("upstream mhc_pre n=1x4096, post_mult=1", 4096, _args(post_mult=1.0)),
                Sample("3 rounds of lanes, tail, post_mult=0.5", 5000, _args(post_mult=0.5)),
                Sample("129 tokens: the blocks kernel's fewest", 129, _args(post_mult=0.5)),
                Sample("256 tokens", 256, _args()),
                Sample("2049 tokens: one token in the second round of lanes", 2049, _args(post_mult=0.5)),
                Sample("one token", 1, _args()),
                Sample("no tokens", 0, _args()),
            ],
            token_dim=None,  # the scale and base gradients sum over every token
            doc=("mhc_pre_split_mixes_bwd(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, "
                 "mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value) -> (input_mixes_grad [N, M3], mhc_scale_grad [3], "
                 "mhc_base_grad [M3]): g_z = g_pre * (1 - sg) * sg | g_post * post_mult_value * (1 - sg) * sg | g_comb; "
                 "input grad g_z * scale[group]; base grad sum_t g_z; scale grad sum over tokens and group of "
                 "g_z * input_mixes (sums over tokens in the reference's fixed lane order)."),
        ),
    ],
)
