// Native tests of the CPU sampling kernels, Philox and the shared sampling math.
// Plain C++ (no framework): prints each failure and exits non-zero if any.
//   g++ -std=c++17 -O1 -fsanitize=address,undefined -Icsrc/include
//       csrc/tests/test_kernels.cpp csrc/kernels/cpu/*.cpp && ./a.out
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../kernels/cpu/cpu_policy.h"
#include "native_check.h"
#include "verify_case.h"
#include "verispec/layers/decode_ops.h"
#include "verispec/layers/linear.h"
#include "verispec/layers/norm.h"
#include "verispec/ops.h"
#include "verispec/philox.h"
#include "verispec/policy_rules.h"
#include "verispec/sampling_math.h"

using namespace verispec;
using namespace verify_case;

namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- helpers ------------------------------------------------------------------------

std::vector<float> apply(const std::vector<float>& logits, int64_t rows, int64_t vocab,
                         PolicyParams pol, OpStatus* status = nullptr) {
  std::vector<float> probs(static_cast<size_t>(rows * vocab), -1.0f);
  ApplyPolicyArgs a;
  a.logits = logits.data();
  a.logits_row_stride = vocab;
  a.rows = rows;
  a.vocab = vocab;
  a.policy = pol;
  a.probs = probs.data();
  a.probs_row_stride = vocab;
  const OpStatus s = apply_policy_cpu(a);
  if (status) *status = s;
  else CHECK(s.ok());
  return probs;
}

std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

int count_nonzero(const std::vector<float>& v) {
  return static_cast<int>(std::count_if(v.begin(), v.end(), [](float x) { return x != 0.0f; }));
}

// Brute force: the policy by sorting (the reference semantics, in double).
std::vector<float> brute_policy(const std::vector<float>& p, int32_t top_k, float top_p,
                                float min_p) {
  const int64_t n = static_cast<int64_t>(p.size());
  std::vector<float> sorted = p;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  float thr = 0.0f;
  if (top_k > 0 && top_k < n) thr = sorted[top_k - 1];
  if (top_p < 1.0f) {
    double mass = 0.0;
    for (float v : sorted) if (v >= thr) mass += v;
    const double target = static_cast<double>(top_p) * mass;
    double cum = 0.0;
    float t = thr;
    for (int64_t i = 0; i < n && sorted[i] >= thr; ++i) {
      cum += sorted[i];
      t = sorted[i];
      // include the ties of sorted[i] before testing
      while (i + 1 < n && sorted[i + 1] == sorted[i]) cum += sorted[++i];
      if (cum >= target) break;
    }
    thr = std::max(thr, t);
  }
  if (min_p > 0.0f) thr = std::max(thr, min_p * sorted[0]);
  std::vector<float> out(p.size(), 0.0f);
  double kept = 0.0;
  for (float v : p) if (v >= thr) kept += v;
  for (size_t i = 0; i < p.size(); ++i) out[i] = p[i] >= thr ? p[i] / static_cast<float>(kept) : 0.0f;
  return out;
}


// ---- Philox & coins -------------------------------------------------------------------

void test_philox_known_answers() {
  // Random123 tests/kat_vectors, "philox4x32 10" lines: ctr[4] key[2] -> out[4].
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 out =
        philox4x32_10(Philox4x32{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}}, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) CHECK(out.v[i] == k.out[i]);
  }
}

void test_stream_layout() {
  const Philox4x32 c = philox_counter(0x0123456789abcdefull, 7, 9, Purpose::kCorrection);
  CHECK(c.v[0] == 9u);           // position
  CHECK(c.v[1] == 7u);           // row
  CHECK(c.v[2] == 0x89abcdefu);  // lo32(offset)
  CHECK(c.v[3] == (0x01234567u | (1u << 28)));
  // Coins: deterministic, in [0, 1), and every coordinate selects a different stream.
  const float u = uniform(42, 3, 1, 2, Purpose::kAccept);
  CHECK(u == uniform(42, 3, 1, 2, Purpose::kAccept));
  CHECK(u >= 0.0f && u < 1.0f);
  CHECK(u != uniform(43, 3, 1, 2, Purpose::kAccept));
  CHECK(u != uniform(42, 4, 1, 2, Purpose::kAccept));
  CHECK(u != uniform(42, 3, 2, 2, Purpose::kAccept));
  CHECK(u != uniform(42, 3, 1, 3, Purpose::kAccept));
  CHECK(u != uniform(42, 3, 1, 2, Purpose::kCorrection));
  CHECK(u != uniform(42, 3, 1, 2, Purpose::kSample));
  CHECK(u != uniform(42, 3, 1, 2, Purpose::kDraft));
  // The key uses all 64 seed bits.
  CHECK(uniform(1ull << 40, 0, 0, 0, Purpose::kSample) != uniform(0, 0, 0, 0, Purpose::kSample));
  // Purpose streams are not shifted copies of each other.
  int equal = 0;
  for (uint32_t j = 0; j < 1000; ++j) {
    equal += uniform(5, 0, 0, j, Purpose::kAccept) == uniform(5, 0, 0, j + 1, Purpose::kCorrection);
  }
  CHECK(equal < 5);
  // Moments of 200k coins: mean 1/2, variance 1/12.
  double sum = 0.0, sum2 = 0.0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = uniform(7, static_cast<uint64_t>(i), 0, 0, Purpose::kSample);
    sum += x;
    sum2 += x * x;
  }
  CHECK_NEAR(sum / n, 0.5, 0.004);
  CHECK_NEAR(sum2 / n - (sum / n) * (sum / n), 1.0 / 12.0, 0.002);
  CHECK(uniform24(0xffffffffu) < 1.0f);
  CHECK(uniform24(0) == 0.0f);
}

// ---- shared math ------------------------------------------------------------------------

void test_half_conversions() {
  CHECK(fp16_to_float(0x3c00) == 1.0f);
  CHECK(fp16_to_float(0xc000) == -2.0f);
  CHECK(fp16_to_float(0x7bff) == 65504.0f);
  CHECK(fp16_to_float(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(fp16_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(fp16_to_float(0x8000) == 0.0f && std::signbit(fp16_to_float(0x8000)));
  CHECK(fp16_to_float(0x7c00) == kInf);
  CHECK(fp16_to_float(0xfc00) == -kInf);
  CHECK(std::isnan(fp16_to_float(0x7e00)));
  CHECK(fp16_to_float(0x3555) == 0.333251953125f);
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(bf16_to_float(0xc040) == -3.0f);
  CHECK(bf16_to_float(0x7f80) == kInf);
  CHECK(std::isnan(bf16_to_float(0x7fc0)));
  CHECK(is_finite(1.0f) && !is_finite(kInf) && !is_finite(-kInf) && !is_finite(kNan));
}

void test_exp_nonpositive() {
  // Against double exp on a sweep of [-104, 0] (the full sweep of every float is
  // ~1 ulp; too slow for a sanitizer build).
  double worst = 0.0;
  for (int i = 0; i <= 400000; ++i) {
    const float x = -104.0f * static_cast<float>(i) / 400000.0f;
    const double want = std::exp(static_cast<double>(x));
    const float wf = static_cast<float>(want);
    const double ulp = static_cast<double>(std::nextafter(wf, 1.0f)) - wf;
    worst = std::max(worst, std::fabs(exp_nonpositive(x) - want) / ulp);
  }
  CHECK(worst <= 1.0);
  CHECK(exp_nonpositive(0.0f) == 1.0f);
  CHECK(exp_nonpositive(-1e-30f) == 1.0f);
  CHECK(exp_nonpositive(-200.0f) == 0.0f);
  CHECK(exp_nonpositive(-kInf) == 0.0f);
  CHECK(exp_nonpositive(-100.0f) > 0.0f);  // subnormal results are kept
}

void test_acceptance_math() {
  CHECK(accept_draft(0.0f, 0.1f, 0.5f));
  CHECK(!accept_draft(0.5f, 0.2f, 0.5f));  // 0.25 < 0.2 is false
  CHECK(accept_draft(0.999f, 0.3f, 0.3f)); // p == q always accepts
  CHECK(!accept_draft(0.0f, 0.0f, 0.0f));  // a zero-probability proposal never passes
  CHECK(accept_draft(0.7f, 0.8f, 1.0f));   // one-hot: accept iff u < p(y)
  CHECK(residual_weight(0.3f, 0.1f) == 0.3f - 0.1f);
  CHECK(residual_weight(0.1f, 0.3f) == 0.0f);
  CHECK(!residual_usable(5e-7f) && residual_usable(2e-6f));
  // The exact inverse CDF: weights 0, 1, 0, 2, 1, 0 (units); the target is floor(c * 4 / 2^64).
  const uint64_t w[] = {0, 1, 0, 2, 1, 0};
  auto fw = [&](int64_t i) { return w[i]; };
  CHECK(draw_target(0, 4) == 0 && pick_fixed(fw, 6, draw_target(0, 4)) == 1);
  CHECK(draw_target(~uint64_t{0}, 4) == 3 && pick_fixed(fw, 6, 3) == 4);
  CHECK(draw_target(uint64_t{1} << 62, 4) == 1 && pick_fixed(fw, 6, 1) == 3);  // c / 2^64 = 1/4
  CHECK(draw_target((uint64_t{1} << 62) - 1, 4) == 0);                          // just below: token 1
  CHECK(pick_fixed(fw, 6, 2) == 3 && pick_fixed(fw, 6, 4) == -1);  // target >= total: none
  // Fixed-point weights are exact: floor(w * 2^40), and back to float rounds once.
  CHECK(fixed_weight(1.0f) == uint64_t{1} << 40 && fixed_weight(0.0f) == 0);
  CHECK(fixed_weight(0.75f) == uint64_t{3} << 38);
  CHECK(fixed_weight(std::ldexp(1.0f, -41)) == 0 && fixed_weight(std::ldexp(3.0f, -40)) == 3);
  CHECK(fixed_weight(100.0f) == uint64_t{8} << 40);  // saturates: sums of 2^20 stay below 2^63
  CHECK(fixed_to_float(uint64_t{1} << 40) == 1.0f && fixed_to_float(uint64_t{3} << 38) == 0.75f);
  // Scaled weights (sample): the row maximum's power of two maps every weight below 2.
  CHECK(fixed_shift_for(1.0f) == 0 && fixed_shift_for(1.5f) == 0 && fixed_shift_for(2.0f) == -1);
  for (float m : {1e30f, 3e38f, 1e-30f, 1e-40f, 1.4e-45f, 0.75f}) {  // normal and subnormal maxima
    const double scaled = std::ldexp(static_cast<double>(m), fixed_shift_for(m));
    CHECK(scaled >= 1.0 && scaled < 2.0);
    CHECK(fixed_scaled(m, fixed_shift_for(m)) ==
          static_cast<uint64_t>(std::floor(std::ldexp(scaled, kFixedBits))));
  }
  CHECK(fixed_scaled(3.0f, -1) == uint64_t{3} << 39);
  // fixed_weight and fixed_scaled are floor(w 2^40) and floor(w 2^(40 + shift)) exactly: the
  // host's two 32-bit conversions against double arithmetic, over every exponent.
  {
    std::mt19937 bits(77);
    for (int trial = 0; trial < 2000000; ++trial) {
      const float w = bits_float(bits() & 0x7fffffffu);
      if (!is_finite(w)) continue;
      const double c = std::min(static_cast<double>(w), 8.0);
      const uint64_t want = static_cast<uint64_t>(std::floor(std::ldexp(c, kFixedBits)));
      if (fixed_weight(w) != want) {
        CHECK(fixed_weight(w) == want);
        break;
      }
      const int shift = static_cast<int>(bits() % 277) - 127;  // any shift the rows can need
      const double ws = std::ldexp(static_cast<double>(w), shift);
      if (ws >= 2.0) continue;
      const uint64_t want_scaled = static_cast<uint64_t>(std::floor(std::ldexp(ws, kFixedBits)));
      if (fixed_scaled(w, shift) != want_scaled) {
        CHECK(fixed_scaled(w, shift) == want_scaled);
        break;
      }
    }
  }
  // top-p's test on masses: both sides exact in double, one rounding in the product.
  CHECK(mass_at_least(90, 0.9f, 100) == (90.0 >= static_cast<double>(0.9f) * 100.0));
  CHECK(mass_at_least(91, 0.9f, 100) && !mass_at_least(89, 0.9f, 100));
}

// log_reduced: about 1 ulp of log, and monotone on the keyed stream's 2^23 values of u (the
// bound race_min_exponential that keyed sampling skips by rests on it).
void test_log_reduced() {
  double worst = 0.0;
  float previous = -INFINITY;
  bool monotone = true;
  for (uint32_t k = 0; k < (1u << 23); ++k) {
    const float u = (static_cast<float>(k) + 0.5f) * (1.0f / 8388608.0f);
    const float got = log_reduced(u);
    monotone &= got >= previous;
    previous = got;
    const double want = std::log(static_cast<double>(u));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::fabs(got - want) / ulp);
  }
  CHECK(monotone);
  CHECK(worst <= 2.0);
  for (float x : {1e-40f, 1e-30f, 0.1f, 1.0f, 2.0f, 123.0f, 3e38f}) {
    CHECK(std::fabs(log_reduced(x) - std::log(static_cast<double>(x))) <=
          2e-7 * std::max(1.0, std::fabs(std::log(static_cast<double>(x)))));
  }
  CHECK(race_min_exponential() > 0.0f);
  CHECK(race_exponential(0xffffffffu) == race_min_exponential());
  CHECK(race_exponential(0u) > 16.0f && race_exponential(0u) < 17.0f);
}

void test_weighted_threshold_against_sort() {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 60);
    std::vector<float> a(static_cast<size_t>(n));
    const int distinct = 1 + static_cast<int>(rng() % 8);  // many ties on purpose
    for (auto& x : a) x = static_cast<float>(1 + rng() % distinct) / 8.0f;
    std::vector<float> sorted = a;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    uint64_t total = 0;
    for (float v : a) total += fixed_weight(v);
    const float fraction = static_cast<float>(rng() % 1001) / 1000.0f;
    auto enough = [&](uint64_t mass) { return mass_at_least(mass, fraction, total); };
    // Brute force: largest value t with enough(mass{>= t}), masses in fixed point.
    float expected = sorted.back();
    for (float t : sorted) {
      uint64_t m = 0;
      for (float v : a) if (v >= t) m += fixed_weight(v);
      if (enough(m)) {
        expected = t;
        break;
      }
    }
    std::vector<float> work = a;
    CHECK(kernels::cpu::weighted_threshold(work.data(), n, 0, enough) == expected);
  }
}

// ---- the row checks of verify (vectorised) against their scalar definitions -----------

template <typename T>
int64_t naive_check_row(const T* x, int64_t n) {
  bool any_finite = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    if (!logit_valid(v)) return i;
    any_finite |= is_finite(v);
  }
  return any_finite ? kernels::kLogitsOk : kernels::kLogitsAllMasked;
}

template <typename T>
int64_t naive_argmax(const T* x, int64_t n) {
  float best = to_float(x[0]);
  int64_t arg = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (to_float(x[i]) > best) {
      best = to_float(x[i]);
      arg = i;
    }
  }
  return arg;
}

template <typename T>
void check_rows_of(std::vector<T> (*make)(const std::vector<float>&), const char* name) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int argmax_checked = 0;
  for (int64_t n : {1, 2, 15, 16, 17, 2047, 2048, 2049, 5000}) {
    for (int kind = 0; kind < 8; ++kind) {
      std::vector<float> f(static_cast<size_t>(n));
      for (auto& v : f) v = normal(rng);
      const size_t at = rng() % static_cast<size_t>(n), at2 = rng() % static_cast<size_t>(n);
      switch (kind) {
        case 1: for (auto& v : f) v = static_cast<float>(rng() % 3); break;  // ties of the max
        case 2: f[at] = kNan; break;
        case 3: f[at] = kInf; f[at2] = kNan; break;
        case 4: std::fill(f.begin(), f.end(), -kInf); break;  // all masked
        case 5: for (auto& v : f) v = rng() % 2 ? -kInf : v; f[at] = -kInf; break;
        case 6: for (auto& v : f) v = rng() % 2 ? 0.0f : -0.0f; break;  // signed zeros
        case 7: std::fill(f.begin(), f.end(), -kInf); f[at] = 1.0f; f[at2] = 1.0f; break;
        default: break;
      }
      const std::vector<T> x = make(f);
      const int64_t want = naive_check_row(x.data(), n);
      const int64_t got = kernels::cpu::check_logits_row(x.data(), n);
      if (got != want) std::fprintf(stderr, "%s n=%lld kind=%d\n", name, (long long)n, kind);
      CHECK(got == want);
      if (want == kernels::kLogitsOk) {
        CHECK(kernels::cpu::argmax_row(x.data(), n) == naive_argmax(x.data(), n));
        ++argmax_checked;
      }
    }
  }
  CHECK(argmax_checked > 30);
}

std::vector<float> as_float32(const std::vector<float>& f) { return f; }
std::vector<BFloat16> as_bfloat16(const std::vector<float>& f) {
  std::vector<BFloat16> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) out[i].bits = static_cast<uint16_t>(float_bits(f[i]) >> 16);
  return out;
}
std::vector<Float16> as_float16(const std::vector<float>& f) {  // some values overflow to Inf
  std::vector<Float16> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    const float v = f[i];
    uint16_t h;
    if (std::isnan(v)) h = 0x7e00;
    else if (std::isinf(v)) h = v > 0 ? 0x7c00 : 0xfc00;
    else if (v == 0.0f) h = std::signbit(v) ? 0x8000 : 0;
    else {  // nearest-below representable half of a normal value in range
      const float a = std::min(std::fabs(v), 65504.0f);
      int e;
      const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
      e = std::max(e, -13);
      const auto mant = static_cast<uint16_t>(std::ldexp(m, 11) - 1024.0f);  // 10 bits
      h = static_cast<uint16_t>(((e + 14) << 10) | (mant & 0x3ff));
      if (v < 0) h |= 0x8000;
    }
    out[i].bits = h;
  }
  return out;
}

void test_row_checks_and_argmax() {
  check_rows_of<float>(as_float32, "float32");
  check_rows_of<BFloat16>(as_bfloat16, "bfloat16");
  check_rows_of<Float16>(as_float16, "float16");
}

void test_row_sums() {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t n : {0, 1, 7, 8, 9, 1000, 49157}) {
    std::vector<float> p(static_cast<size_t>(n)), q(static_cast<size_t>(n));
    for (auto& v : p) v = unit(rng) / static_cast<float>(n);
    for (auto& v : q) v = unit(rng) / static_cast<float>(n);
    uint64_t sum = 0, residual = 0;
    float max = 0.0f;
    for (int64_t i = 0; i < n; ++i) {  // the sums any order gives: integers
      sum += fixed_weight(p[i]);
      residual += fixed_weight(residual_weight(p[i], q[i]));
      max = std::max(max, p[i]);
    }
    CHECK(kernels::cpu::fixed_sum(p.data(), n) == sum);
    const kernels::cpu::ProbCheck pc = kernels::cpu::prob_check(p.data(), n);
    CHECK(pc.valid && pc.max == max);
    const int shift = fixed_shift_for(max);
    uint64_t scaled = 0;
    for (float v : p) scaled += fixed_scaled(v, shift);
    CHECK(kernels::cpu::fixed_sum_scaled(p.data(), n, shift) == scaled);
    const kernels::cpu::ResidualMass r = kernels::cpu::residual_mass(p.data(), q.data(), n);
    CHECK(r.q_valid && r.mass == residual);
    const kernels::cpu::Tally t = kernels::cpu::tally_at_least(p.data(), n, 0.5f / static_cast<float>(n));
    int64_t count = 0;
    uint64_t mass = 0;
    for (float v : p) {
      count += v >= 0.5f / static_cast<float>(n);
      mass += v >= 0.5f / static_cast<float>(n) ? fixed_weight(v) : 0;
    }
    CHECK(t.count == count && t.mass == mass);
    if (n == 0) continue;
    for (float bad : {-1e-9f, kNan, kInf}) {  // any q that is not a probability
      std::vector<float> qb = q;
      qb[static_cast<size_t>(rng() % static_cast<uint32_t>(n))] = bad;
      CHECK(!kernels::cpu::residual_mass(p.data(), qb.data(), n).q_valid);
      CHECK(!kernels::cpu::prob_check(qb.data(), n).valid);
    }
  }
}

// The softmax normaliser in tiles (sampling_math.h): fixed_rescale is the exact floor of a
// 128-bit product; a tile at the row's maximum adds its sum unchanged; the CPU loop is the
// rule written out tile by tile; and Z is the softmax sum to within its rounding.
void test_tiled_softmax_norm() {
  CHECK(fixed_rescale(0, uint64_t{1} << 40) == 0);
  CHECK(fixed_rescale(12345, uint64_t{1} << 40) == 12345);  // F = 1: the sum itself
  CHECK(fixed_rescale(uint64_t{3} << 40, uint64_t{1} << 39) == uint64_t{3} << 39);
  const uint64_t big = (uint64_t{1} << 51) - 1;  // the largest tile sum, the largest scale
  CHECK(fixed_rescale(big, uint64_t{1} << 40) == big);
  CHECK(fixed_rescale(big, (uint64_t{1} << 40) - 1) == big - 2048);  // floor(big - 2047.99...)
  CHECK(fixed_rescale(7, 3) == 0 && fixed_rescale(uint64_t{1} << 41, 3) == 6);
  CHECK(tile_norm_term(999, 2.5f, 2.5f, 0.7f) == 999);
  CHECK(tile_norm_term(999, -kInf, 2.5f, 1.0f) == 0);  // a tile of masked logits only
  CHECK(stats_tiles(1) == 1 && stats_tiles(1024) == 1 && stats_tiles(1025) == 2);

  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int64_t n : {1, 1023, 1024, 1025, 5000, 128256}) {
    for (float temperature : {1.0f, 0.3f, 2.0f}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (auto& v : x) v = normal(rng);
      if (n > 3000) std::fill(x.begin() + 1024, x.begin() + 2048, -kInf);  // a masked tile
      if (n > 3000) x[static_cast<size_t>(n - 1)] = 30.0f;  // the maximum in the last tile
      const float m = *std::max_element(x.begin(), x.end());
      uint64_t want = 0;
      double exact = 0.0;
      for (int64_t start = 0; start < n; start += kStatsTile) {  // the rule, tile by tile
        const int64_t end = std::min<int64_t>(start + kStatsTile, n);
        float tile_max = -kInf;
        for (int64_t i = start; i < end; ++i) tile_max = std::max(tile_max, x[static_cast<size_t>(i)]);
        uint64_t sum = 0;
        for (int64_t i = start; i < end; ++i) {
          sum += fixed_weight(softmax_weight(x[static_cast<size_t>(i)], tile_max, temperature));
          exact += std::exp((static_cast<double>(x[static_cast<size_t>(i)]) - m) / temperature);
        }
        want += tile_norm_term(sum, tile_max, m, temperature);
      }
      std::vector<float> maxima(static_cast<size_t>(stats_tiles(n)), 0.0f);
      CHECK(kernels::cpu::tile_maxima(x.data(), n, maxima.data()) == m);
      const uint64_t got = kernels::cpu::tiled_softmax_norm(x.data(), n, m, temperature, maxima.data());
      CHECK(got == want);
      // Each weight is off by about an ulp (2^-24 relative) and each tile term by a unit of
      // 2^-40 at most per value: relative error well below 1e-6.
      CHECK(std::fabs(static_cast<double>(got) * std::ldexp(1.0, -kFixedBits) - exact) <= 1e-6 * exact);
    }
  }
}

// ---- apply_policy ---------------------------------------------------------------------

void test_policy_hand_cases() {
  PolicyParams pol;
  // Temperature 0: one-hot at the argmax, ties to the lowest index.
  pol.temperature = 0.0f;
  auto p = apply({1.0f, 3.0f, 3.0f, 0.0f}, 1, 4, pol);
  CHECK(p[0] == 0.0f && p[1] == 1.0f && p[2] == 0.0f && p[3] == 0.0f);

  // Plain softmax.
  pol = PolicyParams{};
  p = apply(logits_of({0.5, 0.3, 0.15, 0.05}), 1, 4, pol);
  CHECK_NEAR(p[0], 0.5, 1e-6);
  CHECK_NEAR(p[3], 0.05, 1e-6);
  // Temperature 2 flattens: p ~ sqrt(p0).
  pol.temperature = 2.0f;
  p = apply(logits_of({0.64, 0.36}), 1, 2, pol);
  CHECK_NEAR(p[0], 0.8 / 1.4, 1e-6);
  // A tiny temperature does not overflow.
  pol.temperature = 1e-30f;
  p = apply({1.0f, 2.0f, 1.5f}, 1, 3, pol);
  CHECK(p[1] == 1.0f && p[0] == 0.0f && p[2] == 0.0f);

  const auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  // top-k.
  pol = PolicyParams{};
  pol.top_k = 2;
  p = apply(l, 1, 4, pol);
  CHECK_NEAR(p[0], 0.625, 1e-6);
  CHECK_NEAR(p[1], 0.375, 1e-6);
  CHECK(p[2] == 0.0f && p[3] == 0.0f);
  pol.top_k = 4;  // >= vocab: disabled
  CHECK(count_nonzero(apply(l, 1, 4, pol)) == 4);
  // top-k keeps ties at the threshold.
  pol.top_k = 1;
  p = apply({1.0f, 2.0f, 2.0f, 0.0f}, 1, 4, pol);
  CHECK(p[0] == 0.0f && p[3] == 0.0f);
  CHECK_NEAR(p[1], 0.5, 1e-6);
  CHECK_NEAR(p[2], 0.5, 1e-6);

  // top-p.
  pol = PolicyParams{};
  pol.top_p = 0.75f;
  p = apply(l, 1, 4, pol);
  CHECK(count_nonzero(p) == 2);
  CHECK_NEAR(p[0], 0.625, 1e-6);
  pol.top_p = 0.85f;
  CHECK(count_nonzero(apply(l, 1, 4, pol)) == 3);
  pol.top_p = 0.49f;
  p = apply(l, 1, 4, pol);
  CHECK(count_nonzero(p) == 1 && p[0] == 1.0f);
  pol.top_p = 1e-9f;  // smallest useful: the argmax alone
  CHECK(count_nonzero(apply(l, 1, 4, pol)) == 1);
  // top-p keeps ties.
  pol.top_p = 0.3f;
  p = apply({0.0f, 1.0f, 1.0f, 1.0f, -5.0f}, 1, 5, pol);
  CHECK(count_nonzero(p) == 3);

  // top-k then top-p on the survivors: survivors {.5, .3, .15} (mass .95), target .76.
  pol = PolicyParams{};
  pol.top_k = 3;
  pol.top_p = 0.8f;
  p = apply(l, 1, 4, pol);
  CHECK(count_nonzero(p) == 2);
  pol.top_p = 0.9f;  // target .855 > .8: three survive
  CHECK(count_nonzero(apply(l, 1, 4, pol)) == 3);

  // min-p: keep p >= 0.5 * 0.5.
  pol = PolicyParams{};
  pol.min_p = 0.5f;
  p = apply(l, 1, 4, pol);
  CHECK(count_nonzero(p) == 2);
  CHECK_NEAR(p[0] + p[1], 1.0, 1e-6);
  pol.min_p = 1.0f;  // only the max (and its ties)
  CHECK(count_nonzero(apply(l, 1, 4, pol)) == 1);
}

void test_policy_against_brute_force() {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % (trial % 10 == 0 ? 5000 : 300));
    auto logits = random_logits(rng, static_cast<size_t>(vocab), 3.0f);
    if (trial % 3 == 0) {  // coarse logits: many exact ties
      for (auto& x : logits) x = std::round(x);
    }
    PolicyParams pol;
    pol.temperature = 0.5f + static_cast<float>(rng() % 4) * 0.5f;
    pol.top_k = (rng() % 2) ? static_cast<int32_t>(rng() % (vocab + 2)) : 0;
    pol.top_p = (rng() % 2) ? 0.05f + static_cast<float>(rng() % 95) / 100.0f : 1.0f;
    pol.min_p = (rng() % 3 == 0) ? static_cast<float>(rng() % 50) / 100.0f : 0.0f;
    PolicyParams plain;
    plain.temperature = pol.temperature;
    const auto softmax = apply(logits, 1, vocab, plain);
    const auto got = apply(logits, 1, vocab, pol);
    const auto want = brute_policy(softmax, pol.top_k, pol.top_p, pol.min_p);
    double sum = 0.0;
    bool same_support = true, close = true;
    for (int64_t i = 0; i < vocab; ++i) {
      same_support &= (got[i] > 0.0f) == (want[i] > 0.0f);
      close &= std::fabs(got[i] - want[i]) <= 1e-6f;
      sum += got[i];
    }
    CHECK(same_support);
    CHECK(close);
    CHECK_NEAR(sum, 1.0, 1e-5);
  }
}

void test_policy_dtypes_strides_and_rows() {
  // bf16 / fp16 logits equal float logits of the same values.
  const uint16_t bf[] = {0x3f80, 0x4000, 0xbf80, 0x4040};  // 1, 2, -1, 3
  const uint16_t hf[] = {0x3c00, 0x4000, 0xbc00, 0x4200};  // 1, 2, -1, 3
  const float f[] = {1.0f, 2.0f, -1.0f, 3.0f};
  std::vector<float> out_f(4), out_b(4), out_h(4);
  ApplyPolicyArgs a;
  a.rows = 1;
  a.vocab = 4;
  a.logits_row_stride = 4;
  a.probs_row_stride = 4;
  a.policy.top_k = 3;
  a.logits = f;
  a.probs = out_f.data();
  CHECK(apply_policy_cpu(a).ok());
  a.logits = bf;
  a.logits_dtype = LogitsDType::kBFloat16;
  a.probs = out_b.data();
  CHECK(apply_policy_cpu(a).ok());
  a.logits = hf;
  a.logits_dtype = LogitsDType::kFloat16;
  a.probs = out_h.data();
  CHECK(apply_policy_cpu(a).ok());
  CHECK(out_f == out_b && out_f == out_h);
  CHECK(out_f[2] == 0.0f);

  // Row strides and per-row policies.
  std::vector<float> logits = {0.0f, 1.0f, 2.0f, 99.0f,  // row 0 (+1 padding)
                               2.0f, 1.0f, 0.0f, 99.0f};
  std::vector<float> probs(10, -1.0f);
  const float temps[] = {0.0f, 1.0f};
  const int32_t ks[] = {0, 1};
  ApplyPolicyArgs b;
  b.logits = logits.data();
  b.logits_row_stride = 4;
  b.rows = 2;
  b.vocab = 3;
  b.policy.temperature_per_row = temps;
  b.policy.top_k_per_row = ks;
  b.probs = probs.data();
  b.probs_row_stride = 5;
  CHECK(apply_policy_cpu(b).ok());
  CHECK(probs[0] == 0.0f && probs[1] == 0.0f && probs[2] == 1.0f);  // greedy row
  CHECK(probs[3] == -1.0f && probs[4] == -1.0f);                     // gap untouched
  CHECK(probs[5] == 1.0f && probs[6] == 0.0f && probs[7] == 0.0f);  // top-1 row
}

void test_policy_errors() {
  PolicyParams pol;
  OpStatus s;
  // NaN in row 1 col 2 (and +Inf in row 2): the lowest row is reported, good rows computed.
  std::vector<float> logits = {0.0f, 1.0f, 2.0f, 0.0f, 1.0f, kNan, 0.0f, kInf, 1.0f};
  auto p = apply(logits, 3, 3, pol, &s);
  CHECK(s.code == StatusCode::kNanOrInfLogits);
  CHECK(s.row == 1 && s.col == 2 && s.has_value && std::isnan(s.value));
  CHECK(std::strstr(s.what, "NaN") != nullptr);
  CHECK(p[3] == 0.0f && p[4] == 0.0f && p[5] == 0.0f);
  CHECK(p[6] == 0.0f && p[7] == 0.0f && p[8] == 0.0f);
  CHECK_NEAR(p[0] + p[1] + p[2], 1.0, 1e-6);
  // +Inf alone.
  apply({0.0f, kInf}, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kNanOrInfLogits && s.row == 0 && s.col == 1 && s.value == kInf);
  // -Inf is a mask; a row of only -Inf is an error (col -1).
  p = apply({-kInf, 0.0f, -kInf, -kInf, -kInf, -kInf}, 2, 3, pol, &s);
  CHECK(s.code == StatusCode::kNanOrInfLogits && s.row == 1 && s.col == -1 && !s.has_value);
  CHECK(std::strstr(s.what, "-Inf") != nullptr);
  CHECK(p[0] == 0.0f && p[2] == 0.0f && p[1] == 1.0f);
  for (float t : {0.0f, 0.5f, 1e-30f}) {
    PolicyParams masked;
    masked.temperature = t;
    masked.top_p = 0.5f;
    p = apply({-kInf, 2.0f, 3.0f, -kInf}, 1, 4, masked, &s);
    CHECK(s.ok() && p[0] == 0.0f && p[3] == 0.0f && p[2] == 1.0f);
  }

  // Scalar policy out of range: kInvalidArgument naming the parameter.
  const std::vector<float> ok_logits = {0.0f, 1.0f};
  pol.temperature = -1.0f;
  apply(ok_logits, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidArgument && std::strstr(s.what, "temperature"));
  CHECK(s.has_value && s.value == -1.0);
  CHECK(std::string(s.what) == policy_rule(PolicyField::kTemperature));
  pol = PolicyParams{};
  pol.top_p = 0.0f;
  apply(ok_logits, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidArgument && std::strstr(s.what, "top_p"));
  pol = PolicyParams{};
  pol.top_p = kNan;
  apply(ok_logits, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidArgument && std::strstr(s.what, "top_p"));
  pol = PolicyParams{};
  pol.min_p = 1.5f;
  apply(ok_logits, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidArgument && std::strstr(s.what, "min_p"));
  pol = PolicyParams{};
  pol.top_k = -2;
  apply(ok_logits, 1, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidArgument && std::strstr(s.what, "top_k"));

  // Per-row value out of range: kInvalidPolicy with row, field and value.
  const float temps[] = {1.0f, kInf};
  pol = PolicyParams{};
  pol.temperature_per_row = temps;
  apply({0.0f, 1.0f, 0.0f, 1.0f}, 2, 2, pol, &s);
  CHECK(s.code == StatusCode::kInvalidPolicy && s.row == 1 &&
        s.col == static_cast<int64_t>(PolicyField::kTemperature) && s.value == kInf);
  CHECK(std::strstr(s.what, "temperature") != nullptr);

  // Sizes.
  ApplyPolicyArgs a;
  a.rows = 1;
  a.vocab = 0;
  CHECK(apply_policy_cpu(a).code == StatusCode::kInvalidArgument);
  a.rows = 0;  // empty: nothing to do
  CHECK(apply_policy_cpu(a).ok());
}

// ---- sample -------------------------------------------------------------------------------

// policy_rules.h: the composition of its messages and the number format (the text of the
// rules is checked from Python, tests/test_policy_rules.py).
void test_policy_rules() {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(policy_error(1.0, 0, 1.0, 0.0).empty());
  CHECK(policy_error(0.0, 0, 1e-45, 1.0).empty());
  CHECK(policy_error(inf, 0, 1.0, 0.0) == policy_violation(PolicyField::kTemperature, "inf"));
  CHECK(policy_error(1.0, -3, 2.0, 0.0) == policy_violation(PolicyField::kTopK, "-3"));
  CHECK(policy_error(1.0, std::numeric_limits<int64_t>::min(), 1.0, 0.0) ==
        policy_violation(PolicyField::kTopK, "-9223372036854775808"));
  CHECK(policy_error(1.0, std::numeric_limits<int64_t>::max(), 1.0, 0.0).empty());  // past int32: off, like >= vocab
  CHECK(policy_error(1.0, 0, 1e-46, 0.0) ==
        policy_violation(PolicyField::kTopP, "1e-46 (0 as float32)"));
  CHECK(policy_error(-1e39, 0, 1.0, 0.0) ==
        policy_violation(PolicyField::kTemperature, "-1e+39 (-inf as float32)"));
  CHECK(policy_error(1.0, 0, 1.0, nan) == policy_violation(PolicyField::kMinP, "nan"));
  CHECK(policy_error_field(nan, -1, nan, nan) == static_cast<int32_t>(PolicyField::kTemperature));
  CHECK(policy_error_field(1.0, 0, 1.0 + 1e-9, -1e-46) == -1);  // float32: 1 and -0

  // One argument alone reads as policy_error with the others at their defaults.
  const PolicyField fields[] = {PolicyField::kTemperature, PolicyField::kTopK,
                                PolicyField::kTopP, PolicyField::kMinP};
  const double values[] = {0.0, -0.0, 1.0, -1.0, 0.5, 2.0, inf, -inf, 1e-45, -1e-45, 3e9, -3e9};
  for (PolicyField f : fields) {
    for (double v : values) {
      const bool is_k = f == PolicyField::kTopK;
      if (is_k && (std::isinf(v) || v != std::floor(v))) continue;  // top_k: integers
      const double t = f == PolicyField::kTemperature ? v : 1.0;
      const int64_t k = is_k ? static_cast<int64_t>(v) : 0;
      const double p = f == PolicyField::kTopP ? v : 1.0, m = f == PolicyField::kMinP ? v : 0.0;
      CHECK(policy_value_error(f, v) == policy_error(t, k, p, m));
    }
  }
  CHECK(policy_value_error(PolicyField::kTopK, nan) == policy_violation(PolicyField::kTopK, "nan"));
  CHECK(policy_value_error(PolicyField::kTopK, 1e30).empty());
  CHECK(policy_value_error(PolicyField::kTopK, -1e30) ==
        policy_violation(PolicyField::kTopK, "-1e+30"));

  // Numbers: integers plain, others in the fewest digits that read back (float32 values
  // as float32), no locale, no iostreams.
  CHECK(format_value(nan) == "nan" && format_value(-inf) == "-inf" && format_value(inf) == "inf");
  CHECK(format_value(0.0) == "0" && format_value(-0.0) == "-0");
  CHECK(format_value(2.0) == "2" && format_value(-2147483648.0) == "-2147483648");
  CHECK(format_value(-0.5) == "-0.5" && format_value(0.1) == "0.1");
  CHECK(format_value(0.1f) == "0.1" && format_value(1.1f) == "1.1");
  CHECK(format_value(1e-45f) == "1e-45" && format_value(5e-324) == "5e-324");
  CHECK(format_value(1.0 + 1e-7) == "1.0000001" && format_value(1e30) == "1e+30");
  CHECK(format_value(1e15) == "1e+15" && format_value(0.30000000000000004) == "0.30000000000000004");
}

void test_sample() {
  const std::vector<float> probs = {0.1f, 0.0f, 0.2f, 0.7f};  // one row
  SampleArgs a;
  a.probs = probs.data();
  a.rows = 1;
  a.vocab = 4;
  a.probs_row_stride = 4;
  int32_t token = -7;
  a.tokens = &token;
  int counts[4] = {0, 0, 0, 0};
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    a.rng.seed = 99;
    a.rng.offset = static_cast<uint64_t>(i);
    CHECK(sample_cpu(a).ok());
    CHECK(token >= 0 && token < 4);
    if (token >= 0 && token < 4) ++counts[token];
  }
  CHECK(counts[1] == 0);  // zero mass is never drawn
  CHECK_NEAR(counts[0] / static_cast<double>(n), 0.1, 0.01);
  CHECK_NEAR(counts[2] / static_cast<double>(n), 0.2, 0.012);
  CHECK_NEAR(counts[3] / static_cast<double>(n), 0.7, 0.012);

  // Deterministic; unnormalised weights are scaled; seeds/offsets change the stream.
  const std::vector<float> scaled = {1.0f, 0.0f, 2.0f, 7.0f};
  std::vector<int32_t> t1(64), t2(64), t3(64);
  std::vector<float> many;
  for (int r = 0; r < 64; ++r) many.insert(many.end(), probs.begin(), probs.end());
  std::vector<float> many_scaled;
  for (int r = 0; r < 64; ++r) many_scaled.insert(many_scaled.end(), scaled.begin(), scaled.end());
  SampleArgs m = a;
  m.rows = 64;
  m.rng.seed = 5;
  m.rng.offset = 17;
  m.probs = many.data();
  m.tokens = t1.data();
  CHECK(sample_cpu(m).ok());
  m.tokens = t2.data();
  CHECK(sample_cpu(m).ok());
  CHECK(t1 == t2);
  m.probs = many_scaled.data();
  m.tokens = t3.data();
  CHECK(sample_cpu(m).ok());
  int same = 0;
  for (int r = 0; r < 64; ++r) same += t1[r] == t3[r];
  CHECK(same >= 60);  // identical up to rounding at the CDF boundaries
  m.rng.offset = 18;
  CHECK(sample_cpu(m).ok());
  CHECK(t3 != t1);
  // Rows draw different coins.
  CHECK(std::count(t1.begin(), t1.end(), t1[0]) < 64);

  // Errors: negative, NaN, zero mass; the bad row gets -1, others are sampled.
  const std::vector<float> bad = {0.5f, 0.5f, 0.2f, -0.1f, 0.0f, 0.0f, 1.0f, kNan};
  int32_t out[4] = {9, 9, 9, 9};
  SampleArgs e;
  e.probs = bad.data();
  e.rows = 4;
  e.vocab = 2;
  e.probs_row_stride = 2;
  e.tokens = out;
  OpStatus s = sample_cpu(e);
  CHECK(s.code == StatusCode::kInvalidProbs && s.row == 1 && s.col == 1 && s.value == -0.1f);
  CHECK(out[0] >= 0 && out[1] == -1 && out[2] == -1 && out[3] == -1);
  e.probs = bad.data() + 4;
  e.rows = 1;
  s = sample_cpu(e);
  CHECK(s.code == StatusCode::kInvalidProbs && s.row == 0 && s.col == -1);
  CHECK(std::strstr(s.what, "zero") != nullptr);
  e.rng.offset = kPhiloxMaxOffset;
  CHECK(sample_cpu(e).code == StatusCode::kInvalidArgument);
}

// ---- verify ---------------------------------------------------------------------------------

int argmax_of(const float* x, int64_t n) {
  return static_cast<int>(std::max_element(x, x + n) - x);
}

void test_verify_greedy_contract() {
  std::mt19937 rng(5);
  VerifyCase c;
  c.batch = 6;
  c.k = 4;
  c.vocab = 50;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * c.vocab));
  c.policy.temperature = 0.0f;  // greedy
  c.policy.top_k = 3;            // the filters never change the argmax
  // Row b drafts the argmax for its first b positions, then a wrong token.
  c.drafts.resize(static_cast<size_t>(c.batch * c.k));
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.k; ++j) {
      const int am = argmax_of(&c.logits[static_cast<size_t>((b * (c.k + 1) + j) * c.vocab)], c.vocab);
      c.drafts[static_cast<size_t>(b * c.k + j)] = j < b ? am : (am + 1) % static_cast<int>(c.vocab);
    }
  }
  for (uint64_t seed : {1ull, 2ull}) {  // greedy ignores the coins
    c.seed = seed;
    const VerifyOut o = c.run();
    CHECK(o.status.ok());
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t acc = std::min<int64_t>(b, c.k);
      CHECK(o.accepted[b] == acc);
      CHECK(o.emitted[b] == acc + 1);
      for (int64_t j = 0; j <= acc; ++j) {
        const int am = argmax_of(&c.logits[static_cast<size_t>((b * (c.k + 1) + j) * c.vocab)], c.vocab);
        CHECK(o.tokens[static_cast<size_t>(b * (c.k + 1) + j)] == am);
      }
      for (int64_t j = acc + 1; j <= c.k; ++j) {
        CHECK(o.tokens[static_cast<size_t>(b * (c.k + 1) + j)] == -1);
      }
    }
  }
  // Per-row temperature 0 makes just those rows greedy.
  std::vector<float> temps(static_cast<size_t>(c.batch), 0.0f);
  temps[1] = 1.0f;
  c.policy = PolicyParams{};
  c.policy.temperature_per_row = temps.data();
  const VerifyOut o = c.run();
  CHECK(o.status.ok());
  for (int64_t b = 0; b < c.batch; ++b) {
    if (b != 1) CHECK(o.accepted[b] == std::min<int64_t>(b, c.k));
  }
}

// Draft probs equal to the target's p: every proposal is accepted, always.
void test_verify_p_equals_q() {
  std::mt19937 rng(8);
  VerifyCase c;
  c.batch = 5;
  c.k = 3;
  c.vocab = 40;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * c.vocab));
  c.policy.temperature = 0.8f;
  c.policy.top_p = 0.9f;
  c.policy.top_k = 20;
  const auto p_all = apply(c.logits, c.batch * (c.k + 1), c.vocab, c.policy);
  c.draft_probs.clear();
  c.drafts.clear();
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.k; ++j) {
      const float* p = &p_all[static_cast<size_t>((b * (c.k + 1) + j) * c.vocab)];
      c.draft_probs.insert(c.draft_probs.end(), p, p + c.vocab);
      c.drafts.push_back(argmax_of(p, c.vocab));  // any token with q > 0
    }
  }
  for (uint64_t off = 0; off < 50; ++off) {
    c.offset = off;
    const VerifyOut o = c.run();
    CHECK(o.status.ok());
    for (int64_t b = 0; b < c.batch; ++b) {
      CHECK(o.accepted[b] == c.k && o.emitted[b] == c.k + 1);
      const int32_t bonus = o.tokens[static_cast<size_t>(b * (c.k + 1) + c.k)];
      CHECK(bonus >= 0 && bonus < c.vocab);
      if (bonus >= 0 && bonus < c.vocab) {
        CHECK(p_all[static_cast<size_t>((b * (c.k + 1) + c.k) * c.vocab + bonus)] > 0.0f);
      }
    }
  }
}

// One-hot drafts: accept with probability p(y); a correction never repeats y.
void test_verify_one_hot() {
  VerifyCase c;
  c.batch = 1;
  c.k = 1;
  c.vocab = 3;
  c.logits = logits_of({0.6, 0.3, 0.1, 0.2, 0.3, 0.5});
  c.drafts = {1};  // p(y) = 0.3
  int accepted = 0;
  const int n = 20000;
  int repeated = 0;
  for (int i = 0; i < n; ++i) {
    c.offset = static_cast<uint64_t>(i);
    const VerifyOut o = c.run();
    CHECK(o.status.ok());
    accepted += o.accepted[0];
    if (o.accepted[0] == 0) repeated += o.tokens[0] == 1;
  }
  CHECK_NEAR(accepted / static_cast<double>(n), 0.3, 0.012);
  CHECK(repeated == 0);
  // With p(y) = 1 (top-k 1 keeps y alone) the proposal is always accepted.
  c.drafts = {0};
  c.policy.top_k = 1;
  for (int i = 0; i < 100; ++i) {
    c.offset = static_cast<uint64_t>(i);
    CHECK(c.run().accepted[0] == 1);
  }
}

// The first emitted token is distributed as p_0 whatever q is (small chi-square check),
// and corrections come from max(p - q, 0): never a token with p <= q.
void test_verify_exactness_small() {
  VerifyCase c;
  c.batch = 1;
  c.k = 2;
  c.vocab = 4;
  const std::vector<double> p0 = {0.1, 0.4, 0.3, 0.2};
  const std::vector<double> q0 = {0.4, 0.1, 0.3, 0.2};
  c.logits = logits_of({0.1, 0.4, 0.3, 0.2, 0.25, 0.25, 0.25, 0.25, 0.7, 0.1, 0.1, 0.1});
  c.draft_probs = {0.4f, 0.1f, 0.3f, 0.2f, 0.25f, 0.25f, 0.25f, 0.25f};
  const int n = 40000;
  std::mt19937 rng(1);
  std::discrete_distribution<int> qd(q0.begin(), q0.end());
  int counts[4] = {0, 0, 0, 0};
  int bad_correction = 0;
  for (int i = 0; i < n; ++i) {
    c.drafts = {qd(rng), static_cast<int32_t>(rng() % 4)};
    c.offset = static_cast<uint64_t>(i);
    const VerifyOut o = c.run();
    CHECK(o.status.ok());
    ++counts[o.tokens[0]];
    if (o.accepted[0] == 0) bad_correction += p0[o.tokens[0]] <= q0[o.tokens[0]];
  }
  double chi2 = 0.0;
  for (int i = 0; i < 4; ++i) {
    const double e = p0[i] * n;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  CHECK(chi2 < 16.3);  // 3 dof, p = 0.001
  CHECK(bad_correction == 0);
}

void test_verify_ragged_and_padding() {
  std::mt19937 rng(21);
  VerifyCase c;
  c.batch = 4;
  c.k = 3;
  c.vocab = 30;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * c.vocab), 0.5f);
  c.drafts.resize(static_cast<size_t>(c.batch * c.k));
  for (auto& t : c.drafts) t = static_cast<int32_t>(rng() % c.vocab);
  c.num_draft = {0, 2, 3, 1};
  // Garbage after num_draft is padding: never read, never checked.
  c.drafts[1 * 3 + 2] = -5;
  for (int64_t v = 0; v < c.vocab; ++v) c.logits[static_cast<size_t>((1 * 4 + 3) * c.vocab + v)] = kNan;
  for (uint64_t off = 0; off < 200; ++off) {
    c.offset = off;
    const VerifyOut o = c.run();
    CHECK(o.status.ok());
    for (int64_t b = 0; b < c.batch; ++b) c.check_row(o, b);
  }
  // num_draft 0 everywhere, K = 0 and no draft tokens at all: plain sampling.
  VerifyCase z;
  z.batch = 3;
  z.k = 0;
  z.vocab = 5;
  z.logits = random_logits(rng, 15);
  const VerifyOut o = z.run();
  CHECK(o.status.ok());
  for (int b = 0; b < 3; ++b) CHECK(o.emitted[b] == 1 && o.accepted[b] == 0 && o.tokens[b] >= 0);
}

void test_verify_roundoff_rule() {
  // p is one-hot at token 2 (top-k 1); q = p plus mass on token 0, proposed: p(0) = 0
  // so it is always rejected, and max(p - q, 0) has zero mass: sample p, i.e. token 2.
  VerifyCase c;
  c.batch = 1;
  c.k = 1;
  c.vocab = 3;
  c.logits = {0.0f, 1.0f, 3.0f, 0.0f, 0.0f, 0.0f};
  c.policy.top_k = 1;
  c.drafts = {0};
  c.draft_probs = {0.5f, 0.0f, 1.0f};
  for (uint64_t off = 0; off < 50; ++off) {
    c.offset = off;
    const VerifyOut o = c.run();
    CHECK(o.status.ok() && o.accepted[0] == 0 && o.tokens[0] == 2 && o.tokens[1] == -1);
  }
}

void test_verify_determinism() {
  std::mt19937 rng(4);
  VerifyCase c;
  c.batch = 8;
  c.k = 4;
  c.vocab = 64;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * c.vocab), 1.0f);
  c.drafts.resize(static_cast<size_t>(c.batch * c.k));
  for (auto& t : c.drafts) t = static_cast<int32_t>(rng() % c.vocab);
  c.seed = 77;
  c.offset = 3;
  const VerifyOut a = c.run(), b = c.run();
  CHECK(a.tokens == b.tokens && a.emitted == b.emitted && a.accepted == b.accepted);
  // bf16 logits of the same values give the same result.
  std::vector<uint16_t> bf(c.logits.size());
  for (size_t i = 0; i < bf.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &c.logits[i], 4);
    bf[i] = static_cast<uint16_t>(u >> 16);
    u &= 0xffff0000u;
    std::memcpy(&c.logits[i], &u, 4);
  }
  const VerifyOut f = c.run();
  VerifyOut h;
  h.tokens.assign(f.tokens.size(), 0);
  h.emitted.assign(8, 0);
  h.accepted.assign(8, 0);
  VerifyArgs args;
  args.target_logits = bf.data();
  args.target_logits_dtype = LogitsDType::kBFloat16;
  args.target_logits_stride_b = (c.k + 1) * c.vocab;
  args.target_logits_stride_k = c.vocab;
  args.batch = c.batch;
  args.num_spec = c.k;
  args.vocab = c.vocab;
  args.draft_tokens = c.drafts.data();
  args.draft_tokens_stride_b = c.k;
  args.rng.seed = c.seed;
  args.rng.offset = c.offset;
  args.tokens = h.tokens.data();
  args.tokens_stride_b = c.k + 1;
  args.num_emitted = h.emitted.data();
  args.num_accepted = h.accepted.data();
  CHECK(verify_cpu(args).ok());
  CHECK(f.tokens == h.tokens && f.emitted == h.emitted);
  // Seed and offset through pointers read the same stream.
  const int64_t seed = 77, offset = 3;
  args.target_logits = c.logits.data();
  args.target_logits_dtype = LogitsDType::kFloat32;
  args.rng = RandomParams{};
  args.rng.seed_ptr = &seed;
  args.rng.offset_ptr = &offset;
  CHECK(verify_cpu(args).ok());
  CHECK(f.tokens == h.tokens);
}

void test_verify_errors() {
  std::mt19937 rng(9);
  VerifyCase c;
  c.batch = 3;
  c.k = 2;
  c.vocab = 10;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * c.vocab));
  c.drafts = {1, 2, 3, 4, 5, 6};
  CHECK(c.run().status.ok());

  // NaN in row 1, position 2 (the bonus position is checked too).
  VerifyCase n = c;
  n.logits[static_cast<size_t>((1 * 3 + 2) * 10 + 7)] = kNan;
  VerifyOut o = n.run();
  CHECK(o.status.code == StatusCode::kNanOrInfLogits && o.status.row == 1 && o.status.col == 2);
  CHECK(o.emitted[1] == 0 && o.accepted[1] == 0 && o.tokens[3] == -1 && o.tokens[5] == -1);
  CHECK(o.emitted[0] >= 1 && o.emitted[2] >= 1);  // other rows still verified

  // Token out of range in row 2, position 1 (and a later NaN row is not the one reported).
  VerifyCase t = c;
  t.drafts[2 * 2 + 1] = 10;
  o = t.run();
  CHECK(o.status.code == StatusCode::kTokenOutOfRange && o.status.row == 2 &&
        o.status.col == 1 && o.status.value == 10.0);
  t.drafts[2 * 2 + 1] = -1;
  CHECK(t.run().status.code == StatusCode::kTokenOutOfRange);
  t.drafts[2 * 2 + 1] = 3;
  t.logits[0] = kInf;
  o = t.run();
  CHECK(o.status.code == StatusCode::kNanOrInfLogits && o.status.row == 0 && o.status.col == 0);

  // A position whose logits are all -Inf (a -Inf mask elsewhere is fine).
  VerifyCase m = c;
  for (int64_t v = 0; v < 10; ++v) m.logits[static_cast<size_t>((2 * 3 + 1) * 10 + v)] = -kInf;
  o = m.run();
  CHECK(o.status.code == StatusCode::kNanOrInfLogits && o.status.row == 2 && o.status.col == 1);
  m = c;
  for (int64_t v = 0; v < 10; v += 2) {
    for (int64_t j = 0; j < 3; ++j) m.logits[static_cast<size_t>((0 * 3 + j) * 10 + v)] = -kInf;
  }
  m.drafts = {1, 3, 4, 5, 6, 7};
  for (uint64_t off = 0; off < 100; ++off) {
    m.offset = off;
    o = m.run();
    CHECK(o.status.ok());
    for (int64_t j = 0; j < o.emitted[0]; ++j) CHECK(o.tokens[static_cast<size_t>(j)] % 2 == 1);
  }

  // num_draft out of range.
  VerifyCase r = c;
  r.num_draft = {2, 3, 0};
  o = r.run();
  CHECK(o.status.code == StatusCode::kNumDraftOutOfRange && o.status.row == 1 && o.status.value == 3);
  r.num_draft = {-1, 0, 0};
  CHECK(r.run().status.code == StatusCode::kNumDraftOutOfRange);

  // Invalid draft_probs where read: q(y) negative.
  VerifyCase q = c;
  q.draft_probs.assign(static_cast<size_t>(3 * 2 * 10), 0.1f);
  q.draft_probs[static_cast<size_t>((0 * 2 + 1) * 10 + 2)] = -0.5f;  // q_1(y = 2) of row 0
  o = q.run();
  CHECK(o.status.code == StatusCode::kInvalidProbs && o.status.row == 0 && o.status.col == 1);
  // NaN elsewhere in a q row is found when that row is read for the residual: make
  // every proposal impossible under p (top-k 1 keeps only the argmax) so row 0 rejects at 0.
  VerifyCase w = c;
  w.policy.top_k = 1;
  w.draft_probs.assign(static_cast<size_t>(3 * 2 * 10), 0.1f);
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t j = 0; j < 2; ++j) {
      const int am = argmax_of(&w.logits[static_cast<size_t>((b * 3 + j) * 10)], 10);
      w.drafts[static_cast<size_t>(b * 2 + j)] = (am + 1) % 10;
    }
  }
  const int y0 = w.drafts[0];
  w.draft_probs[static_cast<size_t>((y0 + 3) % 10)] = kNan;
  o = w.run();
  CHECK(o.status.code == StatusCode::kInvalidProbs && o.status.row == 0 && o.status.col == 0);

  // Per-row policy values.
  VerifyCase pr = c;
  const float top_p[] = {1.0f, 0.5f, 1.5f};
  pr.policy.top_p_per_row = top_p;
  o = pr.run();
  CHECK(o.status.code == StatusCode::kInvalidPolicy && o.status.row == 2 &&
        o.status.col == static_cast<int64_t>(PolicyField::kTopP) && o.status.value == 1.5);
  // Scalars.
  VerifyCase sc = c;
  sc.policy.min_p = -0.1f;
  CHECK(sc.run().status.code == StatusCode::kInvalidArgument);
}

void test_decode_device_error() {
  CHECK(decode_device_error(OpKind::kVerify, kNoDeviceError).ok());
  const uint64_t rec = (uint64_t{5} << 32) | (uint64_t{4} << 28) | 3;
  const OpStatus s = decode_device_error(OpKind::kVerify, rec);
  CHECK(s.code == StatusCode::kTokenOutOfRange && s.row == 5 && s.col == 3);
  const OpStatus z = decode_device_error(OpKind::kSample, (uint64_t{1} << 32) | (uint64_t{6} << 28) | 0x0fffffff);
  CHECK(z.code == StatusCode::kInvalidProbs && z.row == 1 && z.col == -1);
}

}  // namespace

// ---- the CPU linear kernel (verispec/layers/linear.h) ------------------------------------------
//
// Every instruction set this CPU runs against a double-precision product; each row of a
// call bitwise equal to that row alone (batch invariance) for any M, thread count and row
// stride. Here no OpenMP runtime is loaded, so split calls run on the kernel's own worker
// threads (the pool the sanitizers watch).
void test_linear() {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const LinearIsa isas[] = {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512};
  CHECK(std::strcmp(linear_threads_name(), "verispec") == 0);
  for (LinearIsa isa : isas) {
    if (!linear_isa_supported(isa)) continue;
    for (bool kn : {false, true})
    for (int64_t k : {1, 15, 16, 17, 33, 130}) {
      const int64_t n = 301, rows = 19, ldx = k + 3;  // k >= 33: the big calls split
      // w[c, j] at w[c * k + j] ([N, K]) or, kn, at w[j * n + c] ([K, N])
      std::vector<float> w(static_cast<size_t>(n * k)), x(static_cast<size_t>(rows * ldx), kNan);
      for (auto& v : w) v = normal(rng);
      auto weight = [&](int64_t c, int64_t j) { return kn ? w[j * n + c] : w[c * k + j]; };
      const int64_t ldw = kn ? n : k;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < k; ++j) x[r * ldx + j] = normal(rng);
      // each row alone, one thread
      std::vector<float> alone(static_cast<size_t>(rows * n));
      for (int64_t r = 0; r < rows; ++r) {
        LinearArgs a;
        a.x = x.data() + r * ldx; a.w = w.data(); a.y = alone.data() + r * n;
        a.m = 1; a.n = n; a.k = k; a.ldx = ldx; a.ldw = ldw; a.ldy = n; a.isa = isa;
        a.weight_kn = kn;
        CHECK(linear_f32(a).empty());
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < n; ++c) {
          double exact = 0, scale = 0;
          for (int64_t j = 0; j < k; ++j) {
            exact += static_cast<double>(x[r * ldx + j]) * weight(c, j);
            scale += std::fabs(static_cast<double>(x[r * ldx + j]) * weight(c, j));
          }
          CHECK_NEAR(alone[r * n + c], exact, 2.0 * k * 1.2e-7 * scale + 1e-30);
        }
      for (int64_t m : {2, 8, 9, 19})
        for (int threads : {1, 2, 5}) {
          std::vector<float> y(static_cast<size_t>(m * (n + 2)), kNan);
          LinearArgs a;
          a.x = x.data(); a.w = w.data(); a.y = y.data();
          a.m = m; a.n = n; a.k = k; a.ldx = ldx; a.ldw = ldw; a.ldy = n + 2;
          a.num_threads = threads; a.isa = isa; a.weight_kn = kn;
          CHECK(linear_f32(a).empty());
          bool same = true;
          for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < n; ++c)
              same = same && std::memcmp(&y[r * (n + 2) + c], &alone[r * n + c], sizeof(float)) == 0;
          CHECK(same);
          CHECK(std::isnan(y[n]) && std::isnan(y[n + 1]));  // the row padding is not written
        }
    }
  }
  // argument errors: reported, nothing written
  std::vector<float> x(8, 1.0f), w(8, 1.0f), y(4, -1.0f);
  LinearArgs a;
  a.x = x.data(); a.w = w.data(); a.y = y.data();
  a.m = 2; a.n = 2; a.k = 4; a.ldx = 4; a.ldw = 4; a.ldy = 2;
  a.num_threads = 0;
  CHECK(linear_f32(a).find("num_threads must be >= 1") != std::string::npos);
  a.num_threads = 1;
  a.ldw = 3;
  CHECK(linear_f32(a).find("row strides must cover a row") != std::string::npos);
  a.ldw = 4;
  a.y = x.data();
  CHECK(linear_f32(a).find("must not overlap") != std::string::npos);
  a.y = y.data();
  CHECK(y[0] == -1.0f);
  CHECK(linear_f32(a).empty());
  CHECK(y[0] == 4.0f && y[3] == 4.0f);
}

// ---- RMSNorm (verispec/layers/norm.h) ----------------------------------------------------------
void test_rms_norm() {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 5, dim = 37, ldx = 40;
  std::vector<float> x(rows * ldx, kNan), w(dim), y(rows * ldx, kNan);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i) x[r * ldx + i] = normal(rng) * static_cast<float>(r + 1);
  for (auto& v : w) v = 1.0f + 0.1f * normal(rng);
  CHECK(rms_norm_f32(x.data(), rows, dim, ldx, w.data(), 1e-5f, y.data(), ldx).empty());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[r * ldx + i]) * x[r * ldx + i];
    const double scale = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int64_t i = 0; i < dim; ++i) {
      const double want = w[i] * x[r * ldx + i] * scale;
      CHECK_NEAR(y[r * ldx + i], want, 1e-6 * std::fabs(want) + 1e-30);
    }
    CHECK(std::isnan(y[r * ldx + dim]));  // the row padding is not written
  }
  // in place (y == x) gives the same values
  std::vector<float> z = x;
  CHECK(rms_norm_f32(z.data(), rows, dim, ldx, w.data(), 1e-5f, z.data(), ldx).empty());
  CHECK(std::memcmp(z.data(), y.data(), sizeof(float) * dim) == 0);
  CHECK(rms_norm_f32(x.data(), rows, dim, dim - 1, w.data(), 1e-5f, y.data(), ldx).find("ldx") !=
        std::string::npos);
  CHECK(rms_norm_f32(x.data(), rows, 0, ldx, w.data(), 1e-5f, y.data(), ldx).find("dim >= 1") !=
        std::string::npos);
}

// The arguments of a paged-attention case: pools k and v ([slots, nkv, d]), queries q
// and out ([tokens, nh d]), the rows' query starts, positions, context lengths and block
// tables (table_width blocks a row); scale 1 / sqrt(d). The rest keeps its defaults.
PagedAttentionArgs attention_args(const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, std::vector<float>& out,
                                  int64_t nh, int64_t nkv, int64_t d,
                                  const std::vector<int64_t>& qs, const std::vector<int64_t>& pos,
                                  const std::vector<int32_t>& ctx,
                                  const std::vector<int32_t>& tables, int64_t table_width,
                                  int64_t bs) {
  PagedAttentionArgs a;
  a.q = q.data();
  a.k_pool = k.data();
  a.v_pool = v.data();
  a.num_slots = static_cast<int64_t>(k.size()) / (nkv * d);
  a.tokens = static_cast<int64_t>(pos.size());
  a.num_heads = nh;
  a.num_kv_heads = nkv;
  a.head_dim = d;
  a.rows = static_cast<int64_t>(ctx.size());
  a.query_start = qs.data();
  a.positions = pos.data();
  a.context_lens = ctx.data();
  a.block_tables = tables.data();
  a.table_stride = a.table_width = table_width;
  a.block_size = bs;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d));
  a.out = out.data();
  return a;
}

// Paged attention of a verify row and a decode row over shuffled blocks, against a
// double-precision loop; the same bits on every ISA and thread count; a tree node equal
// to its path as a chain; errors leave the output alone. Under ASan every index is
// checked against the pools' extent.
void test_paged_attention() {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t nh = 4, nkv = 2, d = 20, bs = 3, blocks = 12, slots = blocks * bs;
  std::vector<float> k(slots * nkv * d), v(slots * nkv * d);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  // row 0: 10 keys in blocks 7, 2, 9, 0; its last 3 tokens new. row 1: 5 keys in 4, 11.
  const std::vector<int32_t> tables = {7, 2, 9, 0, 4, 11, -1, -1};
  const std::vector<int32_t> ctx = {10, 5};
  const std::vector<int64_t> qs = {0, 3, 4}, pos = {7, 8, 9, 4};
  const int64_t tokens = 4;
  std::vector<float> q(tokens * nh * d), out(tokens * nh * d, kNan);
  for (auto& x : q) x = normal(rng);
  PagedAttentionArgs a = attention_args(q, k, v, out, nh, nkv, d, qs, pos, ctx, tables, 4, bs);
  CHECK(a.num_slots == slots && a.tokens == tokens && a.rows == 2);
  auto slot = [&](int64_t row, int64_t j) { return tables[row * 4 + j / bs] * bs + j % bs; };
  auto reference = [&](int64_t t, int64_t row, const std::vector<int64_t>& keys, int64_t h) {
    std::vector<double> s;
    double m = -1e300, sum = 0;
    const int64_t kvh = h / (nh / nkv);
    for (int64_t j : keys) {
      double dot = 0;
      for (int64_t i = 0; i < d; ++i)
        dot += static_cast<double>(q[(t * nh + h) * d + i]) * k[(slot(row, j) * nkv + kvh) * d + i];
      s.push_back(dot * a.scale);
      m = std::max(m, s.back());
    }
    std::vector<double> o(d, 0.0);
    for (size_t j = 0; j < keys.size(); ++j) {
      const double e = std::exp(s[j] - m);
      sum += e;
      for (int64_t i = 0; i < d; ++i) o[i] += e * v[(slot(row, keys[j]) * nkv + kvh) * d + i];
    }
    for (auto& x : o) x /= sum;
    return o;
  };
  CHECK(paged_attention_f32(a).empty());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = t < 3 ? 0 : 1;
    std::vector<int64_t> keys;
    for (int64_t j = 0; j <= pos[t]; ++j) keys.push_back(j);
    for (int64_t h = 0; h < nh; ++h) {
      const std::vector<double> want = reference(t, row, keys, h);
      for (int64_t i = 0; i < d; ++i) CHECK_NEAR(out[(t * nh + h) * d + i], want[i], 2e-6);
    }
  }
  const std::vector<float> base = out;
  for (LinearIsa isa : {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512}) {
    if (!linear_isa_supported(isa)) continue;
    for (int threads : {1, 2, 3})
      for (bool share : {true, false}) {  // row 0's 3 tokens read their keys together or each
        std::fill(out.begin(), out.end(), kNan);
        a.isa = isa;
        a.num_threads = threads;
        a.share_keys = share;
        CHECK(paged_attention_f32(a).empty());
        CHECK(std::memcmp(out.data(), base.data(), sizeof(float) * out.size()) == 0);
      }
  }
  a.share_keys = true;
  a.isa = LinearIsa::kAuto;
  a.num_threads = 1;
  // row 0 as a tree: new tokens 7, 8, 9 = a root and two children (8 and 9 siblings);
  // node 9 sees keys 0..7 and itself, as the chain 0..7 then 9.
  const std::vector<uint8_t> tree = {1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1};
  const std::vector<int64_t> tree_pos = {7, 8, 8, 4};
  a.tree_mask = tree.data();
  a.positions = tree_pos.data();
  CHECK(paged_attention_f32(a).empty());
  for (int64_t h = 0; h < nh; ++h) {
    const std::vector<double> want = reference(2, 0, {0, 1, 2, 3, 4, 5, 6, 7, 9}, h);
    for (int64_t i = 0; i < d; ++i) CHECK_NEAR(out[(2 * nh + h) * d + i], want[i], 2e-6);
  }
  // errors: nothing written
  std::fill(out.begin(), out.end(), kNan);
  a.tree_mask = nullptr;
  a.positions = pos.data();
  const std::vector<int32_t> bad_tables = {7, 2, 12, 0, 4, 11, -1, -1};
  a.block_tables = bad_tables.data();
  CHECK(paged_attention_f32(a).find("row 0's block 2 must be in [0, 12), got 12") != std::string::npos);
  a.block_tables = tables.data();
  const std::vector<int64_t> bad_pos = {7, 8, 10, 4};
  a.positions = bad_pos.data();
  CHECK(paged_attention_f32(a).find("token 2 (row 0) must have a position") != std::string::npos);
  for (float x : out) CHECK(std::isnan(x));
  // exp against std::exp
  for (float x = -87.0f; x <= 88.0f; x += 0.37f)
    CHECK_NEAR(decode_exp(x), std::exp(static_cast<double>(x)), 3e-7 * std::exp(static_cast<double>(x)));
}

// Past 512 keys: chunks merged in order, a decode token's chunks cut across items on 2-3
// threads; a row of 3 tokens read together or each alone. Same bits everywhere, float64
// within 2e-6 (under ASan: the partial buffers' bounds).
void test_paged_attention_long_context() {
  std::mt19937 rng(22);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t nh = 4, nkv = 2, d = 16, bs = 8, ctx = 1100, blocks = (ctx + bs - 1) / bs;
  std::vector<float> k(blocks * bs * nkv * d), v(blocks * bs * nkv * d);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  std::vector<int32_t> table(blocks);
  for (int64_t i = 0; i < blocks; ++i) table[i] = static_cast<int32_t>((i * 37) % blocks);
  const std::vector<int32_t> ctx_lens = {static_cast<int32_t>(ctx)};
  const std::vector<int64_t> qs = {0, 3}, pos = {ctx - 3, ctx - 2, ctx - 1};
  std::vector<float> q(3 * nh * d), out(3 * nh * d, kNan), base;
  for (auto& x : q) x = normal(rng);
  PagedAttentionArgs a =
      attention_args(q, k, v, out, nh, nkv, d, qs, pos, ctx_lens, table, blocks, bs);
  a.share_keys = false;
  CHECK(paged_attention_f32(a).empty());
  base = out;
  for (int64_t h = 0; h < nh; ++h) {  // token 2 against float64
    const int64_t kvh = h / (nh / nkv);
    std::vector<double> sc(ctx), o(d, 0.0);
    double m = -1e300, sum = 0.0;
    for (int64_t j = 0; j < ctx; ++j) {
      const float* kj = k.data() + ((table[j / bs] * bs + j % bs) * nkv + kvh) * d;
      double dot = 0.0;
      for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(q[(2 * nh + h) * d + i]) * kj[i];
      sc[j] = dot * a.scale;
      m = std::max(m, sc[j]);
    }
    for (int64_t j = 0; j < ctx; ++j) {
      const double e = std::exp(sc[j] - m);
      sum += e;
      const float* vj = v.data() + ((table[j / bs] * bs + j % bs) * nkv + kvh) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += e * vj[i];
    }
    for (int64_t i = 0; i < d; ++i) CHECK_NEAR(base[(2 * nh + h) * d + i], o[i] / sum, 2e-6);
  }
  for (LinearIsa isa : {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512}) {
    if (!linear_isa_supported(isa)) continue;
    for (int threads : {1, 2, 3})
      for (bool share : {true, false}) {
        a.isa = isa;
        a.num_threads = threads;
        a.share_keys = share;
        a.tokens = 3;
        a.query_start = qs.data();
        a.positions = pos.data();
        a.q = q.data();
        std::fill(out.begin(), out.end(), kNan);
        CHECK(paged_attention_f32(a).empty());
        CHECK(std::memcmp(out.data(), base.data(), sizeof(float) * out.size()) == 0);
        // the last token alone: a decode pass (its chunks cut when share and threads > 1)
        const std::vector<int64_t> one = {0, 1}, last = {ctx - 1};
        a.tokens = 1;
        a.query_start = one.data();
        a.positions = last.data();
        a.q = q.data() + 2 * nh * d;
        std::fill(out.begin(), out.end(), kNan);
        CHECK(paged_attention_f32(a).empty());
        CHECK(std::memcmp(out.data(), base.data() + 2 * nh * d, sizeof(float) * nh * d) == 0);
      }
  }
}

int main() {
  test_philox_known_answers();
  test_stream_layout();
  test_half_conversions();
  test_exp_nonpositive();
  test_acceptance_math();
  test_log_reduced();
  test_weighted_threshold_against_sort();
  test_row_checks_and_argmax();
  test_row_sums();
  test_tiled_softmax_norm();
  test_policy_hand_cases();
  test_policy_against_brute_force();
  test_policy_dtypes_strides_and_rows();
  test_policy_errors();
  test_policy_rules();
  test_sample();
  test_verify_greedy_contract();
  test_verify_p_equals_q();
  test_verify_one_hot();
  test_verify_exactness_small();
  test_verify_ragged_and_padding();
  test_verify_roundoff_rule();
  test_verify_determinism();
  test_verify_errors();
  test_decode_device_error();
  test_linear();
  test_rms_norm();
  test_paged_attention();
  test_paged_attention_long_context();
  return native_check::check_summary("test_kernels");
}
