"""mhc.mhc_pre_split_mixes_bwd: gradient of ``mhc_pre_split_mixes``.

Gradients ``pre_layer_mix_grad``, ``post_layer_mix_grad`` fp32 [num_tokens, M] (the
``(N, M, 1)`` tensors), ``comb_res_mix_grad`` fp32 [num_tokens, M * M] and the forward
inputs ``input_mixes`` fp32 [num_tokens, M3], ``mhc_scale`` [3], ``mhc_base`` [M3] ->
``input_mixes_grad`` fp32 [num_tokens, M3], ``mhc_scale_grad`` [3], ``mhc_base_grad``
[M3].  In float32, each operation rounded on its own (the reference's order), with
``z = input_mixes * scale[k] + base`` and ``sg = sigmoid(z)`` as in the forward pass:

    g_z = (g_pre * (1 - sg)) * sg  |  ((g_post * post_mult_value) * (1 - sg)) * sg  |  g_comb
    input_mixes_grad = g_z * scale[k]
    mhc_base_grad[j] = sum_t g_z[t, j];   S[j] = sum_t g_z[t, j] * input_mixes[t, j]
    mhc_scale_grad[k] = S[first of group k] + ... (left to right over the group's mixes)

with the sums over tokens in ``tile_kernels_aot.torch.mhc._token_sum``'s order.

Design
------
As ``mhc_head_compute_mix_bwd``: one cluster of ``CLUSTER`` blocks of ``THREADS``
threads, a thread per lane of ``_token_sum`` with ``2 * M3`` running sums in registers
(48 for M = 4), the fixed lane tree through shuffles, shared and distributed shared
memory (``kernels_tl/mhc/mix_math.py``), rank 0 writing the small gradients.  ``M`` is
static; the token count dynamic (offsets 64-bit); zero tokens launch and write zeros.
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.mix_math import (CLUSTER, CLUSTER_LOAD_SOURCE, LANES, THREADS, WARPS, cluster_token_sum,
                                      sigmoid)

PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def mhc_pre_split_mixes_bwd_kernel(mhc_mult):
    m = mhc_mult
    mm = m * m
    m3 = 2 * m + mm
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def mhc_pre_split_mixes_bwd(
        pre_layer_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        post_layer_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        comb_res_mix_grad: T.Tensor[(num_tokens, mm), T.float32],
        input_mixes: T.Tensor[(num_tokens, m3), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(m3,), T.float32],
        input_mixes_grad: T.Tensor[(num_tokens, m3), T.float32],
        mhc_scale_grad: T.Tensor[(3,), T.float32],
        mhc_base_grad: T.Tensor[(m3,), T.float32],
        mhc_post_mult_value: T.float32,
    ):
        with T.Kernel(CLUSTER, threads=THREADS, cluster_dims=CLUSTER):
            T.import_source(CLUSTER_LOAD_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            rank = block_rank_in_cluster()
            red = T.alloc_shared((WARPS * 2 * m3,), T.float32)
            xch = T.alloc_shared((2 * m3,), T.float32)
            tot = T.alloc_shared((2 * m3,), T.float32)
            acc = T.alloc_local((2 * m3,), T.float32)  # [0, m3): g_z; [m3, 2 m3): g_z * input_mixes
            mix = T.alloc_local((m3,), T.float32)
            gz = T.alloc_local((m3,), T.float32)
            sg = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            s_pre = mhc_scale[0]
            s_post = mhc_scale[1]
            s_comb = mhc_scale[2]
            for c in T.unroll(2 * m3):
                acc[c] = T.float32(0)
            lane = T.Cast("int64", rank * THREADS + tid)
            for r in T.serial(T.ceildiv(num_tokens, LANES)):
                t = T.Cast("int64", r) * LANES + lane
                if t < num_tokens:
                    for j in T.unroll(m3):
                        mix[j] = input_mixes[t, j]
                    for j in T.unroll(m):
                        gz[j] = pre_layer_mix_grad[t, j]
                        gz[m + j] = post_layer_mix_grad[t, j]
                    for j in T.unroll(mm):
                        gz[2 * m + j] = comb_res_mix_grad[t, j]
                    for j in T.unroll(m):
                        sg = sigmoid(T.ieee_add(T.ieee_mul(mix[j], s_pre), mhc_base[j]))
                        gz[j] = T.ieee_mul(T.ieee_mul(gz[j], T.ieee_sub(T.float32(1), sg)), sg)
                        input_mixes_grad[t, j] = T.ieee_mul(gz[j], s_pre)
                    for j in T.unroll(m):
                        sg = sigmoid(T.ieee_add(T.ieee_mul(mix[m + j], s_post), mhc_base[m + j]))
                        gz[m + j] = T.ieee_mul(T.ieee_mul(T.ieee_mul(gz[m + j], mhc_post_mult_value),
                                                          T.ieee_sub(T.float32(1), sg)), sg)
                        input_mixes_grad[t, m + j] = T.ieee_mul(gz[m + j], s_post)
                    for j in T.unroll(mm):
                        input_mixes_grad[t, 2 * m + j] = T.ieee_mul(gz[2 * m + j], s_comb)
                    for j in T.unroll(m3):
                        acc[j] = T.ieee_add(acc[j], gz[j])
                        acc[m3 + j] = T.ieee_add(acc[m3 + j], T.ieee_mul(gz[j], mix[j]))
            cluster_token_sum(acc, 2 * m3, red, xch, tot, tid, rank)
            if rank == 0:
                if tid < m3:
                    mhc_base_grad[tid] = tot[tid]
                if tid < 3:
                    # group tid: mixes [first, first + size)
                    first = T.if_then_else(tid == 0, 0, T.if_then_else(tid == 1, m, 2 * m))
                    size = T.if_then_else(tid == 2, mm, m)
                    total = tot[m3 + first]
                    for j in T.serial(1, size):
                        total = T.ieee_add(total, tot[m3 + first + j])
                    mhc_scale_grad[tid] = total

    return mhc_pre_split_mixes_bwd
