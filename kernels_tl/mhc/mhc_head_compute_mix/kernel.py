"""mhc.mhc_head_compute_mix: the stream weights in front of the LM head.

``input_mix`` fp32 [num_tokens, M], ``mhc_scale`` fp32 [1], ``mhc_base`` fp32 [M] ->
``output_mix`` fp32 [num_tokens, M]: ``sigmoid(input_mix * mhc_scale + mhc_base) +
mhc_pre_eps``, each operation rounded on its own (the reference's order), ``sigmoid(z) =
1 / (1 + expf(-z))`` (torch's CUDA sigmoid).

Design
------
One thread per (token, stream) element, ``THREADS`` per block (contiguous loads and
stores per warp); ``M`` is static, the token count dynamic, the element index 64-bit.
Latency-bound: 8 bytes per element.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.mix_math import sigmoid

THREADS = 256
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def mhc_head_compute_mix_kernel(mhc_mult):
    m = mhc_mult
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def mhc_head_compute_mix(
        input_mix: T.Tensor[(num_tokens * m,), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(m,), T.float32],
        output_mix: T.Tensor[(num_tokens * m,), T.float32],
        mhc_pre_eps: T.float32,
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens * m, THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            e = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            j = T.Cast("int32", e % m)
            if e < num_tokens * m:
                z = T.ieee_add(T.ieee_mul(input_mix[e], mhc_scale[0]), mhc_base[j])
                output_mix[e] = T.ieee_add(sigmoid(z), mhc_pre_eps)

    return mhc_head_compute_mix
