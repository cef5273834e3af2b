"""moe.group_count and moe.aux_fi: a histogram of expert (group) indices.

``group_idx`` int64 [num_tokens, num_topk] (contiguous), read as its ``num_elements`` flat
entries.  Entry ``v`` counts for bin ``v`` when ``0 <= v < num_groups``; every other entry
(``-1``, any negative, ``>= num_groups``) is skipped.  ``mode`` (run time) picks the output:

* ``MODE_COUNT``: ``counts`` int32 [num_groups] = the count, truncated to 32 bits (the
  reference's int64 -> int32 cast);
* ``MODE_FI``: ``fi`` float32 [num_groups] = ``float32(count * num_groups) / denominator``,
  one IEEE division; ``denominator`` is the host's float32 of ``num_tokens * num_aux_topk``;
* ``MODE_ZERO``: ``fi`` = +0.0 (aux_fi with no tokens).

Design
------
One launch of one thread-block cluster of ``CLUSTER`` blocks of ``THREADS`` threads.  The
blocks combine their counts through distributed shared memory behind cluster barriers, so
there is no global workspace, no zeroed memory and no global atomics; integer counts do
not depend on the order of the adds, so the result is exact and deterministic.

* Thread ``t`` of each block owns shared bin ``t`` (hence ``num_groups <= THREADS``).
* Split: more than one tile (``THREADS * UNROLL`` entries) of input: block ``r`` takes the
  ``r``-th of ``CLUSTER`` contiguous ranges of ``per`` entries (a multiple of ``THREADS``,
  so every warp load is 256 contiguous bytes); at most one tile (decode sizes): block 0
  takes everything and the others do nothing (no cluster barrier, no exchange).
* Count: a block walks its range in tiles; each thread issues ``UNROLL`` coalesced 8-byte
  loads, then (after the barrier that orders the zeroed histogram before them, which the
  loads overlap) one shared ``atomicAdd`` per counted entry.  Element indices are 64-bit.
  Every ``CHUNK_TILES`` tiles (2^31 entries) the shared counts are folded into each owner's
  64-bit register total and cleared, so no 32-bit counter can wrap.
* Combine (split case): block ``r`` owns bins ``[64 r, 64 r + 64)`` (``BINS_PER_BLOCK``) and
  zeroes its sums of them before a first cluster barrier, whose arrive comes before the loads
  and whose wait after the count, so it costs no wait of its own.  Then thread ``b`` of every
  block pushes its nonzero count of bin ``b`` into the owner's sum (one
  ``red.shared::cluster.add`` per thread: a warp's 32 bins go to 32 consecutive words of one
  block; 32-bit adds for counts below 2^27, which 16 blocks cannot carry past 2^31, 64-bit adds
  otherwise), a second cluster barrier (release/acquire) completes every add, and the owner
  writes its bins from its own shared memory.  Nothing touches another block's shared memory
  after that barrier, so no third barrier holds the blocks before they exit.  Integer adds do
  not depend on their order: exact and deterministic.  Single-block case: thread ``t`` of
  block 0 writes output ``t`` from its own total.
* Every output word has exactly one writer.  ``num_groups``, ``num_topk`` and the token
  count are run-time values: one cubin per arch serves both ops and every expert count
  from 1 to 1024.

``CLUSTER`` is 16, above the portable 8: the runtime allows the non-portable size on the
kernel before launching it (csrc/runtime.cc).
"""

from tilelang import language as T
from tilelang.cuda.language import block_rank_in_cluster, cluster_arrive, cluster_sync, cluster_wait

from kernels_tl.dependent_launch import wait_for_previous_grid

# Blocks per cluster: 16 SMs share the read (the most an H100/H200/B200 cluster may have).
CLUSTER = 16
# One bin per thread: the most bins (experts) a call may have.
THREADS = 1024
# Loads each thread has in flight per tile: 1024 x 16 x 8 bytes = 128 KiB per block; a
# block's range at upstream's benchmark sizes (<= 15.4k entries) is one tile.
UNROLL = 16
TILE = THREADS * UNROLL
# Tiles between folds of the shared counts into the 64-bit totals: 2^31 entries, so a bin's
# int32 shared counter stays below 2^31.
CHUNK_TILES = 2**31 // TILE
# Bins each block sums in the combine step (thread j of block r: bin r * BINS_PER_BLOCK + j).
BINS_PER_BLOCK = THREADS // CLUSTER
# An atomic add into another block's shared memory within the cluster (distributed shared
# memory): ``mapa`` gives the same offset in block ``rank``, ``red.shared::cluster`` adds there
# without returning a value.  Only valid between a cluster barrier after the owner zeroed the
# word and the cluster barrier before the owner reads it.
CLUSTER_ADD_SOURCE = r"""
__device__ __forceinline__ unsigned tka_cluster_word(const void* local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
  return remote;
}
__device__ __forceinline__ void tka_cluster_add(unsigned* small, int64_t* large, int rank, int64_t value) {
  if (value < (int64_t{1} << 27)) {  // 16 such adds stay below 2^31
    asm volatile("red.relaxed.cluster.shared::cluster.add.u32 [%0], %1;"
                 :
                 : "r"(tka_cluster_word(small, rank)), "r"(static_cast<unsigned>(value))
                 : "memory");
  } else {
    asm volatile("red.relaxed.cluster.shared::cluster.add.u64 [%0], %1;"
                 :
                 : "r"(tka_cluster_word(large, rank)), "l"(value)
                 : "memory");
  }
}
"""
MODE_COUNT, MODE_FI, MODE_ZERO = 0, 1, 2
# Every access is guarded by the kernel's own bounds (loads below `end`, bins below `num_groups`),
# so TileLang's extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_safe_memory_legalize": True}


def host_constants():
    return {"max_groups": THREADS, "mode_count": MODE_COUNT, "mode_fi": MODE_FI, "mode_zero": MODE_ZERO}


def group_count_kernel():
    num_elements = T.dynamic("num_elements", "int64")
    num_groups = T.dynamic("num_groups")

    @T.macro
    def write_bin(counts, fi, mode, denominator, b, count):
        """Output ``b`` from the complete 64-bit count of bin ``b``."""
        if mode == MODE_COUNT:
            counts[b] = T.Cast("int32", count)
        elif mode == MODE_FI:
            fi[b] = T.Cast("float32", count * T.Cast("int64", num_groups)) / denominator
        else:
            fi[b] = T.float32(0)

    @T.prim_func
    def group_count(
        group_idx: T.Tensor[(num_elements,), T.int64],
        counts: T.Tensor[(num_groups,), T.int32],
        fi: T.Tensor[(num_groups,), T.float32],
        mode: T.int32,
        denominator: T.float32,
    ):
        with T.Kernel(CLUSTER, threads=THREADS, cluster_dims=CLUSTER):
            T.import_source(CLUSTER_ADD_SOURCE)
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            hist = T.alloc_shared((THREADS,), T.int32)
            # bins [rank * BINS_PER_BLOCK, (rank + 1) * BINS_PER_BLOCK): the cluster's sums,
            # pushed counts below 2^27 (all of them at any practical size) added in 32 bits,
            # larger ones in 64
            small = T.alloc_shared((BINS_PER_BLOCK,), T.uint32)
            large = T.alloc_shared((BINS_PER_BLOCK,), T.int64)
            values = T.alloc_local((UNROLL,), T.int64)
            rank = T.alloc_var(T.int32)
            total = T.alloc_var(T.int64)
            per = T.alloc_var(T.int64)
            begin = T.alloc_var(T.int64)
            end = T.alloc_var(T.int64)
            rank = block_rank_in_cluster()
            total = T.int64(0)
            hist[tid] = 0
            if tid < BINS_PER_BLOCK:
                small[tid] = T.uint32(0)
                large[tid] = T.int64(0)
            # this block's range [begin, end): split over the cluster when there is more than
            # one tile, else all of it in block 0 (the test is uniform over the cluster)
            split = num_elements > T.int64(TILE)
            if split:
                cluster_arrive()  # this block's sums are zeroed (waited on before the first push)
            per = num_elements
            if split:
                per = T.ceildiv(T.ceildiv(num_elements, T.int64(CLUSTER)), T.int64(THREADS)) * T.int64(THREADS)
            begin = T.min(T.Cast("int64", rank) * per, num_elements)
            end = T.min(begin + per, num_elements)
            num_tiles = T.ceildiv(end - begin, T.int64(TILE))
            for chunk in T.serial(T.ceildiv(num_tiles, T.int64(CHUNK_TILES))):
                for tile in T.serial(T.min(T.int64(CHUNK_TILES), num_tiles - chunk * T.int64(CHUNK_TILES))):
                    base = begin + (chunk * T.int64(CHUNK_TILES) + tile) * T.int64(TILE) + T.Cast("int64", tid)
                    for u in T.unroll(UNROLL):  # all loads in flight before the first add
                        values[u] = T.int64(-1)
                        if base + T.int64(u * THREADS) < end:
                            values[u] = group_idx[base + T.int64(u * THREADS)]
                    T.sync_threads()  # the zeroed (or folded) histogram, while the loads are in flight
                    for u in T.unroll(UNROLL):
                        if values[u] >= T.int64(0):
                            if values[u] < T.Cast("int64", num_groups):
                                T.atomic_add(hist[T.Cast("int32", values[u])], 1)
                # fold this chunk's counts into the owners' 64-bit totals
                T.sync_threads()
                total = total + T.Cast("int64", hist[tid])
                hist[tid] = 0
                T.sync_threads()
            if split:
                cluster_wait()  # every block's sums are zeroed
                # push bin tid's count to its owner (block tid // BINS_PER_BLOCK): a warp's 32
                # bins go to one block, to 32 consecutive words
                if tid < num_groups and total != T.int64(0):
                    T.evaluate(T.call_extern("void", "tka_cluster_add", T.address_of(small[tid % BINS_PER_BLOCK]),
                                             T.address_of(large[tid % BINS_PER_BLOCK]), tid // BINS_PER_BLOCK, total))
                cluster_sync()  # every push is done and visible to its owner; nothing remote after it
                bin_ = rank * BINS_PER_BLOCK + tid
                if tid < BINS_PER_BLOCK and bin_ < num_groups:
                    write_bin(counts, fi, mode, denominator, bin_, T.Cast("int64", small[tid]) + large[tid])
            elif rank == 0 and tid < num_groups:
                write_bin(counts, fi, mode, denominator, tid, total)

    return group_count
