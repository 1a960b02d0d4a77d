#include "sdk/kb/file_set.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

namespace oomguard::kb {
namespace {

Incident Make(const std::string& id, int64_t t, const std::string& pattern, const std::string& run, int rank) {
  Incident i;
  i.id = id;
  i.time_unix_ms = t;
  i.pattern = pattern;
  i.run_id = run;
  i.rank = rank;
  i.fingerprint = "fp-" + pattern;
  return i;
}

TEST(ParseSince, DurationsDatesAndMilliseconds) {
  const int64_t now = 10'000'000'000;
  EXPECT_EQ(*ParseSince("", now), 0);
  EXPECT_EQ(*ParseSince("30m", now), now - 30 * 60'000);
  EXPECT_EQ(*ParseSince("12h", now), now - 12 * 3'600'000);
  EXPECT_EQ(*ParseSince("7d", now), now - 7 * 86'400'000);
  EXPECT_EQ(*ParseSince("1714521600000", now), 1714521600000);
  EXPECT_EQ(*ParseSince("2024-05-01", now), 1714521600000);
  EXPECT_EQ(*ParseSince("999999999d", now), 0);  // longer than the epoch: everything
}

TEST(ParseSince, RejectsWithTheText) {
  for (const char* bad : {"yesterday", "5w", "-3h", "2024-05-01x", "2024-13-45"}) {
    auto r = ParseSince(bad, 1000);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
  }
}

TEST(MatchesQuery, EveryFilter) {
  Incident i = Make("abcdef", 5000, "fragmentation", "run-1", 2);
  i.workload = "w";
  EXPECT_TRUE(MatchesQuery(i, {}));
  IncidentQuery q;
  q.pattern = "fragmentation";
  q.rank = 2;
  q.run_id = "run-1";
  q.workload = "w";
  q.fingerprint = "fp-fragmentation";
  q.id_prefix = "abc";
  q.since_unix_ms = 5000;
  EXPECT_TRUE(MatchesQuery(i, q));
  auto miss = [&](auto mutate) {
    IncidentQuery m = q;
    mutate(&m);
    return !MatchesQuery(i, m);
  };
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->pattern = "workspace"; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->rank = 0; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->run_id = "run-2"; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->workload = "x"; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->fingerprint = "fp"; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->id_prefix = "abd"; }));
  EXPECT_TRUE(miss([](IncidentQuery* m) { m->since_unix_ms = 5001; }));
}

TEST(GroupIncidents, CountsRunsOnceAndOrdersByCount) {
  std::vector<Incident> v = {Make("a", 10, "p", "r1", 0), Make("b", 30, "p", "r1", 1), Make("c", 20, "p", "r2", 0),
                             Make("d", 40, "q", "r3", 0)};
  auto g = GroupIncidents(v);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].pattern, "p");
  EXPECT_EQ(g[0].count, 3);
  EXPECT_EQ(g[0].runs, 2);
  EXPECT_EQ(g[0].first_seen_unix_ms, 10);
  EXPECT_EQ(g[0].last_seen_unix_ms, 30);
  EXPECT_EQ(g[0].last_id, "b");
  EXPECT_EQ(g[1].count, 1);
}

TEST(KnowledgeBaseSet, MergesFilesNewestFirstAndLimitsTheMerge) {
  auto dir = std::filesystem::temp_directory_path() / ("og_fileset_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (int f = 0; f < 2; ++f) {
    auto kb = KnowledgeBase::Open((dir / ("host-" + std::to_string(f) + ".db")).string()).value();
    std::vector<Incident> incs;
    for (int k = 0; k < 3; ++k) incs.push_back(Make("f" + std::to_string(f) + "-" + std::to_string(k), 100 * k + f, "p", "r", f));
    ASSERT_TRUE(kb->Insert(incs).ok());
  }
  auto set = KnowledgeBaseSet::Open({(dir / "host-*.db").string()});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->size(), 2u);
  IncidentQuery q;
  q.limit = 4;
  auto r = set->Query(q);
  ASSERT_TRUE(r.ok());
  std::vector<std::string> ids;
  for (auto& i : *r) ids.push_back(i.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"f1-2", "f0-2", "f1-1", "f0-1"}));
  auto stats = set->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->incidents, 6);
  ASSERT_EQ(stats->files.size(), 2u);
  auto none = KnowledgeBaseSet::Open({(dir / "nothing-*.db").string()});
  EXPECT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no file matches"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace oomguard::kb
