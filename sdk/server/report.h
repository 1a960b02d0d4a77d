// The self-contained HTML report (`oomguard kb report --html OUT`): the
// browser's page with its style, its script and the whole snapshot inlined,
// so one file can be attached to a ticket and opened offline.
//
// The data travels as JSON inside <script type="application/json">, with
// '<', '>' and '&' written as \u003c, \u003e, \u0026: no incident text can
// close the element or open markup. The page reads it with JSON.parse and
// renders it with the same code (textContent only) as when served.
//
// Thread-safety: pure function of an immutable index.
#ifndef OOMGUARD_SDK_SERVER_REPORT_H_
#define OOMGUARD_SDK_SERVER_REPORT_H_

#include <string>
#include <string_view>

#include "oomguard/status.h"
#include "sdk/server/incident_index.h"

namespace oomguard::server {

// The report's HTML. kInternal only when the embedded assets cannot be
// inlined safely (a build problem: an asset holds "</script" or "</style").
StatusOr<std::string> RenderReport(const IncidentIndex& index, int64_t generated_unix_ms);

// The report's data document: {"mode":"report","generated_unix_ms","stats",
// "patterns","groups","runs","incidents"}, '<' '>' '&' escaped as above.
std::string ReportDataJson(const IncidentIndex& index, int64_t generated_unix_ms);

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_REPORT_H_
