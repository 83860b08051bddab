// The policy of one row on the CPU, shared by apply_policy (policy.cpp) and verify
// (verify.cpp). No sorting. Every mass is a fixed-point sum (sampling_math.h), so each
// threshold and normaliser is the integer the CUDA kernels reduce to. A threshold search brackets the top-k / top-p threshold
// with whole-row count+mass passes (vectorised): geometric steps p_max * 2^-4, 2^-8,
// ..., then bisection on the float bits until at most kBracket values lie inside; the
// exact threshold is then selected among those few (std::nth_element for top-k, a
// mass-weighted quickselect for top-p).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.h"

namespace verispec {
namespace kernels {
namespace cpu {

// Calls fn(const T*) with the logits pointer cast to its element type.
template <typename Fn>
auto dispatch_dtype(LogitsDType dtype, const void* ptr, Fn&& fn) {
  switch (dtype) {
    case LogitsDType::kBFloat16: return fn(static_cast<const BFloat16*>(ptr));
    case LogitsDType::kFloat16: return fn(static_cast<const Float16*>(ptr));
    case LogitsDType::kFloat32: break;
  }
  return fn(static_cast<const float*>(ptr));
}

// ---- row loops (row_loops.cpp) ----------------------------------------------------------
// The passes over a whole row, compiled apart: vectorised, with AVX2 / AVX-512 clones
// picked at load time where the toolchain supports it, and without FMA contraction so
// every clone rounds alike.

// out[i] = float(x[i]).
void to_float_row(const float* x, int64_t n, float* out);
void to_float_row(const BFloat16* x, int64_t n, float* out);
void to_float_row(const Float16* x, int64_t n, float* out);

// Whether every v[0, n) is a valid logit (logit_valid: no NaN, no +Inf).
bool row_logits_valid(const float* v, int64_t n);

// Whether every v[0, n) is a valid logit, and whether any is finite.
struct RowCheck {
  bool valid;
  bool any_finite;
};
RowCheck check_row(const float* v, int64_t n);

// max of v[0, n), n >= 1.
float row_max(const float* v, int64_t n);

// The first i with v[i] == value, or n.
int64_t find_first(const float* v, int64_t n, float value);

// Calls fn(const float* v, int64_t len, int64_t start) on x[0, n) as float, in order: the
// row itself for float32, else chunks converted into a buffer on the stack. Stops early
// when fn returns false.
template <typename T, typename Fn>
void for_float_chunks(const T* x, int64_t n, Fn&& fn) {
  if constexpr (std::is_same_v<T, float>) {
    fn(x, n, int64_t{0});
  } else {
    constexpr int64_t kChunk = 2048;
    float buffer[kChunk];
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t len = std::min(kChunk, n - start);
      to_float_row(x + start, len, buffer);
      if (!fn(static_cast<const float*>(buffer), len, start)) return;
    }
  }
}

// Checks a logits row x[0, n): kLogitsOk, the first NaN / +Inf, or kLogitsAllMasked.
template <typename T>
int64_t check_logits_row(const T* x, int64_t n) {
  RowCheck all{true, false};
  for_float_chunks(x, n, [&all](const float* v, int64_t len, int64_t) {
    const RowCheck c = check_row(v, len);
    all.valid &= c.valid;
    all.any_finite |= c.any_finite;
    return all.valid;
  });
  if (!all.valid) {  // the first bad index
    for (int64_t i = 0; i < n; ++i) {
      if (!logit_valid(to_float(x[i]))) return i;
    }
  }
  return all.any_finite ? kLogitsOk : kLogitsAllMasked;
}

// argmax of x[0, n) (n >= 1, valid, one finite), ties to the lowest index: the first
// index of the maximum.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = 0.0f;
  int64_t arg = -1;
  for_float_chunks(x, n, [&](const float* v, int64_t len, int64_t start) {
    const float m = row_max(v, len);
    if (arg < 0 || m > best) {  // an equal maximum in a later chunk is not first
      best = m;
      arg = start + find_first(v, len, m);
    }
    return true;
  });
  return arg;
}

// How many of v[0, n) are >= a threshold, and their fixed-point mass (sampling_math.h
// fixed_weight: exact, so the same integer as any CUDA reduction).
struct Tally {
  int64_t count;
  uint64_t mass;
};
Tally tally_at_least(const float* v, int64_t n, float threshold);

// The fixed-point sum of v[0, n) (fixed_weight).
uint64_t fixed_sum(const float* v, int64_t n);

// Whether every w[0, n) is a probability (>= 0 and finite), and their maximum.
struct ProbCheck {
  float max;
  bool valid;
};
ProbCheck prob_check(const float* w, int64_t n);

// The fixed-point sum of weights w[0, n) scaled by 2^shift (fixed_scaled).
uint64_t fixed_sum_scaled(const float* w, int64_t n, int shift);

// The residual of verify: the fixed-point sum of max(p[i] - q[i], 0), and whether every
// q[i] is a probability (>= 0 and finite); mass is 0 if not.
struct ResidualMass {
  uint64_t mass;
  bool q_valid;
};
ResidualMass residual_mass(const float* p, const float* q, int64_t n);

// v[i] = softmax_weight(v[i], row_max, temperature).
void softmax_weights_inplace(float* v, int64_t n, float row_max, float temperature);

// The maximum of each tile of v[0, n) (n >= 1) into maxima[t] (sampling_math.h
// stats_tiles(n) of them); returns the row's maximum.
float tile_maxima(const float* v, int64_t n, float* maxima);

// The softmax normaliser Z of logits v[0, n) (all valid, maximum row_max, tile maxima from
// tile_maxima) in fixed point, by sampling_math.h's tiles (tile_norm_term): the device's
// one-pass value.
uint64_t tiled_softmax_norm(const float* v, int64_t n, float row_max, float temperature,
                            const float* maxima);

// v[i] = v[i] / norm.
void divide_row(float* v, int64_t n, float norm);

// v[i] = v[i] >= threshold ? v[i] / kept : 0.
void renormalise_row(float* v, int64_t n, float threshold, float kept);

// Copies the v[i] in [lo, hi) to out (in order); returns how many.
int64_t gather_range(const float* v, int64_t n, float lo, float hi, float* out);

// ---- selection ------------------------------------------------------------------------

// The largest value t of a[0, n) (n >= 1, values >= 0) with enough(mass{a_i >= t}) (masses
// in fixed point, `above` the mass of the values above a[0, n)): a quickselect that
// partitions by value (descending, three-way) and recurses into the side holding the
// threshold, carrying the mass of everything above. Reorders a. enough is monotone.
template <typename Enough>
inline float weighted_threshold(float* a, int64_t n, uint64_t above, const Enough& enough) {
  int64_t lo = 0, hi = n;
  float last_pivot = a[0];
  while (lo < hi) {
    float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];  // median of three
    if (x > y) std::swap(x, y);
    if (y > z) std::swap(y, z);
    if (x > y) std::swap(x, y);
    const float pivot = y;
    // Partition a[lo, hi) into [lo, gt) > pivot, [gt, lt) == pivot, [lt, hi) < pivot.
    int64_t gt = lo, i = lo, lt = hi;
    uint64_t mass_gt = 0, mass_eq = 0;
    while (i < lt) {
      const float v = a[i];
      if (v > pivot) {
        mass_gt += fixed_weight(v);
        std::swap(a[i++], a[gt++]);
      } else if (v < pivot) {
        std::swap(a[i], a[--lt]);
      } else {
        mass_eq += fixed_weight(v);
        ++i;
      }
    }
    if (enough(above + mass_gt)) {  // enough above the pivot: t is among [lo, gt)
      hi = gt;
    } else if (enough(above + mass_gt + mass_eq)) {
      return pivot;
    } else {
      above += mass_gt + mass_eq;
      last_pivot = pivot;
      lo = lt;
    }
  }
  // Not reached for a bracket that holds the threshold; keep everything.
  return last_pivot;
}

// A bracket [lo, hi) of float bit patterns around a threshold: enough(tally at lo),
// not enough(tally at hi), so the threshold lies in [lo, hi).
struct Bracket {
  uint32_t lo, hi;
  Tally at_lo, at_hi;
};

constexpr int64_t kBracket = 1024;  // values in the final bracket, at most (unless ties)

// Brackets the largest t >= floor with enough(tally_at_least(p, t)); enough(at_floor)
// must hold and p <= p_max.
template <typename Enough>
Bracket bracket_threshold(const float* p, int64_t n, float floor, const Tally& at_floor,
                          float p_max, const Enough& enough) {
  Bracket b{float_bits(floor), float_bits(p_max) + 1, at_floor, Tally{0, 0}};
  for (int shift = 4; shift <= 64; shift *= 2) {  // geometric steps down from p_max
    const float c = std::ldexp(p_max, -shift);
    if (c <= floor) break;
    const Tally t = tally_at_least(p, n, c);
    if (enough(t)) {
      b.lo = float_bits(c);
      b.at_lo = t;
      break;
    }
    b.hi = float_bits(c);
    b.at_hi = t;
  }
  while (b.hi - b.lo > 1 && b.at_lo.count - b.at_hi.count > kBracket) {  // bisection
    const uint32_t mid = b.lo + (b.hi - b.lo) / 2;
    const Tally t = tally_at_least(p, n, bits_float(mid));
    if (enough(t)) {
      b.lo = mid;
      b.at_lo = t;
    } else {
      b.hi = mid;
      b.at_hi = t;
    }
  }
  return b;
}

// Copies the p[i] inside the bracket to out; returns how many.
inline int64_t gather_bracket(const float* p, int64_t n, const Bracket& b, float* out) {
  return gather_range(p, n, bits_float(b.lo), bits_float(b.hi), out);
}

// Per-call scratch of the policy.
struct PolicyScratch {
  std::vector<float> values;
  std::vector<float> tile_max;  // sampling_math.h tiles
  explicit PolicyScratch(int64_t vocab)
      : values(static_cast<size_t>(vocab)), tile_max(static_cast<size_t>(stats_tiles(vocab))) {}
};

// The k-th largest of p[0, n) (0 < k < n; 0 <= p <= p_max).
inline float kth_largest(const float* p, int64_t n, int64_t k, float p_max, PolicyScratch& s) {
  const Bracket b = bracket_threshold(p, n, 0.0f, Tally{n, 0}, p_max,
                                      [k](const Tally& t) { return t.count >= k; });
  float* vals = s.values.data();
  const int64_t m = gather_bracket(p, n, b, vals);
  const int64_t rank = k - b.at_hi.count - 1;  // descending, inside the bracket
  std::nth_element(vals, vals + rank, vals + m, std::greater<float>());
  return vals[rank];
}

// top-p among the survivors p >= floor: the largest t >= floor with
// mass{p >= t} >= top_p * mass{p >= floor}.
inline float top_p_threshold(const float* p, int64_t n, float top_p, float floor, float p_max,
                             PolicyScratch& s) {
  const Tally at_floor = tally_at_least(p, n, floor);
  const uint64_t survivors = at_floor.mass;
  auto enough = [top_p, survivors](uint64_t mass) { return mass_at_least(mass, top_p, survivors); };
  const Bracket b = bracket_threshold(p, n, floor, at_floor, p_max,
                                      [&enough](const Tally& t) { return enough(t.mass); });
  float* vals = s.values.data();
  const int64_t m = gather_bracket(p, n, b, vals);  // >= 1: the bracket holds the threshold
  return weighted_threshold(vals, m, b.at_hi.mass, enough);
}

// ---- the policy of a row ------------------------------------------------------------

// out = policy(x) for one row of n >= 1 logits (ops.h apply_policy semantics).
// Returns check_logits_row's verdict; out is garbage unless kLogitsOk.
template <typename T>
int64_t policy_row(const T* x, int64_t n, const RowPolicy& pol, float* out, PolicyScratch& s) {
  to_float_row(x, n, out);
  if (!row_logits_valid(out, n)) return check_logits_row(x, n);
  const float m = tile_maxima(out, n, s.tile_max.data());
  if (!is_finite(m)) return kLogitsAllMasked;  // every logit -Inf
  if (pol.greedy()) {
    const int64_t arg = std::find(out, out + n, m) - out;  // the first maximum
    std::fill(out, out + n, 0.0f);
    out[arg] = 1.0f;
    return kLogitsOk;
  }
  const float norm =
      fixed_to_float(tiled_softmax_norm(out, n, m, pol.temperature, s.tile_max.data()));
  softmax_weights_inplace(out, n, m, pol.temperature);
  divide_row(out, n, norm);
  const float p_max = 1.0f / norm;  // the maximum has weight exp(0) = 1

  // Every filter keeps {p >= threshold}; combine them into one threshold.
  float threshold = 0.0f;
  if (top_k_active(pol.top_k, n)) threshold = kth_largest(out, n, pol.top_k, p_max, s);
  if (top_p_active(pol.top_p)) threshold = top_p_threshold(out, n, pol.top_p, threshold, p_max, s);
  if (min_p_active(pol.min_p)) {
    threshold = std::max(threshold, min_p_threshold(pol.min_p, p_max));
  }
  if (threshold > 0.0f) {
    renormalise_row(out, n, threshold, fixed_to_float(tally_at_least(out, n, threshold).mass));
  }
  return kLogitsOk;
}

// The value of a policy field, for error messages.
inline double policy_field_value(const RowPolicy& pol, int32_t field) {
  switch (static_cast<PolicyField>(field)) {
    case PolicyField::kTemperature: return pol.temperature;
    case PolicyField::kTopK: return pol.top_k;
    case PolicyField::kTopP: return pol.top_p;
    case PolicyField::kMinP: return pol.min_p;
  }
  return 0.0;
}

// Status of an out-of-range per-row policy, with its value.
inline OpStatus invalid_policy_status(OpKind op, int64_t row, const RowPolicy& pol,
                                      int32_t field) {
  OpStatus st = make_status(op, StatusCode::kInvalidPolicy, row, field);
  st.has_value = true;
  st.value = policy_field_value(pol, field);
  return st;
}

}  // namespace cpu
}  // namespace kernels
}  // namespace verispec
