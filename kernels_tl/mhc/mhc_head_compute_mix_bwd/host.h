// mhc.mhc_head_compute_mix_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_head_compute_mix_bwd::mhc_head_compute_mix_bwd {

struct Plan {
  int64_t num_tokens, mult;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.input_mix.shape[0];
  p.mult = a.input_mix.shape[1];
  TKA_CHECK(a.output_mix_grad.shape[0] == p.num_tokens && a.output_mix_grad.shape[1] == p.mult, "output_mix_grad",
            "must have the shape of input_mix [%lld, %lld], got [%lld, %lld]", static_cast<long long>(p.num_tokens),
            static_cast<long long>(p.mult), static_cast<long long>(a.output_mix_grad.shape[0]),
            static_cast<long long>(a.output_mix_grad.shape[1]));
  TKA_CHECK(a.mhc_scale.shape[0] == 1, "mhc_scale", "must have shape (1,), got (%lld,)",
            static_cast<long long>(a.mhc_scale.shape[0]));
  TKA_CHECK(a.mhc_base.shape[0] == p.mult, "mhc_base", "must have shape (%lld,) to match input_mix, got (%lld,)",
            static_cast<long long>(p.mult), static_cast<long long>(a.mhc_base.shape[0]));
  c.mhc_mult = p.mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.input_mix_grad, F32, {p.num_tokens, p.mult});
  dense_output(s.mhc_scale_grad, F32, {1});
  dense_output(s.mhc_base_grad, F32, {p.mult});
}

// zero tokens still launch: the scale and base gradients are then zeros
inline bool needs_launch(const Plan&) { return true; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.output_mix_grad = a.output_mix_grad.data;
  k.input_mix = a.input_mix.data;
  k.mhc_scale = a.mhc_scale.data;
  k.mhc_base = a.mhc_base.data;
  k.input_mix_grad = o.input_mix_grad.data;
  k.mhc_scale_grad = o.mhc_scale_grad.data;
  k.mhc_base_grad = o.mhc_base_grad.data;
  k.num_tokens = p.num_tokens;
  return true;
}

}  // namespace tka::mhc_mhc_head_compute_mix_bwd::mhc_head_compute_mix_bwd
