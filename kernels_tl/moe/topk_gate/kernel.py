"""moe.topk_gate: the indices of each token's ``num_topk`` largest expert scores.

``scores`` float32 [num_tokens, num_experts] (contiguous) -> ``topk_idx`` int64
[num_tokens, num_topk], in descending score order, ties to the smaller expert
index.

Design
------
One warp per token, ``TOKENS_PER_BLOCK`` warps per block.  Lane ``l`` keeps the
scores of experts ``l, l + 32, l + 64, ...`` in registers (``slots`` of them),
so every load is one coalesced 128-byte row segment per warp and every lane has
work for every expert count (72 experts: 3 slots, the last one 8 lanes wide).

Each score becomes a 32-bit unsigned *key* whose integer order is the order we
want (see ``_order_key``).  The token's top-k then takes ``num_topk`` rounds
of:

1. every lane takes the max of its keys;
2. ``redux.sync.max.u32`` (one instruction, sm_80+) gives the warp's max key;
3. each lane offers the smallest expert index among its slots holding that
   key, ``redux.sync.min.u32`` picks the smallest offer: ties go to the
   smaller index, across lanes and within a lane;
4. the owner of the winning slot zeroes its key (key 0 is below every real
   score), and lane ``r`` keeps the winner of round ``r``.

Lanes ``0..num_topk-1`` then store their int64 index (one coalesced store per
token).  A round is about ``4 * slots + 10`` instructions per warp (sm_90a,
256 experts: 4 VIMNMX3, 2 REDUX, 32 ISETP/SEL, ~5 others), with no shuffles,
no shared memory and no block barrier.  These *exact rounds* are now the
fallback of the composite-key pass below, which every row runs first.  The
loop over rounds is a plain run-time loop (nvcc unrolls it by 2), so
``num_topk`` is a *dynamic* parameter: one cubin per expert count serves every
top-k, for about 2 instructions of loop control per round.  Ranks are
collected 32 at a time, so any ``1 <= num_topk <= num_experts`` works.

Composite keys (round 2 of tuning).  The low ``IDX_BITS`` bits of every key
(7 for 72 experts, 8 for 256, 9 for 288 and 384) are replaced by
``IDX_MASK - expert``: keys become unique, their order is (prefix descending,
expert ascending), and one ``redux.max`` per round names the winner -- no offer
step, no second reduction, and only the owner's slot equals the winner.  ~28
instructions per round instead of ~48 (sm_90a, 256 experts), one reduction
latency instead of two.  The result is exact when

* every key of the row has zero low bits (scores that came from bf16 or fp16,
  integers, ...): the composite order *is* the reference order; or
* the prefixes of the k + 1 largest composite keys are pairwise different (a
  uniform check per round, on the reduction's uniform result): then every
  other key is smaller than the k-th, and the k are strictly ordered.

Otherwise (two of the top k + 1 scores differ only in their low bits, or tie
exactly with low bits set, or several NaNs are among them) the warp reloads
its row and runs the exact rounds; the composite pass's stores are
overwritten.  A Python model of both passes matched the stable sort on 6000
rows (random, ties, near ties, NaN/inf, bf16-valued; k = 1, 8, 9, 33, all).

Order and NaN handling (the spec is the reference: a stable descending sort,
``torch.sort(scores, descending=True, stable=True).indices[:, :num_topk]``):

* ``-0.0`` and ``+0.0`` are equal (tie -> smaller index);
* every NaN, whatever its sign and payload, ranks above ``+inf``, and NaNs tie
  among themselves (-> smaller index), as in ``torch.sort``/``torch.topk``;
* ``-inf`` is an ordinary (smallest) score: every returned row holds
  ``num_topk`` distinct indices.

Static configurations: ``num_experts`` only (72, 256, 288, 384: 4 configs cover
DESIGN.md's coverage, every top-k included).

Expected cost at 8192 x 256, k = 8: 8 MiB read + 0.5 MiB written (~2 us of
DRAM time, overlapped with the compute of tokens whose rows have arrived);
~90 instructions of loads and key conversion plus 8 rounds of ~43, i.e.
~435 warp instructions per token, 3.6 M in all: ~3.5 us of issue time on 132
SMs at one instruction per scheduler per cycle.

Occupancy (tuning; H200 measured 9.3 us at 8192 x 256, k = 8, target 9).
Before: 34 registers on sm_90a, which the allocator rounds to 40 per thread
(256-register warp granularity): 51 warps fit, i.e. 6 blocks = 48 warps per
SM, 792 blocks per wave for 1024 blocks -- 1.3 waves, and the last 232 blocks
start only when first-wave blocks retire, paying a second full DRAM latency +
8-round dependency chain on top.  Now:

* ``__launch_bounds__(256, 8)`` (``T.annotate_min_blocks_per_sm``) caps the
  kernel at 32 registers, so 8 blocks = 64 warps (the hardware maximum) fit
  per SM: 1056 resident blocks >= 1024, the whole 8192-token batch is one
  wave and every row load is issued at kernel start;
* the offer step selects the slot base ``32 * s`` (an immediate) and adds the
  lane once before ``redux.min``, instead of keeping 8-12 ``32 * s + lane``
  constants in registers: that is what makes the 32-register cap free (no
  spills, no re-materialised constants; the loop, unrolled by 2, is 96 instructions
  for 2 rounds on sm_90a at 256 experts, as before).  ``_NO_OFFER`` is
  0xFFFFFF00 so that adding a lane id cannot wrap.

ptxas (sm_90a / sm_100a): 72 experts 24 / 22, 256: 28 / 26, 288: 28 / 28,
384: 32 / 30 registers, no spills.  Predicted: the 256-expert launch loses its
second-wave tail, ~9.3 -> ~8 us (instruction count per token unchanged).
Measured 9.2-9.4 us device time, 8.9 us kernel time (64-launch graphs; Nsight
Compute: 0.53 instructions issued per scheduler and cycle, 62% achieved
occupancy: latency-bound by the two dependent reductions of every round).

Round 2: the composite-key pass (above).  With both passes in one kernel,
ptxas at the 32-register cap keeps everything in registers for 72 experts and
spills 4 / 24 / 48 bytes (sm_90a; sm_100a 0 / 4 / 8) for 256 / 288 / 384, all
outside the round loops (values kept for the fallback and the per-32-ranks
store).  Predicted: ~40% fewer instructions per row at k = 8, ~7.5-8 us.
Measured 8.2 us device time, 7.9 us kernel time (from 9.2 / 8.9 in the same
session; 8192 x 256, k = 8, random fp32 scores, i.e. the verifying path).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

WARP = 32
# 8 warps = 8 tokens per block: 256 threads, small enough that a partial last
# block wastes little, large enough to keep the block count low.
TOKENS_PER_BLOCK = 8
# Blocks per SM asked of ptxas: 64 warps (the hardware maximum), i.e. a
# 32-register cap (every expert count fits without spills).
MIN_BLOCKS_PER_SM = 64 // TOKENS_PER_BLOCK
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}

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


def topk_gate_kernel(num_experts: int):
    assert num_experts >= 1
    num_tokens = T.dynamic("num_tokens")
    num_topk = T.dynamic("num_topk")
    slots = (num_experts + WARP - 1) // WARP
    full_slots = num_experts // WARP  # slots where all 32 lanes hold an expert
    # Composite keys (see "Composite keys"): the low IDX_BITS of a key carry
    # ``IDX_MASK - expert``, the rest is the key's prefix.
    idx_bits = max(1, (num_experts - 1).bit_length())
    idx_mask = (1 << idx_bits) - 1
    prefix_mask = 0xFFFFFFFF ^ idx_mask

    @T.macro
    def load_keys(scores, keys, token, lane):
        for s in T.unroll(slots):
            if s < full_slots or s * WARP + lane < num_experts:
                keys[s] = _order_key(T.reinterpret(scores[token, s * WARP + lane], T.uint32))
            else:
                keys[s] = T.uint32(_REMOVED)

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
            # <= 32 registers: 8 blocks = 64 warps per SM (see "Occupancy").
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
