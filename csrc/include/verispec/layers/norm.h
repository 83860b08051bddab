// RMSNorm of float32 rows on the CPU: y = w * (x * rsqrt(mean(x^2) + eps)), the order
// transformers' LlamaRMSNorm multiplies in. Framework-free: raw pointers and sizes.
//
// Why it exists: torch's float32 rms_norm on CPU is a chain of ~10 small ops; inside a
// decode loop, right after a matrix product, it cost ~65 us a call (61 calls a SmolLM2
// token, ~4 ms of ~40). This is one pass over each row.
#pragma once

#include <cstdint>
#include <string>

namespace verispec {

// x: [rows, dim], row stride ldx; w: [dim]; y: [rows, dim], row stride ldy (y may be x).
// The mean of squares is summed in double, then rounded to float like torch's float32
// statistic; the scale is 1 / sqrt(mean + eps) in float. Returns "" or what is wrong.
std::string rms_norm_f32(const float* x, int64_t rows, int64_t dim, int64_t ldx, const float* w,
                         float eps, float* y, int64_t ldy);

// The residual add before a norm, in one pass: x += delta (in place), then y = the
// RMSNorm of the new x as rms_norm_f32 computes it. delta: [rows, dim], row stride ldd.
std::string add_rms_norm_f32(float* x, int64_t rows, int64_t dim, int64_t ldx,
                             const float* delta, int64_t ldd, const float* w, float eps, float* y,
                             int64_t ldy);

}  // namespace verispec
