#include "sdk/kb/jsonl.h"

#include <gtest/gtest.h>

#include <sstream>

namespace oomguard::kb {
namespace {

TEST(Jsonl, ReadsRecordsSkippingBlankLinesAndCarriageReturns) {
  std::istringstream in("{\"id\":\"a\",\"step\":3}\r\n\n   \n{\"id\":\"b\"}");
  auto r = ReadIncidentsJsonl(in, "x.jsonl", BadLine::kError);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->incidents.size(), 2u);
  EXPECT_EQ(r->incidents[0].id, "a");
  EXPECT_EQ(r->incidents[0].step, 3);
  EXPECT_EQ(r->incidents[1].id, "b");
  EXPECT_EQ(r->skipped, 0);
}

TEST(Jsonl, StrictNamesTheBadLineLenientSkipsIt) {
  const std::string text = "{\"id\":\"a\"}\n{\"id\":\"torn\",\"ste\n{\"id\":\"c\"}\n";
  std::istringstream strict(text);
  auto bad = ReadIncidentsJsonl(strict, "x.jsonl", BadLine::kError);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message().rfind("x.jsonl:2: ", 0), 0u) << bad.status().message();

  std::istringstream lenient(text);
  auto ok = ReadIncidentsJsonl(lenient, "x.jsonl", BadLine::kSkip);
  ASSERT_TRUE(ok.ok());
  ASSERT_EQ(ok->incidents.size(), 2u);
  EXPECT_EQ(ok->incidents[1].id, "c");
  EXPECT_EQ(ok->skipped, 1);
}

TEST(Jsonl, AnOverlongLineIsNotReadWhole) {
  const std::string text = "{\"id\":\"a\"}\n" + std::string(kMaxJsonlLineBytes + 10, 'x') + "\n{\"id\":\"c\"}\n";
  std::istringstream strict(text);
  auto bad = ReadIncidentsJsonl(strict, "big", BadLine::kError);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("big:2: line is longer than 1 MiB"), std::string::npos);
  std::istringstream lenient(text);
  auto ok = ReadIncidentsJsonl(lenient, "big", BadLine::kSkip);
  ASSERT_TRUE(ok.ok());
  ASSERT_EQ(ok->incidents.size(), 2u);  // the rest of the long line is not taken for a line
  EXPECT_EQ(ok->skipped, 1);
}

TEST(Jsonl, AMissingFileIsNotFound) {
  auto r = ReadIncidentsJsonlFile("/nonexistent/dir/x.jsonl", BadLine::kError);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace oomguard::kb
