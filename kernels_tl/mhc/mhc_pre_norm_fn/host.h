// mhc.mhc_pre_norm_fn: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_mhc_pre_norm_fn::mhc_pre_norm_fn {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden, features, rows, cluster, tile_tokens, splits;
};

// Tokens per tile (64 or 128) and blocks per tile (2 or 8; each block walks 8 / cluster of the 8
// lane groups, K / 1024 steps each): the layout with the least block time over its waves, a step
// costing the bytes it moves into the SM (x 16 KB + W 12 KB at 64 tokens, 32 + 12 KB at 128), a
// block's pipeline fill and final tree 3 steps, clusters of 8 fitting `sms` rounded down to 8
// blocks; ties go to 64 tokens, then to the smaller cluster.  With the norm weight, also a
// 128-token tile of two clusters of 2 (splits = 2: each cluster walks 4 of the 8 lane groups
// and stores its subtree sums, a second launch adds the two; clusters of 2 always fit the
// SMs, unlike 32 clusters of 4 at one block per SM), costed with 2 more steps for the second
// launch; a strictly smaller cost is needed to take it.  Without the weight the split layout
// is never picked (those calls keep their layouts).  Every layout sums each token in the same
// order (the result never depends on it).
struct Layout {
  int64_t tile_tokens, cluster, splits;
};

inline Layout pick_layout(int64_t num_tokens, int64_t features, int64_t sms, bool has_weight) {
  const int64_t steps = features / 1024;
  Layout best{64, 2, 1};
  int64_t best_cost = -1;
  for (int64_t tile : {64, 128}) {
    const int64_t tiles = (num_tokens + tile - 1) / tile, step_kb = tile / 4 + 12;
    for (int64_t c : {2, 8}) {
      int64_t slots = c == 8 ? sms - sms % 8 : sms;
      if (slots < c) slots = c;
      const int64_t waves = (tiles * c + slots - 1) / slots;
      const int64_t cost = waves * ((8 / c) * steps + 3) * step_kb;
      if (best_cost < 0 || cost < best_cost) best = Layout{tile, c, 1}, best_cost = cost;
    }
  }
  if (has_weight) {  // 128 tokens, two clusters of 2 per tile, each block 2 lane groups
    const int64_t tiles = (num_tokens + 127) / 128, slots = sms < 2 ? 2 : sms;
    const int64_t waves = (tiles * 4 + slots - 1) / slots;
    const int64_t cost = waves * (2 * steps + 3 + 2) * (128 / 4 + 12);
    if (cost < best_cost) best = Layout{128, 2, 2};
  }
  return best;
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.residual.shape[0];
  p.mhc_mult = a.residual.shape[1];
  p.hidden = a.residual.shape[2];
  p.features = p.mhc_mult * p.hidden;
  p.rows = p.mhc_mult * (p.mhc_mult + 2);
  const long long K = p.features, m3 = p.rows;
  TKA_CHECK(a.mhc_fn.shape[0] == m3 && a.mhc_fn.shape[1] == K, "mhc_fn",
            "must have shape [mhc_mult * (mhc_mult + 2), mhc_mult * hidden] = [%lld, %lld], got [%lld, %lld]", m3, K,
            static_cast<long long>(a.mhc_fn.shape[0]), static_cast<long long>(a.mhc_fn.shape[1]));
  if (a.mhc_norm_weight.present) {
    TKA_CHECK(a.mhc_norm_weight.shape[0] == K, "mhc_norm_weight", "must have shape [%lld], got [%lld]", K,
              static_cast<long long>(a.mhc_norm_weight.shape[0]));
    TKA_CHECK(aligned(a.mhc_norm_weight.data, 16), "mhc_norm_weight", "must start 16-byte aligned");
  }
  TKA_CHECK(K > 0 && K % 1024 == 0, "residual",
            "must have mhc_mult * hidden a positive multiple of 1024 (256 lanes x 4 elements), got %lld", K);
  TKA_CHECK(K <= (int64_t{1} << 30), "residual", "must have mhc_mult * hidden <= 2^30, got %lld", K);
  TKA_CHECK(m3 * K <= (int64_t{1} << 31) - 1, "mhc_fn", "must have fewer than 2^31 elements, got %lld", m3 * K);
  TKA_CHECK(aligned(a.residual.data, 16), "residual", "must start 16-byte aligned");
  TKA_CHECK(aligned(a.mhc_fn.data, 16), "mhc_fn", "must start 16-byte aligned");
  const int sms = plan_sm_count(op, a.residual.device);
  if (sms < 0) return false;  // the device query failed (error set)
  const Layout l = pick_layout(p.num_tokens, K, sms, a.mhc_norm_weight.present);
  p.cluster = l.cluster;
  p.tile_tokens = l.tile_tokens;
  p.splits = l.splits;
  TKA_CHECK((p.num_tokens + p.tile_tokens - 1) / p.tile_tokens * p.cluster <= INT32_MAX, "residual",
            "must have fewer than 2^31 / %lld tiles of %lld tokens, got %lld tokens", static_cast<long long>(p.cluster),
            static_cast<long long>(p.tile_tokens), static_cast<long long>(p.num_tokens));
  c.mhc_mult = p.mhc_mult;
  c.cluster = p.cluster;
  c.tile_tokens = p.tile_tokens;
  c.splits = p.splits;
  return true;
}

// scratch `partials`: 2 records of 128 * (M3 + 1) floats per 128 tokens (the split layout's;
// skipped by the other layouts: no memory or tensor is made for it)
inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.out, F32, {p.num_tokens, p.rows});
  dense_output(s.partials, F32, {(p.num_tokens + 127) / 128 * 256 * (p.rows + 1)});
  s.partials.skip = p.splits == 1;
}

// the split layout: launch 0 the clusters' subtree sums into `partials`, launch 1 adds them
inline int64_t launches(const Plan& p) { return p.splits; }

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k,
                        int64_t launch) {
  TKA_CHECK(p.splits == 1 || o.partials.data != nullptr, "residual", "cannot run the split layout without its scratch buffer");
  k.residual = a.residual.data;
  k.mhc_fn = a.mhc_fn.data;
  // no weight: the kernel copies K floats from it but never uses them (has_weight == 0); mhc_fn
  // (M3 * K floats) stands in
  k.mhc_norm_weight = a.mhc_norm_weight.present ? a.mhc_norm_weight.data : a.mhc_fn.data;
  k.out = o.out.data;
  k.num_tokens = p.num_tokens;
  k.chunks = p.features / 128;
  k.has_weight = a.mhc_norm_weight.present ? 1 : 0;
  k.eps = static_cast<float>(a.mhc_norm_eps);
  k.features = static_cast<float>(p.features);
  // the split layout's parameters (in KernelArgs where a split config is prebuilt)
  TKA_SET_IF_PRESENT(k, partials, o.partials.data);
  TKA_SET_IF_PRESENT(k, combine, launch);
  return true;
}

}  // namespace tka::mhc_mhc_pre_norm_fn::mhc_pre_norm_fn
