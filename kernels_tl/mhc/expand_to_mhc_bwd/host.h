// mhc.expand_to_mhc_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_expand_to_mhc_bwd::expand_to_mhc_bwd {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.out_grad.shape[0];
  p.mhc_mult = a.out_grad.shape[1];
  p.hidden = a.out_grad.shape[2];
  TKA_CHECK(p.mhc_mult >= 1, "out_grad", "must have at least one stream (shape[1]), got 0");
  TKA_CHECK(p.hidden % 8 == 0, "out_grad", "must have a hidden size (last dim) that is a multiple of 8, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.out_grad.data, 16), "out_grad", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.hidden_grad, BF16, {p.num_tokens, p.hidden});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens * (p.hidden / 8) <= 2147483647 - 256, "out_grad", "has too many elements for one launch");
  TKA_CHECK(aligned(o.hidden_grad.data, 16), "hidden_grad", "must start 16-byte aligned");
  k.out_grad = a.out_grad.data;
  k.hidden_grad = o.hidden_grad.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

}  // namespace tka::mhc_expand_to_mhc_bwd::expand_to_mhc_bwd
