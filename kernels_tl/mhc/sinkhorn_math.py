"""Float32 steps of the Sinkhorn kernels, each in ``tile_kernels_aot.torch.mhc.sinkhorn_normalize``'s
exact order: sums left to right, IEEE adds, products and divisions, torch's CUDA softmax.

Layout: one lane per matrix element.  ``lanes_per_matrix(n)`` consecutive lanes of a warp
hold one token's ``n x n`` matrix, lane ``e = i * n + j`` its element ``(i, j)`` in a
one-element local buffer.  A row or column sum gathers the ``n`` values with
``__shfl_sync`` (full mask, sub-warp ``width``) into a local buffer ``r`` and adds them
there in the reference's order, so every lane of the row or column computes the same sum
and divides only its own element.  Every lane of the warp must reach every step: the
kernels keep tail lanes running on dummy data and mask only their loads and stores.
"""

from tilelang import language as T


def _pow2_at_least(n):
    p = 1
    while p < n:
        p *= 2
    return p


def lanes_per_matrix(n):
    """Lanes of one matrix: ``next_pow2(n * n)``, a divisor of 32 for ``n <= 5``."""
    if n * n > 32:
        raise ValueError(f"mhc sinkhorn kernels: a matrix must fit in one warp (n * n <= 32), got n = {n}")
    return _pow2_at_least(n * n)


def lane_coords(bid, tid, n, threads):
    """``(token, lane, e, i, j)`` of thread ``tid`` of block ``bid`` (``threads`` threads):
    its token (int64), its lane within the token's group, and the element ``e = i * n + j``
    it holds (lanes past ``n * n`` mirror the last element; only their stores are masked)."""
    lanes = lanes_per_matrix(n)
    token = T.Cast("int64", bid) * (threads // lanes) + T.Cast("int64", tid // lanes)
    lane = tid % lanes
    e = T.min(lane, n * n - 1) if n * n < lanes else lane
    return token, lane, e, e // n, e % n


def butterfly_sum(r, n):
    """torch's CUDA softmax row sum of ``r[0 : n]``: an XOR butterfly over ``next_pow2(n)``
    lanes, offsets halving from the largest; lanes past ``n`` hold 0, which the adds below
    skip (exact: the sums are non-negative)."""
    width = _pow2_at_least(n)
    lanes = [r[j] if j < n else None for j in range(width)]
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


def lane_sum(r, n):
    """``((r[0] + r[1]) + r[2]) + ...`` of the gathered values, IEEE adds."""
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
    """``v[0]`` (an element of row ``i``) -> its row softmax as torch computes it on CUDA:
    ``e = expf(x - rowmax)``, ``e / butterfly_sum(e)``; every lane of the row computes the
    row's max and sum (the max left to right; with a NaN or infinity in the row the sum is
    NaN whichever max is taken)."""
    top = T.alloc_var(T.float32)
    lane_gather(r, v[0], i * n, 1, n, width)
    top = r[0]
    for k in T.unroll(1, n):
        top = T.max(top, r[k])
    for k in T.unroll(n):
        r[k] = T.exp(T.ieee_sub(r[k], top))
    v[0] = T.ieee_fdiv(T.exp(T.ieee_sub(v[0], top)), butterfly_sum(r, n))


@T.macro
def lane_normalize(v, r, first, stride, n, width, eps):
    """``v[0] /= (sum + eps)``, the sum over the ``n`` lanes ``first + k * stride`` left
    to right: a column step with ``(j, n)``, a row step with ``(i * n, 1)``."""
    lane_gather(r, v[0], first, stride, n, width)
    v[0] = T.ieee_fdiv(v[0], T.ieee_add(lane_sum(r, n), eps))


@T.macro
def lane_sinkhorn(v, r, i, j, n, width, repeat, eps):
    """The whole forward on this lane's element ``v[0]`` (row ``i``, column ``j``), as
    ``sinkhorn_normalize`` computes it: the row softmax, ``+ eps``, a column step, then
    ``repeat - 1`` row and column steps."""
    lane_softmax(v, r, i, n, width)
    v[0] = T.ieee_add(v[0], eps)
    lane_normalize(v, r, j, n, n, width, eps)  # columns
    for _ in T.serial(repeat - 1):
        lane_normalize(v, r, i * n, 1, n, width, eps)  # rows
        lane_normalize(v, r, j, n, n, width, eps)  # columns


@T.macro
def lane_step_bwd(g, u, d, r, first, stride, n, width):
    """Backward of one step ``v = u / d`` (``d`` = the step's sum + eps, this lane's):
    ``g[0] = (g[0] - sum(g * u) / d) / d``, the sum over the lanes as in ``lane_normalize``."""
    lane_gather(r, T.ieee_mul(g[0], u), first, stride, n, width)
    g[0] = T.ieee_fdiv(T.ieee_sub(g[0], T.ieee_fdiv(lane_sum(r, n), d)), d)


@T.macro
def lane_softmax_bwd(g, p, r, i, n, width):
    """Backward of the row softmax ``p`` (this lane's value, row ``i``):
    ``g[0] = (g[0] - rowsum(g * p)) * p``."""
    lane_gather(r, T.ieee_mul(g[0], p), i * n, 1, n, width)
    g[0] = T.ieee_mul(T.ieee_sub(g[0], lane_sum(r, n)), p)
