"""moe.expand_to_fused (+ ``_with_sf``): copy each token's row to every fused row it is routed to.

``x`` [num_tokens, hidden] (any dtype: the kernel moves bytes) -> ``out`` [num_rows, hidden]
with ``out[token_topk_to_pos[t, k]] = x[t]`` for every routed pair (``pos >= 0``) and zero
rows where ``pos_to_expert < 0`` (padding).  With scale factors, ``x_sf`` [num_tokens,
sf_cols] (32-bit words: fp32 or packed UE8M0) moves the same way into ``out_sf``, whose
element ``[row, col]`` lies at ``row * sf_row_stride + col * sf_col_stride`` (row-major or
TMA-aligned column-major), zero on padding rows.

Design
------
Bound by memory: every byte of ``x`` is read once, every byte of ``out`` written once.

* A row is ``row_vecs`` 16-byte vectors (``hidden * element_size / 16``; the host checks that
  it is whole and that the pointers are 16-byte aligned).  ``lanes_per_row =
  ceil(row_vecs / VPT)`` threads share a row; lane ``l`` owns vectors ``l, l + lanes, ...``
  (``VPT`` of them), so each load or store instruction of a warp covers contiguous bytes.
* The flat thread index runs over ``max(num_tokens, num_rows)`` row slots times the lanes
  (one 32-bit division per thread).  Slot ``r``, if it is a token, loads its row's vectors
  (all ``VPT`` in flight) and its positions ``KC`` at a time (run-time top-k, any size) and
  stores the vectors to each routed row; then, if fused row ``r`` is padding (its flag
  loaded with the row), zeroes it.  Every load is issued before the first store, so one
  memory round trip serves a thread (top-k <= 8).  The scale-factor words follow the same
  lanes (``lane, lane + lanes, ...``), one 32-bit word each.
* Positions outside ``[0, num_rows)`` are skipped (a consistent mapping has none).
* Offsets into ``x``, ``out`` and ``out_sf`` are 64-bit (TileLang widens buffer indices);
  the flat thread index is 32-bit (the host bounds ``slots * lanes_per_row``).

No static configuration: one kernel serves every dtype, hidden size, top-k and
scale-factor layout.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid

THREADS = 256
VPT = 4  # 16-byte vectors per thread (64 bytes of a row in flight per thread)
KC = 8  # positions loaded together (top-k <= 8 in one round trip; more in rounds of 8)
MIN_BLOCKS_PER_SM = 4  # <= 64 registers: 1024 threads, 64 KB of loads in flight per SM
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / vector / word tests
    "tl.disable_safe_memory_legalize": True,
}


def host_constants() -> dict:
    return {"vectors_per_thread": VPT}


def expand_to_fused_kernel():
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")  # fused rows (num_expanded_tokens)
    num_topk = T.dynamic("num_topk")
    row_vecs = T.dynamic("row_vecs")  # 16-byte vectors per row
    sf_cols = T.dynamic("sf_cols")  # 32-bit scale-factor words per row (0: none)
    out_sf_words = T.dynamic("out_sf_words")  # storage of out_sf

    @T.prim_func
    def expand_to_fused(
        x: T.Tensor[(num_tokens, row_vecs, 4), T.uint32],
        out: T.Tensor[(num_rows, row_vecs, 4), T.uint32],
        token_topk_to_pos: T.Tensor[(num_tokens, num_topk), T.int32],
        pos_to_expert: T.Tensor[(num_rows,), T.int32],
        x_sf: T.Tensor[(num_tokens, sf_cols), T.uint32],
        out_sf: T.Tensor[(out_sf_words,), T.uint32],
        lanes_per_row: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(T.max(num_tokens, num_rows) * lanes_per_row, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(lanes_per_row > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            buf = T.alloc_local((VPT, 4), T.uint32)
            pos = T.alloc_local((KC,), T.int32)
            word = T.alloc_var(T.uint32)
            row = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            row = (bid * THREADS + tid) // lanes_per_row
            lane = (bid * THREADS + tid) - row * lanes_per_row

            # Every load is issued before the first store (the compiler may not move loads of
            # x past stores to out): the row's padding flag, its vectors, its first positions.
            padding = T.alloc_var(T.bool)
            padding = False
            if row < num_rows:
                padding = pos_to_expert[row] < 0

            # ---- a token: its row to every fused row it is routed to
            if row < num_tokens:
                for j in T.unroll(VPT):
                    if lane + j * lanes_per_row < row_vecs:
                        for u in T.vectorized(4):
                            buf[j, u] = x[row, lane + j * lanes_per_row, u]
                for c in T.serial(T.ceildiv(num_topk, KC)):
                    for i in T.unroll(KC):
                        pos[i] = -1
                        if c * KC + i < num_topk:
                            pos[i] = token_topk_to_pos[row, c * KC + i]
                    for i in T.unroll(KC):
                        if pos[i] >= 0 and pos[i] < num_rows:
                            for j in T.unroll(VPT):
                                if lane + j * lanes_per_row < row_vecs:
                                    for u in T.vectorized(4):
                                        out[pos[i], lane + j * lanes_per_row, u] = buf[j, u]
                    for s in T.serial(T.ceildiv(sf_cols, lanes_per_row)):
                        if lane + s * lanes_per_row < sf_cols:
                            word = x_sf[row, lane + s * lanes_per_row]
                            for i in T.unroll(KC):
                                if pos[i] >= 0 and pos[i] < num_rows:
                                    out_sf[pos[i] * sf_row_stride + (lane + s * lanes_per_row) * sf_col_stride] = word

            # ---- a padding row of the fused layout: zeros
            if padding:
                for j in T.unroll(VPT):
                    if lane + j * lanes_per_row < row_vecs:
                        for u in T.vectorized(4):
                            out[row, lane + j * lanes_per_row, u] = T.uint32(0)
                for i in T.serial(T.ceildiv(sf_cols, lanes_per_row)):
                    if lane + i * lanes_per_row < sf_cols:
                        out_sf[row * sf_row_stride + (lane + i * lanes_per_row) * sf_col_stride] = T.uint32(0)

    return expand_to_fused
