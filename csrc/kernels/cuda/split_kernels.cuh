// Rows split across blocks: the sampling ops when a launch has fewer rows than the GPU
// has SMs. One block per row leaves most SMs idle there (B = 1, K = 4 is 5 blocks on an
// H200's 132 SMs) and reads a whole row through one SM. Without a filter the statistics of
// a row are a maximum with its first index and a sum of fixed-point integers
// (sampling_math.h), which any split adds up to the same values, so each row is cut into
// `chunks` contiguous ranges, one block each, and the results are bit for bit those of
// the one-block kernels (row_kernels.cuh) and the CPU:
//
//   split_max_kernel   per chunk: the first invalid index, the maximum and its first index
//   split_sum_kernel   per chunk: the row's maximum from every chunk's record, then the
//                      chunk's fixed-point sum (softmax weights of logits, or scaled
//                      probabilities for sample)
//   then per op        verify: a small kernel turns each position's chunk records into
//                      the RowStats verify_sample_kernel reads; apply_policy: each chunk
//                      writes its probabilities; sample: one block per row picks the chunk
//                      that holds the draw's target and walks it.
//
// Filters (top-k, top-p, min-p) and keyed sampling keep the one-block kernels. Device code
// only; the launchers are in ops.cu, the host simulation runs the same code
// (csrc/tests/test_cuda_sim_kernels.cpp).
#pragma once

#include <climits>

#include "row_kernels.cuh"

namespace verispec {
namespace kernels {
namespace cuda {

constexpr int kSplitMinChunk = 4096;  // values per block at least

// How a launch of `rows` rows of `vocab` values is cut: chunks per row (1: no split) and
// values per chunk. Splits only launches of at most kCudaSplitMaxRows rows, into at most
// kCudaSplitMaxChunks chunks of at least kSplitMinChunk values, aiming at two blocks per SM.
struct SplitPlan {
  int chunks;
  int chunk_len;
};

VERISPEC_HD inline SplitPlan split_plan(int64_t rows, int64_t vocab, int sms) {
  SplitPlan plan{1, static_cast<int>(vocab)};
  if (rows < 1 || rows > kCudaSplitMaxRows || sms < 1) return plan;
  int64_t chunks = (2 * static_cast<int64_t>(sms) + rows - 1) / rows;
  const int64_t most = vocab / kSplitMinChunk;
  if (chunks > most) chunks = most;
  if (chunks > kCudaSplitMaxChunks) chunks = kCudaSplitMaxChunks;
  if (chunks < 2) return plan;
  plan.chunks = static_cast<int>(chunks);
  plan.chunk_len = static_cast<int>((vocab + chunks - 1) / chunks);
  return plan;
}

// One chunk's statistics (24 bytes: kCudaSplitBytes counts them so).
struct ChunkStats {
  float max;                // the largest valid value (-Inf if none)
  int32_t argmax;           // its first index (INT_MAX if none)
  int32_t bad;              // the first invalid index (INT_MAX if none)
  int32_t pad;
  unsigned long long sum;   // fixed-point sum (split_sum_kernel)
};
static_assert(sizeof(ChunkStats) == 24, "kCudaSplitBytes assumes 24-byte chunk records");

// A row's statistics from its chunk records, in every thread: the first invalid index,
// the maximum and its first index (ArgMaxOp: the same winner in any order), and (sums)
// the total of the chunks' sums.
struct SplitRow {
  int bad;
  ArgMax best;
  unsigned long long sum;
};

__device__ inline SplitRow combine_chunks(const ChunkStats* rec, int chunks, bool sums) {
  SplitRow r{INT_MAX, ArgMax{-INFINITY, INT_MAX}, 0};
  for (int g = 0; g < chunks; ++g) {
    const ChunkStats c = rec[g];
    r.bad = min(r.bad, c.bad);
    r.best = ArgMaxOp()(r.best, ArgMax{c.max, c.argmax});
    if (sums) r.sum += c.sum;
  }
  return r;
}

// ---- the rows of each op ------------------------------------------------------------------
// row(r, &x, &pol): whether row r is computed (a valid policy, a position the walk reads)
// and its values; kind: logits (softmax weights) or probabilities (sample).

template <typename T>
struct VerifyRows {
  VerifyArgs a;
  __device__ bool row(int64_t r, const T** x, RowPolicy* pol) const {
    VerifyPosition p;
    if (!verify_position(a, r, &p)) return false;
    *pol = p.pol;
    *x = logits_at<T>(a, p.b, p.j);
    return true;
  }
  static constexpr bool kProbs = false;
};

template <typename T>
struct PolicyRows {
  ApplyPolicyArgs a;
  __device__ bool row(int64_t r, const T** x, RowPolicy* pol) const {
    *pol = resolve_policy(a.policy, r);
    if (invalid_policy_field(*pol) >= 0) return false;
    *x = static_cast<const T*>(a.logits) + r * a.logits_row_stride;
    return true;
  }
  static constexpr bool kProbs = false;
};

struct SampleRows {
  SampleArgs a;
  __device__ bool row(int64_t r, const float** x, RowPolicy* pol) const {
    *pol = RowPolicy{1.0f, 0, 1.0f, 0.0f};
    *x = a.probs + r * a.probs_row_stride;
    return true;
  }
  static constexpr bool kProbs = true;
};

// The chunk of a rows * chunks launch that this block holds: its row r, [begin, end),
// the row's values and policy; false for a row the op does not compute.
template <typename T, typename Rows>
struct SplitChunk {
  int64_t r;
  int begin, end;
  const T* x;
  RowPolicy pol;
  __device__ bool take(const Rows& rows, int64_t vocab, const SplitPlan& plan) {
    r = blockIdx.x / plan.chunks;
    begin = static_cast<int>(blockIdx.x % plan.chunks) * plan.chunk_len;
    end = min(begin + plan.chunk_len, static_cast<int>(vocab));
    return rows.row(r, &x, &pol);
  }
};

// grid: rows * chunks blocks; out: [rows, chunks]. Logits: invalid = NaN / +Inf;
// probabilities: negative, NaN or Inf.
template <typename T, int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_max_kernel(Rows rows, int64_t vocab, SplitPlan plan, ChunkStats* out) {
  __shared__ BlockOps<BLOCK> ops;
  SplitChunk<T, Rows> c;
  if (!c.take(rows, vocab, plan)) return;
  const T* x = c.x;
  const int begin = c.begin, end = c.end;
  ArgMax local{-INFINITY, INT_MAX};
  int bad = INT_MAX;
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
    const float v = to_float(ld(x + i));
    const bool invalid = Rows::kProbs ? not_a_probability(v) : !logit_valid(v);
    if (invalid) {
      bad = min(bad, i);
    } else if (argmax_before(v, i, local.value, local.index)) {
      local = ArgMax{v, i};
    }
  }
  bad = ops.min_int(bad);
  const ArgMax best = ops.argmax(local);
  if (threadIdx.x == 0) out[blockIdx.x] = ChunkStats{best.value, best.index, bad, 0, 0};
}

// grid: rows * chunks blocks: the chunk's fixed-point sum, from the row's maximum. Greedy
// rows and rows at fault need none.
template <typename T, int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_sum_kernel(Rows rows, int64_t vocab, SplitPlan plan, ChunkStats* out) {
  __shared__ BlockOps<BLOCK> ops;
  SplitChunk<T, Rows> c;
  if (!c.take(rows, vocab, plan)) return;
  const SplitRow row = combine_chunks(out + c.r * plan.chunks, plan.chunks, false);
  if (row.bad != INT_MAX || !is_finite(row.best.value) || c.pol.greedy()) return;
  if (Rows::kProbs && !(row.best.value > 0.0f)) return;  // zero mass: an error, no sum
  const T* x = c.x;
  const int begin = c.begin, end = c.end;
  const RowPolicy pol = c.pol;
  unsigned long long acc = 0;
  if (Rows::kProbs) {
    const int shift = fixed_shift_for(row.best.value);
    for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
      acc += fixed_scaled(to_float(ld(x + i)), shift);
    }
  } else {
    for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
      acc += fixed_weight(softmax_weight(to_float(ld(x + i)), row.best.value, pol.temperature));
    }
  }
  acc = ops.sum_fixed(acc);
  if (threadIdx.x == 0) out[blockIdx.x].sum = acc;
}

// A row's RowStats without a filter (compute_row_stats<.., false>'s), from its chunk
// records; returns that function's verdict.
__device__ inline int split_row_stats(const ChunkStats* rec, int chunks, bool greedy,
                                      RowStats* s) {
  const SplitRow row = combine_chunks(rec, chunks, !greedy);
  if (row.bad != INT_MAX) return row.bad;
  if (!is_finite(row.best.value)) return static_cast<int>(kLogitsAllMasked);
  *s = RowStats{};
  s->row_max = row.best.value;
  s->argmax = row.best.index;
  s->norm = greedy ? 1.0f : fixed_to_float(row.sum);
  s->kept = 1.0f;
  s->threshold = 0.0f;
  return static_cast<int>(kLogitsOk);
}

// ---- verify ---------------------------------------------------------------------------

// grid: batch * (K + 1) blocks of one warp; what verify_policy_kernel<.., false> writes,
// from the chunk records.
template <typename T>
__global__ void __launch_bounds__(32)
    verify_split_stats_kernel(VerifyArgs a, SplitPlan plan, const ChunkStats* chunks,
                              RowStats* stats, unsigned long long* record) {
  VerifyPosition p;
  if (threadIdx.x != 0 || !verify_position(a, blockIdx.x, &p)) return;
  RowStats s{};
  const int verdict = split_row_stats(chunks + blockIdx.x * plan.chunks, plan.chunks,
                                      p.pol.greedy(), &s);
  finish_position_stats<T>(a, p.b, p.j, p.n, p.pol, verdict, &s, record);
  stats[blockIdx.x] = s;
}

// ---- apply_policy --------------------------------------------------------------------

// grid: rows * chunks blocks: each writes its chunk's probabilities (zeros for a row at
// fault; the first chunk's block reports the fault).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    apply_policy_split_write_kernel(ApplyPolicyArgs a, SplitPlan plan, const ChunkStats* chunks,
                                    unsigned long long* record) {
  const int64_t row = blockIdx.x / plan.chunks;
  const int g = static_cast<int>(blockIdx.x % plan.chunks);
  const int V = static_cast<int>(a.vocab);
  const T* x = static_cast<const T*>(a.logits) + row * a.logits_row_stride;  // [V]
  float* out = a.probs + row * a.probs_row_stride;                            // [V]
  const int begin = g * plan.chunk_len;
  const int end = min(begin + plan.chunk_len, V);
  const RowPolicy pol = resolve_policy(a.policy, row);
  const int field = invalid_policy_field(pol);
  if (field >= 0) {
    if (g == 0 && threadIdx.x == 0) report_error(record, row, StatusCode::kInvalidPolicy, field);
  } else {
    RowStats s;
    const int bad = split_row_stats(chunks + row * plan.chunks, plan.chunks, pol.greedy(), &s);
    if (bad == kLogitsOk) {
      for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
        st(out + i, policy_prob(to_float(ld(x + i)), i, s, pol.temperature, pol.greedy()));
      }
      return;
    }
    if (g == 0 && threadIdx.x == 0) {
      report_error(record, row, StatusCode::kNanOrInfLogits, bad >= 0 ? bad : -1);
    }
  }
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) st(out + i, 0.0f);
}

// ---- sample ----------------------------------------------------------------------------

// grid: rows blocks: the row's total from its chunks' sums, the chunk that holds the
// draw's target (chunk order), and the exact walk along it (block_pick_target). The same
// token as sample_kernel: the integers and the rule are the same.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    sample_split_pick_kernel(SampleArgs a, SplitPlan plan, const ChunkStats* chunks,
                             unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t row = blockIdx.x;
  const int V = static_cast<int>(a.vocab);
  const float* w = a.probs + row * a.probs_row_stride;  // [V]
  const ChunkStats* rec = chunks + row * plan.chunks;
  const SplitRow r = combine_chunks(rec, plan.chunks, true);
  if (r.bad != INT_MAX || !(r.best.value > 0.0f)) {  // a bad value, or zero mass (col -1)
    if (threadIdx.x == 0) {
      report_error(record, row, StatusCode::kInvalidProbs, r.bad != INT_MAX ? r.bad : -1);
      a.tokens[row] = -1;
    }
    return;
  }
  const uint64_t draw = uniform64(resolve_seed(a.rng), resolve_offset(a.rng),
                                  static_cast<uint32_t>(row), 0, Purpose::kSample);
  const unsigned long long target = draw_target(draw, r.sum);  // < r.sum
  int g = 0;
  unsigned long long before = 0;
  while (before + rec[g].sum <= target) before += rec[g++].sum;  // stops: target < total
  const int begin = g * plan.chunk_len;
  const int n = min(begin + plan.chunk_len, V) - begin;
  const int shift = fixed_shift_for(r.best.value);
  auto fixed = [w, shift, begin](int i) { return fixed_scaled(ld(w + begin + i), shift); };
  int lo, hi;
  thread_chunk<BLOCK>(n, &lo, &hi);
  unsigned long long mine = 0;
  for (int i = lo; i < hi; ++i) mine += fixed(i);
  const int token = begin + block_pick_target<BLOCK>(fixed, n, target - before, mine, ops);
  if (threadIdx.x == 0) a.tokens[row] = token;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec
