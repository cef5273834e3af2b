"""Float32 primitives the FP8-quantizing kernels share (TileLang expressions and macros).

* ``scale_factor``: a group's (sf, sf_inv, UE8M0 exponent) from its absolute maximum,
  TileKernels' e4m3 rules (``sf = a / 448``, ``sf_inv = 448 / a``, optionally rounded up
  to a power of two), NaN kept (docs/ops.md, "NaN");
* ``fast_quotient``: the correctly rounded ``l / d`` for ``d = 1 + expf(-l)`` without
  nvcc's range check and slow-path branch (exact for ``|l| < FAST_DIV_LIMIT``);
* ``fma_rn``: a single-rounding float32 multiply-add.

Used by ``quant/swiglu_forward_and_per_token_cast`` and the SwiGLU kernels beside it.
``scale_factor`` needs ``kernels_tl.nan_max.DEVICE_SOURCE`` imported by the kernel.
"""

from tilelang import language as T

from kernels_tl.nan_max import max_nan

FP8_MAX = 448.0
# |l| below which the branch-free divide is exact for any float32 l (see fast_quotient)
FAST_DIV_LIMIT = 64.0


def fma_rn(a, b, c):
    """``a * b + c`` with one rounding (``__fmaf_rn``)."""
    return T.call_extern(T.float32, "__fmaf_rn", a, b, c)


@T.macro
def fast_quotient(l, d, tmp, finite=False):
    """tmp[0] = l / d, correctly rounded, for d = 1 + expf(-l) and |l| < FAST_DIV_LIMIT
    (and for every finite bf16 l > -87.5; -0 for l <= -87.5 while d is finite).

    The operations of nvcc's ``div.rn.f32`` fast path (approximate reciprocal, one
    Newton step, quotient, exact remainder, correction) without its range check
    (FCHK) and its slow-path branch: 6 instructions instead of 10.  That path is
    exact whenever no intermediate leaves the normal range (it depends on the
    mantissas only), and with |l| < 64: d is in [1, 2^93) (1/d normal), q = l / d
    is normal unless l is so small that d == 2 exactly (then the Newton step gives
    r1 = 0.5 exactly and every step is exact, subnormal l included).  The
    remainder is formed as d * q0 - l and added times -r1 (never zero), so that
    l = -0 gives -0 like the IEEE divide.  Past |l| = 64 nothing is proven, but every
    finite bf16 l > -87.5 was checked on sm_90a (GPU test ``test_every_bf16_gate_value``);
    for l <= -87.5, d >= 2^126, the reciprocal (``.ftz``) is 0 and the result is
    l * 0 + (-l) * -0 = -0, the contract's value.  l = +-inf gives q0 = +-inf (the IEEE
    quotient) and a NaN remainder; the result is then q0.  ``finite``: the caller knows l is
    not infinite (or NaN, which gives NaN either way), so that select is left out.
    """
    tmp[1] = T.call_extern(T.float32, "tl::fast_rcp", d)  # MUFU.RCP
    tmp[2] = fma_rn(-d, tmp[1], T.float32(1.0))  # e = 1 - d * r0
    tmp[1] = fma_rn(tmp[1], tmp[2], tmp[1])  # r1 = r0 + r0 * e
    tmp[2] = T.call_extern(T.float32, "__fmul_rn", l, tmp[1])  # q0
    tmp[3] = fma_rn(d, tmp[2], -l)  # d * q0 - l (exact)
    if finite:
        tmp[0] = fma_rn(tmp[3], -tmp[1], tmp[2])
    else:  # l = +-inf: q0 is the IEEE quotient and the remainder inf - inf is NaN: keep q0
        tmp[0] = T.if_then_else(T.abs(l) != T.float32(float("inf")), fma_rn(tmp[3], -tmp[1], tmp[2]), tmp[2])



def scale_factor(amax, sf_clamp_min, round_sf):
    """(sf, sf_inv, biased exponent of the rounded sf) from a group's amax, as expressions.

    TileKernels' rules, bit-exact: ``a = max(amax, sf_clamp_min)``, ``sf = a / 448``,
    ``sf_inv = 448 / a``, with NaN kept (a NaN amax gives NaN factors).  Rounded
    (``round_sf``: a Python bool or a runtime flag),
    ``e = (bits(a / 448) + 0x7FFFFF) >> 23`` is the biased exponent of
    2^ceil(log2(a / 448)) (a / 448 is positive and normal for sf_clamp_min >= 2^-117),
    ``sf = 2^(e - 127)`` and ``sf_inv = 2^(127 - e)``, both exact; a NaN or infinite
    ``a / 448`` keeps the unrounded factors and ``e = 0xFF``.
    """
    a = max_nan(amax, sf_clamp_min)  # a NaN amax stays NaN
    sf = T.ieee_fdiv(a, T.float32(FP8_MAX))
    sf_inv = T.ieee_fdiv(T.float32(FP8_MAX), a)
    # a NaN or infinite amax keeps the unrounded factors (UE8M0 byte 0xFF)
    finite = (T.reinterpret(sf, T.uint32) & T.uint32(0x7F800000)) != T.uint32(0x7F800000)
    e = T.if_then_else(finite, (T.reinterpret(sf, T.uint32) + T.uint32(0x7FFFFF)) >> T.uint32(23), T.uint32(0xFF))
    sf_round = T.if_then_else(finite, T.reinterpret(e << T.uint32(23), T.float32), sf)
    sf_inv_round = T.if_then_else(finite, T.reinterpret((T.uint32(254) - e) << T.uint32(23), T.float32), sf_inv)
    if round_sf is True:
        return sf_round, sf_inv_round, e
    return T.if_then_else(round_sf, sf_round, sf), T.if_then_else(round_sf, sf_inv_round, sf_inv), e
