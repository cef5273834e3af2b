"""mhc.mhc_pre_big_fuse: the inference pre path after the norm-fn projection, one kernel.

The op runs as two launches (host.h): ``mhc_pre_norm_fn``'s own kernel writes the token's
projected mixes (float32 [num_tokens, M3], ``M3 = M * (M + 2)``, a scratch buffer), then this
kernel does, per token, everything ``mhc_pre_split_mixes``, ``sinkhorn_normalize`` and
``mhc_pre_apply_mix`` do, reading the residual streams once:

    pre_j  = sigmoid(mixes[j] * scale[0] + base[j]) + pre_eps                  (j < M)
    post_j = sigmoid(mixes[M + j] * scale[1] + base[M + j]) * post_mult_value  (j < M)
    comb   = sinkhorn(mixes[2M + e] * scale[2] + base[2M + e], repeat, sinkhorn_eps)
    layer_input[h] = bf16(sum_m residual[m, h] * pre_m)

each with the very expressions of those kernels (``mix_math.sigmoid``, ``sinkhorn_math``,
``stream_math.apply_mix_value``), so the result is the chain's, bit for bit.

Design
------
One grid of ``THREADS``-thread blocks in two parts (a block-uniform branch):

- blocks ``[0, mix_blocks)``: ``sinkhorn_normalize``'s lane layout, ``THREADS / L`` tokens a
  block, ``L = next_pow2(M * M)`` lanes a token (16 at ``M = 4``), lane ``e`` holding comb
  element ``e``; lanes ``j < M`` also store ``post_j``.  First in the grid, so that their
  ``2 * repeat - 1`` dependent steps overlap the stream traffic of the other blocks;
- blocks ``[mix_blocks, ...)``: ``pre_apply_mix``'s layout, one thread per 16-byte piece of a
  token's hidden row (flat index over ``num_tokens * pieces``): the thread issues its ``M``
  stream pieces' loads, then computes its token's ``M`` pre weights from the mixes (an L1 hit
  for all but the first lanes of a token) while they are in flight, then stores one piece.

``M`` is the only static dim; the token count, hidden size, ``repeat`` and the scalars are
run-time values.  Element offsets are 64-bit (TileLang widens buffer indices); the flat piece
index is 32-bit (the host bounds ``num_tokens * pieces``).
"""

from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from kernels_tl.mhc import streams
from kernels_tl.mhc.mix_math import sigmoid
from kernels_tl.mhc.sinkhorn_math import lane_coords, lane_sinkhorn, lanes_per_matrix
from kernels_tl.mhc.stream_math import apply_mix_value
from kernels_tl.mhc.streams import MIN_BLOCKS_PER_SM, PIECE, THREADS

PASS_CONFIGS = streams.PASS_CONFIGS


def host_constants(mhc_mult):
    """Tokens per block of the Sinkhorn part and threads per block (the host sizes the grid
    split with them)."""
    return {"mix_tokens_per_block": THREADS // lanes_per_matrix(mhc_mult), "threads": THREADS}


def mhc_pre_big_fuse_kernel(mhc_mult):
    M = mhc_mult
    M3 = M * (M + 2)
    nn = M * M
    lanes = lanes_per_matrix(M)
    per_block = THREADS // lanes
    num_tokens = T.dynamic("num_tokens")
    pieces = T.dynamic("pieces")

    @T.prim_func
    def mhc_pre_big_fuse(
        mixes: T.Tensor[(num_tokens, M3), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        residual: T.Tensor[(num_tokens, M, pieces, PIECE), T.bfloat16],
        post_mix: T.Tensor[(num_tokens, M), T.float32],
        comb_mix: T.Tensor[(num_tokens, nn), T.float32],
        layer_input: T.Tensor[(num_tokens, pieces, PIECE), T.bfloat16],
        mhc_post_mult_value: T.float32,
        mhc_pre_eps: T.float32,
        eps: T.float32,  # sinkhorn_eps
        repeat: T.int32,
    ):
        mix_blocks = T.ceildiv(num_tokens, per_block)
        with T.Kernel(mix_blocks + T.ceildiv(num_tokens * pieces, THREADS), threads=THREADS) as bid:
            wait_for_previous_grid()  # programmatic dependent launch: the mixes of norm-fn's kernel
            T.assume(pieces > 0)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS_PER_SM)
            tid = T.get_thread_binding()
            if bid < mix_blocks:
                # mhc_pre_split_mixes' post and comb, then sinkhorn_normalize (its kernel's steps)
                token, lane, e, i, j = lane_coords(bid, tid, M, THREADS)
                v = T.alloc_local((1,), T.float32)
                r = T.alloc_local((M,), T.float32)
                v[0] = T.float32(0)
                if token < num_tokens:
                    v[0] = T.ieee_add(T.ieee_mul(mixes[token, 2 * M + e], mhc_scale[2]), mhc_base[2 * M + e])
                    if lane < M:
                        z = T.ieee_add(T.ieee_mul(mixes[token, M + lane], mhc_scale[1]), mhc_base[M + lane])
                        post_mix[token, lane] = T.ieee_mul(sigmoid(z), mhc_post_mult_value)
                lane_sinkhorn(v, r, i, j, M, lanes, repeat, eps)
                if token < num_tokens and lane < nn:
                    comb_mix[token, e] = v[0]
            else:
                # mhc_pre_split_mixes' pre, then mhc_pre_apply_mix (its kernel's steps)
                xs = T.alloc_local((M, PIECE), T.bfloat16)
                w = T.alloc_local((M,), T.float32)
                acc = T.alloc_local((PIECE,), T.float32)
                flat = T.alloc_var(T.int32)
                token = T.alloc_var(T.int32)
                piece = T.alloc_var(T.int32)
                flat = (bid - mix_blocks) * THREADS + tid
                token = flat // pieces
                piece = flat - token * pieces
                if token < num_tokens:
                    for m in T.unroll(M):
                        for u in T.vectorized(PIECE):
                            xs[m, u] = residual[token, m, piece, u]
                    # every mix load first (the sigmoids' division slow paths would keep the
                    # compiler from hoisting them), then the sigmoids
                    for m in T.unroll(M):
                        w[m] = T.ieee_add(T.ieee_mul(mixes[token, m], mhc_scale[0]), mhc_base[m])
                    for m in T.unroll(M):
                        w[m] = T.ieee_add(sigmoid(w[m]), mhc_pre_eps)
                    for u in T.unroll(PIECE):
                        acc[u] = apply_mix_value(xs, w, u, M)
                    for u in T.vectorized(PIECE):
                        layer_input[token, piece, u] = T.cast(acc[u], T.bfloat16)

    return mhc_pre_big_fuse
