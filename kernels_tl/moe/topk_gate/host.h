// moe.topk_gate: host side (see csrc/include/tka/host.h for the interface).
#pragma once

#include "args.h"

namespace tka::moe_topk_gate::topk_gate {

// kernel.py: MAX_EXPERTS (16 slots of 32 experts per lane) and WARP.
constexpr int64_t kMaxExperts = 512;
constexpr int64_t kWarp = 32;

struct Plan {
  int64_t num_tokens, num_experts;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.scores.shape[0];
  p.num_experts = a.scores.shape[1];
  TKA_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "scores",
            "must have 1 to %lld experts (scores.shape[1]), got %lld", static_cast<long long>(kMaxExperts),
            static_cast<long long>(p.num_experts));
  TKA_CHECK(a.num_topk >= 1 && a.num_topk <= p.num_experts, "num_topk",
            "must be in [1, num_experts] (scores.shape[1] = %lld), got %lld", static_cast<long long>(p.num_experts),
            static_cast<long long>(a.num_topk));
  // The size class: the kernel keeps max_experts / 32 slots per lane, all full but the last,
  // whose lanes past num_experts are padding.
  c.max_experts = align_up(p.num_experts, kWarp);
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { dense_output(s.out, I64, {p.num_tokens, a.num_topk}); }

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.scores = a.scores.data;
  k.topk_idx = o.out.data;
  k.num_tokens = p.num_tokens;
  k.num_experts = p.num_experts;
  k.num_topk = a.num_topk;
  return true;
}

}  // namespace tka::moe_topk_gate::topk_gate
