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
(``c`` of 8 column quads, ``g`` of 16 token groups) keeps the projection's 4 x M3 values of its
4 columns and 4 x M3 running sums of ``fn_grad`` in registers (192 at M3 = 24).  Tokens go in
tiles of ``TILE`` (64): a tile's x slice (64 rows x 64 bytes), its ``ug`` rows, ``sg`` values
and (when given) the ``x_grad`` slice are copied to shared memory by ``cp.async`` into a ring of
``STAGES`` slots issued ``STAGES - 1`` tiles ahead; token ``16 r + g`` of a tile goes to token
group ``g``.

Per token a thread reads the token's M3 ``ug`` values (16-byte loads, one address per 8 lanes)
and its 4 x values and does 8 x M3 FMAs: each ``ug`` value serves 8 FMAs (4 columns x 2
products), and the 4 columns' ``v`` chains are independent, so a warp issues the chain steps
back to back instead of waiting out one chain's FMA latency.  Its ``x_grad_out`` (two words) is
stored from registers.  The token loop is not unrolled: its body (one token, ~230 instructions)
stays small in the instruction cache, and unrolled it would spill.  Rows of the last tile past
the end hold ``x = +0`` and ``ug = -0``: their products are -0, which leaves every ``fn_grad``
sum unchanged (+0, -0, NaN and infinities included), so only the stores test the token count.

``fn_grad`` order: in each block, token group ``g`` adds the products of its tokens (``16 r + g``
of the block's tiles) in increasing token order from +0 (FMAs); the block's 16 group sums are
added left to right from group 0; in a cluster the blocks' sums are then added left to right
from rank 0 (through distributed shared memory).  The order depends on the cluster size, which
the host picks from the token count, K and the SM count.

K is a run-time multiple of 32, the token count a run-time value (64-bit offsets); ``mhc_mult``
is static (M3 = M (M + 2) a multiple of 4).
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_sync

from kernels_tl import cp_async, fp_pack
from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE
from kernels_tl.dependent_launch import wait_for_previous_grid

COLS = 32  # columns of K per block (K is a multiple of 32)
QUADS = COLS // 4  # threads across the columns, 4 columns each: 8 FMAs per ug value read
THREADS = 128
GROUPS = THREADS // QUADS  # token groups (16)
TILE = 64  # tokens per ring slot
PER_GROUP = TILE // GROUPS  # tokens of a tile per thread (4)
STAGES = 5  # ring slots: 4 tiles in flight (16 KB of x per block, 2 blocks per SM by registers)
CLUSTERS = (1, 2, 4, 8)
# Barriers are placed by hand (one per tile, two around the final sums' shared writes) and every shared or
# global index is in bounds by construction (only rows that are tokens are copied, and only the stores test
# the token count): TileLang's automatic barriers and guards would add work to every tile.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}

# the store of one word (a bf16 pair) into x_grad_out (4-byte aligned: x_grad_out= needs no more)
DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_nfbwd_store_word(void* dst, unsigned word) {
  *static_cast<unsigned*>(dst) = word;
}
"""


def host_constants(mhc_mult, cluster):
    return {"cols_per_block": COLS, "tile_tokens": TILE}


def mhc_pre_norm_fn_bwd_kernel(mhc_mult, cluster):
    assert cluster in CLUSTERS
    m3 = mhc_mult * (mhc_mult + 2)
    assert m3 % 4 == 0
    row_pieces = COLS * 2 // 16  # 16-byte pieces of a tile row of x (4)
    x_rows = THREADS // row_pieces  # rows of x per pass of the block (32)
    x_passes = TILE // x_rows  # 2
    u_row_pieces = m3 // 4  # 16-byte pieces of a ug row
    u_pieces = TILE * u_row_pieces
    u_passes = (u_pieces + THREADS - 1) // THREADS
    outs = m3 * COLS  # fn_grad values per block
    num_tokens = T.dynamic("num_tokens", "int64")
    features = T.dynamic("features")  # K

    @T.macro
    def copy_rows(ring, src, accumulate, slot, t0, rows, col0, tid):
        """cp.async copies of the first ``rows`` rows of the tile from token ``t0`` into ring slot ``slot``
        (``rows`` = TILE: no test)."""
        xs, gs, us, ss = ring
        residual, x_grad, out_mul_grad, sqrsum_grad = src
        for q in T.unroll(x_passes):
            r = tid // row_pieces + q * x_rows
            col = col0 + tid % row_pieces * 8
            if r < rows:
                T.evaluate(cp_async.copy16(xs[slot, r, tid % row_pieces * 4], residual[t0 + r, col]))
                if accumulate:
                    T.evaluate(cp_async.copy16(gs[slot, r, tid % row_pieces * 4], x_grad[t0 + r, col]))
        for q in T.unroll(u_passes):
            p = tid + q * THREADS
            if p < u_pieces:
                if p // u_row_pieces < rows:
                    T.evaluate(cp_async.copy16(us[slot, p // u_row_pieces, p % u_row_pieces * 4],
                                               out_mul_grad[t0 + p // u_row_pieces, p % u_row_pieces * 4]))
        if tid < rows:
            T.evaluate(cp_async.copy4(ss[slot, tid], T.address_of(sqrsum_grad[t0 + tid])))

    @T.macro
    def copy_tile(ring, src, accumulate, slot, tile, col0, tid):
        """Tile ``tile`` into ring slot ``slot``: the rows that are tokens by cp.async; in the last tile,
        x = +0 and ug = -0 in the rows past the end (plain stores)."""
        xs, _, us, _ = ring
        t0 = T.Cast("int64", tile) * TILE
        rows = T.Cast("int32", T.min(num_tokens - t0, TILE))  # rows of the tile that are tokens
        if rows == TILE:
            copy_rows(ring, src, accumulate, slot, t0, TILE, col0, tid)
        else:
            copy_rows(ring, src, accumulate, slot, t0, rows, col0, tid)
            for q in T.unroll(x_passes):
                if tid // row_pieces + q * x_rows >= rows:
                    for e in T.vectorized(4):
                        xs[slot, tid // row_pieces + q * x_rows, tid % row_pieces * 4 + e] = T.uint32(0)
            for q in T.unroll(u_passes):
                p = tid + q * THREADS
                if p < u_pieces:
                    if p // u_row_pieces >= rows:
                        for e in T.vectorized(4):
                            us[slot, p // u_row_pieces, p % u_row_pieces * 4 + e] = T.float32(-0.0)

    @T.macro
    def token(ring, x_grad_out, regs, accumulate, slot, row, t, col0, c):
        """Token ``row`` of the tile in slot ``slot`` (token ``t``): its products added to the sums,
        its x_grad_out stored."""
        xs, gs, us, ss = ring
        w, acc, u, v, xf = regs
        for h in T.unroll(2):
            pair = xs[slot, row, 2 * c + h]
            # bf16 -> float32: the 16 bits moved up; the low half is the earlier column
            xf[2 * h] = T.reinterpret(pair << T.uint32(16), T.float32)
            xf[2 * h + 1] = T.reinterpret(pair & T.uint32(0xFFFF0000), T.float32)
        for e in T.unroll(4):
            v[e] = T.float32(0)
        for q in T.unroll(m3 // 4):
            for e in T.vectorized(4):
                u[e] = us[slot, row, q * 4 + e]
            for jj in T.unroll(4):
                for e in T.unroll(4):
                    v[e] = v[e] + u[jj] * w[q * 4 + jj, e]
                    acc[q * 4 + jj, e] = acc[q * 4 + jj, e] + u[jj] * xf[e]
        for e in T.unroll(4):
            v[e] = v[e] + (xf[e] + xf[e]) * ss[slot, row]
        if accumulate:
            for h in T.unroll(2):
                gpair = gs[slot, row, 2 * c + h]
                v[2 * h] = T.ieee_add(T.reinterpret(gpair << T.uint32(16), T.float32), v[2 * h])
                v[2 * h + 1] = T.ieee_add(T.reinterpret(gpair & T.uint32(0xFFFF0000), T.float32), v[2 * h + 1])
        if t < num_tokens:
            for h in T.unroll(2):
                T.evaluate(T.call_extern("void", "tka_nfbwd_store_word",
                                         T.address_of(x_grad_out[t, col0 + 4 * c + 2 * h]),
                                         fp_pack.bf16x2(v[2 * h], v[2 * h + 1])))

    @T.macro
    def all_tiles(ring, src, x_grad_out, regs, accumulate, tiles, rank, col0, tid, c, g):
        """The block's tiles through the ring (``accumulate``: x_grad given, a static flag)."""
        t0 = T.alloc_var(T.int64)  # the current tile's first token
        # prologue: tiles 0 .. STAGES - 2 in flight
        for s in T.unroll(STAGES - 1):
            if s < tiles:
                copy_tile(ring, src, accumulate, s, s * cluster + rank, col0, tid)
            cp_async.commit()
        for i in T.serial(tiles):
            cp_async.wait(STAGES - 2)  # this thread's copies of tile i landed
            # everyone's copies (and fills) of tile i are in, and everyone is done with tile i - 1's slot
            T.sync_threads()
            if i + STAGES - 1 < tiles:
                copy_tile(ring, src, accumulate, (i + STAGES - 1) % STAGES, (i + STAGES - 1) * cluster + rank, col0,
                          tid)
            cp_async.commit()
            t0 = T.Cast("int64", i * cluster + rank) * TILE
            for r in T.serial(PER_GROUP):  # not unrolled: a small loop body, and no spills
                token(ring, x_grad_out, regs, accumulate, i % STAGES, r * GROUPS + g, t0 + r * GROUPS + g, col0, c)

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
            T.import_source(cp_async.DEVICE_SOURCE + fp_pack.DEVICE_SOURCE + DEVICE_SOURCE
                            + (CLUSTER_LOAD_SOURCE if cluster > 1 else ""))
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            c = tid % QUADS
            g = tid // QUADS
            col0 = (bid // cluster) * COLS
            rank = T.alloc_var(T.int32)
            rank = block_rank_in_cluster() if cluster > 1 else 0
            # this block's tiles: rank, rank + cluster, rank + 2 cluster, ...
            tiles = (T.Cast("int32", T.ceildiv(num_tokens, TILE)) + (cluster - 1 - rank)) // cluster

            xs = T.alloc_shared((STAGES, TILE, COLS // 2), T.uint32)  # bf16 pairs
            gs = T.alloc_shared((STAGES, TILE, COLS // 2), T.uint32)
            us = T.alloc_shared((STAGES, TILE, m3), T.float32)
            ss = T.alloc_shared((STAGES, TILE), T.float32)
            red = T.alloc_shared((GROUPS, m3, COLS), T.float32)
            w = T.alloc_local((m3, 4), T.float32)
            acc = T.alloc_local((m3, 4), T.float32)
            u = T.alloc_local((4,), T.float32)  # the token's ug, 4 rows at a time
            v = T.alloc_local((4,), T.float32)
            xf = T.alloc_local((4,), T.float32)
            total = T.alloc_var(T.float32)

            for j in T.unroll(m3):
                for e in T.unroll(4):
                    w[j, e] = mhc_fn[j, col0 + 4 * c + e]
                    acc[j, e] = T.float32(0)
            ring = (xs, gs, us, ss)
            src = (residual, x_grad, out_mul_grad, sqrsum_grad)
            regs = (w, acc, u, v, xf)
            # the accumulating and the plain loop as two copies: no per-token test of with_x_grad
            if with_x_grad != 0:
                all_tiles(ring, src, x_grad_out, regs, True, tiles, rank, col0, tid, c, g)
            else:
                all_tiles(ring, src, x_grad_out, regs, False, tiles, rank, col0, tid, c, g)

            # the 16 token groups' sums of each fn_grad value, left to right.  `red` may share
            # shared memory with the rings (TileLang's planner reuses it): everyone has finished
            # reading the last tile, and no copy is pending (the last real one was waited for)
            T.sync_threads()
            for j in T.unroll(m3):
                for e in T.unroll(4):
                    red[g, j, 4 * c + e] = acc[j, e]
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
