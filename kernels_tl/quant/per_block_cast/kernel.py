"""quant.per_block_cast (+ ``_with_sf_only``, ``_with_precomputed_sf``): FP8/FP4 quantization
with one scale factor per ``block_m x block_k`` tile of ``x``.

``x`` bf16/fp32 [num_tokens, hidden] (contiguous, hidden % 64 == 0) -> ``out`` e4m3
[num_tokens, hidden] or packed e2m1 [num_tokens, hidden / 2], and the factor grid
``out_sf`` [ceil(num_tokens / block_m), ceil(hidden / block_k)]: fp32 row-major, fp32
TMA-aligned column-major, or UE8M0 packed four per int32 (column-major).  The arithmetic is
the reference's (``tile_kernels_aot.torch.quant.per_block_cast``) and per_token_cast's
(``kernels_tl/quant_encoding.py``): a NaN-keeping amax per tile, ``sf = c / MAX``,
``sf_inv = MAX / c`` or powers of two with ``round_sf``, ``q = encode(float32(x) * sf_inv)``.

Design
------
Memory-bound: every value is loaded once into registers, the tile's maximum goes through
shuffles and one shared-memory exchange, and the codes are written from the same registers.

* A *piece* is 16 bytes of x (8 bf16 or 4 fp32), one ``LDG.128``.
* A block (CTA) covers ``block_m`` rows (one row of tiles) by ``LC`` pieces: ``LC``
  column lanes by ``LR`` row lanes, each thread ``RPT`` pieces of one column, rows
  ``rl, rl + LR, ...``.  With precomputed factors (no tile maximum, so a block need not
  hold a whole tile) the host may give a block ``block_rows`` = ``LR * 4`` or ``LR * 2``
  rows of one row of tiles (a run-time value): small calls then spread over more blocks.
  A warp covers one or two whole row segments of ``LC`` pieces (256-512 contiguous
  bytes).  ``LC`` is a multiple of a tile's width in pieces for both ``block_k`` (32 and
  128, a run-time value), so a thread's pieces lie in one tile.
* Tile maximum: in registers (bf16 on packed pairs), then ``shfl_xor`` over the lanes of
  the warp that share the tile, then each warp's maximum per tile through shared memory.
* Factors: one thread per tile writes them (fp32 words through the sf tensor's two
  strides; packed UE8M0 as single bytes of the int32 words, the thread of the last tile
  of a row also zeroes the word's unused bytes).  ``read_sf`` (precomputed factors) skips
  the maximum and reads ``sf`` instead (``sf_inv = 1 / sf``); ``write_out`` = 0 is sf-only.
* Offsets into x and out are 64-bit (x may hold more than 2^31 elements), computed once per
  thread (a base and a row step) so that every access is one add; the grid is
  one-dimensional, row of tiles major.
* bf16 -> e4m3 codes: ``tka_store_bf16x8_e4m3`` (the widening by shift/mask, ``__fmul_rn``,
  ``cvt.rn.satfinite.e4m3x2.f32``, one 8-byte store per piece).

Static configurations: ``in_dtype`` (bfloat16, float32) x ``fmt`` (e4m3, e2m1) x
``block_m`` (32, 128): 8 kernels; ``block_k``, the token count, hidden, the sf layout and
``round_sf`` are run-time values.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE, bf16x2_max_nan, max_nan
from kernels_tl.quant_encoding import (  # noqa: F401 (PASS_CONFIGS: read by the build)
    MAX_VALUE, PASS_CONFIGS, STORE_BYTE_SOURCE, e2m1_nibble, has_fp4_convert, scale_factors, store_scale_factor)

WARP = 32
NACC = 4  # independent running maxima of the bf16 pairs
_IN_BYTES = {"bfloat16": 2, "float32": 4}
BLOCK_KS = (32, 128)



# Eight bf16 values (four words, first value in the low half) times s -> eight e4m3 codes (first
# in the low byte), one 8-byte store: float32(x) * s rounded once (the widening is exact: the
# bf16 bits on top of a zero half), cvt.rn.satfinite (NaN -> 0x7F), as the reference.
CAST_SOURCE = r"""
__device__ __forceinline__ unsigned tka_bf16x2_e4m3x2(unsigned w, float s) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d)
      : "f"(__fmul_rn(__uint_as_float(w & 0xFFFF0000u), s)), "f"(__fmul_rn(__uint_as_float(w << 16), s)));
  return d;
}
__device__ __forceinline__ void tka_store_bf16x8_e4m3(void* p, unsigned w0, unsigned w1, unsigned w2, unsigned w3,
                                                      float s) {
  *reinterpret_cast<uint2*>(p) = make_uint2(tka_bf16x2_e4m3x2(w0, s) | (tka_bf16x2_e4m3x2(w1, s) << 16),
                                            tka_bf16x2_e4m3x2(w2, s) | (tka_bf16x2_e4m3x2(w3, s) << 16));
}
"""


def layout(in_dtype: str, block_m: int):
    """(LC, LR, RPT): column lanes (pieces per block row), row lanes, pieces per thread.

    LC is the widest tile in pieces (16 bf16, 32 fp32) or, for 32-row tiles, 32 (a warp
    on one row); RPT = 8 (128 bytes of x per thread in flight): 128-row tiles take 256
    (bf16) or 512 (fp32) threads, 32-row tiles 128."""
    piece = 16 // _IN_BYTES[in_dtype]
    widest = max(BLOCK_KS) // piece
    lc = max(widest, WARP) if block_m == 32 else widest
    rpt = 8
    lr = block_m // rpt
    assert lc * lr in (128, 256, 512) and lc % (min(BLOCK_KS) // piece) == 0 and lc <= WARP
    return lc, lr, rpt


def per_block_cast_kernel(in_dtype: str, fmt: str, block_m: int):
    assert in_dtype in _IN_BYTES and fmt in ("e4m3", "e2m1") and block_m in (32, 128)
    piece = 16 // _IN_BYTES[in_dtype]  # elements per 16-byte load
    LC, LR, RPT = layout(in_dtype, block_m)
    threads = LC * LR
    num_warps = threads // WARP
    max_tiles = LC // (min(BLOCK_KS) // piece)  # tiles per block row at the narrowest block_k

    hw_fp4 = fmt == "e2m1" and has_fp4_convert()
    if fmt == "e4m3":
        out_dtype, out_width = T.float8_e4m3fn, piece
    elif hw_fp4:
        out_dtype, out_width = T.float4_e2m1fn, piece  # TileLang packs two per byte
    else:
        out_dtype, out_width = T.uint8, piece // 2  # nibbles packed by hand

    num_pieces = T.dynamic("num_pieces", "int64")  # num_tokens * hidden / piece (the buffers' extent)
    sf_words = T.dynamic("sf_words")  # 32-bit words of sf storage

    @T.prim_func
    def per_block_cast(
        x: T.Tensor[(num_pieces, piece), in_dtype],
        out: T.Tensor[(num_pieces, out_width), out_dtype],
        # fp32 factors or packed UE8M0 words, as raw 32-bit words; tile [m, k] (packed: the
        # word of tiles 4c..4c+3) is at m * sf_row_stride + k (or c) * sf_col_stride.
        sf: T.Tensor[(sf_words,), T.uint32],
        num_tokens: T.int32,
        row_pieces: T.int32,  # hidden / piece
        col_tiles: T.int32,  # blocks per row of tiles: ceil(row_pieces / LC)
        tile_shift: T.int32,  # log2(block_k / piece)
        num_sf_cols: T.int32,  # tiles per row: ceil(hidden / block_k)
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        round_sf: T.int32,
        packed_sf: T.int32,
        write_out: T.int32,
        read_sf: T.int32,
        # rows a block covers: block_m, or with read_sf (no tile maximum) LR * 4 or LR * 2 so
        # that a small call spreads over more blocks (each thread RPT, 4 or 2 pieces)
        block_rows: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_rows) * col_tiles, threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            T.assume(col_tiles > 0)
            T.annotate_min_blocks_per_sm(2048 // threads // 2)  # <= 64 registers per thread
            T.import_source(DEVICE_SOURCE + STORE_BYTE_SOURCE + CAST_SOURCE)

            xv = T.alloc_local((RPT, piece), in_dtype)
            amax = T.alloc_local((1,), T.float32)
            if in_dtype == "bfloat16":
                pmax = T.alloc_local((NACC,), T.uint32)  # running maxima of |x| pairs (two bf16)
                pair = T.alloc_local((2,), in_dtype)
            sf_inv = T.alloc_local((1,), T.float32)
            sf_bits = T.alloc_local((1,), T.uint32)  # fp32 factor bits, or the UE8M0 byte
            packed = T.alloc_local((out_width,), T.uint8)
            warp_max = T.alloc_shared((num_warps * max_tiles,), T.float32, scope="shared")

            # Every index below derives from these, computed once (registers, not re-derived per
            # access): one 32-bit division per block, 64-bit piece offsets into x and out.  The
            # block's rows are [row0, row0 + block_rows), inside one row of tiles (block_rows
            # divides block_m); row0 < num_tokens < 2^31 - 256 (host), so int32 holds it.
            row_block = T.alloc_var(T.int32)
            row0 = T.alloc_var(T.int32)
            tile_row = T.alloc_var(T.int32)
            col = T.alloc_var(T.int32)
            rows_left = T.alloc_var(T.int32)
            base = T.alloc_var(T.int64)
            step = T.alloc_var(T.int64)
            row_block = bid // col_tiles
            row0 = row_block * block_rows
            tile_row = row0 // block_m  # block_m a power of two: a shift
            col = (bid - row_block * col_tiles) * LC + tid % LC  # piece column
            # row i of this thread (row0 + tid // LC + i * LR) is valid iff i * LR < rows_left:
            # below num_tokens and inside the block's rows (i < block_rows / LR)
            rows_left = T.min(num_tokens - row0, block_rows) - tid // LC
            base = T.Cast("int64", row0 + tid // LC) * T.Cast("int64", row_pieces) + T.Cast("int64", col)
            step = T.Cast("int64", row_pieces) * LR  # pieces between a thread's rows
            c = tid % LC
            rl = tid // LC
            col_ok = col < row_pieces
            tile_pieces = 1 << tile_shift
            first_lane = (c & (tile_pieces - 1)) == 0  # of its tile's row
            tile = c >> tile_shift  # tile of this block row
            tile_col = col >> tile_shift  # tile column in the sf grid

            # ---- load: all pieces first
            for i in T.unroll(RPT):
                if col_ok and i * LR < rows_left:
                    for u in T.vectorized(piece):
                        xv[i, u] = x[base + step * i, u]
                else:
                    for u in T.unroll(piece):
                        xv[i, u] = T.cast(0, in_dtype)

            if read_sf != 0:
                # ---- given factors: sf_inv = 1 / sf
                sf_inv[0] = T.float32(1)
                if tile_col < num_sf_cols:
                    sf_inv[0] = T.float32(1) / T.reinterpret(
                        sf[tile_row * sf_row_stride + tile_col * sf_col_stride], T.float32)
            else:
                # ---- tile max: registers, the warp's lanes of the tile, then the warps
                if in_dtype == "bfloat16":
                    # bf16 pairs stay packed (a NaN-keeping max on |x|), one widening at the end
                    # NACC independent chains (short dependent latency), then a tree
                    for a in T.unroll(NACC):
                        pmax[a] = T.reinterpret(T.abs2(xv[2 * a // piece, T.Ramp(2 * a % piece, 1, 2)]), T.uint32)
                    for i in T.unroll(NACC, RPT * piece // 2):
                        pmax[i % NACC] = bf16x2_max_nan(pmax[i % NACC], T.reinterpret(
                            T.abs2(xv[2 * i // piece, T.Ramp(2 * i % piece, 1, 2)]), T.uint32))
                    for a in T.unroll(NACC // 2):
                        pmax[a] = bf16x2_max_nan(pmax[a], pmax[a + NACC // 2])
                    pmax[0] = bf16x2_max_nan(pmax[0], pmax[1])
                    pair[T.Ramp(0, 1, 2)] = T.reinterpret(pmax[0], "bfloat16x2")
                    amax[0] = max_nan(T.cast(pair[0], T.float32), T.cast(pair[1], T.float32))
                else:
                    amax[0] = T.float32(0)
                    for i in T.unroll(RPT * piece):
                        amax[0] = max_nan(amax[0], T.abs(xv[i // piece, i % piece]))
                for s in T.unroll(5):
                    if (1 << s) >= LC:
                        # lanes of other rows of this warp: same tile
                        amax[0] = max_nan(amax[0], T.shfl_xor(amax[0], 1 << s))
                    elif (1 << s) < tile_pieces:  # uniform: the lanes of one tile row
                        amax[0] = max_nan(amax[0], T.shfl_xor(amax[0], 1 << s))
                if tid % WARP < LC and first_lane:
                    warp_max[(tid // WARP) * max_tiles + tile] = amax[0]
                T.sync_threads()
                amax[0] = warp_max[tile]
                for w in T.unroll(1, num_warps):
                    amax[0] = max_nan(amax[0], warp_max[w * max_tiles + tile])

                scale_factors(amax, fmt, round_sf, packed_sf, sf_bits, sf_inv, 0)

                # ---- store the factor: the first thread of the tile
                if rl == 0 and col_ok and first_lane:
                    store_scale_factor(sf, tile_row, tile_col, sf_bits[0], sf_bits[0], packed_sf, sf_row_stride,
                                       sf_col_stride, num_sf_cols)

            # ---- quantize and store
            if write_out != 0:
                for i in T.unroll(RPT):
                    if col_ok and i * LR < rows_left:
                        if fmt == "e4m3" and in_dtype == "bfloat16":
                            T.evaluate(T.call_extern(
                                "void", "tka_store_bf16x8_e4m3", T.address_of(out[base + step * i, 0]),
                                *[T.reinterpret(xv[i, T.Ramp(2 * k, 1, 2)], T.uint32) for k in range(4)],
                                sf_inv[0]))
                        elif fmt == "e4m3" or hw_fp4:
                            for u in T.vectorized(piece):
                                out[base + step * i, u] = T.cast(
                                    T.cast(xv[i, u], T.float32) * sf_inv[0], out_dtype)
                        else:
                            for b in T.unroll(out_width):
                                lo = e2m1_nibble(T.cast(xv[i, 2 * b], T.float32) * sf_inv[0])
                                hi = e2m1_nibble(T.cast(xv[i, 2 * b + 1], T.float32) * sf_inv[0])
                                packed[b] = T.cast(lo | (hi << T.uint32(4)), T.uint8)
                            for b in T.vectorized(out_width):
                                out[base + step * i, b] = packed[b]

    return per_block_cast


def host_constants(in_dtype: str, fmt: str, block_m: int) -> dict:
    """Pieces per block row (``LC``), for the host's grid: ceil(row_pieces / LC) blocks per
    row of block_rows rows; row lanes (``LR``), the unit of block_rows below block_m."""
    lc, lr, _ = layout(in_dtype, block_m)
    return {"block_pieces": lc, "row_lanes": lr}
