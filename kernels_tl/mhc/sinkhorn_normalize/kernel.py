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
One thread per token: the ``n * n`` values live in registers (``n`` is static, 4 in
practice: 16 floats, four 16-byte loads and stores), so the ``2 * repeat - 1`` steps run
without a barrier or a shuffle.  ``repeat`` and ``eps`` are run-time values; the token
count is dynamic and the element offsets 64-bit.  ``THREADS`` threads per block, so a
prefill call spreads over many SMs; the op is latency-bound (64 bytes in and out per
token, ~16 divisions per step).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.sinkhorn_math import normalize_columns, normalize_rows, softmax_rows

THREADS = 64
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def sinkhorn_normalize_kernel(n):
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
