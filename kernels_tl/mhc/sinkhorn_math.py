"""Float32 steps of the Sinkhorn kernels on a token's ``n x n`` matrix held in registers (a
flat row-major local buffer), each in ``tile_kernels_aot.torch.mhc.sinkhorn_normalize``'s
exact order: sums left to right, IEEE adds and divisions, torch's CUDA softmax."""

from tilelang import language as T


def _pow2_at_least(n):
    p = 1
    while p < n:
        p *= 2
    return p


def butterfly_sum(y, base, n):
    """torch's CUDA softmax row sum of ``y[base : base + n]`` (an expression): an XOR
    butterfly over ``next_pow2(n)`` lanes, offsets halving from the largest; lanes past
    ``n`` hold 0, which the adds below skip (exact: the sums are non-negative)."""
    width = _pow2_at_least(n)
    lanes = [y[base + j] if j < n else None for j in range(width)]
    d = width // 2
    while d >= 1:
        lanes = [_add(lanes[l], lanes[l ^ d]) for l in range(width)]
        d //= 2
    return lanes[0]


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return T.ieee_add(a, b)


@T.macro
def softmax_rows(y, n):
    """Row softmax of the flat row-major ``n x n`` registers ``y``, in place, in torch's
    CUDA order."""
    top = T.alloc_var(T.float32)
    total = T.alloc_var(T.float32)
    for i in T.unroll(n):
        top = y[i * n]
        for j in T.unroll(1, n):
            top = T.max(top, y[i * n + j])
        for j in T.unroll(n):
            y[i * n + j] = T.exp(T.ieee_sub(y[i * n + j], top))
        total = butterfly_sum(y, i * n, n)
        for j in T.unroll(n):
            y[i * n + j] = T.ieee_fdiv(y[i * n + j], total)


@T.macro
def normalize_columns(y, n, eps):
    """``y[:, j] /= (sum_i y[i, j] + eps)``, the sum left to right."""
    denom = T.alloc_var(T.float32)
    for j in T.unroll(n):
        denom = y[j]
        for i in T.unroll(1, n):
            denom = T.ieee_add(denom, y[i * n + j])
        denom = T.ieee_add(denom, eps)
        for i in T.unroll(n):
            y[i * n + j] = T.ieee_fdiv(y[i * n + j], denom)


@T.macro
def normalize_rows(y, n, eps):
    """``y[i, :] /= (sum_j y[i, j] + eps)``, the sum left to right."""
    denom = T.alloc_var(T.float32)
    for i in T.unroll(n):
        denom = y[i * n]
        for j in T.unroll(1, n):
            denom = T.ieee_add(denom, y[i * n + j])
        denom = T.ieee_add(denom, eps)
        for j in T.unroll(n):
            y[i * n + j] = T.ieee_fdiv(y[i * n + j], denom)


@T.macro
def column_step_bwd(g, u, n, eps):
    """Backward of ``v = u / (colsum(u) + eps)``: ``g = (g - colsum(g * u) / d) / d``."""
    denom = T.alloc_var(T.float32)
    dot = T.alloc_var(T.float32)
    for j in T.unroll(n):
        denom = u[j]
        dot = T.ieee_mul(g[j], u[j])
        for i in T.unroll(1, n):
            denom = T.ieee_add(denom, u[i * n + j])
            dot = T.ieee_add(dot, T.ieee_mul(g[i * n + j], u[i * n + j]))
        denom = T.ieee_add(denom, eps)
        dot = T.ieee_fdiv(dot, denom)
        for i in T.unroll(n):
            g[i * n + j] = T.ieee_fdiv(T.ieee_sub(g[i * n + j], dot), denom)


@T.macro
def row_step_bwd(g, u, n, eps):
    """Backward of ``v = u / (rowsum(u) + eps)``: ``g = (g - rowsum(g * u) / d) / d``."""
    denom = T.alloc_var(T.float32)
    dot = T.alloc_var(T.float32)
    for i in T.unroll(n):
        denom = u[i * n]
        dot = T.ieee_mul(g[i * n], u[i * n])
        for j in T.unroll(1, n):
            denom = T.ieee_add(denom, u[i * n + j])
            dot = T.ieee_add(dot, T.ieee_mul(g[i * n + j], u[i * n + j]))
        denom = T.ieee_add(denom, eps)
        dot = T.ieee_fdiv(dot, denom)
        for j in T.unroll(n):
            g[i * n + j] = T.ieee_fdiv(T.ieee_sub(g[i * n + j], dot), denom)


@T.macro
def softmax_bwd(g, p, n):
    """Backward of the row softmax ``p``: ``g = (g - rowsum(g * p)) * p``."""
    dot = T.alloc_var(T.float32)
    for i in T.unroll(n):
        dot = T.ieee_mul(g[i * n], p[i * n])
        for j in T.unroll(1, n):
            dot = T.ieee_add(dot, T.ieee_mul(g[i * n + j], p[i * n + j]))
        for j in T.unroll(n):
            g[i * n + j] = T.ieee_mul(T.ieee_sub(g[i * n + j], dot), p[i * n + j])
