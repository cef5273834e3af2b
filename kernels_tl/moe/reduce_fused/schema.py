"""moe.reduce_fused: one kernel per (input dtype, output dtype, path); the token count, fused
rows, hidden size, top-k and the options (weights, per-row x_sf, output sf) are run-time values.
The host takes the burst path when its grid (one thread per 32 bytes of every token's row) fits
in one wave of 4 blocks of 128 threads per SM (67584 threads on 132 SMs, 75776 on 148), the
stream path otherwise; the samples name the path they take on a 132-SM H200."""

from kernels_tl.schema import Op, Out, Param, QuantizedTensor, Rand, Randn, Routed, Routing, Sample, Schema, Str, Tensor

POS = Routed("token_topk_to_pos")
DENSE = Routing(num_topk=8, num_experts=32)
# upstream's benchmark layout: 4001 tokens per rank x 8 EP ranks, top-6 of 72 experts, 9 per
# rank: the tokens with at least one local expert (about 1.31 of 6 slots routed), rows sized exactly
UPSTREAM = Routing(num_topk=6, num_experts=9, unrouted=0.782, exact=True)
# the MoE layer's routing (moe_layer.py): top-8 of 256 experts, alignment 16, rows at the no-sync bound
LAYER = Routing(num_topk=8, num_experts=256, alignment=16)


def _rows(hidden: int, dtype: str = "bfloat16"):
    return Randn(["P", hidden], dtype)


def _weights(num_topk: int):
    return Rand(["T", num_topk], "float32")


SCALE = Rand([1], "float32", 0.5, 2.0)

SCHEMA = Schema(
    static=("in_dtype", "out_dtype", "path"),
    ops=[
        Op(
            module="moe",
            name="reduce_fused",
            params=[
                Param("x", QuantizedTensor(["bfloat16", "float32"], ["float32"], 2, plain_dtypes=["bfloat16", "float32"])),
                Param("topk_weights", Tensor(["float32"], 2, optional=True)),
                Param("token_topk_to_pos", Tensor(["int32"], 2)),
                Param("fp8_format", Str(["", "e4m3"]), ""),
                Param("sf", Tensor(["float32"], 1, optional=True), None),
            ],
            # upstream takes out positionally, after sf
            outs=[Out("out", dtype="'float8_e4m3fn' if fp8_format == 'e4m3' else x.dtype",
                      shape="[token_topk_to_pos.shape[0], x.shape[1]]", positional=True)],
            returns=["out"],
            reference="tile_kernels_aot.torch.moe.reduce_fused",
            samples=[
                # burst path (a grid resident at once)
                Sample("decode", 128, [_rows(7168), _weights(8), POS], routing=DENSE),
                Sample("decode: the MoE layer's call", 128, [_rows(3584), None, POS], routing=LAYER),
                Sample("burst: (x, x_sf), fp32 to e4m3 with sf, top-9", 128,
                       [(_rows(2560, "float32"), Rand(["P"], "float32", 0.5, 2.0)), _weights(9), POS, "e4m3", SCALE],
                       routing=Routing(num_topk=9, num_experts=72, alignment=16, unrouted=0.2)),
                Sample("burst: e4m3 saturating, sf", 100, [_rows(4096), _weights(8), POS, "e4m3",
                                                           Rand([1], "float32", 100.0, 400.0)], routing=DENSE),
                Sample("burst: top-20 in three rounds, hidden 256, a partial block", 37, [_rows(256), _weights(20), POS],
                       routing=Routing(num_topk=20, num_experts=40, alignment=8, unrouted=0.3)),
                Sample("burst: one full wave (150 tokens at hidden 7168)", 150, [_rows(7168), None, POS], routing=DENSE),
                # stream path
                Sample("stream: one token past a burst wave (151 tokens at hidden 7168)", 151, [_rows(7168), None, POS],
                       routing=DENSE),
                Sample("prefill", 8192, [_rows(7168), _weights(8), POS], routing=DENSE),
                Sample("upstream: e4m3 with sf", 18356, [_rows(7168), _weights(6), POS, "e4m3", SCALE], routing=UPSTREAM),
                Sample("upstream: e4m3", 18428, [_rows(7168), _weights(6), POS, "e4m3"], routing=UPSTREAM),
                Sample("e4m3 saturating, sf", 2000, [_rows(4096), _weights(8), POS, "e4m3", Rand([1], "float32", 100.0, 400.0)],
                       routing=DENSE),
                Sample("no weights, fp32", 2000, [_rows(2048, "float32"), None, POS],
                       routing=Routing(num_topk=6, num_experts=16, alignment=64, unrouted=0.3)),
                Sample("(x, x_sf), fp32 to e4m3 with sf", 1000,
                       [(_rows(2560, "float32"), Rand(["P"], "float32", 0.5, 2.0)), _weights(9), POS, "e4m3", SCALE],
                       routing=Routing(num_topk=9, num_experts=72, alignment=16, unrouted=0.2)),
                Sample("(x, x_sf), no weights, bf16", 1000, [(_rows(3072), Rand(["P"], "float32", 0.5, 2.0)), None, POS],
                       routing=Routing(num_topk=4, num_experts=8, alignment=4, unrouted=0.5)),
                Sample("top-1, hidden 1024", 3000, [_rows(1024), _weights(1), POS], routing=Routing(num_topk=1, num_experts=8)),
            ],
            dims=[],
            # the routed rows of x (and their x_sf) are read once; the positions, weights, sf and out once
            bytes=("(token_topk_to_pos >= 0).sum().item() * (x.shape[1] * x.element_size() + (4 if x_sf is not None else 0))"
                   " + token_topk_to_pos.nbytes + (topk_weights.nbytes if topk_weights is not None else 0)"
                   " + (4 if sf is not None else 0) + out.nbytes"),
            doc=("reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format='', sf=None, out=None) -> [num_tokens, "
                 "hidden]: per token, in float32, acc = fma(x[p], w[t, k] * x_sf[p], acc) over its routed positions "
                 "p = token_topk_to_pos[t, k] >= 0 in k order (w = 1 without weights, x_sf = 1 for a plain x), then "
                 "acc * sf[0], rounded to x.dtype or to e4m3 (saturating).  x: [num_expanded_tokens, hidden] bf16/fp32 "
                 "(hidden % 256 == 0) or (x, x_sf [num_expanded_tokens] fp32)."),
        ),
    ],
)
