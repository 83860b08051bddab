// Internal to the quantized kernels (quant_linear.cpp, quant_int8.cpp): block-field
// readers shared by both arithmetics, and the int8 arithmetic's entry point.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "verispec/layers/quant.h"

namespace verispec {
namespace quant_detail {

// ---- what the formats share (one place for every kernel) --------------------------------

// K-quants (and IQ4_XS): super-blocks of 256 weights (8 blocks of 32); the rest: blocks of 32.
constexpr bool is_k_quant(QuantType t) {
  return t == QuantType::kQ2_K || t == QuantType::kQ3_K || t == QuantType::kQ4_K ||
         t == QuantType::kQ5_K || t == QuantType::kQ6_K || t == QuantType::kIQ4_XS;
}
// Formats with a multiplier per half block of 16 (Q6_K's int8 sub-scales, Q2_K's 4-bit
// ones, Q3_K's 6-bit ones less 32).
constexpr bool half_scales(QuantType t) {
  return t == QuantType::kQ6_K || t == QuantType::kQ2_K || t == QuantType::kQ3_K;
}
// Bytes of a block (K-quants: of a super-block).
constexpr int64_t block_bytes(QuantType t) {
  switch (t) {
    case QuantType::kQ4_0: return 18;
    case QuantType::kQ4_1: return 20;
    case QuantType::kQ5_0: return 22;
    case QuantType::kQ5_1: return 24;
    case QuantType::kQ8_0: return 34;
    case QuantType::kQ4_K: return 144;
    case QuantType::kQ5_K: return 176;
    case QuantType::kQ6_K: return 210;
    case QuantType::kIQ4_NL: return 18;
    case QuantType::kIQ4_XS: return 136;
    case QuantType::kQ2_K: return 84;
    case QuantType::kQ3_K: return 110;
    case QuantType::kF16:
    case QuantType::kBF16: return 64;
  }
  return 0;
}
// Formats whose weights carry a min term (w = scale * q + min).
constexpr bool has_min(QuantType t) {
  return t == QuantType::kQ4_1 || t == QuantType::kQ5_1 || t == QuantType::kQ4_K ||
         t == QuantType::kQ5_K || t == QuantType::kQ2_K;
}
// Formats whose 8-bit quants (as the int8 arithmetic forms them) are signed.
constexpr bool signed_quants(QuantType t) {
  return t == QuantType::kQ8_0 || t == QuantType::kIQ4_NL || t == QuantType::kIQ4_XS;
}
// IQ4_XS: sub-block j's scale (-32..31) from the super-block's 16-bit scales_h and its
// 32-bit scales_l.
constexpr int iq4xs_scale(uint32_t scales_h, uint32_t scales_l, int j) {
  return static_cast<int>(((scales_l >> (4 * j)) & 0x0F) | (((scales_h >> (2 * j)) & 3) << 4)) - 32;
}
// The offset subtracted from the unsigned quants (w = d * (q - offset)).
constexpr int32_t quant_offset(QuantType t) {
  return t == QuantType::kQ4_0   ? 8
         : t == QuantType::kQ5_0 ? 16
         : t == QuantType::kQ6_K ? 32
         : t == QuantType::kQ3_K ? 4
                                 : 0;
}
// Q3_K: scale g (0..15, of elements 16g..16g + 15) of a block's 12 scale bytes, as the
// signed multiplier (the 6-bit field less 32): its low 4 bits are the low (g < 8) or high
// nibble of byte g % 8, its high 2 bits bits 2 (g / 4).. of byte 8 + g % 4.
constexpr int q3k_scale(const uint8_t* s, int g) {
  return static_cast<int>(((s[g % 8] >> (4 * (g / 8))) & 0x0F) | (((s[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
}
// Q3_K: the unsigned quant (0..7, offset 4) of element l (0..31) of sub-block j (0..7) of a
// block: 2 bits at bit 2 (j % 4) of byte 32 (j / 4) + l of the 64 quant bytes at 32, the
// third bit j of hmask byte l.
constexpr int q3k_quant(const uint8_t* block, int j, int l) {
  return ((block[32 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3) | (((block[l] >> j) & 1) << 2);
}
// Q5_0 / Q5_1: where the 4 bytes of high bits and the 16 of nibbles lie in a block.
constexpr int64_t q5_high_bits_at(QuantType t) { return t == QuantType::kQ5_1 ? 4 : 2; }
constexpr int64_t q5_nibbles_at(QuantType t) { return q5_high_bits_at(t) + 4; }


inline uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<unsigned>(p[1]) << 8));
}

inline uint32_t load_u32(const uint8_t* p) {
  return load_u16(p) | (static_cast<uint32_t>(load_u16(p + 2)) << 16);
}

// bfloat16 -> float (exact: its bits are a float's top 16).
inline float bf16_to_float(const uint8_t* p) {
  const uint32_t bits = static_cast<uint32_t>(load_u16(p)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE half -> float (exact: every half is a float).
inline float half_to_float(const uint8_t* p) {
  const uint32_t h = load_u16(p);
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 bytes.
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The int8 arithmetic's code paths (all compute the same bits; see quant.h).
enum class Int8Path { kScalar, kAvx2, kAvxVnni, kAvx512Vnni };
// The path a resolved LinearIsa (not kAuto) runs: AVX-512 with VNNI -> kAvx512Vnni; AVX2
// (or AVX-512 without VNNI) -> kAvxVnni where the CPU has AVX-VNNI, else kAvx2.
Int8Path int8_path(LinearIsa isa);
const char* int8_path_name(Int8Path path);
// Tests: run every int8 call on the path named (int8_path_name), whatever the isa; an
// empty name undoes it. Returns an error when the name is unknown or the CPU lacks it.
std::string int8_force_path(const char* name);

// Rows 0..rows-1 (<= 16) of one packed group (QuantLayout::kPacked16) in the file's layout,
// row stride ldo bytes.
void unpack16_group(QuantType type, int64_t k, const uint8_t* group, int64_t rows, uint8_t* out,
                    int64_t ldo);

// y = x w^T in the int8 arithmetic; arguments checked by quant_linear_f32.
void quant_linear_int8(const QuantLinearArgs& args, LinearIsa isa);

}  // namespace quant_detail
}  // namespace verispec
