// Private parts of fault injection (include/oomguard/faults.h), exposed for
// the SDK's own tests and not part of the installed API.
#ifndef OOMGUARD_SDK_CORE_FAULTS_INTERNAL_H_
#define OOMGUARD_SDK_CORE_FAULTS_INTERNAL_H_

#include <atomic>

#include "oomguard/faults.h"
#include "oomguard/status.h"

namespace oomguard::internal {

// True while some rule is set: FaultPoint's fast path reads only this.
// Constant-initialised, so fault points in static initialisers see false.
extern std::atomic<bool> g_faults_armed;

// FaultPoint's slow path: evaluates the active rules at `site`.
void FireFaults(FaultSite site, const FaultContext& ctx);

// What LoadFaultRulesFromEnv does with the variable's value, minus the
// once-per-process latch, so that tests can exercise it in-process.
// nullptr or an all-whitespace value: OK, and the active rules are left alone
// (an unset variable must not undo rules set through SetFaultRules). Otherwise
// the value is parsed and installed; a parse error leaves the active rules
// unchanged and is returned as is (kInvalidArgument naming the rule).
// Thread-safety: as SetFaultRules.
Status LoadFaultRulesFromEnvValue(const char* value);

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_CORE_FAULTS_INTERNAL_H_
