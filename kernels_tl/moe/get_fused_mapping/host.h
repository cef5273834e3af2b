// moe.get_fused_mapping: host side (interface: tka/host.h).
#pragma once

#include <algorithm>

#include "args.h"

namespace tka::moe_get_fused_mapping::get_fused_mapping {

// Thread e of each block owns expert e (kernel.py: MAX_EXPERTS); kernel_args checks this
// against the kernel's own constant.
constexpr int64_t kMaxExperts = 1024;
// Rows and flat entries are int32 in the kernel, with room for a chunk rounding and a
// grid-wide stride (at most 128 x 1024 = 2^17 threads) past the last one: every layout and
// every row count stays below this.
constexpr int64_t kMaxRows = (int64_t{1} << 31) - (int64_t{1} << 18);

struct Plan {
  int64_t num_tokens, num_topk, num_elements, num_experts, rows;
  bool cooperative;  // the cooperative kernel (else the grid of independent blocks)
  int64_t max_grid;  // the cooperative launch's most blocks: one resident block per SM (0 otherwise)
};

// Entries up to which the plain grid of independent blocks serves the call (kernel.py:
// SMALL_ENTRIES; kernel_args checks it against the kernel's constant); above, the cooperative
// kernel.
constexpr int64_t kSmallEntries = 4096;
// The cooperative path's most blocks and its budget of per-block counts (kernel.py: MAX_GRID,
// SCRATCH_BUDGET; checked in kernel_args): the grid is at most
// min(MAX_GRID, SMs, max(SCRATCH_BUDGET / num_experts, 1)) blocks (one resident block per SM: a
// cooperative launch needs every block resident, and the driver refuses one that cannot be), and
// the scratch holds the counts of min(MAX_GRID, ...) blocks for every expert.
constexpr int64_t kMaxGrid = 128;
constexpr int64_t kScratchBudget = 32768;

inline int64_t most_blocks(int64_t num_experts) {
  return std::min<int64_t>(std::max<int64_t>(kScratchBudget / std::max<int64_t>(num_experts, 1), 1), kMaxGrid);
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.topk_idx.shape[0];
  p.num_topk = a.topk_idx.shape[1];
  p.num_experts = a.num_experts;
  TKA_CHECK(a.num_experts >= 0 && a.num_experts <= kMaxExperts, "num_experts",
            "must be in [0, %lld] (one expert per thread of the kernel), got %lld", static_cast<long long>(kMaxExperts),
            static_cast<long long>(a.num_experts));
  TKA_CHECK(a.alignment >= 1 && a.alignment < kMaxRows, "alignment", "must be in [1, 2^31 - 2^18), got %lld",
            static_cast<long long>(a.alignment));
  TKA_CHECK(a.num_expanded_tokens >= 0 && a.num_expanded_tokens < kMaxRows, "num_expanded_tokens",
            "must be in [0, 2^31 - 2^18) (the rows are int32), got %lld", static_cast<long long>(a.num_expanded_tokens));
  TKA_CHECK(p.num_tokens == 0 || p.num_topk < kMaxRows / p.num_tokens, "topk_idx",
            "is too large: %lld x %lld entries; the fused layout's rows are int32 (below 2^31 - 2^18)",
            static_cast<long long>(p.num_tokens), static_cast<long long>(p.num_topk));
  p.num_elements = p.num_tokens * p.num_topk;
  // The most rows the layout can need: every expert's count rounded up to alignment.
  const int64_t bound = p.num_elements + p.num_experts * (a.alignment - 1);  // < 2^31 * 1025: no overflow
  TKA_CHECK(bound < kMaxRows, "alignment",
            "is too large: num_tokens * num_topk + num_experts * (alignment - 1) = %lld must be below 2^31 - 2^18 "
            "(the fused layout's rows are int32)", static_cast<long long>(bound));
  // No sync in the kernel op: num_expanded_tokens rows, or in sync mode the most the layout
  // can need (TileKernels' bound), which the public wrapper trims after its host sync.
  const bool sync = a.num_expanded_tokens == 0 && !a.force_no_sync;
  p.rows = sync ? bound / a.alignment * a.alignment : a.num_expanded_tokens;
  p.cooperative = p.num_elements > kSmallEntries;
  p.max_grid = 0;
  if (p.cooperative) {  // the blocks path's grid does not depend on the device
    const int sms = plan_sm_count(op, a.topk_idx.device);
    if (sms < 0) return false;  // the device query failed (error set)
    p.max_grid = std::min<int64_t>(kMaxGrid, sms);  // the kernel's shared memory allows one block per SM
  }
  c.path = p.cooperative ? "cooperative" : "blocks";
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.pos_to_expert, I32, {p.rows});
  dense_output(s.pos_to_token, I32, {p.rows});
  dense_output(s.pos_to_token_topk, I32, {p.rows});
  dense_output(s.token_topk_to_pos, I32, {p.num_tokens, p.num_topk});
  dense_output(s.expert_start, I32, {p.num_experts});
  dense_output(s.expert_end, I32, {p.num_experts});
  dense_output(s.num_tokens_per_expert, I32, {p.num_experts});
  // the cooperative path's per-block counts, [expert][block] (every element written before the
  // kernel's grid-wide barrier, read after it); the blocks path has none (skipped: no tensor is
  // made for it, so a call given every output allocates nothing)
  dense_output(s.scratch, I32, {p.num_experts * most_blocks(p.num_experts)});
  s.scratch.skip = !p.cooperative;
}

// Every output element is written by the kernel: a launch whenever there is one.
inline bool needs_launch(const Plan& p) { return p.rows > 0 || p.num_elements > 0 || p.num_experts > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o,
                        KernelArgs& k) {
  TKA_CHECK(p.num_experts <= c.max_experts, "num_experts", "must be at most %lld for this kernel, got %lld",
            static_cast<long long>(c.max_experts), static_cast<long long>(p.num_experts));
  // The blocks path reads every entry in every block, as int16 counts: kSmallEntries at most.
  TKA_CHECK(c.cooperative != 0 || p.num_elements <= c.small_entries, "topk_idx",
            "has %lld entries, more than this kernel's %lld", static_cast<long long>(p.num_elements),
            static_cast<long long>(c.small_entries));
  // The scratch (outputs) and the grid (the kernel's expression) follow the same constants.
  TKA_CHECK(c.cooperative == 0 || (c.max_grid == kMaxGrid && c.scratch_budget == kScratchBudget), "topk_idx",
            "cannot run: the kernel's grid limits (%lld blocks, %lld counts) differ from the host's (%lld, %lld)",
            static_cast<long long>(c.max_grid), static_cast<long long>(c.scratch_budget),
            static_cast<long long>(kMaxGrid), static_cast<long long>(kScratchBudget));
  k.topk_idx = a.topk_idx.data;
  k.pos_to_expert = o.pos_to_expert.data;
  k.pos_to_token = o.pos_to_token.data;
  k.pos_to_token_topk = o.pos_to_token_topk.data;
  k.token_topk_to_pos = o.token_topk_to_pos.data;
  k.expert_start = o.expert_start.data;
  k.expert_end = o.expert_end.data;
  k.num_tokens_per_expert = o.num_tokens_per_expert.data;
  k.num_elements = p.num_elements;
  k.num_rows = p.rows;
  k.num_experts = p.num_experts;
  k.num_topk = p.num_elements > 0 ? p.num_topk : 1;  // the divisor of flat index -> token (any with no entries)
  k.alignment = a.alignment;
  // the cooperative kernel's parameters (the blocks kernel has neither: absent from a build without it)
  TKA_SET_IF_PRESENT(k, scratch, o.scratch.data);
  TKA_SET_IF_PRESENT(k, max_grid, p.max_grid);
  return true;
}

}  // namespace tka::moe_get_fused_mapping::get_fused_mapping
