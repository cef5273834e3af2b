"""moe.expand_to_fused (+ ``_with_sf``): copy each token's row to every fused row it is routed to.

``x`` [num_tokens, hidden] (any dtype: the kernel moves bytes) -> ``out`` [num_rows, hidden]
with ``out[token_topk_to_pos[t, k]] = x[t]`` for every routed pair (``pos >= 0``) and zero
rows where ``pos_to_expert < 0`` (padding).  With scale factors, ``x_sf`` [num_tokens,
sf_cols] (32-bit words: fp32 or packed UE8M0) moves the same way into ``out_sf``, whose
element ``[row, col]`` lies at ``row * sf_row_stride + col * sf_col_stride`` (row-major or
TMA-aligned column-major), zero on padding rows.

Design
------
Bound by memory: every byte of ``x`` is read once, every byte of ``out`` written once.  The
grid has two parts, told apart by the block index (uniform per block):

* Blocks ``[0, copy_blocks)``: the copy, ``lanes_per_row`` threads per token.  A row
  is ``row_vecs`` 16-byte vectors (``hidden * element_size / 16``; the host checks that it is
  whole and that the pointers are 16-byte aligned); lane ``l`` owns vectors ``l, l + lanes,
  ...`` below ``row_vecs`` (at most ``VPT``: the host's ``lanes_per_row >= ceil(row_vecs /
  v)`` with ``v <= VPT``), so each load or store instruction of a warp covers contiguous
  bytes.  The first ``block_span`` threads of a copy block take consecutive (token, lane)
  pairs of the flat index ``block * block_span + thread``: the host sets ``block_span`` to
  whole tokens per block (``tokens_per_block * lanes_per_row``, the other threads idle) when
  a row's lanes fit in a block, else to ``THREADS``.  The host rounds ``lanes_per_row`` to
  whole warps (or a power of two below 32), so no token straddles a warp boundary, takes ``v = VPT``
  (up to 128 bytes per thread) for many tokens, and fewer vectors per thread for few tokens
  (decode: a token per block) so that the copy spreads over every SM.  A thread loads its
  vectors, its first ``SFW`` scale-factor words (``lane, lane + lanes, ...``) and its
  positions ``KC`` at a time (run-time top-k, any size) before the first store, so one
  memory round trip serves it (top-k <= 8), then stores the vectors and words to each routed
  row.  (A lane has at most ``SFW`` words: with 32 or 128 channels per factor and at most 8
  vectors per lane, ``ceil(sf_cols / lanes) <= 4``; the host checks it.)
* Blocks ``[copy_blocks, num_blocks)``: the padding check.  Its units are pieces of fused
  rows, ``2^piece_shift`` pieces of ``piece_vecs`` vectors per row (unit ``u``: row ``u >>
  piece_shift``); padding block ``b`` takes the ``pad_span`` (at most 256) units ``b *
  block_step + i * unit_step``.  Each thread loads its lane's ``pos_to_expert`` flag of every
  group of 32 of them at once (one round trip; every warp loads the same lines), and per group
  every warp ballots the same 32 flags, so each warp holds the same mask without shared memory
  or a barrier, and the whole block zeroes each padding unit among them in turn (16-byte
  streaming stores, 4 KB per block-wide instruction; a row's scale-factor words with its first
  piece).
  A unit that is not padding costs a 4-byte load, not a thread per 16-byte lane.  The host
  picks one of two layouts:

  - *few padding rows* (most fused rows are routed: upstream's exactly sized layouts, a dense
    decode): whole rows, 256 consecutive ones per block (``block_step = 256, unit_step = 1``),
    a few flag-only blocks beside the copy (at decode 4 beside 128 copy blocks: one block per
    SM);
  - *mostly padding* (many rows past the most routed pairs, e.g. the MoE layer's no-sync bound
    at decode: 3840 of 4864 rows): pieces of at most 256 vectors (one block-wide store each)
    dealt out over ``P`` blocks with an odd stride (``block_step = 1, unit_step = P``), ``P``
    the slots the copy leaves of one wave (at decode 267 beside 128 copy blocks: three blocks
    per SM, two of them zeroing), so every block holds nearly the same share of padding
    wherever it lies and every SM zeroes with two blocks' warps; the grid is then one wave,
    and the next grid starts as this one's blocks exit (``launch_now = 0``), on SMs it finds
    empty rather than in whatever slots are free while this grid runs.

  These blocks come last in the grid, so the copy's blocks are dispatched first, one per SM
  when there are few tokens (decode), and the padding blocks take the slots left.
* Positions outside ``[0, num_rows)`` are skipped (a consistent mapping has none).
* Offsets into ``x``, ``out`` and ``out_sf`` are 64-bit (TileLang widens buffer indices);
  the thread and unit indices are 32-bit (the host bounds the grid's threads and the units
  below 2^31).

No static configuration: one kernel serves every dtype, hidden size, top-k and
scale-factor layout; the vectors per thread are a run-time choice (``lanes_per_row``).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid_then

THREADS = 256
VPT = 8  # most 16-byte vectors per thread (128 bytes of a row in flight per thread)
SFW = 4  # scale-factor words per thread loaded with the row
KC = 8  # positions loaded together (top-k <= 8 in one round trip; more in rounds of 8)
MIN_BLOCKS_PER_SM = 3  # <= 85 registers: 768 threads, 96 KB of loads in flight per SM
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / vector / word tests
    "tl.disable_safe_memory_legalize": True,
}

# the padding check's zeros as streaming stores (st.global.cs: evict-first in L2): this launch writes
# them once and reads nothing back, and the routed rows written beside them are what the next
# kernel reads (the MoE layer's up projection), so the zeros are the lines L2 gives up first
DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_zero_16_cs(void* dst) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %1, %1, %1};" :: "l"(dst), "r"(0u) : "memory");
}
__device__ __forceinline__ void tka_zero_4_cs(void* dst) {
  asm volatile("st.global.cs.b32 [%0], %1;" :: "l"(dst), "r"(0u) : "memory");
}
"""


def host_constants() -> dict:
    return {"vectors_per_thread": VPT, "sf_words_per_thread": SFW, "threads": THREADS,
            "blocks_per_sm": MIN_BLOCKS_PER_SM}


def expand_to_fused_kernel():
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")  # fused rows (num_expanded_tokens)
    num_topk = T.dynamic("num_topk")
    row_vecs = T.dynamic("row_vecs")  # 16-byte vectors per row
    sf_cols = T.dynamic("sf_cols")  # 32-bit scale-factor words per row (0: none)
    out_sf_words = T.dynamic("out_sf_words")  # storage of out_sf

    @T.prim_func
    def expand_to_fused(
        x: T.Tensor[(num_tokens, row_vecs, 4), T.uint32],
        out: T.Tensor[(num_rows, row_vecs, 4), T.uint32],
        token_topk_to_pos: T.Tensor[(num_tokens, num_topk), T.int32],
        pos_to_expert: T.Tensor[(num_rows,), T.int32],
        x_sf: T.Tensor[(num_tokens, sf_cols), T.uint32],
        out_sf: T.Tensor[(out_sf_words,), T.uint32],
        lanes_per_row: T.int32,
        block_span: T.int32,
        copy_blocks: T.int32,
        pad_span: T.int32,
        block_step: T.int32,
        unit_step: T.int32,
        piece_shift: T.int32,
        piece_vecs: T.int32,
        launch_now: T.int32,
        num_blocks: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
    ):
        with T.Kernel(num_blocks, threads=THREADS) as bid:
            wait_for_previous_grid_then(launch_now)  # programmatic dependent launch
            T.import_source(DEVICE_SOURCE)
            T.assume(lanes_per_row > 0)
            T.assume(block_span > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            buf = T.alloc_local((VPT, 4), T.uint32)
            words = T.alloc_local((SFW,), T.uint32)
            pos = T.alloc_local((KC,), T.int32)
            flags = T.alloc_local((THREADS // 32,), T.int32)
            mask = T.alloc_var(T.uint32)
            count = T.alloc_var(T.int32)
            slot = T.alloc_var(T.int32)
            first = T.alloc_var(T.int32)
            unit = T.alloc_var(T.int32)
            start = T.alloc_var(T.int32)
            row = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            flat = T.alloc_var(T.int32)

            if bid < copy_blocks:
                # ---- the copy: a token's row to every fused row it is routed to
                # the block's first `block_span` threads take consecutive lanes of the flat
                # (token, lane) index: whole tokens per block when the host sets
                # block_span = tokens_per_block * lanes_per_row, the flat index when THREADS
                flat = bid * block_span + tid
                row = flat // lanes_per_row
                lane = flat - row * lanes_per_row
                if tid < block_span and row < num_tokens:
                    # every load before the first store (the compiler may not move loads of x
                    # past stores to out): the vectors, the first words, the first positions
                    for j in T.unroll(VPT):
                        if lane + j * lanes_per_row < row_vecs:
                            for u in T.vectorized(4):
                                buf[j, u] = x[row, lane + j * lanes_per_row, u]
                    for s in T.unroll(SFW):
                        words[s] = T.uint32(0)
                        if lane + s * lanes_per_row < sf_cols:
                            words[s] = x_sf[row, lane + s * lanes_per_row]
                    for c in T.serial(T.ceildiv(num_topk, KC)):
                        for i in T.unroll(KC):
                            pos[i] = -1
                            if c * KC + i < num_topk:
                                pos[i] = token_topk_to_pos[row, c * KC + i]
                        for i in T.unroll(KC):
                            if pos[i] >= 0 and pos[i] < num_rows:
                                for j in T.unroll(VPT):
                                    if lane + j * lanes_per_row < row_vecs:
                                        for u in T.vectorized(4):
                                            out[pos[i], lane + j * lanes_per_row, u] = buf[j, u]
                                for s in T.unroll(SFW):
                                    if lane + s * lanes_per_row < sf_cols:
                                        out_sf[pos[i] * sf_row_stride + (lane + s * lanes_per_row) * sf_col_stride] = words[s]

            else:
                # ---- the padding check: 32 units at a time, the block zeroes each padding unit
                lane = tid % 32
                first = (bid - copy_blocks) * block_step  # the block's units: first + i * unit_step
                # every group's flag of this lane loaded at once (one round trip, not one per group)
                for g in T.unroll(THREADS // 32):
                    flags[g] = 0
                    unit = first + (g * 32 + lane) * unit_step
                    if g * 32 + lane < pad_span and unit < T.shift_left(num_rows, piece_shift):
                        if pos_to_expert[T.shift_right(unit, piece_shift)] < 0:
                            flags[g] = 1
                for g in T.unroll(THREADS // 32):
                    if g * 32 < pad_span:
                        # every warp ballots the same 32 flags (the branch is uniform per block)
                        mask = T.Cast(T.uint32, T.ballot(flags[g] != 0))
                        # the count fixed before the loop: a bound over `mask` itself would be
                        # re-evaluated after each unit has consumed its bit
                        count = T.call_extern(T.int32, "__popc", mask)
                        for r in T.serial(count):
                            slot = T.call_extern(T.int32, "__ffs", mask) - 1
                            mask = mask & (mask - T.uint32(1))
                            unit = first + (g * 32 + slot) * unit_step
                            row = T.shift_right(unit, piece_shift)
                            start = (unit - T.shift_left(row, piece_shift)) * piece_vecs  # the piece's first vector
                            for v in T.serial(T.ceildiv(piece_vecs, THREADS)):
                                if tid + v * THREADS < piece_vecs and start + tid + v * THREADS < row_vecs:
                                    T.evaluate(T.call_extern("void", "tka_zero_16_cs",
                                                             T.address_of(out[row, start + tid + v * THREADS, 0])))
                            if start == 0:  # the row's first piece: its scale-factor words
                                for s in T.serial(T.ceildiv(sf_cols, THREADS)):
                                    if tid + s * THREADS < sf_cols:
                                        T.evaluate(T.call_extern(
                                            "void", "tka_zero_4_cs",
                                            T.address_of(out_sf[row * sf_row_stride + (tid + s * THREADS) * sf_col_stride])))

    return expand_to_fused
