// The int8 arithmetic of quant_linear_f32 (verispec/layers/quant.h, QuantArith::kInt8): each row
// of x is quantized to int8 per block of 32 (row-local: a row's int8 values do not depend
// on the other rows), each 32-weight block's quants are unpacked to 8-bit integers in
// registers, and their products with x's int8 values are summed exactly in int32 lanes
// (VNNI vpdpbusd on AVX-512 VNNI and AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2, plain C++
// on the rest). The float part is one fixed sequence (quant.h, "int8 arithmetic"), the
// same on every instruction set: integers are exact, so every path computes the same bits.
// This file: x's quantization, the scalar path and the dispatch; the vector paths are
// quant_int8_{vnni512,avxvnni,avx2}.cpp (quant_int8_body.inc compiled once per
// instruction set, each its own translation unit so that a build compiles them in
// parallel).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "linear_tiles.h"
#include "quant_int8_internal.h"
#include "quant_internal.h"
#include "verispec/layers/quant.h"

#if defined(__x86_64__) || defined(_M_X64)
#define VERISPEC_X86 1
#include <immintrin.h>
#endif

namespace verispec {
namespace quant_detail {
namespace {

// v rounded to the nearest integer, ties to even (|v| <= 127.5 here).
inline int round_even(float v) {
#if VERISPEC_X86
  return _mm_cvtss_si32(_mm_set_ss(v));  // the default rounding mode: to nearest even
#else
  return static_cast<int>(std::nearbyint(v));
#endif
}

// One block of 32: amax = max |x|; dx = amax / 127; q = round-to-nearest-even(x * (127 /
// amax)) (in [-127, 127]); a zero block has dx = 0 and q = 0. Non-finite values give
// dx = NaN (so the row's outputs are NaN) and q = 0. Plain scalar code: max, the two
// divisions, the multiply and the rounding are each correctly rounded, so any
// vectorization of it computes the same values.
void quantize_block(const float* x, int8_t* q, float* dx) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && std::isfinite(a);
    amax = a > amax ? a : amax;
  }
  if (!finite || amax == 0.0f) {
    std::memset(q, 0, 32);
    *dx = finite ? 0.0f : std::nanf("");
    return;
  }
  const float inv = 127.0f / amax;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(round_even(x[i] * inv));
  *dx = amax / 127.0f;
}

#if VERISPEC_X86
// quantize_block and the block's two half sums with 512-bit vectors: the same max (exact
// in any order; a non-finite value is caught first, as there), the same division, the same
// products and the same rounding (vcvtps2dq in the default mode, as _mm_cvtss_si32), so
// the same bits. x's quantization runs on the calling thread before each product (a
// 1.7B-shaped decode token: ~100 of them, 8192 values the largest).
__attribute__((target("avx512f,avx512bw"))) void quantize_block_avx512(const float* x, int8_t* q,
                                                                         float* dx, int32_t* lo,
                                                                         int32_t* hi) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
  const __m512 top = _mm512_set1_ps(std::numeric_limits<float>::max());
  const bool finite = _mm512_cmp_ps_mask(a0, top, _CMP_LE_OQ) == 0xFFFF &&
                      _mm512_cmp_ps_mask(a1, top, _CMP_LE_OQ) == 0xFFFF;
  const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.0f;
  if (!finite || amax == 0.0f) {
    std::memset(q, 0, 32);
    *dx = finite ? 0.0f : std::nanf("");
    *lo = *hi = 0;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  // The int8 is the int32's low byte, as static_cast<int8_t> takes it: the same in
  // [-127, 127], and for a product that overflows to +-inf (amax subnormal: 127 / amax is
  // inf) the conversion's 0x80000000 gives 0 either way. The sums are of those bytes.
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  *lo = _mm512_reduce_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(q0, 24), 24));
  *hi = _mm512_reduce_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24));
  *dx = amax / 127.0f;
}
#endif

void quantize_x(const QuantLinearArgs& a, QuantX* out, bool avx512) {
  out->m = a.m;
  out->blocks = a.k / 32;
  const size_t nb = static_cast<size_t>(a.m * out->blocks);
  if (out->q.size() < 32 * nb) out->q.resize(32 * nb);
  if (out->s.size() < nb) {
    for (auto* v : {&out->s, &out->slo, &out->shi}) v->resize(nb);
    out->dx.resize(nb);
    out->sf.resize(nb);
  }
  for (int64_t r = 0; r < a.m; ++r)
    for (int64_t b = 0; b < out->blocks; ++b) {
      const size_t i = static_cast<size_t>(r * out->blocks + b);
      int8_t* q = out->q.data() + 32 * i;
      int32_t lo = 0, hi = 0;
#if VERISPEC_X86
      if (avx512) {
        quantize_block_avx512(a.x + r * a.ldx + 32 * b, q, &out->dx[i], &lo, &hi);
      } else
#endif
      {
        quantize_block(a.x + r * a.ldx + 32 * b, q, &out->dx[i]);
        for (int e = 0; e < 16; ++e) {
          lo += q[e];
          hi += q[e + 16];
        }
      }
      out->s[i] = lo + hi;
      out->sf[i] = static_cast<float>(lo + hi);
      out->slo[i] = lo;
      out->shi[i] = hi;
    }
}

// ---- weights: one block of 32 as 8-bit integers -----------------------------------------
//
// For a row's 32-weight block b: u[32] the quants (unsigned; Q8_0, IQ4_NL: signed), the
// offset o (the block's integer product is sum u q - o * sum q: quant_offset), the
// multipliers (Q6_K, Q2_K, Q3_K: the sub-scales of elements 0..15 and 16..31; else 1), the float scale
// ws (x's block scale is multiplied by it once) and the min coefficient wc (Q4_1, Q5_1: m;
// Q4_K, Q5_K: -(dmin * min); times dx it multiplies the sum of x's block).
// Q2_K: the min's integer is min_lo * (sum of x's values 0..15) + min_hi * (16..31); else
// min_lo = min_hi = 1 (the block's sum).
struct WBlock {
  int32_t offset = 0, mul_lo = 1, mul_hi = 1, min_lo = 1, min_hi = 1;
  float ws = 0.0f, wc = 0.0f;
};

// The scalars of block b; `u` (when not null) gets the 32 quants.
inline WBlock decode_block(QuantType type, const uint8_t* row, int64_t b, uint8_t* u) {
  WBlock w;
  w.offset = quant_offset(type);
  switch (type) {
    case QuantType::kF16:
    case QuantType::kBF16: return w;  // the float arithmetic only (quant_linear_f32)
    case QuantType::kQ8_0: {
      const uint8_t* s = row + 34 * b;
      w.ws = half_to_float(s);
      if (u) std::memcpy(u, s + 2, 32);
      return w;
    }
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kIQ4_NL: {
      const bool q41 = type == QuantType::kQ4_1;
      const uint8_t* s = row + block_bytes(type) * b;
      w.ws = half_to_float(s);
      if (q41) w.wc = half_to_float(s + 2);
      if (u) {
        const uint8_t* q = s + (q41 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
          u[i] = q[i] & 0x0F;
          u[i + 16] = q[i] >> 4;
        }
        if (type == QuantType::kIQ4_NL)
          for (int i = 0; i < 32; ++i) u[i] = static_cast<uint8_t>(kIq4nlValues[u[i]]);
      }
      return w;
    }
    case QuantType::kQ5_0:
    case QuantType::kQ5_1: {
      const uint8_t* s = row + block_bytes(type) * b;
      w.ws = half_to_float(s);
      if (type == QuantType::kQ5_1) w.wc = half_to_float(s + 2);
      if (u) {
        const uint32_t qh = load_u32(s + q5_high_bits_at(type));
        const uint8_t* q = s + q5_nibbles_at(type);
        for (int i = 0; i < 16; ++i) {
          u[i] = static_cast<uint8_t>((q[i] & 0x0F) | (((qh >> i) & 1) << 4));
          u[i + 16] = static_cast<uint8_t>((q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
      }
      return w;
    }
    case QuantType::kQ2_K: {
      const uint8_t* s = row + 84 * (b / 8);
      const int j = static_cast<int>(b % 8);
      w.ws = half_to_float(s + 80);
      w.wc = -half_to_float(s + 82);
      w.mul_lo = s[2 * j] & 0x0F;
      w.mul_hi = s[2 * j + 1] & 0x0F;
      w.min_lo = s[2 * j] >> 4;
      w.min_hi = s[2 * j + 1] >> 4;
      if (u) {
        const uint8_t* q = s + 16 + 32 * (j / 4);
        for (int l = 0; l < 32; ++l) u[l] = static_cast<uint8_t>((q[l] >> (2 * (j % 4))) & 3);
      }
      return w;
    }
    case QuantType::kQ3_K: {
      const uint8_t* s = row + 110 * (b / 8);
      const int j = static_cast<int>(b % 8);
      w.ws = half_to_float(s + 108);
      w.mul_lo = q3k_scale(s + 96, 2 * j);
      w.mul_hi = q3k_scale(s + 96, 2 * j + 1);
      if (u)
        for (int l = 0; l < 32; ++l) u[l] = static_cast<uint8_t>(q3k_quant(s, j, l));
      return w;
    }
    case QuantType::kIQ4_XS: {
      const uint8_t* s = row + 136 * (b / 8);
      const int j = static_cast<int>(b % 8);
      // exact: a half times an integer of 6 bits
      w.ws = half_to_float(s) * static_cast<float>(iq4xs_scale(load_u16(s + 2), load_u32(s + 4), j));
      if (u) {
        const uint8_t* q = s + 8 + 16 * j;
        for (int i = 0; i < 16; ++i) {
          u[i] = static_cast<uint8_t>(kIq4nlValues[q[i] & 0x0F]);
          u[i + 16] = static_cast<uint8_t>(kIq4nlValues[q[i] >> 4]);
        }
      }
      return w;
    }
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: {
      const bool five = type == QuantType::kQ5_K;
      const uint8_t* s = row + (five ? 176 : 144) * (b / 8);
      const int j = static_cast<int>(b % 8);
      int sc, mn;
      scale_min_k4(s + 4, j, &sc, &mn);
      w.ws = half_to_float(s) * static_cast<float>(sc);        // exact: 11 x 6 bits
      w.wc = -(half_to_float(s + 2) * static_cast<float>(mn));  // exact
      if (u) {
        const uint8_t* q = s + (five ? 48 : 16) + 32 * (j / 2);
        const int shift = (j & 1) * 4;
        for (int l = 0; l < 32; ++l) {
          u[l] = static_cast<uint8_t>((q[l] >> shift) & 0x0F);
          if (five) u[l] = static_cast<uint8_t>(u[l] | (((s[16 + l] >> j) & 1) << 4));
        }
      }
      return w;
    }
    case QuantType::kQ6_K: {
      const uint8_t* s = row + 210 * (b / 8);
      const int h = static_cast<int>(b % 8) / 4, quarter = static_cast<int>(b % 4);
      const int8_t* scales = reinterpret_cast<const int8_t*>(s + 192);
      w.ws = half_to_float(s + 208);
      w.mul_lo = scales[8 * h + 2 * quarter];
      w.mul_hi = scales[8 * h + 2 * quarter + 1];
      if (u) {
        const uint8_t* lo = s + 64 * h + (quarter & 1) * 32;
        const uint8_t* hi = s + 128 + 32 * h;
        const int lo_shift = (quarter / 2) * 4, hi_shift = 2 * quarter;
        for (int l = 0; l < 32; ++l)
          u[l] = static_cast<uint8_t>(((lo[l] >> lo_shift) & 0x0F) | (((hi[l] >> hi_shift) & 3) << 4));
      }
      return w;
    }
  }
  return w;
}

// ---- the reference sequence in plain C++ ------------------------------------------------

// The exact integer product of weight block `w` (quants u) with x's block q.
inline int32_t block_product(QuantType type, const WBlock& w, const uint8_t* u, const int8_t* q,
                             int32_t s, int32_t slo, int32_t shi) {
  const bool signed_w = signed_quants(type);
  int32_t lo = 0, hi = 0;
  for (int e = 0; e < 16; ++e) {
    lo += (signed_w ? static_cast<int8_t>(u[e]) : u[e]) * q[e];
    hi += (signed_w ? static_cast<int8_t>(u[e + 16]) : u[e + 16]) * q[e + 16];
  }
  if (half_scales(type)) return (lo - w.offset * slo) * w.mul_lo + (hi - w.offset * shi) * w.mul_hi;
  return lo + hi - w.offset * s;
}

// y[m, n]: one float, block by block in order: y = fma(float(P), fl(ws * dx), y), then
// (formats with a min) y = fma(float(S), fl(wc * dx), y).
void rows_scalar(const QuantLinearArgs& a, const QuantX& xq, int64_t n0, int64_t n1) {
  const int64_t nb = xq.blocks;
  const bool has_mins = has_min(a.type);
  alignas(32) uint8_t u[32];
  const int64_t rb = a.k / quant_block_elems(a.type) * quant_block_bytes(a.type);
  std::vector<uint8_t> unpacked(a.layout == QuantLayout::kPacked16 ? static_cast<size_t>(rb) : 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.ldw;
    if (!unpacked.empty()) {  // packed: the row back in the file's layout
      quant_unpack16(a.type, a.w, a.n, a.k, n, 1, unpacked.data(), rb);
      row = unpacked.data();
    }
    for (int64_t m = 0; m < a.m; ++m) {
      float y = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const WBlock w = decode_block(a.type, row, b, u);
        const size_t i = static_cast<size_t>(m * nb + b);
        const int32_t p = block_product(a.type, w, u, xq.q.data() + 32 * i, xq.s[i], xq.slo[i], xq.shi[i]);
        y = std::fma(static_cast<float>(p), w.ws * xq.dx[i], y);
        if (has_mins)  // the min's integer: S, or Q2_K's weighted halves (exact in a float)
          y = std::fma(static_cast<float>(w.min_lo * xq.slo[i] + w.min_hi * xq.shi[i]), w.wc * xq.dx[i], y);
      }
      a.y[m * a.ldy + n] = y;
    }
  }
}

// Each part owns a contiguous range of y's columns, cut in chunks of whole 16-row groups.
// A part takes its own chunks from the front (one stream through memory, as the hardware
// prefetcher likes it); a part out of chunks takes the others' from the back. A static split
// left one thread waiting on the other at the end of every product: the two cores do not
// get equal shares of the memory bandwidth (measured on the 1.7B Q4_K_M decode, 2 threads:
// the two parts' end times differed by 5-7 ms a token in ~40). Which thread computes a
// column does not change its value: each is its own sum over its row (rows_group).
//
// A part's range is one 64-bit word, front chunk in the high half and end in the low,
// changed by compare-and-swap only: the owner moves the front up, a thief the end down,
// so a chunk is taken exactly once.
struct ChunkRange {
  std::atomic<uint64_t> word{0};
};

constexpr int kInlineParts = 8;
constexpr int64_t kChunksPerPart = 16;

struct Job {
  const QuantLinearArgs* args;
  const QuantX* xq;
  void (*rows)(const QuantLinearArgs&, const QuantX&, int64_t, int64_t);
  int64_t per;    // columns a part owns (a multiple of kRows)
  int64_t chunk;  // columns a chunk holds (a multiple of kRows; divides per)
  int parts;
  ChunkRange* ranges;  // [parts]
};

inline uint64_t pack_range(uint32_t front, uint32_t end) {
  return (static_cast<uint64_t>(front) << 32) | end;
}

// The owner's next chunk of range r (its index within the range), or -1 when none is left.
inline int64_t take_front(ChunkRange& r) {
  uint64_t w = r.word.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t front = static_cast<uint32_t>(w >> 32), end = static_cast<uint32_t>(w);
    if (front >= end) return -1;
    if (r.word.compare_exchange_weak(w, pack_range(front + 1, end), std::memory_order_relaxed))
      return front;
  }
}

// A thief's chunk: the last of range r, or -1 when none is left.
inline int64_t take_back(ChunkRange& r) {
  uint64_t w = r.word.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t front = static_cast<uint32_t>(w >> 32), end = static_cast<uint32_t>(w);
    if (front >= end) return -1;
    if (r.word.compare_exchange_weak(w, pack_range(front, end - 1), std::memory_order_relaxed))
      return end - 1;
  }
}

void run_chunk(const Job& j, int owner, int64_t c) {
  const int64_t n0 = owner * j.per + c * j.chunk;
  const int64_t n1 = std::min({j.args->n, n0 + j.chunk, (owner + 1) * j.per});
  if (n0 < n1) j.rows(*j.args, *j.xq, n0, n1);
}

void run_part(void* ctx, int part) {
  const Job& j = *static_cast<const Job*>(ctx);
  for (int64_t c; (c = take_front(j.ranges[part])) >= 0;) run_chunk(j, part, c);
  for (int d = 1; d < j.parts; ++d) {  // the others' last chunks, nearest part first
    const int victim = (part + d) % j.parts;
    for (int64_t c; (c = take_back(j.ranges[victim])) >= 0;) run_chunk(j, victim, c);
  }
}

// A path forced by quant_int8_force_path (-1: none).
std::atomic<int> forced_path{-1};

bool path_runs(Int8Path p) {
#if VERISPEC_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  switch (p) {
    case Int8Path::kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw");
    case Int8Path::kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case Int8Path::kAvx2: return avx2;
    case Int8Path::kScalar: return true;
  }
  return false;
#else
  return p == Int8Path::kScalar;
#endif
}

}  // namespace

std::string int8_force_path(const char* name) {
  if (name == nullptr || *name == 0) {
    forced_path = -1;
    return "";
  }
  for (Int8Path p : {Int8Path::kScalar, Int8Path::kAvx2, Int8Path::kAvxVnni, Int8Path::kAvx512Vnni})
    if (std::strcmp(name, int8_path_name(p)) == 0) {
      if (!path_runs(p)) return std::string("int8 path ") + name + " does not run on this CPU";
      forced_path = static_cast<int>(p);
      return "";
    }
  return std::string("unknown int8 path ") + name;
}

Int8Path int8_path(LinearIsa isa) {
  const int forced = forced_path.load();
  if (forced >= 0) return static_cast<Int8Path>(forced);
#if VERISPEC_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == LinearIsa::kAvx512 && avx2 && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return Int8Path::kAvx512Vnni;
  if ((isa == LinearIsa::kAvx512 || isa == LinearIsa::kAvx2) && avx2) {
    if (__builtin_cpu_supports("avxvnni")) return Int8Path::kAvxVnni;
    return Int8Path::kAvx2;
  }
#endif
  (void)isa;
  return Int8Path::kScalar;
}

const char* int8_path_name(Int8Path p) {
  switch (p) {
    case Int8Path::kAvx512Vnni: return "avx512-vnni";
    case Int8Path::kAvxVnni: return "avx-vnni";
    case Int8Path::kAvx2: return "avx2-maddubs";
    case Int8Path::kScalar: return "scalar";
  }
  return "unknown";
}

void quant_linear_int8(const QuantLinearArgs& a, LinearIsa isa) {
  thread_local QuantX xq;  // the caller's: workers only read it during run_parallel
  const Int8Path path = int8_path(isa);
  quantize_x(a, &xq, path == Int8Path::kAvx512Vnni);
  Job job{&a, &xq, &rows_scalar, 0, 0, 0, nullptr};
#if VERISPEC_X86
  switch (path) {
    case Int8Path::kAvx512Vnni: job.rows = vnni512::rows_for_type(a.type, a.layout); break;
    case Int8Path::kAvxVnni: job.rows = avxvnni::rows_for_type(a.type, a.layout); break;
    case Int8Path::kAvx2: job.rows = avx2::rows_for_type(a.type, a.layout); break;
    case Int8Path::kScalar: break;
  }
#endif
  // N split in parts of whole rows (a multiple of 16: packed, whole groups), at least 2^16
  // multiply-adds each.
  const int64_t work = a.m * a.n * a.k;
  int64_t parts = std::min<int64_t>(a.num_threads, std::max<int64_t>(1, work / (int64_t{1} << 16)));
  parts = std::max<int64_t>(1, std::min<int64_t>(parts, (a.n + kRows - 1) / kRows));
  int64_t per = (a.n + parts - 1) / parts;
  per = (per + kRows - 1) / kRows * kRows;
  parts = (a.n + per - 1) / per;
  job.per = per;
  // Chunks of about a sixteenth of a part (whole groups): the thread that finishes first
  // waits at most about one chunk of the other's.
  const int64_t groups = per / kRows;
  job.chunk = std::max<int64_t>(1, groups / kChunksPerPart) * kRows;
  job.parts = static_cast<int>(parts);
  ChunkRange inline_ranges[kInlineParts];
  std::vector<ChunkRange> heap_ranges(parts > kInlineParts ? static_cast<size_t>(parts) : 0);
  job.ranges = parts > kInlineParts ? heap_ranges.data() : inline_ranges;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t cols = std::min(a.n, (p + 1) * per) - p * per;
    const int64_t chunks = (cols + job.chunk - 1) / job.chunk;
    job.ranges[p].word.store(pack_range(0, static_cast<uint32_t>(chunks)), std::memory_order_relaxed);
  }
  linear_detail::run_parallel(static_cast<int>(parts), &run_part, &job, a.own_threads);
}

}  // namespace quant_detail
}  // namespace verispec
