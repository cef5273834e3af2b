"""moe.mask_indices_by_tp: keep the experts of one TP rank, renumbered locally.

``indices`` int64 or int32 [num_tokens, num_topk] (contiguous) -> ``masked`` of the same
shape and dtype.  With ``per_gpu = n // num_ep_ranks``, an entry ``v >= 0`` has
``q = v // per_gpu`` and ``r = v % per_gpu``; it is kept when ``q % num_tp_ranks ==
tp_rank`` and becomes ``(q // num_tp_ranks) * per_gpu + r``, every other entry (negative
ones included) becomes -1.  That closed form equals the reference's ``v - tp_rank *
per_gpu`` then ``- (local // per_dp) * (per_dp - per_gpu)`` for every kept entry (notes.md).

Design
------
The tensor is one flat run of ``num_elements`` entries (64-bit count and index).  A
thread takes ``VEC`` consecutive entries, 16 bytes (2 int64 or 4 int32): one vector load
and one vector store when both pointers are 16-byte aligned and the chunk is whole
(``wide``), else entry by entry with a bound check (misaligned views, the tail).
128 threads per block: 8192 x 8 int64 is 256 blocks.

The two divisions (by ``per_gpu`` and by ``num_tp_ranks``) are multiplications by a
host-computed ``ceil(2^s / d)`` and a shift ``s`` (exact for dividends below 2^31, see
notes.md): an integer division by a run-time divisor is about 20 instructions with
quarter-rate conversions, which would make the int32 case issue-bound.  int64 entries of
2^31 or more take a branch with 64-bit divisions.  Static configurations: ``dtype`` only.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 128
ELEM_BYTES = {"int64": 8, "int32": 4}
DTYPES = tuple(ELEM_BYTES)
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def host_constants(dtype: str) -> dict:
    return {"vec": 16 // ELEM_BYTES[dtype]}


def mask_indices_by_tp_kernel(dtype: str):
    vec = 16 // ELEM_BYTES[dtype]
    wide_values = dtype == "int64"  # entries may pass 2^31
    num_elements = T.dynamic("num_elements", "int64")

    def fast_divide(n32, mul, shift):
        """n32 // d for a uint32 n32 < 2^31, with (mul, shift) the host's magic pair of d."""
        return T.Cast("uint32", (T.Cast("uint64", n32) * T.Cast("uint64", mul)) >> T.Cast("uint64", shift))

    @T.macro
    def remap(vals, j, per_gpu, per_gpu_mul, per_gpu_shift, num_tp_ranks, tp_mul, tp_shift, tp_rank):
        """vals[j] -> its masked value, in place."""
        q = T.alloc_var(T.uint32)
        dp = T.alloc_var(T.uint32)
        q64 = T.alloc_var(T.int64)
        dp64 = T.alloc_var(T.int64)
        r64 = T.alloc_var(T.int64)
        if vals[j] < 0:
            vals[j] = T.Cast(dtype, -1)
        elif (not wide_values) or vals[j] < T.Cast(dtype, 2**31):  # int32: always (a Python-level True)
            v32 = T.Cast("uint32", vals[j])
            q = fast_divide(v32, per_gpu_mul, per_gpu_shift)
            dp = fast_divide(q, tp_mul, tp_shift)
            if q - dp * T.Cast("uint32", num_tp_ranks) == T.Cast("uint32", tp_rank):
                vals[j] = T.Cast(dtype, dp * T.Cast("uint32", per_gpu) + (v32 - q * T.Cast("uint32", per_gpu)))
            else:
                vals[j] = T.Cast(dtype, -1)
        else:
            # int64 entries >= 2^31: plain 64-bit divisions (nonnegative operands)
            q64 = T.truncdiv(T.Cast("int64", vals[j]), T.Cast("int64", per_gpu))
            dp64 = T.truncdiv(q64, T.Cast("int64", num_tp_ranks))
            r64 = T.Cast("int64", vals[j]) - q64 * T.Cast("int64", per_gpu)  # a variable: no reassociation past 2^63
            if q64 - dp64 * T.Cast("int64", num_tp_ranks) == T.Cast("int64", tp_rank):
                vals[j] = T.Cast(dtype, dp64 * T.Cast("int64", per_gpu) + r64)
            else:
                vals[j] = T.Cast(dtype, -1)

    @T.prim_func
    def mask_indices_by_tp(
        indices: T.Tensor[(num_elements,), dtype],
        masked: T.Tensor[(num_elements,), dtype],
        per_gpu: T.int32,
        per_gpu_mul: T.int64,
        per_gpu_shift: T.int32,
        num_tp_ranks: T.int32,
        tp_mul: T.int64,
        tp_shift: T.int32,
        tp_rank: T.int32,
        wide: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_elements, THREADS * vec), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            base = (T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())) * vec
            vals = T.alloc_local((vec,), dtype)
            if wide != 0 and base + vec <= num_elements:
                for j in T.vectorized(vec):
                    vals[j] = indices[base + j]
                for j in T.unroll(vec):
                    remap(vals, j, per_gpu, per_gpu_mul, per_gpu_shift, num_tp_ranks, tp_mul, tp_shift, tp_rank)
                for j in T.vectorized(vec):
                    masked[base + j] = vals[j]
            else:
                for j in T.unroll(vec):
                    if base + j < num_elements:
                        vals[j] = indices[base + j]
                        remap(vals, j, per_gpu, per_gpu_mul, per_gpu_shift, num_tp_ranks, tp_mul, tp_shift, tp_rank)
                        masked[base + j] = vals[j]

    return mask_indices_by_tp
