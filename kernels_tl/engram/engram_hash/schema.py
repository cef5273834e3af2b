"""engram.engram_hash: one kernel; tokens, n-gram size, layers and tables per n-gram are
run-time values."""

from kernels_tl.schema import Op, Out, Param, Randint, Sample, Schema, Tensor


def _sample(name, tokens, n, layers, tables, id_range=(0, 100000), mult_range=(0, 100000)):
    # upstream's ranges: ids and multipliers below 1e5, table sizes in [1e5, 1e6); offsets any int32
    return Sample(name, tokens, [
        Randint(["T", n], "int32", *id_range),
        Randint([layers, n], "int64", *mult_range),
        Randint([layers, n - 1, tables], "int32", 100000, 1000000),
        Randint([layers, (n - 1) * tables], "int32", 0, 1 << 24),
    ])


SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="engram",
            name="engram_hash",
            params=[Param("ngram_token_ids", Tensor(["int32"], 2)),
                    Param("multipliers", Tensor(["int64"], 2)),
                    Param("vocab_sizes", Tensor(["int32"], 3)),
                    Param("offsets", Tensor(["int32"], 2))],
            outs=[Out("output", dtype="'int32'",
                      shape="[vocab_sizes.shape[0], ngram_token_ids.shape[0], "
                            "(ngram_token_ids.shape[1] - 1) * vocab_sizes.shape[2]]")],
            returns=["output"],
            reference="tile_kernels_aot.torch.engram.engram_hash",
            samples=[
                _sample("decode", 128, 3, 2, 8),
                _sample("prefill", 8192, 3, 2, 8),
                _sample("upstream 8001", 8001, 3, 2, 8),
                _sample("upstream 4001", 4001, 3, 2, 8),
                _sample("n=2, E=4", 777, 2, 2, 4),
                # negative ids, int64-overflowing products: wrapping XOR, floor modulo
                _sample("n=4, wide", 777, 4, 3, 8, (-(2**31), 2**31 - 1), (-(2**62), 2**62)),
            ],
            token_dim=None,  # per-token rows, but the output's token dim is its second ([L, T, ...])
            doc=("engram_hash(ngram_token_ids, multipliers, vocab_sizes, offsets) -> [L, T, (n-1)*E] int32: "
                 "h_i = XOR_{j<=i} int64(ids[t, j]) * multipliers[l, j] (wrapping), "
                 "out[l, t, (i-1)*E + e] = int32(floormod(h_i, vocab_sizes[l, i-1, e]) + offsets[l, (i-1)*E + e]).  "
                 "ngram_token_ids: int32 [T, n]; multipliers: int64 [L, n]; vocab_sizes: int32 [L, n-1, E] "
                 "(nonzero); offsets: int32 [L, (n-1)*E]; all contiguous."),
        ),
    ],
)
