"""transpose.transpose / transpose.batched_transpose: swap the last two dims.

``x`` [B, M, N] -> ``out`` [B, N, M] (contiguous); ``transpose`` is the same
kernel on a 2-D ``x`` (B = 1).  Only ``x.stride(-1) == 1`` is required: the row
and batch strides are run-time values (multiples of 4 elements).  A transpose
moves bits, so the kernel works on 16-byte chunks and 32-bit words; the dtype
enters only through the element size.

Design
------
One 256-thread block per TM x TN tile of ``x`` (``TILES``: bf16 128 x 128, fp32
64 x 128, fp8 128 x 256, 32 KiB each).  The grid is (ceil(M/TM), ceil(N/TN), B)
with the M tiles innermost: blocks started one after another write consecutive
pieces of the same TN output rows, so the output streams out in whole rows.
The shared buffer is padded (never touched) so that ``BLOCKS_PER_SM`` = 3
blocks, about 96 KiB of tile loads, are resident per SM: more only queues
requests.  M and N are multiples of 64; block-uniform flags (``m_full``,
``n_full``) send edge tiles down a path that tests every access, full tiles
take a branch without predicates.

0. Programmatic dependent launch: the first ``%nsmid`` blocks (about one per
   SM) may be resident before the previous grid ends.  In them warp 0 waits for
   it; the last warp prefetches the tile into L2 if that wait is still on after
   ``PREFETCH_AFTER_CYCLES``, so the previous grid's drain overlaps this grid's
   first reads.  Every other block only waits.
1. global -> shared: consecutive threads take consecutive 16-byte chunks of the
   tile, row-major; a thread's 8 loads (128 bytes) are all issued before its
   first shared store.
2. shared -> registers -> global, after one barrier: a *unit* is ``P`` output
   rows x one 16-byte output chunk (``P`` = elements per 32-bit word): ``V`` =
   16 / elem_bytes LDS.32 of one word column, a V x P transpose in registers by
   byte permutes (fp32: none, bf16: 8 PRMT, fp8: 32), ``P`` 16-byte stores.  A
   warp writes 8 consecutive chunks (128 bytes) of 4 output rows.

Bank conflicts: a chunk's slot in its 128-byte line is XORed with
``(row // V) % 8``, so phase 2's 32 lanes hit 32 banks; phase 1's STS.128 of a
quarter-warp fills one whole line, which the XOR only permutes.

Alignment: the 16-byte path needs ``x``'s pointer and strides to be multiples
of 16 bytes (the stub passes ``wide``); otherwise phase 1 loads each chunk as
4-element pieces into the same layout (fp32 pieces are chunks: no narrow path).
Static configurations: ``dtype`` in {bfloat16, float32, float8_e4m3fn}.  bf16
8192 x 4096: 33.1 us device time on an H200, 96% of its copy bandwidth
(``notes.md``).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# Tile per dtype, (input rows TM, input cols TN) = (output cols, output rows).
TILES = {"bfloat16": (128, 128), "float32": (64, 128), "float8_e4m3fn": (128, 256)}
SUB = 64  # M and N are multiples of 64: an edge tile may hold only a multiple of 64 rows / columns
CHUNKS_PER_THREAD = 8  # 16-byte chunks each thread loads (and stores): 128 bytes in flight
ELEM_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
DTYPES = tuple(ELEM_BYTES)
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # the kernel predicates its edge tiles itself (m_full, n_full)
    "tl.disable_safe_memory_legalize": True,
}
# Resident blocks per SM wanted: ~96 KiB of tile loads in flight per SM (see
# notes.md); every dtype's tile is 32 KiB, and would otherwise fit 5-6 blocks.
BLOCKS_PER_SM = 3
SMEM_PER_SM = 228 * 1024  # sm_90a and sm_100a; each resident block also reserves 1 KiB


def _smem_bytes(tile_bytes: int, blocks_per_sm: int):
    """Shared memory a block allocates so that exactly ``blocks_per_sm`` fit on an SM."""
    size = -(-SMEM_PER_SM // (blocks_per_sm + 1) // 1024) * 1024  # (k + 1) blocks of size + 1 KiB do not fit
    size = max(size, -(-tile_bytes // 1024) * 1024)
    assert blocks_per_sm * (size + 1024) <= SMEM_PER_SM < (blocks_per_sm + 1) * (size + 1024)
    return size


# Cycles the last warp of a first-wave block polls for the release of the previous grid
# before it prefetches the block's tile (~2 us at 1.98 GHz; see notes.md).
PREFETCH_AFTER_CYCLES = 4000

# Device helpers: the SM count (%nsmid), and the wait of a block that may start early.
# Thread 0 initialises an mbarrier (one barrier makes that visible to the block); warp 0
# waits for the previous grid and then arrives on it (phase 0 completes when the wait has
# returned); the last warp polls it and, while the wait is still on after ``poll_cycles``
# (PREFETCH_AFTER_CYCLES), prefetches the tile into L2, one prefetch.global.L2 per 128-byte
# line.  A prefetch is only a hint and L2 holds the one copy of every line, so the
# previous grid's stores still reach the loads made after the wait.  (A named barrier
# between warp 0 and the last warp instead of the block barrier: racecheck and synccheck
# report errors on it.)
DEVICE_SOURCE = r"""
__device__ __forceinline__ int tka_num_sms() { int v; asm("mov.u32 %0, %%nsmid;" : "=r"(v)); return v; }
__device__ __forceinline__ void tka_prefetch_while_waiting(const void* tile, long long row_stride_bytes, int rows,
                                                           int row_bytes, int prefetch, int poll_cycles) {
  __shared__ __align__(8) unsigned long long released;
  const unsigned bar = (unsigned)__cvta_generic_to_shared(&released);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
  __syncthreads();
  if (warp == 0) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
  } else if (warp == blockDim.x / 32 - 1) {
    const long long start = clock64();
    unsigned done;
    do {
      asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar) : "memory");
    } while (!done && clock64() - start < poll_cycles);
    if (!done && prefetch) {
      const char* base = (const char*)tile;
      const int lines_per_row = row_bytes / 128;
      for (int i = lane; i < rows * lines_per_row; i += 32)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(base + (i / lines_per_row) * row_stride_bytes + (i % lines_per_row) * 128)
                     : "memory");
    }
  }
}
"""


def _byte_perm(a, b, selector: int):
    """PRMT: byte k of the result is byte ``selector >> 4k & 7`` of {b, a}."""
    return T.call_extern("uint32", "__byte_perm", a, b, T.uint32(selector))


def batched_transpose_kernel(dtype: str):
    eb = ELEM_BYTES[dtype]
    TM, TN = TILES[dtype]
    P = 4 // eb  # elements per 32-bit word
    V = 16 // eb  # elements per 16-byte chunk (= words one unit reads)
    C = TN // V  # chunks per tile row
    CM = TM // V  # chunks per output tile row
    threads = TM * C // CHUNKS_PER_THREAD
    rows_per_pass = threads // C  # tile rows one phase-1 pass covers
    # Narrow path (row or batch stride, or the pointer, not 16-byte aligned):
    # each chunk is loaded as NP pieces of 4 elements.  fp32 pieces are chunks.
    NP = V // 4
    piece = {1: "uint32x4", 2: "uint32x2", 4: "uint32"}[NP]
    # Phase 2: a unit is (word column nw, output chunk mc).  A warp covers 8
    # consecutive output chunks of 4 consecutive word columns (one smem chunk).
    MCW = 8
    units_per_thread = (TN // P) * CM // threads
    assert rows_per_pass * CHUNKS_PER_THREAD == TM and CM % MCW == 0 and C % 8 == 0
    assert TM % SUB == 0 and TN % SUB == 0 and units_per_thread * threads == (TN // P) * CM
    # The shared buffer is the tile plus padding that only caps the resident
    # blocks per SM (the padding is never touched).
    smem_chunks = _smem_bytes(TM * TN * eb, BLOCKS_PER_SM) // 16

    num_batches = T.dynamic("num_batches")
    rows = T.dynamic("rows")  # M
    cols = T.dynamic("cols")  # N
    tiles_m, tiles_n = T.ceildiv(rows, TM), T.ceildiv(cols, TN)  # grid x and y
    batch_stride = T.dynamic("batch_stride", "int64")  # elements
    row_stride = T.dynamic("row_stride", "int64")  # elements

    def smem_chunk(r, c):
        """Swizzled place of chunk ``c`` of tile row ``r``."""
        q = r * C + c
        return q // 8 * 8 + ((q % 8) ^ (r // V % 8))

    @T.prim_func
    def batched_transpose(
        x: T.StridedTensor[(num_batches, rows, cols), (batch_stride, row_stride, 1), dtype],
        out: T.Tensor[(num_batches, cols, rows), dtype],
        wide: T.int32,
    ):
        # Consecutive blocks take consecutive tiles down M: together they write
        # whole output rows (see the docstring).
        with T.Kernel(tiles_m, tiles_n, num_batches, threads=threads) as (
            pid_m,
            pid_n,
            pid_b,
        ):
            # Chunk / piece views: every global access below is a single 16-byte
            # (narrow path: 4-element) load or store.  Row lengths are written
            # as whole 64-element sub-tiles, which they are.
            x_chunks = T.StridedTensor(
                (num_batches, rows, cols // SUB * (SUB // V)),
                (batch_stride // V, row_stride // V, 1),
                "uint32x4",
                data=x.data,
            )
            x_pieces = T.StridedTensor(
                (num_batches, rows, cols // SUB * (SUB // 4)),
                (batch_stride // 4, row_stride // 4, 1),
                piece,
                data=x.data,
            )
            out_chunks = T.Tensor((num_batches, cols, rows // SUB * (SUB // V)), "uint32x4", out.data)
            tile = T.alloc_shared((smem_chunks,), "uint32x4")
            tile_pieces = T.view(tile, (smem_chunks * NP,), piece)
            tile_words = T.view(tile, (smem_chunks * 4,), T.uint32)
            column = T.alloc_local((V,), T.uint32)  # one word column, V tile rows
            packed = T.alloc_local((4 * P,), T.uint32)  # P output chunks
            tid = T.get_thread_binding()
            # An edge tile may hold only some multiple of 64 rows and/or columns
            # (block-uniform flags; edge tiles test every access).
            m_full = pid_m * TM + TM <= rows
            n_full = pid_n * TN + TN <= cols
            full = (wide != 0 or NP == 1) and m_full and n_full  # the branch-free 16-byte path

            # Only blocks of the first wave (by linear index) can start before the previous
            # grid ends (programmatic dependent launch); the first %nsmid of them (about one
            # per SM) may prefetch while they wait (see notes.md: one per SM gains as much
            # as three, and costs nothing measurable when nothing runs before).
            T.import_source(DEVICE_SOURCE)
            starts_early = ((pid_b * tiles_n + pid_n) * tiles_m + pid_m
                          < T.call_extern(T.int32, "tka_num_sms"))
            if starts_early:
                T.evaluate(T.call_extern("void", "tka_prefetch_while_waiting", T.address_of(x_chunks[pid_b, pid_m * TM, pid_n * C]),
                                         row_stride * eb, TM, TN * eb, T.Cast(T.int32, full), PREFETCH_AFTER_CYCLES))
            wait_for_previous_grid()  # programmatic dependent launch

            # 1. global -> shared.  Consecutive threads take consecutive chunks
            # of a tile row (whole 128-byte lines); pass i covers tile rows
            # rows_per_pass * i ... .  Full tiles take a branch without
            # predicates so that every compiler keeps all 8 loads in flight
            # before the first store.
            c = tid % C
            col_ok = pid_n * C + c < cols // V
            if full:
                for i in T.unroll(CHUNKS_PER_THREAD):
                    r = i * rows_per_pass + tid // C
                    tile[smem_chunk(r, c)] = x_chunks[pid_b, pid_m * TM + r, pid_n * C + c]
            elif wide != 0 or NP == 1:
                for i in T.unroll(CHUNKS_PER_THREAD):
                    r = i * rows_per_pass + tid // C
                    if pid_m * TM + r < rows and col_ok:
                        tile[smem_chunk(r, c)] = x_chunks[pid_b, pid_m * TM + r, pid_n * C + c]
            else:
                for i in T.unroll(CHUNKS_PER_THREAD):
                    r = i * rows_per_pass + tid // C
                    if pid_m * TM + r < rows and col_ok:
                        for h in T.unroll(NP):
                            tile_pieces[smem_chunk(r, c) * NP + h] = x_pieces[
                                pid_b, pid_m * TM + r, (pid_n * C + c) * NP + h
                            ]
            T.sync_threads()

            # 2. shared -> registers -> out
            for i in T.unroll(units_per_thread):
                lane = (i * threads + tid) % 32
                warp = (i * threads + tid) // 32
                mc = lane % MCW + MCW * (warp % (CM // MCW))
                nw = lane // MCW + (32 // MCW) * (warp // (CM // MCW))
                if (m_full or pid_m * TM + mc * V < rows) and (n_full or pid_n * TN + nw * P < cols):
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
                        out_chunks[pid_b, pid_n * TN + nw * P + e, pid_m * CM + mc] = packed[T.Ramp(e * 4, 1, 4)]

    return batched_transpose


def host_constants(dtype: str) -> dict:
    """The tile width: the grid's y extent is the number of column tiles (at most 65535)."""
    return {"tile_cols": TILES[dtype][1]}
