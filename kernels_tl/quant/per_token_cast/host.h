// quant.per_token_cast, _with_sf_only, _with_precomputed_sf: host side (interface: tka/host.h).
#pragma once

#include <type_traits>

#include "args.h"

namespace tka::quant_per_token_cast {

struct Plan {
  int64_t num_tokens, hidden;
  int64_t piece;       // elements per piece (plain: one 16-byte load, e5m6: 8; pre-quantized: 16)
  int64_t group;       // the static config: 16, 32, 64, 128, or 0 (one group per row, or pre-quantized)
  int64_t npc;         // num_per_channels
  int64_t num_groups;  // scale factors per row
  int64_t sf_cols;     // columns of out_sf (packed UE8M0: words of 4 factors)
  DType out_dtype;     // E4M3, I8 (packed e2m1) or U8 (packed e5m6)
  bool quantized;      // x is a (data, sf) pair
  bool x_sf_packed;    // its factors are packed UE8M0 words
  int64_t sms;         // (pre-quantized) the device's SMs: the grid is the blocks resident at once
};

enum class Variant { kCast, kSfOnly, kPrecomputedSf };

// A pre-quantized (data, sf) x: its checks and dims.
template <typename A>
bool plan_quantized(const char* op, const A& a, Variant variant, Plan& p) {
  TKA_CHECK(variant == Variant::kCast, "x", "as a pre-quantized (data, sf) pair is supported by per_token_cast only");
  TKA_CHECK(!a.x_block_size_is_none, "x_block_size", "is required when x is a (data, sf) pair");
  TKA_CHECK(a.fmt != "e5m6", "fmt", "'e5m6' takes a plain bfloat16/float32 x");
  const int64_t bm = a.x_block_size[0], bk = a.x_block_size[1];
  TKA_CHECK(bm > 0 && bk > 0 && bk % 16 == 0 && bm < 2147483647 && bk < 2147483647, "x_block_size",
            "must be positive with x_block_size[1] a multiple of 16, got (%lld, %lld)", static_cast<long long>(bm),
            static_cast<long long>(bk));
  const int64_t npc = a.num_per_channels;
  TKA_CHECK(npc == 16 || npc == 32 || npc == 64 || npc == 128, "num_per_channels",
            "must be 16, 32, 64 or 128 for a pre-quantized x, got %lld", static_cast<long long>(npc));
  const bool e4m3_in = a.x.dtype == E4M3;
  p.hidden = a.x.shape[1] * (e4m3_in ? 1 : 2);
  p.piece = 16;
  TKA_CHECK(p.hidden % 16 == 0, "x", "data must hold a multiple of 16 values per row, got %lld",
            static_cast<long long>(p.hidden));
  const int64_t piece_bytes = e4m3_in ? 16 : 8;
  TKA_CHECK(p.num_tokens <= 1 || a.x.stride[0] % piece_bytes == 0, "x.stride(0)",
            "of the data must be a multiple of 16 (e4m3) or 8 (packed e2m1) bytes");
  TKA_CHECK(aligned(a.x.data, 16), "x", "data must start 16-byte aligned");
  const int64_t blocks = ceil_div(p.hidden, bk);
  p.x_sf_packed = a.x_sf.dtype == I32;
  const int64_t want_rows = ceil_div(p.num_tokens, bm), want_cols = p.x_sf_packed ? ceil_div(blocks, 4) : blocks;
  TKA_CHECK(a.x_sf.ndim == 2 && a.x_sf.shape[0] == want_rows && a.x_sf.shape[1] == want_cols, "x's sf",
            "must have shape [ceil(T / bm), %s] = [%lld, %lld] for x_block_size (%lld, %lld)",
            p.x_sf_packed ? "ceil(ceil(H / bk) / 4) (packed UE8M0)" : "ceil(H / bk)", static_cast<long long>(want_rows),
            static_cast<long long>(want_cols), static_cast<long long>(bm), static_cast<long long>(bk));
  // the kernel steps from row to row by byte strides below 2**31
  TKA_CHECK(p.num_tokens <= 1 || a.x.stride[0] < 2147483647, "x.stride(0)", "of the data must be below 2**31 bytes");
  TKA_CHECK(a.x_sf.stride[0] < 536870912 && a.x_sf.stride[1] < 2147483647 &&
                (want_rows == 0 || (want_rows - 1) * a.x_sf.stride[0] + (want_cols - 1) * a.x_sf.stride[1] < 2147483647),
            "x's sf", "is too large for 32-bit offsets");
  p.group = 0;  // the group size is a run-time value of this kernel
  p.sms = plan_sm_count(op, a.x.device);
  return p.sms >= 0;  // else the device query failed (error set)
}

// The checks and dims the three ops share (`A` is the op's Args).
template <typename A>
bool plan_cast(const char* op, const A& a, Variant variant, Plan& p, Config& c) {
  const int64_t npc = a.num_per_channels;
  TKA_CHECK(npc > 0, "num_per_channels", "must be positive, got %lld", static_cast<long long>(npc));
  const bool e5m6 = a.fmt == "e5m6";
  TKA_CHECK(!e5m6 || variant == Variant::kCast, "fmt", "'e5m6' is supported by per_token_cast only");
  p.num_tokens = a.x.shape[0];
  p.npc = npc;
  p.quantized = a.x_sf.present;
  p.x_sf_packed = false;
  p.sms = 0;
  p.out_dtype = a.fmt == "e4m3" ? E4M3 : e5m6 ? U8 : I8;
  if (p.quantized) {
    if (!plan_quantized(op, a, variant, p)) return false;
  } else {
    TKA_CHECK(a.x_block_size_is_none, "x_block_size", "is only meaningful for a pre-quantized (data, sf) x");
    p.hidden = a.x.shape[1];
    const bool grouped = !e5m6 && (npc == 16 || npc == 32 || npc == 64 || npc == 128);
    if (e5m6) {
      TKA_CHECK(npc == p.hidden && p.hidden % 8 == 0, "num_per_channels",
                "must equal hidden (one group per row, hidden %% 8 == 0) for 'e5m6', got %lld for hidden %lld",
                static_cast<long long>(npc), static_cast<long long>(p.hidden));
    } else {
      TKA_CHECK(grouped || (npc == p.hidden && p.hidden % 64 == 0), "num_per_channels",
                "must be 16, 32, 64, 128, or hidden (one group per row, hidden %% 64 == 0); got %lld",
                static_cast<long long>(npc));
    }
    TKA_CHECK(variant == Variant::kCast || npc != p.hidden, "num_per_channels",
              "== hidden (one group per row) is not supported by this op");
    const int64_t load = a.x.dtype == BF16 ? 8 : 4;  // elements per 16-byte load
    p.piece = e5m6 ? 8 : load;
    p.group = grouped ? npc : 0;
    TKA_CHECK(p.hidden % p.piece == 0, "x",
              "must have a hidden size divisible by %lld here: rows are read in whole pieces", static_cast<long long>(p.piece));
    TKA_CHECK(p.num_tokens <= 1 || a.x.stride[0] % load == 0, "x.stride(0)",
              "must be a multiple of 8 (bfloat16) or 4 (float32): rows must start 16-byte aligned");
    TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
    TKA_CHECK(p.group != 0 || p.hidden <= 8192, "x", "must have hidden <= 8192 for one group per row (num_per_channels == hidden)");
  }
  TKA_CHECK(p.out_dtype != I8 || p.hidden % 2 == 0, "x", "must have an even hidden size for 'e2m1'");
  p.num_groups = ceil_div(p.hidden, npc);
  p.sf_cols = a.use_packed_ue8m0 ? ceil_div(p.num_groups, 4) : p.num_groups;
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
  const int64_t cols = p.out_dtype == E4M3 ? p.hidden : p.out_dtype == I8 ? p.hidden / 2 : p.hidden / 2 * 3;
  dense_output(s, p.out_dtype, {p.num_tokens, cols});
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
// slot, or, one group per row, the next power of two >= hidden / 32; pre-quantized: one lane
// per 16 values, padded to whole groups (packed: whole words of 4 groups).
inline int64_t lanes_per_row(const Plan& p, const Constants& k, bool packed) {
  if (p.quantized) return align_up(p.hidden / 16, (packed ? 4 : 1) * (p.npc / 16));
  if (p.group != 0)
    return ceil_div(packed ? align_up(p.num_groups, 4) : p.num_groups, k.groups_per_lane) * k.lanes_per_group;
  int64_t n = 1;
  while (n < ceil_div(p.hidden, 32)) n *= 2;
  return n;
}

// The pre-quantized kernel's own parameters (present in KernelArgs when a build has one of its configs).
template <typename K, typename = void>
struct HasQuantizedInput : std::false_type {};
template <typename K>
struct HasQuantizedInput<K, std::void_t<decltype(&K::x_sf)>> : std::true_type {};

template <typename A, typename K>
void quantized_args(const A& a, const Plan& p, const Constants& c, K& k) {
  if constexpr (HasQuantizedInput<K>::value) {
    // blocks per lane column: the resident blocks shared by the columns, at most one step of
    // rows per block (each warp then walks its rows `row_grid` blocks apart)
    const int64_t columns = ceil_div(k.lanes_per_row, 32 * (a.x.dtype == E4M3 ? 1 : 2));
    k.row_grid = p.quantized ? std::max<int64_t>(1, std::min(ceil_div(p.num_tokens, c.quant_block_rows),
                                                                 p.sms * c.quant_blocks_per_sm / columns))
                             : 1;
    k.x_sf = a.x_sf.present ? a.x_sf.data : nullptr;
    k.group_pieces = p.npc / 16;
    int64_t shift = 0;
    while ((int64_t{1} << shift) < p.npc / 16) ++shift;
    k.group_shift = static_cast<int32_t>(shift);  // npc / 16 is 1, 2, 4 or 8
    // rows / x_block_size[0] as (umulhi(row, mul) + row) >> shift (kernel.py: fast_div_params)
    const int64_t bm = a.x_sf.present ? a.x_block_size[0] : 1;
    int64_t bm_shift = 0;
    while ((int64_t{1} << bm_shift) < bm) ++bm_shift;
    const uint64_t bm_mul = ((uint64_t{1} << 32) * ((uint64_t{1} << bm_shift) - static_cast<uint64_t>(bm))) /
                                static_cast<uint64_t>(bm) + 1;
    k.block_rows_mul = static_cast<int32_t>(static_cast<uint32_t>(bm_mul));
    k.block_rows_shift = static_cast<int32_t>(bm_shift);
    k.block_pieces = a.x_sf.present ? a.x_block_size[1] / 16 : 1;
    k.x_sf_row_stride = a.x_sf.present ? a.x_sf.stride[0] : 0;
    k.x_sf_col_stride = a.x_sf.present ? a.x_sf.stride[1] : 0;
    k.x_sf_packed = p.x_sf_packed ? 1 : 0;
  }
}

// The kernel's parameters: `out` (nullptr: not written), and the factors `sf` it writes or,
// with `read_sf`, reads, at `sf_row_stride` / `sf_col_stride` (elements).
template <typename A>
bool cast_args(const char* op, const A& a, const Plan& p, const Constants& c, KernelArgs& k, void* out, void* sf,
               int64_t sf_row_stride, int64_t sf_col_stride, bool read_sf) {
  // factors only (no out, no given sf) of a config with the warp layout (float32, groups of 128):
  // a warp per `sf_only_warp_groups` groups of a row
  const bool warp_sf = out == nullptr && !read_sf && c.sf_only_warp_groups > 0;
  const int64_t lanes =
      warp_sf ? ceil_div(p.num_groups, c.sf_only_warp_groups) * 32 : lanes_per_row(p, c, a.use_packed_ue8m0);
  TKA_CHECK(p.num_tokens * lanes <= 2147483647 - 4096, "x", "has too many rows for one launch");
  // (pre-quantized) a warp's row indices run up to two steps of the whole grid past the last row
  TKA_CHECK(!p.quantized || p.num_tokens + 2 * c.quant_block_rows * p.sms * c.quant_blocks_per_sm <= 2147483647, "x",
            "has too many rows for one launch");
  // the pre-quantized kernel: 32 lanes of 16 values per block column (grid y), and a piece's 16
  // codes stored as one vector (16 or 8 bytes)
  TKA_CHECK(!p.quantized || lanes <= int64_t{65535} * 32, "x", "has too many values per row for one launch");
  TKA_CHECK(!p.quantized || out == nullptr || aligned(out, p.out_dtype == E4M3 ? 16 : 8), "out",
            "must start %d-byte aligned", p.out_dtype == E4M3 ? 16 : 8);
  k.x = a.x.data;
  k.out = out;
  k.sf = sf;
  k.num_tokens = p.num_tokens;
  k.row_pieces = p.hidden / p.piece;
  // elements between rows (pre-quantized: 32-bit words of the data)
  const int64_t row_stride = p.num_tokens > 1 ? a.x.stride[0] : a.x.shape[1];
  k.x_stride = p.quantized ? row_stride / 4 : row_stride;
  k.lanes_per_row = lanes;
  k.num_groups = p.num_groups;
  k.sf_row_stride = sf_row_stride;
  k.sf_col_stride = sf_col_stride;
  k.round_sf = a.round_sf ? 1 : 0;
  k.packed_sf = a.use_packed_ue8m0 ? 1 : 0;
  k.write_out = out != nullptr;
  k.read_sf = read_sf;
  quantized_args(a, p, c, k);
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
