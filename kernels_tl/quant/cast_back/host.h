// quant.cast_back and quant.per_token_cast_back: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::quant_cast_back {

struct Plan {
  int64_t num_tokens, hidden;
  int64_t row_atoms;              // hidden / 8: atoms (8 elements) per row
  int64_t bm_shift, bk_shift;     // row >> bm_shift, channel >> bk_shift select the factor
  bool packed;                    // packed UE8M0 words (int32) rather than fp32 factors
};

// Shift that maps an index below `extent` to its block of `block`: log2(block) for a power of
// two, 31 (index 0 for every index below 2^31) for a block at least as large as the extent;
// -1 for anything else.
inline int64_t block_shift(int64_t block, int64_t extent) {
  if (block >= extent) return 31;
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block) ++shift;
  return (int64_t{1} << shift) == block ? shift : -1;
}

// The checks and dims the two ops share: `bm` x `bk` blocks of factors.
template <typename A>
bool plan_cast_back(const char* op, const A& a, int64_t bm, int64_t bk, const char* block_arg, Plan& p, Config& c) {
  const bool e5m6 = !a.x_special_fmt_is_none;  // the only special format
  p.num_tokens = a.x.shape[0];
  if (e5m6) {
    TKA_CHECK_TYPE(a.x.dtype == U8, "x", "must be uint8 (packed e5m6) with x_special_fmt='e5m6', got %s",
                   dtype_name(a.x.dtype));
    TKA_CHECK(a.x.shape[1] % 12 == 0, "x", "e5m6 data width must be a multiple of 12 bytes (8 values), got %lld",
              static_cast<long long>(a.x.shape[1]));
    p.hidden = a.x.shape[1] / 3 * 2;
    c.in_fmt = "e5m6";
  } else {
    TKA_CHECK_TYPE(a.x.dtype == E4M3 || a.x.dtype == I8, "x",
                   "must be float8_e4m3fn or int8 (packed e2m1) without x_special_fmt (uint8 is e5m6 data: pass "
                   "x_special_fmt='e5m6'), got %s", dtype_name(a.x.dtype));
    p.hidden = a.x.dtype == I8 ? a.x.shape[1] * 2 : a.x.shape[1];
    TKA_CHECK(p.hidden % 64 == 0, "x", "must have a hidden size divisible by 64, got %lld",
              static_cast<long long>(p.hidden));
    c.in_fmt = a.x.dtype == I8 ? "e2m1" : "e4m3";
  }
  c.out_dtype = a.fmt == "bf16" ? "bfloat16" : "float32";
  p.row_atoms = p.hidden / 8;

  TKA_CHECK(bm > 0 && bk > 0, block_arg, "must be positive, got (%lld, %lld)", static_cast<long long>(bm),
            static_cast<long long>(bk));
  p.bm_shift = block_shift(bm, p.num_tokens);
  p.bk_shift = block_shift(bk, p.hidden);
  TKA_CHECK(p.bm_shift >= 0 && p.bk_shift >= 0, block_arg,
            "must be powers of two (or at least the token count / hidden size), got (%lld, %lld)",
            static_cast<long long>(bm), static_cast<long long>(bk));

  // the factor grid: [ceil(T / bm), ceil(H / bk)] fp32, or [.., ceil(../ 4)] packed UE8M0 words
  const TensorArg& sf = a.x_sf;
  TKA_CHECK(sf.ndim == 2, "x's sf", "must be 2-D, got %d-D", sf.ndim);
  p.packed = sf.dtype == I32;
  const int64_t rows = ceil_div(p.num_tokens, bm), blocks = ceil_div(p.hidden, bk);
  const int64_t cols = p.packed ? ceil_div(blocks, 4) : blocks;
  TKA_CHECK(sf.shape[0] == rows && sf.shape[1] == cols, "x's sf",
            "must have shape [%lld, %lld] (%s factors of %lld x %lld blocks of a [%lld, %lld] tensor), got [%lld, %lld]",
            static_cast<long long>(rows), static_cast<long long>(cols), p.packed ? "packed UE8M0" : "float32",
            static_cast<long long>(bm), static_cast<long long>(bk), static_cast<long long>(p.num_tokens),
            static_cast<long long>(p.hidden), static_cast<long long>(sf.shape[0]), static_cast<long long>(sf.shape[1]));
  for (int d = 0; d < 2; ++d)
    TKA_CHECK(sf.shape[d] <= 1 || (sf.stride[d] >= 0 && sf.stride[d] <= 2147483647), "x's sf",
              "strides must be below 2^31 elements");
  TKA_CHECK(aligned(a.x.data, e5m6 || a.x.dtype == I8 ? 4 : 8), "x",
            "data must start %d-byte aligned", e5m6 || a.x.dtype == I8 ? 4 : 8);
  return true;
}

template <typename A>
void out_spec(const A& a, const Plan& p, OutSpec& s) {
  dense_output(s, a.fmt == "bf16" ? BF16 : F32, {p.num_tokens, p.hidden});
}

inline bool launch_needed(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

// Atoms per lane: 8, or 4 when the call is too small to give 2^18 lanes with 8 per lane.  Not
// fewer than 4: below that a small call's time is per-block and per-thread cost (a decode call of
// 128 x 7168 at one atom per lane is 448 blocks, 3.4 per SM at the 4 blocks of 64 registers an SM
// holds, so the next grid's blocks find no room to start early under programmatic dependent
// launch); at 4 it is 112 blocks of 256 threads, one per SM, 32 elements per thread.
inline int64_t lanes_per_row(const Plan& p, const Constants& k) {
  constexpr int64_t kMinAtoms = 4;
  int64_t atoms = k.atoms_per_lane;
  while (atoms > kMinAtoms && p.num_tokens * ceil_div(p.row_atoms, atoms) < (int64_t{1} << 18)) atoms /= 2;
  return ceil_div(p.row_atoms, atoms);
}

template <typename A, typename O>
bool cast_back_args(const char* op, const A& a, const Plan& p, const Constants& c, const O& o, KernelArgs& k) {
  const int64_t lanes = lanes_per_row(p, c);
  TKA_CHECK(p.num_tokens * lanes <= 2147483647 - 256, "x", "has too many rows for one launch");
  // 16-byte stores of 8 bf16; 8 fp32 are one 32-byte store on sm_100a
  TKA_CHECK(aligned(o.out.data, a.fmt == "bf16" ? 16 : 32), "out", "must start %d-byte aligned", a.fmt == "bf16" ? 16 : 32);
  k.x = a.x.data;
  k.sf = a.x_sf.data;
  k.out = o.out.data;
  k.num_tokens = p.num_tokens;
  k.row_atoms = p.row_atoms;
  k.lanes_per_row = lanes;
  k.bm_shift = p.bm_shift;
  k.bk_shift = p.bk_shift;
  k.sf_row_stride = a.x_sf.shape[0] > 1 ? a.x_sf.stride[0] : 0;
  k.sf_col_stride = a.x_sf.shape[1] > 1 ? a.x_sf.stride[1] : 0;
  k.packed_sf = p.packed ? 1 : 0;
  return true;
}

namespace cast_back {
using tka::quant_cast_back::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  return plan_cast_back(op, a, a.x_block_size[0], a.x_block_size[1], "x_block_size", p, c);
}
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { out_spec(a, p, s.out); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_back_args(op, a, p, c, o, k);
}
}  // namespace cast_back

namespace per_token_cast_back {
using tka::quant_cast_back::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  return plan_cast_back(op, a, 1, a.num_per_channels, "num_per_channels", p, c);
}
inline void outputs(const Args& a, const Plan& p, OutSpecs& s) { out_spec(a, p, s.out); }
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_back_args(op, a, p, c, o, k);
}
}  // namespace per_token_cast_back

}  // namespace tka::quant_cast_back
