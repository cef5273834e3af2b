"""mhc.sinkhorn_normalize: Sinkhorn-Knopp normalisation of each token's ``n x n`` matrix.

``x`` fp32 [num_tokens, n, n] (contiguous) -> ``out`` fp32 [num_tokens, n, n], in float32
and in exactly the reference's order (``tile_kernels_aot.torch.mhc.sinkhorn_normalize``):

    p = softmax(x row) as torch computes it on CUDA: e = expf(x - rowmax), the row sum an
        XOR butterfly over next_pow2(n) lanes, p = e / sum
    y = p + eps;  y /= (colsum + eps)
    repeat - 1 times:  y /= (rowsum + eps);  y /= (colsum + eps)

with every row/column sum left to right and every step a true (IEEE) division.

Design
------
One lane per matrix element (``n * n <= 32``; ``n`` static, 4 in practice): a token's
matrix lives in ``L = next_pow2(n * n)`` consecutive lanes of a warp (16 for ``n = 4``,
two tokens per warp), lane ``i * n + j`` holding element ``(i, j)``.  Each step gathers
the lane's row or column with ``n`` independent ``__shfl_sync`` (full mask, width ``L``),
adds them in the reference's order (every lane of the row or column computes the same
sum) and divides its own element: one IEEE division per lane per step, where a thread
holding the whole matrix runs ``n * n`` of them back to back.  That is the op's critical
path (``2 * repeat - 1`` steps), so it is 16 times shorter, and a call spreads over 16
times as many warps.  Tail lanes (tokens past ``num_tokens``, lanes past ``n * n``) run
every step on dummy data so that the shuffles see full warps; only their load and store
are masked.  ``THREADS`` threads per block (``THREADS / L`` tokens); the token count,
``repeat`` and ``eps`` are run-time values, element offsets 64-bit.

``n * n > 32`` (not in the shape table) falls back to one thread per token with the matrix
in registers.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.sinkhorn_math import (lane_normalize, lane_softmax, lanes_per_matrix, normalize_columns,
                                          normalize_rows, softmax_rows)

THREADS = 128
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def sinkhorn_normalize_kernel(n):
    if n * n > 32:
        return _per_thread_kernel(n)
    nn = n * n
    lanes = lanes_per_matrix(n)
    per_block = THREADS // lanes
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_normalize(
        x: T.Tensor[(num_tokens, nn), T.float32],
        out: T.Tensor[(num_tokens, nn), T.float32],
        repeat: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, per_block)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            lane = tid % lanes
            e = T.min(lane, nn - 1)  # lanes past n * n mirror the last element
            i = e // n
            j = e % n
            token = T.Cast("int64", bid) * per_block + T.Cast("int64", tid // lanes)
            v = T.alloc_local((1,), T.float32)
            r = T.alloc_local((n,), T.float32)
            v[0] = T.float32(0)
            if token < num_tokens:
                v[0] = x[token, e]
            lane_softmax(v, r, i, n, lanes)
            v[0] = T.ieee_add(v[0], eps)
            lane_normalize(v, r, j, n, n, lanes, eps)  # columns
            for _ in T.serial(repeat - 1):
                lane_normalize(v, r, i * n, 1, n, lanes, eps)  # rows
                lane_normalize(v, r, j, n, n, lanes, eps)  # columns
            if token < num_tokens and lane < nn:
                out[token, e] = v[0]

    return sinkhorn_normalize


def _per_thread_kernel(n):
    nn = n * n
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_normalize(
        x: T.Tensor[(num_tokens, nn), T.float32],
        out: T.Tensor[(num_tokens, nn), T.float32],
        repeat: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            token = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            y = T.alloc_local((nn,), T.float32)
            if token < num_tokens:
                for k in T.vectorized(nn):
                    y[k] = x[token, k]
                softmax_rows(y, n)
                for k in T.unroll(nn):
                    y[k] = T.ieee_add(y[k], eps)
                normalize_columns(y, n, eps)
                for _ in T.serial(repeat - 1):
                    normalize_rows(y, n, eps)
                    normalize_columns(y, n, eps)
                for k in T.vectorized(nn):
                    out[token, k] = y[k]

    return sinkhorn_normalize
