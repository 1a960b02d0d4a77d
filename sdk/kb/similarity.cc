// FindSimilar (similarity.h).
#include "sdk/kb/similarity.h"

#include <algorithm>
#include <cmath>

#include "sdk/kb/text_model.h"

namespace oomguard::kb {
namespace {

// Weights of the three signals; they add to 1.
constexpr double kSameFingerprint = 0.45;
constexpr double kSamePattern = 0.25;
constexpr double kText = 0.30;
constexpr int kBuckets = 4096;
// Incidents sharing neither fingerprint nor pattern are compared by text only
// up to this many (newest first in a knowledge base's order), so one lookup
// in a library of 100,000 incidents stays within a second.
constexpr size_t kMaxTextOnly = 20000;

using Sparse = std::vector<std::pair<int, float>>;

double Cosine(const Sparse& a, const Sparse& b) {
  // Both are sorted by bucket and L2-normalised.
  double dot = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].first < b[j].first) ++i;
    else if (a[i].first > b[j].first) ++j;
    else dot += static_cast<double>(a[i++].second) * b[j++].second;
  }
  return std::clamp(dot, 0.0, 1.0);
}

Sparse FeaturesOf(const Incident& inc) {
  std::string text = inc.message;
  if (!inc.context.empty()) text += "\n" + inc.context;
  return TextFeatures(text, kBuckets);
}

}  // namespace

std::string ResolutionOf(const Incident& i) {
  std::string out;
  if (i.outcome != IncidentOutcome::kUnknown && i.outcome != IncidentOutcome::kPending) {
    out = std::string(IncidentOutcomeName(i.outcome));
    if (i.action != LadderAction::kNone) out += " by " + std::string(LadderActionName(i.action));
    if (i.micro_before > 0 && i.micro_after > 0 && i.micro_after != i.micro_before)
      out += " (micro-batch " + std::to_string(i.micro_before) + " -> " + std::to_string(i.micro_after) + ")";
  }
  if (!i.remedies.empty()) out += std::string(out.empty() ? "" : "; ") + "remedy: " + i.remedies[0];
  return out.empty() ? "no resolution recorded" : out;
}

std::vector<SimilarIncident> FindSimilar(const Incident& target, const std::vector<Incident>& pool, size_t limit,
                                         double min_score) {
  const Sparse t = FeaturesOf(target);
  std::vector<SimilarIncident> out;
  size_t text_only = 0;
  for (const Incident& inc : pool) {
    if (!target.id.empty() && inc.id == target.id) continue;
    SimilarIncident s;
    s.incident = &inc;
    std::vector<std::string> why;
    if (!target.fingerprint.empty() && inc.fingerprint == target.fingerprint) {
      s.score += kSameFingerprint;
      why.push_back("same fingerprint");
    }
    if (!target.pattern.empty() && target.pattern != "unknown" && inc.pattern == target.pattern) {
      s.score += kSamePattern;
      why.push_back("same pattern");
    }
    if (why.empty() && ++text_only > kMaxTextOnly) continue;
    const double cos = Cosine(t, FeaturesOf(inc));
    s.score += kText * cos;
    if (cos >= 0.2) why.push_back("texts " + std::to_string(static_cast<int>(cos * 100 + 0.5)) + "% alike");
    if (s.score < min_score) continue;
    for (const auto& w : why) s.why += (s.why.empty() ? "" : "; ") + w;
    out.push_back(std::move(s));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const SimilarIncident& a, const SimilarIncident& b) { return a.score > b.score; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

}  // namespace oomguard::kb
