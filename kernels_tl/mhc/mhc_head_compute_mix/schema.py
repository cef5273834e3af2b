"""mhc.mhc_head_compute_mix: one kernel per mhc_mult (static); tokens and eps are run-time values."""

from kernels_tl.schema import Float, Op, Out, Param, Randn, Sample, Schema, Tensor


def _args(mult=4, pre_eps=1e-6):
    return [Randn(["T", mult], "float32"), Randn([1], "float32"), Randn([mult], "float32"), pre_eps]


SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_head_compute_mix",
            params=[Param("input_mix", Tensor(["float32"], 2)),
                    Param("mhc_scale", Tensor(["float32"], 1)),
                    Param("mhc_base", Tensor(["float32"], 1)),
                    Param("mhc_pre_eps", Float())],
            outs=[Out("output_mix", dtype="'float32'", shape="list(input_mix.shape)")],
            returns=["output_mix"],
            reference="tile_kernels_aot.torch.mhc.mhc_head_compute_mix",
            samples=[
                Sample("decode", 128, _args()),
                Sample("prefill", 8192, _args()),
                Sample("pre_eps=1e-2", 1001, _args(pre_eps=1e-2)),
                Sample("three tokens", 3, _args()),
            ],
            doc=("mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, mhc_pre_eps) -> output_mix: "
                 "sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps.  input_mix: float32 [N, M]; "
                 "mhc_scale: float32 [1]; mhc_base: float32 [M]."),
        ),
    ],
)
