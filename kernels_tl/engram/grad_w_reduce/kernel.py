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
memory-level parallelism must come from rows requested ahead of the chain.  Blocks of one
warp; lane ``l`` of block ``b`` owns the four columns ``4 * (32 * b + l) .. + 3`` (a warp: 128
columns, 512 contiguous bytes of each row).  The rows stream through a ring of ``STAGES``
groups of ``ROWS`` rows in shared memory (160 rows, 80 KB), filled by ``cp.async`` (16 bytes a
lane and row, no registers held), so that every row up to ``P = 160`` (132 on an H200, 148 on
a B200) is requested at once: 68 KB a warp at ``P = 132``; two warps fit on an SM, and the 224
warps of hidden 7168 (hc_mult 4) are one wave.  The lane waits for one group at a time (the
ring keeps ``STAGES - 1`` later groups in flight), adds its rows in order and refills the
group's slots with the group ``STAGES`` further on (only when ``P > 160``).  A lane reads only
the slots it filled itself: its wait alone makes them visible, and no barrier is needed.

Columns are copied 16 bytes at a time when ``hc_mult * hidden`` is a multiple of 4 and the
partial sums start 16-byte aligned (the host's ``vec`` flag), else 4 bytes at a time with a
guard per column.  ``P``, the columns and the shapes are run-time values (one cubin); row
offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.engram import cp_async

WARP = 32
VEC = 4  # columns per lane (16 bytes of fp32)
SPAN = WARP * VEC  # columns per block
ROWS = 10  # rows per group
STAGES = 16  # groups in the ring (wait counts up to STAGES - 1 <= cp_async.MAX_GROUPS)
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                # shared memory is written by cp.async (unseen by TileLang); each lane reads
                # only its own slots, after its own wait
                "tl.disable_thread_storage_sync": True, "tl.disable_buffer_init_check": True}

# 4-byte copies for the unaligned path (cp.async.ca: the 4-byte form)
SCALAR_SOURCE = r"""
__device__ __forceinline__ void tka_cp_async_4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(s), "l"(gmem) : "memory");
}
"""


def _copy4(dst, src):
    return T.call_extern("void", "tka_cp_async_4", T.address_of(dst), T.address_of(src))


@T.macro
def _issue(ring, grad_w_partial, group, num_rows, num_cols, col0, lane, vec):
    """Group ``group``'s rows of the lane's columns into its ring slot, then one commit (an
    empty group past the last row)."""
    if vec == 1:
        if col0 < num_cols:
            for u in T.unroll(ROWS):
                if group * ROWS + u < num_rows:
                    T.evaluate(cp_async.copy16(ring[group % STAGES, u, lane, 0], grad_w_partial[group * ROWS + u, col0]))
    else:
        for u in T.unroll(ROWS):
            if group * ROWS + u < num_rows:
                for i in T.unroll(VEC):
                    if col0 + i < num_cols:
                        T.evaluate(_copy4(ring[group % STAGES, u, lane, i], grad_w_partial[group * ROWS + u, col0 + i]))
    cp_async.commit()


def grad_w_reduce_kernel():
    assert STAGES - 1 <= cp_async.MAX_GROUPS
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
        with T.Kernel(T.Cast("int32", T.ceildiv(num_cols, SPAN)), threads=WARP) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(cp_async.DEVICE_SOURCE + SCALAR_SOURCE)
            lane = T.get_thread_binding()
            col0 = (T.Cast("int64", bid) * WARP + T.Cast("int64", lane)) * VEC
            ring = T.alloc_shared((STAGES, ROWS, WARP, VEC), T.float32)
            vals = T.alloc_local((VEC,), T.float32)
            total = T.alloc_local((VEC,), T.float32)
            side = T.alloc_local((4, VEC), T.float32)  # weight_hidden, weight_embed, and their gradients
            groups = T.ceildiv(num_rows, ROWS)

            # ---- the first STAGES groups in flight
            for b in T.serial(STAGES):
                _issue(ring, grad_w_partial, b, num_rows, num_cols, col0, lane, vec)

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

            # ---- one group at a time: wait, add its rows in order, refill its slots
            for b in T.serial(groups):
                cp_async.wait(STAGES - 1)
                for u in T.unroll(ROWS):
                    if b * ROWS + u < num_rows:
                        for i in T.vectorized(VEC):
                            vals[i] = ring[b % STAGES, u, lane, i]
                        for i in T.unroll(VEC):
                            total[i] = total[i] + vals[i]
                _issue(ring, grad_w_partial, b + STAGES, num_rows, num_cols, col0, lane, vec)

            for i in T.unroll(VEC):
                if col0 + i < num_cols:
                    grad_weight_hidden[col0 + i] = T.ieee_add(side[2, i], T.ieee_mul(total[i], side[1, i]))
                    grad_weight_embed[col0 + i] = T.ieee_add(side[3, i], T.ieee_mul(total[i], side[0, i]))

    return grad_w_reduce
