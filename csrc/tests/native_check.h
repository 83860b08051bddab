// The checks of the native test programs (no framework): each failed check prints where
// and what, and the program ends with check_summary(), non-zero if any failed.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>

namespace native_check {
inline int failures = 0;
inline int checks = 0;

// Prints "<name>: N checks, M failures"; returns the program's exit status.
inline int check_summary(const char* name) {
  std::printf("%s: %d checks, %d failures\n", name, checks, failures);
  return failures == 0 ? 0 : 1;
}

// The message of the E thrown by f, or "<none>" if f threw nothing.
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<none>";
}

inline bool has(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}
}  // namespace native_check

#define CHECK(cond)                                                                \
  do {                                                                             \
    ++native_check::checks;                                                        \
    if (!(cond)) {                                                                 \
      ++native_check::failures;                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                              \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                         \
  do {                                                                                \
    ++native_check::checks;                                                           \
    const double va_ = (a), vb_ = (b);                                                \
    if (!(std::fabs(va_ - vb_) <= (tol))) {                                           \
      ++native_check::failures;                                                       \
      std::fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g, %s = %.9g (tol %g)\n", \
                   __FILE__, __LINE__, #a, va_, #b, vb_, static_cast<double>(tol));   \
    }                                                                                 \
  } while (0)
