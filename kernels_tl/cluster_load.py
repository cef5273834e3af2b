"""Reads of another block's shared memory within a thread-block cluster (distributed shared
memory): ``mapa`` turns a local shared address into the same offset in block ``rank`` of the
cluster, ``ld.shared::cluster`` reads it.  A kernel pulls the helpers in with
``T.import_source(CLUSTER_LOAD_SOURCE)`` and calls them with ``T.call_extern``; the reads are
only valid between a cluster barrier after the owner's writes and one before the owner exits.
"""

CLUSTER_LOAD_SOURCE = r"""
__device__ __forceinline__ unsigned tka_cluster_address(const void* local, int rank) {
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
__device__ __forceinline__ int tka_cluster_load_s32(const int* local, int rank) {
  int value;
  asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(value) : "r"(tka_cluster_address(local, rank)) : "memory");
  return value;
}
__device__ __forceinline__ float tka_cluster_load_f32(const float* local, int rank) {
  float value;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(tka_cluster_address(local, rank)) : "memory");
  return value;
}
__device__ __forceinline__ int64_t tka_cluster_load_s64(const int64_t* local, int rank) {
  int64_t value;
  asm volatile("ld.shared::cluster.s64 %0, [%1];" : "=l"(value) : "r"(tka_cluster_address(local, rank)) : "memory");
  return value;
}
"""
