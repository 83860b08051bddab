#include "verispec/ngram.h"

#include <string>

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
      const int64_t to = from + std::min(k, len - from);  // from + k may overflow
      if (matched_n != nullptr) *matched_n = n;
      return std::vector<int32_t>(tokens_.begin() + from, tokens_.begin() + to);
    }
  }
  return {};
}

}  // namespace verispec
