// The knowledge base on a real PostgreSQL server (pg_server.sh: initdb in a
// temporary directory, stopped at the end): the same answers as SQLite for
// the same incidents, migrations, notes, shared priors, the spool while the
// server is away, and no password in any message.
#include <gtest/gtest.h>
#include <libpq-fe.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/jsonl.h"
#include "sdk/kb/store.h"
#include "tests/kb/pg_test_server.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

// SQL on the server, for what the knowledge base has no call for.
std::string Sql(const std::string& url, const std::string& sql) {
  PGconn* c = PQconnectdb(url.c_str());
  std::string out;
  if (PQstatus(c) == CONNECTION_OK) {
    PGresult* r = PQexec(c, sql.c_str());
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) > 0) out = PQgetvalue(r, 0, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK && PQresultStatus(r) != PGRES_COMMAND_OK)
      out = std::string("ERROR ") + PQerrorMessage(c);
    PQclear(r);
  } else {
    out = std::string("ERROR ") + PQerrorMessage(c);
  }
  PQfinish(c);
  return out;
}

std::vector<Incident> Corpus() {
  auto r = kb::ReadIncidentsJsonlFile(std::string(OOMGUARD_KB_TESTDATA) + "/patterns.jsonl", kb::BadLine::kError);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r->incidents) : std::vector<Incident>();
}

Incident Simple(const std::string& id, int64_t time, const std::string& workload = "w") {
  Incident i;
  i.id = id;
  i.run_id = "run-" + id.substr(0, 2);
  i.time_unix_ms = time;
  i.kind = IncidentKind::kDevice;
  i.phase = Phase::kBackward;
  i.workload = workload;
  i.requested_bytes = 1 << 20;
  i.steps_ok_before = 100;
  return i;
}

class KbPgTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(server_.url().empty()) << server_.error();
    spool_ = server_.dir() + "/spool";
  }
  KnowledgeBaseOptions Options() const {
    KnowledgeBaseOptions o;
    o.spool_dir = spool_;
    o.retry_interval_ms = 100;
    return o;
  }
  testing::PgTestServer server_;
  std::string spool_;
};

TEST_F(KbPgTest, SameAnswersAsSqliteForTheSameIncidents) {
  const std::vector<Incident> corpus = Corpus();
  ASSERT_GE(corpus.size(), 10u);
  const std::string file = server_.dir() + "/same.db";
  auto lite = KnowledgeBase::Open(file);
  auto pg = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_TRUE(lite.ok()) << lite.status();
  ASSERT_TRUE(pg.ok()) << pg.status();
  ASSERT_TRUE((*lite)->Insert(corpus).ok());
  ASSERT_TRUE((*pg)->Insert(corpus).ok());

  std::vector<IncidentQuery> queries(6);
  queries[1].limit = 3;
  queries[2].pattern = corpus[0].pattern.empty() ? "fragmentation" : corpus[0].pattern;
  queries[3].id_prefix = corpus[1].id.substr(0, 3);
  queries[4].limit = 4;
  queries[4].offset = 2;
  queries[5].rank = corpus[2].rank;
  for (const IncidentQuery& q : queries) {
    auto a = (*lite)->Query(q);
    auto b = (*pg)->Query(q);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    for (size_t i = 0; i < a->size(); ++i) EXPECT_EQ(IncidentToJson((*a)[i]), IncidentToJson((*b)[i]));
    EXPECT_EQ(*(*lite)->Count(q), *(*pg)->Count(q));
  }
  auto ga = (*lite)->Groups();
  auto gb = (*pg)->Groups();
  ASSERT_TRUE(gb.ok()) << gb.status();
  ASSERT_EQ(ga->size(), gb->size());
  for (size_t i = 0; i < ga->size(); ++i) {
    EXPECT_EQ((*ga)[i].fingerprint, (*gb)[i].fingerprint);
    EXPECT_EQ((*ga)[i].count, (*gb)[i].count);
    EXPECT_EQ((*ga)[i].pattern, (*gb)[i].pattern);
    EXPECT_EQ((*ga)[i].last_id, (*gb)[i].last_id);
  }
  auto sa = (*lite)->Stats();
  auto sb = (*pg)->Stats();
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sb->schema_version, KnowledgeBase::SchemaVersion());
  EXPECT_EQ(sa->incidents, sb->incidents);
  EXPECT_EQ(sa->by_pattern, sb->by_pattern);
  EXPECT_EQ(sa->by_outcome, sb->by_outcome);
  EXPECT_EQ(sa->by_kind, sb->by_kind);
  // The same incident JSON both ways, byte for byte.
  EXPECT_EQ(Sql(server_.url(), "SELECT body FROM incidents WHERE id = '" + corpus[0].id + "'"),
            IncidentToJson((*(*lite)->Query({.id_prefix = corpus[0].id}))[0]));
}

TEST_F(KbPgTest, MigratesAnOlderSchemaAndRefusesANewerOne) {
  {
    auto kb = KnowledgeBase::Open(server_.url(), Options());
    ASSERT_TRUE(kb.ok()) << kb.status();
    Incident old = Simple("mg01", 1000);
    old.message = "Boom in the Attention layer";
    ASSERT_TRUE((*kb)->Insert({old}).ok());
  }
  // Back to version 2 (no models, no notes, no search column or browser indexes), with a prior.
  ASSERT_EQ(Sql(server_.url(),
                "DROP TABLE prior_models; DROP TABLE notes; ALTER TABLE incidents DROP COLUMN search;"
                "DROP INDEX incidents_pattern_newest, incidents_outcome_newest, incidents_groups, incidents_kind,"
                " incidents_rank, incidents_run_hosts, incidents_runs;"
                "UPDATE schema_version SET version=2; INSERT INTO priors VALUES('w', 48, 1)"),
            "");
  {
    KnowledgeBaseOptions ro;
    ro.read_only = true;
    auto reader = KnowledgeBase::Open(server_.url(), ro);  // a reader never migrates
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ((*reader)->Stats()->schema_version, 2);
    EXPECT_EQ((*reader)->PriorMicroBatch("w"), 48);
    EXPECT_EQ((*reader)->Query({.text = "attention"})->size(), 1u);  // no search column: the record is read
  }
  {
    auto kb = KnowledgeBase::Open(server_.url(), Options());
    ASSERT_TRUE(kb.ok()) << kb.status();
    EXPECT_EQ((*kb)->PriorMicroBatch("w"), 48);
    EXPECT_EQ((*kb)->Stats()->schema_version, KnowledgeBase::SchemaVersion());
    // The migration filled the search column of the incident already there.
    EXPECT_EQ(Sql(server_.url(), "SELECT search LIKE '%boom in the attention layer%' FROM incidents WHERE id = 'mg01'"),
              "t");
    EXPECT_EQ((*kb)->Query({.text = "ATTENTION"})->size(), 1u);
    EXPECT_EQ((*kb)->Query({.text = "attention_"})->size(), 0u);  // '_' is no wildcard
    EXPECT_TRUE((*kb)->SetNote({"fp", "fixed by expandable_segments", "ana", 0}).ok());
  }
  ASSERT_EQ(Sql(server_.url(), "UPDATE schema_version SET version=99"), "");
  auto kb = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(kb.status().message().find("99"), std::string::npos);
}

TEST_F(KbPgTest, RefusesADatabaseThatIsNotAKnowledgeBase) {
  ASSERT_EQ(Sql(server_.url(), "CREATE TABLE payroll(x int)"), "");
  auto kb = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(kb.status().message().find("payroll"), std::string::npos);
  EXPECT_EQ(Sql(server_.url(), "SELECT to_regclass('incidents') IS NULL"), "t");
}

TEST_F(KbPgTest, NotesAndSharedPriors) {
  Incident oom = Simple("aa01", 1000, "mlp-h256");
  {
    // Job 1 (any host): met a real OOM, then ran clean at 24.
    auto job = KnowledgeBase::Open(server_.url(), Options());
    ASSERT_TRUE(job.ok()) << job.status();
    (*job)->sink()->Record(oom);
    ASSERT_TRUE((*job)->RecordCleanMicroBatch("mlp-h256", 24).ok());
    ASSERT_TRUE((*job)->Flush().ok());
  }
  // Job 2, a new process: starts from what job 1 learned.
  auto job2 = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_TRUE(job2.ok()) << job2.status();
  EXPECT_EQ((*job2)->PriorMicroBatch("mlp-h256"), 24);
  EXPECT_FALSE((*job2)->PriorMicroBatch("other").has_value());

  auto stored = (*job2)->Query({.id_prefix = "aa01"});
  ASSERT_EQ(stored->size(), 1u);
  const std::string fp = (*stored)[0].fingerprint;
  ASSERT_FALSE(fp.empty());
  ASSERT_TRUE((*job2)->SetNote({fp, "fixed by expandable_segments", "ana", 0}).ok());
  ASSERT_TRUE((*job2)->SetNote({fp, "fixed by expandable_segments:True", "bo", 0}).ok());  // replaces
  auto notes = (*job2)->Notes();
  ASSERT_TRUE(notes.ok()) << notes.status();
  ASSERT_EQ(notes->size(), 1u);
  EXPECT_EQ((*notes)[0].text, "fixed by expandable_segments:True");
  EXPECT_EQ((*notes)[0].author, "bo");
  EXPECT_GT((*notes)[0].updated_unix_ms, 0);
  ASSERT_TRUE((*job2)->SetNote({fp, "", "bo", 0}).ok());  // removes
  EXPECT_TRUE((*job2)->Notes()->empty());
  EXPECT_EQ((*job2)->SetNote({"", "x", "", 0}).code(), StatusCode::kInvalidArgument);

  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto reader = KnowledgeBase::Open(server_.url(), ro);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->PriorMicroBatch("mlp-h256"), 24);
  EXPECT_FALSE((*reader)->Insert({Simple("bb01", 1)}).ok());
}

TEST_F(KbPgTest, IncidentsWaitInTheSpoolWhileTheServerIsAwayAndArriveOnce) {
  auto kb = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_TRUE(kb.ok()) << kb.status();
  for (int i = 0; i < 10; ++i) (*kb)->sink()->Record(Simple("up" + std::to_string(i), 1000 + i));
  ASSERT_TRUE((*kb)->Flush().ok());

  ASSERT_TRUE(server_.Stop());
  for (int i = 0; i < 20; ++i) (*kb)->sink()->Record(Simple("dn" + std::to_string(i), 2000 + i));
  Status away = (*kb)->Flush();
  EXPECT_EQ(away.code(), StatusCode::kUnavailable) << away;
  EXPECT_NE(away.message().find("spool"), std::string::npos) << away;
  SinkStats st = (*kb)->sink_stats();
  EXPECT_EQ(st.spooled, 20);
  EXPECT_EQ(st.spool_pending, 20);
  EXPECT_EQ(st.lost(), 0);
  // An outcome for a spooled record follows it into the spool, in order.
  Incident done = Simple("dn0", 2000);
  done.outcome = IncidentOutcome::kRecovered;
  (*kb)->sink()->UpdateOutcome(done);
  (void)(*kb)->Flush();

  ASSERT_TRUE(server_.Start());
  Status back = (*kb)->Flush();
  for (int i = 0; i < 50 && !back.ok(); ++i) {
    ::usleep(100 * 1000);
    back = (*kb)->Flush();
  }
  ASSERT_TRUE(back.ok()) << back;
  EXPECT_EQ((*kb)->sink_stats().spool_pending, 0);
  EXPECT_EQ(Sql(server_.url(), "SELECT COUNT(*) FROM incidents"), "30");
  EXPECT_EQ(Sql(server_.url(), "SELECT outcome FROM incidents WHERE id = 'dn0'"), "recovered");
  // Sent once: nothing is left in the spool directory to send again.
  size_t spool_bytes = 0;
  for (const auto& e : fs::directory_iterator(spool_)) spool_bytes += fs::file_size(e.path());
  EXPECT_EQ(spool_bytes, 0u);
}

TEST_F(KbPgTest, AJobStartsWhileTheServerIsDownAndSpools) {
  ASSERT_TRUE(server_.Stop());
  {
    auto kb = KnowledgeBase::Open(server_.url(), Options());
    ASSERT_TRUE(kb.ok()) << kb.status();
    EXPECT_FALSE((*kb)->PriorMicroBatch("w").has_value());  // no prior: a warning, no error
    for (int i = 0; i < 5; ++i) (*kb)->sink()->Record(Simple("of" + std::to_string(i), 10 + i));
    EXPECT_EQ((*kb)->Flush().code(), StatusCode::kUnavailable);
  }  // the job ends with its incidents in the spool
  ASSERT_TRUE(server_.Start());
  // The next job on the host adopts them.
  auto next = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_TRUE(next.ok()) << next.status();
  Status s = (*next)->Flush();
  for (int i = 0; i < 50 && !s.ok(); ++i) {
    ::usleep(100 * 1000);
    s = (*next)->Flush();
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Sql(server_.url(), "SELECT COUNT(*) FROM incidents WHERE id LIKE 'of%'"), "5");
}

// Priors learned while the server is away wait in the spool with the
// incidents, on disk: a job that ends before the server is back leaves them
// to the next job on the host, which sends them.
TEST_F(KbPgTest, PriorsWaitInTheSpoolWhileTheServerIsAwayAndArriveOnce) {
  SizeModel model;
  model.fixed_bytes = 1 << 20;
  model.unit_bytes = 4096;
  {
    auto job = KnowledgeBase::Open(server_.url(), Options());
    ASSERT_TRUE(job.ok()) << job.status();
    (*job)->sink()->Record(Simple("pr01", 1000, "w-away"));  // a real OOM: clean sizes now set the prior
    ASSERT_TRUE((*job)->Flush().ok());
    ASSERT_TRUE(server_.Stop());
    ASSERT_TRUE((*job)->RecordCleanMicroBatch("w-away", 24).ok());
    ASSERT_TRUE((*job)->RecordModel("w-away", model).ok());
    Status away = (*job)->Flush();
    EXPECT_EQ(away.code(), StatusCode::kUnavailable) << away;
    SinkStats st = (*job)->sink_stats();
    EXPECT_EQ(st.spooled, 2);  // the size and the model
    EXPECT_EQ(st.lost(), 0);
  }  // ends with its priors in the spool
  ASSERT_TRUE(server_.Start());
  auto next = KnowledgeBase::Open(server_.url(), Options());
  ASSERT_TRUE(next.ok()) << next.status();
  Status s = (*next)->Flush();
  for (int i = 0; i < 50 && !s.ok(); ++i) {
    ::usleep(100 * 1000);
    s = (*next)->Flush();
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*next)->PriorMicroBatch("w-away"), 24);
  auto m = (*next)->PriorModel("w-away");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->unit_bytes, 4096);
  EXPECT_EQ(Sql(server_.url(), "SELECT COUNT(*) FROM priors WHERE workload = 'w-away'"), "1");
  size_t spool_bytes = 0;
  for (const auto& e : fs::directory_iterator(spool_)) spool_bytes += fs::file_size(e.path());
  EXPECT_EQ(spool_bytes, 0u);
}

// What makes a late or repeated prior harmless: an update applies only over
// a prior learned no later, and the same update twice is one.
TEST_F(KbPgTest, APriorThatArrivesLateNeverUndoesANewerOne) {
  auto store = kb::Store::Open(server_.url(), 1000, true);
  ASSERT_TRUE(store.ok()) << store.status();
  auto write = [&](int64_t size, bool replace, int64_t learned) {
    kb::PriorUpdate u;
    u.workload = "w-late";
    u.micro_batch = size;
    u.replace = replace;
    u.learned_unix_ms = learned;
    return (*store)->Write({}, {u}, 0);
  };
  auto prior = [&] { return Sql(server_.url(), "SELECT micro_batch FROM priors WHERE workload = 'w-late'"); };
  ASSERT_TRUE(write(32, true, 2000).ok());
  ASSERT_TRUE(write(16, true, 1000).ok());  // learned earlier, sent later (a spool): no change
  EXPECT_EQ(prior(), "32");
  ASSERT_TRUE(write(32, true, 2000).ok());  // sent twice: the same
  EXPECT_EQ(prior(), "32");
  ASSERT_TRUE(write(64, false, 1500).ok());  // a raise learned before the prior: no change
  EXPECT_EQ(prior(), "32");
  ASSERT_TRUE(write(64, false, 3000).ok());  // a raise learned after it
  EXPECT_EQ(prior(), "64");
  ASSERT_TRUE(write(40, true, 4000).ok());  // a newer limit (a real OOM) replaces
  EXPECT_EQ(prior(), "40");
  ASSERT_TRUE(write(72, false, 6000).ok());  // raises commute: the largest wins whatever the order
  ASSERT_TRUE(write(80, false, 5000).ok());
  ASSERT_TRUE(write(48, false, 7000).ok());
  EXPECT_EQ(prior(), "80");
  ASSERT_TRUE(write(96, false, 3500).ok());  // but not one learned before the newest limit (4000)
  EXPECT_EQ(prior(), "80");
}

// The roles of docs/knowledge_base.md (scripts/kb_postgres_roles.sql): a job
// records incidents and priors and reads priors, nothing more; the browser
// reads everything and writes notes, nothing more.
TEST_F(KbPgTest, RolesGrantWhatEachNeedsAndNoMore) {
  {
    auto owner = KnowledgeBase::Open(server_.url(), Options());  // creates the tables
    ASSERT_TRUE(owner.ok()) << owner.status();
  }
  std::ifstream in(std::string(OOMGUARD_SOURCE_DIR) + "/scripts/kb_postgres_roles.sql");
  std::string roles((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(roles.empty());
  ASSERT_EQ(Sql(server_.url(), roles), "");
  ASSERT_EQ(Sql(server_.url(), "CREATE ROLE job1 LOGIN IN ROLE oomguard_job;"
                               "CREATE ROLE web1 LOGIN IN ROLE oomguard_browser"),
            "");
  auto as = [&](const std::string& user) {
    std::string url = server_.url();
    url.replace(url.find("oomguard@"), 9, user + "@");
    return url;
  };
  {
    auto job = KnowledgeBase::Open(as("job1"), Options());
    ASSERT_TRUE(job.ok()) << job.status();
    Incident oom = Simple("jb01", 5000, "roles");
    (*job)->sink()->Record(oom);
    oom.outcome = IncidentOutcome::kRecovered;
    (*job)->sink()->UpdateOutcome(oom);
    ASSERT_TRUE((*job)->RecordCleanMicroBatch("roles", 12).ok());
    Status s = (*job)->Flush();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ((*job)->PriorMicroBatch("roles"), 12);
    Status note = (*job)->SetNote({"fp", "a job writes no notes", "", 0});
    EXPECT_EQ(note.code(), StatusCode::kFailedPrecondition) << note;
    EXPECT_NE(note.message().find("privilege"), std::string::npos) << note;
  }
  EXPECT_EQ(Sql(server_.url(), "SELECT outcome FROM incidents WHERE id = 'jb01'"), "recovered");
  {
    auto web = KnowledgeBase::Open(as("web1"), Options());
    ASSERT_TRUE(web.ok()) << web.status();
    auto found = (*web)->Query({.id_prefix = "jb01"});
    ASSERT_TRUE(found.ok()) << found.status();
    ASSERT_EQ(found->size(), 1u);
    EXPECT_TRUE((*web)->Stats().ok());
    EXPECT_TRUE((*web)->SetNote({(*found)[0].fingerprint, "fixed by halving", "web", 0}).ok());
    Status ins = (*web)->Insert({Simple("wb01", 1)});
    EXPECT_EQ(ins.code(), StatusCode::kFailedPrecondition) << ins;
  }
  EXPECT_EQ(Sql(server_.url(), "SELECT COUNT(*) FROM incidents WHERE id = 'wb01'"), "0");
}

TEST(KbPgUrlTest, PasswordsNeverAppear) {
  EXPECT_EQ(kb::RedactUrl("postgresql://job:s3cret@db.example:5432/kb?sslmode=verify-full"),
            "postgresql://job:***@db.example:5432/kb?sslmode=verify-full");
  EXPECT_EQ(kb::RedactUrl("postgres://job@db/kb?password=s3cret&sslmode=require"),
            "postgres://job@db/kb?password=***&sslmode=require");
  EXPECT_EQ(kb::RedactUrl("postgresql://job@db/kb"), "postgresql://job@db/kb");
  EXPECT_EQ(kb::RedactUrl("/data/kb.db"), "/data/kb.db");
  // A server that is not there: the error names the server, never the password.
  const std::string url = "postgresql://job:s3cret@/kb?host=/nonexistent-dir&connect_timeout=2";
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto kb = KnowledgeBase::Open(url, ro);
  ASSERT_FALSE(kb.ok());
  EXPECT_EQ(kb.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(kb.status().message().find("s3cret"), std::string::npos) << kb.status();
  EXPECT_NE(kb.status().message().find("job:***@"), std::string::npos) << kb.status();
  // A password that is part of its own mask ("*" in "***"), in a message
  // that quotes it back: scrubbing ends (it used to search forever).
  auto starred = KnowledgeBase::Open("postgresql://job:*@/kb?host=/nonexistent-dir&bogus*=1", ro);
  ASSERT_FALSE(starred.ok());
  EXPECT_NE(starred.status().message().find("bogus***"), std::string::npos) << starred.status();
  // A writer starts anyway (it spools); its path() is redacted too.
  KnowledgeBaseOptions w;
  w.spool_dir = fs::temp_directory_path() / ("oomguard-pg-url-" + std::to_string(::getpid()));
  auto writer = KnowledgeBase::Open(url, w);
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->path().find("s3cret"), std::string::npos);
  (*writer)->sink()->Record(Simple("pw01", 1));
  Status s = (*writer)->Flush();
  EXPECT_EQ(s.message().find("s3cret"), std::string::npos) << s;
  EXPECT_EQ((*writer)->sink_stats().last_error.find("s3cret"), std::string::npos);
  writer->reset();
  std::error_code ec;
  fs::remove_all(w.spool_dir, ec);
}

}  // namespace
}  // namespace oomguard
