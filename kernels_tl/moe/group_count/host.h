// moe.group_count and moe.aux_fi: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::moe_group_count {

// Thread t of each block of the kernel owns bin t (kernel.py: THREADS); kernel_args
// checks this against the kernel's own constant.
constexpr int64_t kMaxGroups = 1024;

// Both ops: the index tensor's dims and the bin count (num_groups or num_experts).
struct HistogramPlan {
  int64_t num_tokens, num_elements, num_groups;
  const char* groups_arg;  // how messages name the bin count
};

inline bool plan_histogram(const char* op, const TensorArg& idx, int64_t groups, const char* groups_arg, HistogramPlan& p) {
  TKA_CHECK(groups >= 0 && groups <= kMaxGroups, groups_arg, "must be in [0, %lld] (one bin per thread of the kernel), got %lld",
            static_cast<long long>(kMaxGroups), static_cast<long long>(groups));
  p.num_tokens = idx.shape[0];
  p.num_elements = idx.shape[0] * idx.shape[1];
  p.num_groups = groups;
  p.groups_arg = groups_arg;
  return true;
}

// Every bin is written, also for an empty input (zeros): a launch whenever there is a bin.
inline bool needs_launch(const HistogramPlan& p) { return p.num_groups > 0; }

// The kernel arguments both ops share; the caller sets its output pointer and mode.
inline bool histogram_args(const char* op, const TensorArg& idx, const HistogramPlan& p, const Constants& c, KernelArgs& k) {
  TKA_CHECK(p.num_groups <= c.max_groups, p.groups_arg, "must be at most %lld for this kernel, got %lld",
            static_cast<long long>(c.max_groups), static_cast<long long>(p.num_groups));
  k.group_idx = idx.data;
  k.num_elements = p.num_elements;
  k.num_groups = p.num_groups;
  k.counts = nullptr;
  k.fi = nullptr;
  k.denominator = 0.0;
  return true;
}

namespace group_count {

using Plan = HistogramPlan;
using moe_group_count::needs_launch;

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  return plan_histogram(op, a.group_idx, a.num_groups, "num_groups", p);
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.out, I32, {p.num_groups}); }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  if (!histogram_args(op, a.group_idx, p, c, k)) return false;
  k.counts = o.out.data;
  k.mode = c.mode_count;
  return true;
}

}  // namespace group_count

namespace aux_fi {

using Plan = HistogramPlan;
using moe_group_count::needs_launch;

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  return plan_histogram(op, a.topk_idx, a.num_experts, "num_experts", p);
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.out, F32, {p.num_groups}); }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  if (!histogram_args(op, a.topk_idx, p, c, k)) return false;
  k.fi = o.out.data;
  // The reference's divisor: Python's float(num_tokens * num_aux_topk) (the exact product
  // rounded once to double), then float32 (the stub's cast, round to nearest).  The product
  // of two int64 fits in 128 bits, whatever num_aux_topk is (0 or negative included: the
  // reference gives inf/NaN/negative fractions then, and so does the kernel).
  const __int128 product = static_cast<__int128>(p.num_tokens) * static_cast<__int128>(a.num_aux_topk);
  k.denominator = static_cast<double>(product);
  k.mode = p.num_tokens == 0 ? c.mode_zero : c.mode_fi;  // no tokens: zeros, as the reference
  return true;
}

}  // namespace aux_fi

}  // namespace tka::moe_group_count
