#include "sdk/kb/file_set.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <map>
#include <set>

#include "sdk/kb/store.h"

namespace oomguard::kb {

StatusOr<std::vector<std::string>> ExpandPaths(const std::vector<std::string>& given) {
  std::vector<std::string> specs = given;
  if (specs.empty()) {
    if (const char* url = std::getenv("OOMGUARD_KB_URL"); url != nullptr && *url != '\0') specs.push_back(url);
  }
  if (specs.empty())
    return Status::InvalidArgument(
        "--db is required (repeat it, or use a glob, to read several files; or set OOMGUARD_KB_URL to a "
        "postgresql:// URL)");
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const std::string& spec : specs) {
    // A server's URL is no glob ('?' starts its parameters).
    if (spec.find_first_of("*?[") == std::string::npos || IsServerUrl(spec)) {
      if (seen.insert(spec).second) out.push_back(spec);
      continue;
    }
    glob_t g{};
    int rc = ::glob(spec.c_str(), 0, nullptr, &g);
    if (rc != 0 || g.gl_pathc == 0) {
      globfree(&g);
      return Status::InvalidArgument("--db '" + spec + "': no file matches");
    }
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (seen.insert(g.gl_pathv[i]).second) out.emplace_back(g.gl_pathv[i]);
    globfree(&g);
  }
  return out;
}

StatusOr<int64_t> ParseSince(std::string_view text, int64_t now_unix_ms) {
  if (text.empty()) return int64_t{0};
  std::string s(text);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == 0 && end != s.c_str()) {
    std::string_view unit(end);
    if (unit.empty()) return static_cast<int64_t>(v);  // unix milliseconds
    int64_t mult = unit == "s"   ? 1000
                   : unit == "m" ? 60'000
                   : unit == "h" ? 3'600'000
                   : unit == "d" ? 86'400'000
                                 : 0;
    // A duration longer than the epoch would overflow; it means "everything".
    if (mult > 0 && v >= 0) return v > now_unix_ms / mult ? int64_t{0} : now_unix_ms - v * mult;
  }
  std::tm tm{};
  if (s.size() == 10) {
    const char* rest = strptime(s.c_str(), "%Y-%m-%d", &tm);
    if (rest != nullptr && *rest == '\0') return static_cast<int64_t>(timegm(&tm)) * 1000;
  }
  return Status::InvalidArgument(
      "'" + s + "': expected a duration (30m, 12h, 7d), a date (2024-05-01) or unix milliseconds");
}

std::string LowerAscii(std::string_view text) {
  std::string out(text);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string SearchText(const Incident& i) {
  std::string out;
  for (std::string_view f : {std::string_view(i.id), std::string_view(i.run_id), std::string_view(i.host),
                             std::string_view(i.message), std::string_view(i.exception_type),
                             std::string_view(i.pattern), std::string_view(i.workload), PhaseName(i.phase),
                             IncidentKindName(i.kind), IncidentOutcomeName(i.outcome),
                             std::string_view(i.fingerprint), std::string_view(i.evidence)}) {
    if (!out.empty()) out += '\x1f';
    out += f;
  }
  return LowerAscii(out);
}

bool MatchesQuery(const Incident& i, const IncidentQuery& q) {
  if (!q.pattern.empty() && i.pattern != q.pattern) return false;
  if (q.rank && i.rank != *q.rank) return false;
  if (!q.run_id.empty() && i.run_id != q.run_id) return false;
  if (!q.workload.empty() && i.workload != q.workload) return false;
  if (!q.fingerprint.empty() && i.fingerprint != q.fingerprint) return false;
  if (!q.id_prefix.empty() && i.id.compare(0, q.id_prefix.size(), q.id_prefix) != 0) return false;
  if (!q.id.empty() && i.id != q.id) return false;
  if (!q.outcome.empty() && IncidentOutcomeName(i.outcome) != q.outcome) return false;
  if (q.since_unix_ms > 0 && i.time_unix_ms < q.since_unix_ms) return false;
  if (!q.text.empty() && SearchText(i).find(LowerAscii(q.text)) == std::string::npos) return false;
  return true;
}

bool NewerFirst(const Incident& a, const Incident& b) {
  if (a.time_unix_ms != b.time_unix_ms) return a.time_unix_ms > b.time_unix_ms;
  return a.id < b.id;
}

std::vector<IncidentGroup> GroupIncidents(const std::vector<Incident>& incidents) {
  struct Acc {
    IncidentGroup g;
    std::set<std::string> runs;
  };
  std::map<std::string, Acc> groups;
  for (const Incident& i : incidents) {
    Acc& acc = groups[i.fingerprint];
    IncidentGroup& g = acc.g;
    if (g.count == 0)
      g = {i.fingerprint, i.pattern, i.kind, i.phase, i.workload, 0, 0, i.time_unix_ms, i.time_unix_ms, i.id};
    ++g.count;
    acc.runs.insert(i.run_id);
    g.first_seen_unix_ms = std::min(g.first_seen_unix_ms, i.time_unix_ms);
    if (i.time_unix_ms > g.last_seen_unix_ms) {
      g.last_seen_unix_ms = i.time_unix_ms;
      g.last_id = i.id;
    }
  }
  std::vector<IncidentGroup> out;
  out.reserve(groups.size());
  for (auto& [fp, acc] : groups) {
    acc.g.runs = static_cast<int64_t>(acc.runs.size());
    out.push_back(std::move(acc.g));
  }
  std::sort(out.begin(), out.end(), [](const IncidentGroup& x, const IncidentGroup& y) {
    if (x.count != y.count) return x.count > y.count;
    if (x.last_seen_unix_ms != y.last_seen_unix_ms) return x.last_seen_unix_ms > y.last_seen_unix_ms;
    return x.fingerprint < y.fingerprint;  // the store's order too (Store::Groups)
  });
  return out;
}

StatusOr<KnowledgeBaseSet> KnowledgeBaseSet::Open(const std::vector<std::string>& specs) {
  auto paths = ExpandPaths(specs);
  if (!paths.ok()) return paths.status();
  KnowledgeBaseSet set;
  for (const std::string& path : *paths) {
    // Reading never creates, migrates or writes a file (nor leaves -wal/-shm).
    auto store = Store::OpenReadOnly(path, KnowledgeBaseOptions{}.busy_timeout_ms);
    if (!store.ok()) return store.status();
    set.files_.push_back(std::move(store).value());
    set.specs_.push_back(path);
  }
  return set;
}

KnowledgeBaseSet::KnowledgeBaseSet() = default;
KnowledgeBaseSet::~KnowledgeBaseSet() = default;
KnowledgeBaseSet::KnowledgeBaseSet(KnowledgeBaseSet&&) noexcept = default;
KnowledgeBaseSet& KnowledgeBaseSet::operator=(KnowledgeBaseSet&&) noexcept = default;

StatusOr<std::vector<Incident>> KnowledgeBaseSet::Query(const IncidentQuery& query) {
  // One store pages itself (a server answers only the page); several are
  // merged first: each gives its first offset + limit, the merge is sliced.
  if (files_.size() == 1) return files_[0]->Query(query);
  IncidentQuery each = query;
  each.offset = 0;
  if (query.limit > 0) each.limit = query.limit + query.offset;
  std::vector<Incident> all;
  for (auto& store : files_) {
    auto r = store->Query(each);  // each file already limited, so the merge is too
    if (!r.ok()) return r.status();
    if (all.empty()) {
      all = std::move(r).value();
    } else {
      for (auto& inc : *r) all.push_back(std::move(inc));
    }
  }
  std::stable_sort(all.begin(), all.end(), NewerFirst);
  const size_t skip = std::min(all.size(), static_cast<size_t>(query.offset));
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(skip));
  if (query.limit > 0 && all.size() > static_cast<size_t>(query.limit))
    all.resize(static_cast<size_t>(query.limit));
  return all;
}

StatusOr<int64_t> KnowledgeBaseSet::Count(const IncidentQuery& query) {
  int64_t n = 0;
  for (auto& store : files_) {
    auto c = store->Count(query);
    if (!c.ok()) return c.status();
    n += *c;
  }
  return n;
}

StatusOr<std::vector<IncidentGroup>> KnowledgeBaseSet::Groups(IncidentQuery filters) {
  filters.limit = 0;
  filters.offset = 0;
  if (files_.size() == 1) return files_[0]->Groups(filters);
  // Each store groups its own; the merge adds counts, takes the extremes and
  // counts a group's runs over the union of the stores' (fingerprint, run)
  // pairs, so a run spanning two stores counts once.
  std::map<std::string, IncidentGroup> merged;
  std::set<std::pair<std::string, std::string>> runs;
  for (auto& store : files_) {
    auto groups = store->Groups(filters);
    if (!groups.ok()) return groups.status();
    for (IncidentGroup& g : *groups) {
      auto [it, fresh] = merged.emplace(g.fingerprint, g);
      if (fresh) continue;
      IncidentGroup& m = it->second;
      m.count += g.count;
      m.first_seen_unix_ms = std::min(m.first_seen_unix_ms, g.first_seen_unix_ms);
      if (g.last_seen_unix_ms > m.last_seen_unix_ms ||
          (g.last_seen_unix_ms == m.last_seen_unix_ms && g.last_id < m.last_id)) {
        const int64_t count = m.count, first = m.first_seen_unix_ms;
        m = g;
        m.count = count;
        m.first_seen_unix_ms = first;
      }
    }
    auto pairs = store->GroupRuns(filters);
    if (!pairs.ok()) return pairs.status();
    runs.insert(pairs->begin(), pairs->end());
  }
  std::map<std::string, int64_t> run_counts;
  for (const auto& [fp, run] : runs) ++run_counts[fp];
  std::vector<IncidentGroup> out;
  out.reserve(merged.size());
  for (auto& [fp, g] : merged) {
    g.runs = run_counts[fp];
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const IncidentGroup& x, const IncidentGroup& y) {
    if (x.count != y.count) return x.count > y.count;
    if (x.last_seen_unix_ms != y.last_seen_unix_ms) return x.last_seen_unix_ms > y.last_seen_unix_ms;
    return x.fingerprint < y.fingerprint;
  });
  return out;
}

StatusOr<std::vector<RunSummary>> KnowledgeBaseSet::Runs() {
  // A run spanning stores (ranks on several hosts) is one run: its counts
  // add up, its hosts join, its workload is that of its newest incident.
  std::map<std::string, RunSummary> merged;
  for (auto& store : files_) {
    auto runs = store->Runs();
    if (!runs.ok()) return runs.status();
    for (RunSummary& r : *runs) {
      auto [it, fresh] = merged.emplace(r.run_id, r);
      if (fresh) continue;
      RunSummary& m = it->second;
      m.incidents += r.incidents;
      m.failed += r.failed;
      if (r.last_unix_ms > m.last_unix_ms) m.workload = r.workload;
      m.first_unix_ms = std::min(m.first_unix_ms, r.first_unix_ms);
      m.last_unix_ms = std::max(m.last_unix_ms, r.last_unix_ms);
      m.first_step = std::min(m.first_step, r.first_step);
      m.last_step = std::max(m.last_step, r.last_step);
      std::set<std::string> hosts(m.hosts.begin(), m.hosts.end());
      hosts.insert(r.hosts.begin(), r.hosts.end());
      m.hosts.assign(hosts.begin(), hosts.end());
    }
  }
  std::vector<RunSummary> out;
  out.reserve(merged.size());
  for (auto& [id, r] : merged) out.push_back(std::move(r));
  // Newest activity first.
  std::sort(out.begin(), out.end(), [](const RunSummary& a, const RunSummary& b) {
    return a.last_unix_ms != b.last_unix_ms ? a.last_unix_ms > b.last_unix_ms : a.run_id < b.run_id;
  });
  return out;
}

StatusOr<std::vector<std::pair<int, int64_t>>> KnowledgeBaseSet::RankCounts() {
  std::map<int, int64_t> by_rank;
  for (auto& store : files_) {
    auto ranks = store->RankCounts();
    if (!ranks.ok()) return ranks.status();
    for (const auto& [rank, n] : *ranks) by_rank[rank] += n;
  }
  return std::vector<std::pair<int, int64_t>>(by_rank.begin(), by_rank.end());
}

StatusOr<std::string> KnowledgeBaseSet::ChangeStamp() {
  std::string sig;
  for (size_t k = 0; k < files_.size(); ++k) {
    if (!files_[k]->remote()) {
      for (const std::string& f : {specs_[k], specs_[k] + "-wal"}) {
        struct stat st {};
        if (::stat(f.c_str(), &st) != 0) {
          sig += "-;";
          continue;
        }
        // The inode too: `mv new.db kb.db` (rsync, scp) puts another file
        // under the name, possibly with the same size and time.
        sig += std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) +
               ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + ";";
      }
      continue;
    }
    auto stamp = files_[k]->ChangeStamp();
    if (!stamp.ok()) return stamp.status();
    sig += *stamp + ";";
  }
  return sig;
}

StatusOr<FileSetStats> KnowledgeBaseSet::Stats() {
  FileSetStats out;
  std::map<std::string, int64_t> by_pattern, by_outcome, by_kind;
  for (auto& store : files_) {
    auto s = store->Stats();
    if (!s.ok()) return s.status();
    out.files.push_back({store->path(), s->schema_version, s->incidents, s->dropped_recorded});
    out.incidents += s->incidents;
    out.dropped += s->dropped_recorded;
    for (auto& [k, n] : s->by_pattern) by_pattern[k] += n;
    for (auto& [k, n] : s->by_outcome) by_outcome[k] += n;
    for (auto& [k, n] : s->by_kind) by_kind[k] += n;
    for (auto& p : s->priors) out.priors.push_back(p);
  }
  auto sorted = [](const std::map<std::string, int64_t>& m) {
    std::vector<std::pair<std::string, int64_t>> v(m.begin(), m.end());
    std::stable_sort(v.begin(), v.end(), [](auto& x, auto& y) { return x.second > y.second; });
    return v;
  };
  out.by_pattern = sorted(by_pattern);
  out.by_outcome = sorted(by_outcome);
  out.by_kind = sorted(by_kind);
  return out;
}

StatusOr<std::map<std::string, GroupNote>> KnowledgeBaseSet::Notes() {
  std::map<std::string, GroupNote> out;
  for (auto& store : files_) {
    auto notes = store->Notes();
    if (!notes.ok()) return notes.status();
    for (GroupNote& n : *notes) {
      auto it = out.find(n.fingerprint);
      if (it == out.end() || it->second.updated_unix_ms < n.updated_unix_ms) out[n.fingerprint] = std::move(n);
    }
  }
  return out;
}

std::vector<std::string> KnowledgeBaseSet::paths() const {
  std::vector<std::string> out;
  for (const auto& store : files_) out.push_back(store->path());
  return out;
}

}  // namespace oomguard::kb
