// transpose.transpose and transpose.batched_transpose: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::transpose_batched_transpose {

struct Plan {
  int64_t num_batches, rows, cols;  // x is [num_batches, rows (M), cols (N)]
  int64_t row_stride, batch_stride;
  int dim;  // the dim of x holding M (for messages)
};

inline bool empty(const Plan& p) { return p.num_batches == 0 || p.rows == 0 || p.cols == 0; }

// Alignment and stride checks are skipped for empty tensors (nothing is launched).
inline bool plan_transpose(const char* op, const TensorArg& x, bool batched, Plan& p, Config& c) {
  p.dim = batched ? 1 : 0;
  p.num_batches = batched ? x.shape[0] : 1;
  p.rows = x.shape[p.dim];
  p.cols = x.shape[p.dim + 1];
  p.row_stride = x.stride[p.dim];
  p.batch_stride = batched ? x.stride[0] : 0;
  TKA_CHECK(p.rows % 64 == 0, "x", "must have M (x.shape[%d]) a multiple of 64, got %lld", p.dim, static_cast<long long>(p.rows));
  TKA_CHECK(p.cols % 64 == 0, "x", "must have N (x.shape[%d]) a multiple of 64, got %lld", p.dim + 1,
            static_cast<long long>(p.cols));
  TKA_CHECK(empty(p) || p.row_stride % 4 == 0, "x", "must have a row stride (x.stride(%d)) that is a multiple of 4 elements",
            p.dim);
  TKA_CHECK(empty(p) || aligned(x.data, 4 * dtype_bytes(x.dtype)), "x", "must be aligned to 4 elements");
  if (batched) {
    TKA_CHECK(p.num_batches <= 65535, "x", "must have at most 65535 batches (x.shape[0])");
    TKA_CHECK(empty(p) || p.num_batches == 1 || p.batch_stride % 4 == 0, "x",
              "must have a batch stride (x.stride(0)) that is a multiple of 4 elements");
  }
  c.dtype = x.dtype;
  return true;
}

inline bool transpose_args(const char* op, const TensorArg& x, const Plan& p, const Constants& c, const TensorArg& out,
                           KernelArgs& k) {
  TKA_CHECK(ceil_div(p.cols, c.tile_cols) <= 65535, "x", "must have N (x.shape[%d]) at most 65535 * %lld for %s", p.dim + 1,
            static_cast<long long>(c.tile_cols), dtype_name(x.dtype));
  const int64_t vec = 16 / dtype_bytes(x.dtype);  // elements per 16-byte chunk
  k.x_pieces = x.data;
  k.out_chunks = out.data;
  k.num_batches = p.num_batches;
  k.rows = p.rows;
  k.cols = p.cols;
  k.batch_stride = p.num_batches > 1 ? p.batch_stride : 0;
  k.row_stride = p.row_stride;
  // 16-byte loads when every row start is 16-byte aligned, else 4-element loads
  k.wide = aligned(x.data, 16) && p.row_stride % vec == 0 && (p.num_batches == 1 || p.batch_stride % vec == 0);
  return true;
}

namespace batched_transpose {
using tka::transpose_batched_transpose::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_transpose(op, a.x, true, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, a.x.dtype, {p.num_batches, p.cols, p.rows});
}
inline bool needs_launch(const Plan& p) { return !empty(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return transpose_args(op, a.x, p, c, o.out, k);
}
}  // namespace batched_transpose

namespace transpose {
using tka::transpose_batched_transpose::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_transpose(op, a.x, false, p, c); }
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { dense_output(s.out, a.x.dtype, {p.cols, p.rows}); }
inline bool needs_launch(const Plan& p) { return !empty(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return transpose_args(op, a.x, p, c, o.out, k);
}
}  // namespace transpose

}  // namespace tka::transpose_batched_transpose
