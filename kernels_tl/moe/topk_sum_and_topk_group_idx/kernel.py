"""moe.topk_sum_and_topk_group_idx: each token's best expert groups.

``scores`` float32 [num_tokens, num_groups, num_experts_per_group] (contiguous) ->
``topk_group_idx`` int64 [num_tokens, num_topk_groups].  A group's score is its largest
score (``num_topk_sum`` 1) or the float32 sum of its two largest (2); the output lists the
``num_topk_groups`` best groups, best first, equal group scores smaller index first
(``torch.sort(..., descending=True, stable=True)``).  NaN ranks above ``+inf`` (a group
holding a NaN scores NaN, as does ``+inf + -inf``), NaNs tie among themselves, and
``-0.0 == +0.0``.

Design
------
A block of ``THREADS`` threads takes ``tokens_per_block`` consecutive tokens (the host's
choice: as many as its lanes and the staging tile hold).  Their rows are one contiguous
span, which the block copies into shared memory ``TILE`` floats per pass with coalesced
loads (16-byte vectors when rows are whole vectors and the tensor is 16-byte aligned, 4-byte
otherwise), all of a thread's loads in flight before its first store.  The tile keeps one
padding word per 32, so the group scans below read it with few bank conflicts whatever the
group size.  A row longer than the tile is one token per block, scanned over several passes.

Each token gets ``lanes`` = the power of two >= ``num_groups`` consecutive lanes, lane ``g``
owning group ``g``: it keeps the group's two largest scores in a top-2 recurrence that ranks
NaN highest (``max.NaN`` for the larger, ``fminf``, which drops a NaN, for the candidate of
the smaller), so no order keys are needed per element.  The group score becomes a uint32
key whose integer order is the ranking (NaN -> 0xFFFFFFFF, both zeros -> 0x80000000);
group ``g``'s rank is the number of groups of its token with a larger key, or an equal key
and a smaller index (``num_groups`` shuffles within the token's lanes), and lanes with rank
``< num_topk_groups`` store their index at that rank.

Everything is a run-time value: one cubin serves every shape.  Token and element offsets
are 64-bit (the scores may pass 2^31 elements).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE, max_nan

# 4 warps: DeepSeek-V3's 8 x 32 rows are 16 tokens per block (512 blocks at 8192 tokens),
# 8 lanes each.
THREADS = 128
# Floats staged per pass: 32 per thread (8 16-byte loads), 16 KiB (+ 512 bytes of padding).
TILE = 4096
PER_THREAD = TILE // THREADS
VEC = 4
# One padding word after every 32 tile words: the word of element f is f + (f >> PAD_SHIFT).
PAD_SHIFT = 5
TILE_WORDS = TILE + (TILE >> PAD_SHIFT)
# Blocks per SM asked of ptxas: 8 x 4 warps (a 64-register cap); 8 tiles are 132 KiB of shared memory.
MIN_BLOCKS_PER_SM = 8
MAX_GROUPS = 32  # a token's groups are lanes of one warp
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel itself (its element < the block's span)
    "tl.disable_safe_memory_legalize": True,
}

_NAN_KEY = 0xFFFFFFFF
_ZERO_KEY = 0x80000000


def host_constants():
    return {"threads": THREADS, "tile": TILE, "vec": VEC, "max_groups": MAX_GROUPS}


def _rank_key(score):
    """float32 -> uint32 whose integer order is the ranking: the sign-flip of the bits
    (negative scores inverted, positive ones above them), every NaN the largest key and
    both zeros one key."""
    bits = T.reinterpret(score, T.uint32)
    magnitude = bits & T.uint32(0x7FFFFFFF)
    flipped = bits ^ T.if_then_else((bits >> T.uint32(31)) != T.uint32(0), T.uint32(0xFFFFFFFF), T.uint32(0x80000000))
    return T.if_then_else(
        magnitude > T.uint32(0x7F800000),
        T.uint32(_NAN_KEY),
        T.if_then_else(magnitude == T.uint32(0), T.uint32(_ZERO_KEY), flipped),
    )


def topk_sum_and_topk_group_idx_kernel():
    num_elements = T.dynamic("num_elements", "int64")  # num_tokens * num_groups * num_experts_per_group
    num_outputs = T.dynamic("num_outputs", "int64")  # num_tokens * num_topk_groups

    @T.prim_func
    def topk_sum_and_topk_group_idx(
        scores: T.Tensor[(num_elements,), T.float32],
        topk_group_idx: T.Tensor[(num_outputs,), T.int64],
        num_tokens: T.int32,
        num_groups: T.int32,
        num_experts_per_group: T.int32,
        num_topk_sum: T.int32,
        num_topk_groups: T.int32,
        lane_shift: T.int32,  # log2 of the lanes per token
        tokens_per_block: T.int32,
        wide: T.int32,  # 16-byte loads: the row length is a multiple of 4 and scores 16-byte aligned
    ):
        with T.Kernel(T.ceildiv(num_tokens, tokens_per_block), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            T.import_source(DEVICE_SOURCE)
            T.assume(num_groups > 0)
            T.assume(num_experts_per_group > 0)
            T.assume(tokens_per_block > 0)
            tid = T.get_thread_binding()
            tile = T.alloc_shared((TILE_WORDS,), T.float32)
            vals = T.alloc_local((PER_THREAD,), T.float32)
            top1 = T.alloc_var(T.float32)
            top2 = T.alloc_var(T.float32)
            rank = T.alloc_var(T.int32)

            row = num_groups * num_experts_per_group
            first_token = T.Cast("int64", bid) * T.Cast("int64", tokens_per_block)
            block_tokens = T.Cast("int32", T.min(T.Cast("int64", tokens_per_block), T.Cast("int64", num_tokens) - first_token))
            span = block_tokens * row  # <= max(TILE, row): the host's tokens_per_block
            block_start = first_token * T.Cast("int64", row)

            # this lane's (token, group) and the group's floats in the block's span
            lanes = 1 << lane_shift
            token = tid >> lane_shift
            group = tid & (lanes - 1)
            owner = token < block_tokens and group < num_groups
            group_start = token * row + group * num_experts_per_group
            group_end = group_start + num_experts_per_group

            top1 = -T.infinity(T.float32)
            top2 = -T.infinity(T.float32)
            for p in T.serial(T.ceildiv(span, TILE)):
                tile_start = p * TILE
                tile_len = T.min(TILE, span - tile_start)
                # 1. global -> shared, all loads before the first store
                if wide != 0:
                    vec_start = T.truncdiv(block_start + T.Cast("int64", tile_start), VEC)
                    for i in T.unroll(PER_THREAD // VEC):
                        q = i * THREADS + tid  # 16-byte vector of the tile
                        if q * VEC < tile_len:
                            for v in T.vectorized(VEC):
                                vals[i * VEC + v] = scores[(vec_start + T.Cast("int64", q)) * VEC + v]
                    for i in T.unroll(PER_THREAD // VEC):
                        q = i * THREADS + tid
                        if q * VEC < tile_len:
                            for v in T.unroll(VEC):  # the 4 share a padding offset: q * 4 is a multiple of 4
                                tile[q * VEC + v + (q >> (PAD_SHIFT - 2))] = vals[i * VEC + v]
                else:
                    for i in T.unroll(PER_THREAD):
                        f = i * THREADS + tid
                        if f < tile_len:
                            vals[i] = scores[block_start + T.Cast("int64", tile_start + f)]
                    for i in T.unroll(PER_THREAD):
                        f = i * THREADS + tid
                        if f < tile_len:
                            tile[f + (f >> PAD_SHIFT)] = vals[i]
                T.sync_threads()
                # 2. the group's top 2 (NaN the largest) over its floats in this tile
                if owner:
                    for f in T.serial(T.max(group_start, tile_start) - tile_start,
                                      T.min(group_end, tile_start + tile_len) - tile_start):
                        x = tile[f + (f >> PAD_SHIFT)]
                        top2 = max_nan(top2, T.call_extern(T.float32, "fminf", top1, x))
                        top1 = max_nan(top1, x)
                T.sync_threads()  # the tile is read before the next pass overwrites it

            # 3. rank the token's groups: every lane of the warp takes part in the shuffles
            key = T.if_then_else(num_topk_sum == 1, _rank_key(top1), _rank_key(top1 + top2))
            rank = 0
            for i in T.serial(num_groups):
                other = T.shfl_sync(key, i, lanes)
                rank = rank + T.Cast("int32", other > key or (other == key and i < group))
            if owner and rank < num_topk_groups:
                topk_group_idx[(first_token + T.Cast("int64", token)) * T.Cast("int64", num_topk_groups)
                               + T.Cast("int64", rank)] = T.Cast("int64", group)

    return topk_sum_and_topk_group_idx
