"""quant.per_token_cast (+ ``_with_sf_only``, ``_with_precomputed_sf``): FP8/FP4
quantization of each row in groups of ``num_per_channels`` channels.

``x`` bf16/fp32 [num_tokens, hidden] (rows may be strided) -> ``out`` e4m3
[num_tokens, hidden] or packed e2m1 [num_tokens, hidden / 2] (element ``2j`` in
the low nibble of byte ``j``), and each group's factor ``out_sf``: fp32
row-major, fp32 TMA-aligned column-major, or UE8M0 packed four per int32.  The
arithmetic is the reference's (``tile_kernels_aot.torch.quant``):
``c = max(amax, clamp_min)``, ``sf = c / MAX``, ``sf_inv = MAX / c`` (IEEE
divisions) or, with ``round_sf``, powers of two ``2**ceil(log2(c / MAX))`` taken
on the bits; ``q = encode(float32(x) * sf_inv)`` (e4m3 ``cvt.rn.satfinite``,
e2m1 round-to-nearest-even saturating at 6).

Design
------
Memory-bound; everything lives in registers (shared memory only for the
cross-warp max of one group per row).

* A *piece* is 16 bytes, one ``LDG.128``.  A thread owns 32 values (4 bf16 or 8
  fp32 pieces), every load issued before the first use.
* A group is shared by ``TPG`` consecutive lanes (2 for groups of 32 and 64, 4
  for 128) that read its pieces interleaved (lane ``r``: pieces ``r, r + TPG,
  ...``): each load instruction covers whole 32-byte sectors and the group max
  takes ``log2(TPG)`` shuffles.  A thread covers ``ROUNDS`` consecutive groups
  (``_group_layout``, also the source of the stub's thread count).
* ``lanes_per_row`` threads per row over the flat thread index (one division
  per thread), so hidden and the token count are dynamic.  Groups past a row's
  end load nothing and add 0 to the max.
* One group per row (``group = 0``): ``lanes_per_row`` = next power of two of
  ``hidden / 32`` (hidden <= 8192), a shuffle tree, then an 8-float exchange.
* bf16 max on packed pairs (``max.NaN.bf16x2`` on ``|x|``), one widening per lane:
  widening every element spilled.  Every max keeps NaN (``kernels_tl/nan_max.py``): a
  group holding a NaN gets NaN factors (UE8M0 byte 0xFF) and NaN codes.
* The slot's first lane writes the factors through the sf tensor's two strides;
  packed UE8M0 words gather their bytes from neighbouring slots (``shfl_down``).
  Runtime flags (uniform): ``write_out``, ``read_sf``, ``round_sf``, ``packed_sf``.
* e2m1: sm_100a's ``cvt.rn.satfinite.e2m1x2.f32``; elsewhere a branch-free count
  of rounding boundaries (bit-identical), chosen from the current TVM target.

Static configurations: ``in_dtype`` (bfloat16, float32) x ``fmt`` (e4m3, e2m1)
x ``group`` (32, 64, 128, 0): 16 configs.  bf16 -> e4m3, 8192 x 7168, groups of
128: 42.5 us device time on an H200, 99% of its copy bandwidth (``notes.md``).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.nan_max import DEVICE_SOURCE, bf16x2_max_nan, max_nan
from kernels_tl.quant_encoding import PASS_CONFIGS, MAX_VALUE, e2m1_nibble, has_fp4_convert, scale_factors  # noqa: F401

THREADS = 256  # per block
# Grouped configs: every thread owns 64 bytes of bf16 x (4 16-byte pieces, 32 values) or
# 128 bytes of fp32 x (8 pieces, 32 values).  One group per row: 32 elements.  (For bf16,
# 64 bytes per thread measured ~1 us faster at the prefill shape than 128: see notes.md.)
PIECES_PER_THREAD = {"bfloat16": 4, "float32": 8}
ELEMS_PER_THREAD_ROW = 32
# Launch bounds: <= 64 registers, i.e. at least 4 blocks of 256 threads per SM (no
# spills in any config; the bf16 grouped configs need ~40 and get 6).
MIN_BLOCKS_PER_SM = 4
WARP = 32

_IN_BYTES = {"bfloat16": 2, "float32": 4}


def _group_layout(in_dtype: str, group: int):
    """(TPG, PPT, ROUNDS) of a grouped config: lanes per group, pieces per thread
    per group, groups per thread.  TPG >= 2 keeps every load sector-complete."""
    piece = 16 // _IN_BYTES[in_dtype]
    pieces_per_group = group // piece
    tpg = 4 if group == 128 else 2
    ppt = pieces_per_group // tpg
    rounds = PIECES_PER_THREAD[in_dtype] // ppt
    assert tpg * ppt == pieces_per_group and rounds * ppt == PIECES_PER_THREAD[in_dtype] and 4 % rounds == 0
    return tpg, ppt, rounds


def per_token_cast_kernel(in_dtype: str, fmt: str, group: int):
    assert in_dtype in _IN_BYTES and fmt in MAX_VALUE and group in (0, 32, 64, 128)
    piece = 16 // _IN_BYTES[in_dtype]  # elements per 16-byte load
    per_row = group == 0
    npieces = ELEMS_PER_THREAD_ROW // piece if per_row else PIECES_PER_THREAD[in_dtype]  # pieces per thread
    if per_row:
        tpg, ppt, rounds = None, npieces, 1
    else:
        tpg, ppt, rounds = _group_layout(in_dtype, group)
    pieces_per_group = None if per_row else group // piece
    slots_per_word = 4 // rounds  # slots whose groups share one packed UE8M0 word

    hw_fp4 = fmt == "e2m1" and has_fp4_convert()
    if fmt == "e4m3":
        out_dtype, out_width = T.float8_e4m3fn, piece
    elif hw_fp4:
        out_dtype, out_width = T.float4_e2m1fn, piece  # TileLang packs two per byte
    else:
        out_dtype, out_width = T.uint8, piece // 2  # nibbles packed by hand

    # Where a thread's data lies.  `lane`: its index among the lanes sharing a
    # group (per row: among the row's lanes); `slot`: which run of `rounds`
    # groups of its row it covers; piece (j, k): its k-th piece of round j.
    def lane_of(lane_in_row):
        return lane_in_row if per_row else lane_in_row % tpg

    def slot_of(lane_in_row):
        return 0 if per_row else lane_in_row // tpg

    def group_of(slot, j):
        return slot * rounds + j

    def piece_of(slot, lane, j, k, lanes_per_row):
        if per_row:
            return k * lanes_per_row + lane
        return group_of(slot, j) * pieces_per_group + k * tpg + lane

    num_tokens = T.dynamic("num_tokens")
    row_pieces = T.dynamic("row_pieces")  # hidden / piece
    x_stride = T.dynamic("x_stride")  # elements between rows of x
    sf_words = T.dynamic("sf_words")  # 32-bit words of sf storage

    @T.prim_func
    def per_token_cast(
        x: T.StridedTensor[(num_tokens, row_pieces, piece), (x_stride, piece, 1), in_dtype],
        out: T.Tensor[(num_tokens, row_pieces, out_width), out_dtype],
        # fp32 factors or packed UE8M0 words, as raw 32-bit words; element
        # [row, group (or group / 4 when packed)] is at row * sf_row_stride + col * sf_col_stride.
        sf: T.Tensor[(sf_words,), T.uint32],
        lanes_per_row: T.int32,
        num_groups: T.int32,
        sf_row_stride: T.int32,
        sf_col_stride: T.int32,
        round_sf: T.int32,
        packed_sf: T.int32,
        write_out: T.int32,
        read_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens * lanes_per_row, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            tid = T.get_thread_binding()
            # Rows start on 16-byte boundaries (checked by the host): every piece is one vector load.
            T.assume(x_stride % piece == 0)
            T.assume(lanes_per_row > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            T.import_source(DEVICE_SOURCE)

            xv = T.alloc_local((npieces, piece), in_dtype)
            amax = T.alloc_local((rounds,), T.float32)
            if in_dtype == "bfloat16":
                pmax = T.alloc_local((1,), T.uint32)  # running max of |x| pairs (two bf16)
                pair = T.alloc_local((2,), in_dtype)
            sf_inv = T.alloc_local((rounds,), T.float32)
            sf_bits = T.alloc_local((rounds,), T.uint32)  # fp32 factor bits, or the UE8M0 byte
            packed = T.alloc_local((out_width,), T.uint8)
            word = T.alloc_var(T.uint32)
            if per_row:
                warp_max = T.alloc_shared((THREADS // WARP,), T.float32, scope="shared")

            # one 32-bit division per thread; the indices below derive from these two
            row = T.alloc_var(T.int32)
            lane_in_row = T.alloc_var(T.int32)
            row = (bid * THREADS + tid) // lanes_per_row
            lane_in_row = (bid * THREADS + tid) - row * lanes_per_row
            lane = lane_of(lane_in_row)
            slot = slot_of(lane_in_row)
            row_ok = row < num_tokens

            # ---- load: all pieces first, so that every load is in flight before the first use
            for j in T.unroll(rounds):
                for k in T.unroll(ppt):
                    if row_ok and piece_of(slot, lane, j, k, lanes_per_row) < row_pieces:
                        for u in T.vectorized(piece):
                            xv[j * ppt + k, u] = x[row, piece_of(slot, lane, j, k, lanes_per_row), u]
                    else:
                        for u in T.unroll(piece):
                            xv[j * ppt + k, u] = T.cast(0, in_dtype)

            # ---- group max: in registers, then across the lanes sharing the group
            for j in T.unroll(rounds):
                if in_dtype == "bfloat16":
                    # bf16 pairs stay packed: a NaN-keeping max on |x| (exact, like the fp32 one),
                    # one widening per lane at the end.  Widening every element to fp32
                    # here let the compiler keep 64 fp32 copies alive for the scaling (spills).
                    pmax[0] = T.reinterpret(T.abs2(xv[j * ppt, T.Ramp(0, 1, 2)]), T.uint32)
                    for i in T.unroll(1, ppt * piece // 2):
                        pmax[0] = bf16x2_max_nan(pmax[0], T.reinterpret(
                            T.abs2(xv[j * ppt + 2 * i // piece, T.Ramp(2 * i % piece, 1, 2)]), T.uint32))
                    pair[T.Ramp(0, 1, 2)] = T.reinterpret(pmax[0], "bfloat16x2")
                    amax[j] = max_nan(T.cast(pair[0], T.float32), T.cast(pair[1], T.float32))
                else:
                    amax[j] = T.float32(0)
                    for i in T.unroll(ppt * piece):
                        amax[j] = max_nan(amax[j], T.abs(xv[j * ppt + i // piece, i % piece]))
            if per_row:
                for s in T.unroll(5):
                    if (1 << s) < lanes_per_row:
                        amax[0] = max_nan(amax[0], T.shfl_xor(amax[0], 1 << s))
                if lanes_per_row > WARP:
                    # rows wider than a warp: exchange the warp maxima (uniform branch)
                    if tid % WARP == 0:
                        warp_max[tid // WARP] = amax[0]
                    T.sync_threads()
                    warps_per_row = lanes_per_row // WARP
                    first = (tid // WARP) - (tid // WARP) % warps_per_row
                    amax[0] = warp_max[first]
                    for w in T.unroll(1, THREADS // WARP):
                        if w < warps_per_row:
                            amax[0] = max_nan(amax[0], warp_max[first + w])
            else:
                for j in T.unroll(rounds):
                    for s in T.unroll(tpg.bit_length() - 1):
                        amax[j] = max_nan(amax[j], T.shfl_xor(amax[j], 1 << s))

            # ---- factors
            for j in T.unroll(rounds):
                if read_sf != 0:
                    sf_inv[j] = T.float32(1)
                    if row_ok and group_of(slot, j) < num_groups:
                        given = T.reinterpret(
                            sf[row * sf_row_stride + group_of(slot, j) * sf_col_stride], T.float32)
                        sf_inv[j] = T.float32(1) / given
                else:
                    scale_factors(amax, fmt, round_sf, packed_sf, sf_bits, sf_inv, j)

            # ---- store the factors: one 32-bit word per group (fp32) or per 4 groups (UE8M0)
            if read_sf == 0:
                if packed_sf != 0:
                    word = T.uint32(0)
                    for j in T.unroll(rounds):
                        if group_of(slot, j) < num_groups:
                            word = word | (sf_bits[j] << T.uint32(8 * ((group_of(slot, j)) % 4)))
                    if not per_row:
                        # the slots of one word are consecutive lanes of this warp: gather their bytes
                        part = word
                        for m in T.unroll(1, slots_per_word):
                            word = word | T.shfl_down(part, m * tpg)
                    if row_ok and lane == 0 and slot % slots_per_word == 0 and group_of(slot, 0) < num_groups:
                        sf[row * sf_row_stride + (group_of(slot, 0) // 4) * sf_col_stride] = word
                else:
                    for j in T.unroll(rounds):
                        if row_ok and lane == 0 and group_of(slot, j) < num_groups:
                            sf[row * sf_row_stride + group_of(slot, j) * sf_col_stride] = sf_bits[j]

            # ---- quantize and store
            if write_out != 0:
                for j in T.unroll(rounds):
                    for k in T.unroll(ppt):
                        if row_ok and piece_of(slot, lane, j, k, lanes_per_row) < row_pieces:
                            if fmt == "e4m3" or hw_fp4:
                                for u in T.vectorized(piece):
                                    out[row, piece_of(slot, lane, j, k, lanes_per_row), u] = T.cast(
                                        T.cast(xv[j * ppt + k, u], T.float32) * sf_inv[j], out_dtype)
                            else:
                                for b in T.unroll(out_width):
                                    lo = e2m1_nibble(T.cast(xv[j * ppt + k, 2 * b], T.float32) * sf_inv[j])
                                    hi = e2m1_nibble(T.cast(xv[j * ppt + k, 2 * b + 1], T.float32) * sf_inv[j])
                                    packed[b] = T.cast(lo | (hi << T.uint32(4)), T.uint8)
                                for b in T.vectorized(out_width):
                                    out[row, piece_of(slot, lane, j, k, lanes_per_row), b] = packed[b]

    return per_token_cast


def host_constants(in_dtype: str, fmt: str, group: int) -> dict:
    """The layout the host needs for the thread count of a row: lanes per group and
    groups per lane of a grouped config (0 for one group per row)."""
    if group == 0:
        return {"lanes_per_group": 0, "groups_per_lane": 0}
    tpg, _, rounds = _group_layout(in_dtype, group)
    return {"lanes_per_group": tpg, "groups_per_lane": rounds}
