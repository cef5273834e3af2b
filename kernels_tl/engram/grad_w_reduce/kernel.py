"""engram.grad_w_reduce: finish the Engram weight gradients, accumulating in place.

``grad_w_partial`` fp32 [P, hc_mult, hidden], ``weight_hidden`` / ``weight_embed`` bf16
[hc_mult, hidden], ``grad_weight_hidden`` / ``grad_weight_embed`` fp32 [hc_mult, hidden]
(read and written; all contiguous):

    G = ((0 + partial[0]) + partial[1]) + ... + partial[P - 1]     (rows in order, fp32)
    grad_weight_hidden += G * weight_embed;  grad_weight_embed += G * weight_hidden

each product and sum rounded on its own (no fused multiply-add), as the reference does.

Design
------
The sum over ``P`` is one chain per column, so the parallelism is in the columns and the
memory-level parallelism must come from rows requested ahead of the chain.  Blocks of
``THREADS`` threads (four warps) own ``SPAN`` consecutive columns; thread ``t`` owns the ``VEC``
columns ``SPAN * b + VEC * t .. + VEC - 1`` (its ``VEC`` floats of each row, contiguous across
the block, so its shared-memory reads are conflict-free).  The rows stream through a ring of
``STAGES`` groups of ``ROWS`` rows in shared memory; every row up to ``STAGES * ROWS`` is
requested at once.  Each thread waits for one group at a time, adds its rows in order and, when
``P`` exceeds the ring, the block refills the group's slot with the group ``STAGES`` further on.

Aligned rows (``hc_mult * hidden`` a multiple of 4 and the partial sums 16-byte aligned: the
host's ``vec`` flag) are fetched by the TMA engine: one 1-D bulk copy (``cp.async.bulk``) per
row of the block's columns (``SPAN * 4`` bytes, less in the last block), completing on the
group's mbarrier (one per ring slot, parity = the slot's use count).  The ``ROWS`` copies of a
group are issued by ``ISSUE_WARPS`` warps, ``ROWS / ISSUE_WARPS`` lanes each (row ``u`` by lane
``u // ISSUE_WARPS`` of warp ``u % ISSUE_WARPS``): the SASS issues a bulk copy from uniform
registers, so a warp's copies go one lane at a time, and warps issue side by side.  Before a
slot is refilled every thread has read it (a proxy fence per thread, then a block barrier),
thread 0 announces the group's bytes and the issuing lanes copy.

Other rows take the 4-byte form: ``cp.async.ca`` copies, one per column (guarded), waited for
with ``cp.async.wait_group``.  A thread reads only the slots it filled itself, so its wait alone
makes them visible.  ``P``, the columns and the shapes are run-time values (one cubin); row
offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl import cp_async

WARP = 32
THREADS = 128  # four warps
SPAN = 256  # columns per block (a row's piece: SPAN * 4 bytes, one bulk copy)
VEC = SPAN // THREADS  # columns per thread
ROWS = 16  # rows per group
STAGES = 4  # groups in the ring: 64 rows in flight (level with 80, faster than 48 or 160; wait counts <= MAX_GROUPS)
ISSUE_WARPS = 4  # warps issuing a group's bulk copies (ROWS / ISSUE_WARPS lanes each)
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                # shared memory is written by cp.async / cp.async.bulk (unseen by TileLang);
                # each thread reads its slots after its own wait
                "tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True}

# 1-D bulk copies and mbarriers for the aligned path (the unaligned path's 4-byte copies:
# cp_async.copy4).
DEVICE_SOURCE = r"""
__device__ __forceinline__ unsigned tka_smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// one thread: every barrier of the ring expects one arrival; the fences make the
// initialisation visible to the TMA engine (the async proxy)
__device__ __forceinline__ void tka_gwr_init_barriers(void* bars, int n) {
  for (int i = 0; i < n; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(tka_smem_addr(static_cast<unsigned long long*>(bars) + i)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// the arrival of a barrier's phase, announcing the bytes its copies bring
__device__ __forceinline__ void tka_gwr_expect(void* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(tka_smem_addr(bar)), "r"(bytes) : "memory");
}
// one 1-D bulk copy (16-byte aligned, a multiple of 16 bytes) completing on ``bar``
__device__ __forceinline__ void tka_gwr_bulk(void* smem, const void* gmem, int bytes, void* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(tka_smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(tka_smem_addr(bar)) : "memory");
}
// wait for the phase of parity ``parity`` (acquire: the copies' bytes are visible after it)
__device__ __forceinline__ void tka_gwr_wait(void* bar, int parity) {
  unsigned done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(tka_smem_addr(bar)), "r"(parity) : "memory");
  } while (!done);
}
// this thread's shared-memory reads of a slot, before the bulk copies that refill it (a
// block barrier follows, so every thread's reads precede the issuing threads' copies)
__device__ __forceinline__ void tka_gwr_proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
"""


@T.macro
def _issue(ring, grad_w_partial, group, num_rows, num_cols, col0, tid):
    """4-byte form: group ``group``'s rows of the thread's columns into its ring slot, then one
    commit (an empty group past the last row)."""
    for u in T.unroll(ROWS):
        if group * ROWS + u < num_rows:
            for i in T.unroll(VEC):
                if col0 + i < num_cols:
                    T.evaluate(cp_async.copy4(ring[group % STAGES, u, tid * VEC + i],
                                              T.address_of(grad_w_partial[group * ROWS + u, col0 + i])))
    cp_async.commit()


@T.macro
def _expect(bars, group, num_rows, row_bytes, tid):
    """Bulk form, thread 0: the arrival of group ``group``'s barrier phase with its bytes."""
    if tid == 0:
        T.evaluate(T.call_extern("void", "tka_gwr_expect", T.address_of(bars[group % STAGES]),
                                 T.Cast("int32", T.min(num_rows - group * ROWS, ROWS)) * row_bytes))


@T.macro
def _bulk(ring, bars, grad_w_partial, group, num_rows, block_col, row_bytes, issue_row):
    """Bulk form: the issuing lane of row ``issue_row`` of a group copies that row of group
    ``group`` (the block's columns); other threads have ``issue_row`` = ROWS."""
    if issue_row < ROWS:
        if group * ROWS + issue_row < num_rows:
            T.evaluate(T.call_extern("void", "tka_gwr_bulk", T.address_of(ring[group % STAGES, issue_row, 0]),
                                     T.address_of(grad_w_partial[group * ROWS + issue_row, block_col]), row_bytes,
                                     T.address_of(bars[group % STAGES])))


@T.macro
def _add_group(ring, vals, total, group, num_rows, tid):
    """Add the thread's columns of group ``group``'s rows, in order."""
    for u in T.unroll(ROWS):
        if group * ROWS + u < num_rows:
            for i in T.vectorized(VEC):
                vals[i] = ring[group % STAGES, u, tid * VEC + i]
            for i in T.unroll(VEC):
                total[i] = total[i] + vals[i]


def grad_w_reduce_kernel():
    assert STAGES - 1 <= cp_async.MAX_GROUPS and SPAN % THREADS == 0 and VEC <= 4
    assert ROWS % ISSUE_WARPS == 0 and ROWS // ISSUE_WARPS <= WARP and ISSUE_WARPS * WARP <= THREADS
    num_rows = T.dynamic("num_rows", "int64")  # P
    num_cols = T.dynamic("num_cols", "int64")  # hc_mult * hidden

    @T.prim_func
    def grad_w_reduce(
        grad_w_partial: T.Tensor[(num_rows, num_cols), T.float32],
        weight_hidden: T.Tensor[(num_cols,), T.bfloat16],
        weight_embed: T.Tensor[(num_cols,), T.bfloat16],
        grad_weight_hidden: T.Tensor[(num_cols,), T.float32],
        grad_weight_embed: T.Tensor[(num_cols,), T.float32],
        vec: T.int32,  # 1: num_cols % 4 == 0 and grad_w_partial 16-byte aligned
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_cols, SPAN)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(cp_async.DEVICE_SOURCE + DEVICE_SOURCE)
            tid = T.get_thread_binding()
            block_col = T.Cast("int64", bid) * SPAN
            col0 = block_col + T.Cast("int64", tid) * VEC
            # the row of each group this thread copies (bulk form), ROWS if none
            lane = tid % WARP
            warp = tid // WARP
            issue_row = T.if_then_else(T.And(warp < ISSUE_WARPS, lane < ROWS // ISSUE_WARPS),
                                       lane * ISSUE_WARPS + warp, ROWS)
            ring = T.alloc_shared((STAGES, ROWS, SPAN), T.float32)
            bars = T.alloc_shared((STAGES,), T.uint64)
            vals = T.alloc_local((VEC,), T.float32)
            total = T.alloc_local((VEC,), T.float32)
            side = T.alloc_local((4, VEC), T.float32)  # weight_hidden, weight_embed, and their gradients
            groups = T.ceildiv(num_rows, ROWS)
            # bytes of one row's piece in this block (a multiple of 16 when vec == 1)
            row_bytes = T.Cast("int32", T.min(num_cols - block_col, SPAN)) * 4

            # ---- the first STAGES groups in flight
            if vec == 1:
                if tid == 0:
                    T.evaluate(T.call_extern("void", "tka_gwr_init_barriers", T.address_of(bars[0]), STAGES))
                    for b in T.serial(STAGES):
                        if b < groups:
                            _expect(bars, b, num_rows, row_bytes, tid)
                T.sync_threads()  # barriers initialised and armed before any copy
                for b in T.serial(STAGES):
                    _bulk(ring, bars, grad_w_partial, b, num_rows, block_col, row_bytes, issue_row)
            else:
                for b in T.serial(STAGES):
                    _issue(ring, grad_w_partial, b, num_rows, num_cols, col0, tid)

            # ---- the weights and the gradients (their latency overlaps the rows')
            for i in T.unroll(VEC):
                total[i] = T.float32(0)
                for s in T.unroll(4):
                    side[s, i] = T.float32(0)
                if col0 + i < num_cols:
                    side[0, i] = T.cast(weight_hidden[col0 + i], T.float32)
                    side[1, i] = T.cast(weight_embed[col0 + i], T.float32)
                    side[2, i] = grad_weight_hidden[col0 + i]
                    side[3, i] = grad_weight_embed[col0 + i]

            # ---- one group at a time: wait, add its rows in order, refill its slot
            if vec == 1:
                for b in T.serial(groups):
                    T.evaluate(T.call_extern("void", "tka_gwr_wait", T.address_of(bars[b % STAGES]),
                                             T.Cast("int32", (b // STAGES) % 2)))
                    _add_group(ring, vals, total, b, num_rows, tid)
                    if b + STAGES < groups:  # uniform across the block
                        T.evaluate(T.call_extern("void", "tka_gwr_proxy_fence"))
                        _expect(bars, b + STAGES, num_rows, row_bytes, tid)
                        T.sync_threads()  # every thread has read the slot (and it is armed)
                        _bulk(ring, bars, grad_w_partial, b + STAGES, num_rows, block_col, row_bytes, issue_row)
            else:
                for b in T.serial(groups):
                    cp_async.wait(STAGES - 1)
                    _add_group(ring, vals, total, b, num_rows, tid)
                    _issue(ring, grad_w_partial, b + STAGES, num_rows, num_cols, col0, tid)

            for i in T.unroll(VEC):
                if col0 + i < num_cols:
                    grad_weight_hidden[col0 + i] = T.ieee_add(side[2, i], T.ieee_mul(total[i], side[1, i]))
                    grad_weight_embed[col0 + i] = T.ieee_add(side[3, i], T.ieee_mul(total[i], side[0, i]))

    return grad_w_reduce
