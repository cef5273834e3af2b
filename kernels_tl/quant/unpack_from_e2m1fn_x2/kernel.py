"""quant.unpack_from_e2m1fn_x2: packed FP4 (E2M1) bytes to float32, bfloat16 or float16.

``x`` int8/uint8 ``[rows, L]`` (the host's view of ``[..., L]``: leading dims flattened into
rows ``row_stride`` bytes apart) -> ``out`` ``[rows, 2L]`` dense, ``out[r, 2j + i]`` the value
of nibble ``i`` of byte ``x[r, j]`` (low nibble first).  A nibble ``s e1 e0 m`` is decoded by
integer arithmetic into float32 bits, with no subnormal intermediate: magnitude code
``c = e1 e0 m`` gives ``0`` (c = 0), ``0x3F000000`` (0.5, c = 1) or ``0x3F000000 + c << 22``
(``2^(e-1) * (1 + m/2)``, c >= 2), the sign is ``s << 31`` (nibble 8 is ``-0.0``); every value
is exact in the three output dtypes, so the final conversion is exact too.

Design
------
Byte-bound and element-wise.  A *chunk* is 16 consecutive bytes of a row (32 outputs).  One
thread per chunk: the flat thread index over ``rows * chunks_per_row`` (one 32-bit division)
gives the row and the chunk.

* Vector path (``vector != 0``, set by the host when every full chunk and its outputs are
  16-byte aligned: both base pointers aligned and either a single row, i.e. a contiguous input
  seen as one flat row, or ``L`` and ``row_stride`` multiples of 16): one 16-byte load of four
  words from ``x_words`` and 16-byte stores of the 32 values to ``out_chunks`` (8 for fp32, 4
  for bf16 / fp16), each warp instruction covering contiguous sectors.
* Byte path (the row's last, partial chunk; every chunk when ``vector == 0``, e.g. a
  misaligned view or an odd row stride): byte loads and element stores, guarded by the row
  length.
* ``x_words`` / ``x_bytes`` and ``out_chunks`` / ``out_elems`` are two views of the same
  pointer each (the host passes it twice).  Offsets are 64-bit (``row * row_stride`` may pass
  2^31); the host keeps ``rows * chunks_per_row`` below 2^31.

Static configuration: ``out_dtype`` (float32, bfloat16, float16), 3 per arch; the shape,
the row stride and the path are run-time.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 256  # per block
CHUNK = 16  # bytes per thread: one 16-byte load
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / chunk / byte tests
    "tl.disable_safe_memory_legalize": True,
}
OUT_DTYPES = ("float32", "bfloat16", "float16")
NIBBLES = tuple(range(8))  # per 32-bit word
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _u32(v):
    return T.uint32(v)


def e2m1_float(word, i):
    """The float32 value of nibble ``i`` (0..7, low first) of the 32-bit ``word``, exactly,
    built from its bits with no subnormal intermediate."""
    nibble = word >> _u32(4 * i) if i else word
    code = nibble & _u32(7)
    magnitude = T.if_then_else(code >= _u32(2), (code << _u32(22)) + _u32(0x3F000000), code * _u32(0x3F000000))
    sign = (nibble & _u32(8)) << _u32(28)
    return T.reinterpret(magnitude | sign, T.float32)


def unpack_from_e2m1fn_x2_kernel(out_dtype: str):
    assert out_dtype in OUT_DTYPES
    per_store = 16 // _BYTES[out_dtype]  # outputs per 16-byte store

    x_len = T.dynamic("x_len", "int64")  # bytes the view spans
    x_chunks = T.dynamic("x_chunks", "int64")  # whole 16-byte chunks the view spans
    out_len = T.dynamic("out_len", "int64")  # rows * 2L
    out_chunks_len = T.dynamic("out_chunks_len", "int64")  # out_len / 32

    @T.prim_func
    def unpack_from_e2m1fn_x2(
        x_words: T.Tensor[(x_chunks, 4), T.uint32],
        x_bytes: T.Tensor[(x_len,), T.uint8],
        out_chunks: T.Tensor[(out_chunks_len, 2 * CHUNK), out_dtype],
        out_elems: T.Tensor[(out_len,), out_dtype],
        rows: T.int32,
        chunks_per_row: T.int32,  # ceil(L / 16)
        row_len: T.int64,  # L (bytes)
        row_stride: T.int64,  # bytes between rows
        vector: T.int32,  # 1: full chunks take the 16-byte path
    ):
        with T.Kernel(T.ceildiv(rows * chunks_per_row, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(chunks_per_row > 0)
            tid = T.get_thread_binding()
            words = T.alloc_local((4,), T.uint32)
            vals = T.alloc_local((2 * CHUNK,), out_dtype)
            byte = T.alloc_var(T.uint32)
            row = T.alloc_var(T.int32)
            chunk = T.alloc_var(T.int32)
            row = (bid * THREADS + tid) // chunks_per_row
            chunk = (bid * THREADS + tid) - row * chunks_per_row
            first = T.Cast("int64", chunk) * CHUNK  # the chunk's first byte in its row
            if row < rows:
                if vector != 0 and first + CHUNK <= row_len:
                    # the chunk's index in 16-byte units (row_stride % 16 == 0 or a single row)
                    src = T.Cast("int64", row) * (row_stride // CHUNK) + T.Cast("int64", chunk)
                    dst = T.Cast("int64", row) * (row_len // CHUNK) + T.Cast("int64", chunk)
                    for w in T.vectorized(4):
                        words[w] = x_words[src, w]
                    for w in T.unroll(4):
                        for i in NIBBLES:  # a Python loop: the decoder takes the nibble as an int
                            vals[8 * w + i] = T.Cast(out_dtype, e2m1_float(words[w], i))
                    for s in T.unroll(2 * CHUNK // per_store):
                        for u in T.vectorized(per_store):
                            out_chunks[dst, s * per_store + u] = vals[s * per_store + u]
                else:
                    base = T.Cast("int64", row) * row_stride + first
                    out_base = T.Cast("int64", row) * (2 * row_len) + 2 * first
                    for b in T.unroll(CHUNK):
                        if first + b < row_len:
                            byte = T.Cast("uint32", x_bytes[base + b])  # one load (a local, not re-read)
                            out_elems[out_base + 2 * b] = T.Cast(out_dtype, e2m1_float(byte, 0))
                            out_elems[out_base + 2 * b + 1] = T.Cast(out_dtype, e2m1_float(byte, 1))

    return unpack_from_e2m1fn_x2


def host_constants(out_dtype: str) -> dict:
    """Bytes per thread (the chunk) and per block (threads), for the host's grid bound."""
    return {"chunk": CHUNK, "threads": THREADS}
