// Several processes record incidents into one knowledge-base file at once;
// none may be lost (SQLite locking + WAL + busy_timeout + migration race).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>

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

TEST(KbMultiprocessTest, FourProcessesWritingOneFileLoseNothing) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("oomguard-kb-mp-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "shared.db").string();

  // Fork before this process starts any thread: the children start their own.
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
  ASSERT_EQ(all->size(), static_cast<size_t>(kProcesses * kPerProcess));
  std::set<std::string> ids;
  for (const auto& i : *all) {
    ids.insert(i.id);
    EXPECT_EQ(i.outcome, IncidentOutcome::kRecovered) << i.id;
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kProcesses * kPerProcess));
  EXPECT_EQ((*kb)->PriorMicroBatch("clean"), 10 + kProcesses - 1);  // no OOM for it: the largest wins
  auto groups = (*kb)->Groups();
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->size(), 1u);
  EXPECT_EQ((*groups)[0].runs, kProcesses);
  kb->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace oomguard
