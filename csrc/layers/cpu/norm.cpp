// RMSNorm of float32 rows (verispec/layers/norm.h).
#include "verispec/layers/norm.h"

#include <cmath>
#include <string>

namespace verispec {

namespace {

std::string norm_args_error(int64_t rows, int64_t dim, int64_t ldx, float eps, int64_t ldy) {
  if (rows < 0 || dim < 1)
    return "rows must be >= 0 and dim >= 1, got rows = " + std::to_string(rows) +
           ", dim = " + std::to_string(dim);
  if (ldx < dim || ldy < dim)
    return "row strides must cover a row: ldx = " + std::to_string(ldx) + ", ldy = " +
           std::to_string(ldy) + " (>= dim = " + std::to_string(dim) + ")";
  if (!(eps >= 0.0f)) return "eps must be >= 0, got " + std::to_string(eps);
  return "";
}

}  // namespace

std::string rms_norm_f32(const float* x, int64_t rows, int64_t dim, int64_t ldx, const float* w,
                         float eps, float* y, int64_t ldy) {
  std::string error = norm_args_error(rows, dim, ldx, eps, ldy);
  if (!error.empty()) return error;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * scale);
  }
  return "";
}

std::string add_rms_norm_f32(float* x, int64_t rows, int64_t dim, int64_t ldx,
                             const float* delta, int64_t ldd, const float* w, float eps, float* y,
                             int64_t ldy) {
  std::string error = norm_args_error(rows, dim, ldx, eps, ldy);
  if (!error.empty()) return error;
  if (ldd < dim)
    return "the row stride of delta must cover a row: ldd = " + std::to_string(ldd) +
           " (>= dim = " + std::to_string(dim) + ")";
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i) x[r * ldx + i] += delta[r * ldd + i];
  return rms_norm_f32(x, rows, dim, ldx, w, eps, y, ldy);
}

}  // namespace verispec
