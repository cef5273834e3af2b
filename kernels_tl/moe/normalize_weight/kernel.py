"""moe.normalize_weight: each token's top-k weights divided by their sum.

``topk_weights`` float32 [num_tokens, num_topk] (contiguous) -> ``denominator`` float32
[num_tokens], ``1e-20 + w_0 + ... + w_{k-1}`` accumulated left to right in float32, and
``normalized`` float32 [num_tokens, num_topk], ``w_k / denominator`` (IEEE division).

Design
------
One thread per token, ``THREADS`` tokens per block.  A thread loads its row's weights
``CHUNK`` at a time, all in flight together (a warp reads 32 consecutive rows: one
contiguous span), sums them in order, writes the denominator, then reads the row again
(from L1) and writes the quotients.  ``num_topk`` is a run-time value: one cubin serves every top-k.
The op moves ``12 * num_tokens * num_topk`` bytes at most a few MB, so it is bound by
latency: one wave of small blocks, no shared memory, no barrier.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# 128 tokens per block: 171 blocks for 21.9k tokens, more than one per SM.
THREADS = 128
# Weights a thread loads before it adds them: a top-k up to 8 costs one memory round trip
# (a plain loop over a run-time top-k waits for each load in turn).
CHUNK = 8
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def normalize_weight_kernel():
    num_tokens = T.dynamic("num_tokens")
    num_topk = T.dynamic("num_topk")

    @T.macro
    def load_chunk(topk_weights, weights, token, c):
        """Weights c * CHUNK ... of the token's row, all loads in flight together."""
        for j in T.unroll(CHUNK):
            if c * CHUNK + j < num_topk:
                weights[j] = topk_weights[token, c * CHUNK + j]

    @T.prim_func
    def normalize_weight(
        topk_weights: T.Tensor[(num_tokens, num_topk), T.float32],
        denominator: T.Tensor[(num_tokens,), T.float32],
        normalized: T.Tensor[(num_tokens, num_topk), T.float32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            token = bid * THREADS + T.get_thread_binding()
            total = T.alloc_var(T.float32)
            weights = T.alloc_local((CHUNK,), T.float32)
            if token < num_tokens:
                total = T.float32(1e-20)
                for c in T.serial(T.ceildiv(num_topk, CHUNK)):
                    load_chunk(topk_weights, weights, token, c)
                    for j in T.unroll(CHUNK):  # the in-order sum
                        if c * CHUNK + j < num_topk:
                            total = total + weights[j]
                denominator[token] = total
                for c in T.serial(T.ceildiv(num_topk, CHUNK)):
                    load_chunk(topk_weights, weights, token, c)  # the row again: L1 hits
                    for j in T.unroll(CHUNK):
                        if c * CHUNK + j < num_topk:
                            normalized[token, c * CHUNK + j] = weights[j] / total

    return normalize_weight
