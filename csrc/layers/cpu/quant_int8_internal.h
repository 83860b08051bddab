// Internal to the int8 arithmetic (quant_int8.cpp and its vector paths
// quant_int8_{vnni512,avxvnni,avx2}.cpp): x quantized per block, and each vector path's
// entry point.
#pragma once

#include <cstdint>
#include <vector>

#include "verispec/layers/quant.h"

namespace verispec {
namespace quant_detail {

// ---- the order of the sums --------------------------------------------------------------
//
// Each output y[m, n] is one float accumulator that takes the blocks of the row in order
// (rows_scalar). The vector paths run 16 weight rows side by side, one per int32 / float
// lane: the 32 quants of one block of each of the 16 rows are transposed so that a
// block's integer dot product with x is summed whole in its row's lane (8 instructions
// for 16 rows, x's four values broadcast), and no sum ever crosses lanes.
constexpr int kRows = 16;

// ---- activations ------------------------------------------------------------------------

// x quantized, per row m and block b (index i = m * blocks + b): q[32 i ..] its 32 int8
// values, dx[i] the block's scale, s[i] the sum of its 32 values (exact; sf: as a float,
// exact), slo / shi the sums of values 0..15 and 16..31.
struct QuantX {
  int64_t m = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<int32_t> s, slo, shi;
  std::vector<float> dx, sf;
};

// y's columns n0 .. n1 - 1 for every row of x (a path's rows function).
using RowsFn = void (*)(const QuantLinearArgs&, const QuantX&, int64_t, int64_t);

// Each vector path's rows function for a type and layout (nullptr: a float-only type).
// Defined on x86 only; call one only where quant_int8.cpp's path_runs says it runs.
namespace vnni512 {
RowsFn rows_for_type(QuantType t, QuantLayout layout);
}
namespace avxvnni {
RowsFn rows_for_type(QuantType t, QuantLayout layout);
}
namespace avx2 {
RowsFn rows_for_type(QuantType t, QuantLayout layout);
}

}  // namespace quant_detail
}  // namespace verispec
