"""engram.grad_w_reduce: one kernel; P and the weights' shape are run-time values."""

from kernels_tl.schema import Op, Param, Randn, Sample, Schema, Tensor


def _sample(name, rows, hc, hidden):
    return Sample(name, 1, [
        Randn([rows, hc, hidden], "float32"),
        Randn([hc, hidden], "bfloat16"),
        Randn([hc, hidden], "bfloat16"),
        Randn([hc, hidden], "float32"),
        Randn([hc, hidden], "float32"),
    ])


SCHEMA = Schema(
    static=(),
    ops=[
        Op(
            module="engram",
            name="grad_w_reduce",
            params=[Param("grad_w_partial", Tensor(["float32"], 3)),
                    Param("weight_hidden", Tensor(["bfloat16"], 2)),
                    Param("weight_embed", Tensor(["bfloat16"], 2)),
                    Param("grad_weight_hidden", Tensor(["float32"], 2, mutable=True)),
                    Param("grad_weight_embed", Tensor(["float32"], 2, mutable=True))],
            outs=[],
            returns=[],
            reference="tile_kernels_aot.torch.engram.grad_w_reduce",
            samples=[
                _sample("upstream: hidden 7168", 132, 4, 7168),  # P = the H200's SMs
                _sample("upstream: hidden 2048", 132, 4, 2048),
                _sample("hidden=4096", 132, 4, 4096),
                _sample("P=148 (B200), hc=2", 148, 2, 1024),
                _sample("P=5", 5, 4, 512),
                _sample("P=300 (ring refills)", 300, 4, 1024),
                _sample("P=200, hc=3, hidden=1001 (4-byte copies, ring refills)", 200, 3, 1001),
            ],
            token_dim=None,
            doc=("grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> "
                 "None: G = sum_p grad_w_partial[p] (rows in order), grad_weight_hidden += G * weight_embed, "
                 "grad_weight_embed += G * weight_hidden, in place.  grad_w_partial: float32 [P, hc_mult, hidden]; "
                 "weights: bfloat16 [hc_mult, hidden]; gradients: float32 [hc_mult, hidden]; all contiguous."),
        ),
    ],
)
