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
16-byte piece of a row (flat index over ``num_tokens * pieces``, as in ``post``): it loads its
``M`` stream pieces once, then for each layer writes its layer-input piece and its ``M`` new
stream pieces, keeping the streams in registers (updated in place, column by column).  The
layer-output pieces are loaded two layers ahead (three register slots) and the token's mixes
prefetched into L1 with them, read when the layer is computed, so each layer's loads overlap
two layers of arithmetic and stores; 80 registers, 3 blocks of 256 threads per SM.

The lists are passed by value: ``MAX_LAYERS`` pointer parameters per list (one kernel parameter
each, unused ones null) and the run-time counts ``num_layers`` (1 ..  MAX_LAYERS) and
``num_post`` (``num_layers`` or ``num_layers - 1``).  The layer loop is unrolled at trace time
with each layer guarded by the counts, so a launch needs no device-side pointer table and is
CUDA-graph capturable; a call with more layers runs chained launches (``host.h``).  No static dim
but ``M``; the token count and hidden size are run-time values.
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.streams import PIECE, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS

MAX_LAYERS = 16  # layers per launch: the pointer parameters of each list below (host.h: kLayersPerLaunch)
LO_AHEAD = 2  # layers a layer-output piece is loaded ahead of its use (LO_AHEAD + 1 register slots)
MIN_BLOCKS_PER_SM = 3  # <= 80 registers: the streams, the layer-output slots, one layer's mixes

# an L1 prefetch of the line holding `p` (a hint: no register); a 16-byte store from a thread's
# registers that stays one 16-byte store (nvcc splits some into four 4-byte stores when the four
# words are not in an aligned register quad: one move each is cheaper)
DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" :: "l"(p)); }
__device__ __forceinline__ void tka_store_16(void* dst, const void* src) {
  const uint4 v = *static_cast<const uint4*>(src);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
"""


def prefetch_l1(elem):
    """An L1 prefetch of the line holding ``elem`` (a global BufferLoad), for ``T.evaluate``."""
    return T.call_extern("void", "tka_prefetch_l1", T.address_of(elem))


def store_16(dst, src):
    """One 16-byte store (for ``T.evaluate``): ``dst`` a global element, ``src`` a local one
    (BufferLoads; 16-byte aligned addresses)."""
    return T.call_extern("void", "tka_store_16", T.address_of(dst), T.address_of(src))


def apply_mix_value_folded(xs, w, u, mhc_mult: int):
    """``stream_math.apply_mix_value(xs, w, u, mhc_mult)`` bit for bit, with one add of zero
    instead of one per accumulator: that function's accumulators start from ``+0``, so each is
    its terms' sum up to the sign of a zero result and never ``-0`` (an IEEE round-to-nearest
    sum is ``-0`` only when both operands are); equal-up-to-zero-sign operands give
    equal-up-to-zero-sign sums, so its total is this function's unsigned-zero total, never
    ``-0``, and ``total + 0`` (``-0 + 0 = +0``, any other value unchanged) is exactly it.  NaNs
    propagate through both (the GPU's adds return the canonical NaN either way)."""
    acc = [None] * 4
    for m in range(mhc_mult):
        term = T.ieee_mul(T.cast(xs[m, u], T.float32), w[m])
        acc[m % 4] = term if acc[m % 4] is None else T.ieee_add(acc[m % 4], term)
    total = acc[0]
    for k in range(1, min(4, mhc_mult)):
        total = T.ieee_add(total, acc[k])
    return T.ieee_add(total, T.float32(0))


def post_value(xs, rs, pw, cw, n, u, mhc_mult: int):
    """Value ``u`` of new stream ``n``: ``stream_math.post_piece``'s arithmetic for one value,
    ``mixed = sum_m cw[m, n] * rs[m, u]`` as an FMA chain over ``m = 0, 1, ...`` from zero, then
    ``(xs[u] * pw[n]) + mixed`` (two IEEE roundings) rounded to bf16."""
    mixed = T.float32(0)
    for m in range(mhc_mult):
        mixed = T.fma(cw[m, n], T.cast(rs[m, u], T.float32), mixed)
    return T.cast(T.ieee_add(T.ieee_mul(T.cast(xs[u], T.float32), pw[n]), mixed), T.bfloat16)


def host_constants(mhc_mult: int) -> dict:
    return {"max_layers": MAX_LAYERS}


def multilayer_recompute_kernel(mhc_mult: int):
    M = mhc_mult
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    # one fresh buffer per parameter (TileLang calls a callable annotation)
    def Streams():
        return T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16]

    def Row():
        return T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16]

    def Mix():
        return T.Tensor[(num_tokens, M), T.float32]

    def Comb():
        return T.Tensor[(num_tokens, M, M), T.float32]

    assert MAX_LAYERS == 16, "the parameter lists below spell out 16 layers"

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
        with T.Kernel(T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
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
            T.import_source(DEVICE_SOURCE)
            tid = T.get_thread_binding()
            rs = T.alloc_local((M, PIECE), T.bfloat16)  # the streams' pieces, updated in place per layer
            col = T.alloc_local((M,), T.bfloat16)  # value u of every new stream
            acc = T.alloc_local((PIECE,), T.float32)
            # the layer-output pieces in LO_AHEAD + 1 register slots (layer i in slot i % (LO_AHEAD + 1)),
            # loaded LO_AHEAD layers ahead; the token's mixes are read when the layer is computed, from
            # L1, where a prefetch issued with the layer-output load has brought them
            xs = [T.alloc_local((PIECE,), T.bfloat16) for _ in range(LO_AHEAD + 1)]
            w = T.alloc_local((M,), T.float32)
            pw = T.alloc_local((M,), T.float32)
            cw = T.alloc_local((M, M), T.float32)
            token = T.alloc_var(T.int32)
            lane = T.alloc_var(T.int32)
            token = (bid * THREADS + tid) // pieces
            lane = (bid * THREADS + tid) - token * pieces
            if token < num_tokens:
                for m in T.unroll(M):
                    for u in T.vectorized(PIECE):
                        rs[m, u] = initial_residual[token, m, lane, u]
                # step j loads layer j's layer-output piece and prefetches its mixes, then computes
                # layer j - LO_AHEAD (Python lists and ints: unrolled at trace time, each layer
                # guarded by the run-time counts)
                for j in list(range(MAX_LAYERS + LO_AHEAD)):
                    if j < MAX_LAYERS:
                        if j < num_layers:
                            T.evaluate(prefetch_l1(pre[j][token, 0]))
                        if j < num_post:
                            for u in T.vectorized(PIECE):
                                xs[j % (LO_AHEAD + 1)][u] = lo[j][token, lane, u]
                            T.evaluate(prefetch_l1(post[j][token, 0]))
                            T.evaluate(prefetch_l1(comb[j][token, 0, 0]))
                    if j >= LO_AHEAD:
                        i = j - LO_AHEAD
                        if i < num_layers:
                            for m in T.unroll(M):
                                w[m] = pre[i][token, m]
                            for u in T.unroll(PIECE):
                                acc[u] = apply_mix_value_folded(rs, w, u, M)
                            for u in T.vectorized(PIECE):
                                li[i][token, lane, u] = T.cast(acc[u], T.bfloat16)
                        if i < num_post:
                            for m in T.unroll(M):
                                pw[m] = post[i][token, m]
                                for n in T.unroll(M):
                                    cw[m, n] = comb[i][token, m, n]
                            # value u of the new streams needs only value u of the old ones: each
                            # column replaces the old one in place (no second set of registers)
                            for u in T.unroll(PIECE):
                                for n in T.unroll(M):
                                    col[n] = post_value(xs[i % (LO_AHEAD + 1)], rs, pw, cw, n, u, M)
                                for n in T.unroll(M):
                                    rs[n, u] = col[n]
                            for n in T.unroll(M):
                                T.evaluate(store_16(res[i][token, n, lane, 0], rs[n, 0]))

    return multilayer_recompute
