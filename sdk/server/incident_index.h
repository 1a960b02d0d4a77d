// IncidentIndex: an immutable in-memory snapshot of one or more knowledge-base
// files, shaped for the browser: paging and text search over the incidents,
// lookup by id, per-run timelines, groups and totals.
//
// Why a snapshot instead of SQL per request: the page asks for the same few
// thousand (or hundred thousand) rows over and over, text search over the
// JSON body has no index in SQLite, and the files may be written by training
// processes at the same time. One read per change, then every request is a
// scan of memory (100,000 incidents page in a few milliseconds; see
// bench/kb_serve_bench.cc) that never touches a lock a trainer may hold.
//
// Thread-safety: immutable after construction; share it as
// std::shared_ptr<const IncidentIndex> between any number of threads.
#ifndef OOMGUARD_SDK_SERVER_INCIDENT_INDEX_H_
#define OOMGUARD_SDK_SERVER_INCIDENT_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/store.h"

namespace oomguard::server {

using RunSummary = kb::RunSummary;

class IncidentIndex {
 public:
  // What the page may ask of the incident list. filters.limit is ignored
  // (offset/limit page the matches instead).
  struct ListQuery {
    IncidentQuery filters;
    std::string text;  // case-insensitive (ASCII) substring of the searchable fields
    size_t offset = 0;
    size_t limit = 50;
  };
  struct Page {
    size_t total = 0;                    // every match, not only this page
    std::vector<const Incident*> items;  // newest first; point into the index
  };

  // `incidents` in any order (sorted here, newest first). `files` supplies the
  // per-file figures, recorded drops and priors; the counts by pattern, kind
  // and outcome are recomputed from `incidents` so every view of one snapshot
  // agrees.
  IncidentIndex(std::vector<Incident> incidents, kb::FileSetStats files, int64_t loaded_unix_ms,
                std::map<std::string, GroupNote> notes = {});

  Page List(const ListQuery& query) const;
  // nullptr when no incident has exactly this id.
  const Incident* Find(std::string_view id) const;
  // The run's incidents by step (then time); empty when the run is unknown.
  std::vector<const Incident*> Run(std::string_view run_id) const;

  const std::vector<Incident>& incidents() const { return incidents_; }
  const std::vector<IncidentGroup>& groups() const { return groups_; }
  // Runs with a non-empty run id, newest activity first.
  const std::vector<RunSummary>& runs() const { return runs_; }
  const kb::FileSetStats& stats() const { return stats_; }
  // Incident counts by rank, ascending rank.
  const std::vector<std::pair<int, int64_t>>& by_rank() const { return by_rank_; }
  int64_t loaded_unix_ms() const { return loaded_unix_ms_; }
  // The team's notes on fingerprint groups, by fingerprint.
  const std::map<std::string, GroupNote>& notes() const { return notes_; }

 private:
  std::vector<Incident> incidents_;                     // newest first
  std::unordered_map<std::string_view, size_t> by_id_;  // views into incidents_[i].id
  std::unordered_map<std::string_view, std::vector<size_t>> by_run_;
  std::vector<IncidentGroup> groups_;
  std::vector<RunSummary> runs_;
  std::vector<std::pair<int, int64_t>> by_rank_;
  kb::FileSetStats stats_;
  int64_t loaded_unix_ms_ = 0;
  std::map<std::string, GroupNote> notes_;
};

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_INCIDENT_INDEX_H_
