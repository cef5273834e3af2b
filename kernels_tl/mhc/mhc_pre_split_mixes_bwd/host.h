// mhc.mhc_pre_split_mixes_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_pre_split_mixes_bwd::mhc_pre_split_mixes_bwd {

// Up to this many tokens the one-launch cluster kernel serves the call, above it the blocks
// kernel's two launches (kernel.py: CLUSTER_TOKENS, and BLOCKS, whose 2 * M3 partial sums each
// the scratch holds; kernel_args checks both against the kernel's constants).
constexpr int64_t kClusterTokens = 128;
constexpr int64_t kBlocks = 128;

struct Plan {
  int64_t num_tokens, mult, mult3;
  bool cluster;
};

inline bool same_shape(const TensorArg& t, int64_t d0, int64_t d1, int64_t d2) {
  return t.shape[0] == d0 && t.shape[1] == d1 && t.shape[2] == d2;
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  TKA_CHECK(a.mhc_mult >= 1 && a.mhc_mult <= 16, "mhc_mult", "must be in [1, 16], got %lld",
            static_cast<long long>(a.mhc_mult));
  p.mult = a.mhc_mult;
  p.mult3 = p.mult * (p.mult + 2);
  p.num_tokens = a.input_mixes.shape[0];
  const long long n = p.num_tokens, m = p.mult;
  TKA_CHECK(a.input_mixes.shape[1] == p.mult3, "input_mixes", "must have mhc_mult * (mhc_mult + 2) = %lld mixes, got %lld",
            static_cast<long long>(p.mult3), static_cast<long long>(a.input_mixes.shape[1]));
  TKA_CHECK(same_shape(a.pre_layer_mix_grad, n, m, 1), "pre_layer_mix_grad", "must have shape [%lld, %lld, 1]", n, m);
  TKA_CHECK(same_shape(a.post_layer_mix_grad, n, m, 1), "post_layer_mix_grad", "must have shape [%lld, %lld, 1]", n, m);
  TKA_CHECK(same_shape(a.comb_res_mix_grad, n, m, m), "comb_res_mix_grad", "must have shape [%lld, %lld, %lld]", n, m, m);
  TKA_CHECK(a.mhc_scale.shape[0] == 3, "mhc_scale", "must have shape (3,), got (%lld,)",
            static_cast<long long>(a.mhc_scale.shape[0]));
  TKA_CHECK(a.mhc_base.shape[0] == p.mult3, "mhc_base", "must have shape (%lld,), got (%lld,)",
            static_cast<long long>(p.mult3), static_cast<long long>(a.mhc_base.shape[0]));
  c.mhc_mult = p.mult;
  p.cluster = p.num_tokens <= kClusterTokens;
  c.path = p.cluster ? "cluster" : "blocks";
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.input_mixes_grad, F32, {p.num_tokens, p.mult3});
  dense_output(s.mhc_scale_grad, F32, {3});
  dense_output(s.mhc_base_grad, F32, {p.mult3});
  // the blocks kernel's partial sums, written by launch 0 before launch 1 reads them; the
  // cluster kernel has none (skipped: no tensor is made for it)
  dense_output(s.scratch, F32, {kBlocks * 2 * p.mult3});
  s.scratch.skip = p.cluster;
}

// zero tokens still launch: the scale and base gradients are then zeros
inline bool needs_launch(const Plan&) { return true; }

// The blocks kernel: launch 0 writes the input gradient and each block's partial sums; launch 1
// (which waits for it) sums the partials.
inline int64_t launches(const Plan& p) { return p.cluster ? 1 : 2; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k,
                        int64_t launch) {
  TKA_CHECK(c.blocks == kBlocks && c.cluster_tokens == kClusterTokens, "input_mixes",
            "cannot run: the kernel's constants (%lld blocks, %lld tokens) differ from the host's (%lld, %lld)",
            static_cast<long long>(c.blocks), static_cast<long long>(c.cluster_tokens),
            static_cast<long long>(kBlocks), static_cast<long long>(kClusterTokens));
  k.pre_layer_mix_grad = a.pre_layer_mix_grad.data;
  k.post_layer_mix_grad = a.post_layer_mix_grad.data;
  k.comb_res_mix_grad = a.comb_res_mix_grad.data;
  k.input_mixes = a.input_mixes.data;
  k.mhc_scale = a.mhc_scale.data;
  k.mhc_base = a.mhc_base.data;
  k.input_mixes_grad = o.input_mixes_grad.data;
  k.mhc_scale_grad = o.mhc_scale_grad.data;
  k.mhc_base_grad = o.mhc_base_grad.data;
  k.num_tokens = p.num_tokens;
  k.mhc_post_mult_value = static_cast<float>(a.mhc_post_mult_value);
  // the blocks kernel's parameters (absent from a build with the cluster kernel alone)
  TKA_SET_IF_PRESENT(k, scratch, o.scratch.data);
  TKA_SET_IF_PRESENT(k, phase, static_cast<int32_t>(launch));
  return true;
}

}  // namespace tka::mhc_mhc_pre_split_mixes_bwd::mhc_pre_split_mixes_bwd
