#include "sdk/server/incident_index.h"

#include <algorithm>
#include <map>
#include <set>

namespace oomguard::server {
namespace {

std::vector<std::pair<std::string, int64_t>> Counted(const std::map<std::string, int64_t>& m) {
  std::vector<std::pair<std::string, int64_t>> v(m.begin(), m.end());
  std::stable_sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  return v;
}

}  // namespace

IncidentIndex::IncidentIndex(std::vector<Incident> incidents, kb::FileSetStats files, int64_t loaded_unix_ms,
                             std::map<std::string, GroupNote> notes)
    : incidents_(std::move(incidents)),
      stats_(std::move(files)),
      loaded_unix_ms_(loaded_unix_ms),
      notes_(std::move(notes)) {
  std::stable_sort(incidents_.begin(), incidents_.end(), kb::NewerFirst);
  by_id_.reserve(incidents_.size());
  std::map<std::string, int64_t> by_pattern, by_outcome, by_kind;
  std::map<int, int64_t> by_rank;
  for (size_t k = 0; k < incidents_.size(); ++k) {
    const Incident& i = incidents_[k];
    by_id_.emplace(i.id, k);  // two files holding one id: the newest copy wins (emplace keeps the first)
    if (!i.run_id.empty()) by_run_[i.run_id].push_back(k);  // no run id: not part of any run
    ++by_pattern[i.pattern];
    ++by_outcome[std::string(IncidentOutcomeName(i.outcome))];
    ++by_kind[std::string(IncidentKindName(i.kind))];
    ++by_rank[i.rank];
  }
  stats_.incidents = static_cast<int64_t>(incidents_.size());
  stats_.by_pattern = Counted(by_pattern);
  stats_.by_outcome = Counted(by_outcome);
  stats_.by_kind = Counted(by_kind);
  by_rank_.assign(by_rank.begin(), by_rank.end());
  groups_ = kb::GroupIncidents(incidents_);

  for (auto& [run, members] : by_run_) {
    // members are newest first (incidents_ order); the timeline wants steps.
    std::stable_sort(members.begin(), members.end(), [this](size_t a, size_t b) {
      const Incident& x = incidents_[a];
      const Incident& y = incidents_[b];
      return x.step != y.step ? x.step < y.step : x.time_unix_ms < y.time_unix_ms;
    });
    RunSummary r;
    r.run_id = std::string(run);
    std::set<std::string> hosts;
    int64_t newest = -1;
    r.first_unix_ms = INT64_MAX;
    for (size_t k : members) {
      const Incident& i = incidents_[k];
      ++r.incidents;
      if (i.outcome == IncidentOutcome::kFailed) ++r.failed;
      hosts.insert(i.host);
      r.first_unix_ms = std::min(r.first_unix_ms, i.time_unix_ms);
      r.last_unix_ms = std::max(r.last_unix_ms, i.time_unix_ms);
      if (i.time_unix_ms > newest) {
        newest = i.time_unix_ms;
        r.workload = i.workload;
      }
    }
    r.first_step = incidents_[members.front()].step;
    r.last_step = incidents_[members.back()].step;
    r.hosts.assign(hosts.begin(), hosts.end());
    runs_.push_back(std::move(r));
  }
  std::sort(runs_.begin(), runs_.end(), [](const RunSummary& a, const RunSummary& b) {
    return a.last_unix_ms != b.last_unix_ms ? a.last_unix_ms > b.last_unix_ms : a.run_id < b.run_id;
  });
}

IncidentIndex::Page IncidentIndex::List(const ListQuery& q) const {
  IncidentQuery filters = q.filters;
  if (!q.text.empty()) filters.text = q.text;
  Page page;
  const size_t end = q.offset + std::min(q.limit, SIZE_MAX - q.offset);
  // One pass: count every match, keep those inside the requested window.
  for (const Incident& i : incidents_) {
    if (!kb::MatchesQuery(i, filters)) continue;
    if (page.total >= q.offset && page.total < end) page.items.push_back(&i);
    ++page.total;
  }
  return page;
}

const Incident* IncidentIndex::Find(std::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &incidents_[it->second];
}

std::vector<const Incident*> IncidentIndex::Run(std::string_view run_id) const {
  std::vector<const Incident*> out;
  auto it = by_run_.find(run_id);
  if (it == by_run_.end()) return out;
  out.reserve(it->second.size());
  for (size_t k : it->second) out.push_back(&incidents_[k]);
  return out;
}

}  // namespace oomguard::server
