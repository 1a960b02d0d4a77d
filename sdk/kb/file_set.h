// Reading several knowledge-base files as one: the `oomguard kb` commands and
// the browser (`kb serve`, `kb report`) share this so that a filter, a merge
// or a group means the same thing in the terminal and in the page.
//
// One file per host is the documented layout across hosts, so every read
// here merges: incidents newest first, groups and stats recounted over the
// union (a run spanning two files counts once).
//
// Thread-safety: the free functions are pure. A KnowledgeBaseSet is used by
// one thread at a time (the server gives it to its loader only).
#ifndef OOMGUARD_SDK_KB_FILE_SET_H_
#define OOMGUARD_SDK_KB_FILE_SET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "oomguard/status.h"

namespace oomguard::kb {

// Expands --db specs: a spec with '*', '?' or '[' is a glob (it must match at
// least one file), a postgresql:// URL is a server, any other is a path.
// Duplicates are dropped, order kept. No spec: $OOMGUARD_KB_URL when set.
// kInvalidArgument names the spec that matched nothing, or says none was given.
StatusOr<std::vector<std::string>> ExpandPaths(const std::vector<std::string>& specs);

// "30m", "12h", "7d", "45s" (ago, relative to now_unix_ms), "2024-05-01"
// (UTC midnight) or unix milliseconds; "" is 0 (no filter). kInvalidArgument
// quotes the text and lists the accepted forms; the caller prefixes the name
// of the option or parameter it came from.
StatusOr<int64_t> ParseSince(std::string_view text, int64_t now_unix_ms);

// The in-memory twin of the store's WHERE clause (Store::Query): true when
// `incident` passes every non-empty filter of `query`. `limit` is ignored.
bool MatchesQuery(const Incident& incident, const IncidentQuery& query);

// What IncidentQuery::text searches: the searchable fields, lower-case
// (ASCII), joined by '\x1f'. The store keeps it in a column (schema 5), so
// the server and the file search the same text as MatchesQuery.
std::string SearchText(const Incident& incident);
// `text` lower-cased (ASCII), as SearchText is.
std::string LowerAscii(std::string_view text);

// The store's order: newest first, ties by id ascending.
bool NewerFirst(const Incident& a, const Incident& b);

// Groups by fingerprint: count, distinct runs, first/last seen and the newest
// id; most frequent first, ties newest first, then by fingerprint.
std::vector<IncidentGroup> GroupIncidents(const std::vector<Incident>& incidents);

// Totals over several files.
struct FileSetStats {
  struct File {
    std::string path;
    int schema_version = 0;
    int64_t incidents = 0;
    int64_t dropped = 0;
  };
  std::vector<File> files;
  int64_t incidents = 0;
  int64_t dropped = 0;                                      // recorded drops of full queues
  std::vector<std::pair<std::string, int64_t>> by_pattern;  // count descending, then name
  std::vector<std::pair<std::string, int64_t>> by_outcome;
  std::vector<std::pair<std::string, int64_t>> by_kind;
  std::vector<MicroBatchPrior> priors;  // every file's, in file order
};

// The knowledge-base files named by --db specs, opened for reading only
// (never created, migrated or written, no -wal/-shm left behind). Movable,
// not copyable.
class Store;
struct RunSummary;

class KnowledgeBaseSet {
 public:
  // Expands `specs` and opens every file (Store::OpenReadOnly). Fails on the
  // first file that does not open, with its code and message (naming the path).
  static StatusOr<KnowledgeBaseSet> Open(const std::vector<std::string>& specs);
  KnowledgeBaseSet();
  ~KnowledgeBaseSet();
  KnowledgeBaseSet(KnowledgeBaseSet&&) noexcept;
  KnowledgeBaseSet& operator=(KnowledgeBaseSet&&) noexcept;

  // Every file's matches, merged newest first; query.offset and query.limit
  // apply to the merge (one store answers just that page; several each give
  // their first offset + limit, so a deep page costs its depth per store).
  StatusOr<std::vector<Incident>> Query(const IncidentQuery& query);
  // How many incidents pass the filters, over every file.
  StatusOr<int64_t> Count(const IncidentQuery& query);
  // The groups of the incidents passing `filters` (limit, offset ignored),
  // counted by each store; merged over several (a run in two files counts once).
  StatusOr<std::vector<IncidentGroup>> Groups(IncidentQuery filters);
  // Runs with a run id, merged over the files, newest activity first.
  StatusOr<std::vector<RunSummary>> Runs();
  // Incident counts by rank over every file, ascending rank.
  StatusOr<std::vector<std::pair<int, int64_t>>> RankCounts();
  StatusOr<FileSetStats> Stats();
  // Every file's group notes by fingerprint; where two files note one group,
  // the newer note wins.
  StatusOr<std::map<std::string, GroupNote>> Notes();
  // Changes when anything in the files may have: each file's (and its
  // -wal's) inode, size and modification time, each server's change stamp.
  StatusOr<std::string> ChangeStamp();

  // What each file is called in messages (a server's URL without its password).
  std::vector<std::string> paths() const;
  // What opens each again (a server's URL as given, with its password).
  const std::vector<std::string>& specs() const { return specs_; }
  size_t size() const { return files_.size(); }

 private:
  std::vector<std::unique_ptr<Store>> files_;
  std::vector<std::string> specs_;
};

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_FILE_SET_H_
