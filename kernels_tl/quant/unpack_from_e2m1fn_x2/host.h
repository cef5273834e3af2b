// quant.unpack_from_e2m1fn_x2: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_unpack_from_e2m1fn_x2::unpack_from_e2m1fn_x2 {

struct Plan {
  int64_t rows;        // the leading dims' product (1 for a contiguous input seen as one flat row)
  int64_t row_len;     // bytes per row
  int64_t row_stride;  // bytes between rows
  bool empty;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  const TensorArg& x = a.x;
  const int64_t L = x.shape[x.ndim - 1];
  // the leading dims as rows one stride apart: dims of extent 1 are skipped, each other dim's
  // stride must be the next inner one's stride times its extent
  int64_t rows = 1, stride = L, inner_extent = 0;
  for (int d = x.ndim - 2; d >= 0; --d) {
    if (x.shape[d] == 1) continue;
    if (inner_extent == 0) {
      stride = x.stride[d];
    } else {
      TKA_CHECK(x.stride[d] == stride * inner_extent || x.shape[d] == 0, "x",
                "must have leading dims that flatten into rows of one stride (dim %d has stride %lld, not %lld)",
                d, static_cast<long long>(x.stride[d]), static_cast<long long>(stride * inner_extent));
    }
    inner_extent = inner_extent == 0 ? x.shape[d] : inner_extent * x.shape[d];
    rows *= x.shape[d];
  }
  p.empty = rows == 0 || L == 0;
  TKA_CHECK(stride >= 0, "x", "must have non-negative strides");
  if (!p.empty && (rows == 1 || stride == L)) {  // contiguous: one flat row
    p.rows = 1;
    p.row_len = rows * L;
    p.row_stride = p.row_len;
  } else {
    p.rows = rows;
    p.row_len = L;
    p.row_stride = stride;
  }
  c.out_dtype = a.out_dtype;
  return true;
}

inline void outputs(const Args& a, const Plan&, OutSpecs& s) {
  // [..., L] -> [..., 2L], dense
  OutSpec& o = s.out;
  o.dtype = a.out_dtype;
  o.ndim = a.x.ndim;
  for (int d = 0; d < a.x.ndim; ++d) o.shape[d] = a.x.shape[d];
  o.shape[a.x.ndim - 1] *= 2;
  dense_strides(&o);
}

inline bool needs_launch(const Plan& p) { return !p.empty; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  const int64_t chunks_per_row = ceil_div(p.row_len, c.chunk);
  TKA_CHECK(chunks_per_row <= 2147483647 / p.rows - c.threads, "x", "has too many bytes for one launch (%lld rows of %lld)",
            static_cast<long long>(p.rows), static_cast<long long>(p.row_len));
  // the 16-byte path: every full chunk and its 32 outputs start 16-byte aligned
  const bool vector = aligned(a.x.data, 16) && aligned(o.out.data, 16) &&
                      (p.rows == 1 || (p.row_len % c.chunk == 0 && p.row_stride % c.chunk == 0));
  // two views of each pointer (16-byte words / bytes, 32-output chunks / elements); their extents
  // are only declared (every access is guarded by the kernel), so they are no parameters
  k.x_words = a.x.data;
  k.x_bytes = a.x.data;
  k.out_chunks = o.out.data;
  k.out_elems = o.out.data;
  k.rows = p.rows;
  k.chunks_per_row = chunks_per_row;
  k.row_len = p.row_len;
  k.row_stride = p.row_stride;
  k.vector = vector ? 1 : 0;
  return true;
}

}  // namespace tka::quant_unpack_from_e2m1fn_x2::unpack_from_e2m1fn_x2
