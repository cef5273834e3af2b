// mhc.mhc_post, mhc.mhc_post_fwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_post {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden;
};

// The shapes every mhc_post op (forward and backward) checks: x [N, H], residual [N, M, H],
// post_layer_mix [N, M, 1], comb_res_mix [N, M, M].
inline bool plan_post(const char* op, const TensorArg& x, const TensorArg& residual, const TensorArg& post,
                      const TensorArg& comb, Plan& p, Config& c) {
  p.num_tokens = residual.shape[0];
  p.mhc_mult = residual.shape[1];
  p.hidden = residual.shape[2];
  const long long n = p.num_tokens, m = p.mhc_mult, h = p.hidden;
  TKA_CHECK(x.shape[0] == n && x.shape[1] == h, "x", "must have shape [%lld, %lld] to match residual", n, h);
  TKA_CHECK(post.shape[0] == n && post.shape[1] == m && post.shape[2] == 1, "post_layer_mix",
            "must have shape [%lld, %lld, 1] to match residual", n, m);
  TKA_CHECK(comb.shape[0] == n && comb.shape[1] == m && comb.shape[2] == m, "comb_res_mix",
            "must have shape [%lld, %lld, %lld] to match residual", n, m, m);
  TKA_CHECK(m >= 1, "residual", "must have at least one stream (shape[1]), got 0");
  TKA_CHECK(h % 8 == 0, "residual", "must have a hidden size (last dim) that is a multiple of 8, got %lld", h);
  TKA_CHECK(aligned(x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(aligned(residual.data, 16), "residual", "must start 16-byte aligned");
  c.mhc_mult = p.mhc_mult;
  return true;
}

template <typename A, typename O>
inline bool post_args(const char* op, const A& a, const Plan& p, const O& o, KernelArgs& k) {
  TKA_CHECK(p.num_tokens * (p.hidden / 8) <= 2147483647 - 256, "residual", "has too many elements for one launch");
  TKA_CHECK(aligned(o.out.data, 16), "out", "must start 16-byte aligned");
  k.x = a.x.data;
  k.residual = a.residual.data;
  k.post_mix = a.post_layer_mix.data;
  k.comb_mix = a.comb_res_mix.data;
  k.out = o.out.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

namespace mhc_post {
using tka::mhc_post::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  return plan_post(op, a.x, a.residual, a.post_layer_mix, a.comb_res_mix, p, c);
}
inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.out, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
}
inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  return post_args(op, a, p, o, k);
}
}  // namespace mhc_post

namespace mhc_post_fwd {
using tka::mhc_post::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  return plan_post(op, a.x, a.residual, a.post_layer_mix, a.comb_res_mix, p, c);
}
inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.out, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
}
inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  return post_args(op, a, p, o, k);
}
}  // namespace mhc_post_fwd

}  // namespace tka::mhc_post
