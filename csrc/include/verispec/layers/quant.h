// Linear layers over GGUF-quantized weights, for a few rows (CPU): y = x w^T with w kept
// in the file's block format ([N, K]: each weight row is K / block_elems blocks, rows
// row_bytes apart). Framework-free: raw pointers, sizes, strides.
//
// Formats (ggml block layouts, little-endian; d, dmin, m: IEEE half floats):
//   Q8_0 (32 elems, 34 B):  d, int8 q[32]                        w = d * q
//   Q4_0 (32 elems, 18 B):  d, 16 B of nibbles (low: 0..15, high: 16..31)
//                                                                 w = d * (q - 8)
//   Q4_1 (32 elems, 20 B):  d, m, nibbles as Q4_0                  w = d * q + m
//   Q5_0 (32 elems, 22 B):  d, 4 B of high bits (bit i of the little-endian uint32:
//        element i), nibbles as Q4_0                q = nibble + 16 * bit, w = d * (q - 16)
//   Q5_1 (32 elems, 24 B):  d, m, high bits and nibbles as Q5_0    w = d * q + m
//   IQ4_NL (32 elems, 18 B): d, nibbles as Q4_0, each an index into the non-linear table
//        kIq4nlValues (-127 .. 113)                                 w = d * table[q]
//   Q4_K (256 elems, 144 B): d, dmin, 12 B of 6-bit scales/mins for 8 sub-blocks of 32,
//        128 B of nibbles (sub-block 2j: low nibbles of bytes 32j.., 2j+1: high ones)
//                                                                 w = (d*sc) * q - (dmin*mn)
//   Q5_K (256 elems, 176 B): d, dmin, scales as Q4_K, 32 B of high bits (bit i of byte l:
//        element 32i + l), 128 B of nibbles as Q4_K              q = nibble + 16 * bit
//   Q6_K (256 elems, 210 B): 128 B low nibbles, 64 B of 2-bit highs, int8 scales[16] (one
//        per 16 elements), d at the end                           w = (d*sc) * (q - 32)
//   Q2_K (256 elems, 84 B): 16 B of scales (one byte per 16 elements: low nibble sc, high
//        nibble mn), 64 B of 2-bit quants (sub-block j = 4h + i of 32: bits 2i of bytes
//        32h..32h + 31), d, dmin             w = (d*sc) * q - (dmin*mn), per 16 elements
//   Q3_K (256 elems, 110 B): 32 B hmask (bit j of byte l: the high bit of element 32j + l),
//        64 B of 2-bit quants as Q2_K's, 12 B of 16 6-bit scales (scale g: low 4 bits the
//        low (g < 8) or high (g >= 8) nibble of byte g % 8, high 2 bits bits 2 (g / 4),
//        2 (g / 4) + 1 of byte 8 + g % 4), d at the end
//                       q = quant + 4 * bit, w = (d * (sc - 32)) * (q - 4), per 16 elements
//   IQ4_XS (256 elems, 136 B): d, 16-bit scales_h (2 bits per sub-block j of 32: bits 2j,
//        2j + 1), 4 B scales_l (4 bits per sub-block: bits 4j..4j + 3 of the uint32), 128 B
//        of nibbles (sub-block j: bytes 16j.., low nibbles elements 0..15, high 16..31),
//        indices into kIq4nlValues    w = (d * ((scales_l | scales_h << 4) - 32)) * table[q]
//   F16, BF16 (32 elems, 64 B): 32 IEEE half / bfloat16 values, no scale (ggml stores them
//        as rows of 16-bit values; a "block" here is 32 of them)          w = float(v)
//        Always the float arithmetic (an int8 request runs it: the weights carry no block
//        scale for integer products); the packed layout applies as to any format.
// Every weight is computed in float32 as written (products and the subtraction each
// rounded once, no fused multiply-add), which is exactly what gguf.quants' numpy
// dequantization computes: the dequantized weights are the same bits on every path.
//
// Two arithmetics (QuantLinearArgs::arith); both are batch invariant: y[m, n] does not
// depend on M, on the row's position, on strides or on the thread count.
//
// kFloat: the kernel dequantizes a tile of weight rows to float32 (in L1) and runs
// linear.h's float32 tile kernels on it, so each output is the float sequence of
// linear_f32 over the dequantized row (the rounding rule of linear.h; it depends on K and
// the instruction set only). Accuracy against a float64 dot product of the same
// dequantized weights: the float32 sum of K products,
// |y - y64| <= (K / lanes + log2(lanes) + 1) * 2^-24 * sum_k |x_k w_k|
// (lanes: 8 on scalar / AVX2, 16 on AVX-512); the tests check the looser K * 2^-24 * sum.
//
// kInt8 (the default; quant_int8.cpp): each row of x is quantized per block b of 32
// values: amax_b = max |x|, dx_b = fl(amax_b / 127), q = round-half-even(fl(x * fl(127 /
// amax_b))) in [-127, 127] (a zero block: dx = 0; a non-finite value: dx = NaN, so the row
// is NaN). Row-local, so batch invariance holds. A weight block of 32 is unpacked to 8-bit
// integers u (Q8_0, IQ4_NL, IQ4_XS: signed, IQ4_NL's / IQ4_XS's the table's values; Q4_0: 0..15 with offset
// 8; Q5_0: 0..31 with offset 16; Q4_1, Q5_1, Q4_K, Q5_K: 0..15 / 0..31;
// Q6_K: 0..63 with offset 32 and one int8 sub-scale per 16; Q2_K: 0..3 and one 4-bit scale
// and one 4-bit min per 16; Q3_K: 0..7 with offset 4 and one sub-scale sc - 32 (-32..31)
// per 16) and the block's exact integer
//   P = sum_k u_k q_k - offset * S        (S = sum of the block's q)
// (Q6_K, Q2_K, Q3_K: each half's such sum times its sub-scale, added) is formed (vpdpbusd on AVX-512
// VNNI / AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2, C++). With ws the block's weight scale
// (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/Q6_K/Q2_K/Q3_K: d; Q4_K/Q5_K: d * sc; IQ4_XS: d * (ls - 32); exact) and wc its min
// (Q4_1/Q5_1: m; Q4_K/Q5_K:
// -(dmin * mn), exact; else none), one float accumulator per output takes the blocks in
// order:
//   y = fma(float(P), fl(ws * dx_b), y);  y = fma(float(S), fl(wc * dx_b), y)
// (Q2_K: wc = -dmin, and S is mn_lo * S_lo + mn_hi * S_hi, its halves' sums times their mins)
// The vector paths run 16 weight rows side by side, one per lane (a block's quants of the
// 16 rows loaded as they lie in the packed layout, QuantLayout::kPacked16, or transposed in
// registers from the file's layout, so each block's integer sum stays whole in its row's
// lane): one float sequence on every instruction set and layout, so every path computes
// the same bits (tested).
// Accuracy against a float64 dot product of the dequantized weights w (the activation
// rounding dominates: |x_k - dx_b q_k| <= 0.50003 amax_b / 127):
//   |y - y64| <= sum_b 0.50003 * amax_b / 127 * sum_{k in b} |w_k|
//              + (K/32 + 8) * 2^-23 * sum_k (|x_k| + amax_b / 254) * (|w_k| + C_b)
// with C_b the block's min term (Q4_1/Q5_1 |m|, Q4_K/Q5_K 63 |dmin|, Q2_K 15 |dmin|, else 0);
// relative to
// sum |x_k w_k| the first term is about 2^-8 (the second holds the K/32 accumulations of
// two fused multiply-adds each and the rounded products ws * dx). Tested per format x
// instruction set, and a block scale 5% off falls outside it.
#pragma once

#include <cstdint>
#include <string>

#include "verispec/layers/linear.h"

namespace verispec {

// The arithmetic of quant_linear_f32 (see "Arithmetic" above and "int8 arithmetic" below).
enum class QuantArith : int32_t { kFloat = 0, kInt8 = 1 };
const char* quant_arith_name(QuantArith arith);
// The int8 arithmetic's code path for `isa` (kAuto: the best): "avx512-vnni", "avx-vnni",
// "avx2-maddubs" or "scalar" (every one computes the same bits).
const char* quant_int8_path_name(LinearIsa isa);
// Tests: every int8 call runs the path named ("" to undo); the error when it cannot.
std::string quant_int8_force_path(const std::string& name);

// ggml's type ids for the supported formats.
enum class QuantType : int32_t {
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30
};
// Every supported format, in ggml's id order.
constexpr QuantType kQuantTypes[] = {QuantType::kF16,   QuantType::kQ4_0, QuantType::kQ4_1,
                                     QuantType::kQ5_0,  QuantType::kQ5_1, QuantType::kQ8_0,
                                     QuantType::kQ2_K,  QuantType::kQ3_K, QuantType::kQ4_K,
                                     QuantType::kQ5_K,  QuantType::kQ6_K,
                                     QuantType::kIQ4_NL, QuantType::kIQ4_XS, QuantType::kBF16};
// F16 and BF16: 16-bit float weights, products in the float arithmetic only.
constexpr bool quant_is_float16(QuantType t) { return t == QuantType::kF16 || t == QuantType::kBF16; }
// IQ4_NL's 16 weight values, indexed by a block's nibbles (ggml's kvalues_iq4nl).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// Whether `type_id` is a supported ggml type id.
bool quant_type_supported(int32_t type_id);
const char* quant_type_name(QuantType type);
int64_t quant_block_elems(QuantType type);  // weights per block
int64_t quant_block_bytes(QuantType type);  // bytes per block

// How a matrix's blocks lie in memory.
//
// kRows: row n's blocks, in order, at w + n * ldw (the file's layout).
// kPacked16: the rows in groups of 16 (the last group padded with zero rows), group g
//   at w + 16 * row_bytes * g. A row's bytes are cut into chunks: 2 bytes for each IEEE
//   half field (d, dmin, m; and IQ4_XS's 16-bit scales_h) and 4 bytes for everything else
//   (quants, scales, high bits),
//   in order; the chunk of c bytes at offset x of row r's bytes is stored at 16 x + c r of
//   its group. So a field's values for the 16 rows lie side by side, one 64-byte line per
//   4 bytes of each row (lane r: row r) or 32 bytes for a half: the int8 kernel loads them
//   as they are (no transposes) and reads each group as one stream. Same bytes in all
//   (plus the padding); quant_pack16 / quant_unpack16 convert.
enum class QuantLayout : int32_t { kRows = 0, kPacked16 = 1 };
constexpr int64_t kQuantPackRows = 16;

// Bytes of n rows of k weights packed (16 * row_bytes per group of 16 rows).
int64_t quant_packed_bytes(QuantType type, int64_t n, int64_t k);
// out (quant_packed_bytes) = rows 0..n of w ([n, k] blocks, row stride ldw) packed.
std::string quant_pack16(QuantType type, const uint8_t* w, int64_t n, int64_t k, int64_t ldw,
                         uint8_t* out);
// out[i] (row stride ldo bytes) = row row0 + i of the packed n x k matrix `packed`, in the
// file's layout, for i < count.
std::string quant_unpack16(QuantType type, const uint8_t* packed, int64_t n, int64_t k, int64_t row0,
                           int64_t count, uint8_t* out, int64_t ldo);

struct QuantLinearArgs {
  const float* x = nullptr;    // [m, k], row stride ldx (elements)
  const uint8_t* w = nullptr;  // [n, k] in blocks of `type`: kRows row stride ldw (bytes);
                               // kPacked16 packed (ldw unused)
  QuantLayout layout = QuantLayout::kRows;
  float* y = nullptr;          // [m, n], row stride ldy (elements)
  int64_t m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  QuantType type = QuantType::kQ8_0;
  int num_threads = 1;         // threads that share the N dimension (the caller included)
  LinearIsa isa = LinearIsa::kAuto;
  bool own_threads = false;    // as LinearArgs::own_threads
  QuantArith arith = QuantArith::kInt8;
};

// y = x w^T. Returns an empty string, or what is wrong with the arguments (nothing is
// written then): k must be a multiple of the block size, ldw cover a row's blocks.
std::string quant_linear_f32(const QuantLinearArgs& args);

// out[r, 0..k) = the float32 weights of rows[r] of w ([n, k] blocks, row stride ldw
// bytes; packed: ldw unused); out row stride ldo elements. rows == nullptr: rows 0..count-1.
std::string quant_dequantize_rows(QuantType type, const uint8_t* w, int64_t n, int64_t k,
                                  int64_t ldw, const int64_t* rows, int64_t count, float* out,
                                  int64_t ldo, LinearIsa isa = LinearIsa::kAuto,
                                  QuantLayout layout = QuantLayout::kRows);

}  // namespace verispec
