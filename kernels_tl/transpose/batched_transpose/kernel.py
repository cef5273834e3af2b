"""transpose.transpose / transpose.batched_transpose: swap the last two dims.

``x`` [B, M, N] -> ``out`` [B, N, M] (contiguous); ``transpose`` is the same
kernel on a 2-D ``x`` (B = 1).  Rows of ``x`` may be padded: only
``x.stride(-1) == 1`` is required, the row and batch strides are run-time
values (multiples of 4 elements).  A transpose moves bits, so the kernel works
on 16-byte chunks and 32-bit words; the dtype enters only through the element
size.  Static configurations: ``dtype`` in {bfloat16, float32, float8_e4m3fn},
i.e. 3 configs cover everything (B, M, N and both strides stay dynamic).

Design
------
One block per TM x TN tile of ``x`` (TM rows, TN columns; ``TILES``: bf16
128 x 128, fp32 64 x 128, fp8 128 x 256, i.e. 32 KiB for every dtype).  The
grid is (ceil(M/TM), ceil(N/TN), B) with the M tiles innermost: blocks that
the hardware starts one after another write consecutive pieces of the same
TN output rows, so the output streams out in whole rows (see "Tuning", round
3).  M and N are only multiples of 64, so an edge tile may hold just a
multiple of 64 rows and/or columns: two block-uniform flags (``m_full``,
``n_full``) send edge tiles down a path that tests every access against M
and N, and full tiles take a branch without any predicate.  Every thread
moves 8 chunks (128 bytes) in and 128 bytes out: 256 threads for each dtype.

0. wait for the previous grid (programmatic dependent launch: blocks of the
   first wave may be resident before that grid has finished).  In the first
   ``%nsmid`` blocks (about one per SM) warp 0 waits and the last warp
   prefetches the tile into L2 if the wait is still on after
   ``PREFETCH_AFTER_CYCLES``, so the previous grid's drain overlaps this grid's
   first reads.  Every other block only waits (see "Tuning", round 6).
1. global -> shared: consecutive threads take consecutive 16-byte chunks of
   the tile, row-major (a 128-byte line per 8 threads; a tile row is 2 (bf16,
   fp8) or 4 (fp32) lines).  On the full-tile path a thread's 8 loads are all
   issued before its first shared store (checked in the SASS of every config
   for sm_90a and sm_100a).
2. shared -> registers -> global: after one barrier each thread owns *units*
   of ``P`` output rows x one 16-byte output chunk, ``P`` = elements per
   32-bit word.  A unit reads one word column of the tile across ``V`` = 16 /
   elem_bytes consecutive rows (``V`` x LDS.32), transposes that V x P element
   block in registers with byte permutes (fp32: none, bf16: 8 PRMT, fp8: 32
   PRMT) and stores ``P`` chunks.  The 32 lanes of a warp write 8 consecutive
   chunks (128 bytes) of 4 output rows; a block writes TM * elem_bytes bytes
   of each of its TN output rows (bf16 and fp32 256, fp8 128).

Bank conflicts: the tile is kept as 16-byte chunks, and a chunk's slot inside
its 128-byte line (8 slots x 4 banks) is XORed with ``(row // V) % 8``.  A
phase-2 LDS.32 reads 4 words (one chunk) from each of 8 consecutive row groups
(rows ``V * mc + v``, mc = 8 consecutive values); the XOR puts the 8 into 8
different slots, so the 32 lanes hit 32 banks.  A quarter-warp of phase-1
STS.128 writes one whole line, which the XOR only permutes: also conflict-free.

Alignment: the 16-byte path needs ``x``'s data pointer, row stride and batch
stride to be multiples of 16 bytes; the stub tests that and passes ``wide``.
Otherwise (strides and pointer only multiples of 4 elements, as upstream
allows) phase 1 loads each chunk as 4-element pieces (bf16: 2 x 8 bytes, fp8:
4 x 4 bytes) into the same shared layout; fp32 pieces are whole chunks, so
fp32 has no narrow path (and no ``wide`` parameter).  The branch is
block-uniform, so the 16-byte path costs nothing extra.  ``out`` is freshly
allocated (16-byte aligned).

Tuning (H200, 8192 x 4096 bf16, was 39.8 us = 3.37 TB/s with 64 x 64 tiles,
128 threads, 4 chunks per thread).  Changed to 128 x 128 tiles and 8 chunks
per thread:

* each block now reads and writes 256-byte row segments (was 128): half as
  many DRAM row/page touches per byte, and writes of whole 256-byte pieces of
  an output row from consecutive warps of one block;
* a thread keeps 128 bytes of loads in flight (was 64), with all 8 LDG.128
  ahead of the first STS on both archs;
* a quarter as many blocks (2048 at this shape, ~3.9 waves of 528 resident
  blocks, instead of 8192 block launches + barriers), each amortising its
  index math over twice the bytes.

Per thread (bf16): 8 x LDG.128, 8 x STS.128, 32 x LDS.32, 32 x PRMT, 8 x
STG.128; ptxas: bf16 48 registers (sm_90a and sm_100a), fp32 46 / 47, fp8
55 / 56, no spills.  bf16: 5 blocks (1280 threads, 160 KiB of shared memory
and of loads in flight) per SM.  Predicted: ~34 us at 8192 x 4096 bf16
(~3.9-4.0 TB/s, close to the device copy), i.e. about upstream's 35.0 us or
slightly better.

Round 2 (measured round 1: 38.7 us = 3.47 TB/s; copy 4.21 TB/s).  Hypothesis
fitted to all three transpose points at this shape, which differ in tile
size and in tile bytes resident per SM:

* round 0: 64-tiles (128-byte row pieces), 12 blocks x 8 KiB = 96 KiB/SM, 39.8 us;
* round 1: 128-tiles (256-byte pieces), 5 blocks x 32 KiB = 160 KiB/SM, 38.7 us;
* upstream: 128-tiles, 256 threads, but 70 registers, so 3 blocks x 32 KiB =
  96 KiB/SM, same grid order, 35.0 us.

The two effects separate: at a fixed 96 KiB/SM the bigger tile is worth
-4.8 us (longer pieces of each 16 KiB-strided output row per DRAM page
opened), and at a fixed tile going from 96 to 160 KiB/SM costs +3.7 us.
Little's law needs only ~32 KiB/SM (4.2 TB/s x ~1 us / 132); 160 KiB/SM is 21
MB of reads queued GPU-wide, so the extra requests add no bandwidth, only
queueing: more distinct DRAM pages (20 block rows of reads, thousands of
256-byte output pieces) are interleaved at the memory controllers and the row
hit rate drops, and the late, bursty write-back of each block's stores waits
behind that read backlog.  (Round 1's other change, 8 instead of 4 loads per
thread, cannot be separated; per_token_cast's doubling of bytes in flight
also gained nothing, consistent with in-flight bytes not being the limit.)

Change: only occupancy.  The shared buffer is padded (never touched) so that
bf16 runs 3 blocks per SM (57 KiB each: 3 x 58 <= 228 < 4 x 58) and fp8 6
(33 KiB), i.e. 96 KiB of tile loads per SM as in the fastest point above;
fp32 stays at 2 by registers (128 KiB).  The generated kernel code is
byte-identical to round 1 (only the dynamic shared-memory size changes), so
outputs are unchanged.  Prediction: ~35 us at 8192 x 4096 bf16 (upstream's
point; 3.8 TB/s), possibly slightly better from the 16-byte accesses.  If it
is not faster than 38.7 us the hypothesis is wrong and round 1 should stay.
(Rounds 0-2 were timed with 2-launch graphs, about 1-2 us high; round 2
measured 35.0-35.5 us with 64-launch graphs.)

Round 3 (issue 2, 64-launch graphs, one small wheel per variant, H200).  At
8192 x 4096 bf16 the kernel ran 35.0 us against 33.3 us for torch's copy_ of
the same bytes, and 3.93 against 4.24 TB/s at 16384 x 8192: it loses in the
steady state, not only in ramp-up and tail.  The grid then had the N tiles
innermost, so consecutive blocks read one band of input rows and wrote 256
bytes into each of 128 different output rows.  Measured (us at 8192 x 4096
bf16 / 16384 x 8192 bf16 / 8192 x 2048 fp32 / 8192 x 8192 fp8):

* old order, 128 x 128 tiles: 35.0 / 136.7 / 36.1 / 39.6;
* M tiles innermost (consecutive blocks continue the same output rows):
  34.4-34.5 / 131.8-132.1 / 35.4-35.5 / 37.8-38.0; with 2, 4 or 5 blocks per SM
  within 0.2 us;
* tiles grouped in bands of 2-16 (either order): 34.9-35.9, slower;
* per-dtype tile shapes with M innermost: bf16 64 x 256 34.9-35.1, 128 x 256
  35.0-35.3, 64 x 512 35.6; fp32 64 x 128 34.5-34.7 (the best); fp8 128 x 256
  35.0-35.2 (the best; 256 x 256 35.5, 128 x 512 35.9);
* 4 or 16 chunks per thread instead of 8: within 0.2 us; bf16 128 x 256 or
  256 x 128 tiles with 16 chunks per thread (256 threads, 3 blocks per SM):
  34.9 against 34.3 in the same run; smaller bf16 tiles, 64 x 128 or 128 x 64
  with 6 blocks per SM: 35.7-35.8 and 37.6-37.7.

Kept: M innermost, bf16 128 x 128, fp32 64 x 128, fp8 128 x 256, 3 blocks
(96 KiB of tiles) per SM for each dtype: 34.5 / 132.0 / 34.7 / 35.0-35.2.
ptxas: 53-56 registers for every config on both archs, no spills.  Streaming
(``st.global.cs``) stores were 0.2-0.3 us slower.

Round 4 (issue 2, seventh session; cache hints on the full-tile loads, same sweep
shapes, two interleaved repeats): ``ld.global.L2::256B`` (fetch 256-byte sectors, a
tile row piece) 34.09-34.10 us against 34.10-34.21 for the shipped loads, i.e. no
change; an L2 evict-first policy with ``L1::no_allocate`` 35.25-35.46 and both together
35.43-35.44, 1.1-1.3 us slower at every shape (4-5% at 16384 x 8192).  The plain loads
stay.  Since the fifth session the kernel runs 33.8-34.2 us (with programmatic
dependent launch), 94-96% of the bandwidth of a 1 GiB copy on the same machine.

Round 5 (issue 2, eighth session; one sm_90a wheel per variant, the same four shapes,
two interleaved repeats per machine; "alone": the CUPTI duration of one launch issued
after the previous one finished, as the bench's kernel time).  A block waits for the
previous grid (``griddepcontrol.wait``) before its first request, so in a stream of
transposes each grid's drain is followed by the next grid's ramp-up.  Tried: before the
wait, an L2 prefetch of the tile's rows (legal there: L2 holds the one copy of every
line, so the previous grid's stores still reach the loads after the wait).  Measured
(us at 8192 x 4096 bf16, graph / alone; base 33.96-34.31 / 34.20-34.29):

* ``cp.async.bulk.prefetch.L2`` of each 256-byte row piece (one thread per tile row),
  3 blocks per SM: 33.55-33.82 / 35.45-35.54; 2 blocks per SM: 33.37-33.62 /
  35.96-36.04 (16384 x 8192: 129.0-129.9 against 131.1-131.6 in graphs);
* only in the first wave of blocks (linear block index < ``%nsmid`` x blocks per SM,
  the blocks that can be resident before the previous grid ends), 3 blocks per SM:
  bulk 33.84 / 35.45-35.50, bulk from all 8 warps 33.79-33.88 / 35.04-35.14, a
  ``prefetch.global.L2`` per 128-byte line from every 8th thread 33.82-33.85 /
  34.84-34.88;
* 2 blocks per SM without a prefetch: 34.04-34.27 / 34.44-34.49.

Every prefetch variant gains 0.2-0.7 us between back-to-back transposes and loses
0.6-1.8 us for a transpose that runs alone (after a kernel that is not a programmatic
primary, or after a gap).  Not taken: the bench's graphs would improve by making the
kernel slower wherever nothing overlaps its start.

Round 6 (issue 2, ninth session; same harness, alone from 64-128 launches a process).  Prefetch
only while the previous grid still runs.  A probe kernel launched as a programmatic
dependent measured its ``griddepcontrol.wait``: 2-7 cycles after an idle GPU, at most 296
cycles after a plain kernel, and up to 27,000 (p90 8,400-9,400) after a running primary
that had triggered.  So a block can tell that it started early by a wait that has not
returned after a few thousand cycles: warp 0 waits and then arrives on an mbarrier, the
last warp polls the mbarrier and prefetches the tile (per 128-byte line) once
``PREFETCH_AFTER_CYCLES`` have passed without the arrival.  Measured (us at 8192 x 4096
bf16, graph / alone; the kernel before this round 34.01-34.25 / 34.21-34.33):

* the protocol in every block (a shared flag, one block barrier first): 33.55-33.88 /
  34.64-34.92; the same without the prefetch instruction: 33.97-34.16 / 34.49-34.77,
  i.e. the alone cost is the protocol's (barriers and polling delay the loads), not
  the prefetch's, which never issues when the grid starts alone;
* in the first wave only (linear block index < ``%nsmid`` x 3), mbarrier, poll 2,000 /
  4,000 / 8,000 / 16,000 cycles: 33.76-33.82 / 33.07-33.20 / 33.28-33.33 / 33.98-34.11 in
  graphs (presumably a short poll lets blocks that start in the last microsecond of the
  previous grid prefetch, and those slow its drain), alone 34.26-34.61;
* 4,000 cycles, in the first block per SM only (index < ``%nsmid``): 33.11-33.16 /
  34.30-34.37; the first two per SM: 33.07-33.21 / 34.41-34.48; all three:
  33.04-33.08 / 34.47-34.60; the kernel before 34.03-34.13 / 34.30-34.33 (same run,
  three processes each).

Taken: the first block per SM, 4,000 cycles: about 0.9 us (3%) faster between
back-to-back transposes, and no measurable cost alone.  (The same overlap should apply
after any kernel that triggers its dependents early, as every kernel of this package
does; not measured.)  Sanitizers: a version that synchronised only warp 0 and the last
warp, by a named barrier (``bar.arrive`` / ``bar.sync 1, 64``), drew racecheck errors on
the tile, and synccheck errors with ``bar.sync`` on both sides; with one block barrier
(the shipped code) memcheck, racecheck and synccheck are clean, with three blocks per SM
taking part and with one.  The wheel's bench (tenth session, four passes): 33.03-33.06
us in graphs, 34.10-34.35 alone.
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
# the docstring); every dtype's tile is 32 KiB, and would otherwise fit 5-6 blocks.
BLOCKS_PER_SM = 3
SMEM_PER_SM = 228 * 1024  # sm_90a and sm_100a; each resident block also reserves 1 KiB


def _smem_bytes(tile_bytes: int, blocks_per_sm: int):
    """Shared memory a block allocates so that exactly ``blocks_per_sm`` fit on an SM."""
    size = -(-SMEM_PER_SM // (blocks_per_sm + 1) // 1024) * 1024  # (k + 1) blocks of size + 1 KiB do not fit
    size = max(size, -(-tile_bytes // 1024) * 1024)
    assert blocks_per_sm * (size + 1024) <= SMEM_PER_SM < (blocks_per_sm + 1) * (size + 1024)
    return size


# Cycles the last warp of a first-wave block polls for the release of the previous grid
# before it prefetches the block's tile (~2 us at 1.98 GHz; see "Round 6").
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
            # per SM) may prefetch while they wait (see "Round 6": one per SM gains as much
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
