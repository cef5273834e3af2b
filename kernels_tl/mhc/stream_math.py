"""The per-piece arithmetic of the mHC forward stream kernels, shared by the single-layer kernels
(``pre_apply_mix``, ``post``) and the fused ``multilayer_recompute``, so a layer of the latter
computes exactly what the former do."""

from tilelang import language as T

from kernels_tl.mhc.streams import PIECE, torch_stream_sum


def apply_mix_value(xs, w, u, mhc_mult: int):
    """Value ``u`` of a sublayer-input piece (``mhc_pre_apply_mix``) before its bf16 rounding:
    ``sum_m xs[m, u] * w[m]``, each product one float32 rounding (``xs``: the ``M`` bf16 stream
    pieces, ``w``: the token's ``M`` float32 pre-mix weights), summed by
    :func:`torch_stream_sum`."""
    return torch_stream_sum([T.ieee_mul(T.cast(xs[m, u], T.float32), w[m]) for m in range(mhc_mult)],
                            mhc_mult, T.float32(0))


@T.macro
def post_piece(xs, rs, pw, cw, mixed, os, n):
    """New stream ``n``'s piece (``mhc_post``) into ``os`` (bf16 [PIECE]): value ``u`` is
    ``(xs[u] * pw[n]) + mixed[u]`` (two IEEE roundings) rounded to bf16 once, ``mixed[u] =
    sum_m cw[m, n] * rs[m, u]`` as an FMA chain over ``m = 0, 1, ...`` from zero (a GEMM's order
    for ``K = M``).  ``xs``: the bf16 layer-output piece, ``rs``: the ``M`` bf16 stream pieces
    [M, PIECE], ``pw`` / ``cw``: the token's float32 post [M] and comb [M, M] mixes; ``mixed``:
    float32 [PIECE] scratch."""
    for u in T.unroll(PIECE):
        mixed[u] = T.float32(0)
        for m in T.unroll(rs.shape[0]):
            mixed[u] = T.fma(cw[m, n], T.cast(rs[m, u], T.float32), mixed[u])
        os[u] = T.cast(T.ieee_add(T.ieee_mul(T.cast(xs[u], T.float32), pw[n]), mixed[u]), T.bfloat16)

