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
rows.  The activations stay in registers from the loads to the stores.

Transposed output (4-byte loads): warp ``w`` covers tokens ``32 * (w // 2) ...`` (its
*row group*) and channels ``32 * (w % 2) ...`` of the tile; lane ``L`` owns the channel
pair of word ``L % 16`` (two bf16 channels per 32-bit word) for 16 tokens, the first or the
second 16 of the row group (``L // 16``).  So a half-warp reads 64 contiguous bytes of
each half of a row per load, and a lane issues all its 32 loads (16 rows x l, r) before
the math.

* amax: a lane's 16 ``|act|`` pairs with ``max.NaN.bf16x2`` (bf16 act: exact), then the
  other half of its row group (``shfl.xor 16``): the block of 32 tokens.  For blocks of
  128 tokens the four row groups meet in shared memory (one barrier; the barrier runs
  for 32 too, which keeps the code uniform).
* a lane's 16 tokens of one channel are 16 contiguous fp8 bytes; one ``shfl.xor 16``
  exchange (4 words) hands each lane a whole row group (32 tokens, one 32-byte sector) of
  one channel: lanes ``< 16`` write the low channel of their pair, lanes ``>= 16`` the
  high one; the block writes 128 contiguous bytes of each of its 64 output rows.

Untransposed output (``without_transpose``; 16-byte pieces, 8-byte stores): lane ``L`` of
warp ``w`` owns the 8 channels ``8 * (L % 8) ...`` of the tile (4 words of each half row,
one 16-byte piece) for the 4 tokens ``16 * w + L // 8 + 4 * k`` (k = 0..3).  A lane's 8
pieces (4 tokens x l, r) are 16-byte loads into registers (a warp load reads 4 whole
128-byte tile rows), all issued before the math: a never-taken branch on ``token_blocks``
ends their basic block, which ptxas does not sink loads out of.

* amax: a lane's 4 tokens per word (``max.NaN.bf16x2``), then the warp's 16 tokens
  (``shfl.xor`` 8 and 16); lanes 0-7 put the warp's 32 words in shared memory.  After a
  barrier, thread ``t`` takes channel ``t % 64`` of token group ``t // 64`` (blocks of 32:
  warps ``2g``, ``2g + 1``; blocks of 128: threads ``< 64``, all 8 warps), computes its
  factors once, writes ``out_sf`` (a coalesced row of 64 floats per group) and the inverse
  to shared memory; after a second barrier each lane reads its 8 inverses (two 16-byte
  shared loads) and writes each token's 8 fp8 bytes with one 8-byte store (8 lanes write
  64 contiguous bytes of an output row).

Static configurations: ``transposed`` x ``clamped`` (4 per arch).  ``num_per_tokens``,
``round_sf``, the clamp value, the token count and the hidden size are run-time values.
Offsets are 64-bit (``hidden_chunks`` is an int64 dim).  ``x`` must be 16-byte aligned for
the untransposed kernel (the host checks it).  The design, its
expectation and the measured times are in ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.fp_pack import DEVICE_SOURCE as PACK_SOURCE
from kernels_tl.fp_pack import bf16x2, e4m3x4
from kernels_tl.load_order import DEVICE_SOURCE as LOAD_ORDER_SOURCE
from kernels_tl.load_order import end_of_loads
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
# untransposed: a lane owns 8 channels (4 words of each half row: one 16-byte load) of 4 tokens
LANE_CHANNELS = 8
LANE_WORDS = LANE_CHANNELS // 2  # 4
LANES_PER_ROW = TILE_CHANNELS // LANE_CHANNELS  # 8: a 128-byte tile row per 8 lanes
ROWS_PER_LOAD = WARP // LANES_PER_ROW  # 4 rows per warp load
LANE_TOKENS = 4
WARP_TOKENS = ROWS_PER_LOAD * LANE_TOKENS  # 16
assert LANE_TOKENS * LANE_WORDS == ROWS and WARP_TOKENS * THREADS // WARP == TILE_TOKENS
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
    # the untransposed kernel's two shared buffers stay apart: overlaid (the first is dead
    # when the second is written), the second would need a third barrier
    "tl.disable_shared_memory_reuse": True,
}
DEVICE_SOURCE = NAN_MAX_SOURCE + PACK_SOURCE
# one 8-byte store of two words at an 8-byte aligned global address (nvcc splits a
# vectorized uint2 copy, and even a make_uint2 store, into two 4-byte stores here); and
# the end of the loads' basic block (kernels_tl/load_order.py: without it ptxas sinks 5 of a
# lane's 8 loads into the math, the last after about 400 instructions)
STORE_SOURCE = r"""
__device__ __forceinline__ void tka_store_u32x2(unsigned* p, unsigned a, unsigned b) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(a), "r"(b) : "memory");
}""" + LOAD_ORDER_SOURCE


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


@T.macro
def _tile_activations(xl, xr, v, act, clamped, swiglu_clamp_value, counts, tmp):
    """act[i] for the 16 loaded word pairs (xl[i], xr[i]), with or without the clamp."""
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
            _activations(xl, xr, v, act, CLAMP, swiglu_clamp_value, counts, tmp, True)
        else:
            _activations(xl, xr, v, act, CLAMP, swiglu_clamp_value, counts, tmp, False)
    else:
        _activations(xl, xr, v, act, CLAMP_NONE, swiglu_clamp_value, counts, tmp, True)


def swiglu_forward_and_per_channel_cast_and_transpose_kernel(transposed: int, clamped: int):
    assert transposed in (0, 1) and clamped in (0, 1), (transposed, clamped)

    token_blocks = T.dynamic("token_blocks")  # n / 128
    # hidden / 64, int64: every offset below is computed in 64 bits, and hidden as a
    # multiple of 64 lets TileLang prove the alignment of every vector
    hidden_chunks = T.dynamic("hidden_chunks", "int64")
    sf_rows = T.dynamic("sf_rows")  # n / num_per_tokens (only the buffer's extent)
    num_tokens = token_blocks * TILE_TOKENS
    hidden = hidden_chunks * TILE_CHANNELS
    out_shape = (hidden, num_tokens) if transposed else (num_tokens, hidden)

    @T.macro
    def transposed_tile(x, out, out_sf, swiglu_clamp_value, round_sf, blocks_of_128, bx, by):
        # 32-bit words of four fp8 tokens of an output row (rebinding keeps the parameter `out`)
        out = T.view(out, (hidden, num_tokens // 4), T.uint32)

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
        _tile_activations(xl, xr, v, act, clamped, swiglu_clamp_value, counts, tmp)

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

    @T.macro
    def untransposed_tile(x, out, out_sf, swiglu_clamp_value, round_sf, blocks_of_128, bx, by):
        # 32-bit words of four fp8 channels of an output row
        out = T.view(out, (num_tokens, hidden // 4), T.uint32)

        xl = T.alloc_local((ROWS,), T.uint32)  # word 4 k + j: token k, channels 2 j, 2 j + 1 of the lane
        xr = T.alloc_local((ROWS,), T.uint32)
        v = T.alloc_local((2 * ROWS,), T.float32)
        act = T.alloc_local((ROWS,), T.uint32)  # bf16 pairs, indexed like xl
        tmp = T.alloc_local((4,), T.float32)  # fast_quotient's temporaries
        counts = T.alloc_local((3,), T.int32)  # (no clamp counting here)
        amax = T.alloc_local((LANE_WORDS,), T.uint32)  # |act| maxima of the lane's 4 words
        inv = T.alloc_local((LANE_CHANNELS,), T.float32)  # the lane's 8 inverse factors
        q = T.alloc_local((2,), T.uint32)  # one token's 8 fp8 bytes
        # the warps' |act| maxima (bf16 pairs over their 16 tokens), then the inverse
        # factors of each token group (4 groups of 32 tokens, or 1 of 128) and channel
        amax_smem = T.alloc_shared((THREADS // WARP * TILE_CHANNELS // 2,), T.uint32)
        inv_smem = T.alloc_shared((ROW_GROUPS * TILE_CHANNELS,), T.float32)
        m = T.alloc_var(T.uint32)
        sf = T.alloc_var(T.float32)

        tid = T.get_thread_binding()
        warp = tid // WARP
        lane = tid % WARP
        chunk = lane % LANES_PER_ROW  # the lane's 8 channels in the tile
        cw = T.Cast(T.int64, bx) * (TILE_CHANNELS // 2) + chunk * LANE_WORDS  # first word in the half row
        row0 = by * TILE_TOKENS + warp * WARP_TOKENS + lane // LANES_PER_ROW  # tokens row0 + 4 k

        # the 8 pieces as 16-byte loads into registers (a warp load reads 4 whole 128-byte tile
        # rows), all issued before the math: a block runs only when token_blocks > 0
        for k in T.unroll(LANE_TOKENS):
            for j in T.vectorized(LANE_WORDS):
                xl[k * LANE_WORDS + j] = x[row0 + k * ROWS_PER_LOAD, cw + j]
        for k in T.unroll(LANE_TOKENS):
            for j in T.vectorized(LANE_WORDS):
                xr[k * LANE_WORDS + j] = x[row0 + k * ROWS_PER_LOAD, hidden // 2 + cw + j]
        if not clamped:  # the clamped kernel's clamp-mode branches already end the loads' block
            T.evaluate(end_of_loads(token_blocks == 0))
        _tile_activations(xl, xr, v, act, clamped, swiglu_clamp_value, counts, tmp)

        # |act| maxima per word: the lane's 4 tokens, then the warp's 16 (the 4 lanes of a chunk)
        for j in T.unroll(LANE_WORDS):
            amax[j] = act[j] & T.uint32(0x7FFF7FFF)
            for k in T.unroll(1, LANE_TOKENS):
                amax[j] = bf16x2_max_nan(amax[j], act[k * LANE_WORDS + j] & T.uint32(0x7FFF7FFF))
        for j in T.unroll(LANE_WORDS):
            amax[j] = bf16x2_max_nan(amax[j], T.shfl_xor(amax[j], LANES_PER_ROW))
        for j in T.unroll(LANE_WORDS):
            amax[j] = bf16x2_max_nan(amax[j], T.shfl_xor(amax[j], 2 * LANES_PER_ROW))
        if lane < LANES_PER_ROW:
            for j in T.vectorized(LANE_WORDS):
                amax_smem[warp * (TILE_CHANNELS // 2) + chunk * LANE_WORDS + j] = amax[j]
        T.sync_threads()

        # one thread per channel and token group: its factors, once
        m = T.uint32(0)
        group = tid // TILE_CHANNELS  # token group (blocks of 32), 0 for blocks of 128
        channel = tid % TILE_CHANNELS
        word = channel // 2
        if blocks_of_128 != 0:
            if tid < TILE_CHANNELS:  # warps 0-1; the group's 8 warps
                m = amax_smem[word]
                for w in T.unroll(1, THREADS // WARP):
                    m = bf16x2_max_nan(m, amax_smem[w * (TILE_CHANNELS // 2) + word])
        else:  # the group's 2 warps
            m = bf16x2_max_nan(amax_smem[(2 * group) * (TILE_CHANNELS // 2) + word],
                               amax_smem[(2 * group + 1) * (TILE_CHANNELS // 2) + word])
        if blocks_of_128 == 0 or tid < TILE_CHANNELS:
            # channel 2 * word in the low half, 2 * word + 1 in the high half
            a = T.reinterpret(T.if_then_else(channel % 2 == 0, m << T.uint32(16), m & T.uint32(0xFFFF0000)),
                              T.float32)
            c_sf, c_inv, _ = scale_factor(a, T.float32(SF_CLAMP_MIN), round_sf != 0)
            sf = c_sf
            inv_smem[group * TILE_CHANNELS + channel] = c_inv
            sf_row = T.if_then_else(blocks_of_128 != 0, by, by * ROW_GROUPS + group)
            out_sf[sf_row, T.Cast(T.int64, bx) * TILE_CHANNELS + channel] = sf
        T.sync_threads()

        # the lane's 8 inverse factors (its token group), then a token's 8 bytes per store
        lane_group = T.if_then_else(blocks_of_128 != 0, 0, warp // 2)
        for j in T.vectorized(LANE_CHANNELS):
            inv[j] = inv_smem[lane_group * TILE_CHANNELS + chunk * LANE_CHANNELS + j]
        col = T.Cast(T.int64, bx) * (TILE_CHANNELS // 4) + chunk * 2  # output word of the lane's channels
        for k in T.unroll(LANE_TOKENS):
            for h in T.unroll(2):
                a0 = act[k * LANE_WORDS + 2 * h]
                a1 = act[k * LANE_WORDS + 2 * h + 1]
                q[h] = e4m3x4(_low(a0) * inv[4 * h], _high(a0) * inv[4 * h + 1],
                              _low(a1) * inv[4 * h + 2], _high(a1) * inv[4 * h + 3])
            T.evaluate(T.call_extern("void", "tka_store_u32x2", T.address_of(out[row0 + k * ROWS_PER_LOAD, col]),
                                     q[0], q[1]))

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
            T.import_source(DEVICE_SOURCE + (BF16X2_MIN_SOURCE if clamped else "")
                            + ("" if transposed else STORE_SOURCE))
            # 32-bit words: two bf16 channels of x (rebinding keeps the parameter called `x`)
            x = T.view(x, (num_tokens, hidden), T.uint32)
            if transposed:
                transposed_tile(x, out, out_sf, swiglu_clamp_value, round_sf, blocks_of_128, bx, by)
            else:
                untransposed_tile(x, out, out_sf, swiglu_clamp_value, round_sf, blocks_of_128, bx, by)

    return swiglu_forward_and_per_channel_cast_and_transpose
