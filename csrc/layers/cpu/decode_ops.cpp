// The small per-layer ops of a decoder step (verispec/layers/decode_ops.h).
//
// Each op is written once, as plain loops over fixed 16-lane accumulators, and compiled
// for AVX-512, AVX2 and baseline x86-64 (the bodies are inlined into three entry points
// with different target attributes, and the compiler vectorizes the lane loops). The
// lanes fix the order of every sum, this file is compiled with -ffp-contract=off (no
// fused multiply-add), and exp is one polynomial, so every path computes the same bits.
#include "verispec/layers/decode_ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "linear_tiles.h"
#include "verispec/layers/norm.h"

#if defined(__x86_64__) || defined(_M_X64)
#define VERISPEC_X86 1
#include <immintrin.h>
#endif

#define VERISPEC_INLINE inline __attribute__((always_inline))

namespace verispec {
namespace {

constexpr int kLanes = 16;

// exp(x): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2 split in a part with few
// bits, so n * kLn2Hi is exact, and the rest), e^r by a degree-7 polynomial (the
// classic Cephes expf coefficients), times 2^n built in the exponent bits.
VERISPEC_INLINE float exp_poly(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * kLog2e + kRound) - kRound;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Sum of the 16 lanes, halving: lanes l and l + w added for w = 8, 4, 2, 1.
VERISPEC_INLINE float lane_sum(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// a . b over n: element i in lane i % 16, lanes summed by lane_sum.
VERISPEC_INLINE float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  return lane_sum(acc);
}

#if VERISPEC_X86
// dot() with the 16 lanes in registers: the same products, sums and halving, so the same
// bits (a horizontal sum of a lane array costs the loop form ~30 scalar operations and
// store-to-load round trips per dot: most of an attention call).
__attribute__((target("avx512f,avx2"))) VERISPEC_INLINE float dot_avx512(const float* a, const float* b,
                                                                         int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_mask_add_ps(acc, m, acc,
                             _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
  }
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// The same with the lanes as two 256-bit halves (lanes 0..7, 8..15).
__attribute__((target("avx2"))) VERISPEC_INLINE float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  for (int l = 0; i + l < n; ++l) lanes[l] += a[i + l] * b[i + l];
  const __m256 s8 = _mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

// scores[g * ld + j] = (q_g . k_j) * scale for query heads g < nq (rows of q, d apart) and
// the keys j < keys at k_pool + (slots[j] * nkv + kvh + g / group) * d: query head g reads
// KV head kvh + g / group (a call of one KV head's query heads: nq <= group).
#define VERISPEC_SCORES(suffix, target_attr, dot_fn)                                          \
  target_attr void scores_##suffix(const float* q, const float* k_pool, const int64_t* slots,  \
                                   int64_t keys, int64_t nkv, int64_t kvh, int64_t d,          \
                                   int64_t nq, int64_t group, float scale, float* scores,      \
                                   int64_t ld) {                                               \
    for (int64_t g = 0; g < nq; ++g)                                                           \
      for (int64_t j = 0; j < keys; ++j)                                                       \
        scores[g * ld + j] =                                                                   \
            dot_fn(q + g * d, k_pool + (slots[j] * nkv + kvh + g / group) * d, d) * scale;     \
  }

// out[g] = sum_j p[g * ldp + j] * v_j (j < keys in order, from 0, or with `accumulate`
// from out[g] as it is: the sum over earlier keys, so keys in several calls add up to
// the same bits) for g < nq, v_j at v_pool + (slots[j] * nkv + kvh) * d: plain loops (the
// compiler vectorizes over the d elements).
VERISPEC_INLINE void values_loops(const float* p, int64_t ldp, const float* v_pool,
                                  const int64_t* slots, int64_t keys, int64_t nkv, int64_t kvh,
                                  int64_t d, int64_t nq, int64_t group, float* out,
                                  bool accumulate) {
  if (!accumulate)
    for (int64_t i = 0; i < nq * d; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t g = 0; g < nq; ++g) {
      const float* v = v_pool + (slots[j] * nkv + kvh + g / group) * d;
      const float pj = p[g * ldp + j];
      float* o = out + g * d;
      for (int64_t i = 0; i < d; ++i) o[i] += pj * v[i];
    }
  }
}

VERISPEC_SCORES(portable, , dot)
void values_portable(const float* p, int64_t ldp, const float* v_pool, const int64_t* slots,
                     int64_t keys, int64_t nkv, int64_t kvh, int64_t d, int64_t nq, int64_t group,
                     float* out, bool accumulate) {
  values_loops(p, ldp, v_pool, slots, keys, nkv, kvh, d, nq, group, out, accumulate);
}
#if VERISPEC_X86
VERISPEC_SCORES(avx2, __attribute__((target("avx2"))), dot_avx2)
__attribute__((target("avx2"))) void values_avx2(const float* p, int64_t ldp, const float* v_pool,
                                                 const int64_t* slots, int64_t keys, int64_t nkv,
                                                 int64_t kvh, int64_t d, int64_t nq, int64_t group,
                                                 float* out, bool accumulate) {
  values_loops(p, ldp, v_pool, slots, keys, nkv, kvh, d, nq, group, out, accumulate);
}

// AVX-512 with d = 16 C (C = 4, 8: head sizes 64 and 128): q's and the output rows stay in
// registers across the keys (the loop forms keep them in memory, and each key's sum then
// waits on the last key's store). The same operations in the same order as the loops.
template <int C>
__attribute__((target("avx512f,avx2"))) VERISPEC_INLINE float score_avx512(const __m512* qv,
                                                                        const float* k) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) acc = _mm512_add_ps(acc, _mm512_mul_ps(qv[c], _mm512_loadu_ps(k + 16 * c)));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// The 16 keys' sums of acc[0..15] as score_avx512 reduces each one (lanes l and l + w
// added for w = 8, 4, 2, 1), computed across the registers: each stage adds the halves of
// two registers at once, so 16 keys take 15 additions instead of 64 (the same pairs, so
// the same bits). Returns the sums in key order.
__attribute__((target("avx512f,avx2"))) VERISPEC_INLINE __m512 reduce16_avx512(const __m512* acc) {
  __m512 s1[8], s2[4], s3[2];
  for (int m = 0; m < 8; ++m)  // 256-bit half h of s1[m]: key 2m + h, lanes i + (i + 8)
    s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0xEE));
  for (int n = 0; n < 4; ++n)  // 128-bit lane L of s2[n]: key 4n + L, lanes i + (i + 4)
    s2[n] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * n], s1[2 * n + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * n], s1[2 * n + 1], 0xDD));
  for (int n = 0; n < 2; ++n)  // lane L: keys 8n + L (floats 0, 1), 8n + 4 + L (2, 3)
    s3[n] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * n], s2[2 * n + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * n], s2[2 * n + 1], 0xEE));
  // float 4 L + i: key L + 4 i
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88),
                                 _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// The keys 16 at a time, each query head's 16 sums (its q in registers) as score_avx512
// forms them, reduced together (reduce16_avx512); the last keys one by one. The key blocks
// are the outer loop: a call of several KV heads (a decode token's item) reads each key's
// heads where they lie side by side in its slot, one run of nq / group * d floats, instead
// of one head's d floats a slot apart (8 KB at 32 KV heads of 64) per pass over the keys.
template <int C>
__attribute__((target("avx512f,avx2"))) void scores_avx512_d(const float* q, const float* k_pool,
                                                             const int64_t* slots, int64_t keys,
                                                             int64_t nkv, int64_t kvh, int64_t nq,
                                                             int64_t group, float scale,
                                                             float* scores, int64_t ld) {
  constexpr int64_t d = 16 * C;
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t heads_kv = (nq + group - 1) / group;  // the KV heads the call reads
  int64_t j = 0;
  for (; j + 16 <= keys; j += 16) {
    if (j + 32 <= keys)  // the next 16 keys: on their way from memory meanwhile
      for (int u = 16; u < 32; ++u) {
        const float* k = k_pool + (slots[j + u] * nkv + kvh) * d;
        for (int64_t c = 0; c < heads_kv * C; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(k + 16 * c), _MM_HINT_T1);
      }
    for (int64_t g = 0; g < nq; ++g) {
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + g * d + 16 * c);
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) {
        const float* k = k_pool + (slots[j + u] * nkv + kvh + g / group) * d;
        acc[u] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
          acc[u] = _mm512_add_ps(acc[u], _mm512_mul_ps(qv[c], _mm512_loadu_ps(k + 16 * c)));
      }
      _mm512_storeu_ps(scores + g * ld + j, _mm512_mul_ps(reduce16_avx512(acc), vscale));
    }
  }
  for (int64_t g = 0; g < nq; ++g) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + g * d + 16 * c);
    for (int64_t jj = j; jj < keys; ++jj)
      scores[g * ld + jj] = score_avx512<C>(qv, k_pool + (slots[jj] * nkv + kvh + g / group) * d) * scale;
  }
}

// G query heads at a time (16 registers of sums), so a key's G * C sums are independent.
// Query heads of several KV heads (a decode token's item): the keys outer, each
// key's heads where they lie in its slot, the outputs accumulating in memory (L1): the same
// sums in the same order per head as the register form below.
template <int C>
__attribute__((target("avx512f,avx2"))) void values_avx512_keys(const float* p, int64_t ldp,
                                                                const float* v_pool,
                                                                const int64_t* slots, int64_t keys,
                                                                int64_t nkv, int64_t kvh, int64_t nq,
                                                                int64_t group, float* out,
                                                                bool accumulate) {
  constexpr int64_t d = 16 * C;
  const int64_t heads_kv = (nq + group - 1) / group;
  if (!accumulate)
    for (int64_t i = 0; i < nq * d; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
  for (int64_t j = 0; j < keys; ++j) {
    if (j + 8 < keys) {  // 8 keys ahead: on its way from memory meanwhile
      const float* v = v_pool + (slots[j + 8] * nkv + kvh) * d;
      for (int64_t c = 0; c < heads_kv * C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(v + 16 * c), _MM_HINT_T1);
    }
    for (int64_t g = 0; g < nq; ++g) {
      const float* v = v_pool + (slots[j] * nkv + kvh + g / group) * d;
      const __m512 pj = _mm512_set1_ps(p[g * ldp + j]);
      float* o = out + g * d;
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(_mm512_loadu_ps(o + 16 * c),
                                                   _mm512_mul_ps(pj, _mm512_loadu_ps(v + 16 * c))));
    }
  }
}

template <int C>
__attribute__((target("avx512f,avx2"))) void values_avx512_d(const float* p, int64_t ldp,
                                                             const float* v_pool,
                                                             const int64_t* slots, int64_t keys,
                                                             int64_t nkv, int64_t kvh, int64_t nq,
                                                             int64_t group, float* out,
                                                             bool accumulate) {
  constexpr int64_t d = 16 * C;
  constexpr int G = 16 / C;
  if (nq > group)  // several KV heads
    return values_avx512_keys<C>(p, ldp, v_pool, slots, keys, nkv, kvh, nq, group, out, accumulate);
  for (int64_t g0 = 0; g0 < nq; g0 += G) {
    const int ng = static_cast<int>(std::min<int64_t>(G, nq - g0));
    __m512 o[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        o[g][c] = accumulate && g < ng ? _mm512_loadu_ps(out + (g0 + g) * d + 16 * c)
                                       : _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      if (j + 8 < keys)  // 8 keys ahead: on its way from memory meanwhile
        for (int c = 0; c < C; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(v_pool + (slots[j + 8] * nkv + kvh) * d + 16 * c), _MM_HINT_T0);
      const float* v = v_pool + (slots[j] * nkv + kvh) * d;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int g = 0; g < G; ++g) {
        if (g >= ng) break;
        const __m512 pj = _mm512_set1_ps(p[(g0 + g) * ldp + j]);
        for (int c = 0; c < C; ++c) o[g][c] = _mm512_add_ps(o[g][c], _mm512_mul_ps(pj, vv[c]));
      }
    }
    for (int g = 0; g < ng; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (g0 + g) * d + 16 * c, o[g][c]);
  }
}

__attribute__((target("avx512f,avx2"))) void scores_avx512(const float* q, const float* k_pool,
                                                           const int64_t* slots, int64_t keys,
                                                           int64_t nkv, int64_t kvh, int64_t d,
                                                           int64_t nq, int64_t group, float scale,
                                                           float* scores, int64_t ld) {
  if (d == 64) return scores_avx512_d<4>(q, k_pool, slots, keys, nkv, kvh, nq, group, scale, scores, ld);
  if (d == 128) return scores_avx512_d<8>(q, k_pool, slots, keys, nkv, kvh, nq, group, scale, scores, ld);
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t j = 0; j < keys; ++j)
      scores[g * ld + j] =
          dot_avx512(q + g * d, k_pool + (slots[j] * nkv + kvh + g / group) * d, d) * scale;
}

__attribute__((target("avx512f,avx2"))) void values_avx512(const float* p, int64_t ldp,
                                                           const float* v_pool,
                                                           const int64_t* slots, int64_t keys,
                                                           int64_t nkv, int64_t kvh, int64_t d,
                                                           int64_t nq, int64_t group, float* out,
                                                           bool accumulate) {
  if (d == 64) return values_avx512_d<4>(p, ldp, v_pool, slots, keys, nkv, kvh, nq, group, out, accumulate);
  if (d == 128) return values_avx512_d<8>(p, ldp, v_pool, slots, keys, nkv, kvh, nq, group, out, accumulate);
  values_loops(p, ldp, v_pool, slots, keys, nkv, kvh, d, nq, group, out, accumulate);
}
#endif
#undef VERISPEC_SCORES
using ScoresFn = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float*, int64_t);
using ValuesFn = void (*)(const float*, int64_t, const float*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float*, bool);

// ---- RoPE and the cache write ----------------------------------------------------------

VERISPEC_INLINE void rope_row(const float* x, const float* c, const float* s, int64_t d, float* y) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + x[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

VERISPEC_INLINE void rope_kv_body(const RopeKvArgs& a) {
  const int64_t d = a.head_dim, nh = a.num_heads, nkv = a.num_kv_heads;
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* row = a.qkv + t * a.ldqkv;
    if (a.positions[t] < 0) {  // padding (slot < 0, checked): a zero query, nothing written
      std::memset(a.q_out + t * nh * d, 0, static_cast<size_t>(nh * d) * sizeof(float));
      continue;
    }
    const float* c = a.cos + a.positions[t] * d;
    const float* s = a.sin + a.positions[t] * d;
    for (int64_t h = 0; h < nh; ++h) rope_row(row + h * d, c, s, d, a.q_out + (t * nh + h) * d);
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < nkv; ++h)
      rope_row(row + (nh + h) * d, c, s, d, a.k_pool + (slot * nkv + h) * d);
    std::memcpy(a.v_pool + slot * nkv * d, row + (nh + nkv) * d,
                static_cast<size_t>(nkv * d) * sizeof(float));
  }
}

// ---- attention -----------------------------------------------------------------------

// Keys are taken in chunks of kKeyChunk by their index in the token's key list: a token
// with more keys than that attends each chunk on its own (its scores' maximum m_c, the
// sum s_c of their exponentials, the weighted values o_c) and the chunks are merged in
// chunk order (merge_chunks), so a long context's chunks can run on different threads
// and the bits still depend only on the token's query and keys. With at most kKeyChunk
// keys there is one chunk: the plain softmax, unchanged.
constexpr int64_t kKeyChunk = 512;

// Keys a several-token item takes at a time, for all its tokens and heads: their K (or V)
// rows stay in the L1 cache while each query reads them. Divides kKeyChunk.
constexpr int64_t kKeyTile = 64;

inline int64_t key_chunks(int64_t keys) { return (keys + kKeyChunk - 1) / kKeyChunk; }

// The first key a token at position p sees: keys at positions <= p - window are out of
// the window (window 0: none is).
inline int64_t window_first(int64_t p, int64_t window) {
  return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

// One work item: tokens t0..t1 - 1 of one row, query heads h0..h0 + nq - 1 (all of one
// KV head). Several tokens only for a chain row without a window, whose tokens see the
// row's keys 0..positions[t]: the item reads each key once for all of them. c1 > 0: a
// single token's key chunks c0..c1 - 1 only (their partial results go to the job's
// partials, merged after every item has run).
struct AttentionItem {
  int64_t t0, t1, h0, nq;
  int64_t c0 = 0, c1 = 0;
};

struct AttentionJob {
  const PagedAttentionArgs* a;
  std::vector<int64_t> token_row;  // [tokens]: the row of each token
  // The cache slot of each of a row's keys 0..context_lens[row] - 1, the rows one after
  // another (row b's from row_slot_start[b]): worked out once a call, not per token and
  // head (an integer division a key).
  std::vector<int64_t> row_slots;
  std::vector<int64_t> row_slot_start;  // [rows]
  std::vector<AttentionItem> items;
  // Tokens whose chunks are cut across items: part_start[t] >= 0, their chunks' o_c
  // [nch][num_heads][head_dim] from part_o[part_start[t] * head_dim] and m_c, s_c
  // [nch][num_heads] from part_m / part_s[part_start[t]].
  std::vector<int64_t> part_start, part_chunks;
  std::vector<float> part_o, part_m, part_s;
  int parts;
  void (*item_fn)(const AttentionJob&, const AttentionItem&);
};

// sg[j] = exp(sg[j] - m) for j < keys (>= 1), m = max_j sg[j] (written to *max); returns
// their sum, in 16 lanes (lane l: keys l, l + 16, ... in order) then halving (lane_sum).
VERISPEC_INLINE float exp_scores(float* sg, int64_t keys, float* max) {
  // The largest score, as m = sg[j] > m ? sg[j] : m from m = sg[0] in order would find
  // it, in 16 lanes (the same value, a zero's sign aside, which no exp below sees).
  float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = sg[0];
  int64_t jm = 0;
  for (; jm + kLanes <= keys; jm += kLanes)
    for (int l = 0; l < kLanes; ++l) lane_max[l] = sg[jm + l] > lane_max[l] ? sg[jm + l] : lane_max[l];
  for (; jm < keys; ++jm) lane_max[0] = sg[jm] > lane_max[0] ? sg[jm] : lane_max[0];
  float m = lane_max[0];
  for (int l = 1; l < kLanes; ++l) m = lane_max[l] > m ? lane_max[l] : m;
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= keys; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      sg[j + l] = exp_poly(sg[j + l] - m);
      acc[l] += sg[j + l];
    }
  for (int l = 0; j + l < keys; ++l) {
    sg[j + l] = exp_poly(sg[j + l] - m);
    acc[l] += sg[j + l];
  }
  *max = m;
  return lane_sum(acc);
}

// The weight of each of nch chunks (maxima m[c * stride]): w_c = exp(m_c - max_c m_c),
// into w[c]; returns sum_c w_c s_c in chunk order (s[c * stride]).
VERISPEC_INLINE float chunk_weights(const float* m, const float* s, int64_t nch, int64_t stride,
                                    float* w) {
  float top = m[0];
  for (int64_t c = 1; c < nch; ++c) top = m[c * stride] > top ? m[c * stride] : top;
  float sum = 0.0f;
  for (int64_t c = 0; c < nch; ++c) {
    w[c] = exp_poly(m[c * stride] - top);
    sum = c == 0 ? w[c] * s[0] : sum + w[c] * s[c * stride];
  }
  return sum;
}

// out[i] = w_0 o_0[i], then + w_c o_c[i] for c = 1, 2, ... (in this order, one chunk at a
// time: merge_into(out, o_c, w_c, c == 0)).
VERISPEC_INLINE void merge_into(float* out, const float* o, float w, bool first, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = first ? w * o[i] : out[i] + w * o[i];
}

// A several-token item (a chain row: token t sees keys 0..positions[t], none when it is
// padding, position < 0). Each score, sum and output is what attend_body computes for the
// token alone: the same operations in the same order, the keys taken a tile at a time
// (the outputs accumulate across a chunk's tiles in key order).
template <ScoresFn Scores, ValuesFn Values>
VERISPEC_INLINE void attend_tokens_body(const AttentionJob& job, const AttentionItem& it) {
  const PagedAttentionArgs& a = *job.a;
  const int64_t d = a.head_dim, nh = a.num_heads, nkv = a.num_kv_heads;
  const int64_t kvh = it.h0 / (nh / nkv), nq = it.nq, nt = it.t1 - it.t0;
  const int64_t* slots = job.row_slots.data() + job.row_slot_start[job.token_row[it.t0]];
  auto keys_of = [&](int64_t t) { return a.positions[t] < 0 ? int64_t{0} : a.positions[t] + 1; };
  int64_t ld = 0;
  for (int64_t t = it.t0; t < it.t1; ++t) ld = std::max(ld, keys_of(t));
  const int64_t max_chunks = std::max<int64_t>(1, key_chunks(ld));
  thread_local std::vector<float> scratch, sums, maxima, weights, chunk_out;
  if (static_cast<int64_t>(scratch.size()) < nt * nq * ld)
    scratch.resize(static_cast<size_t>(nt * nq * ld));
  sums.resize(static_cast<size_t>(nt * nq * max_chunks));    // [nt, nq, chunk]: s_c
  maxima.resize(static_cast<size_t>(nt * nq * max_chunks));  // m_c
  weights.resize(static_cast<size_t>(nt * nq * max_chunks)); // w_c
  if (max_chunks > 1) chunk_out.resize(static_cast<size_t>(nt * nq * d));  // o_c of the chunk
  auto scores_of = [&](int64_t t) { return scratch.data() + (t - it.t0) * nq * ld; };  // [nq, ld]
  auto out_of = [&](int64_t t) { return a.out + t * nh * d + it.h0 * d; };            // [nq, d]
  auto at = [&](int64_t t, int64_t g) { return ((t - it.t0) * nq + g) * max_chunks; };
  for (int64_t j0 = 0; j0 < ld; j0 += kKeyTile)
    for (int64_t t = it.t0; t < it.t1; ++t) {
      const int64_t nk = std::min(keys_of(t), j0 + kKeyTile) - j0;
      if (nk > 0)
        Scores(a.q + t * nh * d + it.h0 * d, a.k_pool, slots + j0, nk, nkv, kvh, d, nq, nh / nkv,
               a.scale, scores_of(t) + j0, ld);
    }
  for (int64_t t = it.t0; t < it.t1; ++t) {
    const int64_t keys = keys_of(t), nch = key_chunks(keys);
    for (int64_t g = 0; g < nq; ++g) {
      const int64_t i = at(t, g);
      for (int64_t c = 0; c < nch; ++c)
        sums[i + c] = exp_scores(scores_of(t) + g * ld + c * kKeyChunk,
                                 std::min(keys, (c + 1) * kKeyChunk) - c * kKeyChunk, &maxima[i + c]);
      if (nch > 1) sums[i] = chunk_weights(&maxima[i], &sums[i], nch, 1, &weights[i]);
    }
  }
  for (int64_t j0 = 0; j0 < ld; j0 += kKeyTile)
    for (int64_t t = it.t0; t < it.t1; ++t) {
      const int64_t keys = keys_of(t), nk = std::min(keys, j0 + kKeyTile) - j0;
      if (nk <= 0) continue;
      if (key_chunks(keys) == 1) {
        Values(scores_of(t) + j0, ld, a.v_pool, slots + j0, nk, nkv, kvh, d, nq, nh / nkv, out_of(t),
               j0 > 0);
        continue;
      }
      float* o = chunk_out.data() + (t - it.t0) * nq * d;
      Values(scores_of(t) + j0, ld, a.v_pool, slots + j0, nk, nkv, kvh, d, nq, nh / nkv, o,
             j0 % kKeyChunk > 0);
      const int64_t c = j0 / kKeyChunk;
      if (j0 + nk == std::min(keys, (c + 1) * kKeyChunk))  // the chunk's last tile
        for (int64_t g = 0; g < nq; ++g)
          merge_into(out_of(t) + g * d, o + g * d, weights[at(t, g) + c], c == 0, d);
    }
  for (int64_t t = it.t0; t < it.t1; ++t) {
    float* out = out_of(t);
    for (int64_t g = 0; g < nq; ++g)
      for (int64_t i = 0; i < d; ++i)
        out[g * d + i] = keys_of(t) > 0 ? out[g * d + i] / sums[at(t, g)] : 0.0f;
  }
}

template <ScoresFn Scores, ValuesFn Values>
VERISPEC_INLINE void attend_body(const AttentionJob& job, const AttentionItem& it) {
  if (it.t1 - it.t0 > 1) return attend_tokens_body<Scores, Values>(job, it);
  const PagedAttentionArgs& a = *job.a;
  const int64_t d = a.head_dim, nh = a.num_heads, nkv = a.num_kv_heads;
  const int64_t group = nh / nkv, t = it.t0, h0 = it.h0, nq = it.nq;
  const int64_t kvh = h0 / group, row = job.token_row[t];
  float* out = a.out + t * nh * d + h0 * d;  // [nq, d]
  if (a.tree_mask == nullptr && a.positions[t] < 0) {  // padding: sees nothing, outputs zeros
    for (int64_t i = 0; i < nq * d; ++i) out[i] = 0.0f;
    return;
  }
  const int64_t* row_slots = job.row_slots.data() + job.row_slot_start[row];
  // The slots of the keys the token sees, in cache order: 0..positions[t], or with a
  // tree mask the keys before the row's new tokens and the new tokens the mask allows.
  thread_local std::vector<int64_t> tree_slots;
  thread_local std::vector<float> scratch, local_o, local_m, local_s, weights;
  const int64_t ctx = a.context_lens[row];
  const int64_t p = a.positions[t];
  const int64_t first = window_first(p, a.window);
  const int64_t* slots = row_slots + first;
  int64_t keys = p + 1 - first;
  if (a.tree_mask != nullptr) {
    const int64_t start = a.query_start[row], n = a.query_start[row + 1] - start;
    const uint8_t* mask = a.tree_mask + t * a.tokens + start;
    tree_slots.assign(row_slots + first, row_slots + (ctx - n > first ? ctx - n : first));
    for (int64_t u = 0; u < n; ++u)
      if (mask[u] && a.positions[start + u] >= first) tree_slots.push_back(row_slots[ctx - n + u]);
    slots = tree_slots.data();
    keys = static_cast<int64_t>(tree_slots.size());
  }
  if (keys == 0) {  // a tree mask that hides everything, itself included: nothing to attend
    for (int64_t i = 0; i < nq * d; ++i) out[i] = 0.0f;
    return;
  }
  const int64_t nch = key_chunks(keys), nk_max = std::min(keys, kKeyChunk);
  if (static_cast<int64_t>(scratch.size()) < nq * nk_max)
    scratch.resize(static_cast<size_t>(nq * nk_max));
  float* scores = scratch.data();  // [nq, keys of the chunk]
  const float* q = a.q + t * nh * d + h0 * d;
  if (nch == 1) {
    Scores(q, a.k_pool, slots, keys, nkv, kvh, d, nq, group, a.scale, scores, keys);
    float sums[64], top;  // nq <= 64: one KV head's group (<= 64, checked) or wide_heads
    for (int64_t g = 0; g < nq; ++g) sums[g] = exp_scores(scores + g * keys, keys, &top);
    Values(scores, keys, a.v_pool, slots, keys, nkv, kvh, d, nq, group, out, false);
    for (int64_t g = 0; g < nq; ++g)
      for (int64_t i = 0; i < d; ++i) out[g * d + i] = out[g * d + i] / sums[g];
    return;
  }
  // Several chunks: each one's o_c, m_c, s_c ([chunk][head]), into the job's partials
  // (chunks c0..c1 - 1 of a cut token, all its heads there) or here (all of them).
  const bool cut = it.c1 > 0;
  const int64_t c0 = cut ? it.c0 : 0, c1 = cut ? it.c1 : nch, heads = cut ? nh : nq;
  const int64_t h_base = cut ? h0 : 0;
  float *po, *pm, *ps;
  if (cut) {
    const int64_t base = job.part_start[t];
    po = const_cast<float*>(job.part_o.data()) + base * d;
    pm = const_cast<float*>(job.part_m.data()) + base;
    ps = const_cast<float*>(job.part_s.data()) + base;
  } else {
    local_o.resize(static_cast<size_t>(nch * nq * d));
    local_m.resize(static_cast<size_t>(nch * nq));
    local_s.resize(static_cast<size_t>(nch * nq));
    po = local_o.data();
    pm = local_m.data();
    ps = local_s.data();
  }
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t j0 = c * kKeyChunk, nk = std::min(keys, j0 + kKeyChunk) - j0;
    Scores(q, a.k_pool, slots + j0, nk, nkv, kvh, d, nq, group, a.scale, scores, nk);
    for (int64_t g = 0; g < nq; ++g) {
      const int64_t i = c * heads + h_base + g;
      ps[i] = exp_scores(scores + g * nk, nk, &pm[i]);
    }
    Values(scores, nk, a.v_pool, slots + j0, nk, nkv, kvh, d, nq, group, po + (c * heads + h_base) * d,
           false);
  }
  if (cut) return;  // merged by merge_cut_tokens
  weights.resize(static_cast<size_t>(nch));
  for (int64_t g = 0; g < nq; ++g) {
    const float sum = chunk_weights(pm + g, ps + g, nch, nq, weights.data());
    float* o = out + g * d;
    for (int64_t c = 0; c < nch; ++c) merge_into(o, po + (c * nq + g) * d, weights[c], c == 0, d);
    for (int64_t i = 0; i < d; ++i) o[i] = o[i] / sum;
  }
}

// The heads of the tokens whose chunks were cut across items, merged as attend_body
// merges an uncut token's.
void merge_cut_tokens(AttentionJob& job) {
  const PagedAttentionArgs& a = *job.a;
  const int64_t d = a.head_dim, nh = a.num_heads;
  std::vector<float> weights;
  for (int64_t t = 0; t < a.tokens; ++t) {
    if (job.part_start[t] < 0) continue;
    const int64_t nch = job.part_chunks[t], base = job.part_start[t];
    weights.resize(static_cast<size_t>(nch));
    for (int64_t h = 0; h < nh; ++h) {
      const float sum = chunk_weights(job.part_m.data() + base + h, job.part_s.data() + base + h,
                                      nch, nh, weights.data());
      float* o = a.out + (t * nh + h) * d;
      for (int64_t c = 0; c < nch; ++c)
        merge_into(o, job.part_o.data() + (base + c * nh + h) * d, weights[c], c == 0, d);
      for (int64_t i = 0; i < d; ++i) o[i] = o[i] / sum;
    }
  }
}

VERISPEC_INLINE void silu_mul_body(const float* gu, int64_t rows, int64_t inter, int64_t ld,
                                   float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * ld;
    const float* u = g + inter;
    float* o = out + r * ldo;
    for (int64_t i = 0; i < inter; ++i) o[i] = (g[i] / (1.0f + exp_poly(-g[i]))) * u[i];
  }
}

// ---- the entry points per instruction set -------------------------------------------

#define VERISPEC_ISA_FNS(suffix, target_attr)                                              \
  target_attr void rope_kv_##suffix(const RopeKvArgs& a) { rope_kv_body(a); }               \
  target_attr void attend_##suffix(const AttentionJob& j, const AttentionItem& item) {      \
    attend_body<scores_##suffix, values_##suffix>(j, item);                                 \
  }                                                                                         \
  target_attr void silu_mul_##suffix(const float* gu, int64_t rows, int64_t inter,          \
                                     int64_t ld, float* out, int64_t ldo) {                 \
    silu_mul_body(gu, rows, inter, ld, out, ldo);                                           \
  }
VERISPEC_ISA_FNS(portable, )
#if VERISPEC_X86
VERISPEC_ISA_FNS(avx512, __attribute__((target("avx512f,avx2"))))
VERISPEC_ISA_FNS(avx2, __attribute__((target("avx2"))))
#endif
#undef VERISPEC_ISA_FNS

struct IsaFns {
  void (*rope_kv)(const RopeKvArgs&);
  void (*attend)(const AttentionJob&, const AttentionItem&);
  void (*silu_mul)(const float*, int64_t, int64_t, int64_t, float*, int64_t);
};

// The functions of `isa` (kAuto: the best this CPU runs; an ISA it lacks: nullptr).
const IsaFns* fns_for(LinearIsa isa) {
  static const IsaFns portable{&rope_kv_portable, &attend_portable, &silu_mul_portable};
#if VERISPEC_X86
  static const IsaFns avx512{&rope_kv_avx512, &attend_avx512, &silu_mul_avx512};
  static const IsaFns avx2{&rope_kv_avx2, &attend_avx2, &silu_mul_avx2};
#endif
  if (!linear_isa_supported(isa)) return nullptr;
  switch (linear_detail::resolve_isa(isa)) {
#if VERISPEC_X86
    case LinearIsa::kAvx512:
      return &avx512;
    case LinearIsa::kAvx2:
      return &avx2;
#endif
    default:
      return &portable;
  }
}

std::string isa_error(LinearIsa isa) {
  return std::string("isa ") + linear_isa_name(isa) + " is not supported on this CPU";
}

void attend_part(void* ctx, int part) {
  const AttentionJob& job = *static_cast<const AttentionJob*>(ctx);
  const int64_t items = static_cast<int64_t>(job.items.size());
  for (int64_t item = part; item < items; item += job.parts) job.item_fn(job, job.items[item]);
}

// Below this many multiply-adds (scores and values) an attention call runs on one
// thread: waking the team costs more than the work (a decode token over ~100 keys).
constexpr int64_t kMinParallelWork = int64_t{1} << 17;

std::string check_attention(const PagedAttentionArgs& a) {
  const std::string in = "paged_attention: ";
  if (a.tokens < 1 || a.rows < 1 || a.head_dim < 1 || a.num_kv_heads < 1 || a.num_heads < 1)
    return in + "tokens, rows, head_dim, num_heads and num_kv_heads must be >= 1, got " +
           std::to_string(a.tokens) + ", " + std::to_string(a.rows) + ", " +
           std::to_string(a.head_dim) + ", " + std::to_string(a.num_heads) + ", " +
           std::to_string(a.num_kv_heads);
  if (a.num_heads % a.num_kv_heads || a.num_heads / a.num_kv_heads > 64)
    return in + "num_heads must be a multiple of num_kv_heads, at most 64 times it, got " +
           std::to_string(a.num_heads) + " and " + std::to_string(a.num_kv_heads);
  if (a.window < 0) return in + "window must be >= 0 (0: none), got " + std::to_string(a.window);
  if (a.block_size < 1 || a.table_width < 0 || (a.rows > 1 && a.table_stride < a.table_width))
    return in + "block_size must be >= 1 and table_stride >= table_width, got " +
           std::to_string(a.block_size) + ", " + std::to_string(a.table_stride) + ", " +
           std::to_string(a.table_width);
  if (!a.q || !a.k_pool || !a.v_pool || !a.out || !a.query_start || !a.positions ||
      !a.context_lens || !a.block_tables)
    return in + "null data pointer";
  if (a.query_start[0] != 0 || a.query_start[a.rows] != a.tokens)
    return in + "query_start must rise from 0 to tokens = " + std::to_string(a.tokens) +
           ", got " + std::to_string(a.query_start[0]) + " .. " +
           std::to_string(a.query_start[a.rows]);
  for (int64_t b = 0; b < a.rows; ++b) {
    if (a.query_start[b + 1] < a.query_start[b])
      return in + "query_start must not fall, row " + std::to_string(b) + ": " +
             std::to_string(a.query_start[b]) + " > " + std::to_string(a.query_start[b + 1]);
    const int64_t ctx = a.context_lens[b];
    const int64_t blocks = (ctx + a.block_size - 1) / a.block_size;
    if (ctx < 0 || blocks > a.table_width)
      return in + "row " + std::to_string(b) + "'s context_lens must be in [0, " +
             std::to_string(a.table_width * a.block_size) + "] (its block table), got " +
             std::to_string(ctx);
    const int32_t* table = a.block_tables + b * a.table_stride;
    for (int64_t i = 0; i < blocks; ++i)
      if (table[i] < 0 || (static_cast<int64_t>(table[i]) + 1) * a.block_size > a.num_slots)
        return in + "row " + std::to_string(b) + "'s block " + std::to_string(i) +
               " must be in [0, " + std::to_string(a.num_slots / a.block_size) + "), got " +
               std::to_string(table[i]);
    const int64_t n = a.query_start[b + 1] - a.query_start[b];
    if (a.tree_mask != nullptr && n > ctx)
      return in + "row " + std::to_string(b) + " has " + std::to_string(n) +
             " new tokens but context_lens " + std::to_string(ctx);
    for (int64_t t = a.query_start[b]; t < a.query_start[b + 1]; ++t)
      if (a.positions[t] >= ctx || a.positions[t] < (a.tree_mask == nullptr ? -1 : 0))
        return in + "token " + std::to_string(t) + " (row " + std::to_string(b) +
               ") must have a position in [0, context_lens = " + std::to_string(ctx) +
               ") (or -1: padding), got " + std::to_string(a.positions[t]);
  }
  return "";
}

}  // namespace

float decode_exp(float x) { return exp_poly(x); }

namespace {

std::string check_rope(const RopeKvArgs& a) {
  const std::string in = "rope_kv_write: ";
  if (fns_for(a.isa) == nullptr) return in + isa_error(a.isa);
  if (a.tokens < 0 || a.head_dim < 2 || a.head_dim % 2 || a.num_heads < 1 || a.num_kv_heads < 1)
    return in + "tokens must be >= 0, head_dim even and >= 2, heads >= 1; got tokens " +
           std::to_string(a.tokens) + ", head_dim " + std::to_string(a.head_dim) + ", heads " +
           std::to_string(a.num_heads) + " / " + std::to_string(a.num_kv_heads);
  if (a.tokens > 1 && a.ldqkv < (a.num_heads + 2 * a.num_kv_heads) * a.head_dim)
    return in + "ldqkv must cover a row of q, k and v, got " + std::to_string(a.ldqkv);
  if (a.tokens == 0) return "";
  if (!a.qkv || !a.positions || !a.cos || !a.sin || !a.slots || !a.k_pool || !a.v_pool || !a.q_out)
    return in + "null data pointer";
  for (int64_t t = 0; t < a.tokens; ++t) {
    if (a.positions[t] >= a.max_position || (a.positions[t] < 0 && (a.positions[t] != -1 ||
                                                                     a.slots[t] >= 0)))
      return in + "positions[" + std::to_string(t) + "] must be in [0, " +
             std::to_string(a.max_position) + ") (or -1 with slot -1: padding), got " +
             std::to_string(a.positions[t]) + " with slot " + std::to_string(a.slots[t]);
    if (a.slots[t] >= a.num_slots)
      return in + "slots[" + std::to_string(t) + "] must be < num_slots = " +
             std::to_string(a.num_slots) + ", got " + std::to_string(a.slots[t]);
  }
  return "";
}

}  // namespace

std::string rope_kv_write_f32(const RopeKvArgs& a) {
  std::string error = check_rope(a);
  if (!error.empty() || a.tokens == 0) return error;
  fns_for(a.isa)->rope_kv(a);
  return "";
}

std::string paged_attention_f32(const PagedAttentionArgs& a) {
  const IsaFns* fns = fns_for(a.isa);
  if (fns == nullptr) return "paged_attention: " + isa_error(a.isa);
  std::string error = check_attention(a);
  if (!error.empty() || a.check_only) return error;
  AttentionJob job;
  job.a = &a;
  job.token_row.resize(static_cast<size_t>(a.tokens));
  job.row_slot_start.resize(static_cast<size_t>(a.rows));
  int64_t work = 0;
  for (int64_t b = 0; b < a.rows; ++b) {
    const int64_t n = a.query_start[b + 1] - a.query_start[b];
    const bool skip = a.max_queries > 0 && n > a.max_queries;
    job.row_slot_start[b] = static_cast<int64_t>(job.row_slots.size());
    if (!skip) {  // blocks 0..ceil(ctx / bs) - 1 of the row's table (checked against the pools)
      const int64_t ctx = a.context_lens[b], bs = a.block_size;
      const int32_t* table = a.block_tables + b * a.table_stride;
      for (int64_t j0 = 0; j0 < ctx; j0 += bs) {
        const int64_t base = static_cast<int64_t>(table[j0 / bs]) * bs;
        for (int64_t j = j0; j < ctx && j < j0 + bs; ++j) job.row_slots.push_back(base + j - j0);
      }
    }
    for (int64_t t = a.query_start[b]; t < a.query_start[b + 1]; ++t) {
      job.token_row[t] = skip ? -1 : b;
      const int64_t keys = a.tree_mask != nullptr ? a.context_lens[b] : a.positions[t] + 1;  // >= 0
      if (!skip) work += keys * a.num_heads * a.head_dim * 2;
    }
  }
  const int threads = a.num_threads < 1 ? 1 : a.num_threads;
  const int64_t group = a.num_heads / a.num_kv_heads, nkv = a.num_kv_heads;
  // A chain row of several tokens (no tree mask, no window) is cut into items of a KV
  // head and a run of its tokens: as few runs as give the team two items a thread, so
  // each key is read once for the run's tokens and the KV head's query heads. Any other
  // token makes items of its own: its KV head (the query heads share each key read), or,
  // when that gives the team fewer items than threads, a query head. (share_keys false:
  // every token its own items, a query head each below two items a thread, no chunk
  // cut across items.)
  auto several = [&](int64_t b) {
    const int64_t n = a.query_start[b + 1] - a.query_start[b];
    return a.share_keys && n > 1 && a.tree_mask == nullptr && a.window == 0 &&
           !(a.max_queries > 0 && n > a.max_queries);
  };
  int64_t chain_units = 0;
  for (int64_t b = 0; b < a.rows; ++b)
    if (several(b)) chain_units += nkv;
  const int64_t runs_wanted =
      chain_units == 0 ? 1 : std::max<int64_t>(1, (2 * threads + chain_units - 1) / chain_units);
  const int64_t heads_per_item = a.tokens * nkv >= (a.share_keys ? 1 : 2) * threads ? group : 1;
  // A token takes several KV heads an item, as many as still give the team two items a
  // thread (at most 64 query heads): its keys' heads lie side by side in each slot, so the
  // item reads one run a slot instead of one head's d floats a slot apart (a 1.7B-shaped
  // decode token: 4 items of 8 KV heads, 2 KB a slot, instead of 32 of 256 bytes). Each
  // head's sums are the same whatever heads share its item, and so are a long context's
  // chunks (their partials are kept per head).
  const int64_t kv_wide = std::clamp<int64_t>(a.tokens * nkv / (2 * threads), 1,
                                              std::min<int64_t>(nkv, 64 / group));
  const int64_t wide_heads = heads_per_item == group ? kv_wide * group : heads_per_item;
  for (int64_t b = 0; b < a.rows; ++b) {
    const int64_t start = a.query_start[b], n = a.query_start[b + 1] - start;
    if (a.max_queries > 0 && n > a.max_queries) continue;  // skipped: its outputs untouched
    if (several(b)) {
      const int64_t runs = std::min(n, runs_wanted);
      for (int64_t r = 0; r < runs; ++r)
        for (int64_t h = 0; h < nkv; ++h)
          job.items.push_back({start + n * r / runs, start + n * (r + 1) / runs, h * group, group});
    } else {
      for (int64_t t = start; t < start + n; ++t)
        for (int64_t h0 = 0; h0 < a.num_heads; h0 += wide_heads)
          job.items.push_back({t, t + 1, h0, std::min(wide_heads, a.num_heads - h0)});
    }
  }
  if (job.items.empty()) return "";
  // Fewer items than two a thread (a decode token or a few over long contexts): the key
  // chunks of a chain token are cut across items, as many pieces as that takes.
  job.part_start.assign(static_cast<size_t>(a.tokens), -1);
  job.part_chunks.assign(static_cast<size_t>(a.tokens), 0);
  const int64_t uncut = static_cast<int64_t>(job.items.size());
  bool any_cut = false;
  if (a.share_keys && uncut < 2 * threads && work >= kMinParallelWork) {
    const int64_t pieces_wanted = (2 * threads + uncut - 1) / uncut;
    std::vector<AttentionItem> items;
    int64_t total = 0;
    for (const AttentionItem& it : job.items) {
      const int64_t t = it.t0;
      const int64_t nch = it.t1 - it.t0 == 1 && a.tree_mask == nullptr && a.positions[t] >= 0
                              ? key_chunks(a.positions[t] + 1 - window_first(a.positions[t], a.window))
                              : 1;
      const int64_t pieces = std::min(nch, pieces_wanted);
      if (pieces < 2) {
        items.push_back(it);
        continue;
      }
      if (job.part_start[t] < 0) {
        job.part_start[t] = total;
        job.part_chunks[t] = nch;
        total += nch * a.num_heads;
      }
      for (int64_t piece = 0; piece < pieces; ++piece)
        items.push_back({t, t + 1, it.h0, it.nq, nch * piece / pieces, nch * (piece + 1) / pieces});
      any_cut = true;
    }
    job.items.swap(items);
    job.part_o.resize(static_cast<size_t>(total * a.head_dim));
    job.part_m.resize(static_cast<size_t>(total));
    job.part_s.resize(static_cast<size_t>(total));
  }
  const int64_t items = static_cast<int64_t>(job.items.size());
  job.parts = work < kMinParallelWork ? 1 : static_cast<int>(std::min<int64_t>(threads, items));
  job.item_fn = fns->attend;
  linear_detail::run_parallel(job.parts, &attend_part, &job, /*own_threads=*/false);
  if (any_cut) merge_cut_tokens(job);
  return "";
}

std::string write_attend_f32(const WriteAttendArgs& w) {
  const PagedAttentionArgs& in = w.attention;
  const int64_t t_count = in.tokens, d = in.head_dim;
  if (!w.q.data || !w.k.data || !w.v.data || !w.slots || !w.k_pool || !w.v_pool)
    return "write_attend: null data pointer";
  for (int64_t t = 0; t < t_count; ++t)
    if (w.slots[t] >= in.num_slots)
      return "write_attend: token " + std::to_string(t) + "'s slot must be < num_slots = " +
             std::to_string(in.num_slots) + " (or < 0: no write), got " +
             std::to_string(w.slots[t]);
  PagedAttentionArgs a = in;
  a.k_pool = w.k_pool;
  a.v_pool = w.v_pool;
  thread_local std::vector<float> rows;  // the queries as [tokens, num_heads head_dim]
  if (rows.size() < static_cast<size_t>(t_count * in.num_heads * d + 1))
    rows.resize(static_cast<size_t>(t_count * in.num_heads * d + 1));
  a.q = rows.data();
  a.check_only = true;
  std::string error = paged_attention_f32(a);
  if (!error.empty()) return "write_attend: " + error;
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t h = 0; h < in.num_heads; ++h)
      std::memcpy(rows.data() + (t * in.num_heads + h) * d,
                  w.q.data + h * w.q.head_stride + t * w.q.token_stride, sizeof(float) * d);
    const int64_t s = w.slots[t];
    if (s < 0) continue;
    for (int64_t h = 0; h < in.num_kv_heads; ++h) {
      std::memcpy(w.k_pool + (s * in.num_kv_heads + h) * d,
                  w.k.data + h * w.k.head_stride + t * w.k.token_stride, sizeof(float) * d);
      std::memcpy(w.v_pool + (s * in.num_kv_heads + h) * d,
                  w.v.data + h * w.v.head_stride + t * w.v.token_stride, sizeof(float) * d);
    }
  }
  a.check_only = false;
  return paged_attention_f32(a);
}

namespace {

// One group of heads: out[h, t] = x[h, t] * cos[t] + rotate_half(x[h, t]) * sin[t].
void rotate_half_heads(const StridedHeads& x, int64_t heads, const RotateHalfArgs& a,
                       float* out) {
  const int64_t d = a.head_dim, half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < a.tokens; ++t) {
      const float* in = x.data + h * x.head_stride + t * x.token_stride;
      const float* c = a.cos + t * a.cs_stride;
      const float* s = a.sin + t * a.cs_stride;
      float* o = out + (h * a.tokens + t) * d;
      for (int64_t i = 0; i < half; ++i) o[i] = in[i] * c[i] + (-in[i + half]) * s[i];
      for (int64_t i = half; i < d; ++i) o[i] = in[i] * c[i] + in[i - half] * s[i];
    }
  }
}

}  // namespace

std::string rotate_half_rope_f32(const RotateHalfArgs& a) {
  if (a.tokens < 0 || a.head_dim < 2 || a.head_dim % 2 || a.num_heads < 1 || a.num_kv_heads < 1 ||
      (a.tokens > 1 && a.cs_stride < a.head_dim))
    return "rotate_half_rope: tokens must be >= 0, head_dim even and >= 2, heads >= 1 and the "
           "cos/sin row stride >= head_dim; got tokens " + std::to_string(a.tokens) +
           ", head_dim " + std::to_string(a.head_dim) + ", heads " +
           std::to_string(a.num_heads) + " / " + std::to_string(a.num_kv_heads) +
           ", row stride " + std::to_string(a.cs_stride);
  if (a.tokens == 0) return "";
  if (!a.q.data || !a.k.data || !a.cos || !a.sin || !a.q_out || !a.k_out)
    return "rotate_half_rope: null data pointer";
  rotate_half_heads(a.q, a.num_heads, a, a.q_out);
  rotate_half_heads(a.k, a.num_kv_heads, a, a.k_out);
  return "";
}

std::string silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, int64_t ld,
                         float* out, int64_t ldo, LinearIsa isa) {
  const IsaFns* fns = fns_for(isa);
  if (fns == nullptr) return "silu_mul: " + isa_error(isa);
  if (rows < 0 || inter < 1 || (rows > 1 && (ld < 2 * inter || ldo < inter)))
    return "silu_mul: rows must be >= 0, inter >= 1, ld >= 2 inter and ldo >= inter, got rows " +
           std::to_string(rows) + ", inter " + std::to_string(inter) + ", ld " +
           std::to_string(ld) + ", ldo " + std::to_string(ldo);
  if (rows > 0 && (!gate_up || !out)) return "silu_mul: null data pointer";
  fns->silu_mul(gate_up, rows, inter, ld, out, ldo);
  return "";
}

}  // namespace verispec

namespace verispec {
namespace {

// y [m, n] = x [m, k] . w^T, part by part into column slices of y.
std::string quant_product(const QuantMatrixRef& w, const float* x, int64_t m, float* y,
                          int threads, QuantArith arith) {
  int64_t n0 = 0;
  for (int p = 0; p < w.parts; ++p) {
    QuantLinearArgs a;
    a.x = x;
    a.w = w.data[p];
    a.y = y + n0;
    a.m = m;
    a.n = w.rows[p];
    a.k = w.k;
    a.ldx = w.k;
    a.ldw = w.ldw[p];
    a.layout = w.layout[p];
    a.ldy = w.n;
    a.type = w.type[p];
    a.num_threads = threads;
    a.arith = arith;
    std::string error = quant_linear_f32(a);
    if (!error.empty()) return error;
    n0 += w.rows[p];
  }
  return "";
}

std::string check_matrix(const QuantMatrixRef& w, int64_t n, int64_t k, const char* name,
                         int64_t layer) {
  int64_t rows = 0;
  for (int p = 0; p < w.parts; ++p) rows += w.rows[p];
  if (w.parts < 1 || w.parts > QuantMatrixRef::kMaxParts || w.n != n || w.k != k || rows != n)
    return "decode_layers: layer " + std::to_string(layer) + "'s " + name + " must be [" +
           std::to_string(n) + ", " + std::to_string(k) + "] in 1.." +
           std::to_string(QuantMatrixRef::kMaxParts) + " parts, got [" + std::to_string(w.n) +
           " (" + std::to_string(rows) + " in parts), " + std::to_string(w.k) + "] in " +
           std::to_string(w.parts);
  return "";
}

}  // namespace

std::string decode_layers_f32(const DecodeLayersArgs& a) {
  const int64_t t = a.tokens, hidden = a.hidden, inter = a.inter;
  const int64_t nh = a.rope.num_heads, nkv = a.rope.num_kv_heads, d = a.rope.head_dim;
  const int64_t qkv_n = (nh + 2 * nkv) * d;
  if (t < 1 || hidden < 1 || inter < 1 || a.num_layers < 1 || !a.x || !a.layers || !a.k_pools ||
      !a.v_pools)
    return "decode_layers: tokens, hidden, inter and num_layers must be >= 1 and the pointers "
           "set";
  if (a.attention.num_heads != nh || a.attention.num_kv_heads != nkv || a.attention.head_dim != d ||
      a.rope.tokens != t || a.attention.tokens != t)
    return "decode_layers: rope and attention must agree on tokens and heads";
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const QuantLayerRef& w = a.layers[l];
    if (!w.attn_norm || !w.mlp_norm || !a.k_pools[l] || !a.v_pools[l])
      return "decode_layers: layer " + std::to_string(l) + ": null norm or pool";
    for (const std::string& error :
         {check_matrix(w.wqkv, qkv_n, hidden, "wqkv", l), check_matrix(w.wo, hidden, nh * d, "wo", l),
          check_matrix(w.gate_up, 2 * inter, hidden, "gate_up", l),
          check_matrix(w.down, hidden, inter, "down", l)})
      if (!error.empty()) return error;
  }
  std::vector<float> h(t * hidden), qkv(t * qkv_n), q(t * nh * d), att(t * nh * d),
      delta(t * hidden), gu(t * 2 * inter), act(t * inter);
  // The indices, checked once (layer 0's pools stand for all: one slot count).
  RopeKvArgs rope = a.rope;
  rope.qkv = qkv.data();
  rope.ldqkv = qkv_n;
  rope.q_out = q.data();
  rope.k_pool = a.k_pools[0];
  rope.v_pool = a.v_pools[0];
  PagedAttentionArgs attention = a.attention;
  attention.q = q.data();
  attention.out = att.data();
  attention.k_pool = a.k_pools[0];
  attention.v_pool = a.v_pools[0];
  attention.check_only = true;
  std::string error = check_rope(rope);
  if (error.empty()) error = paged_attention_f32(attention);
  if (!error.empty()) return error;
  attention.check_only = false;
  error = rms_norm_f32(a.x, t, hidden, hidden, a.layers[0].attn_norm, a.eps, h.data(), hidden);
  for (int64_t l = 0; l < a.num_layers && error.empty(); ++l) {
    const QuantLayerRef& w = a.layers[l];
    rope.k_pool = a.k_pools[l];
    rope.v_pool = a.v_pools[l];
    attention.k_pool = a.k_pools[l];
    attention.v_pool = a.v_pools[l];
    error = quant_product(w.wqkv, h.data(), t, qkv.data(), a.num_threads, a.arith);
    if (error.empty()) fns_for(rope.isa)->rope_kv(rope);
    if (error.empty()) error = paged_attention_f32(attention);
    if (error.empty()) error = quant_product(w.wo, att.data(), t, delta.data(), a.num_threads, a.arith);
    if (error.empty())
      error = add_rms_norm_f32(a.x, t, hidden, hidden, delta.data(), hidden, w.mlp_norm, a.eps,
                               h.data(), hidden);
    if (error.empty()) error = quant_product(w.gate_up, h.data(), t, gu.data(), a.num_threads, a.arith);
    if (error.empty()) error = silu_mul_f32(gu.data(), t, inter, 2 * inter, act.data(), inter);
    if (error.empty()) error = quant_product(w.down, act.data(), t, delta.data(), a.num_threads, a.arith);
    if (!error.empty()) break;
    if (l + 1 < a.num_layers) {
      error = add_rms_norm_f32(a.x, t, hidden, hidden, delta.data(), hidden,
                               a.layers[l + 1].attn_norm, a.eps, h.data(), hidden);
    } else {
      for (int64_t i = 0; i < t * hidden; ++i) a.x[i] += delta[i];
    }
  }
  return error.empty() ? "" : "decode_layers: " + error;
}

}  // namespace verispec
