// apply_policy on CUDA: the launcher of apply_policy_kernel (row_kernels.cuh), one block
// per row, compiled with or without the filter code (policy_may_filter).
// Napkin math (V = 32000, bf16, no filter): 3 reads of 64 KB + one 128 KB write per
// row; each active top-k / top-p search adds up to 10 read passes (8-way, see
// threshold_search.h).
#include "launch.cuh"
#include "row_kernels.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

}  // namespace

OpStatus apply_policy_cuda(const ApplyPolicyArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_apply_policy_args(a);
  if (!s.ok() || a.rows == 0) return s;
  DeviceGuard guard(launch.device);
  if (guard.error() != cudaSuccess) return cuda_error_status(guard.error());
  OpWorkspace ws;
  s = ws.acquire(launch, apply_policy_cuda_workspace_bytes());
  if (!s.ok()) return s;
  const auto stream = static_cast<cudaStream_t>(launch.stream);
  const bool filter = policy_may_filter(a.policy, a.vocab);
  dispatch_dtype(a.logits_dtype, a.logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    const auto grid = static_cast<unsigned>(a.rows);
    if (filter) {
      apply_policy_kernel<T, kBlock, true><<<grid, kBlock, 0, stream>>>(a, ws.record());
    } else {
      apply_policy_kernel<T, kBlock, false><<<grid, kBlock, 0, stream>>>(a, ws.record());
    }
  });
  uint64_t record;
  s = ws.finish(launch, &record);
  if (!s.ok()) return s;
  s = decode_device_error(OpKind::kApplyPolicy, record);
  if (s.code == StatusCode::kInvalidPolicy) fill_policy_value(a.policy, &s);
  if (s.code == StatusCode::kNanOrInfLogits && s.col >= 0) {
    fill_logit_value(a.logits, a.logits_dtype, s.row * a.logits_row_stride + s.col, &s);
  }
  return s;
}

}  // namespace verispec
