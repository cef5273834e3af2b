// engram.fused_weight: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::engram_fused_weight::fused_weight {

struct Plan {
  int64_t hc_mult, hidden;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  p.hc_mult = a.weight_hidden.shape[0];
  p.hidden = a.weight_hidden.shape[1];
  TKA_CHECK(a.weight_embed.shape[0] == p.hc_mult && a.weight_embed.shape[1] == p.hidden, "weight_embed",
            "must have the shape of weight_hidden [%lld, %lld], got [%lld, %lld]", static_cast<long long>(p.hc_mult),
            static_cast<long long>(p.hidden), static_cast<long long>(a.weight_embed.shape[0]),
            static_cast<long long>(a.weight_embed.shape[1]));
  TKA_CHECK(p.hidden % 8 == 0, "weight_hidden", "must have a hidden size divisible by 8 (16-byte pieces), got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(p.hc_mult * p.hidden / 8 <= 2147483647 - 128, "weight_hidden", "has too many elements for one launch");
  TKA_CHECK(aligned(a.weight_hidden.data, 16), "weight_hidden", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.weight_embed.data, 16), "weight_embed", "must start 16-byte aligned");
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.weight_fused, F32, {p.hc_mult, p.hidden}); }

inline bool needs_launch(const Plan& p) { return p.hc_mult > 0 && p.hidden > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.weight_hidden = a.weight_hidden.data;
  k.weight_embed = a.weight_embed.data;
  k.weight_fused = o.weight_fused.data;
  k.num_pieces = p.hc_mult * p.hidden / 8;
  return true;
}

}  // namespace tka::engram_fused_weight::fused_weight
