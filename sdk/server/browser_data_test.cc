// StoreData (SQL per request over several stores) must answer every view as
// the in-memory index answers it over the same incidents: the index is the
// reference (IndexData), the stores are two SQLite files whose runs and
// fingerprint groups span both.
#include "sdk/server/browser_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "sdk/server/snapshot.h"

namespace oomguard::server {
namespace {

Incident Make(int k) {
  Incident i;
  char id[16];
  std::snprintf(id, sizeof(id), "i%03d", k);
  i.id = id;
  i.run_id = k % 5 == 0 ? "" : "run-" + std::to_string(k % 4);  // runs in both files; some without
  i.time_unix_ms = 1000 + (k % 17) * 10;                       // ties on time, broken by id
  i.host = "host" + std::to_string(k % 2);
  i.rank = k % 3;
  i.step = k * 7 % 23;
  i.phase = k % 2 ? Phase::kForward : Phase::kBackward;
  i.kind = IncidentKind::kDevice;
  i.workload = "w" + std::to_string(k % 3);
  i.pattern = k % 4 == 0 ? "fragmentation" : "activation_spike";
  i.fingerprint = i.pattern.substr(0, 4) + "-" + i.workload;
  i.outcome = k % 6 == 0 ? IncidentOutcome::kFailed : k % 6 == 1 ? IncidentOutcome::kRolledBack
                                                                  : IncidentOutcome::kRecovered;
  i.message = k % 9 == 0 ? "CUDA out of memory in the Attention block" : "out of memory";
  return i;
}

class BrowserDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("og_browser_data_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    std::vector<Incident> files[2];
    for (int k = 0; k < 60; ++k) {
      Incident i = Make(k);
      all_.push_back(i);
      files[k % 2].push_back(i);
    }
    for (int f = 0; f < 2; ++f) {
      KnowledgeBaseOptions o;
      o.classify = false;
      auto kb = KnowledgeBase::Open((dir_ / ("host-" + std::to_string(f) + ".db")).string(), o).value();
      ASSERT_TRUE(kb->Insert(files[f]).ok());
    }
    specs_ = {(dir_ / "host-*.db").string()};
    auto set = kb::KnowledgeBaseSet::Open(specs_);
    ASSERT_TRUE(set.ok()) << set.status();
    auto index = LoadIndex(&*set);
    ASSERT_TRUE(index.ok()) << index.status();
    reference_ = std::make_unique<IndexData>([idx = *index] { return idx; });
    auto stores = StoreData::Open(specs_, 0);
    ASSERT_TRUE(stores.ok()) << stores.status();
    stores_ = std::move(stores).value();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
  std::vector<Incident> all_;
  std::vector<std::string> specs_;
  std::unique_ptr<IndexData> reference_;
  std::unique_ptr<StoreData> stores_;
};

std::vector<std::string> Ids(const std::vector<Incident>& v) {
  std::vector<std::string> out;
  for (const Incident& i : v) out.push_back(i.id);
  return out;
}

TEST_F(BrowserDataTest, PagesFiltersAndCountsAsTheIndex) {
  std::vector<IncidentQuery> queries(8);
  queries[1].pattern = "fragmentation";
  queries[2].rank = 2;
  queries[3].run_id = "run-1";
  queries[4].workload = "w2";
  queries[4].since_unix_ms = 1080;
  queries[5].text = "ATTENTION";
  queries[6].outcome = "rolled_back";
  queries[7].fingerprint = "acti-w1";
  for (size_t n = 0; n < queries.size(); ++n) {
    for (int64_t offset : {0, 3, 25, 59, 70}) {
      IncidentQuery q = queries[n];
      q.offset = offset;
      q.limit = 7;
      auto want = reference_->List(q);
      auto got = stores_->List(q);
      ASSERT_TRUE(want.ok() && got.ok()) << got.status();
      EXPECT_EQ(got->total, want->total) << "query " << n << " offset " << offset;
      EXPECT_EQ(Ids(got->items), Ids(want->items)) << "query " << n << " offset " << offset;
    }
  }
}

TEST_F(BrowserDataTest, GroupsRunsAndTotalsAsTheIndexAcrossTwoStores) {
  for (IncidentQuery q : {IncidentQuery{}, IncidentQuery{.pattern = "fragmentation"}, IncidentQuery{.workload = "w1"}}) {
    auto want = reference_->Groups(q);
    auto got = stores_->Groups(q);
    ASSERT_TRUE(want.ok() && got.ok()) << got.status();
    ASSERT_EQ(got->size(), want->size());
    for (size_t k = 0; k < want->size(); ++k) {
      const IncidentGroup &g = (*got)[k], &w = (*want)[k];
      EXPECT_EQ(g.fingerprint, w.fingerprint);
      EXPECT_EQ(g.count, w.count) << w.fingerprint;
      EXPECT_EQ(g.runs, w.runs) << w.fingerprint;  // a run in both files counts once
      EXPECT_EQ(g.first_seen_unix_ms, w.first_seen_unix_ms);
      EXPECT_EQ(g.last_seen_unix_ms, w.last_seen_unix_ms);
      EXPECT_EQ(g.pattern, w.pattern);
      EXPECT_EQ(g.workload, w.workload);
    }
  }
  auto want_runs = reference_->Runs();
  auto got_runs = stores_->Runs();
  ASSERT_TRUE(want_runs.ok() && got_runs.ok()) << got_runs.status();
  ASSERT_EQ(got_runs->size(), want_runs->size());
  for (size_t k = 0; k < want_runs->size(); ++k) {
    const RunSummary &r = (*got_runs)[k], &w = (*want_runs)[k];
    EXPECT_EQ(r.run_id, w.run_id);
    EXPECT_EQ(r.incidents, w.incidents);
    EXPECT_EQ(r.failed, w.failed);
    EXPECT_EQ(r.first_unix_ms, w.first_unix_ms);
    EXPECT_EQ(r.last_unix_ms, w.last_unix_ms);
    EXPECT_EQ(r.first_step, w.first_step);
    EXPECT_EQ(r.last_step, w.last_step);
    EXPECT_EQ(r.hosts, w.hosts);
  }
  auto timeline = stores_->Run("run-2");
  auto want_timeline = reference_->Run("run-2");
  ASSERT_TRUE(timeline.ok() && want_timeline.ok());
  EXPECT_EQ(Ids(*timeline), Ids(*want_timeline));
  EXPECT_TRUE(stores_->Run("no-such-run")->empty());

  auto t = stores_->Totals();
  auto w = reference_->Totals();
  ASSERT_TRUE(t.ok() && w.ok()) << t.status();
  EXPECT_EQ(t->stats.incidents, 60);
  EXPECT_EQ(t->stats.by_pattern, w->stats.by_pattern);
  EXPECT_EQ(t->by_rank, w->by_rank);
  EXPECT_EQ(t->runs, w->runs);
  EXPECT_EQ(t->groups, w->groups);
  EXPECT_EQ(t->last_incident_unix_ms, w->last_incident_unix_ms);
  ASSERT_TRUE(t->last_recovered && w->last_recovered);
  EXPECT_EQ(t->last_recovered->id, w->last_recovered->id);
  EXPECT_EQ(t->stats.files.size(), 2u);
}

TEST_F(BrowserDataTest, FindsOneIncidentAndSeesNewOnesWithoutALoad) {
  auto one = stores_->Find("i007");
  ASSERT_TRUE(one.ok() && one->has_value());
  EXPECT_EQ((*one)->message, Make(7).message);
  EXPECT_FALSE(stores_->Find("i999")->has_value());
  EXPECT_EQ(stores_->Totals()->stats.incidents, 60);
  {
    KnowledgeBaseOptions o;
    o.classify = false;
    auto kb = KnowledgeBase::Open((dir_ / "host-0.db").string(), o).value();
    Incident late = Make(99);
    late.time_unix_ms = 5000;
    ASSERT_TRUE(kb->Insert({late}).ok());
  }
  // poll 0: the stores are asked on every request; the totals are read again.
  EXPECT_EQ(stores_->Totals()->stats.incidents, 61);
  EXPECT_EQ(stores_->List({.limit = 1})->items.at(0).id, "i099");
}

}  // namespace
}  // namespace oomguard::server
