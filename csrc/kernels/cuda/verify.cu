// verify on CUDA: the launcher of verify_policy_kernel (one block per row position) and
// verify_sample_kernel (one block per row), row_kernels.cuh, on the caller's stream.
#include "launch.cuh"
#include "row_kernels.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

}  // namespace

OpStatus verify_cuda(const VerifyArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_verify_args(a);
  if (!s.ok() || a.batch == 0) return s;
  if (a.batch * (a.num_spec + 1) > INT_MAX) {
    return invalid_argument("batch * (K + 1) must be < 2^31 on CUDA");
  }
  DeviceGuard guard(launch.device);
  if (guard.error() != cudaSuccess) return cuda_error_status(guard.error());
  OpWorkspace ws;
  s = ws.acquire(launch, verify_cuda_workspace_bytes(a.batch, a.num_spec));
  if (!s.ok()) return s;
  auto* stats = static_cast<RowStats*>(ws.payload());
  const auto stream = static_cast<cudaStream_t>(launch.stream);
  const bool filter = verify_may_filter(a);
  dispatch_dtype(a.target_logits_dtype, a.target_logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    const auto positions = static_cast<unsigned>(a.batch * (a.num_spec + 1));
    if (filter) {
      verify_policy_kernel<T, kBlock, true><<<positions, kBlock, 0, stream>>>(a, stats, ws.record());
    } else {
      verify_policy_kernel<T, kBlock, false><<<positions, kBlock, 0, stream>>>(a, stats, ws.record());
    }
    verify_sample_kernel<T, kBlock>
        <<<static_cast<unsigned>(a.batch), kBlock, 0, stream>>>(a, stats, ws.record());
  });
  uint64_t record;
  s = ws.finish(launch, &record);
  if (!s.ok()) return s;
  s = decode_device_error(OpKind::kVerify, record);
  switch (s.code) {
    case StatusCode::kInvalidPolicy: fill_policy_value(a.policy, &s); break;
    case StatusCode::kNumDraftOutOfRange: fill_value(a.num_draft, s.row, &s); break;
    case StatusCode::kTokenOutOfRange:
      fill_value(a.draft_tokens, s.row * a.draft_tokens_stride_b + s.col, &s);
      break;
    default: break;
  }
  return s;
}

}  // namespace verispec
