#include "sdk/server/metrics.h"

#include <cstdio>

namespace oomguard::server {
namespace {

void Header(std::string* out, const char* name, const char* type, const char* help) {
  *out += "# HELP ";
  *out += name;
  *out += ' ';
  *out += help;
  *out += "\n# TYPE ";
  *out += name;
  *out += ' ';
  *out += type;
  *out += '\n';
}

void Sample(std::string* out, const char* name, std::string_view label, std::string_view value, double v) {
  *out += name;
  if (!label.empty()) {
    *out += '{';
    *out += label;
    *out += "=\"";
    *out += EscapeLabelValue(value);
    *out += "\"}";
  }
  char buf[40];
  std::snprintf(buf, sizeof(buf), " %.17g\n", v);
  *out += buf;
}

void Counts(std::string* out, const char* name, const char* help, const char* label,
            const std::vector<std::pair<std::string, int64_t>>& counts) {
  Header(out, name, "counter", help);
  for (const auto& [k, n] : counts) Sample(out, name, label, k.empty() ? "none" : k, static_cast<double>(n));
}

}  // namespace

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string PrometheusText(const BrowserTotals& t) {
  const kb::FileSetStats& s = t.stats;
  std::string out;
  Header(&out, "oomguard_incidents_total", "counter", "Out-of-memory incidents in the knowledge base.");
  Sample(&out, "oomguard_incidents_total", "", "", static_cast<double>(s.incidents));
  Counts(&out, "oomguard_incidents_by_pattern_total", "Incidents by classified OOM pattern.", "pattern",
         s.by_pattern);
  Counts(&out, "oomguard_incidents_by_kind_total", "Incidents by kind of memory (device, host, workspace).",
         "kind", s.by_kind);
  Counts(&out, "oomguard_incidents_by_outcome_total",
         "Incidents by outcome (recovered, rolled_back, failed).", "outcome", s.by_outcome);
  Header(&out, "oomguard_incidents_by_rank_total", "counter", "Incidents by the rank that hit them.");
  for (const auto& [rank, n] : t.by_rank)
    Sample(&out, "oomguard_incidents_by_rank_total", "rank", std::to_string(rank), static_cast<double>(n));
  Header(&out, "oomguard_incidents_dropped_total", "counter",
         "Incidents lost to full knowledge-base queues, as recorded in the files.");
  Sample(&out, "oomguard_incidents_dropped_total", "", "", static_cast<double>(s.dropped));

  // Newest incident overall, and the newest one whose recovery finished.
  const Incident* recovered = t.last_recovered ? &*t.last_recovered : nullptr;
  Header(&out, "oomguard_last_incident_timestamp_seconds", "gauge",
         "Unix time of the newest incident (0: none).");
  Sample(&out, "oomguard_last_incident_timestamp_seconds", "", "",
         static_cast<double>(t.last_incident_unix_ms) / 1000.0);
  Header(&out, "oomguard_last_recovery_seconds", "gauge",
         "How long the newest recovered incident took from the OOM to the retry that succeeded.");
  Sample(&out, "oomguard_last_recovery_seconds", "", "", recovered ? recovered->recovery_ms / 1000.0 : 0.0);
  Header(&out, "oomguard_last_recovery_timestamp_seconds", "gauge",
         "Unix time of the newest recovered incident (0: none).");
  Sample(&out, "oomguard_last_recovery_timestamp_seconds", "", "",
         recovered ? static_cast<double>(recovered->time_unix_ms) / 1000.0 : 0.0);
  Header(&out, "oomguard_kb_files", "gauge", "Knowledge-base files served.");
  Sample(&out, "oomguard_kb_files", "", "", static_cast<double>(s.files.size()));
  Header(&out, "oomguard_kb_snapshot_timestamp_seconds", "gauge", "Unix time the files were last read.");
  Sample(&out, "oomguard_kb_snapshot_timestamp_seconds", "", "",
         static_cast<double>(t.loaded_unix_ms) / 1000.0);
  return out;
}

}  // namespace oomguard::server
