// mhc.expand_to_mhc: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_expand_to_mhc::expand_to_mhc {

struct Plan {
  int64_t num_tokens, hidden, mhc_mult;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.hidden.shape[0];
  p.hidden = a.hidden.shape[1];
  p.mhc_mult = a.mhc_mult;
  TKA_CHECK(p.mhc_mult >= 1, "mhc_mult", "must be at least 1, got %lld", static_cast<long long>(p.mhc_mult));
  TKA_CHECK(p.hidden % 8 == 0, "hidden", "must have a hidden size (last dim) that is a multiple of 8, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.hidden.data, 16), "hidden", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.out, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens * (p.hidden / 8) <= 2147483647 - 256, "hidden", "has too many elements for one launch");
  TKA_CHECK(aligned(o.out.data, 16), "out", "must start 16-byte aligned");
  k.hidden = a.hidden.data;
  k.out = o.out.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

}  // namespace tka::mhc_expand_to_mhc::expand_to_mhc
