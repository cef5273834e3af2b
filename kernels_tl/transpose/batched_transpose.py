"""transpose.transpose / transpose.batched_transpose: swap the last two dims.

``x`` [B, M, N] -> ``out`` [B, N, M] (contiguous); ``transpose`` is the same
kernel on a 2-D ``x`` (B = 1).  Rows of ``x`` may be padded: only
``x.stride(-1) == 1`` is required, the row and batch strides are run-time
values.  A transpose moves bits, so the kernel works on 16-byte chunks and
32-bit words; the dtype enters only through the element size.  Static
configurations: ``dtype`` in {bfloat16, float32, float8_e4m3fn}, i.e. 3
configs cover everything (B, M, N and both strides stay dynamic).

Design
------
One block per 64 x 64-element tile (grid: N/64, M/64, B).  64 divides every
legal M and N, so one tile shape serves all of them (no mod-128 variants).
Every thread moves 4 chunks (64 bytes) in and 64 bytes out, so the block has
TILE * TILE * elem_bytes / 64 threads: fp32 256, bf16 128, fp8 64.

1. global -> shared: consecutive threads take consecutive 16-byte chunks of
   the tile, row-major (one 128-byte line per 8 threads; a 64-byte fp8 row per
   4).  A thread's 4 loads are all issued before its first shared store.
2. shared -> registers -> global: after one barrier each thread owns *units*
   of ``P`` output rows x one 16-byte output chunk, ``P`` = elements per
   32-bit word.  A unit reads one word column of the tile across ``V`` = 16 /
   elem_bytes consecutive rows (``V`` x LDS.32), transposes that V x P element
   block in registers with byte permutes (fp32: none, bf16: 8 PRMT, fp8: 32
   PRMT) and stores ``P`` chunks.  The 32 lanes of a warp write 8 consecutive
   chunks (128 bytes) of 4 output rows (fp32, bf16) or 4 chunks (a whole
   64-byte tile row) of 8 output rows (fp8).

Bank conflicts: the tile is kept as 16-byte chunks, and a chunk's slot inside
its 128-byte line (8 slots x 4 banks) is XORed with ``(row // V) * K % 8``.
A phase-2 LDS.32 reads 4 words (one chunk) from each of 8 (row group, chunk)
pairs; the XOR puts the 8 pairs into 8 different slots, so the 32 lanes hit 32
banks (K = 2 for fp8, where an instruction covers 4 row groups x 2 chunks).
A quarter-warp of phase-1 STS.128 writes one whole line, which the XOR only
permutes: also conflict-free.

Alignment: 16-byte accesses need ``x``'s data pointer, row stride and batch
stride to be multiples of 16 bytes (the op checks; upstream asks only for a
row stride that is a multiple of 4 elements).  ``out`` is freshly allocated,
or a caller's ``out=`` tensor that must be 16-byte aligned as well.

Expected cost at 8192 x 4096 bf16: 64 MiB read + 64 MiB written; per thread
4 x LDG.128, 4 x STS.128, 16 x LDS.32, 16 x PRMT, 4 x STG.128 and 40
registers (12 blocks, 96 KiB of loads in flight per SM).  At 4.0 TB/s that is
33.6 us.
"""

from tilelang import language as T

from kernels_tl.spec import KernelSpec, OpSpec, Out, Param, Tensor

TILE = 64  # elements per tile side; M and N are multiples of 64
CHUNKS_PER_THREAD = 4  # 16-byte chunks each thread loads (and stores)
ELEM_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
DTYPES = tuple(ELEM_BYTES)


def _byte_perm(a, b, selector: int):
    """PRMT: byte k of the result is byte ``selector >> 4k & 7`` of {b, a}."""
    return T.call_extern("uint32", "__byte_perm", a, b, T.uint32(selector))


def batched_transpose_kernel(dtype: str):
    eb = ELEM_BYTES[dtype]
    P = 4 // eb  # elements per 32-bit word
    V = 16 // eb  # elements per 16-byte chunk (= words one unit reads)
    C = TILE // V  # chunks per tile row: fp32 16, bf16 8, fp8 4
    K = 2 if C < 8 else 1  # swizzle multiplier (see the module docstring)
    threads = TILE * C // CHUNKS_PER_THREAD
    # Phase 2: a unit is (word column nw, output chunk mc).  A warp covers MCW
    # consecutive output chunks of 32 // MCW consecutive word columns.
    MCW = min(8, C)
    units_per_thread = (TILE // P) * C // threads

    num_batches = T.dynamic("num_batches")
    rows = T.dynamic("rows")  # M
    cols = T.dynamic("cols")  # N
    batch_stride = T.dynamic("batch_stride", "int64")  # elements
    row_stride = T.dynamic("row_stride", "int64")  # elements

    def smem_chunk(r, c):
        """Swizzled place of chunk ``c`` of tile row ``r``."""
        q = r * C + c
        return q // 8 * 8 + ((q % 8) ^ (r // V * K % 8))

    @T.prim_func
    def batched_transpose(
        x: T.StridedTensor[(num_batches, rows, cols), (batch_stride, row_stride, 1), dtype],
        out: T.Tensor[(num_batches, cols, rows), dtype],
    ):
        with T.Kernel(cols // TILE, rows // TILE, num_batches, threads=threads) as (pid_n, pid_m, pid_b):
            # 16-byte chunk views (the op checks the alignment): every global
            # access below is a single 128-bit load or store.  Row lengths are
            # written as whole tiles so that no bounds check is generated.
            x_chunks = T.StridedTensor(
                (num_batches, rows, cols // TILE * C), (batch_stride // V, row_stride // V, 1), "uint32x4", data=x.data
            )
            out_chunks = T.Tensor((num_batches, cols, rows // TILE * C), "uint32x4", out.data)
            tile = T.alloc_shared((TILE * C,), "uint32x4")
            tile_words = T.view(tile, (TILE * C * 4,), T.uint32)
            column = T.alloc_local((V,), T.uint32)  # one word column, V tile rows
            packed = T.alloc_local((4 * P,), T.uint32)  # P output chunks
            tid = T.get_thread_binding()

            # 1. global -> shared
            for i in T.unroll(CHUNKS_PER_THREAD):
                r = (i * threads + tid) // C
                c = (i * threads + tid) % C
                tile[smem_chunk(r, c)] = x_chunks[pid_b, pid_m * TILE + r, pid_n * C + c]
            T.sync_threads()

            # 2. shared -> registers -> out
            for i in T.unroll(units_per_thread):
                lane = (i * threads + tid) % 32
                warp = (i * threads + tid) // 32
                mc = lane % MCW + MCW * (warp % (C // MCW))
                nw = lane // MCW + (32 // MCW) * (warp // (C // MCW))
                for v in T.unroll(V):
                    column[v] = tile_words[smem_chunk(mc * V + v, nw // 4) * 4 + nw % 4]
                # packed[e * 4 + j] = word j of output row nw * P + e: element e
                # of each of the words column[j * P], ..., column[j * P + P - 1].
                if P == 1:
                    for j in T.unroll(4):
                        packed[j] = column[j]
                elif P == 2:
                    for j in T.unroll(4):
                        packed[j] = _byte_perm(column[2 * j], column[2 * j + 1], 0x5410)  # low halves
                        packed[4 + j] = _byte_perm(column[2 * j], column[2 * j + 1], 0x7632)  # high halves
                else:
                    for j in T.unroll(4):
                        # interleave the bytes of rows (0, 1) and of rows (2, 3), then merge the pairs
                        lo01 = _byte_perm(column[4 * j], column[4 * j + 1], 0x5140)
                        hi01 = _byte_perm(column[4 * j], column[4 * j + 1], 0x7362)
                        lo23 = _byte_perm(column[4 * j + 2], column[4 * j + 3], 0x5140)
                        hi23 = _byte_perm(column[4 * j + 2], column[4 * j + 3], 0x7362)
                        packed[j] = _byte_perm(lo01, lo23, 0x5410)
                        packed[4 + j] = _byte_perm(lo01, lo23, 0x7632)
                        packed[8 + j] = _byte_perm(hi01, hi23, 0x5410)
                        packed[12 + j] = _byte_perm(hi01, hi23, 0x7632)
                for e in T.unroll(P):
                    out_chunks[pid_b, pid_n * TILE + nw * P + e, pid_m * C + mc] = packed[T.Ramp(e * 4, 1, 4)]

    return batched_transpose


KERNEL = KernelSpec(
    name="transpose.batched_transpose",
    factory=batched_transpose_kernel,
    static=("dtype",),
    bytes="2 * num_batches * rows * cols * {'bfloat16': 2, 'float32': 4, 'float8_e4m3fn': 1}[dtype]",
    pass_configs={"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True},
)

# C++ (stub) side.  ``vec`` = elements per 16-byte chunk.  Alignment and
# stride checks are skipped for empty tensors (nothing is launched).
_EMPTY = "num_batches == 0 || rows == 0 || cols == 0"


def _checks(rows_dim: str, cols_dim: str, row_stride: str, batch_stride: str = None):
    """The stub's checks; ``rows_dim``/``cols_dim``: which dims of x are M and N."""
    checks = [
        ("rows % 64 == 0", f"x.shape[{rows_dim}] (M) must be a multiple of 64"),
        ("cols % 64 == 0", f"x.shape[{cols_dim}] (N) must be a multiple of 64"),
        ("rows / 64 <= 65535", f"x.shape[{rows_dim}] (M) must be at most 64 * 65535"),
        (f"{_EMPTY} || {row_stride} % vec == 0",
         f"x.stride({rows_dim}) (the row stride) must be a multiple of 16 bytes"),
        (f"{_EMPTY} || reinterpret_cast<uintptr_t>(x.data) % 16 == 0", "x must be 16-byte aligned"),
    ]
    if batch_stride is not None:
        checks += [
            ("num_batches <= 65535", "x.shape[0] (B) must be at most 65535"),
            (f"{_EMPTY} || num_batches == 1 || {batch_stride} % vec == 0",
             "x.stride(0) (the batch stride) must be a multiple of 16 bytes"),
        ]
    return checks


OPS = [
    OpSpec(
        module="transpose",
        name="batched_transpose",
        params=[Param("x", Tensor(list(DTYPES), 3, contiguous=False))],
        outs=[Out("out", "x.dtype", ["num_batches", "cols", "rows"])],
        returns=["out"],
        dims={
            "num_batches": "x.shape[0]",
            "rows": "x.shape[1]",
            "cols": "x.shape[2]",
            "vec": "16 / dtype_bytes(x.dtype)",
        },
        checks=_checks("1", "2", "x.stride[1]", "x.stride[0]"),
        config={"dtype": "x.dtype"},
        kernel_args={
            "x_chunks": "x.data",
            "out_chunks": "out.data",
            "num_batches": "num_batches",
            "rows": "rows",
            "cols": "cols",
            "batch_stride": "num_batches > 1 ? x.stride[0] : int64_t(0)",
            "row_stride": "x.stride[1]",
        },
        launch_when="num_batches > 0 && rows > 0 && cols > 0",
        doc=(
            "batched_transpose(x) -> [B, N, M]: out[b, j, i] = x[b, i, j].  x: [B, M, N] bfloat16, float32 or "
            "float8_e4m3fn, M and N multiples of 64, x.stride(-1) == 1, row and batch strides multiples of 16 bytes; "
            "the result is contiguous."
        ),
    ),
    OpSpec(
        module="transpose",
        name="transpose",
        params=[Param("x", Tensor(list(DTYPES), 2, contiguous=False))],
        outs=[Out("out", "x.dtype", ["cols", "rows"])],
        returns=["out"],
        dims={
            "num_batches": "1",
            "rows": "x.shape[0]",
            "cols": "x.shape[1]",
            "vec": "16 / dtype_bytes(x.dtype)",
        },
        checks=_checks("0", "1", "x.stride[0]"),
        config={"dtype": "x.dtype"},
        kernel_args={
            "x_chunks": "x.data",
            "out_chunks": "out.data",
            "num_batches": "num_batches",
            "rows": "rows",
            "cols": "cols",
            "batch_stride": "int64_t(0)",
            "row_stride": "x.stride[0]",
        },
        launch_when="rows > 0 && cols > 0",
        doc=(
            "transpose(x) -> [N, M]: out[j, i] = x[i, j].  x: [M, N] bfloat16, float32 or float8_e4m3fn, M and N "
            "multiples of 64, x.stride(-1) == 1, row stride a multiple of 16 bytes; the result is contiguous."
        ),
    ),
]
