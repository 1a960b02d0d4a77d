// The incident vocabulary: every enumerator has a name, the names are the
// documented ones, and parsing inverts naming.
#include "oomguard/incident.h"

#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace oomguard {
namespace {

// Walks an enum from 0 until the name repeats the first (what an
// out-of-range value reads as), checking the round trip on the way.
template <typename E>
std::vector<std::string> NamesOf(std::string_view (*name)(E), std::optional<E> (*parse)(std::string_view)) {
  std::vector<std::string> out;
  std::set<std::string_view> seen;
  for (int i = 0; i < 64; ++i) {
    const E e = static_cast<E>(i);
    if (i > 0 && name(e) == name(static_cast<E>(0))) break;
    EXPECT_TRUE(seen.insert(name(e)).second) << "two enumerators named " << name(e);
    EXPECT_EQ(parse(name(e)), e) << name(e);
    out.emplace_back(name(e));
  }
  return out;
}

TEST(IncidentVocabularyTest, NamesAreTheDocumentedSetsAndRoundTrip) {
  EXPECT_EQ(NamesOf(PhaseName, ParsePhase),
            (std::vector<std::string>{"unknown", "data", "forward", "backward", "optimizer", "commit", "checkpoint",
                                      "init", "load", "eval", "comm"}));
  EXPECT_EQ(NamesOf(IncidentKindName, ParseIncidentKind),
            (std::vector<std::string>{"unknown", "device", "host", "workspace", "coordination"}));
  EXPECT_EQ(NamesOf(LadderActionName, ParseLadderAction),
            (std::vector<std::string>{"none", "release", "halve", "rollback", "give_up"}));
  EXPECT_EQ(NamesOf(IncidentOutcomeName, ParseIncidentOutcome),
            (std::vector<std::string>{"unknown", "pending", "recovered", "rolled_back", "failed"}));
}

TEST(IncidentVocabularyTest, ParsingRejectsEverythingElse) {
  EXPECT_FALSE(ParsePhase("").has_value());
  EXPECT_FALSE(ParsePhase("Forward").has_value());
  EXPECT_FALSE(ParsePhase("vote").has_value());  // the knowledge base reads old files' "vote" itself
  EXPECT_FALSE(ParseIncidentKind("none").has_value());
  EXPECT_FALSE(ParseLadderAction("giveup").has_value());
  EXPECT_FALSE(ParseIncidentOutcome("rolled back").has_value());
}

TEST(IncidentVocabularyTest, ANewIncidentKnowsNothing) {
  Incident i;
  EXPECT_EQ(i.phase, Phase::kUnknown);
  EXPECT_EQ(i.kind, IncidentKind::kUnknown);
  EXPECT_EQ(i.action, LadderAction::kNone);
  EXPECT_EQ(i.outcome, IncidentOutcome::kUnknown);
  EXPECT_TRUE(IsKnown(i, "step"));
  i.unknown = {"step"};
  EXPECT_FALSE(IsKnown(i, "step"));
}

}  // namespace
}  // namespace oomguard
