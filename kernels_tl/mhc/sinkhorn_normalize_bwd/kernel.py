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
One lane per matrix element, as the forward kernel (``sinkhorn_math``; ``n * n <= 32``,
``n`` static, 4 in practice): ``L = next_pow2(n * n)`` lanes per token, row and column sums
gathered with full-warp ``__shfl_sync`` (width ``L``) and added in the reference's order
by every lane of the row or column.  The forward recomputation stashes each lane's
``u_k`` and its step denominator ``d_k`` (the very sum the backward step needs, so the
backward gathers only ``g * u_k``, and the reciprocal of ``d_k`` can start before that
gather lands) in shared memory, ``[slot][thread]``: conflict-free, no cross-lane access,
no barrier.  The backward loop loads step ``k - 1``'s pair while it works on step ``k``.
``max_repeat`` (static) sizes the stash, ``repeat <= max_repeat`` is a run-time value and
the host picks the smallest prebuilt ``max_repeat`` (multiples of 10); the threads per
block follow from the stash (128 up to ``max_repeat`` 40).  Tail lanes run on dummy data
(zeros) so the shuffles see full warps; only loads and stores are masked.  Token offsets
are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.sinkhorn_math import (lane_coords, lane_gather, lane_softmax, lane_softmax_bwd, lane_step_bwd,
                                          lane_sum, lanes_per_matrix)

STASH_BYTES = 80 * 1024  # per block at most (a smaller stash keeps 128 threads)
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def threads_for(max_repeat):
    per_thread = 2 * (2 * max_repeat) * 4  # u_k and d_k, 2 * max_repeat slots each
    return 32 * max(1, min(4, STASH_BYTES // (32 * per_thread)))


def host_constants(n, max_repeat):
    return {"threads": threads_for(max_repeat)}


def sinkhorn_normalize_bwd_kernel(n, max_repeat):
    nn = n * n
    lanes = lanes_per_matrix(n)
    threads = threads_for(max_repeat)
    slots = 2 * max_repeat  # u: p, then u_0 .. u_{K-1};  d: d_0 .. d_{K-1}
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_normalize_bwd(
        grad_output: T.Tensor[(num_tokens, nn), T.float32],
        x: T.Tensor[(num_tokens, nn), T.float32],
        grad_input: T.Tensor[(num_tokens, nn), T.float32],
        repeat: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, threads // lanes)), threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            token, lane, e, i, j = lane_coords(bid, tid, n, threads)
            stash_u = T.alloc_shared((slots * threads,), T.float32)
            stash_d = T.alloc_shared((slots * threads,), T.float32)
            v = T.alloc_local((1,), T.float32)
            g = T.alloc_local((1,), T.float32)
            r = T.alloc_local((n,), T.float32)
            u = T.alloc_var(T.float32)
            d = T.alloc_var(T.float32)
            u_next = T.alloc_var(T.float32)
            d_next = T.alloc_var(T.float32)
            v[0] = T.float32(0)
            g[0] = T.float32(0)
            if token < num_tokens:
                v[0] = x[token, e]
                g[0] = grad_output[token, e]
            lane_softmax(v, r, i, n, lanes)
            stash_u[tid] = v[0]
            v[0] = T.ieee_add(v[0], eps)
            for k in T.serial(2 * repeat - 1):  # columns for even k, rows for odd
                stash_u[(1 + k) * threads + tid] = v[0]
                lane_gather(r, v[0], T.if_then_else(k % 2 == 0, j, i * n), T.if_then_else(k % 2 == 0, n, 1), n,
                            lanes)
                d = T.ieee_add(lane_sum(r, n), eps)
                stash_d[k * threads + tid] = d
                v[0] = T.ieee_fdiv(v[0], d)
            u = stash_u[(2 * repeat - 1) * threads + tid]
            d = stash_d[(2 * repeat - 2) * threads + tid]
            for kk in T.serial(2 * repeat - 1):
                k = 2 * repeat - 2 - kk
                u_next = stash_u[k * threads + tid]  # u_{k-1}; p at k = 0
                d_next = stash_d[T.max(k - 1, 0) * threads + tid]
                lane_step_bwd(g, u, d, r, T.if_then_else(k % 2 == 0, j, i * n), T.if_then_else(k % 2 == 0, n, 1),
                              n, lanes)
                u = u_next
                d = d_next
            lane_softmax_bwd(g, u, r, i, n, lanes)
            if token < num_tokens and lane < nn:
                grad_input[token, e] = g[0]

    return sinkhorn_normalize_bwd
