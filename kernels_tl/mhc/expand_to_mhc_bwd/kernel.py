"""mhc.expand_to_mhc_bwd: the gradient of ``expand_to_mhc``, the sum of the stream gradients.

``out_grad`` bf16 [num_tokens, M, H] -> bf16 [num_tokens, H]: in float32, ``acc = 0``,
``acc = acc + out_grad[t, m, h]`` for ``m = 0, 1, ...`` (IEEE adds, the reference's
order), rounded to nearest even once.

Design
------
Bound by memory: ``2 * M * H`` bytes read, ``2 * H`` written per token.  One thread per
16-byte piece of a row (flat thread index over ``num_tokens * pieces``): the ``M`` pieces
of the streams are loaded together (64 bytes in flight per thread for ``M = 4``), summed,
and one piece stored.  No static dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import MIN_BLOCKS_PER_SM, PIECE, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS


def expand_to_mhc_bwd_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    @T.prim_func
    def expand_to_mhc_bwd(
        out_grad: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        hidden_grad: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
    ):
        with T.Kernel(T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            g = T.alloc_local((M, PIECE), T.bfloat16)
            acc = T.alloc_local((PIECE,), T.float32)
            token = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            token = (bid * THREADS + tid) // pieces
            lane = (bid * THREADS + tid) - token * pieces
            if token < num_tokens:
                for m in T.unroll(M):
                    for u in T.vectorized(PIECE):
                        g[m, u] = out_grad[token, m, lane, u]
                for u in T.unroll(PIECE):
                    acc[u] = T.float32(0)
                for m in T.unroll(M):
                    for u in T.unroll(PIECE):
                        acc[u] = T.ieee_add(acc[u], T.cast(g[m, u], T.float32))
                for u in T.vectorized(PIECE):
                    hidden_grad[token, lane, u] = T.cast(acc[u], T.bfloat16)

    return expand_to_mhc_bwd
