// mhc.mhc_head_compute_mix: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_head_compute_mix::mhc_head_compute_mix {

struct Plan {
  int64_t num_tokens, mult;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.input_mix.shape[0];
  p.mult = a.input_mix.shape[1];
  TKA_CHECK(a.mhc_scale.shape[0] == 1, "mhc_scale", "must have shape (1,), got (%lld,)",
            static_cast<long long>(a.mhc_scale.shape[0]));
  TKA_CHECK(a.mhc_base.shape[0] == p.mult, "mhc_base", "must have shape (%lld,) to match input_mix, got (%lld,)",
            static_cast<long long>(p.mult), static_cast<long long>(a.mhc_base.shape[0]));
  c.mhc_mult = p.mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.output_mix, F32, {p.num_tokens, p.mult}); }

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.input_mix = a.input_mix.data;
  k.mhc_scale = a.mhc_scale.data;
  k.mhc_base = a.mhc_base.data;
  k.output_mix = o.output_mix.data;
  k.num_tokens = p.num_tokens;
  k.mhc_pre_eps = static_cast<float>(a.mhc_pre_eps);
  return true;
}

}  // namespace tka::mhc_mhc_head_compute_mix::mhc_head_compute_mix
