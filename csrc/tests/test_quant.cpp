// The quantized CPU linear kernel (verispec/layers/quant.h) under the sanitizers: for every
// format and instruction set, the dequantized weights against an element-by-element
// reference written from the block layouts (bit for bit), products against a double
// product of those weights within the documented bound, bitwise batch invariance over
// M, thread counts (the kernel's own workers: no OpenMP runtime here) and row strides,
// and the argument errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "native_check.h"
#include "verispec/layers/linear.h"
#include "verispec/layers/quant.h"

using namespace verispec;

namespace {

float half_bits_to_float(uint16_t h) {  // normal halves only (what the test writes)
  const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  const float v = std::ldexp(1.0f + man / 1024.0f, exp - 15);
  return (h & 0x8000) ? -v : v;
}

uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Element e of the block at `b`, written from the layout in quant.h one element at a time.
float reference_weight(QuantType t, const uint8_t* b, int e) {
  switch (t) {
    case QuantType::kF16: return half_bits_to_float(u16(b + 2 * e));
    case QuantType::kBF16: {
      const uint32_t bits = static_cast<uint32_t>(u16(b + 2 * e)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case QuantType::kQ8_0:
      return half_bits_to_float(u16(b)) * static_cast<float>(static_cast<int8_t>(b[2 + e]));
    case QuantType::kQ4_0: {
      const int q = e < 16 ? (b[2 + e] & 15) : (b[2 + e - 16] >> 4);
      return half_bits_to_float(u16(b)) * static_cast<float>(q - 8);
    }
    case QuantType::kQ4_1: {
      const int q = e < 16 ? (b[4 + e] & 15) : (b[4 + e - 16] >> 4);
      return half_bits_to_float(u16(b)) * static_cast<float>(q) + half_bits_to_float(u16(b + 2));
    }
    case QuantType::kQ5_0:
    case QuantType::kQ5_1: {
      const bool q51 = t == QuantType::kQ5_1;
      const uint8_t* qh = b + (q51 ? 4 : 2);
      const uint8_t* qs = qh + 4;
      const int q = (e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4)) | (((qh[e / 8] >> (e % 8)) & 1) << 4);
      if (q51) return half_bits_to_float(u16(b)) * static_cast<float>(q) + half_bits_to_float(u16(b + 2));
      return half_bits_to_float(u16(b)) * static_cast<float>(q - 16);
    }
    case QuantType::kQ2_K: {
      const int sub = e / 32, l = e % 32, g = e / 16;  // g: the 16 elements' scale byte
      const int q = (b[16 + 32 * (sub / 4) + l] >> (2 * (sub % 4))) & 3;
      return (half_bits_to_float(u16(b + 80)) * static_cast<float>(b[g] & 15)) * static_cast<float>(q) -
             half_bits_to_float(u16(b + 82)) * static_cast<float>(b[g] >> 4);
    }
    case QuantType::kQ3_K: {
      const int sub = e / 32, l = e % 32, g = e / 16;  // g: the 16 elements' scale
      const int low = (b[32 + 32 * (sub / 4) + l] >> (2 * (sub % 4))) & 3, high = (b[l] >> sub) & 1;
      const int sc_lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4;
      const int sc_hi = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
      return (half_bits_to_float(u16(b + 108)) * static_cast<float>((sc_lo | (sc_hi << 4)) - 32)) *
             static_cast<float>(low + 4 * high - 4);
    }
    case QuantType::kIQ4_XS: {
      static const int kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
      const int sub = e / 32, l = e % 32;
      const int ls = ((b[4 + sub / 2] >> (4 * (sub % 2))) & 15) | (((u16(b + 2) >> (2 * sub)) & 3) << 4);
      const uint8_t byte = b[8 + 16 * sub + l % 16];
      const int q = l < 16 ? byte & 15 : byte >> 4;
      return (half_bits_to_float(u16(b)) * static_cast<float>(ls - 32)) * static_cast<float>(kValues[q]);
    }
    case QuantType::kIQ4_NL: {
      static const int kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
      const int q = e < 16 ? (b[2 + e] & 15) : (b[2 + e - 16] >> 4);
      return half_bits_to_float(u16(b)) * static_cast<float>(kValues[q]);
    }
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: {
      const int sub = e / 32, l = e % 32;
      const uint8_t* s = b + 4;
      int sc, mn;
      if (sub < 4) {
        sc = s[sub] & 63;
        mn = s[sub + 4] & 63;
      } else {
        sc = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
        mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
      }
      const bool five = t == QuantType::kQ5_K;
      const uint8_t byte = b[(five ? 48 : 16) + 32 * (sub / 2) + l];
      int q = sub % 2 ? byte >> 4 : byte & 15;
      if (five) q += ((b[16 + l] >> sub) & 1) << 4;
      return (half_bits_to_float(u16(b)) * static_cast<float>(sc)) * static_cast<float>(q) -
             half_bits_to_float(u16(b + 2)) * static_cast<float>(mn);
    }
    case QuantType::kQ6_K: {
      const int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
      const uint8_t lo = b[64 * half + 32 * (quarter % 2) + l];
      const int low = quarter < 2 ? lo & 15 : lo >> 4;
      const int high = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
      const int scale = static_cast<int8_t>(b[192 + e / 16]);
      return (half_bits_to_float(u16(b + 208)) * static_cast<float>(scale)) *
             static_cast<float>((low | (high << 4)) - 32);
    }
  }
  return NAN;
}

// Random blocks with normal half scales of about 2^-7..2^-5.
std::vector<uint8_t> random_rows(QuantType t, int64_t n, int64_t k, std::mt19937& rng) {
  const int64_t bb = quant_block_bytes(t), blocks = n * k / quant_block_elems(t);
  std::vector<uint8_t> w(static_cast<size_t>(blocks * bb));
  for (auto& v : w) v = static_cast<uint8_t>(rng());
  if (quant_is_float16(t)) {  // normal values of either sign, about 2^-7..2^-5
    for (size_t i = 0; i < w.size(); i += 2) {
      const uint16_t h = t == QuantType::kF16
                             ? static_cast<uint16_t>(((rng() & 1) << 15) | ((8 + rng() % 3) << 10) | (rng() & 0x3FF))
                             : static_cast<uint16_t>(((rng() & 1) << 15) | ((120 + rng() % 3) << 7) | (rng() & 0x7F));
      w[i] = static_cast<uint8_t>(h & 0xFF);
      w[i + 1] = static_cast<uint8_t>(h >> 8);
    }
    return w;
  }
  std::vector<int> halves;
  if (t == QuantType::kQ6_K) halves = {208};
  else if (t == QuantType::kQ2_K) halves = {80, 82};
  else if (t == QuantType::kQ3_K) halves = {108};
  else if (t == QuantType::kQ4_1 || t == QuantType::kQ5_1 || t == QuantType::kQ4_K ||
           t == QuantType::kQ5_K)
    halves = {0, 2};
  else halves = {0};
  for (int64_t b = 0; b < blocks; ++b)
    for (int off : halves) {
      const uint16_t h = static_cast<uint16_t>(((8 + rng() % 3) << 10) | (rng() & 0x3FF));
      w[b * bb + off] = static_cast<uint8_t>(h & 0xFF);
      w[b * bb + off + 1] = static_cast<uint8_t>(h >> 8);
    }
  return w;
}

// The size of a block's min term (quant.h, int8 arithmetic): Q4_1 / Q5_1 |m|, Q4_K / Q5_K
// 63 |dmin| (the largest 6-bit min), Q2_K 15 |dmin|, else 0.
double min_term(QuantType t, const uint8_t* b) {
  if (t == QuantType::kQ4_1 || t == QuantType::kQ5_1) return std::fabs(half_bits_to_float(u16(b + 2)));
  if (t == QuantType::kQ4_K || t == QuantType::kQ5_K) return 63.0 * std::fabs(half_bits_to_float(u16(b + 2)));
  if (t == QuantType::kQ2_K) return 15.0 * std::fabs(half_bits_to_float(u16(b + 82)));
  return 0.0;
}

// The int8 arithmetic's bound (quant.h) for x row `x` against dequantized row `w`:
// sum_b 0.50003 * amax_b / 127 * sum_{k in b} |w_k| + (K/32 + 8) * 2^-23 * sum_k
// (|x_k| + amax_b / 254) * (|w_k| + C_b).
double int8_bound(QuantType t, const float* x, const float* w, const uint8_t* wrow, int64_t k) {
  double quant = 0, rounding = 0;
  for (int64_t b = 0; b < k / 32; ++b) {
    double amax = 0, wsum = 0;
    for (int i = 0; i < 32; ++i) {
      amax = std::fmax(amax, std::fabs(static_cast<double>(x[32 * b + i])));
      wsum += std::fabs(static_cast<double>(w[32 * b + i]));
    }
    const int64_t block = 32 * b / quant_block_elems(t);
    const double c = min_term(t, wrow + block * quant_block_bytes(t));
    quant += 0.50003 * amax / 127.0 * wsum;
    for (int i = 0; i < 32; ++i)
      rounding += (std::fabs(static_cast<double>(x[32 * b + i])) + amax / 254.0) *
                  (std::fabs(static_cast<double>(w[32 * b + i])) + c);
  }
  return quant + (k / 32 + 8) * std::ldexp(1.0, -23) * rounding + 1e-30;
}

void test_format(QuantType t, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t k = quant_block_elems(t) * 2, n = 41, rows = 17, ldx = k + 5;
  const int64_t row_bytes = k / quant_block_elems(t) * quant_block_bytes(t);
  const std::vector<uint8_t> w = random_rows(t, n, k, rng);
  std::vector<float> ref(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t block = j / quant_block_elems(t);
      ref[r * k + j] = reference_weight(t, w.data() + r * row_bytes + block * quant_block_bytes(t),
                                        static_cast<int>(j % quant_block_elems(t)));
    }
  std::vector<float> x(static_cast<size_t>(rows * ldx), NAN);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) x[r * ldx + j] = normal(rng);

  std::vector<float> int8_scalar;  // the int8 arithmetic's outputs on the scalar path
  for (LinearIsa isa : {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512}) {
    if (!linear_isa_supported(isa)) continue;
    std::vector<float> deq(static_cast<size_t>(n * k));
    CHECK(quant_dequantize_rows(t, w.data(), n, k, row_bytes, nullptr, n, deq.data(), k, isa).empty());
    CHECK(std::memcmp(deq.data(), ref.data(), deq.size() * sizeof(float)) == 0);
    const int64_t picked[] = {40, 3, 3};
    std::vector<float> some(static_cast<size_t>(3 * k));
    CHECK(quant_dequantize_rows(t, w.data(), n, k, row_bytes, picked, 3, some.data(), k, isa).empty());
    CHECK(std::memcmp(some.data(), ref.data() + 40 * k, k * sizeof(float)) == 0);

   for (QuantArith arith : {QuantArith::kFloat, QuantArith::kInt8}) {
    std::vector<float> alone(static_cast<size_t>(rows * n));
    for (int64_t r = 0; r < rows; ++r) {
      QuantLinearArgs a;
      a.x = x.data() + r * ldx; a.w = w.data(); a.y = alone.data() + r * n;
      a.m = 1; a.n = n; a.k = k; a.ldx = ldx; a.ldw = row_bytes; a.ldy = n; a.type = t; a.isa = isa;
      a.arith = arith;
      CHECK(quant_linear_f32(a).empty());
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c) {
        double exact = 0, scale = 0;
        for (int64_t j = 0; j < k; ++j) {
          exact += static_cast<double>(x[r * ldx + j]) * ref[c * k + j];
          scale += std::fabs(static_cast<double>(x[r * ldx + j]) * ref[c * k + j]);
        }
        // (F16 / BF16 run the float arithmetic whatever arith says)
        const double tol = arith == QuantArith::kFloat || quant_is_float16(t)
                               ? k * std::ldexp(1.0, -24) * scale + 1e-30
                               : int8_bound(t, x.data() + r * ldx, ref.data() + c * k,
                                            w.data() + c * row_bytes, k);
        CHECK_NEAR(alone[r * n + c], exact, tol);
      }
    // int8: every instruction set computes the scalar path's bits
    if (arith == QuantArith::kInt8 && !quant_is_float16(t)) {
      if (isa == LinearIsa::kScalar) int8_scalar = alone;
      else CHECK(std::memcmp(alone.data(), int8_scalar.data(), alone.size() * sizeof(float)) == 0);
    }
    for (int64_t m : {2, 3, 5, 6, 7, 8, 9, 16, 17})  // every pass size (quant_int8_body.inc)
      for (int threads : {1, 2, 5}) {
        std::vector<float> y(static_cast<size_t>(m * (n + 2)), NAN);
        QuantLinearArgs a;
        a.x = x.data(); a.w = w.data(); a.y = y.data();
        a.m = m; a.n = n; a.k = k; a.ldx = ldx; a.ldw = row_bytes; a.ldy = n + 2;
        a.type = t; a.num_threads = threads; a.isa = isa; a.arith = arith;
        CHECK(quant_linear_f32(a).empty());
        bool same = true;
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c)
            same = same && std::memcmp(&y[r * (n + 2) + c], &alone[r * n + c], sizeof(float)) == 0;
        CHECK(same);
        CHECK(std::isnan(y[n]) && std::isnan(y[n + 1]));  // the row padding is not written
      }
    // The packed layout (41 rows: two full groups and one of 9): the same bits, read from a
    // buffer of exactly quant_packed_bytes (the sanitizers see any read past it).
    std::vector<uint8_t> packed(static_cast<size_t>(quant_packed_bytes(t, n, k)));
    CHECK(packed.size() == static_cast<size_t>(3 * 16 * row_bytes));
    CHECK(quant_pack16(t, w.data(), n, k, row_bytes, packed.data()).empty());
    for (int64_t m : {1, 5, 17})
      for (int threads : {1, 2}) {
        std::vector<float> y(static_cast<size_t>(m * n), NAN);
        QuantLinearArgs a;
        a.x = x.data(); a.w = packed.data(); a.y = y.data(); a.layout = QuantLayout::kPacked16;
        a.m = m; a.n = n; a.k = k; a.ldx = ldx; a.ldw = 0; a.ldy = n;
        a.type = t; a.num_threads = threads; a.isa = isa; a.arith = arith;
        CHECK(quant_linear_f32(a).empty());
        CHECK(std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)) == 0);
      }
    std::vector<float> deq(static_cast<size_t>(n * k));
    CHECK(quant_dequantize_rows(t, packed.data(), n, k, 0, nullptr, n, deq.data(), k, isa,
                                QuantLayout::kPacked16).empty());
    CHECK(std::memcmp(deq.data(), ref.data(), deq.size() * sizeof(float)) == 0);
   }
  }
  // Packing is lossless: rows 0..n and any range of them come back.
  std::vector<uint8_t> packed(static_cast<size_t>(quant_packed_bytes(t, n, k)));
  CHECK(quant_pack16(t, w.data(), n, k, row_bytes, packed.data()).empty());
  std::vector<uint8_t> back(w.size(), 0);
  CHECK(quant_unpack16(t, packed.data(), n, k, 0, n, back.data(), row_bytes).empty());
  CHECK(back == w);
  std::vector<uint8_t> some(static_cast<size_t>(20 * row_bytes));
  CHECK(quant_unpack16(t, packed.data(), n, k, 13, 20, some.data(), row_bytes).empty());
  CHECK(std::memcmp(some.data(), w.data() + 13 * row_bytes, some.size()) == 0);
  CHECK(native_check::has(quant_unpack16(t, packed.data(), n, k, 30, 12, some.data(), row_bytes),
                          "rows [30, 42) are out of range [0, 41)"));
}

void test_errors() {
  std::vector<uint8_t> w(2 * 18, 0);
  std::vector<float> x(64, 1.0f), y(4, -1.0f);
  QuantLinearArgs a;
  a.x = x.data(); a.w = w.data(); a.y = y.data();
  a.m = 2; a.n = 2; a.k = 32; a.ldx = 32; a.ldw = 18; a.ldy = 2; a.type = QuantType::kQ4_0;
  a.k = 31;
  a.ldx = 31;
  CHECK(native_check::has(quant_linear_f32(a), "k must be a multiple of Q4_0's block of 32 weights, got k = 31"));
  a.k = 32;
  a.ldx = 32;
  a.ldw = 17;
  CHECK(native_check::has(quant_linear_f32(a), "ldw must cover a row's blocks: expected >= 18 bytes, got 17"));
  a.ldw = 18;
  a.num_threads = 0;
  CHECK(native_check::has(quant_linear_f32(a), "num_threads must be >= 1"));
  a.num_threads = 1;
  a.type = static_cast<QuantType>(16);
  CHECK(native_check::has(quant_linear_f32(a), "unsupported quantization type id 16"));
  a.type = QuantType::kQ4_0;
  CHECK(y[0] == -1.0f);
  CHECK(quant_linear_f32(a).empty());
  CHECK(y[0] == 0.0f);  // d = 0
  const int64_t bad_row = 2;
  std::vector<float> out(32);
  CHECK(native_check::has(quant_dequantize_rows(QuantType::kQ4_0, w.data(), 2, 32, 18, &bad_row, 1,
                                                out.data(), 32),
                          "row index 2 at 0 is out of range [0, 2)"));
}

}  // namespace

int main() {
  std::mt19937 rng(23);
  for (QuantType t : kQuantTypes) test_format(t, rng);
  test_errors();
  return native_check::check_summary("test_quant");
}
