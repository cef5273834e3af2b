"""mhc.pre_apply_mix_bwd: the gradients of ``pre_apply_mix``.

``o_grad`` bf16 [num_tokens, H], ``x`` bf16 [num_tokens, M, H], ``mix`` fp32 [num_tokens, M],
optional ``x_grad`` bf16 [num_tokens, M, H] (a gradient already accumulated for ``x``) ->
``x_grad_out`` bf16 [num_tokens, M, H] and ``mix_grad`` fp32 [num_tokens, M]:

* ``x_grad_out[t, m, h] = mix[t, m] * o_grad[t, h]`` (float32, one rounding), plus
  ``x_grad[t, m, h]`` when given (a second IEEE add), rounded to bf16 once: exactly the
  reference's operations;
* ``mix_grad[t, m] = sum_h o_grad[t, h] * x[t, m, h]`` in float32: each thread accumulates
  its pieces with FMAs, then the block sums the threads (``streams.block_sum``).  The
  reference sums with PyTorch's reduction, whose order depends on the launch shape, so this
  output matches it within a tolerance (docs/ops.md), not bit for bit.

Design
------
Bound by memory: ``2 * H + 4 * M * H`` bytes (``+ 2 * M * H`` with ``x_grad``) and ``8 * M``
per token.  One block of ``BLOCK`` threads per token (the sum over the hidden size stays in
the block); thread ``tid`` takes the pieces ``tid, tid + BLOCK, ...`` of the row, each
piece of ``o_grad`` with the ``M`` pieces of ``x`` (and of ``x_grad``) loaded together.
``with_x_grad`` is a run-time flag (a uniform branch).  No static dim but ``M``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import BLOCK, MIN_BLOCKS_PER_SM, PIECE, WARPS, block_partials, block_total

PASS_CONFIGS = streams.PASS_CONFIGS


def pre_apply_mix_bwd_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")
    num_acc = T.dynamic("num_acc")  # rows of x_grad: num_tokens when given, else 0

    @T.prim_func
    def pre_apply_mix_bwd(
        o_grad: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        x: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        mix: T.Tensor[(num_tokens, M), T.float32],
        x_grad: T.Tensor[(num_acc, M, pieces, PIECE), T.bfloat16],
        x_grad_out: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        mix_grad: T.Tensor[(num_tokens, M), T.float32],
        with_x_grad: T.int32,
    ):
        with T.Kernel(num_tokens, threads=BLOCK) as token:
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            g = T.alloc_local((PIECE,), T.bfloat16)
            xs = T.alloc_local((M, PIECE), T.bfloat16)
            acc = T.alloc_local((M, PIECE), T.bfloat16)
            out = T.alloc_local((M, PIECE), T.bfloat16)
            w = T.alloc_local((M,), T.float32)
            partial = T.alloc_local((M,), T.float32)
            reduce_buf = T.alloc_shared((WARPS, M), T.float32)
            lane = T.alloc_var(T.int32)
            for m in T.unroll(M):
                w[m] = mix[token, m]
                partial[m] = T.float32(0)
            for i in T.serial(T.ceildiv(pieces, BLOCK)):
                lane = i * BLOCK + tid
                if lane < pieces:
                    for u in T.vectorized(PIECE):
                        g[u] = o_grad[token, lane, u]
                    for m in T.unroll(M):
                        for u in T.vectorized(PIECE):
                            xs[m, u] = x[token, m, lane, u]
                    if with_x_grad != 0:
                        for m in T.unroll(M):
                            for u in T.vectorized(PIECE):
                                acc[m, u] = x_grad[token, m, lane, u]
                    for m in T.unroll(M):
                        for u in T.unroll(PIECE):
                            partial[m] = T.fma(T.cast(g[u], T.float32), T.cast(xs[m, u], T.float32), partial[m])
                            # mix * o_grad, then + x_grad when given: the reference's two roundings
                            out[m, u] = T.cast(
                                T.if_then_else(with_x_grad != 0,
                                               T.ieee_add(T.cast(acc[m, u], T.float32),
                                                          T.ieee_mul(w[m], T.cast(g[u], T.float32))),
                                               T.ieee_mul(w[m], T.cast(g[u], T.float32))),
                                T.bfloat16)
                        for u in T.vectorized(PIECE):
                            x_grad_out[token, m, lane, u] = out[m, u]
            block_partials(partial, reduce_buf, M)
            for m in T.unroll(M):
                if tid == m:
                    mix_grad[token, m] = block_total(reduce_buf, m)

    return pre_apply_mix_bwd
