// mhc.mhc_post_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_post_bwd::mhc_post_bwd {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.residual.shape[0];
  p.mhc_mult = a.residual.shape[1];
  p.hidden = a.residual.shape[2];
  const long long n = p.num_tokens, m = p.mhc_mult, h = p.hidden;
  TKA_CHECK(a.x.shape[0] == n && a.x.shape[1] == h, "x", "must have shape [%lld, %lld] to match residual", n, h);
  TKA_CHECK(a.post_layer_mix.shape[0] == n && a.post_layer_mix.shape[1] == m && a.post_layer_mix.shape[2] == 1,
            "post_layer_mix", "must have shape [%lld, %lld, 1] to match residual", n, m);
  TKA_CHECK(a.comb_res_mix.shape[0] == n && a.comb_res_mix.shape[1] == m && a.comb_res_mix.shape[2] == m,
            "comb_res_mix", "must have shape [%lld, %lld, %lld] to match residual", n, m, m);
  TKA_CHECK(a.d_o.shape[0] == n && a.d_o.shape[1] == m && a.d_o.shape[2] == h, "d_o",
            "must have the shape of residual [%lld, %lld, %lld]", n, m, h);
  TKA_CHECK(m >= 1, "residual", "must have at least one stream (shape[1]), got 0");
  TKA_CHECK(h % 8 == 0, "residual", "must have a hidden size (last dim) that is a multiple of 8, got %lld", h);
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.residual.data, 16), "residual", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.d_o.data, 16), "d_o", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.d_x, BF16, {p.num_tokens, p.hidden});
  dense_output(s.d_residual, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
  dense_output(s.d_post_layer_mix, F32, {p.num_tokens, p.mhc_mult, 1});
  dense_output(s.d_comb_res_mix, F32, {p.num_tokens, p.mhc_mult, p.mhc_mult});
}

// every token's mix gradients are written, zero when the hidden size is
inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens <= 2147483647, "residual", "has too many tokens for one launch");
  TKA_CHECK(aligned(o.d_x.data, 16), "d_x", "must start 16-byte aligned");
  TKA_CHECK(aligned(o.d_residual.data, 16), "d_residual", "must start 16-byte aligned");
  k.x = a.x.data;
  k.residual = a.residual.data;
  k.post_mix = a.post_layer_mix.data;
  k.comb_mix = a.comb_res_mix.data;
  k.d_o = a.d_o.data;
  k.d_x = o.d_x.data;
  k.d_residual = o.d_residual.data;
  k.d_post = o.d_post_layer_mix.data;
  k.d_comb = o.d_comb_res_mix.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

}  // namespace tka::mhc_post_bwd::mhc_post_bwd
