// quant.swiglu_backward_and_per_token_cast: host side (interface: tka/host.h).
#pragma once

#include <cmath>
#include <limits>

#include "args.h"

namespace tka::quant_swiglu_backward_and_per_token_cast::swiglu_backward_and_per_token_cast {

struct Plan {
  int64_t num_rows, hidden;  // x is [num_rows, 2 * hidden]
  int64_t num_tokens, num_topk;
  int64_t npc;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_rows = a.x.shape[0];
  p.hidden = a.x.shape[1] / 2;
  p.npc = a.num_per_channels;
  p.num_tokens = a.token_topk_to_pos.shape[0];
  p.num_topk = a.token_topk_to_pos.shape[1];
  TKA_CHECK(p.npc == 32 || p.npc == 128, "num_per_channels", "must be 32 or 128, got %lld", static_cast<long long>(p.npc));
  TKA_CHECK(a.x.shape[1] % (2 * p.npc) == 0, "x", "must have shape [num_rows, 2 * hidden] with hidden a multiple of num_per_channels");
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned (rows are read in 16-byte vectors)");
  TKA_CHECK(aligned(a.grad_out.data, 16), "grad_out", "must start 16-byte aligned (rows are read in 16-byte vectors)");
  TKA_CHECK(a.x_sf.shape[0] == p.num_rows && a.x_sf.shape[1] == 2 * p.hidden / p.npc, "x",
            "'s sf must have shape [num_rows, 2 * hidden / num_per_channels]");
  TKA_CHECK(a.grad_out.shape[0] == p.num_rows && a.grad_out.shape[1] == p.hidden, "grad_out",
            "must have shape [num_rows, hidden] (x.shape[0], x.shape[1] / 2)");
  TKA_CHECK(a.weight.shape[0] == p.num_tokens && a.weight.shape[1] == p.num_topk, "weight",
            "must have the shape of token_topk_to_pos");
  TKA_CHECK(a.pos_to_token_topk.shape[0] == p.num_rows, "pos_to_token_topk", "must have shape [num_rows] (x.shape[0])");
  TKA_CHECK(p.num_tokens * p.num_topk < (int64_t(1) << 31), "token_topk_to_pos", "must have fewer than 2^31 entries");
  TKA_CHECK(p.num_rows < (int64_t(1) << 31), "x", "must have fewer than 2^31 rows");
  c.group = p.npc;
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.out, BF16, {p.num_rows, p.hidden});
  dense_output(s.x_grad_fp8, E4M3, {p.num_rows, 2 * p.hidden});
  dense_output(s.x_grad_sf, F32, {p.num_rows, 2 * p.hidden / p.npc});
  dense_output(s.x_grad, BF16, {p.num_rows, 2 * p.hidden});
  dense_output(s.weight_grad, F32, {p.num_tokens, p.num_topk});
}

// rows and weight entries: with no rows (or hidden 0), weight_grad still needs its zeros
// (the grid then has one block, which only zeroes entries), and with no entries there is
// nothing to map to but rows still compute
inline bool needs_launch(const Plan& p) { return (p.num_rows > 0 && p.hidden > 0) || p.num_tokens * p.num_topk > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.x = a.x.data;
  k.x_sf = a.x_sf.data;
  k.grad_out = a.grad_out.data;
  k.weight = a.weight.data;
  k.pos_to_token_topk = a.pos_to_token_topk.data;
  k.token_topk_to_pos = a.token_topk_to_pos.data;
  k.out = o.out.data;
  k.x_grad_fp8 = o.x_grad_fp8.data;
  k.x_grad_sf = o.x_grad_sf.data;
  k.x_grad = o.x_grad.data;
  k.weight_grad = o.weight_grad.data;
  // no clamp: c = +inf (min(l, inf) = l, clamp(r, -inf, inf) = r, nothing counts as clamped)
  k.swiglu_clamp_value = a.swiglu_clamp_value_is_none ? std::numeric_limits<double>::infinity() : a.swiglu_clamp_value;
  k.round_sf = a.round_sf;
  k.num_rows = p.num_rows;
  k.num_entries = p.num_tokens * p.num_topk;
  k.hidden_units = p.hidden / 32;
  return true;
}

}  // namespace tka::quant_swiglu_backward_and_per_token_cast::swiglu_backward_and_per_token_cast
