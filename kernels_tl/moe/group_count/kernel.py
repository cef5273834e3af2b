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
One kernel of ``THREADS`` (256) threads per block; a run-time ``phase`` picks what a launch
does, and the host launches it once or twice per call (host.h):

* ``PHASE_SINGLE`` (at most one tile of input, e.g. decode: one launch of one block): the
  block counts every entry and writes the outputs.
* ``PHASE_PARTIAL`` (launch 0 of two, a grid of ``num_rows`` blocks): block ``b`` counts the
  contiguous range ``[b * per, min((b + 1) * per, num_elements))`` (``per`` a multiple of 32,
  so every warp load is 256 contiguous bytes) and writes its whole row ``partial[b, :]`` of
  the uninitialised scratch buffer (int32, every word of the row, zeros included).
* ``PHASE_REDUCE`` (launch 1 of two, ``ceil(num_groups / REDUCE_BINS)`` blocks): after the
  programmatic-dependent-launch wait (launch 0 complete, its stores visible), block ``j`` sums
  the ``num_rows`` rows of bins ``[j * REDUCE_BINS, (j + 1) * REDUCE_BINS)`` in 64 bits and
  writes those outputs.  Integer sums do not depend on their order: exact and deterministic.

Count (both counting phases): a block zeroes its shared histogram (thread ``t`` bins ``t``,
``t + THREADS``, ...), walks its range in tiles, each thread issuing ``UNROLL`` coalesced
8-byte loads (a 32-bit count of the tile's entries left guards them), then, after the barrier
that orders the zeroed histogram before them (the loads overlap it), one shared ``atomicAdd``
per entry in ``[0, num_groups)`` (one unsigned 64-bit compare).  Element indices are 64-bit.
The host keeps every block's range at most 2^30 entries, so no int32 shared count (nor
partial word) can wrap.

Reduce: lane ``l`` of warp ``g`` sums bin ``j * REDUCE_BINS + l`` over rows ``g, g +
REDUCE_GROUPS, ...``, ``REDUCE_UNROLL`` loads in flight per pass (a warp reads 128 contiguous
bytes of one row); the warps' sums meet in shared memory and warp 0 adds them and writes.

Every output word has exactly one writer.  ``num_groups``, ``num_topk``, the token count, the
grid and the split are run-time values: one cubin per arch serves both ops and every expert
count from 1 to 1024.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# Threads per block.  Few warps on purpose: a block's time at these sizes is mostly the
# instructions its warps issue (every warp runs every unrolled slot, valid or not), so a
# block of 8 warps with several entries per thread issues a quarter of what 32 warps do.
THREADS = 256
# The most bins (experts) a call may have; each thread owns bins t, t + THREADS, ...
MAX_GROUPS = 1024
BINS_PER_THREAD = MAX_GROUPS // THREADS
# Loads each thread has in flight per tile of a counting block: 256 x 16 x 8 bytes = 32 KiB.
UNROLL = 16
TILE = THREADS * UNROLL
# Reduce launch: bins per block (lane = bin: a warp reads 32 consecutive int32 of a row), row
# groups per block (warp = row group), rows each thread has in flight per pass: one pass sums
# up to REDUCE_ROWS = 144 counting blocks (the host's cap on the counting grid).
REDUCE_BINS = 32
REDUCE_GROUPS = THREADS // REDUCE_BINS
REDUCE_UNROLL = 18
REDUCE_ROWS = REDUCE_GROUPS * REDUCE_UNROLL
MODE_COUNT, MODE_FI, MODE_ZERO = 0, 1, 2
PHASE_SINGLE, PHASE_PARTIAL, PHASE_REDUCE = 0, 1, 2
# Every access is guarded by the kernel's own bounds (loads below `end`, rows below `num_rows`,
# bins below `num_groups`), so TileLang's extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_safe_memory_legalize": True}


def host_constants():
    return {"max_groups": MAX_GROUPS, "tile": TILE, "reduce_bins": REDUCE_BINS, "reduce_rows": REDUCE_ROWS,
            "mode_count": MODE_COUNT, "mode_fi": MODE_FI, "mode_zero": MODE_ZERO, "phase_single": PHASE_SINGLE,
            "phase_partial": PHASE_PARTIAL, "phase_reduce": PHASE_REDUCE}


def group_count_kernel():
    num_elements = T.dynamic("num_elements", "int64")
    num_groups = T.dynamic("num_groups")
    num_rows = T.dynamic("num_rows")

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
        partial: T.Tensor[(num_rows, num_groups), T.int32],
        counts: T.Tensor[(num_groups,), T.int32],
        fi: T.Tensor[(num_groups,), T.float32],
        num_blocks: T.int32,
        per: T.int64,
        phase: T.int32,
        mode: T.int32,
        denominator: T.float32,
    ):
        with T.Kernel(num_blocks, threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch: launch 0's rows are complete
            tid = T.get_thread_binding()
            hist = T.alloc_shared((MAX_GROUPS,), T.int32)
            sums = T.alloc_shared((REDUCE_GROUPS, REDUCE_BINS), T.int64)
            values = T.alloc_local((UNROLL,), T.int64)
            cells = T.alloc_local((REDUCE_UNROLL,), T.int32)
            begin = T.alloc_var(T.int64)
            end = T.alloc_var(T.int64)
            acc = T.alloc_var(T.int64)
            if phase == PHASE_REDUCE:
                lane = tid % REDUCE_BINS
                group = tid // REDUCE_BINS
                bin_ = bid * REDUCE_BINS + lane
                acc = T.int64(0)
                if bin_ < num_groups:
                    for p in T.serial(T.ceildiv(num_rows, REDUCE_ROWS)):
                        for u in T.unroll(REDUCE_UNROLL):  # every load of the pass in flight
                            cells[u] = 0
                            if p * REDUCE_ROWS + u * REDUCE_GROUPS + group < num_rows:
                                cells[u] = partial[p * REDUCE_ROWS + u * REDUCE_GROUPS + group, bin_]
                        for u in T.unroll(REDUCE_UNROLL):
                            acc = acc + T.Cast("int64", cells[u])
                sums[group, lane] = acc
                T.sync_threads()
                if tid < REDUCE_BINS and bin_ < num_groups:
                    acc = T.int64(0)
                    for g in T.unroll(REDUCE_GROUPS):
                        acc = acc + sums[g, tid]
                    write_bin(counts, fi, mode, denominator, bin_, acc)
            else:
                for i in T.unroll(BINS_PER_THREAD):
                    hist[i * THREADS + tid] = 0
                begin = T.min(T.Cast("int64", bid) * per, num_elements)
                end = T.min(begin + per, num_elements)
                for tile in T.serial(T.ceildiv(end - begin, T.int64(TILE))):
                    # entries of this tile left from this thread's first one (32-bit: < TILE)
                    left = T.Cast("int32", T.min(end - begin - tile * T.int64(TILE), T.int64(TILE))) - tid
                    base = begin + tile * T.int64(TILE) + T.Cast("int64", tid)
                    for u in T.unroll(UNROLL):  # all loads in flight before the first add
                        values[u] = T.int64(-1)
                        if u * THREADS < left:
                            values[u] = group_idx[base + T.int64(u * THREADS)]
                    T.sync_threads()  # the zeroed histogram, while the loads are in flight
                    for u in T.unroll(UNROLL):
                        # 0 <= value < num_groups in one unsigned compare (a negative one wraps high)
                        if T.Cast("uint64", values[u]) < T.Cast("uint64", num_groups):
                            T.atomic_add(hist[T.Cast("int32", values[u])], 1)
                T.sync_threads()  # every add of the block (also orders the zeroing in an empty block)
                for i in T.unroll(BINS_PER_THREAD):
                    if i * THREADS + tid < num_groups:
                        if phase == PHASE_SINGLE:
                            write_bin(counts, fi, mode, denominator, i * THREADS + tid,
                                      T.Cast("int64", hist[i * THREADS + tid]))
                        else:
                            partial[bid, i * THREADS + tid] = hist[i * THREADS + tid]

    return group_count
