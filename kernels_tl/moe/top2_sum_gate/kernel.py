"""moe.top2_sum_gate: the DeepSeek-V3 router in one pass per token.

``logits`` float32 [num_tokens, E] -> ``topk_idx`` int64 and ``topk_weights`` float32
[num_tokens, K + S], and ``unmapped_topk_idx`` int64 [num_tokens, K] updated in place
(``tile_kernels_aot.torch.moe.top2_sum_gate`` is the contract): score every expert
(sigmoid, sqrtsoftplus or softmax, with torch's float32 arithmetic), rank the groups by
the sum of their two best keys (``score + bias``; ``logits + bias`` for softmax) and keep
the best ``num_topk_groups``, take the K best keys (ties to the smaller expert, NaN above
``+inf``, ``-0.0 == +0.0``) or the fixed row already stored, normalise the picked scores
(``s / (1e-20 + s_0 + ... + s_{K-1}) * routed_scaling_factor``, left to right), append
the shared experts, map to physical replicas and keep this TP rank's experts.

Design
------
One warp per token, ``TOKENS_PER_BLOCK`` (4) warps per block, no block barrier.  Lane
``l`` holds experts ``l, l + 32, ...`` (``slots`` = ``max_experts / 32`` of them, the
size class; ``E`` is a run-time value ``<= max_experts``): every row load is one
coalesced 128-byte segment per slot, and it is torch's own softmax layout (the
persistent warp softmax keeps element ``it * 32 + l`` in lane ``l``), so the softmax's
per-lane folds and butterflies are torch's, bit for bit.  Every load a row needs (logits,
bias, the mask flags, a fixed row, the replica counts) is issued before the first
branch.

Scores go to shared memory (the weights read the picked ones), keys become uint32
*order keys* whose integer order is the ranking.  With a group limit, the keys are staged
in shared memory, lane ``g`` folds group ``g``'s top 2 (NaN-keeping), the group sums are
ranked by shuffles, and a ballot gives the allowed groups; experts of other groups get the
key of ``-inf`` (they still tie with real ``-inf`` keys by index, as in the reference).
Selection, as ``moe.topk_gate``: composite keys (the low bits of each key replaced by
``idx_mask - expert``) make one ``redux.sync.max`` per round name the winner; the result is
exact when no key has low bits set or the prefixes of the k + 1 best composite keys differ
pairwise (checked per round), else the warp redoes the rounds exactly from the plain keys
(kept in shared memory): ``redux.sync.max`` of the keys, then ``redux.sync.min`` of the
experts holding it.  The owner drops the winner and lane ``r`` keeps round ``r``'s; every
lane accumulates the denominator in round order from the shared scores.

Everything but the size class is a run-time value: scoring function, expert, group and
top-k counts, options, ranks.  Token, row and output offsets are 64-bit.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE, max_nan

WARP = 32
# 4 warps = 4 tokens per block: small blocks fill the SMs at decode sizes, and the
# per-warp staging (4 * max_experts words) stays at 32 KiB per block for 512 experts.
TOKENS_PER_BLOCK = 4
MAX_EXPERTS = 512
MAX_GROUPS = 32  # a token's groups are lanes of its warp
# group of expert e = (e * group_mul) >> GROUP_SHIFT, exact for e * experts_per_group < 2^16
GROUP_SHIFT = 16
SIGMOID, SQRTSOFTPLUS, SOFTMAX = 0, 1, 2  # ScoringFunc values (identity is refused by the host)
HASH_MULTIPLIER = 23333  # spreads tokens over an expert's replicas (the reference's constant)
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel itself (token, expert and lane bounds)
    "tl.disable_safe_memory_legalize": True,
    # warps never share data: the staging is per warp, ordered by T.sync_warp()
    "tl.disable_thread_storage_sync": True,
}

_REMOVED = 0  # key of a taken or padding slot: below every real key
_NEG_INF_KEY = 0x00800000  # the order key of -inf, the smallest real key
_NO_OFFER = 0xFFFFFF00  # + a lane id: above every expert index, no wrap
_QUIET_NAN = 0x7FC00000  # torch's softmax writes std::numeric_limits<float>::quiet_NaN() for a zero sum


def host_constants(max_experts: int):
    return {"warp": WARP, "tokens_per_block": TOKENS_PER_BLOCK, "max_experts": max_experts,
            "max_groups": MAX_GROUPS, "group_shift": GROUP_SHIFT}


def _key(value):
    """float32 -> uint32 in ranking order: ``0x80000000 +- |x|`` by sign (both zeros one key),
    every NaN 0xFFFFFFFF; ``-inf`` is ``_NEG_INF_KEY``, so 0 is free for removed slots."""
    bits = T.reinterpret(value, T.uint32)
    magnitude = bits & T.uint32(0x7FFFFFFF)
    ordered = T.if_then_else((bits >> T.uint32(31)) != T.uint32(0), T.uint32(0x80000000) - magnitude,
                             T.uint32(0x80000000) + magnitude)
    return T.if_then_else(magnitude > T.uint32(0x7F800000), T.uint32(0xFFFFFFFF), ordered)


def _ieee_max(a, b):
    """torch's ``a > b ? a : b`` (a NaN ``b`` wins, a NaN ``a`` loses)."""
    return T.if_then_else(a > b, a, b)


def _lane_max(keys, slots):
    """The largest of a lane's keys (an expression)."""
    value = keys[0]
    for s in range(1, slots):
        value = T.max(value, keys[s])
    return value


def top2_sum_gate_kernel(max_experts: int):
    """The kernel of one size class: any ``E <= max_experts`` (a multiple of 4) at run time;
    the host picks ``max_experts = align_up(E, 32)``."""
    assert max_experts % WARP == 0 and WARP <= max_experts <= MAX_EXPERTS, \
        f"max_experts must be a multiple of {WARP} in [{WARP}, {MAX_EXPERTS}], got {max_experts}"
    slots = max_experts // WARP
    # composite keys: the low idx_bits carry idx_mask - expert, the rest is the key's prefix
    idx_bits = (max_experts - 1).bit_length()
    idx_mask = (1 << idx_bits) - 1
    prefix_mask = 0xFFFFFFFF ^ idx_mask
    num_logits = T.dynamic("num_logits", "int64")  # num_tokens * num_experts
    num_slots_out = T.dynamic("num_slots_out", "int64")  # num_tokens * (num_topk + num_shared)
    num_unmapped = T.dynamic("num_unmapped", "int64")  # the unmapped_topk_idx storage span
    num_map = T.dynamic("num_map", "int64")  # (num_experts + num_shared) * (num_extra + 1)
    num_rows = T.dynamic("num_rows")  # num_tokens (mask lengths)
    num_logical = T.dynamic("num_logical")  # num_experts + num_shared
    num_bias = T.dynamic("num_bias")  # num_experts

    @T.prim_func
    def top2_sum_gate(
        logits: T.Tensor[(num_logits,), T.float32],
        bias: T.Tensor[(num_bias,), T.float32],
        mask: T.Tensor[(num_rows,), T.bool],
        fix_routing_mask: T.Tensor[(num_rows,), T.bool],
        to_physical_map: T.Tensor[(num_map,), T.int32],
        logical_count: T.Tensor[(num_logical,), T.int32],
        unmapped_topk_idx: T.Tensor[(num_unmapped,), T.int64],
        topk_idx: T.Tensor[(num_slots_out,), T.int64],
        topk_weights: T.Tensor[(num_slots_out,), T.float32],
        num_tokens: T.int32,
        num_experts: T.int32,
        num_topk: T.int32,
        num_shared: T.int32,
        scoring: T.int32,  # SIGMOID, SQRTSOFTPLUS or SOFTMAX
        softmax_width: T.int32,  # torch's lanes per row: min(next_pow2(E), 32)
        softmax_span: T.int32,  # torch's elements per row incl. padding: next_pow2(E)
        grouped: T.int32,  # num_groups != num_topk_groups
        num_groups: T.int32,
        num_topk_groups: T.int32,
        experts_per_group: T.int32,
        group_mul: T.int32,  # ceil(2^GROUP_SHIFT / experts_per_group)
        has_mask: T.int32,
        has_fix: T.int32,
        has_unmapped: T.int32,
        unmapped_stride: T.int64,
        has_map: T.int32,
        map_cols: T.int32,  # num_extra + 1
        routed_scaling_factor: T.float32,
        ep_rank: T.int64,
        per_gpu: T.int32,  # (E + num_extra) // num_ep_ranks
        per_dp: T.int32,  # per_gpu * num_tp_ranks
        num_tp_ranks: T.int32,
        tp_rank: T.int32,  # -1 when outside [0, num_tp_ranks): nothing is kept
    ):
        with T.Kernel(T.ceildiv(num_tokens, TOKENS_PER_BLOCK), threads=TOKENS_PER_BLOCK * WARP) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(DEVICE_SOURCE)
            T.assume(num_experts > 0)
            T.assume(per_gpu > 0)
            T.assume(per_dp > 0)
            T.assume(num_tp_ranks > 0)
            tid = T.get_thread_binding()
            lane = tid % WARP
            warp = tid // WARP
            token = bid * TOKENS_PER_BLOCK + warp

            scores_s = T.alloc_shared((TOKENS_PER_BLOCK, max_experts), T.float32)
            keys_s = T.alloc_shared((TOKENS_PER_BLOCK, max_experts), T.float32)
            counts_s = T.alloc_shared((TOKENS_PER_BLOCK, max_experts), T.int32)
            plain_s = T.alloc_shared((TOKENS_PER_BLOCK, max_experts), T.uint32)  # keys for the exact rounds
            x = T.alloc_local((slots,), T.float32)
            b = T.alloc_local((slots,), T.float32)
            sc = T.alloc_local((slots,), T.float32)
            keys = T.alloc_local((slots,), T.uint32)
            routed = T.alloc_var(T.int32)
            fixed = T.alloc_var(T.int32)
            fixed_idx = T.alloc_var(T.int64)
            shared_count = T.alloc_var(T.int32)
            row_max = T.alloc_var(T.float32)
            row_sum = T.alloc_var(T.float32)
            top1 = T.alloc_var(T.float32)
            top2 = T.alloc_var(T.float32)
            group_key = T.alloc_var(T.uint32)
            group_rank = T.alloc_var(T.int32)
            scan = T.alloc_var(T.int32)
            denominator = T.alloc_var(T.float32)
            picked = T.alloc_var(T.float32)
            offer = T.alloc_var(T.uint32)
            low_bits = T.alloc_var(T.uint32)
            last = T.alloc_var(T.uint32)  # the previous round's composite winner
            distinct = T.alloc_var(T.int32)  # every prefix so far differed from the previous one
            rank_idx = T.alloc_var(T.int64)
            logical = T.alloc_var(T.int64)
            weight = T.alloc_var(T.float32)
            physical = T.alloc_var(T.int32)
            count = T.alloc_var(T.int32)
            replica = T.alloc_var(T.int64)

            # The whole warp shares `token`: every shuffle and reduction below runs with
            # all 32 lanes and every branch on their results is uniform.
            if token < num_tokens:
                token64 = T.Cast("int64", token)
                row = token64 * T.Cast("int64", num_experts)
                out_row = token64 * T.Cast("int64", num_topk + num_shared)
                unmapped_row = token64 * unmapped_stride
                # 1. every load of the row, before the first branch on any of them
                for s in T.unroll(slots):
                    if s * WARP + lane < num_experts:
                        x[s] = logits[row + T.Cast("int64", s * WARP + lane)]
                        b[s] = bias[s * WARP + lane]
                        if has_map != 0:
                            counts_s[warp, s * WARP + lane] = logical_count[s * WARP + lane]
                routed = 1
                if has_mask != 0:
                    routed = T.Cast("int32", mask[token])
                fixed = 0
                fixed_idx = T.int64(0)
                if has_fix != 0:
                    fixed = T.Cast("int32", fix_routing_mask[token])
                    if lane < num_topk:
                        fixed_idx = unmapped_topk_idx[unmapped_row + T.Cast("int64", lane)]
                shared_count = 1
                if has_map != 0 and lane >= num_topk and lane < num_topk + num_shared:
                    shared_count = logical_count[num_experts + lane - num_topk]

                if routed == 0:
                    # not routed: -1 / 0.0, and the stored row becomes -1
                    if has_unmapped != 0 and lane < num_topk:
                        unmapped_topk_idx[unmapped_row + T.Cast("int64", lane)] = T.int64(-1)
                    if lane < num_topk + num_shared:
                        topk_idx[out_row + T.Cast("int64", lane)] = T.int64(-1)
                        topk_weights[out_row + T.Cast("int64", lane)] = T.float32(0)
                else:
                    # 2. scores (torch's float32 arithmetic) and ranking keys
                    if scoring == SOFTMAX:
                        # torch's persistent warp softmax: per-lane fold over its iterations
                        # (padding elements are -inf), butterflies over its lanes, then
                        # exp(x - max) summed in iteration order and divided by the sum.
                        row_max = T.if_then_else(lane < num_experts, x[0], -T.infinity(T.float32))
                        for s in T.unroll(1, slots):
                            row_max = _ieee_max(row_max, T.if_then_else(s * WARP + lane < num_experts, x[s],
                                                                        -T.infinity(T.float32)))
                        if softmax_span - softmax_width + lane >= num_experts:
                            row_max = _ieee_max(row_max, -T.infinity(T.float32))
                        for i in T.unroll(5):
                            if (16 >> i) < softmax_width:
                                other = T.shfl_xor(row_max, 16 >> i)
                                row_max = T.if_then_else(row_max < other, other, row_max)
                        row_sum = T.float32(0)
                        for s in T.unroll(slots):
                            if s * WARP + lane < num_experts:
                                sc[s] = T.exp(x[s] - row_max)
                                row_sum = row_sum + sc[s]
                        if softmax_span - softmax_width + lane >= num_experts:
                            row_sum = row_sum + T.exp(-T.infinity(T.float32) - row_max)
                        for i in T.unroll(5):
                            if (16 >> i) < softmax_width:
                                row_sum = row_sum + T.shfl_xor(row_sum, 16 >> i)
                        for s in T.unroll(slots):
                            if s * WARP + lane < num_experts:
                                sc[s] = T.if_then_else(row_sum == T.float32(0),
                                                       T.reinterpret(T.uint32(_QUIET_NAN), T.float32), sc[s] / row_sum)
                                keys[s] = _key(x[s] + b[s])
                                if grouped != 0:
                                    keys_s[warp, s * WARP + lane] = x[s] + b[s]
                            else:
                                keys[s] = T.uint32(_REMOVED)
                    else:
                        for s in T.unroll(slots):
                            if s * WARP + lane < num_experts:
                                if scoring == SIGMOID:
                                    sc[s] = T.float32(1) / (T.float32(1) + T.exp(-x[s]))
                                else:
                                    sc[s] = T.sqrt(T.if_then_else(x[s] > T.float32(20), x[s], T.log1p(T.exp(x[s]))))
                                keys[s] = _key(sc[s] + b[s])
                                if grouped != 0:
                                    keys_s[warp, s * WARP + lane] = sc[s] + b[s]
                            else:
                                keys[s] = T.uint32(_REMOVED)
                    for s in T.unroll(slots):
                        if s * WARP + lane < num_experts:
                            scores_s[warp, s * WARP + lane] = sc[s]
                    T.sync_warp()

                    denominator = T.float32(1e-20)
                    rank_idx = T.int64(0)
                    if fixed == 0:
                        # 3. group limit: lane g folds group g's two best keys (NaN-keeping)
                        if grouped != 0:
                            group_key = T.uint32(0)
                            if lane < num_groups:
                                top1 = -T.infinity(T.float32)
                                top2 = -T.infinity(T.float32)
                                # start at a lane-dependent element: fewer bank conflicts
                                scan = T.truncmod(lane, experts_per_group)
                                for _ in T.serial(experts_per_group):
                                    v = keys_s[warp, lane * experts_per_group + scan]
                                    top2 = max_nan(top2, T.call_extern(T.float32, "fminf", top1, v))
                                    top1 = max_nan(top1, v)
                                    scan = T.if_then_else(scan + 1 == experts_per_group, 0, scan + 1)
                                group_key = _key(top1 + top2)
                            group_rank = 0
                            for i in T.serial(num_groups):
                                other_key = T.shfl_sync(group_key, i)
                                group_rank = group_rank + T.Cast(
                                    "int32", other_key > group_key or (other_key == group_key and i < lane))
                            allowed = T.Cast("uint32", T.ballot(lane < num_groups and group_rank < num_topk_groups))
                            for s in T.unroll(slots):
                                group = T.shift_right((s * WARP + lane) * group_mul, GROUP_SHIFT)
                                if s * WARP + lane < num_experts and ((allowed >> T.Cast("uint32", group))
                                                                      & T.uint32(1)) == T.uint32(0):
                                    keys[s] = T.uint32(_NEG_INF_KEY)
                        # 4. top-k.  Composite pass: the low idx_bits of each key become
                        # idx_mask - expert, so keys are unique and one redux.max per round names
                        # the winner.  Exact when no key has low bits set, or when the prefixes
                        # of the k + 1 best composite keys differ pairwise (checked per round).
                        low_bits = T.uint32(0)
                        for s in T.unroll(slots):
                            low_bits = low_bits | (keys[s] & T.uint32(idx_mask))
                            if s * WARP + lane < num_experts:
                                plain_s[warp, s * WARP + lane] = keys[s]
                        exact_prefixes = T.warp_reduce_bitor(low_bits) == T.uint32(0)
                        for s in T.unroll(slots):
                            keys[s] = T.if_then_else(
                                keys[s] != T.uint32(_REMOVED),
                                (keys[s] & T.uint32(prefix_mask)) | (T.uint32(idx_mask - s * WARP) - T.Cast("uint32", lane)),
                                T.uint32(_REMOVED))
                        last = T.uint32(0)
                        distinct = 1
                        for r in T.serial(num_topk):
                            winner = T.warp_reduce_max(_lane_max(keys, slots))
                            distinct = distinct & T.Cast(
                                "int32", (winner & T.uint32(prefix_mask)) != (last & T.uint32(prefix_mask)))
                            last = winner
                            for s in T.unroll(slots):
                                keys[s] = T.if_then_else(keys[s] == winner, T.uint32(_REMOVED), keys[s])
                            expert = T.Cast("int32", T.uint32(idx_mask) - (winner & T.uint32(idx_mask)))
                            if lane == r:
                                rank_idx = T.Cast("int64", expert)
                            denominator = denominator + scores_s[warp, expert]
                        if not exact_prefixes:
                            # the (k+1)-th prefix must differ from the k-th too (0 when none is left)
                            following = T.warp_reduce_max(_lane_max(keys, slots))
                            distinct = distinct & T.Cast(
                                "int32", (following & T.uint32(prefix_mask)) != (last & T.uint32(prefix_mask)))
                            if distinct == 0:
                                # Exact rounds on the plain keys: the best key, then the smallest
                                # expert holding it.
                                for s in T.unroll(slots):
                                    keys[s] = T.if_then_else(s * WARP + lane < num_experts,
                                                             plain_s[warp, s * WARP + lane], T.uint32(_REMOVED))
                                denominator = T.float32(1e-20)
                                for r in T.serial(num_topk):
                                    best = T.warp_reduce_max(_lane_max(keys, slots))
                                    offer = T.uint32(_NO_OFFER)
                                    for s_ in T.unroll(slots):
                                        offer = T.if_then_else(keys[slots - 1 - s_] == best,
                                                               T.uint32((slots - 1 - s_) * WARP), offer)
                                    winner = T.warp_reduce_min(offer + T.Cast("uint32", lane))
                                    for s in T.unroll(slots):
                                        keys[s] = T.if_then_else(T.Cast("int32", winner) - lane == s * WARP,
                                                                 T.uint32(_REMOVED), keys[s])
                                    if lane == r:
                                        rank_idx = T.Cast("int64", winner)
                                    denominator = denominator + scores_s[warp, T.Cast("int32", winner)]
                    else:
                        # a fixed row: the stored experts (a negative one reads expert 0's
                        # score, as the reference's clamp does)
                        rank_idx = fixed_idx
                        picked = T.float32(0)
                        if lane < num_topk:
                            picked = scores_s[warp, T.Cast("int32", T.min(T.max(fixed_idx, T.int64(0)),
                                                                         T.Cast("int64", num_experts - 1)))]
                        for i in T.serial(num_topk):
                            denominator = denominator + T.shfl_sync(picked, i)

                    # 5. weights, shared experts, replicas, TP ranks
                    if lane < num_topk + num_shared:
                        if lane < num_topk:
                            logical = rank_idx
                            weight = scores_s[warp, T.Cast("int32", T.min(T.max(rank_idx, T.int64(0)),
                                                                         T.Cast("int64", num_experts - 1)))]
                            weight = weight / denominator * routed_scaling_factor
                            if has_unmapped != 0 and fixed == 0:
                                unmapped_topk_idx[unmapped_row + T.Cast("int64", lane)] = rank_idx
                        else:
                            logical = T.Cast("int64", num_experts + lane - num_topk)
                            weight = T.float32(1)
                        # logical indices of valid inputs are in [-1, E + S): 32-bit from here
                        physical = T.Cast("int32", T.max(T.min(logical, T.Cast("int64", num_experts + num_shared)),
                                                         T.int64(-1)))
                        if has_map != 0 and physical >= 0:
                            if lane < num_topk:
                                count = counts_s[warp, T.min(physical, num_experts - 1)]
                            else:
                                count = shared_count
                            replica = T.floormod(ep_rank + token64 * T.int64(HASH_MULTIPLIER),
                                                 T.Cast("int64", T.max(count, 1)))
                            replica = T.min(T.max(replica, T.int64(0)), T.Cast("int64", map_cols - 1))
                            physical = to_physical_map[T.Cast("int64", T.min(physical, num_experts + num_shared - 1))
                                                       * T.Cast("int64", map_cols) + replica]
                        kept = physical >= 0 and T.truncmod(T.truncdiv(physical, per_gpu), num_tp_ranks) == tp_rank
                        shifted = physical - tp_rank * per_gpu
                        local = shifted - T.truncdiv(shifted, per_dp) * (per_dp - per_gpu)
                        topk_idx[out_row + T.Cast("int64", lane)] = T.if_then_else(
                            kept, T.Cast("int64", local), T.int64(-1))
                        topk_weights[out_row + T.Cast("int64", lane)] = weight

    return top2_sum_gate
