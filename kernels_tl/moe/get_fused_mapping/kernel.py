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
Every block reads all entries (at most 64 KiB) and computes the whole layout itself, so the
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

``path="cluster"`` (more entries): up to ``MAX_CLUSTERS`` thread-block clusters of ``CLUSTER``
blocks; the blocks of a cluster exchange their per-expert counts through distributed shared
memory, every cluster counts every entry, and the clusters share placement (cluster ``k``
places the ``k``-th part of every warp range) and padding; see
``_cluster_kernel``.

Every output element has exactly one writer.  All counts and rows are int32: the host
refuses layouts of 2^31 - 2^16 rows or more.  Nothing else is static: one cubin per path
and arch serves every token count, top-k, alignment and expert count up to ``THREADS``.
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_arrive, cluster_sync, cluster_wait

from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE
from kernels_tl.dependent_launch import wait_for_previous_grid

PATHS = ("blocks", "cluster")
CLUSTER = 16  # blocks per cluster: 16 SMs share the reads and writes (non-portable size)
THREADS = 1024
WARPS = THREADS // 32
MAX_EXPERTS = THREADS  # thread e owns expert e in step 2
UNROLL = 16  # cluster path: loads in flight per lane: 128 KiB per block
STEP = 32 * UNROLL  # cluster path: entries a warp takes per step
SMALL_ENTRIES = 8192  # blocks path: the most entries (every block reads them all: 64 KiB)
SMALL_GROUPS = SMALL_ENTRIES // THREADS  # blocks path: groups of 32 per warp chunk, at most
ROWS_PER_BLOCK = 2048  # blocks path: one block per this many rows + entries ...
MAX_BLOCKS = 32  # ... up to this many (a warp chunk each at most)
ROWS_PER_CLUSTER = 65536  # cluster path: one cluster per this many rows and as many entries ...
# ... up to this many (each counts every entry; they share placement and padding: cluster k
# places the k-th part of every warp range).  4 x 16 full-SM blocks fit one wave of a 132-SM
# part; past 4 the padding tail's int32 stride needs 64 bits.
MAX_CLUSTERS = 4
# Barriers are placed by hand (warp-private histogram rows need only __syncwarp).
# Every access is guarded by the kernel's own bounds (loads below `end`, rows below `num_rows`),
# so TileLang's extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}


def host_constants(path):
    return {"max_experts": MAX_EXPERTS, "cluster": CLUSTER if path == "cluster" else 1, "warps": WARPS,
            "small_entries": SMALL_ENTRIES}


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


def _clusters(num_rows, num_elements):
    """Clusters of the cluster path: one per ROWS_PER_CLUSTER rows and as many entries, 1 to
    MAX_CLUSTERS (in int32 without overflow: each quotient is below 2^15)."""
    return T.min(T.ceildiv(num_rows, ROWS_PER_CLUSTER) + T.ceildiv(num_elements, ROWS_PER_CLUSTER), MAX_CLUSTERS)


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
    ``kept`` (step 1's registers), later steps re-read from global memory."""
    if s == 0:
        for u in T.unroll(UNROLL):
            experts[u] = kept[u]
    else:
        _load_step(topk_idx, values, begin, end, lane, s)
        for u in T.unroll(UNROLL):
            experts[u] = _expert_of(values[u], num_experts)


@T.macro
def _count_before(hist, experts, begin, pbegin, warp, lane, s):
    """Add the entries of step ``s`` of a warp's range that lie before ``pbegin`` (the start
    of this cluster's part) to the warp's histogram row (shared atomics: the counts do not
    depend on their order)."""
    for u in T.unroll(UNROLL):
        if begin + s * STEP + u * 32 + lane < pbegin and experts[u] >= 0:
            T.atomic_add(hist[warp * MAX_EXPERTS + experts[u]], 1)


@T.macro
def _place_step(outs, hist, base_of, experts, token, begin, pbegin, pend, warp, lane, lanes_below, num_topk, num_rows,
                s):
    """Place the entries of step ``s`` of a warp's range that lie in ``[pbegin, pend)``, their
    expert ids in ``experts``; ``hist``'s row of the warp counts the range's entries before
    them of each expert.  ``pbegin - begin`` is a multiple of 32, so each group of 32 lies
    wholly inside or outside the part (uniform over the warp); ``token`` starts at
    ``pbegin + lane`` and advances by one group per placed group."""
    for u in T.unroll(UNROLL):
        if begin + s * STEP + u * 32 >= pbegin and begin + s * STEP + u * 32 < pend:
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
            if begin + s * STEP + u * 32 + lane < pend:
                if expert >= 0:
                    row = row + below + base_of[expert]
                _write_pair(outs, row, expert, token[0], begin + s * STEP + u * 32 + lane, num_rows)
            _advance_token(token, num_topk)


@T.macro
def _cluster_body(topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end,
                  num_tokens_per_expert, num_topk, alignment, num_elements, num_rows, num_experts, bx, tid, warp, lane):
    """One launch of ``_clusters()`` thread-block clusters of ``CLUSTER`` blocks of ``THREADS``
    threads.  Within a cluster the blocks exchange their per-expert counts through distributed
    shared memory and a cluster barrier, so there is no global workspace, no zeroed memory and no
    grid-wide barrier; every cluster counts every entry and computes the same offsets, and the
    clusters share steps 3 and 4.  The flat entries are split into ``CLUSTER * WARPS`` contiguous
    warp ranges (block-major, so the order of (block, warp, position in range) is the flat order),
    each a multiple of 32 long, the same in every cluster.

    1. Count: each warp walks its range ``STEP`` entries at a time (``UNROLL`` coalesced 8-byte
       loads per lane in flight) and adds every routed entry to its own row of the shared
       histogram ``hist[warp][expert]``; the expert ids of its first step stay in registers
       for step 3 (the whole range up to ``STEP`` entries per warp: 262144 entries in all).
    2. Offsets: thread ``e`` owns expert ``e`` (so ``num_experts <= THREADS``): it turns
       column ``e`` of the histogram into exclusive prefix sums over the block's warps and
       publishes the block's count; after a cluster barrier it reads the counts of every block
       of the cluster (``ld.shared::cluster``), giving ``c[e]`` and the count in earlier blocks;
       a block-wide scan of ``a`` gives ``start``, and ``base[e]`` = ``start[e]`` + the count
       in earlier blocks is this block's first row of expert ``e``.
    3. Place: cluster ``k`` places the ``k``-th of ``clusters`` parts (whole groups of 32) of
       every warp range, so each warp of the grid walks a ``1 / clusters`` share of its range
       (the serial chain per warp shrinks with the cluster count, not only the warps' number).
       The warp first adds the entries of its range before the part to its histogram row
       (shared atomics: order-free), then walks the part in order (from registers, past the
       first step from global memory; one copy of the code for every step); within 32
       entries, ``__match_any_sync`` gives each lane the number of earlier lanes with its
       expert, and the warp's histogram row counts the earlier entries of its range, so rows
       follow flat order exactly and the result is deterministic (no atomics decide a row).
    4. Padding: the rows ``[start + c, start + a)`` of each expert (a warp per expert) and the
       tail ``[sum(a), num_rows)`` (the whole grid) are set to -1.

    ``CLUSTER`` is 16, above the portable 8: the runtime allows the non-portable size on the
    kernel before launching it (csrc/runtime.cc)."""
    nclusters = _clusters(num_rows, num_elements)
    cid = bx // CLUSTER  # this block's cluster: consecutive blocks form one

    hist = T.alloc_shared((WARPS * MAX_EXPERTS,), T.int32)  # [warp][expert]
    # [0, MAX_EXPERTS): this block's count per expert, read by the other blocks until they
    # pass their cluster_arrive; then WARPS words of the scan's per-warp totals.  One buffer,
    # so that the compiler's shared-memory reuse never places the totals over the counts.
    exchange = T.alloc_shared((MAX_EXPERTS + WARPS,), T.int32)
    base_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # start[e] + count in earlier blocks
    count_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # c[e]
    start_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # start[e]
    aligned_of = T.alloc_shared((MAX_EXPERTS,), T.int32)  # a[e]

    values = T.alloc_local((UNROLL,), T.int64)
    kept = T.alloc_local((UNROLL,), T.int32)  # expert ids of the first step (steps 1 and 3)
    experts = T.alloc_local((UNROLL,), T.int32)
    parts = T.alloc_local((CLUSTER,), T.int32)
    token = T.alloc_local((4,), T.int32)  # step 3's token of the next entry (place_step)
    lv = T.alloc_local((4,), T.int32)
    rank = T.alloc_var(T.int32)
    rank = block_rank_in_cluster()
    expert = T.alloc_var(T.int32)
    acc = T.alloc_var(T.int32)
    cnt = T.alloc_var(T.int32)
    before = T.alloc_var(T.int32)
    begin = T.alloc_var(T.int32)
    end = T.alloc_var(T.int32)

    # this warp's row of the histogram, zeroed (only the warp itself touches it in step 1)
    for j in T.serial(T.ceildiv(num_experts, 32)):
        if j * 32 + lane < num_experts:
            hist[warp * MAX_EXPERTS + j * 32 + lane] = 0
    T.sync_warp()

    # this warp's range of flat entries: [begin, end)
    warp_range = T.Cast("int64", T.ceildiv(T.ceildiv(num_elements, CLUSTER * WARPS), 32) * 32)
    gwarp = T.Cast("int64", rank * WARPS + warp)
    begin = T.Cast("int32", T.min(gwarp * warp_range, T.Cast("int64", num_elements)))
    end = T.Cast("int32", T.min((gwarp + 1) * warp_range, T.Cast("int64", num_elements)))
    steps = T.ceildiv(end - begin, STEP)

    # 1. count; the first step's ids stay in `kept`
    for u in T.unroll(UNROLL):
        kept[u] = -1
    if steps > 0:
        _load_step(topk_idx, values, begin, end, lane, 0)
        for u in T.unroll(UNROLL):
            kept[u] = _expert_of(values[u], num_experts)
        for u in T.unroll(UNROLL):
            if kept[u] >= 0:
                T.atomic_add(hist[warp * MAX_EXPERTS + kept[u]], 1)
    for s in T.serial(1, steps):
        _load_step(topk_idx, values, begin, end, lane, s)
        for u in T.unroll(UNROLL):
            expert = _expert_of(values[u], num_experts)
            if expert >= 0:
                T.atomic_add(hist[warp * MAX_EXPERTS + expert], 1)
    T.sync_threads()

    # 2. offsets: per-warp exclusive prefix within the block, then across the cluster
    acc = 0
    if tid < num_experts:
        for w in T.serial(WARPS):
            cnt = hist[w * MAX_EXPERTS + tid]
            hist[w * MAX_EXPERTS + tid] = acc
            acc = acc + cnt
        exchange[tid] = acc
    cluster_sync()  # every block's counts are written and visible cluster-wide
    cnt = 0
    before = 0
    if tid < num_experts:
        for r in T.unroll(CLUSTER):  # all remote reads in flight, then the sums
            parts[r] = T.call_extern(T.int32, "tka_cluster_load_s32", T.address_of(exchange[tid]), r)
        for r in T.unroll(CLUSTER):
            cnt = cnt + parts[r]
            if r < rank:
                before = before + parts[r]
    cluster_arrive()  # done reading the other blocks' shared memory (they wait before exiting)
    lv[0] = 0
    if tid < num_experts:
        lv[0] = T.ceildiv(cnt, alignment) * alignment
    # block-wide exclusive scan of a[e] over the experts (totals after the counts)
    _aligned_scan(lv, exchange, MAX_EXPERTS, warp, lane)
    if tid < num_experts:
        start_of[tid] = lv[1]
        count_of[tid] = cnt
        aligned_of[tid] = lv[0]
        base_of[tid] = lv[1] + before
        if bx == 0:
            expert_start[tid] = lv[1]
            expert_end[tid] = lv[1] + lv[0]
            num_tokens_per_expert[tid] = lv[0]
    T.sync_threads()

    # 3. place, in flat order within each expert: cluster `cid` places the `cid`-th of
    # `nclusters` parts of every warp range (every cluster computed the same offsets).
    # The part is [pbegin, pend), whole groups of 32 from `begin`; the entries of the range
    # before it are first added to the warp's histogram row.
    part = T.ceildiv(T.ceildiv(end - begin, 32), nclusters) * 32
    pbegin = T.min(begin + cid * part, end)
    pend = T.min(pbegin + part, end)
    lanes_below = T.Cast("uint32", (T.Cast("int64", 1) << T.Cast("int64", lane)) - 1)
    for s in T.serial(T.ceildiv(pbegin - begin, STEP)):  # steps with entries before the part
        _step_ids(topk_idx, values, kept, experts, begin, end, lane, num_experts, s)
        _count_before(hist, experts, begin, pbegin, warp, lane, s)
    T.sync_warp()
    _start_token(token, pbegin + lane, num_topk)
    for s in T.serial(T.truncdiv(pbegin - begin, STEP), T.ceildiv(pend - begin, STEP)):  # steps of the part
        _step_ids(topk_idx, values, kept, experts, begin, end, lane, num_experts, s)
        _place_step((pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), hist, base_of, experts, token,
                    begin, pbegin, pend, warp, lane, lanes_below, num_topk, num_rows, s)

    # 4. padding rows, over the whole grid
    _pad((pos_to_expert, pos_to_token, pos_to_token_topk), start_of, count_of, aligned_of,
         exchange[MAX_EXPERTS + WARPS - 1], (cid * CLUSTER + rank) * WARPS + warp, nclusters * CLUSTER * WARPS,
         (cid * CLUSTER + rank) * THREADS + tid, nclusters * CLUSTER * THREADS, lane, num_experts, num_rows, lv)
    cluster_wait()  # no block exits while another may still read its shared memory


def get_fused_mapping_kernel(path):
    if path not in PATHS:
        raise ValueError(f"moe.get_fused_mapping: path must be one of {PATHS}, got {path!r}")
    num_elements = T.dynamic("num_elements")
    num_rows = T.dynamic("num_rows")
    num_experts = T.dynamic("num_experts")
    blocks = path == "blocks"
    grid = _blocks_grid(num_rows, num_elements) if blocks else CLUSTER * _clusters(num_rows, num_elements)

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
        num_topk: T.int32,
        alignment: T.int32,
    ):
        with T.Kernel(grid, threads=THREADS, cluster_dims=None if blocks else CLUSTER) as bx:
            if not blocks:
                T.import_source(CLUSTER_LOAD_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            args = (topk_idx, pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end,
                    num_tokens_per_expert, num_topk, alignment, num_elements, num_rows, num_experts, bx, tid, tid // 32,
                    tid % 32)
            if blocks:
                _blocks_body(*args)
            else:
                _cluster_body(*args)

    return get_fused_mapping
