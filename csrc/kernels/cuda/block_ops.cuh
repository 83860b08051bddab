// Block-wide building blocks of the sampling kernels (one block per row): reductions
// that hand every thread the result, the threshold searches of the policy, and the
// inverse-CDF pick. All reductions use CUB's fixed tree, so results are deterministic
// for a given block size.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>

#include "../common.h"

namespace verispec {
namespace kernels {
namespace cuda {

struct MinInt {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxInt {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

struct ArgMax {
  float value;
  int index;
};
struct ArgMaxOp {  // larger value first, ties to the lower index (sampling_math.h)
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return argmax_before(a.value, a.index, b.value, b.index) ? a : b;
  }
};

// Shared state of a block; construct in shared memory, one per kernel.
template <int BLOCK>
struct BlockOps {
  using ReduceF = cub::BlockReduce<float, BLOCK>;
  using ReduceI = cub::BlockReduce<int, BLOCK>;
  using ReduceA = cub::BlockReduce<ArgMax, BLOCK>;
  using ScanF = cub::BlockScan<float, BLOCK>;
  union Temp {
    typename ReduceF::TempStorage f;
    typename ReduceI::TempStorage i;
    typename ReduceA::TempStorage a;
    typename ScanF::TempStorage s;
  };
  Temp temp;
  float bcast_f;
  int bcast_i;
  ArgMax bcast_a;

  // Each reduction ends with the result in every thread and `temp` free for reuse.
  __device__ float sum(float v) {
    const float r = ReduceF(temp.f).Sum(v);
    if (threadIdx.x == 0) bcast_f = r;
    __syncthreads();
    const float out = bcast_f;
    __syncthreads();
    return out;
  }
  __device__ int sum_int(int v) {
    const int r = ReduceI(temp.i).Sum(v);
    if (threadIdx.x == 0) bcast_i = r;
    __syncthreads();
    const int out = bcast_i;
    __syncthreads();
    return out;
  }
  template <typename Op>
  __device__ int reduce_int(int v, Op op) {
    const int r = ReduceI(temp.i).Reduce(v, op);
    if (threadIdx.x == 0) bcast_i = r;
    __syncthreads();
    const int out = bcast_i;
    __syncthreads();
    return out;
  }
  __device__ int min_int(int v) { return reduce_int(v, MinInt()); }
  __device__ int max_int(int v) { return reduce_int(v, MaxInt()); }
  __device__ ArgMax argmax(ArgMax v) {
    const ArgMax r = ReduceA(temp.a).Reduce(v, ArgMaxOp());
    if (threadIdx.x == 0) bcast_a = r;
    __syncthreads();
    const ArgMax out = bcast_a;
    __syncthreads();
    return out;
  }
};

// Reports a value error into the record (lowest record wins; see ops.h). Any thread.
__device__ inline void report_error(unsigned long long* record, int64_t row, StatusCode code,
                                    int64_t col) {
  if (record) atomicMin(record, static_cast<unsigned long long>(pack_error(row, code, col)));
}

// ---- the policy of one row --------------------------------------------------------------

// What the policy of a row reduces to: p_i = policy_prob(l_i, i). 32 bytes: the verify
// workspace holds one per (row, position) (kVerifyStatsBytesPerPosition).
struct RowStats {
  float row_max;    // max logit
  float norm;       // sum of softmax weights: p_raw = weight / norm
  float threshold;  // keep p_raw >= threshold; 0 keeps all (no renormalisation)
  float kept;       // mass of the kept p_raw
  int32_t argmax;   // ties to the lowest index
  float p_y;        // verify: p(proposal)
  float q_y;        // verify: q(proposal)
  int32_t valid;    // verify: 1 once computed; 0 if the position is at fault
};
static_assert(sizeof(RowStats) <= kVerifyStatsBytesPerPosition, "RowStats outgrew the workspace");

// The policy probability of logit l at index i (the same formula as cpu_policy.h).
__device__ inline float policy_prob(float l, int i, const RowStats& s, float temperature,
                                    bool greedy) {
  if (greedy) return i == s.argmax ? 1.0f : 0.0f;
  const float p = softmax_weight(l, s.row_max, temperature) / s.norm;
  if (s.threshold > 0.0f) return p >= s.threshold ? p / s.kept : 0.0f;
  return p;
}

// Computes the policy of logits x[0, V) into *stats (same value in every thread).
// Returns kLogitsOk, the lowest index of a NaN / +Inf logit, or kLogitsAllMasked (no
// finite logit; -Inf is a mask). Threshold searches bisect the bit
// pattern of the probability (monotone for values >= 0): each step is one pass with a
// block count or mass, at most 31 steps, and the result is an exact probability value.
template <typename T, int BLOCK>
__device__ int compute_row_stats(const T* __restrict__ x, int V, const RowPolicy& pol,
                                 bool greedy, BlockOps<BLOCK>& ops, RowStats* stats) {
  const int tid = threadIdx.x;
  ArgMax local{-INFINITY, INT_MAX};
  int bad = INT_MAX;
  for (int i = tid; i < V; i += BLOCK) {
    const float v = to_float(x[i]);
    if (!logit_valid(v)) {
      bad = min(bad, i);
    } else if (argmax_before(v, i, local.value, local.index)) {
      local = ArgMax{v, i};
    }
  }
  bad = ops.min_int(bad);
  if (bad != INT_MAX) return bad;
  const ArgMax best = ops.argmax(local);
  if (!is_finite(best.value)) return static_cast<int>(kLogitsAllMasked);
  RowStats s{};
  s.row_max = best.value;
  s.argmax = best.index;
  s.norm = 1.0f;
  s.kept = 1.0f;
  s.threshold = 0.0f;
  if (greedy) {
    *stats = s;
    return static_cast<int>(kLogitsOk);
  }
  const float temperature = pol.temperature;
  float acc = 0.0f;
  for (int i = tid; i < V; i += BLOCK) acc += softmax_weight(to_float(x[i]), s.row_max, temperature);
  s.norm = ops.sum(acc);
  const float norm = s.norm;
  const float row_max = s.row_max;
  auto p_raw = [&](int i) { return softmax_weight(to_float(x[i]), row_max, temperature) / norm; };
  auto count_ge = [&](float t) {
    int c = 0;
    for (int i = tid; i < V; i += BLOCK) c += p_raw(i) >= t;
    return ops.sum_int(c);
  };
  auto mass_ge = [&](float t) {
    float m = 0.0f;
    for (int i = tid; i < V; i += BLOCK) {
      const float p = p_raw(i);
      if (p >= t) m += p;
    }
    return ops.sum(m);
  };
  const float p_max = 1.0f / norm;  // the argmax has weight exp(0) = 1

  float threshold = 0.0f;
  if (top_k_active(pol.top_k, V)) {
    // Largest t with count{p >= t} >= k: the k-th largest probability.
    const int k = pol.top_k;
    if (count_ge(p_max) >= k) {
      threshold = p_max;
    } else {
      uint32_t lo = 0, hi = float_bits(p_max);  // count(lo) >= k > count(hi)
      while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        const int c = count_ge(bits_float(mid));
        if (c >= k) lo = mid;
        else hi = mid;
        if (c == k) break;  // {p >= mid} is exactly the top-k set already
      }
      threshold = bits_float(lo);
    }
  }
  if (top_p_active(pol.top_p)) {
    // Largest t >= threshold with mass{p >= t} >= top_p * mass{p >= threshold}.
    const float target = top_p_target_mass(pol.top_p, mass_ge(threshold));
    if (mass_ge(p_max) >= target) {
      threshold = p_max;
    } else {
      uint32_t lo = float_bits(threshold), hi = float_bits(p_max);  // mass(lo) >= target > mass(hi)
      while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (mass_ge(bits_float(mid)) >= target) lo = mid;
        else hi = mid;
      }
      threshold = bits_float(lo);
    }
  }
  if (min_p_active(pol.min_p)) threshold = fmaxf(threshold, min_p_threshold(pol.min_p, p_max));
  if (threshold > 0.0f) {
    s.threshold = threshold;
    s.kept = mass_ge(threshold);
  }
  *stats = s;
  return static_cast<int>(kLogitsOk);
}

// ---- inverse CDF --------------------------------------------------------------------

struct WeightTotal {
  float total;  // sum of the weights
  int last;     // largest index with a positive weight, -1 if none
};

// Total and last positive index of weights w(i) >= 0, i < V.
template <int BLOCK, typename WeightFn>
__device__ WeightTotal block_total(const WeightFn& w, int V, BlockOps<BLOCK>& ops) {
  float acc = 0.0f;
  int last = -1;
  for (int i = threadIdx.x; i < V; i += BLOCK) {
    const float wi = w(i);
    if (wi > 0.0f) {
      acc += wi;
      last = i;
    }
  }
  WeightTotal t;
  t.total = ops.sum(acc);
  t.last = ops.max_int(last);
  return t;
}

// Inverse-CDF pick (sampling_math.h rule) over weights w(i) >= 0 with coin u, given
// their block_total: tiles of BLOCK in index order with a running prefix (block scan),
// stopping at the first tile that holds the pick. Returns -1 if all weights are zero.
template <int BLOCK, typename WeightFn>
__device__ int block_pick(const WeightFn& w, int V, float u, const WeightTotal& t,
                          BlockOps<BLOCK>& ops) {
  if (t.last < 0) return -1;
  const float target = inverse_cdf_target(u, t.total);
  float running = 0.0f;
  for (int base = 0; base < V; base += BLOCK) {
    const int i = base + threadIdx.x;
    const float wi = i < V ? w(i) : 0.0f;
    float before, tile_total;
    typename BlockOps<BLOCK>::ScanF(ops.temp.s).ExclusiveSum(wi, before, tile_total);
    __syncthreads();  // temp is reused by the reduction below
    const bool hit = wi > 0.0f && running + before + wi > target;
    const int found = ops.min_int(hit ? i : INT_MAX);
    if (found != INT_MAX) return found;
    running += tile_total;
  }
  return t.last;  // rounding: the running sum never exceeded the target
}

template <int BLOCK, typename WeightFn>
__device__ int block_pick(const WeightFn& w, int V, float u, BlockOps<BLOCK>& ops) {
  return block_pick<BLOCK>(w, V, u, block_total<BLOCK>(w, V, ops), ops);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec
