// engram.engram_hash: host side (interface: tka/host.h).
#pragma once

#include "args.h"

namespace tka::engram_engram_hash::engram_hash {

struct Plan {
  int64_t num_tokens, max_ngram, num_layers, num_tables, num_cols, num_outputs;
};

inline bool plan(const char* op, const Args& a, Plan& p, Config&) {
  p.num_tokens = a.ngram_token_ids.shape[0];
  p.max_ngram = a.ngram_token_ids.shape[1];
  p.num_layers = a.vocab_sizes.shape[0];
  p.num_tables = a.vocab_sizes.shape[2];
  TKA_CHECK(p.max_ngram >= 1, "ngram_token_ids", "must have at least one column (the n-gram size), got 0");
  TKA_CHECK(a.vocab_sizes.shape[1] == p.max_ngram - 1, "vocab_sizes",
            "must have shape [L, n - 1, E] with n = ngram_token_ids.shape[1] = %lld, got dim 1 = %lld",
            static_cast<long long>(p.max_ngram), static_cast<long long>(a.vocab_sizes.shape[1]));
  TKA_CHECK(a.multipliers.shape[0] == p.num_layers && a.multipliers.shape[1] == p.max_ngram, "multipliers",
            "must have shape [L, n] = [%lld, %lld], got [%lld, %lld]", static_cast<long long>(p.num_layers),
            static_cast<long long>(p.max_ngram), static_cast<long long>(a.multipliers.shape[0]),
            static_cast<long long>(a.multipliers.shape[1]));
  p.num_cols = (p.max_ngram - 1) * p.num_tables;
  TKA_CHECK(a.offsets.shape[0] == p.num_layers && a.offsets.shape[1] == p.num_cols, "offsets",
            "must have shape [L, (n - 1) * E] = [%lld, %lld], got [%lld, %lld]", static_cast<long long>(p.num_layers),
            static_cast<long long>(p.num_cols), static_cast<long long>(a.offsets.shape[0]),
            static_cast<long long>(a.offsets.shape[1]));
  p.num_outputs = p.num_layers * p.num_tokens * p.num_cols;
  TKA_CHECK(ceil_div(p.num_outputs, 256) <= 2147483647, "ngram_token_ids", "has too many outputs for one launch");
  return true;
}

inline void outputs(const Args&, const Plan& p, OutSpecs& s) {
  dense_output(s.output, I32, {p.num_layers, p.num_tokens, p.num_cols});
}

inline bool needs_launch(const Plan& p) { return p.num_outputs > 0; }

inline bool kernel_args(const char*, const Args& a, const Plan& p, const Constants&, const Outs& o, KernelArgs& k) {
  k.ngram_token_ids = a.ngram_token_ids.data;
  k.multipliers = a.multipliers.data;
  k.vocab_sizes = a.vocab_sizes.data;
  k.offsets = a.offsets.data;
  k.output = o.output.data;
  k.num_tokens = p.num_tokens;
  k.max_ngram = p.max_ngram;
  k.num_layers = p.num_layers;
  k.num_tables = p.num_tables;
  k.num_cols = p.num_cols;
  return true;
}

}  // namespace tka::engram_engram_hash::engram_hash
