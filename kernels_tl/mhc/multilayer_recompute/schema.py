"""mhc.mhc_multilayer_recompute: one kernel per mhc_mult; the token count, hidden size and the
numbers of layers and posts are run-time values (more layers than one launch takes run as chained
launches)."""

from kernels_tl.mhc.stream_samples import BF16_GEMM, comb_mix, hidden, stream_mix, streams
from kernels_tl.schema import Op, Param, Sample, Schema, Tensor, TensorList, Tensors

MAX_LIST = 64  # tensors per list in one call (the host's views of them); 16 layers per launch (kernel.py)


def _args(num_layers: int, num_post: int, h: int) -> list:
    return [streams(h),
            Tensors([stream_mix()] * num_layers),
            Tensors([hidden(h)] * num_post),
            Tensors([stream_mix()] * num_post),
            Tensors([comb_mix()] * num_post),
            Tensors([hidden(h)] * num_layers),
            Tensors([streams(h)] * num_post)]


def _sample(name: str, tokens: int, num_layers: int, num_post: int, h: int) -> Sample:
    return Sample(f"{name}: {num_layers} layers, {num_post} posts, hidden {h}", tokens, _args(num_layers, num_post, h))


SAMPLES = [
    Sample("decode", 128, _args(10, 9, 7168)),
    Sample("prefill", 8192, _args(3, 3, 7168)),
    # TileKernels' benchmark (10 layers, 9 or 10 posts, 8192 tokens, hidden 2560) and test matrix
    _sample("upstream", 8192, 10, 10, 2560),
    _sample("upstream", 8192, 10, 9, 2560),
    _sample("upstream", 8192, 1, 1, 2560),
    _sample("upstream", 8192, 3, 2, 2560),
    _sample("upstream", 8192, 10, 9, 4096),
    _sample("hidden 2048", 1000, 3, 2, 2048),
    # more layers than one launch takes: chained launches (16 + 4 layers, the last without a post;
    # 16 + 1 with one)
    _sample("chained", 128, 20, 19, 2560),
    _sample("chained", 128, 17, 17, 1024),
    # a row whose pieces do not fill the last block; one layer without a post
    _sample("tails", 77, 2, 1, 1000),
]

SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_multilayer_recompute",
            params=[
                Param("initial_residual", Tensor(["bfloat16"], 2, leading=True)),
                Param("pre_mix_list", TensorList(["float32"], 1, MAX_LIST, leading=True)),
                Param("layer_output_list", TensorList(["bfloat16"], 1, MAX_LIST, leading=True)),
                Param("post_mix_list", TensorList(["float32"], 1, MAX_LIST, leading=True)),
                Param("comb_mix_list", TensorList(["float32"], 2, MAX_LIST, leading=True)),
                Param("layer_input_list", TensorList(["bfloat16"], 1, MAX_LIST, leading=True, mutable=True)),
                Param("residual_list", TensorList(["bfloat16"], 2, MAX_LIST, leading=True, mutable=True)),
            ],
            outs=[],
            returns=[],
            reference="tile_kernels_aot.torch.mhc.mhc_multilayer_recompute",
            samples=SAMPLES,
            # each layer's post is mhc_post's arithmetic, whose GEMM order the reference leaves to cuBLAS
            tolerance={"layer_input_list": BF16_GEMM, "residual_list": BF16_GEMM},
            launches=True,
            doc=("mhc_multilayer_recompute(initial_residual, pre_mix_list, layer_output_list, post_mix_list, "
                 "comb_mix_list, layer_input_list, residual_list) -> None: from r = initial_residual, for layer i: "
                 "layer_input_list[i] = mhc_pre_apply_mix(r, pre_mix_list[i]) and, for i < P = len(layer_output_list) "
                 "(L or L - 1), r = residual_list[i] = mhc_post(layer_output_list[i], r, post_mix_list[i], "
                 "comb_mix_list[i]), r in bf16 after every layer; the streams stay on chip between layers.  "
                 "initial_residual: bf16 [..., M, H], H % 8 == 0; pre/post mixes: float32 [..., M, 1] or [..., M]; "
                 "layer outputs and inputs: bf16 [..., H]; comb mixes: float32 [..., M, M]; residuals: bf16 "
                 "[..., M, H]; the leading dims of every tensor those of initial_residual; at most 64 layers."),
        ),
    ],
)
