// quant.per_block_cast, _with_sf_only, _with_precomputed_sf: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_per_block_cast {

struct Plan {
  int64_t num_tokens, hidden;
  int64_t piece;          // elements per 16-byte load
  int64_t block_m, block_k;
  int64_t rows, cols;     // the factor grid: ceil(T / block_m) x ceil(H / block_k)
  int64_t sf_cols;        // columns of out_sf (packed UE8M0: words of 4 factors)
  bool e4m3;
};

enum class Variant { kCast, kSfOnly, kPrecomputedSf };

// The checks and dims the three ops share (`A` is the op's Args).
template <typename A>
bool plan_cast(const char* op, const A& a, Variant variant, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.hidden = a.x.shape[1];
  p.piece = a.x.dtype == BF16 ? 8 : 4;
  p.e4m3 = a.fmt == "e4m3";
  p.block_m = a.block_size[0];
  p.block_k = a.block_size[1];
  TKA_CHECK((p.block_m == 32 || p.block_m == 128) && (p.block_k == 32 || p.block_k == 128), "block_size",
            "must be in {32, 128} x {32, 128}, got (%lld, %lld)", static_cast<long long>(p.block_m),
            static_cast<long long>(p.block_k));
  TKA_CHECK(p.hidden % 64 == 0, "x", "must have a hidden size divisible by 64, got %lld", static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(p.num_tokens <= 2147483647 - 256, "x", "has too many rows for one launch (at most 2^31 - 257)");
  p.rows = ceil_div(p.num_tokens, p.block_m);
  p.cols = ceil_div(p.hidden, p.block_k);
  p.sf_cols = a.use_packed_ue8m0 ? ceil_div(p.cols, 4) : p.cols;
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
  c.block_m = p.block_m;
  return true;
}

inline void data_output(const Plan& p, OutSpec& s) {
  dense_output(s, p.e4m3 ? E4M3 : I8, {p.num_tokens, p.e4m3 ? p.hidden : p.hidden / 2});
}

// fp32 [rows, cols] row-major; or column-major with the row dim padded to 16 bytes; packed
// UE8M0 words int32 [rows, ceil(cols / 4)] in the same column-major form (upstream's views).
template <typename A>
void sf_output(const A& a, const Plan& p, OutSpec& s) {
  const DType dtype = a.use_packed_ue8m0 ? I32 : F32;
  if (!a.use_tma_aligned_col_major_sf) return dense_output(s, dtype, {p.rows, p.sf_cols});
  const int64_t row_stride = p.rows > 0 ? align_up(p.rows, 4) : 1;  // upstream's strides for an empty batch: 1
  strided_output(s, dtype, {p.rows, p.sf_cols}, {1, row_stride}, p.sf_cols * align_up(p.rows, 4));
}

inline bool launch_needed(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline int64_t log2_of(int64_t n) {
  int64_t s = 0;
  while ((int64_t{1} << s) < n) ++s;
  return s;
}

// Rows per block: block_m, a whole row of tiles (the tile maximum is taken inside a block).  With
// given factors (`read_sf`: no maximum) halved, down to 2 rows per row lane, while the halved grid
// still has at most one block per SM (132 on the H200): a decode call of 128 x 7168 bf16 with
// 128 x 128 tiles is then 112 blocks of 4 pieces per thread rather than 56 of 8, half the serial
// loads and stores per thread and twice the SMs issuing them.  Larger calls keep block_m.
inline int64_t block_rows(const Plan& p, const Constants& c, int64_t col_tiles, bool read_sf) {
  constexpr int64_t kOneWave = 132;
  int64_t rows = p.block_m;
  while (read_sf && rows > 2 * c.row_lanes && ceil_div(p.num_tokens, rows / 2) * col_tiles <= kOneWave) rows /= 2;
  return rows;
}

// The kernel's parameters: `out` (nullptr: not written), and the factors `sf` it writes or,
// with `read_sf`, reads, at `sf_row_stride` / `sf_col_stride` (32-bit words).
template <typename A>
bool cast_args(const char* op, const A& a, const Plan& p, const Constants& c, KernelArgs& k, void* out, void* sf,
               int64_t sf_row_stride, int64_t sf_col_stride, bool read_sf) {
  const int64_t row_pieces = p.hidden / p.piece;
  const int64_t col_tiles = ceil_div(row_pieces, c.block_pieces);
  const int64_t rows_per_block = block_rows(p, c, col_tiles, read_sf);
  TKA_CHECK(ceil_div(p.num_tokens, rows_per_block) * col_tiles <= 2147483647, "x", "is too large for one launch");
  TKA_CHECK(sf_row_stride * p.rows + sf_col_stride * p.sf_cols <= 2147483647, "out_sf", "is too large (32-bit offsets)");
  k.x = a.x.data;
  k.out = out;
  k.sf = sf;
  k.num_tokens = p.num_tokens;
  k.row_pieces = row_pieces;
  k.col_tiles = col_tiles;
  k.tile_shift = log2_of(p.block_k / p.piece);
  k.num_sf_cols = p.cols;
  k.sf_row_stride = sf_row_stride;
  k.sf_col_stride = sf_col_stride;
  k.round_sf = a.round_sf ? 1 : 0;
  k.packed_sf = a.use_packed_ue8m0 ? 1 : 0;
  k.write_out = out != nullptr;
  k.read_sf = read_sf;
  k.block_rows = rows_per_block;
  return true;
}

namespace per_block_cast {
using tka::quant_per_block_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_cast(op, a, Variant::kCast, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  data_output(p, s.out);
  sf_output(a, p, s.out_sf);
}
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, o.out.data, o.out_sf.data, o.out_sf.stride[0], o.out_sf.stride[1], false);
}
}  // namespace per_block_cast

namespace per_block_cast_with_sf_only {
using tka::quant_per_block_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_cast(op, a, Variant::kSfOnly, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { sf_output(a, p, s.out_sf); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, nullptr, o.out_sf.data, o.out_sf.stride[0], o.out_sf.stride[1], false);
}
}  // namespace per_block_cast_with_sf_only

namespace per_block_cast_with_precomputed_sf {
using tka::quant_per_block_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  if (!plan_cast(op, a, Variant::kPrecomputedSf, p, c)) return false;
  TKA_CHECK(a.sf.shape[0] == p.rows && a.sf.shape[1] == p.cols, "sf",
            "must have shape [ceil(T / block_size[0]), ceil(hidden / block_size[1])] = [%lld, %lld], got [%lld, %lld]",
            static_cast<long long>(p.rows), static_cast<long long>(p.cols),
            static_cast<long long>(a.sf.shape[0]), static_cast<long long>(a.sf.shape[1]));
  return true;
}
inline void outputs(const Args&, const Plan& p, OutSpecs& s) { data_output(p, s.out); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(op, a, p, c, k, o.out.data, a.sf.data, p.rows > 1 ? a.sf.stride[0] : p.cols, 1, true);
}
}  // namespace per_block_cast_with_precomputed_sf

}  // namespace tka::quant_per_block_cast
