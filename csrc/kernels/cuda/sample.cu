// sample on CUDA: the launcher of sample_kernel (row_kernels.cuh), one block per row.
#include "launch.cuh"
#include "row_kernels.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

}  // namespace

OpStatus sample_cuda(const SampleArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_sample_args(a);
  if (!s.ok() || a.rows == 0) return s;
  DeviceGuard guard(launch.device);
  if (guard.error() != cudaSuccess) return cuda_error_status(guard.error());
  OpWorkspace ws;
  s = ws.acquire(launch, sample_cuda_workspace_bytes());
  if (!s.ok()) return s;
  sample_kernel<kBlock><<<static_cast<unsigned>(a.rows), kBlock, 0,
                          static_cast<cudaStream_t>(launch.stream)>>>(a, ws.record());
  uint64_t record;
  s = ws.finish(launch, &record);
  if (!s.ok()) return s;
  s = decode_device_error(OpKind::kSample, record);
  if (s.code == StatusCode::kInvalidProbs && s.col >= 0) {
    fill_value(a.probs, s.row * a.probs_row_stride + s.col, &s);
  }
  return s;
}

}  // namespace verispec
