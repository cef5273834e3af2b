// moe.normalize_weight: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::moe_normalize_weight::normalize_weight {

struct Plan {
  int64_t num_tokens, num_topk;
};

inline bool plan(const char*, const Args& a, Plan& p, Config&) {
  p.num_tokens = a.topk_weights.shape[0];
  p.num_topk = a.topk_weights.shape[1];
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.denominator, F32, {p.num_tokens});
  dense_output(s.normalized, F32, {p.num_tokens, p.num_topk});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.topk_weights = a.topk_weights.data;
  k.denominator = o.denominator.data;
  k.normalized = o.normalized.data;
  k.num_elements = p.num_tokens * p.num_topk;
  k.num_topk = p.num_topk;
  return true;
}

}  // namespace tka::moe_normalize_weight::normalize_weight
