// The incident kind (incident.h, core) of a classified OOM (oom.h, memory).
// Here, in memory, because the core must not know OomKind; shared by the
// guard and the knowledge base's importer and classifier.
// Thread-safety: a pure function.
#ifndef OOMGUARD_SDK_MEMORY_INCIDENT_KIND_H_
#define OOMGUARD_SDK_MEMORY_INCIDENT_KIND_H_

#include "oomguard/incident.h"
#include "oomguard/oom.h"

namespace oomguard::internal {

inline IncidentKind IncidentKindOf(OomKind kind) {
  switch (kind) {
    case OomKind::kDevice: return IncidentKind::kDevice;
    case OomKind::kHost: return IncidentKind::kHost;
    case OomKind::kWorkspace: return IncidentKind::kWorkspace;
    case OomKind::kNone: break;
  }
  return IncidentKind::kUnknown;
}

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_MEMORY_INCIDENT_KIND_H_
