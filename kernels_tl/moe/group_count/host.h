// moe.group_count and moe.aux_fi: host side (interface: tka/host.h).
#pragma once

#include <algorithm>

#include "args.h"

namespace tka::moe_group_count {

// The kernel's bin limit and reduce layout (kernel.py: MAX_GROUPS, REDUCE_BINS, REDUCE_ROWS);
// kernel_args checks them against the kernel's own constants.
constexpr int64_t kMaxGroups = 1024;
constexpr int64_t kReduceBins = 32;
constexpr int64_t kReduceRows = 144;
// Up to one tile of one block (kernel.py: TILE, 4096 entries = 32 KiB of int64: decode and a
// few hundred tokens) one block counts everything in one launch: one load round trip, as the
// split form's counting launch, without its second launch.  Above it, two launches.
constexpr int64_t kSingleMax = 4096;
// A counting block's range holds at least this many entries (4 loads per thread) ...
constexpr int64_t kMinPerBlock = 1024;
// ... and at most 2^30, so no int32 count of a block (shared or in its partial row) can wrap.
constexpr int64_t kMaxPerBlock = int64_t{1} << 30;

// Both ops: the index tensor's dims, the bin count (num_groups or num_experts) and the split.
struct HistogramPlan {
  int64_t num_tokens, num_elements, num_groups;
  int64_t rows;  // counting blocks of the split form (rows of the scratch `partial`); 0: one launch
  int64_t per;   // entries per counting block (a multiple of 32)
  const char* groups_arg;  // how messages name the bin count
};

inline bool plan_histogram(const char* op, const TensorArg& idx, int64_t groups, const char* groups_arg, HistogramPlan& p) {
  TKA_CHECK(groups >= 0 && groups <= kMaxGroups, groups_arg, "must be in [0, %lld] (the kernel's shared histogram), got %lld",
            static_cast<long long>(kMaxGroups), static_cast<long long>(groups));
  p.num_tokens = idx.shape[0];
  p.num_elements = idx.shape[0] * idx.shape[1];
  p.num_groups = groups;
  p.groups_arg = groups_arg;
  p.rows = 0;
  p.per = p.num_elements;
  if (p.num_elements > kSingleMax && groups > 0) {
    const int sms = plan_sm_count(op, idx.device);
    if (sms < 0) return false;  // the device query failed (error set)
    // one block per SM (small blocks: the reduce's blocks and the next call's fit beside
    // them), at most the rows one reduce pass sums
    int64_t blocks = std::min<int64_t>(std::min<int64_t>(sms, kReduceRows), ceil_div(p.num_elements, kMinPerBlock));
    blocks = std::max<int64_t>(blocks, ceil_div(p.num_elements, kMaxPerBlock - 32));  // past 2^37 entries only
    p.per = align_up(ceil_div(p.num_elements, blocks), 32);
    p.rows = ceil_div(p.num_elements, p.per);  // every block has entries
  }
  return true;
}

// Every bin is written, also for an empty input (zeros): a launch whenever there is a bin.
inline bool needs_launch(const HistogramPlan& p) { return p.num_groups > 0; }

// One launch (one block) up to kSingleMax entries, else the counting launch and the reduce.
inline int64_t launches(const HistogramPlan& p) { return p.rows > 0 ? 2 : 1; }

// The [num_groups] output, then the scratch rows of the split form (skipped for one launch: no
// tensor is made, so a one-launch call given `out` allocates nothing).
inline void histogram_outputs(const HistogramPlan& p, DType dtype, OutSpec& out, OutSpec& partial) {
  dense_output(out, dtype, {p.num_groups});
  dense_output(partial, I32, {p.rows, p.num_groups});
  partial.skip = p.rows == 0;
}

// The kernel arguments both ops share for launch `launch`; the caller sets its output pointer and mode.
inline bool histogram_args(const char* op, const TensorArg& idx, const HistogramPlan& p, const Constants& c,
                           const TensorArg& partial, int64_t launch, KernelArgs& k) {
  TKA_CHECK(p.num_groups <= c.max_groups, p.groups_arg, "must be at most %lld for this kernel, got %lld",
            static_cast<long long>(c.max_groups), static_cast<long long>(p.num_groups));
  TKA_CHECK(c.reduce_bins == kReduceBins && c.reduce_rows == kReduceRows, p.groups_arg,
            "cannot run: the kernel sums %lld bins x %lld rows per reduce block, the host expects %lld x %lld",
            static_cast<long long>(c.reduce_bins), static_cast<long long>(c.reduce_rows),
            static_cast<long long>(kReduceBins), static_cast<long long>(kReduceRows));
  k.group_idx = idx.data;
  k.partial = partial.data;
  k.num_elements = p.num_elements;
  k.num_groups = p.num_groups;
  k.num_rows = p.rows;
  k.per = p.per;
  if (p.rows == 0) {
    k.num_blocks = 1;
    k.phase = c.phase_single;
  } else if (launch == 0) {
    k.num_blocks = p.rows;
    k.phase = c.phase_partial;
  } else {
    k.num_blocks = ceil_div(p.num_groups, kReduceBins);
    k.phase = c.phase_reduce;
  }
  k.counts = nullptr;
  k.fi = nullptr;
  k.denominator = 0.0;
  return true;
}

namespace group_count {

using Plan = HistogramPlan;
using moe_group_count::launches;
using moe_group_count::needs_launch;

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  return plan_histogram(op, a.group_idx, a.num_groups, "num_groups", p);
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { histogram_outputs(p, I32, s.out, s.partial); }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k,
                        int64_t launch) {
  if (!histogram_args(op, a.group_idx, p, c, o.partial, launch, k)) return false;
  k.counts = o.out.data;
  k.mode = c.mode_count;
  return true;
}

}  // namespace group_count

namespace aux_fi {

using Plan = HistogramPlan;
using moe_group_count::launches;
using moe_group_count::needs_launch;

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  return plan_histogram(op, a.topk_idx, a.num_experts, "num_experts", p);
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { histogram_outputs(p, F32, s.out, s.partial); }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k,
                        int64_t launch) {
  if (!histogram_args(op, a.topk_idx, p, c, o.partial, launch, k)) return false;
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
