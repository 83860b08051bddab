// The CUDA kernels of the sampling ops, one block per row (or per row position), as
// templates over the logits type and the block size. The launchers (ops.cu) instantiate
// them with 512 threads; csrc/tests/test_cuda_sim_kernels.cpp runs the same code on the
// host in the simulation of csrc/tests/cuda_sim/, with small blocks, against the CPU
// launchers. Device code only: no CUDA runtime call here.
#pragma once

#include <climits>

#include "block_ops.cuh"

namespace verispec {
namespace kernels {
namespace cuda {

// Threads per block of every launch of these kernels (ops.cu); the simulation test runs
// one case at this size too.
constexpr int kLaunchBlock = 512;

// ---- apply_policy ------------------------------------------------------------------
// grid: rows blocks. compute_row_stats finds the max, the softmax normaliser and the
// filter threshold by block-wide threshold search (no sort of the vocabulary); one more
// pass writes the probabilities. Rows at fault: 0.
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

// ---- sample ------------------------------------------------------------------------

// The keyed sample of valid weights w (sampling_math.h race_score), as the CPU's
// keyed_pick: the block's heaviest token (first maximum) starts the race; each thread
// races the tokens of every BLOCK-th block of four, drawing no Philox block for four
// tokens that cannot reach its best so far even at race_min_exponential; then a block
// argmax. -1: zero mass.
template <int BLOCK>
__device__ int keyed_block_pick(const float* w, int V, uint64_t seed, uint64_t position,
                                BlockOps<BLOCK>& ops) {
  ArgMax local{-1.0f, -1};
  for (int i = threadIdx.x; i < V; i += BLOCK) {
    if (argmax_before(w[i], i, local.value, local.index)) local = ArgMax{w[i], i};
  }
  const ArgMax heaviest = ops.argmax(local);
  if (!(heaviest.value > 0.0f)) return -1;
  const float w_max = heaviest.value;
  const int top = heaviest.index;
  const float e_min = race_min_exponential();
  local = ArgMax{race_score(1.0f, race_exponential(
                     race_block(seed, position, static_cast<uint32_t>(top / 4)).v[top % 4])),
                 top};
  const int quads = (V + 3) / 4;
  for (int q = threadIdx.x; q < quads; q += BLOCK) {
    const int base = 4 * q, end = min(base + 4, V);
    bool contender = false;
    for (int i = base; i < end; ++i) {
      contender = contender || (w[i] > 0.0f && !(race_score(w[i] / w_max, e_min) < local.value));
    }
    if (!contender) continue;
    const Philox4x32 block = race_block(seed, position, static_cast<uint32_t>(q));
    for (int i = base; i < end; ++i) {
      if (!(w[i] > 0.0f)) continue;
      const float score = race_score(w[i] / w_max, race_exponential(block.v[i - base]));
      if (argmax_before(score, i, local.value, local.index)) local = ArgMax{score, i};
    }
  }
  return ops.argmax(local).index;
}

// grid: rows blocks. A validation pass, then block_pick (a pass of per-thread chunk sums,
// a block scan over them, a walk along the chunk that holds the target), or the keyed
// race (keyed_block_pick). Rows at fault: -1.
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
  int token;
  if (a.row_seeds) {
    token = keyed_block_pick<BLOCK>(w, V, static_cast<uint64_t>(a.row_seeds[row]),
                                    static_cast<uint64_t>(a.row_positions[row]), ops);
  } else {
    const float u = uniform(resolve_seed(a.rng), resolve_offset(a.rng), static_cast<uint32_t>(row),
                            0, Purpose::kSample);
    token = block_pick<BLOCK>([w](int i) { return w[i]; }, V, u, ops);
  }
  if (threadIdx.x == 0) {
    if (token < 0) report_error(record, row, StatusCode::kInvalidProbs, -1);  // zero mass
    a.tokens[row] = token;
  }
}

// ---- verify ------------------------------------------------------------------------
// Two kernels on one stream:
//   1. verify_policy_kernel, one block per (row b, position j <= n_b): the policy of
//      target_logits[b, j] as RowStats (max, normaliser, threshold, kept mass) plus
//      p_j(y_j) and q_j(y_j), into the stats workspace. All positions run in parallel.
//   2. verify_sample_kernel, one block per row: thread 0 walks the acceptance tests on
//      those scalars; the block then samples the correction (residual max(p - q, 0),
//      roundoff rule: p) or the bonus (p_n) with a block-wide inverse CDF.
// Checks match the CPU: per row, policy, num_draft, tokens, NaN/Inf in every position
// <= n, q(y) for j < n, and the q row read at a rejection.
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
  const bool greedy = pol.greedy();
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
  const bool greedy = pol.greedy();
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

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec
