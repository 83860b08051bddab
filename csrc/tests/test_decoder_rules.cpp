// Native test of the decoder's rules outside the decoder class, run under AddressSanitizer
// + UBSan in CI: the n-gram index (ngram.h), the stop rules (apply_stop_rules) and
// adaptive k's cost model (adaptive_k.h). Expected values are worked out by hand in the
// comments or by an independent brute force of the documented rule, never by the code
// under test.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "native_check.h"
#include "ngram_reference.h"
#include "verispec/adaptive_k.h"
#include "verispec/errors.h"
#include "verispec/ngram.h"
#include "verispec/spec_decoder.h"

namespace {

using verispec::FinishReason;
using verispec::InvalidArgumentError;
using verispec::NGramIndex;
using Tokens = std::vector<int32_t>;

using native_check::error_of;
using native_check::has;

using verispec_test::brute_propose;

NGramIndex index_of(const Tokens& t, int64_t min_n, int64_t max_n) {
  NGramIndex g(min_n, max_n);
  g.extend(t.data(), static_cast<int64_t>(t.size()));
  return g;
}

void test_ngram_validation() {
  CHECK(has(error_of<InvalidArgumentError>([] { NGramIndex(0, 3); }), "min_n = 0"));
  CHECK(has(error_of<InvalidArgumentError>([] { NGramIndex(-1, 3); }), "min_n = -1"));
  CHECK(has(error_of<InvalidArgumentError>([] { NGramIndex(3, 2); }), "max_n = 2"));
  CHECK(has(error_of<InvalidArgumentError>([] { NGramIndex(1, 65); }), "max_n = 65"));
  CHECK(error_of<InvalidArgumentError>([] { NGramIndex(64, 64); }) == "<none>");
  NGramIndex g(2, 2);
  CHECK(g.min_n() == 2 && g.max_n() == 2);
  // extend: a negative count or a null pointer with tokens to read is an error that
  // names the argument, and changes nothing.
  g.extend(nullptr, 0);  // nothing to read: fine
  const std::string neg = error_of<InvalidArgumentError>([&] { g.extend(nullptr, -2); });
  CHECK(has(neg, "n must be >= 0") && has(neg, "-2"));
  CHECK(has(error_of<InvalidArgumentError>([&] { g.extend(nullptr, 3); }), "tokens"));
  CHECK(g.length() == 0);
}

void test_ngram_propose() {
  int64_t m = -1;
  NGramIndex empty(1, 3);
  CHECK(empty.propose(4, &m).empty() && m == 0);
  NGramIndex one = index_of({7}, 1, 3);  // a single token has no earlier occurrence
  CHECK(one.propose(4, &m).empty() && m == 0);
  // 1 2 3 4 1 2 3: the suffix 1 2 3 ends earlier at e = 2 -> tokens[3..] = 4 1 2 3.
  NGramIndex g = index_of({1, 2, 3, 4, 1, 2, 3}, 1, 3);
  CHECK(g.propose(2, &m) == Tokens({4, 1}) && m == 3);
  CHECK(g.propose(10, &m) == Tokens({4, 1, 2, 3}) && m == 3);  // stops at the end
  m = -1;
  CHECK(g.propose(0, &m).empty() && m == 0);
  CHECK(g.propose(-5).empty());
  // The most recent occurrence wins: 5 9 5 7 5, key 5 ends at 0 and 2 -> after 2: 7 5.
  CHECK(index_of({5, 9, 5, 7, 5}, 1, 1).propose(3, &m) == Tokens({7, 5}) && m == 1);
  // Longest n first, then shorter: 1 2 8 2 has no earlier "8 2", but "2" at e = 1.
  CHECK(index_of({1, 2, 8, 2}, 1, 2).propose(5, &m) == Tokens({8, 2}) && m == 1);
  CHECK(index_of({1, 2, 8, 2}, 2, 2).propose(5, &m).empty() && m == 0);
  // 2 1 2 3 1 2 3 (min_n = 2): the suffix "1 2 3" (n = 3) ends earlier at e = 3 -> 1 2.
  CHECK(index_of({2, 1, 2, 3, 1, 2, 3}, 2, 3).propose(2, &m) == Tokens({1, 2}) && m == 3);
}

void test_ngram_propose_tree() {
  int64_t m = -1;
  std::vector<int32_t> parents;
  // "1 2" was followed by 3 5 1 2 (latest), 4 1 2 3, and 3 1 2 4: the 3-branch counts 2.
  NGramIndex g = index_of({1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2}, 1, 3);
  CHECK(g.propose_tree(6, 2, &parents, &m) == Tokens({3, 5, 1, 2, 4, 1}) && m == 2);
  CHECK(parents == std::vector<int32_t>({-1, 0, 1, 2, -1, 4}));
  CHECK(g.propose_tree(3, 2, &parents) == Tokens({3, 5, 1}));  // the first k: still a tree
  CHECK(g.propose_tree(6, 1, &parents) == Tokens({3, 5, 1, 2}));  // one child per node
  CHECK(parents == std::vector<int32_t>({-1, 0, 1, 2}));
  // one occurrence: the chain propose() gives
  NGramIndex one = index_of({4, 5, 6, 7, 4}, 1, 2);
  CHECK(one.propose_tree(3, 3, &parents, &m) == one.propose(3) && m == 1);
  CHECK(parents == std::vector<int32_t>({-1, 0, 1}));
  CHECK(one.propose_tree(0, 3, &parents).empty() && parents.empty());
  CHECK(index_of({7}, 1, 3).propose_tree(4, 2, &parents, &m).empty() && m == 0);
  CHECK(has(error_of<InvalidArgumentError>([&] { one.propose_tree(3, 0, &parents); }), "branches"));
  CHECK(has(error_of<InvalidArgumentError>([&] { one.propose_tree(3, 2, nullptr); }), "parents"));
}

void test_ngram_rollback() {
  NGramIndex g = index_of({1, 2, 3, 4, 1, 2, 3}, 1, 3);
  int64_t m = -1;
  g.rollback(5);  // 1 2 3 4 1: only "1" recurs (e = 0) -> 2 3 4
  CHECK(g.length() == 5 && g.tokens() == Tokens({1, 2, 3, 4, 1}));
  CHECK(g.propose(3, &m) == Tokens({2, 3, 4}) && m == 1);
  const int32_t more[2] = {7, 7};
  g.extend(more, 2);  // 1 2 3 4 1 7 7: "7" at e = 5 -> 7
  CHECK(g.propose(3, &m) == Tokens({7}) && m == 1);
  // Rolling back past the length, or below 0, is an error naming the range; no change.
  const std::string past = error_of<InvalidArgumentError>([&] { g.rollback(8); });
  CHECK(has(past, "[0, 7]") && has(past, "got 8"));
  CHECK(has(error_of<InvalidArgumentError>([&] { g.rollback(-1); }), "got -1"));
  CHECK(g.length() == 7);
  g.rollback(7);  // to the current length: a no-op
  CHECK(g.propose(3, &m) == Tokens({7}));
  g.rollback(0);
  CHECK(g.length() == 0 && g.propose(3, &m).empty() && m == 0);
  // The dropped n-grams are gone: rebuilt, the index answers as a fresh one would.
  const Tokens t = {1, 2, 3, 4, 1, 2, 3};
  g.extend(t.data(), 7);
  CHECK(g.propose(10, &m) == Tokens({4, 1, 2, 3}) && m == 3);
}

// Random extends and rollbacks over a 3-token alphabet (many matches, and rollbacks
// through them), each proposal and the token history compared with the brute force.
void test_ngram_random(uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t min_n = 1 + rng() % 3, max_n = min_n + rng() % 4;
  NGramIndex g(min_n, max_n);
  Tokens ref;
  for (int step = 0; step < 600; ++step) {
    if (rng() % 4 == 0 && !ref.empty()) {
      const int64_t keep = static_cast<int64_t>(rng() % (ref.size() + 1));
      g.rollback(keep);
      ref.resize(static_cast<size_t>(keep));
    } else {
      Tokens add(rng() % 6);
      for (auto& t : add) t = static_cast<int32_t>(rng() % 3);
      g.extend(add.data(), static_cast<int64_t>(add.size()));
      ref.insert(ref.end(), add.begin(), add.end());
    }
    const int64_t k = rng() % 7;
    int64_t m = -1, bm = -1;
    const Tokens p = g.propose(k, &m);
    CHECK(g.tokens() == ref);
    CHECK(p == brute_propose(ref, min_n, max_n, k, &bm) && m == bm);
    CHECK(static_cast<int64_t>(p.size()) <= k);
  }
}

void test_ngram_long() {
  // 20000 tokens of period 7 (i % 7): the suffix of 4 ends again 7 earlier, so the
  // proposal is the next period: tokens[len - 7 + j] = (len + j) % 7.
  Tokens t(20000);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i % 7);
  NGramIndex g = index_of(t, 1, 4);
  const int64_t len = 20000;
  int64_t m = -1;
  Tokens want;
  for (int64_t j = 0; j < 5; ++j) want.push_back(static_cast<int32_t>((len + j) % 7));
  CHECK(g.propose(5, &m) == want && m == 4);
  // An absurd k proposes what there is: the 7 tokens after the match, never more.
  CHECK(g.propose(std::numeric_limits<int64_t>::max(), &m).size() == 7 && m == 4);
  CHECK(g.propose(int64_t{1} << 40).size() == 7);
  g.rollback(3);  // 0 1 2: no repeat at all
  CHECK(g.propose(5, &m).empty() && m == 0);
}

struct Stop {
  int64_t keep;
  FinishReason reason;
};

Stop stop(const Tokens& tokens, const Tokens& generated = {}, int64_t max_new = 100,
          const Tokens& eos = {}, const std::vector<Tokens>& seqs = {}, int64_t prompt_len = 3,
          int64_t max_context = 1000) {
  verispec::StopParams st;
  st.max_new_tokens = max_new;
  st.eos_ids = eos;
  st.stop_sequences = seqs;
  FinishReason r = FinishReason::kAborted;  // must be overwritten
  const int64_t keep = verispec::apply_stop_rules(st, generated, tokens.data(),
                                                  static_cast<int64_t>(tokens.size()),
                                                  prompt_len, max_context, &r);
  return {keep, r};
}

bool is(Stop s, int64_t keep, FinishReason r) { return s.keep == keep && s.reason == r; }

void test_stop_rules() {
  CHECK(is(stop({5, 6, 7}), 3, FinishReason::kNone));
  CHECK(is(stop({}), 0, FinishReason::kNone));  // n = 0
  // EOS is kept as the last token, everything after it dropped; the first one counts.
  CHECK(is(stop({5, 2, 7, 2}, {}, 100, {9, 2}), 2, FinishReason::kEos));
  CHECK(is(stop({9, 2}, {}, 100, {9, 2}), 1, FinishReason::kEos));
  CHECK(is(stop({5, 6, 9}, {}, 100, {9}), 3, FinishReason::kEos));
  // Stop sequences: 3 | 4 8 straddles the step boundary (kept through 8: 2 tokens) ...
  CHECK(is(stop({4, 8, 1}, {1, 2, 3}, 100, {}, {{3, 4, 8}}), 2, FinishReason::kStop));
  // ... two of its tokens generated before, one new ...
  CHECK(is(stop({4, 5}, {1, 2, 3}, 100, {}, {{2, 3, 4}}), 1, FinishReason::kStop));
  // ... all new; the earliest completion among several sequences wins ...
  CHECK(is(stop({7, 4, 8, 5, 6}, {}, 100, {}, {{5, 6}, {4, 8}}), 3, FinishReason::kStop));
  // ... not when the generated part does not match, nor for the empty sequence ...
  CHECK(is(stop({4, 8, 1}, {1, 2}, 100, {}, {{3, 4, 8}}), 3, FinishReason::kNone));
  CHECK(is(stop({1, 2}, {}, 100, {}, {{}}), 2, FinishReason::kNone));
  // ... nor one completed before these tokens (it ended the earlier step).
  CHECK(is(stop({5}, {3, 4, 8}, 100, {}, {{3, 4, 8}}), 1, FinishReason::kNone));
  // A sequence longer than all the tokens there are never matches.
  CHECK(is(stop({1, 1}, {1}, 100, {}, {{1, 1, 1, 1}}), 2, FinishReason::kNone));
  // max_new_tokens cuts exactly: 8 generated, limit 10 -> 2 of 4 kept.
  CHECK(is(stop({1, 2, 3, 4}, Tokens(8, 0), 10), 2, FinishReason::kLength));
  CHECK(is(stop({1}, Tokens(9, 0), 10), 1, FinishReason::kLength));
  CHECK(is(stop({1, 2}, {}, 2), 2, FinishReason::kLength));
  // Already at (or past) the limit: nothing more fits.
  CHECK(is(stop({1, 2}, Tokens(10, 0), 10), 0, FinishReason::kLength));
  CHECK(is(stop({1}, {}, 0), 0, FinishReason::kLength));
  // The context counts the prompt: 5 + 2 generated + 1 = 8 = max_context.
  CHECK(is(stop({1, 2, 3}, {0, 0}, 100, {}, {}, 5, 8), 1, FinishReason::kContext));
  CHECK(is(stop({1, 2, 3, 4}, {}, 100, {}, {}, 5, 8), 3, FinishReason::kContext));
  CHECK(is(stop({1, 2}, {0}, 100, {}, {}, 7, 8), 0, FinishReason::kContext));
  // On the same token, EOS before a stop sequence before the length before the context.
  CHECK(is(stop({1, 9, 2}, {}, 2, {9}, {{1, 9}}), 2, FinishReason::kEos));
  CHECK(is(stop({1, 9, 2}, {}, 2, {}, {{1, 9}}), 2, FinishReason::kStop));
  CHECK(is(stop({1, 9, 2}, {}, 2, {}, {}, 1, 3), 2, FinishReason::kLength));
}

void test_stop_rules_errors() {
  verispec::StopParams st;
  st.max_new_tokens = 10;
  const Tokens gen = {1, 2};
  const int32_t tok[2] = {3, 4};
  FinishReason r = FinishReason::kNone;
  auto call = [&](const int32_t* t, int64_t n, FinishReason* reason) {
    return [&st, &gen, t, n, reason] {
      verispec::apply_stop_rules(st, gen, t, n, 3, 100, reason);
    };
  };
  const std::string neg = error_of<InvalidArgumentError>(call(tok, -3, &r));
  CHECK(has(neg, "apply_stop_rules") && has(neg, "n must be >= 0") && has(neg, "got -3"));
  const std::string null = error_of<InvalidArgumentError>(call(nullptr, 2, &r));
  CHECK(has(null, "tokens must not be null") && has(null, "n = 2"));
  CHECK(has(error_of<InvalidArgumentError>(call(tok, 2, nullptr)), "reason must not be null"));
  CHECK(error_of<InvalidArgumentError>(call(nullptr, 0, &r)) == "<none>");  // nothing to read
}

void test_expected_tokens_and_best_k() {
  // E(k) = 1 + a + ... + a^k: a = 0.5, k = 3 -> 1.875; a = 0 -> 1; a = 1 -> k + 1.
  CHECK_NEAR(verispec::expected_tokens(0.5, 3), 1.875, 1e-12);
  CHECK_NEAR(verispec::expected_tokens(0.9, 2), 1.0 + 0.9 + 0.81, 1e-12);
  CHECK_NEAR(verispec::expected_tokens(0.0, 5), 1.0, 0.0);
  CHECK_NEAR(verispec::expected_tokens(1.0, 4), 5.0, 0.0);
  CHECK_NEAR(verispec::expected_tokens(0.7, 0), 1.0, 1e-12);  // k = 0: the one target token
  std::vector<double> target;  // target[n - 1] = 1 + 0.2 (n - 1): the prior shape
  for (int i = 0; i < 9; ++i) target.push_back(1.0 + 0.2 * i);
  // a = 0: E = 1 whatever k, costs grow -> k = 0; a = 1 with a free draft: E / cost =
  // (k + 1) / (1 + 0.2 k) grows with k -> max_k.
  CHECK(verispec::best_k(0.0, 0.1, target, 8) == 0);
  CHECK(verispec::best_k(1.0, 0.0, target, 8) == 8);
  CHECK(verispec::best_k(1.0, 0.0, target, 3) == 3);
  CHECK(verispec::best_k(1.0, 0.0, target, 0) == 0);  // max_k = 0: plain decoding
  CHECK(verispec::best_k(1.0, 0.0, target, -1) == 0);
  // a = 1 but each draft pass costs 2: (k + 1) / (1 + 2.2 k) falls from 1 at k = 0.
  CHECK(verispec::best_k(1.0, 2.0, target, 8) == 0);
  // Ties go to the smaller k: a = 0, free draft, flat target -> every rate is 1.
  CHECK(verispec::best_k(0.0, 0.0, std::vector<double>(9, 1.0), 8) == 0);
  // a = 0.5, draft 0.1: rates k = 0..3 are 1/1, 1.5/1.3 = 1.1538, 1.75/1.6 = 1.09375,
  // 1.875/1.9 = 0.987 -> k = 1.
  CHECK(verispec::best_k(0.5, 0.1, target, 8) == 1);
  // A table shorter than max_k + 1 bounds k by its size (k = 2 here, not 8).
  CHECK(verispec::best_k(1.0, 0.0, {1.0, 1.2, 1.4}, 8) == 2);
}

void test_tree_tokens_and_when_a_tree_pays() {
  // E_tree(a, s, d) = E(a, d) + (1 - a) s (1 + a + ... + a^(d-1)).
  CHECK_NEAR(verispec::expected_tree_tokens(0.5, 0.0, 3), verispec::expected_tokens(0.5, 3), 1e-12);
  CHECK_NEAR(verispec::expected_tree_tokens(0.5, 0.4, 2), 1.75 + 0.5 * 0.4 * 1.5, 1e-12);
  CHECK_NEAR(verispec::expected_tree_tokens(1.0, 0.9, 4), 5.0, 1e-12);  // the spine never fails
  CHECK_NEAR(verispec::expected_tree_tokens(0.0, 1.0, 3), 2.0, 1e-12);  // level 0's sibling only
  // Depth 2 either way, a = 0.5: the chain expects 1.75 tokens, the tree 1.75 + 0.75 s.
  // Draft passes cost 0.2; the chain's target pass 1.0, the tree's (two more rows) 1.2:
  // the tree pays iff (1.75 + 0.75 s) / 1.4 > 1.75 / 1.2, i.e. s > 0.3889.
  CHECK(verispec::tree_pays(0.5, 0.40, 2, 2, 1.75, 0.2, 0.2, 1.0, 1.2));
  CHECK(!verispec::tree_pays(0.5, 0.38, 2, 2, 1.75, 0.2, 0.2, 1.0, 1.2));
  CHECK(!verispec::tree_pays(0.5, 0.0, 2, 2, 1.75, 0.2, 0.2, 1.0, 1.0001));  // no sibling accepted
  CHECK(!verispec::tree_pays(1.0, 1.0, 2, 2, 3.0, 0.2, 0.2, 1.0, 1.01));     // the spine never fails
  CHECK(verispec::tree_pays(0.5, 0.5, 2, 2, 1.75, 0.2, 0.2, 1.0, 1.0));      // free rows: any s > 0
  CHECK(!verispec::tree_pays(0.5, 0.5, 1, 0, 1.5, 0.1, 0.0, 1.0, 1.0));      // depth 0: no tree
  // In a batch the other rows' expected tokens dilute the gain: with 10 more expected
  // tokens in the step, s = 0.9 no longer pays for the 20% longer pass.
  CHECK(verispec::tree_pays(0.5, 0.9, 2, 2, 1.75, 0.2, 0.2, 1.0, 1.2));
  CHECK(!verispec::tree_pays(0.5, 0.9, 2, 2, 11.75, 0.2, 0.2, 1.0, 1.2));
  // A node budget of 6 with f = 2: the chain of 6 (a = 0.9: E = 5.69, 6 draft passes of
  // 0.05, pass 1.0) against the tree of depth 3 (E = 3.44 + 0.1 s 2.71 <= 3.71, 3 draft
  // passes, the same 6 nodes): the deep chain wins even when every sibling is accepted.
  CHECK(!verispec::tree_pays(0.9, 1.0, 6, 3, verispec::expected_tokens(0.9, 6), 0.3, 0.15, 1.0, 1.0));
  // With a = 0.3 the chain stops at depth 1 (E = 1.3); the tree of depth 1 and its one
  // sibling (E = 1.3 + 0.7 s) pays for a 10% longer pass once s > 0.18.
  CHECK(verispec::tree_pays(0.3, 0.25, 1, 1, 1.3, 0.05, 0.05, 1.0, 1.1));
  CHECK(!verispec::tree_pays(0.3, 0.15, 1, 1, 1.3, 0.05, 0.05, 1.0, 1.1));
}

void test_cost_model() {
  verispec::CostModel cm;
  CHECK(!cm.has_draft());
  std::vector<double> p = cm.target_passes(1, 8);  // the prior: 1, 1.2, ..., 2.4
  CHECK(p.size() == 8);
  CHECK_NEAR(p[0], 1.0, 1e-12);
  CHECK_NEAR(p[7], 2.4, 1e-12);
  cm.observe_target(1, 2.0);  // one size: the prior scaled through it, 2 (1 + 0.2 (n - 1))
  CHECK_NEAR(cm.target_pass(5), 3.6, 1e-12);
  cm.observe_target(3, 3.0);  // two sizes: the line through (1, 2) and (3, 3)
  CHECK_NEAR(cm.target_pass(2), 2.5, 1e-12);
  CHECK_NEAR(cm.target_pass(8), 5.5, 1e-12);
  cm.observe_target(3, 4.0);  // EWMA: 0.8 * 3 + 0.2 * 4
  CHECK_NEAR(cm.target_pass(3), 3.2, 1e-12);
  cm.observe_target(0, 9.0);  // no tokens: ignored
  cm.observe_target(-5, 9.0);
  CHECK_NEAR(cm.target_pass(3), 3.2, 1e-12);
  CHECK(cm.measured().size() == 2);
  cm.observe_draft(0.5);
  cm.observe_draft(1.5);  // 0.8 * 0.5 + 0.2 * 1.5
  CHECK(cm.has_draft());
  CHECK_NEAR(cm.draft_pass(), 0.7, 1e-12);
  // A flat memory-bound part, then linear growth: the knee and slope are found exactly.
  verispec::CostModel hinge;
  for (int64_t t = 1; t <= 16; ++t) hinge.observe_target(t, 1.0);
  for (int64_t t : {32, 64, 128}) hinge.observe_target(t, 1.0 + static_cast<double>(t - 16) / 16.0);
  CHECK_NEAR(hinge.knee(), 16.0, 1e-9);
  CHECK_NEAR(hinge.flat(), 1.0, 1e-9);
  CHECK_NEAR(hinge.slope(), 1.0 / 16.0, 1e-9);
  CHECK_NEAR(hinge.target_pass(4), 1.0, 1e-9);
  CHECK_NEAR(hinge.target_pass(1024), 1.0 + 1008.0 / 16.0, 1e-6);  // extrapolated
  // Buckets past 16 tokens: four per octave, each averaging the sizes it saw.
  verispec::CostModel b;
  b.observe_target(17, 1.0);
  b.observe_target(18, 2.0);
  CHECK(b.measured().size() == 1);
  CHECK_NEAR(b.measured()[0].first, 17.2, 1e-12);
  CHECK_NEAR(b.measured()[0].second, 1.2, 1e-12);
  b.observe_target(int64_t{1} << 62, 1.0);  // absurd sizes land in the last bucket
  CHECK(b.measured().size() == 2);
  // A longer pass never costs less, even after a noisy measurement: 5 at n = 1, 3 at
  // n = 2 fit a falling line, so the fit is flat at their mean 4.
  verispec::CostModel noisy;
  noisy.observe_target(1, 5.0);
  noisy.observe_target(2, 3.0);
  for (double c : noisy.target_passes(1, 6)) CHECK_NEAR(c, 4.0, 1e-12);
  // A server's sizes: decode batches of 16-32 tokens (tens of ms) and whole prompts (over
  // a second). Fitted on relative errors, the decode sizes keep their growth: 4 more
  // tokens at 16 cost ~6 ms. (Unweighted, the prompts decided the line: flat at 45 ms up
  // to 32 tokens, so 16 proposals looked free.)
  verispec::CostModel served;
  const int64_t sizes[] = {16, 20, 32, 700, 900};
  const double secs[] = {0.040, 0.046, 0.064, 1.30, 1.80};
  for (int i = 0; i < 5; ++i) served.observe_target(sizes[i], secs[i]);
  CHECK_NEAR(served.target_pass(16), 0.040, 0.004);
  CHECK(served.target_pass(20) - served.target_pass(16) >= 0.005);
  CHECK_NEAR(served.target_pass(32), 0.064, 0.006);
}

// The batch rule: with a pass cost flat to 16 tokens and then linear, one row speculates
// far and a batch of 64 rows at the same acceptance does not speculate at all. A rule
// that saw one row at a time (the rows' tokens not added up) would choose the same k for both.
void test_batch_k() {
  verispec::CostModel cm;
  for (int64_t t = 1; t <= 16; ++t) cm.observe_target(t, 1.0);
  for (int64_t t : {32, 64, 128}) cm.observe_target(t, 1.0 + static_cast<double>(t - 16) / 16.0);
  const double draft = 0.05, a = 0.8;
  const std::vector<int64_t> one = verispec::best_batch_k({a}, {8}, draft, cm, {});
  CHECK(one.size() == 1 && one[0] == 8);
  CHECK(one[0] == verispec::best_k(a, draft, cm.target_passes(1, 9), 8));  // the one-row rule
  const std::vector<int64_t> many =
      verispec::best_batch_k(std::vector<double>(64, a), std::vector<int64_t>(64, 8), draft, cm, {});
  CHECK(many.size() == 64);
  for (int64_t k : many) CHECK(k == 0);
  // A perfect draft still speculates in a batch of 4 (the pass stays near the flat part).
  const std::vector<int64_t> four =
      verispec::best_batch_k(std::vector<double>(4, 1.0), std::vector<int64_t>(4, 8), 0.0, cm, {});
  int64_t proposals = 0;
  for (int64_t k : four) proposals += k;
  CHECK(proposals >= 12);  // at least the flat part's 16 tokens
  // Caps hold, and rows decided elsewhere (rest) count: 64 decoding rows make the pass
  // compute-bound for the one row too.
  const std::vector<int64_t> capped = verispec::best_batch_k({a, a}, {0, 3}, draft, cm, {});
  CHECK(capped[0] == 0 && capped[1] <= 3 && capped[1] >= 1);
  const std::vector<int64_t> loaded =
      verispec::best_batch_k({a}, {8}, draft, cm, verispec::BatchRest{64.0, 0, 64});
  CHECK(loaded[0] < one[0]);
  CHECK(verispec::best_batch_k({}, {}, draft, cm, {}).empty());
}

void test_probe_interval_and_tracker() {
  // probe cost = draft + (T2 - T1) = 0.5 + 0.25; budget: 1% of T1 = 0.01 per plain
  // step -> ceil(0.75 / 0.01) = 75 steps, the fewest that keep probes within budget.
  const int64_t every = verispec::probe_interval(0.5, {1.0, 1.25, 1.5});
  CHECK(every == 75);
  CHECK(0.75 <= verispec::kProbeBudget * static_cast<double>(every) * 1.0 * (1 + 1e-12));
  CHECK(0.75 > verispec::kProbeBudget * static_cast<double>(every - 1) * 1.0);
  // Ten rows that may all probe share the budget: ten times the interval.
  CHECK(verispec::probe_interval(0.5, {1.0, 1.25, 1.5}, 10) == 750);
  // A free probe still waits the minimum; missing or zero costs fall back to it.
  CHECK(verispec::probe_interval(0.0, {1.0, 1.0}) == verispec::kMinProbeInterval);
  CHECK(verispec::probe_interval(0.5, {1.0}) == verispec::kMinProbeInterval);
  CHECK(verispec::probe_interval(0.5, {0.0, 1.0}) == verispec::kMinProbeInterval);
  // An absurdly slow draft is capped at 10^6 steps, not an overflowing cast.
  CHECK(verispec::probe_interval(1e300, {1.0, 1.2}) == 1000000);
  // The tracker: 4 accepted of 4 from the prior 0.5: s = t = 1 + .95 + .95^2 + .95^3
  // = 3.709875, rate = 4.709875 / 5.709875.
  verispec::AcceptanceTracker tr;
  CHECK_NEAR(tr.rate, 0.5, 0.0);
  tr.update(4, 4);
  CHECK_NEAR(tr.rate, 4.709875 / 5.709875, 1e-12);
  // 3 proposed, 1 accepted: trials are the accepted one and the rejected one.
  verispec::AcceptanceTracker t2;
  t2.update(3, 1);  // s = 0.95, t = 1.95 -> 1.95 / 3.95
  CHECK_NEAR(t2.rate, 1.95 / 3.95, 1e-12);
  t2.update(0, 0);  // nothing proposed: no evidence
  CHECK_NEAR(t2.rate, 1.95 / 3.95, 1e-12);
}

}  // namespace

int main() {
  test_ngram_validation();
  test_ngram_propose();
  test_ngram_propose_tree();
  test_ngram_rollback();
  for (uint32_t seed = 0; seed < 16; ++seed) test_ngram_random(seed);
  test_ngram_long();
  test_stop_rules();
  test_stop_rules_errors();
  test_expected_tokens_and_best_k();
  test_tree_tokens_and_when_a_tree_pays();
  test_cost_model();
  test_batch_k();
  test_probe_interval_and_tracker();
  return native_check::check_summary("test_decoder_rules");
}
