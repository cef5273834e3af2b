"""moe.inplace_unique_group_indices: repeated group indices of a row become -1, in place.

``group_indices`` int64 [num_tokens, num_topk] (contiguous): an entry ``>= 0`` equal to an
entry to its left becomes -1 (the leftmost occurrence stays); negative entries stay.

Design
------
One thread per row (rows are independent; an entry depends on every entry to its left),
``THREADS`` rows per block.  The thread loads the row's first ``CHUNK`` (8) entries at
once into registers, as 16-byte pairs when the row starts 16-byte aligned (``wide``: an
even top-k and an aligned pointer), and compares each with the ones before it (an
unrolled triangle of 64-bit compares: equality, so any int64 value is handled, whatever
``num_groups`` says).  Entries past ``CHUNK`` (top-k > 8) are compared with the
registers and then with the row's entries ``CHUNK..j-1`` in memory, which this thread
may already have set to -1: harmless, since the leftmost occurrence of a value is never
written and -1 matches no entry that is compared.  Only repeated entries are stored.

The token count and top-k are run-time values: one cubin.  The row's element offset is
64-bit (num_tokens * num_topk may pass 2^31).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# Rows per block: 8192 tokens are 128 blocks (about one per SM), decode 2.
THREADS = 64
# Entries a thread keeps in registers, loaded together (a top-k up to 8 is one round trip).
CHUNK = 8
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every access is guarded by the kernel itself (row < num_tokens, j < num_topk)
    "tl.disable_safe_memory_legalize": True,
}


def inplace_unique_group_indices_kernel():
    num_elements = T.dynamic("num_elements", "int64")  # num_tokens * num_topk (only the buffer's extent)

    @T.prim_func
    def inplace_unique_group_indices(
        group_indices: T.Tensor[(num_elements,), T.int64],
        num_tokens: T.int32,
        num_topk: T.int32,
        wide: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(num_topk > 0)
            row = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            start = row * T.Cast("int64", num_topk)
            vals = T.alloc_local((CHUNK,), T.int64)
            found = T.alloc_var(T.int32)
            x = T.alloc_var(T.int64)
            if row < num_tokens:
                if wide != 0:
                    # num_topk is even: the row is whole pairs, starting at pair start // 2
                    for c in T.unroll(CHUNK // 2):
                        if c * 2 < num_topk:
                            for v in T.vectorized(2):
                                vals[c * 2 + v] = group_indices[(T.truncdiv(start, 2) + c) * 2 + v]
                else:
                    for j in T.unroll(CHUNK):
                        if j < num_topk:
                            vals[j] = group_indices[start + j]
                for j in T.unroll(1, CHUNK):
                    if j < num_topk and vals[j] >= 0:
                        found = 0
                        for i in T.unroll(j):
                            found = found | T.Cast(T.int32, vals[i] == vals[j])
                        if found != 0:
                            group_indices[start + j] = T.int64(-1)
                # top-k past CHUNK: registers, then the row in memory
                for j in T.serial(CHUNK, num_topk):
                    x = group_indices[start + j]
                    if x >= 0:
                        found = 0
                        for i in T.unroll(CHUNK):
                            found = found | T.Cast(T.int32, vals[i] == x)
                        for i in T.serial(CHUNK, j):
                            found = found | T.Cast(T.int32, group_indices[start + i] == x)
                        if found != 0:
                            group_indices[start + j] = T.int64(-1)

    return inplace_unique_group_indices
