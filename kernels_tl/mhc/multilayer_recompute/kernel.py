"""mhc.multilayer_recompute: several layers' sublayer inputs and residual streams recomputed in one
kernel, each token's streams kept in registers from layer to layer.

For layer ``i < num_layers`` (``r`` starting as ``initial_residual`` bf16 [num_tokens, M, H]):

    layer_input_i = mhc_pre_apply_mix(r, pre_mix_i)                 bf16 [num_tokens, H]
    if i < num_post:  r = residual_i = mhc_post(layer_output_i, r, post_mix_i, comb_mix_i)

with the arithmetic of the single-layer kernels (``stream_math.apply_mix_value`` and
``stream_math.post_piece``, the helpers ``pre_apply_mix`` and ``post`` are built from) and ``r``
rounded to bf16 after every layer, so the result equals the chained single-layer kernels bit for
bit.

Design
------
Bound by memory: per token ``2MH`` (initial streams) + per layer ``4M + 2H`` (pre mix, layer
input) + per post ``2H + 4M + 4M^2 + 2MH`` (layer output, mixes, new streams), read or written
once; the single-layer composition also reads the streams back every layer.  One thread per
16-byte piece of a row, one warp per 32 pieces of one token (warp ``g`` of the grid: token
``g / chunks``, pieces from ``32 (g % chunks)``, ``chunks = ceil(pieces / 32)``): a thread loads its
``M`` stream pieces once, then for each layer writes its layer-input piece and its ``M`` new
stream pieces, keeping the streams in registers (updated in place, two columns at a time).

Every other operand travels by ``cp.async`` into shared memory ``AHEAD`` layers before its use,
holding no register while in flight: each thread's layer-output piece (a slot per thread) and the
warp's token's mixes (one 4-byte copy per lane into a slot per warp, made visible to the warp by
``__syncwarp``).  No layer waits on a load issued after the one before it (the first layer waits
once, for its streams, layer output and mixes together), and at 64 registers 4 blocks of 256
threads (32 warps) fit an SM.  The arithmetic reads a piece as four 32-bit words of two bf16 (the
even value is the word shifted up 16, the odd one its high half: exact) and packs new pairs with
``cvt.rn.bf16x2``, the instruction a bf16 cast of two values compiles to.

The lists are passed by value: ``MAX_LAYERS`` pointer parameters per list (one kernel parameter
each, unused ones null) and the run-time counts ``num_layers`` (1 ..  MAX_LAYERS) and
``num_post`` (``num_layers`` or ``num_layers - 1``).  The layer loop is unrolled at trace time,
each layer guarded by the counts, and a thread ends after its launch's last layer; a launch needs no
device-side pointer table and is CUDA-graph capturable; a call with more layers runs chained
launches (``host.h``).  No static dim but ``M``; the token count and hidden size are run-time
values.
"""

from tilelang import language as T

from kernels_tl import fp_pack
from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl import cp_async
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import PIECE, THREADS

# a warp's mix slots are ordered by T.sync_warp() (no block barrier is ever needed)
PASS_CONFIGS = {**streams.PASS_CONFIGS, "tl.disable_thread_storage_sync": True}

MAX_LAYERS = 16  # layers per launch: the pointer parameters of each list below (host.h: kLayersPerLaunch)
AHEAD = 2  # layers whose layer-output pieces and mixes are in flight beyond the one computed
# shared slots per thread (layer outputs) and per warp (mixes), layer i in slot i % SLOTS: the slot
# refilled at layer i was last read at layer i - 2, which every lane of the warp finished before it
# passed layer i - 1's __syncwarp, so that one barrier per layer orders the slot's reads and refill
SLOTS = AHEAD + 2
MIN_BLOCKS_PER_SM = 4  # <= 64 registers: the streams and one layer's mixes (nothing in flight holds one)
WARP = 32
WORDS = PIECE // 2  # a 16-byte piece as 32-bit words of two bf16 (the even value in the low half)

# the address of a lane's mix word: pre, post or comb (lane < m, < 2m, else) plus the byte offset
# the lane computed once (selects, no branch); the thread's end (TileLang distributes an if over
# each statement it guards, so the unused layers of a launch would each still test their guards);
# a 16-byte store from a thread's registers that stays one 16-byte store (nvcc splits some into
# four 4-byte stores when the four words are not in an aligned register quad: one move each is
# cheaper)
DEVICE_SOURCE = r"""
__device__ __forceinline__ void* tka_mix_word(void* pre, void* post, void* comb, int lane, int m, long long offset) {
  return static_cast<char*>(lane < m ? pre : lane < 2 * m ? post : comb) + offset;
}
__device__ __forceinline__ void tka_exit() { asm volatile("exit;"); }
__device__ __forceinline__ void tka_store_16(void* dst, const void* src) {
  const uint4 v = *static_cast<const uint4*>(src);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
"""


def store_16(dst, src):
    """One 16-byte store (for ``T.evaluate``): ``dst`` a global element, ``src`` a local one
    (BufferLoads; 16-byte aligned addresses)."""
    return T.call_extern("void", "tka_store_16", T.address_of(dst), T.address_of(src))


def bf16_value(word, v: int):
    """Value ``v`` (0: the low half, 1: the high half) of a word of two bf16, as float32 (exact)."""
    bits = word << T.uint32(16) if v == 0 else word & T.uint32(0xFFFF0000)
    return T.reinterpret(bits, T.float32)


def column(rs, k, v: int, mhc_mult: int):
    """The ``M`` streams' float32 values in column ``2 k + v`` of a piece (``rs``: [M, WORDS] words)."""
    return [bf16_value(rs[m, k], v) for m in range(mhc_mult)]


def apply_mix_value_folded(rs_u, w, mhc_mult: int):
    """``stream_math.apply_mix_value`` of one value bit for bit (``rs_u``: the ``M`` streams'
    float32 values), with one add of zero instead of one per accumulator: that function's
    accumulators start from ``+0``, so each is its terms' sum up to the sign of a zero result and
    never ``-0`` (an IEEE round-to-nearest sum is ``-0`` only when both operands are);
    equal-up-to-zero-sign operands give equal-up-to-zero-sign sums, so its total is this
    function's unsigned-zero total, never ``-0``, and ``total + 0`` (``-0 + 0 = +0``, any other
    value unchanged) is exactly it.  NaNs propagate through both (the GPU's adds return the
    canonical NaN either way)."""
    acc = [None] * 4
    for m in range(mhc_mult):
        term = T.ieee_mul(rs_u[m], w[m])
        acc[m % 4] = term if acc[m % 4] is None else T.ieee_add(acc[m % 4], term)
    total = acc[0]
    for k in range(1, min(4, mhc_mult)):
        total = T.ieee_add(total, acc[k])
    return T.ieee_add(total, T.float32(0))


def post_value(x, rs_u, pw, cw, n, mhc_mult: int):
    """A value of new stream ``n`` before its bf16 rounding: ``stream_math.post_piece``'s
    arithmetic for one value, ``mixed = sum_m cw[m, n] * rs_u[m]`` as an FMA chain over
    ``m = 0, 1, ...`` from zero, then ``(x * pw[n]) + mixed`` (two IEEE roundings); ``x`` and
    ``rs_u``: the layer output's and the ``M`` streams' float32 values."""
    mixed = T.float32(0)
    for m in range(mhc_mult):
        mixed = T.fma(cw[m, n], rs_u[m], mixed)
    return T.ieee_add(T.ieee_mul(x, pw[n]), mixed)


def host_constants(mhc_mult: int) -> dict:
    return {"max_layers": MAX_LAYERS}


def multilayer_recompute_kernel(mhc_mult: int):
    M = mhc_mult
    MIXES = 2 * M + M * M  # a token's pre, post and comb mixes of one layer: one word per lane
    WARPS = THREADS // WARP
    assert MIXES <= WARP, "a warp copies its token's mixes one word per lane"
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    # one fresh buffer per parameter (TileLang calls a callable annotation); bf16 rows as words
    def Streams():
        return T.Tensor[(num_tokens, M, pieces, WORDS), T.uint32]

    def Row():
        return T.Tensor[(num_tokens, pieces, WORDS), T.uint32]

    def Mix():
        return T.Tensor[(num_tokens, M), T.float32]

    def Comb():
        return T.Tensor[(num_tokens, M, M), T.float32]

    assert MAX_LAYERS == 16, "the parameter lists below spell out 16 layers"

    @T.macro
    def issue(j, ops, st, num_layers, num_post):
        """Layer j's copies into its slots (no group closed): lane e < MIXES copies word e of
        the warp's token's mixes (pre, post, comb; only pre for a layer without a post), each
        thread its layer-output piece."""
        pre, lo, post, comb = ops
        lo_s, mix_s, token, piece, tid, warp, lane, mix_offset = st
        if j < num_layers:
            if lane < T.if_then_else(j < num_post, MIXES, M):
                src = T.call_extern("handle", "tka_mix_word", T.address_of(pre[j][0, 0]),
                                    T.address_of(post[j][0, 0]), T.address_of(comb[j][0, 0, 0]), lane, M,
                                    mix_offset)
                T.evaluate(cp_async.copy4(mix_s[j % SLOTS, warp, lane], src))
        if j < num_post:
            if piece < pieces:
                T.evaluate(cp_async.copy16(lo_s[j % SLOTS, tid, 0], lo[j][token, piece, 0]))

    @T.macro
    def layer(i, ops, outs, st, regs, num_layers, num_post):
        """Layer i, then the layers after it (a thread ends after its launch's last layer).
        Layer i + AHEAD's copies go into the slots layer i - 2 read; one group per layer, so
        layer i's have landed when at most AHEAD groups are in flight."""
        li, res = outs
        lo_s, mix_s, token, piece, tid, warp, lane, mix_offset = st
        rs, xs, li_w, w, pw, cw = regs
        s = i % SLOTS
        if i + AHEAD < MAX_LAYERS:
            issue(i + AHEAD, ops, st, num_layers, num_post)
        cp_async.commit()
        cp_async.wait(AHEAD)
        T.sync_warp()  # the warp's mix copies of layer i, visible to every lane
        if piece < pieces:
            for m in T.vectorized(M):
                w[m] = mix_s[s, warp, m]
            if i < num_post:
                for n in T.vectorized(M):
                    pw[n] = mix_s[s, warp, M + n]
                for m in T.unroll(M):
                    for n in T.vectorized(M):
                        cw[m, n] = mix_s[s, warp, 2 * M + m * M + n]
                for k in T.vectorized(WORDS):
                    xs[k] = lo_s[s, tid, k]
                # column u of the layer input and of the new streams needs only column u of the
                # old streams: each new pair of columns replaces the old pair in place
                for k in T.unroll(WORDS):
                    old = [column(rs, k, v, M) for v in (0, 1)]
                    li_w[k] = fp_pack.bf16x2(*[apply_mix_value_folded(old[v], w, M) for v in (0, 1)])
                    for n in list(range(M)):
                        rs[n, k] = fp_pack.bf16x2(*[post_value(bf16_value(xs[k], v), old[v], pw, cw, n, M)
                                                    for v in (0, 1)])
                T.evaluate(store_16(li[i][token, piece, 0], li_w[0]))
                for n in T.unroll(M):
                    T.evaluate(store_16(res[i][token, n, piece, 0], rs[n, 0]))
            else:  # the last layer, without a post
                for k in T.unroll(WORDS):
                    li_w[k] = fp_pack.bf16x2(*[apply_mix_value_folded(column(rs, k, v, M), w, M) for v in (0, 1)])
                T.evaluate(store_16(li[i][token, piece, 0], li_w[0]))
        if i + 1 < MAX_LAYERS:
            # the end, with no copy in flight (layers >= num_layers have none); the next layer stays
            # nested in its test too: without it ptxas spills in the layer bodies
            if num_layers <= i + 1:
                T.evaluate(T.call_extern("void", "tka_exit"))
            if i + 1 < num_layers:
                layer(i + 1, ops, outs, st, regs, num_layers, num_post)

    @T.prim_func
    def multilayer_recompute(
        initial_residual: Streams,
        pre_mix_0: Mix, pre_mix_1: Mix, pre_mix_2: Mix, pre_mix_3: Mix,
        pre_mix_4: Mix, pre_mix_5: Mix, pre_mix_6: Mix, pre_mix_7: Mix,
        pre_mix_8: Mix, pre_mix_9: Mix, pre_mix_10: Mix, pre_mix_11: Mix,
        pre_mix_12: Mix, pre_mix_13: Mix, pre_mix_14: Mix, pre_mix_15: Mix,
        layer_output_0: Row, layer_output_1: Row, layer_output_2: Row, layer_output_3: Row,
        layer_output_4: Row, layer_output_5: Row, layer_output_6: Row, layer_output_7: Row,
        layer_output_8: Row, layer_output_9: Row, layer_output_10: Row, layer_output_11: Row,
        layer_output_12: Row, layer_output_13: Row, layer_output_14: Row, layer_output_15: Row,
        post_mix_0: Mix, post_mix_1: Mix, post_mix_2: Mix, post_mix_3: Mix,
        post_mix_4: Mix, post_mix_5: Mix, post_mix_6: Mix, post_mix_7: Mix,
        post_mix_8: Mix, post_mix_9: Mix, post_mix_10: Mix, post_mix_11: Mix,
        post_mix_12: Mix, post_mix_13: Mix, post_mix_14: Mix, post_mix_15: Mix,
        comb_mix_0: Comb, comb_mix_1: Comb, comb_mix_2: Comb, comb_mix_3: Comb,
        comb_mix_4: Comb, comb_mix_5: Comb, comb_mix_6: Comb, comb_mix_7: Comb,
        comb_mix_8: Comb, comb_mix_9: Comb, comb_mix_10: Comb, comb_mix_11: Comb,
        comb_mix_12: Comb, comb_mix_13: Comb, comb_mix_14: Comb, comb_mix_15: Comb,
        layer_input_0: Row, layer_input_1: Row, layer_input_2: Row, layer_input_3: Row,
        layer_input_4: Row, layer_input_5: Row, layer_input_6: Row, layer_input_7: Row,
        layer_input_8: Row, layer_input_9: Row, layer_input_10: Row, layer_input_11: Row,
        layer_input_12: Row, layer_input_13: Row, layer_input_14: Row, layer_input_15: Row,
        residual_0: Streams, residual_1: Streams, residual_2: Streams, residual_3: Streams,
        residual_4: Streams, residual_5: Streams, residual_6: Streams, residual_7: Streams,
        residual_8: Streams, residual_9: Streams, residual_10: Streams, residual_11: Streams,
        residual_12: Streams, residual_13: Streams, residual_14: Streams, residual_15: Streams,
        num_layers: T.int32,
        num_post: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens * T.ceildiv(pieces, WARP), WARPS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            pre = [
                pre_mix_0, pre_mix_1, pre_mix_2, pre_mix_3,
                pre_mix_4, pre_mix_5, pre_mix_6, pre_mix_7,
                pre_mix_8, pre_mix_9, pre_mix_10, pre_mix_11,
                pre_mix_12, pre_mix_13, pre_mix_14, pre_mix_15,
            ]
            lo = [
                layer_output_0, layer_output_1, layer_output_2, layer_output_3,
                layer_output_4, layer_output_5, layer_output_6, layer_output_7,
                layer_output_8, layer_output_9, layer_output_10, layer_output_11,
                layer_output_12, layer_output_13, layer_output_14, layer_output_15,
            ]
            post = [
                post_mix_0, post_mix_1, post_mix_2, post_mix_3,
                post_mix_4, post_mix_5, post_mix_6, post_mix_7,
                post_mix_8, post_mix_9, post_mix_10, post_mix_11,
                post_mix_12, post_mix_13, post_mix_14, post_mix_15,
            ]
            comb = [
                comb_mix_0, comb_mix_1, comb_mix_2, comb_mix_3,
                comb_mix_4, comb_mix_5, comb_mix_6, comb_mix_7,
                comb_mix_8, comb_mix_9, comb_mix_10, comb_mix_11,
                comb_mix_12, comb_mix_13, comb_mix_14, comb_mix_15,
            ]
            li = [
                layer_input_0, layer_input_1, layer_input_2, layer_input_3,
                layer_input_4, layer_input_5, layer_input_6, layer_input_7,
                layer_input_8, layer_input_9, layer_input_10, layer_input_11,
                layer_input_12, layer_input_13, layer_input_14, layer_input_15,
            ]
            res = [
                residual_0, residual_1, residual_2, residual_3,
                residual_4, residual_5, residual_6, residual_7,
                residual_8, residual_9, residual_10, residual_11,
                residual_12, residual_13, residual_14, residual_15,
            ]
            T.import_source(cp_async.DEVICE_SOURCE + fp_pack.DEVICE_SOURCE + DEVICE_SOURCE)
            tid = T.get_thread_binding()
            warp = tid // WARP
            lane = tid % WARP
            lo_s = T.alloc_shared((SLOTS, THREADS, WORDS), T.uint32)  # each thread's layer-output pieces
            mix_s = T.alloc_shared((SLOTS, WARPS, MIXES), T.float32)  # each warp's token's mixes
            rs = T.alloc_local((M, WORDS), T.uint32)  # the streams' pieces, updated in place per layer
            xs = T.alloc_local((WORDS,), T.uint32)  # the layer-output piece
            li_w = T.alloc_local((WORDS,), T.uint32)  # the layer-input piece
            w = T.alloc_local((M,), T.float32)
            pw = T.alloc_local((M,), T.float32)
            cw = T.alloc_local((M, M), T.float32)
            token = T.alloc_var(T.int32)
            piece = T.alloc_var(T.int32)
            mix_offset = T.alloc_var(T.int64)
            chunks = T.ceildiv(pieces, WARP)
            token = (bid * WARPS + warp) // chunks
            piece = (bid * WARPS + warp - token * chunks) * WARP + lane
            # the byte offset of the lane's mix word in its tensor (lanes M .. 2M - 1: post, 2M ..: comb)
            mix_offset = T.if_then_else(lane < 2 * M, (T.Cast("int64", token) * M + lane % M) * 4,
                                        (T.Cast("int64", token) * (M * M) + lane - 2 * M) * 4)
            ops = (pre, lo, post, comb)
            st = (lo_s, mix_s, token, piece, tid, warp, lane, mix_offset)
            if token < num_tokens:
                if piece < pieces:
                    for m in T.unroll(M):
                        for k in T.vectorized(WORDS):
                            rs[m, k] = initial_residual[token, m, piece, k]
                for j in list(range(AHEAD)):
                    issue(j, ops, st, num_layers, num_post)
                    cp_async.commit()
                layer(0, ops, (li, res), st, (rs, xs, li_w, w, pw, cw), num_layers, num_post)

    return multilayer_recompute
