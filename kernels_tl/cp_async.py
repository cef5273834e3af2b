"""``cp.async`` helpers (device source for ``T.import_source``), shared by the kernels that stage
global memory in shared memory without registers: the Engram gate kernels and ``grad_w_reduce``,
``quant.per_channel_cast`` and ``mhc.multilayer_recompute``.

Each thread copies 16-byte pieces (``cp.async.cg``: L2 only) or 4-byte words (``cp.async.ca``)
from global memory into slots of shared memory, with no register staging, so a thread can have
all of its copies in flight at once; it closes groups of copies with ``commit`` and waits with
``wait(n)`` until at most ``n`` of its groups are still in flight.  The wait alone makes a
thread's own copies visible to it; slots other threads read need a barrier after the wait.
``wait`` takes a run-time count for the kernels' unrolled loops (a constant there after
unrolling, so the switch folds away); it is a compiler memory barrier, so shared-memory reads
written after it stay after it.
"""

from tilelang import language as T

MAX_GROUPS = 16  # the largest count tka_cp_async_wait names; a larger one waits for all

DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void tka_cp_async_4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void tka_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tka_cp_async_wait_n() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
__device__ __forceinline__ void tka_cp_async_wait(int n) {
  switch (n) {
    case 1: tka_cp_async_wait_n<1>(); break;
    case 2: tka_cp_async_wait_n<2>(); break;
    case 3: tka_cp_async_wait_n<3>(); break;
    case 4: tka_cp_async_wait_n<4>(); break;
    case 5: tka_cp_async_wait_n<5>(); break;
    case 6: tka_cp_async_wait_n<6>(); break;
    case 7: tka_cp_async_wait_n<7>(); break;
    case 8: tka_cp_async_wait_n<8>(); break;
    case 9: tka_cp_async_wait_n<9>(); break;
    case 10: tka_cp_async_wait_n<10>(); break;
    case 11: tka_cp_async_wait_n<11>(); break;
    case 12: tka_cp_async_wait_n<12>(); break;
    case 13: tka_cp_async_wait_n<13>(); break;
    case 14: tka_cp_async_wait_n<14>(); break;
    case 15: tka_cp_async_wait_n<15>(); break;
    case 16: tka_cp_async_wait_n<16>(); break;
    default: tka_cp_async_wait_n<0>(); break;  // 0, or past MAX_GROUPS: wait for every group
  }
}
"""


def copy16(dst, src):
    """One 16-byte copy (an expression for ``T.evaluate``): ``dst`` a shared-memory element,
    ``src`` a global one (BufferLoads)."""
    return T.call_extern("void", "tka_cp_async_16", T.address_of(dst), T.address_of(src))


def copy4(dst, src_address):
    """One 4-byte copy (an expression for ``T.evaluate``): ``dst`` a shared-memory element (a
    BufferLoad), ``src_address`` the address of a global one (``T.address_of`` of a BufferLoad,
    or a choice among such addresses)."""
    return T.call_extern("void", "tka_cp_async_4", T.address_of(dst), src_address)


@T.macro
def commit():
    T.evaluate(T.call_extern("void", "tka_cp_async_commit"))


@T.macro
def wait(pending):
    """Wait until at most ``pending`` of this thread's committed groups are in flight."""
    T.evaluate(T.call_extern("void", "tka_cp_async_wait", T.Cast("int32", pending)))
