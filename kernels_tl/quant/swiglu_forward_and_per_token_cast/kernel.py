"""quant.swiglu_forward_and_per_token_cast: SwiGLU forward fused with a per-token FP8 cast.

``x`` [n, 2 * hidden] (bfloat16 or float32, contiguous; ``hidden % 128 == 0``)
-> ``out`` [n, hidden] float8_e4m3fn and its scale factors ``out_sf``.  With
``l``/``r`` the left/right halves of a row, every element is, in float32 and in
exactly this order (the contract of ``tile_kernels_aot/torch/swiglu.py``)::

    l, r = clamp(l, max=c), clamp(r, -c, c)          # only with swiglu_clamp_value c
    v    = ((l / (1 + expf(-l))) * r) * w            # w: the row's top-k weight (1 without)
    (the quotient is -0 for l <= -87.5, where |l / (1 + expf(-l))| < 2^-119)

and per row and scale group (128 channels, or the whole row)::

    a   = max(max |v|, sf_clamp_min)
    sf  = a / 448,  out = e4m3_satfinite(v * (448 / a))              # two IEEE divides
    round_sf: sf = 2^ceil(log2(a / 448)) (exponent bits), out = e4m3(v * 2^-that)

Options: ``pos_to_token_topk``/``topk_weights`` (``w = topk_weights.view(-1)[pos]``,
0 for ``pos < 0``), ``pos_to_expert`` (rows < 0 are neither used nor counted;
their ``out`` and sf are written as zeros), the clamp and its counters
(``clamped_count`` [3] int64: ``l > c``, ``r > c``, ``r < -c`` before clamping),
``round_sf``.  Clamps are selects and the group max is ``max.NaN``, so NaN propagates
as in the reference: a group holding a NaN gets NaN factors (docs/ops.md, "NaN").

Design
------
Groups of 128 (``max_row_hidden == 0``, ``hidden`` dynamic): 4 warps per block,
one row per warp; lane ``l`` of grid column ``bx`` owns channels
``16 * (32 * bx + l) ...``, so a warp covers four scale groups of 8 lanes.  A
lane loads 16 left and 16 right inputs as 16-byte vectors (bf16 kept as 32-bit
words), the group amax is three ``shfl.xor``, its 16 fp8 bytes one 16-byte
store; a packed UE8M0 word is a warp's four groups, OR-gathered by shuffles.
Row blocks past 65535 go to ``bz``; store indices are re-read from the special
registers so that nothing stays live across the math.

Nothing stands between the loads and the math (each branch there costs ~0.7 us
at the prefill shape): lanes past the row re-read its last chunk, and the
``plain = 1`` configs compile the option flags out (``plain = 0`` dispatches at
run time to six copies of the element loop).  Two elements at a time (both
``expf`` first).  The divide, ``fast_quotient``, is nvcc's ``div.rn.f32`` fast
path without its range check: exact for bf16 gates raised to -88.5 first (one
``max.NaN.bf16x2`` per two channels); an fp32 lane with some ``|l| >= 64`` takes
an IEEE-divide copy.  Small grids (``PREFETCH_MAX_LANES``) first prefetch the
right half into L2 (predicated, no branch).  ``REGISTER_CAP`` gives bf16 on
sm_90a 64 warps per SM.

One group per row (``max_row_hidden > 0``, row-major fp32 sf only): one
256-thread block per row, the row's 16-byte chunks in registers, all loads
first, then a block max.

Counted clamps of bf16 in groups of 128 (``plain = 2``, ``_counted_kernel``): the
same lanes in a grid of at most the resident blocks (12 of 4 warps per SM, 40
registers), each walking row blocks and adding its counts once (3 atomics per block
instead of per 4 rows).  The kernel is issue-bound at MoE sizes, so a row costs as
few instructions as it can: the next row's ``pos_to_expert`` is read one row early,
counts are bf16x2 compare masks summed and decoded by one ``dp2a`` per counter and
row, a finite positive-bf16 clamp runs on the packed pairs with a divide that skips
the infinity check, and the group's factor divides ``a / 448`` once.

The MoE form, bf16 in groups of 128 with ``pos_to_expert`` alone and packed UE8M0
factors (``plain = 3``, the routed kernel), runs the group layout with every other
option compiled out: the row's ``pos_to_expert`` is loaded with its inputs and tested
after its math (a skipped row's inputs are read and dropped), so no load waits for
it; the factor divides ``a / 448`` once (``group_factors``, as the counted kernel);
32 registers, 64 warps per SM.  Its row costs what a row of the no-option kernel does
(about 490 SASS instructions per warp on sm_90a, against about 570 on the ``plain =
0`` path it replaces).

The same call with counted clamps and a clamp value that is a positive bf16 (``plain = 4``,
the counted routed kernel) keeps that row and its 32 registers and adds, before the math, the
counts of the raw pairs (``count_word``: a lane's three counts in one word, summed over the
warp by one ``redux.sync``) and the clamps on the packed pairs (after which no gate is
infinite: the divide without its infinity select); lane 0 stores the warp's word to a scratch
buffer, one word per warp-row, and a second launch of the same kernel (programmatic
dependent) sums the words into ``clamped_count`` (3 atomics per block, at most 4 blocks per
SM).  About 560 SASS instructions per warp-row on sm_90a.

Static configurations: ``in_dtype`` x (``sf_format``, ``max_row_hidden``) in
{(fp32, 0), (fp32_col, 0), (ue8m0_col, 0), (fp32, 8192)} x ``plain`` (0, 1),
bf16 x the three group formats with ``plain = 2``, and bf16 packed UE8M0 with
``plain`` 3 and 4: 21 configs.  bf16, 8192 x 2 * 2048, groups of 128: 21.2 us device time on an H200
(95% of its copy bandwidth).  Measurements and alternatives: ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE as NAN_MAX_SOURCE
from kernels_tl.nan_max import bf16x2_max_nan, max_nan
from kernels_tl.quant_math import FAST_DIV_LIMIT, FP8_MAX, fast_quotient, fma_rn, scale_factor

WARP = 32
GROUP = 128  # channels per scale factor (group mode)
LANE_CHANNELS = 16  # channels per lane (group mode): 16-byte fp8 store
LANES_PER_GROUP = GROUP // LANE_CHANNELS  # 8
GROUPS_PER_WARP = WARP // LANES_PER_GROUP  # 4 = one packed UE8M0 word
# One row per warp, 4 rows (128 threads) per block: small blocks keep the drain of the last
# blocks short (measured 0.4-0.8 us faster than 8 rows at the prefill shape, see notes.md).
ROWS_PER_BLOCK = 4
MAX_GRID_Y = 65535  # row blocks per grid column (the rest go to blockIdx.z)
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every access is in bounds by construction (rows and chunks are predicated);
    # without this TileLang adds per-element guards that break the 16-byte vectors
    "tl.disable_safe_memory_legalize": True,
}
# Lanes (16-channel chunks) up to which a lane prefetches its right half into L2 before it
# loads its left half: a quarter of an H200's thread slots (<= 16 warps per SM), where the
# two halves' fetches would otherwise be two round trips in series (see notes.md).
PREFETCH_MAX_LANES = 65536
# Group mode: registers per thread, capped for occupancy (-> blocks per SM for ptxas), the
# lowest that needs no spills: bf16 on sm_90a 32 (64 warps per SM), 40 with packed UE8M0
# factors (its gather needs more); sm_100a's code 48; fp32 input holds twice the raw data (64).
REGISTER_CAP = {("bfloat16", "sm_90a"): 32, ("bfloat16", "sm_90a", "ue8m0_col"): 40}
REGISTER_CAP_DEFAULT = {"bfloat16": 48, "float32": 64}
# The routed kernel (no option but pos_to_expert, its factor divided once) needs no more than 32
# on either arch (no spills): 64 warps per SM.
ROUTED_REGISTER_CAP = 32
ROW_THREADS = 256  # per-row mode: one row per block
# Counted kernel (``plain = 2``): blocks of ROWS_PER_BLOCK warps, this many per SM (40
# registers, 48 warps per SM as the group kernel's packed UE8M0 config), a grid of at most that
# many blocks per SM (the host sizes it, see host.h), so a launch makes 3 clamp-count atomics
# per resident block instead of 3 per 4 rows.
COUNTED_BLOCKS_PER_SM = 12
# A row's sum of eight bf16x2 compare masks starts here, so that its low half never borrows
# (it holds COUNT_BIAS - A for A <= 8 true low halves); see count_row.
COUNT_BIAS = 0x4000
COUNT_DECODE = 0xFFFE  # dp2a bytes (-2, -1): -2 * low - high = A + B - 2 * COUNT_BIAS
# The counted routed kernel (``plain = 4``): a warp's three counts of one row piece packed in one
# word of the scratch, 10 bits each (at most 32 lanes x 16 = 512), summed by its second launch
# (SUM_WORDS_PER_STEP independent loads per thread and step).
COUNT_FIELD_BITS = 10
COUNT_FIELD_MASK = (1 << COUNT_FIELD_BITS) - 1
SUM_WORDS_PER_STEP = 4

SF_FORMATS = ("fp32", "fp32_col", "ue8m0_col")
CLAMP_NONE, CLAMP, CLAMP_AND_COUNT = 0, 1, 2
FAST_FINITE = 2  # `fast` of swiglu_values: the fast divide for l that cannot be infinite
COUNTED = 2  # the `plain` value of the clamp-counting kernel (bf16, groups of 128)
ROUTED = 3  # the `plain` value of the routed kernel (pos_to_expert only, bf16, packed UE8M0)
# the routed kernel with counted clamps (a finite positive bf16 clamp value; two launches)
ROUTED_COUNTED = 4
BF16X2_SIGNS = 0x80008000
# l at or below which the quotient is -0 by contract (expf(-l) >= 2^126 there)
SILU_ZERO_BELOW = -87.5
SILU_FLOOR_BF16X2 = 0xC2B1C2B1  # two bf16 -88.5: the floor bf16 gates are raised to

BF16X2_MIN_SOURCE = r"""__device__ __forceinline__ unsigned tka_bf16x2_min_nan(unsigned a, unsigned b) {
  unsigned d; asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
"""
# Device helpers (besides kernels_tl/nan_max.py's): volatile reads of
# the thread and block indices, so that indices derived from them at the start of a row
# are not kept live (in registers) across the math for the stores at its end.
DEVICE_SOURCE = NAN_MAX_SOURCE + r"""
__device__ __forceinline__ void tka_prefetch_l2_if(const void* p, int cond) {
  asm volatile("{ .reg .pred q; setp.ne.s32 q, %1, 0; @q prefetch.global.L2 [%0]; }" :: "l"(p), "r"(cond));
}
__device__ __forceinline__ int tka_tid_x() { int v; asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v)); return v; }
__device__ __forceinline__ int tka_ctaid_x() { int v; asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v)); return v; }
__device__ __forceinline__ int tka_ctaid_y() { int v; asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v)); return v; }
__device__ __forceinline__ int tka_ctaid_z() { int v; asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v)); return v; }
__device__ __forceinline__ unsigned tka_bf16x2_gt(unsigned a, unsigned b) {
  unsigned d; asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
__device__ __forceinline__ unsigned tka_bf16x2_lt(unsigned a, unsigned b) {
  unsigned d; asm("set.lt.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
""" + BF16X2_MIN_SOURCE + r"""// The largest bf16 <= c (NaN for NaN), in both halves of a word: for every bf16 value l,
// l > c exactly when l > that bf16, and l < -c exactly when l < its negation.
__device__ __forceinline__ unsigned tka_bf16x2_floor(float c) {
  unsigned u = __float_as_uint(c);
  unsigned h = u >> 16;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) h = 0x7FC0u;
  else if ((u & 0xFFFFu) != 0u && (u >> 31) != 0u) h += 1u;  // negative, inexact: away from zero
  return h | (h << 16);
}
"""
# The counted kernel's helpers besides DEVICE_SOURCE: c + lo16(a) * b0 + hi16(a) * b1 with the
# halves of a and the two low bytes of b signed (PTX dp2a.lo), wrapping like an unsigned add.
COUNTED_SOURCE = DEVICE_SOURCE + r"""
__device__ __forceinline__ unsigned tka_dp2a_lo(unsigned a, unsigned b, unsigned c) {
  unsigned d; asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
"""
# The counted routed kernel's: COUNTED_SOURCE and a warp's sum (redux.sync, a uniform register).
ROUTED_COUNTED_SOURCE = COUNTED_SOURCE + r"""__device__ __forceinline__ unsigned tka_redux_add(unsigned v) {
  return __reduce_add_sync(0xFFFFFFFFu, v);
}
"""


def _as_float(words, i, half, packed):
    """float32 value of input element ``2 * i + half`` of a local input array.

    bf16 inputs are kept as 32-bit words of two bf16 (``packed``): widening is a
    shift (low half) or a mask (high half), one instruction each.
    """
    if not packed:
        return words[2 * i + half]
    if half == 0:
        return T.reinterpret(words[i] << T.uint32(16), T.float32)
    return T.reinterpret(words[i] & T.uint32(0xFFFF0000), T.float32)


@T.macro
def _denominator(xl, xr, v, k, i, half, packed, mode, swiglu_clamp_value, counts):
    """v[k] = 1 + expf(-l) for input element 2 * i + half (and the clamp counts)."""
    l = _as_float(xl, i, half, packed)
    r = _as_float(xr, i, half, packed)
    if mode == CLAMP_AND_COUNT:
        counts[0] += T.Cast(T.int32, l > swiglu_clamp_value)
        counts[1] += T.Cast(T.int32, r > swiglu_clamp_value)
        counts[2] += T.Cast(T.int32, r < -swiglu_clamp_value)
    if mode != CLAMP_NONE:
        l = T.Select(l > swiglu_clamp_value, swiglu_clamp_value, l)
    # __fadd_rn: `1 + e` stays its own rounding (no FMA with expf's last multiply)
    v[k] = T.ieee_add(T.float32(1.0), T.exp(-l))


@T.macro
def _product(xl, xr, v, k, i, half, packed, w, weighted, mode, swiglu_clamp_value, tmp, fast):
    """v[k] = (l / v[k]) * r [* w] for input element 2 * i + half.

    ``fast``: the divide without nvcc's range check and slow-path branch (see
    ``fast_quotient``; the caller has made sure the lane's l are in its range);
    ``FAST_FINITE``: the same for l that cannot be infinite (without the infinity select);
    otherwise the IEEE divide, and -0 for l <= -87.5 as the contract says.
    """
    l = _as_float(xl, i, half, packed)
    r = _as_float(xr, i, half, packed)
    if mode != CLAMP_NONE:
        l = T.Select(l > swiglu_clamp_value, swiglu_clamp_value, l)
        r = T.Select(r < -swiglu_clamp_value, -swiglu_clamp_value, r)
        r = T.Select(r > swiglu_clamp_value, swiglu_clamp_value, r)
    if fast:
        fast_quotient(l, v[k], tmp, finite=fast == FAST_FINITE)
        q = tmp[0]
    else:
        q = T.if_then_else(l <= T.float32(SILU_ZERO_BELOW), T.float32(-0.0), T.ieee_fdiv(l, v[k]))
    if weighted:
        v[k] = q * r * w
    else:
        v[k] = q * r


@T.macro
def swiglu_values(xl, xr, v, base, num_pairs, packed, w, weighted, mode, swiglu_clamp_value, counts, tmp, fast):
    """v[base + k] = ((l / (1 + expf(-l))) * r) [* w] for 2 * num_pairs elements.

    ``weighted``, ``mode`` and ``fast`` are Python-static (one copy of the loop per
    variant).  Clamps are selects, not fminf, so that NaN propagates like
    ``torch.clamp`` (lower bound first, as ``clamp(min=-c, max=c)``); the counters
    see the unclamped values.  Two elements at a time: both ``1 + expf`` first,
    then both divides (``v`` holds the denominators in between), which overlaps
    the exponentials' latency and keeps expf's constants in registers.
    """
    for p in T.unroll(num_pairs):
        i = base // 2 + p
        _denominator(xl, xr, v, base + 2 * p, i, 0, packed, mode, swiglu_clamp_value, counts)
        _denominator(xl, xr, v, base + 2 * p + 1, i, 1, packed, mode, swiglu_clamp_value, counts)
        _product(xl, xr, v, base + 2 * p, i, 0, packed, w, weighted, mode, swiglu_clamp_value, tmp, fast)
        _product(xl, xr, v, base + 2 * p + 1, i, 1, packed, w, weighted, mode, swiglu_clamp_value, tmp, fast)


@T.macro
def _swiglu_variants(xl, xr, v, base, num_pairs, packed, w, has_weights, clamp_mode, c, counts, tmp, fast):
    """Dispatch on the runtime flags (uniform branches) to the six loop variants."""
    if has_weights != 0:
        if clamp_mode == CLAMP_NONE:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, True, CLAMP_NONE, c, counts, tmp, fast)
        elif clamp_mode == CLAMP:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, True, CLAMP, c, counts, tmp, fast)
        else:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, True, CLAMP_AND_COUNT, c, counts, tmp, fast)
    else:
        if clamp_mode == CLAMP_NONE:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, False, CLAMP_NONE, c, counts, tmp, fast)
        elif clamp_mode == CLAMP:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, False, CLAMP, c, counts, tmp, fast)
        else:
            swiglu_values(xl, xr, v, base, num_pairs, packed, w, False, CLAMP_AND_COUNT, c, counts, tmp, fast)


@T.macro
def swiglu_values_any(xl, xr, v, base, num_pairs, packed, w, has_weights, clamp_mode, swiglu_clamp_value, counts,
                      tmp, rng):
    """The option variants with the fast divide wherever it is exact, else the IEEE one.

    bf16 (``packed``): in the fast copy l is raised to -88.5 (NaN kept; the quotient
    of every l <= -87.5 is -0 either way, see ``fast_quotient``) and the fast divide
    is exact for every such l, so nothing is checked: no branch waits for the loads.
    fp32: a lane whose |l| all lie below FAST_DIV_LIMIT (fmaxf, which skips NaN; NaN
    gives NaN through either divide) takes the fast copy, any other lane the IEEE
    copy.  A clamp can only lower l: with c <= -FAST_DIV_LIMIT the IEEE copy runs (a
    uniform branch) on the raw l, so that the count of ``l > c`` sees the unclamped,
    unraised gates (the floor would count a gate below c < -88.5; in the fast copy,
    c > -64, raising l to -88.5 leaves ``l > c`` unchanged).  Needs DEVICE_SOURCE
    imported.
    """
    if packed:
        in_range = True
    else:
        rng[0] = T.float32(0.0)
        for p in T.unroll(2 * num_pairs):
            rng[0] = T.max(rng[0], T.abs(xl[base + p]))
        in_range = rng[0] < T.float32(FAST_DIV_LIMIT)
    if in_range and (clamp_mode == CLAMP_NONE or swiglu_clamp_value > -FAST_DIV_LIMIT):
        if packed:
            for p in T.unroll(num_pairs):
                xl[base // 2 + p] = bf16x2_max_nan(xl[base // 2 + p], T.uint32(SILU_FLOOR_BF16X2))
        _swiglu_variants(xl, xr, v, base, num_pairs, packed, w, has_weights, clamp_mode, swiglu_clamp_value,
                         counts, tmp, True)
    else:
        _swiglu_variants(xl, xr, v, base, num_pairs, packed, w, has_weights, clamp_mode, swiglu_clamp_value,
                         counts, tmp, False)


def is_positive_bf16(c):
    """``c`` (float32) is a positive bf16 value: the clamps can run on packed pairs."""
    return T.And(c > T.float32(0.0), (T.reinterpret(c, T.uint32) & T.uint32(0xFFFF)) == T.uint32(0))


@T.macro
def clamp_pairs(xl, xr, num_words, c_pair):
    """``l = clamp(l, max=c)``, ``r = clamp(r, -c, c)`` on ``num_words`` packed bf16 pairs, for
    ``c`` a positive bf16 value in both halves of ``c_pair``: ``min.NaN`` / ``max.NaN.bf16x2``,
    equal to the selects of ``swiglu_values`` there (no signed-zero bound; a NaN stays NaN,
    canonicalized by every later operation).  Needs BF16X2_MIN_SOURCE imported."""
    for p in T.unroll(num_words):
        xl[p] = T.call_extern(T.uint32, "tka_bf16x2_min_nan", xl[p], c_pair)
        xr[p] = T.call_extern(T.uint32, "tka_bf16x2_min_nan",
                              bf16x2_max_nan(xr[p], c_pair ^ T.uint32(BF16X2_SIGNS)), c_pair)


def _mask_sum(words, num_words, compare, bound):
    """COUNT_BIAS plus the ``compare`` masks (0xFFFF per true bf16 half) of ``num_words``
    packed words against ``bound``, as one wrapping uint32 sum."""
    total = T.uint32(COUNT_BIAS)
    for p in range(num_words):
        total = total + T.call_extern(T.uint32, compare, words[p], bound)
    return total


@T.macro
def count_row(xl, xr, num_words, c_floor, counts):
    """Add one row's clamp counts (``l > c``, ``r > c``, ``r < -c`` over ``num_words`` packed
    pairs, at most 8) to ``counts``, each less ``2 * COUNT_BIAS``.

    ``c_floor`` is ``c`` rounded down to bf16 in both halves, so the bf16x2 compares decide
    the float32 comparisons with ``c`` exactly; NaN compares false.  A true low half adds
    0xFFFF = 2^16 - 1 and a true high half 0xFFFF0000 = -2^16 (mod 2^32), so the sum is
    ``2^16 (A - B) + COUNT_BIAS - A`` for A true low and B true high halves: its low half is
    ``COUNT_BIAS - A`` (no borrow, A <= 8) and its high half ``A - B`` (signed, |A - B| <= 8),
    and ``dp2a`` with bytes (-2, -1) adds ``-2 (COUNT_BIAS - A) - (A - B) = A + B - 2 * COUNT_BIAS``.
    Needs COUNTED_SOURCE imported."""
    counts[0] = _decoded_count(xl, num_words, "tka_bf16x2_gt", c_floor, counts[0])
    counts[1] = _decoded_count(xr, num_words, "tka_bf16x2_gt", c_floor, counts[1])
    counts[2] = _decoded_count(xr, num_words, "tka_bf16x2_lt", c_floor ^ T.uint32(BF16X2_SIGNS), counts[2])


def _decoded_count(words, num_words, compare, bound, acc):
    """``acc`` plus the number of true halves of one row's ``compare`` masks less ``2 *
    COUNT_BIAS``: their sum (``_mask_sum``) decoded by ``dp2a`` (see ``count_row``)."""
    return T.call_extern(T.uint32, "tka_dp2a_lo", _mask_sum(words, num_words, compare, bound),
                         T.uint32(COUNT_DECODE), acc)


def count_word(xl, xr, num_words, c_floor):
    """One lane's three counts of one row (``count_row``'s) packed in one word: ``l > c`` in bits
    0-9, ``r > c`` in bits 10-19, ``r < -c`` in bits 20-29.  Each is at most 2 * ``num_words`` =
    16, so a warp's sum of the words (at most 512 per field) carries nothing between fields.  The
    fields are decoded into each other (one ``dp2a`` and one shift-add each).  Needs COUNTED_SOURCE
    imported."""
    bias = T.uint32(2 * COUNT_BIAS)
    word = _decoded_count(xr, num_words, "tka_bf16x2_lt", c_floor ^ T.uint32(BF16X2_SIGNS), bias)
    word = _decoded_count(xr, num_words, "tka_bf16x2_gt", c_floor, (word << T.uint32(COUNT_FIELD_BITS)) + bias)
    return _decoded_count(xl, num_words, "tka_bf16x2_gt", c_floor, (word << T.uint32(COUNT_FIELD_BITS)) + bias)


@T.macro
def flush_counts(counts, count_smem, clamped_count, tid, num_warps):
    """Block-reduce the three clamp counters; one int64 atomic per non-zero total."""
    for j in T.unroll(3):
        for s in T.unroll(5):
            counts[j] += T.shfl_xor(counts[j], 16 >> s)
    if tid % WARP == 0:
        for j in T.unroll(3):
            count_smem[(tid // WARP) * 3 + j] = counts[j]
    T.sync_threads()
    if tid < 3:
        total = T.alloc_var(T.int32)
        total = 0
        for w in T.unroll(num_warps):
            total += count_smem[w * 3 + tid]
        if total != 0:
            T.atomic_add(clamped_count[tid], T.Cast(T.int64, total))


@T.macro
def store_lane(out, out_sf, q, sf, sf_exp, row2, bx2, lane2, num_tokens, num_chunks, sf_format):
    """Store a lane's 16 codes ``q`` and its group's factor (``sf``, or ``sf_exp`` packed):
    row ``row2``, grid column ``bx2``, lane ``lane2``; nothing past the rows or the chunks."""
    chunk = bx2 * WARP + lane2  # this lane's channels: [16 * chunk, 16 * chunk + 16)
    if row2 < num_tokens:  # warp-uniform
        if chunk < num_chunks:
            for i in T.vectorized(LANE_CHANNELS):
                out[row2, chunk * LANE_CHANNELS + i] = q[i]
        if sf_format == "ue8m0_col":
            # byte `group % 4` of the row's word `bx`; zero for skipped rows and
            # for the padding groups past hidden / 128
            word = T.alloc_var(T.uint32)
            word = T.if_then_else(chunk < num_chunks and lane2 % LANES_PER_GROUP == 0,
                                  sf_exp << T.uint32(8 * (lane2 // LANES_PER_GROUP)), T.uint32(0))
            word = word | T.shfl_xor(word, 8)
            word = word | T.shfl_xor(word, 16)
            if lane2 == 0:
                out_sf[bx2, row2] = T.reinterpret(word, T.int32)
        elif chunk < num_chunks and lane2 % LANES_PER_GROUP == 0:
            if sf_format == "fp32":
                out_sf[row2, chunk // LANES_PER_GROUP] = sf
            else:
                out_sf[chunk // LANES_PER_GROUP, row2] = sf


def host_constants(in_dtype: str, sf_format: str, max_row_hidden: int, plain: int) -> dict:
    """Blocks per SM of the counted kernel (the host sizes its grid to the resident blocks); the
    counted routed kernel's grids: row blocks per grid column (launch 0), threads per block and
    words per thread and step (launch 1)."""
    return {"rows_per_block": ROWS_PER_BLOCK, "counted_blocks_per_sm": COUNTED_BLOCKS_PER_SM,
            "max_grid_y": MAX_GRID_Y, "threads": ROWS_PER_BLOCK * WARP, "sum_words_per_step": SUM_WORDS_PER_STEP}


def swiglu_forward_and_per_token_cast_kernel(in_dtype: str, sf_format: str, max_row_hidden: int, plain: int):
    assert in_dtype in ("bfloat16", "float32"), in_dtype
    assert sf_format in SF_FORMATS, sf_format
    assert plain in (0, 1, COUNTED, ROUTED, ROUTED_COUNTED), plain
    per_row = max_row_hidden > 0
    if per_row:
        assert sf_format == "fp32", "one group per row supports row-major fp32 sf only"
    if plain == COUNTED:
        assert in_dtype == "bfloat16" and not per_row, "the counted kernel is bf16, groups of 128"
    if plain in (ROUTED, ROUTED_COUNTED):
        assert in_dtype == "bfloat16" and sf_format == "ue8m0_col" and not per_row, \
            "the routed kernel is bf16, groups of 128, packed UE8M0 factors"
    elem_bytes = 2 if in_dtype == "bfloat16" else 4

    num_tokens = T.dynamic("num_tokens")
    # hidden // 128: hidden as a multiple of 128 lets TileLang prove that every row and
    # chunk start is 16-byte aligned, so the loads and stores below are vectorized
    hidden_blocks = T.dynamic("hidden_blocks")
    num_weights = T.dynamic("num_weights")
    sf_stride = T.dynamic("sf_stride")  # column-major sf: token stride, align(num_tokens, 4)
    hidden = hidden_blocks * GROUP

    if per_row:
        sf_shape = (num_tokens, 1)
        sf_dtype = T.float32
    elif sf_format == "fp32":
        sf_shape, sf_dtype = (num_tokens, hidden_blocks), T.float32
    elif sf_format == "fp32_col":
        sf_shape, sf_dtype = (hidden_blocks, sf_stride), T.float32
    else:  # int32 words of four UE8M0 bytes, column-major
        sf_shape, sf_dtype = (T.ceildiv(hidden_blocks, GROUPS_PER_WARP), sf_stride), T.int32

    if plain == COUNTED:
        return _counted_kernel(sf_format, num_tokens, hidden_blocks, num_weights, sf_shape, sf_dtype)
    if per_row:
        body = _row_body(in_dtype, elem_bytes, max_row_hidden, num_tokens, hidden_blocks)
    else:
        body = _group_body(in_dtype, sf_format, num_tokens, hidden_blocks, routed=plain in (ROUTED, ROUTED_COUNTED),
                           counted=plain == ROUTED_COUNTED)

    @T.prim_func
    def swiglu_forward_and_per_token_cast(
        x: T.Tensor((num_tokens, hidden * 2), in_dtype),
        out: T.Tensor((num_tokens, hidden), T.float8_e4m3fn),
        out_sf: T.Tensor(sf_shape, sf_dtype),
        pos_to_token_topk: T.Tensor((num_tokens,), T.int32),
        topk_weights: T.Tensor((num_weights,), T.float32),
        pos_to_expert: T.Tensor((num_tokens,), T.int32),
        clamped_count: T.Tensor((3,), T.int64),
        # the counted routed kernel's scratch, a word of packed counts per warp-row: launch 0 -> 1
        row_counts: T.Tensor((num_tokens * T.ceildiv(hidden_blocks, GROUPS_PER_WARP),), T.int32),
        has_weights: T.int32,
        has_pos_to_expert: T.int32,
        clamp_mode: T.int32,
        swiglu_clamp_value: T.float32,
        round_sf: T.int32,
        sf_clamp_min: T.float32,
        launch_index: T.int32,  # the counted routed kernel: 0 the rows, 1 the sum of their counts
        grid_x: T.int32,  # and its grid (host.h)
        grid_y: T.int32,
        grid_z: T.int32,
    ):
        # plain (no optional input; the routed kernel reads pos_to_expert on its own): the
        # flags are compile-time zeros, one straight-line copy
        body(x, out, out_sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, row_counts,
             0 if plain else has_weights, 0 if plain else has_pos_to_expert, CLAMP_NONE if plain else clamp_mode,
             swiglu_clamp_value, round_sf, sf_clamp_min, launch_index, grid_x, grid_y, grid_z)

    return swiglu_forward_and_per_token_cast


def _input_words(x, in_dtype, num_tokens, hidden):
    """The input as loaded: 32-bit words of two bf16 (``packed``), or the fp32 values."""
    if in_dtype == "bfloat16":
        return T.view(x, (num_tokens, hidden), T.uint32), T.uint32, 2
    return x, T.float32, 1


def _target_arch() -> str:
    """The arch being lowered for ("" outside a CUDA target; aot/lower.py sets one)."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda":
        return ""
    return str(target.attrs.get("arch", ""))


def _launch_grid(counted, num_tokens, hidden_blocks, grid_x, grid_y, grid_z):
    """The group layout's grid: 512-channel columns x row blocks (past MAX_GRID_Y of them in z);
    the counted routed kernel's from its parameters (its two launches differ, see host.h)."""
    if counted:
        return grid_x, grid_y, grid_z
    num_row_blocks = T.ceildiv(num_tokens, ROWS_PER_BLOCK)
    return (T.ceildiv(hidden_blocks, GROUPS_PER_WARP), T.min(num_row_blocks, MAX_GRID_Y),
            T.ceildiv(num_row_blocks, MAX_GRID_Y))


def _group_body(in_dtype, sf_format, num_tokens, hidden_blocks, routed=False, counted=False):
    """Groups of 128, one row per warp (the module docstring).  ``routed``: the routed kernel;
    ``counted`` (with ``routed``): its counted form, launched twice: launch 0 the rows, clamped
    on the packed pairs, each warp's three counts of its row piece packed in one word of the
    scratch ``row_counts``; launch 1 the sum of those words into ``clamped_count``."""
    threads = ROWS_PER_BLOCK * WARP
    arch = _target_arch()
    registers = ROUTED_REGISTER_CAP if routed else REGISTER_CAP.get(
        (in_dtype, arch, sf_format), REGISTER_CAP.get((in_dtype, arch), REGISTER_CAP_DEFAULT[in_dtype]))
    min_blocks = 65536 // (registers * threads)  # the SM's register file
    hidden = hidden_blocks * GROUP
    num_chunks = hidden_blocks * LANES_PER_GROUP  # 16-channel chunks per row
    columns = T.ceildiv(hidden_blocks, GROUPS_PER_WARP)  # 512-channel row pieces
    V = LANE_CHANNELS

    @T.macro
    def sum_counts(bx, row_counts, clamped_count, grid_x):
        """Launch 1 of the counted routed kernel: the scratch's words bx * 128 + tid + k * 128 *
        grid_x (k = 0, 1, ...; SUM_WORDS_PER_STEP independent loads per step), unpacked and
        summed; one block reduction, 3 atomics.  (T x columns words: below 2^31 for any input
        below 2^40 elements.)"""
        tid = T.get_thread_binding()
        sums = T.alloc_local((3,), T.int32)
        sum_smem = T.alloc_shared((ROWS_PER_BLOCK * 3,), T.int32)
        word = T.alloc_var(T.uint32)
        idx = T.alloc_var(T.int32)
        num_words = num_tokens * columns
        for j in T.unroll(3):
            sums[j] = 0
        for step in T.serial(T.ceildiv(num_words, grid_x * threads * SUM_WORDS_PER_STEP)):
            for k in T.unroll(SUM_WORDS_PER_STEP):
                idx = ((step * SUM_WORDS_PER_STEP + k) * grid_x + bx) * threads + tid
                if idx < num_words:
                    word = T.reinterpret(row_counts[idx], T.uint32)
                    for j in T.unroll(3):
                        sums[j] += T.Cast(T.int32, (word >> T.uint32(j * COUNT_FIELD_BITS))
                                          & T.uint32(COUNT_FIELD_MASK))
        flush_counts(sums, sum_smem, clamped_count, tid, ROWS_PER_BLOCK)

    @T.macro
    def body(x, out, out_sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, row_counts,
             has_weights, has_pos_to_expert, clamp_mode, swiglu_clamp_value, round_sf, sf_clamp_min,
             launch_index, grid_x, grid_y, grid_z):
        grid = _launch_grid(counted, num_tokens, hidden_blocks, grid_x, grid_y, grid_z)
        with T.Kernel(grid[0], grid[1], grid[2], threads=threads) as (bx, by, bz):
            wait_for_previous_grid()  # programmatic dependent launch (launch 1: waits for launch 0)
            T.annotate_min_blocks_per_sm(min_blocks)
            T.import_source(ROUTED_COUNTED_SOURCE if counted else DEVICE_SOURCE)
            if counted:
                if launch_index != 0:  # launch 1: the sum of launch 0's counts
                    sum_counts(bx, row_counts, clamped_count, grid_x)
                    T.thread_return()
            tid = T.get_thread_binding()
            lane = tid % WARP
            # (rebinding the name keeps the kernel parameter called `x`)
            x, word_dtype, per_word = _input_words(x, in_dtype, num_tokens, hidden)
            W = V // per_word  # input words per lane and half (8 bf16 pairs or 16 fp32)

            xl = T.alloc_local((W,), word_dtype)
            xr = T.alloc_local((W,), word_dtype)
            v = T.alloc_local((V,), T.float32)
            q = T.alloc_local((V,), T.float8_e4m3fn)
            counts = T.alloc_local((3,), T.int32)
            tmp = T.alloc_local((4,), T.float32)  # fast_quotient's temporaries
            rng = T.alloc_local((1,), word_dtype)  # fp32: the lane's max |l| (fast-divide range check)
            count_smem = T.alloc_shared((ROWS_PER_BLOCK * 3,), T.int32)
            row = T.alloc_var(T.int32)
            src = T.alloc_var(T.int32)
            keep = T.alloc_var(T.bool)
            w = T.alloc_var(T.float32)
            amax = T.alloc_var(T.float32)
            sf = T.alloc_var(T.float32)
            sf_inv = T.alloc_var(T.float32)
            sf_exp = T.alloc_var(T.uint32)
            if routed:
                expert = T.alloc_var(T.int32)
                sf_q = T.alloc_var(T.float32)
            if counted:
                c_pair = T.alloc_var(T.uint32)  # c in both halves (a positive bf16 value: host.h)
                warp_counts = T.alloc_var(T.uint32)  # the warp's three counts of its row piece (count_word)
                c_pair = T.reinterpret(swiglu_clamp_value, T.uint32) | (T.reinterpret(swiglu_clamp_value, T.uint32)
                                                                        >> T.uint32(16))
            for j in T.unroll(3):
                counts[j] = 0

            row = (bz * MAX_GRID_Y + by) * ROWS_PER_BLOCK + tid // WARP
            keep = row < num_tokens
            if has_pos_to_expert != 0 and keep:
                keep = pos_to_expert[row] >= 0
            if keep:  # warp-uniform
                if routed:
                    # loaded with the row and tested after its math: no load waits for it
                    # (a skipped row's inputs are read, never used)
                    expert = pos_to_expert[row]
                w = T.float32(1.0)
                if has_weights != 0:
                    pos = pos_to_token_topk[row]
                    w = T.if_then_else(pos >= 0, topk_weights[T.max(pos, 0)], T.float32(0.0))
                # lanes past the row (whole groups of the last bx) read its last chunk again:
                # no branch around the loads (one costs ~0.7 us at the prefill shape)
                src = T.min(bx * WARP + lane, num_chunks - 1)
                # A small grid is latency-bound: the right half's fetch starts with the left's
                # (a predicated prefetch: a branch here would delay the loads of every grid).
                T.evaluate(T.call_extern("void", "tka_prefetch_l2_if", T.address_of(x[row, hidden // per_word + src * W]),
                                         T.Cast(T.int32, num_tokens * num_chunks <= PREFETCH_MAX_LANES)))
                for i in T.vectorized(W):
                    xl[i] = x[row, src * W + i]
                for i in T.vectorized(W):
                    xr[i] = x[row, hidden // per_word + src * W + i]
                if counted:
                    # counts of the raw pairs (not of a repeated chunk or a skipped row), summed over
                    # the warp (a uniform register); then the -88.5 floor and the clamps on the packed
                    # pairs, after which no gate is infinite: the fast divide without its infinity select
                    warp_counts = count_word(xl, xr, W, c_pair)
                    warp_counts = T.call_extern(T.uint32, "tka_redux_add", T.if_then_else(
                        T.And(src == bx * WARP + lane, expert >= 0), warp_counts, T.uint32(0)))
                    for p in T.unroll(W):
                        xl[p] = bf16x2_max_nan(xl[p], T.uint32(SILU_FLOOR_BF16X2))
                    clamp_pairs(xl, xr, W, c_pair)
                    swiglu_values(xl, xr, v, 0, W, True, w, False, CLAMP_NONE, swiglu_clamp_value, counts, tmp,
                                  FAST_FINITE)
                else:
                    swiglu_values_any(xl, xr, v, 0, V // 2, per_word == 2, w, has_weights, clamp_mode,
                                      swiglu_clamp_value, counts, tmp, rng)
                if clamp_mode == CLAMP_AND_COUNT and bx * WARP + lane >= num_chunks:
                    for j in T.unroll(3):
                        counts[j] = 0  # a repeated chunk is not counted twice

                amax = T.float32(0.0)
                for i in T.unroll(V):
                    amax = max_nan(amax, T.abs(v[i]))
                # the 8 lanes of a group hold one row's 128 channels: xor 1, 2, 4 stays inside
                for s in T.unroll(3):
                    amax = max_nan(amax, T.shfl_xor(amax, 1 << s))
                if routed:
                    group_factors(amax, sf_clamp_min, round_sf, sf_format, sf_q, sf, sf_inv, sf_exp)
                else:
                    sf_val, sf_inv_val, sf_exp_val = scale_factor(
                        amax, sf_clamp_min, True if sf_format == "ue8m0_col" else round_sf != 0)
                    sf = sf_val
                    sf_inv = sf_inv_val
                    sf_exp = sf_exp_val
                for i in T.vectorized(V):
                    q[i] = T.Cast(T.float8_e4m3fn, v[i] * sf_inv)  # cvt.rn.satfinite
                if routed:
                    if expert < 0:  # a skipped row: zero bytes and zero scale factors
                        sf = T.float32(0.0)
                        sf_exp = T.uint32(0)
                        for i in T.vectorized(V):
                            q[i] = T.reinterpret(T.uint8(0), T.float8_e4m3fn)
            elif not routed:  # (past the last row the routed kernel leaves q unset: nothing is stored)
                # a skipped row (pos_to_expert < 0) or none: zero bytes and zero scale factors
                sf = T.float32(0.0)
                sf_exp = T.uint32(0)
                for i in T.vectorized(V):
                    q[i] = T.Cast(T.float8_e4m3fn, T.float32(0.0))

            # The stores' indices from the special registers again (volatile reads): nothing
            # derived from them stays live across the math (at 32 registers it would spill).
            t2 = T.call_extern(T.int32, "tka_tid_x")
            bx2 = T.call_extern(T.int32, "tka_ctaid_x")
            row2 = ((T.call_extern(T.int32, "tka_ctaid_z") * MAX_GRID_Y + T.call_extern(T.int32, "tka_ctaid_y"))
                    * ROWS_PER_BLOCK + t2 // WARP)
            store_lane(out, out_sf, q, sf, sf_exp, row2, bx2, t2 % WARP, num_tokens, num_chunks, sf_format)
            if counted:
                if row2 < num_tokens and t2 % WARP == 0:
                    word_index = T.alloc_var(T.int32)
                    word_index = row2 * grid_x + bx2  # (launch 0: grid_x is the row's columns)
                    row_counts[word_index] = T.reinterpret(warp_counts, T.int32)

            if clamp_mode == CLAMP_AND_COUNT:
                flush_counts(counts, count_smem, clamped_count, tid, ROWS_PER_BLOCK)

    return body


def _row_body(in_dtype, elem_bytes, max_row_hidden, num_tokens, hidden_blocks):
    C = 16 // elem_bytes  # channels per 16-byte chunk of each half
    threads = ROW_THREADS
    steps = max_row_hidden // (C * threads)  # 16-byte chunks per half and thread
    assert steps >= 1 and steps * C * threads == max_row_hidden, max_row_hidden
    num_warps = threads // WARP
    hidden = hidden_blocks * GROUP
    row_chunks = hidden_blocks * (GROUP // C)

    @T.macro
    def body(x, out, out_sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, row_counts,
             has_weights, has_pos_to_expert, clamp_mode, swiglu_clamp_value, round_sf, sf_clamp_min,
             launch_index, grid_x, grid_y, grid_z):
        with T.Kernel(num_tokens, threads=threads) as row:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(DEVICE_SOURCE)
            tid = T.get_thread_binding()
            x, word_dtype, per_word = _input_words(x, in_dtype, num_tokens, hidden)  # see _group_body
            W = C // per_word  # input words per chunk and half

            xl = T.alloc_local((steps * W,), word_dtype)
            xr = T.alloc_local((steps * W,), word_dtype)
            v = T.alloc_local((steps * C,), T.float32)
            q = T.alloc_local((C,), T.float8_e4m3fn)
            counts = T.alloc_local((3,), T.int32)
            tmp = T.alloc_local((4,), T.float32)  # fast_quotient's temporaries
            rng = T.alloc_local((1,), word_dtype)  # the lane's max |l| (fast-divide range check)
            amax_smem = T.alloc_shared((num_warps,), T.float32)
            count_smem = T.alloc_shared((num_warps * 3,), T.int32)
            keep = T.alloc_var(T.bool)
            w = T.alloc_var(T.float32)
            amax = T.alloc_var(T.float32)
            sf = T.alloc_var(T.float32)
            sf_inv = T.alloc_var(T.float32)
            for j in T.unroll(3):
                counts[j] = 0

            keep = True
            if has_pos_to_expert != 0:
                keep = pos_to_expert[row] >= 0
            w = T.float32(1.0)
            if has_weights != 0 and keep:
                pos = pos_to_token_topk[row]
                w = T.if_then_else(pos >= 0, topk_weights[T.max(pos, 0)], T.float32(0.0))

            # every load first (2 * steps 16-byte vectors in flight per thread), then the math;
            # chunk `s * threads + tid` keeps each step's loads coalesced
            if keep:
                for s in T.unroll(steps):
                    if s * threads + tid < row_chunks:
                        for i in T.vectorized(W):
                            xl[s * W + i] = x[row, (s * threads + tid) * W + i]
                        for i in T.vectorized(W):
                            xr[s * W + i] = x[row, hidden // per_word + (s * threads + tid) * W + i]
            for s in T.unroll(steps):
                if keep and s * threads + tid < row_chunks:
                    swiglu_values_any(xl, xr, v, s * C, C // 2, per_word == 2, w, has_weights, clamp_mode,
                                      swiglu_clamp_value, counts, tmp, rng)
                else:
                    for i in T.vectorized(C):
                        v[s * C + i] = T.float32(0.0)

            amax = T.float32(0.0)
            for i in T.unroll(steps * C):
                amax = max_nan(amax, T.abs(v[i]))
            for s in T.unroll(5):
                amax = max_nan(amax, T.shfl_xor(amax, 16 >> s))
            if tid % WARP == 0:
                amax_smem[tid // WARP] = amax
            T.sync_threads()
            for wi in T.unroll(num_warps):
                amax = max_nan(amax, amax_smem[wi])
            sf_val, sf_inv_val, _ = scale_factor(amax, sf_clamp_min, round_sf != 0)
            sf = sf_val
            sf_inv = sf_inv_val

            for s in T.unroll(steps):
                if s * threads + tid < row_chunks:
                    for i in T.vectorized(C):
                        q[i] = T.Cast(T.float8_e4m3fn, v[s * C + i] * sf_inv)
                    for i in T.vectorized(C):
                        out[row, (s * threads + tid) * C + i] = q[i]
            if tid == 0:
                out_sf[row, 0] = T.if_then_else(keep, sf, T.float32(0.0))

            if clamp_mode == CLAMP_AND_COUNT:
                flush_counts(counts, count_smem, clamped_count, tid, num_warps)

    return body


def _is_finite(f):
    """The float32 ``f`` is finite (its exponent bits are not all ones)."""
    return (T.reinterpret(f, T.uint32) & T.uint32(0x7F800000)) != T.uint32(0x7F800000)


def _rounds(sf_format, finite, round_sf):
    """The factor is rounded to a power of two: always for packed UE8M0, else with round_sf;
    only where ``a / 448`` is ``finite``."""
    return finite if sf_format == "ue8m0_col" else T.And(finite, round_sf != 0)


@T.macro
def group_factors(amax: T.Ref, sf_clamp_min, round_sf, sf_format, sf_q: T.Ref, sf: T.Ref, sf_inv: T.Ref,
                  sf_exp: T.Ref):
    """A group's factors from its max |v| ``amax`` (a var, overwritten): ``scale_factor``'s
    rules with ``a / 448`` divided once (``scale_factor`` as an expression tree is divided
    again by each of its uses): a = max(amax, sf_clamp_min), sf = a / 448 and sf_inv = 448 / a,
    or rounded up to 2^(e - 127) and 2^(127 - e) (e the biased exponent of the rounded a / 448)
    where a / 448 is finite (UE8M0 byte 0xFF and the unrounded factors otherwise).  The
    arguments passed by reference are vars."""
    amax = max_nan(amax, sf_clamp_min)
    sf_q = T.ieee_fdiv(amax, T.float32(FP8_MAX))
    sf_exp = T.if_then_else(_is_finite(sf_q), (T.reinterpret(sf_q, T.uint32) + T.uint32(0x7FFFFF))
                            >> T.uint32(23), T.uint32(0xFF))
    if _rounds(sf_format, _is_finite(sf_q), round_sf):
        sf = T.reinterpret(sf_exp << T.uint32(23), T.float32)
        sf_inv = T.reinterpret((T.uint32(254) - sf_exp) << T.uint32(23), T.float32)
    else:
        sf = sf_q
        sf_inv = T.ieee_fdiv(T.float32(FP8_MAX), amax)


def _counted_kernel(sf_format, num_tokens, hidden_blocks, num_weights, sf_shape, sf_dtype):
    """The clamp-counting kernel (``plain = 2``; bf16, groups of 128).

    The lane layout and the math of ``_group_body``, in a grid of ``row_grid`` row blocks per
    grid column (at most ``COUNTED_BLOCKS_PER_SM`` blocks per SM, sized by the host): warp
    ``k`` of block ``by`` takes rows ``r = 4 * by + k``, ``r + step``, ``r + 2 * step``, ...
    (``step = 4 * row_grid``) and the block adds its counts to ``clamped_count`` once at the
    end (one block reduction, 3 atomics).  The kernel is issue-bound at MoE sizes (hidden
    1024: about 600 warp instructions per 2 KB row piece), so a row costs as few
    instructions as it can:

    * the next row's ``pos_to_expert`` and ``pos_to_token_topk`` are read while this row is
      computed (raw values, tested at the end of the row), so nothing dependent stands
      before a row's loads;
    * counts on the raw bf16 pairs: ``set.{gt,lt}.u32.bf16x2`` against ``c`` rounded down
      to bf16 (exact for bf16 values) gives a mask of 0xFFFF per true half; a row's eight
      masks summed from ``COUNT_BIAS`` hold ``2^16 (A - B) + COUNT_BIAS - A`` (A, B: true
      low and high halves, at most 8 each), and one ``dp2a`` with bytes (-2, -1) adds
      ``A + B - 2 * COUNT_BIAS`` to the lane's counter (``count_row``);
    * a clamp value that is a finite positive bf16 (0.5, 10, ...) clamps the packed pairs
      with ``min.NaN`` / ``max.NaN.bf16x2`` (equal to the selects there) and runs the
      unclamped loop with ``fast_quotient(..., finite=True)`` (the clamped gates cannot be infinite); any
      other value the selects of ``swiglu_values``;
    * the group's factor divides ``a / 448`` once (``scale_factor`` as an expression tree
      is divided again by each of its uses).
    """
    hidden = hidden_blocks * GROUP
    num_chunks = hidden_blocks * LANES_PER_GROUP
    num_row_blocks = T.ceildiv(num_tokens, ROWS_PER_BLOCK)
    V = LANE_CHANNELS
    W = V // 2  # bf16 pairs per lane and half

    @T.macro
    def loop(xl, xr, v, w, has_weights, mode, c, counts, tmp, fast):
        if has_weights != 0:
            swiglu_values(xl, xr, v, 0, W, True, w, True, mode, c, counts, tmp, fast)
        else:
            swiglu_values(xl, xr, v, 0, W, True, w, False, mode, c, counts, tmp, fast)

    @T.prim_func
    def swiglu_forward_and_per_token_cast(
        x: T.Tensor((num_tokens, hidden * 2), T.bfloat16),
        out: T.Tensor((num_tokens, hidden), T.float8_e4m3fn),
        out_sf: T.Tensor(sf_shape, sf_dtype),
        pos_to_token_topk: T.Tensor((num_tokens,), T.int32),
        topk_weights: T.Tensor((num_weights,), T.float32),
        pos_to_expert: T.Tensor((num_tokens,), T.int32),
        clamped_count: T.Tensor((3,), T.int64),
        has_weights: T.int32,
        has_pos_to_expert: T.int32,
        swiglu_clamp_value: T.float32,
        round_sf: T.int32,
        sf_clamp_min: T.float32,
        row_grid: T.int32,  # row blocks per grid column, 1 <= row_grid <= ceil(num_tokens / 4)
    ):
        with T.Kernel(T.ceildiv(hidden_blocks, GROUPS_PER_WARP), row_grid, threads=ROWS_PER_BLOCK * WARP) as (bx, by):
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(COUNTED_BLOCKS_PER_SM)
            T.import_source(COUNTED_SOURCE)
            tid = T.get_thread_binding()
            lane = tid % WARP
            x = T.view(x, (num_tokens, hidden), T.uint32)  # bf16 pairs (keeps the parameter `x`)

            xl = T.alloc_local((W,), T.uint32)
            xr = T.alloc_local((W,), T.uint32)
            v = T.alloc_local((V,), T.float32)
            q = T.alloc_local((V,), T.float8_e4m3fn)
            # the lane's counters (l > c, r > c, r < -c), each less 2 * COUNT_BIAS per row step
            counts = T.alloc_local((3,), T.uint32)
            totals = T.alloc_local((3,), T.int32)  # the lane's final counts
            tmp = T.alloc_local((4,), T.float32)  # the quotients' temporaries
            count_smem = T.alloc_shared((ROWS_PER_BLOCK * 3,), T.int32)
            rb = T.alloc_var(T.int32)  # this step's row block
            row = T.alloc_var(T.int32)
            src = T.alloc_var(T.int32)
            cur = T.alloc_var(T.bool)  # this row is kept
            next_expert = T.alloc_var(T.int32)  # the next row's pos_to_expert (0 without; -1 past the end)
            pos = T.alloc_var(T.int32)
            w = T.alloc_var(T.float32)
            c_floor = T.alloc_var(T.uint32)
            packed_clamp = T.alloc_var(T.bool)
            amax = T.alloc_var(T.float32)
            sf_q = T.alloc_var(T.float32)  # a / 448
            sf = T.alloc_var(T.float32)
            sf_inv = T.alloc_var(T.float32)
            sf_exp = T.alloc_var(T.uint32)
            for j in T.unroll(3):
                counts[j] = T.uint32(0)
            c_floor = T.call_extern(T.uint32, "tka_bf16x2_floor", swiglu_clamp_value)
            # c a finite positive bf16 value: the clamps are bf16x2 min/max on the packed words
            # (then c_floor holds c itself) and the clamped gates are finite
            packed_clamp = T.And(is_positive_bf16(swiglu_clamp_value),
                                 swiglu_clamp_value < T.float32(float("inf")))

            # the first row's keep flag
            row = by * ROWS_PER_BLOCK + tid // WARP
            cur = row < num_tokens
            if has_pos_to_expert != 0 and cur:
                cur = pos_to_expert[row] >= 0

            # The same step count for every block (kernel parameters only): a block past the
            # last row block in its final step stores nothing.  Every step subtracts
            # 2 * COUNT_BIAS from each counter (count_row, or the skipped-row branch).
            rb = by
            while rb < num_row_blocks:
                row = rb * ROWS_PER_BLOCK + tid // WARP
                # the next row's pos_to_expert, tested at the end of this row (its latency hides
                # behind the row); rows past the end are not kept
                next_expert = -1
                if row < num_tokens - row_grid * ROWS_PER_BLOCK:
                    next_expert = 0
                    if has_pos_to_expert != 0:
                        next_expert = pos_to_expert[row + row_grid * ROWS_PER_BLOCK]
                if cur:  # warp-uniform
                    # lanes past the row read its last chunk again (their counts are dropped)
                    src = T.min(bx * WARP + lane, num_chunks - 1)
                    for i in T.vectorized(W):
                        xl[i] = x[row, src * W + i]
                    for i in T.vectorized(W):
                        xr[i] = x[row, hidden // 2 + src * W + i]
                    w = T.float32(1.0)
                    if has_weights != 0:
                        pos = pos_to_token_topk[row]
                        w = T.if_then_else(pos >= 0, topk_weights[T.max(pos, 0)], T.float32(0.0))
                    count_row(xl, xr, W, c_floor, counts)
                    # gates raised to -88.5 (NaN kept): the fast divide is exact for all of them
                    for p in T.unroll(W):
                        xl[p] = bf16x2_max_nan(xl[p], T.uint32(SILU_FLOOR_BF16X2))
                    if packed_clamp:  # uniform
                        clamp_pairs(xl, xr, W, c_floor)
                        loop(xl, xr, v, w, has_weights, CLAMP_NONE, swiglu_clamp_value, counts, tmp, FAST_FINITE)
                    elif swiglu_clamp_value > -FAST_DIV_LIMIT:  # a clamp only lowers l
                        loop(xl, xr, v, w, has_weights, CLAMP, swiglu_clamp_value, counts, tmp, True)
                    else:
                        loop(xl, xr, v, w, has_weights, CLAMP, swiglu_clamp_value, counts, tmp, False)

                    amax = T.float32(0.0)
                    for i in T.unroll(V):
                        amax = max_nan(amax, T.abs(v[i]))
                    for s in T.unroll(3):  # the group's 8 lanes
                        amax = max_nan(amax, T.shfl_xor(amax, 1 << s))
                    group_factors(amax, sf_clamp_min, round_sf, sf_format, sf_q, sf, sf_inv, sf_exp)
                    for i in T.vectorized(V):
                        q[i] = T.Cast(T.float8_e4m3fn, v[i] * sf_inv)
                else:  # skipped or past the end: zeros
                    for j in T.unroll(3):
                        counts[j] = counts[j] - T.uint32(2 * COUNT_BIAS)
                    sf = T.float32(0.0)
                    sf_exp = T.uint32(0)
                    for i in T.vectorized(V):
                        q[i] = T.Cast(T.float8_e4m3fn, T.float32(0.0))
                # the row again from the loop index and the special registers (volatile reads),
                # so that no index stays live across the math
                row = rb * ROWS_PER_BLOCK + T.call_extern(T.int32, "tka_tid_x") // WARP
                store_lane(out, out_sf, q, sf, sf_exp, row, bx, lane, num_tokens, num_chunks, sf_format)
                cur = next_expert >= 0
                rb = rb + row_grid

            # lanes past the row count nothing
            for j in T.unroll(3):
                totals[j] = T.if_then_else(
                    bx * WARP + lane < num_chunks,
                    T.Cast(T.int32, counts[j] + T.Cast(T.uint32, T.ceildiv(num_row_blocks - by, row_grid))
                           * T.uint32(2 * COUNT_BIAS)), 0)
            flush_counts(totals, count_smem, clamped_count, tid, ROWS_PER_BLOCK)

    return swiglu_forward_and_per_token_cast
