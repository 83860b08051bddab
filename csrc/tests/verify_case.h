// Shared by the native tests of verify (test_kernels.cpp: the CPU launcher;
// test_cuda_sim_kernels.cpp: the CUDA kernels in the host simulation against it): one
// verify call's inputs as host vectors, its outputs, and the structure every output row
// must have.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "native_check.h"
#include "verispec/ops.h"
#include "verispec/sampling_math.h"

namespace verify_case {

using namespace verispec;

inline std::vector<float> random_logits(std::mt19937& rng, size_t n, float scale = 2.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct VerifyOut {
  std::vector<int32_t> tokens;
  std::vector<int32_t> emitted;
  std::vector<int32_t> accepted;
  OpStatus status;

  // Whether row b has the same tokens and counts in both.
  bool row_equal(const VerifyOut& other, int64_t b, int64_t k) const {
    for (int64_t j = 0; j <= k; ++j) {
      if (tokens[static_cast<size_t>(b * (k + 1) + j)] != other.tokens[static_cast<size_t>(b * (k + 1) + j)]) {
        return false;
      }
    }
    return emitted[static_cast<size_t>(b)] == other.emitted[static_cast<size_t>(b)] &&
           accepted[static_cast<size_t>(b)] == other.accepted[static_cast<size_t>(b)];
  }
};

struct VerifyCase {
  int64_t batch = 1, k = 1, vocab = 4;
  std::vector<float> logits;       // [batch, k + 1, vocab]
  std::vector<BFloat16> logits_bf16;  // used instead of logits when not empty
  std::vector<int32_t> drafts;     // [batch, k]
  std::vector<float> draft_probs;  // [batch, k, vocab] or empty (one-hot); [batch, k, W]
                                   // with draft_index (ops.h "Compact q")
  std::vector<int32_t> draft_index;  // [vocab] or empty
  int64_t draft_width = 0;           // W
  std::vector<int32_t> num_draft;  // [batch] or empty
  PolicyParams policy;  // greedy: temperature 0
  uint64_t seed = 1, offset = 0;
  VerifyMethod method = VerifyMethod::kToken;

  int64_t n(int64_t b) const { return num_draft.empty() ? k : num_draft[static_cast<size_t>(b)]; }

  // The launcher's arguments, with outputs in *o (sized and filled with 12345 here).
  VerifyArgs args(VerifyOut* o) const {
    o->tokens.assign(static_cast<size_t>(batch * (k + 1)), 12345);
    o->emitted.assign(static_cast<size_t>(batch), 12345);
    o->accepted.assign(static_cast<size_t>(batch), 12345);
    VerifyArgs a;
    if (logits_bf16.empty()) {
      a.target_logits = logits.data();
    } else {
      a.target_logits = logits_bf16.data();
      a.target_logits_dtype = LogitsDType::kBFloat16;
    }
    a.target_logits_stride_b = (k + 1) * vocab;
    a.target_logits_stride_k = vocab;
    a.batch = batch;
    a.num_spec = k;
    a.vocab = vocab;
    a.draft_tokens = drafts.empty() ? nullptr : drafts.data();
    a.draft_tokens_stride_b = k;
    const int64_t w = draft_index.empty() ? vocab : draft_width;
    a.draft_probs = draft_probs.empty() ? nullptr : draft_probs.data();
    a.draft_probs_stride_b = k * w;
    a.draft_probs_stride_k = w;
    a.draft_index = draft_index.empty() ? nullptr : draft_index.data();
    a.draft_width = draft_index.empty() ? 0 : draft_width;
    a.num_draft = num_draft.empty() ? nullptr : num_draft.data();
    a.method = method;
    a.policy = policy;
    a.rng.seed = seed;
    a.rng.offset = offset;
    a.tokens = o->tokens.data();
    a.tokens_stride_b = k + 1;
    a.num_emitted = o->emitted.data();
    a.num_accepted = o->accepted.data();
    return a;
  }

  // launcher(const VerifyArgs&) -> OpStatus: verify_cpu, or a simulated CUDA launch.
  template <typename Launcher>
  VerifyOut run_with(Launcher&& launcher) const {
    VerifyOut o;
    o.status = launcher(args(&o));
    return o;
  }
  VerifyOut run() const { return run_with(verify_cpu); }

  // The structure of row b of o: the accepted proposals, one emitted token in range,
  // -1 after it, num_emitted = accepted + 1; a row at fault is all -1 with zero counts.
  void check_row(const VerifyOut& o, int64_t b, bool at_fault = false) const {
    const int32_t* t = &o.tokens[static_cast<size_t>(b * (k + 1))];
    const int32_t acc = o.accepted[static_cast<size_t>(b)];
    const int32_t emitted = o.emitted[static_cast<size_t>(b)];
    if (at_fault) {
      CHECK(emitted == 0 && acc == 0);
      for (int64_t j = 0; j <= k; ++j) CHECK(t[j] == -1);
      return;
    }
    CHECK(acc >= 0 && acc <= n(b) && emitted == acc + 1);
    for (int64_t j = 0; j <= k; ++j) {
      if (j < acc) CHECK(t[j] == drafts[static_cast<size_t>(b * k + j)]);
      if (j == acc) CHECK(t[j] >= 0 && t[j] < vocab);
      if (j > acc) CHECK(t[j] == -1);
    }
  }
};

}  // namespace verify_case
