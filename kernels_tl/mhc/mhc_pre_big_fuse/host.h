// mhc.mhc_pre_big_fuse: host side (interface: tka/host.h).
//
// Two launches on the call's stream: the prologue runs mhc_pre_norm_fn's own host path (its
// plan, its prebuilt kernel) into the scratch buffer `mixes` [num_tokens, M3]; then this folder's
// kernel reads the mixes and the residual and writes post_mix, comb_mix and layer_input.
#pragma once

#include "args.h"
#include "mhc/mhc_pre_norm_fn/args.h"

namespace tka::mhc_mhc_pre_big_fuse::mhc_pre_big_fuse {

namespace norm = ::tka::mhc_mhc_pre_norm_fn::mhc_pre_norm_fn;

struct Plan {
  int64_t num_tokens, mhc_mult, hidden, rows;
  norm::Args norm_args;  // the prologue's call of mhc_pre_norm_fn
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.residual.shape[0];
  p.mhc_mult = a.residual.shape[1];
  p.hidden = a.residual.shape[2];
  p.rows = p.mhc_mult * (p.mhc_mult + 2);
  const long long m = p.mhc_mult, m3 = p.rows, K = p.mhc_mult * p.hidden;
  TKA_CHECK(m >= 1 && m * m <= 32, "residual", "must have 1 to 5 streams (shape[1]), got %lld", m);
  TKA_CHECK(a.fn.shape[0] == m3 && a.fn.shape[1] == K, "fn",
            "must have shape [mhc_mult * (mhc_mult + 2), mhc_mult * hidden] = [%lld, %lld], got [%lld, %lld]", m3, K,
            static_cast<long long>(a.fn.shape[0]), static_cast<long long>(a.fn.shape[1]));
  TKA_CHECK(a.mhc_scale.shape[0] == 3, "mhc_scale", "must have shape (3,), got (%lld,)",
            static_cast<long long>(a.mhc_scale.shape[0]));
  TKA_CHECK(a.mhc_base.shape[0] == m3, "mhc_base", "must have shape (%lld,), got (%lld,)", m3,
            static_cast<long long>(a.mhc_base.shape[0]));
  TKA_CHECK(a.sinkhorn_repeat >= 1 && a.sinkhorn_repeat <= 1000000, "sinkhorn_repeat", "must be in [1, 10^6], got %lld",
            static_cast<long long>(a.sinkhorn_repeat));
  TKA_CHECK(aligned(a.residual.data, 16), "residual", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.fn.data, 16), "fn", "must start 16-byte aligned");
  TKA_CHECK(p.num_tokens * (p.hidden / 8) <= 2147483647 - 256, "residual", "has too many elements for one launch");
  // mhc_pre_norm_fn's kernel's limits (its plan checks them again in the prologue)
  TKA_CHECK(K > 0 && K % 1024 == 0, "residual",
            "must have mhc_mult * hidden a positive multiple of 1024 (256 lanes x 4 elements), got %lld", K);
  TKA_CHECK(K <= (int64_t{1} << 30), "residual", "must have mhc_mult * hidden <= 2^30, got %lld", K);
  TKA_CHECK(m3 * K <= (int64_t{1} << 31) - 1, "fn", "must have fewer than 2^31 elements, got %lld", m3 * K);
  norm::Args& n = p.norm_args;  // mhc_pre_norm_fn(residual, fn, None, rms_eps, n_splits=n_splits)
  n.residual = a.residual;
  n.mhc_fn = a.fn;
  n.mhc_norm_weight = TensorArg{};  // None
  n.mhc_norm_eps = a.rms_eps;
  n.fuse_grad_acc = false;
  n.n_splits = a.n_splits;
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.post_mix, F32, {p.num_tokens, p.mhc_mult, 1});
  dense_output(s.comb_mix, F32, {p.num_tokens, p.mhc_mult, p.mhc_mult});
  dense_output(s.layer_input, BF16, {p.num_tokens, p.hidden});
  dense_output(s.mixes, F32, {p.num_tokens, p.rows});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

// mhc_pre_norm_fn's kernel into the scratch mixes, on the same stream (this kernel waits for it)
inline bool prologue(const char* op, const Args&, const Plan& p, const Outs& o, int device, void* stream) {
  static const TensorArg no_partials{};  // norm-fn's split layout's scratch: never picked without the weight
  return norm::run(op, p.norm_args, norm::Outs{o.mixes, no_partials}, device, stream);
}

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  TKA_CHECK(c.mix_tokens_per_block > 0 && c.threads > 0, "residual", "cannot run: the kernel's layout constants are missing");
  // the kernel's flat thread index over both parts of its grid, (block * threads + thread), is 32-bit
  const int64_t blocks = ceil_div(p.num_tokens, c.mix_tokens_per_block) + ceil_div(p.num_tokens * (p.hidden / 8), c.threads);
  TKA_CHECK(blocks * c.threads <= 2147483647, "residual", "has too many elements for one launch");
  TKA_CHECK(aligned(o.layer_input.data, 16), "layer_input", "must start 16-byte aligned");
  k.mixes = o.mixes.data;
  k.mhc_scale = a.mhc_scale.data;
  k.mhc_base = a.mhc_base.data;
  k.residual = a.residual.data;
  k.post_mix = o.post_mix.data;
  k.comb_mix = o.comb_mix.data;
  k.layer_input = o.layer_input.data;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  k.mhc_post_mult_value = static_cast<float>(a.mhc_post_mult_value);
  k.mhc_pre_eps = static_cast<float>(a.mhc_pre_eps);
  k.eps = static_cast<float>(a.mhc_sinkhorn_eps);
  k.repeat = a.sinkhorn_repeat;
  return true;
}

}  // namespace tka::mhc_mhc_pre_big_fuse::mhc_pre_big_fuse
