// mhc.mhc_multilayer_recompute: host side (interface: tka/host.h).
//
// Every tensor has initial_residual's leading dims (flattened into one token dim N); the kernel
// takes MAX_LAYERS (Constants::max_layers) layers per launch, so a call with more layers runs as
// chained launches: launch j takes layers [j * max_layers, ...), starting from the residual the
// previous launch wrote last (residual_list[j * max_layers - 1]).
#pragma once

#include <algorithm>

#include "args.h"

namespace tka::mhc_multilayer_recompute::mhc_multilayer_recompute {

struct Plan {
  int64_t num_tokens, mhc_mult, hidden, num_layers, num_post;
  int lead;  // leading dims of every tensor
};

constexpr int kLayersPerLaunch = 16;  // the kernel's pointer parameters per list (checked against Constants)

// `t` starts with `r`'s first `lead` dims and has `rest` more dims.
inline bool leads_like(const TensorArg& t, const TensorArg& r, int lead, int rest) {
  if (t.ndim != lead + rest) return false;
  for (int d = 0; d < lead; ++d)
    if (t.shape[d] != r.shape[d]) return false;
  return true;
}

// A pre or post mix: [..., M, 1] or [..., M].
inline bool is_mix(const TensorArg& t, const TensorArg& r, int lead, int64_t m) {
  return (leads_like(t, r, lead, 2) && t.shape[lead] == m && t.shape[lead + 1] == 1) ||
         (leads_like(t, r, lead, 1) && t.shape[lead] == m);
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  const TensorArg& r = a.initial_residual;
  p.lead = r.ndim - 2;
  p.mhc_mult = r.shape[p.lead];
  p.hidden = r.shape[p.lead + 1];
  p.num_tokens = 1;
  for (int d = 0; d < p.lead; ++d) p.num_tokens *= r.shape[d];
  p.num_layers = a.pre_mix_list.size;
  p.num_post = a.layer_output_list.size;
  const long long m = p.mhc_mult, h = p.hidden, L = p.num_layers, P = p.num_post;
  TKA_CHECK(m >= 1, "initial_residual", "must have at least one stream (shape[-2]), got 0");
  TKA_CHECK(h % 8 == 0, "initial_residual", "must have a hidden size (last dim) that is a multiple of 8, got %lld", h);
  TKA_CHECK(aligned(r.data, 16), "initial_residual", "must start 16-byte aligned");
  TKA_CHECK(L >= 1, "pre_mix_list", "must not be empty");
  TKA_CHECK(a.layer_input_list.size == L, "layer_input_list", "must have as many tensors as pre_mix_list (%lld), got %lld",
            L, (long long)a.layer_input_list.size);
  TKA_CHECK(a.post_mix_list.size == P, "post_mix_list", "must have as many tensors as layer_output_list (%lld), got %lld",
            P, (long long)a.post_mix_list.size);
  TKA_CHECK(a.comb_mix_list.size == P, "comb_mix_list", "must have as many tensors as layer_output_list (%lld), got %lld",
            P, (long long)a.comb_mix_list.size);
  TKA_CHECK(a.residual_list.size == P, "residual_list", "must have as many tensors as layer_output_list (%lld), got %lld",
            P, (long long)a.residual_list.size);
  TKA_CHECK(P == L || P == L - 1, "layer_output_list", "must have num_layers (%lld) or num_layers - 1 tensors, got %lld",
            L, P);
  for (int64_t i = 0; i < L; ++i) {
    TKA_CHECK(is_mix(a.pre_mix_list.items[i], r, p.lead, m), "pre_mix_list",
              "[%lld] must have shape [..., %lld, 1] (or [..., %lld]) with initial_residual's leading dims",
              (long long)i, m, m);
    const TensorArg& li = a.layer_input_list.items[i];
    TKA_CHECK(leads_like(li, r, p.lead, 1) && li.shape[p.lead] == h, "layer_input_list",
              "[%lld] must have shape [..., %lld] with initial_residual's leading dims", (long long)i, h);
    TKA_CHECK(aligned(li.data, 16), "layer_input_list", "[%lld] must start 16-byte aligned", (long long)i);
  }
  for (int64_t i = 0; i < P; ++i) {
    const TensorArg& x = a.layer_output_list.items[i];
    TKA_CHECK(leads_like(x, r, p.lead, 1) && x.shape[p.lead] == h, "layer_output_list",
              "[%lld] must have shape [..., %lld] with initial_residual's leading dims", (long long)i, h);
    TKA_CHECK(aligned(x.data, 16), "layer_output_list", "[%lld] must start 16-byte aligned", (long long)i);
    TKA_CHECK(is_mix(a.post_mix_list.items[i], r, p.lead, m), "post_mix_list",
              "[%lld] must have shape [..., %lld, 1] (or [..., %lld]) with initial_residual's leading dims",
              (long long)i, m, m);
    const TensorArg& comb = a.comb_mix_list.items[i];
    TKA_CHECK(leads_like(comb, r, p.lead, 2) && comb.shape[p.lead] == m && comb.shape[p.lead + 1] == m,
              "comb_mix_list", "[%lld] must have shape [..., %lld, %lld] with initial_residual's leading dims",
              (long long)i, m, m);
    const TensorArg& res = a.residual_list.items[i];
    TKA_CHECK(leads_like(res, r, p.lead, 2) && res.shape[p.lead] == m && res.shape[p.lead + 1] == h,
              "residual_list", "[%lld] must have shape [..., %lld, %lld] with initial_residual's leading dims",
              (long long)i, m, h);
    TKA_CHECK(aligned(res.data, 16), "residual_list", "[%lld] must start 16-byte aligned", (long long)i);
  }
  c.mhc_mult = p.mhc_mult;
  return true;
}

inline void outputs(const Args&, const Plan&, OutSpecs&) {}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline int64_t launches(const Plan& p) { return ceil_div(p.num_layers, kLayersPerLaunch); }

#define TKA_LAYER_FIELDS(list)                                                                          \
  {&KernelArgs::list##_0,  &KernelArgs::list##_1,  &KernelArgs::list##_2,  &KernelArgs::list##_3,       \
   &KernelArgs::list##_4,  &KernelArgs::list##_5,  &KernelArgs::list##_6,  &KernelArgs::list##_7,       \
   &KernelArgs::list##_8,  &KernelArgs::list##_9,  &KernelArgs::list##_10, &KernelArgs::list##_11,      \
   &KernelArgs::list##_12, &KernelArgs::list##_13, &KernelArgs::list##_14, &KernelArgs::list##_15}

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs&, KernelArgs& k,
                        int64_t launch) {
  static void* KernelArgs::* const kPre[] = TKA_LAYER_FIELDS(pre_mix);
  static void* KernelArgs::* const kOutput[] = TKA_LAYER_FIELDS(layer_output);
  static void* KernelArgs::* const kPost[] = TKA_LAYER_FIELDS(post_mix);
  static void* KernelArgs::* const kComb[] = TKA_LAYER_FIELDS(comb_mix);
  static void* KernelArgs::* const kInput[] = TKA_LAYER_FIELDS(layer_input);
  static void* KernelArgs::* const kResidual[] = TKA_LAYER_FIELDS(residual);
  TKA_CHECK(c.max_layers == kLayersPerLaunch, "pre_mix_list", "cannot run: the kernel takes %lld layers per launch, "
            "the host expects %d", (long long)c.max_layers, kLayersPerLaunch);
  // the kernel's 32-bit thread index runs over 32 lanes per started 32 pieces of every token
  TKA_CHECK(p.num_tokens * ceil_div(p.hidden / 8, 32) * 32 <= 2147483647 - 256, "initial_residual",
            "has too many elements for one launch");
  const int64_t first = launch * kLayersPerLaunch;
  const int64_t layers = std::min<int64_t>(p.num_layers - first, kLayersPerLaunch);
  // layers [first, first + layers) have posts up to num_post (a launch before the last has all)
  const int64_t posts = std::max<int64_t>(std::min<int64_t>(p.num_post - first, layers), 0);
  k.initial_residual = first == 0 ? a.initial_residual.data : a.residual_list.items[first - 1].data;
  for (int64_t i = 0; i < layers; ++i) {
    k.*kPre[i] = a.pre_mix_list.items[first + i].data;
    k.*kInput[i] = a.layer_input_list.items[first + i].data;
  }
  for (int64_t i = 0; i < posts; ++i) {
    k.*kOutput[i] = a.layer_output_list.items[first + i].data;
    k.*kPost[i] = a.post_mix_list.items[first + i].data;
    k.*kComb[i] = a.comb_mix_list.items[first + i].data;
    k.*kResidual[i] = a.residual_list.items[first + i].data;
  }
  k.num_layers = layers;
  k.num_post = posts;
  k.num_tokens = p.num_tokens;
  k.pieces = p.hidden / 8;
  return true;
}

#undef TKA_LAYER_FIELDS

}  // namespace tka::mhc_multilayer_recompute::mhc_multilayer_recompute
