"""quant.per_channel_cast, quant.per_channel_cast_and_transpose, quant.per_channel_cast_fused:
e4m3 quantization with one scale factor per channel per ``num_per_tokens`` consecutive rows.

``x`` [num_tokens, hidden] (bf16, fp32, or pre-quantized e4m3 codes with per-token factors
``x_sf`` [num_tokens, hidden / 128] that are applied first) -> ``out`` e4m3 [num_rows, hidden]
(or, transposed, [hidden, num_rows]) and ``out_sf`` fp32 [ceil(num_rows / npt), hidden]
(row-major).  Output row ``r`` is input row ``r``, or with ``gather`` input row
``pos_to_token[r]`` (a zero row where that is negative or past the input).  The arithmetic is
the reference's (``tile_kernels_aot.torch.quant``): ``v = x`` (pre-quantized:
``v = fl(q * s_in)``), ``amax`` per (row block, channel) over the existing rows, NaN kept,
``sf = max(amax, 1e-4) / 448``, ``sf_inv = 448 / max(amax, 1e-4)`` (IEEE divisions; with
``round_sf`` powers of two, ``kernels_tl/quant_math.py``), ``out = e4m3(fl(v * sf_inv))``
(``cvt.rn.satfinite``).

Design
------
Memory-bound.  A block of 256 threads owns a tile of 128 rows x ``L`` 16-byte pieces of input
row (a piece is ``V`` channels: 8 bf16, 4 fp32, 16 e4m3; ``CH = L * V`` channels per tile).
Thread ``tid`` takes piece ``tid % L`` of the ``R`` consecutive rows ``R * (tid // L) + i``: R
16-byte loads, all in flight before the first use.  Two layouts (static ``wide``):

- narrow, ``L = 8, R = 4``: 128 bytes of each tile row, 64 bytes of loads per thread, a warp
  instruction reads 4 whole 128-byte lines (fp32; bf16 without a gather; transposed);
- wide, ``L = 16, R = 8``: 256 bytes of each tile row, 128 bytes of loads per thread (32 KiB
  per block), a warp instruction reads 2 rows x 256 bytes (bf16 with a gather; pre-quantized).

With ``gather`` the thread first loads the R positions of its rows (16-byte loads).  Either
way a warp covers 16 rows (``32 / L`` row groups of R rows).

Pre-quantized (wide, e4m3 codes): the R pieces go by ``cp.async`` into the thread's own 16-byte
slots of a 32 KiB shared tile (a missing row or piece: a zero slot, nothing read; one predicated
copy or store and the row's input factor per row, no branch), then the thread waits for its own
copies only (no barrier: no other thread reads its slots; a never-taken branch before the wait
keeps all R factor loads ahead of it, ``kernels_tl/load_order.py``).  Steps 1 and 4 read each
slot back (``LDS.128``) and decode its 16 codes to f16 pairs (exact) each time, so no codes are
held in registers between the steps: 48 registers and 42 KiB of shared memory, 5 blocks (160 KiB
of loads) per SM.  One 16-byte store per row.

0. Block order (in place): without a gather, channel tile fastest (grid x), so the blocks
   started together read whole rows; with a gather, row tile fastest, so the blocks started
   together read a column band of every output row and a token that several output rows read
   (routed to several local experts) is still in L2 at its later reads (the grid's extents
   swap on the run-time ``gather``, 0 or 1).  Transposed: row tile in x.
1. amax of each of the thread's channels over its R rows (bf16: on packed pairs,
   ``max.NaN.bf16x2`` of ``|x|``; pre-quantized: ``|fl(q * s_in)|`` per element), then over
   the warp's row groups
   (``shfl_xor`` by ``L``, ``2L`` below 32): a warp holds the maxima of 16 rows.
2. Lanes ``0 .. L-1`` of each warp write them to shared memory ([8 warps][CH] fp32); barrier.
3. One thread per (row block of ``npt`` rows, channel) in the tile takes the max over the
   ``npt / 16`` warps of its block, computes (sf, sf_inv), writes sf to ``out_sf`` (consecutive
   threads: consecutive channels) and sf_inv to shared memory; barrier.
4. Each thread encodes its R x V values with its block's sf_inv: ``cvt.rn.satfinite.e4m3x2``
   into 32-bit words.  In place: R stores of V bytes (``STG.64`` bf16, ``STG.128``
   pre-quantized, ``STG.32`` fp32).
   Transposed (bf16, narrow): per channel, the codes of its 4 rows made directly as one word
   (``tka_e4m3x4_codes`` of the channel's 4 products: byte i is row i), stored into a
   [CH][128 bytes] shared tile (the word's slot XORed with ``4 * (channel // 8)``:
   conflict-free); barrier; then 16-byte chunks of 16 tokens go out, 8 lanes per 128-byte output
   line.  The exchange, the factors and the code tile are three static shared arrays (no
   aliasing, so no barrier before a reuse): three barriers per block.  ``num_per_tokens`` (32 or
   128) enters the index math as a shift (``31 - clz``).

Rows past ``num_rows`` (a partial last block) and pieces past ``hidden`` load nothing (they add
0 to the maxima) and store nothing.  With a gather ``num_rows % 16 == 0`` and a thread's first row
is a multiple of R (4 or 8), so its R rows exist together.  Offsets into ``x``, ``x_sf``, ``out``
and ``out_sf`` are 64-bit.  ``npt`` (16, 32, 64 or 128), ``gather`` and ``round_sf`` are
run-time values.

Static configurations: ``in_dtype`` x ``transpose`` x ``wide``: (bfloat16, 0, 0), (float32, 0,
0), (bfloat16, 0, 1), (float8_e4m3fn, 0, 1), (bfloat16, 1, 0): 5.  The host takes the wide one
for a pre-quantized x and for a bf16 x with a gather.  Measured times in ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl import cp_async
from kernels_tl.load_order import DEVICE_SOURCE as LOAD_ORDER_SOURCE
from kernels_tl.load_order import end_of_loads
from kernels_tl.nan_max import DEVICE_SOURCE as NAN_MAX_SOURCE
from kernels_tl.nan_max import bf16x2_max_nan, max_nan
from kernels_tl.quant.per_token_cast.kernel import CAST_SOURCE, QUANT_SOURCE
from kernels_tl.quant_math import scale_factor

THREADS = 256
WARPS = THREADS // 32
TILE_ROWS = 128  # rows of a tile: the largest row block (num_per_tokens)
# Thread layout (lanes per tile row, rows per thread) by ``wide``: 16 lanes x 8 rows (a tile row is
# 256 bytes, 128 bytes of loads per thread) or 8 lanes x 4 rows (a tile row is 128 bytes, 64 bytes
# of loads per thread; transposed: a thread's 4 rows are one word of the output).  Either way a
# warp covers 16 rows.
LAYOUT = {1: (16, 8), 0: (8, 4)}
WARP_ROWS = 16
# Launch bounds (blocks of 256 threads per SM) by (transpose, wide, in_dtype): narrow 4 (<= 64
# registers); wide 3 (<= 80), the pre-quantized input 5 (<= 48: its codes wait in shared memory,
# 42 KiB per block); transposed 5 (<= 48 registers; 11 KiB of static shared memory per block).
MIN_BLOCKS_PER_SM = {(0, 0, "bfloat16"): 4, (0, 0, "float32"): 4, (0, 1, "bfloat16"): 3, (0, 1, "float32"): 3,
                     (0, 1, "float8_e4m3fn"): 5, (1, 0, "bfloat16"): 5}
FP8_MAX = 448.0
SF_CLAMP_MIN = 1e-4
IN_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / piece tests
    "tl.disable_safe_memory_legalize": True,
}

# Device helpers: an e4m3 code pair of a word as an f16 pair (exact, 0x7F / 0xFF -> NaN), one f16
# of such a pair as float32 (the two steps of ``tka_e4m3x2_values``, apart so that the f16 pairs
# can be kept).
DEVICE_SOURCE = r"""
__device__ __forceinline__ unsigned tka_pcc_e4m3x2_f16x2(unsigned w, int hi) {
  unsigned h;
  const unsigned short p16 = (unsigned short)((w >> (16 * hi)) & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(p16));
  return h;
}
__device__ __forceinline__ float tka_pcc_f16_value(unsigned h, int hi) {
  float v;
  const unsigned short b = (unsigned short)((h >> (16 * hi)) & 0xFFFFu);
  asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(b));
  return v;
}
// n (4 or 8) consecutive positions from a 16-byte aligned address, as 16-byte loads
__device__ __forceinline__ void tka_pcc_load_rows(int* dst, const int* src, int n) {
  #pragma unroll
  for (int k = 0; k < n / 4; ++k) {
    const int4 v = reinterpret_cast<const int4*>(src)[k];
    dst[4 * k] = v.x; dst[4 * k + 1] = v.y; dst[4 * k + 2] = v.z; dst[4 * k + 3] = v.w;
  }
}
// Pre-quantized input, a thread's own 16-byte slot of the shared tile (called with the slot's
// address, so TileLang sees no shared access and inserts no barriers: no other thread touches
// the slot).  Fetch: where `ok`, the row's piece (at x_col + pos * row_bytes) by cp.async into the
// slot and its input factor (at sf_col + pos * sf_cols) as the result; else a zero slot and 0,
// nothing read.  One predicated copy or store, 64-bit offsets, no branch.
__device__ __forceinline__ float tka_pcc_fetch(void* slot, const void* x_col, const float* sf_col, int pos,
                                               int row_bytes, int sf_cols, bool ok) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(slot);
  const unsigned p = ok ? (unsigned)pos : 0u;  // pos >= 0 where ok: unsigned 32 x 32 -> 64-bit products
  const char* src = static_cast<const char*>(x_col) + (unsigned long long)p * (unsigned)row_bytes;
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q cp.async.cg.shared.global [%0], [%1], 16;\n\t"
      "@!q st.shared.v4.u32 [%0], {%3, %3, %3, %3};\n\t}" ::"r"(s), "l"(src), "r"((int)ok), "r"(0u) : "memory");
  return ok ? sf_col[(unsigned long long)p * (unsigned)sf_cols] : 0.0f;
}
// The slot read back (after the cp.async wait, a compiler memory barrier, so it stays after it)
__device__ __forceinline__ void tka_pcc_slot_load(unsigned* dst, const void* slot) {
  const uint4 v = *static_cast<const uint4*>(slot);
  dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}
"""


def per_channel_cast_kernel(in_dtype: str, transpose: int, wide: int):
    assert in_dtype in IN_BYTES
    assert transpose in (0, 1) and (not transpose or in_dtype == "bfloat16")
    quantized = in_dtype == "float8_e4m3fn"
    assert wide in (0, 1) and not (transpose and wide) and (wide or not quantized)
    L, R = LAYOUT[wide]  # lanes per tile row, rows per thread
    V = 16 // IN_BYTES[in_dtype]  # channels per 16-byte piece
    # transposed: a thread's 4 rows are one output word per channel, its 8 channels one 8-word slot group
    assert not transpose or (R == 4 and V == 8 and L == 8)
    assert 32 // L * R == WARP_ROWS
    SHFL_STEPS = (32 // L).bit_length() - 1  # row groups of a warp: 4 (2 steps) or 2 (1 step)
    CH = L * V  # channels per tile
    OW = V // 4  # 32-bit words of e4m3 codes per piece
    # the fewest rows per factor: 32 transposed (upstream's 32 and 128), else 128, so that the
    # (row block, channel) pairs of a tile are at most one per thread
    min_npt = 32 if transpose else TILE_ROWS
    assert TILE_ROWS // min_npt * CH <= THREADS
    # values per 32-bit input word
    PER_WORD = 4 // IN_BYTES[in_dtype]
    # pre-quantized: pieces per input factor (128 channels)
    SF_PIECES = 128 // V

    def value(w, i, c):
        """Channel c of the thread's row i as float32 (bf16 or fp32 x)."""
        if in_dtype == "bfloat16":  # c may be a loop variable: the shift is 16 for even c, 0 for odd
            return T.reinterpret((w[i, c // PER_WORD] << T.Cast("uint32", 16 - 16 * (c % 2))) & T.uint32(0xFFFF0000),
                                 T.float32)
        return T.reinterpret(w[i, c // PER_WORD], T.float32)

    def scaled(w, sf_inv, i, c):
        return T.call_extern(T.float32, "__fmul_rn", value(w, i, c), sf_inv[c])

    @T.macro
    def load_codes(tile, wr, hr, row, lane):
        """Pre-quantized: one 16-byte piece of the shared tile, its codes as f16 pairs (exact)."""
        T.evaluate(T.call_extern("void", "tka_pcc_slot_load", T.address_of(wr[0]), T.address_of(tile[row, lane, 0])))
        for m in T.unroll(8):
            hr[m] = T.call_extern(T.uint32, "tka_pcc_e4m3x2_f16x2", wr[m // 2], m % 2)

    def code_value(hr, c, s):
        """fl(q * s) of channel c of the piece that load_codes decoded."""
        return T.call_extern(T.float32, "__fmul_rn", T.call_extern(T.float32, "tka_pcc_f16_value", hr[c // 2], c % 2), s)

    num_tokens = T.dynamic("num_tokens")  # rows of x
    num_rows = T.dynamic("num_rows")  # rows of the output (pos_to_token's length with gather)
    row_pieces = T.dynamic("row_pieces")  # hidden / V
    sf_cols = T.dynamic("sf_cols")  # columns of x_sf (pre-quantized: hidden / 128)
    sf_elems = T.dynamic("sf_elems")  # ceil(num_rows / npt) * hidden

    if transpose:
        # [hidden, num_rows] e4m3 as 16-byte chunks of 16 rows
        out_type = T.Tensor[(row_pieces * V, num_rows // 16), "uint32x4"]
        grid = (T.ceildiv(num_rows, TILE_ROWS), T.ceildiv(row_pieces, L))
    else:
        # [num_rows, hidden] e4m3 as 32-bit words
        out_type = T.Tensor[(num_rows * row_pieces * OW,), T.uint32]
        # x: channel tiles, y: row tiles; with a gather the other way round (row tile fastest)
        col_tiles = T.ceildiv(row_pieces, L)
        row_tiles = T.ceildiv(num_rows, TILE_ROWS)
        # (gather is 0 or 1: the launch geometry is plain integer arithmetic for the host stub)
        grid = (lambda gather: gather * row_tiles + (1 - gather) * col_tiles,
                lambda gather: gather * col_tiles + (1 - gather) * row_tiles)

    @T.prim_func
    def per_channel_cast(
        x: T.Tensor[(num_tokens, row_pieces, 4), T.uint32],  # 16-byte pieces of x as 32-bit words
        x_sf: T.Tensor[(num_tokens, sf_cols), T.float32],  # pre-quantized input's factors (else unused)
        pos_to_token: T.Tensor[(num_rows,), T.int32],  # with gather
        out: out_type,
        out_sf: T.Tensor[(sf_elems,), T.float32],
        num_per_tokens: T.int32,  # 16, 32, 64 or 128
        gather: T.int32,
        round_sf: T.int32,
    ):
        with T.Kernel(*[g(gather) if callable(g) else g for g in grid], threads=THREADS) as block_ids:
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM[(transpose, wide, in_dtype)])
            T.import_source(NAN_MAX_SOURCE + CAST_SOURCE + QUANT_SOURCE + cp_async.DEVICE_SOURCE + DEVICE_SOURCE
                            + (LOAD_ORDER_SOURCE if quantized else ""))
            tid = T.get_thread_binding()
            T.assume(num_per_tokens >= min_npt)
            T.assume(num_per_tokens <= TILE_ROWS)

            # transposed: three static tiles, none aliasing another, so that only the three
            # read-after-write barriers remain (merged into one dynamic buffer, TileLang also put a
            # barrier before each reuse of the bytes)
            tile_scope = "shared" if transpose else "shared.dyn"
            partial = T.alloc_shared((WARPS, CH), T.float32, scope=tile_scope)  # per-warp maxima of 16 rows
            inv = T.alloc_shared((TILE_ROWS // min_npt, CH), T.float32, scope=tile_scope)  # sf_inv per (row block, channel)
            if transpose:
                # e4m3 codes of the tile, one 128-byte row (32 words) per channel, slots swizzled
                codes_v = T.alloc_shared((CH * 8,), "uint32x4", scope=tile_scope)
                codes_t = T.view(codes_v, (CH * 32,), T.uint32)
            if quantized:
                # the tile's codes, 16 bytes per (row, piece): each thread's own slots (cp.async), static
                # shared memory apart from the merged dynamic buffers
                tile = T.alloc_shared((TILE_ROWS, L, 4), T.uint32, scope="shared")
                wr = T.alloc_local((4,), T.uint32)  # one piece of one row
                hr = T.alloc_local((8,), T.uint32)  # its codes as f16 pairs

            if not quantized:
                w = T.alloc_local((R, 4), T.uint32)  # the thread's R pieces
            pos = T.alloc_local((R,), T.int32)
            s_in = T.alloc_local((R,), T.float32)
            amax = T.alloc_local((V,), T.float32)
            pmax = T.alloc_local((4,), T.uint32)  # bf16: packed maxima of channel pairs
            sf_inv = T.alloc_local((V,), T.float32)
            code = T.alloc_local((R, OW), T.uint32)
            a = T.alloc_var(T.float32)

            if transpose:
                bx, by = block_ids
                tile_c = by  # channel tile
                tile_r = bx  # row tile: blocks started together write the same output rows
            else:
                # Without a gather, channel tile fastest: the blocks started together read whole
                # rows.  With a gather, row tile fastest: the blocks started together read a
                # 256-byte column band of every output row, so the band of a token that several
                # output rows read (routed to several local experts) is still in L2 at its
                # repeated reads.
                # (variables: the generated code would otherwise repeat the selects at every use)
                bx, by = block_ids
                tile_c = T.alloc_var(T.int32)
                tile_r = T.alloc_var(T.int32)
                tile_c = T.if_then_else(gather != 0, by, bx)
                tile_r = T.if_then_else(gather != 0, bx, by)
            rg = tid // L
            piece = tile_c * L + tid % L
            piece_ok = piece < row_pieces
            row0 = tile_r * TILE_ROWS + rg * R  # the thread's first row
            rows_ok = row0 < num_rows  # num_rows % 16 == 0 with gather or transposed; else per row

            # ---- positions: the source row of each of the R rows (-1: a zero row)
            if gather != 0:
                for i in T.unroll(R):
                    pos[i] = -1
                if rows_ok:
                    # 16-byte loads (row0 % R == 0, pos_to_token 16-byte aligned)
                    T.evaluate(T.call_extern("void", "tka_pcc_load_rows", T.address_of(pos[0]), T.address_of(pos_to_token[row0]), R))
                for i in T.unroll(R):
                    pos[i] = T.if_then_else(pos[i] < num_tokens, pos[i], -1)
            else:
                for i in T.unroll(R):
                    pos[i] = T.if_then_else(row0 + i < num_rows, row0 + i, -1)

            # ---- loads: all R pieces (and their input factors) before the first use; pre-quantized:
            # into the thread's own slots of the shared tile (zeros for a missing row or piece)
            if quantized:
                for i in T.unroll(R):
                    s_in[i] = T.call_extern(
                        T.float32, "tka_pcc_fetch", T.address_of(tile[rg * R + i, tid % L, 0]),
                        T.address_of(x[0, piece, 0]), T.address_of(x_sf[0, piece // SF_PIECES]), pos[i], row_pieces * 16,
                        sf_cols, piece_ok and pos[i] >= 0)
            else:
                for i in T.unroll(R):
                    s_in[i] = T.float32(0)
                    if piece_ok and pos[i] >= 0:
                        for u in T.vectorized(4):
                            w[i, u] = x[T.Cast("int64", pos[i]), piece, u]
                    else:
                        for u in T.unroll(4):
                            w[i, u] = T.uint32(0)
            if quantized:
                # all R input factors issued before the wait (kernels_tl/load_order.py: without the
                # branch ptxas sinks 4 of the 8 factor loads past the wait for the copies, one more
                # round trip after the data is in); a block runs only when num_rows > 0 (the host
                # launches none else, and the grid has ceil(num_rows / 128) row tiles)
                T.evaluate(end_of_loads(num_rows == 0))
                # the thread's copies done (and visible to it); no other thread reads its slots
                cp_async.commit()
                cp_async.wait(0)

            # ---- 1. amax over the thread's rows, then over the warp's row groups
            if in_dtype == "bfloat16":
                for k in T.unroll(4):
                    pmax[k] = w[0, k] & T.uint32(0x7FFF7FFF)
                    for i in T.unroll(1, R):
                        pmax[k] = bf16x2_max_nan(pmax[k], w[i, k] & T.uint32(0x7FFF7FFF))
                    for st in T.unroll(SHFL_STEPS):
                        pmax[k] = bf16x2_max_nan(pmax[k], T.shfl_xor(pmax[k], L << st))
                    amax[2 * k] = T.reinterpret(pmax[k] << T.uint32(16), T.float32)
                    amax[2 * k + 1] = T.reinterpret(pmax[k] & T.uint32(0xFFFF0000), T.float32)
            elif quantized:
                # row by row from the tile: the codes as f16 pairs (exact), |fl(q * s_in)|
                for i in T.unroll(R):
                    load_codes(tile, wr, hr, rg * R + i, tid % L)
                    for c in T.unroll(V):
                        if i == 0:
                            amax[c] = T.abs(code_value(hr, c, s_in[i]))
                        else:
                            amax[c] = max_nan(amax[c], T.abs(code_value(hr, c, s_in[i])))
                for c in T.unroll(V):
                    for st in T.unroll(SHFL_STEPS):
                        amax[c] = max_nan(amax[c], T.shfl_xor(amax[c], L << st))
            else:
                for c in T.unroll(V):
                    amax[c] = T.abs(value(w, 0, c))
                    for i in T.unroll(1, R):
                        amax[c] = max_nan(amax[c], T.abs(value(w, i, c)))
                    for st in T.unroll(SHFL_STEPS):
                        amax[c] = max_nan(amax[c], T.shfl_xor(amax[c], L << st))

            # ---- 2. the warp's maxima to shared memory
            if tid % 32 < L:
                for c in T.vectorized(V):
                    partial[tid // 32, (tid % L) * V + c] = amax[c]
            T.sync_threads()

            # ---- 3. factors: one thread per (row block, channel)
            warps_per_block = num_per_tokens // WARP_ROWS
            if transpose:
                # num_per_tokens is a power of two (32 or 128 here): shifts, no run-time division
                npt_log2 = 31 - T.call_extern(T.int32, "__clz", num_per_tokens)
                num_blocks = T.shift_right(TILE_ROWS, npt_log2)
            else:
                num_blocks = TILE_ROWS // num_per_tokens  # row blocks of a tile (folded: 1)
            if tid < num_blocks * CH:
                blk = tid // CH
                ch = tid % CH
                a = partial[blk * warps_per_block, ch]
                for m in T.unroll(1, TILE_ROWS // WARP_ROWS):
                    if m < warps_per_block:
                        a = max_nan(a, partial[blk * warps_per_block + m, ch])
                sf, inv_value, _ = scale_factor(a, T.float32(SF_CLAMP_MIN), round_sf != 0)
                inv[blk, ch] = inv_value
                channel = tile_c * CH + ch
                if channel < row_pieces * V and tile_r * TILE_ROWS + blk * num_per_tokens < num_rows:
                    out_sf[(T.Cast("int64", tile_r) * num_blocks + blk) * T.Cast("int64", row_pieces * V)
                           + channel] = sf
            T.sync_threads()

            # ---- 4. encode
            blk_t = T.shift_right(rg * R, npt_log2) if transpose else rg * R // num_per_tokens
            for c in T.vectorized(V):
                sf_inv[c] = inv[blk_t, (tid % L) * V + c]
            if quantized:
                # decoded again from the tile (registers kept for occupancy), one 16-byte store per row
                for i in T.unroll(R):
                    load_codes(tile, wr, hr, rg * R + i, tid % L)
                    for q in T.unroll(OW):
                        code[i, q] = T.call_extern(
                            T.uint32, "tka_e4m3x4_codes",
                            *[T.call_extern(T.float32, "__fmul_rn", code_value(hr, 4 * q + e, s_in[i]), sf_inv[4 * q + e])
                              for e in range(4)])
                    if piece_ok and row0 + i < num_rows:
                        T.evaluate(T.call_extern(
                            "void", "tka_store_x4", T.address_of(out[(T.Cast("int64", row0 + i) * row_pieces + piece) * OW]),
                            code[i, 0], code[i, 1], code[i, 2], code[i, 3]))
            elif transpose:
                # per channel, the codes of its 4 rows as one word (byte i: row i; the same products
                # and conversions as the in-place codes), into the channel's 128-byte row with the
                # word slot XORed with 4 * (channel // 8) = 4 * (tid % L): a warp's 32 stores hit 32
                # banks (rg's low 2 bits from the lane, its high 3 bits XOR the lane's piece)
                for c in T.unroll(V):
                    codes_t[((tid % L) * V + c) * 32 + (rg ^ ((tid % L) * 4))] = T.call_extern(
                        T.uint32, "tka_e4m3x4_codes", *[scaled(w, sf_inv, i, c) for i in range(R)])
                T.sync_threads()
                for j in T.unroll(CH * 8 // THREADS):
                    unit = j * THREADS + tid
                    ch_o = unit // 8
                    chunk = unit % 8
                    if tile_c * CH + ch_o < row_pieces * V:
                        out[T.Cast("int64", tile_c * CH + ch_o), tile_r * 8 + chunk] = \
                            codes_v[ch_o * 8 + (chunk ^ (ch_o // 8 % 8))]
            else:
                for i in T.unroll(R):
                    for q in T.unroll(OW):
                        code[i, q] = T.call_extern(
                            T.uint32, "tka_e4m3x4_codes", scaled(w, sf_inv, i, 4 * q),
                            scaled(w, sf_inv, i, 4 * q + 1), scaled(w, sf_inv, i, 4 * q + 2),
                            scaled(w, sf_inv, i, 4 * q + 3))
                    # in place: each row's codes go out as soon as they are made
                    if piece_ok and row0 + i < num_rows:
                        for q in T.vectorized(OW):
                            out[(T.Cast("int64", row0 + i) * row_pieces + piece) * OW + q] = code[i, q]

    return per_channel_cast


def host_constants(in_dtype: str, transpose: int, wide: int) -> dict:
    """Channels per tile (grid) and per 16-byte piece (hidden's granularity)."""
    V = 16 // IN_BYTES[in_dtype]
    return {"tile_channels": LAYOUT[wide][0] * V, "piece_channels": V}
