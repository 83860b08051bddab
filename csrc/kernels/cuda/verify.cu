// verify on CUDA, two kernels on the launcher's stream:
//   1. verify_policy_kernel, one block per (row b, position j <= n_b): the policy of
//      target_logits[b, j] as RowStats (max, normaliser, threshold, kept mass) plus
//      p_j(y_j) and q_j(y_j), into the workspace. All positions run in parallel.
//   2. verify_sample_kernel, one block per row: thread 0 walks the acceptance tests on
//      those scalars; the block then samples the correction (residual max(p - q, 0),
//      roundoff rule: p) or the bonus (p_n) with a block-wide inverse CDF.
// Checks match the CPU: per row, policy, num_draft, tokens, NaN/Inf in every position
// <= n, q(y) for j < n, and the q row read at a rejection.
#include "block_ops.cuh"
#include "launch.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = 512;

__device__ inline int64_t row_num_draft(const VerifyArgs& a, int64_t b) {
  return a.num_draft ? a.num_draft[b] : a.num_spec;
}

template <typename T>
__device__ inline const T* logits_at(const VerifyArgs& a, int64_t b, int64_t j) {
  return static_cast<const T*>(a.target_logits) + b * a.target_logits_stride_b +
         j * a.target_logits_stride_k;
}

// grid: batch * (K + 1) blocks; stats: [batch, K + 1].
template <typename T, int BLOCK, bool FILTER>
__global__ void __launch_bounds__(BLOCK)
    verify_policy_kernel(VerifyArgs a, RowStats* stats, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t width = a.num_spec + 1;
  const int64_t b = blockIdx.x / width;
  const int64_t j = blockIdx.x % width;
  const RowPolicy pol = resolve_policy(a.policy, b);
  const int64_t n = row_num_draft(a, b);
  // A bad policy or num_draft is reported by verify_sample_kernel; padding is not read.
  if (invalid_policy_field(pol) >= 0 || n < 0 || n > a.num_spec || j > n) return;
  const int V = static_cast<int>(a.vocab);
  const bool greedy = a.greedy || pol.greedy();
  bool ok = true;
  int y = -1;
  if (j < n) {
    y = a.draft_tokens[b * a.draft_tokens_stride_b + j];
    if (y < 0 || y >= V) {
      if (threadIdx.x == 0) report_error(record, b, StatusCode::kTokenOutOfRange, j);
      ok = false;
    }
  }
  const T* x = logits_at<T>(a, b, j);  // [V]
  RowStats s;
  if (compute_row_stats<T, BLOCK, FILTER>(x, V, pol, greedy, ops, &s) != kLogitsOk) {
    if (threadIdx.x == 0) report_error(record, b, StatusCode::kNanOrInfLogits, j);
    ok = false;
  }
  if (threadIdx.x != 0) return;
  s.p_y = 0.0f;
  s.q_y = 1.0f;  // one-hot proposal
  if (ok && j < n) {
    s.p_y = policy_prob(to_float(x[y]), y, s, pol.temperature, greedy);
    if (a.draft_probs) {
      s.q_y = a.draft_probs[b * a.draft_probs_stride_b + j * a.draft_probs_stride_k + y];
      if (!(s.q_y >= 0.0f) || !is_finite(s.q_y)) {
        report_error(record, b, StatusCode::kInvalidProbs, j);
        ok = false;
      }
    }
  }
  s.valid = ok ? 1 : 0;
  stats[blockIdx.x] = s;
}

// grid: batch blocks.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    verify_sample_kernel(VerifyArgs a, const RowStats* stats, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  __shared__ int accepted_shared;
  const int64_t b = blockIdx.x;
  const int64_t width = a.num_spec + 1;
  const int tid = threadIdx.x;
  int32_t* out = a.tokens + b * a.tokens_stride_b;  // [K + 1]
  const RowPolicy pol = resolve_policy(a.policy, b);
  const int64_t n = row_num_draft(a, b);
  const RowStats* rs = stats + b * width;  // [K + 1]
  const int field = invalid_policy_field(pol);
  bool fault;
  if (field >= 0) {
    if (tid == 0) report_error(record, b, StatusCode::kInvalidPolicy, field);
    fault = true;
  } else if (n < 0 || n > a.num_spec) {
    if (tid == 0) report_error(record, b, StatusCode::kNumDraftOutOfRange, -1);
    fault = true;
  } else {
    int invalid = 0;
    for (int64_t j = tid; j <= n; j += BLOCK) invalid |= rs[j].valid == 0;
    fault = __syncthreads_or(invalid) != 0;  // verify_policy_kernel reported it
  }
  const int32_t* y = a.draft_tokens ? a.draft_tokens + b * a.draft_tokens_stride_b : nullptr;
  const bool greedy = a.greedy || pol.greedy();
  const uint64_t seed = resolve_seed(a.rng);
  const uint64_t offset = resolve_offset(a.rng);
  const auto row32 = static_cast<uint32_t>(b);
  if (!fault) {
    // The walk: acceptance tests on the per-position scalars.
    if (tid == 0) {
      int64_t acc = n;
      for (int64_t j = 0; j < n; ++j) {
        const bool pass = greedy ? y[j] == rs[j].argmax
                                 : accept_draft(uniform(seed, offset, row32,
                                                        static_cast<uint32_t>(j), Purpose::kAccept),
                                                rs[j].p_y, rs[j].q_y);
        if (!pass) {
          acc = j;
          break;
        }
      }
      accepted_shared = static_cast<int>(acc);
    }
    __syncthreads();
    const int acc = accepted_shared;
    const RowStats st = rs[acc];
    const int V = static_cast<int>(a.vocab);
    int token = -1;
    if (greedy) {
      token = st.argmax;
    } else {
      const T* x = logits_at<T>(a, b, acc);  // [V]
      const float temperature = pol.temperature;
      auto p_at = [&](int i) { return policy_prob(to_float(x[i]), i, st, temperature, false); };
      const float u = uniform(seed, offset, row32, static_cast<uint32_t>(acc), Purpose::kCorrection);
      bool use_p = true;
      if (acc < n && a.draft_probs) {  // rejected: the residual max(p - q, 0)
        const float* q = a.draft_probs + b * a.draft_probs_stride_b + acc * a.draft_probs_stride_k;
        int bad = 0;
        for (int i = tid; i < V; i += BLOCK) bad |= !(q[i] >= 0.0f) || !is_finite(q[i]);
        if (__syncthreads_or(bad)) {
          if (tid == 0) report_error(record, b, StatusCode::kInvalidProbs, acc);
          fault = true;
        } else {
          auto r = [&](int i) { return residual_weight(p_at(i), q[i]); };
          const WeightTotal t = block_total<BLOCK>(r, V, ops);
          if (residual_usable(t.total)) {
            token = block_pick<BLOCK>(r, V, u, t, ops);
            use_p = false;
          }
        }
      } else if (acc < n) {  // rejected one-hot proposal: p without y
        const int yj = y[acc];
        auto r = [&](int i) { return i == yj ? 0.0f : p_at(i); };
        const WeightTotal t = block_total<BLOCK>(r, V, ops);
        if (residual_usable(t.total)) {
          token = block_pick<BLOCK>(r, V, u, t, ops);
          use_p = false;
        }
      }
      if (!fault && use_p) token = block_pick<BLOCK>(p_at, V, u, ops);  // bonus, or roundoff
    }
    if (!fault) {
      for (int64_t j = tid; j < width; j += BLOCK) out[j] = j < acc ? y[j] : (j == acc ? token : -1);
      if (tid == 0) {
        a.num_accepted[b] = acc;
        a.num_emitted[b] = acc + 1;
      }
      return;
    }
  }
  // The row is at fault.
  for (int64_t j = tid; j < width; j += BLOCK) out[j] = -1;
  if (tid == 0) {
    a.num_accepted[b] = 0;
    a.num_emitted[b] = 0;
  }
}

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
  const bool filter = !a.greedy && policy_may_filter(a.policy, a.vocab);
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
