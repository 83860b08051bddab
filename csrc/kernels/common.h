// Helpers shared by the CPU (cpu/*.cpp) and CUDA (cuda/*.cu) kernels: resolving the
// per-row policy, the device error record, and the text of each status.
// Internal to csrc/kernels; the public surface is verispec/ops.h.
#pragma once

#include <cstdint>

#include "verispec/ops.h"
#include "verispec/philox.h"
#include "verispec/sampling_math.h"

namespace verispec {
namespace kernels {

// q(x) of a draft row under ops.h "Compact q": row[x] without an index, else the row's
// column draft_index[x] (0 outside the draft vocabulary, NaN for a column past the row).
// Load: how the backend reads global memory (a plain read on the CPU).
struct PlainLoad {
  template <typename T>
  VERISPEC_HD T operator()(const T* p) const { return *p; }
};
template <typename Load = PlainLoad>
VERISPEC_HD inline float compact_q(const float* row, const int32_t* index, int64_t width,
                                   int64_t x, const Load& load = Load{}) {
  if (index == nullptr) return load(row + x);
  const int32_t m = load(index + x);
  if (m < 0) return 0.0f;
  return m < width ? load(row + m) : __builtin_nanf("");
}

// The policy of one row, scalars and per-row arrays resolved.
struct RowPolicy {
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  VERISPEC_HD bool greedy() const { return temperature == 0.0f; }
};

VERISPEC_HD inline RowPolicy resolve_policy(const PolicyParams& p, int64_t row) {
  RowPolicy r;
  r.temperature = p.temperature_per_row ? p.temperature_per_row[row] : p.temperature;
  r.top_k = p.top_k_per_row ? p.top_k_per_row[row] : p.top_k;
  r.top_p = p.top_p_per_row ? p.top_p_per_row[row] : p.top_p;
  r.min_p = p.min_p_per_row ? p.min_p_per_row[row] : p.min_p;
  return r;
}

// The first out-of-range field of a row policy (as PolicyField), or -1.
VERISPEC_HD inline int32_t invalid_policy_field(const RowPolicy& r) {
  return first_invalid_policy_field(r.temperature, r.top_k, r.top_p, r.min_p);
}

VERISPEC_HD inline uint64_t resolve_seed(const RandomParams& r) {
  return r.seed_ptr ? static_cast<uint64_t>(*r.seed_ptr) : r.seed;
}
VERISPEC_HD inline uint64_t resolve_offset(const RandomParams& r) {
  return r.offset_ptr ? static_cast<uint64_t>(*r.offset_ptr) : r.offset;
}

// Whether a row's policy may filter (top-k, top-p or min-p). False only when every filter
// is a disabled scalar; the CUDA policy kernels then leave the filter code out.
inline bool policy_may_filter(const PolicyParams& p, int64_t vocab) {
  if (p.top_k_per_row || p.top_p_per_row || p.min_p_per_row) return true;
  return top_k_active(p.top_k, vocab) || top_p_active(p.top_p) || min_p_active(p.min_p);
}

// verify: a greedy row (temperature 0) is never filtered, so a scalar temperature 0 (every
// row greedy) needs no filter code.
inline bool verify_may_filter(const VerifyArgs& a) {
  const bool all_greedy = !a.policy.temperature_per_row && a.policy.temperature == 0.0f;
  return !all_greedy && policy_may_filter(a.policy, a.vocab);
}

// What a check of one logits row found: every value usable (kLogitsOk), the index of
// the first NaN / +Inf (>= 0), or no finite value at all (kLogitsAllMasked: all -Inf).
constexpr int64_t kLogitsOk = -1;
constexpr int64_t kLogitsAllMasked = -2;

// ---- device error record (layout in ops.h) -------------------------------------------

constexpr int64_t kErrorColMax = (int64_t{1} << 28) - 1;

VERISPEC_HD inline uint64_t pack_error(int64_t row, StatusCode code, int64_t col) {
  // A negative or too large col is stored saturated and reads back as -1 (unknown).
  const uint64_t c = (col < 0 || col > kErrorColMax) ? kErrorColMax : col;
  return (static_cast<uint64_t>(row) << 32) |
         (static_cast<uint64_t>(static_cast<uint32_t>(code) & 0xfu) << 28) | c;
}

// ---- status text ------------------------------------------------------------------

// What a value error means for `op` (static text), e.g. "draft_tokens out of range".
const char* status_what(OpKind op, StatusCode code, int64_t col);

// A status with code, row, col and the op's text; the value is filled by the caller.
OpStatus make_status(OpKind op, StatusCode code, int64_t row, int64_t col);

OpStatus invalid_argument(const char* what);

// Host-side checks of sizes and scalar policy shared by both backends.
OpStatus check_policy_scalars(const PolicyParams& p);
OpStatus check_apply_policy_args(const ApplyPolicyArgs& a);
OpStatus check_sample_args(const SampleArgs& a);
OpStatus check_verify_args(const VerifyArgs& a);
// ops.h "Compact q": draft_width >= 1 with draft_index (draft_probs given).
OpStatus check_compact_q(const float* draft_probs, const int32_t* draft_index,
                         int64_t draft_width);
OpStatus check_verify_tree_args(const VerifyTreeArgs& a);

}  // namespace kernels
}  // namespace verispec
