"""mhc.pre_apply_mix: the sublayer input, the streams weighted by the pre mix.

``x`` bf16 [num_tokens, M, H], ``mix`` fp32 [num_tokens, M] (the reference's ``[.., M, 1]``)
-> ``out`` bf16 [num_tokens, H]: ``p_m = x[t, m, h] * mix[t, m]`` (one float32 rounding
each), summed as PyTorch's ``sum(-2)`` sums them (``streams.torch_stream_sum``: stream
order ``((0 + p0) + p1) + ...`` for ``M <= 4``), rounded to nearest even once.  The
products and sums are IEEE operations (``__fmul_rn``/``__fadd_rn``), never contracted
into FMAs, since the reference rounds each product.

Design
------
Bound by memory: ``2 * M * H + 4 * M`` bytes read, ``2 * H`` written per token.  One thread
per 16-byte piece of a row (flat thread index over ``num_tokens * pieces``): the ``M``
pieces of the streams (64 bytes in flight per thread for ``M = 4``) and the token's ``M``
weights (an L1 hit for all but the first lanes of a token), one piece stored.  No static
dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.stream_math import apply_mix_value
from kernels_tl.mhc.streams import MIN_BLOCKS_PER_SM, PIECE, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS


def pre_apply_mix_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    @T.prim_func
    def pre_apply_mix(
        x: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        mix: T.Tensor[(num_tokens, M), T.float32],
        out: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
    ):
        with T.Kernel(T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            xs = T.alloc_local((M, PIECE), T.bfloat16)
            w = T.alloc_local((M,), T.float32)
            acc = T.alloc_local((PIECE,), T.float32)
            token = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            token = (bid * THREADS + tid) // pieces
            lane = (bid * THREADS + tid) - token * pieces
            if token < num_tokens:
                for m in T.unroll(M):
                    for u in T.vectorized(PIECE):
                        xs[m, u] = x[token, m, lane, u]
                for m in T.unroll(M):
                    w[m] = mix[token, m]
                for u in T.unroll(PIECE):
                    acc[u] = apply_mix_value(xs, w, u, M)
                for u in T.vectorized(PIECE):
                    out[token, lane, u] = T.cast(acc[u], T.bfloat16)

    return pre_apply_mix
