"""mhc.mhc_pre_norm_fn_bwd_mul: the K-wide part of the norm-fn backward, on tensor cores.

Inputs per token ``t``: ``ug[t, j]`` (the gradient of ``x @ W.T``, float32 [T, M3]) and
``sg[t]`` (the gradient of ``sum x^2``, float32 [T]); ``x`` = ``residual`` bf16 [T, K]
(K = M * H), ``W`` = ``mhc_fn`` float32 [M3, K], optional ``x_grad`` bf16 [T, K]::

    x_grad_out[t, k] = bf16(x_grad[t, k] + (v[t, k] + (x[t, k] + x[t, k]) * sg[t]))
    v[t, k]          = sum_j ug[t, j] * W[j, k]      (bf16 tensor-core MMA, float32 accumulation)
    fn_grad[j, k]    = sum_t ug[t, j] * x[t, k]       (likewise; the order below)

(without ``x_grad`` the outer addition is left out; the inner ``+`` may contract into an FMA).

Exact products: a float32 ``v`` splits exactly into three bf16 values, ``h`` (``v`` with the
low 16 bits cleared: 8 significant bits), ``m`` (the same of ``v - h``) and ``l = v - h - m``
(at most 8 significant bits).  Every product of two bf16 parts is exact in float32.

- ``v``: one bf16 GEMM per 64-token tile, A = the tile's ``ug`` parts [64, 8 M3], B = the
  column slice's ``W`` parts [8 M3, COLS], the 8 blocks of M3 being the part pairs
  (h h, h m, h l, m h, m m, m l, l h, l m) of (ug, W): every product but ``l * l`` (below
  2^-32 of ``|ug W|``); the MMA's own order of float32 additions over the 8 M3 terms.
- ``fn_grad``: one bf16 GEMM per tile from +0, ``tile[c, p M3 + j] = sum_t x[t, c] * ug_p[t, j]``
  (A = the x tile transposed, B = the tile's ``ug`` parts [3 M3, 64] transposed, zero rows up
  to 80), added to the block's running sums tile by tile (float32, round to nearest); then
  ``(s_h + s_m) + s_l`` per value; in a thread-block cluster the blocks' sums are added left
  to right from rank 0 (distributed shared memory).

Infinities and NaN: an infinite or NaN ``v`` has ``h = v`` (a NaN made quiet), ``m = l = +0``,
and where its ``h`` meets the other operand's ``m`` or ``l`` (blocks h m, h l, m h, l h) a +0
stands in, so in ``v`` only ``h * h`` products can be infinite or NaN, and they are exactly
where ``ug[t, j] * W[j, k]`` is (with its sign; ``h`` is 0 only for 0 and float32 denormals
below 2^-133).  In ``fn_grad`` ``s_h`` likewise has exactly the reference's infinite and NaN
terms; ``s_m`` and ``s_l`` may hold ``0 * inf``, so a non-finite ``s_h`` is the value as it is.

Layout: a column slice of ``COLS`` (64) consecutive columns of K belongs to one block, or to a
cluster of ``cluster`` blocks (static: 1, 2, 4 or 8; the host picks it) that deal the slice's
64-token tiles round-robin (tile ``i`` to rank ``i % cluster``).  One warpgroup (128 threads).
The slice's W parts are built once in shared memory; per tile ``cp.async`` (16 bytes, L2 only,
zero-filled past the last token) copies the x slice, the ``ug`` rows, the ``sg`` values and
(when given) the ``x_grad`` slice into a ring of ``STAGES`` slots, ``STAGES - 1`` tiles ahead;
each thread splits 12 of the tile's ``ug`` values into the two A/B tiles; after a proxy fence
and a barrier the two GEMMs run (wgmma on sm_90a, mma.sync on sm_100a) and the ``x_grad``
epilogue works on the accumulator fragment directly.  Rows past the last token are zeros in
every ring buffer (so they add +0 to ``fn_grad``) and are never stored.

The order depends on the cluster size, which the host picks from the token count, K and the
SM count; a token's ``x_grad_out`` row never depends on the batch.  K is a run-time multiple of
``COLS``, the token count a run-time value (64-bit offsets); ``mhc_mult`` is static.
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_sync

from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE
from kernels_tl.dependent_launch import wait_for_previous_grid

COLS = 64  # columns of K per block (the fn GEMM's M, the x_grad GEMM's N)
TILE = 64  # tokens per ring slot (the x_grad GEMM's M, the fn GEMM's k)
THREADS = 128  # one warpgroup
STAGES = 5  # ring slots: 4 tiles in flight
GS_PAD = 8  # x_grad ring rows padded to 72 elements (144 bytes): conflict-free epilogue reads
CLUSTERS = (1, 2, 4, 8)
# the x_grad GEMM's 8 blocks of M3 inner terms pair the parts (ug, W) h h, h m, h l, m h, m m,
# m l, l h, l m: every pair but (l, l) (_u_part, _w_part)
# Barriers are placed by hand (three per tile, around the final sums) and every shared or global
# index is in bounds by construction: TileLang's automatic barriers and guards would add work
# to every tile.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}

# cp.async of 16 (L2 only) or 4 bytes with a source size (0: the destination is zero-filled and
# nothing is read), the group fences (the wait leaves STAGES - 2 groups pending) and the
# generic-to-async proxy fence that makes a thread's shared-memory writes visible to wgmma
ASYNC_SOURCE = r"""
__device__ __forceinline__ unsigned tka_nfbwd_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void tka_nfbwd_cp16(void* dst, const void* src, int valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(tka_nfbwd_smem(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void tka_nfbwd_cp4(void* dst, const void* src, int valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"(tka_nfbwd_smem(dst)), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void tka_nfbwd_st16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
__device__ __forceinline__ void tka_nfbwd_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void tka_nfbwd_landed() {
  asm volatile("cp.async.wait_group """ + str(STAGES - 2) + r""";" ::: "memory");
}
__device__ __forceinline__ void tka_nfbwd_proxy_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
"""


def host_constants(mhc_mult, cluster):
    return {"cols_per_block": COLS, "tile_tokens": TILE}


def _split3(v):
    """The bf16 parts ``h``, ``m``, ``l`` of float32 ``v`` (exact: ``v = h + m + l``) and ``hx``,
    the ``h`` that meets the other operand's ``m`` or ``l``: for a finite ``v`` ``hx = h``; an
    infinite or NaN ``v`` has ``h = v`` (a NaN made quiet), ``m = l = hx = +0``, so that only
    ``h * h`` products can be infinite or NaN (never ``inf * 0`` from a zero part)."""
    bits = T.reinterpret(v, T.uint32)
    special = (bits & T.uint32(0x7F800000)) == T.uint32(0x7F800000)
    r1 = v - T.reinterpret(bits & T.uint32(0xFFFF0000), T.float32)  # exact
    r2 = r1 - T.reinterpret(T.reinterpret(r1, T.uint32) & T.uint32(0xFFFF0000), T.float32)  # exact
    h = T.if_then_else(special & ((bits & T.uint32(0x007FFFFF)) != T.uint32(0)),
                       (bits >> T.uint32(16)) | T.uint32(0x40), bits >> T.uint32(16))
    m = T.if_then_else(special, T.uint32(0), T.reinterpret(r1, T.uint32) >> T.uint32(16))
    lo = T.if_then_else(special, T.uint32(0), T.reinterpret(r2, T.uint32) >> T.uint32(16))
    hx = T.if_then_else(special, T.uint32(0), bits >> T.uint32(16))
    return [T.reinterpret(T.Cast("uint16", p), T.bfloat16) for p in (h, m, lo, hx)]


def _u_part(b):
    """The ``ug`` part of the x_grad GEMM's inner block ``b``: h h, h m, h l, m h, m m, m l, l h,
    l m; ``hx`` (3) where ``h`` meets ``W``'s ``m`` or ``l``."""
    return T.if_then_else((b == 1) | (b == 2), 3, b // 3)


def _w_part(b):
    """The ``W`` part of inner block ``b``; ``hx`` (3) where ``h`` meets ``ug``'s ``m`` or ``l``."""
    return T.if_then_else((b == 3) | (b == 6), 3, b % 3)


def mhc_pre_norm_fn_bwd_kernel(mhc_mult, cluster):
    assert cluster in CLUSTERS
    m3 = mhc_mult * (mhc_mult + 2)
    assert m3 % 8 == 0
    fn_n = (3 * m3 + 15) // 16 * 16  # the fn GEMM's N: the 3 parts, zero rows up to a multiple of 16
    assert fn_n <= 256  # a wgmma N (TileLang widens N only in multiples of 16)
    inner = 8 * m3  # the x_grad GEMM's k
    row_pieces = COLS * 2 // 16  # 16-byte pieces of a tile row of x (8)
    x_passes = TILE * row_pieces // THREADS  # 4
    u_row = m3 // 4  # 16-byte pieces of a ug row
    u_passes = TILE * u_row // THREADS  # 3
    assert TILE * u_row % THREADS == 0
    u_per_thread = TILE * m3 // THREADS  # ug values each thread splits per tile (12)
    u_threads_per_row = THREADS // TILE  # 2
    w_per_thread = m3 * COLS // THREADS  # W values each thread splits once (12)
    outs = m3 * COLS  # fn_grad values per block
    fn_passes = outs // THREADS
    assert outs % THREADS == 0 and outs % cluster == 0
    num_tokens = T.dynamic("num_tokens", "int64")
    features = T.dynamic("features")  # K

    @T.macro
    def copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad, slot, tile, col0, tid):
        t0 = T.Cast("int64", tile) * TILE
        for q in T.unroll(x_passes):
            p = tid + q * THREADS
            t = t0 + p // row_pieces
            row = T.min(t, num_tokens - 1)
            col = col0 + (p % row_pieces) * 8
            T.evaluate(T.call_extern("void", "tka_nfbwd_cp16", T.address_of(xs[slot, p // row_pieces, (p % row_pieces) * 8]),
                                     T.address_of(residual[row, col]), t < num_tokens))
            if with_x_grad != 0:
                T.evaluate(T.call_extern("void", "tka_nfbwd_cp16",
                                         T.address_of(gs[slot, p // row_pieces, (p % row_pieces) * 8]),
                                         T.address_of(x_grad[row, col]), t < num_tokens))
        for q in T.unroll(u_passes):
            p = tid + q * THREADS
            t = t0 + p // u_row
            row = T.min(t, num_tokens - 1)
            T.evaluate(T.call_extern("void", "tka_nfbwd_cp16", T.address_of(us[slot, p // u_row, (p % u_row) * 4]),
                                     T.address_of(out_mul_grad[row, (p % u_row) * 4]), t < num_tokens))
        if tid < TILE:
            t = t0 + tid
            row = T.min(t, num_tokens - 1)
            T.evaluate(T.call_extern("void", "tka_nfbwd_cp4", T.address_of(ss[slot, tid]),
                                     T.address_of(sqrsum_grad[row]), t < num_tokens))

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
            T.assume(features % COLS == 0)
            tid = T.get_thread_binding()
            col0 = (bid // cluster) * COLS
            rank = block_rank_in_cluster() if cluster > 1 else 0
            # this block's tiles: rank, rank + cluster, rank + 2 cluster, ...
            tiles = (T.Cast("int32", T.ceildiv(num_tokens, TILE)) + (cluster - 1 - rank)) // cluster

            xs = T.alloc_shared((STAGES, TILE, COLS), T.bfloat16)
            gs = T.alloc_shared((STAGES, TILE, COLS + GS_PAD), T.bfloat16)
            us = T.alloc_shared((STAGES, TILE, m3), T.float32)
            ss = T.alloc_shared((STAGES, TILE), T.float32)
            wp = T.alloc_shared((inner, COLS), T.bfloat16)  # W parts of the 8 inner blocks (_w_part)
            up = T.alloc_shared((TILE, inner), T.bfloat16)  # ug parts of the 8 inner blocks (_u_part)
            ut = T.alloc_shared((fn_n, TILE), T.bfloat16)  # ug parts transposed (h; m; l; zero rows)
            ob = T.alloc_shared((TILE, COLS + GS_PAD), T.bfloat16)  # the tile's x_grad_out
            red = T.alloc_shared((COLS, fn_n), T.float32)
            fsum = T.alloc_shared((m3, COLS), T.float32)
            xacc = T.alloc_fragment((TILE, COLS), T.float32)
            ftile = T.alloc_fragment((COLS, fn_n), T.float32)  # one tile's fn sums
            facc = T.alloc_fragment((COLS, fn_n), T.float32)  # the block's, tile by tile
            parts = T.alloc_local((4,), T.bfloat16)
            uv = T.alloc_var(T.float32)
            total = T.alloc_var(T.float32)

            T.clear(facc)

            for q in T.unroll((fn_n - 3 * m3) * TILE // THREADS):
                ut[3 * m3 + (tid + q * THREADS) // TILE, (tid + q * THREADS) % TILE] = T.bfloat16(0)

            # prologue: tiles 0 .. STAGES - 2 in flight
            for s in T.unroll(STAGES - 1):
                if s < tiles:
                    copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad, s,
                              s * cluster + rank, col0, tid)
                T.evaluate(T.call_extern("void", "tka_nfbwd_commit"))

            # the slice's W parts, once (made visible to the async proxy by the first tile's fence): thread tid takes column tid % COLS, rows tid // COLS + 2 q
            for q in T.unroll(w_per_thread):
                uv = mhc_fn[tid // COLS + q * (THREADS // COLS), col0 + tid % COLS]
                parts[0] = _split3(uv)[0]
                parts[1] = _split3(uv)[1]
                parts[2] = _split3(uv)[2]
                parts[3] = _split3(uv)[3]
                for b in T.unroll(8):
                    wp[b * m3 + tid // COLS + q * (THREADS // COLS), tid % COLS] = parts[_w_part(b)]

            for i in T.serial(tiles):
                T.evaluate(T.call_extern("void", "tka_nfbwd_landed"))  # this thread's copies of tile i landed
                # everyone's copies of tile i are in; everyone is done with tile i - 1 (its ring
                # slot, its GEMMs' reads of up / ut, its epilogue)
                T.sync_threads()
                if i + STAGES - 1 < tiles:
                    copy_tile(xs, us, ss, gs, residual, out_mul_grad, sqrsum_grad, x_grad, with_x_grad,
                              (i + STAGES - 1) % STAGES, (i + STAGES - 1) * cluster + rank, col0, tid)
                T.evaluate(T.call_extern("void", "tka_nfbwd_commit"))
                slot = i % STAGES
                # this thread's ug values: token tid // 2, j = (tid % 2) * 12 + e
                for e in T.unroll(u_per_thread):
                    tt = tid // u_threads_per_row
                    j = (tid % u_threads_per_row) * u_per_thread + e
                    uv = us[slot, tt, j]
                    parts[0] = _split3(uv)[0]
                    parts[1] = _split3(uv)[1]
                    parts[2] = _split3(uv)[2]
                    parts[3] = _split3(uv)[3]
                    for b in T.unroll(8):
                        up[tt, b * m3 + j] = parts[_u_part(b)]
                    for p in T.unroll(3):
                        ut[p * m3 + j, tt] = parts[p]
                # this thread's shared writes (its cp.async copies, its parts) visible to the async
                # proxy; then everyone's are in
                T.evaluate(T.call_extern("void", "tka_nfbwd_proxy_fence"))
                T.sync_threads()
                T.gemm(up, wp, xacc, clear_accum=True)
                T.gemm(xs[slot, :, :], ut, ftile, transpose_A=True, transpose_B=True, clear_accum=True)
                for a, b in T.Parallel(COLS, fn_n):
                    facc[a, b] = facc[a, b] + ftile[a, b]
                # x_grad_out: the accumulator fragment's values to ob, then 16-byte row pieces to
                # global memory (ob was last read before this tile's first barrier)
                if with_x_grad != 0:
                    for r, c in T.Parallel(TILE, COLS):
                        ob[r, c] = T.Cast("bfloat16", T.ieee_add(
                            T.Cast("float32", gs[slot, r, c]),
                            xacc[r, c] + (T.Cast("float32", xs[slot, r, c]) + T.Cast("float32", xs[slot, r, c]))
                            * ss[slot, r]))
                else:
                    for r, c in T.Parallel(TILE, COLS):
                        ob[r, c] = T.Cast("bfloat16", (
                            xacc[r, c] + (T.Cast("float32", xs[slot, r, c]) + T.Cast("float32", xs[slot, r, c]))
                            * ss[slot, r]))
                T.sync_threads()
                t0 = T.Cast("int64", i * cluster + rank) * TILE
                for q in T.unroll(x_passes):
                    p = tid + q * THREADS
                    if t0 + p // row_pieces < num_tokens:
                        T.evaluate(T.call_extern("void", "tka_nfbwd_st16",
                                                 T.address_of(x_grad_out[t0 + p // row_pieces, col0 + (p % row_pieces) * 8]),
                                                 T.address_of(ob[p // row_pieces, (p % row_pieces) * 8])))

            # the block's sums: (h + m) + l per value.  No copy is pending (the last real one was
            # waited for), and the barrier orders everyone's last epilogue before red's writes
            T.sync_threads()
            T.copy(facc, red)
            T.sync_threads()
            for q in T.unroll(fn_passes):
                j = (tid + q * THREADS) // COLS
                c = (tid + q * THREADS) % COLS
                # a non-finite h sum is the reference's (its infinite and NaN terms are exactly the
                # reference's); the m and l sums may then hold 0 * inf
                total = T.if_then_else(
                    (T.reinterpret(red[c, j], T.uint32) & T.uint32(0x7F800000)) == T.uint32(0x7F800000),
                    red[c, j], (red[c, j] + red[c, m3 + j]) + red[c, 2 * m3 + j])
                if cluster > 1:
                    fsum[j, c] = total  # only this thread writes (j, c)
                else:
                    fn_grad[j, col0 + c] = total
            if cluster > 1:
                # the blocks' sums, left to right from rank 0, through distributed shared memory;
                # each block writes a share of the slice's values
                cluster_sync()
                share = outs // cluster
                for q in T.unroll((share + THREADS - 1) // THREADS):
                    if tid + q * THREADS < share:
                        j = (rank * share + tid + q * THREADS) // COLS
                        c = (rank * share + tid + q * THREADS) % COLS
                        total = T.call_extern(T.float32, "tka_cluster_load_f32", T.address_of(fsum[j, c]), 0)
                        for rr in T.unroll(cluster - 1):
                            total = total + T.call_extern(T.float32, "tka_cluster_load_f32",
                                                          T.address_of(fsum[j, c]), rr + 1)
                        fn_grad[j, col0 + c] = total
                cluster_sync()  # no block exits while another may read its sums

    return mhc_pre_norm_fn_bwd
