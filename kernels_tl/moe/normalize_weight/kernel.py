"""moe.normalize_weight: each token's top-k weights divided by their sum.

``topk_weights`` float32 [num_tokens, num_topk] (contiguous) -> ``denominator`` float32
[num_tokens], ``1e-20 + w_0 + ... + w_{k-1}`` accumulated left to right in float32, and
``normalized`` float32 [num_tokens, num_topk], ``w_k / denominator`` (IEEE division).

Design
------
One thread per token, ``THREADS`` tokens per block.  A thread reads its row's ``num_topk``
weights (a warp reads 32 consecutive rows: one contiguous span, served from L1 after the
first pass), sums them in order, writes the denominator, then reads the row again and
writes the quotients.  ``num_topk`` is a run-time value: one cubin serves every top-k.
The op moves ``12 * num_tokens * num_topk`` bytes at most a few MB, so it is bound by
latency: one wave of small blocks, no shared memory, no barrier.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

# 128 tokens per block: 171 blocks for 21.9k tokens, more than one per SM.
THREADS = 128
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
        with T.Kernel(T.ceildiv(num_tokens, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            token = bid * THREADS + T.get_thread_binding()
            total = T.alloc_var(T.float32)
            if token < num_tokens:
                total = T.float32(1e-20)
                for k in T.serial(num_topk):
                    total = total + topk_weights[token, k]
                denominator[token] = total
                for k in T.serial(num_topk):
                    normalized[token, k] = topk_weights[token, k] / total

    return normalize_weight
