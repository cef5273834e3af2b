"""mhc.post_bwd: the gradients of ``mhc_post``.

``x`` bf16 [num_tokens, H], ``residual`` bf16 [num_tokens, M, H], ``post`` fp32
[num_tokens, M], ``comb`` fp32 [num_tokens, M, M], ``d_o`` bf16 [num_tokens, M, H] (``g``)
-> in float32:

    d_x[h]           = sum_n g[n, h] * post[n]       products rounded, summed as the
                                                     reference's ``sum(-2)`` (stream order)
    d_residual[m, h] = sum_n comb[m, n] * g[n, h]    FMAs in stream order from 0
    d_post[n]        = sum_h x[h] * g[n, h]
    d_comb[m, n]     = sum_h residual[m, h] * g[n, h]

``d_x`` and ``d_residual`` rounded to bf16 once.  ``d_x`` follows the reference's
operations exactly.  The reference computes ``d_residual`` with a batched float32 GEMM
(cuBLAS), whose accumulation order it does not fix, and ``d_post``/``d_comb`` with
reductions over the hidden size (PyTorch's reduction tree, cuBLAS), whose order depends on
the launch shape: those three match within the op's tolerance (docs/ops.md).  The sums
over the hidden size run as FMAs per thread over its pieces, then across the block
(``streams.block_partials``/``block_total``).

Design
------
Bound by memory: ``2 * H + 4 * M * H + 4 * M * (M + 1)`` bytes read, ``2 * H + 2 * M * H +
4 * M * (M + 1)`` written per token.  One block of ``BLOCK`` threads per token; thread
``tid`` takes the pieces ``tid, tid + BLOCK, ...``, each with the ``2 * M + 1`` pieces of
``d_o``, ``residual`` and ``x`` loaded together.  The ``M * (M + 1)`` partial sums stay in
registers until the block reduction.  No static dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.load_order import DEVICE_SOURCE as LOAD_ORDER_SOURCE
from kernels_tl.load_order import end_of_loads
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import (BLOCK, MIN_BLOCKS_PER_SM, PIECE, WARPS, block_partials, block_total,
                                    torch_stream_sum)

PASS_CONFIGS = streams.PASS_CONFIGS


def post_bwd_kernel(mhc_mult: int):
    M = mhc_mult
    S = M * (M + 1)  # the sums over the hidden size: d_post (M), then d_comb (M * M)
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    @T.prim_func
    def post_bwd(
        x: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        residual: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        post_mix: T.Tensor[(num_tokens, M), T.float32],
        comb_mix: T.Tensor[(num_tokens, M, M), T.float32],
        d_o: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        d_x: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        d_residual: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        d_post: T.Tensor[(num_tokens, M), T.float32],
        d_comb: T.Tensor[(num_tokens, M * M), T.float32],
    ):
        with T.Kernel(num_tokens, threads=BLOCK) as token:
            T.import_source(LOAD_ORDER_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            xs = T.alloc_local((PIECE,), T.bfloat16)
            rs = T.alloc_local((M, PIECE), T.bfloat16)
            gs = T.alloc_local((M, PIECE), T.bfloat16)
            pw = T.alloc_local((M,), T.float32)
            cw = T.alloc_local((M, M), T.float32)
            acc = T.alloc_local((PIECE,), T.float32)
            ob = T.alloc_local((PIECE,), T.bfloat16)
            partial = T.alloc_local((S,), T.float32)
            reduce_buf = T.alloc_shared((WARPS, S), T.float32)
            lane = T.alloc_var(T.int32)
            for m in T.unroll(M):
                pw[m] = post_mix[token, m]
                for n in T.unroll(M):
                    cw[m, n] = comb_mix[token, m, n]
            for k in T.unroll(S):
                partial[k] = T.float32(0)
            for i in T.serial(T.ceildiv(pieces, BLOCK)):
                lane = i * BLOCK + tid
                if lane < pieces:
                    for m in T.unroll(M):
                        for u in T.vectorized(PIECE):
                            gs[m, u] = d_o[token, m, lane, u]
                    for m in T.unroll(M):
                        for u in T.vectorized(PIECE):
                            rs[m, u] = residual[token, m, lane, u]
                    for u in T.vectorized(PIECE):
                        xs[u] = x[token, lane, u]
                    # all 2 * M + 1 loads issued before the math (kernels_tl/load_order.py)
                    T.evaluate(end_of_loads(num_tokens == 0))
                    # the partial sums over the hidden size first: x and residual are dead after them
                    for n in T.unroll(M):
                        for u in T.unroll(PIECE):
                            partial[n] = T.fma(T.cast(xs[u], T.float32), T.cast(gs[n, u], T.float32), partial[n])
                            for m in T.unroll(M):
                                partial[M + m * M + n] = T.fma(T.cast(rs[m, u], T.float32),
                                                               T.cast(gs[n, u], T.float32), partial[M + m * M + n])
                    # d_x: the products g[n] * post[n], summed over the streams
                    for u in T.unroll(PIECE):
                        ob[u] = T.cast(torch_stream_sum([T.ieee_mul(T.cast(gs[n, u], T.float32), pw[n])
                                                         for n in range(M)], M, T.float32(0)), T.bfloat16)
                    for u in T.vectorized(PIECE):
                        d_x[token, lane, u] = ob[u]
                    # d_residual[m] = sum_n comb[m, n] * g[n]
                    for m in T.unroll(M):
                        for u in T.unroll(PIECE):
                            acc[u] = T.float32(0)
                            for n in T.unroll(M):
                                acc[u] = T.fma(cw[m, n], T.cast(gs[n, u], T.float32), acc[u])
                            ob[u] = T.cast(acc[u], T.bfloat16)
                        for u in T.vectorized(PIECE):
                            d_residual[token, m, lane, u] = ob[u]
            block_partials(partial, reduce_buf, S)
            for k in T.unroll(S):
                if tid == k:
                    if k < M:
                        d_post[token, k] = block_total(reduce_buf, k)
                    else:
                        d_comb[token, k - M] = block_total(reduce_buf, k)

    return post_bwd
