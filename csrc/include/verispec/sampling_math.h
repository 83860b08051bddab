// The sampling math of verispec, written once for the CPU and CUDA kernels.
//
// Everything here is a small `__host__ __device__` inline function on scalars, so the
// two backends make the same decision from the same numbers:
//
//   p      target distribution after the policy (temperature, top-k, top-p, min-p)
//   q      the distribution the drafter sampled its proposal y from
//   accept y  iff  u * q(y) < p(y)              u = ACCEPT coin; no division, so
//                                               q(y) = 0 accepts whenever p(y) > 0
//   residual r_i = max(p_i - q_i, 0)            sampled at the first rejection
//   roundoff: if sum_i r_i < kResidualEps although a rejection happened (p and q
//             equal up to rounding), sample from p instead of the residual.
//
// One rule for every random choice, the same bits on both backends. Every sum that a
// decision depends on (a softmax normaliser, a kept mass, a residual mass, the masses of a
// draw) is a sum of fixed-point integers: each weight w in [0, 8) counts
// fixed_weight(w) = floor(w * 2^40), and integer addition gives the same total in any
// order, so a CUDA block tree, a CPU loop or any split of a row across blocks agree to
// the bit. Per-element float math is written once below and never contracted into FMAs
// (fp_mul/fp_add: the round-to-nearest intrinsics on the device; host files are built
// with -ffp-contract=off), so a weight or probability is one float sequence everywhere.
//
// Inverse-CDF rule (both backends): with the 64-bit coin c (philox.h uniform64) and the
// fixed-point weights W_i of a row, total = sum W_i, the target is
// t = floor(c * total / 2^64) < total (draw_target), and the pick is the smallest i with
// W_0 + ... + W_i > t. Exact: P(i) = W_i / total up to the coin's 2^-64 steps; a token
// of weight zero is never picked, and no rounding case remains.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "verispec/philox.h"

#if defined(__CUDACC__) || defined(VERISPEC_CUDA_SIM)
#include <cuda_fp16.h>  // __half2float (the simulation has a stand-in)
#endif

namespace verispec {

// Residual mass below which a rejection samples from p instead (the roundoff rule).
constexpr float kResidualEps = 1e-6f;

// ---- scalar helpers ---------------------------------------------------------------

VERISPEC_HD inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

VERISPEC_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// True for every value except +-Inf and NaN; immune to -ffast-math.
VERISPEC_HD inline bool is_finite(float x) {
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// A usable logit: anything but NaN and +Inf. -Inf is a mask (probability 0); a row
// needs at least one finite logit.
VERISPEC_HD inline bool logit_valid(float x) {
  const uint32_t b = float_bits(x);
  return (b & 0x7fffffffu) <= 0x7f800000u && b != 0x7f800000u;
}

// ---- float arithmetic without contraction ---------------------------------------------
// nvcc fuses a * b + c into an FMA by default, which rounds once where the host rounds
// twice; these never fuse, so the device computes the host's bits.
VERISPEC_HD inline float fp_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
VERISPEC_HD inline float fp_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
VERISPEC_HD inline float fp_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// ---- fixed-point weights ----------------------------------------------------------------
// A weight w in [0, 8) counts floor(w * 2^kFixedBits) units: below 2^43, so the sum of a
// row of up to kMaxVocab = 2^20 weights stays below 2^63. Conversions are exact (a
// power-of-two scaling, then truncation), so both backends get the same integers. The
// weights summed are probabilities, weights relative to a maximum, or residuals: in
// [0, 1] up to rounding (a normalised residual below 2); larger values saturate.
constexpr int kFixedBits = 40;
constexpr int64_t kMaxVocab = int64_t{1} << 20;  // vocab must be at most this (ops check it)

VERISPEC_HD inline uint64_t fixed_weight(float w) {
  const float c = w < 8.0f ? w : 8.0f;
#if defined(__CUDA_ARCH__)
  return __float2ull_rz(c * 1099511627776.0f);  // 2^40: exact scaling, then truncation
#else
  // The same floor(c * 2^40) from two 32-bit conversions, which vectorise on x86 (a
  // float-to-uint64 conversion does not before AVX-512DQ): c * 2^20 = hi + rem exactly,
  // rem in [0, 1), and floor(c * 2^40) = hi * 2^20 + floor(rem * 2^20).
  const float top = c * 1048576.0f;  // 2^20: exact, below 2^23
  const int32_t hi = static_cast<int32_t>(top);
  const float rem = top - static_cast<float>(hi);  // exact: the fraction of a float
  const int32_t lo = static_cast<int32_t>(rem * 1048576.0f);
  return (static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 20) + static_cast<uint32_t>(lo);
#endif
}

// w * 2^shift, exact wherever the result is a normal float (two steps keep every factor a
// float); a smaller result counts 0 in fixed_weight either way.
VERISPEC_HD inline float scale_pow2(float w, int shift) {
  const int first = shift > 100 ? 100 : (shift < -100 ? -100 : shift);
  const float once = w * bits_float(static_cast<uint32_t>(first + 127) << 23);
  return once * bits_float(static_cast<uint32_t>(shift - first + 127) << 23);
}

// floor(w * 2^(kFixedBits + shift)) for a weight w >= 0 of a row whose largest weight
// w_max has w_max * 2^shift < 2 (sample: unnormalised weights scaled by their maximum's
// power of two, fixed_shift_for): fixed_weight of w * 2^shift.
VERISPEC_HD inline uint64_t fixed_scaled(float w, int shift) {
  return fixed_weight(scale_pow2(w, shift));
}

// The shift that maps a row's weights, largest w_max > 0 (finite), below 2: -e with
// 2^e <= w_max < 2^(e + 1), e in [-149, 127].
VERISPEC_HD inline int fixed_shift_for(float w_max) {
  const uint32_t b = float_bits(w_max) & 0x7fffffffu;
  if (b == 0) return 0;  // no weight: any shift
  int e = static_cast<int>(b >> 23) - 127;
  if ((b >> 23) == 0) {  // subnormal: 2^e <= w_max with e from the highest set bit
    e = -127;
    for (uint32_t m = b & 0x7fffffu; (m & 0x400000u) == 0; m <<= 1) --e;
  }
  return -e;
}

// Units of `fixed` as a float: the one conversion of an integer mass back to a float
// (round to nearest, then an exact scaling).
VERISPEC_HD inline float fixed_to_float(uint64_t fixed) {
#if defined(__CUDA_ARCH__)
  return __ull2float_rn(fixed) * 9.09494701772928238e-13f;  // 2^-40: exact
#else
  return static_cast<float>(fixed) * 9.09494701772928238e-13f;
#endif
}

// floor(c * total / 2^64): the inverse-CDF target of a 64-bit coin, always < total.
VERISPEC_HD inline uint64_t draw_target(uint64_t coin, uint64_t total) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(coin, total);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(coin) * total) >> 64);
#endif
}

// Whether mass >= fraction * of (top-p's test): both converted to double exactly (masses
// stay below 2^53), one rounding in the product.
VERISPEC_HD inline bool mass_at_least(uint64_t mass, float fraction, uint64_t of) {
  return static_cast<double>(mass) >= static_cast<double>(fraction) * static_cast<double>(of);
}

// ---- 16-bit floats -----------------------------------------------------------------
// Storage types only: the kernels read them and compute in float32.

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

VERISPEC_HD inline float bf16_to_float(uint16_t bits) {
  return bits_float(static_cast<uint32_t>(bits) << 16);  // bf16 is float32's top half
}

VERISPEC_HD inline float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // cvt.f32.f16: exact
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // Inf, NaN
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);  // +-0
    exp = 113;                               // subnormal: normalise (127 - 15 + 1)
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return bits_float(sign | (exp << 23) | (mant << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));  // rebias 15 -> 127
#endif
}

VERISPEC_HD inline float to_float(float x) { return x; }
VERISPEC_HD inline float to_float(BFloat16 x) { return bf16_to_float(x.bits); }
VERISPEC_HD inline float to_float(Float16 x) { return fp16_to_float(x.bits); }

// ---- the policy -----------------------------------------------------------------------
// probs = softmax(logits / T) is computed as exp((l - max) / T) / sum, which never
// overflows for tiny T. Every filter keeps {p_i >= threshold}, so top-k, top-p and min-p
// combine into one threshold (their maximum) and ties at a threshold are always kept.

// exp(x) for x in [-110, 0], about 1 ulp (Cephes expf: Cody-Waite reduction, degree-6
// polynomial), subnormal results included, 0 below -104. Branch-free so that CPU loops
// vectorise; the same function on both backends.
// Every multiply and add is its own rounding (fp_mul / fp_add), on both backends.
VERISPEC_HD inline float exp_reduced(float x) {
  // round(x / ln 2)
  const float n = fp_sub(fp_add(fp_mul(x, 1.44269504088896341f), 12582912.0f), 12582912.0f);
  // x - n ln 2, in two parts
  const float r = fp_add(fp_sub(x, fp_mul(n, 0.693359375f)), fp_mul(n, 2.12194440e-4f));
  float poly = 1.9875691500e-4f;
  poly = fp_add(fp_mul(poly, r), 1.3981999507e-3f);
  poly = fp_add(fp_mul(poly, r), 8.3334519073e-3f);
  poly = fp_add(fp_mul(poly, r), 4.1665795894e-2f);
  poly = fp_add(fp_mul(poly, r), 1.6666665459e-1f);
  poly = fp_add(fp_mul(poly, r), 5.0000001201e-1f);
  const float y = fp_add(fp_add(fp_mul(poly, fp_mul(r, r)), r), 1.0f);
  const int32_t e = static_cast<int32_t>(n);  // in [-159, 0]
  const int32_t e1 = e > -125 ? e : -125;     // y * 2^e1 stays normal: exact
  return fp_mul(fp_mul(y, bits_float(static_cast<uint32_t>(e1 + 127) << 23)),
                bits_float(static_cast<uint32_t>(e - e1 + 127) << 23));  // one rounding if subnormal
}

// log(x) for x > 0 finite, about 1 ulp (Cephes logf: x = m 2^e with m in [sqrt(1/2),
// sqrt(2)), a degree-9 polynomial in m - 1), without contraction: the same bits on both
// backends (the keyed stream's exponentials use it).
VERISPEC_HD inline float log_reduced(float x) {
  uint32_t b = float_bits(x);
  int32_t e = static_cast<int32_t>(b >> 23) - 126;  // x = m 2^e, m in [0.5, 1)
  if ((b >> 23) == 0) {                              // subnormal: normalise first
    b = float_bits(fp_mul(x, 16777216.0f));          // * 2^24: exact
    e = static_cast<int32_t>(b >> 23) - 126 - 24;
  }
  float m = bits_float((b & 0x007fffffu) | 0x3f000000u);
  if (m < 0.707106781186547524f) {
    m = fp_add(m, m);  // exact
    e -= 1;
  }
  const float f = fp_sub(m, 1.0f);  // exact (Sterbenz)
  const float z = fp_mul(f, f);
  float poly = 7.0376836292e-2f;
  poly = fp_add(fp_mul(poly, f), -1.1514610310e-1f);
  poly = fp_add(fp_mul(poly, f), 1.1676998740e-1f);
  poly = fp_add(fp_mul(poly, f), -1.2420140846e-1f);
  poly = fp_add(fp_mul(poly, f), 1.4249322787e-1f);
  poly = fp_add(fp_mul(poly, f), -1.6668057665e-1f);
  poly = fp_add(fp_mul(poly, f), 2.0000714765e-1f);
  poly = fp_add(fp_mul(poly, f), -2.4999993993e-1f);
  poly = fp_add(fp_mul(poly, f), 3.3333331174e-1f);
  const float fe = static_cast<float>(e);
  float y = fp_mul(fp_mul(poly, f), z);
  y = fp_add(y, fp_mul(fe, -2.12194440e-4f));
  y = fp_sub(y, fp_mul(0.5f, z));
  return fp_add(fp_add(f, y), fp_mul(fe, 0.693359375f));
}

// The softmax exponent (l - max) / T of logit l (T > 0), clamped to [-110, 0]: the
// weight is 0 below -104 anyway, and the clamp maps masked logits (-Inf) there too.
VERISPEC_HD inline float softmax_exponent(float l, float row_max, float temperature) {
  const float x = (l - row_max) / temperature;
  return x > -110.0f ? x : -110.0f;
}

// exp(x) for any x <= 0 (-Inf included).
VERISPEC_HD inline float exp_nonpositive(float x) { return exp_reduced(x > -110.0f ? x : -110.0f); }

// Unnormalised softmax weight of logit l: exp((l - max) / T), in [0, 1].
VERISPEC_HD inline float softmax_weight(float l, float row_max, float temperature) {
  return exp_reduced(softmax_exponent(l, row_max, temperature));
}

// ---- the softmax normaliser, in tiles ----------------------------------------------------
// The normaliser Z of a row's softmax weights w_i = exp((l_i - max) / T) is read in one
// pass over the logits on the device: the row is cut into fixed tiles of kStatsTile values
// ([t * kStatsTile, (t + 1) * kStatsTile), whatever the block count), and a tile needs only
// its own maximum m_t to sum its weights, so no second pass waits for the row's maximum:
//
//   S_t = sum over the tile of fixed_weight(exp((l_i - m_t) / T))        (integers)
//   Z   = sum over tiles of floor(S_t * F_t / 2^40),  F_t = fixed_weight(exp((m_t - max) / T))
//
// Every term is an integer computed from the tile alone and the row's maximum, so any
// split of the row, any block and the CPU's loop give the same Z to the bit. Z differs
// from sum_i fixed_weight(w_i) by rounding only (at most one unit per tile and value,
// 2^-40 each); the probabilities stay w_i / Z (the weight of the maximum is exactly 1, so
// the largest probability is 1 / Z).
constexpr int kStatsTile = 1024;
constexpr int64_t kMaxStatsTiles = kMaxVocab / kStatsTile;

VERISPEC_HD inline int64_t stats_tiles(int64_t vocab) {
  return (vocab + kStatsTile - 1) / kStatsTile;
}

// floor(sum * scale / 2^40) for a tile sum below 2^51 and a scale at most 2^40 (the
// product stays below 2^91): exact 128-bit arithmetic on both backends.
VERISPEC_HD inline uint64_t fixed_rescale(uint64_t sum, uint64_t scale) {
#if defined(__CUDA_ARCH__)
  const uint64_t hi = __umul64hi(sum, scale);
  const uint64_t lo = sum * scale;
  return (hi << (64 - kFixedBits)) | (lo >> kFixedBits);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(sum) * scale) >> kFixedBits);
#endif
}

// A tile's term of Z: its sum S_t (weights against its maximum m_t) scaled to the row's
// maximum. A tile of masked logits only (m_t = -Inf) adds 0.
VERISPEC_HD inline uint64_t tile_norm_term(uint64_t tile_sum, float tile_max, float row_max,
                                           float temperature) {
  return fixed_rescale(tile_sum, fixed_weight(softmax_weight(tile_max, row_max, temperature)));
}

// top-p keeps the largest threshold t with mass{p >= t} >= top_p * survivor_mass, masses
// in fixed point: mass_at_least(mass, top_p, survivor_mass).

// min-p keeps p >= min_p * max p.
VERISPEC_HD inline float min_p_threshold(float min_p, float max_prob) { return min_p * max_prob; }

// Which filters are active (disabled values are no-ops, not errors).
VERISPEC_HD inline bool top_k_active(int32_t top_k, int64_t vocab) {
  return top_k > 0 && top_k < vocab;
}
VERISPEC_HD inline bool top_p_active(float top_p) { return top_p < 1.0f; }
VERISPEC_HD inline bool min_p_active(float min_p) { return min_p > 0.0f; }

// Valid parameter ranges; each test is written so that NaN fails it. The one definition
// of the ranges: policy_rules.h words them for error messages and checks host-side
// arguments with these, and every layer above (decoder, bindings, Python) asks it.
VERISPEC_HD inline bool temperature_valid(float t) { return t >= 0.0f && is_finite(t); }
VERISPEC_HD inline bool top_k_valid(int32_t k) { return k >= 0; }
VERISPEC_HD inline bool top_p_valid(float p) { return p > 0.0f && p <= 1.0f; }
VERISPEC_HD inline bool min_p_valid(float p) { return p >= 0.0f && p <= 1.0f; }

// The first out-of-range argument of a policy, in the order temperature (0), top_k (1),
// top_p (2), min_p (3) (ops.h's PolicyField), or -1 when all are valid. Host checks and
// per-row kernel checks both report this one.
VERISPEC_HD inline int32_t first_invalid_policy_field(float temperature, int32_t top_k,
                                                      float top_p, float min_p) {
  if (!temperature_valid(temperature)) return 0;
  if (!top_k_valid(top_k)) return 1;
  if (!top_p_valid(top_p)) return 2;
  if (!min_p_valid(min_p)) return 3;
  return -1;
}

// Argmax order: larger value first, ties to the lower index.
VERISPEC_HD inline bool argmax_before(float a, int64_t ia, float b, int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// ---- keyed sampling (exponential race) ----------------------------------------------

// A keyed sample draws token i of weights w with the exponentials E_i of the keyed
// stream (philox.h race_exponential): token = argmax over w_i > 0 of (w_i / max w) / E_i,
// ties to the lower index. P(token = i) = w_i / sum(w) (the exponential race, i.e. the
// Gumbel-max trick). Two weight vectors raced with the same E (the same request seed and
// position) pick the same token with probability >= (1 - TV) / (1 + TV), TV their total
// variation distance (Gumbel-max coupling): the drafter-invariant acceptance rule of
// keyed verification rests on it. `scaled_w` is w_i / max w, in (0, 1].
VERISPEC_HD inline float race_score(float scaled_w, float e) { return scaled_w / e; }

// The Exp(1) variate of one keyed-stream word (philox.h): -log(u), u = (top 23 bits + 1/2)
// / 2^23, exact in float32 and in [2^-24, 1 - 2^-24]: never 0 or 1, so E is in
// [5.96e-8, 16.7], never 0 or infinite. log_reduced: the same bits on both backends.
VERISPEC_HD inline float race_exponential(uint32_t word) {
  const float u = (static_cast<float>(word >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -log_reduced(u);
}

// The smallest value race_exponential returns (the word 0xffffffff): every keyed-stream
// exponential is >= it (log_reduced is monotone on the 2^23 values u takes), which bounds
// the score a token can reach in a race.
VERISPEC_HD inline float race_min_exponential() { return race_exponential(0xffffffffu); }

// ---- speculative acceptance -------------------------------------------------------

// Accept proposal y, drawn from q, against target p with coin u in [0, 1):
// P(accept) = min(1, p(y) / q(y)). For a deterministic (one-hot) proposal q(y) = 1.
VERISPEC_HD inline bool accept_draft(float u, float p_y, float q_y) { return u * q_y < p_y; }

// Residual weight max(p - q, 0) of one token; for one-hot drafts q = [i == y].
VERISPEC_HD inline float residual_weight(float p, float q) {
  const float d = p - q;
  return d > 0.0f ? d : 0.0f;
}

// The roundoff rule: sample the residual only when its mass is meaningful.
VERISPEC_HD inline bool residual_usable(float residual_mass) {
  return residual_mass >= kResidualEps;
}

// ---- tree verification (sampled children) --------------------------------------------
// Siblings are tried in node order against r (r = p at first): child c with token x is
// accepted iff u * q_i(x) < r(x); after a rejection r becomes norm(max(r - q_i, 0))
// (p when that mass is < kResidualEps). With replacement q_i = q; without, q_i is q with
// the earlier siblings' tokens removed and renormalised: q_i(x) = q(x) / remaining,
// remaining = 1 - (sum of q over the removed tokens), summed in float in node order.

// q_i(x) of a sibling without replacement (x not removed): q(x) / remaining; 0 once no
// mass remains (no sibling can then have been drawn).
VERISPEC_HD inline float renormalised_q(float q_x, float remaining) {
  return remaining > 0.0f ? q_x / remaining : 0.0f;
}

// ---- block verification (Sun et al., arXiv 2403.10444) ------------------------------
// A chain y_1..y_n drawn from q_0..q_{n-1}; p_0..p_n the target's distributions.
//   weights  w_0 = 1, w_i = min(1, w_{i-1} * p_{i-1}(y_i) / q_{i-1}(y_i))
//   h_i      = R_i / (R_i + 1 - w_i) for 1 <= i < n, R_i = sum_x max(w_i p_i(x) - q_i(x), 0);
//            h_n = w_n
//   tau      = the largest i in [1, n] with eta_i < h_i, else 0  (eta_i: ACCEPT coin i - 1)
//   emit y_1..y_tau, then a token from p_n if tau == n, else from
//   norm(max(w_tau p_tau - q_tau, 0)) (roundoff rule: p_tau).

// w_i from w_{i-1} and the proposal's p(y), q(y). q(y) = 0 with p(y) > 0 gives 1, as the
// token-wise test accepts it; p(y) = 0 gives 0.
VERISPEC_HD inline float block_weight(float w_prev, float p_y, float q_y) {
  const float num = w_prev * p_y;
  if (!(num > 0.0f)) return 0.0f;
  if (num >= q_y) return 1.0f;
  return num / q_y;
}

// One token's weight of the block residual max(w p - q, 0).
VERISPEC_HD inline float block_residual_weight(float w, float p, float q) {
  return residual_weight(w * p, q);
}

// h_i = R / (R + 1 - w): the chance that prefix i is kept as the end of the accepted
// block given that no longer prefix is; 1 where R = 0 and w = 1 (q = p past a prefix of
// full weight: every later h is then 1 as well).
VERISPEC_HD inline float block_keep_probability(float residual_mass, float w) {
  const float denom = residual_mass + (1.0f - w);
  return denom > 0.0f ? residual_mass / denom : 1.0f;
}

// eta_i < h_i keeps prefix i (P = h_i).
VERISPEC_HD inline bool block_keep(float eta, float h) { return eta < h; }

// ---- inverse CDF ------------------------------------------------------------------------

// The exact inverse-CDF pick over n fixed-point weights W(i) (W: callable int64_t ->
// uint64_t) given target < sum W (draw_target): the smallest i whose running sum passes
// the target. Returns -1 only if target >= the sum (no weight: the caller's zero-mass case).
template <typename WeightFn>
VERISPEC_HD inline int64_t pick_fixed(const WeightFn& w, int64_t n, uint64_t target) {
  uint64_t running = 0;
  for (int64_t i = 0; i < n; ++i) {
    running += w(i);
    if (running > target) return i;
  }
  return -1;
}

}  // namespace verispec
