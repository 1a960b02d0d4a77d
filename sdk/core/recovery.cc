// RecoveryStore's anchor (recovery.h): its vtable and type_info live here, in
// the core, below both the guard that calls it and the checkpointer that
// implements it.
#include "oomguard/recovery.h"

namespace oomguard {

RecoveryStore::~RecoveryStore() = default;

}  // namespace oomguard
