"""Float32 steps of the Sinkhorn kernels, each in ``tile_kernels_aot.torch.mhc.sinkhorn_normalize``'s
exact order: sums left to right, IEEE adds and divisions, torch's CUDA softmax.

Two layouts of a token's ``n x n`` matrix:

- per thread: the whole matrix in registers (a flat row-major local buffer), the steps
  ``softmax_rows`` ... ``softmax_bwd``;
- per element (``lane_*``): ``lanes_per_matrix(n)`` consecutive lanes of a warp hold one
  matrix, lane ``e = i * n + j`` its element ``(i, j)`` in a one-element local buffer; a
  row or column sum gathers the ``n`` values with ``__shfl_sync`` (full mask, sub-warp
  ``width``) into a local buffer ``r`` and adds them there in the reference's order, so
  every lane of the row or column computes the same sum and divides only its own element.
  Every lane of the warp must reach every step (the callers keep tail lanes running on
  dummy data and only mask their loads and stores).
"""

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


def lanes_per_matrix(n):
    """Lanes of one matrix in the per-element layout: ``next_pow2(n * n)``, a divisor of 32
    for ``n <= 5``."""
    return _pow2_at_least(n * n)


def _seq_sum(r, n):
    """``((r[0] + r[1]) + r[2]) + ...``, IEEE adds."""
    acc = r[0]
    for k in range(1, n):
        acc = T.ieee_add(acc, r[k])
    return acc


@T.macro
def lane_gather(r, v, first, stride, n, width):
    """``r[k] = v`` of the lane ``first + k * stride`` of this matrix, ``k < n``."""
    for k in T.unroll(n):
        r[k] = T.shfl_sync(v, first + k * stride, width)


@T.macro
def lane_softmax(v, r, i, n, width):
    """``v[0]`` (an element of row ``i``) -> its row softmax, in torch's CUDA order (as
    ``softmax_rows``): every lane of the row computes the row's max and butterfly sum."""
    top = T.alloc_var(T.float32)
    lane_gather(r, v[0], i * n, 1, n, width)
    top = r[0]
    for k in T.unroll(1, n):
        top = T.max(top, r[k])
    for k in T.unroll(n):
        r[k] = T.exp(T.ieee_sub(r[k], top))
    v[0] = T.ieee_fdiv(T.exp(T.ieee_sub(v[0], top)), butterfly_sum(r, 0, n))


@T.macro
def lane_normalize(v, r, first, stride, n, width, eps):
    """``v[0] /= (sum + eps)``, the sum over the ``n`` lanes ``first + k * stride`` left
    to right: a column step with ``(j, n)``, a row step with ``(i * n, 1)``."""
    lane_gather(r, v[0], first, stride, n, width)
    v[0] = T.ieee_fdiv(v[0], T.ieee_add(_seq_sum(r, n), eps))
