"""engram.engram_gate_bwd: the Engram gate backward from the forward's saved intermediates.

``grad_out`` (g), ``hidden_states`` (x) bf16 [T, 4, H] (contiguous), ``k`` bf16 [T, 4, H]
(unit last stride, strides multiples of 8), ``v`` bf16 [T, H] (row stride a multiple of 8),
``weight_fused`` (w) fp32 [4, H], ``dot``, ``gate_score``, ``rstd_x``, ``rstd_k`` fp32 [T, 4]
-> ``grad_hidden_states``, ``grad_k`` bf16 [T, 4, H], ``grad_v`` bf16 [T, H],
``grad_w_partial`` fp32 [P, 4, H].  Per token and stream, every product and sum rounded on
its own (no FMA), in the reference's order (``tile_kernels_aot.torch.engram``):

    dl   = sum_d g * v                    (128 lanes: ``_lane_sum(..., BWD_LANES)``)
    r    = 0 if ((|dot| * s) * rstd_x) * rstd_k < clamp
           else (((dl * gate) * (1 - gate)) * 0.5) * sqrt(((s * rstd_x) * rstd_k) / |dot|)
    grad_x = g + r * (k * w - x * (((dot * rstd_x) * rstd_x) / H))
    grad_k =     r * (x * w - k * (((dot * rstd_k) * rstd_k) / H))
    grad_v = ((g0 * gate0 + g1 * gate1) + g2 * gate2) + g3 * gate3
    grad_w_partial[p] = (0 + t_first) + ... + t_last,   t = (r * x) * k, over token chunk p

Two kernels per H (the static key ``small_batch``): the host takes the small-batch kernel when
no chunk holds more than one token (``T <= P``), the persistent kernel otherwise.  Both give
lane ``l`` of a stream the pieces ``j * 128 + l`` and use the summation orders above.

Persistent kernel
-----------------
``P`` blocks (the device's SM count: one per SM), block ``p`` walks its chunk of
``ceil(T / P)`` tokens in order, so that each column's weight-gradient sum is one chain in a
register of the thread that owns the column.  512 threads: warps ``4c .. 4c+3`` own stream
``c``; lane ``l`` of the stream owns the 16-byte pieces ``j * 128 + l`` (``j < H / 1024``) of
the stream's rows, ``8 * H / 1024`` weight-gradient accumulators.  A token's g, x and k rows
and its v row (``26 * H`` bytes: 182 KB at H 7168) sit in shared memory, filled by ``cp.async``
(each thread copies its own pieces of g, x and k, and a share of v) in the order the token
uses them: one group with g and v, then one group per piece with x and k.  Per token:

1. wait for the token's g and v group (its ``steps`` x/k groups may still be in flight),
   barrier;
2. ``dl`` partial sums (own g pieces, v) in the reference's order, and the thread's share of
   ``grad_v`` (the four streams' g of its pieces, in stream order); warp butterfly, warp sums
   to shared memory, barrier, the stream's sum ``(w0 + w1) + (w2 + w3)``, ``r``;
3. the thread copies its share of the next token's v row (retired by the barrier of step 2);
   per piece ``j``: w of the piece from shared memory for the resident steps (``resident_steps``:
   as many steps' w as fit beside a token, copied once by each thread, its own pieces, in its
   first group), else from registers, loaded from global (L2) at the previous such piece (the
   first before the barrier of step 2); wait for the piece's x/k
   group, x, k, g from shared memory, ``grad_x``, ``grad_k`` (16-byte stores), the
   weight-gradient terms; the piece's g slot then takes the next token's piece.  After the
   loop the next token's g and v close one group, and its x and k pieces follow, one group
   per piece.

So the next token's g and v are in flight during step 3 and its x and k from the end of step
3, through the next token's steps 1 and 2 and into its step 3, which starts on its first
piece while the later ones land: the SM always has loads in flight.

Every shared slot of g, x and k is read back by the thread that filled it, except g in
``grad_v`` and v in step 2, which the barrier of step 1 makes visible and the barrier of step
2 retires before any thread copies over them.

Small-batch kernel
------------------
``P x 4`` blocks of 128 threads (four blocks per SM: at most 128 registers, ``8 * H - 2 KB`` of
shared memory), block ``(p, c)`` stream ``c`` of token ``p`` (none past the last token: the
block writes its ``grad_w_partial[p, c]`` row of zeros).  Thread ``l`` is lane ``l`` of the
stream (the same pieces ``j * 128 + l`` as in the persistent kernel, the same four warps of
``_lane_sum``); every slot of shared memory is read back by the thread that copied it, so the
only barrier is the one of the warp sums.  Each thread issues all its loads at the start, in
the order the token uses them: the saved values; the four streams' g of its ``grad_v`` pieces
(the block's quarter of the columns, ``H / 32`` pieces, into registers); the stream's g and v
piece by piece (one group per piece; v's last piece into registers, which keeps a block 2 KB
under a quarter of the SM); x and k piece by piece (one group per piece), each piece followed
by its w (L2, into registers: ``8 * H / 1024`` floats).  A warp fence (``__syncwarp``, a NOP in
the SASS that ptxas schedules around) after each load of registers keeps ptxas from sinking it
behind the copies that follow.  The clamp test, ``sqrt(c / |dot|)`` and the two normalisation
terms need only the saved values.  Then:

1. ``grad_v`` of the thread's pieces of the quarter (the four streams in order);
2. per piece ``j`` as it lands (the thread's own group): the piece's ``dl`` terms;
3. warp butterfly, warp sums (lane 0 of each warp into its own, already read, v slot of piece
   0), barrier, ``(w0 + w1) + (w2 + w3)``, ``r``;
4. per piece as its x and k land: ``grad_x``, ``grad_k`` and the weight-gradient terms
   ``0 + (r * x) * k`` (the sum of the chunk's one token), stored at once.

The rows are held as 32-bit words of two bf16 (a value is one shift or mask).

Tokens, P and strides are run-time values; ``hc_mult`` (4) and ``H`` are static.  Element
offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl import cp_async

WARP = 32
PIECE = 8  # bf16 elements per 16-byte access
LANES = 128  # threads per stream (the reference's BWD_LANES)
HC = 4
THREADS = HC * LANES
SPAN = LANES * PIECE
WORDS = PIECE // 2  # 32-bit words of two bf16 per piece (small-batch kernel)
SMEM_LIMIT = 227 * 1024  # shared memory one block may have (sm_90, sm_100)
W_STEP_BYTES = HC * LANES * PIECE * 4  # w of one step (all four streams), float32
SMALL_BATCH_BLOCKS_PER_SM = HC  # small-batch kernel: a token's four blocks per SM's share
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                # shared memory is written by cp.async (unseen by TileLang): the barriers are
                # placed by hand (see the docstring)
                "tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                # every access is in bounds (tokens < num_tokens, pieces < H / 8): no guards
                "tl.disable_safe_memory_legalize": True}

# Small-batch kernel: the warp-level fence that keeps ptxas from sinking loads of registers below
# later copies.
SMALL_BATCH_SOURCE = r"""
__device__ __forceinline__ void tka_issue_fence() { __syncwarp(); }
"""


def _f32(value):
    return T.cast(value, T.float32)


def _token_smem_bytes(hidden):
    """g, x, k (4 rows each) and v (one row) of a token, bf16, and the warp sums."""
    return 2 * (3 * HC + 1) * hidden + 4 * (THREADS // WARP)


def resident_steps(hidden):
    """The steps whose w stays in shared memory for the whole kernel: as many as fit beside a
    token's rows, spread over the steps (step ``floor(i * steps / m)``, ``i < m``)."""
    steps = hidden // SPAN
    m = min(steps, (SMEM_LIMIT - _token_smem_bytes(hidden)) // W_STEP_BYTES)
    return [(i * steps) // m for i in range(m)]  # distinct: steps // m >= 1


def _any_equal(j, values):
    """``j == v`` for some ``v`` in ``values`` (a TIR condition; folds once ``j`` is unrolled)."""
    cond = T.bool(False)
    for value in values:
        cond = T.Or(cond, j == value)
    return cond


def _lookup(j, table, default=0):
    """``table[j]`` for a step ``j`` (a TIR expression; folds once ``j`` is unrolled)."""
    expr = T.int32(default)
    for key, value in table.items():
        expr = T.Select(j == key, T.int32(value), expr)
    return expr


def _bf16(word, i):
    """Value ``i`` of a piece of bf16 held as 32-bit words, from its word (the even value in the
    low half), as float32: one shift or mask once ``i`` is unrolled."""
    return T.reinterpret((word << T.Cast(T.uint32, 16 - 16 * (i % 2))) & T.uint32(0xFFFF0000), T.float32)


def _issue_fence():
    T.evaluate(T.call_extern("void", "tka_issue_fence"))


# The backward's arithmetic, shared by both kernels (float32 expressions in the reference's
# order; the kernels differ in where their operands come from, not in how they combine them).
def _below_clamp(abs_dot, scalar, rx, rk, clamp_value):
    """The gate's clamp is active: ``|dot| * scalar * rstd_x * rstd_k < clamp_value``."""
    return T.ieee_mul(T.ieee_mul(T.ieee_mul(abs_dot, scalar), rx), rk) < clamp_value


def _slope(abs_dot, scalar, rx, rk):
    """``sqrt(scalar * rstd_x * rstd_k / |dot|)``, the square root's derivative factor."""
    return T.sqrt(T.ieee_fdiv(T.ieee_mul(T.ieee_mul(scalar, rx), rk), abs_dot))


def _norm_term(d, rstd, hidden):
    """``dot * rstd^2 / H``: the normalisation's share of a row's gradient."""
    return T.ieee_fdiv(T.ieee_mul(T.ieee_mul(d, rstd), rstd), T.float32(hidden))


def _r(dl, gate, below, slope):
    """dL/d(dot) from dL/dgate: zero under the clamp, else ``dl * gate * (1 - gate) * 0.5 * slope``."""
    return T.Select(below, T.float32(0), T.ieee_mul(T.ieee_mul(T.ieee_mul(T.ieee_mul(
        dl, gate), T.ieee_sub(T.float32(1), gate)), T.float32(0.5)), slope))


def _grad_x(g, x, k, w, r, dot_x):
    """One element of grad_x: ``g + r * (k * w - x * dot_x)``, rounded to bf16."""
    return T.cast(T.ieee_add(g, T.ieee_mul(r, T.ieee_sub(T.ieee_mul(k, w), T.ieee_mul(x, dot_x)))), T.bfloat16)


def _grad_k(x, k, w, r, dot_k):
    """One element of grad_k: ``r * (x * w - k * dot_k)``, rounded to bf16."""
    return T.cast(T.ieee_mul(r, T.ieee_sub(T.ieee_mul(x, w), T.ieee_mul(k, dot_k))), T.bfloat16)


def engram_gate_bwd_kernel(hc_mult, hidden, small_batch):
    assert hc_mult == HC, "the backward kernel is built for hc_mult == 4"
    assert hidden % SPAN == 0, "hidden must be a multiple of 1024"
    assert _token_smem_bytes(hidden) <= SMEM_LIMIT, "a token's rows must fit in shared memory"
    pieces = hidden // PIECE
    num_tokens = T.dynamic("num_tokens", "int64")
    num_blocks = T.dynamic("num_blocks", "int64")  # P
    k_stride_t = T.dynamic("k_stride_t", "int64")  # elements (multiples of 8)
    k_stride_c = T.dynamic("k_stride_c", "int64")
    v_stride_t = T.dynamic("v_stride_t", "int64")
    if small_batch:
        assert hidden >= 2 * SPAN, "the small-batch kernel keeps v's last step in registers: H >= 2048"
        body, source = _small_batch_body(hidden, num_tokens)
    else:
        body, source = _persistent_body(hidden, num_tokens, num_blocks)

    @T.prim_func
    def engram_gate_bwd(
        grad_out: T.Tensor[(num_tokens, HC, pieces, PIECE), T.bfloat16],
        hidden_states: T.Tensor[(num_tokens, HC, pieces, PIECE), T.bfloat16],
        k: T.StridedTensor[(num_tokens, HC, pieces, PIECE), (k_stride_t, k_stride_c, PIECE, 1), T.bfloat16],
        v: T.StridedTensor[(num_tokens, pieces, PIECE), (v_stride_t, PIECE, 1), T.bfloat16],
        weight_fused: T.Tensor[(HC, pieces, PIECE), T.float32],
        dot: T.Tensor[(num_tokens, HC), T.float32],
        gate_score: T.Tensor[(num_tokens, HC), T.float32],
        rstd_x: T.Tensor[(num_tokens, HC), T.float32],
        rstd_k: T.Tensor[(num_tokens, HC), T.float32],
        grad_x: T.Tensor[(num_tokens, HC, pieces, PIECE), T.bfloat16],
        grad_k: T.Tensor[(num_tokens, HC, pieces, PIECE), T.bfloat16],
        grad_v: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        grad_w_partial: T.Tensor[(num_blocks, HC, pieces, PIECE), T.float32],
        clamp_value: T.float32,
        scalar: T.float32,  # H ** -0.5 rounded to float32
    ):
        if small_batch:
            # P x 4 blocks of 128 threads, block (p, c) stream c of token p (module docstring)
            with T.Kernel(T.Cast("int32", num_blocks), HC, threads=LANES) as (bid, c):
                wait_for_previous_grid()  # programmatic dependent launch
                T.import_source(source)
                # 4 blocks per SM (P x 4 blocks in one wave): at most 128 registers a thread
                T.annotate_min_blocks_per_sm(SMALL_BATCH_BLOCKS_PER_SM)
                T.assume(k_stride_t % PIECE == 0)
                T.assume(k_stride_c % PIECE == 0)
                T.assume(v_stride_t % PIECE == 0)
                body(bid, c, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, grad_x,
                     grad_k, grad_v, grad_w_partial, clamp_value, scalar)
        else:
            with T.Kernel(T.Cast("int32", num_blocks), threads=THREADS) as bid:
                wait_for_previous_grid()  # programmatic dependent launch
                T.import_source(source)
                T.assume(k_stride_t % PIECE == 0)
                T.assume(k_stride_c % PIECE == 0)
                T.assume(v_stride_t % PIECE == 0)
                body(bid, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, grad_x, grad_k,
                     grad_v, grad_w_partial, clamp_value, scalar)

    return engram_gate_bwd


def _persistent_body(hidden, num_tokens, num_blocks):
    """The persistent kernel's body (module docstring) and its device source."""
    steps = hidden // SPAN
    pieces = hidden // PIECE
    share = -(-pieces // THREADS)  # grad_v pieces (and v pieces to copy) per thread
    resident = resident_steps(hidden)  # w of these steps from shared memory
    slot = {j: n for n, j in enumerate(resident)}
    num_res = len(resident)
    loaded = [j for j in range(steps) if j not in slot]  # w of these steps from global (L2)
    after = {j: loaded[n + 1] for n, j in enumerate(loaded[:-1])}  # the next loaded step
    assert _token_smem_bytes(hidden) + len(resident) * W_STEP_BYTES <= SMEM_LIMIT

    @T.macro
    def body(bid, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, grad_x, grad_k, grad_v,
             grad_w_partial, clamp_value, scalar):
        T.assume(num_blocks > 0)
        tid = T.get_thread_binding()
        c = tid // LANES
        lane = tid % LANES
        warp = tid // WARP

        g_s = T.alloc_shared((HC, pieces, PIECE), T.bfloat16)
        x_s = T.alloc_shared((HC, pieces, PIECE), T.bfloat16)
        k_s = T.alloc_shared((HC, pieces, PIECE), T.bfloat16)
        v_s = T.alloc_shared((pieces, PIECE), T.bfloat16)
        warp_sums = T.alloc_shared((THREADS // WARP,), T.float32)
        # w of the resident steps, each thread its own piece as two 16-byte halves (element
        # e of the piece at [.., e // 4, lane, e % 4]: a warp's 16-byte reads are contiguous)
        w_s = T.alloc_shared((HC, max(len(resident), 1), 2, LANES, 4), T.float32)
        gv = T.alloc_local((PIECE,), T.bfloat16)
        vv = T.alloc_local((PIECE,), T.bfloat16)
        xv = T.alloc_local((PIECE,), T.bfloat16)
        kv = T.alloc_local((PIECE,), T.bfloat16)
        wv = T.alloc_local((PIECE,), T.float32)
        wn = T.alloc_local((PIECE,), T.float32)  # w of the next piece, loaded a piece ahead
        ox = T.alloc_local((PIECE,), T.bfloat16)
        ok = T.alloc_local((PIECE,), T.bfloat16)
        acc_w = T.alloc_local((steps, PIECE), T.float32)
        gates = T.alloc_local((HC,), T.float32)
        gq = T.alloc_local((HC, PIECE), T.bfloat16)
        dl = T.alloc_var(T.float32)
        r = T.alloc_var(T.float32)
        d_c = T.alloc_var(T.float32)
        gate_c = T.alloc_var(T.float32)
        rx = T.alloc_var(T.float32)
        rk = T.alloc_var(T.float32)
        dot_x = T.alloc_var(T.float32)
        dot_k = T.alloc_var(T.float32)
        gsum = T.alloc_var(T.float32)

        per_block = T.ceildiv(num_tokens, num_blocks)
        t_start = T.min(T.Cast("int64", bid) * per_block, num_tokens)
        t_end = T.min(t_start + per_block, num_tokens)

        for j in T.unroll(steps):
            for i in T.unroll(PIECE):
                acc_w[j, i] = T.float32(0)

        # ---- the chunk's first token in flight: g and v (one group), then x and k piece by piece
        # (one group per piece), the order in which the token uses them
        if t_start < t_end:
            # the resident steps' w (the thread's own pieces; landed by the first token's step 1)
            for n in T.unroll(num_res):
                for half in T.unroll(2):
                    T.evaluate(cp_async.copy16(w_s[c, n, half, lane, 0],
                                               weight_fused[c, (n * steps) // num_res * LANES + lane, half * 4]))
            for j in T.unroll(steps):
                T.evaluate(cp_async.copy16(g_s[c, j * LANES + lane, 0], grad_out[t_start, c, j * LANES + lane, 0]))
            for m in T.unroll(share):
                if m * THREADS + tid < pieces:
                    T.evaluate(cp_async.copy16(v_s[m * THREADS + tid, 0], v[t_start, m * THREADS + tid, 0]))
        cp_async.commit()
        for j in T.unroll(steps):
            if t_start < t_end:
                T.evaluate(cp_async.copy16(x_s[c, j * LANES + lane, 0], hidden_states[t_start, c, j * LANES + lane, 0]))
                T.evaluate(cp_async.copy16(k_s[c, j * LANES + lane, 0], k[t_start, c, j * LANES + lane, 0]))
            cp_async.commit()

        for t in T.serial(t_start, t_end):
            # the token's saved values (their latency overlaps the wait)
            d_c = dot[t, c]
            gate_c = gate_score[t, c]
            rx = rstd_x[t, c]
            rk = rstd_k[t, c]
            for h in T.unroll(HC):
                gates[h] = gate_score[t, h]
            # ---- 1. the token's g and v have landed (each thread its copies; the barrier: all);
            # the token's x and k pieces (the last `steps` groups) may still be in flight
            cp_async.wait(steps)
            T.sync_threads()
            # ---- 2. dL/dgate partial sums; grad_v = sum over streams of g * gate, in stream order
            dl = T.float32(0)
            for j in T.unroll(steps):
                for i in T.vectorized(PIECE):
                    gv[i] = g_s[c, j * LANES + lane, i]
                for i in T.vectorized(PIECE):
                    vv[i] = v_s[j * LANES + lane, i]
                for i in T.unroll(PIECE):
                    dl = dl + T.ieee_mul(_f32(gv[i]), _f32(vv[i]))
            for m in T.unroll(share):
                if m * THREADS + tid < pieces:
                    for h in T.unroll(HC):
                        for i in T.vectorized(PIECE):
                            gq[h, i] = g_s[h, m * THREADS + tid, i]
                    for i in T.unroll(PIECE):
                        gsum = T.ieee_mul(_f32(gq[0, i]), gates[0])
                        for h in T.unroll(1, HC):
                            gsum = gsum + T.ieee_mul(_f32(gq[h, i]), gates[h])
                        ox[i] = T.cast(gsum, T.bfloat16)
                    for i in T.vectorized(PIECE):
                        grad_v[t, m * THREADS + tid, i] = ox[i]
            # the stream's sum: warp butterfly, then (w0 + w1) + (w2 + w3)
            for s in T.unroll(5):
                dl = dl + T.shfl_xor(dl, 16 >> s)
            if tid % WARP == 0:
                warp_sums[warp] = dl
            # w of step 3's first loaded piece: its L2 latency under the barrier
            if len(loaded) > 0:
                for i in T.vectorized(PIECE):
                    wn[i] = weight_fused[c, loaded[0] * LANES + lane, i]
            # every read of v and of other threads' g for this token is done past this barrier
            T.sync_threads()
            dl = ((warp_sums[c * 4] + warp_sums[c * 4 + 1]) + (warp_sums[c * 4 + 2] + warp_sums[c * 4 + 3]))
            abs_dot = T.abs(d_c)
            below = _below_clamp(abs_dot, scalar, rx, rk, clamp_value)
            slope = _slope(abs_dot, scalar, rx, rk)
            r = _r(dl, gate_c, below, slope)
            dot_x = _norm_term(d_c, rx, hidden)
            dot_k = _norm_term(d_c, rk, hidden)
            # ---- 3. the next token's v share (its slots retired by the barrier above); then per
            # piece: grad_x, grad_k, weight-gradient terms, and the freed g slot takes the next
            # token's piece.  Past the loop: the next token's g and v close one group, and its x
            # and k pieces follow, one group per piece.
            if t + 1 < t_end:
                for m in T.unroll(share):
                    if m * THREADS + tid < pieces:
                        T.evaluate(cp_async.copy16(v_s[m * THREADS + tid, 0], v[t + 1, m * THREADS + tid, 0]))
            for j in T.unroll(steps):
                p = j * LANES + lane
                if _any_equal(j, resident):  # resident: from shared memory
                    for half in T.unroll(2):
                        for i in T.vectorized(4):
                            wv[half * 4 + i] = w_s[c, _lookup(j, slot), half, lane, i]
                else:  # loaded a loaded piece ahead; the next loaded piece's w goes out now
                    for i in T.vectorized(PIECE):
                        wv[i] = wn[i]
                    if _any_equal(j, list(after)):
                        for i in T.vectorized(PIECE):
                            wn[i] = weight_fused[c, _lookup(j, after) * LANES + lane, i]
                # the piece's x and k have landed: the groups of pieces j + 1 .. steps - 1 may not
                cp_async.wait(steps - 1 - j)
                for i in T.vectorized(PIECE):
                    xv[i] = x_s[c, p, i]
                for i in T.vectorized(PIECE):
                    kv[i] = k_s[c, p, i]
                for i in T.vectorized(PIECE):
                    gv[i] = g_s[c, p, i]
                if t + 1 < t_end:
                    T.evaluate(cp_async.copy16(g_s[c, p, 0], grad_out[t + 1, c, p, 0]))
                for i in T.unroll(PIECE):
                    xf = _f32(xv[i])
                    kf = _f32(kv[i])
                    ox[i] = _grad_x(_f32(gv[i]), xf, kf, wv[i], r, dot_x)
                    ok[i] = _grad_k(xf, kf, wv[i], r, dot_k)
                    acc_w[j, i] = acc_w[j, i] + T.ieee_mul(T.ieee_mul(r, xf), kf)
                for i in T.vectorized(PIECE):
                    grad_x[t, c, p, i] = ox[i]
                for i in T.vectorized(PIECE):
                    grad_k[t, c, p, i] = ok[i]
            cp_async.commit()
            for j in T.unroll(steps):
                if t + 1 < t_end:
                    T.evaluate(cp_async.copy16(x_s[c, j * LANES + lane, 0], hidden_states[t + 1, c, j * LANES + lane, 0]))
                    T.evaluate(cp_async.copy16(k_s[c, j * LANES + lane, 0], k[t + 1, c, j * LANES + lane, 0]))
                cp_async.commit()

        # ---- the chunk's weight-gradient sums (zeros for an empty chunk)
        for j in T.unroll(steps):
            for i in T.vectorized(PIECE):
                grad_w_partial[bid, c, j * LANES + lane, i] = acc_w[j, i]

    return body, cp_async.DEVICE_SOURCE


def _small_batch_body(hidden, num_tokens):
    """The small-batch kernel's body (module docstring) and its device source."""
    steps = hidden // SPAN
    pieces = hidden // PIECE
    quarter = pieces // HC  # grad_v pieces of a block: H / 4 columns
    share = -(-quarter // LANES)  # grad_v pieces per thread (the last partly idle)

    @T.macro
    def body(bid, c, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, grad_x, grad_k,
             grad_v, grad_w_partial, clamp_value, scalar):
        lane = T.get_thread_binding()
        warp = lane // WARP
        t = T.Cast("int64", bid)  # the chunk's one token, if any (the host: T <= P)

        # the stream's g, x and k rows and the v row but its last step as words of two bf16, each
        # slot read back only by the thread that copied it (the warp sums alias the v slots of
        # piece 0 of lanes 0, 32, 64, 96); the last step of v goes to registers (vl), which keeps
        # a block 2 KB under a quarter of the SM's shared memory at H 7168
        rows_s = T.alloc_shared((3, pieces, WORDS), T.uint32)
        v_s = T.alloc_shared((pieces - LANES, WORDS), T.uint32)
        vl = T.alloc_local((PIECE,), T.bfloat16)
        gw = T.alloc_local((WORDS,), T.uint32)
        vw = T.alloc_local((WORDS,), T.uint32)
        xw = T.alloc_local((WORDS,), T.uint32)
        kw = T.alloc_local((WORDS,), T.uint32)
        gq = T.alloc_local((share, HC, PIECE), T.bfloat16)  # the four streams' g of the grad_v pieces
        wv = T.alloc_local((steps, PIECE), T.float32)  # w of every piece of the thread
        ov = T.alloc_local((share, PIECE), T.bfloat16)
        ox = T.alloc_local((PIECE,), T.bfloat16)
        ok = T.alloc_local((PIECE,), T.bfloat16)
        ow = T.alloc_local((PIECE,), T.float32)
        gates = T.alloc_local((HC,), T.float32)
        below = T.alloc_var(T.bool)
        slope = T.alloc_var(T.float32)
        dot_x = T.alloc_var(T.float32)
        dot_k = T.alloc_var(T.float32)
        dl = T.alloc_var(T.float32)
        r = T.alloc_var(T.float32)
        gsum = T.alloc_var(T.float32)

        if t < num_tokens:
            # ---- every load at once: the saved values; the four streams' g of the thread's grad_v
            # pieces (registers); g and v of the stream, one group per piece; x and k, one group
            # per piece, each followed by the piece's w (registers).  The fences keep each load of
            # registers where it stands (ptxas would move them behind the copies).
            for h in T.unroll(HC):
                gates[h] = gate_score[t, h]
            d_c = dot[t, c]
            gate_c = gate_score[t, c]
            rx = rstd_x[t, c]
            rk = rstd_k[t, c]
            for m in T.unroll(share):
                if m * LANES + lane < quarter:
                    for h in T.unroll(HC):
                        for i in T.vectorized(PIECE):
                            gq[m, h, i] = grad_out[t, h, c * quarter + m * LANES + lane, i]
            _issue_fence()
            for j in T.unroll(steps):
                T.evaluate(cp_async.copy16(rows_s[0, j * LANES + lane, 0], grad_out[t, c, j * LANES + lane, 0]))
                if j < steps - 1:
                    T.evaluate(cp_async.copy16(v_s[j * LANES + lane, 0], v[t, j * LANES + lane, 0]))
                else:
                    for i in T.vectorized(PIECE):
                        vl[i] = v[t, j * LANES + lane, i]
                    _issue_fence()
                cp_async.commit()
            for j in T.unroll(steps):
                T.evaluate(cp_async.copy16(rows_s[1, j * LANES + lane, 0], hidden_states[t, c, j * LANES + lane, 0]))
                T.evaluate(cp_async.copy16(rows_s[2, j * LANES + lane, 0], k[t, c, j * LANES + lane, 0]))
                cp_async.commit()
                for i in T.vectorized(PIECE):
                    wv[j, i] = weight_fused[c, j * LANES + lane, i]
                _issue_fence()
            # what r needs besides dL/dgate, and the normalisation terms: saved values only
            abs_dot = T.abs(d_c)
            below = _below_clamp(abs_dot, scalar, rx, rk, clamp_value)
            slope = _slope(abs_dot, scalar, rx, rk)
            dot_x = _norm_term(d_c, rx, hidden)
            dot_k = _norm_term(d_c, rk, hidden)
            # ---- grad_v of the block's quarter of the columns, in stream order
            for m in T.unroll(share):
                if m * LANES + lane < quarter:
                    for i in T.unroll(PIECE):
                        gsum = T.ieee_mul(_f32(gq[m, 0, i]), gates[0])
                        for h in T.unroll(1, HC):
                            gsum = gsum + T.ieee_mul(_f32(gq[m, h, i]), gates[h])
                        ov[m, i] = T.cast(gsum, T.bfloat16)
                    for i in T.vectorized(PIECE):
                        grad_v[t, c * quarter + m * LANES + lane, i] = ov[m, i]
            # ---- 1. dL/dgate terms per piece as it lands (the thread's own slots: no barrier)
            dl = T.float32(0)
            for j in T.unroll(steps):
                p = j * LANES + lane
                cp_async.wait(2 * steps - 1 - j)
                for i in T.vectorized(WORDS):
                    gw[i] = rows_s[0, p, i]
                if j < steps - 1:
                    for i in T.vectorized(WORDS):
                        vw[i] = v_s[p, i]
                    for i in T.unroll(PIECE):
                        dl = dl + T.ieee_mul(_bf16(gw[i // 2], i), _bf16(vw[i // 2], i))
                else:
                    for i in T.unroll(PIECE):
                        dl = dl + T.ieee_mul(_bf16(gw[i // 2], i), _f32(vl[i]))
            # ---- 2. the stream's sum: warp butterfly, warp sums (lane 0 of each warp into its own
            # v slot of piece 0, read above), barrier, (w0 + w1) + (w2 + w3); r
            for s in T.unroll(5):
                dl = dl + T.shfl_xor(dl, 16 >> s)
            if lane % WARP == 0:
                v_s[lane, 0] = T.reinterpret(dl, T.uint32)
            T.sync_threads()
            dl = ((T.reinterpret(v_s[0, 0], T.float32) + T.reinterpret(v_s[WARP, 0], T.float32))
                  + (T.reinterpret(v_s[2 * WARP, 0], T.float32) + T.reinterpret(v_s[3 * WARP, 0], T.float32)))
            r = _r(dl, gate_c, below, slope)
            # ---- 3. per piece as its x and k land (its w in registers): grad_x, grad_k and the
            # weight-gradient terms, the chunk's sum from zero (-0 becomes +0, as in the reference)
            for j in T.unroll(steps):
                p = j * LANES + lane
                cp_async.wait(steps - 1 - j)
                for i in T.vectorized(WORDS):
                    gw[i] = rows_s[0, p, i]
                for i in T.vectorized(WORDS):
                    xw[i] = rows_s[1, p, i]
                for i in T.vectorized(WORDS):
                    kw[i] = rows_s[2, p, i]
                for i in T.unroll(PIECE):
                    xf = _bf16(xw[i // 2], i)
                    kf = _bf16(kw[i // 2], i)
                    ox[i] = _grad_x(_bf16(gw[i // 2], i), xf, kf, wv[j, i], r, dot_x)
                    ok[i] = _grad_k(xf, kf, wv[j, i], r, dot_k)
                    ow[i] = T.ieee_add(T.float32(0), T.ieee_mul(T.ieee_mul(r, xf), kf))
                for i in T.vectorized(PIECE):
                    grad_x[t, c, p, i] = ox[i]
                for i in T.vectorized(PIECE):
                    grad_k[t, c, p, i] = ok[i]
                for i in T.vectorized(PIECE):
                    grad_w_partial[bid, c, p, i] = ow[i]
        else:  # an empty chunk
            for j in T.unroll(steps):
                for i in T.vectorized(PIECE):
                    grad_w_partial[bid, c, j * LANES + lane, i] = T.float32(0)

    return body, cp_async.DEVICE_SOURCE + SMALL_BATCH_SOURCE
