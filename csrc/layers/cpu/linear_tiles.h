// Internal to the CPU linear kernels: the float32 tile functions and the thread split of
// linear.cpp, shared by the quantized kernel (quant_linear.cpp) so that both compute an
// output with the same float sequence (one place for the rounding rule of linear.h).
#pragma once

#include <cstdint>

#include "verispec/layers/linear.h"

namespace verispec {
namespace linear_detail {

// Weight rows one wide tile computes on `isa` (a resolved instruction set, not kAuto).
int tile_rows(LinearIsa isa);

// y[0..mb) x [0..rows) = x[0..mb) . w[0..rows)^T over k, w row-major [rows, k] with row
// stride ldw; mb in [1, kLinearRowBlock], rows 1 or tile_rows(isa). Each output is the
// float sequence of linear_f32 with [N, K] weights (linear.h), whatever mb and rows are.
void tile_f32(LinearIsa isa, int mb, int rows, const float* x, int64_t ldx, const float* w,
              int64_t ldw, float* y, int64_t ldy, int64_t k);

// The horizontal sum of a 16-lane AVX-512 accumulator (lanes[0..16)) exactly as
// linear_f32's AVX-512 kernels reduce theirs: a kernel that keeps linear_f32's lane
// sums itself (quant_linear.cpp's fused AVX-512 path) finishes with this.
float reduce_avx512_lanes(const float* lanes);

// Runs fn(ctx, part) for every part in [0, parts) in parallel: on the loaded OpenMP
// runtime's team (torch's) unless own_threads, else on linear.cpp's worker pool.
void run_parallel(int parts, void (*fn)(void*, int), void* ctx, bool own_threads);

// Whether `isa` is kAuto or one this CPU runs; kAuto resolved to the best one.
LinearIsa resolve_isa(LinearIsa isa);

}  // namespace linear_detail
}  // namespace verispec
