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
One block per token, one warp per stream (``hc`` warps).  Pass 1: each lane loads its 16-byte
pieces of x and k (and 2 x 16 bytes of w, L2/L1-resident: 4 * hc * H bytes for the whole
call), all ``H / 256`` pieces unrolled so that the loads are in flight together, stashes
its x pieces in shared memory (its own, so no barrier) and accumulates the three sums.
After the butterfly every lane holds the token's dot, rstd's and gate.  Pass 2: x from
shared memory, v from global (one row per token, read by the ``hc`` warps of the block at
the same time: one DRAM read, the rest L1/L2 hits), 16-byte stores of the output.  Tokens,
strides, eps, clamp_value and save_for_backward (``saved_rows``: T or 0) are run-time
values; ``hc`` and ``H`` are static (the unrolled piece loop and the stash size depend on
``H``).  Element offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

WARP = 32
PIECE = 8  # bf16 elements per 16-byte access
SPAN = WARP * PIECE  # elements of a row one warp covers per step
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def host_constants(hc_mult, hidden):
    return {"threads": hc_mult * WARP}


def _f32(value):
    return T.cast(value, T.float32)


def engram_gate_fwd_kernel(hc_mult, hidden):
    assert hidden % SPAN == 0, "hidden must be a multiple of 256"
    steps = hidden // SPAN
    pieces = hidden // PIECE
    threads = hc_mult * WARP
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
    ):
        with T.Kernel(T.Cast("int32", num_tokens), threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            # rows start on 16-byte boundaries (checked by the host): each piece is one access
            T.assume(k_stride_t % PIECE == 0)
            T.assume(k_stride_c % PIECE == 0)
            T.assume(v_stride_t % PIECE == 0)
            tid = T.get_thread_binding()
            c = tid // WARP
            lane = tid % WARP
            t = T.Cast("int64", bid)

            x_stash = T.alloc_shared((hc_mult, steps, WARP, PIECE), T.bfloat16)
            xv = T.alloc_local((PIECE,), T.bfloat16)
            kv = T.alloc_local((PIECE,), T.bfloat16)
            wv = T.alloc_local((PIECE,), T.float32)
            vv = T.alloc_local((PIECE,), T.bfloat16)
            ov = T.alloc_local((PIECE,), T.bfloat16)
            acc_d = T.alloc_var(T.float32)
            acc_x = T.alloc_var(T.float32)
            acc_k = T.alloc_var(T.float32)
            gate = T.alloc_var(T.float32)
            z = T.alloc_var(T.float32)
            a = T.alloc_var(T.float32)

            acc_d = T.float32(0)
            acc_x = T.float32(0)
            acc_k = T.float32(0)
            # ---- pass 1: the three sums of the row, x stashed for pass 2
            for j in T.unroll(steps):
                for i in T.vectorized(PIECE):
                    xv[i] = hidden_states[t, c, j * WARP + lane, i]
                for i in T.vectorized(PIECE):
                    kv[i] = k[t, c, j * WARP + lane, i]
                for i in T.vectorized(PIECE):
                    wv[i] = weight_fused[c, j * WARP + lane, i]
                for i in T.vectorized(PIECE):
                    x_stash[c, j, lane, i] = xv[i]
                for i in T.unroll(PIECE):
                    xf = _f32(xv[i])
                    kf = _f32(kv[i])
                    acc_d = acc_d + T.ieee_mul(T.ieee_mul(xf, wv[i]), kf)
                    acc_x = acc_x + T.ieee_mul(xf, xf)
                    acc_k = acc_k + T.ieee_mul(kf, kf)
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

            # ---- pass 2: out = x + gate * v
            for j in T.unroll(steps):
                for i in T.vectorized(PIECE):
                    vv[i] = v[t, j * WARP + lane, i]
                for i in T.vectorized(PIECE):
                    xv[i] = x_stash[c, j, lane, i]
                for i in T.unroll(PIECE):
                    ov[i] = T.cast(T.ieee_add(_f32(xv[i]), T.ieee_mul(gate, _f32(vv[i]))), T.bfloat16)
                for i in T.vectorized(PIECE):
                    output[t, c, j * WARP + lane, i] = ov[i]

    return engram_gate_fwd
