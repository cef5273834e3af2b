"""The Engram gate kernels' tensor parameters (``engram_gate_fwd``, ``engram_gate_bwd``).

Rows of x, k, g and the outputs are ``[T, hc, H / 8, 8]`` (16-byte pieces), v and grad_v
``[T, H / 8, 8]``, w ``[hc, H / 8, 8]`` fp32; k and v may be strided (elements, multiples of 8,
checked by the host).  Each method returns a fresh type: a prim_func parameter needs its own.
"""

from tilelang import language as T

PIECE = 8  # bf16 elements per 16-byte access


class GateTensors:
    def __init__(self, hc_mult, hidden):
        self.hc_mult = hc_mult
        self.pieces = hidden // PIECE
        self.num_tokens = T.dynamic("num_tokens", "int64")
        self.k_stride_t = T.dynamic("k_stride_t", "int64")
        self.k_stride_c = T.dynamic("k_stride_c", "int64")
        self.v_stride_t = T.dynamic("v_stride_t", "int64")

    def rows(self, dtype=T.bfloat16):
        """x, g and the per-stream outputs."""
        return T.Tensor[(self.num_tokens, self.hc_mult, self.pieces, PIECE), dtype]

    def k(self):
        return T.StridedTensor[(self.num_tokens, self.hc_mult, self.pieces, PIECE),
                               (self.k_stride_t, self.k_stride_c, PIECE, 1), T.bfloat16]

    def v(self):
        return T.StridedTensor[(self.num_tokens, self.pieces, PIECE), (self.v_stride_t, PIECE, 1), T.bfloat16]

    def token_row(self):
        """grad_v: one contiguous row per token."""
        return T.Tensor[(self.num_tokens, self.pieces, PIECE), T.bfloat16]

    def w(self):
        return T.Tensor[(self.hc_mult, self.pieces, PIECE), T.float32]

    def per_stream(self, rows):
        """fp32 [rows, hc]: dot, gate_score, rstd_x, rstd_k."""
        return T.Tensor[(rows, self.hc_mult), T.float32]

    def partial_rows(self, rows):
        """fp32 [rows, hc, H / 8, 8]: grad_w_partial."""
        return T.Tensor[(rows, self.hc_mult, self.pieces, PIECE), T.float32]


@T.macro
def assume_aligned(ts):
    """Rows start on 16-byte boundaries (checked by the host): each piece is one access."""
    T.assume(ts.k_stride_t % PIECE == 0)
    T.assume(ts.k_stride_c % PIECE == 0)
    T.assume(ts.v_stride_t % PIECE == 0)
