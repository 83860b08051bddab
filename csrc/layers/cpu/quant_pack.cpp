// QuantLayout::kPacked16 (verispec/layers/quant.h): 16 rows' chunks side by side. One rule for
// every format: a row is cut into 2-byte chunks (its IEEE half fields) and 4-byte chunks
// (the rest), and the chunk of c bytes at offset x of row r of a group is stored at
// 16 x + c r of the group's bytes.
#include <algorithm>
#include <cstring>
#include <string>

#include "quant_internal.h"
#include "verispec/layers/quant.h"

#if defined(__x86_64__) || defined(_M_X64)
#define VERISPEC_X86 1
#include <immintrin.h>
#endif

namespace verispec {
namespace {

// The offsets of the 2-byte (IEEE half) fields of one block (K-quants: super-block).
struct HalfFields {
  int count;
  int offset[2];
};

HalfFields half_fields(QuantType type) {
  switch (type) {
    case QuantType::kF16:
    case QuantType::kBF16: return {0, {0, 0}};  // values, not scales: 4-byte chunks
    case QuantType::kQ8_0:
    case QuantType::kQ4_0:
    case QuantType::kQ5_0:
    case QuantType::kIQ4_NL: return {1, {0, 0}};
    case QuantType::kQ4_1:
    case QuantType::kQ5_1:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: return {2, {0, 2}};
    case QuantType::kQ6_K: return {1, {208, 0}};
    case QuantType::kIQ4_XS: return {2, {0, 2}};  // d, and the 16-bit scales_h
    case QuantType::kQ2_K: return {2, {80, 82}};
    case QuantType::kQ3_K: return {1, {108, 0}};  // d at the end
  }
  return {0, {0, 0}};
}

int64_t row_bytes_of(QuantType type, int64_t k) {
  return k / quant_block_elems(type) * quant_block_bytes(type);
}

// Calls f(x, c) for each chunk of a row of `row_bytes` bytes, in order.
template <class F>
void for_each_chunk(QuantType type, int64_t row_bytes, F&& f) {
  const int64_t unit = quant_block_bytes(type);
  const HalfFields h = half_fields(type);
  for (int64_t b = 0; b < row_bytes; b += unit)
    for (int64_t x = 0; x < unit;) {
      const bool half = (h.count > 0 && x == h.offset[0]) || (h.count > 1 && x == h.offset[1]);
      const int c = half ? 2 : 4;
      f(b + x, c);
      x += c;
    }
}

// Rows 0..rows-1 (<= 16) of the packed group at src into dst (row stride ldo): four 4-byte
// chunks of 16 rows (four 64-byte lines) are one 4 x 4 transpose of 32-bit words per 4 rows.
void unpack_group(QuantType type, int64_t rb, const uint8_t* src, int64_t rows, uint8_t* dst,
                  int64_t ldo) {
  const int64_t unit = quant_block_bytes(type);
  const HalfFields h = half_fields(type);
  for (int64_t b = 0; b < rb; b += unit) {
    int64_t x = b;
    const int64_t end = b + unit;
    while (x < end) {
      const int64_t o = x - b;
      if ((h.count > 0 && o == h.offset[0]) || (h.count > 1 && o == h.offset[1])) {
        for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ldo + x, src + 16 * x + 2 * r, 2);
        x += 2;
        continue;
      }
      // A run of 4-byte chunks up to the next half field (or the unit's end).
      int64_t stop = end;
      for (int i = 0; i < h.count; ++i)
        if (b + h.offset[i] > x) stop = std::min(stop, b + h.offset[i]);
#if VERISPEC_X86
      for (; x + 16 <= stop; x += 16) {
        const uint8_t* line = src + 16 * x;  // lines t = 0..3 at + 64 t; rows 4q.. at + 16 q
        for (int64_t q = 0; q < 4 && 4 * q < rows; ++q) {
          const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * q));
          const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 64 + 16 * q));
          const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 128 + 16 * q));
          const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 192 + 16 * q));
          const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpackhi_epi32(a0, a1);
          const __m128i t2 = _mm_unpacklo_epi32(a2, a3), t3 = _mm_unpackhi_epi32(a2, a3);
          const __m128i r[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2),
                                _mm_unpacklo_epi64(t1, t3), _mm_unpackhi_epi64(t1, t3)};
          for (int64_t j = 0; j < 4 && 4 * q + j < rows; ++j)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (4 * q + j) * ldo + x), r[j]);
        }
      }
#endif
      for (; x < stop; x += 4)
        for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ldo + x, src + 16 * x + 4 * r, 4);
    }
  }
}

std::string check(QuantType type, int64_t n, int64_t k) {
  if (!quant_type_supported(static_cast<int32_t>(type)))
    return "unsupported quantization type id " + std::to_string(static_cast<int32_t>(type));
  if (n < 0 || k < 0) return "sizes must be >= 0, got n = " + std::to_string(n) + ", k = " + std::to_string(k);
  if (k % quant_block_elems(type) != 0)
    return std::string("k must be a multiple of ") + quant_type_name(type) + "'s block of " +
           std::to_string(quant_block_elems(type)) + " weights, got k = " + std::to_string(k);
  return "";
}

}  // namespace

namespace quant_detail {
void unpack16_group(QuantType type, int64_t k, const uint8_t* group, int64_t rows, uint8_t* out,
                    int64_t ldo) {
  unpack_group(type, row_bytes_of(type, k), group, rows, out, ldo);
}
}  // namespace quant_detail

int64_t quant_packed_bytes(QuantType type, int64_t n, int64_t k) {
  return (n + kQuantPackRows - 1) / kQuantPackRows * kQuantPackRows * row_bytes_of(type, k);
}

std::string quant_pack16(QuantType type, const uint8_t* w, int64_t n, int64_t k, int64_t ldw,
                         uint8_t* out) {
  std::string error = check(type, n, k);
  if (!error.empty()) return error;
  const int64_t rb = row_bytes_of(type, k);
  if (n > 1 && ldw < rb)
    return "ldw must cover a row's blocks: expected >= " + std::to_string(rb) + " bytes, got " +
           std::to_string(ldw);
  const int64_t groups = (n + kQuantPackRows - 1) / kQuantPackRows;
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* dst = out + g * kQuantPackRows * rb;
    const int64_t rows = std::min<int64_t>(kQuantPackRows, n - g * kQuantPackRows);
    if (rows < kQuantPackRows) std::memset(dst, 0, static_cast<size_t>(kQuantPackRows * rb));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* src = w + (g * kQuantPackRows + r) * ldw;
      for_each_chunk(type, rb, [&](int64_t x, int c) { std::memcpy(dst + 16 * x + c * r, src + x, c); });
    }
  }
  return "";
}

std::string quant_unpack16(QuantType type, const uint8_t* packed, int64_t n, int64_t k, int64_t row0,
                           int64_t count, uint8_t* out, int64_t ldo) {
  std::string error = check(type, n, k);
  if (!error.empty()) return error;
  const int64_t rb = row_bytes_of(type, k);
  if (row0 < 0 || count < 0 || row0 + count > n)
    return "rows [" + std::to_string(row0) + ", " + std::to_string(row0 + count) +
           ") are out of range [0, " + std::to_string(n) + ")";
  if (count > 1 && ldo < rb)
    return "ldo must cover a row's blocks: expected >= " + std::to_string(rb) + " bytes, got " +
           std::to_string(ldo);
  for (int64_t i = 0; i < count;) {
    const int64_t row = row0 + i, g = row / kQuantPackRows, r = row % kQuantPackRows;
    const uint8_t* src = packed + g * kQuantPackRows * rb;
    if (r == 0 && count - i >= kQuantPackRows) {  // a whole group
      unpack_group(type, rb, src, kQuantPackRows, out + i * ldo, ldo);
      i += kQuantPackRows;
      continue;
    }
    uint8_t* dst = out + i * ldo;
    for_each_chunk(type, rb, [&](int64_t x, int c) { std::memcpy(dst + x, src + 16 * x + c * r, c); });
    ++i;
  }
  return "";
}

}  // namespace verispec
