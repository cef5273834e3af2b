"""engram.engram_gate_fwd: two kernels per (hc_mult, hidden) (``batch``: the host takes "small",
fewer and longer stages, up to 8 tokens per block, and "large" above); tokens, strides, eps,
clamp_value and save_for_backward are run-time values."""

from kernels_tl.schema import Bool, Float, Op, Out, Param, Randn, Sample, Schema, Tensor

EPS = 1e-20  # upstream's test and benchmark values
CLAMP = 1e-6


def _sample(name, tokens, hidden, hc=4, save=True, clamp=CLAMP, eps=EPS):
    return Sample(name, tokens, [
        Randn(["T", hc, hidden], "bfloat16"),
        Randn(["T", hc, hidden], "bfloat16"),
        Randn(["T", hidden], "bfloat16"),
        Randn([hc, hidden], "float32"),
        eps, clamp, save,
    ])


# None (absent) unless save_for_backward
SAVED = "[hidden_states.shape[0], hidden_states.shape[1]] if save_for_backward else None"

SCHEMA = Schema(
    static=("hc_mult", "hidden", "batch"),
    ops=[
        Op(
            module="engram",
            name="engram_gate_fwd",
            params=[Param("hidden_states", Tensor(["bfloat16"], 3)),
                    Param("k", Tensor(["bfloat16"], 3, contiguous=False)),
                    Param("v", Tensor(["bfloat16"], 2, contiguous=False)),
                    Param("weight_fused", Tensor(["float32"], 2)),
                    Param("eps", Float()),
                    Param("clamp_value", Float()),
                    Param("save_for_backward", Bool(), True)],
            outs=[Out("output", dtype="hidden_states.dtype", shape="list(hidden_states.shape)"),
                  Out("dot", dtype="'float32'", shape=SAVED, optional=True),
                  Out("gate_score", dtype="'float32'", shape=SAVED, optional=True),
                  Out("rstd_x", dtype="'float32'", shape=SAVED, optional=True),
                  Out("rstd_k", dtype="'float32'", shape=SAVED, optional=True)],
            returns=["output", "dot", "gate_score", "rstd_x", "rstd_k"],
            reference="tile_kernels_aot.torch.engram.engram_gate_fwd",
            samples=[
                _sample("decode", 128, 7168),
                _sample("prefill", 8192, 7168),
                _sample("upstream 8001", 8001, 7168),
                _sample("upstream 4001", 4001, 7168),
                _sample("decode, inference", 128, 7168, save=False),
                _sample("prefill, inference", 8192, 7168, save=False),
                _sample("hidden=2048", 1000, 2048),
                _sample("hidden=2560 (one-step stages, ring of 5)", 1000, 2560),
                _sample("hidden=4096", 1000, 4096),
                _sample("hidden=4096, inference", 1000, 4096, save=False),
                *[_sample(f"hidden={h}", 1000, h) for h in (3072, 5120, 6144)],
                _sample("clamp=0.3 (active)", 1000, 2048, clamp=0.3),
                _sample("eps=1e-6", 300, 4096, eps=1e-6),
                # the small layout at every table H (CHUNK 4 / 5 / 6 / 8 / 5 / 8 at 2048 .. 6144), and
                # both sides of the host's choice on a 132-SM part (33 groups: 264 tokens small, 265 large)
                *[_sample(f"decode, hidden={h}", 64, h) for h in (2048, 2560, 3072, 5120, 6144)],
                _sample("decode, hidden=4096, inference", 64, 4096, save=False),
                _sample("264 tokens (the small layout's most on 132 SMs)", 264, 7168),
                _sample("265 tokens (the large layout's fewest on 132 SMs)", 265, 7168),
            ],
            doc=("engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, save_for_backward=True) -> "
                 "(output, dot, gate_score, rstd_x, rstd_k): output [T, hc, H] bf16 = x + gate * v with "
                 "gate = sigmoid(copysign(sqrt(max(|z|, clamp_value)), z)), z = dot * rstd_x * rstd_k / sqrt(H), "
                 "dot = sum x * w * k, rstd = 1 / sqrt(mean(square) + eps); the four [T, hc] float32 intermediates "
                 "are None unless save_for_backward.  hidden_states: bf16 [T, hc, H] contiguous; k: bf16 [T, hc, H] "
                 "(last dim unit-stride); v: bf16 [T, H] (last dim unit-stride); weight_fused: float32 [hc, H]; "
                 "H a multiple of 256."),
        ),
    ],
)
