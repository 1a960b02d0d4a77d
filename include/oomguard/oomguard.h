// oomguard: keep a training loop alive through out-of-memory errors.
// The umbrella header: includes every public header.
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
#include "oomguard/logging.h"
#include "oomguard/oom.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"
#include "oomguard/size_controller.h"
#include "oomguard/status.h"
#include "oomguard/version.h"

#endif  // OOMGUARD_OOMGUARD_H_
