// quant.swiglu_forward_and_per_channel_cast_and_transpose: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_swiglu_forward_and_per_channel_cast_and_transpose::swiglu_forward_and_per_channel_cast_and_transpose {

struct Plan {
  int64_t num_tokens, hidden;  // x is [num_tokens, 2 * hidden]
  int64_t npt;                 // num_per_tokens
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.hidden = a.x.shape[1] / 2;
  p.npt = a.num_per_tokens;
  TKA_CHECK(p.npt == 32 || p.npt == 128, "num_per_tokens", "must be 32 or 128, got %lld", static_cast<long long>(p.npt));
  TKA_CHECK(p.num_tokens % 128 == 0, "x", "must have a row count that is a multiple of 128, got %lld",
            static_cast<long long>(p.num_tokens));
  TKA_CHECK(a.x.shape[1] % 128 == 0, "x", "must have shape [num_tokens, 2 * hidden] with 2 * hidden a multiple of 128, got %lld",
            static_cast<long long>(a.x.shape[1]));
  if (a.without_transpose) {
    TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned with without_transpose (read in 16-byte pieces)");
  } else {
    TKA_CHECK(aligned(a.x.data, 4), "x", "must start 4-byte aligned (channel pairs are read as 32-bit words)");
  }
  c.transposed = a.without_transpose ? 0 : 1;
  c.clamped = a.swiglu_clamp_value_is_none ? 0 : 1;
  return true;
}

// out: e4m3 [hidden, num_tokens] (or [num_tokens, hidden]); out_sf: fp32 [num_tokens / npt, hidden]
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  if (a.without_transpose) {
    dense_output(s.out, E4M3, {p.num_tokens, p.hidden});
  } else {
    dense_output(s.out, E4M3, {p.hidden, p.num_tokens});
  }
  dense_output(s.out_sf, F32, {p.num_tokens / p.npt, p.hidden});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.x = a.x.data;
  k.out = o.out.data;
  k.out_sf = o.out_sf.data;
  k.swiglu_clamp_value = a.swiglu_clamp_value_is_none ? 0.0 : a.swiglu_clamp_value;
  k.round_sf = a.round_sf;
  k.blocks_of_128 = p.npt == 128;
  k.token_blocks = p.num_tokens / 128;
  k.hidden_chunks = p.hidden / 64;
  return true;
}

}  // namespace tka::quant_swiglu_forward_and_per_channel_cast_and_transpose::swiglu_forward_and_per_channel_cast_and_transpose
