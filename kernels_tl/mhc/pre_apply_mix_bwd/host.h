// mhc.mhc_pre_apply_mix_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_pre_apply_mix_bwd::mhc_pre_apply_mix_bwd {

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
  TKA_CHECK(a.o_grad.shape[0] == p.num_tokens && a.o_grad.shape[1] == p.hidden, "o_grad",
            "must have shape [%lld, %lld] to match x, got [%lld, %lld]", static_cast<long long>(p.num_tokens),
            static_cast<long long>(p.hidden), static_cast<long long>(a.o_grad.shape[0]),
            static_cast<long long>(a.o_grad.shape[1]));
  if (a.x_grad.present) {
    TKA_CHECK(a.x_grad.shape[0] == p.num_tokens && a.x_grad.shape[1] == p.mhc_mult && a.x_grad.shape[2] == p.hidden,
              "x_grad", "must have the shape of x");
    TKA_CHECK(aligned(a.x_grad.data, 16), "x_grad", "must start 16-byte aligned");
  }
  TKA_CHECK(p.mhc_mult >= 1, "x", "must have at least one stream (shape[1]), got 0");
  TKA_CHECK(p.hidden % 8 == 0, "x", "must have a hidden size (last dim) that is a multiple of 8, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.o_grad.data, 16), "o_grad", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.x_grad_out, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
  dense_output(s.mix_grad, F32, {p.num_tokens, p.mhc_mult, 1});
}

// every token's mix_grad is written, zero when the hidden size is
inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens <= 2147483647, "x", "has too many tokens for one launch");
  TKA_CHECK(aligned(o.x_grad_out.data, 16), "x_grad_out", "must start 16-byte aligned");
  k.o_grad = a.o_grad.data;
  k.x = a.x.data;
  k.mix = a.mix.data;
  k.x_grad = a.x_grad.present ? a.x_grad.data : nullptr;
  k.x_grad_out = o.x_grad_out.data;
  k.mix_grad = o.mix_grad.data;
  k.with_x_grad = a.x_grad.present;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

}  // namespace tka::mhc_pre_apply_mix_bwd::mhc_pre_apply_mix_bwd
