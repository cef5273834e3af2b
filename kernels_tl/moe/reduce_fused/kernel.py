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
Bound by memory: the routed rows of ``x`` are read once (gathered), ``out`` written once.  Two
kernels (the static key ``path``; the host picks one per call): ``"burst"`` when its grid fits
in one wave of the device's SMs (small token counts), ``"stream"`` otherwise.  Both run the
arithmetic below through the same macros (``_issue_row``, ``_accumulate``, ``_finish``), so
the output does not depend on the path.

Stream path
~~~~~~~~~~~

* A piece is 16 bytes of ``x`` (8 bf16 or 4 fp32 values).  A thread owns ``PIECES = 8``
  pieces of its token's row (128 bytes), ``lane + j * lanes_per_row`` (interleaved, so each
  warp instruction covers 512 contiguous bytes); ``lanes_per_row = hidden / (PIECES * piece)``
  exactly, since ``hidden % 256 == 0``: no tail, no guard per piece.
* An item is (token, lane).  The grid is at most one wave (``blocks_per_sm`` blocks of 128
  threads per SM, the host's choice from the SM count); thread ``f`` takes items ``f, f +
  stride, ..`` (``stride`` = the grid's threads), the token and lane advanced by a fixed
  quotient and remainder (no division per item; the host bounds ``items + stride`` below 2^31).
* An item's time is memory round trips, so the positions travel one item ahead, in
  registers: while item ``i``'s first group of rows is in flight, the thread loads item
  ``i + 1``'s positions (slots ``0 .. KC - 1``, ``KC = 8``) and resolves them at once
  (``resolve_first``): the rows and slots of its lowest ``C = 2`` routed slots (``k`` order,
  a bit mask taken lowest bit first) and a mask of its other routed slots.  Item ``i + 1``
  then issues its first rows (with their weights and ``x_sf``) with no dependent load ahead
  of them: at upstream's sparse layout (about 1.3 of 6 slots routed) an item costs one DRAM
  round trip, with 128 to 256 bytes per thread in flight.  No load crosses the loop's back
  edge (the resolved values are plain integers), so no register copy waits on memory.
* Later routed rows (the rest of the first ``KC`` slots: a dense top-k; slots past ``KC``)
  follow in groups of ``C`` in ``k`` order, one round trip each (chunk 0's positions read
  again: L1 hits).  The accumulators are first written by the first group's FMAs, so they
  hold no register while its rows travel; the FMAs run in ``k`` order (an explicit ``fma``:
  one rounding, as in the reference).
* Registers: 2 rows x 128 bytes + 64 fp32 accumulators fit the 168 registers of 3 blocks of
  128 threads per SM, without spills (bf16: 168, fp32: 139-144, on sm_90a and sm_100a).
* Positions outside ``[0, num_rows)`` are skipped (a consistent mapping has none).
* ``with_weights``, ``with_x_sf``, ``with_sf``: run-time flags (uniform branches).
* Offsets into every input and ``out`` are 64-bit (TileLang widens buffer indices).
* ``sf[0]`` is read once per thread; every access follows the dependent-launch wait.

Burst path
~~~~~~~~~~
For a call whose grid of one thread per (token, 32-byte slice) is resident at once
(``BURST_BLOCKS_PER_SM`` blocks of ``BURST_THREADS`` per SM): the cost of an item is its
chain of dependent round trips, so the chain is made as short as it can be.

* A thread owns ``BURST_VECTORS = 2`` interleaved 16-byte pieces of one token's row (``lane +
  j * lanes_per_row``, as the stream path); ``lanes_per_row = hidden / (2 * piece)`` exactly.
* It loads the token's positions ``0 .. KC - 1`` (``sf`` beside them), then issues the loads of
  every routed row among them at once (8 x 32 bytes, with their weights and ``x_sf``): one round
  trip for the positions, one for all the rows.  A top-k past ``KC`` runs in rounds of ``KC``
  slots, the next round's positions loaded while this round's rows travel (they overwrite the
  position registers once the rows' addresses are issued; a bit mask keeps the routed slots).
* The FMAs then run in ``k`` order, then ``acc * sf``, the conversion and the store.
* Registers: 8 rows x 8 (32 bytes each) + positions, weights and ``x_sf`` while the rows travel; round 0 (peeled
  from the rounds' loop) zeroes the 16 accumulators only after issuing its rows, so they hold no
  register then.  Launch bounds ask for ``BURST_BLOCKS_PER_SM = 4`` blocks of 128 threads per
  SM (<= 128 registers: bf16 128, fp32 120-123, no spill, on sm_90a and sm_100a).

Static configurations: ``in_dtype`` (bfloat16, float32) x ``out_dtype`` (the input's, or
float8_e4m3fn) x ``path``: 8 kernels for every hidden size, top-k and option.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 128
PIECES = 8  # 16-byte pieces of a row per thread (128 bytes)
C = 2  # routed rows loaded together
KC = 8  # positions of a chunk (the slots the first group and the resolved mask cover; a burst round)
MIN_BLOCKS_PER_SM = 3  # <= 168 registers per thread
PATHS = ("stream", "burst")
BURST_THREADS = 128
BURST_VECTORS = 2  # burst path: 16-byte pieces of a row per thread (32 bytes)
BURST_BLOCKS_PER_SM = 4  # burst path: <= 128 registers per thread
IN_BYTES = {"bfloat16": 2, "float32": 4}
OUT_DTYPES = {"bfloat16": ("bfloat16", "float8_e4m3fn"), "float32": ("float32", "float8_e4m3fn")}
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own token / position tests
    "tl.disable_safe_memory_legalize": True,
}


def host_constants(in_dtype: str, out_dtype: str, path: str) -> dict:
    """Elements of a row per thread (``hidden`` must be a multiple of it); the threads of a
    block and the blocks of one SM that the launch bounds promise (the size of one wave);
    whether this is the burst kernel (one thread per item, any grid) or the stream kernel (a
    grid of at most one wave, each thread walking its items)."""
    burst = path == "burst"
    return {"elements_per_lane": (BURST_VECTORS if burst else PIECES) * 16 // IN_BYTES[in_dtype],
            "threads": BURST_THREADS if burst else THREADS,
            "blocks_per_sm": BURST_BLOCKS_PER_SM if burst else MIN_BLOCKS_PER_SM, "burst": int(burst)}


# ---- the arithmetic of both paths (one routed row's loads, its FMAs, the scale and the store) --

@T.macro
def _issue_row(x, x_sf, topk_weights, buf, w, xs, s, row, weight_index, lane, lanes_per_row, with_weights,
               with_x_sf, pieces, piece):
    """The loads of routed row ``row`` (in ``[0, num_rows)``) for one thread: its ``pieces``
    16-byte pieces ``lane + j * lanes_per_row`` into ``buf[s]``, its weight into ``w[s]`` and
    its ``x_sf`` into ``xs[s]`` (each left as the caller set it, 1, without)."""
    for j in T.unroll(pieces):
        for u in T.vectorized(piece):
            buf[s, j, u] = x[row, lane + j * lanes_per_row, u]
    if with_weights != 0:
        w[s] = topk_weights[weight_index]
    if with_x_sf != 0:
        xs[s] = x_sf[row]


@T.macro
def _accumulate(acc, buf, w, xs, s, with_x_sf, pieces, piece):
    """One routed row's step, the reference's: ``s = w * x_sf`` (a float32 multiply, only with
    ``x_sf``), then ``acc = fma(float(x), s, acc)`` (one rounding) per element."""
    if with_x_sf != 0:
        w[s] = w[s] * xs[s]
    for j in T.unroll(pieces):
        for u in T.unroll(piece):
            acc[j * piece + u] = T.fma(T.cast(buf[s, j, u], T.float32), w[s], acc[j * piece + u])


@T.macro
def _finish(out, acc, token, lane, lanes_per_row, with_sf, sf_value, pieces, piece, out_dtype):
    """``acc * sf`` (with ``sf``), rounded to ``out_dtype`` (e4m3: ``cvt.rn.satfinite``) and
    stored as the thread's pieces of the token's output row."""
    if with_sf != 0:
        for e in T.unroll(pieces * piece):
            acc[e] = acc[e] * sf_value
    for j in T.unroll(pieces):
        for u in T.vectorized(piece):
            out[token, lane + j * lanes_per_row, u] = T.cast(acc[j * piece + u], out_dtype)




def reduce_fused_kernel(in_dtype: str, out_dtype: str, path: str):
    if path not in PATHS:
        raise ValueError(f"moe.reduce_fused: path must be one of {PATHS}, got {path!r}")
    assert in_dtype in IN_BYTES and out_dtype in OUT_DTYPES[in_dtype]
    burst = path == "burst"
    piece = 16 // IN_BYTES[in_dtype]
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")  # fused rows (num_expanded_tokens)
    num_topk = T.dynamic("num_topk")
    row_pieces = T.dynamic("row_pieces")  # hidden / piece
    num_weights = T.dynamic("num_weights")  # num_tokens * num_topk with weights, else 0
    num_x_sf = T.dynamic("num_x_sf")  # num_rows with x_sf, else 0

    @T.macro
    def load_chunk(token_topk_to_pos, p, mask, token, c):
        """The token's positions ``c * KC .. c * KC + KC - 1`` into ``p`` (-1 past the top-k) and
        a bit mask of the routed ones (in ``[0, num_rows)``) into ``mask[0]``."""
        for i in T.unroll(KC):
            p[i] = -1
            if c * KC + i < num_topk:
                p[i] = token_topk_to_pos[token, c * KC + i]
        mask[0] = T.uint32(0)
        for i in T.unroll(KC):
            if p[i] >= 0 and p[i] < num_rows:
                mask[0] = mask[0] | T.uint32(1 << i)

    @T.macro
    def resolve_first(token_topk_to_pos, p, token, first_row, first_slot, rest):
        """The token's slots ``0 .. KC - 1``: the rows of its lowest ``C`` routed slots (in
        ``k`` order; -1: none) and their slots into ``first_row`` / ``first_slot``; its other
        routed slots among them as a bit mask into ``rest[0]``.  (Registers only: the positions
        are loaded, tested and selected here, never read again.)"""
        load_chunk(token_topk_to_pos, p, rest, token, 0)
        for s in T.unroll(C):
            first_slot[s] = T.call_extern(T.int32, "__ffs", rest[0]) - 1  # -1: none left
            rest[0] = rest[0] & (rest[0] - T.uint32(1))
            first_row[s] = -1
            for i in T.unroll(KC):
                if first_slot[s] == i:
                    first_row[s] = p[i]

    @T.macro
    def stream(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, num_blocks, with_weights, with_x_sf,
               with_sf, bid, tid):
        """The stream path (module docstring): a grid of at most one wave, each thread walking
        its items with the positions one item ahead."""
        acc = T.alloc_local((PIECES * piece,), T.float32)
        buf = T.alloc_local((C, PIECES, piece), in_dtype)
        p = T.alloc_local((KC,), T.int32)  # a chunk's positions (-1: past the top-k)
        w = T.alloc_local((C,), T.float32)  # a group's weights (1 without)
        xs = T.alloc_local((C,), T.float32)  # a group's x_sf (1 without)
        row = T.alloc_local((C,), T.int32)  # a later group's rows (-1: none)
        cur_row = T.alloc_local((C,), T.int32)  # this item's first group (-1: none)
        cur_slot = T.alloc_local((C,), T.int32)
        cur_rest = T.alloc_local((1,), T.uint32)  # this item's other routed slots of chunk 0
        nxt_row = T.alloc_local((C,), T.int32)  # the next item's first group
        nxt_slot = T.alloc_local((C,), T.int32)
        nxt_rest = T.alloc_local((1,), T.uint32)
        mask = T.alloc_local((1,), T.uint32)
        slot = T.alloc_var(T.int32)
        groups = T.alloc_var(T.int32)
        token = T.alloc_var(T.int32)
        lane = T.alloc_var(T.int32)
        nxt_token = T.alloc_var(T.int32)
        nxt_lane = T.alloc_var(T.int32)
        items = T.alloc_var(T.int32)
        sf_value = T.alloc_var(T.float32)
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
        sf_value = T.float32(1)
        if with_sf != 0 and items > 0:
            sf_value = sf[0]
        # the first item's first group (its positions' round trip is the only one not
        # overlapped with rows)
        for s in T.unroll(C):
            cur_row[s] = -1
            cur_slot[s] = 0
        cur_rest[0] = T.uint32(0)
        if items > 0:
            resolve_first(token_topk_to_pos, p, token, cur_row, cur_slot, cur_rest)
        for it in T.serial(items):
            nxt_lane = lane + step_lanes
            nxt_token = token + step_tokens
            if nxt_lane >= lanes_per_row:
                nxt_lane = nxt_lane - lanes_per_row
                nxt_token = nxt_token + 1
            # ---- this item's first group in flight: rows, weights, x_sf (addresses resolved
            # during the previous item: no dependent load ahead of them)
            for s in T.unroll(C):
                w[s] = T.float32(1)
                xs[s] = T.float32(1)
                if cur_row[s] >= 0:
                    _issue_row(x, x_sf, topk_weights, buf, w, xs, s, cur_row[s], token * num_topk + cur_slot[s], lane,
                               lanes_per_row, with_weights, with_x_sf, PIECES, piece)
            # ---- the next item's positions: loaded and resolved while those rows travel
            for s in T.unroll(C):
                nxt_row[s] = -1
                nxt_slot[s] = 0
            nxt_rest[0] = T.uint32(0)
            if it + 1 < items:
                resolve_first(token_topk_to_pos, p, nxt_token, nxt_row, nxt_slot, nxt_rest)
            # ---- the first group's FMAs, in k order (the reference's: one rounding per step)
            for e in T.unroll(PIECES * piece):
                acc[e] = T.float32(0)
            for s in T.unroll(C):
                if cur_row[s] >= 0:
                    _accumulate(acc, buf, w, xs, s, with_x_sf, PIECES, piece)
            # ---- the item's later routed rows (a dense top-k; a top-k past KC), C at a time in
            # k order, each group one round trip (chunk 0's positions read again: L1 hits)
            for c in T.serial(T.ceildiv(num_topk, KC)):
                if c == 0:
                    mask[0] = cur_rest[0]
                else:
                    load_chunk(token_topk_to_pos, p, mask, token, c)
                # the group count fixed before the loop: a bound over `mask` itself would be
                # re-evaluated after each group has consumed its bits
                groups = T.ceildiv(T.call_extern(T.int32, "__popc", mask[0]), C)
                for g in T.serial(groups):
                    for s in T.unroll(C):
                        slot = T.call_extern(T.int32, "__ffs", mask[0]) - 1  # -1: none left
                        mask[0] = mask[0] & (mask[0] - T.uint32(1))
                        row[s] = -1
                        if slot >= 0:
                            row[s] = token_topk_to_pos[token, c * KC + slot]
                        w[s] = T.float32(1)
                        xs[s] = T.float32(1)
                        if row[s] >= 0 and row[s] < num_rows:
                            _issue_row(x, x_sf, topk_weights, buf, w, xs, s, row[s], token * num_topk + c * KC + slot,
                                       lane, lanes_per_row, with_weights, with_x_sf, PIECES, piece)
                    for s in T.unroll(C):
                        if row[s] >= 0 and row[s] < num_rows:
                            _accumulate(acc, buf, w, xs, s, with_x_sf, PIECES, piece)
            _finish(out, acc, token, lane, lanes_per_row, with_sf, sf_value, PIECES, piece, out_dtype)
            token = nxt_token
            lane = nxt_lane
            for s in T.unroll(C):
                cur_row[s] = nxt_row[s]
                cur_slot[s] = nxt_slot[s]
            cur_rest[0] = nxt_rest[0]

    @T.macro
    def burst_round(x, x_sf, topk_weights, token_topk_to_pos, acc, buf, p, w, xs, mask, token, lane, lanes_per_row,
                    with_weights, with_x_sf, c, first):
        """Burst round ``c`` (slots ``c * KC ..``, positions in ``p``, routed slots in ``mask``):
        every routed row in flight at once, the next round's positions beside them, then the
        FMAs in ``k`` order.  ``first``: round 0, whose FMAs first write the accumulators (so
        they hold no register while its rows travel)."""
        routed = mask[0]  # this round's routed slots (mask: the next round's, once loaded)
        for i in T.unroll(KC):
            w[i] = T.float32(1)
            xs[i] = T.float32(1)
            if (routed >> T.uint32(i)) & T.uint32(1) != T.uint32(0):
                _issue_row(x, x_sf, topk_weights, buf, w, xs, i, p[i], token * num_topk + c * KC + i, lane,
                           lanes_per_row, with_weights, with_x_sf, BURST_VECTORS, piece)
        if (c + 1) * KC < num_topk:
            load_chunk(token_topk_to_pos, p, mask, token, c + 1)
        if first:
            for e in T.unroll(BURST_VECTORS * piece):
                acc[e] = T.float32(0)
        for i in T.unroll(KC):
            if (routed >> T.uint32(i)) & T.uint32(1) != T.uint32(0):
                _accumulate(acc, buf, w, xs, i, with_x_sf, BURST_VECTORS, piece)

    @T.macro
    def burst_path(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, with_weights, with_x_sf, with_sf,
                   bid, tid):
        """The burst path (module docstring): one item per thread; the positions, then every
        routed row of a round at once."""
        acc = T.alloc_local((BURST_VECTORS * piece,), T.float32)
        buf = T.alloc_local((KC, BURST_VECTORS, piece), in_dtype)
        p = T.alloc_local((KC,), T.int32)  # a round's positions (-1: past the top-k)
        w = T.alloc_local((KC,), T.float32)  # a round's weights (1 without)
        xs = T.alloc_local((KC,), T.float32)  # a round's x_sf (1 without)
        mask = T.alloc_local((1,), T.uint32)  # a round's routed slots
        token = T.alloc_var(T.int32)
        lane = T.alloc_var(T.int32)
        sf_value = T.alloc_var(T.float32)
        item = bid * BURST_THREADS + tid  # the host bounds the grid's threads below 2^31
        token = item // lanes_per_row
        lane = item - token * lanes_per_row
        if token < num_tokens:
            sf_value = T.float32(1)
            if with_sf != 0:
                sf_value = sf[0]
            load_chunk(token_topk_to_pos, p, mask, token, 0)
            burst_round(x, x_sf, topk_weights, token_topk_to_pos, acc, buf, p, w, xs, mask, token, lane,
                        lanes_per_row, with_weights, with_x_sf, 0, True)
            for c in T.serial(1, T.ceildiv(num_topk, KC)):
                burst_round(x, x_sf, topk_weights, token_topk_to_pos, acc, buf, p, w, xs, mask, token, lane,
                            lanes_per_row, with_weights, with_x_sf, c, False)
            _finish(out, acc, token, lane, lanes_per_row, with_sf, sf_value, BURST_VECTORS, piece, out_dtype)

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
        with T.Kernel(num_blocks, threads=BURST_THREADS if burst else THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch: before any memory access
            T.assume(lanes_per_row > 0)
            T.assume(num_blocks > 0)
            T.annotate_min_blocks_per_sm(BURST_BLOCKS_PER_SM if burst else MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            if burst:
                burst_path(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, with_weights, with_x_sf,
                           with_sf, bid, tid)
            else:
                stream(x, x_sf, topk_weights, token_topk_to_pos, sf, out, lanes_per_row, num_blocks, with_weights,
                       with_x_sf, with_sf, bid, tid)

    return reduce_fused
