// mhc.mhc_pre_split_mixes: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_pre_split_mixes::mhc_pre_split_mixes {

struct Plan {
  int64_t num_tokens, mult, mult3;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  TKA_CHECK(a.mhc_mult >= 1 && a.mhc_mult <= 16, "mhc_mult", "must be in [1, 16], got %lld",
            static_cast<long long>(a.mhc_mult));
  p.mult = a.mhc_mult;
  p.mult3 = p.mult * (p.mult + 2);
  p.num_tokens = a.input_mixes.shape[0];
  TKA_CHECK(a.input_mixes.shape[1] == p.mult3, "input_mixes", "must have mhc_mult * (mhc_mult + 2) = %lld mixes, got %lld",
            static_cast<long long>(p.mult3), static_cast<long long>(a.input_mixes.shape[1]));
  TKA_CHECK(a.mhc_scale.shape[0] == 3, "mhc_scale", "must have shape (3,), got (%lld,)",
            static_cast<long long>(a.mhc_scale.shape[0]));
  TKA_CHECK(a.mhc_base.shape[0] == p.mult3, "mhc_base", "must have shape (%lld,), got (%lld,)",
            static_cast<long long>(p.mult3), static_cast<long long>(a.mhc_base.shape[0]));
  c.mhc_mult = p.mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.pre_layer_mix, F32, {p.num_tokens, p.mult, 1});
  dense_output(s.post_layer_mix, F32, {p.num_tokens, p.mult, 1});
  dense_output(s.comb_res_mix, F32, {p.num_tokens, p.mult, p.mult});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.input_mixes = a.input_mixes.data;
  k.mhc_scale = a.mhc_scale.data;
  k.mhc_base = a.mhc_base.data;
  k.pre_layer_mix = o.pre_layer_mix.data;
  k.post_layer_mix = o.post_layer_mix.data;
  k.comb_res_mix = o.comb_res_mix.data;
  k.num_tokens = p.num_tokens;
  k.mhc_post_mult_value = static_cast<float>(a.mhc_post_mult_value);
  k.mhc_pre_eps = static_cast<float>(a.mhc_pre_eps);
  return true;
}

}  // namespace tka::mhc_mhc_pre_split_mixes::mhc_pre_split_mixes
