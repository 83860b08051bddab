#include "verispec/ngram.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "verispec/errors.h"

namespace verispec {

NGramIndex::NGramIndex(int64_t min_n, int64_t max_n) : min_n_(min_n), max_n_(max_n) {
  if (min_n < 1 || max_n < min_n || max_n > 64) {
    throw InvalidArgumentError("NGram: need 1 <= min_n <= max_n <= 64, got min_n = " +
                               std::to_string(min_n) + ", max_n = " + std::to_string(max_n));
  }
  maps_.resize(static_cast<size_t>(max_n - min_n + 1));
}

uint64_t NGramIndex::key(int64_t end, int64_t n) const {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(n);
  for (int64_t i = end - n + 1; i <= end; ++i) {
    h ^= static_cast<uint32_t>(tokens_[static_cast<size_t>(i)]);
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
  }
  return h;
}

bool NGramIndex::same(int64_t end_a, int64_t end_b, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens_[static_cast<size_t>(end_a - i)] != tokens_[static_cast<size_t>(end_b - i)]) {
      return false;
    }
  }
  return true;
}

void NGramIndex::append(int32_t token) {
  tokens_.push_back(token);
  const int64_t end = length() - 1;
  for (int64_t n = min_n_; n <= max_n_ && n <= end + 1; ++n) {
    maps_[static_cast<size_t>(n - min_n_)][key(end, n)].push_back(static_cast<int32_t>(end));
  }
}

void NGramIndex::extend(const int32_t* tokens, int64_t n) {
  if (n < 0) {
    throw InvalidArgumentError("NGram.extend: n must be >= 0, got " + std::to_string(n));
  }
  if (tokens == nullptr && n > 0) {
    throw InvalidArgumentError("NGram.extend: tokens must not be null when n = " +
                               std::to_string(n) + " > 0");
  }
  for (int64_t i = 0; i < n; ++i) append(tokens[i]);
}

void NGramIndex::rollback(int64_t new_len) {
  if (new_len < 0 || new_len > length()) {
    throw InvalidArgumentError("NGram.rollback: new_len must be in [0, " +
                               std::to_string(length()) + "], got " + std::to_string(new_len));
  }
  // Each dropped position is the newest entry of each key it inserted: pop them.
  for (int64_t end = length() - 1; end >= new_len; --end) {
    for (int64_t n = min_n_; n <= max_n_ && n <= end + 1; ++n) {
      auto& map = maps_[static_cast<size_t>(n - min_n_)];
      auto it = map.find(key(end, n));
      it->second.pop_back();
      if (it->second.empty()) map.erase(it);
    }
    tokens_.pop_back();
  }
}

std::vector<int32_t> NGramIndex::propose(int64_t k, int64_t* matched_n) const {
  const int64_t len = length();
  if (matched_n != nullptr) *matched_n = 0;
  if (k <= 0) return {};
  for (int64_t n = std::min<int64_t>(max_n_, len); n >= min_n_; --n) {
    const auto& map = maps_[static_cast<size_t>(n - min_n_)];
    auto it = map.find(key(len - 1, n));
    if (it == map.end()) continue;
    const auto& ends = it->second;  // the last entry is the suffix itself
    for (auto e = ends.rbegin(); e != ends.rend(); ++e) {
      if (*e >= len - 1 || !same(*e, len - 1, n)) continue;
      const int64_t from = *e + 1;
      int64_t to = from + std::min(k, len - from);  // from + k may overflow
      for (int64_t i = from; i < to; ++i) {  // a continuation stops at a separator
        if (tokens_[static_cast<size_t>(i)] < 0) to = i;
      }
      if (to == from) continue;  // the occurrence ends its text: an earlier one may not
      if (matched_n != nullptr) *matched_n = n;
      return std::vector<int32_t>(tokens_.begin() + from, tokens_.begin() + to);
    }
  }
  return {};
}

std::vector<int32_t> NGramIndex::propose_tree(int64_t k, int64_t branches,
                                              std::vector<int32_t>* parents,
                                              int64_t* matched_n, std::vector<double>* freqs,
                                              std::vector<double>* chain_freqs) const {
  if (parents == nullptr) throw InvalidArgumentError("NGram.propose_tree: parents must not be null");
  if (branches < 1) {
    throw InvalidArgumentError("NGram.propose_tree: branches must be >= 1, got " +
                               std::to_string(branches));
  }
  parents->clear();
  if (freqs != nullptr) freqs->clear();
  if (chain_freqs != nullptr) chain_freqs->clear();
  if (matched_n != nullptr) *matched_n = 0;
  const int64_t len = length();
  if (k <= 0) return {};
  // The continuations' starts, most recent first, of the longest n that matches.
  std::vector<int64_t> froms;
  for (int64_t n = std::min<int64_t>(max_n_, len); n >= min_n_ && froms.empty(); --n) {
    const auto& map = maps_[static_cast<size_t>(n - min_n_)];
    auto it = map.find(key(len - 1, n));
    if (it == map.end()) continue;
    const auto& ends = it->second;
    for (auto e = ends.rbegin(); e != ends.rend(); ++e) {
      if (*e >= len - 1 || !same(*e, len - 1, n)) continue;
      if (tokens_[static_cast<size_t>(*e + 1)] < 0) continue;  // ends its text
      froms.push_back(*e + 1);
      if (static_cast<int64_t>(froms.size()) == kMaxTreeMatches) break;
    }
    if (!froms.empty() && matched_n != nullptr) *matched_n = n;
  }
  if (froms.empty()) return {};
  // The trie of the continuations (node 0: the root).
  struct TrieNode {
    int32_t token = -1;
    int64_t count = 0;
    int64_t recency = 0;      // the most recent occurrence through it (0: the latest)
    int64_t out = -1;         // its index among the selected nodes
    int64_t chosen = 0;       // its selected children
    std::vector<int64_t> children;
  };
  std::vector<TrieNode> trie(1);
  std::vector<int64_t> parent_of(1, -1);
  for (size_t m = 0; m < froms.size(); ++m) {
    int64_t at = 0;
    for (int64_t d = 0; d < k && froms[m] + d < len; ++d) {
      const int32_t token = tokens_[static_cast<size_t>(froms[m] + d)];
      if (token < 0) break;  // a separator: the continuation ends
      int64_t next = -1;
      for (int64_t c : trie[static_cast<size_t>(at)].children) {
        if (trie[static_cast<size_t>(c)].token == token) next = c;
      }
      if (next < 0) {
        next = static_cast<int64_t>(trie.size());
        TrieNode node;
        node.token = token;
        node.recency = static_cast<int64_t>(m);
        trie.push_back(node);
        parent_of.push_back(at);
        trie[static_cast<size_t>(at)].children.push_back(next);
      }
      trie[static_cast<size_t>(next)].count += 1;
      at = next;
    }
  }
  // A node's share among its siblings: its count over theirs (continuations cut short by
  // the end of the context count for no child).
  const auto share = [&](int64_t node) {
    int64_t total = 0;
    for (int64_t c : trie[static_cast<size_t>(parent_of[static_cast<size_t>(node)])].children)
      total += trie[static_cast<size_t>(c)].count;
    return static_cast<double>(trie[static_cast<size_t>(node)].count) / static_cast<double>(total);
  };
  if (chain_freqs != nullptr) {  // the most recent occurrence's path: propose(k)'s tokens
    int64_t at = 0;
    for (int64_t d = 0; d < k && froms[0] + d < len; ++d) {
      const int32_t token = tokens_[static_cast<size_t>(froms[0] + d)];
      if (token < 0) break;
      for (int64_t c : trie[static_cast<size_t>(at)].children) {
        if (trie[static_cast<size_t>(c)].token == token) at = c;
      }
      chain_freqs->push_back(share(at));
    }
  }
  // Best first from the root.
  std::vector<int32_t> tokens;
  std::vector<int64_t> frontier = trie[0].children;
  while (static_cast<int64_t>(tokens.size()) < k) {
    int64_t best = -1;
    size_t best_at = 0;
    for (size_t i = 0; i < frontier.size(); ++i) {
      const TrieNode& c = trie[static_cast<size_t>(frontier[i])];
      if (trie[static_cast<size_t>(parent_of[static_cast<size_t>(frontier[i])])].chosen >= branches) continue;
      if (best < 0) {
        best = frontier[i];
        best_at = i;
        continue;
      }
      const TrieNode& b = trie[static_cast<size_t>(best)];
      if (c.count > b.count || (c.count == b.count && (c.recency < b.recency ||
                                                       (c.recency == b.recency && frontier[i] < best)))) {
        best = frontier[i];
        best_at = i;
      }
    }
    if (best < 0) break;
    frontier.erase(frontier.begin() + static_cast<std::ptrdiff_t>(best_at));
    TrieNode& node = trie[static_cast<size_t>(best)];
    TrieNode& parent = trie[static_cast<size_t>(parent_of[static_cast<size_t>(best)])];
    parent.chosen += 1;
    node.out = static_cast<int64_t>(tokens.size());
    tokens.push_back(node.token);
    parents->push_back(static_cast<int32_t>(parent.out));  // the root's out is -1
    if (freqs != nullptr) freqs->push_back(share(best));
    frontier.insert(frontier.end(), node.children.begin(), node.children.end());
  }
  return tokens;
}

}  // namespace verispec
