// moe.mask_indices_by_tp: host side (interface: tka/host.h).
#pragma once

#include <climits>

#include "args.h"

namespace tka::moe_mask_indices_by_tp::mask_indices_by_tp {

struct Plan {
  int64_t num_tokens, num_topk, per_gpu;
};

// The pair (mul, shift) with n // d == (n * mul) >> shift for every 0 <= n < 2^31, for a
// divisor 1 <= d < 2^31: shift = 31 + ceil(log2 d), mul = ceil(2^shift / d) <= 2^32, so the
// product stays below 2^63 (the error bound is in notes.md).
inline void magic_divisor(int64_t d, int64_t& mul, int64_t& shift) {
  int64_t log2_up = 0;
  while ((int64_t{1} << log2_up) < d) ++log2_up;
  shift = 31 + log2_up;
  mul = static_cast<int64_t>(((uint64_t{1} << shift) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.indices.shape[0];
  p.num_topk = a.indices.shape[1];
  TKA_CHECK(a.num_ep_ranks >= 1, "num_ep_ranks", "must be >= 1, got %lld", static_cast<long long>(a.num_ep_ranks));
  TKA_CHECK(a.n >= 1 && a.n % a.num_ep_ranks == 0, "n", "must be a positive multiple of num_ep_ranks (%lld), got %lld",
            static_cast<long long>(a.num_ep_ranks), static_cast<long long>(a.n));
  TKA_CHECK(a.num_tp_ranks >= 1, "num_tp_ranks", "must be >= 1, got %lld", static_cast<long long>(a.num_tp_ranks));
  TKA_CHECK(a.tp_rank >= 0 && a.tp_rank < a.num_tp_ranks, "tp_rank", "must be in [0, num_tp_ranks) = [0, %lld), got %lld",
            static_cast<long long>(a.num_tp_ranks), static_cast<long long>(a.tp_rank));
  p.per_gpu = a.n / a.num_ep_ranks;
  // TileKernels passes per_gpu * num_tp_ranks as an int32 (and the kernel's fast path needs it)
  TKA_CHECK(p.per_gpu <= INT32_MAX / a.num_tp_ranks, "n",
            "too large: (n // num_ep_ranks) * num_tp_ranks must be below 2^31, got %lld * %lld",
            static_cast<long long>(p.per_gpu), static_cast<long long>(a.num_tp_ranks));
  c.dtype = a.indices.dtype;
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, a.indices.dtype, {p.num_tokens, p.num_topk});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.num_topk > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  k.indices = a.indices.data;
  k.masked = o.out.data;
  k.num_elements = p.num_tokens * p.num_topk;
  k.per_gpu = p.per_gpu;
  magic_divisor(p.per_gpu, k.per_gpu_mul, k.per_gpu_shift);
  k.num_tp_ranks = a.num_tp_ranks;
  magic_divisor(a.num_tp_ranks, k.tp_mul, k.tp_shift);
  k.tp_rank = a.tp_rank;
  // one 16-byte access per thread when both pointers allow it
  k.wide = aligned(a.indices.data, 16) && aligned(o.out.data, 16) && c.vec * dtype_bytes(a.indices.dtype) == 16;
  return true;
}

}  // namespace tka::moe_mask_indices_by_tp::mask_indices_by_tp
