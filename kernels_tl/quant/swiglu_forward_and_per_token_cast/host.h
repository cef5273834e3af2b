// quant.swiglu_forward_and_per_token_cast: host side (interface: tka/host.h).
#pragma once

#include <cstring>

#include "args.h"

namespace tka::quant_swiglu_forward_and_per_token_cast::swiglu_forward_and_per_token_cast {

struct Plan {
  int64_t num_tokens, hidden;  // x is [num_tokens, 2 * hidden]
  int64_t num_sf;              // scale factors per row
  int64_t sf_cols;             // columns of out_sf (packed UE8M0: words of 4 factors)
  int64_t sms;                 // the device's SMs (the counted kernels' grids), else 0
  int64_t columns;             // 512-channel pieces of a row (the group layout's grid columns)
  bool routed_counted;         // the counted routed kernel (plain = 4): two launches, a scratch
};

// `c` rounded to float32 is a positive finite bf16 value (its low 16 bits zero): the counted
// routed kernel clamps the packed bf16 pairs with it
inline bool is_positive_bf16(double c) {
  const float f = static_cast<float>(c);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return f > 0.0f && bits < 0x7F800000u && (bits & 0xFFFFu) == 0;
}

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.hidden = a.x.shape[1] / 2;
  const int64_t npc = a.num_per_channels;
  p.num_sf = npc > 0 ? p.hidden / npc : 0;
  p.sf_cols = a.use_packed_ue8m0 ? ceil_div(p.num_sf, 4) : p.num_sf;
  TKA_CHECK(a.x.shape[1] % 256 == 0, "x", "must have shape [num_tokens, 2 * hidden] with hidden a multiple of 128");
  TKA_CHECK(aligned(a.x.data, 32), "x", "must start 32-byte aligned (rows are read in 16- and 32-byte vectors)");
  TKA_CHECK(npc == 128 || (npc == p.hidden && p.hidden > 0), "num_per_channels",
            "must be 128 or hidden (x.shape[1] / 2), got %lld", static_cast<long long>(npc));
  TKA_CHECK(!a.use_tma_aligned_col_major_sf || npc == 128, "use_tma_aligned_col_major_sf", "=True needs num_per_channels == 128");
  TKA_CHECK(!a.use_packed_ue8m0 || (a.use_tma_aligned_col_major_sf && a.round_sf), "use_packed_ue8m0",
            "=True needs use_tma_aligned_col_major_sf=True and round_sf=True");
  TKA_CHECK(!a.pos_to_token_topk.present || a.topk_weights.present, "topk_weights", "must be given with pos_to_token_topk");
  TKA_CHECK(!a.pos_to_token_topk.present || a.pos_to_token_topk.shape[0] == p.num_tokens, "pos_to_token_topk",
            "must have shape [num_tokens] (x.shape[0])");
  TKA_CHECK(!a.pos_to_expert.present || a.pos_to_expert.shape[0] == p.num_tokens, "pos_to_expert",
            "must have shape [num_tokens] (x.shape[0])");
  TKA_CHECK(!a.clamped_count.present || !a.swiglu_clamp_value_is_none, "clamped_count", "needs swiglu_clamp_value");
  TKA_CHECK(!a.clamped_count.present || a.clamped_count.shape[0] == 3, "clamped_count", "must have shape [3]");
  c.in_dtype = a.x.dtype;
  c.sf_format = std::string_view(a.use_packed_ue8m0 ? "ue8m0_col" : a.use_tma_aligned_col_major_sf ? "fp32_col" : "fp32");
  // one group per row: the smallest multiple of 8192 that holds the row
  c.max_row_hidden = npc == 128 ? 0 : align_up(p.hidden, 8192);
  // no optional input: the kernel with the option flags compiled out; counted clamps of bf16
  // in groups of 128: the kernel whose grid is the resident blocks (plain = 2), or with
  // pos_to_expert and packed UE8M0 factors, no weights and a positive bf16 clamp value the
  // counted routed kernel (4); bf16 in groups of 128 with pos_to_expert and packed UE8M0
  // factors, no other option: the routed kernel (3)
  c.plain = (a.pos_to_token_topk.present || a.pos_to_expert.present || !a.swiglu_clamp_value_is_none) ? 0 : 1;
  if (a.pos_to_expert.present && !a.pos_to_token_topk.present && a.swiglu_clamp_value_is_none &&
      a.use_packed_ue8m0 && npc == 128 && a.x.dtype == BF16)
    c.plain = 3;
  p.sms = 0;
  p.columns = ceil_div(p.hidden / 128, 4);
  p.routed_counted = false;
  if (a.clamped_count.present && npc == 128 && a.x.dtype == BF16) {
    p.routed_counted = a.pos_to_expert.present && !a.pos_to_token_topk.present && a.use_packed_ue8m0 &&
                       is_positive_bf16(a.swiglu_clamp_value);
    c.plain = p.routed_counted ? 4 : 2;
    p.sms = plan_sm_count(op, a.x.device);
    if (p.sms < 0) return false;  // the device query failed (error set)
  }
  return true;
}

// fp32 [n, k] row-major; or column-major with the token stride padded to 4 (TMA); or UE8M0
// bytes packed 4 to an int32, column-major [n, ceil(k / 4)]
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, E4M3, {p.num_tokens, p.hidden});
  const DType sf_dtype = a.use_packed_ue8m0 ? I32 : F32;
  // the counted routed kernel's scratch: a word of packed counts per warp-row (launch 0 -> 1);
  // the other calls allocate none
  if (p.routed_counted)
    dense_output(s.row_counts, I32, {p.num_tokens * p.columns});
  else
    s.row_counts.skip = true;
  if (!a.use_tma_aligned_col_major_sf) return dense_output(s.out_sf, sf_dtype, {p.num_tokens, p.sf_cols});
  const int64_t token_stride = align_up(p.num_tokens, 4);
  strided_output(s.out_sf, sf_dtype, {p.num_tokens, p.sf_cols}, {1, token_stride}, p.sf_cols * token_stride);
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

// the counted routed kernel: launch 0 the rows, launch 1 the sum of their counts; else one launch
inline int64_t launches(const Plan& p) { return p.routed_counted ? 2 : 1; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k,
                        int64_t launch) {
  k.x = a.x.data;
  k.out = o.out.data;
  k.out_sf = o.out_sf.data;
  k.pos_to_token_topk = a.pos_to_token_topk.present ? a.pos_to_token_topk.data : nullptr;
  k.topk_weights = a.topk_weights.present ? a.topk_weights.data : nullptr;
  k.pos_to_expert = a.pos_to_expert.present ? a.pos_to_expert.data : nullptr;
  k.clamped_count = a.clamped_count.present ? a.clamped_count.data : nullptr;
  k.has_weights = a.pos_to_token_topk.present;
  k.has_pos_to_expert = a.pos_to_expert.present;
  k.clamp_mode = a.swiglu_clamp_value_is_none ? 0 : (a.clamped_count.present ? 2 : 1);
  k.swiglu_clamp_value = a.swiglu_clamp_value_is_none ? 0.0 : a.swiglu_clamp_value;
  k.round_sf = a.round_sf;
  k.sf_clamp_min = a.sf_clamp_min_is_none ? 1e-4 : a.sf_clamp_min;
  k.num_tokens = p.num_tokens;
  k.hidden_blocks = p.hidden / 128;
  k.sf_stride = o.out_sf.stride[1];  // column-major formats: the token stride of a group
  // counted kernel: row blocks per grid column, so that the grid is at most the blocks
  // resident at once (each block walks its row blocks, then adds its counts once)
  const int64_t row_blocks = ceil_div(p.num_tokens, c.rows_per_block);
  k.row_grid = std::max<int64_t>(1, std::min(row_blocks, p.sms * c.counted_blocks_per_sm / p.columns));
  // counted routed kernel: launch 0 the group layout's grid (the routed kernel's); launch 1 sums
  // the T x columns scratch words, sum_words_per_step loads per thread and step, in at most 4
  // blocks per SM (3 atomics each)
  int64_t grid[3] = {p.columns, std::min(row_blocks, c.max_grid_y), ceil_div(row_blocks, c.max_grid_y)};
  if (launch == 1) {
    const int64_t per_block = c.threads * c.sum_words_per_step;
    grid[0] = std::max<int64_t>(1, std::min(ceil_div(p.num_tokens * p.columns, per_block), 4 * p.sms));
    grid[1] = grid[2] = 1;
  }
  TKA_SET_IF_PRESENT(k, row_counts, o.row_counts.data);
  TKA_SET_IF_PRESENT(k, launch_index, launch);
  TKA_SET_IF_PRESENT(k, grid_x, grid[0]);
  TKA_SET_IF_PRESENT(k, grid_y, grid[1]);
  TKA_SET_IF_PRESENT(k, grid_z, grid[2]);
  return true;
}

}  // namespace tka::quant_swiglu_forward_and_per_token_cast::swiglu_forward_and_per_token_cast
