#include "oomguard/status.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace oomguard {
namespace {

StatusOr<std::vector<std::string>> Words() {
  return std::vector<std::string>{std::string(64, 'a'), std::string(64, 'b'), std::string(64, 'c')};
}

// Range-for over a temporary's value() binds `auto&& range = Words().value();`;
// the StatusOr dies at the end of that statement, so a reference into it
// would dangle (ASan: stack-use-after-scope; plain builds: garbage).
TEST(StatusOrTest, RangeForOverATemporarysValueOwnsTheValue) {
  std::string joined;
  for (const std::string& w : Words().value()) joined += w.substr(0, 1);
  EXPECT_EQ(joined, "abc");
  auto&& held = *Words();
  static_assert(!std::is_reference_v<decltype(*Words())>);
  static_assert(!std::is_reference_v<decltype(Words().value())>);
  ASSERT_EQ(held.size(), 3u);
  EXPECT_EQ(held[2], std::string(64, 'c'));
}

TEST(StatusOrTest, ErrorKeepsItsStatusAndLvaluesStillReference) {
  StatusOr<int> bad = Status::NotFound("no such thing");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
  StatusOr<int> good = 7;
  good.value() = 9;  // an lvalue StatusOr still hands out a reference
  EXPECT_EQ(*good, 9);
}

StatusOr<std::unique_ptr<int>> Broken() {
  return Status::InvalidArgument("OOMGUARD_FAULTS: rule 1 'oom@stpe=3': unknown key 'stpe'");
}

// The README's first line, Create(options).value(), on an error: it must not
// hand out a value that is not there (a segfault in Release builds, once),
// whatever the build type (these tests build without assertions too).
TEST(StatusOrTest, ValueOfAnErrorThrowsWithTheStatusInEveryAccessor) {
  StatusOr<std::unique_ptr<int>> bad = Broken();
  const StatusOr<std::unique_ptr<int>>& cbad = bad;
  const std::string expected = "StatusOr::value() on an error: INVALID_ARGUMENT: OOMGUARD_FAULTS: rule 1";
  auto check = [&](auto&& access) {
    try {
      access();
      ADD_FAILURE() << "no exception";
    } catch (const BadStatusOrAccess& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    }
  };
  check([&] { (void)bad.value(); });
  check([&] { (void)cbad.value(); });
  check([&] { (void)Broken().value(); });
  check([&] { (void)*bad; });
  check([&] { (void)*Broken(); });
  check([&] { (void)bad->get(); });
  check([&] { (void)cbad->get(); });
  // The error itself is untouched by the failed access.
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

// Uncaught (as in a main() that calls Create(...).value()), the program
// stops with the status on stderr, not a silent crash.
TEST(StatusOrDeathTest, UncaughtValueOfAnErrorStopsWithTheStatusMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto uncaught = []() noexcept {
    std::unique_ptr<int> p = Broken().value();
    std::printf("%d\n", *p);
  };
  EXPECT_DEATH(uncaught(), "StatusOr::value\\(\\) on an error: INVALID_ARGUMENT: OOMGUARD_FAULTS: rule 1 'oom@stpe=3'");
}

}  // namespace
}  // namespace oomguard
