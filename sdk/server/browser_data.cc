#include "sdk/server/browser_data.h"

#include <algorithm>
#include <set>

#include "sdk/core/ids.h"

namespace oomguard::server {
namespace {

bool Recovered(const Incident& i) {
  return i.outcome == IncidentOutcome::kRecovered || i.outcome == IncidentOutcome::kRolledBack;
}

// No filter set (paging aside): the whole library's groups, which both
// sources keep ready.
bool Unfiltered(const IncidentQuery& q) {
  return q.pattern.empty() && !q.rank && q.run_id.empty() && q.since_unix_ms == 0 && q.workload.empty() &&
         q.fingerprint.empty() && q.text.empty() && q.outcome.empty() && q.id.empty() && q.id_prefix.empty();
}

void ByStep(std::vector<Incident>* v) {
  std::stable_sort(v->begin(), v->end(), [](const Incident& x, const Incident& y) {
    return x.step != y.step ? x.step < y.step : x.time_unix_ms < y.time_unix_ms;
  });
}

}  // namespace

// ---- IndexData: an in-memory snapshot ----

StatusOr<BrowserData::Page> IndexData::List(const IncidentQuery& q) {
  auto snap = snapshot_();
  IncidentIndex::ListQuery lq;
  lq.filters = q;
  lq.text = q.text;
  lq.offset = static_cast<size_t>(q.offset);
  lq.limit = q.limit > 0 ? static_cast<size_t>(q.limit) : SIZE_MAX;
  IncidentIndex::Page p = snap->List(lq);
  Page out;
  out.total = static_cast<int64_t>(p.total);
  for (const Incident* i : p.items) out.items.push_back(*i);
  return out;
}

StatusOr<std::optional<Incident>> IndexData::Find(const std::string& id) {
  auto snap = snapshot_();
  const Incident* i = snap->Find(id);
  return i == nullptr ? std::optional<Incident>() : std::optional<Incident>(*i);
}

StatusOr<std::vector<Incident>> IndexData::Run(const std::string& run_id) {
  auto snap = snapshot_();
  std::vector<Incident> out;
  for (const Incident* i : snap->Run(run_id)) out.push_back(*i);
  return out;
}

StatusOr<std::vector<RunSummary>> IndexData::Runs() { return snapshot_()->runs(); }

StatusOr<std::vector<IncidentGroup>> IndexData::Groups(const IncidentQuery& filters) {
  auto snap = snapshot_();
  if (Unfiltered(filters)) return snap->groups();
  std::vector<Incident> matching;
  for (const Incident& i : snap->incidents())
    if (kb::MatchesQuery(i, filters)) matching.push_back(i);
  return kb::GroupIncidents(matching);
}

StatusOr<BrowserTotals> IndexData::Totals() {
  auto snap = snapshot_();
  BrowserTotals t;
  t.stats = snap->stats();
  t.by_rank = snap->by_rank();
  t.runs = static_cast<int64_t>(snap->runs().size());
  t.groups = static_cast<int64_t>(snap->groups().size());
  if (!snap->incidents().empty()) t.last_incident_unix_ms = snap->incidents().front().time_unix_ms;
  for (const Incident& i : snap->incidents()) {
    if (Recovered(i)) {
      t.last_recovered = i;
      break;
    }
  }
  t.loaded_unix_ms = snap->loaded_unix_ms();
  return t;
}

StatusOr<std::map<std::string, GroupNote>> IndexData::Notes() { return snapshot_()->notes(); }

StatusOr<std::vector<Incident>> IndexData::SimilarPool(const Incident&) { return snapshot_()->incidents(); }

// ---- StoreData: SQL per request ----

StatusOr<std::unique_ptr<StoreData>> StoreData::Open(const std::vector<std::string>& specs, int poll_ms) {
  auto set = kb::KnowledgeBaseSet::Open(specs);
  if (!set.ok()) return set.status();
  std::unique_ptr<StoreData> data(new StoreData(set->specs(), set->paths(), poll_ms));
  for (const std::string& s : data->specs_) data->any_file_ = data->any_file_ || !kb::IsServerUrl(s);
  auto stamp = set->ChangeStamp();
  if (!stamp.ok()) return stamp.status();
  data->stamp_ = *stamp;
  data->stamp_checked_ = std::chrono::steady_clock::now();
  if (!data->any_file_) data->set_ = std::move(set).value();
  return data;
}

Status StoreData::With(const std::function<Status(kb::KnowledgeBaseSet&)>& read) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!set_) {
    auto set = kb::KnowledgeBaseSet::Open(specs_);
    if (!set.ok()) return set.status();
    set_ = std::move(set).value();
  }
  const auto now = std::chrono::steady_clock::now();
  if (poll_ms_ <= 0 || now - stamp_checked_ >= std::chrono::milliseconds(poll_ms_)) {
    auto stamp = set_->ChangeStamp();
    if (!stamp.ok()) {
      set_.reset();  // a server that went away: connect again next time
      return stamp.status();
    }
    stamp_checked_ = now;
    if (*stamp != stamp_) {
      stamp_ = std::move(stamp).value();
      totals_.reset();
      runs_.reset();
      groups_.reset();
    }
  }
  Status s = read(*set_);
  // Files are not held open between requests; a server whose connection
  // failed is connected again by the next one.
  if (any_file_ || !s.ok()) set_.reset();
  return s;
}

StatusOr<BrowserData::Page> StoreData::List(const IncidentQuery& q) {
  Page page;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    auto items = set.Query(q);
    if (!items.ok()) return items.status();
    auto total = set.Count(q);
    if (!total.ok()) return total.status();
    page.items = std::move(items).value();
    page.total = *total;
    return Status::Ok();
  }));
  return page;
}

StatusOr<std::optional<Incident>> StoreData::Find(const std::string& id) {
  std::optional<Incident> out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    IncidentQuery q;
    q.id = id;
    q.limit = 1;  // the newest copy where two stores hold one id
    auto r = set.Query(q);
    if (!r.ok()) return r.status();
    if (!r->empty()) out = std::move(r->front());
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::vector<Incident>> StoreData::Run(const std::string& run_id) {
  std::vector<Incident> out;
  if (run_id.empty()) return out;  // no run id: not part of any run
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    IncidentQuery q;
    q.run_id = run_id;
    auto r = set.Query(q);
    if (!r.ok()) return r.status();
    out = std::move(r).value();
    return Status::Ok();
  }));
  ByStep(&out);
  return out;
}

StatusOr<std::vector<RunSummary>> StoreData::Runs() {
  std::vector<RunSummary> out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    if (!runs_) {
      auto r = set.Runs();
      if (!r.ok()) return r.status();
      runs_ = std::move(r).value();
    }
    out = *runs_;
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::vector<IncidentGroup>> StoreData::Groups(const IncidentQuery& filters) {
  const bool unfiltered = Unfiltered(filters);
  std::vector<IncidentGroup> out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    if (unfiltered && groups_) {
      out = *groups_;
      return Status::Ok();
    }
    auto g = set.Groups(filters);
    if (!g.ok()) return g.status();
    out = std::move(g).value();
    if (unfiltered) groups_ = out;
    return Status::Ok();
  }));
  return out;
}

StatusOr<BrowserTotals> StoreData::Totals() {
  BrowserTotals out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    if (totals_) {
      out = *totals_;
      return Status::Ok();
    }
    BrowserTotals t;
    auto stats = set.Stats();
    if (!stats.ok()) return stats.status();
    t.stats = std::move(stats).value();
    auto ranks = set.RankCounts();
    if (!ranks.ok()) return ranks.status();
    t.by_rank = std::move(ranks).value();
    if (!runs_) {
      auto r = set.Runs();
      if (!r.ok()) return r.status();
      runs_ = std::move(r).value();
    }
    t.runs = static_cast<int64_t>(runs_->size());
    if (!groups_) {
      auto g = set.Groups(IncidentQuery{});
      if (!g.ok()) return g.status();
      groups_ = std::move(g).value();
    }
    t.groups = static_cast<int64_t>(groups_->size());
    IncidentQuery newest;
    newest.limit = 1;
    auto last = set.Query(newest);
    if (!last.ok()) return last.status();
    if (!last->empty()) t.last_incident_unix_ms = last->front().time_unix_ms;
    for (const char* outcome : {"recovered", "rolled_back"}) {
      newest.outcome = outcome;
      auto r = set.Query(newest);
      if (!r.ok()) return r.status();
      if (!r->empty() && (!t.last_recovered || kb::NewerFirst(r->front(), *t.last_recovered)))
        t.last_recovered = std::move(r->front());
    }
    t.loaded_unix_ms = internal::NowUnixMs();
    totals_ = t;
    out = std::move(t);
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::map<std::string, GroupNote>> StoreData::Notes() {
  std::map<std::string, GroupNote> out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    auto n = set.Notes();
    if (!n.ok()) return n.status();
    out = std::move(n).value();
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::vector<Incident>> StoreData::SimilarPool(const Incident& target) {
  std::vector<Incident> out;
  OOMGUARD_RETURN_IF_ERROR(With([&](kb::KnowledgeBaseSet& set) -> Status {
    IncidentQuery q;
    q.limit = kSimilarPool;
    auto newest = set.Query(q);
    if (!newest.ok()) return newest.status();
    out = std::move(newest).value();
    if (!target.pattern.empty()) {
      q.pattern = target.pattern;
      auto same = set.Query(q);
      if (!same.ok()) return same.status();
      std::set<std::string> have;
      for (const Incident& i : out) have.insert(i.id);
      for (Incident& i : *same)
        if (have.insert(i.id).second) out.push_back(std::move(i));
    }
    return Status::Ok();
  }));
  return out;
}

}  // namespace oomguard::server
