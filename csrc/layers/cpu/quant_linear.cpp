// y = x w^T over GGUF-quantized weights (verispec/layers/quant.h): a tile of weight rows is
// dequantized to float32 into a per-thread buffer (it stays in L1/L2), then linear.cpp's
// float32 tile kernels read it for every block of kLinearRowBlock rows of x. The
// quantized weights are read from memory once per call; the float tile never leaves the
// cache. Each output is linear_f32's float sequence over the dequantized row, so the
// rounding rule (and batch invariance) of linear.h holds as it is.
#include "verispec/layers/quant.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "linear_tiles.h"
#include "quant_internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#define VERISPEC_X86 1
#include <immintrin.h>
#endif

namespace verispec {
namespace {

using quant_detail::bf16_to_float;
using quant_detail::half_to_float;
using quant_detail::load_u16;
using quant_detail::load_u32;
using quant_detail::scale_min_k4;

// One row of `blocks` blocks -> float32. Plain loops the compiler vectorizes for the
// instruction set of the function it is inlined into (the wrappers below); every weight
// is the same float expression on every path (see quant.h).
__attribute__((always_inline)) inline void dequant_row(QuantType type,
                                                      const uint8_t* __restrict src,
                                                      int64_t blocks, float* __restrict dst) {
  switch (type) {
    case QuantType::kF16:
      for (int64_t i = 0; i < 32 * blocks; ++i) dst[i] = half_to_float(src + 2 * i);
      return;
    case QuantType::kBF16:
      for (int64_t i = 0; i < 32 * blocks; ++i) dst[i] = bf16_to_float(src + 2 * i);
      return;
    case QuantType::kQ8_0:
      for (int64_t b = 0; b < blocks; ++b, src += 34, dst += 32) {
        const float d = half_to_float(src);
        const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
        for (int i = 0; i < 32; ++i) dst[i] = d * static_cast<float>(q[i]);
      }
      return;
    case QuantType::kQ4_0:
    case QuantType::kIQ4_NL: {  // a nibble's value: q - 8, or IQ4_NL's table entry
      const bool nl = type == QuantType::kIQ4_NL;
      auto value = [nl](int q) { return static_cast<float>(nl ? kIq4nlValues[q] : q - 8); };
      for (int64_t b = 0; b < blocks; ++b, src += 18, dst += 32) {
        const float d = half_to_float(src);
        const uint8_t* q = src + 2;
        for (int i = 0; i < 16; ++i) {
          dst[i] = d * value(q[i] & 0x0F);
          dst[i + 16] = d * value(q[i] >> 4);
        }
      }
      return;
    }
    case QuantType::kQ4_1:
      for (int64_t b = 0; b < blocks; ++b, src += 20, dst += 32) {
        const float d = half_to_float(src), m = half_to_float(src + 2);
        const uint8_t* q = src + 4;
        for (int i = 0; i < 16; ++i) {
          dst[i] = d * static_cast<float>(q[i] & 0x0F) + m;
          dst[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
        }
      }
      return;
    case QuantType::kQ5_0:
    case QuantType::kQ5_1: {
      const bool q51 = type == QuantType::kQ5_1;
      const int64_t size = quant_detail::block_bytes(type);
      for (int64_t b = 0; b < blocks; ++b, src += size, dst += 32) {
        const float d = half_to_float(src), m = q51 ? half_to_float(src + 2) : 0.0f;
        const uint32_t qh = load_u32(src + quant_detail::q5_high_bits_at(type));
        const uint8_t* q = src + quant_detail::q5_nibbles_at(type);
        for (int i = 0; i < 32; ++i) {
          const int v = ((i < 16 ? q[i] : q[i - 16] >> 4) & 0x0F) | (((qh >> i) & 1) << 4);
          dst[i] = q51 ? d * static_cast<float>(v) + m : d * static_cast<float>(v - 16);
        }
      }
      return;
    }
    case QuantType::kQ2_K:
      for (int64_t b = 0; b < blocks; ++b, src += 84, dst += 256) {
        const float d = half_to_float(src + 80), dmin = half_to_float(src + 82);
        for (int g = 0; g < 16; ++g) {  // 16 elements: scale byte g, quants of sub-block g / 2
          const float a = d * static_cast<float>(src[g] & 0x0F), c = dmin * static_cast<float>(src[g] >> 4);
          const int j = g / 2, l0 = 16 * (g & 1);
          const uint8_t* q = src + 16 + 32 * (j / 4) + l0;
          for (int l = 0; l < 16; ++l) dst[32 * j + l0 + l] = a * static_cast<float>((q[l] >> (2 * (j % 4))) & 3) - c;
        }
      }
      return;
    case QuantType::kQ3_K:
      for (int64_t b = 0; b < blocks; ++b, src += 110, dst += 256) {
        const float d = half_to_float(src + 108);
        for (int g = 0; g < 16; ++g) {  // 16 elements: scale g, quants of sub-block g / 2
          const float a = d * static_cast<float>(quant_detail::q3k_scale(src + 96, g));
          const int j = g / 2, l0 = 16 * (g & 1);
          for (int l = l0; l < l0 + 16; ++l)
            dst[32 * j + l] = a * static_cast<float>(quant_detail::q3k_quant(src, j, l) - 4);
        }
      }
      return;
    case QuantType::kIQ4_XS:
      for (int64_t b = 0; b < blocks; ++b, src += 136, dst += 256) {
        const float d = half_to_float(src);
        const uint32_t sh = load_u16(src + 2), sl = load_u32(src + 4);
        for (int j = 0; j < 8; ++j) {
          const float a = d * static_cast<float>(quant_detail::iq4xs_scale(sh, sl, j));
          const uint8_t* q = src + 8 + 16 * j;
          for (int i = 0; i < 16; ++i) {
            dst[32 * j + i] = a * static_cast<float>(kIq4nlValues[q[i] & 0x0F]);
            dst[32 * j + i + 16] = a * static_cast<float>(kIq4nlValues[q[i] >> 4]);
          }
        }
      }
      return;
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: {
      const bool five = type == QuantType::kQ5_K;
      const int64_t size = five ? 176 : 144;
      for (int64_t b = 0; b < blocks; ++b, src += size, dst += 256) {
        const float d = half_to_float(src), dmin = half_to_float(src + 2);
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;                 // Q5_K only
        const uint8_t* qs = src + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min_k4(scales, j, &sc, &mn);
          const float a = d * static_cast<float>(sc), c = dmin * static_cast<float>(mn);
          const uint8_t* q = qs + 32 * (j / 2);
          const int shift = (j & 1) * 4;
          float* out = dst + 32 * j;
          if (five) {
            for (int l = 0; l < 32; ++l)
              out[l] = a * static_cast<float>(((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4)) - c;
          } else {
            for (int l = 0; l < 32; ++l) out[l] = a * static_cast<float>((q[l] >> shift) & 0x0F) - c;
          }
        }
      }
      return;
    }
    case QuantType::kQ6_K:
      for (int64_t b = 0; b < blocks; ++b, src += 210, dst += 256) {
        const float d = half_to_float(src + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = src + 64 * h;
          const uint8_t* qh = src + 128 + 32 * h;
          float* out = dst + 128 * h;
          // 8 groups of 16: group g covers out[16g..16g+16), scale scales[8h + g]
          for (int g = 0; g < 8; ++g) {
            const float a = d * static_cast<float>(scales[8 * h + g]);
            const int quarter = g / 2;                       // 0..3: 32 outputs each
            const int l0 = 16 * (g & 1);
            const uint8_t* lo = ql + (quarter & 1) * 32;     // quarters 1, 3: bytes 32..63
            const int lo_shift = (quarter / 2) * 4;          // quarters 2, 3: high nibbles
            const int hi_shift = 2 * quarter;
            for (int l = l0; l < l0 + 16; ++l) {
              const int q = ((lo[l] >> lo_shift) & 0x0F) | (((qh[l] >> hi_shift) & 3) << 4);
              out[32 * quarter + l] = a * static_cast<float>(q - 32);
            }
          }
        }
      }
      return;
  }
}

using DequantFn = void (*)(QuantType, const uint8_t*, int64_t, float*);

void dequant_scalar(QuantType type, const uint8_t* src, int64_t blocks, float* dst) {
  dequant_row(type, src, blocks, dst);
}
#if VERISPEC_X86
// Explicit vectors (the compiler's vectorization of the plain loops is several times
// slower); the products and sums are the plain loops' (mul, then add or subtract: no
// fused multiply-add), so the weights are the same bits. AVX2: Q8_0, Q4_0, Q4_1; AVX-512:
// those and the K-quants (the other formats run the plain loops: the float arithmetic is
// not their fast path, the int8 one is).
// A half scale with the F16C instruction (exact, as half_to_float).
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  return _cvtsh_ss(load_u16(p));
}

__attribute__((target("avx2,fma,f16c"))) void dequant_avx2(QuantType type, const uint8_t* src,
                                                           int64_t blocks, float* dst) {
  if (quant_is_float16(type)) {  // exact conversions: the plain loops' values
    for (int64_t i = 0; i < 32 * blocks; i += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      _mm256_storeu_ps(dst + i, type == QuantType::kF16
                                    ? _mm256_cvtph_ps(v)
                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
    return;
  }
  if (type != QuantType::kQ8_0 && type != QuantType::kQ4_0 && type != QuantType::kQ4_1) {
    dequant_row(type, src, blocks, dst);
    return;
  }
  const __m256i low4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  const int64_t size = quant_block_bytes(type);
  for (int64_t b = 0; b < blocks; ++b, src += size, dst += 32) {
    const __m256 d = _mm256_set1_ps(half_f16c(src));
    if (type == QuantType::kQ8_0) {
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * i));
        _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
      continue;
    }
    const bool q41 = type == QuantType::kQ4_1;
    const uint8_t* qs = src + (q41 ? 4 : 2);
    const __m256 m = _mm256_set1_ps(q41 ? half_f16c(src + 2) : 0.0f);
    for (int i = 0; i < 2; ++i) {
      const __m256i bytes =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
      __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_srli_epi32(bytes, 4);
      if (!q41) {
        lo = _mm256_sub_epi32(lo, eight);
        hi = _mm256_sub_epi32(hi, eight);
      }
      __m256 wl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), wh = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi));
      if (q41) {
        wl = _mm256_add_ps(wl, m);
        wh = _mm256_add_ps(wh, m);
      }
      _mm256_storeu_ps(dst + 8 * i, wl);
      _mm256_storeu_ps(dst + 16 + 8 * i, wh);
    }
  }
}

// 16 bytes at p as 16 int32 lanes.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline __m512i
bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lanes shifted right by a count known at run time.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline __m512i
shift_right(__m512i v, int count) {
  return _mm512_srl_epi32(v, _mm_cvtsi32_si128(count));
}

// 16 F16 / BF16 values at p as floats (exact).
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline __m512
halves16(QuantType type, const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (type == QuantType::kF16) return _mm512_cvtph_ps(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// The K-quants with AVX-512: the plain loops' expressions on 16 weights at a time.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void dequant_k_avx512(
    QuantType type, const uint8_t* src, int64_t blocks, float* dst) {
  const __m512i low4 = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1),
                three = _mm512_set1_epi32(3), n32 = _mm512_set1_epi32(32);
  if (type == QuantType::kQ6_K) {
    for (int64_t b = 0; b < blocks; ++b, src += 210, dst += 256) {
      const float d = half_f16c(src + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = src + 64 * h;
        const uint8_t* qh = src + 128 + 32 * h;
        for (int g = 0; g < 8; ++g) {
          const __m512 a = _mm512_set1_ps(d * static_cast<float>(scales[8 * h + g]));
          const int quarter = g / 2, l0 = 16 * (g & 1);
          const __m512i lo = _mm512_and_si512(
              shift_right(bytes16(ql + (quarter & 1) * 32 + l0), (quarter / 2) * 4), low4);
          const __m512i hi = _mm512_and_si512(shift_right(bytes16(qh + l0), 2 * quarter), three);
          const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), n32);
          _mm512_storeu_ps(dst + 128 * h + 32 * quarter + l0, _mm512_mul_ps(a, _mm512_cvtepi32_ps(q)));
        }
      }
    }
    return;
  }
  const bool five = type == QuantType::kQ5_K;
  const int64_t size = five ? 176 : 144;
  for (int64_t b = 0; b < blocks; ++b, src += size, dst += 256) {
    const float d = half_f16c(src), dmin = half_f16c(src + 2);
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + (five ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(src + 4, j, &sc, &mn);
      const __m512 a = _mm512_set1_ps(d * static_cast<float>(sc));
      const __m512 c = _mm512_set1_ps(dmin * static_cast<float>(mn));
      for (int half = 0; half < 2; ++half) {
        __m512i q = _mm512_and_si512(
            shift_right(bytes16(qs + 32 * (j / 2) + 16 * half), (j & 1) * 4), low4);
        if (five)
          q = _mm512_or_si512(q, _mm512_slli_epi32(
                                     _mm512_and_si512(shift_right(bytes16(qh + 16 * half), j), one), 4));
        _mm512_storeu_ps(dst + 32 * j + 16 * half,
                         _mm512_sub_ps(_mm512_mul_ps(a, _mm512_cvtepi32_ps(q)), c));
      }
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void dequant_avx512(
    QuantType type, const uint8_t* src, int64_t blocks, float* dst) {
  if (type == QuantType::kQ4_K || type == QuantType::kQ5_K || type == QuantType::kQ6_K) {
    dequant_k_avx512(type, src, blocks, dst);
    return;
  }
  if (quant_is_float16(type)) {
    for (int64_t i = 0; i < 32 * blocks; i += 16) _mm512_storeu_ps(dst + i, halves16(type, src + 2 * i));
    return;
  }
  if (type != QuantType::kQ8_0 && type != QuantType::kQ4_0 && type != QuantType::kQ4_1) {
    dequant_row(type, src, blocks, dst);  // the plain loops, vectorized for AVX-512
    return;
  }
  const __m512i low4 = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
  const int64_t size = quant_block_bytes(type);
  for (int64_t b = 0; b < blocks; ++b, src += size, dst += 32) {
    const __m512 d = _mm512_set1_ps(half_f16c(src));
    if (type == QuantType::kQ8_0) {
      for (int i = 0; i < 2; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 + 16 * i));
        _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
      }
      continue;
    }
    const bool q41 = type == QuantType::kQ4_1;
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (q41 ? 4 : 2))));
    __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_srli_epi32(bytes, 4);
    if (!q41) {
      lo = _mm512_sub_epi32(lo, eight);
      hi = _mm512_sub_epi32(hi, eight);
    }
    __m512 wl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), wh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
    if (q41) {
      const __m512 m = _mm512_set1_ps(half_f16c(src + 2));
      wl = _mm512_add_ps(wl, m);
      wh = _mm512_add_ps(wh, m);
    }
    _mm512_storeu_ps(dst, wl);
    _mm512_storeu_ps(dst + 16, wh);
  }
}

// ---- fused AVX-512 products for the 32-weight formats, up to kLinearRowBlock rows -------
//
// At few rows the buffered path spends as much on storing and reloading the float tile
// as on the products. Here a block's 32 weights are unpacked into two registers and used
// at once. Each output keeps the AVX-512 float kernel's 16 lane sums, one FMA per 16
// weights in order, and its final reduction (reduce_avx512_lanes): the same float
// sequence as linear_f32 over the dequantized row, bit for bit (K is a multiple of 32,
// so there is no masked tail), so the rounding rule does not change.

struct Block32 {
  __m512 lo, hi;  // weights 0..15, 16..31
};

template <QuantType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline Block32
unpack32(const uint8_t* src) {
  if (quant_is_float16(T)) return {halves16(T, src), halves16(T, src + 32)};
  const __m512 d = _mm512_set1_ps(half_f16c(src));
  if (T == QuantType::kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 18));
    return {_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))),
            _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)))};
  }
  const bool q41 = T == QuantType::kQ4_1;
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (q41 ? 4 : 2))));
  __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(bytes, 4);
  if (!q41) {
    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
    hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
  }
  __m512 wl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), wh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
  if (q41) {
    const __m512 m = _mm512_set1_ps(half_f16c(src + 2));
    wl = _mm512_add_ps(wl, m);
    wh = _mm512_add_ps(wh, m);
  }
  return {wl, wh};
}

struct FusedTile {
  const float* x;
  const uint8_t* w;  // the tile's first weight row
  float* y;
  int64_t ldx, ldw, ldy, blocks;
};

// y[0..MB) x [0..R) for R weight rows.
template <QuantType T, int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void fused_avx512(
    const FusedTile& t) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t size = quant_block_bytes(T);
  for (int64_t b = 0; b < t.blocks; ++b) {
    Block32 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* src = t.w + r * t.ldw + b * size;
      _mm_prefetch(reinterpret_cast<const char*>(src + 512), _MM_HINT_T0);
      wv[r] = unpack32<T>(src);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 x0 = _mm512_loadu_ps(t.x + m * t.ldx + 32 * b);
      const __m512 x1 = _mm512_loadu_ps(t.x + m * t.ldx + 32 * b + 16);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[m][r] = _mm512_fmadd_ps(x0, wv[r].lo, acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(x1, wv[r].hi, acc[m][r]);
      }
    }
  }
  alignas(64) float lanes[16];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(lanes, acc[m][r]);
      t.y[m * t.ldy + r] = linear_detail::reduce_avx512_lanes(lanes);
    }
}

using FusedFn = void (*)(const FusedTile&);
// Weight rows in flight: 8 x 2 sums + 2 x 2 weights + 2 x = 22 of 32 registers.
constexpr int kFusedRows = 2;

template <QuantType T, size_t... I>
constexpr std::array<FusedFn, 2 * kLinearRowBlock> fused_table(std::index_sequence<I...>) {
  return {&fused_avx512<T, static_cast<int>(I) + 1, kFusedRows>...,
          &fused_avx512<T, static_cast<int>(I) + 1, 1>...};
}

// [mb - 1] for kFusedRows rows, [kLinearRowBlock + mb - 1] for one; nullptr: no fused path.
const FusedFn* fused_for(QuantType type) {
  static constexpr auto q8 = fused_table<QuantType::kQ8_0>(std::make_index_sequence<kLinearRowBlock>{});
  static constexpr auto q40 = fused_table<QuantType::kQ4_0>(std::make_index_sequence<kLinearRowBlock>{});
  static constexpr auto q41 = fused_table<QuantType::kQ4_1>(std::make_index_sequence<kLinearRowBlock>{});
  static constexpr auto f16 = fused_table<QuantType::kF16>(std::make_index_sequence<kLinearRowBlock>{});
  static constexpr auto bf16 = fused_table<QuantType::kBF16>(std::make_index_sequence<kLinearRowBlock>{});
  switch (type) {
    case QuantType::kQ8_0: return q8.data();
    case QuantType::kQ4_0: return q40.data();
    case QuantType::kQ4_1: return q41.data();
    case QuantType::kF16: return f16.data();
    case QuantType::kBF16: return bf16.data();
    default: return nullptr;
  }
}
#endif

// The vector dequantizers also need F16C (every AVX2 CPU so far has it) and, for
// AVX-512, BW and VL; without them the plain loops run (same weights, bit for bit).
DequantFn dequant_for(LinearIsa isa) {
#if VERISPEC_X86
  __builtin_cpu_init();
  const bool f16c = __builtin_cpu_supports("f16c");
  if (isa == LinearIsa::kAvx512 && f16c && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return &dequant_avx512;
  if ((isa == LinearIsa::kAvx512 || isa == LinearIsa::kAvx2) && f16c) return &dequant_avx2;
#endif
  (void)isa;
  return &dequant_scalar;
}

struct Job {
  const QuantLinearArgs* args;
  LinearIsa isa;
  DequantFn dequant;
  int wide;
  int64_t cols_per_part;
  const void* fused;  // the FusedFn table when the fused AVX-512 path runs this call
};

#if VERISPEC_X86
void run_part_fused(const Job& job, const QuantLinearArgs& a, int64_t n0, int64_t n1) {
  const FusedFn* table = static_cast<const FusedFn*>(job.fused);
  const int mb = static_cast<int>(a.m);  // <= kLinearRowBlock on this path
  FusedTile t{a.x, nullptr, nullptr, a.ldx, a.ldw, a.ldy, a.k / 32};
  int64_t n = n0;
  for (; n + kFusedRows <= n1; n += kFusedRows) {
    t.w = a.w + n * a.ldw;
    t.y = a.y + n;
    table[mb - 1](t);
  }
  for (; n < n1; ++n) {
    t.w = a.w + n * a.ldw;
    t.y = a.y + n;
    table[kLinearRowBlock + mb - 1](t);
  }
}
#endif

// Rows n0..n1 of a (the file's layout).
void run_rows(const Job& job, const QuantLinearArgs& a, int64_t n0, int64_t n1) {
#if VERISPEC_X86
  if (job.fused != nullptr) {
    run_part_fused(job, a, n0, n1);
    return;
  }
#endif
  const int64_t blocks = a.k / quant_block_elems(a.type);
  // The dequantized tile: `wide` rows of k floats (18 KB for k = 1536 and 3 rows).
  thread_local std::vector<float> tile;
  if (tile.size() < static_cast<size_t>(job.wide * a.k)) tile.resize(job.wide * a.k);
  for (int64_t n = n0; n < n1;) {
    const int rows = n + job.wide <= n1 ? job.wide : 1;
    for (int r = 0; r < rows; ++r) job.dequant(a.type, a.w + (n + r) * a.ldw, blocks, tile.data() + r * a.k);
    for (int64_t m0 = 0; m0 < a.m; m0 += kLinearRowBlock) {
      const int mb = static_cast<int>(std::min<int64_t>(kLinearRowBlock, a.m - m0));
      linear_detail::tile_f32(job.isa, mb, rows, a.x + m0 * a.ldx, a.ldx, tile.data(), a.k,
                              a.y + m0 * a.ldy + n, a.ldy, a.k);
    }
    n += rows;
  }
}

void run_part(void* ctx, int part) {
  const Job& job = *static_cast<const Job*>(ctx);
  const QuantLinearArgs& a = *job.args;
  const int64_t n0 = part * job.cols_per_part;
  const int64_t n1 = std::min(a.n, n0 + job.cols_per_part);
  if (a.layout == QuantLayout::kRows) {
    run_rows(job, a, n0, n1);
    return;
  }
  // Packed: each group of 16 rows back in the file's layout (parts are whole groups), then
  // the same rows as from the file.
  const int64_t rb = a.k / quant_block_elems(a.type) * quant_block_bytes(a.type);
  thread_local std::vector<uint8_t> rows_bytes;
  if (rows_bytes.size() < static_cast<size_t>(kQuantPackRows * rb)) rows_bytes.resize(kQuantPackRows * rb);
  QuantLinearArgs g = a;
  g.layout = QuantLayout::kRows;
  g.w = rows_bytes.data();
  g.ldw = rb;
  for (int64_t n = n0; n < n1; n += kQuantPackRows) {
    const int64_t rows = std::min<int64_t>(kQuantPackRows, n1 - n);
    quant_detail::unpack16_group(a.type, a.k, a.w + n * rb, rows, rows_bytes.data(), rb);
    g.n = rows;
    g.y = a.y + n;
    run_rows(job, g, 0, rows);
  }
}

// Below this many multiply-adds a call runs on one thread (as linear.cpp).
constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(b_bytes) && pb < pa + static_cast<uintptr_t>(a_bytes);
}

std::string check_weights(QuantType type, int64_t n, int64_t k, int64_t ldw) {
  const int64_t block = quant_block_elems(type);
  if (k % block != 0)
    return std::string("k must be a multiple of ") + quant_type_name(type) + "'s block of " +
           std::to_string(block) + " weights, got k = " + std::to_string(k);
  const int64_t row_bytes = k / block * quant_block_bytes(type);
  if (n > 1 && ldw < row_bytes)
    return "ldw must cover a row's blocks: expected >= " + std::to_string(row_bytes) +
           " bytes, got " + std::to_string(ldw);
  return "";
}

}  // namespace

const char* quant_arith_name(QuantArith arith) {
  return arith == QuantArith::kInt8 ? "int8" : "float";
}

const char* quant_int8_path_name(LinearIsa isa) {
  return quant_detail::int8_path_name(quant_detail::int8_path(linear_detail::resolve_isa(isa)));
}

std::string quant_int8_force_path(const std::string& name) {
  return quant_detail::int8_force_path(name.c_str());
}

bool quant_type_supported(int32_t id) {
  for (QuantType t : kQuantTypes)
    if (static_cast<int32_t>(t) == id) return true;
  return false;
}

const char* quant_type_name(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0: return "Q4_0";
    case QuantType::kQ4_1: return "Q4_1";
    case QuantType::kQ5_0: return "Q5_0";
    case QuantType::kQ5_1: return "Q5_1";
    case QuantType::kQ8_0: return "Q8_0";
    case QuantType::kQ4_K: return "Q4_K";
    case QuantType::kQ5_K: return "Q5_K";
    case QuantType::kQ6_K: return "Q6_K";
    case QuantType::kIQ4_NL: return "IQ4_NL";
    case QuantType::kIQ4_XS: return "IQ4_XS";
    case QuantType::kQ2_K: return "Q2_K";
    case QuantType::kQ3_K: return "Q3_K";
    case QuantType::kF16: return "F16";
    case QuantType::kBF16: return "BF16";
  }
  return "unknown";
}

int64_t quant_block_elems(QuantType type) { return quant_detail::is_k_quant(type) ? 256 : 32; }

int64_t quant_block_bytes(QuantType type) { return quant_detail::block_bytes(type); }

std::string quant_linear_f32(const QuantLinearArgs& a) {
  if (!quant_type_supported(static_cast<int32_t>(a.type)))
    return "unsupported quantization type id " + std::to_string(static_cast<int32_t>(a.type));
  if (a.m < 0 || a.n < 0 || a.k < 0)
    return "sizes must be >= 0, got m = " + std::to_string(a.m) + ", n = " + std::to_string(a.n) +
           ", k = " + std::to_string(a.k);
  const bool packed = a.layout == QuantLayout::kPacked16;
  if (!packed && a.layout != QuantLayout::kRows)
    return "unknown weight layout " + std::to_string(static_cast<int32_t>(a.layout));
  std::string error = check_weights(a.type, a.n, a.k, packed ? INT64_MAX : a.ldw);
  if (!error.empty()) return error;
  if (a.ldx < a.k || a.ldy < a.n)
    return "row strides must cover a row: ldx = " + std::to_string(a.ldx) + " (>= k = " +
           std::to_string(a.k) + "), ldy = " + std::to_string(a.ldy) + " (>= n = " +
           std::to_string(a.n) + ")";
  if (a.num_threads < 1) return "num_threads must be >= 1, got " + std::to_string(a.num_threads);
  if (!linear_isa_supported(a.isa))
    return std::string("instruction set ") + linear_isa_name(a.isa) + " is not supported by this CPU";
  if (a.m == 0 || a.n == 0) return "";
  const int64_t row_bytes = a.k / quant_block_elems(a.type) * quant_block_bytes(a.type);
  const int64_t y_bytes = ((a.m - 1) * a.ldy + a.n) * 4;
  if (overlaps(a.y, y_bytes, a.x, ((a.m - 1) * a.ldx + a.k) * 4) ||
      overlaps(a.y, y_bytes, a.w, packed ? quant_packed_bytes(a.type, a.n, a.k) : (a.n - 1) * a.ldw + row_bytes))
    return "the output must not overlap x or w";

  const LinearIsa isa = linear_detail::resolve_isa(a.isa);
  if (a.arith == QuantArith::kInt8 && !quant_is_float16(a.type)) {
    quant_detail::quant_linear_int8(a, isa);
    return "";
  }
  const int wide = linear_detail::tile_rows(isa);
  const int64_t work = a.m * a.n * std::max<int64_t>(a.k, 1);
  int64_t parts = std::min<int64_t>(a.num_threads, std::max<int64_t>(1, work / kMinWorkPerThread));
  const int64_t align = packed ? kQuantPackRows : wide;  // packed: parts of whole groups
  parts = std::min<int64_t>(parts, (a.n + align - 1) / align);
  int64_t per = (a.n + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  parts = (a.n + per - 1) / per;
  const DequantFn dequant = dequant_for(isa);
  const void* fused = nullptr;
#if VERISPEC_X86
  // The fused path: the vector dequantizers of AVX-512 run here, at most one row block.
  if (dequant == &dequant_avx512 && a.m <= kLinearRowBlock) fused = fused_for(a.type);
#endif
  Job job{&a, isa, dequant, wide, per, fused};
  linear_detail::run_parallel(static_cast<int>(parts), &run_part, &job, a.own_threads);
  return "";
}

std::string quant_dequantize_rows(QuantType type, const uint8_t* w, int64_t n, int64_t k,
                                  int64_t ldw, const int64_t* rows, int64_t count, float* out,
                                  int64_t ldo, LinearIsa isa, QuantLayout layout) {
  if (!quant_type_supported(static_cast<int32_t>(type)))
    return "unsupported quantization type id " + std::to_string(static_cast<int32_t>(type));
  if (n < 0 || k < 0 || count < 0)
    return "sizes must be >= 0, got n = " + std::to_string(n) + ", k = " + std::to_string(k) +
           ", count = " + std::to_string(count);
  const bool packed = layout == QuantLayout::kPacked16;
  if (!packed && layout != QuantLayout::kRows)
    return "unknown weight layout " + std::to_string(static_cast<int32_t>(layout));
  std::string error = check_weights(type, n, k, packed ? INT64_MAX : ldw);
  if (!error.empty()) return error;
  if (ldo < k) return "ldo must be >= k = " + std::to_string(k) + ", got " + std::to_string(ldo);
  if (!linear_isa_supported(isa))
    return std::string("instruction set ") + linear_isa_name(isa) + " is not supported by this CPU";
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = rows != nullptr ? rows[i] : i;
    if (row < 0 || row >= n)
      return "row index " + std::to_string(row) + " at " + std::to_string(i) +
             " is out of range [0, " + std::to_string(n) + ")";
  }
  const DequantFn dequant = dequant_for(linear_detail::resolve_isa(isa));
  const int64_t blocks = k / quant_block_elems(type);
  const int64_t rb = blocks * quant_block_bytes(type);
  std::vector<uint8_t> row_bytes(packed ? static_cast<size_t>(rb) : 0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = rows != nullptr ? rows[i] : i;
    const uint8_t* src = w + row * ldw;
    if (packed) {
      quant_unpack16(type, w, n, k, row, 1, row_bytes.data(), rb);
      src = row_bytes.data();
    }
    dequant(type, src, blocks, out + i * ldo);
  }
  return "";
}

}  // namespace verispec
