"""engram.engram_gate_fwd: the Engram gate forward, ``out = x + gate * v``.

``hidden_states`` (x) bf16 [T, hc, H] (contiguous), ``k`` bf16 [T, hc, H] (unit last
stride, token and stream strides multiples of 8), ``v`` bf16 [T, H] (row stride a multiple
of 8), ``weight_fused`` (w) fp32 [hc, H] -> ``output`` bf16 [T, hc, H] and, when saving
for backward, ``dot``, ``gate_score``, ``rstd_x``, ``rstd_k`` fp32 [T, hc].  Per token and
stream, in float32 with every product and sum rounded on its own (no FMA):

    dot    = sum_d (x * w) * k            rstd_x = 1 / sqrt(sum_d x * x / H + eps)   (rstd_k alike)
    z      = ((dot * rstd_x) * rstd_k) * H**-0.5
    gate   = 1 / (expf(-copysign(sqrt(max(|z|, clamp)), z)) + 1)
    out    = bf16(x + gate * v)

The three sums follow the reference's order (``tile_kernels_aot.torch.engram._lane_sum``,
32 lanes): lane ``l`` adds the elements ``d = (j * 32 + l) * 8 + i`` in order of ``(j, i)``
from a zero, then the lanes combine as an XOR butterfly (16, 8, 4, 2, 1).

Two kernels per (hc_mult, H): the host takes the small-batch one for token counts up to twice
the SM count (two waves of one block per SM at H 7168), the persistent one above.

Persistent kernel
-----------------
A persistent grid of ``num_blocks`` blocks (the host's ``min(T, SMs * blocks_per_sm)``:
every block resident at once), ``hc`` warps per block, warp ``c`` owning stream ``c``; block
``b`` walks the tokens ``b, b + num_blocks, b + 2 * num_blocks, ...``.  Lane ``l`` owns the
16-byte pieces ``j * 32 + l`` of its rows (the reference's summation order) and only ever
reads shared-memory slots it filled itself with ``cp.async``, so the warps never meet at a
barrier and every wait is per thread.

Per warp, shared memory holds the x row of its stream (``2 * H`` bytes, kept for the output
pass) and a ring of ``RING`` slots of ``CHUNK`` pieces per lane (``RING * CHUNK * 512``
bytes).  A token is ``2 * stages`` stages of ``CHUNK`` steps (``stages = H / (256 * CHUNK)``):
the k stages (chunk ``i`` of x from the row, of k from the ring: the three sums, w from
global one stage ahead in registers) and then the v stages (chunk ``i`` of x and of v: the
output).  Every stage commits one copy group: when stage ``s`` is consumed, the copy of
stage ``s + RING`` goes into the slot it freed (k of this token, v of this token, or k of the
block's next token), so ``RING`` stages are always in flight and a wait for "all but the
newest ``RING - 1`` groups" finds stage ``s`` landed.  A v stage also frees its x chunk, which
takes the next token's x chunk in the same group: the next token's whole x row is in flight
while the output pass runs, and its first k chunks while the gate is computed.  Stage ``i`` of
the next token's x rides in the group of stage ``i + RING - stages <= i`` (``RING <= stages``),
so the k stage that reads it waits for it too.

``RING`` divides ``2 * stages``, so every stage's slot is static.  Shared memory is
``hc * (2 * H + RING * CHUNK * 512)`` bytes (72 KB at hc 4, H 7168: 3 blocks, 12 warps per SM;
each warp keeps up to 4 KB of k or v plus its x prefetch in flight).  Tokens, strides,
``num_blocks``, eps, clamp_value and save_for_backward (``saved_rows``: T or 0) are run-time
values; ``hc`` and ``H`` are static.  Element offsets are 64-bit.

Small-batch kernel
------------------
One block of ``SMALL_THREADS`` threads per token.  Warp ``c < hc_mult`` sums stream ``c`` with
the lane ownership above, but every copy of its rows is issued at once: x, k and w (fp32, in
two 16-byte halves so that a warp's reads are contiguous) of the whole row into shared memory
(``hc * H * 8`` bytes: 224 KB at hc 4, H 7168), committed as at most ``MAX_GROUPS`` groups of
consecutive steps, and each group is consumed as it lands.  Meanwhile every thread holds its
share of the v row in registers (its pieces ``tid + n * SMALL_THREADS``).  The sum warps put
their gates in shared memory; one barrier (after each sum warp has waited for all of its
copies) makes them and the x rows visible to the block, and all warps write the output, each
thread its v pieces for every stream.  So a token costs about one DRAM round trip plus its
bytes, not a round trip per ring stage.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.engram import cp_async

WARP = 32
PIECE = 8  # bf16 elements per 16-byte access
SPAN = WARP * PIECE  # elements of a row one warp covers per step
RING_PIECES = 8  # 16-byte pieces per lane in the k/v ring (4 KB per warp)
SMEM_PER_SM = 228 * 1024  # shared memory of one SM (sm_90, sm_100)
SMEM_PER_BLOCK = 227 * 1024  # the most one block may have
SMEM_RESERVED = 1024  # the driver's share per resident block
MAX_WARPS_PER_SM = 16  # register file: 128 registers per thread at 16 warps
# the small-batch kernel's block: the hc_mult sum warps, and 16 warps for the output pass
# (one block per SM: its shared memory holds a whole token at H 7168)
SMALL_THREADS = 512
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                # shared memory is written by cp.async (unseen by TileLang) and each lane reads only
                # the slots it filled itself (the small-batch kernel's one barrier is placed by hand)
                "tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                # TileLang's liveness cannot see the cp.async writes nor other warps' reads:
                # every shared buffer keeps its own region
                "tl.disable_shared_memory_reuse": True,
                # every access is in bounds (tokens < num_tokens, guarded prefetches): no guards
                "tl.disable_safe_memory_legalize": True}


def _layout(hidden):
    """(steps, chunk, stages, ring): ``chunk`` steps per stage, ``ring`` slots, ``ring``
    dividing ``2 * stages`` and at most ``stages``; the most ring pieces (up to
    RING_PIECES), then the larger chunk."""
    assert hidden % SPAN == 0, "hidden must be a multiple of 256"
    steps = hidden // SPAN
    best = None
    for chunk in (1, 2):
        if steps % chunk:
            continue
        stages = steps // chunk
        ring = max(r for r in range(1, min(stages, RING_PIECES // chunk) + 1) if (2 * stages) % r == 0)
        key = (ring * chunk, chunk)
        if best is None or key > best[0]:
            best = (key, (steps, chunk, stages, ring))
    return best[1]


def _smem_bytes(hc_mult, hidden):
    steps, chunk, _, ring = _layout(hidden)
    return hc_mult * (steps + ring * chunk) * WARP * PIECE * 2


def _small_smem_bytes(hc_mult, hidden):
    """x and k (bf16) and w (fp32) of a token's rows, and the gates."""
    return hc_mult * hidden * (2 + 2 + 4) + hc_mult * 4


def _blocks_per_sm(hc_mult, hidden):
    """Resident blocks per SM: by shared memory, at most MAX_WARPS_PER_SM warps (the kernel's
    ``__launch_bounds__`` holds ptxas to the registers this many blocks leave)."""
    per_block = _smem_bytes(hc_mult, hidden) + SMEM_RESERVED
    return max(1, min(SMEM_PER_SM // per_block, MAX_WARPS_PER_SM // hc_mult))


def host_constants(hc_mult, hidden, small_batch):
    """The persistent kernel's block and residency (its grid: ``min(T, SMs * blocks_per_sm)``);
    the small-batch kernel's grid is one block per token (one per SM at H 7168)."""
    if small_batch:
        return {"threads": SMALL_THREADS, "blocks_per_sm": 1}
    return {"threads": hc_mult * WARP, "blocks_per_sm": _blocks_per_sm(hc_mult, hidden)}


def _f32(value):
    return T.cast(value, T.float32)


@T.macro
def add_piece(acc, xv, kv, w):
    """One 16-byte piece's terms of the three sums ``acc = (dot, sum x * x, sum k * k)``, in
    order of its elements; ``w(e)`` is the piece's weight element ``e``."""
    for e in T.unroll(PIECE):
        xf = _f32(xv[e])
        kf = _f32(kv[e])
        acc[0] = acc[0] + T.ieee_mul(T.ieee_mul(xf, w(e)), kf)
        acc[1] = acc[1] + T.ieee_mul(xf, xf)
        acc[2] = acc[2] + T.ieee_mul(kf, kf)


@T.macro
def row_gate(acc, lane, t, c, saved, saved_rows, hidden, eps, clamp_value, scalar):
    """The lanes' sums combined (the reference's butterfly: XOR 16, 8, 4, 2, 1), then the
    row's gate, which every lane returns; lane 0 saves ``saved = (dot, gate_score, rstd_x,
    rstd_k)`` when ``saved_rows > 0`` (a uniform branch)."""
    for s in T.unroll(5):
        for n in T.unroll(3):
            acc[n] = acc[n] + T.shfl_xor(acc[n], 16 >> s)
    r_x = T.ieee_fdiv(T.float32(1), T.sqrt(T.ieee_add(T.ieee_fdiv(acc[1], T.float32(hidden)), eps)))
    r_k = T.ieee_fdiv(T.float32(1), T.sqrt(T.ieee_add(T.ieee_fdiv(acc[2], T.float32(hidden)), eps)))
    z = T.ieee_mul(T.ieee_mul(T.ieee_mul(acc[0], r_x), r_k), scalar)
    a = T.abs(z)
    a = T.Select(a < clamp_value, clamp_value, a)  # clamp_min; NaN stays NaN
    # -copysign is a sign flip (exact); expf, then 1 + e and 1 / d each rounded once
    gate = T.alloc_var(T.float32)  # a variable: computed once, not inlined at each use
    gate = T.ieee_fdiv(T.float32(1), T.ieee_add(T.exp(-T.copysign(T.sqrt(a), z)), T.float32(1)))
    if saved_rows > 0:
        if lane == 0:
            saved[0][t, c] = acc[0]
            saved[1][t, c] = gate
            saved[2][t, c] = r_x
            saved[3][t, c] = r_k
    return gate


@T.macro
def mix_piece(ov, xv, v, gate):
    """``ov = bf16(x + gate * v)`` of one piece; ``v(e)`` is its element ``e`` of v."""
    for e in T.unroll(PIECE):
        ov[e] = T.cast(T.ieee_add(_f32(xv[e]), T.ieee_mul(gate, _f32(v(e)))), T.bfloat16)


class _Tensors:
    """The kernels' tensor parameters (a fresh type per parameter) over the dynamic dims: the
    token count, k's and v's strides (elements, multiples of 8) and ``saved_rows`` (the token
    count when saving for backward, else 0: the saved tensors are not touched)."""

    def __init__(self, hc_mult, hidden):
        self.hc_mult = hc_mult
        self.pieces = hidden // PIECE
        self.num_tokens = T.dynamic("num_tokens", "int64")
        self.k_stride_t = T.dynamic("k_stride_t", "int64")
        self.k_stride_c = T.dynamic("k_stride_c", "int64")
        self.v_stride_t = T.dynamic("v_stride_t", "int64")
        self.saved_rows = T.dynamic("saved_rows", "int64")

    def rows(self):  # x and the output
        return T.Tensor[(self.num_tokens, self.hc_mult, self.pieces, PIECE), T.bfloat16]

    def k(self):
        return T.StridedTensor[(self.num_tokens, self.hc_mult, self.pieces, PIECE),
                               (self.k_stride_t, self.k_stride_c, PIECE, 1), T.bfloat16]

    def v(self):
        return T.StridedTensor[(self.num_tokens, self.pieces, PIECE), (self.v_stride_t, PIECE, 1), T.bfloat16]

    def w(self):
        return T.Tensor[(self.hc_mult, self.pieces, PIECE), T.float32]

    def saved(self):  # dot, gate_score, rstd_x, rstd_k
        return T.Tensor[(self.saved_rows, self.hc_mult), T.float32]


@T.macro
def assume_aligned(ts):
    """Rows start on 16-byte boundaries (checked by the host): each piece is one access."""
    T.assume(ts.k_stride_t % PIECE == 0)
    T.assume(ts.k_stride_c % PIECE == 0)
    T.assume(ts.v_stride_t % PIECE == 0)


def engram_gate_fwd_kernel(hc_mult, hidden, small_batch):
    return (_small_batch_kernel if small_batch else _persistent_kernel)(hc_mult, hidden)


def _persistent_kernel(hc_mult, hidden):
    steps, chunk, stages, ring = _layout(hidden)
    assert _smem_bytes(hc_mult, hidden) <= SMEM_PER_BLOCK, "a block's rows must fit in shared memory"
    assert ring <= cp_async.MAX_GROUPS
    threads = hc_mult * WARP
    blocks_per_sm = _blocks_per_sm(hc_mult, hidden)
    ts = _Tensors(hc_mult, hidden)

    @T.prim_func
    def engram_gate_fwd(
        hidden_states: ts.rows(),
        k: ts.k(),
        v: ts.v(),
        weight_fused: ts.w(),
        output: ts.rows(),
        dot: ts.saved(),
        gate_score: ts.saved(),
        rstd_x: ts.saved(),
        rstd_k: ts.saved(),
        eps: T.float32,
        clamp_value: T.float32,
        scalar: T.float32,  # H ** -0.5 rounded to float32
        num_blocks: T.int32,  # 1 <= num_blocks <= num_tokens (host)
    ):
        with T.Kernel(num_blocks, threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            # the persistent grid assumes blocks_per_sm resident blocks: registers to match
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            T.import_source(cp_async.DEVICE_SOURCE)
            assume_aligned(ts)
            T.assume(num_blocks > 0)
            tid = T.get_thread_binding()
            c = tid // WARP
            lane = tid % WARP
            b = T.Cast("int64", bid)

            x_s = T.alloc_shared((hc_mult, steps, WARP, PIECE), T.bfloat16)
            ring_s = T.alloc_shared((hc_mult, ring, chunk, WARP, PIECE), T.bfloat16)  # k, then v
            xv = T.alloc_local((PIECE,), T.bfloat16)
            kv = T.alloc_local((PIECE,), T.bfloat16)
            vv = T.alloc_local((PIECE,), T.bfloat16)
            ov = T.alloc_local((PIECE,), T.bfloat16)
            wv = T.alloc_local((2, chunk, PIECE), T.float32)  # w of this k stage and the next
            acc = T.alloc_local((3,), T.float32)  # dot, sum x * x, sum k * k

            # tokens b, b + num_blocks, ...: at least one (num_blocks <= num_tokens)
            blocks = T.Cast("int64", num_blocks)
            count = T.ceildiv(ts.num_tokens - b, blocks)

            # ---- the first token in flight: its whole x row and its first `ring` k stages
            # (group r < ring holds k stage r; the last one also x chunks ring-1 .. stages-1)
            for i in T.unroll(stages):
                for q in T.unroll(chunk):
                    p = (i * chunk + q) * WARP + lane
                    T.evaluate(cp_async.copy16(x_s[c, i * chunk + q, lane, 0], hidden_states[b, c, p, 0]))
                if i < ring:
                    for q in T.unroll(chunk):
                        p = (i * chunk + q) * WARP + lane
                        T.evaluate(cp_async.copy16(ring_s[c, i, q, lane, 0], k[b, c, p, 0]))
                if i < ring - 1 or i == stages - 1:
                    cp_async.commit()
            # w of k stage 0 (w does not depend on the token)
            for q in T.unroll(chunk):
                for e in T.vectorized(PIECE):
                    wv[0, q, e] = weight_fused[c, q * WARP + lane, e]

            for it in T.serial(count):
                t = b + it * blocks
                has_next = it + 1 < count
                tn = t + blocks

                for n in T.unroll(3):
                    acc[n] = T.float32(0)
                # ---- k stages: the three sums in the reference's order
                for i in T.unroll(stages):
                    if i + 1 < stages:  # w of the next k stage, in flight during this one
                        for q in T.unroll(chunk):
                            for e in T.vectorized(PIECE):
                                wv[(i + 1) % 2, q, e] = weight_fused[c, ((i + 1) * chunk + q) * WARP + lane, e]
                    cp_async.wait(ring - 1)  # this stage's group (and every older one) landed
                    for q in T.unroll(chunk):
                        for e in T.vectorized(PIECE):
                            xv[e] = x_s[c, i * chunk + q, lane, e]
                        for e in T.vectorized(PIECE):
                            kv[e] = ring_s[c, i % ring, q, lane, e]
                        add_piece(acc, xv, kv, lambda e: wv[i % 2, q, e])
                    # the freed slot takes stage i + ring: a later k stage or a v stage of this token
                    if i + ring < stages:
                        for q in T.unroll(chunk):
                            p = ((i + ring) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[c, i % ring, q, lane, 0], k[t, c, p, 0]))
                    else:
                        for q in T.unroll(chunk):
                            p = ((i + ring - stages) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[c, i % ring, q, lane, 0], v[t, p, 0]))
                    cp_async.commit()
                gate = row_gate(acc, lane, t, c, (dot, gate_score, rstd_x, rstd_k), ts.saved_rows, hidden, eps,
                                clamp_value, scalar)
                # w of the next token's k stage 0, in flight during the output pass
                for q in T.unroll(chunk):
                    for e in T.vectorized(PIECE):
                        wv[0, q, e] = weight_fused[c, q * WARP + lane, e]

                # ---- v stages: out = x + gate * v
                for m in T.unroll(stages):
                    cp_async.wait(ring - 1)
                    for q in T.unroll(chunk):
                        p = (m * chunk + q) * WARP + lane
                        for e in T.vectorized(PIECE):
                            xv[e] = x_s[c, m * chunk + q, lane, e]
                        for e in T.vectorized(PIECE):
                            vv[e] = ring_s[c, (stages + m) % ring, q, lane, e]
                        mix_piece(ov, xv, lambda e: vv[e], gate)
                        for e in T.vectorized(PIECE):
                            output[t, c, p, e] = ov[e]
                    # the freed ring slot takes stage m + ring (a v stage of this token or a k
                    # stage of the next); the freed x chunk takes the next token's chunk m
                    if m + ring < stages:
                        for q in T.unroll(chunk):
                            p = ((m + ring) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[c, (stages + m) % ring, q, lane, 0], v[t, p, 0]))
                    if has_next:
                        if m + ring >= stages:
                            for q in T.unroll(chunk):
                                p = ((m + ring - stages) * chunk + q) * WARP + lane
                                T.evaluate(cp_async.copy16(ring_s[c, (stages + m) % ring, q, lane, 0],
                                                           k[tn, c, p, 0]))
                        for q in T.unroll(chunk):
                            p = (m * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(x_s[c, m * chunk + q, lane, 0], hidden_states[tn, c, p, 0]))
                    cp_async.commit()

    return engram_gate_fwd


def _small_batch_kernel(hc_mult, hidden):
    steps = hidden // SPAN
    assert hidden % SPAN == 0, "hidden must be a multiple of 256"
    assert hc_mult * WARP <= SMALL_THREADS
    assert _small_smem_bytes(hc_mult, hidden) <= SMEM_PER_BLOCK, "a token's rows must fit in shared memory"
    chunk = -(-steps // cp_async.MAX_GROUPS)  # steps per copy group
    groups = -(-steps // chunk)
    pieces = hidden // PIECE
    rounds = -(-pieces // SMALL_THREADS)  # v pieces per thread in the output pass
    ts = _Tensors(hc_mult, hidden)

    @T.prim_func
    def engram_gate_fwd_small_batch(
        hidden_states: ts.rows(),
        k: ts.k(),
        v: ts.v(),
        weight_fused: ts.w(),
        output: ts.rows(),
        dot: ts.saved(),
        gate_score: ts.saved(),
        rstd_x: ts.saved(),
        rstd_k: ts.saved(),
        eps: T.float32,
        clamp_value: T.float32,
        scalar: T.float32,  # H ** -0.5 rounded to float32
    ):
        with T.Kernel(T.Cast("int32", ts.num_tokens), threads=SMALL_THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(cp_async.DEVICE_SOURCE)
            assume_aligned(ts)
            tid = T.get_thread_binding()
            warp = tid // WARP
            lane = tid % WARP
            t = T.Cast("int64", bid)

            x_s = T.alloc_shared((hc_mult, pieces, PIECE), T.bfloat16)
            k_s = T.alloc_shared((hc_mult, pieces, PIECE), T.bfloat16)
            w_s = T.alloc_shared((hc_mult, steps, 2, WARP, PIECE // 2), T.float32)  # a step's halves apart
            gate_s = T.alloc_shared((hc_mult,), T.float32)
            xv = T.alloc_local((PIECE,), T.bfloat16)
            kv = T.alloc_local((PIECE,), T.bfloat16)
            wv = T.alloc_local((PIECE,), T.float32)
            vv = T.alloc_local((rounds, PIECE), T.bfloat16)
            ov = T.alloc_local((PIECE,), T.bfloat16)
            acc = T.alloc_local((3,), T.float32)  # dot, sum x * x, sum k * k

            if warp < hc_mult:
                # ---- stream c's rows: every copy at once, group g holding steps g * chunk ..
                c = warp
                for j in T.unroll(steps):
                    p = j * WARP + lane
                    T.evaluate(cp_async.copy16(x_s[c, p, 0], hidden_states[t, c, p, 0]))
                    T.evaluate(cp_async.copy16(k_s[c, p, 0], k[t, c, p, 0]))
                    for h in T.unroll(2):
                        T.evaluate(cp_async.copy16(w_s[c, j, h, lane, 0], weight_fused[c, p, h * 4]))
                    if j % chunk == chunk - 1 or j == steps - 1:
                        cp_async.commit()
            # this thread's v pieces for the output pass, in flight during the sums
            for n in T.unroll(rounds):
                if n * SMALL_THREADS + tid < pieces:
                    for e in T.vectorized(PIECE):
                        vv[n, e] = v[t, n * SMALL_THREADS + tid, e]
            if warp < hc_mult:
                # ---- the three sums in the reference's order, each group as it lands
                c = warp
                for n in T.unroll(3):
                    acc[n] = T.float32(0)
                for j in T.unroll(steps):
                    if j % chunk == 0:
                        cp_async.wait(groups - 1 - j // chunk)
                    p = j * WARP + lane
                    for e in T.vectorized(PIECE):
                        xv[e] = x_s[c, p, e]
                    for e in T.vectorized(PIECE):
                        kv[e] = k_s[c, p, e]
                    for h in T.unroll(2):
                        for e in T.vectorized(PIECE // 2):
                            wv[h * 4 + e] = w_s[c, j, h, lane, e]
                    add_piece(acc, xv, kv, lambda e: wv[e])
                gate_s[c] = row_gate(acc, lane, t, c, (dot, gate_score, rstd_x, rstd_k), ts.saved_rows, hidden, eps,
                                     clamp_value, scalar)
            # every sum warp has waited for all of its copies: its x row and gate to the block
            T.sync_threads()

            # ---- out = x + gate * v: each thread its v pieces, every stream
            for n in T.unroll(rounds):
                p = n * SMALL_THREADS + tid
                if p < pieces:
                    for c in T.unroll(hc_mult):
                        for e in T.vectorized(PIECE):
                            xv[e] = x_s[c, p, e]
                        mix_piece(ov, xv, lambda e: vv[n, e], gate_s[c])
                        for e in T.vectorized(PIECE):
                            output[t, c, p, e] = ov[e]

    return engram_gate_fwd_small_batch
