"""mhc.mhc_pre_norm_fn_bwd_mul: the K-wide part of the norm-fn backward.

Inputs per token ``t``: ``ug[t, j]`` (the gradient of ``x @ W.T``, float32 [T, M3]) and
``sg[t]`` (the gradient of ``sum x^2``, float32 [T]); ``x`` = ``residual`` bf16 [T, K]
(K = M * H), ``W`` = ``mhc_fn`` float32 [M3, K], optional ``x_grad`` bf16 [T, K]::

    x_grad_out[t, k] = bf16(x_grad[t, k] + (v[t, k] + (x[t, k] + x[t, k]) * sg[t]))
    v[t, k]          = sum_j ug[t, j] * W[j, k]      (j = 0, 1, ..., FMAs from +0)
    fn_grad[j, k]    = sum_t ug[t, j] * x[t, k]       (the order below)

(without ``x_grad`` the outer addition is left out; the inner ``+`` may contract into an FMA).

Layout: a column slice of ``COLS`` (32) consecutive columns of K belongs to one block, or to a
thread-block cluster of ``cluster`` blocks (static: 1, 2, 4 or 8; the host picks it) that split
the slice's token tiles between them (tile ``i`` to rank ``i % cluster``), so each ``fn_grad``
column is finished inside one block or cluster (no atomics, no second pass).  Thread ``(g, c)``
(``c`` of 16 column pairs, ``g`` of 8 token groups) keeps the projection's 2 x M3 values of its
columns and 2 x M3 running sums of ``fn_grad`` in registers.  Tokens go in tiles of ``TILE``
(64): a tile's x slice (64 rows x 64 bytes), its ``ug`` rows, ``sg`` values and (when given)
the ``x_grad`` slice are copied to shared memory by ``cp.async`` into a ring of ``STAGES``
slots issued ``STAGES - 1`` tiles ahead; token ``8 r + g`` of a tile goes to token group ``g``.
``x_grad_out`` is stored straight from registers (4 bytes per thread and token, a warp two
64-byte rows).

``fn_grad`` order: in each block, token group ``g`` adds the products of its tokens (``8 r + g``
of the block's tiles) in increasing token order from +0 (FMAs); the block's 8 group sums are
added left to right from group 0; in a cluster the blocks' sums are then added left to right
from rank 0 (through distributed shared memory).  The order depends on the cluster size, which
the host picks from the token count, K and the SM count.

K is a run-time multiple of 32, the token count a run-time value (64-bit offsets); ``mhc_mult``
is static (M3 = M (M + 2) a multiple of 4).
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_sync

from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE
from kernels_tl.dependent_launch import wait_for_previous_grid

COLS = 32  # columns of K per block
PAIRS = COLS // 2  # threads across the columns (2 columns each)
GROUPS = 8  # token groups
THREADS = PAIRS * GROUPS  # 128
TILE = 64  # tokens per ring slot
PER_GROUP = TILE // GROUPS  # tokens of a tile per thread
STAGES = 5  # ring slots: 4 tiles in flight (16 KB of x per block, 2 blocks per SM by registers)
CLUSTERS = (1, 2, 4, 8)
# Barriers are placed by hand (one per tile, two around the final sums' shared writes) and every shared or
# global index is in bounds by construction (rows past the end copy the last token and are
# never used): TileLang's automatic barriers and guards would add work to every tile.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}

# Asynchronous copies global -> shared (`cp.async`: 16 bytes bypassing L1, 4 bytes through
# it), the group fence and the wait for all but the newest STAGES - 2 groups; and the store of
# two floats as a bf16 pair
ASYNC_SOURCE = r"""
__device__ __forceinline__ unsigned tka_nfbwd_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void tka_nfbwd_cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(tka_nfbwd_smem(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void tka_nfbwd_cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(tka_nfbwd_smem(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void tka_nfbwd_fence() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void tka_nfbwd_landed() {
  asm volatile("cp.async.wait_group """ + str(STAGES - 2) + r""";" ::: "memory");
}
__device__ __forceinline__ void tka_nfbwd_store2(void* dst, float lo, float hi) {
  // round to nearest even; cvt.rn.bf16x2.f32 puts its first source in the upper half (the
  // later column)
  unsigned packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  *static_cast<unsigned*>(dst) = packed;
}
"""


def host_constants(mhc_mult, cluster):
    return {"cols_per_block": COLS, "tile_tokens": TILE}


def mhc_pre_norm_fn_bwd_kernel(mhc_mult, cluster):
    assert cluster in CLUSTERS
    m3 = mhc_mult * (mhc_mult + 2)
    assert m3 % 4 == 0
    row_pieces = COLS * 2 // 16  # 16-byte pieces of a tile row of x (4)
    x_passes = TILE * row_pieces // THREADS  # 2
    u_pieces = TILE * m3 // 4  # 16-byte pieces of a tile's ug rows
    u_passes = (u_pieces + THREADS - 1) // THREADS
    outs = m3 * COLS  # fn_grad values per block
    num_tokens = T.dynamic("num_tokens", "int64")
    features = T.dynamic("features")  # K

    @T.macro
    def copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad, slot, tile, col0, tid):
        t0 = T.Cast("int64", tile) * TILE
        for q in T.unroll(x_passes):
            p = tid + q * THREADS
            row = T.min(t0 + p // row_pieces, num_tokens - 1)
            col = col0 + (p % row_pieces) * 8
            T.evaluate(T.call_extern("void", "tka_nfbwd_cp16", T.address_of(xs[slot, p // row_pieces, (p % row_pieces) * 4]),
                                     T.address_of(residual[row, col])))
            if with_x_grad != 0:
                T.evaluate(T.call_extern("void", "tka_nfbwd_cp16",
                                         T.address_of(gs[slot, p // row_pieces, (p % row_pieces) * 4]),
                                         T.address_of(x_grad[row, col])))
        for q in T.unroll(u_passes):
            p = tid + q * THREADS
            if p < u_pieces:
                row = T.min(t0 + p // (m3 // 4), num_tokens - 1)
                T.evaluate(T.call_extern("void", "tka_nfbwd_cp16",
                                         T.address_of(us[slot, p // (m3 // 4), (p % (m3 // 4)) * 4]),
                                         T.address_of(out_mul_grad[row, (p % (m3 // 4)) * 4])))
        if tid < TILE:
            row = T.min(t0 + tid, num_tokens - 1)
            T.evaluate(T.call_extern("void", "tka_nfbwd_cp4", T.address_of(ss[slot, tid]),
                                     T.address_of(sqrsum_grad[row])))

    @T.prim_func
    def mhc_pre_norm_fn_bwd(
        out_mul_grad: T.Tensor[(num_tokens, m3), T.float32],
        sqrsum_grad: T.Tensor[(num_tokens,), T.float32],
        residual: T.Tensor[(num_tokens, features), T.bfloat16],
        mhc_fn: T.Tensor[(m3, features), T.float32],
        x_grad: T.Tensor[(num_tokens, features), T.bfloat16],
        x_grad_out: T.Tensor[(num_tokens, features), T.bfloat16],
        fn_grad: T.Tensor[(m3, features), T.float32],
        with_x_grad: T.int32,
    ):
        with T.Kernel((features // COLS) * cluster, threads=THREADS, cluster_dims=cluster) as bid:
            T.import_source(ASYNC_SOURCE + (CLUSTER_LOAD_SOURCE if cluster > 1 else ""))
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            c = tid % PAIRS
            g = tid // PAIRS
            col0 = (bid // cluster) * COLS
            rank = block_rank_in_cluster() if cluster > 1 else 0
            # this block's tiles: rank, rank + cluster, rank + 2 cluster, ...
            tiles = (T.Cast("int32", T.ceildiv(num_tokens, TILE)) + (cluster - 1 - rank)) // cluster

            xs = T.alloc_shared((STAGES, TILE, COLS // 2), T.uint32)  # bf16 pairs
            gs = T.alloc_shared((STAGES, TILE, COLS // 2), T.uint32)
            us = T.alloc_shared((STAGES, TILE, m3), T.float32)
            ss = T.alloc_shared((STAGES, TILE), T.float32)
            red = T.alloc_shared((GROUPS, m3, COLS), T.float32)
            w = T.alloc_local((m3, 2), T.float32)
            acc = T.alloc_local((m3, 2), T.float32)
            u = T.alloc_local((m3,), T.float32)
            v = T.alloc_local((2,), T.float32)
            xf = T.alloc_local((2,), T.float32)
            gf = T.alloc_local((2,), T.float32)
            total = T.alloc_var(T.float32)

            for j in T.unroll(m3):
                for e in T.unroll(2):
                    w[j, e] = mhc_fn[j, col0 + 2 * c + e]
                    acc[j, e] = T.float32(0)

            # prologue: tiles 0 .. STAGES - 2 in flight
            for s in T.unroll(STAGES - 1):
                if s < tiles:
                    copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad, s,
                              s * cluster + rank, col0, tid)
                T.evaluate(T.call_extern("void", "tka_nfbwd_fence"))

            for i in T.serial(tiles):
                T.evaluate(T.call_extern("void", "tka_nfbwd_landed"))  # this thread's copies of tile i landed
                # everyone's copies of tile i are in, and everyone is done with tile i - 1's slot
                T.sync_threads()
                if i + STAGES - 1 < tiles:
                    copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad,
                              (i + STAGES - 1) % STAGES, (i + STAGES - 1) * cluster + rank, col0, tid)
                T.evaluate(T.call_extern("void", "tka_nfbwd_fence"))
                slot = i % STAGES
                for r in T.unroll(PER_GROUP):
                    row = r * GROUPS + g
                    t = T.Cast("int64", i * cluster + rank) * TILE + row
                    if t < num_tokens:
                        pair = xs[slot, row, c]
                        # bf16 -> float32: the 16 bits moved up; the low half is the earlier column
                        xf[0] = T.reinterpret(pair << T.uint32(16), T.float32)
                        xf[1] = T.reinterpret(pair & T.uint32(0xFFFF0000), T.float32)
                        for q in T.unroll(m3 // 4):
                            for e in T.vectorized(4):
                                u[q * 4 + e] = us[slot, row, q * 4 + e]
                        v[0] = T.float32(0)
                        v[1] = T.float32(0)
                        for j in T.unroll(m3):
                            for e in T.unroll(2):
                                v[e] = v[e] + u[j] * w[j, e]
                                acc[j, e] = acc[j, e] + u[j] * xf[e]
                        for e in T.unroll(2):
                            v[e] = v[e] + (xf[e] + xf[e]) * ss[slot, row]
                        if with_x_grad != 0:
                            gpair = gs[slot, row, c]
                            gf[0] = T.reinterpret(gpair << T.uint32(16), T.float32)
                            gf[1] = T.reinterpret(gpair & T.uint32(0xFFFF0000), T.float32)
                            for e in T.unroll(2):
                                v[e] = T.ieee_add(gf[e], v[e])
                        T.evaluate(T.call_extern("void", "tka_nfbwd_store2", T.address_of(x_grad_out[t, col0 + 2 * c]),
                                                 v[0], v[1]))

            # the 8 token groups' sums of each fn_grad value, left to right.  `red` may share
            # shared memory with the rings (TileLang's planner reuses it): everyone has finished
            # reading the last tile, and no copy is pending (the last real one was waited for)
            T.sync_threads()
            for j in T.unroll(m3):
                for e in T.unroll(2):
                    red[g, j, 2 * c + e] = acc[j, e]
            T.sync_threads()
            for q in T.unroll((outs + THREADS - 1) // THREADS):
                if tid + q * THREADS < outs:
                    j = (tid + q * THREADS) // COLS
                    k = (tid + q * THREADS) % COLS
                    total = red[0, j, k]
                    for gg in T.unroll(GROUPS - 1):
                        total = total + red[gg + 1, j, k]
                    if cluster > 1:
                        red[0, j, k] = total  # only this thread reads and writes (0, j, k)
                    else:
                        fn_grad[j, col0 + k] = total
            if cluster > 1:
                # the blocks' sums (each over its tiles), left to right from rank 0, through
                # distributed shared memory; each block writes a share of the slice's values
                cluster_sync()
                share = outs // cluster
                for q in T.unroll((share + THREADS - 1) // THREADS):
                    if tid + q * THREADS < share:
                        j = (rank * share + tid + q * THREADS) // COLS
                        k = (rank * share + tid + q * THREADS) % COLS
                        total = T.call_extern(T.float32, "tka_cluster_load_f32", T.address_of(red[0, j, k]), 0)
                        for rr in T.unroll(cluster - 1):
                            total = total + T.call_extern(T.float32, "tka_cluster_load_f32",
                                                          T.address_of(red[0, j, k]), rr + 1)
                        fn_grad[j, col0 + k] = total
                cluster_sync()  # no block exits while another may read its sums

    return mhc_pre_norm_fn_bwd
