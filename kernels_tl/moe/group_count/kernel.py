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
One block of ``THREADS`` (1024) threads, so the result is a complete count with no partial
sums to combine across blocks (the runtime hands the kernel uninitialised outputs and there
is no zeroed workspace) and no float atomics: deterministic by construction.  Thread ``t``
owns bin ``t`` (hence ``num_groups <= 1024``): it zeroes the shared histogram word ``t``,
and at the end writes output ``t``.  The block walks the entries in tiles of
``THREADS * UNROLL``: each thread issues ``UNROLL`` coalesced 8-byte loads (a warp reads 256
contiguous bytes per load), then one shared-memory ``atomicAdd`` per counted entry.  Element
indices are 64-bit.  Every ``CHUNK_TILES`` tiles (2^31 entries) the shared counts are folded
into each owner's 64-bit register total and cleared, so no 32-bit counter can wrap: counts
stay exact past 2^32 entries (aux_fi needs the full count).  ``num_groups``, ``num_topk``
and the token count are run-time values: one cubin per arch serves both ops and every
expert count from 1 to 1024.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# One bin per thread: the most bins (experts) a call may have.
THREADS = 1024
# Loads each thread has in flight per tile: 1024 x 16 x 8 bytes = 128 KiB per tile (52 registers
# on sm_90a, no spills, under the 64-register cap of a 1024-thread block).
UNROLL = 16
TILE = THREADS * UNROLL
# Tiles between folds of the shared counts into the 64-bit totals: 2^31 entries, so a bin's
# int32 shared counter stays below 2^31.
CHUNK_TILES = 2**31 // TILE
MODE_COUNT, MODE_FI, MODE_ZERO = 0, 1, 2
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def host_constants():
    return {"max_groups": THREADS, "mode_count": MODE_COUNT, "mode_fi": MODE_FI, "mode_zero": MODE_ZERO}


def group_count_kernel():
    num_elements = T.dynamic("num_elements", "int64")
    num_groups = T.dynamic("num_groups")

    @T.prim_func
    def group_count(
        group_idx: T.Tensor[(num_elements,), T.int64],
        counts: T.Tensor[(num_groups,), T.int32],
        fi: T.Tensor[(num_groups,), T.float32],
        mode: T.int32,
        denominator: T.float32,
    ):
        with T.Kernel(1, threads=THREADS):
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            hist = T.alloc_shared((THREADS,), T.int32)
            values = T.alloc_local((UNROLL,), T.int64)
            total = T.alloc_var(T.int64)
            total = T.int64(0)
            hist[tid] = 0
            T.sync_threads()
            num_tiles = T.ceildiv(num_elements, T.int64(TILE))
            for chunk in T.serial(T.ceildiv(num_tiles, T.int64(CHUNK_TILES))):
                for tile in T.serial(T.min(T.int64(CHUNK_TILES), num_tiles - chunk * T.int64(CHUNK_TILES))):
                    base = (chunk * T.int64(CHUNK_TILES) + tile) * T.int64(TILE) + T.Cast("int64", tid)
                    for u in T.unroll(UNROLL):  # all loads in flight before the first add
                        values[u] = T.int64(-1)
                        if base + T.int64(u * THREADS) < num_elements:
                            values[u] = group_idx[base + T.int64(u * THREADS)]
                    for u in T.unroll(UNROLL):
                        if values[u] >= T.int64(0):
                            if values[u] < T.Cast("int64", num_groups):
                                T.atomic_add(hist[T.Cast("int32", values[u])], 1)
                # fold this chunk's counts into the owners' 64-bit totals
                T.sync_threads()
                total = total + T.Cast("int64", hist[tid])
                hist[tid] = 0
                T.sync_threads()
            if tid < num_groups:
                if mode == MODE_COUNT:
                    counts[tid] = T.Cast("int32", total)
                elif mode == MODE_FI:
                    fi[tid] = T.Cast("float32", total * T.Cast("int64", num_groups)) / denominator
                else:
                    fi[tid] = T.float32(0)

    return group_count
