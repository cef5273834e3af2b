// quant.per_token_cast, _with_sf_only, _with_precomputed_sf: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_per_token_cast {

struct Plan {
  int64_t num_tokens, hidden;
  int64_t piece;       // elements per 16-byte load
  int64_t group;       // the static config: 32, 64, 128, or 0 for one group per row
  int64_t num_groups;  // scale factors per row
  int64_t sf_cols;     // columns of out_sf (packed UE8M0: words of 4 factors)
  bool e4m3;
};

enum class Variant { kCast, kSfOnly, kPrecomputedSf };

// The checks and dims the three ops share (`A` is the op's Args).
template <typename A>
bool plan_cast(const char* op, const A& a, Variant variant, Plan& p, Config& c) {
  TKA_CHECK(!a.x_sf.present, "x", "as a pre-quantized (data, sf) pair is not supported by this build");
  TKA_CHECK(a.x_block_size_is_none, "x_block_size", "is not supported by this build (pre-quantized inputs are not prebuilt)");
  TKA_CHECK(a.fmt != "e5m6", "fmt", "'e5m6' is not supported by this build (only 'e4m3' and 'e2m1')");
  const int64_t npc = a.num_per_channels;
  p.num_tokens = a.x.shape[0];
  p.hidden = a.x.shape[1];
  p.piece = a.x.dtype == BF16 ? 8 : 4;
  p.e4m3 = a.fmt == "e4m3";
  const bool grouped = npc == 32 || npc == 64 || npc == 128;
  TKA_CHECK(npc > 0, "num_per_channels", "must be positive, got %lld", static_cast<long long>(npc));
  TKA_CHECK(grouped || (npc == p.hidden && p.hidden % 64 == 0), "num_per_channels",
            "must be 32, 64, 128, or hidden (one group per row, hidden %% 64 == 0); 16 is not supported by this build; "
            "got %lld", static_cast<long long>(npc));
  TKA_CHECK(variant == Variant::kCast || npc != p.hidden, "num_per_channels",
            "== hidden (one group per row) is not supported by this op");
  p.group = grouped ? npc : 0;
  p.num_groups = ceil_div(p.hidden, npc);
  p.sf_cols = a.use_packed_ue8m0 ? ceil_div(p.num_groups, 4) : p.num_groups;
  TKA_CHECK(p.hidden % p.piece == 0, "x",
            "must have a hidden size divisible by 8 (bfloat16) or 4 (float32): rows are read in 16-byte pieces");
  TKA_CHECK(p.num_tokens <= 1 || a.x.stride[0] % p.piece == 0, "x.stride(0)",
            "must be a multiple of 8 (bfloat16) or 4 (float32): rows must start 16-byte aligned");
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(p.group != 0 || p.hidden <= 8192, "x", "must have hidden <= 8192 for one group per row (num_per_channels == hidden)");
  if (variant == Variant::kPrecomputedSf) {
    TKA_CHECK(!a.use_tma_aligned_col_major_sf && !a.use_packed_ue8m0, "sf",
              "must be row-major float32 (use_tma_aligned_col_major_sf and use_packed_ue8m0 must be False)");
  } else {
    TKA_CHECK(!a.use_packed_ue8m0 || a.use_tma_aligned_col_major_sf, "use_packed_ue8m0",
              "requires use_tma_aligned_col_major_sf=True (packed UE8M0 factors are column-major)");
    TKA_CHECK(!a.use_packed_ue8m0 || a.round_sf, "use_packed_ue8m0", "requires round_sf=True (UE8M0 holds powers of two only)");
  }
  c.in_dtype = a.x.dtype;
  c.fmt = a.fmt;
  c.group = p.group;
  return true;
}

inline void data_output(const Plan& p, OutSpec& s) {
  dense_output(s, p.e4m3 ? E4M3 : I8, {p.num_tokens, p.e4m3 ? p.hidden : p.hidden / 2});
}

// fp32 [T, groups] row-major; or column-major with the token dim padded to 16 bytes; packed
// UE8M0 words int32 [T, ceil(groups / 4)] in the same column-major form (upstream's views).
template <typename A>
void sf_output(const A& a, const Plan& p, OutSpec& s) {
  const DType dtype = a.use_packed_ue8m0 ? I32 : F32;
  if (!a.use_tma_aligned_col_major_sf) return dense_output(s, dtype, {p.num_tokens, p.sf_cols});
  // upstream's strides for an empty batch: 1
  const int64_t token_stride = p.num_tokens > 0 ? align_up(p.num_tokens, 4) : 1;
  strided_output(s, dtype, {p.num_tokens, p.sf_cols}, {1, token_stride}, p.sf_cols * align_up(p.num_tokens, 4));
}

inline bool launch_needed(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

// Threads per row: the slots of a row (packed UE8M0: whole words of 4 groups) times lanes per
// slot, or, one group per row, the next power of two >= hidden / 32.
inline int64_t lanes_per_row(const Plan& p, const Constants& k, bool packed) {
  if (p.group != 0)
    return ceil_div(packed ? align_up(p.num_groups, 4) : p.num_groups, k.groups_per_lane) * k.lanes_per_group;
  int64_t n = 1;
  while (n < ceil_div(p.hidden, 32)) n *= 2;
  return n;
}

// The kernel's parameters: `out` (nullptr: not written), and the factors `sf` it writes or,
// with `read_sf`, reads, at `sf_row_stride` / `sf_col_stride` (elements).
template <typename A>
bool cast_args(const char* op, const A& a, const Plan& p, const Constants& c, KernelArgs& k, void* out, void* sf,
               int64_t sf_row_stride, int64_t sf_col_stride, bool read_sf) {
  const int64_t lanes = lanes_per_row(p, c, a.use_packed_ue8m0);
  TKA_CHECK(p.num_tokens * lanes <= 2147483647 - 256, "x", "has too many rows for one launch");
  k.x = a.x.data;
  k.out = out;
  k.sf = sf;
  k.num_tokens = p.num_tokens;
  k.row_pieces = p.hidden / p.piece;
  k.x_stride = p.num_tokens > 1 ? a.x.stride[0] : p.hidden;
  k.lanes_per_row = lanes;
  k.num_groups = p.num_groups;
  k.sf_row_stride = sf_row_stride;
  k.sf_col_stride = sf_col_stride;
  k.round_sf = a.round_sf ? 1 : 0;
  k.packed_sf = a.use_packed_ue8m0 ? 1 : 0;
  k.write_out = out != nullptr;
  k.read_sf = read_sf;
  return true;
}

namespace per_token_cast {
using tka::quant_per_token_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_cast(op, a, Variant::kCast, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  data_output(p, s.out);
  sf_output(a, p, s.out_sf);
}
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, o.out.data, o.out_sf.data, o.out_sf.stride[0], o.out_sf.stride[1], false);
}
}  // namespace per_token_cast

namespace per_token_cast_with_sf_only {
using tka::quant_per_token_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_cast(op, a, Variant::kSfOnly, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { sf_output(a, p, s.out_sf); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, nullptr, o.out_sf.data, o.out_sf.stride[0], o.out_sf.stride[1], false);
}
}  // namespace per_token_cast_with_sf_only

namespace per_token_cast_with_precomputed_sf {
using tka::quant_per_token_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  if (!plan_cast(op, a, Variant::kPrecomputedSf, p, c)) return false;
  TKA_CHECK(a.sf.shape[0] == p.num_tokens && a.sf.shape[1] == p.num_groups, "sf",
            "must have shape [x.shape[0], ceil(hidden / num_per_channels)] = [%lld, %lld], got [%lld, %lld]",
            static_cast<long long>(p.num_tokens), static_cast<long long>(p.num_groups),
            static_cast<long long>(a.sf.shape[0]), static_cast<long long>(a.sf.shape[1]));
  return true;
}
inline void outputs(const Args&, const Plan& p, OutSpecs& s) { data_output(p, s.out); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, o.out.data, a.sf.data, a.sf.stride[0], 1, true);
}
}  // namespace per_token_cast_with_precomputed_sf

}  // namespace tka::quant_per_token_cast
