// mhc.mhc_pre_apply_mix: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_pre_apply_mix::mhc_pre_apply_mix {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.mhc_mult = a.x.shape[1];
  p.hidden = a.x.shape[2];
  TKA_CHECK(a.mix.shape[0] == p.num_tokens && a.mix.shape[1] == p.mhc_mult && a.mix.shape[2] == 1, "mix",
            "must have shape [%lld, %lld, 1] to match x, got [%lld, %lld, %lld]", static_cast<long long>(p.num_tokens),
            static_cast<long long>(p.mhc_mult), static_cast<long long>(a.mix.shape[0]),
            static_cast<long long>(a.mix.shape[1]), static_cast<long long>(a.mix.shape[2]));
  TKA_CHECK(p.mhc_mult >= 1, "x", "must have at least one stream (shape[1]), got 0");
  TKA_CHECK(p.hidden % 8 == 0, "x", "must have a hidden size (last dim) that is a multiple of 8, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.out, BF16, {p.num_tokens, p.hidden}); }

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens * (p.hidden / 8) <= 2147483647 - 256, "x", "has too many elements for one launch");
  TKA_CHECK(aligned(o.out.data, 16), "out", "must start 16-byte aligned");
  k.x = a.x.data;
  k.mix = a.mix.data;
  k.out = o.out.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

}  // namespace tka::mhc_pre_apply_mix::mhc_pre_apply_mix
