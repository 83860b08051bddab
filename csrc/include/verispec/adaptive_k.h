// Adaptive speculation length: the cost model and the choice of k (one place).
//
// With per-position acceptance rate a, a row with k proposals emits on average
//   E(a, k) = (1 - a^(k+1)) / (1 - a)            (= k + 1 when a = 1).
// A step runs K = max_b k_b draft passes (pass j carries the rows with k_b > j) and ONE
// target pass carrying T tokens: every row's uncached tokens (1 for a decoding row) plus
// its k_b proposals, plus other sequences' prefill chunks. Its time is
//   step(k_1..k_B) = K * draft_pass + target_pass(T).
// k is chosen per row to maximise the BATCH's tokens per second,
//   sum_b E(a_b, k_b) / step(k_1..k_B),
// by coordinate ascent (best_batch_k): for row b, the other rows fixed (their expected
// tokens E_rest, largest k K_rest, tokens T_rest), the k in [0, cap_b] maximising
//   (E_rest + E(a_b, k)) / (max(K_rest, k) * draft_pass + target_pass(T_rest + k + 1)).
// For one row this is the classic rule (best_k). At a small batch the target pass is
// memory-bound (flat in T) and a proposal costs little; at a large batch it is
// compute-bound (linear in T) and every proposal slows every row, so k falls toward 0.
// k = 0 is plain decoding and wins whenever speculation does not pay.
//
// Simplifications, on purpose: the draft pass cost is one number (draft models are small
// and memory-bound; it is the mean of the steady passes, one token per row); the target
// pass cost depends on T only, not on the rows' context lengths.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace verispec {

// Expected tokens emitted by one verify step with k proposals at acceptance a.
double expected_tokens(double a, int64_t k);

// The one-row rule inside a batch: argmax over k in [0, max_k] of
//   (rest_expected + E(a, k)) / (max(rest_k, k) * draft_pass + target_pass[k]),
// where target_pass[k] is the cost of the step's target pass when this row carries k + 1
// tokens (the rest's tokens included); k stops at target_pass.size() - 1. Ties go to the
// smaller k.
int64_t best_k_in_batch(double a, double rest_expected, int64_t rest_k, double draft_pass,
                        const std::vector<double>& target_pass, int64_t max_k);
// A row alone: best_k_in_batch(a, 0, 0, draft_pass, target_pass, max_k); target_pass[n - 1]
// is the cost of a pass with n tokens.
int64_t best_k(double a, double draft_pass, const std::vector<double>& target_pass,
               int64_t max_k);

// Online measurements: an exponentially weighted average of the draft pass cost, and of
// the target pass cost by the pass's TOTAL tokens T, in buckets (exact T up to 16, then
// four per octave; each keeps the average T and seconds it saw). The target cost is a fit
// through the buckets, a flat memory-bound part then linear compute-bound growth:
//   target_pass(T) = flat + slope * max(0, T - knee),   slope >= 0,
// by least squares on relative errors (each bucket weighted 1 / seconds^2: decode passes
// of tens of ms and prompt passes of seconds are fitted alike) with the knee at one of the
// measured T (the best of each; the flat part > 0). Nothing
// measured: the prior 1 + 0.2 (T - 1) in arbitrary units (a 5-token pass costing 1.8x a
// 1-token pass, as measured for SmolLM2 on CPU); one bucket: that prior scaled through it;
// a fit that falls (noise) is flat at the mean, so a longer pass never costs less.
class CostModel {
 public:
  CostModel();
  void observe_draft(double seconds_per_pass);
  // A target pass of `tokens` total tokens took `seconds` (tokens < 1: ignored).
  void observe_target(int64_t tokens, double seconds);
  bool has_draft() const { return draft_seen_; }
  double draft_pass() const { return draft_; }
  // The fitted cost of a target pass with `tokens` tokens.
  double target_pass(int64_t tokens) const;
  // target_pass(first), target_pass(first + 1), ..., n values.
  std::vector<double> target_passes(int64_t first, int64_t n) const;
  // The fit: flat, knee, slope.
  double flat() const { return flat_; }
  double knee() const { return knee_; }
  double slope() const { return slope_; }
  // The measured buckets, by T: (average tokens, seconds).
  std::vector<std::pair<double, double>> measured() const;

 private:
  static constexpr double kWeight = 0.2;      // EWMA weight of a new measurement
  static constexpr double kPriorSlope = 0.2;  // relative cost per extra token
  static constexpr int kExact = 16;           // buckets of one T each: 1..16
  static constexpr int kPerOctave = 4;        // then four per octave
  static constexpr int kBuckets = kExact + kPerOctave * 48;
  void fit();
  double draft_ = 0.0;
  bool draft_seen_ = false;
  std::vector<double> tokens_, seconds_;  // per bucket, EWMA
  std::vector<bool> seen_;
  double flat_ = 1.0, knee_ = 1.0, slope_ = kPriorSlope;
};

// The batch rule (see the top of this file). Rows i = 0..n-1 have acceptance a[i] and may
// propose at most cap[i]; `rest` describes what else is in the step: rows whose k is
// decided elsewhere (their expected tokens and largest k) and every target token not
// counted as a row's k + 1 (prefill chunks, a row's uncached tokens beyond its last).
// Returns k per row; two sweeps of coordinate ascent from k = 0.
struct BatchRest {
  double expected = 0.0;
  int64_t k = 0;
  int64_t tokens = 0;
};
std::vector<int64_t> best_batch_k(const std::vector<double>& a, const std::vector<int64_t>& cap,
                                  double draft_pass, const CostModel& cost, const BatchRest& rest);

// Draft trees under adaptive k (spec_decoder.h "Draft trees"): a row's chain depth d is
// chosen as a chain's (best_batch_k on the spine's acceptance a, the node budget as its
// cap); the row becomes a tree of depth d' = min(d, budget / f) (f children a level)
// only if its siblings' acceptance pays for the extra verify rows and the lost depth.
// With s the chance that a sibling is accepted where the spine node was rejected (a
// sibling has no children: the path ends there), a tree of depth d' emits
//   expected_tree_tokens(a, s, d') = expected_tokens(a, d') + (1 - a) s sum_{j<d'} a^j.
double expected_tree_tokens(double a, double s, int64_t depth);
// Whether the row's tree of depth tree_depth beats its chain of chain_depth in the step's
// rate: (expected - E(a, chain_depth) + E_tree(a, s, tree_depth)) / (draft_tree +
// target_tree) against expected / (draft_chain + target_chain) (expected: the step's
// expected tokens with the row a chain; draft_*, target_*: the step's draft passes and
// target pass with the row as a chain / tree).
bool tree_pays(double a, double s, int64_t chain_depth, int64_t tree_depth, double expected,
               double draft_chain, double draft_tree, double target_chain, double target_tree);
// n-gram tries under adaptive k (spec_decoder.h "Trees"). The lookup's earlier
// occurrences of the matched suffix say how the text went on there: a node's share f of
// the continuations through its parent (NGramIndex::propose_tree's freqs). A row's
// trackers measure a, how often the target follows the continuations where they all
// agree (levels with f = 1), and r, how often it takes the most recent continuation's
// token where they disagree (a language model often repeats the latest occurrence).
// Given the target follows the continuations at a node (chance a), it takes child x with
// chance w(x) (trie_node_weights): 1 where they agree; where they disagree, r for the
// most recent continuation's child, (1 - r) f(x) / (1 - f_recent) for the others, f(x)
// below a node off the most recent path. Node i is on the accepted path with chance
// P(i) = P(parent) a w(i) (P(root) = 1), and the first m nodes (best-first order: a
// trie; a chain: parents i - 1) emit 1 + sum_{i < m} P(i) tokens in expectation:
// expected[m - 1], m = 1..n.
std::vector<double> expected_trie_tokens(double a, const std::vector<int32_t>& parents,
                                         const std::vector<double>& weights);
// w(i) for a trie's nodes (tokens, parents, freqs) given the most recent continuation
// (chain, with its shares chain_freqs); *recent (if given) gets whether each node is on
// that continuation.
std::vector<double> trie_node_weights(double r, const std::vector<int32_t>& tokens,
                                      const std::vector<int32_t>& parents,
                                      const std::vector<double>& freqs,
                                      const std::vector<int32_t>& chain,
                                      const std::vector<double>& chain_freqs,
                                      std::vector<bool>* recent = nullptr);
// A share this close to 1 is a level where the continuations agree.
constexpr double kAgreedShare = 1.0 - 1e-9;
// s is only measured where trees are proposed: a row whose sibling tracker holds fewer
// than kTreeExploreTrials (discounted) trials proposes the tree whatever tree_pays says
// in its first kTreeExploreSteps tree steps, so that a draft whose siblings would pay is
// not judged on the prior alone (a draft whose spine is rarely rejected gives few
// sibling trials: past those steps the prior judges). It explores only where the tree
// would pay with s = 1 (every rejected spine node's sibling accepted): a draft whose
// spine is accepted so often that even then the lost depth and the extra rows cost more
// (a close draft) spends no steps measuring siblings that cannot pay.
constexpr double kTreeExploreTrials = 4.0;
constexpr int64_t kTreeExploreSteps = 4;

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
  // A new sequence's start: the population's rate (every sequence's trials, by the same
  // rule) as the evidence of at most kPopulationTrials trials, so a server whose drafts
  // rarely agree does not start each request at 0.5 and spend its first steps learning
  // what the others showed (a population that saw nothing: the uniform prior).
  static constexpr double kPopulationTrials = 8.0;
  static AcceptanceTracker seeded_by(const AcceptanceTracker& population);
};

// While k = 0, a probe (one step at k = 1) now and then notices a draft that starts
// agreeing. A probe costs what a k = 1 step costs beyond a plain step. In a batch of
// `rows` rows that each probe every N plain steps, rows / N probes land in an average
// step, so probing every
//   N = max(kMinProbeInterval, ceil(rows * probe_cost / (kProbeBudget * plain_step)))
// steps spends at most kProbeBudget of the plain decoding time on probes, whatever the
// draft costs and however many rows share the step. target_pass = {the step's target
// pass with the row at 1 token, at 2 tokens} (in a batch: the other rows' tokens
// included); plain_step = target_pass[0].
constexpr double kProbeBudget = 0.01;
constexpr int64_t kMinProbeInterval = 8;
int64_t probe_interval(double draft_pass, const std::vector<double>& target_pass,
                       int64_t rows = 1);

}  // namespace verispec
