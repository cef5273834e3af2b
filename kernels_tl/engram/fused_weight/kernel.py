"""engram.fused_weight: ``w = float(weight_hidden) * float(weight_embed)``.

``weight_hidden``, ``weight_embed`` bf16 [hc_mult, hidden] (contiguous) -> ``weight_fused``
fp32 [hc_mult, hidden].  The product of two bf16 values has at most 16 significant bits, so
the fp32 product is exact.

Design
------
A flat elementwise kernel over ``hc_mult * hidden`` elements (a run-time count: one cubin
for every shape), ``PIECE`` = 8 elements per thread: one 16-byte load of each weight, two
16-byte stores.  A few KB to a few hundred KB per call: one wave of blocks, bound by
launch latency.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 128
PIECE = 8  # bf16 elements per 16-byte load
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def fused_weight_kernel():
    num_pieces = T.dynamic("num_pieces")  # hc_mult * hidden / 8

    @T.prim_func
    def fused_weight(
        weight_hidden: T.Tensor[(num_pieces, PIECE), T.bfloat16],
        weight_embed: T.Tensor[(num_pieces, PIECE), T.bfloat16],
        weight_fused: T.Tensor[(num_pieces, PIECE), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            piece = bid * THREADS + T.get_thread_binding()
            a = T.alloc_local((PIECE,), T.bfloat16)
            b = T.alloc_local((PIECE,), T.bfloat16)
            w = T.alloc_local((PIECE,), T.float32)
            if piece < num_pieces:
                for i in T.vectorized(PIECE):
                    a[i] = weight_hidden[piece, i]
                for i in T.vectorized(PIECE):
                    b[i] = weight_embed[piece, i]
                for i in T.unroll(PIECE):
                    w[i] = T.cast(a[i], T.float32) * T.cast(b[i], T.float32)
                for i in T.vectorized(PIECE):
                    weight_fused[piece, i] = w[i]

    return fused_weight
