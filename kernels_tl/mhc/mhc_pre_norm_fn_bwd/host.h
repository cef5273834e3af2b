// mhc.mhc_pre_norm_fn_bwd_mul: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_pre_norm_fn_bwd::mhc_pre_norm_fn_bwd_mul {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden, features, rows, cluster;
};

// Blocks per 32-column slice, each taking every cluster-th tile of 64 tokens: going up from 1,
// a larger cluster is taken when its grid fills whole waves of the SMs' block slots (2 blocks
// per SM, by registers) better by more than 5 points, as long as each block keeps at least 4
// tiles to share the slice's fixed work (W, the final sums) over.
inline int64_t pick_cluster(int64_t num_tokens, int64_t features, int64_t sms) {
  const int64_t tiles = (num_tokens + 63) / 64, slices = features / 32, slots = 2 * (sms > 0 ? sms : 1);
  int64_t best = 1;
  double best_fill = 0.0;
  for (int64_t c = 1; c <= 8; c *= 2) {
    if (c > 1 && (tiles + c - 1) / c < 4) break;
    const int64_t blocks = slices * c, waves = (blocks + slots - 1) / slots;
    const double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (fill > best_fill + 0.05) best = c, best_fill = fill;
  }
  return best;
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.residual.shape[0];
  p.mhc_mult = a.residual.shape[1];
  p.hidden = a.residual.shape[2];
  p.features = p.mhc_mult * p.hidden;
  p.rows = p.mhc_mult * (p.mhc_mult + 2);
  const long long T = p.num_tokens, K = p.features, m3 = p.rows;
  TKA_CHECK(a.mhc_fn.shape[0] == m3 && a.mhc_fn.shape[1] == K, "mhc_fn",
            "must have shape [mhc_mult * (mhc_mult + 2), mhc_mult * hidden] = [%lld, %lld], got [%lld, %lld]", m3, K,
            static_cast<long long>(a.mhc_fn.shape[0]), static_cast<long long>(a.mhc_fn.shape[1]));
  TKA_CHECK(a.out_mul_grad.shape[0] == T && a.out_mul_grad.shape[1] == m3, "out_mul_grad",
            "must have shape [num_tokens, mhc_mult * (mhc_mult + 2)] = [%lld, %lld], got [%lld, %lld]", T, m3,
            static_cast<long long>(a.out_mul_grad.shape[0]), static_cast<long long>(a.out_mul_grad.shape[1]));
  TKA_CHECK(a.sqrsum_grad.shape[0] == T, "sqrsum_grad", "must have shape [num_tokens] = [%lld], got [%lld]", T,
            static_cast<long long>(a.sqrsum_grad.shape[0]));
  if (a.x_grad.present) {
    TKA_CHECK(a.x_grad.shape[0] == T && a.x_grad.shape[1] == p.mhc_mult && a.x_grad.shape[2] == p.hidden, "x_grad",
              "must have the shape of residual");
    TKA_CHECK(aligned(a.x_grad.data, 16), "x_grad", "must start 16-byte aligned");
  }
  TKA_CHECK(p.mhc_mult >= 2 && p.mhc_mult % 2 == 0, "residual", "must have an even mhc_mult (shape[1]), got %lld",
            static_cast<long long>(p.mhc_mult));
  TKA_CHECK(K > 0 && K % 32 == 0, "residual", "must have mhc_mult * hidden a positive multiple of 32, got %lld", K);
  TKA_CHECK(K <= (int64_t{1} << 30), "residual", "must have mhc_mult * hidden <= 2^30, got %lld", K);
  TKA_CHECK(m3 * K <= (int64_t{1} << 31) - 1, "mhc_fn", "must have fewer than 2^31 elements, got %lld", m3 * K);
  TKA_CHECK(aligned(a.residual.data, 16), "residual", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.out_mul_grad.data, 16), "out_mul_grad", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.sqrsum_grad.data, 4), "sqrsum_grad", "must start 4-byte aligned");
  const int sms = plan_sm_count(op, a.residual.device);
  if (sms < 0) return false;  // the device query failed (error set)
  p.cluster = pick_cluster(p.num_tokens, K, sms);
  c.mhc_mult = p.mhc_mult;
  c.cluster = p.cluster;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.x_grad_out, BF16, {p.num_tokens, p.mhc_mult, p.hidden});
  dense_output(s.fn_grad, F32, {p.rows, p.features});
}

// fn_grad is written (zero) even without tokens
inline bool needs_launch(const Plan& p) { return p.features > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  TKA_CHECK(aligned(o.x_grad_out.data, 4), "x_grad_out", "must start 4-byte aligned");
  k.out_mul_grad = a.out_mul_grad.data;
  k.sqrsum_grad = a.sqrsum_grad.data;
  k.residual = a.residual.data;
  k.mhc_fn = a.mhc_fn.data;
  // without x_grad the kernel never reads it (with_x_grad == 0); any valid pointer stands in
  k.x_grad = a.x_grad.present ? a.x_grad.data : a.residual.data;
  k.x_grad_out = o.x_grad_out.data;
  k.fn_grad = o.fn_grad.data;
  k.with_x_grad = a.x_grad.present ? 1 : 0;
  k.num_tokens = p.num_tokens;
  k.features = p.features;
  return true;
}

}  // namespace tka::mhc_mhc_pre_norm_fn_bwd::mhc_pre_norm_fn_bwd_mul
