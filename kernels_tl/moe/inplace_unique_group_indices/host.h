// moe.inplace_unique_group_indices: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::moe_inplace_unique_group_indices::inplace_unique_group_indices {

struct Plan {
  int64_t num_tokens, num_topk;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  p.num_tokens = a.group_indices.shape[0];
  p.num_topk = a.group_indices.shape[1];
  // TileKernels asserts num_groups <= 128 (its kernel keeps a 128-bit set); this kernel
  // compares values and needs no bound, but keeps the contract
  TKA_CHECK(a.num_groups >= 1 && a.num_groups <= 128, "num_groups", "must be in [1, 128], got %lld",
            static_cast<long long>(a.num_groups));
  return true;
}

inline void outputs(const Args&, const Plan&, OutSpecs&) {}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.num_topk > 1; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs&, KernelArgs& k) {
  k.group_indices = a.group_indices.data;
  k.num_tokens = p.num_tokens;
  k.num_topk = p.num_topk;
  // pairs of entries as one 16-byte load: every row starts 16-byte aligned
  k.wide = p.num_topk % 2 == 0 && aligned(a.group_indices.data, 16);
  return true;
}

}  // namespace tka::moe_inplace_unique_group_indices::inplace_unique_group_indices
