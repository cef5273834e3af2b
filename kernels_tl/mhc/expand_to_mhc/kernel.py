"""mhc.expand_to_mhc: every token's hidden row copied into ``mhc_mult`` residual streams.

``hidden`` bf16 [num_tokens, H] -> ``out`` bf16 [num_tokens, M, H], ``out[t, m] = hidden[t]``
(bit copies: the kernel moves 32-bit words).

Design
------
Bound by memory: ``2 * H`` bytes read and ``2 * M * H`` written per token.  One thread per
16-byte piece of a row (``pieces = H / 8``; flat thread index over ``num_tokens * pieces``,
one 32-bit division): the piece is loaded once and stored to the ``M`` streams, every warp
instruction covering 512 contiguous bytes.  No static dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import MIN_BLOCKS_PER_SM, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS


def expand_to_mhc_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")  # 16-byte pieces per row: H / 8

    @T.prim_func
    def expand_to_mhc(
        hidden: T.Tensor[(num_tokens, pieces, 4), T.uint32],
        out: T.Tensor[(num_tokens, M, pieces, 4), T.uint32],
    ):
        with T.Kernel(T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            buf = T.alloc_local((4,), T.uint32)
            token = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            token = (bid * THREADS + tid) // pieces
            lane = (bid * THREADS + tid) - token * pieces
            if token < num_tokens:
                for u in T.vectorized(4):
                    buf[u] = hidden[token, lane, u]
                for m in T.unroll(M):
                    for u in T.vectorized(4):
                        out[token, m, lane, u] = buf[u]

    return expand_to_mhc
