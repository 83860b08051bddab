// The whole-row passes of the CPU policy (declared in cpu_policy.h), kept in their own
// translation unit for two build-independent properties:
//   * speed: simple loops the compiler vectorises; on x86-64 Linux each also gets AVX2
//     and AVX-512 clones, chosen at load time (GCC/Clang target_clones), so a portable
//     wheel still runs wide vectors;
//   * identical results on every clone and machine: no FMA contraction here (the
//     baseline has no FMA; the clones must round the same way).
// No trapping math either: the fixed-point conversions (sampling_math.h fixed_weight)
// sit under selects (a clamp, a threshold), and a conversion that might trap would keep
// those loops scalar (10x slower than the float sums they replaced). Results are the
// same: it only lets the compiler ignore floating-point exception flags.
#if defined(__clang__)
#pragma clang fp contract(off)
#pragma clang fp exceptions(ignore)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#include <algorithm>

#include "cpu_policy.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(__SANITIZE_ADDRESS__)
#define VERISPEC_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VERISPEC_CPU_CLONES
#endif

namespace verispec {
namespace kernels {
namespace cpu {

namespace {
constexpr int64_t kLanes = 16;  // float lanes of the maximum: one AVX-512 register
}  // namespace

VERISPEC_CPU_CLONES void to_float_row(const float* x, int64_t n, float* out) {
  std::copy(x, x + n, out);
}

VERISPEC_CPU_CLONES void to_float_row(const BFloat16* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i].bits);
}

void to_float_row(const Float16* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_float(x[i].bits);
}

VERISPEC_CPU_CLONES bool row_logits_valid(const float* v, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !logit_valid(v[i]);
  return bad == 0;
}

VERISPEC_CPU_CLONES RowCheck check_row(const float* v, int64_t n) {
  uint32_t bad = 0, finite = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad |= !logit_valid(v[i]);
    finite |= is_finite(v[i]);
  }
  return RowCheck{bad == 0, finite != 0};
}

// Chunks of 16 without the value (all but one) cost one vectorised test.
VERISPEC_CPU_CLONES int64_t find_first(const float* v, int64_t n, float value) {
  constexpr int64_t kChunk = 16;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    const float* b = v + start;
    int any = 0;
    for (int64_t i = 0; i < len; ++i) any |= b[i] == value;
    if (!any) continue;
    for (int64_t i = 0; i < len; ++i) {
      if (b[i] == value) return start + i;
    }
  }
  return n;
}

VERISPEC_CPU_CLONES float row_max(const float* v, int64_t n) {
  float m[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) m[l] = v[0];  // n >= 1
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) m[l] = v[i + l] > m[l] ? v[i + l] : m[l];
  }
  for (int64_t i = body; i < n; ++i) m[0] = v[i] > m[0] ? v[i] : m[0];
  float r = m[0];
  for (int64_t l = 1; l < kLanes; ++l) r = m[l] > r ? m[l] : r;
  return r;
}

// The count and the mass in separate loops: each vectorises cleanly.
VERISPEC_CPU_CLONES Tally tally_at_least(const float* v, int64_t n, float threshold) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += v[i] >= threshold;
  uint64_t mass = 0;
  for (int64_t i = 0; i < n; ++i) mass += fixed_weight(v[i] >= threshold ? v[i] : 0.0f);
  return Tally{count, mass};
}

VERISPEC_CPU_CLONES uint64_t fixed_sum(const float* v, int64_t n) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += fixed_weight(v[i]);
  return sum;
}

namespace {
// Whether every c[0, n) is a probability (>= 0 and finite). Inlined into the clones below;
// a loop of its own, so that it and the sums each vectorise.
__attribute__((always_inline)) inline bool all_probabilities(const float* c, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(c[i] >= 0.0f) | !is_finite(c[i]);
  return bad == 0;
}
}  // namespace

VERISPEC_CPU_CLONES ProbCheck prob_check(const float* w, int64_t n) {
  if (!all_probabilities(w, n)) return ProbCheck{0.0f, false};
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = w[i] > m ? w[i] : m;
  return ProbCheck{m, true};
}

VERISPEC_CPU_CLONES uint64_t fixed_sum_scaled(const float* w, int64_t n, int shift) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += fixed_scaled(w[i], shift);
  return sum;
}

VERISPEC_CPU_CLONES ResidualMass residual_mass(const float* p, const float* q, int64_t n) {
  if (!all_probabilities(q, n)) return ResidualMass{0, false};
  uint64_t mass = 0;
  for (int64_t i = 0; i < n; ++i) mass += fixed_weight(residual_weight(p[i], q[i]));
  return ResidualMass{mass, true};
}

// Two loops, so that the clamp in softmax_exponent stays branch-free and both vectorise.
VERISPEC_CPU_CLONES void softmax_weights_inplace(float* v, int64_t n, float row_max,
                                                 float temperature) {
  for (int64_t i = 0; i < n; ++i) v[i] = softmax_exponent(v[i], row_max, temperature);
  for (int64_t i = 0; i < n; ++i) v[i] = exp_reduced(v[i]);
}

VERISPEC_CPU_CLONES float tile_maxima(const float* v, int64_t n, float* maxima) {
  float m = -INFINITY;
  for (int64_t start = 0; start < n; start += kStatsTile) {
    const float t = row_max(v + start, std::min<int64_t>(kStatsTile, n - start));
    maxima[start / kStatsTile] = t;
    m = t > m ? t : m;
  }
  return m;
}

// The tile loop of sampling_math.h's normaliser: each tile's weights against its maximum
// (the exponent and exp loops apart, so that the clamp stays branch-free and both
// vectorise), their fixed-point sum, and the tile's term of Z.
VERISPEC_CPU_CLONES uint64_t tiled_softmax_norm(const float* v, int64_t n, float v_max,
                                                float temperature, const float* maxima) {
  float e[kStatsTile];
  uint64_t z = 0;
  for (int64_t start = 0; start < n; start += kStatsTile) {
    const int64_t len = std::min<int64_t>(kStatsTile, n - start);
    const float* t = v + start;
    const float m = maxima[start / kStatsTile];
    for (int64_t i = 0; i < len; ++i) e[i] = softmax_exponent(t[i], m, temperature);
    for (int64_t i = 0; i < len; ++i) e[i] = exp_reduced(e[i]);
    z += tile_norm_term(fixed_sum(e, len), m, v_max, temperature);
  }
  return z;
}

VERISPEC_CPU_CLONES void divide_row(float* v, int64_t n, float norm) {
  for (int64_t i = 0; i < n; ++i) v[i] /= norm;
}

VERISPEC_CPU_CLONES void renormalise_row(float* v, int64_t n, float threshold, float kept) {
  for (int64_t i = 0; i < n; ++i) v[i] = (v[i] >= threshold ? v[i] : 0.0f) / kept;
}

// Chunks of 16 with no value in range (most of them) cost one vectorised test.
VERISPEC_CPU_CLONES int64_t gather_range(const float* v, int64_t n, float lo, float hi,
                                         float* out) {
  constexpr int64_t kChunk = 16;
  int64_t m = 0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    const float* b = v + start;
    int any = 0;
    for (int64_t i = 0; i < len; ++i) any |= (b[i] >= lo) & (b[i] < hi);
    if (!any) continue;
    for (int64_t i = 0; i < len; ++i) {
      out[m] = b[i];
      m += (b[i] >= lo) & (b[i] < hi);
    }
  }
  return m;
}

}  // namespace cpu
}  // namespace kernels
}  // namespace verispec
