// For the guard's unit tests: a fixture that clears fault rules around each
// test, a guard made or the test failed, and an IncidentSink that records
// what it was given.
#ifndef OOMGUARD_SDK_GUARD_GUARD_TESTING_H_
#define OOMGUARD_SDK_GUARD_GUARD_TESTING_H_

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <vector>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/incident.h"

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

}  // namespace oomguard::testing

#endif  // OOMGUARD_SDK_GUARD_GUARD_TESTING_H_
