// Minimal assertion macros for the C++ tests (no gtest dependency).
//
// EXPECT_* records a failure and carries on; CHECK_* records a failure and
// returns from the current test function (which must return void). A test
// binary's main() ends with `return check::Summary("name");`, which prints a
// one-line summary and returns non-zero when anything failed.
#pragma once

#include <cstdio>
#include <exception>
#include <sstream>
#include <string>

namespace check {

inline int& Failures() {
  static int failures = 0;
  return failures;
}

inline int& Checks() {
  static int checks = 0;
  return checks;
}

// Prints the first kMaxPrinted failures; a check failing in a loop would
// otherwise bury the rest of the output.
constexpr int kMaxPrinted = 20;

inline void Fail(const char* file, int line, const std::string& what) {
  const int failures = ++Failures();
  if (failures <= kMaxPrinted) {
    std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  } else if (failures == kMaxPrinted + 1) {
    std::fprintf(stderr, "(further failures are counted, not printed)\n");
  }
}

template <typename A, typename B>
std::string DescribeCompare(const char* a_text, const char* op,
                            const char* b_text, const A& a, const B& b) {
  std::ostringstream out;
  out << a_text << " " << op << " " << b_text << "  (left: " << a
      << ", right: " << b << ")";
  return out.str();
}

// Runs one test function, reporting (and counting) an escaped exception.
template <typename Fn>
void Run(const char* name, Fn&& fn) {
  const int before = Failures();
  try {
    fn();
  } catch (const std::exception& e) {
    Fail(__FILE__, __LINE__,
         std::string(name) + " threw an unexpected exception: " + e.what());
  } catch (...) {
    Fail(__FILE__, __LINE__,
         std::string(name) + " threw an unexpected non-std exception");
  }
  std::fprintf(stderr, "[%s] %s\n", Failures() == before ? "  OK  " : " FAIL ",
               name);
}

inline int Summary(const char* binary) {
  if (Failures() == 0) {
    std::fprintf(stderr, "%s: all %d checks passed\n", binary, Checks());
    return 0;
  }
  std::fprintf(stderr, "%s: %d of %d checks FAILED\n", binary, Failures(),
               Checks());
  return 1;
}

}  // namespace check

#define CHECK_IMPL_(cond, text, on_fail)               \
  do {                                                 \
    ++::check::Checks();                               \
    if (!(cond)) {                                     \
      ::check::Fail(__FILE__, __LINE__, (text));       \
      on_fail;                                         \
    }                                                  \
  } while (0)

#define CHECK_CMP_IMPL_(a, op, b, on_fail)                                  \
  do {                                                                      \
    ++::check::Checks();                                                    \
    const auto& check_a_ = (a);                                             \
    const auto& check_b_ = (b);                                             \
    if (!(check_a_ op check_b_)) {                                          \
      ::check::Fail(__FILE__, __LINE__,                                     \
                    ::check::DescribeCompare(#a, #op, #b, check_a_, check_b_)); \
      on_fail;                                                              \
    }                                                                       \
  } while (0)

#define EXPECT_TRUE(cond) CHECK_IMPL_(cond, "expected true: " #cond, (void)0)
#define EXPECT_FALSE(cond) CHECK_IMPL_(!(cond), "expected false: " #cond, (void)0)
#define EXPECT_EQ(a, b) CHECK_CMP_IMPL_(a, ==, b, (void)0)
#define EXPECT_NE(a, b) CHECK_CMP_IMPL_(a, !=, b, (void)0)
#define EXPECT_LT(a, b) CHECK_CMP_IMPL_(a, <, b, (void)0)
#define EXPECT_GT(a, b) CHECK_CMP_IMPL_(a, >, b, (void)0)

#define CHECK_TRUE(cond) CHECK_IMPL_(cond, "required true: " #cond, return)
#define CHECK_EQ(a, b) CHECK_CMP_IMPL_(a, ==, b, return)

// Expects `stmt` to throw `exc_type`; binds the caught exception's what() to
// the std::string `what_var` declared by the caller.
#define EXPECT_THROW_WHAT(stmt, exc_type, what_var)                          \
  do {                                                                       \
    ++::check::Checks();                                                     \
    bool check_thrown_ = false;                                              \
    try {                                                                    \
      stmt;                                                                  \
    } catch (const exc_type& e) {                                            \
      check_thrown_ = true;                                                  \
      what_var = e.what();                                                   \
    } catch (const std::exception& e) {                                      \
      ::check::Fail(__FILE__, __LINE__,                                      \
                    std::string(#stmt " threw the wrong exception type: ") + \
                        e.what());                                           \
      check_thrown_ = true;                                                  \
    }                                                                        \
    if (!check_thrown_) {                                                    \
      ::check::Fail(__FILE__, __LINE__, #stmt " did not throw " #exc_type);  \
    }                                                                        \
  } while (0)

#define EXPECT_CONTAINS(haystack, needle)                                     \
  do {                                                                        \
    ++::check::Checks();                                                      \
    const std::string check_h_ = (haystack);                                  \
    const std::string check_n_ = (needle);                                    \
    if (check_h_.find(check_n_) == std::string::npos) {                       \
      ::check::Fail(__FILE__, __LINE__,                                       \
                    "expected \"" + check_h_ + "\" to contain \"" + check_n_ + \
                        "\"");                                                \
    }                                                                         \
  } while (0)
