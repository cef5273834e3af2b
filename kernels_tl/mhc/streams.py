"""What the mHC stream kernels share: the 16-byte piece layout of a hidden row and the
per-token block reduction of the backward kernels.

A bf16 hidden row of ``H`` values is ``pieces = H / 8`` pieces of 16 bytes; tensors are
viewed as ``[..., pieces, 8]``, so that ``for u in T.vectorized(8)`` over a piece is one
16-byte load or store (the host checks ``H % 8 == 0`` and 16-byte aligned pointers).
Element offsets are products of the dims in 64-bit arithmetic (TileLang widens buffer
indices), so tensors past 2^31 elements are addressed correctly; the flat thread index of
the piece-parallel kernels is 32-bit (the host bounds ``tokens * pieces``).
"""

from tilelang import language as T

PIECE = 8  # bf16 values per 16-byte piece
THREADS = 256  # piece-parallel kernels: one 16-byte piece per thread (per stream)
BLOCK = 128  # token-per-block kernels (the backward kernels with sums over the hidden size)
MIN_BLOCKS_PER_SM = 4  # piece-parallel: <= 64 registers; token-per-block: <= 128
WARPS = BLOCK // 32
PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernels' own token / piece tests
    "tl.disable_safe_memory_legalize": True,
}


def torch_stream_sum(terms, mhc_mult: int, zero):
    """The sum of ``terms[0 .. mhc_mult - 1]`` (float32 expressions, evaluated once each) in
    the order of PyTorch's CUDA reduction over a non-innermost dim of ``mhc_mult`` values,
    as ``tensor.sum(-2)`` runs it: four accumulators, value ``m`` into accumulator ``m % 4``
    starting from zero, then the accumulators added in order (for ``mhc_mult <= 4``:
    ``((0 + t0) + t1) + ...``, stream order).  IEEE adds: no contraction with the products."""
    acc = [None] * 4
    for m in range(mhc_mult):
        acc[m % 4] = T.ieee_add(zero if acc[m % 4] is None else acc[m % 4], terms[m])
    total = acc[0]
    for k in range(1, min(4, mhc_mult)):
        total = T.ieee_add(total, acc[k])
    return total


@T.macro
def block_partials(partial, reduce_buf, count):
    """Leave the warp sums of ``partial[0 .. count)`` (per-thread float32 values, local) in
    ``reduce_buf`` (shared, ``[WARPS, count]``): a warp shuffle tree per value; the block is
    synced after the call.  :func:`block_total` then adds the warps in order."""
    tid = T.get_thread_binding()
    for k in T.unroll(count):
        partial[k] = T.warp_reduce_sum(partial[k])
    if tid % 32 == 0:
        for k in T.unroll(count):
            reduce_buf[tid // 32, k] = partial[k]
    T.sync_threads()


def block_total(reduce_buf, k):
    """The block's sum of value ``k`` after :func:`block_partials`: its warp sums in warp order."""
    total = reduce_buf[0, k]
    for w in range(1, WARPS):
        total = total + reduce_buf[w, k]
    return total
