// sample on the CPU: validate and sum a row (one vectorised pass, double lanes), then one
// inverse-CDF walk.
#include <algorithm>

#include "cpu_policy.h"

namespace verispec {

OpStatus sample_cpu(const SampleArgs& a) {
  using namespace kernels;
  OpStatus first = check_sample_args(a);
  if (!first.ok() || a.rows == 0) return first;
  const uint64_t seed = resolve_seed(a.rng);
  const uint64_t offset = resolve_offset(a.rng);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* w = a.probs + r * a.probs_row_stride;  // [vocab]
    const cpu::ProbSum sum = cpu::prob_sum(w, a.vocab);
    int64_t bad = -1;
    if (!sum.valid) {  // the first negative, NaN or Inf
      bad = std::find_if(w, w + a.vocab, [](float v) { return !(v >= 0.0f) || !is_finite(v); }) - w;
    }
    const double total = sum.total;
    if (bad >= 0 || total <= 0.0) {
      OpStatus s = make_status(OpKind::kSample, StatusCode::kInvalidProbs, r, bad);
      if (bad >= 0) {
        s.has_value = true;
        s.value = w[bad];
      }
      if (first.ok()) first = s;
      a.tokens[r] = -1;
      continue;
    }
    const float u = uniform(seed, offset, static_cast<uint32_t>(r), 0, Purpose::kSample);
    a.tokens[r] = static_cast<int32_t>(
        pick_inverse_cdf<double>([w](int64_t i) { return w[i]; }, a.vocab, u, total));
  }
  return first;
}

}  // namespace verispec
