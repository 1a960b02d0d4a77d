// Small process-wide facts and identifiers used by several components.
// Thread-safety: all functions may be called from any thread.
#ifndef OOMGUARD_SDK_CORE_IDS_H_
#define OOMGUARD_SDK_CORE_IDS_H_

#include <cstdint>
#include <string>

namespace oomguard::internal {

// 16 lowercase hex digits from a per-process random generator (incident ids, run ids).
std::string RandomHex16();
// The host name, or "unknown-host".
const std::string& HostName();
// Milliseconds since the Unix epoch.
int64_t NowUnixMs();

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_CORE_IDS_H_
