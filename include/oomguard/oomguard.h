// oomguard: keep a training loop alive through out-of-memory errors.
// The umbrella header: includes every public header but logging.h, which
// brings spdlog (and its fmt) into the includer; include it where a program
// injects its own logger (SetLogger). Leaving it out keeps oomguard.h cheap to
// compile and usable beside libtorch 2.x, whose headers carry a newer fmt.
#ifndef OOMGUARD_OOMGUARD_H_
#define OOMGUARD_OOMGUARD_H_

#include "oomguard/checkpoint.h"
#include "oomguard/coordinator.h"
#include "oomguard/device.h"
#include "oomguard/dtype.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/incident.h"
#include "oomguard/knowledge_base.h"
#include "oomguard/oom.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"
#include "oomguard/size_controller.h"
#include "oomguard/status.h"
#include "oomguard/version.h"

#endif  // OOMGUARD_OOMGUARD_H_
