#include "sdk/server/snapshot.h"

#include "sdk/core/ids.h"

namespace oomguard::server {

StatusOr<std::shared_ptr<const IncidentIndex>> LoadIndex(kb::KnowledgeBaseSet* files) {
  auto stats = files->Stats();
  if (!stats.ok()) return stats.status();
  auto incidents = files->Query(IncidentQuery{});
  if (!incidents.ok()) return incidents.status();
  auto notes = files->Notes();
  if (!notes.ok()) return notes.status();
  return std::shared_ptr<const IncidentIndex>(std::make_shared<IncidentIndex>(
      std::move(incidents).value(), std::move(stats).value(), internal::NowUnixMs(), std::move(notes).value()));
}

}  // namespace oomguard::server
