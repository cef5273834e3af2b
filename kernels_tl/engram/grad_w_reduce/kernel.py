"""engram.grad_w_reduce: finish the Engram weight gradients, accumulating in place.

``grad_w_partial`` fp32 [P, hc_mult, hidden], ``weight_hidden`` / ``weight_embed`` bf16
[hc_mult, hidden], ``grad_weight_hidden`` / ``grad_weight_embed`` fp32 [hc_mult, hidden]
(read and written; all contiguous):

    G = ((0 + partial[0]) + partial[1]) + ... + partial[P - 1]     (rows in order, fp32)
    grad_weight_hidden += G * weight_embed;  grad_weight_embed += G * weight_hidden

each product and sum rounded on its own (no fused multiply-add), as the reference does.

Design
------
One thread per column (``hc_mult * hidden`` columns, a run-time count; so are ``P`` and the
shapes: one cubin).  The sum over ``P`` is a chain per column, so the parallelism is in the
columns and the memory-level parallelism in each thread: it issues ``BATCH`` row loads
before it adds them (a warp's loads of a row are one 128-byte line), so ``P = 132`` takes
three round trips to memory.  The weights and the two gradients are loaded before the
first batch so that they arrive with it.  Row offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 128
BATCH = 64  # row loads in flight per thread
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def grad_w_reduce_kernel():
    num_rows = T.dynamic("num_rows", "int64")  # P
    num_cols = T.dynamic("num_cols", "int64")  # hc_mult * hidden

    @T.prim_func
    def grad_w_reduce(
        grad_w_partial: T.Tensor[(num_rows, num_cols), T.float32],
        weight_hidden: T.Tensor[(num_cols,), T.bfloat16],
        weight_embed: T.Tensor[(num_cols,), T.bfloat16],
        grad_weight_hidden: T.Tensor[(num_cols,), T.float32],
        grad_weight_embed: T.Tensor[(num_cols,), T.float32],
    ):
        with T.Kernel(T.Cast("int32", T.ceildiv(num_cols, THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            col = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            rows = T.alloc_local((BATCH,), T.float32)
            total = T.alloc_var(T.float32)
            if col < num_cols:
                wh = T.cast(weight_hidden[col], T.float32)
                we = T.cast(weight_embed[col], T.float32)
                gwh = grad_weight_hidden[col]
                gwe = grad_weight_embed[col]
                total = T.float32(0)
                for b in T.serial(T.ceildiv(num_rows, BATCH)):
                    for u in T.unroll(BATCH):
                        if b * BATCH + u < num_rows:
                            rows[u] = grad_w_partial[b * BATCH + u, col]
                    for u in T.unroll(BATCH):
                        if b * BATCH + u < num_rows:
                            total = total + rows[u]
                grad_weight_hidden[col] = T.ieee_add(gwh, T.ieee_mul(total, we))
                grad_weight_embed[col] = T.ieee_add(gwe, T.ieee_mul(total, wh))

    return grad_w_reduce
