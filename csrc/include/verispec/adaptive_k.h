// Adaptive speculation length: the cost model and the choice of k (one place).
//
// With per-position acceptance rate a, a step with k proposals emits on average
//   E[tokens](k) = (1 - a^(k+1)) / (1 - a)            (= k + 1 when a = 1)
// and costs k draft passes plus one target pass carrying k + 1 tokens per row:
//   cost(k) = k * draft_pass + target_pass(k + 1).
// k is chosen to maximise E[tokens](k) / cost(k) over 0..max_k; k = 0 is plain
// decoding (E = 1, cost = target_pass(1)) and wins whenever speculation does not pay.
#pragma once

#include <cstdint>
#include <vector>

namespace verispec {

// Expected tokens emitted by one verify step with k proposals at acceptance a.
double expected_tokens(double a, int64_t k);

// argmax_k E[tokens](k) / (k * draft_pass + target_pass[k]), where target_pass[n - 1]
// is the cost of a pass with n tokens per row (size >= max_k + 1). Ties go to the
// smaller k.
int64_t best_k(double a, double draft_pass, const std::vector<double>& target_pass,
               int64_t max_k);

// Online measurements: exponentially weighted averages of the draft pass cost and of
// the target pass cost by tokens per row. Unmeasured target sizes are extrapolated
// from the measured ones with a linear fit (one point: the prior slope, a 5-token pass
// costing 1.8x a 1-token pass, as measured for SmolLM2 on CPU).
//
// max_tokens_per_row is at most kMaxTokensPerRow (InvalidArgumentError beyond): a
// verify pass carries k + 1 tokens per row, and no useful k comes near it, while an
// absurd size (10^12) would otherwise try to allocate terabytes; below 1 it is 1.
constexpr int64_t kMaxTokensPerRow = 1024;
class CostModel {
 public:
  explicit CostModel(int64_t max_tokens_per_row);
  void observe_draft(double seconds_per_pass);
  void observe_target(int64_t tokens_per_row, double seconds);
  bool has_draft() const { return draft_seen_; }
  double draft_pass() const { return draft_; }
  // Cost of a target pass with n = 1..max tokens per row (all of them, as a vector).
  std::vector<double> target_passes() const;

 private:
  static constexpr double kWeight = 0.2;   // EWMA weight of a new measurement
  static constexpr double kPriorSlope = 0.2;  // relative cost per extra token
  double draft_ = 0.0;
  bool draft_seen_ = false;
  std::vector<double> target_;
  std::vector<bool> seen_;
};

// Per-sequence acceptance estimate over proposal trials: every accepted position, plus
// the rejected one if there was a rejection. rate = (s + 1) / (t + 2) with s successes
// and t trials both discounted by kDecay per trial: a uniform prior (0.5 before any
// evidence) that a few trials already move (4 accepts: 0.83), and a memory of about
// 1 / (1 - kDecay) = 20 trials so a draft that stops agreeing is noticed.
struct AcceptanceTracker {
  static constexpr double kDecay = 0.95;
  double successes = 0.0;             // discounted
  double trials = 0.0;                // discounted
  double rate = 0.5;                  // the estimate
  int64_t steps_without_drafts = 0;   // consecutive steps at k = 0
  // a step proposed `proposed` tokens and `accepted` of them passed
  void update(int64_t proposed, int64_t accepted);
};

// While k = 0, a probe (one step at k = 1) now and then notices a draft that starts
// agreeing. A probe costs what a k = 1 step costs beyond a plain step; probing every
// probe_interval(...) plain steps spends at most kProbeBudget of the plain decoding
// time on probes, whatever the draft costs.
constexpr double kProbeBudget = 0.01;
constexpr int64_t kMinProbeInterval = 8;
int64_t probe_interval(double draft_pass, const std::vector<double>& target_pass);

}  // namespace verispec
