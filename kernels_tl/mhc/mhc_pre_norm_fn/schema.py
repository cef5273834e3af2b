"""mhc.mhc_pre_norm_fn: one kernel per (mhc_mult, cluster, tile_tokens, splits); the token count
and K = mhc_mult * hidden (a multiple of 1024) are run-time values, and the host picks the tile
(64 or 128 tokens), the cluster size (2 or 8 in the shape tables) and the clusters per tile (1,
or 2 with the norm weight: two launches, the second adding the clusters' subtree sums from the
scratch buffer) from the token count and K."""

from kernels_tl.schema import Bool, Float, Int, Op, Out, Param, Randn, Sample, Schema, Tensor

M = 4  # mhc_mult of every sample (TileKernels' tests use 4 only)
M3 = M * (M + 2)


def _args(hidden: int, weight: bool) -> list:
    k = M * hidden
    return [Randn(["T", M, hidden], "bfloat16"), Randn([M3, k], "float32"),
            Randn([k], "float32") if weight else None, 1e-6]


# TileKernels 1.0.0 tests/mhc/test_norm_fn.py: n1 in {4096, 8192} x hidden {1280, 2560, 7168}
# x weight or not; the split-K test at n1 in {13, 48, 512} x hidden {1280, 2560, 4096, 7168}
_SAMPLES = [
    Sample("decode", 128, _args(7168, False)),
    Sample("prefill", 8192, _args(7168, False)),
    Sample("decode, norm weight", 128, _args(7168, True)),
    *[Sample(f"hidden {h}", 1000, _args(h, False)) for h in (2048, 2560, 4096)],
    Sample("upstream: 4096 tokens, hidden 1280, norm weight", 4096, _args(1280, True)),
    Sample("upstream: 8192 tokens, hidden 2560", 8192, _args(2560, False)),
    Sample("upstream: 4096 tokens, hidden 7168, norm weight", 4096, _args(7168, True)),
    Sample("upstream split-K: 13 tokens, hidden 4096 (a partial block)", 13, _args(4096, False)),
    Sample("upstream split-K: 48 tokens, hidden 7168", 48, _args(7168, False)),
    Sample("upstream split-K: 512 tokens, hidden 1280", 512, _args(1280, False)),
    Sample("options: fuse_grad_acc=False, n_splits=1", 77, _args(2560, True), {"fuse_grad_acc": False, "n_splits": 1}),
    # the host's layout (host.h pick_layout, 132 SMs): 64-token tiles with cluster 8 at decode, the
    # 1000-token samples and the split-K rows, cluster 2 at 4096 / 4100 tokens with the norm weight
    # (4100: a partial last tile); 128-token tiles with cluster 2 at 8192 / 8200 / 16384 tokens
    # (8200: a partial last tile), 8 at 2048.  The names of the next samples predate the current
    # layouts (they keep their inputs).
    Sample("cluster 1, partial tile: 4100 tokens, hidden 1280", 4100, _args(1280, True)),
    Sample("cluster 2: 2048 tokens, hidden 1280", 2048, _args(1280, False)),
    Sample("cluster 1, partial tile: 8200 tokens, hidden 2560", 8200, _args(2560, False)),
    Sample("16384 tokens, hidden 1280", 16384, _args(1280, False)),
    # with the norm weight at 132 SMs: 128-token tiles of two clusters of 2 (splits 2) at 4096 x
    # hidden 7168 (above) and here (4000: a partial last tile); 128-token tiles of one cluster of
    # 2 at 8192 tokens, of one cluster of 8 at 2048
    Sample("norm weight, two clusters per tile, partial tile: 4000 tokens, hidden 4096", 4000, _args(4096, True)),
    Sample("norm weight, 128-token tile: 8192 tokens, hidden 2560", 8192, _args(2560, True)),
    Sample("norm weight, 128-token tile, cluster 8: 2048 tokens, hidden 1280", 2048, _args(1280, True)),
]

SCHEMA = Schema(
    static=("mhc_mult", "cluster", "tile_tokens", "splits"),
    ops=[
        Op(
            module="mhc",
            name="mhc_pre_norm_fn",
            params=[
                Param("residual", Tensor(["bfloat16"], 3)),
                Param("mhc_fn", Tensor(["float32"], 2)),
                Param("mhc_norm_weight", Tensor(["float32"], 1, optional=True)),
                Param("mhc_norm_eps", Float()),
                Param("fuse_grad_acc", Bool(), True),
                Param("n_splits", Int(), 16),
            ],
            outs=[Out("out", dtype="'float32'", shape="[residual.shape[0], mhc_fn.shape[0]]")],
            returns=["out"],
            reference="tile_kernels_aot.torch.mhc.mhc_pre_norm_fn",
            samples=_SAMPLES,
            # the kernel sums x @ W.T on tensor cores (bf16 [hi; lo] split of W: exact products,
            # float32 accumulation in the MMA's order, possibly truncating at each k-step of 16);
            # sum(x^2) follows the reference's order exactly.  Bound (docs/ops.md): |err| <=
            # (2 K / 64 + K / 256 + 12) * 2^-24 * (largest partial sum), 6.1e-5 of it at K = 28672;
            # partial sums stay near max|out| for these inputs, so 1e-4 of max|out|.  Dropping W's
            # low part (~1e-3 of max) or any index error (O(1)) is far outside it.
            tolerance={"out": (1e-6, 1e-4)},
            # the split layout's per-(tile, split) subtree and square sums (host.h outputs)
            scratch=[Out("partials", dtype="'float32'",
                         shape="[ceil_div(residual.shape[0], 128) * 256 * (mhc_fn.shape[0] + 1)]")],
            launches=True,
            doc=("mhc_pre_norm_fn(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, fuse_grad_acc=True, n_splits=16) "
                 "-> [num_tokens, M3] float32: (x @ W.T) * rsqrt(sum(x**2) / K + eps), x = residual as [num_tokens, K], "
                 "W = tf32(mhc_fn * mhc_norm_weight) (or tf32(mhc_fn)), x @ W.T on tensor cores, sum(x**2) in a fixed lane order (docs/ops.md).  "
                 "residual: bf16 [num_tokens, M, H], M * H a multiple of 1024; mhc_fn: float32 [M * (M + 2), M * H]; "
                 "mhc_norm_weight: float32 [M * H] or None.  fuse_grad_acc and n_splits do not change the result."),
        ),
    ],
)
