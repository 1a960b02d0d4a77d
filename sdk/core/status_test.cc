#include "oomguard/status.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace oomguard
