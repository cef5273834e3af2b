"""quant.swiglu_forward_and_per_channel_cast_and_transpose: one kernel per (output layout,
clamp on/off); the token count, hidden size, num_per_tokens, round_sf and the clamp value
are run-time values."""

from kernels_tl.schema import Bool, Float, Int, Op, Out, Param, Randn, Sample, Schema, Str, Tensor


def _sample(name: str, tokens: int, hidden: int, num_per_tokens: int = 128, **options) -> Sample:
    return Sample(name, tokens, [Randn(["T", 2 * hidden], "bfloat16"), "e4m3", num_per_tokens], options)


SCHEMA = Schema(
    static=("transposed", "clamped"),
    ops=[
        Op(
            module="quant",
            name="swiglu_forward_and_per_channel_cast_and_transpose",
            params=[
                Param("x", Tensor(["bfloat16"], 2)),
                Param("fmt", Str(["e4m3"])),
                Param("num_per_tokens", Int()),
                Param("round_sf", Bool(), False),
                Param("without_transpose", Bool(), False),
                Param("swiglu_clamp_value", Float(optional=True), None),
            ],
            # host.h outputs(): e4m3 [hidden, T] (or [T, hidden]); fp32 factors [T / t, hidden]
            dims=[("T", "x.shape[0]"), ("hidden", "x.shape[1] // 2")],
            outs=[Out("out", dtype="'float8_e4m3fn'", shape="[T, hidden] if without_transpose else [hidden, T]"),
                  Out("out_sf", dtype="'float32'", shape="[T // num_per_tokens, hidden]")],
            returns=["out", "out_sf"],
            reference="tile_kernels_aot.torch.swiglu.swiglu_forward_and_per_channel_cast_and_transpose",
            samples=[
                _sample("decode", 128, 7168),
                _sample("prefill", 8192, 4096),
                # TileKernels' benchmark: 8064 tokens, hidden 7168, blocks of 128 tokens
                _sample("upstream, without transpose", 8064, 7168, without_transpose=True),
                _sample("upstream, without transpose, clamp 0.5", 8064, 7168, without_transpose=True,
                        swiglu_clamp_value=0.5),
                _sample("upstream, transposed", 8064, 7168),
                _sample("upstream, transposed, clamp 0.5", 8064, 7168, swiglu_clamp_value=0.5),
                _sample("blocks of 32, round_sf, hidden 576", 512, 576, 32, round_sf=True),
                _sample("blocks of 32, without transpose, clamp 10, hidden 2560", 1024, 2560, 32,
                        without_transpose=True, swiglu_clamp_value=10.0),
                _sample("round_sf, clamp 0.5, hidden 3072", 640, 3072, 128, round_sf=True, swiglu_clamp_value=0.5),
                _sample("without transpose, round_sf, hidden 2048", 384, 2048, 128, round_sf=True,
                        without_transpose=True),
                _sample("clamp -70 (the IEEE-divide copy), hidden 6144", 256, 6144, 32, swiglu_clamp_value=-70.0),
                # 0.3 is no bf16 value: the select clamps of the fast-divide copy (0.5 and 10
                # clamp the packed pairs)
                _sample("clamp 0.3 (the select clamps), without transpose", 512, 2048, 128, without_transpose=True,
                        swiglu_clamp_value=0.3),
                # the untransposed kernel's blocks of 32 without clamp, three channel tiles
                _sample("blocks of 32, without transpose, hidden 192", 256, 192, 32, without_transpose=True),
                # the untransposed clamped kernel's IEEE-divide copy
                _sample("clamp -70 (the IEEE-divide copy), without transpose, hidden 1024", 256, 1024, 32,
                        without_transpose=True, swiglu_clamp_value=-70.0),
            ],
            doc=("SwiGLU forward rounded to bfloat16, fused with a per-channel FP8 (e4m3) cast over blocks of "
                 "num_per_tokens (32 or 128) tokens: returns (out, out_sf), out [hidden, num_tokens] (or "
                 "[num_tokens, hidden] with without_transpose), out_sf float32 [num_tokens / num_per_tokens, hidden]. "
                 "x: [num_tokens, 2 * hidden] bfloat16, num_tokens a multiple of 128, hidden a multiple of 64. See "
                 "tile_kernels_aot.torch.swiglu.swiglu_forward_and_per_channel_cast_and_transpose."),
            token_dim=None,  # scale factors span blocks of tokens; the output may be transposed
            token_multiple=128,
        ),
    ],
)
