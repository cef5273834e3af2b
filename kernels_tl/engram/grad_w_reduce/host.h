// engram.grad_w_reduce: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::engram_grad_w_reduce::grad_w_reduce {

struct Plan {
  int64_t num_rows, hc_mult, hidden;
};

inline bool same_shape(const TensorArg& t, const Plan& p) { return t.shape[0] == p.hc_mult && t.shape[1] == p.hidden; }

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  p.num_rows = a.grad_w_partial.shape[0];
  p.hc_mult = a.grad_w_partial.shape[1];
  p.hidden = a.grad_w_partial.shape[2];
  const long long hc = p.hc_mult, h = p.hidden;
  TKA_CHECK(same_shape(a.weight_hidden, p), "weight_hidden", "must have shape [%lld, %lld] (grad_w_partial's last two dims)", hc, h);
  TKA_CHECK(same_shape(a.weight_embed, p), "weight_embed", "must have shape [%lld, %lld] (grad_w_partial's last two dims)", hc, h);
  TKA_CHECK(same_shape(a.grad_weight_hidden, p), "grad_weight_hidden",
            "must have shape [%lld, %lld] (grad_w_partial's last two dims)", hc, h);
  TKA_CHECK(same_shape(a.grad_weight_embed, p), "grad_weight_embed",
            "must have shape [%lld, %lld] (grad_w_partial's last two dims)", hc, h);
  TKA_CHECK(a.grad_weight_hidden.data != a.grad_weight_embed.data || p.hc_mult * p.hidden == 0, "grad_weight_embed",
            "must not be the same tensor as grad_weight_hidden");
  TKA_CHECK(ceil_div(p.hc_mult * p.hidden, 128) <= 2147483647, "grad_w_partial", "has too many columns for one launch");
  return true;
}

inline void outputs(const Args&, const Plan&, OutSpecs&) {}

inline bool needs_launch(const Plan& p) { return p.hc_mult > 0 && p.hidden > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs&, KernelArgs& k) {
  k.grad_w_partial = a.grad_w_partial.data;
  k.weight_hidden = a.weight_hidden.data;
  k.weight_embed = a.weight_embed.data;
  k.grad_weight_hidden = a.grad_weight_hidden.data;
  k.grad_weight_embed = a.grad_weight_embed.data;
  k.num_rows = p.num_rows;
  k.num_cols = p.hc_mult * p.hidden;
  // 16-byte copies of the partial sums when every row starts 16-byte aligned
  k.vec = (k.num_cols % 4 == 0 && aligned(a.grad_w_partial.data, 16)) ? 1 : 0;
  return true;
}

}  // namespace tka::engram_grad_w_reduce::grad_w_reduce
