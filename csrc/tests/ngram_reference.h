// The n-gram proposal rule of ngram.h written out directly (a brute force over the
// history), for the native tests that check the index and the decoder against it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace verispec_test {

// The longest n in [min_n, max_n] whose last-n key occurs earlier (ending at
// e < len - 1), its most recent occurrence, up to k tokens after it; *matched = that n
// (0: no match).
inline std::vector<int32_t> brute_propose(const std::vector<int32_t>& t, int64_t min_n,
                                          int64_t max_n, int64_t k, int64_t* matched = nullptr) {
  const int64_t len = static_cast<int64_t>(t.size());
  if (matched) *matched = 0;
  for (int64_t n = std::min(max_n, len); n >= min_n && k > 0; --n) {
    for (int64_t e = len - 2; e >= n - 1; --e) {
      bool eq = true;
      for (int64_t i = 0; i < n && eq; ++i) {
        eq = t[static_cast<size_t>(e - i)] == t[static_cast<size_t>(len - 1 - i)];
      }
      if (!eq) continue;
      if (matched) *matched = n;
      std::vector<int32_t> out;
      for (int64_t j = e + 1; j < len && j <= e + k; ++j) out.push_back(t[static_cast<size_t>(j)]);
      return out;
    }
  }
  return {};
}

}  // namespace verispec_test
