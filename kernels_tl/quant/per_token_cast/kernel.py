"""quant.per_token_cast (+ ``_with_sf_only``, ``_with_precomputed_sf``): FP8/FP4
quantization of each row in groups of ``num_per_channels`` channels.

``x`` bf16/fp32 [num_tokens, hidden] (rows may be strided) -> ``out`` e4m3
[num_tokens, hidden] or packed e2m1 [num_tokens, hidden / 2] (element ``2j`` in
the low nibble of byte ``j``), and each group's factor ``out_sf``: fp32
row-major, fp32 TMA-aligned column-major, or UE8M0 packed four per int32.  The
arithmetic is the reference's (``tile_kernels_aot.torch.quant``):
``c = max(amax, clamp_min)``, ``sf = c / MAX``, ``sf_inv = MAX / c`` (IEEE
divisions) or, with ``round_sf``, powers of two ``2**ceil(log2(c / MAX))`` taken
on the bits; ``q = encode(float32(x) * sf_inv)`` (e4m3 ``cvt.rn.satfinite``,
e2m1 round-to-nearest-even saturating at 6).

Design
------
Memory-bound; everything lives in registers (shared memory only for the
cross-warp max of one group per row).

* A *piece* is 16 bytes, one ``LDG.128``.  A thread owns 32 values (4 bf16 or 8
  fp32 pieces), every load issued before the first use.
* A group is shared by ``TPG`` consecutive lanes (2 for groups of 32 and 64, 4
  for 128) that read its pieces interleaved (lane ``r``: pieces ``r, r + TPG,
  ...``): each load instruction covers whole 32-byte sectors and the group max
  takes ``log2(TPG)`` shuffles.  A thread covers ``ROUNDS`` consecutive groups
  (``_group_layout``, also the source of the stub's thread count).
* ``lanes_per_row`` threads per row over the flat thread index (one division
  per thread), so hidden and the token count are dynamic.  Groups past a row's
  end load nothing and add 0 to the max.
* One group per row (``group = 0``): ``lanes_per_row`` = next power of two of
  ``hidden / 32`` (hidden <= 8192), a shuffle tree, then an 8-float exchange.
* bf16 max on packed pairs (``max.NaN.bf16x2`` on ``|x|``), one widening per lane:
  widening every element spilled.  Every max keeps NaN (``kernels_tl/nan_max.py``): a
  group holding a NaN gets NaN factors (UE8M0 byte 0xFF) and NaN codes.
* The slot's first lane writes the factors through the sf tensor's two strides;
  packed UE8M0 words gather their bytes from neighbouring slots (``shfl_down``).
  Runtime flags (uniform): ``write_out``, ``read_sf``, ``round_sf``, ``packed_sf``.
* e2m1: sm_100a's ``cvt.rn.satfinite.e2m1x2.f32``; elsewhere a branch-free count
  of rounding boundaries (bit-identical), chosen from the current TVM target.
* Factors only (``per_token_cast_with_sf_only``: no ``out``, no given sf) of float32 x in groups
  of 128, a read-only stream: a warp takes 8 consecutive groups of one row (the host's
  ``lanes_per_row`` is ``ceil(groups / 8) * 32``), lane ``l`` piece ``l`` of each, so each of the
  8 ``LDG.128`` of a warp reads one group's 512 contiguous bytes (whole 128-byte lines; the
  grouped layout's instructions read 64-byte halves of 8 lines).  The 8 maxima meet by a
  halving exchange (steps over lane bits 4, 3, 2 trade the half of the groups the lane does not
  keep, then bits 1, 0: 9 shuffles), after which lane ``l`` holds group ``l // 4``'s max and
  every fourth lane computes a factor; packed words gather 4 of them with ``shfl_down``.

e5m6 (one group per row): a piece is 8 values (two 16-byte loads of fp32); each value's
12-bit code is the half rounded toward zero, its top 12 bits, plus the reference's rounding
step on the float32 bits; eight codes pack into three words (``tka_e5m6_pack8``: one
``cvt.rz.f16x2.f32`` per two values, the rounding as one carry).  bf16 with a power-of-two
``sf_inv >= 1`` (round_sf, the usual case): every product's low 16 bits are zero, so the step
is ``bit 16 & lsb`` and two codes are rounded in one word (``tka_e5m6_pack8_short``).

Pre-quantized ``(q, s_in)`` (``_quantized_input_kernel``): a lane owns 16 bytes of a row (one e4m3
piece of 16 values, or two e2m1 pieces) in a fixed lane column; the grid is the blocks resident at
once, each warp walks its rows of the column two at a time and loads the next two (data and input
factors) before it works on these, so loads stay in flight while it computes.  A lane's column
(input-factor column, group, addresses in row 0) is computed once, a row's block of input factors
with a multiply-high division.  Groups of 1-8 pieces at run time.  ``max |q * s_in|`` of a piece
is the largest magnitude (e4m3: ``max.NaN`` over the f16 pairs of the codes; e2m1: three halvings
of 0..7, each one add per word) times ``|s_in|`` (``fl(|q| |s|)`` grows with ``|q|``), NaN for
``0 * inf``; with ``round_sf`` a finite group maximum gives its power-of-two factor from its own
bits, without the division.  The codes are ``encode(q * (s_in * sf_inv))``: e4m3 -> e4m3 with one
``mul.f16x2`` per pair when the factor is a power of two (products exact in f16), else value by
value; e2m1 -> e2m1 by a per-factor table of the 8 magnitudes' codes looked up with ``PRMT`` (a
power of two takes one of ten tables kept in shared memory).  One 16- or 8-byte store per piece;
factors as words or, packed UE8M0, as bytes (padding bytes 0).

Static configurations: ``in_dtype`` (bfloat16, float32) x ``fmt`` (e4m3, e2m1) x ``group``
(16, 32, 64, 128, 0); bfloat16/float32 x e5m6 x 0; pre-quantized float8_e4m3fn/int8 x
e4m3/e2m1 x 0: 26 configs.  bf16 -> e4m3, 8192 x 7168, groups of 128: 42.5 us device time on an
H200, 99% of its copy bandwidth; e5m6 54.6 us (90%) before the cheaper encoding; the
pre-quantized kernels' measurements and expectations are in ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE, bf16x2_max_nan, max_nan
from kernels_tl.quant_encoding import (PASS_CONFIGS, CLAMP_MIN, MAX_VALUE, e2m1_nibble, has_fp4_convert,  # noqa: F401
                                       scale_factors)

THREADS = 256  # per block
# Grouped configs: every thread owns 64 bytes of bf16 x (4 16-byte pieces, 32 values) or
# 128 bytes of fp32 x (8 pieces, 32 values).  One group per row: 32 elements.  (For bf16,
# 64 bytes per thread measured ~1 us faster at the prefill shape than 128: see notes.md.)
PIECES_PER_THREAD = {"bfloat16": 4, "float32": 8}
ELEMS_PER_THREAD_ROW = 32
# Launch bounds: <= 64 registers, i.e. at least 4 blocks of 256 threads per SM (no
# spills in any config; the bf16 grouped configs need ~40 and get 6).
MIN_BLOCKS_PER_SM = 4
WARP = 32
# per_token_cast_with_sf_only of float32 x in groups of 128: groups per warp (host.h: sf_only_warp_groups)
WARP_SF_GROUPS = 8

_IN_BYTES = {"bfloat16": 2, "float32": 4}
# pre-quantized inputs (data, sf): e4m3 bytes or e2m1 nibbles packed two per int8
QUANTIZED_INPUTS = ("float8_e4m3fn", "int8")


def _group_layout(in_dtype: str, group: int):
    """(TPG, PPT, ROUNDS) of a grouped config: lanes per group, pieces per thread
    per group, groups per thread.  TPG >= 2 keeps every load sector-complete."""
    piece = 16 // _IN_BYTES[in_dtype]
    pieces_per_group = group // piece
    tpg = 4 if group == 128 else 2  # group 16: 2 lanes of one bf16 piece (or two fp32 pieces) each
    ppt = pieces_per_group // tpg
    rounds = PIECES_PER_THREAD[in_dtype] // ppt
    assert tpg * ppt == pieces_per_group and rounds * ppt == PIECES_PER_THREAD[in_dtype] and 4 % rounds == 0
    return tpg, ppt, rounds


# Device helpers of the e5m6 encoding and of the pre-quantized-input kernel (CUDA, imported
# into the kernel source).  Products are __fmul_rn: one rounding, never contracted.
CAST_SOURCE = r"""
// e5m6 code of a float32 value as the reference rounds it: the half rounded toward zero
// (IEEE; NaN 0x7FFF, overflow to 0x7BFF), its top 12 bits, then a round-to-nearest-even
// step taken on the float32 bits.
__device__ __forceinline__ unsigned tka_e5m6_code(float v) {
  unsigned short h;
  asm("cvt.rz.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  unsigned code = (unsigned)h >> 4;
  code += (((code & 1u) + (__float_as_uint(v) & 0x1FFFFu)) > 0x10000u) ? 1u : 0u;
  return code & 0xFFFu;
}
// The e5m6 codes of eight float32 values (the reference's rounding, as tka_e5m6_code) packed
// into three words, first code in the high bits.  Two values share one cvt.rz.f16x2.f32.  A
// value's rounding step is taken on k = code << 17 | (its float's low 17 bits | code's lowest
// bit): (lsb + low) > 0x10000 holds exactly when (low | lsb) > 0x10000, so k + 0xFFFF carries
// the rounding into the code (bits 17..28; the bits above 28 and below 17 are dropped below).
__device__ __forceinline__ void tka_e5m6_round2(float v0, float v1, unsigned& r0, unsigned& r1) {
  unsigned h;  // v1's half in the high 16 bits, v0's in the low
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(v1), "f"(v0));
  const unsigned low = 0x1FFFFu;
  r0 = (((h << 13) & ~low) | (__float_as_uint(v0) & low) | ((h >> 4) & 1u)) + 0xFFFFu;
  r1 = (((h >> 3) & ~low) | (__float_as_uint(v1) & low) | ((h >> 20) & 1u)) + 0xFFFFu;
}
__device__ __forceinline__ void tka_e5m6_pack8(unsigned* w, float v0, float v1, float v2, float v3, float v4,
                                               float v5, float v6, float v7) {
  unsigned r0, r1, r2, r3, r4, r5, r6, r7;  // code i in bits 17..28 of r_i
  tka_e5m6_round2(v0, v1, r0, r1);
  tka_e5m6_round2(v2, v3, r2, r3);
  tka_e5m6_round2(v4, v5, r4, r5);
  tka_e5m6_round2(v6, v7, r6, r7);
  w[0] = ((r0 << 3) & 0xFFF00000u) | ((r1 >> 9) & 0x000FFF00u) | ((r2 >> 21) & 0xFFu);
  w[1] = ((r2 << 11) & 0xF0000000u) | ((r3 >> 1) & 0x0FFF0000u) | ((r4 >> 13) & 0xFFF0u) | ((r5 >> 25) & 0xFu);
  w[2] = ((r5 << 7) & 0xFF000000u) | ((r6 >> 5) & 0x00FFF000u) | ((r7 >> 17) & 0xFFFu);
}
// The same for values whose low 16 float bits are zero (bf16 x times a power of two >= 1: a
// normal result has at most 8 significant bits, a subnormal one is x's bits shifted left).
// Then the float's low 17 bits are 0 or 0x10000 and the rounding step is `bit 16 & lsb`; two
// codes travel in one word (bits 0..11 and 16..27), and code + 1 stays within 12 bits
// (non-NaN codes are at most 0xFC0).
__device__ __forceinline__ unsigned tka_e5m6_codes2_short(float v0, float v1) {
  unsigned h;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(v1), "f"(v0));
  const unsigned s = h >> 4;  // v0's code in bits 0..11, v1's in bits 16..27
  const unsigned b16 = __byte_perm(__float_as_uint(v0), __float_as_uint(v1), 0x7632);  // bit 16 of each at 0, 16
  return (s & 0x0FFF0FFFu) + (s & b16 & 0x00010001u);
}
__device__ __forceinline__ void tka_e5m6_pack8_short(unsigned* w, float v0, float v1, float v2, float v3, float v4,
                                                     float v5, float v6, float v7) {
  const unsigned c01 = tka_e5m6_codes2_short(v0, v1), c23 = tka_e5m6_codes2_short(v2, v3);
  const unsigned c45 = tka_e5m6_codes2_short(v4, v5), c67 = tka_e5m6_codes2_short(v6, v7);
  w[0] = (c01 << 20) | ((c01 >> 8) & 0x000FFF00u) | ((c23 >> 4) & 0xFFu);
  w[1] = (c23 << 28) | (c23 & 0x0FFF0000u) | ((c45 << 4) & 0xFFF0u) | ((c45 >> 24) & 0xFu);
  w[2] = ((c45 << 8) & 0xFF000000u) | ((c67 << 12) & 0x00FFF000u) | (c67 >> 16);
}
// An f16 pair -> float32 values (exact), low half first.
__device__ __forceinline__ float2 tka_f16x2_values(unsigned h) {
  float lo, hi;
  asm("{.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;}"
      : "=f"(lo), "=f"(hi) : "r"(h));
  return make_float2(lo, hi);
}
// Two e4m3 codes (low byte first) -> float32, exactly; code 0x7F / 0xFF is NaN.
__device__ __forceinline__ float2 tka_e4m3x2_values(unsigned pair) {
  unsigned h;
  unsigned short p16 = (unsigned short)(pair & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(p16));
  return tka_f16x2_values(h);
}
// Four float32 values -> four e4m3 codes (first value in the low byte), RNE, saturating
// to +-448, NaN -> 0x7F.
__device__ __forceinline__ unsigned tka_e4m3x4_codes(float v0, float v1, float v2, float v3) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  return (unsigned)lo | ((unsigned)hi << 16);
}
// FP4 value of a nibble: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 are 0.5 x the 4-bit fields
// of 0xC8643210; the nibble's bit 3 is the sign (nibble 8 is -0).
__device__ __forceinline__ float tka_e2m1_value(unsigned n) {
  float m = __fmul_rn(__uint2float_rn((0xC8643210u >> ((n & 7u) * 4u)) & 0xFu), 0.5f);
  return __uint_as_float(__float_as_uint(m) | ((n & 8u) << 28));
}
// FP4 nibble of a float32 value: round to nearest even, saturating at 6; the magnitude is
// the number of rounding boundaries at or below |v| (a tie goes to the even code), the sign
// bit is the float's.
__device__ __forceinline__ unsigned tka_e2m1_nibble(float v) {
  float a = fabsf(v);
  unsigned code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return code | ((__float_as_uint(v) >> 28) & 8u);
}
// eight e4m3 codes (two words) -> eight e2m1 nibbles
__device__ __forceinline__ unsigned tka_e4m3_to_e2m1(unsigned w0, unsigned w1, float f) {
  unsigned r = 0u;
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 v = tka_e4m3x2_values((i < 2 ? w0 : w1) >> (16 * (i & 1)));
    r |= (tka_e2m1_nibble(__fmul_rn(v.x, f)) | (tka_e2m1_nibble(__fmul_rn(v.y, f)) << 4)) << (8 * i);
  }
  return r;
}
// eight e2m1 nibbles -> eight e2m1 nibbles
__device__ __forceinline__ unsigned tka_e2m1_to_e2m1(unsigned w, float f) {
  unsigned r = 0u;
  #pragma unroll
  for (int i = 0; i < 8; ++i) r |= tka_e2m1_nibble(__fmul_rn(tka_e2m1_value(w >> (4 * i)), f)) << (4 * i);
  return r;
}
// the low four e2m1 nibbles of `w` -> four e4m3 codes
__device__ __forceinline__ unsigned tka_e2m1_to_e4m3(unsigned w, float f) {
  return tka_e4m3x4_codes(__fmul_rn(tka_e2m1_value(w), f), __fmul_rn(tka_e2m1_value(w >> 4), f),
                          __fmul_rn(tka_e2m1_value(w >> 8), f), __fmul_rn(tka_e2m1_value(w >> 12), f));
}
"""


def per_token_cast_kernel(in_dtype: str, fmt: str, group: int):
    if in_dtype in QUANTIZED_INPUTS:
        assert group == 0, "pre-quantized inputs take the group size at run time (static group 0)"
        return _quantized_input_kernel(in_dtype, fmt)
    assert in_dtype in _IN_BYTES and fmt in MAX_VALUE and group in (0, 16, 32, 64, 128)
    e5m6 = fmt == "e5m6"
    assert not e5m6 or group == 0, "e5m6 is one group per row"
    # elements per piece: one 16-byte load; e5m6 pieces are 8 elements (the 12-byte code
    # unit), two 16-byte loads of fp32
    piece = 8 if e5m6 else 16 // _IN_BYTES[in_dtype]
    load = 16 // _IN_BYTES[in_dtype]  # elements per load instruction
    per_row = group == 0
    npieces = ELEMS_PER_THREAD_ROW // piece if per_row else PIECES_PER_THREAD[in_dtype]  # pieces per thread
    if per_row:
        tpg, ppt, rounds = None, npieces, 1
    else:
        tpg, ppt, rounds = _group_layout(in_dtype, group)
    pieces_per_group = None if per_row else group // piece
    # float32 groups of 128 without `out` (per_token_cast_with_sf_only): a warp per 8 groups of a row
    warp_sf = in_dtype == "float32" and group == 128
    assert not warp_sf or npieces == WARP_SF_GROUPS

    def warp_sf_only(write_out, read_sf):
        """The factors-only layout's run-time condition (False where the config has none)."""
        return T.And(write_out == 0, read_sf == 0) if warp_sf else False
    slots_per_word = 4 // rounds  # slots whose groups share one packed UE8M0 word

    hw_fp4 = fmt == "e2m1" and has_fp4_convert()
    if fmt == "e4m3":
        out_dtype, out_width = T.float8_e4m3fn, piece
    elif e5m6:
        out_dtype, out_width = T.uint32, 3  # 8 codes of 12 bits in three words
    elif hw_fp4:
        out_dtype, out_width = T.float4_e2m1fn, piece  # TileLang packs two per byte
    else:
        out_dtype, out_width = T.uint8, piece // 2  # nibbles packed by hand

    # Where a thread's data lies.  `lane`: its index among the lanes sharing a
    # group (per row: among the row's lanes); `slot`: which run of `rounds`
    # groups of its row it covers; piece (j, k): its k-th piece of round j.
    def lane_of(lane_in_row):
        return lane_in_row if per_row else lane_in_row % tpg

    def slot_of(lane_in_row):
        return 0 if per_row else lane_in_row // tpg

    def group_of(slot, j):
        return slot * rounds + j

    def piece_of(slot, lane, j, k, lanes_per_row):
        if per_row:
            return k * lanes_per_row + lane
        return group_of(slot, j) * pieces_per_group + k * tpg + lane

    num_tokens = T.dynamic("num_tokens")
    row_pieces = T.dynamic("row_pieces")  # hidden / piece
    x_stride = T.dynamic("x_stride")  # elements between rows of x
    sf_words = T.dynamic("sf_words")  # 32-bit words of sf storage

    @T.prim_func
    def per_token_cast(
        x: T.StridedTensor[(num_tokens, row_pieces, piece), (x_stride, piece, 1), in_dtype],
        out: T.Tensor[(num_tokens, row_pieces, out_width), out_dtype],
        # fp32 factors or packed UE8M0 words, as raw 32-bit words; element
        # [row, group (or group / 4 when packed)] is at row * sf_row_stride + col * sf_col_stride.
        sf: T.Tensor[(sf_words,), T.uint32],
        lanes_per_row: T.int32,
        num_groups: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        round_sf: T.int32,
        packed_sf: T.int32,
        write_out: T.int32,
        read_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens * lanes_per_row, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            # Rows start on 16-byte boundaries (checked by the host): every piece is one vector load.
            T.assume(x_stride % load == 0)
            T.assume(lanes_per_row > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            T.import_source(DEVICE_SOURCE + CAST_SOURCE)

            xv = T.alloc_local((npieces, piece), in_dtype)
            amax = T.alloc_local((rounds,), T.float32)
            if in_dtype == "bfloat16":
                pmax = T.alloc_local((1,), T.uint32)  # running max of |x| pairs (two bf16)
                pair = T.alloc_local((2,), in_dtype)
            sf_inv = T.alloc_local((rounds,), T.float32)
            sf_bits = T.alloc_local((rounds,), T.uint32)  # fp32 factor bits, or the UE8M0 byte
            packed = T.alloc_local((out_width,), T.uint8)
            if e5m6:
                codes = T.alloc_local((3,), T.uint32)  # the three packed words of a piece
            word = T.alloc_var(T.uint32)
            if per_row:
                warp_max = T.alloc_shared((THREADS // WARP,), T.float32, scope="shared")
            if warp_sf:
                wmax = T.alloc_local((WARP_SF_GROUPS,), T.float32)  # factors only: maxima of the warp's groups
                wsend = T.alloc_local((1,), T.float32)
                wpart = T.alloc_local((1,), T.uint32)

            # one 32-bit division per thread; the indices below derive from these two
            row = T.alloc_var(T.int32)
            lane_in_row = T.alloc_var(T.int32)
            row = (bid * THREADS + tid) // lanes_per_row
            lane_in_row = (bid * THREADS + tid) - row * lanes_per_row
            lane = lane_of(lane_in_row)
            slot = slot_of(lane_in_row)
            row_ok = row < num_tokens

            if warp_sf_only(write_out, read_sf):
                # ---- factors only, float32 groups of 128 (WARP_SF_GROUPS): a warp reads 8 groups of
                # one row, one 16-byte piece of each per lane, so each load instruction of the warp
                # covers one group's 512 contiguous bytes (4 whole lines)
                wslot = lane_in_row // WARP  # the warp's run of WARP_SF_GROUPS groups in the row
                wl = tid % WARP
                for j in T.unroll(WARP_SF_GROUPS):
                    wp = (wslot * WARP_SF_GROUPS + j) * WARP + wl  # piece wl of the group
                    if row_ok and wp < row_pieces:
                        for u in T.vectorized(piece):
                            xv[j, u] = x[row, wp, u]
                    else:
                        for u in T.unroll(piece):
                            xv[j, u] = T.cast(0, in_dtype)
                # the lane's max of each group, then a halving exchange: after the step over lane
                # bit 4 (3, 2) a lane keeps the groups whose index bit 2 (1, 0) equals that lane
                # bit and takes its partner's maxima of them; two more steps finish the warp.  Lane
                # l ends with the max of group l // 4 over all 32 lanes.
                for j in T.unroll(WARP_SF_GROUPS):
                    wmax[j] = max_nan(max_nan(T.abs(xv[j, 0]), T.abs(xv[j, 1])),
                                      max_nan(T.abs(xv[j, 2]), T.abs(xv[j, 3])))
                for st in T.unroll(3):
                    half = WARP_SF_GROUPS >> (st + 1)  # groups kept after this step
                    upper = ((wl >> (4 - st)) & 1) != 0
                    for k in T.unroll(half):
                        wsend[0] = T.if_then_else(upper, wmax[k], wmax[k + half])
                        wmax[k] = max_nan(T.if_then_else(upper, wmax[k + half], wmax[k]),
                                          T.shfl_xor(wsend[0], 16 >> st))
                for st in T.unroll(2):
                    wmax[0] = max_nan(wmax[0], T.shfl_xor(wmax[0], 2 >> st))
                amax[0] = wmax[0]
                scale_factors(amax, fmt, round_sf, packed_sf, sf_bits, sf_inv, 0)
                wg = wslot * WARP_SF_GROUPS + wl // 4  # the lane's group
                if packed_sf != 0:
                    # word (wl // 16) of the warp's two: bytes from lanes 16 w + 4 t, t = 0..3
                    word = T.if_then_else(wg < num_groups, sf_bits[0] << T.Cast("uint32", 8 * (wg % 4)), T.uint32(0))
                    wpart[0] = word
                    for m in T.unroll(1, 4):
                        word = word | T.shfl_down(wpart[0], 4 * m)
                    if row_ok and wl % 16 == 0 and wg < num_groups:
                        sf[row * sf_row_stride + (wg // 4) * sf_col_stride] = word
                else:
                    if row_ok and wl % 4 == 0 and wg < num_groups:
                        sf[row * sf_row_stride + wg * sf_col_stride] = sf_bits[0]
            else:
                # ---- load: all pieces first, so that every load is in flight before the first use
                for j in T.unroll(rounds):
                    for k in T.unroll(ppt):
                        if row_ok and piece_of(slot, lane, j, k, lanes_per_row) < row_pieces:
                            for h in T.unroll(piece // load):
                                for u in T.vectorized(load):
                                    xv[j * ppt + k, h * load + u] = x[row, piece_of(slot, lane, j, k, lanes_per_row), h * load + u]
                        else:
                            for u in T.unroll(piece):
                                xv[j * ppt + k, u] = T.cast(0, in_dtype)

                # ---- group max: in registers, then across the lanes sharing the group
                for j in T.unroll(rounds):
                    if in_dtype == "bfloat16":
                        # bf16 pairs stay packed: a NaN-keeping max on |x| (exact, like the fp32 one),
                        # one widening per lane at the end.  Widening every element to fp32
                        # here let the compiler keep 64 fp32 copies alive for the scaling (spills).
                        pmax[0] = T.reinterpret(T.abs2(xv[j * ppt, T.Ramp(0, 1, 2)]), T.uint32)
                        for i in T.unroll(1, ppt * piece // 2):
                            pmax[0] = bf16x2_max_nan(pmax[0], T.reinterpret(
                                T.abs2(xv[j * ppt + 2 * i // piece, T.Ramp(2 * i % piece, 1, 2)]), T.uint32))
                        pair[T.Ramp(0, 1, 2)] = T.reinterpret(pmax[0], "bfloat16x2")
                        amax[j] = max_nan(T.cast(pair[0], T.float32), T.cast(pair[1], T.float32))
                    else:
                        amax[j] = T.float32(0)
                        for i in T.unroll(ppt * piece):
                            amax[j] = max_nan(amax[j], T.abs(xv[j * ppt + i // piece, i % piece]))
                if per_row:
                    for s in T.unroll(5):
                        if (1 << s) < lanes_per_row:
                            amax[0] = max_nan(amax[0], T.shfl_xor(amax[0], 1 << s))
                    if lanes_per_row > WARP:
                        # rows wider than a warp: exchange the warp maxima (uniform branch)
                        if tid % WARP == 0:
                            warp_max[tid // WARP] = amax[0]
                        T.sync_threads()
                        warps_per_row = lanes_per_row // WARP
                        first = (tid // WARP) - (tid // WARP) % warps_per_row
                        amax[0] = warp_max[first]
                        for w in T.unroll(1, THREADS // WARP):
                            if w < warps_per_row:
                                amax[0] = max_nan(amax[0], warp_max[first + w])
                else:
                    for j in T.unroll(rounds):
                        for s in T.unroll(tpg.bit_length() - 1):
                            amax[j] = max_nan(amax[j], T.shfl_xor(amax[j], 1 << s))

                # ---- factors
                for j in T.unroll(rounds):
                    if read_sf != 0:
                        sf_inv[j] = T.float32(1)
                        if row_ok and group_of(slot, j) < num_groups:
                            given = T.reinterpret(
                                sf[row * sf_row_stride + group_of(slot, j) * sf_col_stride], T.float32)
                            sf_inv[j] = T.float32(1) / given
                    else:
                        scale_factors(amax, fmt, round_sf, packed_sf, sf_bits, sf_inv, j)

                # ---- store the factors: one 32-bit word per group (fp32) or per 4 groups (UE8M0)
                if read_sf == 0:
                    if packed_sf != 0:
                        word = T.uint32(0)
                        for j in T.unroll(rounds):
                            if group_of(slot, j) < num_groups:
                                word = word | (sf_bits[j] << T.uint32(8 * ((group_of(slot, j)) % 4)))
                        if not per_row:
                            # the slots of one word are consecutive lanes of this warp: gather their bytes
                            part = word
                            for m in T.unroll(1, slots_per_word):
                                word = word | T.shfl_down(part, m * tpg)
                        if row_ok and lane == 0 and slot % slots_per_word == 0 and group_of(slot, 0) < num_groups:
                            sf[row * sf_row_stride + (group_of(slot, 0) // 4) * sf_col_stride] = word
                    else:
                        for j in T.unroll(rounds):
                            if row_ok and lane == 0 and group_of(slot, j) < num_groups:
                                sf[row * sf_row_stride + group_of(slot, j) * sf_col_stride] = sf_bits[j]

                # ---- quantize and store
                if write_out != 0:
                    for j in T.unroll(rounds):
                        for k in T.unroll(ppt):
                            if row_ok and piece_of(slot, lane, j, k, lanes_per_row) < row_pieces:
                                if e5m6:
                                    # eight 12-bit codes, first in the high bits, in three words
                                    vals = [T.cast(xv[j * ppt + k, u], T.float32) * sf_inv[j] for u in range(piece)]
                                    if in_dtype == "bfloat16":
                                        # sf_inv a finite power of two >= 1 (round_sf, amax <= MAX): every
                                        # product's low 16 bits are zero (uniform per row)
                                        sfb = T.reinterpret(sf_inv[j], T.uint32)
                                        if (sfb & T.uint32(0x7FFFFF)) == T.uint32(0) and sfb >= T.uint32(0x3F800000) \
                                                and sfb < T.uint32(0x7F800000):
                                            T.evaluate(T.call_extern("void", "tka_e5m6_pack8_short", T.address_of(codes[0]), *vals))
                                        else:
                                            T.evaluate(T.call_extern("void", "tka_e5m6_pack8", T.address_of(codes[0]), *vals))
                                    else:
                                        T.evaluate(T.call_extern("void", "tka_e5m6_pack8", T.address_of(codes[0]), *vals))
                                    p_out = piece_of(slot, lane, j, k, lanes_per_row)
                                    for u in T.unroll(3):
                                        out[row, p_out, u] = codes[u]
                                elif fmt == "e4m3" or hw_fp4:
                                    for u in T.vectorized(piece):
                                        out[row, piece_of(slot, lane, j, k, lanes_per_row), u] = T.cast(
                                            T.cast(xv[j * ppt + k, u], T.float32) * sf_inv[j], out_dtype)
                                else:
                                    for b in T.unroll(out_width):
                                        lo = e2m1_nibble(T.cast(xv[j * ppt + k, 2 * b], T.float32) * sf_inv[j])
                                        hi = e2m1_nibble(T.cast(xv[j * ppt + k, 2 * b + 1], T.float32) * sf_inv[j])
                                        packed[b] = T.cast(lo | (hi << T.uint32(4)), T.uint8)
                                    for b in T.vectorized(out_width):
                                        out[row, piece_of(slot, lane, j, k, lanes_per_row), b] = packed[b]

    return per_token_cast


# Pre-quantized input: a piece is 16 values (16 e4m3 bytes or 8 e2m1 bytes).  A lane owns
# QUANT_PPL pieces of a row (16 bytes: one e4m3 piece, or two adjacent e2m1 pieces) in a fixed
# lane column (32 lanes of grid column blockIdx.y), so every load instruction of a warp reads 512
# contiguous bytes.  The grid is the blocks resident at once (the host: QUANT_BLOCKS_PER_SM per SM
# over the columns): warp w of block (bx, by) takes rows r0 = 8 bx + w, r0 + G, r0 + 2 G, ...
# (G = 8 gridDim.x) of its column, QUANT_STEP_ROWS of them per step, and loads the next step's
# rows (data and input factors, 32 bytes a thread) before it works on this step's, so that every
# warp keeps loads in flight while it computes (a one-shot thread waits for all its loads, then
# computes with none in flight).
QUANT_PPL = {"float8_e4m3fn": 1, "int8": 2}  # pieces per lane
QUANT_STEP_ROWS = 2  # rows of a warp per step: 32 bytes a thread in flight while it works on 32
# Resident blocks per SM (the launch bounds): the registers of two steps of buffers and the row
# work; the e2m1 pieces' work needs more than 64 (4 blocks would spill).
QUANT_BLOCKS_PER_SM = {"float8_e4m3fn": 4, "int8": 3}
_QUANT_WORDS = {"float8_e4m3fn": 4, "int8": 2, "e4m3": 4, "e2m1": 2}  # 32-bit words per 16 values


def fast_div_params(d: int) -> tuple:
    """(mul, shift) with ``n // d == (umulhi(n, mul) + n) >> shift`` for 0 <= n < 2**31 and
    1 <= d < 2**31 (round-up reciprocal; ``tka_fast_div``).  host.h computes the same."""
    shift = (d - 1).bit_length()  # ceil(log2(d))
    mul = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return mul & 0xFFFFFFFF, shift


QUANT_SOURCE = r"""
// A lane's place in row 0 of a tensor (`p` plus `bytes`) as an integer, kept per thread: it goes
// through a shuffle with the lane itself, so that the compiler holds it in registers rather than
// derive it again inside the row loop; and the same place `row` rows further for a row stride of
// `stride` bytes (below 2**31: one wide multiply-add)
__device__ __forceinline__ unsigned long long tka_addr(const void* p, unsigned bytes) {
  return __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(p) + bytes, threadIdx.x & 31u);
}
__device__ __forceinline__ unsigned* tka_at(unsigned long long base, int row, int stride) {
  return reinterpret_cast<unsigned*>(base + static_cast<unsigned long long>(static_cast<unsigned>(row)) *
                                                static_cast<unsigned>(stride));
}
// A lane's 16 bytes of a row (one e4m3 piece)
__device__ __forceinline__ void tka_load_x4(unsigned* dst, unsigned long long base, int row, int stride) {
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "l"(tka_at(base, row, stride)));
}
// A lane's two adjacent 8-byte pieces of a row into dst[0..3]: one 16-byte load when they are
// 16-byte aligned, else two 8-byte loads (rows that start 8-byte aligned only); without `second`
// (a row's last, odd piece) the first only, dst[2..3] = 0
__device__ __forceinline__ void tka_load_pair(unsigned* dst, unsigned long long base, int row, int stride, bool second) {
  const unsigned* p = tka_at(base, row, stride);
  if (second && (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
    asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "l"(p));
  } else {
    asm("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(dst[0]), "=r"(dst[1]) : "l"(p));
    dst[2] = 0u;
    dst[3] = 0u;
    if (second) asm("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(dst[2]), "=r"(dst[3]) : "l"(p + 2));
  }
}
__device__ __forceinline__ unsigned tka_load_word(unsigned long long base, int row, int stride) {
  unsigned v;
  asm("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(tka_at(base, row, stride)));
  return v;
}
// One piece's codes as one 16-byte or 8-byte store, or a lane's two e2m1 pieces (16 bytes when
// aligned); a struct store of uint4 is split into four 4-byte stores by the compiler, PTX is not
__device__ __forceinline__ void tka_store_x4(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void tka_store_x2(void* p, unsigned a, unsigned b) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void tka_store_row_x4(unsigned long long base, int row, int stride, unsigned a, unsigned b,
                                                 unsigned c, unsigned d) {
  tka_store_x4(tka_at(base, row, stride), a, b, c, d);
}
__device__ __forceinline__ void tka_store_row_x2(unsigned long long base, int row, int stride, unsigned a, unsigned b) {
  tka_store_x2(tka_at(base, row, stride), a, b);
}
__device__ __forceinline__ void tka_store_pair(unsigned long long base, int row, int stride, unsigned a, unsigned b,
                                               unsigned c, unsigned d, bool second) {
  unsigned* p = tka_at(base, row, stride);
  if (second && (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull) {
    tka_store_x4(p, a, b, c, d);
  } else {
    tka_store_x2(p, a, b);
    if (second) tka_store_x2(p + 2, c, d);
  }
}
// A group's factor into the sf grid: the fp32 word, or with `packed` the UE8M0 byte (`base` is
// then the address of the byte in row 0)
__device__ __forceinline__ void tka_store_factor(unsigned long long base, int row, int stride, unsigned bits,
                                                 int packed) {
  unsigned* p = tka_at(base, row, stride);
  if (packed != 0) {
    asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "h"(static_cast<unsigned short>(bits & 0xFFu)) : "memory");
  } else {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
  }
}
// n / d for 0 <= n < 2**31 with the host's (mul, shift) of d (host.h; kernel.py: fast_div_params)
__device__ __forceinline__ int tka_fast_div(int n, int mul, int shift) {
  return (int)((__umulhi((unsigned)n, (unsigned)mul) + (unsigned)n) >> shift);
}
// An input factor from its raw x_sf word: the float32 itself, or with `packed` the UE8M0 byte
// at bit `shift` as a float32 exponent field (byte 0 gives 0.0)
__device__ __forceinline__ float tka_input_factor(unsigned raw, unsigned shift, int packed) {
  return __uint_as_float(packed != 0 ? ((raw >> shift) & 0xFFu) << 23 : raw);
}
// A group's factor from its maximum, as the reference's scale_factors_from_amax for the format's
// MAX = max_value: c = max(amax, clamp) (NaN kept), sf = c / MAX, sf_inv = MAX / c (IEEE
// divisions).  With round_sf and a finite c, sf = 2**e, e = ceil(log2(sf)), sf_inv = 2**-e, e
// from c's bits alone: c / MAX rounded to float32 lands on a power of two from above only within
// half an ulp of it, which no float c reaches (MAX has 3 significant bits), so e is c's exponent
// less MAX's, plus one where c's mantissa field exceeds MAX's (checked for every float32 c).
// *bits: the fp32 factor, or with `packed` its UE8M0 byte (0xFF for a NaN or infinite c).
__device__ __forceinline__ float tka_group_factor(float amax, float max_value, float clamp, int round_sf, int packed,
                                                  unsigned* bits) {
  const float c = tka_max_nan(amax, clamp);
  const unsigned cb = __float_as_uint(c), mb = __float_as_uint(max_value);
  if (round_sf != 0 && cb < 0x7F800000u) {
    const unsigned e = ((cb + (0x7FFFFFu - (mb & 0x7FFFFFu))) >> 23) - ((mb >> 23) - 127u);  // biased
    *bits = packed != 0 ? e : e << 23;
    return __uint_as_float((254u - e) << 23);
  }
  const unsigned sf = __float_as_uint(__fdiv_rn(c, max_value));
  *bits = round_sf != 0 && packed != 0 ? 0xFFu : sf;
  return __fdiv_rn(max_value, c);
}
// Four e4m3 codes -> two f16 pairs, exactly (0x7F / 0xFF: NaN): codes 0, 1 in h[0], 2, 3 in h[1]
__device__ __forceinline__ void tka_e4m3x4_f16x2(unsigned w, unsigned* h) {
  asm("{.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;}"
      : "=r"(h[0]), "=r"(h[1]) : "r"(w));
}
// max |q_i * s| of a piece of 16 e4m3 codes held as 8 f16 pairs, as the reference takes it value
// by value (NaN-keeping): fl(|q| |s|) grows with |q|, so the largest |q| (max.NaN over |h|) times
// |s|, except that 0 * inf is NaN
__device__ __forceinline__ float tka_e4m3_piece_amax(const unsigned* h, float s) {
  unsigned m[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i)
    asm("{.reg .b32 x, y;\n\tabs.f16x2 x, %1;\n\tabs.f16x2 y, %2;\n\tmax.NaN.f16x2 %0, x, y;}"
        : "=r"(m[i]) : "r"(h[2 * i]), "r"(h[2 * i + 1]));
  asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(m[0]) : "r"(m[1]));
  asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(m[2]) : "r"(m[3]));
  asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(m[0]) : "r"(m[2]));
  const float2 q = tka_f16x2_values(m[0]);
  const float a = __fmul_rn(tka_max_nan(q.x, q.y), fabsf(s));
  if (isinf(s)) {
    #pragma unroll
    for (int i = 0; i < 8; ++i)
      if ((h[i] & 0x7FFFu) == 0u || (h[i] & 0x7FFF0000u) == 0u) return __uint_as_float(0x7FFFFFFFu);
  }
  return a;
}
// The e4m3 codes of q_i * f of a piece (8 f16 pairs) into r[0..3].  |f| a power of two in
// [2**-14, 2**5]: every product is exact in f16 (|q| <= 448 is a multiple of 2**-9, the f16 grid
// is 2**-24 and the largest product 448 * 32 is finite), so one mul.f16x2 per pair and the
// saturating convert give the reference's codes; any other f value by value in float32.
__device__ __forceinline__ void tka_e4m3_piece_codes(const unsigned* h, float f, unsigned* r) {
  const unsigned b = __float_as_uint(f) & 0x7FFFFFFFu;
  if ((b & 0x7FFFFFu) == 0u && b - 0x38800000u <= 0x42000000u - 0x38800000u) {
    unsigned f2;
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(f2) : "f"(f));
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      unsigned short lo, hi;
      asm("{.reg .b32 p;\n\tmul.rn.f16x2 p, %1, %2;\n\tcvt.rn.satfinite.e4m3x2.f16x2 %0, p;}" : "=h"(lo) : "r"(h[2 * i]), "r"(f2));
      asm("{.reg .b32 p;\n\tmul.rn.f16x2 p, %1, %2;\n\tcvt.rn.satfinite.e4m3x2.f16x2 %0, p;}" : "=h"(hi) : "r"(h[2 * i + 1]), "r"(f2));
      r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
  } else {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = tka_f16x2_values(h[2 * i]), b2 = tka_f16x2_values(h[2 * i + 1]);
      r[i] = tka_e4m3x4_codes(__fmul_rn(a.x, f), __fmul_rn(a.y, f), __fmul_rn(b2.x, f), __fmul_rn(b2.y, f));
    }
  }
}
// The e2m1 code (0..7) of a value a >= 0 (or +inf): round to nearest even, saturating at 6.
// min(a, 6) = K + s * t with t = rne(a / s) for the binade's step s (0.5 below 2, 1 below 4,
// else 2): one rounding of the exact a / s + (2**23 + K / s) by the fused multiply-add, whose
// low mantissa bits are then the code (ties to even: K / s is even).
__device__ __forceinline__ unsigned tka_e2m1_code(float a) {
  a = fminf(a, 6.0f);
  const float scale = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float bias = a < 2.0f ? 8388608.0f : (a < 4.0f ? 8388610.0f : 8388612.0f);
  return __float_as_uint(__fmaf_rn(a, scale, bias)) - 0x4B000000u;
}
// Re-encoding e2m1 codes times a finite f by lookup: byte m of the table is the code of
// fl(|m| |f|) for the magnitude m (0, 0.5, 1, 1.5, 2, 3, 4, 6); fl(-a f) = -fl(a f) (and the
// product of a zero keeps the sign rule), so a code's sign is its input sign xor f's.
__device__ __forceinline__ unsigned long long tka_e2m1_table(float f) {
  float a = fabsf(f);
  unsigned lo = (tka_e2m1_code(__fmul_rn(0.5f, a)) << 8) | (tka_e2m1_code(a) << 16) |
                (tka_e2m1_code(__fmul_rn(1.5f, a)) << 24);
  unsigned hi = tka_e2m1_code(__fmul_rn(2.0f, a)) | (tka_e2m1_code(__fmul_rn(3.0f, a)) << 8) |
                (tka_e2m1_code(__fmul_rn(4.0f, a)) << 16) | (tka_e2m1_code(__fmul_rn(6.0f, a)) << 24);
  return ((unsigned long long)hi << 32) | lo;
}
// f is finite and >= +0 (its sign bit clear)
__device__ __forceinline__ bool tka_finite_nonnegative(float f) { return __float_as_uint(f) < 0x7F800000u; }
// The table of a finite f >= +0.  A power of two 2**k (UE8M0 input factors with round_sf, the usual
// case) takes one of the block's ten tables in shared memory, `tables[k + 5]` for k = -5 .. 4
// (made by tka_e2m1_table at the start): below 2**-5 (any f, its exponent field below 122) every
// product, at most 6 f, rounds to 0 as with k = -5, and from k = 4 on every nonzero magnitude
// saturates, so the exponent is clamped to that range.
__device__ __forceinline__ unsigned long long tka_e2m1_table_of(float f, const void* tables) {
  const unsigned b = __float_as_uint(f), e = b >> 23;
  if ((b & 0x7FFFFFu) == 0u || e < 122u)
    return static_cast<const unsigned long long*>(tables)[min(max((int)e - 122, 0), 9)];
  return tka_e2m1_table(f);
}
// Magnitudes of e2m1 nibbles: x = w & 0x77777777.  Whether some magnitude of the n words x[0 .. n)
// is >= t (1 <= t <= 7): x + (8 - t) in every nibble carries into its bit 3 exactly there (at most
// 7 + 7, no carry between nibbles).
__device__ __forceinline__ bool tka_e2m1_any_ge(const unsigned* x, int n, unsigned t) {
  const unsigned k = (8u - t) * 0x11111111u;
  unsigned a = 0u;
  #pragma unroll
  for (int i = 0; i < n; ++i) a |= x[i] + k;
  return (a & 0x88888888u) != 0u;
}
// max |q_i * s| of the e2m1 codes of n words with magnitudes x[0 .. n), as the reference takes it
// value by value (NaN-keeping): fl(|q| |s|) grows with |q|, so the largest magnitude m (three
// halvings of 0..7) times |s|, except that 0 * inf is NaN (a zero magnitude: a nibble below 1)
__device__ __forceinline__ float tka_e2m1_amax(const unsigned* x, int n, float s) {
  const unsigned t2 = tka_e2m1_any_ge(x, n, 4u) ? 6u : 2u;
  const unsigned t3 = tka_e2m1_any_ge(x, n, t2) ? t2 + 1u : t2 - 1u;
  const unsigned m = tka_e2m1_any_ge(x, n, t3) ? t3 : t3 - 1u;
  // its value: 2**(m / 2 - 1) * (1 + (m % 2) / 2) for m >= 2, 0.5 and 0 below
  const float q = __uint_as_float(m >= 2u ? (m << 22) + 0x3F000000u : (m == 1u ? 0x3F000000u : 0u));
  if (isinf(s)) {
    #pragma unroll
    for (int i = 0; i < n; ++i)
      if (((x[i] + 0x77777777u) & 0x88888888u) != 0x88888888u) return __uint_as_float(0x7FFFFFFFu);
  }
  return __fmul_rn(q, fabsf(s));
}
// Eight e2m1 nibbles (word w, magnitudes x) -> the codes of q_i * f for a finite f >= +0 by its
// table: byte m of the table is a magnitude's code (PRMT reads four selectors from the low 16
// bits: nibbles 0..3 from x, 4..7 from x >> 16), each code keeps its input's sign
__device__ __forceinline__ unsigned tka_e2m1_lookup(unsigned w, unsigned x, unsigned long long table) {
  const unsigned t0 = (unsigned)table, t1 = (unsigned)(table >> 32);
  unsigned lo = __byte_perm(t0, t1, x);        // codes of nibbles 0..3, one per byte
  unsigned hi = __byte_perm(t0, t1, x >> 16);  // nibbles 4..7
  lo += lo >> 4;  // bytes 0 and 2 hold two codes each
  hi += hi >> 4;
  return __byte_perm(lo, hi, 0x6420u) | (w & 0x88888888u);
}
"""


def _quantized_input_kernel(in_dtype: str, fmt: str):
    """Re-quantize ``(q, s_in)`` per token: ``v = q * s_in`` (``s_in`` over ``x_block_size``
    blocks, any sf form), ``amax`` per group of ``v``, factors as for a plain input, and
    ``out = encode(q * (s_in * sf_inv))``.  The group size is a run-time value: a group is
    ``group_pieces`` (1, 2, 4 or 8) consecutive pieces, i.e. ``group_pieces / QUANT_PPL`` lanes or
    (group 16 of e2m1 pieces) half a lane.  A thread's lane column (its input-factor columns,
    groups, addresses in row 0) is fixed; per row it takes one multiply-high division (the row's
    block of input factors).  ``row_grid`` (gridDim.x) blocks share a column and step through its
    rows (the comment above QUANT_PPL)."""
    assert fmt in ("e4m3", "e2m1")
    ppl = QUANT_PPL[in_dtype]
    step = QUANT_STEP_ROWS
    warps = THREADS // WARP
    in_words, out_words = _QUANT_WORDS[in_dtype], _QUANT_WORDS[fmt]
    e4m3_in = in_dtype == "float8_e4m3fn"
    max_value, clamp = T.float32(MAX_VALUE[fmt]), T.float32(CLAMP_MIN[fmt])

    num_tokens = T.dynamic("num_tokens")
    row_pieces = T.dynamic("row_pieces")  # hidden / 16
    x_stride = T.dynamic("x_stride")  # 32-bit words between rows of the data
    sf_words = T.dynamic("sf_words")
    x_sf_words = T.dynamic("x_sf_words")

    @T.macro
    def group_factor(amax, sf_inv, sf_bits, sf_at, sf_lead, sf_keep, k, row, num_tokens, round_sf, packed_sf,
                     sf_row_stride):
        """Group k's factor of the lane (sf_inv[k], sf_bits[k]) and its store by the group's first
        lane."""
        sf_inv[k] = T.call_extern(T.float32, "tka_group_factor", amax[k], max_value, clamp, round_sf, packed_sf,
                                  T.address_of(sf_bits[k]))
        if row < num_tokens and sf_lead[k] != 0:
            T.evaluate(T.call_extern("void", "tka_store_factor", sf_at[k], row, sf_row_stride * 4,
                                     T.if_then_else(sf_keep[k] != 0, sf_bits[k], T.uint32(0)), packed_sf))

    @T.macro
    def load_step(w, raw, rows, x_at, x_sf_at, lane_ok, second, split, pair16, block_rows_mul, block_rows_shift,
                  x_sf_row_bytes):
        """The data and raw input factors of `step` rows (rows[r]; rows past the end and lanes
        past a row load nothing)."""
        for r in T.unroll(step):
            if rows[r] < num_tokens and lane_ok:
                if ppl == 1 or pair16:
                    T.evaluate(T.call_extern("void", "tka_load_x4", T.address_of(w[r, 0]), x_at, rows[r], x_stride * 4))
                else:
                    T.evaluate(T.call_extern("void", "tka_load_pair", T.address_of(w[r, 0]), x_at, rows[r], x_stride * 4,
                                             second))
                brow = T.call_extern(T.int32, "tka_fast_div", rows[r], block_rows_mul, block_rows_shift)
                raw[r, 0] = T.call_extern(T.uint32, "tka_load_word", x_sf_at[0], brow, x_sf_row_bytes)
                if ppl == 2:
                    if split:  # the lane's second piece has its own input factor
                        raw[r, 1] = T.call_extern(T.uint32, "tka_load_word", x_sf_at[1], brow, x_sf_row_bytes)

    @T.prim_func
    def per_token_cast_quantized(
        x: T.StridedTensor[(num_tokens, row_pieces, in_words), (x_stride, in_words, 1), T.uint32],
        x_sf: T.Tensor[(x_sf_words,), T.uint32],  # fp32 factors or packed UE8M0 words of the input
        out: T.Tensor[(num_tokens, row_pieces, out_words), T.uint32],
        sf: T.Tensor[(sf_words,), T.uint32],
        lanes_per_row: T.int32,  # row_pieces padded to whole groups (packed: whole words of 4 groups)
        group_pieces: T.int32,  # pieces per group: 1, 2, 4 or 8
        group_shift: T.int32,  # log2(group_pieces)
        num_groups: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        round_sf: T.int32,
        packed_sf: T.int32,
        block_rows_mul: T.int32,  # x_block_size[0] as fast_div_params (mul as 32 raw bits)
        block_rows_shift: T.int32,
        block_pieces: T.int32,  # x_block_size[1] / 16
        x_sf_row_stride: T.int32,
        x_sf_col_stride: T.int32,
        x_sf_packed: T.int32,
        row_grid: T.int32,  # blocks per lane column (the host: the resident blocks over the columns)
    ):
        with T.Kernel(row_grid, T.ceildiv(lanes_per_row, WARP * ppl), threads=THREADS) as (bx, by):
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            T.assume(x_stride % in_words == 0)
            T.assume(block_pieces > 0)
            T.annotate_min_blocks_per_sm(QUANT_BLOCKS_PER_SM[in_dtype])
            T.import_source(DEVICE_SOURCE + CAST_SOURCE + QUANT_SOURCE)

            w = T.alloc_local((step, 4), T.uint32)  # this step's rows: the lane's 16 bytes of each
            w_next = T.alloc_local((step, 4), T.uint32)  # the next step's, loading meanwhile
            raw = T.alloc_local((step, ppl), T.uint32)  # raw input factors of the lane's pieces
            raw_next = T.alloc_local((step, ppl), T.uint32)
            rows = T.alloc_local((step,), T.int32)  # rows of the next step
            h = T.alloc_local((8,), T.uint32)  # e4m3 data: the piece as f16 pairs
            s_in = T.alloc_local((ppl,), T.float32)
            amax = T.alloc_local((ppl,), T.float32)
            sf_inv = T.alloc_local((ppl,), T.float32)
            sf_bits = T.alloc_local((ppl,), T.uint32)
            res = T.alloc_local((4,), T.uint32)
            blocks = T.alloc_local((ppl,), T.int32)
            x_sf_shift = T.alloc_local((ppl,), T.uint32)  # packed input factors: the byte's bit offset
            x_sf_at = T.alloc_local((ppl,), T.uint64)  # the input factors' word of the lane's pieces, row 0
            sf_at = T.alloc_local((ppl,), T.uint64)  # the factor's word (packed: byte) of the lane's groups
            sf_lead = T.alloc_local((ppl,), T.int32)  # the lane stores the group's factor (a byte of it)
            sf_keep = T.alloc_local((ppl,), T.int32)  # the group is in the row (else a padding byte, 0)
            if not e4m3_in:
                mx = T.alloc_local((4,), T.uint32)  # e2m1 data: the words' magnitudes (w & 0x77777777)
                if fmt == "e2m1":
                    table = T.alloc_local((ppl,), T.uint64)
                    pow2_tables = T.alloc_shared((10,), T.uint64)  # tka_e2m1_table_of
            first = T.alloc_var(T.int32)
            row = T.alloc_var(T.int32)
            x_at = T.alloc_var(T.uint64)  # the lane's data in row 0
            out_at = T.alloc_var(T.uint64)  # the lane's codes in row 0

            # ---- the thread's lane column: its pieces, their input-factor columns, groups
            first = (by * WARP + tid % WARP) * ppl  # first piece of the lane
            lane_ok = first < row_pieces
            second = first + 1 < row_pieces  # (two pieces) the lane's second piece is in the row
            x_at = T.call_extern(T.uint64, "tka_addr", T.address_of(x[0, first, 0]), T.uint32(0))
            out_at = T.call_extern(T.uint64, "tka_addr", T.address_of(out[0, first, 0]), T.uint32(0))
            for k in T.unroll(ppl):
                blocks[k] = (first + k) // block_pieces  # the thread's divisions (32-bit)
                # input factor of a row of blocks: column `block`, or packed UE8M0 byte block % 4
                # of column block // 4
                x_sf_shift[k] = T.if_then_else(x_sf_packed != 0, T.Cast("uint32", (blocks[k] & 3) * 8), T.uint32(0))
                x_sf_at[k] = T.call_extern(T.uint64, "tka_addr", T.address_of(x_sf[T.if_then_else(
                    x_sf_packed != 0, blocks[k] >> 2, blocks[k]) * x_sf_col_stride]), T.uint32(0))
                # the group's factor: the group's first lane stores it, packed UE8M0 as byte g % 4 of
                # word g // 4, also for the groups past the row that fill the row's last word (0)
                g = (first + k) >> group_shift
                sf_at[k] = T.call_extern(T.uint64, "tka_addr", T.address_of(sf[T.if_then_else(
                    packed_sf != 0, g >> 2, g) * sf_col_stride]), T.if_then_else(packed_sf != 0, T.Cast("uint32", g & 3),
                                                                                 T.uint32(0)))
                sf_keep[k] = T.Cast("int32", g < num_groups)
                sf_lead[k] = T.Cast("int32", T.And(((first + k) & (group_pieces - 1)) == 0,
                                                   T.Or(g < num_groups, T.And(packed_sf != 0, g < ((num_groups + 3) >> 2) * 4))))
            split = T.And(second, blocks[ppl - 1] != blocks[0])  # (two pieces) two input factors
            # (two pieces) both in the row and every row's two 16-byte aligned: one vector each
            pair16 = T.And(second, x_stride % 4 == 0)
            out16 = T.And(second, T.And(row_pieces % 2 == 0, (out_at & T.uint64(15)) == T.uint64(0)))
            # lanes of a group: shuffle masks 1, 2, 4 below that count, else 0 (a lane with itself)
            group_mask = T.max(group_pieces // ppl, 1) - 1
            if not e4m3_in and fmt == "e2m1":
                if tid < 10:
                    pow2_tables[tid] = T.call_extern(T.uint64, "tka_e2m1_table", T.call_extern(
                        T.float32, "ldexpf", T.float32(1), tid - 5))
                T.sync_threads()

            # ---- rows: warp w of block bx takes rows 8 bx + w + j * 8 row_grid, `step` at a time;
            # every warp of a block runs the same steps (uniform shuffles), rows past the end
            # are computed on stale registers and neither loaded nor stored
            for r in T.unroll(step):
                rows[r] = bx * warps + tid // WARP + r * row_grid * warps
                for u in T.unroll(4):
                    w_next[r, u] = T.uint32(0)
                for k in T.unroll(ppl):
                    raw_next[r, k] = T.uint32(0)
            load_step(w_next, raw_next, rows, x_at, x_sf_at, lane_ok, second, split, pair16, block_rows_mul,
                      block_rows_shift, x_sf_row_stride * 4)
            for s in T.serial(T.ceildiv(T.ceildiv(num_tokens - bx * warps, row_grid * warps), step)):
                for r in T.unroll(step):
                    for u in T.unroll(4):
                        w[r, u] = w_next[r, u]
                    for k in T.unroll(ppl):
                        raw[r, k] = raw_next[r, k]
                    rows[r] = rows[r] + step * row_grid * warps
                load_step(w_next, raw_next, rows, x_at, x_sf_at, lane_ok, second, split, pair16, block_rows_mul,
                          block_rows_shift, x_sf_row_stride * 4)
                for r in T.unroll(step):
                    row = rows[r] - step * row_grid * warps
                    s_in[0] = T.call_extern(T.float32, "tka_input_factor", raw[r, 0], x_sf_shift[0], x_sf_packed)
                    if ppl == 2:
                        s_in[1] = s_in[0]
                        if split:
                            s_in[1] = T.call_extern(T.float32, "tka_input_factor", raw[r, 1], x_sf_shift[1], x_sf_packed)

                    # ---- max of |q * s_in| per piece (lanes past a row's end: 0), then per group
                    amax[0] = T.float32(0)
                    if e4m3_in:
                        for u in T.unroll(4):
                            T.evaluate(T.call_extern("void", "tka_e4m3x4_f16x2", w[r, u], T.address_of(h[2 * u])))
                        if lane_ok:
                            amax[0] = T.call_extern(T.float32, "tka_e4m3_piece_amax", T.address_of(h[0]), s_in[0])
                    else:
                        for u in T.unroll(4):
                            mx[u] = w[r, u] & T.uint32(0x77777777)
                        amax[1] = T.float32(0)
                        if group_pieces >= 2 and second and s_in[1] == s_in[0]:
                            # both pieces of one group and one factor: one maximum
                            amax[0] = T.call_extern(T.float32, "tka_e2m1_amax", T.address_of(mx[0]), 4, s_in[0])
                        else:
                            if lane_ok:
                                amax[0] = T.call_extern(T.float32, "tka_e2m1_amax", T.address_of(mx[0]), 2, s_in[0])
                            if second:
                                amax[1] = T.call_extern(T.float32, "tka_e2m1_amax", T.address_of(mx[2]), 2, s_in[1])
                        if group_pieces >= 2:  # the lane's two pieces are of one group
                            amax[0] = max_nan(amax[0], amax[1])
                    if group_mask != 0:  # (uniform)
                        for st in T.unroll(3):
                            amax[0] = max_nan(amax[0], T.shfl_xor(amax[0], (1 << st) & group_mask))

                    # ---- factors, and their store (a word, or a byte of a packed UE8M0 word); two
                    # groups per lane only for e2m1 pieces in groups of 16 (uniform)
                    group_factor(amax, sf_inv, sf_bits, sf_at, sf_lead, sf_keep, 0, row, num_tokens, round_sf, packed_sf,
                                 sf_row_stride)
                    if ppl == 2:
                        sf_inv[1] = sf_inv[0]
                        if group_pieces == 1:
                            group_factor(amax, sf_inv, sf_bits, sf_at, sf_lead, sf_keep, 1, row, num_tokens, round_sf,
                                         packed_sf, sf_row_stride)

                    # ---- re-encode q * (s_in * sf_inv); vector stores
                    if row < num_tokens and lane_ok:
                        if e4m3_in:
                            if fmt == "e4m3":
                                T.evaluate(T.call_extern("void", "tka_e4m3_piece_codes", T.address_of(h[0]),
                                                         s_in[0] * sf_inv[0], T.address_of(res[0])))
                                T.evaluate(T.call_extern("void", "tka_store_row_x4", out_at, row, row_pieces * out_words * 4,
                                                         res[0], res[1], res[2], res[3]))
                            else:
                                for u in T.unroll(2):
                                    res[u] = T.call_extern(T.uint32, "tka_e4m3_to_e2m1", w[r, 2 * u], w[r, 2 * u + 1],
                                                           s_in[0] * sf_inv[0])
                                T.evaluate(T.call_extern("void", "tka_store_row_x2", out_at, row, row_pieces * out_words * 4,
                                                         res[0], res[1]))
                        elif fmt == "e2m1":
                            # a finite factor >= +0 by its table (one for both pieces when their factors
                            # are equal, bit for bit), any other value by value
                            table[0] = T.call_extern(T.uint64, "tka_e2m1_table_of", s_in[0] * sf_inv[0],
                                                     T.address_of(pow2_tables[0]))
                            table[1] = table[0]
                            if T.reinterpret(s_in[1] * sf_inv[1], T.uint32) != T.reinterpret(s_in[0] * sf_inv[0], T.uint32):
                                table[1] = T.call_extern(T.uint64, "tka_e2m1_table_of", s_in[1] * sf_inv[1],
                                                         T.address_of(pow2_tables[0]))
                            for k in T.unroll(2):
                                if T.call_extern(T.bool, "tka_finite_nonnegative", s_in[k] * sf_inv[k]):
                                    for u in T.unroll(2):
                                        res[2 * k + u] = T.call_extern(T.uint32, "tka_e2m1_lookup", w[r, 2 * k + u],
                                                                       mx[2 * k + u], table[k])
                                else:
                                    for u in T.unroll(2):
                                        res[2 * k + u] = T.call_extern(T.uint32, "tka_e2m1_to_e2m1", w[r, 2 * k + u],
                                                                       s_in[k] * sf_inv[k])
                            if out16:
                                T.evaluate(T.call_extern("void", "tka_store_row_x4", out_at, row, row_pieces * out_words * 4,
                                                         res[0], res[1], res[2], res[3]))
                            else:
                                T.evaluate(T.call_extern("void", "tka_store_pair", out_at, row, row_pieces * out_words * 4,
                                                         res[0], res[1], res[2], res[3], second))
                        else:
                            for k in T.unroll(2):
                                if k == 0 or second:
                                    for u in T.unroll(4):
                                        res[u] = T.call_extern(T.uint32, "tka_e2m1_to_e4m3",
                                                               w[r, 2 * k + u // 2] >> T.uint32(16 * (u % 2)),
                                                               s_in[k] * sf_inv[k])
                                    T.evaluate(T.call_extern("void", "tka_store_row_x4", out_at + T.uint64(16 * k), row,
                                                             row_pieces * out_words * 4, res[0], res[1], res[2], res[3]))

    return per_token_cast_quantized


def host_constants(in_dtype: str, fmt: str, group: int) -> dict:
    """The layout the host needs for the thread count of a row: lanes per group and
    groups per lane of a grouped config (0 for one group per row), the groups per warp of
    the factors-only layout (0 where the config has none), and for a pre-quantized input the
    resident blocks per SM and the rows a block takes per step (its grid; 0 elsewhere)."""
    warp_groups = WARP_SF_GROUPS if in_dtype == "float32" and group == 128 else 0
    quantized = in_dtype in QUANTIZED_INPUTS
    layout = {"sf_only_warp_groups": warp_groups,
              "quant_blocks_per_sm": QUANT_BLOCKS_PER_SM[in_dtype] if quantized else 0,
              "quant_block_rows": THREADS // WARP * QUANT_STEP_ROWS if quantized else 0}
    if group == 0:  # one group per row, or a pre-quantized input (group size at run time)
        return {"lanes_per_group": 0, "groups_per_lane": 0, **layout}
    tpg, _, rounds = _group_layout(in_dtype, group)
    return {"lanes_per_group": tpg, "groups_per_lane": rounds, **layout}
