"""quant.cast_back and quant.per_token_cast_back: dequantize ``(data, sf)`` to bf16 or fp32.

``data`` holds e4m3 codes ``[T, H]``, packed e2m1 ``int8 [T, H / 2]`` (element ``2j`` in the
low nibble of byte ``j``) or packed e5m6 ``uint8 [T, 3H / 2]`` (eight 12-bit codes per three
little-endian 32-bit words); ``sf`` holds one factor per ``(bm, bk)`` block, as fp32 or as
UE8M0 exponent bytes packed four per int32, at any two strides (row-major, TMA-aligned
column-major, ...).  ``out[i, j] = round(float32(q[i, j]) * sf[i / bm, j / bk])``: one float32
multiplication, rounded once to the output dtype, as the reference
(``tile_kernels_aot.torch.quant.cast_back``) computes it.

Design
------
Memory-bound and element-wise.  An *atom* is 8 consecutive elements of a row: one 16-byte
store of bf16 (two of fp32), from 8 bytes of e4m3 codes (one 8-byte load), 4 bytes of e2m1
(one 4-byte load) or 12 bytes of e5m6 (three 4-byte loads).  Consecutive lanes own consecutive
atoms, so every store instruction of a warp writes 512 contiguous bytes (whole sectors) and
every load instruction reads contiguous words.

* ``lanes_per_row`` threads per row (one 32-bit division per thread, over the flat thread
  index); a thread owns up to ``ATOMS`` atoms ``lane + k * lanes_per_row`` of its row, all
  loads (codes and factors) issued before the first use; factors are kept as the raw words
  read and decoded (packed byte select) only afterwards, so no load waits for another.  The host picks ``lanes_per_row``
  (fewer atoms per thread for small token counts, so that small calls still fill the GPU).
* Block sizes are run-time: ``row >> bm_shift`` and ``col >> bk_shift`` select the factor
  (powers of two; a block at least as wide or as tall as the tensor uses shift 31, i.e. index
  0).  With ``bk >= 8`` an atom lies inside one block and needs one factor; per-channel blocks
  (``bk`` = 1, 2 or 4) load a factor per element (a uniform branch).
* Factors are read through the sf tensor's two strides (elements), as 32-bit words: fp32
  bits, or (``packed_sf``) a word of four exponent bytes, block ``4c + j`` in byte ``j``,
  ``sf = bits(byte << 23)`` (byte 0 gives 0.0, 0xFF gives inf, as the reference decodes them).
* Decoding is exact integer arithmetic on the codes, then one multiplication:
  e4m3: ``bits(s << 31 | em << 20) * 2**120`` (exact, subnormals included), and code 0x7F
  as ``s << 31 | 0x7FF00000``, the NaN torch's own conversion gives (so that even a NaN's
  payload matches the reference); e2m1: ``bits(s << 31 | em << 22) * 2**126`` (``-0`` for
  nibble 8); e5m6: the 12-bit code is the top of an IEEE half, widened by ``cvt.f32.f16``
  exactly as the reference's ``float16 -> float32``.
* Offsets are 64-bit (TileLang's index arithmetic on the buffers; the factor offset is
  formed in int64): ``T * H`` may pass 2^31.

Static configurations: ``in_fmt`` (e4m3, e2m1, e5m6) x ``out_dtype`` (bfloat16, float32):
6 per arch.  Token count, hidden size, block shape, sf dtype and strides are run-time.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 256  # per block
ATOM = 8  # elements per atom: one 16-byte bf16 store
ATOMS = 8  # atoms a thread owns at most (the host may use fewer)
ELEMENTS = tuple(range(ATOM))
MIN_BLOCKS_PER_SM = 4
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / atom tests
    "tl.disable_safe_memory_legalize": True,
}

# 32-bit words of codes per atom
_WORDS = {"e4m3": 2, "e2m1": 1, "e5m6": 3}


def _u32(v):
    return T.uint32(v)


def _e4m3_value(word, j):
    """The float32 value of byte ``j`` of ``word`` (an e4m3 code), exactly as torch's
    conversion: finite codes through the exponent shift, code 0x7F / 0xFF as
    ``sign | 0x7FF00000``."""
    sign = (word << _u32(24 - 8 * j)) & _u32(0x80000000) if j < 3 else word & _u32(0x80000000)
    em = (word >> _u32(8 * j)) & _u32(0x7F)
    value = T.reinterpret(sign | (em << _u32(20)), T.float32) * T.float32(2.0**120)
    return T.if_then_else(em == _u32(0x7F), T.reinterpret(sign | _u32(0x7FF00000), T.float32), value)


def _e2m1_value(word, i):
    """The float32 value of nibble ``i`` of ``word`` (an e2m1 code), exactly."""
    nibble = (word >> _u32(4 * i)) & _u32(0xF)
    bits = ((nibble & _u32(8)) << _u32(28)) | ((nibble & _u32(7)) << _u32(22))
    return T.reinterpret(bits, T.float32) * T.float32(2.0**126)


def _e5m6_half_bits(w, i):
    """The IEEE half bits (code << 4) of code ``i`` of a 96-bit group ``w[0..2]`` (codes
    packed big-end first: ``w0 = h0 << 20 | h1 << 8 | h2 >> 4``, ...)."""
    m = _u32(0xFFF0)
    return [
        (w[0] >> _u32(16)) & m,
        (w[0] >> _u32(4)) & m,
        ((w[0] << _u32(8)) | (w[1] >> _u32(24))) & m,
        (w[1] >> _u32(12)) & m,
        w[1] & m,
        ((w[1] << _u32(12)) | (w[2] >> _u32(20))) & m,
        (w[2] >> _u32(8)) & m,
        (w[2] << _u32(4)) & m,
    ][i]


def cast_back_kernel(in_fmt: str, out_dtype: str):
    assert in_fmt in _WORDS and out_dtype in ("bfloat16", "float32")
    words = _WORDS[in_fmt]

    num_tokens = T.dynamic("num_tokens")
    row_atoms = T.dynamic("row_atoms")  # hidden / 8
    sf_words = T.dynamic("sf_words")

    def atom_of(lane, k, lanes_per_row):
        return lane + k * lanes_per_row

    def factor_word(sf, sf_row, col, bk_shift, sf_col_stride, packed_sf):
        """The raw 32-bit word holding the factor of channel ``col`` (int32) of the row whose
        factors start at ``sf_row``: fp32 bits, or the packed word with its exponent byte."""
        block = col >> bk_shift
        column = T.if_then_else(packed_sf != 0, block >> 2, block)
        return sf[sf_row + T.Cast("int64", column) * T.Cast("int64", sf_col_stride)]

    def factor_value(word, col, bk_shift, packed_sf):
        """The factor of channel ``col`` from its word (``factor_word``)."""
        byte = (word >> T.Cast("uint32", ((col >> bk_shift) & 3) * 8)) & _u32(0xFF)
        return T.reinterpret(T.if_then_else(packed_sf != 0, byte << _u32(23), word), T.float32)

    def factor_of(sf, sf_row, col, bk_shift, sf_col_stride, packed_sf):
        return factor_value(factor_word(sf, sf_row, col, bk_shift, sf_col_stride, packed_sf), col, bk_shift,
                            packed_sf)

    @T.prim_func
    def cast_back(
        x: T.Tensor[(num_tokens, row_atoms, words), T.uint32],
        # fp32 factors or packed UE8M0 words, as raw 32-bit words: factor [m, c] (packed:
        # word [m, c / 4]) is at m * sf_row_stride + c * sf_col_stride
        sf: T.Tensor[(sf_words,), T.uint32],
        out: T.Tensor[(num_tokens, row_atoms, ATOM), out_dtype],
        lanes_per_row: T.int32,
        bm_shift: T.int32,
        bk_shift: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        packed_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens * lanes_per_row, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            T.assume(lanes_per_row > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)

            codes = T.alloc_local((ATOMS, words), T.uint32)
            # raw factor words, decoded only after every load is issued: a decode inside the
            # load loop would wait for each word's load before issuing the next atom's loads
            factor_bits = T.alloc_local((ATOMS,), T.uint32)
            q = T.alloc_local((ATOM,), T.float32)
            vals = T.alloc_local((ATOM,), out_dtype)

            # one 32-bit division per thread (the host keeps num_tokens * lanes_per_row < 2^31)
            row = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            row = (bid * THREADS + tid) // lanes_per_row
            lane = (bid * THREADS + tid) - row * lanes_per_row
            row_ok = row < num_tokens
            sf_row = T.Cast("int64", row >> bm_shift) * T.Cast("int64", sf_row_stride)
            coarse = bk_shift >= 3  # one factor per atom

            # ---- loads: every atom's codes and (coarse) factor before the first use
            for k in T.unroll(ATOMS):
                if row_ok and atom_of(lane, k, lanes_per_row) < row_atoms:
                    if words == 2:
                        for w in T.vectorized(2):
                            codes[k, w] = x[row, atom_of(lane, k, lanes_per_row), w]
                    else:
                        for w in T.unroll(words):
                            codes[k, w] = x[row, atom_of(lane, k, lanes_per_row), w]
                    if coarse:
                        factor_bits[k] = factor_word(sf, sf_row, atom_of(lane, k, lanes_per_row) * ATOM, bk_shift,
                                                     sf_col_stride, packed_sf)

            # ---- decode, scale, round, store
            for k in T.unroll(ATOMS):
                if row_ok and atom_of(lane, k, lanes_per_row) < row_atoms:
                    for u in ELEMENTS:  # a Python loop: the decoders take the element index as an int
                        if in_fmt == "e4m3":
                            q[u] = _e4m3_value(codes[k, u // 4], u % 4)
                        elif in_fmt == "e2m1":
                            q[u] = _e2m1_value(codes[k, 0], u)
                        else:
                            bits = _e5m6_half_bits([codes[k, 0], codes[k, 1], codes[k, 2]], u)
                            half = T.reinterpret(T.Cast("uint16", bits), T.float16)
                            q[u] = T.Cast(T.float32, half)
                    if coarse:
                        factor = factor_value(factor_bits[k], atom_of(lane, k, lanes_per_row) * ATOM, bk_shift,
                                              packed_sf)
                        for u in T.unroll(ATOM):
                            vals[u] = T.Cast(out_dtype, q[u] * factor)
                    else:
                        for u in T.unroll(ATOM):
                            # per-channel blocks: a factor per element
                            col = atom_of(lane, k, lanes_per_row) * ATOM + u
                            vals[u] = T.Cast(out_dtype, q[u] * factor_of(sf, sf_row, col, bk_shift, sf_col_stride, packed_sf))
                    for u in T.vectorized(ATOM):
                        out[row, atom_of(lane, k, lanes_per_row), u] = vals[u]

    return cast_back


def host_constants(in_fmt: str, out_dtype: str) -> dict:
    """Atoms a thread owns at most (the host's bound on atoms per lane)."""
    return {"atoms_per_lane": ATOMS, "atom": ATOM}
