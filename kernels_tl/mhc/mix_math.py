"""Float32 pieces shared by the mHC mix kernels, each in the references' exact order.

``sigmoid(z)`` is torch's CUDA sigmoid, ``1 / (1 + expf(-z))`` (IEEE add and division).
The backward kernels' sums over tokens follow ``tile_kernels_aot.torch.mhc._token_sum``:
``LANES`` lanes (one thread each: a cluster of ``CLUSTER`` blocks of ``THREADS``), lane
``l`` adding tokens ``l, l + LANES, ...`` in order from zero, then a pairwise tree over the
lanes, neighbours first (within a warp by ``shfl.down`` 1, 2, 4, 8, 16; then over the
block's warps; then over the cluster's blocks through distributed shared memory).
"""

from tilelang import language as T
from tilelang.cuda.language import cluster_sync

from kernels_tl.cluster_load import CLUSTER_LOAD_SOURCE  # noqa: F401  (the mix kernels import it from here)

CLUSTER = 8  # blocks per cluster (the largest portable size)
THREADS = 256
WARPS = THREADS // 32
LANES = CLUSTER * THREADS  # tile_kernels_aot.torch.mhc.TOKEN_SUM_LANES


def sigmoid(z):
    """torch's CUDA sigmoid of a float32 expression: ``1 / (1 + expf(-z))``."""
    return T.ieee_fdiv(T.float32(1), T.ieee_add(T.float32(1), T.exp(-z)))


def pair_tree(values):
    """The pairwise sum of a power-of-two list of expressions, neighbours first."""
    while len(values) > 1:
        values = [T.ieee_add(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]



def _warp_partials_tree(red, count, c):
    """Column ``c`` of the block's per-warp sums ``red`` [WARPS * count], pairwise."""
    return pair_tree([red[w * count + c] for w in range(WARPS)])


def _cluster_tree(xch, c):
    """``xch[c]`` of the cluster's blocks, pairwise in rank order (distributed shared memory)."""
    return pair_tree([T.call_extern(T.float32, "tka_cluster_load_f32", T.address_of(xch[c]), r)
                      for r in range(CLUSTER)])


@T.macro
def cluster_token_sum(acc, count, red, xch, tot, tid, rank):
    """Combine each lane's ``count`` partial sums ``acc`` (local; destroyed) over the whole
    cluster in ``_token_sum``'s tree order into rank 0's ``tot[0:count]`` (shared).

    ``red``: shared [WARPS * count]; ``xch``: shared [count], which rank 0 reads from every
    block.  Every thread of every block must call it; after it, rank 0's threads may read
    ``tot`` (the closing cluster barrier also keeps the other blocks alive until rank 0 has
    read their ``xch``)."""
    # within the warp, neighbours first: shfl.down 1, 2, 4, 8, 16 (lane 0 gets the warp's sum)
    for level in T.unroll(5):
        for c in T.unroll(count):
            acc[c] = T.ieee_add(acc[c], T.shfl_down(acc[c], 1 << level))
    if tid % 32 == 0:
        for c in T.unroll(count):
            red[(tid // 32) * count + c] = acc[c]
    T.sync_threads()
    if tid < count:
        xch[tid] = _warp_partials_tree(red, count, tid)
    cluster_sync()  # every block's xch is written and visible cluster-wide
    if rank == 0 and tid < count:
        tot[tid] = _cluster_tree(xch, tid)
    cluster_sync()  # rank 0's tot is complete; no block exits while rank 0 may read its xch
