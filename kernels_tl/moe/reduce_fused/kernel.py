"""moe.reduce_fused: the weighted sum of each token's fused rows, back in token order.

``x`` bf16/fp32 [num_rows, hidden] (``hidden % 256 == 0``), optional per-row ``x_sf`` fp32
[num_rows], optional ``topk_weights`` fp32 [num_tokens, num_topk], ``token_topk_to_pos``
int32 [num_tokens, num_topk], optional output scale ``sf`` fp32 [1] -> ``out``
[num_tokens, hidden] in ``x.dtype`` or e4m3.  Per token, in float32, the reference's order:
``acc = 0``; for ``k = 0 ..`` with ``p = pos[k] >= 0``: ``s = w[k]`` (1 without weights),
``s = s * x_sf[p]``, ``acc = fma(float(x[p]), s, acc)``; then ``acc * sf[0]``; rounded to
nearest even (e4m3: ``cvt.rn.satfinite``, saturating to +-448; NaN stays NaN).

Design
------
Bound by memory: the routed rows of ``x`` are read once (gathered), ``out`` written once.

* A piece is 16 bytes of ``x`` (8 bf16 or 4 fp32 values).  A thread owns ``PIECES = 4``
  pieces of its token's row, ``lane + j * lanes_per_row`` (interleaved, so each warp
  instruction covers contiguous bytes); ``lanes_per_row = hidden / (PIECES * piece)``
  exactly, since ``hidden % 256 == 0``: no tail, no guard per piece.
* An item is (token, lane).  The grid is at most one wave (``blocks_per_sm`` blocks per SM,
  the host's choice from the SM count); thread ``f`` takes items ``f, f + stride, ..``
  (``stride`` = the grid's threads), the token and lane advanced by a fixed quotient and
  remainder (no division per item; the host bounds ``items + stride`` below 2^31).
* An item's time is memory round trips: its token's positions (``KC = 8`` at a time, a
  run-time top-k of any size), then the routed rows with their weights and ``x_sf``.  The
  positions' round trip is taken off the critical path: each item first prefetches the
  next item's row of ``token_topk_to_pos`` into L1 (``prefetch.global.L1``, no registers),
  so that it is in flight with this item's rows and the next item's reads of it hit L1.
  The routed slots of a chunk are a bit mask, taken lowest bit first (``k`` order; the
  slot's position read again, an L1 hit, rather than kept in 8 registers), so the rows are
  loaded ``C = 2`` at a time however the unrouted slots lie: upstream's sparse layout
  (about 1.3 of 6 slots routed) costs one DRAM round trip per item, a dense top-8 four.
  Then the FMAs run in ``k`` order (an explicit ``fma``: one rounding, as in the reference).
* 64 bytes of a row per thread and 2 rows in flight at 80 registers (3 blocks of 256
  threads per SM; sm_90a spills a few words of loop state, outside the row loop).
* Positions outside ``[0, num_rows)`` are skipped (a consistent mapping has none).
* ``with_weights``, ``with_x_sf``, ``with_sf``: run-time flags (uniform branches).
* Offsets into ``x`` and ``out`` are 64-bit (TileLang widens buffer indices).

Static configurations: ``in_dtype`` (bfloat16, float32) x ``out_dtype`` (the input's, or
float8_e4m3fn): 4 kernels for every hidden size, top-k and option.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 256
PIECES = 4  # 16-byte pieces of a row per thread
C = 2  # routed rows loaded together
KC = 8  # positions loaded together
MIN_BLOCKS_PER_SM = 3  # <= 85 registers per thread
IN_BYTES = {"bfloat16": 2, "float32": 4}
OUT_DTYPES = {"bfloat16": ("bfloat16", "float8_e4m3fn"), "float32": ("float32", "float8_e4m3fn")}
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own token / position tests
    "tl.disable_safe_memory_legalize": True,
}

DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_prefetch_l1_if(const void* p, int cond) {
  asm volatile("{ .reg .pred q; setp.ne.s32 q, %1, 0; @q prefetch.global.L1 [%0]; }" :: "l"(p), "r"(cond));
}
"""


def host_constants(in_dtype: str, out_dtype: str) -> dict:
    """Elements of a row per thread (``hidden`` must be a multiple of it); the threads of a
    block and the blocks of one SM that the launch bounds promise (the grid's size)."""
    return {"elements_per_lane": PIECES * 16 // IN_BYTES[in_dtype], "threads": THREADS,
            "blocks_per_sm": MIN_BLOCKS_PER_SM}


def reduce_fused_kernel(in_dtype: str, out_dtype: str):
    assert in_dtype in IN_BYTES and out_dtype in OUT_DTYPES[in_dtype]
    piece = 16 // IN_BYTES[in_dtype]
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")  # fused rows (num_expanded_tokens)
    num_topk = T.dynamic("num_topk")
    row_pieces = T.dynamic("row_pieces")  # hidden / piece
    num_weights = T.dynamic("num_weights")  # num_tokens * num_topk with weights, else 0
    num_x_sf = T.dynamic("num_x_sf")  # num_rows with x_sf, else 0

    @T.macro
    def reduce_items(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, num_blocks, with_weights,
                     with_x_sf, with_sf, bid, tid, rows_per_group, pieces):
        """Every item (token, lane) ``first + i * stride`` of this thread: lane's ``pieces``
        16-byte pieces of the token's output row, ``lane + j * lanes_per_row``."""
        acc = T.alloc_local((pieces * piece,), T.float32)
        buf = T.alloc_local((rows_per_group, pieces, piece), in_dtype)
        pos = T.alloc_local((KC,), T.int32)  # a chunk's positions (-1: past the top-k)
        row = T.alloc_local((rows_per_group,), T.int32)  # the rows of a group (-1: none)
        scale = T.alloc_local((rows_per_group,), T.float32)
        pending = T.alloc_var(T.uint32)  # the chunk's routed slots not yet reduced, one bit each
        slot = T.alloc_var(T.int32)
        groups = T.alloc_var(T.int32)
        token = T.alloc_var(T.int32)
        lane = T.alloc_var(T.int32)
        next_token = T.alloc_var(T.int32)
        next_lane = T.alloc_var(T.int32)
        items = T.alloc_var(T.int32)
        # the host bounds num_tokens * lanes_per_row + stride below 2^31
        first = bid * THREADS + tid
        stride = num_blocks * THREADS
        step_tokens = stride // lanes_per_row
        step_lanes = stride - step_tokens * lanes_per_row
        token = first // lanes_per_row
        lane = first - token * lanes_per_row
        items = 0
        if token < num_tokens:
            items = (num_tokens * lanes_per_row - 1 - first) // stride + 1
        for _ in T.serial(items):
            next_lane = lane + step_lanes
            next_token = token + step_tokens
            if next_lane >= lanes_per_row:
                next_lane = next_lane - lanes_per_row
                next_token = next_token + 1
            # the next item's positions to L1 (both ends of its row of token_topk_to_pos): its
            # first round trip is then an L1 hit, while this item's rows are in flight
            T.evaluate(T.call_extern("void", "tka_prefetch_l1_if",
                                     T.address_of(token_topk_to_pos[T.min(next_token, num_tokens - 1), 0]),
                                     T.Cast("int32", next_token < num_tokens and num_topk > 0)))
            T.evaluate(T.call_extern("void", "tka_prefetch_l1_if",
                                     T.address_of(token_topk_to_pos[T.min(next_token, num_tokens - 1), num_topk - 1]),
                                     T.Cast("int32", next_token < num_tokens and num_topk > 0)))
            for e in T.unroll(pieces * piece):
                acc[e] = T.float32(0)
            for c in T.serial(T.ceildiv(num_topk, KC)):
                for i in T.unroll(KC):
                    pos[i] = -1
                    if c * KC + i < num_topk:
                        pos[i] = token_topk_to_pos[token, c * KC + i]
                # the routed slots, in k order (the lowest pending bit first)
                pending = T.uint32(0)
                for i in T.unroll(KC):
                    if pos[i] >= 0 and pos[i] < num_rows:
                        pending = pending | T.uint32(1 << i)
                # the group count fixed before the loop: a bound over `pending` itself would be
                # re-evaluated after each group has consumed its bits
                groups = T.ceildiv(T.call_extern(T.int32, "__popc", pending), rows_per_group)
                for g in T.serial(groups):
                    for s in T.unroll(rows_per_group):
                        slot = T.call_extern(T.int32, "__ffs", pending) - 1  # -1: none left
                        pending = pending & (pending - T.uint32(1))
                        row[s] = -1
                        if slot >= 0:
                            # read again (an L1 hit) rather than kept: 8 registers fewer
                            row[s] = token_topk_to_pos[token, c * KC + slot]
                        # every load of the group (rows, weights, x_sf) in flight before the first FMA
                        scale[s] = T.float32(1)
                        if row[s] >= 0:
                            for j in T.unroll(pieces):
                                for u in T.vectorized(piece):
                                    buf[s, j, u] = x[row[s], lane + j * lanes_per_row, u]
                            if with_weights != 0:
                                scale[s] = topk_weights[token * num_topk + c * KC + slot]
                    for s in T.unroll(rows_per_group):
                        if row[s] >= 0 and with_x_sf != 0:
                            scale[s] = scale[s] * x_sf[row[s]]
                    # the reference's order: k ascending, one rounding per step
                    for s in T.unroll(rows_per_group):
                        if row[s] >= 0:
                            for j in T.unroll(pieces):
                                for u in T.unroll(piece):
                                    acc[j * piece + u] = T.fma(
                                        T.cast(buf[s, j, u], T.float32), scale[s], acc[j * piece + u])
            if with_sf != 0:
                for e in T.unroll(pieces * piece):
                    acc[e] = acc[e] * sf[0]
            for j in T.unroll(pieces):
                for u in T.vectorized(piece):
                    out[token, lane + j * lanes_per_row, u] = T.cast(acc[j * piece + u], out_dtype)
            token = next_token
            lane = next_lane

    @T.prim_func
    def reduce_fused(
        x: T.Tensor[(num_rows, row_pieces, piece), in_dtype],
        x_sf: T.Tensor[(num_x_sf,), T.float32],
        topk_weights: T.Tensor[(num_weights,), T.float32],
        token_topk_to_pos: T.Tensor[(num_tokens, num_topk), T.int32],
        sf: T.Tensor[(1,), T.float32],
        out: T.Tensor[(num_tokens, row_pieces, piece), out_dtype],
        lanes_per_row: T.int32,
        num_blocks: T.int32,
        with_weights: T.int32,
        with_x_sf: T.int32,
        with_sf: T.int32,
    ):
        with T.Kernel(num_blocks, threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.import_source(DEVICE_SOURCE)
            T.assume(lanes_per_row > 0)
            T.assume(num_blocks > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            reduce_items(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, num_blocks, with_weights,
                         with_x_sf, with_sf, bid, tid, C, PIECES)

    return reduce_fused
