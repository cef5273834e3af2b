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
adds its terms in ``(i, e)`` order into a sum that starts at +0; the 32 lanes of a warp are
combined by a butterfly (``xor`` 16, 8, 4, 2, 1), the 8 warp sums as
``((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7))``.

Layout: one block per 8 tokens, 512 threads: threads ``h * 256 + l`` (``h`` = 0, 1) are lane
``l`` for the projection rows ``12 h .. 12 h + 11`` of the 8 tokens (96 accumulators each);
the ``h = 0`` half also sums the squares.  A lane reads 8 bytes of each token's row and
16 bytes of each of its projection rows per step (coalesced over the 256 lanes); the
projection is L2-resident (M3 * K * 4 bytes) and read once per 8 tokens.  K is a run-time
value (a multiple of 1024); ``mhc_mult`` is static.  Token offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

WARP = 32
LANES = 256  # lanes of the K order
PIECE = 4  # consecutive elements of K per lane and step
SPAN = LANES * PIECE  # K must be a multiple of this
TOKENS = 8  # tokens per block
HALVES = 2  # thread groups splitting the projection rows
THREADS = LANES * HALVES
WARPS = LANES // WARP  # warps per lane group
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def host_constants(mhc_mult):
    return {"span": SPAN, "tokens_per_block": TOKENS}


def _tf32(value):
    """Round a float32 to TF32 the way TileKernels does: +0x1000 on the bits, low 13 bits cleared."""
    bits = T.reinterpret(value, T.uint32)
    return T.reinterpret((bits + T.uint32(0x1000)) & T.uint32(0xFFFFE000), T.float32)


def mhc_pre_norm_fn_kernel(mhc_mult):
    m3 = mhc_mult * (mhc_mult + 2)
    assert m3 % HALVES == 0
    rows = m3 // HALVES  # projection rows per thread
    num_tokens = T.dynamic("num_tokens", "int64")
    pieces = T.dynamic("pieces")  # K / PIECE

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
        with T.Kernel(T.Cast("int32", T.ceildiv(num_tokens, TOKENS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces % LANES == 0)
            tid = T.get_thread_binding()
            half = tid // LANES
            lane = tid % LANES
            warp = lane // WARP
            t0 = T.Cast("int64", bid) * TOKENS

            dot_sums = T.alloc_shared((WARPS, TOKENS, m3), T.float32)
            sq_sums = T.alloc_shared((WARPS, TOKENS), T.float32)
            acc = T.alloc_local((TOKENS, rows), T.float32)
            sq = T.alloc_local((TOKENS,), T.float32)
            xv = T.alloc_local((TOKENS, PIECE), T.bfloat16)
            xf = T.alloc_local((TOKENS, PIECE), T.float32)
            nv = T.alloc_local((PIECE,), T.float32)
            wv = T.alloc_local((PIECE,), T.float32)
            total = T.alloc_var(T.float32)
            ssum = T.alloc_var(T.float32)

            for tt in T.unroll(TOKENS):
                sq[tt] = T.float32(0)
                for r in T.unroll(rows):
                    acc[tt, r] = T.float32(0)

            for i in T.serial(pieces // LANES):
                p = i * LANES + lane
                for tt in T.unroll(TOKENS):
                    # rows past the end read the last token (in bounds) and are never stored
                    for e in T.vectorized(PIECE):
                        xv[tt, e] = residual[T.min(t0 + tt, num_tokens - 1), p, e]
                for tt in T.unroll(TOKENS):
                    for e in T.unroll(PIECE):
                        xf[tt, e] = T.cast(xv[tt, e], T.float32)
                if half == 0:
                    for tt in T.unroll(TOKENS):
                        for e in T.unroll(PIECE):
                            sq[tt] = sq[tt] + xf[tt, e] * xf[tt, e]
                if has_weight != 0:
                    for e in T.vectorized(PIECE):
                        nv[e] = mhc_norm_weight[p, e]
                for r in T.unroll(rows):
                    for e in T.vectorized(PIECE):
                        wv[e] = mhc_fn[half * rows + r, p, e]
                    if has_weight != 0:
                        for e in T.unroll(PIECE):
                            wv[e] = T.ieee_mul(wv[e], nv[e])
                    for e in T.unroll(PIECE):
                        wv[e] = _tf32(wv[e])
                    for tt in T.unroll(TOKENS):
                        for e in T.unroll(PIECE):
                            acc[tt, r] = acc[tt, r] + xf[tt, e] * wv[e]

            # warp butterflies, then the warp sums through shared memory
            for tt in T.unroll(TOKENS):
                for r in T.unroll(rows):
                    for s in T.unroll(5):
                        acc[tt, r] = acc[tt, r] + T.shfl_xor(acc[tt, r], 16 >> s)
                    if lane % WARP == 0:
                        dot_sums[warp, tt, half * rows + r] = acc[tt, r]
                if half == 0:
                    for s in T.unroll(5):
                        sq[tt] = sq[tt] + T.shfl_xor(sq[tt], 16 >> s)
                    if lane % WARP == 0:
                        sq_sums[warp, tt] = sq[tt]
            T.sync_threads()
            if tid < TOKENS * m3:
                tt = tid // m3
                j = tid % m3
                total = ((dot_sums[0, tt, j] + dot_sums[1, tt, j]) + (dot_sums[2, tt, j] + dot_sums[3, tt, j])) + (
                    (dot_sums[4, tt, j] + dot_sums[5, tt, j]) + (dot_sums[6, tt, j] + dot_sums[7, tt, j]))
                ssum = ((sq_sums[0, tt] + sq_sums[1, tt]) + (sq_sums[2, tt] + sq_sums[3, tt])) + (
                    (sq_sums[4, tt] + sq_sums[5, tt]) + (sq_sums[6, tt] + sq_sums[7, tt]))
                if t0 + tt < num_tokens:
                    out[t0 + tt, j] = T.ieee_mul(total, T.rsqrt(T.ieee_add(T.ieee_fdiv(ssum, features), eps)))

    return mhc_pre_norm_fn
