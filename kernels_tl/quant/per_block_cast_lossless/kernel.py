"""quant.per_block_cast_lossless: FP4 (e2m1) with power-of-two factors over (1, 32) tiles ->
FP8 (e4m3) over larger ``out_block`` tiles, exactly.

With ``b`` the biased exponent of an input factor and ``B = max(b over the input tiles of an
output tile) - 6`` (at least 0): ``out_sf = 2**(B - 127)`` and ``out = fp4 * 2**(b - B)``
(``tile_kernels_aot.torch.quant.per_block_cast_lossless``).  For ``-5 <= b - B <= 6`` every
FP4 value times ``2**(b - B)`` is an e4m3 normal number (or zero), so the code is built from
bits: ``exponent field = e + (b - B) + 6`` for an FP4 exponent ``e`` (the FP4 subnormal 0.5 as
``e = 0``), the FP4 mantissa bit as the e4m3 mantissa's top bit, the sign kept.  Per input tile
the eight magnitude codes form a byte table in two words, and ``prmt`` (``__byte_perm``)
looks four nibbles up at once.  Inputs with ``b < B - 5`` are outside the contract (the
reference raises, TileKernels' kernel traps); the kernel does not check them.

Design
------
Memory-bound (0.5 byte read, 1 byte written per value): a *piece* is 16 bytes of FP4 data,
32 values, exactly one input tile, so each piece needs one factor.  A block covers ``RB`` rows
by ``LC`` pieces; thread (``c``, ``rl``) takes pieces of column ``c`` in rows ``rl, rl + LR, ...``
(``RPT`` of them).  The exponent maximum over an output tile: the lanes of the warp that share it
(``shfl_xor``, tile width a run-time shift), then, for tiles taller than one row, the warps through
shared memory.  Stores: two 16-byte vectors per piece.  Input factors: fp32 or packed UE8M0
through two strides (any layout); output factors: fp32 words or single UE8M0 bytes through two
strides, as per_block_cast writes them.

Static configuration: ``block_m`` (output tile rows: 1, 32, 128); the output tile width
(32, 64, 128), token count, hidden and both sf layouts are run-time values.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.quant_encoding import PASS_CONFIGS, STORE_BYTE_SOURCE, store_scale_factor  # noqa: F401

WARP = 32

DEVICE_SOURCE = r"""
// 32 FP4 values (4 words, element 8w + n in nibble n of word w) times 2**k as e4m3 bytes
// (8 words), for k = (K >> 3) - 6 in [-5, 6]: bytes K, K + 8, ... are the e4m3 codes of
// 0.5, 1, 1.5, 2, 3, 4, 6 times 2**k.
__device__ __forceinline__ void tka_fp4_to_e4m3(const unsigned* in, unsigned K, unsigned* out) {
  const unsigned lo = K * 0x01010100u + 0x0C080000u;  // codes 0-3: 0, 0.5, 1, 1.5
  const unsigned hi = K * 0x01010101u + 0x1C181410u;  // codes 4-7: 2, 3, 4, 6
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned s = in[w] >> (16 * h);
      out[2 * w + h] = __byte_perm(lo, hi, s & 0x7777u) | __byte_perm(0x8000u, 0u, (s >> 3) & 0x1111u);
    }
  }
}
"""


def layout(block_m: int):
    """(LC, LR, RPT): pieces per block row, row lanes, pieces per thread.  128-row tiles:
    16 x 16 lanes, 8 pieces each (two rows per warp); otherwise 32 x 8 lanes, 4 pieces each."""
    if block_m == 128:
        return 16, 16, 8
    return 32, 8, 4


def per_block_cast_lossless_kernel(block_m: int):
    assert block_m in (1, 32, 128)
    LC, LR, RPT = layout(block_m)
    threads = LC * LR
    num_warps = threads // WARP
    rows_per_block = LR * RPT
    assert block_m in (1, rows_per_block)
    max_tiles = LC  # tiles per block row at the narrowest output tile (one piece)

    num_pieces = T.dynamic("num_pieces", "int64")  # num_tokens * hidden / 32 (the buffers' extent)
    in_sf_words = T.dynamic("in_sf_words")
    out_sf_words = T.dynamic("out_sf_words")

    @T.prim_func
    def per_block_cast_lossless(
        x: T.Tensor[(num_pieces, 4), T.uint32],  # FP4 data, 16 bytes per piece
        x_sf: T.Tensor[(in_sf_words,), T.uint32],  # fp32 factors or packed UE8M0 words
        out: T.Tensor[(num_pieces, 8), T.uint32],  # e4m3 codes, 32 bytes per piece
        out_sf: T.Tensor[(out_sf_words,), T.uint32],
        num_tokens: T.int32,
        row_pieces: T.int32,  # hidden / 32
        col_tiles: T.int32,  # blocks per row of blocks: ceil(row_pieces / LC)
        tile_shift: T.int32,  # log2(out_block[1] / 32)
        num_sf_cols: T.int32,  # output tiles per row: ceil(hidden / out_block[1])
        in_sf_row_stride: T.int32,
        in_sf_col_stride: T.int32,
        in_packed: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        packed_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, rows_per_block) * col_tiles, threads=threads) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            T.assume(col_tiles > 0)
            T.annotate_min_blocks_per_sm(4)
            T.import_source(DEVICE_SOURCE + STORE_BYTE_SOURCE)

            q = T.alloc_local((RPT, 4), T.uint32)
            codes = T.alloc_local((8,), T.uint32)
            exps = T.alloc_local((RPT,), T.int32)  # input factor exponents (0 where nothing is read)
            big = T.alloc_local((RPT,), T.int32)  # B of each piece's output tile
            word = T.alloc_var(T.uint32)
            if block_m != 1:
                warp_max = T.alloc_shared((num_warps * max_tiles,), T.int32, scope="shared")

            row_block = bid // col_tiles  # one 32-bit division per block
            col_block = bid - row_block * col_tiles
            c = tid % LC
            rl = tid // LC
            col = col_block * LC + c  # piece column = input tile column
            col_ok = col < row_pieces
            tile_pieces = 1 << tile_shift
            first_lane = (c & (tile_pieces - 1)) == 0  # of its output tile's row
            tile = c >> tile_shift
            tile_col = col >> tile_shift
            first_row = row_block * rows_per_block + rl

            # ---- load data and the input factors' exponents (64-bit data offsets)
            for i in T.unroll(RPT):
                exps[i] = 0
                if col_ok and first_row + i * LR < num_tokens:
                    for u in T.vectorized(4):
                        q[i, u] = x[T.Cast("int64", first_row + i * LR) * row_pieces + col, u]
                    if in_packed != 0:
                        word = x_sf[(first_row + i * LR) * in_sf_row_stride + (col // 4) * in_sf_col_stride]
                        exps[i] = T.Cast("int32", (word >> T.Cast("uint32", 8 * (col % 4))) & T.uint32(0xFF))
                    else:
                        word = x_sf[(first_row + i * LR) * in_sf_row_stride + col * in_sf_col_stride]
                        exps[i] = T.Cast("int32", (word >> T.uint32(23)) & T.uint32(0xFF))

            # ---- B per output tile: the largest exponent - 6, at least 0
            if block_m == 1:
                for i in T.unroll(RPT):
                    big[i] = exps[i]
                    for s in T.unroll(5):
                        if (1 << s) < tile_pieces:  # uniform: the lanes of one tile
                            big[i] = T.max(big[i], T.shfl_xor(big[i], 1 << s))
                    big[i] = T.max(big[i], 6) - 6
            else:
                big[0] = exps[0]
                for i in T.unroll(1, RPT):
                    big[0] = T.max(big[0], exps[i])
                for s in T.unroll(5):
                    if (1 << s) >= LC:
                        big[0] = T.max(big[0], T.shfl_xor(big[0], 1 << s))  # other rows of this warp
                    elif (1 << s) < tile_pieces:
                        big[0] = T.max(big[0], T.shfl_xor(big[0], 1 << s))
                if tid % WARP < LC and first_lane:
                    warp_max[(tid // WARP) * max_tiles + tile] = big[0]
                T.sync_threads()
                big[0] = warp_max[tile]
                for w in T.unroll(1, num_warps):
                    big[0] = T.max(big[0], warp_max[w * max_tiles + tile])
                big[0] = T.max(big[0], 6) - 6
                for i in T.unroll(1, RPT):
                    big[i] = big[0]

            # ---- output factors: 2**(B - 127), one thread per tile
            if block_m == 1:
                for i in T.unroll(RPT):
                    if first_row + i * LR < num_tokens and col_ok and first_lane:
                        store_scale_factor(out_sf, first_row + i * LR, tile_col, T.Cast("uint32", big[i]),
                                           T.Cast("uint32", big[i]) << T.uint32(23), packed_sf, sf_row_stride,
                                           sf_col_stride, num_sf_cols)
            else:
                if rl == 0 and col_ok and first_lane:
                    store_scale_factor(out_sf, row_block, tile_col, T.Cast("uint32", big[0]),
                                       T.Cast("uint32", big[0]) << T.uint32(23), packed_sf, sf_row_stride,
                                       sf_col_stride, num_sf_cols)

            # ---- codes: e4m3 bytes of fp4 * 2**(b - B)
            for i in T.unroll(RPT):
                if col_ok and first_row + i * LR < num_tokens:
                    T.evaluate(T.call_extern("void", "tka_fp4_to_e4m3", T.address_of(q[i, 0]),
                                             T.Cast("uint32", (exps[i] - big[i] + 6) * 8), T.address_of(codes[0])))
                    for u in T.vectorized(8):
                        out[T.Cast("int64", first_row + i * LR) * row_pieces + col, u] = codes[u]

    return per_block_cast_lossless


def host_constants(block_m: int) -> dict:
    """Pieces per block row (``LC``) and rows per block, for the host's grid."""
    lc, lr, rpt = layout(block_m)
    return {"block_pieces": lc, "block_rows": lr * rpt}
