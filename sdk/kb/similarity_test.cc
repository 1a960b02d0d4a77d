#include "sdk/kb/similarity.h"

#include <gtest/gtest.h>

#include "oomguard/knowledge_base.h"

namespace oomguard::kb {
namespace {

Incident Make(const std::string& id, const std::string& message, IncidentKind kind = IncidentKind::kDevice) {
  Incident i;
  i.id = id;
  i.kind = kind;
  i.phase = Phase::kForward;
  i.message = message;
  i.workload = "gpt-small";
  ClassifyInPlace(&i);
  return i;
}

TEST(SimilarityTest, TheSameProblemRecurringComesFirstAndTheIncidentItselfNever) {
  const std::string worker = "RuntimeError: DataLoader worker (pid 1620) is killed by signal: Killed.";
  std::vector<Incident> pool = {
      Make("a", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
      Make("b", "RuntimeError: DataLoader worker (pid 2231) is killed by signal: Killed.", IncidentKind::kHost),
      Make("c", "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared "
                "memory (shm).",
           IncidentKind::kHost),
  };
  pool[1].outcome = IncidentOutcome::kRecovered;
  pool[1].action = LadderAction::kHalve;
  pool[1].micro_before = 64;
  pool[1].micro_after = 32;
  Incident target = Make("t", worker, IncidentKind::kHost);
  pool.push_back(target);

  auto near = FindSimilar(target, pool, 5);
  ASSERT_GE(near.size(), 2u);
  EXPECT_EQ(near[0].incident->id, "b");
  EXPECT_NE(near[0].why.find("same fingerprint"), std::string::npos) << near[0].why;
  for (const auto& s : near) EXPECT_NE(s.incident->id, "t");
  for (size_t k = 1; k < near.size(); ++k) EXPECT_GE(near[k - 1].score, near[k].score);
  EXPECT_NE(ResolutionOf(*near[0].incident).find("recovered by halve (micro-batch 64 -> 32)"), std::string::npos)
      << ResolutionOf(*near[0].incident);
  // The device OOM shares nothing with a worker kill: left out.
  for (const auto& s : near) EXPECT_NE(s.incident->id, "a") << s.why;
}

TEST(SimilarityTest, LimitAndAnEmptyPool) {
  Incident t = Make("t", "CUDA out of memory");
  EXPECT_TRUE(FindSimilar(t, {}, 3).empty());
  std::vector<Incident> pool;
  for (int k = 0; k < 6; ++k) pool.push_back(Make("p" + std::to_string(k), "CUDA out of memory"));
  EXPECT_EQ(FindSimilar(t, pool, 3).size(), 3u);
}

}  // namespace
}  // namespace oomguard::kb
