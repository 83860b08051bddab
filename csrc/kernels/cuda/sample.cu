// sample on CUDA: one block per row; a validation pass, then block_pick (a pass of
// per-thread chunk sums, a block scan over them, a walk along the chunk that holds the
// target).
#include "block_ops.cuh"
#include "launch.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) sample_kernel(SampleArgs a, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t row = blockIdx.x;
  const int V = static_cast<int>(a.vocab);
  const float* w = a.probs + row * a.probs_row_stride;  // [V]
  int bad = INT_MAX;
  for (int i = threadIdx.x; i < V; i += BLOCK) {
    const float v = w[i];
    if (!(v >= 0.0f) || !is_finite(v)) bad = min(bad, i);  // negative, NaN or Inf
  }
  bad = ops.min_int(bad);
  if (bad != INT_MAX) {
    if (threadIdx.x == 0) {
      report_error(record, row, StatusCode::kInvalidProbs, bad);
      a.tokens[row] = -1;
    }
    return;
  }
  const float u = uniform(resolve_seed(a.rng), resolve_offset(a.rng), static_cast<uint32_t>(row),
                          0, Purpose::kSample);
  const int token = block_pick<BLOCK>([w](int i) { return w[i]; }, V, u, ops);
  if (threadIdx.x == 0) {
    if (token < 0) report_error(record, row, StatusCode::kInvalidProbs, -1);  // zero mass
    a.tokens[row] = token;
  }
}

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
