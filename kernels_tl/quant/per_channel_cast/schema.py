"""quant.per_channel_cast, per_channel_cast_and_transpose and per_channel_cast_fused: one kernel
per (input dtype, transposed output, wide layout); the token count, output rows, hidden size,
num_per_tokens, round_sf and the row gather (pos_to_token) are run-time values.  A pre-quantized
(data, sf) input of per_channel_cast_fused is the float8_e4m3fn config (wide); a bf16 x with a
gather takes the wide bf16 config."""

from kernels_tl.schema import (Bool, Int, Op, Out, Param, QuantizedTensor, Rand, Randn, Routed, Routing, Sample,
                               Schema, Str, Tensor)

_PARAMS = [
    Param("fmt", Str(["e4m3"])),
    Param("num_per_tokens", Int()),
    Param("round_sf", Bool(), False),
]
_OUT_SF = Out("out_sf", dtype="'float32'", shape="[x.shape[0] // num_per_tokens, x.shape[1]]")

POS = Routed("pos_to_token")
# upstream's benchmark layout: 4001 tokens per rank x 8 EP ranks, top-6 of 72 experts, the 9 of one
# rank; the tokens with at least one local expert, rows aligned to 128 and sized exactly
UPSTREAM = Routing(num_topk=6, num_experts=9, alignment=128, unrouted=0.782, exact=True)
# alignment 16: the last 128-row block is partial; some slots unrouted (padding rows)
TAIL = Routing(num_topk=8, num_experts=32, alignment=16, unrouted=0.3, exact=True)


def _plain_op(name: str, dtypes: list, out_shape: str, samples: list, doc: str) -> Op:
    """per_channel_cast or per_channel_cast_and_transpose: a plain x, T % 128 == 0."""
    return Op(module="quant", name=name, params=[Param("x", Tensor(dtypes, 2)), *_PARAMS],
              outs=[Out("out", dtype="'float8_e4m3fn'", shape=out_shape), _OUT_SF], returns=["out", "out_sf"],
              reference=f"tile_kernels_aot.torch.quant.{name}", samples=samples, token_multiple=128, doc=doc,
              token_dim=None)  # a factor spans num_per_tokens rows: rows are not independent


def _x(hidden: int, dtype: str = "bfloat16"):
    return Randn(["T", hidden], dtype)


def _pre_quantized(hidden: int):
    """(e4m3 codes [T, hidden], fp32 per-token factors over 128 channels [T, hidden / 128])."""
    return (Randn(["T", hidden], "float8_e4m3fn"), Rand(["T", hidden // 128], "float32", 0.5, 2.0))


SCHEMA = Schema(
    static=("in_dtype", "transpose", "wide"),
    ops=[
        _plain_op(
            "per_channel_cast", ["bfloat16", "float32"], "list(x.shape)",
            [
                Sample("decode", 128, [_x(7168), "e4m3", 128]),
                Sample("prefill", 8192, [_x(7168), "e4m3", 128]),
                Sample("upstream: bf16", 8064, [_x(7168), "e4m3", 128]),
                Sample("fp32, round_sf", 1024, [_x(4096, "float32"), "e4m3", 128, True]),
                Sample("hidden 576", 384, [_x(576), "e4m3", 128]),
                Sample("fp32, hidden 576 (18 tiles of 32 channels)", 256, [_x(576, "float32"), "e4m3", 128]),
            ],
            "Quantize x [T, H] (bf16/fp32, T % 128 == 0, H % 64 == 0) to e4m3 with one float32 factor per "
            "channel per 128 rows; returns (out [T, H], out_sf [T / 128, H]).",
        ),
        _plain_op(
            "per_channel_cast_and_transpose", ["bfloat16"], "[x.shape[1], x.shape[0]]",
            [
                Sample("decode", 128, [_x(7168), "e4m3", 128]),
                Sample("prefill", 8192, [_x(7168), "e4m3", 128]),
                Sample("upstream: bf16", 8064, [_x(7168), "e4m3", 128]),
                Sample("32 rows per factor, round_sf", 1024, [_x(2560), "e4m3", 32, True]),
                Sample("hidden 576, 32 rows per factor", 384, [_x(576), "e4m3", 32]),
            ],
            "Quantize x [T, H] (bf16, T % 128 == 0, H % 64 == 0) to e4m3 with one float32 factor per channel "
            "per num_per_tokens (32 or 128) rows, output transposed; returns (out [H, T], "
            "out_sf [T / num_per_tokens, H]).",
        ),
        Op(
            module="quant",
            name="per_channel_cast_fused",
            token_dim=None,  # a factor spans num_per_tokens rows: rows are not independent
            params=[
                Param("x", QuantizedTensor(["float8_e4m3fn"], ["float32"], 2, plain_dtypes=["bfloat16", "float32"])),
                *_PARAMS,
                Param("num_per_channels", Int(optional=True), None),
                Param("pos_to_token", Tensor(["int32"], 1, optional=True), None),
            ],
            outs=[Out("out", dtype="'float8_e4m3fn'", shape="[rows, x.shape[1]]"),
                  Out("out_sf", dtype="'float32'", shape="[ceil_div(rows, num_per_tokens), x.shape[1]]")],
            returns=["out", "out_sf"],
            reference="tile_kernels_aot.torch.quant.per_channel_cast_fused",
            samples=[
                Sample("decode", 128, [_x(7168), "e4m3", 128]),
                Sample("prefill", 8192, [_x(7168), "e4m3", 128]),
                Sample("upstream: gather", 18287, [_x(7168), "e4m3", 128], {"pos_to_token": POS}, routing=UPSTREAM),
                Sample("upstream: gather, fused cast-back", 18434, [_pre_quantized(7168), "e4m3", 128],
                       {"num_per_channels": 128, "pos_to_token": POS}, routing=UPSTREAM),
                Sample("gather, partial last block, round_sf", 1000, [_x(4096), "e4m3", 128, True],
                       {"pos_to_token": POS}, routing=TAIL),
                Sample("gather, fp32, hidden 576", 1000, [_x(576, "float32"), "e4m3", 128],
                       {"pos_to_token": POS}, routing=TAIL),
                # the wide layout's tile is 256 bytes of a row: 576 bf16 channels end half-way into the last one
                Sample("gather, hidden 576 (partial last tile)", 1000, [_x(576), "e4m3", 128],
                       {"pos_to_token": POS}, routing=TAIL),
                Sample("gather, fused cast-back, hidden 1152 (partial last tile)", 1000, [_pre_quantized(1152), "e4m3", 128],
                       {"num_per_channels": 128, "pos_to_token": POS}, routing=TAIL),
                Sample("gather, fused cast-back, partial last block, round_sf", 1000,
                       [_pre_quantized(2048), "e4m3", 128, True], {"num_per_channels": 128, "pos_to_token": POS},
                       routing=TAIL),
                Sample("fused cast-back", 1024, [_pre_quantized(3072), "e4m3", 128], {"num_per_channels": 128}),
                Sample("fp32, round_sf", 1024, [_x(6144, "float32"), "e4m3", 128, True]),
            ],
            dims=[("rows", "pos_to_token.shape[0] if pos_to_token is not None else x.shape[0]")],
            token_multiple=128,
            # every output row reads its gathered row (and its x_sf row) once; positions, out and out_sf once
            bytes=("((pos_to_token >= 0).sum().item() if pos_to_token is not None else x.shape[0])"
                   " * (x.shape[1] * x.element_size() + (x_sf.shape[1] * 4 if x_sf is not None else 0))"
                   " + (pos_to_token.nbytes if pos_to_token is not None else 0) + out.nbytes + out_sf.nbytes"),
            doc="Quantize x [T, H] (bf16/fp32, or a pre-quantized (e4m3 data, fp32 sf [T, H / 128]) pair with "
                "num_per_channels=128, cast back first) to e4m3 with one float32 factor per channel per 128 "
                "rows, optionally gathering the rows through pos_to_token [T_out] (T_out % 16 == 0; a negative "
                "entry gives a zero row; without it T % 128 == 0); returns (out [T_out, H], "
                "out_sf [ceil(T_out / 128), H]).",
        ),
    ],
)
