// The k-ary search behind the CUDA policy's thresholds (cuda/block_ops.cuh), written for
// host and device so the native tests check it on the CPU.
//
// A filter threshold is the largest float t with enough(t) (top-k: count{p >= t} >= k;
// top-p: mass{p >= t} >= target), and enough is monotone in t: true up to the answer,
// false above. Float bit patterns of values >= 0 are ordered like the values, so the
// search runs on bit patterns. Bisection needs one pass over the row per bit (up to 31);
// here every pass evaluates kSearchCandidates patterns that split [lo, hi) evenly, so a
// pass narrows the range 8-fold and a 2^30 range takes 10 passes. The answer is the one
// bisection finds (the largest t with enough(t) is unique), or, where the tally says a
// candidate is final, a pattern that keeps the same set.
// Why 8 ways: a pass costs one softmax weight per value plus one compare per candidate,
// and the candidates and their tallies live in registers: at 16 ways the filtering
// kernels needed 80+ registers a thread (one 512-thread block per SM), at 8 ways 56-64
// (two blocks); counting instructions per value, 8 ways also beat 4 and 16 per row.
#pragma once

#include <cstdint>

#include "verispec/host_device.h"

// Device passes only: the host compiler of a .cu file would warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define VERISPEC_UNROLL _Pragma("unroll")
#else
#define VERISPEC_UNROLL
#endif

namespace verispec {
namespace kernels {

constexpr int kSearchWays = 8;                      // parts of [lo, hi) per pass
constexpr int kSearchCandidates = kSearchWays - 1;  // patterns evaluated per pass

// What a pass found, one bit per candidate c: enough(candidate c) holds; and final (stop:
// no larger t keeps a different set, e.g. top-k with exactly k kept; implies enough).
struct SearchVerdicts {
  uint32_t enough;
  uint32_t exact;
};

// Candidate c (0 <= c < kSearchCandidates) of [lo, hi), ascending in c, inside [lo, hi);
// the last one is > lo whenever hi - lo >= 2, so every pass makes progress.
VERISPEC_HD inline uint32_t search_candidate(uint32_t lo, uint32_t hi, int c) {
  const uint64_t width = hi - lo;
  return lo + static_cast<uint32_t>(width * static_cast<uint64_t>(c + 1) / kSearchWays);
}

// The largest pattern t in [lo, hi) with enough(t), given enough(lo) and not enough(hi).
// tally(lo, hi) -> SearchVerdicts evaluates the candidates search_candidate(lo, hi, c);
// on CUDA every thread of the block calls it together and gets the same verdicts.
// (Candidates are recomputed rather than kept in arrays: on CUDA, arrays live across a
// pass would cost registers.) Should verdicts not be monotone (they are, for sums of
// values >= 0 in a fixed order), the result is still an enough pattern or lo, and the
// loop still ends.
template <typename Tally>
VERISPEC_HD uint32_t search_largest_enough(uint32_t lo, uint32_t hi, Tally&& tally) {
  while (hi - lo > 1) {
    const SearchVerdicts v = tally(lo, hi);
    uint32_t new_lo = lo;
    VERISPEC_UNROLL
    for (int c = 0; c < kSearchCandidates; ++c) {
      const uint32_t cand = search_candidate(lo, hi, c);
      if ((v.exact >> c) & 1u) return cand;
      if (((v.enough >> c) & 1u) && cand > new_lo) new_lo = cand;
    }
    uint32_t new_hi = hi;  // the smallest short candidate above new_lo
    VERISPEC_UNROLL
    for (int c = kSearchCandidates - 1; c >= 0; --c) {
      const uint32_t cand = search_candidate(lo, hi, c);
      if (!((v.enough >> c) & 1u) && cand > new_lo) new_hi = cand;
    }
    lo = new_lo;
    hi = new_hi;
  }
  return lo;
}

}  // namespace kernels
}  // namespace verispec
