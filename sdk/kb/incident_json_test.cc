#include <gtest/gtest.h>

#include "oomguard/knowledge_base.h"

namespace oomguard {
namespace {

TEST(IncidentJsonTest, RoundTripKeepsEveryField) {
  Incident i;
  i.id = "00112233aabbccdd";
  i.run_id = "run";
  i.time_unix_ms = 1700000000123;
  i.host = "h";
  i.rank = 3;
  i.world_size = 4;
  i.step = 77;
  i.micro_index = 2;
  i.phase = Phase::kBackward;
  i.kind = IncidentKind::kDevice;
  i.exception_type = "oomguard::DeviceOomError";
  i.message = "line\nwith \"quotes\"";
  i.requested_bytes = int64_t{5} << 32;
  i.memory = {100, 10, 50, 80, 70, 55, 25, 3, 1};
  i.step_peaks = {1, 2, 3};
  i.steps_ok_before = 9;
  i.sample_cost_this = 512;
  i.sample_cost_median = 128;
  i.ranks = {{0, 1, 2, 3}, {1, 4, 5, 6}};
  i.micro_before = 64;
  i.micro_after = 32;
  i.action = LadderAction::kHalve;
  i.actions = {LadderAction::kRelease, LadderAction::kHalve};
  i.outcome = IncidentOutcome::kRecovered;
  i.recovery_ms = 0.25;
  i.workload = "w";
  i.injected = true;
  i.framework.grad_recording = false;
  i.framework.state_copy_bytes = 4096;
  i.pattern = "fragmentation";
  i.confidence = 0.5;
  i.evidence = "e";
  i.remedies = {"a", "b"};
  i.fingerprint = "ff";
  i.source = "train.log:412";
  i.context = "step 5\nTraceback";
  i.unknown = {"rank"};
  auto back = IncidentFromJson(IncidentToJson(i));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(IncidentToJson(*back), IncidentToJson(i));
  EXPECT_EQ(back->memory.inactive_split, 25);
  EXPECT_EQ(back->ranks[1].peak_allocated, 6);
  EXPECT_EQ(back->framework.grad_recording, std::optional<bool>(false));
  EXPECT_EQ(back->framework.state_copy_bytes, 4096);
  // Grad recording not known travels as null and comes back unknown.
  i.framework.grad_recording.reset();
  back = IncidentFromJson(IncidentToJson(i));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->framework.grad_recording.has_value());
  EXPECT_NE(IncidentToJson(i).find("\"grad_recording\":null"), std::string::npos) << IncidentToJson(i);
  EXPECT_EQ(back->message, i.message);
  EXPECT_EQ(back->unknown, std::vector<std::string>{"rank"});
  EXPECT_FALSE(IsKnown(*back, "rank"));
  EXPECT_TRUE(IsKnown(*back, "step"));
}

TEST(IncidentJsonTest, AbsentFieldsOfOtherToolsAreUnknownNotZero) {
  auto a = IncidentFromJson(R"({"message":"CUDA out of memory."})");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(IsKnown(*a, "step"));
  EXPECT_FALSE(IsKnown(*a, "steps_ok_before"));
  EXPECT_FALSE(IsKnown(*a, "rank"));
  // Present fields are known, even when zero; a flattened steps_ok_before counts.
  auto b = IncidentFromJson(R"({"step":0,"rank":0,"steps_ok_before":0})");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->unknown.empty());
  auto c = IncidentFromJson(R"({"step":3,"history":{"step_peaks":[1]}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->unknown, (std::vector<std::string>{"steps_ok_before", "rank"}));
  // An exported record says itself what it knows.
  auto d = IncidentFromJson(R"({"unknown":[]})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->unknown.empty());
  EXPECT_FALSE(IncidentFromJson(R"({"unknown":"step"})").ok());
}

TEST(IncidentJsonTest, MissingFieldsKeepDefaultsAndIdIsDerived) {
  auto a = IncidentFromJson(R"({"phase":"forward"})");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->phase, Phase::kForward);
  EXPECT_EQ(a->id.size(), 16u);
  auto b = IncidentFromJson(R"({"phase":"forward"})");
  EXPECT_EQ(a->id, b->id);  // re-importing the same line gives the same id
  EXPECT_EQ(a->world_size, 1);
}

// The vocabulary fields travel as their names; absent or "" is the unknown
// value, and "vote" (what earlier builds wrote for a coordination failure)
// still reads, as the collective phase it was.
TEST(IncidentJsonTest, VocabularyTravelsAsNames) {
  Incident i;
  i.phase = Phase::kComm;
  i.kind = IncidentKind::kCoordination;
  i.action = LadderAction::kGiveUp;
  i.actions = {LadderAction::kRelease, LadderAction::kRollback};
  i.outcome = IncidentOutcome::kRolledBack;
  const std::string text = IncidentToJson(i);
  for (const char* name : {R"("phase":"comm")", R"("kind":"coordination")", R"("action":"give_up")",
                           R"("actions":["release","rollback"])", R"("outcome":"rolled_back")"})
    EXPECT_NE(text.find(name), std::string::npos) << name << " in " << text;

  auto blank = IncidentFromJson(R"({"phase":"","kind":"","action":"","outcome":""})");
  ASSERT_TRUE(blank.ok()) << blank.status();
  EXPECT_EQ(blank->phase, Phase::kUnknown);
  EXPECT_EQ(blank->kind, IncidentKind::kUnknown);
  EXPECT_EQ(blank->action, LadderAction::kNone);
  EXPECT_EQ(blank->outcome, IncidentOutcome::kUnknown);

  auto old = IncidentFromJson(R"({"phase":"vote","kind":"coordination"})");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->phase, Phase::kComm);
}

TEST(IncidentJsonTest, AcceptsTorchMemoryStatsKeysAndWholeFloats) {
  auto a = IncidentFromJson(R"({"requested_bytes":1.5e9,"memory":{"reserved_bytes.all.current":42}})");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->requested_bytes, 1500000000);
  EXPECT_EQ(a->memory.reserved, 42);
}

TEST(IncidentJsonTest, BadInputNamesTheField) {
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {R"({"step":"ten"})", "'step' must be an integer, got string"},
      {R"({"memory":{"allocated":[1]}})", "'memory.allocated'"},
      {R"({"memory":5})", "'memory' must be an object"},
      {R"({"ranks":[{"rank":"x"}]})", "'ranks[0].rank'"},
      {R"({"history":{"step_peaks":[1,"a"]}})", "'history.step_peaks[1]'"},
      {R"({"rank":99999999999})", "'rank' is out of range"},
      {R"({"requested_bytes":1.5})", "'requested_bytes' must be an integer"},
      {R"({"remedies":[1]})", "'remedies'"},
      {R"({"confidence":7})", "'confidence'"},
      {R"({"phase":"vote!"})", "'phase' is 'vote!', not one of unknown, data, forward,"},
      {R"({"kind":"gpu"})", "'kind' is 'gpu', not one of unknown, device, host, workspace, coordination"},
      {R"({"action":"shrink"})", "'action' is 'shrink', not one of none, release, halve, rollback, give_up"},
      {R"({"actions":["release","retry"]})", "'actions[1]' is 'retry', not one of none, release,"},
      {R"({"outcome":"ok"})", "'outcome' is 'ok', not one of unknown, pending, recovered, rolled_back, failed"},
      {R"({"phase":3})", "'phase' must be a string"},
      {R"([1,2])", "expected a JSON object"},
      {R"({"step":)", "not valid JSON"},
  };
  for (const auto& c : cases) {
    auto r = IncidentFromJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
}

TEST(IncidentJsonTest, HugeStringsAndArraysAreRejected) {
  std::string big = R"({"message":")" + std::string(100000, 'x') + R"("})";
  auto r = IncidentFromJson(big);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'message' is longer than"), std::string::npos);
  std::string arr = R"({"history":{"step_peaks":[)";
  for (int i = 0; i < 5000; ++i) arr += (i ? ",1" : "1");
  arr += "]}}";
  r = IncidentFromJson(arr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than 4096"), std::string::npos);
  // Deep nesting must not crash the parser.
  std::string deep = R"({"x":)" + std::string(10000, '[') + std::string(10000, ']') + "}";
  (void)IncidentFromJson(deep);
}

}  // namespace
}  // namespace oomguard
