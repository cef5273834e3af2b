"""mhc.mhc_pre_norm_fn: the RMS-normalised projection of the flattened mHC streams.

``residual`` bf16 [T, M, H] read as x [T, K] (K = M * H), ``mhc_fn`` fp32 [M3, K]
(M3 = M * (M + 2)), optional ``mhc_norm_weight`` fp32 [K] -> ``out`` fp32 [T, M3]::

    w[j, k]   = tf32(mhc_fn[j, k] * normw[k])          (the product rounded once; no weight: mhc_fn)
    dot[t, j] = sum_k x[t, k] * w[j, k]                 (the lane order below)
    sq[t]     = sum_k x[t, k] * x[t, k]                 (the same order)
    out[t, j] = dot[t, j] * rsqrt(sq[t] / K + eps)

``tf32(v)`` adds 0x1000 to the float32 bits and clears the low 13 (round half away from
zero to 10 mantissa bits, as TileKernels rounds the projection before its TF32 GEMM).  A bf16
times a TF32 value is exact in float32, so every multiply-add below rounds once, at the add,
whether or not the compiler fuses it: the sums are bit-for-bit those of the reference
(``tile_kernels_aot.torch.mhc._lane_order_dot``).

Order: element ``k`` belongs to lane ``l`` of 256 as ``k = (i * 256 + l) * 4 + e``; each lane
adds its terms in ``(i, e)`` order into a sum that starts at +0; the 32 lanes ``32 g .. 32 g +
31`` of lane group ``g`` are combined as a butterfly (lanes ``m`` and ``m + 16`` first, then
``+ 8``, ``+ 4``, ``+ 2``, ``+ 1``), the 8 group sums as
``((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7))``.

Layout: a tile of ``TOKENS`` (32) tokens is one block of 256 threads, or a cluster of
``cluster`` blocks (static: 1, 2, 4 or 8) that split the 8 lane groups between them.  A block
walks its lane groups one after another (a "phase" each); within a phase thread
``(h, g, a)`` (``a`` the lane in the group, ``g`` of 4 token groups, ``h`` of 2 row halves)
keeps the running sums of lane ``a`` for 8 tokens x 12 projection rows (96 registers) and
4 of those tokens' squares.  Each step (one ``i``) the block stages in shared memory the
tokens' 256-byte slices of x (``cp.async``, a ring of ``STAGES`` slots, issued
``STAGES - 1`` steps ahead) and the projection's 24 x 32 x 4 slice, read one step ahead
into registers, multiplied by the norm weight and rounded to TF32 once per block (double
buffered).  A phase ends with the running sums written to shared memory and each lane
group's butterfly summed there; the last step's group sums meet (through distributed shared
memory in a cluster) in the fixed 8-way tree.  K is a run-time value (a multiple of 1024);
``mhc_mult`` and ``cluster`` are static.  Token offsets are 64-bit.
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_sync

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE

WARP = 32
LANES = 256  # lanes of the K order
PIECE = 4  # consecutive elements of K per lane and step
SPAN = LANES * PIECE  # K must be a multiple of this
GROUP = 32  # lanes per lane group (one phase)
GROUPS = LANES // GROUP  # 8
TOKENS = 32  # tokens per block (per cluster)
TOKEN_GROUP = 8  # tokens per thread
TOKEN_GROUPS = TOKENS // TOKEN_GROUP  # 4
HALVES = 2  # thread groups splitting the projection rows
THREADS = GROUP * TOKEN_GROUPS * HALVES  # 256
STAGES = 4  # x ring slots
PAD = GROUP + 1  # shared row of one sum's 32 lane values, padded against bank conflicts
CLUSTERS = (1, 2, 4, 8)
# Every shared-memory barrier is placed by hand (the step loop's one per step and the phase
# ends'; see the comments there) and every index is in bounds by construction (x rows past the
# end clamp to the last token; the K pieces of a step stay below K / 4): TileLang's automatic
# barriers and guards would add a barrier and a dozen integer operations per step.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}

# cp.async of 16 bytes (L2 only) from a byte offset of a base pointer, and its group fences; the
# wait leaves STAGES - 2 groups pending
ASYNC_SOURCE = r"""
__device__ __forceinline__ void tka_normfn_cp16(void* dst, const void* base, long long offset) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const char* src = static_cast<const char*>(base) + offset;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void tka_normfn_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void tka_normfn_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(""" + str(STAGES - 2) + r""") : "memory");
}
"""


def host_constants(mhc_mult, cluster):
    return {"span": SPAN, "tokens_per_block": TOKENS}


def _tf32(value):
    """Round a float32 to TF32 the way TileKernels does: +0x1000 on the bits, low 13 bits cleared."""
    bits = T.reinterpret(value, T.uint32)
    return T.reinterpret((bits + T.uint32(0x1000)) & T.uint32(0xFFFFE000), T.float32)


def _pair_tree(values):
    """((v0 + v1) + (v2 + v3)) + ... : the pairwise sum of a power-of-two list, neighbours first."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def _groups_tree(res, size, phases, at, remote):
    """``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` over the 8 lane groups' sums at
    offset ``at`` of each phase's slice of ``res`` (``size`` floats); group ``g`` is phase
    ``g % phases`` of cluster rank ``g // phases`` (through distributed shared memory when
    ``remote``)."""
    if remote:
        return _pair_tree([T.call_extern(T.float32, "tka_cluster_load_f32",
                                         T.address_of(res[(g % phases) * size + at]), g // phases)
                           for g in range(GROUPS)])
    return _pair_tree([res[g * size + at] for g in range(GROUPS)])


def mhc_pre_norm_fn_kernel(mhc_mult, cluster):
    assert cluster in CLUSTERS
    m3 = mhc_mult * (mhc_mult + 2)
    assert m3 % (HALVES * 4) == 0  # even mhc_mult: rows split in halves, the W slice in whole passes
    rows = m3 // HALVES  # projection rows per thread
    cols = m3 + 1  # per token: the m3 dot sums and the square sum
    phases = GROUPS // cluster  # lane groups per block
    w_passes = m3 * GROUP // THREADS  # float4 pieces of the W slice per thread and step
    x_passes = TOKENS * GROUP * PIECE * 2 // 16 // THREADS  # 16-byte copies of the x slice per thread
    x_rows = THREADS * 16 // (GROUP * PIECE * 2)  # token rows one pass of the copies covers
    source = ASYNC_SOURCE + (CLUSTER_LOAD_SOURCE if cluster > 1 else "")
    num_tokens = T.dynamic("num_tokens", "int64")
    pieces = T.dynamic("pieces")  # K / PIECE

    @T.macro
    def copy_x(xs, residual, x_at, slot, first, tid):
        # the TOKENS rows' 256-byte slices of a step (from K piece `first`) into a ring slot:
        # 16-byte piece tid % 16 (lanes 2v, 2v + 1) of rows tid // 16 + 16 q
        for q in T.unroll(x_passes):
            T.evaluate(T.call_extern("void", "tka_normfn_cp16",
                                     T.address_of(xs[slot, tid // (THREADS // x_rows) + q * x_rows,
                                                     2 * (tid % (THREADS // x_rows)), 0]),
                                     T.address_of(residual[0, 0, 0]), x_at[q] + T.Cast("int64", first) * (PIECE * 2)))

    @T.macro
    def load_w(wn, nv, mhc_fn, mhc_norm_weight, has_weight, first, tid):
        # this thread's raw pieces of a step's W slice: rows tid // 32 + 8 q, lane tid % 32
        for q in T.unroll(w_passes):
            for e in T.vectorized(PIECE):
                wn[q, e] = mhc_fn[tid // GROUP + q * (THREADS // GROUP), first + tid % GROUP, e]
        if has_weight != 0:
            for e in T.vectorized(PIECE):
                nv[e] = mhc_norm_weight[first + tid % GROUP, e]

    @T.macro
    def store_w(ws, wn, nv, has_weight, buf, tid):
        # the loaded pieces, weighted and rounded to TF32, into W buffer `buf`
        for q in T.unroll(w_passes):
            if has_weight != 0:
                for e in T.unroll(PIECE):
                    wn[q, e] = T.ieee_mul(wn[q, e], nv[e])
            for e in T.unroll(PIECE):
                wn[q, e] = _tf32(wn[q, e])
            for e in T.vectorized(PIECE):
                ws[buf, tid // GROUP + q * (THREADS // GROUP), tid % GROUP, e] = wn[q, e]

    @T.prim_func
    def mhc_pre_norm_fn(
        residual: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        mhc_fn: T.Tensor[(m3, pieces, PIECE), T.float32],
        mhc_norm_weight: T.Tensor[(pieces, PIECE), T.float32],
        out: T.Tensor[(num_tokens, m3), T.float32],
        has_weight: T.int32,
        eps: T.float32,
        features: T.float32,  # K, exact in float32
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, TOKENS)) * cluster, threads=THREADS,
                      cluster_dims=cluster) as bid:
            T.import_source(source)
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces % LANES == 0)
            tid = T.get_thread_binding()
            a = tid % GROUP  # lane within the group
            tg = (tid // GROUP) % TOKEN_GROUPS
            half = tid // (GROUP * TOKEN_GROUPS)
            rank = block_rank_in_cluster() if cluster > 1 else 0
            t0 = T.Cast("int64", bid // cluster) * TOKENS
            steps_per_phase = pieces // LANES
            steps = phases * steps_per_phase

            xs = T.alloc_shared((STAGES, TOKENS, GROUP, PIECE // 2), T.uint32)  # bf16 pairs
            ws = T.alloc_shared((2, m3, GROUP, PIECE), T.float32)
            dump = T.alloc_shared((TOKENS * cols * PAD,), T.float32)
            res = T.alloc_shared((phases * TOKENS * cols,), T.float32)
            acc = T.alloc_local((TOKEN_GROUP, rows), T.float32)
            sq = T.alloc_local((TOKEN_GROUP // HALVES,), T.float32)
            xv = T.alloc_local((TOKEN_GROUP, PIECE // 2), T.uint32)
            xf = T.alloc_local((TOKEN_GROUP, PIECE), T.float32)
            wv = T.alloc_local((PIECE,), T.float32)
            wn = T.alloc_local((w_passes, PIECE), T.float32)  # the next step's W slice, raw
            nv = T.alloc_local((PIECE,), T.float32)
            lv = T.alloc_local((GROUP,), T.float32)
            x_at = T.alloc_local((x_passes,), T.int64)
            total = T.alloc_var(T.float32)
            ssum = T.alloc_var(T.float32)
            # (step within the phase, lane group) of the next x copy, the next W load and the
            # step computed; the phase of the step computed
            x_i = T.alloc_var(T.int32)
            x_g = T.alloc_var(T.int32)
            w_i = T.alloc_var(T.int32)
            w_g = T.alloc_var(T.int32)
            c_i = T.alloc_var(T.int32)
            phase = T.alloc_var(T.int32)

            for tt in T.unroll(TOKEN_GROUP):
                for r in T.unroll(rows):
                    acc[tt, r] = T.float32(0)
            for k in T.unroll(TOKEN_GROUP // HALVES):
                sq[k] = T.float32(0)
            # byte offsets of this thread's x copies in `residual` at K piece 0: rows past the
            # end read the last token (in bounds, never stored)
            for q in T.unroll(x_passes):
                x_at[q] = (T.min(t0 + tid // (THREADS // x_rows) + q * x_rows, num_tokens - 1) * pieces
                           + 2 * (tid % (THREADS // x_rows))) * (PIECE * 2)
            x_i = 0
            x_g = rank * phases
            w_i = 0
            w_g = rank * phases
            c_i = 0
            phase = 0

            # prologue: x of steps 0 .. STAGES - 2 in flight, W of step 0 staged, of step 1 loading
            for s in T.unroll(STAGES - 1):
                if s < steps:
                    copy_x(xs, residual, x_at, s, x_i * LANES + x_g * GROUP, tid)
                T.evaluate(T.call_extern("void", "tka_normfn_commit"))
                x_i += 1  # the next step, phase-major
                if x_i == steps_per_phase:
                    x_i = 0
                    x_g += 1
            load_w(wn, nv, mhc_fn, mhc_norm_weight, has_weight, w_i * LANES + w_g * GROUP, tid)
            w_i += 1  # the next step, phase-major
            if w_i == steps_per_phase:
                w_i = 0
                w_g += 1
            store_w(ws, wn, nv, has_weight, 0, tid)
            if steps > 1:
                load_w(wn, nv, mhc_fn, mhc_norm_weight, has_weight, w_i * LANES + w_g * GROUP, tid)
            w_i += 1  # the next step, phase-major
            if w_i == steps_per_phase:
                w_i = 0
                w_g += 1

            for s in T.serial(steps):
                T.evaluate(T.call_extern("void", "tka_normfn_wait"))  # this thread's copies of step s landed
                # everyone's copies and W of step s are in, and everyone is done with step s - 1
                # (its x slot, its W buffer, the last phase end's reads of dump)
                T.sync_threads()
                if s + STAGES - 1 < steps:
                    # into the slot step s - 1 used
                    copy_x(xs, residual, x_at, (s + STAGES - 1) % STAGES, x_i * LANES + x_g * GROUP, tid)
                T.evaluate(T.call_extern("void", "tka_normfn_commit"))
                x_i += 1  # the next step, phase-major
                if x_i == steps_per_phase:
                    x_i = 0
                    x_g += 1

                # this step's x first, then W of step s + 1 into the other buffer (step s - 1's):
                # integer work that covers the loads' latency; then W of step s + 2 loading, a
                # whole step ahead
                for tt in T.unroll(TOKEN_GROUP):
                    for e in T.vectorized(PIECE // 2):
                        xv[tt, e] = xs[s % STAGES, tg * TOKEN_GROUP + tt, a, e]
                if s + 1 < steps:
                    store_w(ws, wn, nv, has_weight, (s + 1) % 2, tid)
                    if s + 2 < steps:
                        load_w(wn, nv, mhc_fn, mhc_norm_weight, has_weight, w_i * LANES + w_g * GROUP, tid)
                w_i += 1  # the next step, phase-major
                if w_i == steps_per_phase:
                    w_i = 0
                    w_g += 1

                # bf16 -> float32 is the 16 bits moved up: the low half of a pair is the earlier element
                for tt in T.unroll(TOKEN_GROUP):
                    for e in T.unroll(PIECE // 2):
                        xf[tt, 2 * e] = T.reinterpret(xv[tt, e] << T.uint32(16), T.float32)
                        xf[tt, 2 * e + 1] = T.reinterpret(xv[tt, e] & T.uint32(0xFFFF0000), T.float32)
                # squares: half 0 for tokens 0-3 of the thread's 8, half 1 for tokens 4-7
                if half == 0:
                    for k in T.unroll(TOKEN_GROUP // HALVES):
                        for e in T.unroll(PIECE):
                            sq[k] = sq[k] + xf[k, e] * xf[k, e]
                else:
                    for k in T.unroll(TOKEN_GROUP // HALVES):
                        for e in T.unroll(PIECE):
                            sq[k] = sq[k] + xf[TOKEN_GROUP // HALVES + k, e] * xf[TOKEN_GROUP // HALVES + k, e]
                for r in T.unroll(rows):
                    for e in T.vectorized(PIECE):
                        wv[e] = ws[s % 2, half * rows + r, a, e]
                    for tt in T.unroll(TOKEN_GROUP):
                        for e in T.unroll(PIECE):
                            acc[tt, r] = acc[tt, r] + xf[tt, e] * wv[e]

                c_i += 1
                if c_i == steps_per_phase:
                    # end of a phase: the running sums to shared memory, each sum's 32 lanes in a
                    # row (the previous phase end's reads of dump finished before this step's
                    # barrier)
                    c_i = 0
                    for tt in T.unroll(TOKEN_GROUP):
                        for r in T.unroll(rows):
                            dump[((tg * TOKEN_GROUP + tt) * cols + half * rows + r) * PAD + a] = acc[tt, r]
                            acc[tt, r] = T.float32(0)
                    for k in T.unroll(TOKEN_GROUP // HALVES):
                        dump[((tg * TOKEN_GROUP + half * (TOKEN_GROUP // HALVES) + k) * cols + m3) * PAD + a] = sq[k]
                        sq[k] = T.float32(0)
                    T.sync_threads()
                    # each sum's butterfly over the group's 32 lanes: m + 16, + 8, + 4, + 2, + 1
                    for q in T.unroll((TOKENS * cols + THREADS - 1) // THREADS):
                        if tid + q * THREADS < TOKENS * cols:
                            for m in T.unroll(GROUP):
                                lv[m] = dump[(tid + q * THREADS) * PAD + m]
                            for m in T.unroll(16):
                                lv[m] = lv[m] + lv[m + 16]
                            for m in T.unroll(8):
                                lv[m] = lv[m] + lv[m + 8]
                            for m in T.unroll(4):
                                lv[m] = lv[m] + lv[m + 4]
                            for m in T.unroll(2):
                                lv[m] = lv[m] + lv[m + 2]
                            lv[0] = lv[0] + lv[1]
                            res[phase * (TOKENS * cols) + tid + q * THREADS] = lv[0]
                    phase += 1

            # the 8 lane groups' sums of each output, pairwise; in a cluster every block's res is
            # read through distributed shared memory, each block writing a share of the tile
            if cluster > 1:
                cluster_sync()
            else:
                T.sync_threads()
            share = TOKENS * m3 // cluster
            for q in T.unroll((share + THREADS - 1) // THREADS):
                if tid + q * THREADS < share:
                    tt = (rank * share + tid + q * THREADS) // m3
                    j = (rank * share + tid + q * THREADS) % m3
                    total = _groups_tree(res, TOKENS * cols, phases, tt * cols + j, cluster > 1)
                    ssum = _groups_tree(res, TOKENS * cols, phases, tt * cols + m3, cluster > 1)
                    if t0 + tt < num_tokens:
                        out[t0 + tt, j] = T.ieee_mul(total, T.rsqrt(T.ieee_add(T.ieee_fdiv(ssum, features), eps)))
            if cluster > 1:
                cluster_sync()  # no block exits while another may read its res

    return mhc_pre_norm_fn
