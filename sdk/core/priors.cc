// MicroBatchPriors' anchor (priors.h): its vtable and type_info live here, in
// the core, below both the guard that asks and the knowledge base that answers.
#include "oomguard/priors.h"

namespace oomguard {

MicroBatchPriors::~MicroBatchPriors() = default;

}  // namespace oomguard
