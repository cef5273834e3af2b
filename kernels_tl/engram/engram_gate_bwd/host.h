// engram.engram_gate_bwd: host side (interface: tka/host.h).
#pragma once

#include <cmath>

#include "args.h"

namespace tka::engram_engram_gate_bwd::engram_gate_bwd {

struct Plan {
  int64_t num_tokens, hc_mult, hidden, num_blocks;
};

inline bool check_rows(const char* op, const char* name, const TensorArg& t, const Plan& p) {
  TKA_CHECK(t.shape[0] == p.num_tokens && t.shape[1] == p.hc_mult && t.shape[2] == p.hidden, name,
            "must have the shape of hidden_states [%lld, %lld, %lld], got [%lld, %lld, %lld]",
            static_cast<long long>(p.num_tokens), static_cast<long long>(p.hc_mult), static_cast<long long>(p.hidden),
            static_cast<long long>(t.shape[0]), static_cast<long long>(t.shape[1]), static_cast<long long>(t.shape[2]));
  return true;
}

inline bool check_saved(const char* op, const char* name, const TensorArg& t, const Plan& p) {
  TKA_CHECK(t.shape[0] == p.num_tokens && t.shape[1] == p.hc_mult, name, "must have shape [%lld, %lld], got [%lld, %lld]",
            static_cast<long long>(p.num_tokens), static_cast<long long>(p.hc_mult), static_cast<long long>(t.shape[0]),
            static_cast<long long>(t.shape[1]));
  return true;
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.hidden_states.shape[0];
  p.hc_mult = a.hidden_states.shape[1];
  p.hidden = a.hidden_states.shape[2];
  const long long T = p.num_tokens, hc = p.hc_mult, h = p.hidden;
  if (!check_rows(op, "grad_out", a.grad_out, p) || !check_rows(op, "k", a.k, p)) return false;
  TKA_CHECK(a.v.shape[0] == T && a.v.shape[1] == h, "v", "must have shape [%lld, %lld], got [%lld, %lld]", T, h,
            static_cast<long long>(a.v.shape[0]), static_cast<long long>(a.v.shape[1]));
  TKA_CHECK(a.weight_fused.shape[0] == hc && a.weight_fused.shape[1] == h, "weight_fused",
            "must have shape [%lld, %lld], got [%lld, %lld]", hc, h, static_cast<long long>(a.weight_fused.shape[0]),
            static_cast<long long>(a.weight_fused.shape[1]));
  if (!check_saved(op, "dot", a.dot, p) || !check_saved(op, "gate_score", a.gate_score, p) ||
      !check_saved(op, "rstd_x", a.rstd_x, p) || !check_saved(op, "rstd_k", a.rstd_k, p))
    return false;
  TKA_CHECK(hc == 4, "hidden_states", "must have hc_mult == 4 (dim 1) for the backward kernel, got %lld", hc);
  TKA_CHECK(h % 1024 == 0, "hidden_states",
            "must have a hidden size divisible by 1024 (128 lanes per stream x 16-byte pieces), got %lld", h);
  TKA_CHECK(aligned(a.grad_out.data, 16), "grad_out", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.hidden_states.data, 16), "hidden_states", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.k.data, 16), "k", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.v.data, 16), "v", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.weight_fused.data, 16), "weight_fused", "must start 16-byte aligned");
  TKA_CHECK(T <= 1 || a.k.stride[0] % 8 == 0, "k.stride(0)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.k.stride[0]));
  TKA_CHECK(a.k.stride[1] % 8 == 0, "k.stride(1)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.k.stride[1]));
  TKA_CHECK(T <= 1 || a.v.stride[0] % 8 == 0, "v.stride(0)", "must be a multiple of 8 (16-byte aligned rows), got %lld",
            static_cast<long long>(a.v.stride[0]));
  // one block per SM of the device (the reference's P); 132 for a tensor off CUDA, as the reference
  p.num_blocks = plan_sm_count(op, a.hidden_states.device);
  if (p.num_blocks < 0) return false;  // the device query failed (error set)
  c.hc_mult = p.hc_mult;
  c.hidden = p.hidden;
  // at most one token per chunk (T <= P): the small-batch kernel, P x 4 blocks of 128 threads (one
  // per token and stream; its grid is the kernel's own expression), every load in flight at once;
  // more: the persistent kernel, P blocks of 512 threads, which walks each chunk
  c.small_batch = p.num_tokens <= p.num_blocks;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.grad_hidden_states, BF16, {p.num_tokens, p.hc_mult, p.hidden});
  dense_output(s.grad_k, BF16, {p.num_tokens, p.hc_mult, p.hidden});
  dense_output(s.grad_v, BF16, {p.num_tokens, p.hidden});
  dense_output(s.grad_w_partial, F32, {p.num_blocks, p.hc_mult, p.hidden});
}

// An empty batch still writes grad_w_partial (zeros): the kernel runs with every chunk empty.
inline bool needs_launch(const Plan& p) { return p.hidden > 0 && p.hc_mult > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.grad_out = a.grad_out.data;
  k.hidden_states = a.hidden_states.data;
  k.k = a.k.data;
  k.v = a.v.data;
  k.weight_fused = a.weight_fused.data;
  k.dot = a.dot.data;
  k.gate_score = a.gate_score.data;
  k.rstd_x = a.rstd_x.data;
  k.rstd_k = a.rstd_k.data;
  k.grad_x = o.grad_hidden_states.data;
  k.grad_k = o.grad_k.data;
  k.grad_v = o.grad_v.data;
  k.grad_w_partial = o.grad_w_partial.data;
  k.num_tokens = p.num_tokens;
  k.num_blocks = p.num_blocks;
  k.k_stride_t = p.num_tokens > 1 ? a.k.stride[0] : p.hc_mult * p.hidden;
  k.k_stride_c = a.k.stride[1];
  k.v_stride_t = p.num_tokens > 1 ? a.v.stride[0] : p.hidden;
  k.clamp_value = static_cast<float>(a.clamp_value);
  k.scalar = static_cast<float>(std::pow(static_cast<double>(p.hidden), -0.5));
  return true;
}

}  // namespace tka::engram_engram_gate_bwd::engram_gate_bwd
