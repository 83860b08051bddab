// sample on the CPU: validate a row and find its maximum (one vectorised pass), sum its
// fixed-point weights, then one exact inverse-CDF walk; or (keyed) one exponential race
// over the row.
#include <algorithm>

#include "cpu_policy.h"

namespace verispec {

namespace {

// The keyed sample of valid weights w (some positive): the exponential race of
// sampling_math.h over the keyed stream of (seed, position). The race starts from the
// heaviest token; a block of four tokens whose scores cannot reach the best so far even
// at the smallest exponential (race_min_exponential) draws no Philox block, which on a
// language model's distribution skips most of the vocabulary. Skipped tokens score
// strictly below the winner, so the result is the full race's.
int32_t keyed_pick(const float* w, int64_t vocab, uint64_t seed, uint64_t position) {
  const int64_t top = std::max_element(w, w + vocab) - w;  // the first maximum
  const float w_max = w[top];
  const float e_min = race_min_exponential();
  float best = race_score(1.0f, race_exponential(
      race_block(seed, position, static_cast<uint32_t>(top / 4)).v[top % 4]));
  int64_t best_i = top;
  for (int64_t base = 0; base < vocab; base += 4) {
    const int64_t end = std::min<int64_t>(base + 4, vocab);
    bool contender = false;
    for (int64_t i = base; i < end; ++i) {
      contender = contender || (w[i] > 0.0f && !(race_score(w[i] / w_max, e_min) < best));
    }
    if (!contender) continue;
    const Philox4x32 block = race_block(seed, position, static_cast<uint32_t>(base / 4));
    for (int64_t i = base; i < end; ++i) {
      if (!(w[i] > 0.0f)) continue;
      const float score = race_score(w[i] / w_max, race_exponential(block.v[i - base]));
      if (argmax_before(score, i, best, best_i)) {
        best = score;
        best_i = i;
      }
    }
  }
  return static_cast<int32_t>(best_i);
}

}  // namespace

OpStatus sample_cpu(const SampleArgs& a) {
  using namespace kernels;
  OpStatus first = check_sample_args(a);
  if (!first.ok() || a.rows == 0) return first;
  const uint64_t seed = resolve_seed(a.rng);
  const uint64_t offset = resolve_offset(a.rng);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* w = a.probs + r * a.probs_row_stride;  // [vocab]
    const cpu::ProbCheck check = cpu::prob_check(w, a.vocab);
    int64_t bad = -1;
    if (!check.valid) {  // the first negative, NaN or Inf
      bad = std::find_if(w, w + a.vocab, [](float v) { return !(v >= 0.0f) || !is_finite(v); }) - w;
    }
    if (bad >= 0 || !(check.max > 0.0f)) {
      OpStatus s = make_status(OpKind::kSample, StatusCode::kInvalidProbs, r, bad);
      if (bad >= 0) {
        s.has_value = true;
        s.value = w[bad];
      }
      if (first.ok()) first = s;
      a.tokens[r] = -1;
      continue;
    }
    if (a.row_seeds) {
      a.tokens[r] = keyed_pick(w, a.vocab, static_cast<uint64_t>(a.row_seeds[r]),
                               static_cast<uint64_t>(a.row_positions[r]));
      continue;
    }
    // The exact inverse CDF over the weights in fixed point, scaled by the power of two
    // of their maximum (sampling_math.h): the same integers as the CUDA block sums.
    const int shift = fixed_shift_for(check.max);
    const uint64_t total = cpu::fixed_sum_scaled(w, a.vocab, shift);
    const uint64_t draw = uniform64(seed, offset, static_cast<uint32_t>(r), 0, Purpose::kSample);
    a.tokens[r] = static_cast<int32_t>(pick_fixed(
        [w, shift](int64_t i) { return fixed_scaled(w[i], shift); }, a.vocab,
        draw_target(draw, total)));
  }
  return first;
}

}  // namespace verispec
