// For the guard's tests (sdk/guard, tests/dist): a fixture that clears fault
// rules around each test, a guard made or the test failed, and fakes of the
// guard's seams that record what was done to them: an IncidentSink, a
// RecoveryStore and a MicroBatchPriors.
#ifndef OOMGUARD_SDK_GUARD_GUARD_TESTING_H_
#define OOMGUARD_SDK_GUARD_GUARD_TESTING_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/incident.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"

namespace oomguard::testing {

class FaultsCleared : public ::testing::Test {
 protected:
  void SetUp() override { ClearFaultRules(); }
  void TearDown() override { ClearFaultRules(); }
};

inline std::unique_ptr<Guard> MakeGuard(const GuardOptions& o) {
  auto g = Guard::Create(o);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(g).value() : nullptr;
}

class RecordingSink : public IncidentSink {
 public:
  void Record(const Incident& i) override {
    std::lock_guard<std::mutex> l(mu);
    recorded.push_back(i);
  }
  void UpdateOutcome(const Incident& i) override {
    std::lock_guard<std::mutex> l(mu);
    updated.push_back(i);
  }
  std::mutex mu;
  std::vector<Incident> recorded, updated;
};

// A RecoveryStore that holds step numbers instead of state and records every
// call that changes something: restores (with their steps), manifest commits,
// snapshots and the step-committed notices. Like a real store it restores only
// a step it holds (its snapshot or a durable step), so a test that reads
// `restored` knows the guard asked for a step that existed.
// Thread-safety: one thread (the rank's) uses it, as the guard does.
class RecordingRecovery : public RecoveryStore {
 public:
  // What it holds.
  std::set<int64_t> durable;
  std::optional<int64_t> snapshot;

  // How it behaves.
  bool save_on_commit = true;      // OnStepCommitted makes the step durable and the snapshot
  bool can_snapshot = true;        // false: Snapshot is the default kUnimplemented
  std::set<int64_t> fail_restore;  // steps whose restore fails here (kDataLoss)
  std::set<int64_t> fail_commit;   // steps whose Commit fails here (kInternal)

  // What was done to it, in call order.
  std::vector<int64_t> restored;                          // steps restored successfully
  std::vector<int64_t> failed_restores;                   // restores refused (not held, or in fail_restore)
  std::vector<int64_t> commits;                           // Commit's steps (rank 0 writes the manifests)
  std::vector<int64_t> snapshots;                         // Snapshot's steps that were kept
  std::vector<std::pair<int64_t, bool>> steps_committed;  // OnStepCommitted(step, after_recovery)

  int restores() const { return static_cast<int>(restored.size()); }
  std::optional<int64_t> last_restored() const {
    return restored.empty() ? std::nullopt : std::optional<int64_t>(restored.back());
  }
  int commits_after_recovery() const {
    int n = 0;
    for (const auto& [step, after] : steps_committed) n += after ? 1 : 0;
    return n;
  }

  std::vector<int64_t> DurableSteps() override { return {durable.begin(), durable.end()}; }
  std::optional<int64_t> SnapshotStep() override { return snapshot; }
  Status Snapshot(int64_t step) override {
    if (!can_snapshot) return RecoveryStore::Snapshot(step);
    snapshot = step;
    snapshots.push_back(step);
    return Status::Ok();
  }
  Status Restore(int64_t step) override {
    if (fail_restore.count(step) != 0) {
      failed_restores.push_back(step);
      return Status::DataLoss("step " + std::to_string(step) + " is corrupt here");
    }
    if (!(snapshot && *snapshot == step) && durable.count(step) == 0) {
      failed_restores.push_back(step);
      return Status::NotFound("step " + std::to_string(step) + " is not held here");
    }
    restored.push_back(step);
    return Status::Ok();
  }
  Status OnStepCommitted(int64_t step, bool after_recovery) override {
    steps_committed.emplace_back(step, after_recovery);
    if (save_on_commit) {
      durable.insert(step);
      snapshot = step;
    }
    return Status::Ok();
  }
  Status Commit(int64_t step, int /*world_size*/) override {
    if (fail_commit.count(step) != 0)
      return Status::Internal("commit of step " + std::to_string(step) + " failed");
    commits.push_back(step);
    return Status::Ok();
  }
};

// MicroBatchPriors in memory: what a test puts in `sizes` and `models` is what
// the guard reads; what the guard records lands there too (a clean size only
// raises the stored one, as the knowledge base does), and every call is kept.
class RecordingPriors : public MicroBatchPriors {
 public:
  std::map<std::string, int64_t> sizes;     // workload key -> micro-batch
  std::map<std::string, SizeModel> models;  // workload key -> memory model

  std::vector<std::string> asked;                                  // PriorMicroBatch's keys
  std::vector<std::pair<std::string, int64_t>> recorded;           // RecordCleanMicroBatch's
  std::vector<std::pair<std::string, SizeModel>> recorded_models;  // RecordModel's

  std::optional<int64_t> PriorMicroBatch(const std::string& w) override {
    asked.push_back(w);
    auto it = sizes.find(w);
    return it == sizes.end() ? std::nullopt : std::optional<int64_t>(it->second);
  }
  Status RecordCleanMicroBatch(const std::string& w, int64_t size) override {
    recorded.emplace_back(w, size);
    sizes[w] = std::max(sizes[w], size);
    return Status::Ok();
  }
  std::optional<SizeModel> PriorModel(const std::string& w) override {
    auto it = models.find(w);
    return it == models.end() ? std::nullopt : std::optional<SizeModel>(it->second);
  }
  Status RecordModel(const std::string& w, const SizeModel& m) override {
    recorded_models.emplace_back(w, m);
    models[w] = m;
    return Status::Ok();
  }
};

}  // namespace oomguard::testing

#endif  // OOMGUARD_SDK_GUARD_GUARD_TESTING_H_
