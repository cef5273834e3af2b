"""moe.mask_indices_by_tp: one kernel per index dtype; the token count and top-k are run-time values."""

from kernels_tl.schema import Int, Op, Out, Param, Randint, Sample, Schema, Tensor

SCHEMA = Schema(
    static=("dtype",),
    ops=[
        Op(
            module="moe",
            name="mask_indices_by_tp",
            params=[Param("indices", Tensor(["int64", "int32"], 2)), Param("n", Int()), Param("num_ep_ranks", Int()),
                    Param("tp_rank", Int()), Param("num_tp_ranks", Int())],
            outs=[Out("out", dtype="indices.dtype", shape="list(indices.shape)")],
            returns=["out"],
            reference="tile_kernels_aot.torch.moe.mask_indices_by_tp",
            samples=[
                # 256 experts over 64 EP ranks (4 each), TP 4: DeepSeek-V3-like routing
                Sample("decode", 128, [Randint(["T", 8], "int64", -1, 256), 256, 64, 1, 4]),
                Sample("prefill", 8192, [Randint(["T", 8], "int64", -1, 256), 256, 64, 3, 4]),
                # TileKernels' benchmark: 72 experts over 8 EP ranks (9 each), entries of rank 0 or -1
                Sample("upstream", 21876, [Randint(["T", 8], "int64", -1, 9), 72, 8, 0, 2]),
                Sample("int32", 1001, [Randint(["T", 6], "int32", -1, 384), 384, 32, 2, 4]),
                Sample("top-9, one expert per rank", 999, [Randint(["T", 9], "int64", -1, 256), 256, 256, 5, 8]),
                Sample("no TP", 1000, [Randint(["T", 8], "int32", -1, 288), 288, 8, 0, 1]),
                # int64 entries past 2^31 (the 64-bit division path)
                Sample("entries past 2^31", 1000, [Randint(["T", 8], "int64", -1, 2**40), 1_000_000_000, 8, 1, 2]),
            ],
            doc=(
                "mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks) -> same shape and dtype: with "
                "per_gpu = n // num_ep_ranks, an entry v >= 0 whose rank v // per_gpu is TP rank tp_rank "
                "((v // per_gpu) % num_tp_ranks == tp_rank) becomes ((v // per_gpu) // num_tp_ranks) * per_gpu + "
                "v % per_gpu; every other entry becomes -1.  indices: int64 or int32 [num_tokens, num_topk], "
                "contiguous; n a positive multiple of num_ep_ranks; 0 <= tp_rank < num_tp_ranks; "
                "per_gpu * num_tp_ranks < 2^31."
            ),
        ),
    ],
)
