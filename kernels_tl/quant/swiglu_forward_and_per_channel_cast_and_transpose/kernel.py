"""quant.swiglu_forward_and_per_channel_cast_and_transpose: SwiGLU forward, rounded to bf16,
fused with a per-channel FP8 cast over blocks of tokens, optionally transposed.

``x`` [n, 2 * hidden] bfloat16 (contiguous; ``n % 128 == 0``, ``hidden % 64 == 0``) ->
``out`` float8_e4m3fn [hidden, n] (the transpose; [n, hidden] with ``without_transpose``)
and ``out_sf`` float32 [n / t, hidden] with ``t = num_per_tokens`` (32 or 128).  With
``l``/``r`` the left/right halves of a row, in float32 and in exactly this order (the
contract of ``tile_kernels_aot/torch/swiglu.py``)::

    l, r = clamp(l, max=c), clamp(r, -c, c)          # only with swiglu_clamp_value c
    act  = bf16(((l / (1 + expf(-l))) * r))          # round to nearest even
    (the quotient is -0 for l <= -87.5)

and per channel ``j`` and block of ``t`` consecutive tokens::

    a   = max(max_t |act[t, j]|, 1e-4)
    sf  = a / 448,  out = e4m3_satfinite(act * (448 / a))            # two IEEE divides
    round_sf: sf = 2^ceil(log2(a / 448)) (exponent bits), out = e4m3(act * 2^-that)

The SwiGLU math is the per-token kernel's (``swiglu_values`` of
``quant/swiglu_forward_and_per_token_cast``: bf16 gates raised to -88.5 with
``max.NaN.bf16x2``, ``1 + expf`` rounded alone, ``fast_quotient``, clamps as selects);
the scale factors are ``kernels_tl.quant_math.scale_factor``.  A clamp value that is a
positive bf16 value (0.5, 10) clamps the packed pairs (``clamp_pairs``: ``min.NaN`` /
``max.NaN.bf16x2``, equal to the selects there) and runs the unclamped element loop.

Design
------
One block of 256 threads (8 warps) per tile of 128 tokens x 64 channels; the grid is
(hidden / 64, n / 128), channel tiles innermost, so blocks that run together read whole
rows.  Everything stays in registers: warp ``w`` covers tokens ``32 * (w // 2) ...`` (its
*row group*) and channels ``32 * (w % 2) ...`` of the tile; lane ``L`` owns the channel
pair of word ``L % 16`` (two bf16 channels per 32-bit word) for 16 tokens, the first or the
second 16 of the row group (``L // 16``).  So a half-warp reads 64 contiguous bytes of
each half of a row per load, and a lane issues all its 32 loads (16 rows x l, r) before
the math.

* amax: a lane's 16 ``|act|`` pairs with ``max.NaN.bf16x2`` (bf16 act: exact), then the
  other half of its row group (``shfl.xor 16``): the block of 32 tokens.  For blocks of
  128 tokens the four row groups meet in shared memory (one barrier; the barrier runs
  for 32 too, which keeps the code uniform).
* transposed output: a lane's 16 tokens of one channel are 16 contiguous fp8 bytes; one
  ``shfl.xor 16`` exchange (4 words) hands each lane a whole row group (32 tokens, one
  32-byte sector) of one channel: lanes ``< 16`` write the low channel of their pair,
  lanes ``>= 16`` the high one; the block writes 128 contiguous bytes of each of its 64
  output rows.
* untransposed output: each lane writes its channel pair (2 bytes) per token: a half-warp
  writes 32 contiguous bytes of a row.

Static configurations: ``transposed`` x ``clamped`` (4 per arch).  ``num_per_tokens``,
``round_sf``, the clamp value, the token count and the hidden size are run-time values.
Offsets are 64-bit (``hidden_chunks`` is an int64 dim).  The design, its
expectation and the measured times are in ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.fp_pack import DEVICE_SOURCE as PACK_SOURCE
from kernels_tl.fp_pack import bf16x2, e4m3x4
from kernels_tl.nan_max import DEVICE_SOURCE as NAN_MAX_SOURCE
from kernels_tl.nan_max import bf16x2_max_nan
from kernels_tl.quant.swiglu_forward_and_per_token_cast.kernel import (BF16X2_MIN_SOURCE, CLAMP, CLAMP_NONE,
                                                                       SILU_FLOOR_BF16X2, clamp_pairs,
                                                                       is_positive_bf16, swiglu_values)
from kernels_tl.quant_math import FAST_DIV_LIMIT, scale_factor

WARP = 32
TILE_TOKENS = 128  # tokens per block (n is a multiple of 128: blocks of 32 or 128 tokens fit)
TILE_CHANNELS = 64  # channels per block (hidden is a multiple of 64)
THREADS = 256  # 8 warps: 4 row groups of 32 tokens x 2 halves of 32 channels
ROW_GROUP = 32  # tokens per row group (the smaller scale block)
ROW_GROUPS = TILE_TOKENS // ROW_GROUP  # 4
ROWS = 16  # tokens per lane
PAIRS = 16  # channel-pair words per half-warp (32 channels)
# 4 blocks of 256 threads per SM: at most 64 registers per thread (a lane's 32 input words
# and 16 act words, see notes.md)
MIN_BLOCKS_PER_SM = 4
SF_CLAMP_MIN = 1e-4
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every access is in bounds by construction (whole tiles: n % 128 == 0, hidden % 64 == 0);
    # without this TileLang adds per-element guards that break the vectors
    "tl.disable_safe_memory_legalize": True,
}
DEVICE_SOURCE = NAN_MAX_SOURCE + PACK_SOURCE


def _low(word):
    """float32 of the low bf16 of a word."""
    return T.reinterpret(word << T.uint32(16), T.float32)


def _high(word):
    """float32 of the high bf16 of a word."""
    return T.reinterpret(word & T.uint32(0xFFFF0000), T.float32)


@T.macro
def _activations(xl, xr, v, act, mode, swiglu_clamp_value, counts, tmp, fast):
    """act[i] = the bf16 pair of ((l / (1 + expf(-l))) * r) for input words i (0..15)."""
    for i in T.unroll(ROWS):
        swiglu_values(xl, xr, v, 2 * i, 1, True, T.float32(1.0), False, mode, swiglu_clamp_value, counts, tmp, fast)
        act[i] = bf16x2(v[2 * i], v[2 * i + 1])


def _output_view(out, transposed, num_tokens, hidden):
    """The output as stored: words of four tokens (transposed) or pairs of channels."""
    if transposed:
        return T.view(out, (hidden, num_tokens // 4), T.uint32)
    return T.view(out, (num_tokens, hidden // 2), T.uint16)


def swiglu_forward_and_per_channel_cast_and_transpose_kernel(transposed: int, clamped: int):
    assert transposed in (0, 1) and clamped in (0, 1), (transposed, clamped)
    mode = CLAMP if clamped else CLAMP_NONE

    token_blocks = T.dynamic("token_blocks")  # n / 128
    # hidden / 64, int64: every offset below is computed in 64 bits, and hidden as a
    # multiple of 64 lets TileLang prove the alignment of every vector
    hidden_chunks = T.dynamic("hidden_chunks", "int64")
    sf_rows = T.dynamic("sf_rows")  # n / num_per_tokens (only the buffer's extent)
    num_tokens = token_blocks * TILE_TOKENS
    hidden = hidden_chunks * TILE_CHANNELS
    out_shape = (hidden, num_tokens) if transposed else (num_tokens, hidden)

    @T.prim_func
    def swiglu_forward_and_per_channel_cast_and_transpose(
        x: T.Tensor((num_tokens, hidden * 2), T.bfloat16),
        out: T.Tensor(out_shape, T.float8_e4m3fn),
        out_sf: T.Tensor((sf_rows, hidden), T.float32),
        swiglu_clamp_value: T.float32,
        round_sf: T.int32,
        blocks_of_128: T.int32,  # num_per_tokens == 128 (else 32)
    ):
        with T.Kernel(hidden_chunks, token_blocks, threads=THREADS) as (bx, by):
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            T.import_source(DEVICE_SOURCE + BF16X2_MIN_SOURCE if clamped else DEVICE_SOURCE)
            # 32-bit words: two bf16 channels of x, four fp8 tokens of a transposed output row;
            # 16-bit pairs: two fp8 channels of an untransposed output row (rebinding the names
            # keeps the kernel parameters called `x` and `out`)
            x = T.view(x, (num_tokens, hidden), T.uint32)
            out = _output_view(out, transposed, num_tokens, hidden)

            xl = T.alloc_local((ROWS,), T.uint32)
            xr = T.alloc_local((ROWS,), T.uint32)
            v = T.alloc_local((2 * ROWS,), T.float32)
            act = T.alloc_local((ROWS,), T.uint32)  # bf16 pairs (channel 2 * word in the low half)
            tmp = T.alloc_local((4,), T.float32)  # fast_quotient's temporaries
            counts = T.alloc_local((3,), T.int32)  # (no clamp counting here)
            sfv = T.alloc_local((2,), T.float32)
            w0 = T.alloc_local((4,), T.uint32)  # fp8 of the low channel, 16 tokens
            w1 = T.alloc_local((4,), T.uint32)  # fp8 of the high channel
            mine = T.alloc_local((8,), T.uint32)  # the 32 tokens of one channel this lane writes
            amax_smem = T.alloc_shared((ROW_GROUPS * 2 * PAIRS,), T.uint32)
            amax = T.alloc_var(T.uint32)
            sf_lo = T.alloc_var(T.float32)
            sf_hi = T.alloc_var(T.float32)
            inv_lo = T.alloc_var(T.float32)
            inv_hi = T.alloc_var(T.float32)

            tid = T.get_thread_binding()
            warp = tid // WARP
            lane = tid % WARP
            group = warp // 2  # row group in the tile
            sub = lane // PAIRS  # first or second 16 tokens of the row group
            slot = (warp % 2) * PAIRS + lane % PAIRS  # channel-pair word in the tile (0..31)
            cw = T.Cast(T.int64, bx) * (TILE_CHANNELS // 2) + slot  # channel-pair word in the row
            row0 = by * TILE_TOKENS + group * ROW_GROUP + sub * ROWS  # the lane's first token

            # all 32 loads first (a half-warp reads 64 contiguous bytes of a half row each)
            for i in T.unroll(ROWS):
                xl[i] = x[row0 + i, cw]
            for i in T.unroll(ROWS):
                xr[i] = x[row0 + i, hidden // 2 + cw]
            # bf16 gates raised to -88.5, NaN kept: the fast divide is exact for every one
            # (see fast_quotient); a clamp can only lower l, so c <= -64 takes the IEEE copy
            for i in T.unroll(ROWS):
                xl[i] = bf16x2_max_nan(xl[i], T.uint32(SILU_FLOOR_BF16X2))
            if clamped:
                if is_positive_bf16(swiglu_clamp_value):  # uniform
                    # c a positive bf16 value (0.5, 10): the clamps on the packed pairs, 1.5
                    # instructions per element instead of 6 selects, then the unclamped loop
                    c_bits = T.reinterpret(swiglu_clamp_value, T.uint32)
                    clamp_pairs(xl, xr, ROWS, c_bits | (c_bits >> T.uint32(16)))
                    _activations(xl, xr, v, act, CLAMP_NONE, swiglu_clamp_value, counts, tmp, True)
                elif swiglu_clamp_value > -FAST_DIV_LIMIT:  # uniform
                    _activations(xl, xr, v, act, mode, swiglu_clamp_value, counts, tmp, True)
                else:
                    _activations(xl, xr, v, act, mode, swiglu_clamp_value, counts, tmp, False)
            else:
                _activations(xl, xr, v, act, mode, swiglu_clamp_value, counts, tmp, True)

            # |act| maxima of both channels (bf16 pairs), then over the row group's 32 tokens
            amax = T.uint32(0)
            for i in T.unroll(ROWS):
                amax = bf16x2_max_nan(amax, act[i] & T.uint32(0x7FFF7FFF))
            amax = bf16x2_max_nan(amax, T.shfl_xor(amax, PAIRS))
            if sub == 0:
                amax_smem[group * 2 * PAIRS + slot] = amax
            T.sync_threads()
            if blocks_of_128 != 0:  # block-uniform: the four row groups
                for g in T.unroll(ROW_GROUPS):
                    amax = bf16x2_max_nan(amax, amax_smem[g * 2 * PAIRS + slot])

            lo_sf, lo_inv, _ = scale_factor(_low(amax), T.float32(SF_CLAMP_MIN), round_sf != 0)
            hi_sf, hi_inv, _ = scale_factor(_high(amax), T.float32(SF_CLAMP_MIN), round_sf != 0)
            sf_lo = lo_sf
            sf_hi = hi_sf
            inv_lo = lo_inv
            inv_hi = hi_inv
            # one factor row per block of tokens: the first half-warps of its row group(s)
            if sub == 0 and (blocks_of_128 == 0 or group == 0):
                sfv[0] = sf_lo
                sfv[1] = sf_hi
                sf_row = T.if_then_else(blocks_of_128 != 0, by, by * ROW_GROUPS + group)
                for j in T.vectorized(2):
                    out_sf[sf_row, cw * 2 + j] = sfv[j]

            if transposed:
                for j in T.unroll(4):
                    w0[j] = e4m3x4(_low(act[4 * j]) * inv_lo, _low(act[4 * j + 1]) * inv_lo,
                                   _low(act[4 * j + 2]) * inv_lo, _low(act[4 * j + 3]) * inv_lo)
                    w1[j] = e4m3x4(_high(act[4 * j]) * inv_hi, _high(act[4 * j + 1]) * inv_hi,
                                   _high(act[4 * j + 2]) * inv_hi, _high(act[4 * j + 3]) * inv_hi)
                # lanes < 16 keep the low channel and take the other half's 16 tokens of it;
                # lanes >= 16 the high channel
                for j in T.unroll(4):
                    theirs = T.shfl_xor(T.if_then_else(sub == 0, w1[j], w0[j]), PAIRS)
                    mine[j] = T.if_then_else(sub == 0, w0[j], theirs)
                    mine[4 + j] = T.if_then_else(sub == 0, theirs, w1[j])
                channel = cw * 2 + sub
                col = by * (TILE_TOKENS // 4) + group * (ROW_GROUP // 4)  # word of the row group's first token
                for j in T.vectorized(4):
                    out[channel, col + j] = mine[j]
                for j in T.vectorized(4):
                    out[channel, col + 4 + j] = mine[4 + j]
            else:
                for i in T.unroll(ROWS // 2):
                    # tokens 2i and 2i + 1: (low, high) channel bytes of each
                    pair = e4m3x4(_low(act[2 * i]) * inv_lo, _high(act[2 * i]) * inv_hi,
                                  _low(act[2 * i + 1]) * inv_lo, _high(act[2 * i + 1]) * inv_hi)
                    out[row0 + 2 * i, cw] = T.Cast(T.uint16, pair & T.uint32(0xFFFF))
                    out[row0 + 2 * i + 1, cw] = T.Cast(T.uint16, pair >> T.uint32(16))

    return swiglu_forward_and_per_channel_cast_and_transpose
