// engram.engram_gate_fwd: host side (interface: tka/host.h).
#pragma once

#include <algorithm>
#include <cmath>

#include "args.h"

namespace tka::engram_engram_gate_fwd::engram_gate_fwd {

struct Plan {
  int64_t num_tokens, hc_mult, hidden;
  int64_t sms;  // the device's SM count (the persistent grid's unit)
};

// Blocks per stream: one block per SM, every block with a token.
inline int64_t groups(const Plan& p) {
  return std::min<int64_t>(p.num_tokens, std::max<int64_t>(1, p.sms / p.hc_mult));
}

// Up to this many tokens per block the "small" layout serves the call (fewer, longer stages;
// every table H gives it at least 8 warps, so each warp has one token or none).
constexpr int64_t kSmallTokensPerGroup = 8;

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.hidden_states.shape[0];
  p.hc_mult = a.hidden_states.shape[1];
  p.hidden = a.hidden_states.shape[2];
  const long long T = p.num_tokens, hc = p.hc_mult, h = p.hidden;
  TKA_CHECK(a.k.shape[0] == T && a.k.shape[1] == hc && a.k.shape[2] == h, "k",
            "must have the shape of hidden_states [%lld, %lld, %lld], got [%lld, %lld, %lld]", T, hc, h,
            static_cast<long long>(a.k.shape[0]), static_cast<long long>(a.k.shape[1]),
            static_cast<long long>(a.k.shape[2]));
  TKA_CHECK(a.v.shape[0] == T && a.v.shape[1] == h, "v", "must have shape [%lld, %lld], got [%lld, %lld]", T, h,
            static_cast<long long>(a.v.shape[0]), static_cast<long long>(a.v.shape[1]));
  TKA_CHECK(a.weight_fused.shape[0] == hc && a.weight_fused.shape[1] == h, "weight_fused",
            "must have shape [%lld, %lld], got [%lld, %lld]", hc, h, static_cast<long long>(a.weight_fused.shape[0]),
            static_cast<long long>(a.weight_fused.shape[1]));
  TKA_CHECK(h % 256 == 0, "hidden_states", "must have a hidden size divisible by 256 (32 lanes x 16-byte pieces), got %lld", h);
  // 16-byte pieces: every row of k and v must start 16-byte aligned
  TKA_CHECK(aligned(a.hidden_states.data, 16), "hidden_states", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.k.data, 16), "k", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.v.data, 16), "v", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.weight_fused.data, 16), "weight_fused", "must start 16-byte aligned");
  TKA_CHECK(T <= 1 || a.k.stride[0] % 8 == 0, "k.stride(0)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.k.stride[0]));
  TKA_CHECK(hc <= 1 || a.k.stride[1] % 8 == 0, "k.stride(1)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.k.stride[1]));
  TKA_CHECK(T <= 1 || a.v.stride[0] % 8 == 0, "v.stride(0)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.v.stride[0]));
  // the persistent grid: one block per SM of the device (132 for a tensor off CUDA)
  p.sms = plan_sm_count(op, a.hidden_states.device);
  if (p.sms < 0) return false;  // the device query failed (error set)
  c.hc_mult = p.hc_mult;
  c.hidden = p.hidden;
  c.batch = p.num_tokens <= groups(p) * kSmallTokensPerGroup ? "small" : "large";
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.output, BF16, {p.num_tokens, p.hc_mult, p.hidden});
  if (a.save_for_backward) {
    dense_output(s.dot, F32, {p.num_tokens, p.hc_mult});
    dense_output(s.gate_score, F32, {p.num_tokens, p.hc_mult});
    dense_output(s.rstd_x, F32, {p.num_tokens, p.hc_mult});
    dense_output(s.rstd_k, F32, {p.num_tokens, p.hc_mult});
  } else {  // nothing saved: returned as None
    s.dot.skip = s.gate_score.skip = s.rstd_x.skip = s.rstd_k.skip = true;
  }
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hc_mult > 0 && p.hidden > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.hidden_states = a.hidden_states.data;
  k.k = a.k.data;
  k.v = a.v.data;
  k.weight_fused = a.weight_fused.data;
  k.output = o.output.data;
  k.dot = o.dot.data;
  k.gate_score = o.gate_score.data;
  k.rstd_x = o.rstd_x.data;
  k.rstd_k = o.rstd_k.data;
  k.num_tokens = p.num_tokens;
  k.num_groups = groups(p);  // hc blocks (one per stream) per group
  // strides of size-1 dims are free: give them an aligned value
  k.k_stride_t = p.num_tokens > 1 ? a.k.stride[0] : p.hc_mult * p.hidden;
  k.k_stride_c = p.hc_mult > 1 ? a.k.stride[1] : p.hidden;
  k.v_stride_t = p.num_tokens > 1 ? a.v.stride[0] : p.hidden;
  k.saved_rows = a.save_for_backward ? p.num_tokens : 0;
  k.eps = static_cast<float>(a.eps);
  k.clamp_value = static_cast<float>(a.clamp_value);
  // Python's hidden ** -0.5 (C pow in double), then rounded to float32 as torch does
  k.scalar = static_cast<float>(std::pow(static_cast<double>(p.hidden), -0.5));
  return true;
}

}  // namespace tka::engram_engram_gate_fwd::engram_gate_fwd
