// moe.top2_sum_gate: host side (interface: tka/host.h).
#pragma once

#include <climits>
#include <cstdint>

#include "args.h"

namespace tka::moe_top2_sum_gate::top2_sum_gate {

// kernel.py: MAX_EXPERTS (16 slots of 32 experts per lane), WARP, MAX_GROUPS.
constexpr int64_t kMaxExperts = 512;
constexpr int64_t kWarp = 32;
constexpr int64_t kMaxGroups = 32;
constexpr int64_t kIdentity = 3;  // ScoringFunc.IDENTITY: the index of 'identity' in the schema's choices

struct Plan {
  int64_t num_tokens, num_experts, num_shared, num_extra, per_gpu;
  bool grouped;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.logits.shape[0];
  p.num_experts = a.logits.shape[1];
  const int64_t E = p.num_experts, K = a.num_topk;
  // the reference's checks, in its order
  TKA_CHECK(a.bias.shape[0] == E, "bias", "must have %lld entries (logits.shape[1]), got %lld",
            static_cast<long long>(E), static_cast<long long>(a.bias.shape[0]));
  TKA_CHECK(!a.mask.present || a.mask.shape[0] == p.num_tokens, "mask", "must have %lld entries, got %lld",
            static_cast<long long>(p.num_tokens), static_cast<long long>(a.mask.shape[0]));
  TKA_CHECK(a.to_physical_map.present == a.logical_count.present, "to_physical_map",
            "and logical_count must be given together");
  TKA_CHECK((a.num_groups == 0) == (a.num_topk_groups == 0), "num_groups",
            "(%lld) and num_topk_groups (%lld) must be both zero or both non-zero", static_cast<long long>(a.num_groups),
            static_cast<long long>(a.num_topk_groups));
  TKA_CHECK(K >= 1 && K <= E && K <= 32, "num_topk", "must be in [1, min(num_routed_experts = %lld, 32)], got %lld",
            static_cast<long long>(E), static_cast<long long>(K));
  TKA_CHECK(a.num_groups >= 0 && a.num_topk_groups >= 0 && a.num_topk_groups <= a.num_groups, "num_topk_groups",
            "(%lld) must be in [0, num_groups = %lld]", static_cast<long long>(a.num_topk_groups),
            static_cast<long long>(a.num_groups));
  TKA_CHECK(E % 4 == 0, "logits", "must have a multiple of 4 experts (logits.shape[1]), got %lld",
            static_cast<long long>(E));
  TKA_CHECK(a.num_groups == 0 || E % a.num_groups == 0, "num_groups",
            "must divide num_routed_experts (%lld), got %lld", static_cast<long long>(E),
            static_cast<long long>(a.num_groups));
  p.grouped = a.num_groups != a.num_topk_groups;
  if (p.grouped) {
    TKA_CHECK(a.num_groups <= kMaxGroups, "num_groups", "must be <= %lld with a group limit, got %lld",
              static_cast<long long>(kMaxGroups), static_cast<long long>(a.num_groups));
    const int64_t per_group = E / a.num_groups;
    TKA_CHECK(per_group <= 32, "logits", "must have at most 32 experts per group with a group limit, got %lld",
              static_cast<long long>(per_group));
    // the reference ranks groups by torch.topk(k=2) over each group
    TKA_CHECK(per_group >= 2, "logits", "must have at least 2 experts per group with a group limit, got %lld",
              static_cast<long long>(per_group));
    TKA_CHECK(K <= a.num_topk_groups * per_group, "num_topk",
              "(%lld) must be <= the experts of the %lld selected groups", static_cast<long long>(K),
              static_cast<long long>(a.num_topk_groups));
  }
  TKA_CHECK(a.scoring_func != kIdentity, "scoring_func", "'identity' is not supported");
  p.num_shared = 0;
  if (a.use_shared_as_routed) {
    TKA_CHECK(a.num_shared_experts == 1 || a.num_shared_experts == 2, "num_shared_experts",
              "must be 1 or 2 when use_shared_as_routed, got %lld", static_cast<long long>(a.num_shared_experts));
    TKA_CHECK(K % a.num_shared_experts == 0, "num_topk", "(%lld) must be divisible by num_shared_experts (%lld)",
              static_cast<long long>(K), static_cast<long long>(a.num_shared_experts));
    TKA_CHECK(E % (K / a.num_shared_experts) == 0, "num_topk",
              "num_routed_experts (%lld) must be divisible by num_topk // num_shared_experts (%lld)",
              static_cast<long long>(E), static_cast<long long>(K / a.num_shared_experts));
    p.num_shared = a.num_shared_experts;
  }
  const int64_t num_logical = E + p.num_shared;
  p.num_extra = 0;
  if (a.to_physical_map.present) {
    TKA_CHECK(a.to_physical_map.shape[0] == num_logical, "to_physical_map", "must have %lld rows, got %lld",
              static_cast<long long>(num_logical), static_cast<long long>(a.to_physical_map.shape[0]));
    TKA_CHECK(a.to_physical_map.shape[1] >= 1, "to_physical_map", "must have at least one column");
    TKA_CHECK(a.logical_count.shape[0] == num_logical, "logical_count", "must have %lld entries, got %lld",
              static_cast<long long>(num_logical), static_cast<long long>(a.logical_count.shape[0]));
    p.num_extra = a.to_physical_map.shape[1] - 1;
  }
  TKA_CHECK(p.num_shared <= p.num_extra, "num_shared_experts",
            "(%lld) needs as many extra experts in to_physical_map (has %lld)", static_cast<long long>(p.num_shared),
            static_cast<long long>(p.num_extra));
  if (a.unmapped_topk_idx.present) {
    TKA_CHECK(a.unmapped_topk_idx.shape[0] == p.num_tokens && a.unmapped_topk_idx.shape[1] == K, "unmapped_topk_idx",
              "must have shape (%lld, %lld), got (%lld, %lld)", static_cast<long long>(p.num_tokens),
              static_cast<long long>(K), static_cast<long long>(a.unmapped_topk_idx.shape[0]),
              static_cast<long long>(a.unmapped_topk_idx.shape[1]));
  }
  if (a.fix_routing_mask.present) {
    TKA_CHECK(a.unmapped_topk_idx.present, "fix_routing_mask", "needs unmapped_topk_idx");
    TKA_CHECK(a.fix_routing_mask.shape[0] == p.num_tokens, "fix_routing_mask", "must have shape (%lld,), got (%lld,)",
              static_cast<long long>(p.num_tokens), static_cast<long long>(a.fix_routing_mask.shape[0]));
  }
  // limits of this implementation (the reference has none of them)
  TKA_CHECK(E <= kMaxExperts, "logits", "must have at most %lld experts (logits.shape[1]), got %lld",
            static_cast<long long>(kMaxExperts), static_cast<long long>(E));
  TKA_CHECK(K + p.num_shared <= kWarp, "num_topk", "plus the shared experts must be at most %lld, got %lld",
            static_cast<long long>(kWarp), static_cast<long long>(K + p.num_shared));
  TKA_CHECK(p.num_tokens <= INT32_MAX - 4 * kWarp, "logits", "has too many tokens (%lld; at most 2^31 - 129)",
            static_cast<long long>(p.num_tokens));
  // the TP mask's ranks (the reference divides by them)
  TKA_CHECK(a.num_ep_ranks >= 1, "num_ep_ranks", "must be >= 1, got %lld", static_cast<long long>(a.num_ep_ranks));
  TKA_CHECK(a.num_tp_ranks >= 1, "num_tp_ranks", "must be >= 1, got %lld", static_cast<long long>(a.num_tp_ranks));
  p.per_gpu = (E + p.num_extra) / a.num_ep_ranks;
  TKA_CHECK(p.per_gpu >= 1, "num_ep_ranks", "(%lld) must be <= the experts (%lld routed + %lld extra)",
            static_cast<long long>(a.num_ep_ranks), static_cast<long long>(E), static_cast<long long>(p.num_extra));
  TKA_CHECK(p.per_gpu <= INT32_MAX / a.num_tp_ranks, "num_tp_ranks",
            "too large: the experts per rank times num_tp_ranks must be below 2^31, got %lld * %lld",
            static_cast<long long>(p.per_gpu), static_cast<long long>(a.num_tp_ranks));
  // The size class: max_experts / 32 slots per lane.
  c.max_experts = align_up(E > 0 ? E : 1, kWarp);
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.topk_idx, I64, {p.num_tokens, a.num_topk + p.num_shared});
  dense_output(s.topk_weights, F32, {p.num_tokens, a.num_topk + p.num_shared});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o,
                        KernelArgs& k) {
  const int64_t E = p.num_experts;
  TKA_CHECK(E <= c.max_experts, "logits", "has more experts than the kernel's class (%lld)",
            static_cast<long long>(c.max_experts));
  k.logits = a.logits.data;
  k.bias = a.bias.data;
  k.mask = a.mask.present ? a.mask.data : nullptr;
  k.fix_routing_mask = a.fix_routing_mask.present ? a.fix_routing_mask.data : nullptr;
  k.to_physical_map = a.to_physical_map.present ? a.to_physical_map.data : nullptr;
  k.logical_count = a.logical_count.present ? a.logical_count.data : nullptr;
  k.unmapped_topk_idx = a.unmapped_topk_idx.present ? a.unmapped_topk_idx.data : nullptr;
  k.topk_idx = o.topk_idx.data;
  k.topk_weights = o.topk_weights.data;
  k.num_tokens = p.num_tokens;
  k.num_experts = E;
  k.num_topk = a.num_topk;
  k.num_shared = p.num_shared;
  k.scoring = a.scoring_func;
  // torch's persistent softmax: next_pow2(E) elements per row over min(next_pow2(E), 32) lanes
  int64_t span = 1;
  while (span < E) span <<= 1;
  k.softmax_span = span;
  k.softmax_width = span < kWarp ? span : kWarp;
  k.grouped = p.grouped;
  k.num_groups = p.grouped ? a.num_groups : 0;
  k.num_topk_groups = p.grouped ? a.num_topk_groups : 0;
  const int64_t per_group = p.grouped ? E / a.num_groups : 1;
  k.experts_per_group = per_group;
  // group of expert e = (e * group_mul) >> group_shift: exact for e * per_group < 2^group_shift
  // (E <= 512 and per_group <= 32 with a group limit)
  k.group_mul = ((int64_t{1} << c.group_shift) + per_group - 1) / per_group;
  k.has_mask = a.mask.present;
  k.has_fix = a.fix_routing_mask.present;
  k.has_unmapped = a.unmapped_topk_idx.present;
  k.unmapped_stride = a.unmapped_topk_idx.present ? a.unmapped_topk_idx.stride[0] : 0;
  k.has_map = a.to_physical_map.present;
  k.map_cols = p.num_extra + 1;
  k.routed_scaling_factor = a.routed_scaling_factor;
  k.ep_rank = a.ep_rank;
  k.per_gpu = p.per_gpu;
  k.per_dp = p.per_gpu * a.num_tp_ranks;
  k.num_tp_ranks = a.num_tp_ranks;
  // a TP rank outside [0, num_tp_ranks) owns no expert: every slot becomes -1, as in the reference
  k.tp_rank = (a.tp_rank >= 0 && a.tp_rank < a.num_tp_ranks) ? a.tp_rank : -1;
  return true;
}

}  // namespace tka::moe_top2_sum_gate::top2_sum_gate
