"""mhc.mhc_pre_norm_fn: the RMS-normalised projection of the flattened mHC streams, on tensor cores.

``residual`` bf16 [T, M, H] read as x [T, K] (K = M * H), ``mhc_fn`` fp32 [M3, K]
(M3 = M * (M + 2)), optional ``mhc_norm_weight`` fp32 [K] -> ``out`` fp32 [T, M3]::

    w[j, k]   = tf32(mhc_fn[j, k] * normw[k])          (the product rounded once; no weight: mhc_fn)
    dot[t, j] = sum_k x[t, k] * w[j, k]                 (bf16 tensor-core MMA, float32 accumulation)
    sq[t]     = sum_k x[t, k] * x[t, k]                 (CUDA cores, the reference's lane order)
    out[t, j] = dot[t, j] * rsqrt(sq[t] / K + eps)

``tf32(v)`` adds 0x1000 to the float32 bits and clears the low 13 (TileKernels' rounding of the
projection before its TF32 GEMM): 11 significant bits.  Each w splits exactly into two bf16
values, ``hi`` (w with the low 16 bits cleared: 8 significant bits) and ``lo = w - hi`` (at most
3 significant bits), so one bf16 GEMM with N = 2 * M3 columns ``[hi; lo]`` has only exact
products; ``dot = hi-sum + lo-sum``.  Only the order of the float32 additions differs from the
reference (``tile_kernels_aot.torch.mhc._lane_order_dot``): the op's tolerance covers it.

Order, fixed for every token count and cluster size (a token's row never depends on the batch):
K element ``k = (i * 256 + l) * 4 + e`` belongs to lane ``l`` of 256, lane group ``g = l // 32``
of 8.  A "phase" is one lane group: its ``K / 1024`` chunks of 128 consecutive elements
(``i = 0, 1, ...``), each one MMA step (m64 x n48 x k128) into an accumulator that starts the
phase at +0; the phase's partial is ``hi + lo``; the 8 phase partials meet as
``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``.  ``sq`` follows the reference exactly:
lane ``l`` adds its squares in ``(i, e)`` order from +0, the 32 lanes of a group as a butterfly
(xor 16, 8, 4, 2, 1: IEEE addition is commutative, so both lanes of a pair hold the reference's
sum), the 8 group sums in the tree above.

Layout: a tile of ``tile_tokens`` (64 or 128; static) tokens is one block of 256 threads (8 warps, two per
scheduler), or a cluster of ``cluster`` blocks (static: 1, 2, 4 or 8) that split the 8 phases
between them.  A block walks its phases' steps in one pipelined loop: the tile's 64 x 128 bf16
slice of x, the 24 x 128 float32 slice of ``mhc_fn`` and the 128 norm weights go to shared
memory by ``cp.async`` (a ring of ``STAGES`` slots, issued ``STAGES - 1`` steps ahead; every
thread later reads only what it copied itself before the step's barrier, so one barrier per
step suffices); each thread turns its own W pieces into ``hi``/``lo`` bf16 in a double-buffered
B tile; after the step's barrier the block runs ``T.gemm`` as mma.sync m16n8k16 on both archs
(wgmma disabled: its operands are read by ldmatrix, generic loads, so no proxy fence sits in
the loop; warps 4 x 2 over M x N, k-steps of 16 in order) and every thread adds its 8 tokens'
squares of its lane.  A phase ends with the accumulator dumped to
shared memory, each output's ``hi + lo`` pushed onto its thread's register stack of the block's
phase tree (the last phase stores the block's subtree sum) and each token's lane-group square
sum stored as that phase's partial; after the loop the blocks' subtree sums and the square
partials meet (through distributed shared memory in a cluster) in the fixed tree.  At 128
tokens one step's W slice (and its hi / lo conversion) serves twice the tokens of a 64-token
tile: half the L2 reads of W per token.  With ``splits = 2`` a tile is two clusters (each
walking 8 / (2 * cluster) lane groups per block, the aligned subtree of 4 of the 8): launch 0
stores each cluster's subtree sums and square sums into the scratch ``partials``, launch 1
(``combine = 1``: no step; after the dependent-launch wait) adds the two splits' as the tree's
root and writes ``out``: the same tree, so the same bits.  K is a run-time value (a multiple of 1024);
``mhc_mult``, ``cluster``, ``tile_tokens`` and ``splits`` are static.  Token and K offsets are 64-bit.
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
CHUNK = GROUP * PIECE  # K elements per step (128)
TILES = (64, 128)  # tokens per tile (static ``tile_tokens``)
THREADS = 256  # two warpgroups (8 warps: two per scheduler)
WARPS = THREADS // WARP
# ring slots: 4 at 64 tokens (28 KB of x and W per slot), 3 at 128 (44 KB per slot; 4 would not
# fit shared memory): 84 / 88 KB in flight
STAGES_OF = {64: 4, 128: 3}
CLUSTERS = (1, 2, 4, 8)
# clusters per tile (static ``splits``): 1, or 2 whose subtree sums meet in a second launch
SPLITS = (1, 2)
# Every shared-memory barrier is placed by hand (one per step, one at a phase end, the final
# ones) and every index is in bounds by construction (x rows past the end clamp to the last
# token): TileLang's automatic barriers and guards would add more per step.
# The MMA is mma.sync on both archs (wgmma off): its operands are read by ordinary ldmatrix
# loads, so no generic-to-async proxy fence is needed between the cp.async / st.shared writes
# of a step and its MMA.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True,
                "tl.disable_wgmma": True}

# cp.async of 16 bytes (L2 only) from a byte offset of a base pointer, its group fences (the
# wait leaves STAGES - 2 groups pending) and the generic-to-async proxy fence that makes a
# thread's shared-memory writes (cp.async and st.shared) visible to a wgmma (emitted only where
# T.gemm lowers to wgmma: sm_90a without "tl.disable_wgmma", i.e. a caller lowering this
# factory under other pass configs)
ASYNC_SOURCE = r"""
__device__ __forceinline__ void tka_normfn_cp16(void* dst, const void* base, long long offset) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const char* src = static_cast<const char*>(base) + offset;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void tka_normfn_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void tka_normfn_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(@PENDING@) : "memory");
}
__device__ __forceinline__ void tka_normfn_proxy_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
"""


def _uses_wgmma() -> bool:
    """Whether ``T.gemm`` lowers to wgmma here: sm_90a with wgmma not disabled in the pass context
    the factory runs under (aot/lower.py enters ``PASS_CONFIGS`` and the target first).  Only
    then do the step's shared-memory writes need the proxy fence before the MMA reads them."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda" or str(target.attrs.get("arch", "")) != "sm_90a":
        return False
    ctx = tvm.transform.PassContext.current()
    return not bool(ctx.config.get("tl.disable_wgmma", False))


def host_constants(mhc_mult, cluster, tile_tokens, splits):
    return {"span": SPAN, "tokens_per_block": tile_tokens}


def _tf32_bits(value):
    """The float32 bits of ``value`` rounded to TF32 the way TileKernels does: +0x1000, low 13 cleared."""
    return (T.reinterpret(value, T.uint32) + T.uint32(0x1000)) & T.uint32(0xFFFFE000)


def _pair_tree(values):
    """((v0 + v1) + (v2 + v3)) + ... : the pairwise sum of a power-of-two list, neighbours first."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def _groups_tree(res, size, phases, at, remote, groups=GROUPS):
    """``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` over the cluster's ``groups`` phases'
    partials (all 8, or a split's aligned subtree) at offset ``at`` of each phase's slice of
    ``res`` (``size`` floats); phase ``g`` is local phase ``g % phases`` of cluster rank
    ``g // phases`` (through distributed shared memory when ``remote``)."""
    if remote:
        return _pair_tree([T.call_extern(T.float32, "tka_cluster_load_f32",
                                         T.address_of(res[(g % phases) * size + at]), g // phases)
                           for g in range(groups)])
    return _pair_tree([res[g * size + at] for g in range(groups)])


def _ranks_tree(res, at, cluster):
    """The pairwise sum over the cluster's blocks (rank order) of ``res[at]``."""
    if cluster == 1:
        return res[at]
    return _pair_tree([T.call_extern(T.float32, "tka_cluster_load_f32", T.address_of(res[at]), r)
                       for r in range(cluster)])


def mhc_pre_norm_fn_kernel(mhc_mult, cluster, tile_tokens, splits):
    assert cluster in CLUSTERS and tile_tokens in TILES and splits in SPLITS and cluster * splits <= GROUPS
    TOKENS = tile_tokens
    STAGES = STAGES_OF[TOKENS]
    TOKENS_PER_WARP = TOKENS // WARPS  # tokens' squares per thread (8 or 16)
    m3 = mhc_mult * (mhc_mult + 2)
    n = 2 * m3  # GEMM columns: [hi; lo]
    assert n % 8 == 0 and n <= 256  # a wgmma / mma N
    tile_blocks = cluster * splits  # blocks per tile
    phases = GROUPS // tile_blocks  # lane groups per block
    record = TOKENS * (m3 + 1)  # floats of a split's partials: subtree sums, then square sums
    levels = phases.bit_length() - 1  # depth of the phase tree inside a block (3, 2, 1, 0)
    x_chunks = CHUNK * 2 // 16  # 16-byte pieces of a token row's step slice (16)
    x_passes = TOKENS * x_chunks // THREADS  # x copies per thread and step (4 or 8)
    x_rows = THREADS // x_chunks  # token rows one pass covers (16)
    w_chunks = CHUNK * 4 // 16  # 16-byte pieces of a W row's step slice (32)
    assert (m3 * w_chunks) % THREADS == 0 and w_chunks == WARP
    w_passes = m3 * w_chunks // THREADS  # W copies per thread and step (3)
    w_rows = THREADS // w_chunks  # W rows one pass covers (8)
    outs_per_thread = TOKENS * m3 // THREADS  # phase-end partials per thread (6 or 12)
    assert TOKENS * m3 % THREADS == 0
    assert x_passes * THREADS == TOKENS * x_chunks and w_passes * THREADS == m3 * w_chunks
    wgmma = _uses_wgmma()
    source = ASYNC_SOURCE.replace("@PENDING@", str(STAGES - 2)) + (CLUSTER_LOAD_SOURCE if cluster > 1 else "")
    num_tokens = T.dynamic("num_tokens", "int64")
    chunks = T.dynamic("chunks")  # K / CHUNK

    @T.macro
    def issue(xs, wr, nws, residual, mhc_fn, mhc_norm_weight, x_at, w_at, slot, chunk, tid):
        # step `chunk`'s slices into ring slot `slot`: x rows tid // 16 + 8 q, piece tid % 16;
        # W rows tid // 32 + 4 q, piece tid % 32; the norm weights' piece tid % 32 (every warp
        # copies its own, so a thread reads only what it copied)
        k16 = T.Cast("int64", chunk) * CHUNK
        for q in T.unroll(x_passes):
            T.evaluate(T.call_extern("void", "tka_normfn_cp16",
                                     T.address_of(xs[slot, tid // x_chunks + q * x_rows, (tid % x_chunks) * 8]),
                                     T.address_of(residual[0, 0, 0]), x_at[q] + k16 * 2))
        for q in T.unroll(w_passes):
            T.evaluate(T.call_extern("void", "tka_normfn_cp16",
                                     T.address_of(wr[slot, tid // w_chunks + q * w_rows, (tid % w_chunks) * 4]),
                                     T.address_of(mhc_fn[0, 0, 0]), w_at[q] + k16 * 4))
        T.evaluate(T.call_extern("void", "tka_normfn_cp16",
                                 T.address_of(nws[slot, tid // WARP, (tid % WARP) * 4]),
                                 T.address_of(mhc_norm_weight[0, 0]), (k16 + (tid % WARP) * 4) * 4))

    @T.prim_func
    def mhc_pre_norm_fn(
        residual: T.Tensor[(num_tokens, chunks, CHUNK), T.bfloat16],
        mhc_fn: T.Tensor[(m3, chunks, CHUNK), T.float32],
        mhc_norm_weight: T.Tensor[(chunks, CHUNK), T.float32],
        out: T.Tensor[(num_tokens, m3), T.float32],
        has_weight: T.int32,
        eps: T.float32,
        features: T.float32,  # K, exact in float32
        # splits == 2 only (else unused, not kernel parameters): each (tile, split)'s subtree and
        # square sums (launch 0 writes them, launch 1 adds the two splits' into out)
        partials: T.Tensor[(T.ceildiv(num_tokens, TOKENS) * (splits * record),), T.float32],
        combine: T.int32,  # the launch index of a split layout: 0 the steps, 1 the splits' sums
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, TOKENS)) * tile_blocks, threads=THREADS,
                      cluster_dims=cluster) as bid:
            T.import_source(source)
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(chunks % GROUPS == 0)
            tid = T.get_thread_binding()
            a = tid % WARP  # the lane within the lane group (squares)
            warp = tid // WARP  # tokens warp * 8 .. + 7 (squares)
            wc = tid % w_chunks  # this thread's W piece: columns 4 wc .. 4 wc + 3
            rank = block_rank_in_cluster() if cluster > 1 else 0
            t0 = T.Cast("int64", bid // tile_blocks) * TOKENS
            # this block's place among the tile's blocks: split-major, then cluster rank
            place = (bid // cluster) % splits * cluster + rank if splits > 1 else rank
            steps_per_phase = chunks // GROUPS
            # launch 1 of a split layout walks no step: it only adds the splits' partials
            steps = phases * steps_per_phase if splits == 1 else phases * steps_per_phase * (1 - combine)

            xs = T.alloc_shared((STAGES, TOKENS, CHUNK), T.bfloat16)
            wr = T.alloc_shared((STAGES, m3, CHUNK), T.float32)
            nws = T.alloc_shared((STAGES, WARPS, CHUNK), T.float32)
            wb = T.alloc_shared((2, n, CHUNK), T.bfloat16)
            dump = T.alloc_shared((TOKENS, n), T.float32)
            # the block's phase-tree sum of each output, and each phase's square sums
            res = T.alloc_shared((TOKENS * m3,), T.float32)
            res_sq = T.alloc_shared((phases * TOKENS,), T.float32)
            # this thread's outputs' pending left operands of the phase tree, level by level
            stack = T.alloc_local((max(levels, 1), outs_per_thread), T.float32)
            acc = T.alloc_fragment((TOKENS, n), T.float32)
            sq = T.alloc_local((TOKENS_PER_WARP,), T.float32)
            xv = T.alloc_local((PIECE,), T.bfloat16)
            wv = T.alloc_local((PIECE,), T.float32)
            nv = T.alloc_local((PIECE,), T.float32)
            hv = T.alloc_local((PIECE,), T.uint32)
            hb = T.alloc_local((PIECE,), T.bfloat16)
            lb = T.alloc_local((PIECE,), T.bfloat16)
            x_at = T.alloc_local((x_passes,), T.int64)
            w_at = T.alloc_local((w_passes,), T.int64)
            total = T.alloc_var(T.float32)
            ssum = T.alloc_var(T.float32)
            v = T.alloc_var(T.float32)
            # (step within the phase, lane group) of the next copy and of the step computed;
            # the local phase of the step computed
            x_i = T.alloc_var(T.int32)
            x_g = T.alloc_var(T.int32)
            c_i = T.alloc_var(T.int32)
            phase = T.alloc_var(T.int32)

            T.clear(acc)
            for k in T.unroll(TOKENS_PER_WARP):
                sq[k] = T.float32(0)
            # byte offsets of this thread's copies at K = 0: x rows past the end read the last
            # token (in bounds, never stored)
            for q in T.unroll(x_passes):
                x_at[q] = (T.min(t0 + tid // x_chunks + q * x_rows, num_tokens - 1) * chunks * CHUNK
                           + (tid % x_chunks) * 8) * 2
            for q in T.unroll(w_passes):
                w_at[q] = (T.Cast("int64", tid // w_chunks + q * w_rows) * chunks * CHUNK + wc * 4) * 4
            x_i = 0
            x_g = place * phases
            c_i = 0
            phase = 0

            # prologue: steps 0 .. STAGES - 2 in flight (phase-major: chunk = i * 8 + g)
            for s in T.unroll(STAGES - 1):
                if s < steps:
                    issue(xs, wr, nws, residual, mhc_fn, mhc_norm_weight, x_at, w_at, s,
                          x_i * GROUPS + x_g, tid)
                T.evaluate(T.call_extern("void", "tka_normfn_commit"))
                x_i += 1
                if x_i == steps_per_phase:
                    x_i = 0
                    x_g += 1

            for s in T.serial(steps):
                T.evaluate(T.call_extern("void", "tka_normfn_wait"))  # this thread's copies of step s landed
                # this thread's W pieces of step s -> hi / lo bf16 into B buffer s % 2 (last read
                # by step s - 2's MMA, finished before step s - 1's barrier)
                if has_weight != 0:
                    for e in T.vectorized(PIECE):
                        nv[e] = nws[s % STAGES, tid // WARP, wc * 4 + e]
                for q in T.unroll(w_passes):
                    for e in T.vectorized(PIECE):
                        wv[e] = wr[s % STAGES, tid // w_chunks + q * w_rows, wc * 4 + e]
                    if has_weight != 0:
                        for e in T.unroll(PIECE):
                            wv[e] = T.ieee_mul(wv[e], nv[e])
                    for e in T.unroll(PIECE):
                        hv[e] = _tf32_bits(wv[e])
                        # hi: the top 16 bits; lo = w - hi exactly (3 significant bits; +0 when
                        # w is infinite or NaN, so hi alone carries it)
                        hb[e] = T.reinterpret(T.Cast("uint16", hv[e] >> T.uint32(16)), T.bfloat16)
                        v = T.reinterpret(hv[e], T.float32) - T.reinterpret(hv[e] & T.uint32(0xFFFF0000), T.float32)
                        lb[e] = T.reinterpret(T.Cast("uint16", T.if_then_else(
                            (hv[e] & T.uint32(0x7F800000)) == T.uint32(0x7F800000), T.uint32(0),
                            T.reinterpret(v, T.uint32) >> T.uint32(16))), T.bfloat16)
                    for e in T.vectorized(PIECE):
                        wb[s % 2, tid // w_chunks + q * w_rows, wc * 4 + e] = hb[e]
                    for e in T.vectorized(PIECE):
                        wb[s % 2, m3 + tid // w_chunks + q * w_rows, wc * 4 + e] = lb[e]
                # (wgmma only: this thread's shared writes visible to the async proxy); then
                # everyone's x copies and B pieces are in, and everyone is done with step s - 1
                # (its ring slot, its ldmatrix reads of B buffer (s - 1) % 2, the last phase
                # end's reads of dump)
                if wgmma:
                    T.evaluate(T.call_extern("void", "tka_normfn_proxy_fence"))
                T.sync_threads()
                if s + STAGES - 1 < steps:
                    # into the slot step s - 1 used
                    issue(xs, wr, nws, residual, mhc_fn, mhc_norm_weight, x_at, w_at, (s + STAGES - 1) % STAGES,
                          x_i * GROUPS + x_g, tid)
                T.evaluate(T.call_extern("void", "tka_normfn_commit"))
                x_i += 1
                if x_i == steps_per_phase:
                    x_i = 0
                    x_g += 1

                T.gemm(xs[s % STAGES, :, :], wb[s % 2, :, :], acc, transpose_B=True)

                # squares of lane a of tokens warp * 8 + k, in e order
                for k in T.unroll(TOKENS_PER_WARP):
                    for e in T.vectorized(PIECE):
                        xv[e] = xs[s % STAGES, warp * TOKENS_PER_WARP + k, a * PIECE + e]
                    for e in T.unroll(PIECE):
                        sq[k] = sq[k] + T.Cast("float32", xv[e]) * T.Cast("float32", xv[e])

                c_i += 1
                if c_i == steps_per_phase:
                    # end of a phase: the accumulator to shared memory (the previous phase end's
                    # reads of dump finished before this step's barrier), each output's hi + lo
                    # and each token's lane-group butterfly as this phase's partials
                    c_i = 0
                    T.copy(acc, dump)
                    T.clear(acc)
                    for k in T.unroll(TOKENS_PER_WARP):
                        v = sq[k]
                        for m in T.unroll(5):
                            v = v + T.shfl_xor(v, 16 >> m)
                        if a == 0:
                            res_sq[phase * TOKENS + warp * TOKENS_PER_WARP + k] = v
                        sq[k] = T.float32(0)
                    T.sync_threads()
                    # output tid + q * THREADS: this phase's hi + lo into the phase tree
                    # ((p0 + p1) + (p2 + p3)) + ... of the block's phases, kept in registers:
                    # at bit b of the local phase clear the sum so far waits at level b, set it
                    # is added to the right of level b's; the last phase's sum goes to res
                    for q in T.unroll(outs_per_thread):
                        v = (dump[(tid + q * THREADS) // m3, (tid + q * THREADS) % m3]
                             + dump[(tid + q * THREADS) // m3, m3 + (tid + q * THREADS) % m3])
                        if levels == 0:
                            res[tid + q * THREADS] = v
                        else:
                            if phase % 2 == 0:
                                stack[0, q] = v
                            else:
                                v = stack[0, q] + v
                                if levels == 1:
                                    res[tid + q * THREADS] = v
                                else:
                                    if (phase // 2) % 2 == 0:
                                        stack[1, q] = v
                                    else:
                                        v = stack[1, q] + v
                                        if levels == 2:
                                            res[tid + q * THREADS] = v
                                        else:
                                            if (phase // 4) % 2 == 0:
                                                stack[2, q] = v
                                            else:
                                                res[tid + q * THREADS] = stack[2, q] + v
                    phase += 1

            # the 8 phases' partials of each output, pairwise: each block's res holds the sum of
            # its aligned subtree (phases rank * phases ..), so the cluster's blocks meet
            # pairwise in rank order; the square sums meet in the same tree from res_sq.  In a
            # cluster every block's res is read through distributed shared memory, each block
            # writing a share of the tile
            if cluster > 1:
                cluster_sync()
            else:
                T.sync_threads()
            share = TOKENS * m3 // cluster
            if splits == 1:
                for q in T.unroll((share + THREADS - 1) // THREADS):
                    if tid + q * THREADS < share:
                        tt = (rank * share + tid + q * THREADS) // m3
                        j = (rank * share + tid + q * THREADS) % m3
                        total = _ranks_tree(res, tt * m3 + j, cluster)
                        ssum = _groups_tree(res_sq, TOKENS, phases, tt, cluster > 1)
                        if t0 + tt < num_tokens:
                            out[t0 + tt, j] = T.ieee_mul(total, T.rsqrt(T.ieee_add(T.ieee_fdiv(ssum, features), eps)))
            else:
                # the split's record: (tile * splits + split) * record floats in
                base = (T.Cast("int64", bid // tile_blocks) * splits + (bid // cluster) % splits) * record
                if combine == 0:
                    # the cluster's subtree sums (its phases' aligned subtree of the 8) and square
                    # sums, for every token of the tile (rows past the end too: never read into out)
                    for q in T.unroll((share + THREADS - 1) // THREADS):
                        if tid + q * THREADS < share:
                            tt = (rank * share + tid + q * THREADS) // m3
                            j = (rank * share + tid + q * THREADS) % m3
                            partials[base + tt * m3 + j] = _ranks_tree(res, tt * m3 + j, cluster)
                            if j == 0:
                                partials[base + TOKENS * m3 + tt] = _groups_tree(res_sq, TOKENS, phases, tt, cluster > 1,
                                                                                 cluster * phases)
                else:
                    # the two splits' subtrees meet (the root of the tree): 1 / tile_blocks of the
                    # tile's outputs per block
                    first = T.Cast("int64", bid // tile_blocks) * (splits * record)
                    part = TOKENS * m3 // tile_blocks
                    for q in T.unroll((part + THREADS - 1) // THREADS):
                        if tid + q * THREADS < part:
                            tt = (place * part + tid + q * THREADS) // m3
                            j = (place * part + tid + q * THREADS) % m3
                            total = partials[first + tt * m3 + j] + partials[first + record + tt * m3 + j]
                            ssum = (partials[first + TOKENS * m3 + tt]
                                    + partials[first + record + TOKENS * m3 + tt])
                            if t0 + tt < num_tokens:
                                out[t0 + tt, j] = T.ieee_mul(total, T.rsqrt(T.ieee_add(T.ieee_fdiv(ssum, features), eps)))
            if cluster > 1:
                cluster_sync()  # no block exits while another may read its res

    return mhc_pre_norm_fn
