// N-gram prompt lookup: a deterministic drafter over one sequence's tokens.
//
// Rule (the one place it is defined; tests/test_ngram.py checks it against a brute
// force): for n = max_n down to min_n, take the last n tokens as the key; find the
// most recent earlier occurrence of the key, ending at e < len - 1; propose
// tokens[e + 1 : e + 1 + k] (at most up to the end). The first n with a match wins;
// no match proposes nothing.
//
// Separators: a negative token (kSeparator) in the index marks the boundary between
// texts (SpecDecoder's n-gram memory puts earlier requests before the prompt, each
// followed by one). A continuation stops before a separator, and no key holding one
// equals a sequence's own suffix, so nothing is proposed across a boundary.
//
// The index is incremental: appending a token inserts the (max_n - min_n + 1) n-grams
// that end at it; rollback(new_len) removes exactly those of the dropped positions.
// Neither rescans the history. Keys are 64-bit hashes; every candidate is compared
// token by token, so a hash collision can never produce a wrong proposal.
//
// Trees (propose_tree, the one place the trie rule is defined; tests/test_ngram.py
// checks it against a brute force): take the same n (the longest that matches), and of
// it up to kMaxTreeMatches earlier occurrences, most recent first. Each occurrence's
// continuation tokens[e + 1 : e + 1 + k] is a path; the paths form a trie whose nodes
// count how many continuations pass through them (siblings are distinct tokens by
// construction). Nodes are selected best first, at most k of them and at most
// `branches` children per node: among the children of the selected nodes (the root
// first), the largest count wins, ties going to the more recent occurrence, then to the
// node created first. A node's parent is always selected before it, so parents[i] < i
// (-1: a child of the root). With one occurrence, or branches = 1 and one dominant
// path, the tree is a chain; with one occurrence it is exactly propose(k).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace verispec {

class NGramIndex {
 public:
  NGramIndex(int64_t min_n, int64_t max_n);

  int64_t min_n() const { return min_n_; }
  int64_t max_n() const { return max_n_; }
  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }

  void append(int32_t token);
  void extend(const int32_t* tokens, int64_t n);
  void rollback(int64_t new_len);
  // Up to k proposed tokens (possibly none). *matched_n (if given) is the length of
  // the matched suffix, 0 when nothing matched.
  std::vector<int32_t> propose(int64_t k, int64_t* matched_n = nullptr) const;
  // Up to k tree nodes (tokens; *parents gets each node's parent, -1 for the root)
  // with at most `branches` (>= 1) children per node; the rule above. *freqs (if given)
  // gets each node's share of the continuations through its parent (its count over the
  // sum of its parent's children's counts, all of them, selected or not), and
  // *chain_freqs the same along the most recent continuation (propose(k)'s tokens).
  std::vector<int32_t> propose_tree(int64_t k, int64_t branches, std::vector<int32_t>* parents,
                                    int64_t* matched_n = nullptr,
                                    std::vector<double>* freqs = nullptr,
                                    std::vector<double>* chain_freqs = nullptr) const;

  // The boundary between texts (above).
  static constexpr int32_t kSeparator = -1;
  // The most occurrences a tree is built from.
  static constexpr int64_t kMaxTreeMatches = 32;

 private:
  uint64_t key(int64_t end, int64_t n) const;  // hash of tokens[end - n + 1 .. end]
  bool same(int64_t end_a, int64_t end_b, int64_t n) const;

  int64_t min_n_, max_n_;
  std::vector<int32_t> tokens_;
  // Per n (index n - min_n): key -> end positions, increasing.
  std::vector<std::unordered_map<uint64_t, std::vector<int32_t>>> maps_;
};

}  // namespace verispec
