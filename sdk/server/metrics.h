// Prometheus text exposition (format 0.0.4) of a knowledge-base snapshot, so
// an existing Prometheus/Grafana setup can scrape `kb serve` and alert on
// OOMs. Counts are totals over the files served; they only grow while
// incidents are only added, which is how the SDK uses the files.
//
// Thread-safety: pure function.
#ifndef OOMGUARD_SDK_SERVER_METRICS_H_
#define OOMGUARD_SDK_SERVER_METRICS_H_

#include <string>
#include <string_view>

#include "sdk/server/browser_data.h"

namespace oomguard::server {

std::string PrometheusText(const BrowserTotals& totals);

// A label value escaped for the text format (backslash, quote, newline).
std::string EscapeLabelValue(std::string_view v);

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_METRICS_H_
