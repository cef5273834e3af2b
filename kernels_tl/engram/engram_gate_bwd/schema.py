"""engram.engram_gate_bwd: two kernels per hidden size (hc_mult 4), the small-batch one
(``small_batch``: the host's choice for at most one token per SM) and the persistent one;
tokens, strides, P and clamp_value are run-time values."""

from kernels_tl.schema import Float, Op, Out, Param, Rand, Randn, Sample, Schema, Tensor

CLAMP = 1e-6  # upstream's test and benchmark value


def _sample(name, tokens, hidden, clamp=CLAMP):
    # the saved intermediates drawn independently: the kernel reads them as given (the
    # reference computes from the same values), so any finite values test the arithmetic
    return Sample(name, tokens, [
        Randn(["T", 4, hidden], "bfloat16"),  # grad_out
        Randn(["T", 4, hidden], "bfloat16"),  # hidden_states
        Randn(["T", 4, hidden], "bfloat16"),  # k
        Randn(["T", hidden], "bfloat16"),  # v
        Randn([4, hidden], "float32"),  # weight_fused
        Randn(["T", 4], "float32"),  # dot (|dot| * c near 0 for some tokens: the clamp branch)
        Rand(["T", 4], "float32", 0.0, 1.0),  # gate_score
        Rand(["T", 4], "float32", 0.001, 0.05),  # rstd_x
        Rand(["T", 4], "float32", 0.001, 0.05),  # rstd_k
        clamp,
    ])


T_C = "[hidden_states.shape[0], hidden_states.shape[1]]"

SCHEMA = Schema(
    static=("hc_mult", "hidden", "small_batch"),
    ops=[
        Op(
            module="engram",
            name="engram_gate_bwd",
            params=[Param("grad_out", Tensor(["bfloat16"], 3)),
                    Param("hidden_states", Tensor(["bfloat16"], 3)),
                    Param("k", Tensor(["bfloat16"], 3, contiguous=False)),
                    Param("v", Tensor(["bfloat16"], 2, contiguous=False)),
                    Param("weight_fused", Tensor(["float32"], 2)),
                    Param("dot", Tensor(["float32"], 2)),
                    Param("gate_score", Tensor(["float32"], 2)),
                    Param("rstd_x", Tensor(["float32"], 2)),
                    Param("rstd_k", Tensor(["float32"], 2)),
                    Param("clamp_value", Float())],
            outs=[Out("grad_hidden_states", dtype="hidden_states.dtype", shape="list(hidden_states.shape)"),
                  Out("grad_k", dtype="k.dtype", shape="list(k.shape)"),
                  Out("grad_v", dtype="v.dtype", shape="list(v.shape)"),
                  Out("grad_w_partial", dtype="'float32'",
                      shape="[num_sms(hidden_states), hidden_states.shape[1], hidden_states.shape[2]]")],
            returns=["grad_hidden_states", "grad_k", "grad_v", "grad_w_partial"],
            reference="tile_kernels_aot.torch.engram.engram_gate_bwd",
            samples=[
                _sample("decode", 128, 7168),  # fewer tokens than P (132): one-token and empty chunks
                _sample("prefill", 8192, 7168),
                _sample("upstream 8001", 8001, 7168),
                _sample("upstream 4001", 4001, 7168),
                _sample("hidden=2048", 1000, 2048),
                _sample("hidden=4096", 1000, 4096),
                _sample("clamp=0.01 (often active)", 1000, 2048, clamp=0.01),
                _sample("5 tokens (most chunks empty)", 5, 4096),
            ],
            token_dim=None,  # grad_w_partial sums over token chunks: rows are not independent
            bytes=("grad_out.nbytes + hidden_states.nbytes + k.nbytes + v.nbytes + weight_fused.nbytes "
                   "+ 4 * dot.nbytes + grad_hidden_states.nbytes + grad_k.nbytes + grad_v.nbytes "
                   "+ grad_w_partial.nbytes"),
            doc=("engram_gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, "
                 "clamp_value) -> (grad_hidden_states, grad_k, grad_v, grad_w_partial): the gradients of "
                 "engram_gate_fwd from its saved intermediates; grad_w_partial [P, 4, H] float32 holds dL/dw summed "
                 "over P contiguous token chunks (P = the device's SM count; reduce with grad_w_reduce).  grad_out, "
                 "hidden_states: bf16 [T, 4, H] contiguous; k: bf16 [T, 4, H] (last dim unit-stride); v: bf16 [T, H] "
                 "(last dim unit-stride); weight_fused: float32 [4, H]; saved: float32 [T, 4]; H a multiple of 1024."),
        ),
    ],
)
