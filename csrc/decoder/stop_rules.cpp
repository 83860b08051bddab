// The stop rules, applied in this one place (docs/design.md: one place for each rule).
#include <algorithm>
#include <string>

#include "verispec/errors.h"
#include "verispec/spec_decoder.h"

namespace verispec {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "running";
    case FinishReason::kEos: return "eos";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kContext: return "context";
    case FinishReason::kAborted: return "aborted";
  }
  return "unknown";
}

int64_t apply_stop_rules(const StopParams& stop, const std::vector<int32_t>& generated,
                         const int32_t* tokens, int64_t n, int64_t prompt_len,
                         int64_t max_context, FinishReason* reason) {
  if (n < 0) {
    throw InvalidArgumentError("apply_stop_rules: n must be >= 0, got " + std::to_string(n));
  }
  if (tokens == nullptr && n > 0) {
    throw InvalidArgumentError("apply_stop_rules: tokens must not be null when n = " +
                               std::to_string(n) + " > 0");
  }
  if (reason == nullptr) {
    throw InvalidArgumentError("apply_stop_rules: reason must not be null");
  }
  *reason = FinishReason::kNone;
  // The generated tail plus the candidates, to match stop sequences that straddle
  // the step boundary.
  size_t longest = 0;
  for (const auto& s : stop.stop_sequences) longest = std::max(longest, s.size());
  std::vector<int32_t> tail(
      generated.end() - static_cast<std::ptrdiff_t>(std::min(generated.size(), longest)),
      generated.end());
  int64_t total = static_cast<int64_t>(generated.size());
  // Already at a limit (a caller that did not stop in time, max_new_tokens <= 0): the
  // limits cut exactly, so not one more token is kept.
  if (n > 0 && total >= stop.max_new_tokens) {
    *reason = FinishReason::kLength;
    return 0;
  }
  if (n > 0 && prompt_len + total >= max_context) {
    *reason = FinishReason::kContext;
    return 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = tokens[i];
    ++total;
    tail.push_back(t);
    if (std::find(stop.eos_ids.begin(), stop.eos_ids.end(), t) != stop.eos_ids.end()) {
      *reason = FinishReason::kEos;
      return i + 1;
    }
    for (const auto& s : stop.stop_sequences) {
      if (!s.empty() && tail.size() >= s.size() &&
          std::equal(s.begin(), s.end(), tail.end() - static_cast<std::ptrdiff_t>(s.size()))) {
        *reason = FinishReason::kStop;
        return i + 1;
      }
    }
    if (total >= stop.max_new_tokens) {
      *reason = FinishReason::kLength;
      return i + 1;
    }
    if (prompt_len + total >= max_context) {
      *reason = FinishReason::kContext;
      return i + 1;
    }
  }
  return n;
}

}  // namespace verispec
