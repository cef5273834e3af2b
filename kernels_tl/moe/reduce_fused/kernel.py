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
  remainder (no division per item; the host bounds ``items + 2 * stride`` below 2^31).
* Rows travel by ``cp.async`` into the thread's own slots of shared memory (no register
  holds a row in flight, and a thread reads only what it copied, so the wait alone orders
  it: no barrier).  A thread's items form a software pipeline, one item deep:
  while item ``i`` is reduced, the first ``C = 2`` routed rows of item ``i + 1`` (with their
  weights and ``x_sf``) are already in flight in the other slot set, and the positions of
  item ``i + 2`` (``KC = 8`` slots, plain loads into registers) travel too.  At upstream's
  sparse layout (about 1.3 of 6 slots routed) a thread thus keeps two items' rows in
  flight and no round trip of its own on the critical path.
* The routed rows beyond the first ``C`` of the first ``KC`` slots (a dense top-8, a
  top-k above 8) follow in groups of ``C`` in ``k`` order, each loaded and waited for in
  turn (their positions read again: L1 hits).  The FMAs run in ``k`` order (an explicit
  ``fma``: one rounding, as in the reference).
* Positions outside ``[0, num_rows)`` are skipped (a consistent mapping has none).
* ``with_weights``, ``with_x_sf``, ``with_sf``: run-time flags (uniform branches).
* Offsets into ``x`` and ``out`` are 64-bit (TileLang widens buffer indices).

Static configurations: ``in_dtype`` (bfloat16, float32) x ``out_dtype`` (the input's, or
float8_e4m3fn): 4 kernels for every hidden size, top-k and option.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.engram import cp_async

THREADS = 256
PIECES = 4  # 16-byte pieces of a row per thread
C = 2  # routed rows of an item in flight ahead of it (per slot set)
KC = 8  # positions loaded together
SETS = 2  # slot sets: the item being reduced, the next one
MIN_BLOCKS_PER_SM = 3  # <= 85 registers per thread; 3 x 72 KB of shared memory
IN_BYTES = {"bfloat16": 2, "float32": 4}
OUT_DTYPES = {"bfloat16": ("bfloat16", "float8_e4m3fn"), "float32": ("float32", "float8_e4m3fn")}
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own token / position tests
    "tl.disable_safe_memory_legalize": True,
}

DEVICE_SOURCE = cp_async.DEVICE_SOURCE + r"""
__device__ __forceinline__ void tka_rf_cp_async_4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(s), "l"(gmem) : "memory");
}
"""


def _copy4(dst, src):
    return T.call_extern("void", "tka_rf_cp_async_4", T.address_of(dst), T.address_of(src))


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
    def load_positions(token_topk_to_pos, pos, token, chunk):
        """Slots ``chunk * KC ..`` of the token's positions (-1 past the top-k)."""
        for i in T.unroll(KC):
            pos[i] = -1
            if chunk * KC + i < num_topk:
                pos[i] = token_topk_to_pos[token, chunk * KC + i]

    @T.macro
    def issue_rows(x, x_sf, topk_weights, rows_s, w_s, xsf_s, pos, mask, count, token, lane, chunk, slot_set,
                   lanes_per_row, with_weights, with_x_sf, tid):
        """The lowest ``C`` slots of ``mask`` (bits of ``pos``), in ``k`` order, to the slots
        ``0 .. count[0] - 1`` of ``slot_set``: the rows' pieces, weights and ``x_sf`` by
        ``cp.async`` (not committed); their bits leave ``mask[0]``.  (``mask``, ``count``:
        one-element local buffers, written in place.)"""
        count[0] = 0
        for i in T.unroll(KC):
            if (mask[0] >> T.uint32(i)) & T.uint32(1) != T.uint32(0) and count[0] < C:
                for j in T.unroll(PIECES):
                    T.evaluate(cp_async.copy16(rows_s[(slot_set * C + count[0]) * PIECES + j, tid, 0],
                                               x[pos[i], lane + j * lanes_per_row, 0]))
                if with_weights != 0:
                    T.evaluate(_copy4(w_s[slot_set * C + count[0], tid],
                                      topk_weights[token * num_topk + chunk * KC + i]))
                if with_x_sf != 0:
                    T.evaluate(_copy4(xsf_s[slot_set * C + count[0], tid], x_sf[pos[i]]))
                mask[0] = mask[0] & ~T.uint32(1 << i)
                count[0] = count[0] + 1

    @T.macro
    def reduce_rows(rows_s, w_s, xsf_s, acc, v, count, slot_set, with_weights, with_x_sf, tid):
        """acc += the ``count`` rows of ``slot_set`` (landed), in slot order."""
        for s in T.unroll(C):
            if s < count:
                scale = T.alloc_var(T.float32)
                scale = T.float32(1)
                if with_weights != 0:
                    scale = w_s[slot_set * C + s, tid]
                if with_x_sf != 0:
                    scale = scale * xsf_s[slot_set * C + s, tid]
                for j in T.unroll(PIECES):
                    for u in T.vectorized(piece):
                        v[u] = rows_s[(slot_set * C + s) * PIECES + j, tid, u]
                    for u in T.unroll(piece):
                        acc[j * piece + u] = T.fma(T.cast(v[u], T.float32), scale, acc[j * piece + u])

    @T.macro
    def routed_mask(pos, mask):
        """``mask[0]``: the slots of ``pos`` that hold a fused row."""
        mask[0] = T.uint32(0)
        for i in T.unroll(KC):
            if pos[i] >= 0 and pos[i] < num_rows:
                mask[0] = mask[0] | T.uint32(1 << i)

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
            # a thread's slots: [slot set, slot, piece] x thread (consecutive threads, consecutive
            # 16-byte words: conflict-free)
            rows_s = T.alloc_shared((SETS * C * PIECES, THREADS, piece), in_dtype)
            w_s = T.alloc_shared((SETS * C, THREADS), T.float32)
            xsf_s = T.alloc_shared((SETS * C, THREADS), T.float32)
            acc = T.alloc_local((PIECES * piece,), T.float32)
            v = T.alloc_local((piece,), in_dtype)
            pos = T.alloc_local((KC,), T.int32)  # positions of the item two ahead (in flight)
            rpos = T.alloc_local((KC,), T.int32)  # positions of the item's later rows
            cur_count = T.alloc_var(T.int32)  # item i: rows landed in its slot set
            cur_rest = T.alloc_var(T.uint32)  # item i: routed slots of chunk 0 not yet loaded
            nxt_count = T.alloc_var(T.int32)
            nxt_rest = T.alloc_var(T.uint32)
            mask = T.alloc_local((1,), T.uint32)
            count = T.alloc_local((1,), T.int32)
            token = T.alloc_var(T.int32)  # item i
            lane = T.alloc_var(T.int32)
            nxt_token = T.alloc_var(T.int32)  # item i + 1
            nxt_lane = T.alloc_var(T.int32)
            far_token = T.alloc_var(T.int32)  # item i + 2
            far_lane = T.alloc_var(T.int32)
            items = T.alloc_var(T.int32)
            groups = T.alloc_var(T.int32)
            sf_value = T.alloc_var(T.float32)
            # the host bounds num_tokens * lanes_per_row + 2 * stride below 2^31
            first = bid * THREADS + tid
            stride = num_blocks * THREADS
            step_tokens = stride // lanes_per_row
            step_lanes = stride - step_tokens * lanes_per_row
            token = first // lanes_per_row
            lane = first - token * lanes_per_row
            items = 0
            if token < num_tokens:
                items = (num_tokens * lanes_per_row - 1 - first) // stride + 1
            sf_value = T.float32(1)
            if with_sf != 0 and items > 0:
                sf_value = sf[0]
            nxt_lane = lane + step_lanes
            nxt_token = token + step_tokens
            if nxt_lane >= lanes_per_row:
                nxt_lane = nxt_lane - lanes_per_row
                nxt_token = nxt_token + 1

            # ---- prologue: item 0's first rows in flight (slot set 0), item 1's positions
            cur_count = 0
            cur_rest = T.uint32(0)
            if items > 0:
                load_positions(token_topk_to_pos, pos, token, 0)
                routed_mask(pos, mask)
                issue_rows(x, x_sf, topk_weights, rows_s, w_s, xsf_s, pos, mask, count, token, lane, 0, 0,
                           lanes_per_row, with_weights, with_x_sf, tid)
                cur_count = count[0]
                cur_rest = mask[0]
            cp_async.commit()
            if items > 1:
                load_positions(token_topk_to_pos, pos, nxt_token, 0)

            for it in T.serial(items):
                cur_set = it % SETS
                # ---- item i + 1: its first rows in flight (the other set), one group per item
                nxt_count = 0
                nxt_rest = T.uint32(0)
                if it + 1 < items:
                    routed_mask(pos, mask)
                    issue_rows(x, x_sf, topk_weights, rows_s, w_s, xsf_s, pos, mask, count, nxt_token, nxt_lane,
                               0, 1 - cur_set, lanes_per_row, with_weights, with_x_sf, tid)
                    nxt_count = count[0]
                    nxt_rest = mask[0]
                cp_async.commit()
                # ---- item i + 2: its positions in flight (registers, used next iteration)
                far_lane = nxt_lane + step_lanes
                far_token = nxt_token + step_tokens
                if far_lane >= lanes_per_row:
                    far_lane = far_lane - lanes_per_row
                    far_token = far_token + 1
                if it + 2 < items:
                    load_positions(token_topk_to_pos, pos, far_token, 0)
                # ---- item i: its first rows have landed (all groups but the newest)
                cp_async.wait(1)
                for e in T.unroll(PIECES * piece):
                    acc[e] = T.float32(0)
                reduce_rows(rows_s, w_s, xsf_s, acc, v, cur_count, cur_set, with_weights, with_x_sf, tid)
                # its later routed rows (a dense top-k, a top-k past KC), C at a time, k order
                for c in T.serial(T.ceildiv(num_topk, KC)):
                    mask[0] = cur_rest
                    if c > 0 or cur_rest != T.uint32(0):
                        load_positions(token_topk_to_pos, rpos, token, c)
                    if c > 0:
                        routed_mask(rpos, mask)
                    # the group count fixed before the loop (a bound over the mask itself would be
                    # evaluated again after each group has taken its bits)
                    groups = T.ceildiv(T.call_extern(T.int32, "__popc", mask[0]), C)
                    for g in T.serial(groups):
                        issue_rows(x, x_sf, topk_weights, rows_s, w_s, xsf_s, rpos, mask, count, token, lane, c,
                                   cur_set, lanes_per_row, with_weights, with_x_sf, tid)
                        cp_async.commit()
                        cp_async.wait(0)
                        reduce_rows(rows_s, w_s, xsf_s, acc, v, count[0], cur_set, with_weights, with_x_sf, tid)
                if with_sf != 0:
                    for e in T.unroll(PIECES * piece):
                        acc[e] = acc[e] * sf_value
                for j in T.unroll(PIECES):
                    for u in T.vectorized(piece):
                        out[token, lane + j * lanes_per_row, u] = T.cast(acc[j * piece + u], out_dtype)
                token = nxt_token
                lane = nxt_lane
                nxt_token = far_token
                nxt_lane = far_lane
                cur_count = nxt_count
                cur_rest = nxt_rest

    return reduce_fused
