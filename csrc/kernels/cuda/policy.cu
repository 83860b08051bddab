// apply_policy on CUDA: one block per row. compute_row_stats (block_ops.cuh) finds the
// max, the softmax normaliser and the filter threshold by block-wide threshold search
// (no sort of the vocabulary); one more pass writes the probabilities.
// Napkin math (V = 32000, bf16, no filter): 3 reads of 64 KB + one 128 KB write per
// row; each active top-k / top-p search adds up to 10 read passes (8-way, see
// threshold_search.h). Without any filter the kernel is compiled without them.
#include "block_ops.cuh"
#include "launch.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

template <typename T, int BLOCK, bool FILTER>
__global__ void __launch_bounds__(BLOCK)
    apply_policy_kernel(ApplyPolicyArgs a, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t row = blockIdx.x;
  const int V = static_cast<int>(a.vocab);
  const T* x = static_cast<const T*>(a.logits) + row * a.logits_row_stride;  // [V]
  float* out = a.probs + row * a.probs_row_stride;                            // [V]
  const RowPolicy pol = resolve_policy(a.policy, row);
  const int field = invalid_policy_field(pol);
  if (field >= 0) {
    if (threadIdx.x == 0) report_error(record, row, StatusCode::kInvalidPolicy, field);
  } else {
    RowStats s;
    const int bad = compute_row_stats<T, BLOCK, FILTER>(x, V, pol, pol.greedy(), ops, &s);
    if (bad == kLogitsOk) {
      for (int i = threadIdx.x; i < V; i += BLOCK) {
        out[i] = policy_prob(to_float(x[i]), i, s, pol.temperature, pol.greedy());
      }
      return;
    }
    // A NaN / +Inf at `bad`, or all -Inf (col -1).
    if (threadIdx.x == 0) report_error(record, row, StatusCode::kNanOrInfLogits, bad >= 0 ? bad : -1);
  }
  for (int i = threadIdx.x; i < V; i += BLOCK) out[i] = 0.0f;  // the row is at fault
}

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
