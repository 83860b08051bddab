// Rows split across blocks: the sampling ops when a launch has fewer rows than the GPU
// has SMs. One block per row leaves most SMs idle there (B = 1, K = 4 is 5 blocks on an
// H200's 132 SMs) and reads a whole row through one SM. Without a filter the statistics of
// a row are a maximum with its first index and integers any split adds up alike (the
// tiles of the softmax normaliser, or the fixed-point sum of probabilities for sample;
// sampling_math.h), so each row is cut into `chunks` contiguous ranges of whole tiles, one
// block each, and the results are bit for bit those of the one-block kernels
// (row_kernels.cuh) and the CPU:
//
//   logits (verify, apply_policy)
//     split_stats_kernel   per chunk: the first invalid index, the maximum and its first
//                          index, and each tile's maximum and sum (one read of the chunk)
//     then per op          verify: a small kernel turns each position's records into the
//                          RowStats verify_sample_kernel reads; apply_policy: each chunk
//                          adds the row's normaliser from the tile records and writes its
//                          probabilities (the second read)
//   probabilities (sample)
//     split_max_kernel     per chunk: the first invalid index and the maximum
//     split_sum_kernel     per chunk: the fixed-point sum of the probabilities scaled by
//                          the row maximum's power of two
//     sample_split_pick_kernel  one block per row picks the chunk that holds the draw's
//                          target and walks it.
//
// Rows with a filter (top-k, top-p, min-p) split too: their radix selections add the
// chunks' histograms into one per row (see "rows with a filter" below). Keyed sampling
// keeps the one-block kernels. Device code
// only; the launchers are in ops.cu, the host simulation runs the same code
// (csrc/tests/test_cuda_sim_kernels.cpp).
#pragma once

#include <climits>

#include "row_kernels.cuh"

namespace verispec {
namespace kernels {
namespace cuda {

constexpr int kSplitMinChunk = 3 * kStatsTile;  // values per block at least
static_assert(kCudaSplitMaxTiles == kMaxStatsTiles, "ops.h sizes the tile records");

// How a launch of `rows` rows of `vocab` values is cut: chunks per row (1: no split) and
// values per chunk, a whole number of tiles. Splits only launches of at most
// kCudaSplitMaxRows rows, into at most kCudaSplitMaxChunks chunks of at least
// kSplitMinChunk values, aiming at two blocks per SM.
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
  const int64_t len = stats_tiles((vocab + chunks - 1) / chunks) * kStatsTile;
  chunks = (vocab + len - 1) / len;  // no empty chunk after rounding to tiles
  if (chunks < 2) return plan;
  plan.chunks = static_cast<int>(chunks);
  plan.chunk_len = static_cast<int>(len);
  return plan;
}

// The tile records of row r of a split launch, in the workspace after the chunk records.
__device__ inline TileRecords split_tiles(void* split, int64_t r) {
  char* base = static_cast<char*>(split) + kCudaSplitMaxRows * kCudaSplitMaxChunks * 24;
  auto* max = reinterpret_cast<float*>(base);
  auto* sum = reinterpret_cast<unsigned long long*>(base + kCudaSplitMaxRows * kCudaSplitMaxTiles * 4);
  return TileRecords{max + r * kCudaSplitMaxTiles, sum + r * kCudaSplitMaxTiles};
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

// The positions of verify (a row's K + 1 logits rows) and of verify_tree (its N + 1 node
// rows): their positions and logits by overload.
__device__ inline bool position_of(const VerifyArgs& a, int64_t r, VerifyPosition* p) {
  return verify_position(a, r, p);
}
__device__ inline bool position_of(const VerifyTreeArgs& a, int64_t r, TreePosition* p) {
  return tree_position(a, r, p);
}
template <typename T>
__device__ inline const T* position_logits(const VerifyArgs& a, int64_t b, int64_t j) {
  return logits_at<T>(a, b, j);
}
template <typename T>
__device__ inline const T* position_logits(const VerifyTreeArgs& a, int64_t b, int64_t j) {
  return tree_logits_at<T>(a, b, j);
}

template <typename T, typename Args, typename Position>
struct PositionRows {
  using Value = T;
  Args a;
  __device__ bool row(int64_t r, const T** x, RowPolicy* pol) const {
    Position p;
    if (!position_of(a, r, &p)) return false;
    *pol = p.pol;
    *x = position_logits<T>(a, p.b, p.j);
    return true;
  }
  static constexpr bool kProbs = false;
};
template <typename T>
using VerifyRows = PositionRows<T, VerifyArgs, VerifyPosition>;
template <typename T>
using TreeRows = PositionRows<T, VerifyTreeArgs, TreePosition>;

template <typename T>
struct PolicyRows {
  using Value = T;
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
  using Value = float;
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

// The block's chunk record from each thread's argmax and first invalid index.
template <int BLOCK>
__device__ void write_chunk_record(ArgMax local, int bad, BlockOps<BLOCK>& ops, ChunkStats* out) {
  bad = ops.min_int(bad);
  const ArgMax best = ops.argmax(local);
  if (threadIdx.x == 0) out[blockIdx.x] = ChunkStats{best.value, best.index, bad, 0, 0};
}

// grid: rows * chunks blocks; out: [rows, chunks]. Logits rows: the chunk's record and its
// tiles' records (split_tiles) in one read; greedy rows need no sums.
template <typename T, int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_stats_kernel(Rows rows, int64_t vocab, SplitPlan plan, ChunkStats* out) {
  static_assert(!Rows::kProbs, "split_stats_kernel: logits rows");
  __shared__ BlockOps<BLOCK> ops;
  SplitChunk<T, Rows> c;
  if (!c.take(rows, vocab, plan)) return;
  ArgMax local{-INFINITY, INT_MAX};
  int bad = INT_MAX;
  tile_stats_pass<T, BLOCK>(c.x, static_cast<int>(vocab), c.begin / kStatsTile,
                            static_cast<int>(stats_tiles(c.end)), c.pol.temperature,
                            !c.pol.greedy(), split_tiles(out, c.r), &local, &bad);
  write_chunk_record(local, bad, ops, out);
}

// grid: rows * chunks blocks; out: [rows, chunks]. Probabilities (sample): the first bad
// index (negative, NaN or Inf) and the maximum.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    split_max_kernel(SampleRows rows, int64_t vocab, SplitPlan plan, ChunkStats* out) {
  __shared__ BlockOps<BLOCK> ops;
  SplitChunk<float, SampleRows> c;
  if (!c.take(rows, vocab, plan)) return;
  ArgMax local{-INFINITY, INT_MAX};
  int bad = INT_MAX;
  for (int i = c.begin + static_cast<int>(threadIdx.x); i < c.end; i += BLOCK) {
    const float v = ld(c.x + i);
    if (not_a_probability(v)) {
      bad = min(bad, i);
    } else if (argmax_before(v, i, local.value, local.index)) {
      local = ArgMax{v, i};
    }
  }
  write_chunk_record(local, bad, ops, out);
}

// grid: rows * chunks blocks: the chunk's fixed-point sum of probabilities scaled by the
// row maximum's power of two (from every chunk's record). Rows at fault need none.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    split_sum_kernel(SampleRows rows, int64_t vocab, SplitPlan plan, ChunkStats* out) {
  __shared__ BlockOps<BLOCK> ops;
  SplitChunk<float, SampleRows> c;
  if (!c.take(rows, vocab, plan)) return;
  const SplitRow row = combine_chunks(out + c.r * plan.chunks, plan.chunks, false);
  if (row.bad != INT_MAX || !(row.best.value > 0.0f)) return;  // zero mass: an error, no sum
  const int shift = fixed_shift_for(row.best.value);
  unsigned long long acc = 0;
  for (int i = c.begin + static_cast<int>(threadIdx.x); i < c.end; i += BLOCK) {
    acc += fixed_scaled(ld(c.x + i), shift);
  }
  acc = ops.sum_fixed(acc);
  if (threadIdx.x == 0) out[blockIdx.x].sum = acc;
}

// A logits row's RowStats without a filter (compute_row_stats<.., false>'s) from its chunk
// records; norm(row_max) adds the normaliser from its tile records. Returns that
// function's verdict.
template <typename Norm>
__device__ inline int split_row_stats(const ChunkStats* rec, int chunks, bool greedy,
                                      const Norm& norm, RowStats* s) {
  const SplitRow row = combine_chunks(rec, chunks, false);
  if (row.bad != INT_MAX) return row.bad;
  if (!is_finite(row.best.value)) return static_cast<int>(kLogitsAllMasked);
  *s = RowStats{};
  s->row_max = row.best.value;
  s->argmax = row.best.index;
  s->norm = greedy ? 1.0f : fixed_to_float(norm(row.best.value));
  s->kept = 1.0f;
  s->threshold = 0.0f;
  return static_cast<int>(kLogitsOk);
}

// ---- rows with a filter ---------------------------------------------------------------
// A filtered row's thresholds are radix selections (block_ops.cuh): each pass's histogram
// is integers, so the chunks of a split row add theirs into one histogram of the row in
// the workspace (atomics on integers: the same bins in any order, so the same threshold
// and kept mass as one block and the CPU, bit for bit), and one block a row selects the
// digit from it. Launches after split_stats_kernel:
//   split_filter_begin_kernel   rows blocks: the row's statistics from its chunk and tile
//                               records (RowStats without the filters), the filters'
//                               progress started, the histogram cleared
//   per step (for_each_filter_step: each active search's 3 passes, then min-p's)
//     split_filter_pass_kernel  rows * chunks blocks: the chunk's histogram of the pass
//                               (shared, 24 KB), added into the row's; min-p's step adds
//                               the chunk's kept mass instead
//     split_filter_select_kernel  rows blocks: the pass's digit (radix_select), then the
//                               histogram cleared for the next pass
//   then per op                 verify_split_stats_kernel / apply_policy_split_write_kernel
//                               with FILTERED: RowStats from the row's record
//                               (split_filtered_stats).
// Each step reads the row's logits once, as a one-block row's pass does: the same passes
// over the logits, spread over the row's blocks.

constexpr int32_t kSplitRowSkipped = INT_MIN;  // a row the op does not compute

// A split filtered row's record in the workspace (kCudaSplitFilterRowBytes each).
struct SplitFilterRow {
  unsigned long long mass[kRadixBins];  // the current pass's histogram, all chunks
  int count[kRadixBins];
  RowStats stats;                  // without the filters (split_filter_begin_kernel)
  FilterRun run;                   // the searches' progress
  unsigned long long min_p_mass;   // min-p's kept mass, where its step ran
  int32_t verdict;                 // compute_row_stats'; kSplitRowSkipped
  __device__ RadixHist hist() { return RadixHist{count, mass}; }
};
static_assert(sizeof(SplitFilterRow) <= kCudaSplitFilterRowBytes, "ops.h sizes the filter rows");

__device__ inline SplitFilterRow* split_filter_rows(void* split) {
  return reinterpret_cast<SplitFilterRow*>(static_cast<char*>(split) +
                                           kCudaSplitMaxRows * kCudaSplitMaxChunks * 24 +
                                           kCudaSplitMaxRows * kCudaSplitMaxTiles * 12);
}

// The filter steps a launch runs on the host: each search's passes where some row may
// use it, then min-p's kept-mass step (step kFilterSteps). fn(step): the launches of the
// step (split_filter_pass_kernel, then, below kFilterSteps, split_filter_select_kernel).
template <typename Fn>
inline void for_each_filter_step(const PolicyParams& p, int64_t vocab, const Fn& fn) {
  for (int step = 0; step <= kFilterSteps; ++step) {
    bool on;
    if (step < kRadixPasses) {
      on = p.top_k_per_row || top_k_active(p.top_k, vocab);
    } else if (step < kFilterSteps) {
      on = p.top_p_per_row || top_p_active(p.top_p);
    } else {
      on = p.min_p_per_row || min_p_active(p.min_p);
    }
    if (on) fn(step);
  }
}

// Whether a row takes part in filter step `step`: computed, sampled, and the step's search
// active (min-p's step: where min-p raises the threshold).
__device__ inline bool split_filter_step_on(const SplitFilterRow& f, const RowPolicy& pol,
                                            int64_t vocab, int step) {
  if (f.verdict != kLogitsOk || pol.greedy()) return false;
  if (step < kFilterSteps) return filter_search_active(pol, vocab, step / kRadixPasses);
  FilterRun run = f.run;
  return filter_min_p(&run, pol, raw_prob_max(f.stats));
}

// A split filtered row's RowStats (compute_row_stats<.., true>'s) and verdict.
__device__ inline int split_filtered_stats(const SplitFilterRow& f, const RowPolicy& pol,
                                           RowStats* s) {
  *s = f.stats;
  if (f.verdict == kLogitsOk && !pol.greedy()) {
    FilterRun run = f.run;
    filter_min_p(&run, pol, raw_prob_max(f.stats));
    filter_result(run, f.min_p_mass, s);
  }
  return f.verdict;
}

// grid: rows blocks.
template <int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_filter_begin_kernel(Rows rows, int64_t vocab, SplitPlan plan, ChunkStats* chunks) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t r = blockIdx.x;
  SplitFilterRow& f = split_filter_rows(chunks)[r];
  const typename Rows::Value* x;
  RowPolicy pol;
  if (!rows.row(r, &x, &pol)) {
    if (threadIdx.x == 0) f.verdict = kSplitRowSkipped;
    return;
  }
  const TileRecords tiles = split_tiles(chunks, r);
  const int n_tiles = static_cast<int>(stats_tiles(vocab));
  auto norm = [&](float row_max) {
    return tiled_norm<BLOCK>(tiles, n_tiles, row_max, pol.temperature, ops);
  };
  RowStats s{};
  const int verdict = split_row_stats(chunks + r * plan.chunks, plan.chunks, pol.greedy(), norm, &s);
  radix_hist_clear<BLOCK>(f.hist());
  if (threadIdx.x == 0) {
    f.stats = s;
    f.verdict = verdict;
    f.run = filter_run_start();
    f.min_p_mass = 0;
  }
}

// grid: rows * chunks blocks: step `step` over the block's chunk.
template <typename T, int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_filter_pass_kernel(Rows rows, int64_t vocab, SplitPlan plan, ChunkStats* chunks, int step) {
  __shared__ BlockOps<BLOCK> ops;
  __shared__ RadixScratch radix;
  SplitChunk<T, Rows> c;
  if (!c.take(rows, vocab, plan)) return;
  SplitFilterRow& f = split_filter_rows(chunks)[c.r];
  if (!split_filter_step_on(f, c.pol, vocab, step)) return;
  const RowStats s = f.stats;
  const float temperature = c.pol.temperature;
  const T* x = c.x;
  auto p_raw = [&](int i) { return raw_prob(to_float(ld(x + i)), s, temperature); };
  if (step == kFilterSteps) {  // min-p: the kept mass
    FilterRun run = f.run;
    filter_min_p(&run, c.pol, raw_prob_max(s));
    const unsigned long long m =
        ops.sum_fixed(kept_mass_part<BLOCK>(p_raw, c.begin, c.end, run.threshold));
    if (threadIdx.x == 0) atomicAdd(&f.min_p_mass, m);
    return;
  }
  const RadixHist h = radix.hist();
  radix_hist_clear<BLOCK>(h);
  __syncthreads();
  radix_hist_add<BLOCK>(p_raw, c.begin, c.end, step % kRadixPasses, f.run.prefix, h);
  __syncthreads();
  const RadixHist row = f.hist();
  for (int d = static_cast<int>(threadIdx.x); d < kRadixBins; d += BLOCK) {
    if (h.count[d] == 0) continue;
    atomicAdd(&row.count[d], h.count[d]);
    atomicAdd(&row.mass[d], h.mass[d]);
  }
}

// grid: rows blocks: the digit of step `step` from the row's histogram, which is then
// cleared for the next step.
template <int BLOCK, typename Rows>
__global__ void __launch_bounds__(BLOCK)
    split_filter_select_kernel(Rows rows, int64_t vocab, ChunkStats* chunks, int step) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t r = blockIdx.x;
  const typename Rows::Value* x;
  RowPolicy pol;
  if (!rows.row(r, &x, &pol)) return;
  SplitFilterRow& f = split_filter_rows(chunks)[r];
  if (!split_filter_step_on(f, pol, vocab, step)) return;
  FilterRun run = f.run;
  radix_select<BLOCK>(&run, step / kRadixPasses, step % kRadixPasses, pol, f.hist(), ops);
  radix_hist_clear<BLOCK>(f.hist());  // radix_select ends at a barrier: every thread read it
  if (threadIdx.x == 0) f.run = run;
}

// ---- verify ---------------------------------------------------------------------------

// A split row's RowStats (compute_row_stats<.., FILTERED>'s) and verdict, by one warp
// (every lane): from the chunk and tile records (the warp adds the tiles' terms), or
// (FILTERED) from the row's filter record.
template <bool FILTERED>
__device__ inline int warp_split_row_stats(ChunkStats* chunks, const SplitPlan& plan, int64_t r,
                                           int64_t vocab, const RowPolicy& pol, RowStats* s) {
  if constexpr (FILTERED) {
    return split_filtered_stats(split_filter_rows(chunks)[r], pol, s);
  } else {
    const TileRecords tiles = split_tiles(chunks, r);
    const int n_tiles = static_cast<int>(stats_tiles(vocab));
    const float temperature = pol.temperature;
    auto norm = [&](float row_max) {
      unsigned long long z = 0;
      for (int t = static_cast<int>(threadIdx.x); t < n_tiles; t += 32) {
        z += tile_norm_term(tiles.sum[t], tiles.max[t], row_max, temperature);
      }
      return warp_sum(z);
    };
    return split_row_stats(chunks + r * plan.chunks, plan.chunks, pol.greedy(), norm, s);
  }
}

// grid: batch * (K + 1) blocks of one warp; what verify_policy_kernel<.., FILTERED>
// writes (warp_split_row_stats).
template <typename T, bool FILTERED>
__global__ void __launch_bounds__(32)
    verify_split_stats_kernel(VerifyArgs a, SplitPlan plan, ChunkStats* chunks,
                              RowStats* stats, unsigned long long* record) {
  VerifyPosition p;
  if (!verify_position(a, blockIdx.x, &p)) return;
  RowStats s{};
  const int verdict = warp_split_row_stats<FILTERED>(chunks, plan, blockIdx.x, a.vocab, p.pol, &s);
  if (threadIdx.x != 0) return;
  finish_position_stats<T>(a, p.b, p.j, p.n, p.pol, verdict, &s, record);
  stats[blockIdx.x] = s;
  verify_masses(a, stats)[blockIdx.x] = BlockMass{0, 0};
}

// Whether a verify launch runs block_residual_kernel: block verification of sampled
// drafts, some row not greedy.
inline bool verify_needs_block_residuals(const VerifyArgs& a) {
  const bool all_greedy = !a.policy.temperature_per_row && a.policy.temperature == 0.0f;
  return a.method == VerifyMethod::kBlock && a.draft_probs && !all_greedy;
}

// Block verification (ops.h): every position's residual mass and q's check, in parallel.
// grid: batch * (K + 1) * plan.chunks blocks (plan.chunks 1: a block a position; else a
// split launch's plan), after the stats kernels. Position j < n of a sampled row gets
// R_j = the fixed-point sum of block_residual_weight(w_j, p_j, q_j) over the vocabulary
// (chunks add theirs: integers, any order) and its q row's check; w_j, the walk's weight
// before j, is a product of earlier positions' scalars, so each block finds it alone.
// Positions the walk never tests (after w reaches 0, or of a row at fault) are skipped;
// position 0 needs only q's check (the walk tests h from position 1).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    block_residual_kernel(VerifyArgs a, SplitPlan plan, const RowStats* stats) {
  __shared__ BlockOps<BLOCK> ops;
  const int64_t index = blockIdx.x / plan.chunks;
  VerifyPosition p;
  if (!verify_position(a, index, &p) || p.j >= p.n || p.pol.greedy()) return;
  const RowStats* rs = stats + p.b * (a.num_spec + 1);  // [K + 1]
  float w = 1.0f;
  for (int64_t j = 0; j < p.j; ++j) {
    if (rs[j].valid == 0) return;
    w = block_weight(w, rs[j].p_y, rs[j].q_y);
    if (!(w > 0.0f)) return;
  }
  const RowStats sj = rs[p.j];
  if (sj.valid == 0) return;
  const int V = static_cast<int>(a.vocab);
  const int begin = static_cast<int>(blockIdx.x % plan.chunks) * plan.chunk_len;
  const int end = min(begin + plan.chunk_len, V);
  const T* x = logits_at<T>(a, p.b, p.j);  // [V]
  const DraftQ q{a.draft_probs + p.b * a.draft_probs_stride_b + p.j * a.draft_probs_stride_k,
                 a.draft_index, a.draft_width};
  const float temperature = p.pol.temperature;
  unsigned long long part = 0;
  int bad = 0;
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += BLOCK) {
    const float qi = q(i);
    const bool invalid = not_a_probability(qi);
    bad |= invalid;
    if (p.j == 0) continue;
    const float pi = policy_prob(to_float(ld(x + i)), i, sj, temperature, false);
    part += fixed_weight(block_residual_weight(w, pi, invalid ? 0.0f : qi));
  }
  part = ops.sum_fixed(part);
  bad = __syncthreads_or(bad);
  if (threadIdx.x != 0) return;
  BlockMass& m = verify_masses(a, stats)[index];
  atomicAdd(&m.mass, part);
  if (bad) atomicAdd(&m.q_bad, 1ull);
}

// ---- verify_tree -----------------------------------------------------------------------

// grid: batch * (N + 1) blocks of one warp; what tree_policy_kernel<.., FILTERED> writes
// (warp_split_row_stats).
template <bool FILTERED>
__global__ void __launch_bounds__(32)
    tree_split_stats_kernel(VerifyTreeArgs a, SplitPlan plan, ChunkStats* chunks, RowStats* stats) {
  TreePosition p;
  if (!tree_position(a, blockIdx.x, &p)) return;
  RowStats s{};
  const int verdict = warp_split_row_stats<FILTERED>(chunks, plan, blockIdx.x, a.vocab, p.pol, &s);
  if (threadIdx.x != 0) return;
  s.valid = verdict;
  stats[blockIdx.x] = s;
}

// ---- apply_policy --------------------------------------------------------------------

// grid: rows * chunks blocks: each adds its row's normaliser from the tile records (or,
// FILTERED, reads its row's filter record) and writes its chunk's probabilities (zeros for a row at fault; the first chunk's block
// reports the fault).
template <typename T, int BLOCK, bool FILTERED>
__global__ void __launch_bounds__(BLOCK)
    apply_policy_split_write_kernel(ApplyPolicyArgs a, SplitPlan plan, ChunkStats* chunks,
                                    unsigned long long* record) {
  __shared__ BlockOps<BLOCK> ops;
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
    const TileRecords tiles = split_tiles(chunks, row);
    const int n_tiles = static_cast<int>(stats_tiles(V));
    auto norm = [&](float row_max) {
      return tiled_norm<BLOCK>(tiles, n_tiles, row_max, pol.temperature, ops);
    };
    RowStats s;
    const int bad =
        FILTERED ? split_filtered_stats(split_filter_rows(chunks)[row], pol, &s)
                 : split_row_stats(chunks + row * plan.chunks, plan.chunks, pol.greedy(), norm, &s);
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
