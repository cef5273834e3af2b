// moe.expand_to_fused, moe.expand_to_fused_with_sf: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::moe_expand_to_fused {

struct Plan {
  int64_t num_tokens, hidden, num_topk, num_rows;
  int64_t row_vecs;  // 16-byte vectors per row
  int64_t sf_cols;   // 32-bit scale-factor words per row (0: none)
};

// The checks and dims both ops share (`x` is the data, or the plain tensor).
inline bool plan_rows(const char* op, const TensorArg& x, const TensorArg& token_topk_to_pos,
                      const TensorArg& pos_to_expert, Plan& p) {
  p.num_tokens = x.shape[0];
  p.hidden = x.shape[1];
  p.num_topk = token_topk_to_pos.shape[1];
  p.num_rows = pos_to_expert.shape[0];
  p.sf_cols = 0;
  const int64_t row_bytes = p.hidden * (kDTypes[x.dtype].bits / 8);
  TKA_CHECK(token_topk_to_pos.shape[0] == p.num_tokens, "token_topk_to_pos",
            "must have one row per token of x (%lld), got %lld", static_cast<long long>(p.num_tokens),
            static_cast<long long>(token_topk_to_pos.shape[0]));
  TKA_CHECK(row_bytes % 16 == 0, "x",
            "rows must be whole 16-byte vectors (hidden * element size a multiple of 16), got hidden %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(x.data, 16), "x", "must start 16-byte aligned");
  p.row_vecs = row_bytes / 16;
  return true;
}

// The copy's geometry: `lanes` threads per token row, the first `span` threads of each block
// in use, `blocks` copy blocks.
struct CopyGeometry {
  int64_t lanes, span, blocks;
};

// Lanes for at most v vectors per thread: ceil(row_vecs / v), rounded up to a power of two below
// a warp and to whole warps above, so no token straddles a warp boundary (a warp holds whole
// tokens or whole warps of one token: its store instructions cover contiguous bytes of one row
// each, without the split paths of two tokens' slots). A lane then owns at most v vectors
// (vectors l, l + lanes, ... below row_vecs).
inline int64_t warp_lanes(int64_t row_vecs, int64_t v) {
  const int64_t lanes = ceil_div(row_vecs, v);
  if (lanes > 32) return align_up(lanes, 32);
  int64_t pow2 = 1;
  while (pow2 < lanes) pow2 *= 2;
  return pow2;
}

// The most vectors per thread v (<= the kernel's vectors_per_thread, halving) whose copy still
// has kSpreadBlocks blocks, else one vector per thread. A block takes whole tokens when a row's
// lanes fit in it (span = tokens per block x lanes, the rest of the block idle), so with few
// tokens (decode: 128) each token is one block of 224 threads on its own SM (bf16 and e4m3 at
// hidden 7168: 4 and 2 vectors per thread) rather than pieces of tokens on fewer, fuller blocks;
// a longer row (more than a block's threads at one vector) runs on the flat index (span =
// threads). The output bits do not depend on the geometry (a copy).
constexpr int64_t kSpreadBlocks = 128;  // about one copy block per SM (132 on an H200)
inline CopyGeometry geometry(const Plan& p, const Constants& c) {
  CopyGeometry g{};
  for (int64_t v = c.vectors_per_thread; v >= 1; v /= 2) {
    g.lanes = warp_lanes(p.row_vecs, v);
    g.span = g.lanes <= c.threads ? (c.threads / g.lanes) * g.lanes : c.threads;
    g.blocks = ceil_div(p.num_tokens * g.lanes, g.span);
    if (g.blocks >= kSpreadBlocks) break;
  }
  return g;
}

inline bool launch_needed(const Plan& p) { return (p.num_tokens > 0 || p.num_rows > 0) && p.row_vecs > 0; }

// The padding check's layout (the kernel's units: 2^piece_shift pieces of piece_vecs vectors per
// fused row; padding block b takes the `span` units b * block_step + i * unit_step, i < span).
struct PadLayout {
  int64_t blocks, span, block_step, unit_step, piece_shift, piece_vecs;
  bool launch_now;  // the next grid may start while this one runs (else as its blocks exit)
};

// Rows past the most routed pairs (num_tokens * num_topk) are padding or unused for sure. When
// they are few (upstream's exactly sized layouts, a dense decode: none), whole rows, 256 per block:
// a few flag-only blocks after the copy's (at decode 4 beside 128 copy blocks: one block per SM).
// When they are many (the MoE layer's no-sync bound at decode: 3840 of 4864 rows) the zero-fill
// is most of the launch, and a 256-thread block zeroes at a bounded rate (15-20 GB/s in the
// measured layouts), so the SMs need several zeroing blocks each and the same bytes each: the
// rows are cut into 2^k pieces of at most one block-wide store (896 vectors: 4 of 224) and dealt
// out with an odd stride (no alignment's power-of-two pattern follows it) over the slots of one
// wave the copy leaves (blocks_per_sm per SM; at least two blocks per SM, at least 8 and at most
// 256 units per block): at decode 267 blocks of 73 units beside 128 copy blocks, each block's
// zeros within 10-15% of the mean. Such a grid is one wave, and the next launch starts as its
// blocks exit: started early it would take whichever slots are free while this grid runs
// (measured at this layout: up to 6.7 us per launch lost against plain launches), here it finds
// the SMs empty.
inline PadLayout pad_layout(const Plan& p, const Constants& c, int64_t copy_blocks, int sms) {
  PadLayout l{0, c.threads, c.threads, 1, 0, p.row_vecs, true};
  const int64_t sure_padding = std::max<int64_t>(p.num_rows - p.num_tokens * p.num_topk, 0);
  if (p.num_rows == 0 || sure_padding * 8 < p.num_rows) {
    l.blocks = ceil_div(p.num_rows, c.threads);
    return l;
  }
  while (ceil_div(p.row_vecs, int64_t{1} << l.piece_shift) > c.threads) l.piece_shift++;
  l.piece_vecs = align_up(ceil_div(p.row_vecs, int64_t{1} << l.piece_shift), 8);
  const int64_t units = p.num_rows << l.piece_shift;
  const int64_t odd = std::max<int64_t>(1, (std::max<int64_t>(2 * sms, sms * c.blocks_per_sm - copy_blocks) - 1) | 1);
  l.blocks = std::max<int64_t>(std::min<int64_t>(odd, ceil_div(units, 8)), ceil_div(units, c.threads));
  l.span = ceil_div(units, l.blocks);
  l.block_step = 1;
  l.unit_step = l.blocks;
  l.launch_now = false;
  return l;
}

inline bool copy_args(const char* op, const TensorArg& x, const TensorArg& token_topk_to_pos,
                      const TensorArg& pos_to_expert, const Plan& p, const Constants& c, const TensorArg& out,
                      KernelArgs& k) {
  const CopyGeometry g = geometry(p, c);
  const int sms = plan_sm_count(op, x.device);
  if (sms < 0) return false;  // the device query failed (error set)
  const PadLayout pad = pad_layout(p, c, g.blocks, sms);
  // the kernel's thread indices (block * span + thread over the copy) and unit indices (below
  // pad blocks * block_step + 256 * unit_step) are 32-bit
  TKA_CHECK((pad.blocks + g.blocks) * c.threads <= 2147483647 &&
                pad.blocks * pad.block_step + c.threads * pad.unit_step <= 2147483647,
            "pos_to_expert", "has too many rows for one launch");
  TKA_CHECK(aligned(out.data, 16), "out", "must start 16-byte aligned");
  k.x = x.data;
  k.out = out.data;
  k.token_topk_to_pos = token_topk_to_pos.data;
  k.pos_to_expert = pos_to_expert.data;
  k.num_tokens = p.num_tokens;
  k.num_rows = p.num_rows;
  k.num_topk = p.num_topk;
  k.row_vecs = p.row_vecs;
  k.lanes_per_row = g.lanes;
  k.block_span = g.span;
  k.copy_blocks = g.blocks;
  k.pad_span = pad.span;
  k.block_step = pad.block_step;
  k.unit_step = pad.unit_step;
  k.piece_shift = pad.piece_shift;
  k.piece_vecs = pad.piece_vecs;
  k.launch_now = pad.launch_now ? 1 : 0;
  k.num_blocks = pad.blocks + g.blocks;
  k.x_sf = nullptr;
  k.out_sf = nullptr;
  k.sf_cols = 0;
  k.sf_row_stride = 0;
  k.sf_col_stride = 0;
  return true;
}

namespace expand_to_fused {
using tka::moe_expand_to_fused::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  return plan_rows(op, a.x, a.token_topk_to_pos, a.pos_to_expert, p);
}
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { dense_output(s.out, a.x.dtype, {p.num_rows, p.hidden}); }
// no token: nothing to copy, but padding rows still to zero (upstream launches nothing then
// and leaves the buffer uninitialised; the reference zeroes it)
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return copy_args(op, a.x, a.token_topk_to_pos, a.pos_to_expert, p, c, o.out, k);
}
}  // namespace expand_to_fused

namespace expand_to_fused_with_sf {
using tka::moe_expand_to_fused::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  TKA_CHECK(a.x_sf.present, "x", "must be a (data, sf) pair");
  if (!plan_rows(op, a.x, a.token_topk_to_pos, a.pos_to_expert, p)) return false;
  const int64_t npc = a.num_per_channels;
  TKA_CHECK(npc == 32 || npc == 128, "num_per_channels", "must be 32 or 128, got %lld", static_cast<long long>(npc));
  const bool packed = a.x_sf.dtype == I32;
  TKA_CHECK(!packed || a.use_tma_aligned_col_major_sf, "use_tma_aligned_col_major_sf",
            "must be True for packed UE8M0 (int32) scale factors");
  const int64_t groups = ceil_div(p.hidden, npc);
  const int64_t cols = packed ? ceil_div(groups, 4) : groups;
  TKA_CHECK(a.x_sf.ndim == 2 && a.x_sf.shape[0] == p.num_tokens && a.x_sf.shape[1] == cols, "x",
            "scale factors must have shape [%lld, %lld] (hidden %lld, num_per_channels %lld%s)",
            static_cast<long long>(p.num_tokens), static_cast<long long>(cols), static_cast<long long>(p.hidden),
            static_cast<long long>(npc), packed ? ", packed 4 per int32" : "");
  TKA_CHECK(a.x_sf.contiguous(), "x", "scale factors must be contiguous (row-major)");
  p.sf_cols = cols;
  return true;
}
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, a.x.dtype, {p.num_rows, p.hidden});
  if (!a.use_tma_aligned_col_major_sf) return dense_output(s.out_sf, a.x_sf.dtype, {p.num_rows, p.sf_cols});
  // a transposed view of a [sf_cols, align(num_rows, 4)] buffer; stride 1 when empty (upstream's)
  const int64_t row_stride = p.num_rows > 0 ? align_up(p.num_rows, 4) : 1;
  strided_output(s.out_sf, a.x_sf.dtype, {p.num_rows, p.sf_cols}, {1, row_stride}, p.sf_cols * align_up(p.num_rows, 4));
}
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  if (!copy_args(op, a.x, a.token_topk_to_pos, a.pos_to_expert, p, c, o.out, k)) return false;
  TKA_CHECK(align_up(p.num_rows, 4) * p.sf_cols <= 2147483647, "pos_to_expert", "has too many rows for one launch");
  k.x_sf = a.x_sf.data;
  k.out_sf = o.out_sf.data;
  TKA_CHECK(ceil_div(p.sf_cols, k.lanes_per_row) <= c.sf_words_per_thread, "x",
            "has more scale factors per row (%lld) than the kernel's lanes hold", static_cast<long long>(p.sf_cols));
  k.sf_cols = p.sf_cols;
  k.sf_row_stride = o.out_sf.stride[0];
  k.sf_col_stride = o.out_sf.stride[1];
  return true;
}
}  // namespace expand_to_fused_with_sf

}  // namespace tka::moe_expand_to_fused
