"""engram.engram_hash: embedding-table indices of each token's n-grams.

``ngram_token_ids`` int32 [T, n], ``multipliers`` int64 [L, n], ``vocab_sizes`` int32
[L, n - 1, E], ``offsets`` int32 [L, (n - 1) * E] (all contiguous) -> int32
[L, T, (n - 1) * E]:

    h_i = XOR_{j <= i} int64(ids[t, j]) * multipliers[l, j]          (int64, wrapping)
    out[l, t, (i - 1) * E + e] = int32(floormod(h_i, vocab_sizes[l, i - 1, e]) + offsets[l, (i - 1) * E + e])

Design
------
One thread per output element (``l``, ``t``, column), in the output's order: the stores of a
warp are one contiguous span, and the int64 modulo (a long instruction sequence, the cost of
this op) is spread over every thread of the GPU rather than looped per token.  Each thread
recomputes its own XOR chain from the token's ids (at most ``n`` multiplies; the ids and the
layer's multipliers are L1/L2 hits shared by neighbouring threads).  ``n``, ``L`` and ``E`` are
run-time values: one cubin.  Element indices are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 256
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def engram_hash_kernel():
    num_tokens = T.dynamic("num_tokens", "int64")
    max_ngram = T.dynamic("max_ngram", "int64")  # n
    num_layers = T.dynamic("num_layers", "int64")  # L
    num_cols = T.dynamic("num_cols", "int64")  # (n - 1) * E

    @T.prim_func
    def engram_hash(
        ngram_token_ids: T.Tensor[(num_tokens, max_ngram), T.int32],
        multipliers: T.Tensor[(num_layers, max_ngram), T.int64],
        vocab_sizes: T.Tensor[(num_layers, num_cols), T.int32],  # [L, n - 1, E] flattened
        offsets: T.Tensor[(num_layers, num_cols), T.int32],
        output: T.Tensor[(num_layers, num_tokens, num_cols), T.int32],
        num_tables: T.int64,  # E
    ):
        num_outputs = num_layers * num_tokens * num_cols
        with T.Kernel(T.Cast("int32", T.ceildiv(num_outputs, THREADS)), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(num_cols > 0)
            T.assume(num_tables > 0)
            T.assume(num_tokens > 0)
            element = T.Cast("int64", bid) * THREADS + T.Cast("int64", T.get_thread_binding())
            h = T.alloc_var(T.int64)
            if element < num_outputs:
                row = T.truncdiv(element, num_cols)  # l * T + t
                col = element - row * num_cols  # (i - 1) * E + e
                layer = T.truncdiv(row, num_tokens)
                token = row - layer * num_tokens
                last = T.truncdiv(col, num_tables) + 1  # i: the n-gram's last position
                h = T.Cast("int64", ngram_token_ids[token, 0]) * multipliers[layer, 0]
                for j in T.serial(1, last + 1):
                    h = T.bitwise_xor(h, T.Cast("int64", ngram_token_ids[token, j]) * multipliers[layer, j])
                size = T.Cast("int64", vocab_sizes[layer, col])
                output[layer, token, col] = T.Cast("int32", T.floormod(h, size) + T.Cast("int64", offsets[layer, col]))

    return engram_hash
