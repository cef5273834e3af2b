// moe.topk_sum_and_topk_group_idx: host side (interface: tka/host.h).
#pragma once

#include <cstdint>

#include "args.h"

namespace tka::moe_topk_sum_and_topk_group_idx::topk_sum_and_topk_group_idx {

struct Plan {
  int64_t num_tokens, num_groups, num_experts_per_group;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  p.num_tokens = a.scores.shape[0];
  p.num_groups = a.scores.shape[1];
  p.num_experts_per_group = a.scores.shape[2];
  // the reference's order of checks (TileKernels asserts the same limits)
  TKA_CHECK(a.num_topk_sum == 1 || a.num_topk_sum == 2, "num_topk_sum", "must be 1 or 2, got %lld",
            static_cast<long long>(a.num_topk_sum));
  TKA_CHECK(a.num_topk_sum <= p.num_experts_per_group, "num_topk_sum",
            "(%lld) must be <= num_experts_per_group (scores.shape[2] = %lld)", static_cast<long long>(a.num_topk_sum),
            static_cast<long long>(p.num_experts_per_group));
  TKA_CHECK(p.num_groups <= 32, "scores", "must have at most 32 groups (scores.shape[1]), got %lld",
            static_cast<long long>(p.num_groups));
  TKA_CHECK(a.num_topk_groups >= 1 && a.num_topk_groups <= p.num_groups, "num_topk_groups",
            "must be in [1, num_groups] (scores.shape[1] = %lld), got %lld", static_cast<long long>(p.num_groups),
            static_cast<long long>(a.num_topk_groups));
  // the kernel's token count and in-block offsets are 32-bit (its element offsets are 64-bit)
  TKA_CHECK(p.num_tokens <= INT32_MAX, "scores", "has too many tokens (%lld; at most 2^31 - 1)",
            static_cast<long long>(p.num_tokens));
  TKA_CHECK(p.num_groups * p.num_experts_per_group <= INT32_MAX / 2, "scores",
            "rows are too long (%lld floats; at most 2^30 - 1)",
            static_cast<long long>(p.num_groups * p.num_experts_per_group));
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, I64, {p.num_tokens, a.num_topk_groups});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o,
                        KernelArgs& k) {
  TKA_CHECK(p.num_groups <= c.max_groups, "scores", "must have at most %lld groups", static_cast<long long>(c.max_groups));
  const int64_t row = p.num_groups * p.num_experts_per_group;
  // lanes per token: the power of two >= num_groups (a token's lanes never straddle a warp)
  int64_t lane_shift = 0;
  while ((int64_t{1} << lane_shift) < p.num_groups) ++lane_shift;
  // as many tokens as the block has lanes for and its staging tile holds (a row longer than the
  // tile: one token, several passes)
  int64_t tokens_per_block = c.threads >> lane_shift;
  if (tokens_per_block * row > c.tile) tokens_per_block = c.tile / row > 0 ? c.tile / row : 1;
  k.scores = a.scores.data;
  k.topk_group_idx = o.out.data;
  k.num_tokens = p.num_tokens;
  k.num_groups = p.num_groups;
  k.num_experts_per_group = p.num_experts_per_group;
  k.num_topk_sum = a.num_topk_sum;
  k.num_topk_groups = a.num_topk_groups;
  k.lane_shift = lane_shift;
  k.tokens_per_block = tokens_per_block;
  k.wide = row % c.vec == 0 && aligned(a.scores.data, 4 * c.vec);
  return true;
}

}  // namespace tka::moe_topk_sum_and_topk_group_idx::topk_sum_and_topk_group_idx
