#include "verispec/adaptive_k.h"

#include <algorithm>
#include <cmath>

namespace verispec {

double expected_tokens(double a, int64_t k) {
  if (a >= 1.0) return static_cast<double>(k + 1);
  return (1.0 - std::pow(a, static_cast<double>(k + 1))) / (1.0 - a);
}

double expected_tree_tokens(double a, double s, int64_t depth) {
  const double levels = a >= 1.0 ? static_cast<double>(depth)
                                 : (1.0 - std::pow(a, static_cast<double>(depth))) / (1.0 - a);
  return expected_tokens(a, depth) + (1.0 - std::min(a, 1.0)) * std::max(s, 0.0) * levels;
}

std::vector<double> expected_trie_tokens(double a, const std::vector<int32_t>& parents,
                                         const std::vector<double>& weights) {
  const double ac = std::min(std::max(a, 0.0), 1.0);
  const size_t n = std::min(parents.size(), weights.size());
  std::vector<double> reach(n), out(n);
  double sum = 1.0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t p = parents[i];
    const double above = p < 0 ? 1.0 : reach[static_cast<size_t>(p)];
    reach[i] = above * ac * std::min(std::max(weights[i], 0.0), 1.0);
    sum += reach[i];
    out[i] = sum;
  }
  return out;
}

std::vector<double> trie_node_weights(double r, const std::vector<int32_t>& tokens,
                                      const std::vector<int32_t>& parents,
                                      const std::vector<double>& freqs,
                                      const std::vector<int32_t>& chain,
                                      const std::vector<double>& chain_freqs,
                                      std::vector<bool>* recent) {
  const double rc = std::min(std::max(r, 0.0), 1.0);
  const size_t n = std::min({tokens.size(), parents.size(), freqs.size()});
  std::vector<double> w(n);
  std::vector<bool> on(n, false);
  std::vector<int64_t> depth(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t p = parents[i];
    depth[i] = p < 0 ? 0 : depth[static_cast<size_t>(p)] + 1;
    const bool parent_on = p < 0 || on[static_cast<size_t>(p)];
    const size_t d = static_cast<size_t>(depth[i]);
    const bool has_recent = parent_on && d < chain.size() && d < chain_freqs.size();
    on[i] = has_recent && tokens[i] == chain[d];
    const double f = freqs[i];
    if (f >= kAgreedShare) {
      w[i] = 1.0;
    } else if (on[i]) {
      w[i] = rc;
    } else if (has_recent && chain_freqs[d] < 1.0) {
      w[i] = (1.0 - rc) * f / (1.0 - chain_freqs[d]);
    } else {
      w[i] = f;
    }
  }
  if (recent != nullptr) *recent = std::move(on);
  return w;
}

bool tree_pays(double a, double s, int64_t chain_depth, int64_t tree_depth, double expected,
               double draft_chain, double draft_tree, double target_chain, double target_tree) {
  if (tree_depth < 1) return false;
  const double with_tree =
      expected - expected_tokens(a, chain_depth) + expected_tree_tokens(a, s, tree_depth);
  return with_tree * (draft_chain + target_chain) > expected * (draft_tree + target_tree);
}

int64_t best_k_in_batch(double a, double rest_expected, int64_t rest_k, double draft_pass,
                        const std::vector<double>& target_pass, int64_t max_k) {
  int64_t best = 0;
  double best_rate = -1.0;
  for (int64_t k = 0; k <= max_k && k < static_cast<int64_t>(target_pass.size()); ++k) {
    const double cost = static_cast<double>(std::max(rest_k, k)) * draft_pass +
                        target_pass[static_cast<size_t>(k)];
    const double rate = (rest_expected + expected_tokens(a, k)) / std::max(cost, 1e-12);
    if (rate > best_rate * (1.0 + 1e-9)) {
      best_rate = rate;
      best = k;
    }
  }
  return best;
}

int64_t best_k(double a, double draft_pass, const std::vector<double>& target_pass,
               int64_t max_k) {
  return best_k_in_batch(a, 0.0, 0, draft_pass, target_pass, max_k);
}

// ---- the cost model ---------------------------------------------------------------

CostModel::CostModel()
    : tokens_(kBuckets, 0.0), seconds_(kBuckets, 0.0), seen_(kBuckets, false) {
  fit();
}

void CostModel::observe_draft(double s) {
  draft_ = draft_seen_ ? (1 - kWeight) * draft_ + kWeight * s : s;
  draft_seen_ = true;
}

void CostModel::observe_target(int64_t tokens, double s) {
  if (tokens < 1) return;
  int bucket;
  if (tokens <= kExact) {
    bucket = static_cast<int>(tokens - 1);
  } else {
    const double octaves = std::log2(static_cast<double>(tokens) / kExact);
    bucket = kExact + std::min(kBuckets - 1 - kExact, static_cast<int>(octaves * kPerOctave));
  }
  const size_t i = static_cast<size_t>(bucket);
  const double t = static_cast<double>(tokens);
  if (seen_[i]) {
    tokens_[i] = (1 - kWeight) * tokens_[i] + kWeight * t;
    seconds_[i] = (1 - kWeight) * seconds_[i] + kWeight * s;
  } else {
    tokens_[i] = t;
    seconds_[i] = s;
    seen_[i] = true;
  }
  fit();
}

void CostModel::fit() {
  std::vector<double> x, y;
  for (size_t i = 0; i < seen_.size(); ++i) {
    if (!seen_[i]) continue;
    x.push_back(tokens_[i]);  // buckets are in increasing T
    y.push_back(seconds_[i]);
  }
  const size_t m = x.size();
  if (m == 0) {  // the prior shape, in arbitrary units
    flat_ = 1.0, knee_ = 1.0, slope_ = kPriorSlope;
    return;
  }
  if (m == 1) {  // the prior scaled through the one bucket
    const double unit = y[0] / (1.0 + kPriorSlope * (x[0] - 1.0));
    flat_ = unit, knee_ = 1.0, slope_ = kPriorSlope * unit;
    return;
  }
  // Least squares on RELATIVE errors (weights 1 / y^2): the decisions compare passes of
  // nearby sizes, and a batch's measured sizes span from a few decode rows (tens of ms)
  // to whole prompts (seconds). Unweighted, the long passes decide the line and the
  // fitted cost of the decode sizes can be off by 2x or below zero.
  std::vector<double> w(m);
  for (size_t i = 0; i < m; ++i) w[i] = 1.0 / std::max(y[i] * y[i], 1e-300);
  double mean = 0;
  for (double v : y) mean += v;
  mean /= static_cast<double>(m);
  // Candidate: flat at the mean (no growth measured, or a falling fit).
  double best_sse = 0;
  for (size_t i = 0; i < m; ++i) best_sse += w[i] * (y[i] - mean) * (y[i] - mean);
  flat_ = mean, knee_ = x[0], slope_ = 0.0;
  for (size_t j = 0; j + 1 < m; ++j) {  // knee at x[j]: y = f + s * max(0, x - x[j])
    double sw = 0, su = 0, sy = 0, suu = 0, suy = 0;
    for (size_t i = 0; i < m; ++i) {
      const double u = std::max(0.0, x[i] - x[j]);
      sw += w[i], su += w[i] * u, sy += w[i] * y[i], suu += w[i] * u * u, suy += w[i] * u * y[i];
    }
    const double det = sw * suu - su * su;
    if (!(det > 0)) continue;
    const double s = (sw * suy - su * sy) / det;
    if (!(s > 0)) continue;  // a falling or flat fit: the flat candidate covers it
    const double f = (sy - s * su) / sw;
    if (!(f > 0)) continue;  // a pass costs something
    double sse = 0;
    for (size_t i = 0; i < m; ++i) {
      const double r = y[i] - f - s * std::max(0.0, x[i] - x[j]);
      sse += w[i] * r * r;
    }
    if (sse < best_sse * (1.0 - 1e-12)) {
      best_sse = sse;
      flat_ = f, knee_ = x[j], slope_ = s;
    }
  }
}

double CostModel::target_pass(int64_t tokens) const {
  return std::max(flat_ + slope_ * std::max(0.0, static_cast<double>(tokens) - knee_), 1e-12);
}

std::vector<double> CostModel::target_passes(int64_t first, int64_t n) const {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = target_pass(first + static_cast<int64_t>(i));
  return out;
}

std::vector<std::pair<double, double>> CostModel::measured() const {
  std::vector<std::pair<double, double>> out;
  for (size_t i = 0; i < seen_.size(); ++i) {
    if (seen_[i]) out.emplace_back(tokens_[i], seconds_[i]);
  }
  return out;
}

// ---- the batch rule ---------------------------------------------------------------

std::vector<int64_t> best_batch_k(const std::vector<double>& a, const std::vector<int64_t>& cap,
                                  double draft_pass, const CostModel& cost, const BatchRest& rest) {
  const size_t n = std::min(a.size(), cap.size());
  std::vector<int64_t> k(n, 0);
  if (n == 0) return k;
  // Running totals over the rows: expected tokens, tokens, and how many rows hold each k
  // (so the largest k of the others is found without a scan of the rows).
  int64_t max_cap = 0;
  for (size_t i = 0; i < n; ++i) max_cap = std::max(max_cap, cap[i]);
  std::vector<int64_t> holding(static_cast<size_t>(max_cap) + 1, 0);
  holding[0] = static_cast<int64_t>(n);
  double expected = 0;
  for (size_t i = 0; i < n; ++i) expected += expected_tokens(a[i], 0);
  int64_t tokens = static_cast<int64_t>(n);
  std::vector<double> target;
  for (int sweep = 0; sweep < 2; ++sweep) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t ki = k[i];
      const int64_t c = std::max<int64_t>(cap[i], 0);
      if (c == 0) continue;
      holding[static_cast<size_t>(ki)] -= 1;
      int64_t others_k = 0;
      for (int64_t v = max_cap; v > 0; --v) {
        if (holding[static_cast<size_t>(v)] > 0) {
          others_k = v;
          break;
        }
      }
      const double e_rest = rest.expected + expected - expected_tokens(a[i], ki);
      const int64_t t_rest = rest.tokens + tokens - (ki + 1);
      target = cost.target_passes(t_rest + 1, c + 1);
      const int64_t best = best_k_in_batch(a[i], e_rest, std::max(rest.k, others_k), draft_pass,
                                           target, c);
      expected += expected_tokens(a[i], best) - expected_tokens(a[i], ki);
      tokens += best - ki;
      k[i] = best;
      holding[static_cast<size_t>(best)] += 1;
    }
  }
  return k;
}

// ---- probes and acceptance --------------------------------------------------------

int64_t probe_interval(double draft_pass, const std::vector<double>& target_pass,
                       int64_t rows) {
  if (target_pass.size() < 2 || !(target_pass[0] > 0)) return kMinProbeInterval;
  const double probe_cost = draft_pass + std::max(target_pass[1] - target_pass[0], 0.0);
  const double n = static_cast<double>(std::max<int64_t>(rows, 1));
  const double steps = std::ceil(n * probe_cost / (kProbeBudget * target_pass[0]));
  return std::max<int64_t>(kMinProbeInterval, static_cast<int64_t>(std::min(steps, 1e6)));
}

AcceptanceTracker AcceptanceTracker::seeded_by(const AcceptanceTracker& population) {
  AcceptanceTracker t;
  if (!(population.trials > 0)) return t;
  const double w = std::min(population.trials, kPopulationTrials);
  t.trials = w;
  t.successes = w * population.successes / population.trials;
  t.rate = (t.successes + 1.0) / (t.trials + 2.0);
  return t;
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
