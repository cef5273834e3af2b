// mhc.sinkhorn_normalize_bwd: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::mhc_sinkhorn_normalize_bwd::sinkhorn_normalize_bwd {

struct Plan {
  int64_t num_tokens, n;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config& c) {
  p.num_tokens = a.x.shape[0];
  p.n = a.x.shape[1];
  TKA_CHECK(a.x.shape[2] == p.n, "x", "must hold square matrices [num_tokens, n, n], got [%lld, %lld, %lld]",
            static_cast<long long>(p.num_tokens), static_cast<long long>(p.n), static_cast<long long>(a.x.shape[2]));
  for (int d = 0; d < 3; ++d) {
    TKA_CHECK(a.grad_output.shape[d] == a.x.shape[d], "grad_output", "must have the shape of x [%lld, %lld, %lld]",
              static_cast<long long>(p.num_tokens), static_cast<long long>(p.n), static_cast<long long>(p.n));
  }
  TKA_CHECK(a.repeat >= 1 && a.repeat <= 1000, "repeat", "must be in [1, 1000], got %lld",
            static_cast<long long>(a.repeat));
  c.n = p.n;
  c.max_repeat = (a.repeat + 9) / 10 * 10;  // the stash of the smallest multiple of 10 that holds repeat
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) { dense_output(s.grad_input, F32, {p.num_tokens, p.n, p.n}); }

inline bool needs_launch(const Plan& p) { return p.num_tokens > 0; }

inline bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  // a matrix is loaded and stored as 16-byte vectors
  TKA_CHECK(aligned(a.grad_output.data, 16), "grad_output", "must start on a 16-byte boundary");
  TKA_CHECK(aligned(a.x.data, 16), "x", "must start on a 16-byte boundary");
  TKA_CHECK(aligned(o.grad_input.data, 16), "grad_input", "must start on a 16-byte boundary");
  k.grad_output = a.grad_output.data;
  k.x = a.x.data;
  k.grad_input = o.grad_input.data;
  k.num_tokens = p.num_tokens;
  k.repeat = static_cast<int32_t>(a.repeat);
  k.eps = static_cast<float>(a.eps);
  return true;
}

}  // namespace tka::mhc_sinkhorn_normalize_bwd::sinkhorn_normalize_bwd
