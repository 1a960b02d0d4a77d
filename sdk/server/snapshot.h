// LoadIndex: every incident and the totals of knowledge-base files read into
// one in-memory IncidentIndex, for `oomguard kb report` (a self-contained
// HTML file embeds them all). `kb serve` does not load: it asks the stores
// per request (browser_data.h).
//
// Thread-safety: uses `files` from the calling thread only.
#ifndef OOMGUARD_SDK_SERVER_SNAPSHOT_H_
#define OOMGUARD_SDK_SERVER_SNAPSHOT_H_

#include <memory>

#include "oomguard/status.h"
#include "sdk/kb/file_set.h"
#include "sdk/server/incident_index.h"

namespace oomguard::server {

// Reads every incident and the totals of `files` into a new index.
StatusOr<std::shared_ptr<const IncidentIndex>> LoadIndex(kb::KnowledgeBaseSet* files);

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_SNAPSHOT_H_
