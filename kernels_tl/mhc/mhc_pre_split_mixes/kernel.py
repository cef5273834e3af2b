"""mhc.mhc_pre_split_mixes: the projected mixes split into pre, post and comb weights.

``input_mixes`` fp32 [num_tokens, M3] (``M3 = M * (M + 2)``), ``mhc_scale`` fp32 [3],
``mhc_base`` fp32 [M3] -> ``pre`` and ``post`` fp32 [num_tokens, M, 1], ``comb`` fp32
[num_tokens, M, M].  Per mix ``j`` of group ``k`` (pre, post, comb), in float32 with each
operation rounded on its own (the reference's order):

    z = input_mixes[t, j] * mhc_scale[k] + mhc_base[j]
    pre = sigmoid(z) + pre_eps;  post = sigmoid(z) * post_mult_value;  comb = z

``sigmoid(z) = 1 / (1 + expf(-z))``, torch's CUDA sigmoid.

Design
------
One thread per (token, mix) element, ``THREADS`` per block: loads and stores of a warp
are contiguous spans, the scale and base come from L1.  ``M`` is static (the split of
``j`` into groups is then arithmetic on constants); the token count is dynamic and the
element index 64-bit.  The op moves ``8 * M3`` bytes per token: latency-bound.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.mix_math import sigmoid

THREADS = 256
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def mhc_pre_split_mixes_kernel(mhc_mult):
    m = mhc_mult
    m3 = m * (m + 2)
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def mhc_pre_split_mixes(
        input_mixes: T.Tensor[(num_tokens * m3,), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(m3,), T.float32],
        pre_layer_mix: T.Tensor[(num_tokens * m,), T.float32],
        post_layer_mix: T.Tensor[(num_tokens * m,), T.float32],
        comb_res_mix: T.Tensor[(num_tokens * m * m,), T.float32],
        mhc_post_mult_value: T.float32,
        mhc_pre_eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens * m3, THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            e = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            t = e // m3
            j = T.Cast("int32", e - t * m3)
            if e < num_tokens * m3:
                v = input_mixes[e]
                if j < m:
                    z = T.ieee_add(T.ieee_mul(v, mhc_scale[0]), mhc_base[j])
                    pre_layer_mix[t * m + j] = T.ieee_add(sigmoid(z), mhc_pre_eps)
                elif j < 2 * m:
                    z = T.ieee_add(T.ieee_mul(v, mhc_scale[1]), mhc_base[j])
                    post_layer_mix[t * m + (j - m)] = T.ieee_mul(sigmoid(z), mhc_post_mult_value)
                else:
                    comb_res_mix[t * (m * m) + (j - 2 * m)] = T.ieee_add(T.ieee_mul(v, mhc_scale[2]), mhc_base[j])

    return mhc_pre_split_mixes
