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

Design
------
A persistent grid of ``hc * num_groups`` blocks (the host's ``num_groups = min(T, SMs // hc)``:
one block per SM, every block resident at once), block ``b`` serving stream ``c = b % hc`` with
``WARPS`` warps (as many as shared memory holds, at most 16).  The block keeps its stream's w
(fp32, ``4 * H`` bytes) in shared memory for the whole kernel: the block's threads copy it once
with ``cp.async`` and meet at the one barrier of the kernel, so no sum ever waits for an L2 load
of w queued behind the SM's row copies.  Warp ``j`` of group ``g`` (``gw = j * num_groups + g``)
walks the tokens ``gw, gw + G, gw + 2 * G, ...`` with ``G = num_groups * WARPS`` (small batches
spread over every block first).  Lane ``l`` owns the 16-byte pieces ``j * 32 + l`` of its rows
(the reference's summation order) and reads back only the row slots it filled itself with
``cp.async``, so every wait on rows is per thread.

Per warp, shared memory holds the x row of its token (``2 * H`` bytes, kept for the output
pass) and a ring of ``RING`` slots of ``CHUNK`` pieces per lane (``RING * CHUNK * 512``
bytes).  A token is ``2 * stages`` stages of ``CHUNK`` steps (``stages = H / (256 * CHUNK)``):
the k stages (chunk ``i`` of x from the row, of k from the ring, of w from the block's copy: the
three sums) and then the v stages (chunk ``i`` of x and of v: the output).  Every stage commits
one copy group: when stage ``s`` is consumed, the copy of stage ``s + RING`` goes into the slot
it freed (k of this token, v of this token, or k of the warp's next token), so ``RING`` stages
are always in flight and a wait for "all but the newest ``RING - 1`` groups" finds stage ``s``
landed.  A v stage also frees its x chunk, which takes the next token's x chunk in the same
group: the next token's whole x row is in flight while the output pass runs, and its first k
chunks while the gate is computed.  Stage ``i`` of the next token's x rides in the group of
stage ``i + RING - stages <= i`` (``RING <= stages``), so the k stage that reads it waits for it
too.  The v row of a token is read by the ``hc`` blocks of its streams, one DRAM read and L2
hits for the rest when they pass the token at about the same time (they walk the tokens in the
same order).

``RING`` divides ``2 * stages``, so every stage's slot is static.  Shared memory is
``4 * H + WARPS * (2 * H + RING * CHUNK * 512)`` bytes (226 KB at H 7168: 11 warps of 18 KB
beside 28 KB of w).  Two layouts per H (the static key ``batch``; the host takes "small" when
every block has at most 8 tokens, ``T <= 8 * num_groups``, one per warp or none):
"large" takes the largest ring (up to ``RING_PIECES`` pieces per lane), then the largest chunk:
CHUNK 4, RING 2 (2 KB stages) at every table H but 2560 (CHUNK 1, RING 5); "small" takes a ring
of 2 of the largest chunk up to ``SMALL_CHUNK`` pieces that leaves 2 stages or more (CHUNK 7,
RING 2 at H 7168: 3.5 KB stages, 9 warps), so a lone token's row arrives in fewer, longer
stages.  Tokens, strides, ``num_groups``, eps, clamp_value and save_for_backward
(``saved_rows``: T or 0) are run-time values; ``hc`` and ``H`` are static.  Element offsets are
64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl import cp_async

WARP = 32
PIECE = 8  # bf16 elements per 16-byte access
SPAN = WARP * PIECE  # elements of a row one warp covers per step
RING_PIECES = 8  # 16-byte pieces per lane in the k/v ring (4 KB per warp)
SMEM_PER_BLOCK = 227 * 1024  # the most one block may have (one block per SM)
MAX_WARPS = 16  # register file: 128 registers per thread at 16 warps
BATCHES = ("large", "small")  # the static key batch: the host's choice by tokens per block
SMALL_CHUNK = 8  # batch "small": the most pieces per lane in a stage
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                # shared memory is written by cp.async (unseen by TileLang); each lane reads only
                # the row slots it filled itself, and w after the one explicit barrier
                "tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True,
                # every access is in bounds (tokens < num_tokens, guarded prefetches): no guards
                "tl.disable_safe_memory_legalize": True}


def _layout(hidden, batch):
    """(steps, chunk, stages, ring): ``chunk`` steps per stage, ``ring`` slots, ``ring``
    dividing ``2 * stages`` and at most ``stages``.  "large": the most ring pieces (up to
    RING_PIECES), then the larger chunk.  "small": a ring of 2 of the largest chunk up to
    SMALL_CHUNK that leaves at least 2 stages (fewer, longer stages: a lone token's row
    arrives in fewer round trips)."""
    assert hidden % SPAN == 0, "hidden must be a multiple of 256"
    steps = hidden // SPAN
    if batch == "small" and steps >= 2:
        chunk = max(c for c in range(1, min(SMALL_CHUNK, steps // 2) + 1) if steps % c == 0)
        return steps, chunk, steps // chunk, 2
    best = None
    for chunk in (1, 2, 4):
        if steps % chunk:
            continue
        stages = steps // chunk
        ring = max(r for r in range(1, min(stages, RING_PIECES // chunk) + 1) if (2 * stages) % r == 0)
        key = (ring * chunk, chunk)
        if best is None or key > best[0]:
            best = (key, (steps, chunk, stages, ring))
    return best[1]


def _warps(hidden, batch):
    """Warps per block: one block per SM, as many warps as shared memory holds beside w."""
    steps, chunk, _, ring = _layout(hidden, batch)
    per_warp = (steps + ring * chunk) * WARP * PIECE * 2
    return min(MAX_WARPS, (SMEM_PER_BLOCK - 4 * hidden) // per_warp)


def host_constants(hc_mult, hidden, batch):
    return {"threads": _warps(hidden, batch) * WARP}


def _f32(value):
    return T.cast(value, T.float32)


def engram_gate_fwd_kernel(hc_mult, hidden, batch):
    if batch not in BATCHES:
        raise ValueError(f"engram.engram_gate_fwd: batch must be one of {BATCHES}, got {batch!r}")
    steps, chunk, stages, ring = _layout(hidden, batch)
    warps = _warps(hidden, batch)
    assert warps >= 1, "a warp's rows and w must fit in shared memory"
    assert ring <= cp_async.MAX_GROUPS
    pieces = hidden // PIECE
    threads = warps * WARP
    w_copies = -(-2 * pieces // threads)  # 16-byte halves of w per thread
    num_tokens = T.dynamic("num_tokens", "int64")
    k_stride_t = T.dynamic("k_stride_t", "int64")  # elements (multiples of 8)
    k_stride_c = T.dynamic("k_stride_c", "int64")
    v_stride_t = T.dynamic("v_stride_t", "int64")
    saved_rows = T.dynamic("saved_rows", "int64")  # num_tokens when saving, else 0 (unused)

    @T.prim_func
    def engram_gate_fwd(
        hidden_states: T.Tensor[(num_tokens, hc_mult, pieces, PIECE), T.bfloat16],
        k: T.StridedTensor[(num_tokens, hc_mult, pieces, PIECE), (k_stride_t, k_stride_c, PIECE, 1),
                           T.bfloat16],
        v: T.StridedTensor[(num_tokens, pieces, PIECE), (v_stride_t, PIECE, 1), T.bfloat16],
        weight_fused: T.Tensor[(hc_mult, pieces, PIECE), T.float32],
        output: T.Tensor[(num_tokens, hc_mult, pieces, PIECE), T.bfloat16],
        dot: T.Tensor[(saved_rows, hc_mult), T.float32],
        gate_score: T.Tensor[(saved_rows, hc_mult), T.float32],
        rstd_x: T.Tensor[(saved_rows, hc_mult), T.float32],
        rstd_k: T.Tensor[(saved_rows, hc_mult), T.float32],
        eps: T.float32,
        clamp_value: T.float32,
        scalar: T.float32,  # H ** -0.5 rounded to float32
        num_groups: T.int32,  # blocks per stream, 1 <= num_groups <= num_tokens (host)
    ):
        with T.Kernel(num_groups * hc_mult, threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(cp_async.DEVICE_SOURCE)
            # rows start on 16-byte boundaries (checked by the host): each piece is one access
            T.assume(k_stride_t % PIECE == 0)
            T.assume(k_stride_c % PIECE == 0)
            T.assume(v_stride_t % PIECE == 0)
            T.assume(num_groups > 0)
            tid = T.get_thread_binding()
            c = bid % hc_mult
            warp = tid // WARP
            lane = tid % WARP
            # this warp's first token (the first warps of every block take the first tokens)
            gw = T.Cast("int64", warp) * num_groups + bid // hc_mult
            walk = T.Cast("int64", num_groups) * warps  # token step of every warp

            w_s = T.alloc_shared((pieces, PIECE), T.float32)  # stream c's w
            x_s = T.alloc_shared((warps, steps, WARP, PIECE), T.bfloat16)
            ring_s = T.alloc_shared((warps, ring, chunk, WARP, PIECE), T.bfloat16)  # k, then v
            xv = T.alloc_local((PIECE,), T.bfloat16)
            kv = T.alloc_local((PIECE,), T.bfloat16)
            vv = T.alloc_local((PIECE,), T.bfloat16)
            ov = T.alloc_local((PIECE,), T.bfloat16)
            wv = T.alloc_local((PIECE,), T.float32)
            acc_d = T.alloc_var(T.float32)
            acc_x = T.alloc_var(T.float32)
            acc_k = T.alloc_var(T.float32)
            gate = T.alloc_var(T.float32)
            z = T.alloc_var(T.float32)
            a = T.alloc_var(T.float32)

            # tokens gw, gw + walk, ...: none for the warps past the token count
            count = T.if_then_else(gw < num_tokens, T.ceildiv(num_tokens - gw, walk), T.int64(0))

            # ---- w of the stream, copied by the whole block (its own group, the oldest)
            for u in T.unroll(w_copies):
                h = u * threads + tid  # the 16-byte half h % 2 of piece h // 2
                if h < 2 * pieces:
                    T.evaluate(cp_async.copy16(w_s[h // 2, h % 2 * 4], weight_fused[c, h // 2, h % 2 * 4]))
            cp_async.commit()
            # ---- the first token in flight: its whole x row and its first `ring` k stages
            # (group r < ring holds k stage r; the last one also x chunks ring-1 .. stages-1)
            if count > 0:
                for i in T.unroll(stages):
                    for q in T.unroll(chunk):
                        p = (i * chunk + q) * WARP + lane
                        T.evaluate(cp_async.copy16(x_s[warp, i * chunk + q, lane, 0], hidden_states[gw, c, p, 0]))
                    if i < ring:
                        for q in T.unroll(chunk):
                            p = (i * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[warp, i, q, lane, 0], k[gw, c, p, 0]))
                    if i < ring - 1 or i == stages - 1:
                        cp_async.commit()
                cp_async.wait(ring)  # the w group (older than the ring's)
            else:
                cp_async.wait(0)
            T.sync_threads()  # every thread's part of w landed: all of it visible to the block

            for it in T.serial(count):
                t = gw + it * walk
                has_next = it + 1 < count
                tn = t + walk

                acc_d = T.float32(0)
                acc_x = T.float32(0)
                acc_k = T.float32(0)
                # ---- k stages: the three sums in the reference's order
                for i in T.unroll(stages):
                    cp_async.wait(ring - 1)  # this stage's group (and every older one) landed
                    for q in T.unroll(chunk):
                        for e in T.vectorized(PIECE):
                            xv[e] = x_s[warp, i * chunk + q, lane, e]
                        for e in T.vectorized(PIECE):
                            kv[e] = ring_s[warp, i % ring, q, lane, e]
                        for e in T.vectorized(PIECE):
                            wv[e] = w_s[(i * chunk + q) * WARP + lane, e]
                        for e in T.unroll(PIECE):
                            xf = _f32(xv[e])
                            kf = _f32(kv[e])
                            acc_d = acc_d + T.ieee_mul(T.ieee_mul(xf, wv[e]), kf)
                            acc_x = acc_x + T.ieee_mul(xf, xf)
                            acc_k = acc_k + T.ieee_mul(kf, kf)
                    # the freed slot takes stage i + ring: a later k stage or a v stage of this token
                    if i + ring < stages:
                        for q in T.unroll(chunk):
                            p = ((i + ring) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[warp, i % ring, q, lane, 0], k[t, c, p, 0]))
                    else:
                        for q in T.unroll(chunk):
                            p = ((i + ring - stages) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[warp, i % ring, q, lane, 0], v[t, p, 0]))
                    cp_async.commit()
                for s in T.unroll(5):
                    acc_d = acc_d + T.shfl_xor(acc_d, 16 >> s)
                    acc_x = acc_x + T.shfl_xor(acc_x, 16 >> s)
                    acc_k = acc_k + T.shfl_xor(acc_k, 16 >> s)

                # ---- the gate (every lane holds the same values)
                r_x = T.ieee_fdiv(T.float32(1), T.sqrt(T.ieee_add(T.ieee_fdiv(acc_x, T.float32(hidden)), eps)))
                r_k = T.ieee_fdiv(T.float32(1), T.sqrt(T.ieee_add(T.ieee_fdiv(acc_k, T.float32(hidden)), eps)))
                z = T.ieee_mul(T.ieee_mul(T.ieee_mul(acc_d, r_x), r_k), scalar)
                a = T.abs(z)
                a = T.Select(a < clamp_value, clamp_value, a)  # clamp_min; NaN stays NaN
                # -copysign is a sign flip (exact); expf, then 1 + e and 1 / d each rounded once
                gate = T.ieee_fdiv(T.float32(1), T.ieee_add(T.exp(-T.copysign(T.sqrt(a), z)), T.float32(1)))
                if saved_rows > 0:  # save_for_backward (a uniform branch)
                    if lane == 0:
                        dot[t, c] = acc_d
                        gate_score[t, c] = gate
                        rstd_x[t, c] = r_x
                        rstd_k[t, c] = r_k

                # ---- v stages: out = x + gate * v
                for m in T.unroll(stages):
                    cp_async.wait(ring - 1)
                    for q in T.unroll(chunk):
                        p = (m * chunk + q) * WARP + lane
                        for e in T.vectorized(PIECE):
                            xv[e] = x_s[warp, m * chunk + q, lane, e]
                        for e in T.vectorized(PIECE):
                            vv[e] = ring_s[warp, (stages + m) % ring, q, lane, e]
                        for e in T.unroll(PIECE):
                            ov[e] = T.cast(T.ieee_add(_f32(xv[e]), T.ieee_mul(gate, _f32(vv[e]))), T.bfloat16)
                        for e in T.vectorized(PIECE):
                            output[t, c, p, e] = ov[e]
                    # the freed ring slot takes stage m + ring (a v stage of this token or a k
                    # stage of the next); the freed x chunk takes the next token's chunk m
                    if m + ring < stages:
                        for q in T.unroll(chunk):
                            p = ((m + ring) * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(ring_s[warp, (stages + m) % ring, q, lane, 0], v[t, p, 0]))
                    if has_next:
                        if m + ring >= stages:
                            for q in T.unroll(chunk):
                                p = ((m + ring - stages) * chunk + q) * WARP + lane
                                T.evaluate(cp_async.copy16(ring_s[warp, (stages + m) % ring, q, lane, 0],
                                                           k[tn, c, p, 0]))
                        for q in T.unroll(chunk):
                            p = (m * chunk + q) * WARP + lane
                            T.evaluate(cp_async.copy16(x_s[warp, m * chunk + q, lane, 0], hidden_states[tn, c, p, 0]))
                    cp_async.commit()

    return engram_gate_fwd
