#include "verispec/adaptive_k.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "verispec/errors.h"

namespace verispec {

double expected_tokens(double a, int64_t k) {
  if (a >= 1.0) return static_cast<double>(k + 1);
  return (1.0 - std::pow(a, static_cast<double>(k + 1))) / (1.0 - a);
}

int64_t best_k(double a, double draft_pass, const std::vector<double>& target_pass,
               int64_t max_k) {
  int64_t best = 0;
  double best_rate = -1.0;
  for (int64_t k = 0; k <= max_k && k < static_cast<int64_t>(target_pass.size()); ++k) {
    const double cost = static_cast<double>(k) * draft_pass + target_pass[static_cast<size_t>(k)];
    const double rate = expected_tokens(a, k) / std::max(cost, 1e-12);
    if (rate > best_rate * (1.0 + 1e-9)) {
      best_rate = rate;
      best = k;
    }
  }
  return best;
}

namespace {
// The table size, validated before anything is allocated.
size_t cost_table_size(int64_t max_tokens_per_row) {
  if (max_tokens_per_row > kMaxTokensPerRow) {
    throw InvalidArgumentError("CostModel: max_tokens_per_row must be <= " +
                               std::to_string(kMaxTokensPerRow) + ", got " +
                               std::to_string(max_tokens_per_row));
  }
  return static_cast<size_t>(std::max<int64_t>(max_tokens_per_row, 1));
}
}  // namespace

CostModel::CostModel(int64_t max_tokens_per_row)
    : target_(cost_table_size(max_tokens_per_row), 0.0), seen_(target_.size(), false) {}

void CostModel::observe_draft(double s) {
  draft_ = draft_seen_ ? (1 - kWeight) * draft_ + kWeight * s : s;
  draft_seen_ = true;
}

void CostModel::observe_target(int64_t n, double s) {
  if (n < 1 || n > static_cast<int64_t>(target_.size())) return;
  const size_t i = static_cast<size_t>(n - 1);
  target_[i] = seen_[i] ? (1 - kWeight) * target_[i] + kWeight * s : s;
  seen_[i] = true;
}

std::vector<double> CostModel::target_passes() const {
  // Least-squares line through the measured sizes; with one point use the prior slope.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int64_t m = 0;
  for (size_t i = 0; i < target_.size(); ++i) {
    if (!seen_[i]) continue;
    const double x = static_cast<double>(i + 1), y = target_[i];
    sx += x; sy += y; sxx += x * x; sxy += x * y; ++m;
  }
  std::vector<double> out(target_.size(), 1.0);
  if (m == 0) {  // nothing measured: the prior shape, in arbitrary units
    for (size_t i = 0; i < out.size(); ++i) out[i] = 1.0 + kPriorSlope * static_cast<double>(i);
    return out;
  }
  double slope, intercept;
  const double det = static_cast<double>(m) * sxx - sx * sx;
  if (m >= 2 && det > 0) {
    slope = (static_cast<double>(m) * sxy - sx * sy) / det;
    intercept = (sy - slope * sx) / static_cast<double>(m);
  } else {  // one size seen: scale the prior through it
    const double x = sx / static_cast<double>(m), y = sy / static_cast<double>(m);
    const double unit = y / (1.0 + kPriorSlope * (x - 1.0));
    slope = kPriorSlope * unit;
    intercept = unit - slope;
  }
  if (slope < 0) {  // a longer pass never costs less: flat at the mean
    slope = 0;
    intercept = sy / static_cast<double>(m);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = seen_[i] ? target_[i] : std::max(intercept + slope * static_cast<double>(i + 1), 1e-9);
    // A pass with more tokens never costs less. Without this, one noisy measurement
    // (a 2-token pass timed below the 1-token one) makes k = 1 look free forever: the
    // 1-token pass is then never run again, so never re-measured.
    if (i > 0) out[i] = std::max(out[i], out[i - 1]);
  }
  return out;
}

int64_t probe_interval(double draft_pass, const std::vector<double>& target_pass) {
  if (target_pass.size() < 2 || !(target_pass[0] > 0)) return kMinProbeInterval;
  const double probe_cost = draft_pass + std::max(target_pass[1] - target_pass[0], 0.0);
  const double steps = std::ceil(probe_cost / (kProbeBudget * target_pass[0]));
  return std::max<int64_t>(kMinProbeInterval, static_cast<int64_t>(std::min(steps, 1e6)));
}

void AcceptanceTracker::update(int64_t proposed, int64_t accepted) {
  if (proposed <= 0) return;
  // Trials: every accepted position, plus the rejected one if there was a rejection.
  const int64_t n = std::min(proposed, accepted + 1);
  for (int64_t t = 0; t < n; ++t) {
    successes = kDecay * successes + (t < accepted ? 1.0 : 0.0);
    trials = kDecay * trials + 1.0;
  }
  rate = (successes + 1.0) / (trials + 2.0);
}

}  // namespace verispec
