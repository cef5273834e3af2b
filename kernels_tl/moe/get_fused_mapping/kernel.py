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

Design
------
One launch of one thread-block cluster of ``CLUSTER`` blocks of ``THREADS`` threads: the
blocks exchange their per-expert counts through distributed shared memory and a cluster
barrier, so there is no global workspace, no zeroed memory and no grid-wide barrier.  The
flat entries are split into ``CLUSTER * WARPS`` contiguous warp ranges (block-major, so the
order of (block, warp, position in range) is the flat order), each a multiple of 32 long.

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
3. Place: each warp walks its range again in the same order (from registers, past the
   first step from global memory); within 32 entries, ``__match_any_sync`` gives each lane
   the number of earlier lanes with its expert, and the warp's histogram row counts the
   earlier entries of its range, so rows follow flat order exactly and the result is
   deterministic (no atomics decide a row).
4. Padding: the rows ``[start + c, start + a)`` of each expert (a warp per expert) and the
   tail ``[sum(a), num_rows)`` (the whole cluster) are set to -1.

Every output element has exactly one writer.  All counts and rows are int32: the host
refuses layouts of 2^31 - 2^16 rows or more.  Nothing is static: one cubin per arch serves
every token count, top-k, alignment and expert count up to ``THREADS``.  ``CLUSTER`` is 16,
above the portable 8: the runtime allows the non-portable size on the kernel before
launching it (csrc/runtime.cc).
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_arrive, cluster_sync, cluster_wait

from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE
from kernels_tl.dependent_launch import wait_for_previous_grid

CLUSTER = 16  # blocks per cluster: 16 SMs share the reads and writes (non-portable size)
THREADS = 1024
WARPS = THREADS // 32
MAX_EXPERTS = THREADS  # thread e owns expert e in step 2
UNROLL = 16  # loads in flight per lane: 128 KiB per block
STEP = 32 * UNROLL  # entries a warp takes per step
# Barriers are placed by hand (warp-private histogram rows need only __syncwarp).
# Every access is guarded by the kernel's own bounds (loads below `end`, rows below `num_rows`),
# so TileLang's extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}


def host_constants():
    return {"max_experts": MAX_EXPERTS, "cluster": CLUSTER, "warps": WARPS}


def get_fused_mapping_kernel():
    num_elements = T.dynamic("num_elements")
    num_rows = T.dynamic("num_rows")
    num_experts = T.dynamic("num_experts")

    def expert_of(value):
        """The expert id of one entry (int64 ``value``), -1 when it is unrouted."""
        routed = T.if_then_else(value < T.Cast("int64", num_experts), T.Cast("int32", value), -1)
        return T.if_then_else(value >= T.int64(0), routed, -1)

    @T.macro
    def load_step(topk_idx, values, begin, end, lane, s):
        """``values`` <- the entries of step ``s`` of a warp's range ``[begin, end)`` (-1 past
        its end)."""
        for u in T.unroll(UNROLL):  # all loads in flight before the first use
            values[u] = T.int64(-1)
            if begin + s * STEP + u * 32 + lane < end:
                values[u] = topk_idx[begin + s * STEP + u * 32 + lane]

    @T.macro
    def place_step(outs, hist, base_of, experts, token, begin, end, warp, lane, lanes_below, num_topk, s):
        """Place the entries of step ``s`` of a warp's range, their expert ids in ``experts``;
        ``hist``'s row of the warp counts the range's earlier entries of each expert.
        ``token`` = [i // num_topk, i % num_topk, 32 // num_topk, 32 % num_topk] for this
        lane's next entry ``i``, advanced by 32 entries per group (no division per entry)."""
        pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos = outs
        for u in T.unroll(UNROLL):
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
            i = begin + s * STEP + u * 32 + lane
            if i < end:
                if expert >= 0:
                    row = row + below + base_of[expert]
                if expert >= 0 and row < num_rows:
                    pos_to_expert[row] = expert
                    pos_to_token[row] = token[0]
                    pos_to_token_topk[row] = i
                    token_topk_to_pos[i] = row
                else:
                    token_topk_to_pos[i] = -1
            # the next group: i + 32
            token[0] = token[0] + token[2]
            token[1] = token[1] + token[3]
            if token[1] >= num_topk:
                token[1] = token[1] - num_topk
                token[0] = token[0] + 1

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
        with T.Kernel(CLUSTER, threads=THREADS, cluster_dims=CLUSTER):
            T.import_source(CLUSTER_LOAD_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            warp = tid // 32
            lane = tid % 32

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
            rank = T.alloc_var(T.int32)
            begin = T.alloc_var(T.int32)
            end = T.alloc_var(T.int32)
            expert = T.alloc_var(T.int32)
            acc = T.alloc_var(T.int32)
            cnt = T.alloc_var(T.int32)
            before = T.alloc_var(T.int32)
            scan = T.alloc_var(T.int32)
            row = T.alloc_var(T.int32)
            rank = block_rank_in_cluster()

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
                load_step(topk_idx, values, begin, end, lane, 0)
                for u in T.unroll(UNROLL):
                    kept[u] = expert_of(values[u])
                for u in T.unroll(UNROLL):
                    if kept[u] >= 0:
                        T.atomic_add(hist[warp * MAX_EXPERTS + kept[u]], 1)
            for s in T.serial(1, steps):
                load_step(topk_idx, values, begin, end, lane, s)
                for u in T.unroll(UNROLL):
                    expert = expert_of(values[u])
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
            acc = 0
            if tid < num_experts:
                acc = T.ceildiv(cnt, alignment) * alignment
            # block-wide exclusive scan of a[e] over the experts
            scan = acc
            for d in T.unroll(5):
                row = T.shfl_up(scan, 1 << d)
                if lane >= (1 << d):
                    scan = scan + row
            if lane == 31:
                exchange[MAX_EXPERTS + warp] = scan
            T.sync_threads()
            if warp == 0:
                row = exchange[MAX_EXPERTS + lane]
                for d in T.unroll(5):
                    expert = T.shfl_up(row, 1 << d)
                    if lane >= (1 << d):
                        row = row + expert
                T.sync_warp()
                exchange[MAX_EXPERTS + lane] = row  # inclusive over warps
            T.sync_threads()
            if warp > 0:
                scan = scan + exchange[MAX_EXPERTS + warp - 1]
            scan = scan - acc  # exclusive: start[e]
            if tid < num_experts:
                start_of[tid] = scan
                count_of[tid] = cnt
                aligned_of[tid] = acc
                base_of[tid] = scan + before
                if rank == 0:
                    expert_start[tid] = scan
                    expert_end[tid] = scan + acc
                    num_tokens_per_expert[tid] = acc
            T.sync_threads()

            # 3. place, in flat order within each expert
            lanes_below = T.Cast("uint32", (T.Cast("int64", 1) << T.Cast("int64", lane)) - 1)
            token[0] = T.truncdiv(begin + lane, num_topk)
            token[1] = T.truncmod(begin + lane, num_topk)
            token[2] = T.truncdiv(32, num_topk)
            token[3] = T.truncmod(32, num_topk)
            if steps > 0:
                for u in T.unroll(UNROLL):
                    experts[u] = kept[u]
                place_step((pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), hist, base_of, experts, token, begin, end, warp, lane, lanes_below, num_topk, 0)
            for s in T.serial(1, steps):
                load_step(topk_idx, values, begin, end, lane, s)
                for u in T.unroll(UNROLL):
                    experts[u] = expert_of(values[u])
                place_step((pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos), hist, base_of, experts, token, begin, end, warp, lane, lanes_below, num_topk, s)

            # 4. padding rows: [start + c, start + a) of each expert, a warp per expert
            for j in T.serial(T.ceildiv(num_experts, CLUSTER * WARPS)):
                expert = j * CLUSTER * WARPS + rank * WARPS + warp
                if expert < num_experts:
                    row = start_of[expert] + count_of[expert] + lane
                    scan = T.min(start_of[expert] + aligned_of[expert], num_rows)
                    for r in T.serial(row, scan, 32):
                        pos_to_expert[r] = -1
                        pos_to_token[r] = -1
                        pos_to_token_topk[r] = -1
            # ... and the tail [sum(a), num_rows), over the whole cluster
            row = exchange[MAX_EXPERTS + WARPS - 1] + rank * THREADS + tid  # sum(a) + this thread
            for r in T.serial(row, num_rows, CLUSTER * THREADS):
                pos_to_expert[r] = -1
                pos_to_token[r] = -1
                pos_to_token_topk[r] = -1
            cluster_wait()  # no block exits while another may still read its shared memory

    return get_fused_mapping
