// Fault rules as written: the grammar of OOMGUARD_FAULTS and SetFaultRules,
// every key, and the messages of bad rules. Firing is in faults_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "oomguard/faults.h"

namespace oomguard {
namespace {

FaultRule ParseOne(const std::string& spec) {
  StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(spec);
  EXPECT_TRUE(rules.ok()) << spec << ": " << rules.status();
  if (!rules.ok()) return FaultRule{};
  EXPECT_EQ(rules->size(), 1u) << spec;
  return rules->empty() ? FaultRule{} : rules->front();
}

TEST(FaultSiteTest, NamesRoundTrip) {
  for (int i = 0; i < kNumFaultSites; ++i) {
    const auto site = static_cast<FaultSite>(i);
    EXPECT_NE(FaultSiteName(site), "unknown") << i;
    EXPECT_EQ(ParseFaultSite(FaultSiteName(site)), site) << FaultSiteName(site);
  }
  EXPECT_EQ(FaultSiteName(FaultSite::kMicroBatch), "micro_batch");
  EXPECT_EQ(FaultSiteName(FaultSite::kCkptManifest), "ckpt_manifest");
  EXPECT_EQ(FaultSiteName(FaultSite::kKbWrite), "kb_write");
  EXPECT_EQ(ParseFaultSite("ckpt_write"), FaultSite::kCkptWrite);
  EXPECT_EQ(ParseFaultSite("vote"), FaultSite::kVote);
  EXPECT_FALSE(ParseFaultSite("Forward").has_value());
  EXPECT_FALSE(ParseFaultSite("").has_value());
}

TEST(FaultParseTest, EachKey) {
  FaultRule r = ParseOne("oom@step=30");
  EXPECT_EQ(r.kind, FaultKind::kOom);
  EXPECT_EQ(r.step_lo, 30);
  EXPECT_EQ(r.step_hi, 30);

  r = ParseOne("oom@step=2-5");
  EXPECT_EQ(r.step_lo, 2);
  EXPECT_EQ(r.step_hi, 5);
  r = ParseOne("oom@step=4-4");
  EXPECT_EQ(r.step_lo, 4);
  EXPECT_EQ(r.step_hi, 4);

  EXPECT_EQ(ParseOne("oom@rank=1").rank, 1);
  EXPECT_EQ(ParseOne("oom@site=backward").site, FaultSite::kBackward);
  EXPECT_EQ(ParseOne("oom@micro=2").micro, 2);
  EXPECT_EQ(ParseOne("oom@times=0").times, 0);
  EXPECT_EQ(ParseOne("oom@times=7").times, 7);
  EXPECT_EQ(ParseOne("oom@min_size=16").min_size, 16);
  EXPECT_EQ(ParseOne("oom@bytes=1024").bytes, 1024);

  r = ParseOne("host_oom@bytes=7");
  EXPECT_EQ(r.kind, FaultKind::kHostOom);
  EXPECT_EQ(r.bytes, 7);

  r = ParseOne("delay@ms=25");
  EXPECT_EQ(r.kind, FaultKind::kDelay);
  EXPECT_EQ(r.delay_ms, 25);
  EXPECT_EQ(ParseOne("delay@ms=0").delay_ms, 0);
  EXPECT_EQ(ParseOne("delay@ms=3600000").delay_ms, 3600000);

  r = ParseOne("kill@step=57,site=ckpt_write");
  EXPECT_EQ(r.kind, FaultKind::kKill);
  EXPECT_EQ(r.site, FaultSite::kCkptWrite);
  EXPECT_EQ(r.text, "kill@step=57,site=ckpt_write");

  // Error rules and the commit-phase sites.
  EXPECT_EQ(ParseOne("error@site=apply").kind, FaultKind::kError);
  EXPECT_EQ(ParseOne("error@site=apply").site, FaultSite::kApply);
  EXPECT_EQ(ParseOne("oom@site=sync").site, FaultSite::kSync);
  EXPECT_FALSE(ParseFaultRules("error@bytes=5").ok()) << "bytes is for OOM kinds only";

  r = ParseOne("oom@step=1,rank=2,site=vote,micro=3,times=4,min_size=5,bytes=6");
  EXPECT_EQ(r.step_lo, 1);
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.site, FaultSite::kVote);
  EXPECT_EQ(r.micro, 3);
  EXPECT_EQ(r.times, 4);
  EXPECT_EQ(r.min_size, 5);
  EXPECT_EQ(r.bytes, 6);
}

TEST(FaultParseTest, BareKindMatchesEverywhereWithDefaults) {
  const FaultRule r = ParseOne("kill");
  EXPECT_EQ(r.kind, FaultKind::kKill);
  EXPECT_FALSE(r.step_lo.has_value());
  EXPECT_FALSE(r.step_hi.has_value());
  EXPECT_FALSE(r.rank.has_value());
  EXPECT_FALSE(r.site.has_value());
  EXPECT_FALSE(r.micro.has_value());
  EXPECT_EQ(r.times, 1);
  EXPECT_EQ(r.min_size, 0);
  EXPECT_EQ(r.bytes, 1 << 20);
  EXPECT_EQ(r.text, "kill");
}

TEST(FaultParseTest, SeparatorsAndWhitespace) {
  StatusOr<std::vector<FaultRule>> rules =
      ParseFaultRules("  oom@step=30,rank=1,site=backward ;kill@step=57,site=ckpt_write;; \t;");
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 2u);
  EXPECT_EQ((*rules)[0].text, "oom@step=30,rank=1,site=backward");
  EXPECT_EQ((*rules)[0].rank, 1);
  EXPECT_EQ((*rules)[1].text, "kill@step=57,site=ckpt_write");
  EXPECT_EQ((*rules)[1].step_lo, 57);

  const FaultRule r = ParseOne(" oom @ step = 3 , site = forward ");
  EXPECT_EQ(r.step_lo, 3);
  EXPECT_EQ(r.site, FaultSite::kForward);

  for (const char* empty : {"", " ", ";", " ; ;\n"}) {
    StatusOr<std::vector<FaultRule>> none = ParseFaultRules(empty);
    ASSERT_TRUE(none.ok()) << "'" << empty << "': " << none.status();
    EXPECT_TRUE(none->empty()) << "'" << empty << "'";
  }
}

struct BadRule {
  const char* spec;
  const char* rule;     // the rule the message must name
  const char* problem;  // a substring saying what is wrong
};

TEST(FaultParseTest, BadRulesNameTheRuleAndTheProblem) {
  const BadRule kBad[] = {
      {"oom@step=x", "oom@step=x", "step: 'x' is not a number (expected N or A-B)"},
      {"boom@step=1", "boom@step=1", "unknown kind 'boom' (expected oom, host_oom, error, kill or delay)"},
      {"OOM", "OOM", "unknown kind 'OOM'"},
      {"@step=1", "@step=1", "missing kind"},
      {"oom@stpe=1", "oom@stpe=1",
       "unknown key 'stpe' (expected step, rank, site, micro, times, min_size, ms or bytes)"},
      {"oom@site=fwd", "oom@site=fwd", "unknown site 'fwd' (expected micro_batch, forward"},
      {"oom@site=fwd", "oom@site=fwd", "kb_write or eval)"},
      {"oom@step=1,step=2", "oom@step=1,step=2", "duplicate key 'step'"},
      {"oom@site=vote,rank=1,site=vote", "oom@site=vote,rank=1,site=vote", "duplicate key 'site'"},
      {"oom@step=5-3", "oom@step=5-3", "range '5-3' is empty (start 5 > end 3)"},
      {"oom@step=-3", "oom@step=-3", "step: '-3' is negative"},
      {"oom@step=3-", "oom@step=3-", "step: '3-' is not a number"},
      {"oom@step=1-2-3", "oom@step=1-2-3", "step: '1-2-3' is not a number"},
      {"oom@rank=-1", "oom@rank=-1", "rank: '-1' is negative"},
      {"oom@micro=-2", "oom@micro=-2", "micro: '-2' is negative"},
      {"oom@min_size=-5", "oom@min_size=-5", "min_size: '-5' is negative"},
      {"oom@times=-1", "oom@times=-1", "times: '-1' is negative"},
      {"oom@step=3x", "oom@step=3x", "step: '3x' is not a number"},
      {"oom@step=+3", "oom@step=+3", "step: '+3' is not a number"},
      {"oom@step= ", "oom@step=", "step: '' is not a number"},
      {"oom@rank=one", "oom@rank=one", "rank: 'one' is not a number (expected N)"},
      {"oom@step=99999999999999999999", "oom@step=99999999999999999999", "out of range"},
      // Issue 28: an overflow in a range said "is not a number".
      {"oom@step=1-99999999999999999999", "oom@step=1-99999999999999999999",
       "step: range '1-99999999999999999999': end '99999999999999999999' is out of range"},
      {"oom@step=99999999999999999999-100000000000000000000", "oom@step=99999999999999999999-100000000000000000000",
       "start '99999999999999999999' is out of range"},
      {"oom@rank=3000000000", "oom@rank=3000000000", "rank: '3000000000' is out of range"},
      {"oom@step", "oom@step", "'step' has no '=' (expected key=value)"},
      {"oom@step=1,", "oom@step=1,", "empty key=value pair"},
      {"oom@", "oom@", "expected key=value after '@'"},
      {"delay", "delay", "delay needs ms=N"},
      {"delay@step=3", "delay@step=3", "delay needs ms=N"},
      {"delay@ms=-4", "delay@ms=-4", "ms: '-4' is negative"},
      // A delay has an upper bound (issue 15): 1e17 ms would overflow the sleep's nanoseconds.
      {"delay@ms=99999999999999999", "delay@ms=99999999999999999",
       "is out of range (at most 3600000, one hour)"},
      {"delay@ms=3600001", "delay@ms=3600001", "at most 3600000"},
      {"oom@ms=5", "oom@ms=5", "ms is only valid for delay"},
      {"kill@ms=5", "kill@ms=5", "ms is only valid for delay"},
      {"kill@bytes=5", "kill@bytes=5", "bytes is only valid for oom and host_oom"},
      {"delay@ms=1,bytes=5", "delay@ms=1,bytes=5", "bytes is only valid for oom and host_oom"},
      {"oom@bytes=0", "oom@bytes=0", "bytes: must be > 0"},
      {"host_oom@bytes=-1", "host_oom@bytes=-1", "bytes: '-1' is negative"},
      // The message names the bad rule, not its valid neighbours.
      {"oom@step=1; kill@site=nowhere ;delay@ms=1", "kill@site=nowhere", "unknown site 'nowhere'"},
  };
  for (const BadRule& bad : kBad) {
    StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(bad.spec);
    ASSERT_FALSE(rules.ok()) << bad.spec;
    EXPECT_EQ(rules.status().code(), StatusCode::kInvalidArgument) << bad.spec;
    const std::string& msg = rules.status().message();
    EXPECT_NE(msg.find(std::string("fault rule '") + bad.rule + "'"), std::string::npos)
        << bad.spec << " -> " << msg;
    EXPECT_NE(msg.find(bad.problem), std::string::npos) << bad.spec << " -> " << msg;
  }
  // The example from the header, in full.
  EXPECT_EQ(ParseFaultRules("oom@step=x").status().message(),
            "fault rule 'oom@step=x': step: 'x' is not a number (expected N or A-B)");
}

}  // namespace
}  // namespace oomguard
