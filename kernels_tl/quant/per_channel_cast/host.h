// quant.per_channel_cast, per_channel_cast_and_transpose, per_channel_cast_fused: host side
// (interface: tka/host.h).
#pragma once

#include <type_traits>

#include "args.h"

namespace tka::quant_per_channel_cast {

struct Plan {
  int64_t num_tokens;  // rows of x
  int64_t num_rows;    // rows of the output (pos_to_token's length with a gather)
  int64_t hidden;
  int64_t npt;         // num_per_tokens
  bool gather;
  bool quantized;      // x is a (data, sf) pair
  bool transpose;
};

inline bool wide_layout(const Plan& p, int64_t elem) { return !p.transpose && (elem == 1 || (elem == 2 && p.gather)); }

// The checks every op shares: fmt (the schema allows 'e4m3' only), the row block, alignment,
// and the sizes the kernel's 32-bit dims and grid hold.
template <typename A>
bool plan_common(const char* op, const A& a, Plan& p, Config& c) {
  const int64_t elem = a.x.dtype == F32 ? 4 : a.x.dtype == BF16 ? 2 : 1;
  const int64_t piece = 16 / elem;  // channels per 16-byte piece
  TKA_CHECK(p.hidden % piece == 0, "x", "must have a hidden size divisible by %lld for %s input, got %lld",
            static_cast<long long>(piece), elem == 4 ? "float32" : elem == 2 ? "bfloat16" : "e4m3",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  TKA_CHECK(p.num_tokens < 2147483647 && p.num_rows < 2147483647 - 128 && p.hidden < 2147483647, "x",
            "is too large: rows and hidden must be below 2^31");
  // the grid's y extent: channel tiles (of 8 or, wide, 16 pieces) when transposed or with a
  // gather, else row tiles of 128 rows
  const int64_t tile_pieces = wide_layout(p, elem) ? 16 : 8;
  const int64_t grid_y = p.transpose || p.gather ? ceil_div(p.hidden, tile_pieces * piece) : ceil_div(p.num_rows, 128);
  TKA_CHECK(grid_y <= 65535, "x", "is too large for one launch");
  c.in_dtype = a.x.dtype;
  c.transpose = p.transpose ? 1 : 0;
  // the wide layout (256 bytes of 128 rows per block, 8 rows per thread): a pre-quantized x
  // always, a bf16 x with a gather; else (and transposed) the narrow one (128 bytes, 4 rows)
  c.wide = wide_layout(p, elem) ? 1 : 0;
  return true;
}

template <typename A>
bool plan_plain(const char* op, const A& a, Plan& p, Config& c, bool transpose) {
  p.num_tokens = p.num_rows = a.x.shape[0];
  p.hidden = a.x.shape[1];
  p.npt = a.num_per_tokens;
  p.gather = p.quantized = false;
  p.transpose = transpose;
  TKA_CHECK(p.num_tokens % 128 == 0 && p.hidden % 64 == 0, "x",
            "must be [T, H] with T %% 128 == 0 and H %% 64 == 0, got [%lld, %lld]", static_cast<long long>(p.num_tokens),
            static_cast<long long>(p.hidden));
  if (transpose) {
    TKA_CHECK(p.npt == 32 || p.npt == 128, "num_per_tokens", "must be 32 or 128, got %lld", static_cast<long long>(p.npt));
  } else {
    TKA_CHECK(p.npt == 128, "num_per_tokens", "must be 128, got %lld", static_cast<long long>(p.npt));
  }
  return plan_common(op, a, p, c);
}

inline void outputs_of(const Plan& p, OutSpec& out, OutSpec& out_sf) {
  if (p.transpose) {
    dense_output(out, E4M3, {p.hidden, p.num_rows});
  } else {
    dense_output(out, E4M3, {p.num_rows, p.hidden});
  }
  dense_output(out_sf, F32, {ceil_div(p.num_rows, p.npt), p.hidden});
}

inline bool launch_needed(const Plan& p) { return p.num_rows > 0 && p.hidden > 0; }

// Parameters only some configs have (a build's KernelArgs holds those of its configs).
template <typename K, typename = void>
struct HasInputSf : std::false_type {};
template <typename K>
struct HasInputSf<K, std::void_t<decltype(&K::x_sf)>> : std::true_type {};
template <typename K, typename = void>
struct HasRowBlock : std::false_type {};
template <typename K>
struct HasRowBlock<K, std::void_t<decltype(&K::num_per_tokens)>> : std::true_type {};

template <typename A>
bool cast_args(const A& a, const Plan& p, const Constants& c, void* out, void* out_sf, const void* x_sf,
               const void* pos_to_token, KernelArgs& k) {
  k.x = a.x.data;
  k.out = out;
  k.out_sf = out_sf;
  k.pos_to_token = const_cast<void*>(pos_to_token);
  k.num_tokens = p.num_tokens;
  k.num_rows = p.num_rows;
  k.row_pieces = p.hidden / c.piece_channels;
  k.gather = p.gather ? 1 : 0;
  k.round_sf = a.round_sf ? 1 : 0;
  if constexpr (HasInputSf<KernelArgs>::value) {
    k.x_sf = const_cast<void*>(x_sf);
    k.sf_cols = x_sf != nullptr ? p.hidden / 128 : 0;
  }
  if constexpr (HasRowBlock<KernelArgs>::value) k.num_per_tokens = p.npt;
  return true;
}

// What the two plain ops (per_channel_cast, per_channel_cast_and_transpose) share; their
// namespaces take these through a using-directive.
template <typename A, typename S>
void outputs(const A&, const Plan& p, S& s) {
  outputs_of(p, s.out, s.out_sf);
}
inline bool needs_launch(const Plan& p) { return launch_needed(p); }
template <typename A, typename O>
bool kernel_args(const char*, const A& a, const Plan& p, const Constants& c, const O& o, KernelArgs& k) {
  return cast_args(a, p, c, o.out.data, o.out_sf.data, nullptr, nullptr, k);
}

namespace per_channel_cast {
using namespace tka::quant_per_channel_cast;  // Plan, outputs, needs_launch, kernel_args
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_plain(op, a, p, c, false); }
}  // namespace per_channel_cast

namespace per_channel_cast_and_transpose {
using namespace tka::quant_per_channel_cast;  // Plan, outputs, needs_launch, kernel_args
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) { return plan_plain(op, a, p, c, true); }
}  // namespace per_channel_cast_and_transpose

namespace per_channel_cast_fused {
using tka::quant_per_channel_cast::Plan;
inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.hidden = a.x.shape[1];
  p.npt = a.num_per_tokens;
  p.quantized = a.x_sf.present;
  p.gather = a.pos_to_token.present;
  p.transpose = false;
  TKA_CHECK(p.npt == 128, "num_per_tokens", "must be 128, got %lld", static_cast<long long>(p.npt));
  if (p.quantized) {
    TKA_CHECK(!a.num_per_channels_is_none && a.num_per_channels == 128, "num_per_channels",
              "must be 128 for a pre-quantized (data, sf) x");
    TKA_CHECK(a.x_sf.ndim == 2 && a.x_sf.shape[0] == p.num_tokens && a.x_sf.shape[1] * 128 == p.hidden, "x's sf",
              "must be float32 [%lld, %lld] (one factor per token per 128 channels), got [%lld, %lld]",
              static_cast<long long>(p.num_tokens), static_cast<long long>(p.hidden / 128),
              static_cast<long long>(a.x_sf.shape[0]), static_cast<long long>(a.x_sf.ndim == 2 ? a.x_sf.shape[1] : -1));
    TKA_CHECK(a.x_sf.contiguous(), "x's sf", "must be contiguous");
  } else {
    TKA_CHECK(a.num_per_channels_is_none, "num_per_channels", "must be None for a plain x");
  }
  if (p.gather) {
    p.num_rows = a.pos_to_token.shape[0];
    TKA_CHECK(p.num_rows % 16 == 0, "pos_to_token", "must have a length divisible by 16, got %lld",
              static_cast<long long>(p.num_rows));
    TKA_CHECK(aligned(a.pos_to_token.data, 16), "pos_to_token", "must start 16-byte aligned");
  } else {
    p.num_rows = p.num_tokens;
    TKA_CHECK(p.num_rows % 128 == 0, "x", "must have a token count divisible by 128 without pos_to_token, got %lld",
              static_cast<long long>(p.num_rows));
  }
  return plan_common(op, a, p, c);
}
using tka::quant_per_channel_cast::needs_launch;
using tka::quant_per_channel_cast::outputs;
inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  return cast_args(a, p, c, o.out.data, o.out_sf.data, p.quantized ? a.x_sf.data : nullptr,
                   p.gather ? a.pos_to_token.data : nullptr, k);
}
}  // namespace per_channel_cast_fused

}  // namespace tka::quant_per_channel_cast
