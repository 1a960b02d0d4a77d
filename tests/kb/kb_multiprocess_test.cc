// Several processes record incidents into one knowledge-base file at once;
// none may be lost (SQLite locking + WAL + busy_timeout + migration race).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"

namespace oomguard {
namespace {

constexpr int kProcesses = 4;
constexpr int kPerProcess = 500;

// Child body: its own KnowledgeBase (and writer thread) on the shared file.
int WriteIncidents(const std::string& path, int proc) {
  auto kb = KnowledgeBase::Open(path);
  if (!kb.ok()) return 10;
  for (int k = 0; k < kPerProcess; ++k) {
    Incident i;
    i.id = "p" + std::to_string(proc) + "-" + std::to_string(k);
    i.run_id = "run" + std::to_string(proc);
    i.rank = proc;
    i.step = k;
    i.steps_ok_before = 100;  // one classification, so one group
    i.phase = Phase::kBackward;
    i.kind = IncidentKind::kDevice;
    i.workload = "multi";
    i.requested_bytes = 1 << 20;
    (*kb)->sink()->Record(i);
    i.outcome = IncidentOutcome::kRecovered;
    (*kb)->sink()->UpdateOutcome(i);
  }
  if (!(*kb)->RecordCleanMicroBatch("clean", 10 + proc).ok()) return 11;
  if (!(*kb)->Flush().ok()) return 12;
  SinkStats st = (*kb)->sink_stats();
  return st.dropped == 0 && st.write_errors == 0 ? 0 : 13;
}

// A session that met a real OOM for "clean" and then ran it at 5: the prior
// the four processes raise (a clean session only raises an existing prior).
int SeedPrior(const std::string& path) {
  auto kb = KnowledgeBase::Open(path);
  if (!kb.ok()) return 10;
  Incident i;
  i.id = "seed";
  i.run_id = "seed";
  i.kind = IncidentKind::kDevice;
  i.phase = Phase::kForward;
  i.workload = "clean";
  (*kb)->sink()->Record(i);
  if (!(*kb)->RecordCleanMicroBatch("clean", 5).ok()) return 11;
  return (*kb)->Flush().ok() ? 0 : 12;
}

TEST(KbMultiprocessTest, FourProcessesWritingOneFileLoseNothing) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("oomguard-kb-mp-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "shared.db").string();

  // Fork before this process starts any thread: the children start their own.
  {
    pid_t seeder = ::fork();
    ASSERT_GE(seeder, 0);
    if (seeder == 0) ::_exit(SeedPrior(path));
    int status = 0;
    ASSERT_EQ(::waitpid(seeder, &status, 0), seeder);
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 0) << "the seeding process";
  }
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcesses; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ::_exit(WriteIncidents(path, p));
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child " << pid;
  }

  auto kb = KnowledgeBase::Open(path);
  ASSERT_TRUE(kb.ok()) << kb.status();
  auto all = (*kb)->Query({});
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), static_cast<size_t>(kProcesses * kPerProcess) + 1);  // and the seed's
  std::set<std::string> ids;
  for (const auto& i : *all) {
    if (i.id == "seed") continue;
    ids.insert(i.id);
    EXPECT_EQ(i.outcome, IncidentOutcome::kRecovered) << i.id;
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kProcesses * kPerProcess));
  EXPECT_EQ((*kb)->PriorMicroBatch("clean"), 10 + kProcesses - 1);  // clean sessions raise it: the largest wins
  auto groups = (*kb)->Groups();
  ASSERT_TRUE(groups.ok());
  std::vector<IncidentGroup> multi;
  for (const auto& g : *groups)
    if (g.workload == "multi") multi.push_back(g);
  ASSERT_EQ(multi.size(), 1u);
  EXPECT_EQ(multi[0].runs, kProcesses);
  kb->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace oomguard
