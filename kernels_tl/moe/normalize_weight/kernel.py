"""moe.normalize_weight: each token's top-k weights divided by their sum.

``topk_weights`` float32 [num_tokens, num_topk] (contiguous) -> ``denominator`` float32
[num_tokens], ``1e-20 + w_0 + ... + w_{k-1}`` accumulated left to right in float32, and
``normalized`` float32 [num_tokens, num_topk], ``w_k / denominator`` (IEEE division).

Design
------
One thread per (token, k) element of the flat ``[num_tokens * num_topk]`` view, ``THREADS``
elements per block; each thread writes its own quotient, the row's first thread writes the
denominator.  Loads and stores of a warp are one contiguous span.  ``num_topk`` is a
run-time value: one cubin serves every top-k, with a branch uniform over the grid:

* top-k ``LANE_TOPK`` (8): a row is one aligned 8-lane segment of a warp.  Each lane loads
  only its own weight (one coalesced 128-byte load per warp) and adds the row's weights
  from the segment's lanes with shuffles, in order; the row is the element index shifted
  (no division).
* any other top-k: each thread loads its row's weights ``CHUNK`` at a time, all in flight
  together, and sums them in order (every thread of a row gets the same sum); the row comes
  from a 32-bit division while the element count fits in 31 bits, else a 64-bit one.

The op moves ``12 * num_tokens * num_topk`` bytes, at most a few MB, so it is bound by
latency and per-SM instruction issue: one wave of small blocks, no shared memory, no barrier.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# 256 elements per block: a thread per (token, k) element, so loads and stores are coalesced
# and a 21876 x 8 call has 684 blocks (many warps per SM to hide the latency).
THREADS = 256
# Weights a thread loads before it adds them: a top-k up to 8 costs one memory round trip
# (a plain loop over a run-time top-k waits for each load in turn).
CHUNK = 8
# The top-k whose rows a warp sums with shuffles (a divisor of 32; upstream's and the common
# DeepSeek / Kimi / Qwen3 top-k).
LANE_TOPK = 8
# Every access is guarded by the kernel's own bounds (element < num_elements), so TileLang's
# extra guards are left out.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                "tl.disable_safe_memory_legalize": True}


def normalize_weight_kernel():
    num_elements = T.dynamic("num_elements", "int64")  # num_tokens * num_topk
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def normalize_weight(
        topk_weights: T.Tensor[(num_elements,), T.float32],
        denominator: T.Tensor[(num_tokens,), T.float32],
        normalized: T.Tensor[(num_elements,), T.float32],
        num_topk: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_elements, T.int64(THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(num_topk > 0)
            tid = T.get_thread_binding()
            # 64-bit: num_tokens * num_topk may pass 2^31
            element = T.Cast("int64", bid) * T.int64(THREADS) + T.Cast("int64", tid)
            total = T.alloc_var(T.float32)
            own = T.alloc_var(T.float32)
            token = T.alloc_var(T.int64)
            weights = T.alloc_local((CHUNK,), T.float32)
            if num_topk == LANE_TOPK:
                # A row's LANE_TOPK weights lie in one aligned segment of LANE_TOPK lanes of a
                # warp (a block starts at a multiple of THREADS, and 32 is a multiple of
                # LANE_TOPK): each lane loads its own weight (one coalesced load per warp) and
                # adds its row's weights from the segment's lanes in order.  Every lane of the
                # warp takes part in the shuffles; only those inside the input load and store.
                own = T.float32(0)
                if element < num_elements:
                    own = topk_weights[element]
                total = T.float32(1e-20)
                for j in T.unroll(LANE_TOPK):
                    total = total + T.shfl_sync(own, j, LANE_TOPK)
                if element < num_elements:
                    normalized[element] = own / total
                    if tid % LANE_TOPK == 0:
                        denominator[element // LANE_TOPK] = total
            else:
                # any top-k: the row by a 32-bit division while the element index fits
                if num_elements <= T.int64(2**31 - 1):
                    token = T.Cast("int64", T.truncdiv(T.Cast("int32", element), num_topk))
                else:
                    token = T.truncdiv(element, T.Cast("int64", num_topk))
                if element < num_elements:
                    # every thread of a row sums the whole row, in order (the row's threads
                    # read the same words: one transaction each)
                    total = T.float32(1e-20)
                    for c in T.serial(T.ceildiv(num_topk, CHUNK)):
                        for j in T.unroll(CHUNK):  # CHUNK loads in flight together
                            if c * CHUNK + j < num_topk:
                                weights[j] = topk_weights[token * T.Cast("int64", num_topk) + T.Cast("int64", c * CHUNK + j)]
                        for j in T.unroll(CHUNK):  # the in-order sum
                            if c * CHUNK + j < num_topk:
                                total = total + weights[j]
                    normalized[element] = topk_weights[element] / total
                    if element == token * T.Cast("int64", num_topk):
                        denominator[token] = total

    return normalize_weight
