"""mhc.post (``mhc_post``, ``mhc_post_fwd``): the new residual streams after a sublayer.

``x`` bf16 [num_tokens, H], ``residual`` bf16 [num_tokens, M, H], ``post`` fp32
[num_tokens, M] (the reference's ``[.., M, 1]``), ``comb`` fp32 [num_tokens, M, M] ->
``out`` bf16 [num_tokens, M, H]:

    mixed[n, h] = sum_m comb[m, n] * residual[m, h]     FMAs in stream order from 0
    out[n, h]   = (x[h] * post[n]) + mixed[n, h]       two IEEE roundings, then bf16

The reference computes ``mixed`` with one batched float32 GEMM (``einsum``, cuBLAS) and
then ``x * post + mixed`` as two rounded elementwise operations; the kernel does the
latter exactly and the GEMM's inner product as an FMA chain over ``m = 0, 1, ...``
starting from zero, the order a GEMM with ``K = M`` accumulates in.  Whether cuBLAS's
kernel does is not something the reference fixes, hence the op's tolerance (docs/ops.md).

Design
------
Bound by memory: ``2 * H + 2 * M * H + 4 * M * (M + 1)`` bytes read and ``2 * M * H``
written per token.  One thread per 16-byte piece of a row (flat thread index over
``num_tokens * pieces``): the piece of ``x`` and the ``M`` pieces of ``residual`` are loaded
together (80 bytes in flight for ``M = 4``), with the token's ``M * (M + 1)`` mixes (L1
hits for all but the first lanes of a token); ``M`` pieces stored.  No static dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.stream_math import post_piece
from kernels_tl.mhc.streams import MIN_BLOCKS_PER_SM, PIECE, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS


def post_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    @T.prim_func
    def post(
        x: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        residual: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        post_mix: T.Tensor[(num_tokens, M), T.float32],
        comb_mix: T.Tensor[(num_tokens, M, M), T.float32],
        out: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
    ):
        with T.Kernel(T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            xs = T.alloc_local((PIECE,), T.bfloat16)
            rs = T.alloc_local((M, PIECE), T.bfloat16)
            pw = T.alloc_local((M,), T.float32)
            cw = T.alloc_local((M, M), T.float32)
            mixed = T.alloc_local((PIECE,), T.float32)
            os = T.alloc_local((PIECE,), T.bfloat16)
            token = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            token = (bid * THREADS + tid) // pieces
            lane = (bid * THREADS + tid) - token * pieces
            if token < num_tokens:
                for u in T.vectorized(PIECE):
                    xs[u] = x[token, lane, u]
                for m in T.unroll(M):
                    for u in T.vectorized(PIECE):
                        rs[m, u] = residual[token, m, lane, u]
                for m in T.unroll(M):
                    pw[m] = post_mix[token, m]
                    for n in T.unroll(M):
                        cw[m, n] = comb_mix[token, m, n]
                for n in T.unroll(M):
                    post_piece(xs, rs, pw, cw, mixed, os, n)
                    for u in T.vectorized(PIECE):
                        out[token, n, lane, u] = os[u]

    return post
