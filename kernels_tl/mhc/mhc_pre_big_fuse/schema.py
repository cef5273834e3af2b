"""mhc.mhc_pre_big_fuse: one kernel per mhc_mult (plus mhc_pre_norm_fn's kernel, launched first by
the host side); the token count, hidden size, sinkhorn_repeat and the scalars are run-time
values."""

from kernels_tl.schema import Float, Int, Op, Out, Param, Rand, Randn, Sample, Schema, Tensor

M = 4  # mhc_mult of every sample (TileKernels' tests use 4 only)
M3 = M * (M + 2)


def _args(hidden: int, post_mult: float = 2.0, repeat: int = 10) -> list:
    # fn uniform in +-0.01 keeps the mixes near unit size (rms-normalised x times sqrt(K) * 0.0058
    # at K = 28672), so the sigmoids and the softmax are not saturated
    return [Randn(["T", M, hidden], "bfloat16"), Rand([M3, M * hidden], "float32", -0.01, 0.01),
            Rand([3], "float32", -1.0, 1.0), Rand([M3], "float32", -1.0, 1.0), 1e-6, 1e-6, 1e-6, post_mult, repeat]


# TileKernels 1.0.0 tests/mhc/test_pre_big_fuse.py: n1 in {512, 1024, 2048, 8192} x hidden
# {1280, 2560, 4096}, mhc_mult 4, post_mult_value 1.0, sinkhorn_repeat 10
_UPSTREAM = [(n, h) for n in (512, 1024, 2048, 8192) for h in (1280, 2560, 4096)]

_SAMPLES = [
    Sample("decode", 128, _args(7168)),
    Sample("decode, hidden 2560", 128, _args(2560)),
    Sample("prefill", 8192, _args(7168)),
    *[Sample(f"hidden {h}", 1000, _args(h)) for h in (2048, 4096)],
    *[Sample(f"upstream: {n} tokens, hidden {h}", n, _args(h, post_mult=1.0)) for n, h in _UPSTREAM],
    # a partial last block in both parts of the grid (77 tokens: 4 Sinkhorn blocks of 16 tokens,
    # the last with 13; 77 * 128 pieces = 38.5 blocks of 256)
    Sample("tails: 77 tokens, hidden 1024", 77, _args(1024)),
    Sample("5 tokens, hidden 256", 5, _args(256)),
    # sinkhorn_repeat 1: the loop of row and column steps runs zero times
    Sample("options: sinkhorn_repeat=1, n_splits=1", 300, _args(2560, repeat=1), {"n_splits": 1}),
]

SCHEMA = Schema(
    static=("mhc_mult",),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_big_fuse",
            params=[
                Param("residual", Tensor(["bfloat16"], 3)),
                Param("fn", Tensor(["float32"], 2)),
                Param("mhc_scale", Tensor(["float32"], 1)),
                Param("mhc_base", Tensor(["float32"], 1)),
                Param("rms_eps", Float()),
                Param("mhc_pre_eps", Float()),
                Param("mhc_sinkhorn_eps", Float()),
                Param("mhc_post_mult_value", Float()),
                Param("sinkhorn_repeat", Int()),
                Param("n_splits", Int(), 16),
            ],
            outs=[Out("post_mix", dtype="'float32'", shape="[residual.shape[0], residual.shape[1], 1]"),
                  Out("comb_mix", dtype="'float32'", shape="[residual.shape[0], residual.shape[1], residual.shape[1]]"),
                  Out("layer_input", dtype="'bfloat16'", shape="[residual.shape[0], residual.shape[2]]")],
            # mhc_pre_norm_fn's output, which this op's kernel reads
            scratch=[Out("mixes", dtype="'float32'", shape="[residual.shape[0], fn.shape[0]]")],
            prologue=True,
            returns=["post_mix", "comb_mix", "layer_input"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_big_fuse",
            samples=_SAMPLES,
            # the two kernels read the residual twice and pass the mixes through memory
            bytes=("2 * residual.nbytes + fn.nbytes + mhc_scale.nbytes + mhc_base.nbytes "
                   "+ 8 * residual.shape[0] * fn.shape[0] + post_mix.nbytes + comb_mix.nbytes + layer_input.nbytes"),
            # the mixes are mhc_pre_norm_fn's kernel's (within 1e-4 of the largest mix of the reference's:
            # its projection sums in another order, docs/ops.md); every later step is the reference's
            # arithmetic, bit for bit against the chained kernels.  post = mult * sigmoid(scale * mix +
            # base) moves by at most mult * |scale| / 4 of a mix's error, Sinkhorn's comb by a few times
            # |scale| of it, and layer_input by one bf16 step plus sum_m |x_m| times a pre weight's error;
            # with |scale| <= 1 that is below 1e-3 of each output's largest value.  An index error
            # (O(0.1) of the largest value) is far outside it.
            tolerance={"post_mix": (1e-5, 1e-3), "comb_mix": (1e-5, 1e-3), "layer_input": (2.0 ** -7, 1e-3)},
            # 448 and -6 in every fifth value of residual and fn make mixes of about 1e6, so a mix's error
            # (1e-4 of the largest) moves Sinkhorn's logits by about 1e2: at ties comb_mix follows the
            # GEMM's rounding, not a tolerance (test_mhc_modeling checks it against the chained kernels)
            ill_conditioned={"format_max": ["comb_mix"]},
            doc=("mhc_pre_big_fuse(residual, fn, mhc_scale, mhc_base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, "
                 "mhc_post_mult_value, sinkhorn_repeat, n_splits=16) -> (post_mix [num_tokens, M, 1] float32, "
                 "comb_mix [num_tokens, M, M] float32, layer_input [num_tokens, H] bf16): the inference pre path, "
                 "mixes = mhc_pre_norm_fn(residual, fn, None, rms_eps); pre, post, comb = mhc_pre_split_mixes(mixes, "
                 "mhc_scale, mhc_base, M, mhc_post_mult_value, mhc_pre_eps); comb = sinkhorn_normalize(comb, "
                 "sinkhorn_repeat, mhc_sinkhorn_eps); layer_input = mhc_pre_apply_mix(residual, pre), in two "
                 "launches (norm-fn's kernel, then one kernel for the rest, the same bits as those ops' kernels).  "
                 "residual: bf16 [num_tokens, M, H], M * H a multiple of 1024; fn: float32 [M * (M + 2), M * H]; "
                 "mhc_scale: float32 [3]; mhc_base: float32 [M * (M + 2)].  n_splits does not change the result."),
        ),
    ],
)
