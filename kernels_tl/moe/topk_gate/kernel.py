"""moe.topk_gate: the indices of each token's ``num_topk`` largest expert scores.

``scores`` float32 [num_tokens, num_experts] (contiguous) -> ``topk_idx`` int64
[num_tokens, num_topk]: ``torch.sort(scores, descending=True, stable=True)
.indices[:, :num_topk]``, i.e. descending, ties to the smaller expert index.
``-0.0 == +0.0``; every NaN ranks above ``+inf`` and NaNs tie among themselves;
``-inf`` is an ordinary (smallest) score, so a row holds ``num_topk`` distinct
indices.  Any ``1 <= num_experts <= MAX_EXPERTS`` (512) and
``1 <= num_topk <= num_experts``.

Design
------
One warp per token, ``TOKENS_PER_BLOCK`` (8) warps per block.  Lane ``l`` keeps
the scores of experts ``l, l + 32, ...`` in registers (``slots`` of them): every
load is one coalesced 128-byte segment per warp.  ``slots`` is static (the size
class, below); lanes of the last slot past ``num_experts`` are padding.  Each score becomes a uint32
*key* whose integer order is the wanted order (``_order_key``; 0 marks a taken
or padding slot).  No shared memory, no block barrier, no shuffles.

Composite pass (every row): the low ``IDX_BITS`` bits of each key (enough for
the class's largest index: 5 for ``max_experts`` 32, 6 for 64, 7 for 96-128, 8
for 160-256, 9 for 288-512) are replaced by ``IDX_MASK - expert``.
Keys become unique, so one ``redux.sync.max.u32`` per round names the winner;
its owner zeroes that slot and lane ``r`` keeps round ``r``'s winner.  The
result is exact when no key has low bits set (bf16-, fp16- or integer-valued
scores), or when the prefixes of the k + 1 largest composite keys are pairwise
different (a uniform check on each round's reduced value).

Exact rounds (fallback, when that check fails): the warp reloads its row and,
per round, reduces the plain keys with ``redux.max``, then the smallest expert
index holding the max with ``redux.min`` (each lane offers its slot base, an
immediate, plus its lane id once; ``_NO_OFFER`` cannot wrap).  The fallback's
stores overwrite the composite pass's.

``num_topk`` is dynamic: a run-time loop over rounds (nvcc unrolls the
composite one by 4, the exact one by 2);
ranks are collected 32 at a time and stored by the lanes that hold them.
``__launch_bounds__(256, 8)`` caps the kernel at 32 registers, so 64 warps fit
per SM and an 8192-token batch runs in one wave, all row loads issued at once.
The round loops are latency-bound by their dependent warp reductions.

Size classes: the static key is ``max_experts``, a multiple of 32 up to 512
(``slots = max_experts / 32``); ``num_experts`` is a run-time value the host
maps to ``max_experts = align_up(num_experts, 32)``, so every slot but the last
is full and a class serves ``max_experts - 31 .. max_experts`` experts and every
top-k.  Only the last slot's load is guarded; padding keys are 0, below every
real key, so they are never picked and the round loops are the code of a kernel
specialised to ``max_experts`` experts.  8192 x 256, k = 8, random fp32 scores:
7.7 us device time on an H200 (the specialised kernel this replaced; the class
kernel has the same round loops).  Measurements and alternatives: ``notes.md``.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

WARP = 32
# 8 warps = 8 tokens per block: 256 threads, small enough that a partial last
# block wastes little, large enough to keep the block count low.
TOKENS_PER_BLOCK = 8
# Blocks per SM asked of ptxas: 64 warps (the hardware maximum), i.e. a
# 32-register cap (spills, where any, are a few bytes outside the round loops:
# notes.md).
MIN_BLOCKS_PER_SM = 64 // TOKENS_PER_BLOCK
# The largest class: 16 slots per lane, 9 index bits in a composite key.
MAX_EXPERTS = 512
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every access is guarded by the kernel itself (token < num_tokens, the last
    # slot's lane < num_experts, rank < num_topk); with num_experts a run-time
    # extent the pass would otherwise guard every slot's load.
    "tl.disable_safe_memory_legalize": True,
}

_REMOVED = 0  # key of a taken or padding slot: below every real score
# A lane without the max key offers this (+ its lane id, no wrap) to the
# min-reduction: above every real expert index.
_NO_OFFER = 0xFFFFFF00


def _order_key(bits):
    """float32 bits -> uint32 key, monotone in the score.

    Finite scores and infinities map to ``0x80000000 + |x|`` (positive) or
    ``0x80000000 - |x|`` (negative), both zeros to 0x80000000; every NaN maps to
    0xFFFFFFFF.  The smallest real key is 0x00800000 (-inf), so 0 is free to
    mark removed slots.
    """
    magnitude = bits & T.uint32(0x7FFFFFFF)
    signed = T.if_then_else(
        (bits >> T.uint32(31)) != T.uint32(0),
        T.uint32(0x80000000) - magnitude,
        T.uint32(0x80000000) + magnitude,
    )
    return T.if_then_else(magnitude > T.uint32(0x7F800000), T.uint32(0xFFFFFFFF), signed)


def topk_gate_kernel(max_experts: int):
    """The kernel of one size class: every expert count ``num_experts`` in
    ``(max_experts - 32, max_experts]``, given at run time.  The caller (``host.h``)
    picks ``max_experts = align_up(num_experts, 32)``: every slot but the last is then
    full, and only the last slot's lanes past ``num_experts`` are padding."""
    assert max_experts % WARP == 0 and WARP <= max_experts <= MAX_EXPERTS, \
        f"max_experts must be a multiple of {WARP} in [{WARP}, {MAX_EXPERTS}], got {max_experts}"
    num_tokens = T.dynamic("num_tokens")
    num_topk = T.dynamic("num_topk")
    num_experts = T.dynamic("num_experts")  # in (max_experts - 32, max_experts]
    slots = max_experts // WARP
    # Composite keys (module docstring, "Composite pass"): the low IDX_BITS
    # of a key carry ``IDX_MASK - expert``, the rest is the key's prefix.  A
    # function of the class alone: padding slots hold 0 and are never composed.
    idx_bits = (max_experts - 1).bit_length()
    idx_mask = (1 << idx_bits) - 1
    prefix_mask = 0xFFFFFFFF ^ idx_mask

    @T.macro
    def load_keys(scores, keys, token, lane):
        # Slots 0 .. slots - 2 are full for every expert count of the class:
        # unguarded loads, the same code as a kernel specialised to the count.
        for s in T.unroll(slots - 1):
            keys[s] = _order_key(T.reinterpret(scores[token, s * WARP + lane], T.uint32))
        # The last slot: lanes past num_experts are padding (key 0, never picked).
        if (slots - 1) * WARP + lane < num_experts:
            keys[slots - 1] = _order_key(T.reinterpret(scores[token, (slots - 1) * WARP + lane], T.uint32))
        else:
            keys[slots - 1] = T.uint32(_REMOVED)

    def lane_max_of(keys):
        """The largest of a lane's keys (an expression)."""
        value = keys[0]
        for s in range(1, slots):
            value = T.max(value, keys[s])
        return value

    @T.macro
    def exact_rounds(keys, topk_idx, token, lane):
        """Top-k of the plain keys: per round the warp's max key, then the smallest
        index holding it (a second reduction)."""
        rank_idx = T.alloc_var(T.int32)
        for chunk in T.serial(T.ceildiv(num_topk, WARP)):
            rank_idx = 0
            for r in T.serial(T.min(WARP, num_topk - chunk * WARP)):
                warp_max = T.warp_reduce_max(lane_max_of(keys))
                # Smallest index among this lane's slots holding the max.
                offer = T.alloc_var(T.uint32)
                offer = T.uint32(_NO_OFFER)
                for s_ in T.unroll(slots):
                    s = slots - 1 - s_
                    # slot base only (an immediate): the lane is added once below
                    offer = T.if_then_else(keys[s] == warp_max, T.uint32(s * WARP), offer)
                winner = T.warp_reduce_min(offer + T.uint32(lane))
                # Owner of the winner drops it: winner - lane == 32 * slot.
                delta = T.int32(winner) - lane
                for s in T.unroll(slots):
                    keys[s] = T.if_then_else(delta == s * WARP, T.uint32(_REMOVED), keys[s])
                if lane == r:
                    rank_idx = T.int32(winner)
            if lane < T.min(WARP, num_topk - chunk * WARP):
                topk_idx[token, chunk * WARP + lane] = T.int64(rank_idx)

    @T.prim_func
    def topk_gate(
        scores: T.Tensor[(num_tokens, num_experts), T.float32],
        topk_idx: T.Tensor[(num_tokens, num_topk), T.int64],
    ):
        with T.Kernel(T.ceildiv(num_tokens, TOKENS_PER_BLOCK), threads=TOKENS_PER_BLOCK * WARP) as pid:
            wait_for_previous_grid()  # programmatic dependent launch
            # <= 32 registers: 8 blocks = 64 warps per SM (see notes.md, "Occupancy").
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            lane = tid % WARP
            token = pid * TOKENS_PER_BLOCK + tid // WARP
            keys = T.alloc_local((slots,), T.uint32)
            rank_idx = T.alloc_var(T.int32)  # the winner of round `lane` (of the current 32)
            low_bits = T.alloc_var(T.uint32)
            last = T.alloc_var(T.uint32)  # the previous round's composite winner
            distinct = T.alloc_var(T.int32)  # every prefix so far differed from the previous one

            # The whole warp shares `token`, so the warp-wide reductions below
            # always run with all 32 lanes, and every branch on their results is
            # uniform.
            if token < num_tokens:
                load_keys(scores, keys, token, lane)
                low_bits = T.uint32(0)
                for s in T.unroll(slots):
                    low_bits = low_bits | (keys[s] & T.uint32(idx_mask))
                exact_prefixes = T.warp_reduce_bitor(low_bits) == T.uint32(0)
                for s in T.unroll(slots):
                    keys[s] = T.if_then_else(
                        keys[s] != T.uint32(_REMOVED),
                        (keys[s] & T.uint32(prefix_mask)) | (T.uint32(idx_mask - s * WARP) - T.uint32(lane)),
                        T.uint32(_REMOVED),
                    )

                # One reduction per round: composite keys are unique, so the
                # max names its expert and only the owner's slot matches it.
                last = T.uint32(0)
                distinct = 1
                for chunk in T.serial(T.ceildiv(num_topk, WARP)):
                    rank_idx = 0
                    for r in T.serial(T.min(WARP, num_topk - chunk * WARP)):
                        winner = T.warp_reduce_max(lane_max_of(keys))
                        distinct = distinct & T.Cast(
                            T.int32, (winner & T.uint32(prefix_mask)) != (last & T.uint32(prefix_mask)))
                        last = winner
                        for s in T.unroll(slots):
                            keys[s] = T.if_then_else(keys[s] == winner, T.uint32(_REMOVED), keys[s])
                        if lane == r:
                            rank_idx = T.int32(T.uint32(idx_mask) - (winner & T.uint32(idx_mask)))
                    if lane < T.min(WARP, num_topk - chunk * WARP):
                        topk_idx[token, chunk * WARP + lane] = T.int64(rank_idx)

                if not exact_prefixes:
                    # The (k+1)-th key's prefix must differ from the k-th's too
                    # (0 when none is left: below every real prefix).
                    following = T.warp_reduce_max(lane_max_of(keys))
                    distinct = distinct & T.Cast(
                        T.int32, (following & T.uint32(prefix_mask)) != (last & T.uint32(prefix_mask)))
                    if distinct == 0:
                        # Two of the top k + 1 keys share a prefix and their low
                        # bits decide: redo this token with the plain keys.
                        load_keys(scores, keys, token, lane)
                        exact_rounds(keys, topk_idx, token, lane)

    return topk_gate
