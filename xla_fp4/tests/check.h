// A tiny check macro for the C++ unit tests (no gtest: the Bazel build is offline). CHECK failures are counted and
// reported; main() returns xla_fp4::testing::Failures() != 0.
#ifndef XLA_FP4_TESTS_CHECK_H_
#define XLA_FP4_TESTS_CHECK_H_

#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

namespace xla_fp4::testing {

inline int& FailureCount() {
  static int count = 0;
  return count;
}

inline int Failures() { return FailureCount(); }

// Bit pattern equality for floats (so that NaN == NaN and -0 != +0).
inline bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

template <typename A, typename B>
void ReportMismatch(const char* file, int line, const char* expr, const A& got, const B& want) {
  std::ostringstream s;
  s.precision(9);
  s << got << " vs " << want;
  std::fprintf(stderr, "%s:%d: CHECK failed: %s (%s)\n", file, line, expr, s.str().c_str());
  ++FailureCount();
}

}  // namespace xla_fp4::testing

#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::xla_fp4::testing::FailureCount();                                       \
    }                                                                             \
  } while (0)

// a == b (as values; for floats use CHECK_BITS_EQ to compare bit patterns).
#define CHECK_EQ(a, b)                                                                          \
  do {                                                                                          \
    const auto check_a_ = (a);                                                                  \
    const auto check_b_ = (b);                                                                  \
    if (!(check_a_ == check_b_)) {                                                              \
      ::xla_fp4::testing::ReportMismatch(__FILE__, __LINE__, #a " == " #b, +check_a_, +check_b_); \
    }                                                                                           \
  } while (0)

#define CHECK_BITS_EQ(a, b)                                                                                   \
  do {                                                                                                        \
    const float check_a_ = (a);                                                                               \
    const float check_b_ = (b);                                                                               \
    if (!::xla_fp4::testing::SameBits(check_a_, check_b_)) {                                                  \
      ::xla_fp4::testing::ReportMismatch(__FILE__, __LINE__, "bits of " #a " == bits of " #b, check_a_, check_b_); \
    }                                                                                                         \
  } while (0)

#define TEST_MAIN_RESULT()                                                             \
  (::xla_fp4::testing::Failures() == 0                                                 \
       ? (std::fprintf(stderr, "all checks passed\n"), 0)                               \
       : (std::fprintf(stderr, "%d check(s) failed\n", ::xla_fp4::testing::Failures()), 1))

#endif  // XLA_FP4_TESTS_CHECK_H_
