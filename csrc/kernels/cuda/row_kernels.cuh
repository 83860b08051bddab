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
        st(out + i, policy_prob(to_float(ld(x + i)), i, s, pol.temperature, pol.greedy()));
      }
      return;
    }
    // A NaN / +Inf at `bad`, or all -Inf (col -1).
    if (threadIdx.x == 0) report_error(record, row, StatusCode::kNanOrInfLogits, bad >= 0 ? bad : -1);
  }
  for (int i = threadIdx.x; i < V; i += BLOCK) st(out + i, 0.0f);  // the row is at fault
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
    const float wi = ld(w + i);
    if (argmax_before(wi, i, local.value, local.index)) local = ArgMax{wi, i};
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
    float wq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool contender = false;
    for (int i = base; i < end; ++i) {
      wq[i - base] = ld(w + i);
      contender = contender || (wq[i - base] > 0.0f &&
                                !(race_score(wq[i - base] / w_max, e_min) < local.value));
    }
    if (!contender) continue;
    const Philox4x32 block = race_block(seed, position, static_cast<uint32_t>(q));
    for (int i = base; i < end; ++i) {
      if (!(wq[i - base] > 0.0f)) continue;
      const float score = race_score(wq[i - base] / w_max, race_exponential(block.v[i - base]));
      if (argmax_before(score, i, local.value, local.index)) local = ArgMax{score, i};
    }
  }
  return ops.argmax(local).index;
}

// grid: rows blocks. A validation pass that also finds the row's largest weight, then
// block_pick over the weights in fixed point scaled by its power of two (a pass of
// per-thread chunk sums, a block scan over them, a walk along the chunk that holds the
// target: the CPU's integers and pick), or the keyed race (keyed_block_pick). Rows at
// fault: -1.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) sample_kernel(SampleArgs a, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t row = blockIdx.x;
  const int V = static_cast<int>(a.vocab);
  const float* w = a.probs + row * a.probs_row_stride;  // [V]
  int bad = INT_MAX;
  float local_max = 0.0f;
  for (int i = threadIdx.x; i < V; i += BLOCK) {
    const float v = ld(w + i);
    if (!(v >= 0.0f) || !is_finite(v)) bad = min(bad, i);  // negative, NaN or Inf
    local_max = v > local_max ? v : local_max;
  }
  bad = ops.min_int(bad);
  const float w_max = ops.max(local_max);
  if (bad != INT_MAX || !(w_max > 0.0f)) {  // a bad value, or zero mass (col -1)
    if (threadIdx.x == 0) {
      report_error(record, row, StatusCode::kInvalidProbs, bad != INT_MAX ? bad : -1);
      a.tokens[row] = -1;
    }
    return;
  }
  int token;
  if (a.row_seeds) {
    token = keyed_block_pick<BLOCK>(w, V, static_cast<uint64_t>(a.row_seeds[row]),
                                    static_cast<uint64_t>(a.row_positions[row]), ops);
  } else {
    const uint64_t draw = uniform64(resolve_seed(a.rng), resolve_offset(a.rng),
                                    static_cast<uint32_t>(row), 0, Purpose::kSample);
    const int shift = fixed_shift_for(w_max);
    token = block_pick<BLOCK>([w, shift](int i) { return fixed_scaled(ld(w + i), shift); }, V, draw, ops);
  }
  if (threadIdx.x == 0) a.tokens[row] = token;
}

// ---- verify ------------------------------------------------------------------------
// Two kernels on one stream:
//   1. verify_policy_kernel, one block per (row b, position j <= n_b): the policy of
//      target_logits[b, j] as RowStats (max, normaliser, threshold, kept mass) plus
//      p_j(y_j) and q_j(y_j), into the stats workspace. All positions run in parallel.
//   (block verification: block_residual_kernel, split_kernels.cuh, every position's
//      residual mass R_j and q's check in parallel, into BlockMass)
//   2. verify_sample_kernel, one block per row: thread 0 walks the acceptance tests on
//      those scalars; the block then samples the correction (residual max(p - q, 0),
//      roundoff rule: p) or the bonus (p_n) with a block-wide inverse CDF: the one row
//      read again.
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

// The rest of a position's RowStats once its policy is known (verdict: compute_row_stats'),
// by one thread: the proposal's range, p(y) and q(y), and the faults of the position.
template <typename T>
__device__ inline void finish_position_stats(const VerifyArgs& a, int64_t b, int64_t j,
                                             int64_t n, const RowPolicy& pol, int verdict,
                                             RowStats* s, unsigned long long* record) {
  const int V = static_cast<int>(a.vocab);
  bool ok = true;
  int y = -1;
  if (j < n) {
    y = a.draft_tokens[b * a.draft_tokens_stride_b + j];
    if (y < 0 || y >= V) {
      report_error(record, b, StatusCode::kTokenOutOfRange, j);
      ok = false;
    }
  }
  if (verdict != kLogitsOk) {
    report_error(record, b, StatusCode::kNanOrInfLogits, j);
    ok = false;
  }
  s->p_y = 0.0f;
  s->q_y = 1.0f;  // one-hot proposal
  if (ok && j < n) {
    s->p_y = policy_prob(to_float(ld(logits_at<T>(a, b, j) + y)), y, *s, pol.temperature,
                         pol.greedy());
    if (a.draft_probs) {
      const DraftQ q{a.draft_probs + b * a.draft_probs_stride_b + j * a.draft_probs_stride_k,
                     a.draft_index, a.draft_width};
      s->q_y = q(y);
      if (!(s->q_y >= 0.0f) || !is_finite(s->q_y)) {
        report_error(record, b, StatusCode::kInvalidProbs, j);
        ok = false;
      }
    }
  }
  s->valid = ok ? 1 : 0;
}

// Block verification's part of a position's payload, after the RowStats of every
// position (kVerifyStatsBytesPerPosition): the residual mass R_j of the walk's weight w_j
// (block_residual_kernel; fixed point, chunks add theirs) and whether q's row j has a bad
// value (a count of the blocks that saw one). The stats kernels zero it.
struct BlockMass {
  unsigned long long mass;
  unsigned long long q_bad;
};
static_assert(sizeof(RowStats) + sizeof(BlockMass) <= kVerifyStatsBytesPerPosition,
              "the verify payload per position");

__device__ inline BlockMass* verify_masses(const VerifyArgs& a, const RowStats* stats) {
  return reinterpret_cast<BlockMass*>(const_cast<RowStats*>(stats) + a.batch * (a.num_spec + 1));
}

// Position `index` of a [batch, K + 1] launch: its row b, position j, policy and num_draft;
// false where the walk never reads it (a bad policy or num_draft, reported by
// verify_sample_kernel, or padding past num_draft).
struct VerifyPosition {
  int64_t b, j, n;
  RowPolicy pol;
};
__device__ inline bool verify_position(const VerifyArgs& a, int64_t index, VerifyPosition* p) {
  const int64_t width = a.num_spec + 1;
  p->b = index / width;
  p->j = index % width;
  p->pol = resolve_policy(a.policy, p->b);
  p->n = row_num_draft(a, p->b);
  return invalid_policy_field(p->pol) < 0 && p->n >= 0 && p->n <= a.num_spec && p->j <= p->n;
}

// grid: batch * (K + 1) blocks; stats: [batch, K + 1].
template <typename T, int BLOCK, bool FILTER>
__global__ void __launch_bounds__(BLOCK)
    verify_policy_kernel(VerifyArgs a, RowStats* stats, unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  VerifyPosition p;
  if (!verify_position(a, blockIdx.x, &p)) return;
  RowStats s{};
  const int verdict = compute_row_stats<T, BLOCK, FILTER>(
      logits_at<T>(a, p.b, p.j), static_cast<int>(a.vocab), p.pol, p.pol.greedy(), ops, &s);
  if (threadIdx.x != 0) return;
  finish_position_stats<T>(a, p.b, p.j, p.n, p.pol, verdict, &s, record);
  stats[blockIdx.x] = s;
  verify_masses(a, stats)[blockIdx.x] = BlockMass{0, 0};
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
  const int V = static_cast<int>(a.vocab);
  const bool block_method = a.method == VerifyMethod::kBlock && a.draft_probs && !greedy;
  float w_tau = 1.0f;  // block verification: the weight scaling p in the final residual
  if (!fault && block_method) {
    // Block verification (ops.h): tau = the last j with eta_j < h_j; every thread runs the
    // same loop on scalars: q's checks and the residual masses R_j of every position were
    // found in parallel (block_residual_kernel).
    const BlockMass* masses = verify_masses(a, stats) + b * width;  // [K + 1]
    float w = 1.0f;
    int tau = 0;
    for (int64_t j = 0; j <= n; ++j) {
      if (j == n) {
        if (n > 0 && block_keep(uniform(seed, offset, row32, static_cast<uint32_t>(j - 1),
                                        Purpose::kAccept), w)) {
          tau = static_cast<int>(j);
          w_tau = w;
        }
        break;
      }
      const BlockMass m = masses[j];
      if (m.q_bad != 0) {
        if (tid == 0) report_error(record, b, StatusCode::kInvalidProbs, j);
        fault = true;
        break;
      }
      if (j >= 1) {
        const float h = block_keep_probability(fixed_to_float(m.mass), w);
        if (block_keep(uniform(seed, offset, row32, static_cast<uint32_t>(j - 1), Purpose::kAccept),
                       h)) {
          tau = static_cast<int>(j);
          w_tau = w;
        }
      }
      w = block_weight(w, rs[j].p_y, rs[j].q_y);
      if (!(w > 0.0f)) break;  // every later h is 0
    }
    if (tid == 0) accepted_shared = tau;
    __syncthreads();
  }
  if (!fault) {
    // The walk: acceptance tests on the per-position scalars.
    if (tid == 0 && !block_method) {
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
    int token = -1;
    if (greedy) {
      token = st.argmax;
    } else {
      const T* x = logits_at<T>(a, b, acc);  // [V]
      const float temperature = pol.temperature;
      auto p_at = [&](int i) { return policy_prob(to_float(ld(x + i)), i, st, temperature, false); };
      auto p_fixed = [&](int i) { return static_cast<unsigned long long>(fixed_weight(p_at(i))); };
      const uint64_t u = uniform64(seed, offset, row32, static_cast<uint32_t>(acc), Purpose::kCorrection);
      bool use_p = true;
      if (acc < n && a.draft_probs) {  // rejected: the residual max(p - q, 0)
        const DraftQ q{a.draft_probs + b * a.draft_probs_stride_b + acc * a.draft_probs_stride_k,
                       a.draft_index, a.draft_width};
        // One read of the row for the residual's total and q's check together; the walk
        // reads one thread's chunk again.
        auto r = [&](int i) {
          return static_cast<unsigned long long>(
              fixed_weight(block_residual_weight(w_tau, p_at(i), q(i))));
        };
        int lo, hi, bad = 0;
        thread_chunk<BLOCK>(V, &lo, &hi);
        WeightTotal t{0, 0};  // block_total's, with q's check in the same loop
        for (int i = lo; i < hi; ++i) {
          const float qi = q(i);
          const bool invalid = not_a_probability(qi);
          bad |= invalid;
          t.chunk += fixed_weight(block_residual_weight(w_tau, p_at(i), invalid ? 0.0f : qi));
        }
        t.total = ops.sum_fixed(t.chunk);
        if (__syncthreads_or(bad)) {
          if (tid == 0) report_error(record, b, StatusCode::kInvalidProbs, acc);
          fault = true;
        } else {
          if (residual_usable(fixed_to_float(t.total))) {
            token = block_pick<BLOCK>(r, V, u, t, ops);
            use_p = false;
          }
        }
      } else if (acc < n) {  // rejected one-hot proposal: p without y
        const int yj = y[acc];
        auto r = [&](int i) { return i == yj ? 0ull : p_fixed(i); };
        const WeightTotal t = block_total<BLOCK>(r, V, ops);
        if (residual_usable(fixed_to_float(t.total))) {
          token = block_pick<BLOCK>(r, V, u, t, ops);
          use_p = false;
        }
      }
      if (!fault && use_p) token = block_pick<BLOCK>(p_fixed, V, u, ops);  // bonus, or roundoff
    }
    if (!fault) {
      __syncthreads();  // every thread has read accepted_shared
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

// ---- verify_tree ---------------------------------------------------------------------
// Two steps on one stream: the policy of every node row of every tree in parallel
// (tree_policy_kernel, or with few rows the split kernels: split_kernels.cuh), then the
// walk, grid: batch blocks, one per row; scratch: [batch, 2, V] floats (the residual r and,
// without replacement, q minus the removed siblings). The row's checks run first (nodes
// in order, then every logits row j <= n from the verdicts), one fault reported per row as
// the CPU does; then the walk of ops.h, node by node: the node row's RowStats, the draw (block_pick)
// or the sibling tests (uniform across the block: every thread makes the same decision),
// the residual updates as block passes over V.
template <typename T>
__device__ inline const T* tree_logits_at(const VerifyTreeArgs& a, int64_t b, int64_t j) {
  return static_cast<const T*>(a.target_logits) + b * a.target_logits_stride_b +
         j * a.target_logits_stride_n;
}

// The first fault of node i (kOk if none), with the CPU's order: parent, token, sibling.
__device__ inline StatusCode tree_node_fault(const VerifyTreeArgs& a, const int32_t* tok,
                                             const int32_t* par, int64_t i, bool distinct) {
  if (par[i] < -1 || par[i] >= i) return StatusCode::kInvalidParent;
  if (tok[i] < 0 || tok[i] >= a.vocab) return StatusCode::kTokenOutOfRange;
  if (distinct) {
    for (int64_t s = par[i] + 1; s < i; ++s) {
      if (par[s] == par[i] && tok[s] == tok[i]) return StatusCode::kDuplicateSibling;
    }
  }
  return StatusCode::kOk;
}

// Node row `index` of a [batch, N + 1] launch: its row b, node row j and policy; false
// where the walk never reads it (a bad policy or num_nodes, reported by the walk, or past
// num_nodes).
struct TreePosition {
  int64_t b, j;
  RowPolicy pol;
};
__device__ inline bool tree_position(const VerifyTreeArgs& a, int64_t index, TreePosition* p) {
  const int64_t width = a.max_nodes + 1;
  p->b = index / width;
  p->j = index % width;
  p->pol = resolve_policy(a.policy, p->b);
  const int64_t n = a.num_nodes ? a.num_nodes[p->b] : a.max_nodes;
  return invalid_policy_field(p->pol) < 0 && n >= 0 && n <= a.max_nodes && p->j <= n;
}

// The statistics of every node row of every tree, in parallel, before the walk: stats
// [batch, N + 1], each RowStats with `valid` holding compute_row_stats' verdict (the walk
// reports the first bad row). grid: batch * (N + 1) blocks.
template <typename T, int BLOCK, bool FILTER>
__global__ void __launch_bounds__(BLOCK)
    tree_policy_kernel(VerifyTreeArgs a, RowStats* stats) {
  __shared__ BlockOps<BLOCK> ops;
  TreePosition p;
  if (!tree_position(a, blockIdx.x, &p)) return;
  RowStats s{};
  const int verdict = compute_row_stats<T, BLOCK, FILTER>(
      tree_logits_at<T>(a, p.b, p.j), static_cast<int>(a.vocab), p.pol, p.pol.greedy(), ops, &s);
  if (threadIdx.x != 0) return;
  s.valid = verdict;
  stats[blockIdx.x] = s;
}

template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    verify_tree_kernel(VerifyTreeArgs a, float* scratch, const RowStats* stats,
                       unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  const int V = static_cast<int>(a.vocab);
  const int64_t width = a.max_nodes + 1;
  int32_t* out = a.tokens + b * a.tokens_stride_b;  // [N + 1]
  int32_t* nodes = a.max_nodes > 0 ? a.accepted_nodes + b * a.accepted_nodes_stride_b : nullptr;
  float* r = scratch + static_cast<size_t>(b) * 2 * static_cast<size_t>(V);  // [V]
  float* qbuf = r + V;                                                       // [V]
  const RowPolicy pol = resolve_policy(a.policy, b);
  const int64_t n = a.num_nodes ? a.num_nodes[b] : a.max_nodes;
  const int32_t* tok = a.max_nodes > 0 ? a.tree_tokens + b * a.tree_tokens_stride_b : nullptr;
  const int32_t* par = a.max_nodes > 0 ? a.parents + b * a.parents_stride_b : nullptr;
  for (int64_t j = tid; j < width; j += BLOCK) out[j] = -1;
  for (int64_t j = tid; nodes && j < a.max_nodes; j += BLOCK) nodes[j] = -1;
  bool fault = false;
  const int field = invalid_policy_field(pol);
  if (field >= 0) {
    if (tid == 0) report_error(record, b, StatusCode::kInvalidPolicy, field);
    fault = true;
  } else if (n < 0 || n > a.max_nodes) {
    if (tid == 0) report_error(record, b, StatusCode::kNumDraftOutOfRange, -1);
    fault = true;
  } else {
    const bool distinct = !a.draft_probs || !a.replacement;
    int first = INT_MAX;
    for (int64_t i = tid; i < n; i += BLOCK) {
      if (tree_node_fault(a, tok, par, i, distinct) != StatusCode::kOk) {
        first = min(first, static_cast<int>(i));
      }
    }
    first = ops.min_int(first);
    if (first != INT_MAX) {
      if (tid == 0) report_error(record, b, tree_node_fault(a, tok, par, first, distinct), first);
      fault = true;
    }
    for (int64_t j = 0; j <= n && !fault; ++j) {  // tree_policy_kernel's verdicts
      if (stats[b * width + j].valid != kLogitsOk) {
        if (tid == 0) report_error(record, b, StatusCode::kNanOrInfLogits, j);
        fault = true;
      }
    }
  }
  const bool greedy = pol.greedy();
  const uint64_t seed = resolve_seed(a.rng);
  const uint64_t offset = resolve_offset(a.rng);
  const auto row32 = static_cast<uint32_t>(b);
  int64_t cur = -1;
  int depth = 0;
  __syncthreads();  // the padding is written
  while (!fault) {
    const int64_t row = cur + 1;
    const T* x = tree_logits_at<T>(a, b, row);  // [V]
    const RowStats st = stats[b * width + row];  // checked above
    const float temperature = pol.temperature;
    auto p_at = [&](int i) { return policy_prob(to_float(ld(x + i)), i, st, temperature, greedy); };
    auto p_fixed = [&](int i) { return static_cast<unsigned long long>(fixed_weight(p_at(i))); };
    const uint64_t draw =
        uniform64(seed, offset, row32, static_cast<uint32_t>(row), Purpose::kTreeEmit);
    int64_t next = -1;
    int emit = -1;
    if (greedy || !a.draft_probs) {
      const int xt = greedy ? st.argmax : block_pick<BLOCK>(p_fixed, V, draw, ops);
      for (int64_t c = cur + 1; c < n; ++c) {
        if (par[c] == cur && tok[c] == xt) {
          next = c;
          break;
        }
      }
      if (next < 0) emit = xt;
    } else {
      const DraftQ q{a.draft_probs + b * a.draft_probs_stride_b + row * a.draft_probs_stride_n,
                     a.draft_index, a.draft_width};
      bool use_r = false;      // r holds the residual (else r = p)
      float remaining = 1.0f;  // without replacement: 1 - q mass of the removed
      bool row_checked = false;
      for (int64_t c = cur + 1; c < n; ++c) {
        if (par[c] != cur) continue;
        const int xt = tok[c];
        const float q_x = q(xt);
        if (not_a_probability(q_x)) {
          if (tid == 0) report_error(record, b, StatusCode::kInvalidProbs, row);
          fault = true;
          break;
        }
        const float qi_x = a.replacement ? q_x : renormalised_q(q_x, remaining);
        const float r_x = use_r ? r[xt] : p_at(xt);
        if (accept_draft(uniform(seed, offset, row32, static_cast<uint32_t>(c),
                                 Purpose::kTreeAccept),
                         r_x, qi_x)) {
          next = c;
          break;
        }
        if (!row_checked) {
          int bad = 0;
          for (int i = tid; i < V; i += BLOCK) bad |= not_a_probability(q(i));
          if (__syncthreads_or(bad)) {
            if (tid == 0) report_error(record, b, StatusCode::kInvalidProbs, row);
            fault = true;
            break;
          }
          row_checked = true;
          if (!a.replacement) {
            for (int i = tid; i < V; i += BLOCK) qbuf[i] = q(i);
          }
        }
        const float denom = a.replacement ? 1.0f : remaining;
        unsigned long long part = 0;
        for (int i = tid; i < V; i += BLOCK) {
          const float qi = a.replacement ? q(i) : renormalised_q(qbuf[i], denom);
          const float v = residual_weight(use_r ? r[i] : p_at(i), qi);
          r[i] = v;
          part += fixed_weight(v);
        }
        const float mass = fixed_to_float(ops.sum_fixed(part));
        if (residual_usable(mass)) {
          for (int i = tid; i < V; i += BLOCK) r[i] = r[i] / mass;
        } else {
          for (int i = tid; i < V; i += BLOCK) r[i] = p_at(i);
        }
        use_r = true;
        if (!a.replacement) {
          __syncthreads();  // every thread has read qbuf
          if (tid == 0) qbuf[xt] = 0.0f;
          remaining -= q_x;
        }
        __syncthreads();
      }
      if (!fault && next < 0) {  // all rejected, or a leaf
        emit = use_r ? block_pick<BLOCK>(
                           [r](int i) { return static_cast<unsigned long long>(fixed_weight(r[i])); },
                           V, draw, ops)
                     : block_pick<BLOCK>(p_fixed, V, draw, ops);
      }
    }
    if (fault) break;
    if (next < 0) {
      if (tid == 0) {
        out[depth] = emit;
        a.num_emitted[b] = depth + 1;
      }
      return;
    }
    if (tid == 0) {
      out[depth] = tok[next];
      nodes[depth] = static_cast<int32_t>(next);
    }
    ++depth;
    cur = next;
  }
  // The row is at fault.
  __syncthreads();
  for (int64_t j = tid; j < width; j += BLOCK) out[j] = -1;
  for (int64_t j = tid; nodes && j < a.max_nodes; j += BLOCK) nodes[j] = -1;
  if (tid == 0) a.num_emitted[b] = 0;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec
