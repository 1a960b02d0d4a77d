#include "oomguard/knowledge_base.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "oomguard/faults.h"
#include "sdk/kb/store.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

class KnowledgeBaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("oomguard-kb-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "kb.db").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  static Incident Make(const std::string& id, int64_t step, const std::string& workload = "w") {
    Incident i;
    i.id = id;
    i.run_id = "run1";
    i.time_unix_ms = 1000 + step;
    i.step = step;
    i.phase = Phase::kForward;
    i.kind = IncidentKind::kDevice;
    i.workload = workload;
    i.requested_bytes = 1 << 20;
    i.outcome = IncidentOutcome::kPending;
    return i;
  }

  fs::path dir_;
  std::string path_;
};

TEST_F(KnowledgeBaseTest, RecordThenUpdateOutcomeStoresClassifiedIncident) {
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_TRUE(kb.ok()) << kb.status();
  Incident i = Make("a1", 0);
  i.steps_ok_before = 0;
  (*kb)->sink()->Record(i);
  i.outcome = IncidentOutcome::kRecovered;
  i.micro_after = 8;
  i.recovery_ms = 0.5;
  (*kb)->sink()->UpdateOutcome(i);
  ASSERT_TRUE((*kb)->Flush().ok());
  auto rows = (*kb)->Query({});
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].outcome, IncidentOutcome::kRecovered);
  EXPECT_EQ((*rows)[0].micro_after, 8);
  EXPECT_EQ((*rows)[0].pattern, "startup_capacity");
  EXPECT_EQ((*rows)[0].fingerprint.size(), 16u);
  SinkStats st = (*kb)->sink_stats();
  EXPECT_EQ(st.enqueued, 2);
  EXPECT_EQ(st.written, 2);
  EXPECT_EQ(st.dropped, 0);
}

TEST_F(KnowledgeBaseTest, InjectedWriteFailureIsCountedAndLaterWritesSucceed) {
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_TRUE(kb.ok()) << kb.status();
  ASSERT_TRUE(SetFaultRules("oom@site=kb_write").ok());
  (*kb)->sink()->Record(Make("f1", 1));
  Status first = (*kb)->Flush();
  ClearFaultRules();
  EXPECT_EQ(first.code(), StatusCode::kResourceExhausted) << first;
  EXPECT_GE((*kb)->sink_stats().write_errors, 1);
  (*kb)->sink()->Record(Make("f2", 2));
  ASSERT_TRUE((*kb)->Flush().ok());
  auto rows = (*kb)->Query({});
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u) << "the failed batch is lost, the next one is written";
  EXPECT_EQ((*rows)[0].id, "f2");
}

TEST_F(KnowledgeBaseTest, QueryFiltersAndGroups) {
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_TRUE(kb.ok());
  std::vector<Incident> incs;
  for (int k = 0; k < 5; ++k) {
    Incident i = Make("id" + std::to_string(k), 10 + k);
    i.rank = k % 2;
    i.run_id = k < 3 ? "runA" : "runB";
    incs.push_back(i);
  }
  ASSERT_TRUE((*kb)->Insert(incs).ok());
  IncidentQuery q;
  q.rank = 1;
  EXPECT_EQ((*kb)->Query(q)->size(), 2u);
  q = {};
  q.run_id = "runB";
  EXPECT_EQ((*kb)->Query(q)->size(), 2u);
  q = {};
  q.limit = 2;
  auto newest = (*kb)->Query(q);
  ASSERT_EQ(newest->size(), 2u);
  EXPECT_EQ((*newest)[0].id, "id4");
  q = {};
  q.since_unix_ms = 1013;
  EXPECT_EQ((*kb)->Query(q)->size(), 2u);
  auto groups = (*kb)->Groups();
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->size(), 1u);  // same pattern/kind/phase/workload/bucket: one group
  EXPECT_EQ((*groups)[0].count, 5);
  EXPECT_EQ((*groups)[0].runs, 2);
  EXPECT_EQ((*groups)[0].first_seen_unix_ms, 1010);
  EXPECT_EQ((*groups)[0].last_id, "id4");
}

TEST_F(KnowledgeBaseTest, PriorsComeFromRealOomsAndGrowFromCleanSteps) {
  {
    // A session whose only OOM was injected met no limit: it learned
    // nothing, and the next run must not start at the halved size.
    auto kb = KnowledgeBase::Open(path_);
    ASSERT_TRUE(kb.ok());
    EXPECT_FALSE((*kb)->PriorMicroBatch("w").has_value());
    EXPECT_EQ((*kb)->RecordCleanMicroBatch("", 4).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*kb)->RecordCleanMicroBatch("w", 0).code(), StatusCode::kInvalidArgument);
    Incident injected = Make("injected", 0);
    injected.injected = true;
    (*kb)->sink()->Record(injected);
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 32).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_FALSE((*kb)->PriorMicroBatch("w").has_value()) << "an injected OOM taught a prior";
  }
  {
    // A real OOM: the session's clean size after it is the prior.
    auto kb = KnowledgeBase::Open(path_);
    (*kb)->sink()->Record(Make("oom1", 3));
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 64).ok());
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 32).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_EQ((*kb)->PriorMicroBatch("w"), 64);
  }
  {
    // A new session without OOMs only raises the prior.
    auto kb = KnowledgeBase::Open(path_);
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 16).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_EQ((*kb)->PriorMicroBatch("w"), 64);
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 96).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_EQ((*kb)->PriorMicroBatch("w"), 96);
  }
  {
    // After an OOM for the workload, the session's clean size replaces it.
    auto kb = KnowledgeBase::Open(path_);
    (*kb)->sink()->Record(Make("oom2", 3));
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 24).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_EQ((*kb)->PriorMicroBatch("w"), 24);
    EXPECT_FALSE((*kb)->PriorMicroBatch("other").has_value());
  }
}

TEST_F(KnowledgeBaseTest, PriorModelsRoundTripAndTheLatestReplacesThem) {
  SizeModel m;
  m.fixed_bytes = 96.0 * (1 << 20);
  m.unit_bytes = 24.5 * (1 << 20);
  m.overhead_bytes = 1.5 * (1 << 30);
  m.overhead = 0.067;
  m.overhead_too_small = 0.033;
  m.noise_bytes = 8192;
  {
    auto kb = KnowledgeBase::Open(path_);
    ASSERT_TRUE(kb.ok());
    EXPECT_FALSE((*kb)->PriorModel("w").has_value());
    EXPECT_EQ((*kb)->RecordModel("", m).code(), StatusCode::kInvalidArgument);
    SizeModel flat = m;
    flat.unit_bytes = 0;
    EXPECT_EQ((*kb)->RecordModel("w", flat).code(), StatusCode::kInvalidArgument);
    (*kb)->sink()->Record(Make("oom", 3));  // a size prior comes from a session that met a real OOM
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 3900).ok());
    ASSERT_TRUE((*kb)->RecordModel("w", m).ok());
    const int64_t queued = (*kb)->sink_stats().enqueued;
    SizeModel same = m;
    same.unit_bytes *= 1.001;  // the steady state's jitter
    ASSERT_TRUE((*kb)->RecordModel("w", same).ok());
    EXPECT_EQ((*kb)->sink_stats().enqueued, queued) << "a model within 1% is not written again";
    ASSERT_TRUE((*kb)->Flush().ok());
  }
  auto kb = KnowledgeBase::Open(path_);
  auto got = (*kb)->PriorModel("w");
  ASSERT_TRUE(got.has_value());
  EXPECT_DOUBLE_EQ(got->fixed_bytes, m.fixed_bytes);
  EXPECT_DOUBLE_EQ(got->unit_bytes, m.unit_bytes);
  EXPECT_DOUBLE_EQ(got->overhead_bytes, m.overhead_bytes);
  EXPECT_DOUBLE_EQ(got->overhead, m.overhead);
  EXPECT_DOUBLE_EQ(got->overhead_too_small, m.overhead_too_small);
  EXPECT_DOUBLE_EQ(got->noise_bytes, m.noise_bytes);
  EXPECT_FALSE((*kb)->PriorModel("other").has_value());
  auto stats = (*kb)->Stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->priors.size(), 1u);
  EXPECT_EQ(stats->priors[0].micro_batch, 3900);
  ASSERT_TRUE(stats->priors[0].model.has_value());
  EXPECT_DOUBLE_EQ(stats->priors[0].model->unit_bytes, m.unit_bytes);
  // A later session's model replaces it (another device, other conditions).
  SizeModel later = m;
  later.overhead = 0.12;
  ASSERT_TRUE((*kb)->RecordModel("w", later).ok());
  ASSERT_TRUE((*kb)->Flush().ok());
  EXPECT_DOUBLE_EQ((*kb)->PriorModel("w")->overhead, 0.12);
}

TEST_F(KnowledgeBaseTest, StoredModelsThatDoNotParseAreNoPrior) {
  EXPECT_FALSE(kb::SizeModelFromJson("not json").has_value());
  EXPECT_FALSE(kb::SizeModelFromJson("{\"unit_bytes\": 0}").has_value());
  EXPECT_FALSE(kb::SizeModelFromJson("{\"unit_bytes\": 5, \"overhead\": -1}").has_value());
  auto m = kb::SizeModelFromJson("{\"unit_bytes\": 5, \"a_later_field\": 1}");
  ASSERT_TRUE(m.has_value()) << "fields added later are ignored, missing ones are 0";
  EXPECT_EQ(m->unit_bytes, 5);
  EXPECT_EQ(m->overhead, 0);
}

TEST_F(KnowledgeBaseTest, FullQueueDropsAndCountsWithoutBlocking) {
  KnowledgeBaseOptions o;
  o.queue_capacity = 4;
  auto kb = KnowledgeBase::Open(path_, o);
  ASSERT_TRUE(kb.ok());
  // Hold the writer on a lock so the queue cannot drain while we overfill it.
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &other), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "BEGIN EXCLUSIVE", nullptr, nullptr, nullptr), SQLITE_OK);
  auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < 200; ++k) (*kb)->sink()->Record(Make("d" + std::to_string(k), k));
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 500.0);  // 200 records; none may wait for the lock (busy timeout is 5 s)
  ASSERT_EQ(sqlite3_exec(other, "COMMIT", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  ASSERT_TRUE((*kb)->Flush().ok());
  SinkStats st = (*kb)->sink_stats();
  EXPECT_GE(st.dropped, 190);
  EXPECT_EQ(st.enqueued + st.dropped, 200);
  auto stats = (*kb)->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->incidents, st.written);
  EXPECT_EQ(stats->dropped_recorded, st.dropped);  // the drops are recorded in the file
}

TEST_F(KnowledgeBaseTest, LockedDatabaseFailsWritesWithClearErrorAndRecovers) {
  KnowledgeBaseOptions o;
  o.busy_timeout_ms = 50;
  auto kb = KnowledgeBase::Open(path_, o);
  ASSERT_TRUE(kb.ok());
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &other), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "BEGIN EXCLUSIVE", nullptr, nullptr, nullptr), SQLITE_OK);
  (*kb)->sink()->Record(Make("x1", 1));
  Status s = (*kb)->Flush();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(path_), std::string::npos);
  EXPECT_EQ((*kb)->sink_stats().write_errors, 1);
  ASSERT_EQ(sqlite3_exec(other, "COMMIT", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  (*kb)->sink()->Record(Make("x2", 2));
  EXPECT_TRUE((*kb)->Flush().ok());
  EXPECT_EQ((*kb)->Query({})->size(), 1u);
}

TEST_F(KnowledgeBaseTest, CorruptFileIsDataLossNamingThePath) {
  {
    std::ofstream f(path_, std::ios::binary);
    f << std::string(8192, 'z');
  }
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kDataLoss) << kb.status();
  EXPECT_NE(kb.status().message().find(path_), std::string::npos);
}

TEST_F(KnowledgeBaseTest, MissingFileWithoutCreateIsNotFound) {
  KnowledgeBaseOptions o;
  o.create_if_missing = false;
  auto kb = KnowledgeBase::Open(path_, o);
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kNotFound);
  o.queue_capacity = 0;
  EXPECT_EQ(KnowledgeBase::Open(path_, o).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(KnowledgeBaseTest, MigratesVersionOneAndRefusesNewer) {
  {
    // A version-1 file as an earlier build wrote it: incidents but no priors.
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db,
                           "CREATE TABLE schema_version(version INTEGER NOT NULL); INSERT INTO schema_version "
                           "VALUES(1); CREATE TABLE incidents(id TEXT PRIMARY KEY, run_id TEXT NOT NULL DEFAULT '',"
                           " time_unix_ms INTEGER NOT NULL DEFAULT 0, host TEXT NOT NULL DEFAULT '', rank INTEGER"
                           " NOT NULL DEFAULT 0, step INTEGER NOT NULL DEFAULT 0, phase TEXT NOT NULL DEFAULT '',"
                           " kind TEXT NOT NULL DEFAULT '', workload TEXT NOT NULL DEFAULT '', pattern TEXT NOT NULL"
                           " DEFAULT '', confidence REAL NOT NULL DEFAULT 0, fingerprint TEXT NOT NULL DEFAULT '',"
                           " outcome TEXT NOT NULL DEFAULT '', body TEXT NOT NULL);"
                           "INSERT INTO incidents(id, body) VALUES('old', '{\"id\":\"old\",\"step\":5}');",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  {
    auto kb = KnowledgeBase::Open(path_);
    ASSERT_TRUE(kb.ok()) << kb.status();
    EXPECT_EQ((*kb)->Query({})->at(0).step, 5);
    ASSERT_TRUE((*kb)->RecordCleanMicroBatch("w", 8).ok());
    ASSERT_TRUE((*kb)->Flush().ok());
    EXPECT_EQ((*kb)->Stats()->schema_version, KnowledgeBase::SchemaVersion());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE schema_version SET version=99", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(kb.status().message().find("99"), std::string::npos);
}

TEST_F(KnowledgeBaseTest, MigratesVersionTwoKeepingItsPriors) {
  {
    // A version-2 file: size priors, no models, no notes, no search column
    // or browser indexes; one incident.
    auto store = kb::Store::Open(path_, 1000, true);
    ASSERT_TRUE(store.ok());
    Incident old;
    old.id = "mg01";
    old.message = "Boom in the Attention layer";
    ASSERT_TRUE((*store)->Write({old}, {}, 0).ok());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db,
                         "DROP TABLE prior_models; DROP TABLE notes; DROP INDEX incidents_newest;"
                         "DROP INDEX incidents_pattern_newest; DROP INDEX incidents_workload_newest;"
                         "DROP INDEX incidents_outcome_newest; DROP INDEX incidents_groups; DROP INDEX incidents_kind;"
                         "DROP INDEX incidents_rank; DROP INDEX incidents_run_hosts; DROP INDEX incidents_runs;"
                         "ALTER TABLE incidents DROP COLUMN search; UPDATE schema_version SET version=2;"
                         "INSERT INTO priors(workload, micro_batch, updated_unix_ms) VALUES('w', 48, 1);",
                         nullptr, nullptr, nullptr),
            SQLITE_OK)
      << sqlite3_errmsg(db);
  sqlite3_close(db);
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_TRUE(kb.ok()) << kb.status();
  // The migration to 5 filled the search column from the stored record.
  EXPECT_EQ((*kb)->Query({.text = "ATTENTION layer"})->size(), 1u);
  EXPECT_EQ((*kb)->Query({.text = "attention%"})->size(), 0u);  // '%' is no wildcard
  EXPECT_EQ((*kb)->PriorMicroBatch("w"), 48);
  EXPECT_FALSE((*kb)->PriorModel("w").has_value());
  SizeModel m;
  m.unit_bytes = 1 << 20;
  ASSERT_TRUE((*kb)->RecordModel("w", m).ok());
  ASSERT_TRUE((*kb)->Flush().ok());
  EXPECT_TRUE((*kb)->PriorModel("w").has_value());
  EXPECT_EQ((*kb)->Stats()->schema_version, KnowledgeBase::SchemaVersion());
}

// A reader of a version-2 file (an older build's, never migrated since a
// reader does not migrate): sizes, no models, no missing-table error.
TEST_F(KnowledgeBaseTest, ReaderOfVersionTwoSeesSizesAndNoModels) {
  {
    auto store = kb::Store::Open(path_, 1000, true);
    ASSERT_TRUE(store.ok());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db,
                         "DROP TABLE prior_models; DROP TABLE notes; UPDATE schema_version SET version=2;"
                         "INSERT INTO priors(workload, micro_batch, updated_unix_ms) VALUES('w', 48, 1);"
                         "PRAGMA journal_mode=DELETE;",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto kb = KnowledgeBase::Open(path_, ro);
  ASSERT_TRUE(kb.ok()) << kb.status();
  auto stats = (*kb)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->schema_version, 2);
  ASSERT_EQ(stats->priors.size(), 1u);
  EXPECT_EQ(stats->priors[0].micro_batch, 48);
  EXPECT_FALSE(stats->priors[0].model.has_value());
  EXPECT_EQ((*kb)->PriorMicroBatch("w"), 48);
  EXPECT_FALSE((*kb)->PriorModel("w").has_value());
}

TEST_F(KnowledgeBaseTest, WalModeIsOn) {
  auto kb = KnowledgeBase::Open(path_);
  ASSERT_TRUE(kb.ok());
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_step(st), SQLITE_ROW);
  EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(st, 0)), "wal");
  sqlite3_finalize(st);
  sqlite3_close(db);
}

// Readers (issue 15, items 6 and 7) never create, migrate or write a file.
TEST_F(KnowledgeBaseTest, ReaderNeverCreatesOrChangesAFile) {
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  EXPECT_EQ(KnowledgeBase::Open(path_, ro).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(path_));
  std::ofstream(path_).close();  // 0 bytes
  auto empty = KnowledgeBase::Open(path_, ro);
  EXPECT_EQ(empty.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos) << empty.status();
  EXPECT_EQ(fs::file_size(path_), 0u);
  fs::remove(path_);
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE users(name TEXT)", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }
  const auto size = fs::file_size(path_);
  for (bool read_only : {true, false}) {
    KnowledgeBaseOptions o;
    o.read_only = read_only;
    auto other = KnowledgeBase::Open(path_, o);
    EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(other.status().message().find("not an oomguard knowledge base"), std::string::npos)
        << other.status();
  }
  EXPECT_EQ(fs::file_size(path_), size);
  EXPECT_FALSE(fs::exists(path_ + "-wal"));
  EXPECT_FALSE(fs::exists(path_ + "-shm"));
}

// A reader opened while no writer had the file (read as an immutable file)
// still sees what a writer commits afterwards.
TEST_F(KnowledgeBaseTest, ReaderSeesLaterWritesAndLeavesNothing) {
  ASSERT_TRUE(KnowledgeBase::Open(path_).value()->Insert({Make("first", 1)}).ok());
  ASSERT_FALSE(fs::exists(path_ + "-wal"));
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto reader = KnowledgeBase::Open(path_, ro);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->Query({})->size(), 1u);
  {
    auto writer = KnowledgeBase::Open(path_).value();
    ASSERT_TRUE(writer->Insert({Make("second", 2)}).ok());
    auto rows = (*reader)->Query({});  // the writer is still open: its -wal holds "second"
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_EQ(rows->size(), 2u);
  }
  auto rows = (*reader)->Query({});  // the writer checkpointed into the file and removed its -wal
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->size(), 2u);
  EXPECT_EQ((*reader)->Stats()->incidents, 2);
  // The writer closed while the reader still read its -wal, so it left its
  // -wal and -shm (SQLite removes them with the last connection). They are
  // the writer's: the next writer uses and removes them.
  reader->reset();
  KnowledgeBase::Open(path_).value().reset();
  EXPECT_FALSE(fs::exists(path_ + "-wal"));
  EXPECT_FALSE(fs::exists(path_ + "-shm"));
}

// What a reader is asked to write is lost, and counted as lost.
TEST_F(KnowledgeBaseTest, ReaderCountsWritesAsLost) {
  ASSERT_TRUE(KnowledgeBase::Open(path_).ok());
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto reader = KnowledgeBase::Open(path_, ro).value();
  reader->sink()->Record(Make("x", 1));
  ASSERT_TRUE(reader->RecordCleanMicroBatch("w", 4).ok());
  EXPECT_EQ(reader->Flush().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(reader->sink_stats().lost(), 2);
  EXPECT_EQ(reader->Insert({Make("y", 2)}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(reader->Query({})->size(), 0u);
}

}  // namespace
}  // namespace oomguard
