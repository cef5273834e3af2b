"""moe.get_fused_mapping: place every routed (token, k) pair in the expert-major fused layout.

``topk_idx`` int64 [num_tokens, num_topk] (contiguous) is read as its ``num_elements`` flat
entries; entry ``i`` names expert ``v`` when ``0 <= v < num_experts`` and is unrouted
otherwise (-1, any negative, and entries ``>= num_experts``, which the reference refuses).
With ``c[e]`` the count of expert ``e``, ``a[e] = ceil(c[e] / alignment) * alignment`` and
``start`` the exclusive prefix sum of ``a``, the ``r``-th pair of expert ``e`` in flat order
gets row ``p = start[e] + r``; the kernel writes ``pos_to_expert[p] = e``,
``pos_to_token[p] = i // num_topk``, ``pos_to_token_topk[p] = i`` and
``token_topk_to_pos[i] = p`` (-1 for unrouted entries), -1 into every other row of the
``num_rows`` row outputs, and ``expert_start = start``, ``expert_end = start + a``,
``num_tokens_per_expert = a``.  A pair whose row is ``>= num_rows`` (``num_rows`` smaller
than the layout) writes no row and gets ``token_topk_to_pos = -1``: nothing is written out
of bounds, whatever the data.

Two kernels (the static key ``path``; the host picks one per call from the entry count):

``path="blocks"`` (at most ``SMALL_ENTRIES`` entries): a plain grid of up to ``MAX_BLOCKS``
independent blocks of ``THREADS`` threads, one per ``ROWS_PER_BLOCK`` rows and entries.
Every block reads all entries (at most 32 KiB) and computes the whole layout itself, so the
blocks never exchange anything (no cluster, no barrier between blocks, no global workspace);
block ``b`` then places the warp chunks ``w`` with ``w % blocks == b`` and writes its share of
the padding rows.  Warp ``w`` owns the ``w``-th of ``WARPS`` contiguous chunks of entries (at
most ``SMALL_GROUPS`` groups of 32):

1. Count and rank: per group of 32 entries, ``__match_any_sync`` gives each lane the lanes
   with its expert; the lane's rank within the chunk is the chunk's running count of that
   expert (an int16 row ``hist[warp][expert]`` of shared memory) plus the lanes below it, and
   the lowest such lane advances the running count.  The ids and ranks stay in registers.
2. Offsets: thread ``e`` turns column ``e`` into exclusive prefix sums over the warps (the
   count of ``e`` in earlier chunks) and their total ``c[e]``; a block-wide scan of ``a``
   gives ``start``.
3. Place: ``row = start[e] + hist[w][e] + rank``.
4. Padding: rows ``[start + c, start + a)`` (a warp per expert) and the tail
   ``[sum(a), num_rows)``, spread over the whole grid.

``path="cooperative"`` (more entries): one cooperative launch (every block resident at once) of
up to ``MAX_GRID`` blocks (at most one per SM: the host's ``max_grid``), each owning a contiguous
chunk of the entries: each block counts its chunk, writes its per-expert counts to a scratch
buffer, waits at a grid-wide barrier (``T.sync_grid()``), sums the counts, computes the layout
and places its chunk; see ``_cooperative_body``.

Every output element has exactly one writer.  All counts and rows are int32: the host
refuses layouts of 2^31 - 2^18 rows or more.  Nothing else is static: one cubin per path
and arch serves every token count, top-k, alignment and expert count up to ``THREADS``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

PATHS = ("blocks", "cooperative")
THREADS = 1024
WARPS = THREADS // 32
MAX_EXPERTS = THREADS  # thread e owns expert e in the offsets step
SMALL_ENTRIES = 4096  # blocks path: the most entries (every block reads them all: 32 KiB)
SMALL_GROUPS = SMALL_ENTRIES // THREADS  # blocks path: groups of 32 per warp chunk, at most
ROWS_PER_BLOCK = 2048  # blocks path: one block per this many rows + entries ...
MAX_BLOCKS = 32  # ... up to this many (a warp chunk each at most)
UNROLL = 8  # cooperative path: loads in flight per lane (64 KiB per block)
STEP = 32 * UNROLL  # cooperative path: entries a warp takes per step
# cooperative path: at most this many blocks (one wave of full-SM blocks on a 132- or 148-SM part) ...
MAX_GRID = 128
# ... and at most this many counts (blocks x experts) for each block to sum (128 KiB
# from L2): 128 blocks up to 256 experts, 32 at 1024
SCRATCH_BUDGET = 32768
EXPERT_UNROLL = 4  # cooperative path: experts per warp whose counts are in flight together
# Barriers are placed by hand (warp-private histogram rows need only __syncwarp).
# Every access is guarded by the kernel's own bounds (loads below `end`, rows below `num_rows`),
# so TileLang's extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}


def host_constants(path):
    return {"max_experts": MAX_EXPERTS, "cooperative": int(path == "cooperative"), "small_entries": SMALL_ENTRIES,
            "max_grid": MAX_GRID, "scratch_budget": SCRATCH_BUDGET}


def _expert_of(value, num_experts):
    """The expert id of one entry (int64 ``value``), -1 when it is unrouted."""
    routed = T.if_then_else(value < T.Cast("int64", num_experts), T.Cast("int32", value), -1)
    return T.if_then_else(value >= T.int64(0), routed, -1)


@T.macro
def _aligned_scan(lv, totals, base, warp, lane):
    """Block-wide exclusive scan: ``lv[1]`` <- the sum of ``lv[0]`` over the block's earlier
    threads; ``totals[base + WARPS - 1]`` <- the sum over the whole block (``lv[2:4]`` scratch;
    two barriers; ``totals[base:base + WARPS]`` is rewritten)."""
    lv[1] = lv[0]
    for d in T.unroll(5):
        lv[2] = T.shfl_up(lv[1], 1 << d)
        if lane >= (1 << d):
            lv[1] = lv[1] + lv[2]
    if lane == 31:
        totals[base + warp] = lv[1]
    T.sync_threads()
    if warp == 0:
        lv[2] = totals[base + lane]
        for d in T.unroll(5):
            lv[3] = T.shfl_up(lv[2], 1 << d)
            if lane >= (1 << d):
                lv[2] = lv[2] + lv[3]
        T.sync_warp()
        totals[base + lane] = lv[2]  # inclusive over warps
    T.sync_threads()
    if warp > 0:
        lv[1] = lv[1] + totals[base + warp - 1]
    lv[1] = lv[1] - lv[0]


@T.macro
def _pad(rows_out, start_of, count_of, aligned_of, total, gwarp, nwarps, gthread, nthreads, lane, num_experts,
         num_rows, lv):
    """-1 into the padding rows: ``[start + c, start + a)`` of each expert (expert ``e`` by
    global warp ``e % nwarps``) and the tail ``[total, num_rows)`` (grid-stride over
    ``nthreads``); never past ``num_rows``.  ``lv[0:2]`` scratch."""
    pos_to_expert, pos_to_token, pos_to_token_topk = rows_out
    for j in T.serial(T.ceildiv(num_experts, nwarps)):
        if j * nwarps + gwarp < num_experts:
            lv[0] = start_of[j * nwarps + gwarp] + count_of[j * nwarps + gwarp] + lane
            lv[1] = T.min(start_of[j * nwarps + gwarp] + aligned_of[j * nwarps + gwarp], num_rows)
            for r in T.serial(lv[0], lv[1], 32):
                pos_to_expert[r] = -1
                pos_to_token[r] = -1
                pos_to_token_topk[r] = -1
    lv[0] = total + gthread
    for r in T.serial(lv[0], num_rows, nthreads):
        pos_to_expert[r] = -1
        pos_to_token[r] = -1
        pos_to_token_topk[r] = -1


@T.macro
def _advance_token(token, num_topk):
    """``token`` = [i // num_topk, i % num_topk, 32 // num_topk, 32 % num_topk] for a lane's
    entry ``i``, moved on to ``i + 32`` (no division per entry)."""
    token[0] = token[0] + token[2]
    token[1] = token[1] + token[3]
    if token[1] >= num_topk:
        token[1] = token[1] - num_topk
        token[0] = token[0] + 1


@T.macro
def _start_token(token, first, num_topk):
    token[0] = T.truncdiv(first, num_topk)
    token[1] = T.truncmod(first, num_topk)
    token[2] = T.truncdiv(32, num_topk)
    token[3] = T.truncmod(32, num_topk)


@T.macro
def _write_pair(outs, row, expert, token, i, num_rows):
    """Entry ``i`` (expert ``expert``, -1 unrouted) at row ``row``: the three row outputs and
    ``token_topk_to_pos[i]``; -1 there when unrouted or ``row >= num_rows``."""
    pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos = outs
    if expert >= 0 and row < num_rows:
        pos_to_expert[row] = expert
        pos_to_token[row] = token
        pos_to_token_topk[row] = i
        token_topk_to_pos[i] = row
    else:
        token_topk_to_pos[i] = -1


def _blocks_grid(num_rows, num_elements):
    """Blocks of the blocks path: one per ROWS_PER_BLOCK rows + entries, 1 to MAX_BLOCKS."""
    return T.min(T.ceildiv(num_rows + num_elements + 1, ROWS_PER_BLOCK), MAX_BLOCKS)


@T.macro
def _blocks_body(topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end,
                 num_tokens_per_expert, num_topk, alignment, num_elements, num_rows, num_experts, bx, tid, warp, lane):
    """The blocks path (module docstring), in block ``bx`` of ``_blocks_grid()``."""
    nblocks = _blocks_grid(num_rows, num_elements)

    # [warp][expert]: the chunk's running count (step 1), then the count in earlier
    # chunks (step 2); at most SMALL_ENTRIES, so int16 holds it
    hist = T.alloc_shared((WARPS * MAX_EXPERTS,), T.int16)
    totals = T.alloc_shared((WARPS,), T.int32)  # the scan's per-warp totals, then sum(a)
    start_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # start[e]
    count_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # c[e]
    aligned_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # a[e]

    values = T.alloc_local((SMALL_GROUPS,), T.int64)
    experts = T.alloc_local((SMALL_GROUPS,), T.int32)  # expert id of each group's entry
    ranks = T.alloc_local((SMALL_GROUPS,), T.int32)  # its rank among its expert's in the chunk
    row = T.alloc_var(T.int32)

    # this warp's row of the histogram, zeroed (only the warp itself touches it in step 1)
    for j in T.serial(T.ceildiv(num_experts, 32)):
        if j * 32 + lane < num_experts:
            hist[warp * MAX_EXPERTS + j * 32 + lane] = T.int16(0)

    # this warp's chunk of flat entries: [begin, end), a multiple of 32 long (<= 256)
    begin = T.alloc_var(T.int32)
    end = T.alloc_var(T.int32)
    chunk = T.ceildiv(T.ceildiv(num_elements, WARPS), 32) * 32
    begin = T.min(warp * chunk, num_elements)
    end = T.min(begin + chunk, num_elements)
    for g in T.unroll(SMALL_GROUPS):  # every load in flight before the first use
        values[g] = T.int64(-1)
        if begin + g * 32 + lane < end:
            values[g] = topk_idx[begin + g * 32 + lane]
    T.sync_warp()

    # 1. count and rank within the chunk
    lanes_below = T.Cast("uint32", (T.Cast("int64", 1) << T.Cast("int64", lane)) - 1)
    for g in T.unroll(SMALL_GROUPS):
        experts[g] = _expert_of(values[g], num_experts)
        ranks[g] = 0
        if begin + g * 32 < end:  # uniform over the warp
            same = T.match_any_sync(experts[g])
            row = 0
            if experts[g] >= 0:
                row = T.Cast("int32", hist[warp * MAX_EXPERTS + experts[g]])
            T.sync_warp()
            if experts[g] >= 0 and (same & lanes_below) == T.uint32(0):
                hist[warp * MAX_EXPERTS + experts[g]] = T.Cast("int16", row + T.Cast("int32", T.popcount(same)))
            T.sync_warp()
            ranks[g] = row + T.Cast("int32", T.popcount(same & lanes_below))
    T.sync_threads()

    # 2. offsets: column e -> exclusive prefix over the chunks, c[e]; then start[e]
    acc = T.alloc_var(T.int32)
    cnt = T.alloc_var(T.int32)
    lv = T.alloc_local((4,), T.int32)  # the scan's a[e], start[e] and scratch; padding bounds
    acc = 0
    if tid < num_experts:
        for w in T.serial(WARPS):
            cnt = T.Cast("int32", hist[w * MAX_EXPERTS + tid])
            hist[w * MAX_EXPERTS + tid] = T.Cast("int16", acc)
            acc = acc + cnt
    lv[0] = 0
    if tid < num_experts:
        lv[0] = T.ceildiv(acc, alignment) * alignment
    _aligned_scan(lv, totals, 0, warp, lane)
    if tid < num_experts:
        start_of[tid] = lv[1]
        count_of[tid] = acc
        aligned_of[tid] = lv[0]
        if bx == 0:
            expert_start[tid] = lv[1]
            expert_end[tid] = lv[1] + lv[0]
            num_tokens_per_expert[tid] = lv[0]
    T.sync_threads()

    # 3. place this block's chunks, in flat order within each expert
    token = T.alloc_local((4,), T.int32)
    if warp % nblocks == bx:
        _start_token(token, begin + lane, num_topk)
        for g in T.unroll(SMALL_GROUPS):
            if begin + g * 32 < end:  # uniform over the warp
                if begin + g * 32 + lane < end:
                    row = 0
                    if experts[g] >= 0:
                        row = start_of[experts[g]] + T.Cast("int32", hist[warp * MAX_EXPERTS + experts[g]]) + ranks[g]
                    _write_pair((pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), row,
                                experts[g], token[0], begin + g * 32 + lane, num_rows)
            _advance_token(token, num_topk)

    # 4. padding rows, over the whole grid
    _pad((pos_to_expert, pos_to_token, pos_to_token_topk), start_of, count_of, aligned_of, totals[WARPS - 1],
         bx * WARPS + warp, nblocks * WARPS, bx * THREADS + tid, nblocks * THREADS, lane, num_experts,
         num_rows, lv)


def _cooperative_most_blocks(num_experts, max_grid):
    """The most blocks of the cooperative path for ``num_experts``: ``max_grid`` (the host's
    ``min(MAX_GRID, SMs)``: one resident block per SM), fewer when every block's read of the
    ``blocks x experts`` counts would pass SCRATCH_BUDGET."""
    return T.min(T.max(T.floordiv(SCRATCH_BUDGET, T.max(num_experts, 1)), 1), max_grid)


def _cooperative_chunk(num_elements, num_experts, max_grid):
    """Flat entries per block of the cooperative path: a multiple of 32, at least 32, so that
    ``_cooperative_grid`` blocks of it cover every entry (``num_elements + 4095`` stays in int32)."""
    return T.max(T.ceildiv(num_elements, _cooperative_most_blocks(num_experts, max_grid) * 32) * 32, 32)


def _cooperative_grid(num_elements, num_experts, max_grid):
    """Blocks of the cooperative path: ``ceil(num_elements / chunk)`` (written without ``num_elements +
    chunk``, which could pass int32), at least 1, at most ``_cooperative_most_blocks``."""
    return T.max(T.floordiv(num_elements - 1, _cooperative_chunk(num_elements, num_experts, max_grid)) + 1, 1)


@T.macro
def _load_step(topk_idx, values, begin, end, lane, s):
    """``values`` <- the entries of step ``s`` of a warp's range ``[begin, end)`` (-1 past
    its end)."""
    for u in T.unroll(UNROLL):  # all loads in flight before the first use
        values[u] = T.int64(-1)
        if begin + s * STEP + u * 32 + lane < end:
            values[u] = topk_idx[begin + s * STEP + u * 32 + lane]


@T.macro
def _step_ids(topk_idx, values, kept, experts, begin, end, lane, num_experts, s):
    """``experts`` <- the expert ids of step ``s`` of a warp's range: those of step 0 from
    ``kept`` (the counting pass's registers), later steps re-read from global memory."""
    if s == 0:
        for u in T.unroll(UNROLL):
            experts[u] = kept[u]
    else:
        _load_step(topk_idx, values, begin, end, lane, s)
        for u in T.unroll(UNROLL):
            experts[u] = _expert_of(values[u], num_experts)


@T.macro
def _place_step(outs, hist, base_of, experts, token, begin, end, warp, lane, lanes_below, num_topk, num_rows, s):
    """Place the entries of step ``s`` of a warp's range ``[begin, end)``, their expert ids in
    ``experts``; ``hist``'s row of the warp counts the range's entries before them of each
    expert (advanced here).  A group of 32 lies wholly inside or outside the range's groups
    (uniform over the warp); ``token`` starts at ``begin + lane`` and advances by one group per
    group."""
    for u in T.unroll(UNROLL):
        if begin + s * STEP + u * 32 < end:
            expert = experts[u]
            same = T.match_any_sync(expert)
            below = T.Cast("int32", T.popcount(same & lanes_below))
            row = T.alloc_var(T.int32)
            row = 0
            if expert >= 0:
                row = hist[warp * MAX_EXPERTS + expert]
            T.sync_warp()
            if expert >= 0 and below == 0:
                hist[warp * MAX_EXPERTS + expert] = row + T.Cast("int32", T.popcount(same))
            T.sync_warp()
            if begin + s * STEP + u * 32 + lane < end:
                if expert >= 0:
                    row = row + below + base_of[expert]
                _write_pair(outs, row, expert, token[0], begin + s * STEP + u * 32 + lane, num_rows)
            _advance_token(token, num_topk)


@T.macro
def _count_step(hist, experts, warp):
    """Add the routed entries among ``experts`` to the warp's histogram row (shared atomics:
    the counts do not depend on their order)."""
    for u in T.unroll(UNROLL):
        if experts[u] >= 0:
            T.atomic_add(hist[warp * MAX_EXPERTS + experts[u]], 1)


@T.macro
def _sum_counts(scratch, count_of, before_of, parts, sums, nblocks, bx, warp, lane, num_experts):
    """``count_of[e]`` <- the sum of the counts of expert ``e`` over the grid's blocks
    (``scratch[e * nblocks + r]``, written by the counting launch), ``before_of[e]`` <- the sum
    over blocks ``r < bx``.  Warp ``WARPS - 1 - w`` takes the experts ``w (mod WARPS)``
    (the last warps have the fewest entries to count), its lanes the blocks ``lane + 32 k``;
    ``EXPERT_UNROLL`` experts per warp and step have their loads in flight together (coalesced:
    an expert's counts are contiguous); a warp-wide reduction per expert."""
    for j in T.serial(T.ceildiv(num_experts, WARPS * EXPERT_UNROLL)):
        for q in T.unroll(EXPERT_UNROLL):
            for k in T.unroll(MAX_GRID // 32):
                parts[q * (MAX_GRID // 32) + k] = 0
                if (j * EXPERT_UNROLL + q) * WARPS + (WARPS - 1 - warp) < num_experts and lane + k * 32 < nblocks:
                    parts[q * (MAX_GRID // 32) + k] = scratch[((j * EXPERT_UNROLL + q) * WARPS + (WARPS - 1 - warp))
                                                              * nblocks + lane + k * 32]
        for q in T.unroll(EXPERT_UNROLL):
            sums[0] = 0
            sums[1] = 0
            for k in T.unroll(MAX_GRID // 32):
                sums[0] = sums[0] + parts[q * (MAX_GRID // 32) + k]
                if lane + k * 32 < bx:
                    sums[1] = sums[1] + parts[q * (MAX_GRID // 32) + k]
            sums[0] = T.call_extern(T.int32, "__reduce_add_sync", T.uint32(0xFFFFFFFF), sums[0])
            sums[1] = T.call_extern(T.int32, "__reduce_add_sync", T.uint32(0xFFFFFFFF), sums[1])
            if lane == 0 and (j * EXPERT_UNROLL + q) * WARPS + (WARPS - 1 - warp) < num_experts:
                count_of[(j * EXPERT_UNROLL + q) * WARPS + (WARPS - 1 - warp)] = sums[0]
                before_of[(j * EXPERT_UNROLL + q) * WARPS + (WARPS - 1 - warp)] = sums[1]


@T.macro
def _cooperative_body(topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start,
                      expert_end, num_tokens_per_expert, scratch, max_grid, num_topk, alignment, num_elements, num_rows,
                      num_experts, bx, tid, warp, lane):
    """The cooperative path: ``_cooperative_grid()`` blocks of ``THREADS`` threads, all
    resident (a cooperative launch).  Block ``b`` owns the flat entries
    ``[b * chunk, (b + 1) * chunk)`` (``_cooperative_chunk``), its warp ``w`` the ``w``-th
    contiguous piece of them (a multiple of 32 long), so the order of (block, warp, position in
    piece) is the flat order.

    Count: each warp walks its piece ``STEP`` entries at a time (``UNROLL`` coalesced 8-byte
    loads per lane in flight) and adds each routed entry to its own row of the shared histogram
    ``hist[warp][expert]``; the ids of the first step stay in registers.  Thread ``e`` turns
    column ``e`` into exclusive prefix sums over the warps and writes its total, the block's
    count of ``e``, to ``scratch[e * blocks + b]`` (every element: the scratch needs no
    zeroing).

    Exchange: the grid-wide barrier (``T.sync_grid()``: release and acquire at GPU scope), then
    ``_sum_counts`` gives ``c[e]`` and the count in earlier blocks, a block-wide scan of ``a``
    gives ``start``, and ``base[e] = start[e]`` + the count in earlier blocks.

    Place: each warp walks its piece again (the first step from registers) in flat order
    (``__match_any_sync`` per group of 32 over the warp's running count, as ``_place_step``);
    the grid shares the padding rows, block 0 writes the per-expert outputs."""
    nblocks = T.alloc_var(T.int32)  # the grid (the launch computes the same expression)
    nblocks = _cooperative_grid(num_elements, num_experts, max_grid)
    chunk = T.alloc_var(T.int32)
    chunk = _cooperative_chunk(num_elements, num_experts, max_grid)

    hist = T.alloc_shared((WARPS * MAX_EXPERTS,), T.int32)  # [warp][expert]
    totals = T.alloc_shared((WARPS,), T.int32)  # the scan's per-warp totals, then sum(a)
    count_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # c[e]
    before_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # count of e in earlier blocks
    base_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # start[e] + count in earlier blocks
    start_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # start[e]
    aligned_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # a[e]

    values = T.alloc_local((UNROLL,), T.int64)
    kept = T.alloc_local((UNROLL,), T.int32)  # expert ids of the first step
    experts = T.alloc_local((UNROLL,), T.int32)
    parts = T.alloc_local((EXPERT_UNROLL * (MAX_GRID // 32),), T.int32)
    sums = T.alloc_local((2,), T.int32)
    token = T.alloc_local((4,), T.int32)
    lv = T.alloc_local((4,), T.int32)
    acc = T.alloc_var(T.int32)
    cnt = T.alloc_var(T.int32)
    begin = T.alloc_var(T.int32)
    end = T.alloc_var(T.int32)

    # this warp's row of the histogram, zeroed (only the warp itself touches it until the barrier)
    for j in T.serial(T.ceildiv(num_experts, 32)):
        if j * 32 + lane < num_experts:
            hist[warp * MAX_EXPERTS + j * 32 + lane] = 0
    T.sync_warp()

    # this warp's piece [begin, end) of the block's chunk (64-bit: b * chunk may pass int32)
    block_begin = T.min(T.Cast("int64", bx) * T.Cast("int64", chunk), T.Cast("int64", num_elements))
    block_end = T.min(block_begin + T.Cast("int64", chunk), T.Cast("int64", num_elements))
    piece = T.Cast("int64", T.ceildiv(T.ceildiv(chunk, 32), WARPS) * 32)
    begin = T.Cast("int32", T.min(block_begin + T.Cast("int64", warp) * piece, block_end))
    end = T.Cast("int32", T.min(T.Cast("int64", begin) + piece, block_end))
    steps = T.ceildiv(end - begin, STEP)

    # count; the first step's ids stay in `kept`
    _load_step(topk_idx, values, begin, end, lane, 0)
    for u in T.unroll(UNROLL):
        kept[u] = _expert_of(values[u], num_experts)
    _count_step(hist, kept, warp)
    for s in T.serial(1, steps):
        _load_step(topk_idx, values, begin, end, lane, s)
        for u in T.unroll(UNROLL):
            experts[u] = _expert_of(values[u], num_experts)
        _count_step(hist, experts, warp)
    T.sync_threads()

    # column e -> exclusive prefix over the block's warps; `acc` the block's count of e
    acc = 0
    if tid < num_experts:
        for w in T.serial(WARPS):
            cnt = hist[w * MAX_EXPERTS + tid]
            hist[w * MAX_EXPERTS + tid] = acc
            acc = acc + cnt
        scratch[tid * nblocks + bx] = acc
    T.sync_grid()  # every block's counts are in the scratch (a cooperative launch: all blocks resident)
    _sum_counts(scratch, count_of, before_of, parts, sums, nblocks, bx, warp, lane, num_experts)
    T.sync_threads()
    lv[0] = 0
    if tid < num_experts:
        lv[0] = T.ceildiv(count_of[tid], alignment) * alignment
    _aligned_scan(lv, totals, 0, warp, lane)
    if tid < num_experts:
        start_of[tid] = lv[1]
        aligned_of[tid] = lv[0]
        base_of[tid] = lv[1] + before_of[tid]
        if bx == 0:
            expert_start[tid] = lv[1]
            expert_end[tid] = lv[1] + lv[0]
            num_tokens_per_expert[tid] = lv[0]
    T.sync_threads()

    # place this warp's piece, in flat order within each expert
    lanes_below = T.Cast("uint32", (T.Cast("int64", 1) << T.Cast("int64", lane)) - 1)
    _start_token(token, begin + lane, num_topk)
    for s in T.serial(steps):
        _step_ids(topk_idx, values, kept, experts, begin, end, lane, num_experts, s)
        _place_step((pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), hist, base_of, experts,
                    token, begin, end, warp, lane, lanes_below, num_topk, num_rows, s)

    # padding rows, over the whole grid
    _pad((pos_to_expert, pos_to_token, pos_to_token_topk), start_of, count_of, aligned_of, totals[WARPS - 1],
         bx * WARPS + warp, nblocks * WARPS, bx * THREADS + tid, nblocks * THREADS, lane, num_experts, num_rows, lv)


def get_fused_mapping_kernel(path):
    if path not in PATHS:
        raise ValueError(f"moe.get_fused_mapping: path must be one of {PATHS}, got {path!r}")
    num_elements = T.dynamic("num_elements")
    num_rows = T.dynamic("num_rows")
    num_experts = T.dynamic("num_experts")
    num_counts = T.dynamic("num_counts")
    blocks = path == "blocks"

    def grid(max_grid):  # of the kernel's parameter max_grid (unused by the blocks path)
        if blocks:
            return _blocks_grid(num_rows, num_elements)
        return _cooperative_grid(num_elements, num_experts, max_grid)

    @T.prim_func
    def get_fused_mapping(
        topk_idx: T.Tensor[(num_elements,), T.int64],
        pos_to_expert: T.Tensor[(num_rows,), T.int32],
        pos_to_token: T.Tensor[(num_rows,), T.int32],
        pos_to_token_topk: T.Tensor[(num_rows,), T.int32],
        token_topk_to_pos: T.Tensor[(num_elements,), T.int32],
        expert_start: T.Tensor[(num_experts,), T.int32],
        expert_end: T.Tensor[(num_experts,), T.int32],
        num_tokens_per_expert: T.Tensor[(num_experts,), T.int32],
        scratch: T.Tensor[(num_counts,), T.int32],
        num_topk: T.int32,
        alignment: T.int32,
        max_grid: T.int32,
    ):
        with T.Kernel(grid(max_grid), threads=THREADS) as bx:
            wait_for_previous_grid()
            tid = T.get_thread_binding()
            if blocks:
                _blocks_body(topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start,
                             expert_end, num_tokens_per_expert, num_topk, alignment, num_elements, num_rows,
                             num_experts, bx, tid, tid // 32, tid % 32)
            else:
                _cooperative_body(topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
                                  expert_start, expert_end, num_tokens_per_expert, scratch, max_grid, num_topk,
                                  alignment, num_elements, num_rows, num_experts, bx, tid, tid // 32, tid % 32)

    return get_fused_mapping
