// The sampling policy's argument rules, as every layer checks and words them.
//
// The ranges are sampling_math.h's *_valid predicates (also what the kernels test on
// per-row values); this header is the one place that says them in words and the one
// host-side check of policy arguments. The decoder's add, the op bindings
// (verispec._C.check_policy and the ops' scalar arguments), the kernels' status text,
// verispec.reference and the CLI all use it, so a value is accepted or rejected alike
// everywhere and rejected with the same message:
//
//   policy_error(inf, 0, 1, 0)  == "temperature must be finite and >= 0, got inf"
//   policy_error(1, 0, 1.5, 0)  == "top_p must be in (0, 1], got 1.5"
//   policy_error(1, 0, 1, 0)    == ""
//
// The decision is made on the values the kernels compute with: float32 for temperature,
// top_p and min_p, int32 for top_k (a top_k past int32 is, like any top_k >= vocab,
// "off", so it saturates). Messages show the value as the caller gave it, with a note
// where float32 turned it into inf or 0. Callers prefix their own name ("verify: ...").
//
// Host-only: std::string, snprintf (no iostreams: see tests/test_source_rules.py).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "verispec/ops.h"
#include "verispec/sampling_math.h"

namespace verispec {

static_assert(static_cast<int32_t>(PolicyField::kTemperature) == 0 &&
                  static_cast<int32_t>(PolicyField::kTopK) == 1 &&
                  static_cast<int32_t>(PolicyField::kTopP) == 2 &&
                  static_cast<int32_t>(PolicyField::kMinP) == 3,
              "first_invalid_policy_field (sampling_math.h) numbers fields as PolicyField");

inline const char* policy_field_name(PolicyField f) {
  switch (f) {
    case PolicyField::kTemperature: return "temperature";
    case PolicyField::kTopK: return "top_k";
    case PolicyField::kTopP: return "top_p";
    case PolicyField::kMinP: return "min_p";
  }
  return "policy";
}

// The rule of one argument in words: its name and expected range (the *_valid predicate).
inline const char* policy_rule(PolicyField f) {
  switch (f) {
    case PolicyField::kTemperature: return "temperature must be finite and >= 0";
    case PolicyField::kTopK: return "top_k must be >= 0";
    case PolicyField::kTopP: return "top_p must be in (0, 1]";
    case PolicyField::kMinP: return "min_p must be in [0, 1]";
  }
  return "policy value out of range";
}

// A number as error messages show it: "inf", "-inf", "nan", "-0", integers without a
// fraction ("2", "-1"), others in the fewest digits that read back as the same value
// (float32 values as float32: 0.1f reads "0.1", not "0.100000001"); exponents as
// printf's %g writes them ("1e-45", "1e+30").
inline std::string format_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0.0) return std::signbit(v) ? "-0" : "0";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<int64_t>(v));
  char buf[40];
  const float f = static_cast<float>(v);
  const bool is_float32 = static_cast<double>(f) == v;
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (is_float32 ? std::strtof(buf, nullptr) == f : std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// An argument's value for a message: format_value, plus a note when the conversion to
// the kernels' float32 made a finite value inf or a nonzero value 0 (the value that
// then failed, or passed, the rule).
inline std::string policy_value_text(PolicyField f, double v) {
  if (f == PolicyField::kTopK) return format_value(v);
  std::string text = format_value(v);
  const float narrowed = static_cast<float>(v);
  if (std::isfinite(v) && std::isinf(narrowed)) text += narrowed > 0 ? " (inf as float32)" : " (-inf as float32)";
  if (v != 0.0 && narrowed == 0.0f) text += " (0 as float32)";
  return text;
}

// "<rule>, got <value>": the message of an argument that breaks its rule.
inline std::string policy_violation(PolicyField f, const std::string& value_text) {
  return std::string(policy_rule(f)) + ", got " + value_text;
}

// top_k as the kernels take it: int32, saturated (every top_k >= vocab is "off").
inline int32_t saturate_top_k(int64_t k) {
  if (k > std::numeric_limits<int32_t>::max()) return std::numeric_limits<int32_t>::max();
  if (k < std::numeric_limits<int32_t>::min()) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(k);
}

// The first argument out of its range (as PolicyField), or -1 when all are valid.
inline int32_t policy_error_field(double temperature, int64_t top_k, double top_p,
                                  double min_p) {
  return first_invalid_policy_field(static_cast<float>(temperature), saturate_top_k(top_k),
                                    static_cast<float>(top_p), static_cast<float>(min_p));
}

// "" when every argument is in range; else the message of the first bad one, e.g.
// "temperature must be finite and >= 0, got inf".
inline std::string policy_error(double temperature, int64_t top_k, double top_p,
                                double min_p) {
  const int32_t field = policy_error_field(temperature, top_k, top_p, min_p);
  if (field < 0) return "";
  const auto f = static_cast<PolicyField>(field);
  switch (f) {
    case PolicyField::kTemperature: return policy_violation(f, policy_value_text(f, temperature));
    case PolicyField::kTopK: return policy_violation(f, std::to_string(top_k));
    case PolicyField::kTopP: return policy_violation(f, policy_value_text(f, top_p));
    case PolicyField::kMinP: return policy_violation(f, policy_value_text(f, min_p));
  }
  return "";
}

// One argument alone (a per-row value; the others at their defaults): "" or its message,
// the same text policy_error gives for that value as a scalar.
inline std::string policy_value_error(PolicyField f, double value) {
  switch (f) {
    case PolicyField::kTemperature: return policy_error(value, 0, 1.0, 0.0);
    case PolicyField::kTopK: {
      // Range first: converting a double outside int64 is undefined; NaN is not an int.
      if (!(value > -9.3e18 && value < 9.3e18)) {
        return value > 0 ? "" : policy_violation(f, format_value(value));
      }
      return policy_error(1.0, static_cast<int64_t>(value), 1.0, 0.0);
    }
    case PolicyField::kTopP: return policy_error(1.0, 0, value, 0.0);
    case PolicyField::kMinP: return policy_error(1.0, 0, 1.0, value);
  }
  return "";
}

}  // namespace verispec
