"""mhc.mhc_head_compute_mix_bwd: gradient of ``mhc_head_compute_mix``.

``output_mix_grad`` (g) and ``input_mix`` (x) fp32 [num_tokens, M], ``mhc_scale`` fp32 [1],
``mhc_base`` fp32 [M] -> ``input_mix_grad`` fp32 [num_tokens, M], ``mhc_scale_grad`` fp32
[1], ``mhc_base_grad`` fp32 [M].  In float32, each operation rounded on its own (the
reference's order):

    sg = sigmoid(x * scale + base);  g_z = (g * (1 - sg)) * sg;  input_mix_grad = g_z * scale
    mhc_base_grad[j] = sum_t g_z[t, j];  S[j] = sum_t g_z[t, j] * x[t, j]
    mhc_scale_grad = ((S[0] + S[1]) + ...) + S[M - 1]

with the sums over tokens in ``tile_kernels_aot.torch.mhc._token_sum``'s order.

Design
------
One launch of one cluster of ``CLUSTER`` blocks of ``THREADS`` threads, one thread per
lane of ``_token_sum`` (``kernels_tl/mhc/mix_math.py``): thread ``l`` takes tokens ``l,
l + LANES, ...``, writes their input gradient and keeps ``2 * M`` running sums in
registers; the lanes then combine in the fixed tree (warp shuffles, shared memory,
distributed shared memory) and rank 0 writes the two small gradients.  No workspace, no
atomics, no second launch, and deterministic.  ``M`` is static; the token count is
dynamic (offsets 64-bit); zero tokens still launch and write zero gradients.
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc.mix_math import (CLUSTER, CLUSTER_LOAD_SOURCE, LANES, THREADS, WARPS, cluster_token_sum,
                                      sigmoid)

PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def mhc_head_compute_mix_bwd_kernel(mhc_mult):
    m = mhc_mult
    num_tokens = T.dynamic("num_tokens", "int64")

    @T.prim_func
    def mhc_head_compute_mix_bwd(
        output_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        input_mix: T.Tensor[(num_tokens, m), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(m,), T.float32],
        input_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        mhc_scale_grad: T.Tensor[(1,), T.float32],
        mhc_base_grad: T.Tensor[(m,), T.float32],
    ):
        with T.Kernel(CLUSTER, threads=THREADS, cluster_dims=CLUSTER):
            T.import_source(CLUSTER_LOAD_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            rank = block_rank_in_cluster()
            red = T.alloc_shared((WARPS * 2 * m,), T.float32)
            xch = T.alloc_shared((2 * m,), T.float32)
            tot = T.alloc_shared((2 * m,), T.float32)
            acc = T.alloc_local((2 * m,), T.float32)  # [0, m): g_z; [m, 2m): g_z * x
            base = T.alloc_local((m,), T.float32)
            x = T.alloc_local((m,), T.float32)
            g = T.alloc_local((m,), T.float32)
            sg = T.alloc_var(T.float32)
            gz = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)
            scale = mhc_scale[0]
            for j in T.unroll(m):
                base[j] = mhc_base[j]
            for c in T.unroll(2 * m):
                acc[c] = T.float32(0)
            lane = T.Cast("int64", rank * THREADS + tid)
            for r in T.serial(T.ceildiv(num_tokens, LANES)):
                t = T.Cast("int64", r) * LANES + lane
                if t < num_tokens:
                    for j in T.unroll(m):
                        x[j] = input_mix[t, j]
                        g[j] = output_mix_grad[t, j]
                    for j in T.unroll(m):
                        sg = sigmoid(T.ieee_add(T.ieee_mul(x[j], scale), base[j]))
                        gz = T.ieee_mul(T.ieee_mul(g[j], T.ieee_sub(T.float32(1), sg)), sg)
                        input_mix_grad[t, j] = T.ieee_mul(gz, scale)
                        acc[j] = T.ieee_add(acc[j], gz)
                        acc[m + j] = T.ieee_add(acc[m + j], T.ieee_mul(gz, x[j]))
            cluster_token_sum(acc, 2 * m, red, xch, tot, tid, rank)
            if rank == 0:
                if tid < m:
                    mhc_base_grad[tid] = tot[tid]
                if tid == 0:
                    total = tot[m]
                    for j in T.unroll(1, m):
                        total = T.ieee_add(total, tot[m + j])
                    mhc_scale_grad[0] = total

    return mhc_head_compute_mix_bwd
