// quant.per_block_cast_lossless: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_per_block_cast_lossless {

struct Plan {
  int64_t num_tokens, hidden;
  int64_t block_m, block_k;  // the output tiles
  int64_t rows, cols;        // the output factor grid
  int64_t sf_cols;           // columns of out_sf (packed UE8M0: words of 4 factors)
};

namespace per_block_cast_lossless {
using tka::quant_per_block_cast_lossless::Plan;

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.hidden = 2 * a.x.shape[1];
  p.block_m = a.out_block_size[0];
  p.block_k = a.out_block_size[1];
  TKA_CHECK(a.x_sf.present, "x", "must be a (data, sf) pair");
  TKA_CHECK(a.x_block_size[0] == 1 && a.x_block_size[1] == 32, "x_block_size",
            "must be (1, 32) in this build (FP4 factors per 32 channels), got (%lld, %lld)",
            static_cast<long long>(a.x_block_size[0]), static_cast<long long>(a.x_block_size[1]));
  TKA_CHECK((p.block_m == 1 || p.block_m == 32 || p.block_m == 128) &&
                (p.block_k == 32 || p.block_k == 64 || p.block_k == 128),
            "out_block_size", "must be in {1, 32, 128} x {32, 64, 128} in this build, got (%lld, %lld)",
            static_cast<long long>(p.block_m), static_cast<long long>(p.block_k));
  TKA_CHECK(p.hidden % 32 == 0, "x", "must have a hidden size (2 * x[0].shape[1]) divisible by 32, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "data must start 16-byte aligned");
  TKA_CHECK(p.num_tokens <= 2147483647 - 256, "x", "has too many rows for one launch (at most 2^31 - 257)");
  TKA_CHECK(!a.use_packed_ue8m0 || a.use_tma_aligned_col_major_sf, "use_packed_ue8m0",
            "requires use_tma_aligned_col_major_sf=True (packed UE8M0 factors are column-major)");
  const int64_t in_cols = p.hidden / 32;
  const bool in_packed = a.x_sf.dtype == I32;
  const int64_t want_cols = in_packed ? ceil_div(in_cols, 4) : in_cols;
  TKA_CHECK(a.x_sf.ndim == 2 && a.x_sf.shape[0] == p.num_tokens && a.x_sf.shape[1] == want_cols, "x's sf",
            "must be %s of shape [%lld, %lld] for x_block_size (1, 32)",
            in_packed ? "packed UE8M0 int32" : "float32", static_cast<long long>(p.num_tokens),
            static_cast<long long>(want_cols));
  p.rows = ceil_div(p.num_tokens, p.block_m);
  p.cols = ceil_div(p.hidden, p.block_k);
  p.sf_cols = a.use_packed_ue8m0 ? ceil_div(p.cols, 4) : p.cols;
  c.block_m = p.block_m;
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, E4M3, {p.num_tokens, p.hidden});
  const DType dtype = a.use_packed_ue8m0 ? I32 : F32;
  if (!a.use_tma_aligned_col_major_sf) return dense_output(s.out_sf, dtype, {p.rows, p.sf_cols});
  const int64_t row_stride = p.rows > 0 ? align_up(p.rows, 4) : 1;  // upstream's strides for an empty batch: 1
  strided_output(s.out_sf, dtype, {p.rows, p.sf_cols}, {1, row_stride}, p.sf_cols * align_up(p.rows, 4));
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  const int64_t row_pieces = p.hidden / 32;
  const int64_t col_tiles = ceil_div(row_pieces, c.block_pieces);
  const int64_t in_row_stride = p.num_tokens > 1 ? a.x_sf.stride[0] : 0;
  const int64_t in_col_stride = a.x_sf.shape[1] > 1 ? a.x_sf.stride[1] : 0;
  TKA_CHECK(ceil_div(p.num_tokens, c.block_rows) * col_tiles <= 2147483647, "x", "is too large for one launch");
  TKA_CHECK(in_row_stride * p.num_tokens + in_col_stride * a.x_sf.shape[1] <= 2147483647, "x's sf",
            "is too large (32-bit offsets)");
  TKA_CHECK(o.out_sf.stride[0] * p.rows + o.out_sf.stride[1] * p.sf_cols <= 2147483647, "out_sf",
            "is too large (32-bit offsets)");
  int64_t shift = 0;
  while ((int64_t{32} << shift) < p.block_k) ++shift;
  k.x = a.x.data;
  k.x_sf = a.x_sf.data;
  k.out = o.out.data;
  k.out_sf = o.out_sf.data;
  k.num_tokens = p.num_tokens;
  k.row_pieces = row_pieces;
  k.col_tiles = col_tiles;
  k.tile_shift = shift;
  k.num_sf_cols = p.cols;
  k.in_sf_row_stride = in_row_stride;
  k.in_sf_col_stride = in_col_stride;
  k.in_packed = a.x_sf.dtype == I32 ? 1 : 0;
  k.sf_row_stride = o.out_sf.stride[0];
  k.sf_col_stride = o.out_sf.stride[1];
  k.packed_sf = a.use_packed_ue8m0 ? 1 : 0;
  return true;
}
}  // namespace per_block_cast_lossless

}  // namespace tka::quant_per_block_cast_lossless
