"""mhc.sinkhorn_normalize_bwd: gradient of ``sinkhorn_normalize``.

``grad_output`` and ``x`` fp32 [num_tokens, n, n] -> ``grad_input`` fp32 [num_tokens, n,
n], in the reference's exact order (``tile_kernels_aot.torch.mhc.sinkhorn_normalize_bwd``):
recompute the forward pass, keeping the softmax ``p`` and the input ``u_k`` of each of the
``K = 2 * repeat - 1`` normalisation steps; then from the last step back

    g = (g - sum_axis(g * u_k) / d_k) / d_k,   d_k = sum_axis(u_k) + eps

(axis: columns for even ``k``, rows for odd), and ``grad_input = (g - rowsum(g * p)) * p``.
Sums left to right, every product, difference and division rounded on its own.

Design
------
One thread per token, the matrix and its gradient in registers (``n`` static, 4 in
practice).  The ``K + 1`` saved matrices go to shared memory, ``[slot][element][thread]``
so that a warp's accesses hit 32 banks; ``max_repeat`` (static) sizes that stash,
``repeat <= max_repeat`` is a run-time value and the host picks the smallest prebuilt
``max_repeat`` (multiples of 10).  The threads per block follow from the stash (about 80
KiB per block, two blocks per SM).  Token offsets are 64-bit.  Latency-bound: 96 bytes of
memory traffic per token against ~``4 * K * n * n`` divisions.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.sinkhorn_math import (column_step_bwd, normalize_columns, normalize_rows, row_step_bwd,
                                          softmax_bwd, softmax_rows)

STASH_BYTES = 80 * 1024  # per block: two blocks per SM
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def threads_for(n, max_repeat):
    per_thread = 2 * max_repeat * n * n * 4
    return 32 * max(1, min(4, STASH_BYTES // (32 * per_thread)))


def host_constants(n, max_repeat):
    return {"threads": threads_for(n, max_repeat)}


def sinkhorn_normalize_bwd_kernel(n, max_repeat):
    nn = n * n
    threads = threads_for(n, max_repeat)
    slots = 2 * max_repeat  # p, then u_0 .. u_{K-1}
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_normalize_bwd(
        grad_output: T.Tensor[(num_tokens, nn), T.float32],
        x: T.Tensor[(num_tokens, nn), T.float32],
        grad_input: T.Tensor[(num_tokens, nn), T.float32],
        repeat: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, threads)), threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            token = T.Cast("int64", bid) * threads + T.Cast("int64", tid)
            stash = T.alloc_shared((slots * nn * threads,), T.float32)
            y = T.alloc_local((nn,), T.float32)
            g = T.alloc_local((nn,), T.float32)
            if token < num_tokens:
                for e in T.vectorized(nn):
                    y[e] = x[token, e]
                for e in T.vectorized(nn):
                    g[e] = grad_output[token, e]
                softmax_rows(y, n)
                for e in T.unroll(nn):
                    stash[e * threads + tid] = y[e]
                for e in T.unroll(nn):
                    y[e] = T.ieee_add(y[e], eps)
                for k in T.serial(2 * repeat - 1):
                    for e in T.unroll(nn):
                        stash[((1 + k) * nn + e) * threads + tid] = y[e]
                    if k % 2 == 0:
                        normalize_columns(y, n, eps)
                    else:
                        normalize_rows(y, n, eps)
                for kk in T.serial(2 * repeat - 1):
                    k = 2 * repeat - 2 - kk
                    for e in T.unroll(nn):
                        y[e] = stash[((1 + k) * nn + e) * threads + tid]
                    if k % 2 == 0:
                        column_step_bwd(g, y, n, eps)
                    else:
                        row_step_bwd(g, y, n, eps)
                for e in T.unroll(nn):
                    y[e] = stash[e * threads + tid]
                softmax_bwd(g, y, n)
                for e in T.vectorized(nn):
                    grad_input[token, e] = g[e]

    return sinkhorn_normalize_bwd
