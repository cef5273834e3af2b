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
One lane per matrix element (``sinkhorn_math``; ``n`` static with ``n * n <= 32``, 4 in
practice): a token's matrix lives in ``L = next_pow2(n * n)`` consecutive lanes of a warp
(16 for ``n = 4``, two tokens per warp), lane ``i * n + j`` holding element ``(i, j)``.
Each step gathers the lane's column or row with ``n`` independent ``__shfl_sync`` (full
mask, width ``L``), adds them in the reference's order and divides the lane's own
element: one IEEE division per lane per step on the critical path of ``2 * repeat - 1``
steps.  Tail lanes (tokens past ``num_tokens``, lanes past ``n * n``) run every step on
dummy data so that the shuffles see full warps; only their load and store are masked.
``THREADS`` threads per block (``THREADS / L`` tokens); the token count, ``repeat`` and
``eps`` are run-time values, element offsets 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.sinkhorn_math import lane_coords, lane_sinkhorn, lanes_per_matrix

THREADS = 128
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def sinkhorn_normalize_kernel(n):
    nn = n * n
    lanes = lanes_per_matrix(n)
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def sinkhorn_normalize(
        x: T.Tensor[(num_tokens, nn), T.float32],
        out: T.Tensor[(num_tokens, nn), T.float32],
        repeat: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, THREADS // lanes)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            token, lane, e, i, j = lane_coords(bid, T.get_thread_binding(), n, THREADS)
            v = T.alloc_local((1,), T.float32)
            r = T.alloc_local((n,), T.float32)
            v[0] = T.float32(0)
            if token < num_tokens:
                v[0] = x[token, e]
            lane_sinkhorn(v, r, i, j, n, lanes, repeat, eps)
            if token < num_tokens and lane < nn:
                out[token, e] = v[0]

    return sinkhorn_normalize
