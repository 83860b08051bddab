// Block-wide building blocks of the sampling kernels (one block per row): reductions
// that hand every thread the result, the threshold searches of the policy, and the
// inverse-CDF pick. Every reduction has a fixed order (CUB's tree, or warp shuffles
// then warps in order), so results are deterministic for a given block size.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>

#include "../common.h"

// Device passes only: the host compiler of a .cu file would warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define VERISPEC_UNROLL _Pragma("unroll")
#else
#define VERISPEC_UNROLL
#endif

namespace verispec {
namespace kernels {
namespace cuda {

struct MaxFloat {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};
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
  using ReduceU = cub::BlockReduce<unsigned long long, BLOCK>;
  using ReduceA = cub::BlockReduce<ArgMax, BLOCK>;
  using ScanU = cub::BlockScan<unsigned long long, BLOCK>;
  union Temp {
    typename ReduceF::TempStorage f;
    typename ReduceI::TempStorage i;
    typename ReduceU::TempStorage u;
    typename ReduceA::TempStorage a;
    typename ScanU::TempStorage s;
  };
  static_assert(BLOCK % 32 == 0, "whole warps");
  static constexpr int kWarps = BLOCK / 32;
  Temp temp;
  float bcast_f;
  int bcast_i;
  unsigned long long bcast_u;
  ArgMax bcast_a;
  // Each reduction ends with the result in every thread and `temp` free for reuse.
  // Sums are of integers only (counts, fixed-point masses): exact in any order.
  __device__ float max(float v) { return broadcast(ReduceF(temp.f).Reduce(v, MaxFloat()), bcast_f); }
  __device__ int sum_int(int v) { return broadcast(ReduceI(temp.i).Sum(v), bcast_i); }
  __device__ unsigned long long sum_fixed(unsigned long long v) {
    return broadcast(ReduceU(temp.u).Sum(v), bcast_u);
  }
  template <typename Op>
  __device__ int reduce_int(int v, Op op) {
    return broadcast(ReduceI(temp.i).Reduce(v, op), bcast_i);
  }
  __device__ int min_int(int v) { return reduce_int(v, MinInt()); }
  __device__ int max_int(int v) { return reduce_int(v, MaxInt()); }
  __device__ ArgMax argmax(ArgMax v) {
    return broadcast(ReduceA(temp.a).Reduce(v, ArgMaxOp()), bcast_a);
  }

 private:
  // A CUB result (valid in thread 0) handed to every thread through `slot`; the second
  // barrier frees `slot` and `temp` for the next reduction.
  template <typename T>
  __device__ T broadcast(const T& r, T& slot) {
    if (threadIdx.x == 0) slot = r;
    __syncthreads();
    const T out = slot;
    __syncthreads();
    return out;
  }
};

// Global-memory accesses to the ops' inputs and outputs (logits, probabilities, q, the
// probabilities written): plain loads and stores on the device; the host simulation
// counts them per row (csrc/tests/cuda_sim/cuda_sim.h, Traffic), the stand-in for speed
// that native tests pin without a GPU. Workspace scratch is not counted.
template <typename T>
__device__ __forceinline__ T ld(const T* p) {
#if defined(CUDA_SIM_TRAFFIC)
  cuda_sim::traffic.read(p, sizeof(T));
#endif
  return *p;
}
// A draft row's q(x) (ops.h "Compact q": through draft_index when it is set), read with ld.
struct DraftQ {
  const float* row;
  const int32_t* index;  // [vocab], or null: row has vocab columns
  int64_t width;
  __device__ __forceinline__ float operator()(int64_t x) const {
    return compact_q(row, index, width, x, [](const auto* p) { return ld(p); });
  }
};
template <typename T>
__device__ __forceinline__ void st(T* p, T v) {
#if defined(CUDA_SIM_TRAFFIC)
  cuda_sim::traffic.write(p, sizeof(T));
#endif
  *p = v;
}

// A q or probs value that is negative, NaN or infinite.
__device__ inline bool not_a_probability(float v) { return !(v >= 0.0f) || !is_finite(v); }

// Reports a value error into the record (lowest record wins; see ops.h). Any thread.
__device__ inline void report_error(unsigned long long* record, int64_t row, StatusCode code,
                                    int64_t col) {
  if (record) atomicMin(record, static_cast<unsigned long long>(pack_error(row, code, col)));
}

// ---- one pass of row statistics (sampling_math.h: the normaliser in tiles) -------------

__device__ inline float warp_max(float v) {
  VERISPEC_UNROLL
  for (int m = 16; m > 0; m >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}
__device__ inline unsigned long long warp_sum(unsigned long long v) {
  VERISPEC_UNROLL
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Where a row's tile statistics go: the maximum m_t and the fixed-point sum S_t of tile t
// at max[t], sum[t] (shared memory for one block a row, the workspace for a split row).
struct TileRecords {
  float* max;
  unsigned long long* sum;
};

// Tiles [t_begin, t_end) of logits x[0, V), one warp a tile, the block's warps in turn:
// each lane holds kStatsTile / 32 values, the warp's maximum is m_t and (sums) the warp
// adds S_t against it, so each logit is read once. Lane 0 writes the records. Folds this
// thread's values into *local (the argmax, first index on ties) and *bad (the first NaN /
// +Inf index); an invalid value counts as -Inf in its tile.
template <typename T, int BLOCK>
__device__ void tile_stats_pass(const T* __restrict__ x, int V, int t_begin, int t_end,
                                float temperature, bool sums, TileRecords rec, ArgMax* local,
                                int* bad) {
  constexpr int kPerLane = kStatsTile / 32;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int t = t_begin + static_cast<int>(threadIdx.x >> 5); t < t_end; t += BLOCK / 32) {
    const int base = t * kStatsTile + lane;
    float v[kPerLane];
    float m = -INFINITY;
    VERISPEC_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      const int i = base + 32 * k;
      float l = -INFINITY;
      if (i < V) {
        l = to_float(ld(x + i));
        if (!logit_valid(l)) {
          *bad = min(*bad, i);
          l = -INFINITY;
        } else if (argmax_before(l, i, local->value, local->index)) {
          *local = ArgMax{l, i};
        }
      }
      v[k] = l;
      m = l > m ? l : m;
    }
    m = warp_max(m);
    if (sums) {
      unsigned long long acc = 0;
      VERISPEC_UNROLL
      for (int k = 0; k < kPerLane; ++k) acc += fixed_weight(softmax_weight(v[k], m, temperature));
      acc = warp_sum(acc);
      if (lane == 0) rec.sum[t] = acc;
    }
    if (lane == 0) rec.max[t] = m;
  }
}

// Z in fixed point from tiles [0, tiles) of a row (records complete: read after a barrier),
// in every thread.
template <int BLOCK>
__device__ unsigned long long tiled_norm(TileRecords rec, int tiles, float row_max,
                                         float temperature, BlockOps<BLOCK>& ops) {
  unsigned long long z = 0;
  for (int t = static_cast<int>(threadIdx.x); t < tiles; t += BLOCK) {
    z += tile_norm_term(rec.sum[t], rec.max[t], row_max, temperature);
  }
  return ops.sum_fixed(z);
}

// ---- the policy of one row --------------------------------------------------------------

// What the policy of a row reduces to: p_i = policy_prob(l_i, i). 32 bytes: the verify
// workspace holds one per (row, position) (kVerifyStatsBytesPerPosition, with BlockMass).
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
static_assert(sizeof(RowStats) == 32, "the verify payload is an array of 32-byte RowStats");

// The probability of logit l before the filters (p_raw), and the largest (the argmax has
// weight exp(0) = 1): what the filters' thresholds are found among.
__device__ inline float raw_prob(float l, const RowStats& s, float temperature) {
  return softmax_weight(l, s.row_max, temperature) / s.norm;
}
__device__ inline float raw_prob_max(const RowStats& s) { return 1.0f / s.norm; }

// The policy probability of logit l at index i (the same formula as cpu_policy.h).
__device__ inline float policy_prob(float l, int i, const RowStats& s, float temperature,
                                    bool greedy) {
  if (greedy) return i == s.argmax ? 1.0f : 0.0f;
  const float p = raw_prob(l, s, temperature);
  if (s.threshold > 0.0f) return p >= s.threshold ? p / s.kept : 0.0f;
  return p;
}

// ---- the filters' thresholds: radix selection -------------------------------------------
// A filter threshold is the largest value t of the row's probabilities with enough(stat{p >=
// t}) (top-k: count >= k; top-p: mass >= top_p * the survivors' mass), enough monotone,
// false for no value and true for all. Float bit patterns of values >= 0 are ordered like
// the values, so t is found digit by digit from the top of its bits: each of kRadixPasses
// passes over the row builds a histogram (count and fixed-point mass) of the next digit
// over the values that match the digits found so far (radix_hist_add), and a block scan
// from the highest bin finds the one where enough turns true (radix_select). Integer sums:
// the same t (the CPU's, cpu_policy.h) in any order and from any split of the row (one
// block's shared histogram, or a split row's chunks added into the workspace:
// split_kernels.cuh), and stat{p >= t} with it, so no pass is needed for the kept mass.
// 11 + 11 + 10 bits: three passes a threshold.
constexpr int kRadixPasses = 3;
constexpr int kRadixBins = 1 << 11;
VERISPEC_HD constexpr int radix_bits(int pass) { return pass < 2 ? 11 : 10; }
VERISPEC_HD constexpr int radix_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }

struct RadixStat {
  unsigned long long count;
  unsigned long long mass;
};

// A histogram of one pass's digits (kRadixBins bins of counts and fixed-point masses):
// shared memory for one block a row; a split row's is in the workspace (SplitFilterRow).
struct RadixHist {
  int* count;
  unsigned long long* mass;
};

struct RadixScratch {  // a one-block row's shared histogram: 24 KB
  unsigned long long mass[kRadixBins];
  int count[kRadixBins];
  __device__ RadixHist hist() { return RadixHist{count, mass}; }
};

// The filters' searches, in order: top-k, then top-p on its survivors; each is
// kRadixPasses passes, so a row's filters take up to kFilterSteps steps (step = search *
// kRadixPasses + pass), and min-p one more pass for its kept mass where it raises the
// threshold (split rows: step kFilterSteps).
constexpr int kFilterSearches = 2;
constexpr int kFilterSteps = kFilterSearches * kRadixPasses;

VERISPEC_HD inline bool filter_search_active(const RowPolicy& pol, int64_t V, int search) {
  return search == 0 ? top_k_active(pol.top_k, V) : top_p_active(pol.top_p);
}

// The filters' progress over a row, the same in every thread (a split row keeps it in the
// workspace between launches): the current search's digits so far and the stat of the
// values above them, then each finished search's threshold and kept stat.
struct FilterRun {
  RadixStat above;               // stat of the values above the digits found so far
  RadixStat kept;                // stat{p >= threshold}, where kept_known
  unsigned long long survivors;  // top-p: the mass its fraction is of
  uint32_t prefix;               // the current search's digits found so far
  float threshold;               // 0: keep all
  int32_t kept_known;
  int32_t pad;
};

VERISPEC_HD inline FilterRun filter_run_start() {
  return FilterRun{RadixStat{0, 0}, RadixStat{0, 0}, 0, 0u, 0.0f, 0, 0};
}

// Adds p_of(i), i in [begin, end) (this thread: every BLOCK-th), matching run's digits so
// far to the histogram of `pass` (atomics on integers: the same bins in any order).
template <int BLOCK, typename PFn>
__device__ void radix_hist_add(const PFn& p_of, int begin, int end, int pass, uint32_t prefix,
                               RadixHist h) {
  const int bits = radix_bits(pass), shift = radix_shift(pass);
  const uint32_t known = pass == 0 ? 0u : ~((uint32_t{1} << (shift + bits)) - 1u);
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
    const float p = p_of(i);
    const uint32_t u = float_bits(p);
    if ((u & known) != prefix) continue;
    const int d = static_cast<int>((u >> shift) & static_cast<uint32_t>((1 << bits) - 1));
    atomicAdd(&h.count[d], 1);
    atomicAdd(&h.mass[d], static_cast<unsigned long long>(fixed_weight(p)));
  }
}

template <int BLOCK>
__device__ void radix_hist_clear(RadixHist h) {
  for (int d = static_cast<int>(threadIdx.x); d < kRadixBins; d += BLOCK) {
    h.count[d] = 0;
    h.mass[d] = 0;
  }
}

// One pass of search `search` over its complete histogram `h` (every thread calls it; the
// same *run in each): the bin where enough turns true (a block scan from the highest bin)
// is the pass's digit. After the last pass, *run holds the search's threshold t, the
// largest value with enough(stat{p >= t}) (top-k: count >= k; top-p: mass >= top_p * the
// survivors' mass, mass_at_least), and that stat. Float bit patterns of values >= 0 are
// ordered like the values, and the sums are of integers: the CPU's t (cpu_policy.h) from
// any split of the row.
template <int BLOCK>
__device__ void radix_select(FilterRun* run, int search, int pass, const RowPolicy& pol,
                             RadixHist h, BlockOps<BLOCK>& ops) {
  using ScanU = typename BlockOps<BLOCK>::ScanU;
  struct Pick {
    int digit;
    RadixStat above;
  };
  __shared__ Pick pick;
  const int tid = threadIdx.x;
  const int bits = radix_bits(pass), shift = radix_shift(pass), bins = 1 << bits;
  if (tid == 0) pick = Pick{0, run->above};  // enough turns inside this pass's bins: replaced
  // Thread t owns bins [hi - per, hi), hi = bins - t * per: thread 0 the highest, so an
  // exclusive scan in thread order sums the bins above a thread's.
  const int per = (bins + BLOCK - 1) / BLOCK;
  const int hi = bins - tid * per;
  const int lo = hi - per > 0 ? hi - per : 0;
  unsigned long long c = 0, m = 0;
  for (int d = lo; d < hi; ++d) {
    c += static_cast<unsigned long long>(h.count[d]);
    m += h.mass[d];
  }
  unsigned long long c_above, m_above, c_all, m_all;
  ScanU(ops.temp.s).ExclusiveSum(c, c_above, c_all);
  __syncthreads();
  ScanU(ops.temp.s).ExclusiveSum(m, m_above, m_all);
  __syncthreads();
  // top-p: of the top-k survivors' mass, or (no top-k) of every value's.
  if (search == 1 && pass == 0) run->survivors = run->kept_known ? run->kept.mass : m_all;
  const unsigned long long k = static_cast<unsigned long long>(pol.top_k);
  const float top_p = pol.top_p;
  const unsigned long long survivors = run->survivors;
  auto enough = [=](const RadixStat& st) {
    return search == 0 ? st.count >= k : mass_at_least(st.mass, top_p, survivors);
  };
  RadixStat acc{run->above.count + c_above, run->above.mass + m_above};
  for (int d = hi - 1; d >= lo; --d) {
    const RadixStat next{acc.count + static_cast<unsigned long long>(h.count[d]),
                         acc.mass + h.mass[d]};
    if (!enough(acc) && enough(next)) pick = Pick{d, acc};  // exactly one bin of the row
    acc = next;
  }
  __syncthreads();
  const Pick got = pick;
  run->prefix |= static_cast<uint32_t>(got.digit) << shift;
  run->above = got.above;
  if (pass == kRadixPasses - 1) {  // the last bin is the one value t: its stat is in h
    run->kept = RadixStat{got.above.count + static_cast<unsigned long long>(h.count[got.digit]),
                          got.above.mass + h.mass[got.digit]};
    run->kept_known = 1;
    run->threshold = bits_float(run->prefix);
    run->prefix = 0;
    run->above = RadixStat{0, 0};
  }
  __syncthreads();  // every thread has read pick and h: both may change
}

// After the searches: min-p (its threshold from p_max) where it is higher. True where the
// kept mass is then unknown: a pass sums the kept probabilities (filter_result takes it).
VERISPEC_HD inline bool filter_min_p(FilterRun* run, const RowPolicy& pol, float p_max) {
  if (!min_p_active(pol.min_p)) return false;
  const float t = min_p_threshold(pol.min_p, p_max);
  if (!(t > run->threshold)) return false;
  run->threshold = t;
  run->kept_known = 0;
  return true;
}

// The filters' threshold and kept mass into s (kept_mass: min-p's pass, where it ran).
VERISPEC_HD inline void filter_result(const FilterRun& run, unsigned long long kept_mass,
                                      RowStats* s) {
  if (!(run.threshold > 0.0f)) return;
  s->threshold = run.threshold;
  s->kept = fixed_to_float(run.kept_known ? run.kept.mass : kept_mass);
}

// The fixed-point mass of p_of(i) >= threshold over this thread's values of [begin, end).
template <int BLOCK, typename PFn>
__device__ unsigned long long kept_mass_part(const PFn& p_of, int begin, int end, float threshold) {
  unsigned long long m = 0;
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
    const float p = p_of(i);
    if (p >= threshold) m += fixed_weight(p);
  }
  return m;
}

// The filters of a row (top-k, then top-p on the survivors, then min-p) into s->threshold
// and s->kept, from its probabilities p_raw(i) (largest p_max); the CPU's thresholds
// (cpu_policy.h policy_row). Every thread calls it; the same result in each. One block:
// each pass builds the histogram in shared memory, then selects.
template <int BLOCK, typename PFn>
__device__ void filter_threshold(const PFn& p_raw, int V, const RowPolicy& pol, float p_max,
                                 BlockOps<BLOCK>& ops, RowStats* s) {
  __shared__ RadixScratch radix;
  FilterRun run = filter_run_start();
  for (int search = 0; search < kFilterSearches; ++search) {
    if (!filter_search_active(pol, V, search)) continue;
    for (int pass = 0; pass < kRadixPasses; ++pass) {
      radix_hist_clear<BLOCK>(radix.hist());
      __syncthreads();
      radix_hist_add<BLOCK>(p_raw, 0, V, pass, run.prefix, radix.hist());
      __syncthreads();
      radix_select<BLOCK>(&run, search, pass, pol, radix.hist(), ops);
    }
  }
  unsigned long long kept_mass = 0;
  if (filter_min_p(&run, pol, p_max)) {
    kept_mass = ops.sum_fixed(kept_mass_part<BLOCK>(p_raw, 0, V, run.threshold));
  }
  filter_result(run, kept_mass, s);
}

// Computes the policy of logits x[0, V) into *stats (same value in every thread). One
// pass finds the maximum and the normaliser together (tile_stats_pass, then tiled_norm
// over the tile records in shared memory). Returns kLogitsOk, the lowest index of a NaN / +Inf logit, or kLogitsAllMasked (no
// finite logit; -Inf is a mask). The filters' thresholds are exact probability values,
// found by radix selection (filter_threshold: three passes a filter).
// FILTER false: every filter is off for every row (policy_may_filter); the filter code
// is left out, and with it the registers its searches need.
template <typename T, int BLOCK, bool FILTER>
__device__ int compute_row_stats(const T* __restrict__ x, int V, const RowPolicy& pol,
                                 bool greedy, BlockOps<BLOCK>& ops, RowStats* stats) {
  __shared__ float tile_max[kMaxStatsTiles];
  __shared__ unsigned long long tile_sum[kMaxStatsTiles];
  const int tiles = static_cast<int>(stats_tiles(V));
  const TileRecords rec{tile_max, tile_sum};
  ArgMax local{-INFINITY, INT_MAX};
  int bad = INT_MAX;
  tile_stats_pass<T, BLOCK>(x, V, 0, tiles, pol.temperature, !greedy, rec, &local, &bad);
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
  s.norm = fixed_to_float(tiled_norm<BLOCK>(rec, tiles, s.row_max, temperature, ops));
  if constexpr (FILTER) {  // only instantiated here: its shared histogram too
    const RowStats unfiltered = s;
    auto p_raw = [&](int i) { return raw_prob(to_float(ld(x + i)), unfiltered, temperature); };
    filter_threshold<BLOCK>(p_raw, V, pol, raw_prob_max(s), ops, &s);
  }
  *stats = s;
  return static_cast<int>(kLogitsOk);
}

// ---- inverse CDF --------------------------------------------------------------------
// Thread t owns the contiguous chunk [t * C, (t + 1) * C) of the row, C = ceil(V / BLOCK).
// A pick is one pass that sums every chunk's fixed-point weights, one block scan over the
// chunk sums, and a walk along the one chunk that holds the target, by its owner: the
// exact rule of sampling_math.h (pick_fixed), whose integer sums do not depend on the
// chunking, so the CPU's sequential walk picks the same token.

// This thread's chunk [*begin, *end) of [0, V).
template <int BLOCK>
__device__ inline void thread_chunk(int V, int* begin, int* end) {
  const int size = (V + BLOCK - 1) / BLOCK;  // V <= 2^20: threadIdx.x * size stays an int
  *begin = min(static_cast<int>(threadIdx.x) * size, V);
  *end = min(*begin + size, V);
}

struct WeightTotal {
  unsigned long long total;  // fixed-point sum of the weights
  unsigned long long chunk;  // this thread's chunk: its fixed-point sum
};

// The total of fixed-point weights W(i) (uint64, e.g. fixed_weight of a probability) over
// i < V, and this thread's share.
template <int BLOCK, typename FixedFn>
__device__ WeightTotal block_total(const FixedFn& w, int V, BlockOps<BLOCK>& ops) {
  int begin, end;
  thread_chunk<BLOCK>(V, &begin, &end);
  WeightTotal t;
  t.chunk = 0;
  for (int i = begin; i < end; ++i) t.chunk += w(i);
  t.total = ops.sum_fixed(t.chunk);
  return t;
}

// The pick of the exact inverse CDF over fixed-point weights W(i), i < n, for a target
// below their total, given this thread's thread_chunk sum of them: a block scan over the
// chunk sums, then a walk along the one chunk that holds the target, by its owner.
template <int BLOCK, typename FixedFn>
__device__ int block_pick_target(const FixedFn& w, int n, unsigned long long target,
                                 unsigned long long chunk, BlockOps<BLOCK>& ops) {
  unsigned long long before, all;
  typename BlockOps<BLOCK>::ScanU(ops.temp.s).ExclusiveSum(chunk, before, all);
  __syncthreads();  // temp is reused by the reduction below
  // Exactly one chunk holds the target: before <= target < before + chunk.
  if (before <= target && target - before < chunk) {
    int begin, end;
    thread_chunk<BLOCK>(n, &begin, &end);
    ops.bcast_i = begin + static_cast<int>(pick_fixed(
                              [&w, begin](int64_t i) { return w(begin + static_cast<int>(i)); },
                              end - begin, target - before));
  }
  __syncthreads();
  const int out = ops.bcast_i;
  __syncthreads();
  return out;
}

// The exact inverse-CDF pick over fixed-point weights W(i) with the 64-bit coin `draw`,
// given their block_total. Returns -1 if the total is zero.
template <int BLOCK, typename FixedFn>
__device__ int block_pick(const FixedFn& w, int V, uint64_t draw, const WeightTotal& t,
                          BlockOps<BLOCK>& ops) {
  if (t.total == 0) return -1;
  return block_pick_target<BLOCK>(w, V, draw_target(draw, t.total), t.chunk, ops);
}

template <int BLOCK, typename FixedFn>
__device__ int block_pick(const FixedFn& w, int V, uint64_t draw, BlockOps<BLOCK>& ops) {
  return block_pick<BLOCK>(w, V, draw, block_total<BLOCK>(w, V, ops), ops);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec
