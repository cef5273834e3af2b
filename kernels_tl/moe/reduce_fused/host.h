// moe.reduce_fused: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::moe_reduce_fused::reduce_fused {

// The burst kernel's layout (kernel.py: BURST_VECTORS x 16 bytes of a row per thread,
// BURST_THREADS, BURST_BLOCKS_PER_SM; kernel_args checks them against the chosen kernel's
// constants): one thread per (token, 32-byte slice of its row).
constexpr int64_t kBurstBytesPerLane = 32;
constexpr int64_t kBurstThreads = 128;
constexpr int64_t kBurstBlocksPerSm = 4;

struct Plan {
  int64_t num_rows, hidden, num_tokens, num_topk;
  int64_t sms;  // the device's SMs (132 for a tensor off CUDA)
  bool e4m3;
  bool burst;  // the burst kernel's grid is resident at once (else the stream kernel)
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_rows = a.x.shape[0];
  p.hidden = a.x.shape[1];
  p.num_tokens = a.token_topk_to_pos.shape[0];
  p.num_topk = a.token_topk_to_pos.shape[1];
  p.e4m3 = a.fp8_format == "e4m3";
  TKA_CHECK(p.hidden % 256 == 0, "x", "must have a hidden size (x.shape[1]) that is a multiple of 256, got %lld",
            static_cast<long long>(p.hidden));
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start 16-byte aligned");
  if (a.x_sf.present) {
    TKA_CHECK(a.x_sf.ndim == 1 && a.x_sf.shape[0] == p.num_rows, "x",
              "per-row scale factors x_sf must have shape [%lld] (x.shape[0])", static_cast<long long>(p.num_rows));
    TKA_CHECK(a.x_sf.contiguous(), "x", "per-row scale factors x_sf must be contiguous");
  }
  if (a.topk_weights.present) {
    TKA_CHECK(a.topk_weights.shape[0] == p.num_tokens && a.topk_weights.shape[1] == p.num_topk, "topk_weights",
              "must have shape [%lld, %lld] (token_topk_to_pos's), got [%lld, %lld]",
              static_cast<long long>(p.num_tokens), static_cast<long long>(p.num_topk),
              static_cast<long long>(a.topk_weights.shape[0]), static_cast<long long>(a.topk_weights.shape[1]));
  }
  TKA_CHECK(p.e4m3 || !a.sf.present, "sf", "is only supported with fp8 output (fp8_format='e4m3')");
  TKA_CHECK(!a.sf.present || a.sf.shape[0] >= 1, "sf", "must hold the output scale (shape [1]), got an empty tensor");
  p.sms = plan_sm_count(op, a.x.device);
  if (p.sms < 0) return false;  // the device query failed (error set)
  // The burst kernel when its grid (one thread per 32-byte slice of every token's row; hidden
  // % 256 == 0 makes the slices exact) fits in one wave; the stream kernel's one wave otherwise.
  const int64_t burst_items = p.num_tokens * (p.hidden * dtype_bytes(a.x.dtype) / kBurstBytesPerLane);
  p.burst = (burst_items + kBurstThreads - 1) / kBurstThreads <= p.sms * kBurstBlocksPerSm;
  c.in_dtype = a.x.dtype;
  c.out_dtype = p.e4m3 ? E4M3 : a.x.dtype;
  c.path = p.burst ? "burst" : "stream";
  return true;
}

inline void outputs(const Args& a, const Plan& p, OutSpecs& s) {
  dense_output(s.out, p.e4m3 ? E4M3 : a.x.dtype, {p.num_tokens, p.hidden});
}

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0 && p.hidden > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& c, const Outs& o, KernelArgs& k) {
  TKA_CHECK(c.burst == 0 || (c.elements_per_lane * dtype_bytes(a.x.dtype) == kBurstBytesPerLane &&
                             c.threads == kBurstThreads && c.blocks_per_sm == kBurstBlocksPerSm),
            "x", "cannot run: the burst kernel's layout (%lld elements per thread, %lld threads, %lld blocks per SM) "
            "differs from the host's", static_cast<long long>(c.elements_per_lane), static_cast<long long>(c.threads),
            static_cast<long long>(c.blocks_per_sm));
  const int64_t lanes = p.hidden / c.elements_per_lane;
  const int64_t items = p.num_tokens * lanes;
  // burst: one thread per item (token, lane), a grid the plan found resident at once; stream: a
  // grid of at most one wave (every block resident at once), each thread walking its items with
  // a stride of the grid's threads
  const int64_t all_blocks = (items + c.threads - 1) / c.threads;
  const int64_t blocks = c.burst ? all_blocks : std::min<int64_t>(all_blocks, p.sms * c.blocks_per_sm);
  TKA_CHECK(items + blocks * c.threads <= 2147483647, "token_topk_to_pos", "has too many rows for one launch");
  TKA_CHECK(aligned(o.out.data, 16), "out", "must start 16-byte aligned");
  k.x = a.x.data;
  k.x_sf = a.x_sf.present ? a.x_sf.data : nullptr;
  k.topk_weights = a.topk_weights.present ? a.topk_weights.data : nullptr;
  k.token_topk_to_pos = a.token_topk_to_pos.data;
  k.sf = a.sf.present ? a.sf.data : nullptr;
  k.out = o.out.data;
  k.num_rows = p.num_rows;
  k.num_tokens = p.num_tokens;
  k.num_topk = p.num_topk;
  k.row_pieces = p.hidden / (16 / (kDTypes[a.x.dtype].bits / 8));
  k.lanes_per_row = lanes;
  k.num_blocks = blocks;
  k.with_weights = a.topk_weights.present;
  k.with_x_sf = a.x_sf.present;
  k.with_sf = a.sf.present;
  return true;
}

}  // namespace tka::moe_reduce_fused::reduce_fused
