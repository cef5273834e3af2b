"""moe.normalize_weight: each token's top-k weights divided by their sum.

``topk_weights`` float32 [num_tokens, num_topk] (contiguous) -> ``denominator`` float32
[num_tokens], ``1e-20 + w_0 + ... + w_{k-1}`` accumulated left to right in float32, and
``normalized`` float32 [num_tokens, num_topk], ``w_k / denominator`` (IEEE division).

Design
------
One thread per (token, k) element, ``THREADS`` elements per block.  Each thread loads its
row's weights ``CHUNK`` at a time, all in flight together, sums them in order (every
thread of a row gets the same sum), and writes its own quotient; the row's first thread
writes the denominator.  Loads and stores of a warp are one contiguous span.  ``num_topk`` is a run-time value: one cubin serves every top-k.
The op moves ``12 * num_tokens * num_topk`` bytes at most a few MB, so it is bound by
latency: one wave of small blocks, no shared memory, no barrier.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# 256 elements per block: a thread per (token, k) element, so loads and stores are coalesced
# and a 21876 x 8 call has 684 blocks (many warps per SM to hide the latency).
THREADS = 256
# Weights a thread loads before it adds them: a top-k up to 8 costs one memory round trip
# (a plain loop over a run-time top-k waits for each load in turn).
CHUNK = 8
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def normalize_weight_kernel():
    num_tokens = T.dynamic("num_tokens")
    num_topk = T.dynamic("num_topk")

    @T.prim_func
    def normalize_weight(
        topk_weights: T.Tensor[(num_tokens, num_topk), T.float32],
        denominator: T.Tensor[(num_tokens,), T.float32],
        normalized: T.Tensor[(num_tokens, num_topk), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens * num_topk, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            # 64-bit: num_tokens * num_topk may pass 2^31
            T.assume(num_topk > 0)
            element = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            token = T.truncdiv(element, T.Cast("int64", num_topk))
            k = element - token * T.Cast("int64", num_topk)
            total = T.alloc_var(T.float32)
            weights = T.alloc_local((CHUNK,), T.float32)
            if token < num_tokens:
                # every thread of a row sums the whole row, in order (the row's threads read
                # the same words: one transaction each)
                total = T.float32(1e-20)
                for c in T.serial(T.ceildiv(num_topk, CHUNK)):
                    for j in T.unroll(CHUNK):  # CHUNK loads in flight together
                        if c * CHUNK + j < num_topk:
                            weights[j] = topk_weights[token, c * CHUNK + j]
                    for j in T.unroll(CHUNK):  # the in-order sum
                        if c * CHUNK + j < num_topk:
                            total = total + weights[j]
                normalized[token, k] = topk_weights[token, k] / total
                if k == 0:
                    denominator[token] = total

    return normalize_weight
