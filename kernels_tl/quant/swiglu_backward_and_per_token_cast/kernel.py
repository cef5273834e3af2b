"""quant.swiglu_backward_and_per_token_cast: SwiGLU backward from an FP8 input, fused with a
per-token FP8 cast of the input gradient.

Per row ``i`` of ``P`` expanded rows (``x`` e4m3 [P, 2 * hidden] with float32 factors
[P, 2 * hidden / g], ``g = num_per_channels``), with ``w`` the row's routing weight
(``weight.view(-1)[pos_to_token_topk[i]]``, 0 where that is < 0) and, in float32 and in
exactly this order (the contract of ``tile_kernels_aot/torch/swiglu.py``)::

    l, r  = float(q) * sf                              # one multiply per element
    l, r  = min(l, c), clamp(r, -c, c)                 # c = +inf without a clamp
    d     = 1 + expf(-l);  act = (l / d) * r;  s = 1 / d      # IEEE divides
    out   = bf16(act * w)
    gws   = (g * w) * s
    gl    = (gws * r) * fma(l, 1 - s, 1)   (+0 where l was > c)
    gr    = gws * l                         (+0 where r was > c or < -c)
    x_grad = bf16([gl | gr]);  x_grad_fp8, x_grad_sf = per-token e4m3 cast of [gl | gr] in groups of g
    weight_grad[pos] = float32(sum_j g_j * act_j), the exact sum correctly rounded

``weight_grad`` entries no row maps to (``token_topk_to_pos < 0``, or a position whose row
does not point back) are written as 0, also with no rows at all (the grid has at least one
block; a block past the rows only zeroes entries).

Design
------
One row per block of 64 threads (2 warps); a lane owns a 16-channel chunk of each half per
step (``chunk = step * 64 + tid``): 16 fp8 of ``l`` and of ``r`` (one 16-byte load each),
16 bf16 of ``g`` (32 bytes), its group's two factors; it writes 32 bytes of ``out``, 16 +
16 bytes of ``x_grad_fp8`` and 32 + 32 bytes of ``x_grad``.  A scale group (32 or 128
channels: the static ``group``) is 2 or 8 consecutive lanes, reduced by ``shfl.xor``;
lanes past the row re-read its last chunk and store nothing, so the shuffles see whole
warps.  Offsets are 64-bit (``hidden_units`` is an int64 dim).

The divides: ``fast_quotient`` (nvcc's ``div.rn.f32`` fast path without its range check,
exact for ``|l| < 64``) for ``l / d`` and ``1 / d`` when every ``l`` of the lane's chunk is
below 64 in magnitude, the IEEE divide otherwise (a lane-divergent branch real data do not
take).  No SiLU flush here: the backward's quotient is the IEEE one at every ``l``.

The dot product: ``g`` and ``act`` widened to float64 (the product is exact), summed
per lane in double-double (TwoSum, ``__dadd_rn``: no contraction), lanes and warps merged
the same way, the pair rounded to float64 *to odd* and then to float32: the correctly
rounded sum (to about 2^-100 relative), which is what the reference computes.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.fp_pack import DEVICE_SOURCE as PACK_SOURCE
from kernels_tl.nan_max import DEVICE_SOURCE as NAN_MAX_SOURCE
from kernels_tl.nan_max import max_nan
from kernels_tl.quant_math import FAST_DIV_LIMIT, fast_quotient, fma_rn, scale_factor

WARP = 32
THREADS = 64  # one row per block
NUM_WARPS = THREADS // WARP
V = 16  # channels per lane and half per step
UNIT = 32  # hidden is a multiple of this (the smallest group)
SF_CLAMP_MIN = 1e-4
# 8 blocks of 64 threads per SM (16 warps): at most 128 registers per thread, enough to keep
# a lane's 32 float32 gradients and the double-double sum (ptxas keeps a few row-invariant
# offsets on the stack, stored once per row)
MIN_BLOCKS_PER_SM = 8
GROUPS = (32, 128)
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every access is in bounds by construction (see the lane mapping); without this
    # TileLang adds per-element guards that break the 16-byte vectors
    "tl.disable_safe_memory_legalize": True,
}

# besides kernels_tl/nan_max.py's and kernels_tl/fp_pack.py's (tka_bf16x2, tka_e4m3x4)
DEVICE_SOURCE = NAN_MAX_SOURCE + PACK_SOURCE + r"""
// element k (0..3) of a word of four e4m3 bytes, exactly, as float32
__device__ __forceinline__ float tka_e4m3_at(unsigned w, int k) {
  unsigned short pair = (unsigned short)(w >> (16 * (k >> 1)));
  unsigned h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(pair));
  unsigned short half = (unsigned short)(h >> (16 * (k & 1)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(half));
  return f;
}
// float64 shuffles (two 32-bit halves)
__device__ __forceinline__ double tka_shfl_xor_f64(double v, int m) {
  return __shfl_xor_sync(0xffffffffu, v, m);
}
// float32 of hi + lo (|lo| <= ulp(hi)), correctly rounded: the exact pair sum rounded to
// float64 to odd, then to float32 (double rounding through round-to-odd is innocuous)
__device__ __forceinline__ float tka_dd_to_f32(double hi, double lo) {
  double s = __dadd_rn(hi, lo);
  double bb = __dsub_rn(s, hi);
  double e = __dadd_rn(__dsub_rn(hi, __dsub_rn(s, bb)), __dsub_rn(lo, bb));
  long long bits = __double_as_longlong(s);
  if (e != 0.0 && (bits & 1) == 0) bits += ((e > 0.0) == (s > 0.0)) ? 1 : -1;
  return __double2float_rn(__longlong_as_double(bits));
}
"""


def _dadd(a, b):
    return T.call_extern(T.float64, "__dadd_rn", a, b)


def _dsub(a, b):
    return T.call_extern(T.float64, "__dsub_rn", a, b)


@T.macro
def dd_add(acc, p, t):
    """(acc[0], acc[1]) += p in double-double: TwoSum of the high parts, errors into acc[1]."""
    t[0] = _dadd(acc[0], p)  # s
    t[1] = _dsub(t[0], acc[0])  # bb
    acc[1] = _dadd(acc[1], _dadd(_dsub(acc[0], _dsub(t[0], t[1])), _dsub(p, t[1])))
    acc[0] = t[0]


@T.macro
def dd_merge(acc, hi, lo, t):
    """(acc[0], acc[1]) += (hi, lo)."""
    t[0] = _dadd(acc[0], hi)
    t[1] = _dsub(t[0], acc[0])
    acc[1] = _dadd(_dadd(acc[1], lo), _dadd(_dsub(acc[0], _dsub(t[0], t[1])), _dsub(hi, t[1])))
    acc[0] = t[0]


def _bf16_at(word, half):
    """float32 of the low (half 0) or high (half 1) bf16 of a word."""
    if half == 0:
        return T.reinterpret(word << T.uint32(16), T.float32)
    return T.reinterpret(word & T.uint32(0xFFFF0000), T.float32)


def _mul(a, b):
    return T.call_extern(T.float32, "__fmul_rn", a, b)


@T.macro
def _element(gl, gr, gw, k, half, swiglu_clamp_value, w, ob, fv, tmp, acc, dt, valid, fast):
    """Channel ``k = 2 * p + half`` of the lane's chunk.  On entry ``gl[k]``, ``gr[k]`` hold
    the dequantized ``l``, ``r``; on exit the gradients; ``ob[k]`` gets ``act * w``; the
    dot product gets ``g * act``.  Every name below is a let binding (value semantics)."""
    l0 = gl[k]
    r0 = gr[k]
    left_clamped = l0 > swiglu_clamp_value
    right_clamped = T.Or(r0 > swiglu_clamp_value, r0 < -swiglu_clamp_value)
    l = T.Select(left_clamped, swiglu_clamp_value, l0)  # min(l, c), NaN kept
    r1 = T.Select(r0 < -swiglu_clamp_value, -swiglu_clamp_value, r0)  # min(max(r, -c), c), NaN kept
    r = T.Select(r1 > swiglu_clamp_value, swiglu_clamp_value, r1)
    # __fadd_rn: `1 + e` stays its own rounding (no FMA with expf's last multiply);
    # fv[0] = d, fv[1] = l / d, fv[2] = 1 / d (stored once: let bindings are inlined)
    fv[0] = T.ieee_add(T.float32(1.0), T.exp(-l))
    if fast:
        fast_quotient(l, fv[0], tmp)
        fv[1] = tmp[0]
        fast_quotient(T.float32(1.0), fv[0], tmp)
        fv[2] = tmp[0]
    else:
        fv[1] = T.ieee_fdiv(l, fv[0])
        fv[2] = T.ieee_fdiv(T.float32(1.0), fv[0])
    s = fv[2]
    act = _mul(fv[1], r)
    g = _bf16_at(gw[k // 2], half)
    ob[k] = _mul(act, w)
    gws = _mul(_mul(g, w), s)
    gl[k] = T.Select(left_clamped, T.float32(0.0),
                     _mul(_mul(gws, r), fma_rn(l, T.call_extern(T.float32, "__fsub_rn", T.float32(1.0), s),
                                               T.float32(1.0))))
    gr[k] = T.Select(right_clamped, T.float32(0.0), _mul(gws, l))
    # g * act is exact in float64 (8 + 24 significant bits); a lane past the row adds 0
    dd_add(acc, T.if_then_else(valid, T.call_extern(T.float64, "__dmul_rn", T.Cast(T.float64, g),
                                                      T.Cast(T.float64, act)), T.float64(0.0)), dt)


@T.macro
def _chunk(gl, gr, gw, swiglu_clamp_value, w, ob, wo, fv, tmp, acc, dt, valid, fast):
    for p in T.unroll(V // 2):
        _element(gl, gr, gw, 2 * p, 0, swiglu_clamp_value, w, ob, fv, tmp, acc, dt, valid, fast)
        _element(gl, gr, gw, 2 * p + 1, 1, swiglu_clamp_value, w, ob, fv, tmp, acc, dt, valid, fast)
        # out's pair packed at once: 8 words live through the rest of the chunk, not 16 floats
        wo[p] = T.call_extern(T.uint32, "tka_bf16x2", ob[2 * p], ob[2 * p + 1])


@T.macro
def _load_x(x, x_sf, xl, xr, sf, row, src, hidden, group):
    """The lane's input for chunk ``src``: 16 e4m3 of each half and the two factors."""
    for i in T.vectorized(V // 4):
        xl[i] = x[row, src * (V // 4) + i]
    for i in T.vectorized(V // 4):
        xr[i] = x[row, hidden // 4 + src * (V // 4) + i]
    sf[0] = x_sf[row, src * V // group]
    sf[1] = x_sf[row, hidden // group + src * V // group]


@T.macro
def _load_g(grad_out, gw, row, src):
    """The lane's 16 bf16 of ``g`` for chunk ``src``."""
    for i in T.vectorized(V // 2):
        gw[i] = grad_out[row, src * (V // 2) + i]


@T.macro
def _cast_half(vals, h, x_grad_fp8, x_grad_sf, wb, row, chunk, hidden, group, lanes_per_group, lane, valid, round_sf):
    """Half ``h`` (0: left, 1: right) of the lane's gradients: the group's amax (over the
    lane, then the group's lanes), its factors, the 16 e4m3 bytes and the factor."""
    amax = T.alloc_var(T.float32)
    amax = T.float32(0.0)
    for k in T.unroll(V):
        amax = max_nan(amax, T.abs(vals[k]))
    for s in T.unroll(lanes_per_group.bit_length() - 1):
        amax = max_nan(amax, T.shfl_xor(amax, 1 << s))
    sf_val, sf_inv_val, _ = scale_factor(amax, T.float32(SF_CLAMP_MIN), round_sf != 0)
    if valid:
        for i in T.unroll(V // 4):
            wb[i] = T.call_extern(T.uint32, "tka_e4m3x4", _mul(vals[4 * i], sf_inv_val),
                                  _mul(vals[4 * i + 1], sf_inv_val), _mul(vals[4 * i + 2], sf_inv_val),
                                  _mul(vals[4 * i + 3], sf_inv_val))
        for i in T.vectorized(V // 4):
            x_grad_fp8[row, h * (hidden // 4) + chunk * (V // 4) + i] = wb[i]
        if lane % lanes_per_group == 0:
            x_grad_sf[row, h * (hidden // group) + chunk * V // group] = sf_val


def swiglu_backward_and_per_token_cast_kernel(group: int):
    assert group in GROUPS, group
    lanes_per_group = group // V  # 2 or 8

    num_rows = T.dynamic("num_rows")
    num_entries = T.dynamic("num_entries")  # num_tokens * num_topk
    # hidden / 32, int64: every offset below is computed in 64 bits, and hidden as a
    # multiple of 32 lets TileLang prove the 16-byte alignment of every vector
    hidden_units = T.dynamic("hidden_units", "int64")
    hidden = hidden_units * UNIT
    sf_cols = hidden_units * (2 * UNIT // group) if group == 32 else hidden_units // (group // UNIT) * 2
    num_chunks = hidden_units * (UNIT // V)  # 16-channel chunks per half (int64)

    @T.prim_func
    def swiglu_backward_and_per_token_cast(
        x: T.Tensor((num_rows, hidden * 2), T.float8_e4m3fn),
        x_sf: T.Tensor((num_rows, sf_cols), T.float32),
        grad_out: T.Tensor((num_rows, hidden), T.bfloat16),
        weight: T.Tensor((num_entries,), T.float32),
        pos_to_token_topk: T.Tensor((num_rows,), T.int32),
        token_topk_to_pos: T.Tensor((num_entries,), T.int32),
        out: T.Tensor((num_rows, hidden), T.bfloat16),
        x_grad_fp8: T.Tensor((num_rows, hidden * 2), T.float8_e4m3fn),
        x_grad_sf: T.Tensor((num_rows, sf_cols), T.float32),
        x_grad: T.Tensor((num_rows, hidden * 2), T.bfloat16),
        weight_grad: T.Tensor((num_entries,), T.float32),
        swiglu_clamp_value: T.float32,
        round_sf: T.int32,
    ):
        # at least one block: with no rows, weight_grad still needs its zeros (the block of
        # row 0 then only runs the pass below, every row-indexed access guarded)
        with T.Kernel(T.max(num_rows, 1), threads=THREADS) as row:
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            T.import_source(DEVICE_SOURCE)
            tid = T.get_thread_binding()
            lane = tid % WARP
            # 32-bit word views: 4 e4m3 or 2 bf16 per word
            x = T.view(x, (num_rows, hidden // 2), T.uint32)
            grad_out = T.view(grad_out, (num_rows, hidden // 2), T.uint32)
            out = T.view(out, (num_rows, hidden // 2), T.uint32)
            x_grad_fp8 = T.view(x_grad_fp8, (num_rows, hidden // 2), T.uint32)
            x_grad = T.view(x_grad, (num_rows, hidden), T.uint32)

            xl = T.alloc_local((V // 4,), T.uint32)
            xr = T.alloc_local((V // 4,), T.uint32)
            gw = T.alloc_local((V // 2,), T.uint32)
            gl = T.alloc_local((V,), T.float32)
            gr = T.alloc_local((V,), T.float32)
            ob = T.alloc_local((V,), T.float32)
            wo = T.alloc_local((V // 2,), T.uint32)  # out's packed bf16 pairs
            wb = T.alloc_local((V // 2,), T.uint32)  # packed bf16 / e4m3 words to store
            tmp = T.alloc_local((4,), T.float32)  # fast_quotient's temporaries
            fv = T.alloc_local((3,), T.float32)  # an element's d, l / d, 1 / d
            acc = T.alloc_local((2,), T.float64)  # the dot product, double-double
            dt = T.alloc_local((2,), T.float64)
            dt2 = T.alloc_local((2,), T.float64)
            dot_smem = T.alloc_shared((NUM_WARPS * 2,), T.float64)
            w = T.alloc_var(T.float32)
            pos = T.alloc_var(T.int32)
            mapped = T.alloc_var(T.bool)
            rng = T.alloc_var(T.float32)
            sf = T.alloc_local((2,), T.float32)  # the chunk's factors (left, right)
            num_steps = T.if_then_else(row < num_rows, T.ceildiv(num_chunks, THREADS), T.int64(0))

            # the first step's loads and the row's position go out first: the zeroing pass
            # below and the weight read then overlap their latency
            first_src = T.min(T.Cast(T.int64, tid), num_chunks - 1)  # step 0's chunk (see the loop)
            pos = -1
            if row < num_rows:
                _load_x(x, x_sf, xl, xr, sf, row, first_src, hidden, group)
                _load_g(grad_out, gw, row, first_src)
                pos = pos_to_token_topk[row]

            # weight_grad entries no row maps to: 0 (a grid-stride pass over the entries)
            total_threads = T.Cast(T.int64, T.max(num_rows, 1)) * THREADS
            for it in T.serial(T.ceildiv(num_entries, total_threads)):
                e = T.Cast(T.int64, it) * total_threads + T.Cast(T.int64, row) * THREADS + tid
                if e < num_entries:
                    p = token_topk_to_pos[e]
                    if p < 0 or p >= num_rows:
                        weight_grad[e] = T.float32(0.0)
                    elif pos_to_token_topk[p] != e:
                        weight_grad[e] = T.float32(0.0)

            mapped = pos >= 0 and pos < num_entries
            w = T.if_then_else(mapped, weight[T.max(T.min(pos, num_entries - 1), 0)], T.float32(0.0))
            acc[0] = T.float64(0.0)
            acc[1] = T.float64(0.0)

            # the block of a row past num_rows (only with none: see the grid) has no chunks
            for step in T.serial(num_steps):
                chunk = T.Cast(T.int64, step) * THREADS + tid
                valid = chunk < num_chunks
                # lanes past the row re-read its last chunk (whole warps reach the shuffles)
                next_src = T.min(chunk + THREADS, num_chunks - 1)
                # this step's inputs were loaded before the loop (step 0) or during the step before
                for k in T.unroll(V):
                    gl[k] = _mul(T.call_extern(T.float32, "tka_e4m3_at", xl[k // 4], k % 4), sf[0])
                    gr[k] = _mul(T.call_extern(T.float32, "tka_e4m3_at", xr[k // 4], k % 4), sf[1])
                # software pipeline: xl, xr and the factors are free once dequantized, so the
                # next step's fp8 loads go out before this step's math (the branch on rng
                # below ends their basic block, so ptxas cannot sink them into the math)
                if step + 1 < num_steps:
                    _load_x(x, x_sf, xl, xr, sf, row, next_src, hidden, group)

                # the fast divide is exact while every |l| (after the clamp, which only
                # lowers l) is below 64; fmaxf skips NaN, which either divide propagates
                rng = T.float32(0.0)
                for k in T.unroll(V):
                    rng = T.max(rng, T.abs(gl[k]))
                if rng < T.float32(FAST_DIV_LIMIT) and swiglu_clamp_value > -FAST_DIV_LIMIT:
                    _chunk(gl, gr, gw, swiglu_clamp_value, w, ob, wo, fv, tmp, acc, dt, valid, True)
                else:
                    _chunk(gl, gr, gw, swiglu_clamp_value, w, ob, wo, fv, tmp, acc, dt, valid, False)

                # gw is free after the math: the next step's gradient load goes out before
                # this step's stores and cast
                if step + 1 < num_steps:
                    _load_g(grad_out, gw, row, next_src)
                if valid:
                    for i in T.vectorized(V // 2):
                        out[row, chunk * (V // 2) + i] = wo[i]
                    for i in T.unroll(V // 2):
                        wb[i] = T.call_extern(T.uint32, "tka_bf16x2", gl[2 * i], gl[2 * i + 1])
                    for i in T.vectorized(V // 2):
                        x_grad[row, chunk * (V // 2) + i] = wb[i]
                    for i in T.unroll(V // 2):
                        wb[i] = T.call_extern(T.uint32, "tka_bf16x2", gr[2 * i], gr[2 * i + 1])
                    for i in T.vectorized(V // 2):
                        x_grad[row, hidden // 2 + chunk * (V // 2) + i] = wb[i]
                _cast_half(gl, 0, x_grad_fp8, x_grad_sf, wb, row, chunk, hidden, group, lanes_per_group, lane, valid,
                           round_sf)
                _cast_half(gr, 1, x_grad_fp8, x_grad_sf, wb, row, chunk, hidden, group, lanes_per_group, lane, valid,
                           round_sf)

            # the row's dot product: lanes, then the two warps
            for s in T.unroll(5):
                dt[0] = T.call_extern(T.float64, "tka_shfl_xor_f64", acc[0], 16 >> s)
                dt[1] = T.call_extern(T.float64, "tka_shfl_xor_f64", acc[1], 16 >> s)
                dd_merge(acc, dt[0], dt[1], dt2)
            if lane == 0:
                dot_smem[(tid // WARP) * 2] = acc[0]
                dot_smem[(tid // WARP) * 2 + 1] = acc[1]
            T.sync_threads()
            if tid == 0 and mapped:
                acc[0] = dot_smem[0]
                acc[1] = dot_smem[1]
                dd_merge(acc, dot_smem[2], dot_smem[3], dt)  # NUM_WARPS == 2
                weight_grad[pos] = T.call_extern(T.float32, "tka_dd_to_f32", acc[0], acc[1])

    return swiglu_backward_and_per_token_cast
