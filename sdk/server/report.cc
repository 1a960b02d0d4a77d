#include "sdk/server/report.h"

#include <algorithm>
#include <cctype>

#include "sdk/server/assets.h"
#include "sdk/server/browser_api.h"

namespace oomguard::server {
namespace {

constexpr std::string_view kStyleLink = "<link rel=\"stylesheet\" href=\"/app.css\">";
constexpr std::string_view kScriptTag = "<script type=\"module\" src=\"/app.js\"></script>";
// No network at all from the file; inline style and script are the report's own.
constexpr std::string_view kReportCsp =
    "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'\">";

bool ContainsNoCase(std::string_view hay, std::string_view needle) {
  auto it = std::search(hay.begin(), hay.end(), needle.begin(), needle.end(),
                        [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == b; });
  return it != hay.end();
}

bool ReplaceOnce(std::string* s, std::string_view from, std::string_view to) {
  size_t at = s->find(from);
  if (at == std::string::npos) return false;
  s->replace(at, from.size(), to);
  return true;
}

}  // namespace

std::string ReportDataJson(const IncidentIndex& index, int64_t generated_unix_ms) {
  std::shared_ptr<const IncidentIndex> shared(&index, [](const IncidentIndex*) {});
  IndexData data([shared] { return shared; });
  const BrowserTotals totals = *data.Totals();
  std::string incidents = "[";
  for (size_t k = 0; k < index.incidents().size(); ++k) {
    if (k > 0) incidents += ',';
    incidents += IncidentToJson(index.incidents()[k]);
  }
  incidents += ']';
  std::string doc = "{\"mode\":\"report\",\"generated_unix_ms\":" + std::to_string(generated_unix_ms) +
                    ",\"stats\":" + StatsJson(totals) + ",\"patterns\":" + PatternsJson(totals.stats.by_pattern) +
                    ",\"groups\":" + GroupsJson(index.groups()) + ",\"runs\":" + RunsJson(index.runs()) +
                    ",\"incidents\":" + incidents + "}";
  // Outside strings JSON never holds these characters, so escaping every
  // occurrence only rewrites string contents, which JSON.parse restores.
  std::string out;
  out.reserve(doc.size() + doc.size() / 16);
  for (char c : doc) {
    if (c == '<')
      out += "\\u003c";
    else if (c == '>')
      out += "\\u003e";
    else if (c == '&')
      out += "\\u0026";
    else
      out += c;
  }
  return out;
}

StatusOr<std::string> RenderReport(const IncidentIndex& index, int64_t generated_unix_ms) {
  const EmbeddedAsset* html = FindAsset("index.html");
  const EmbeddedAsset* css = FindAsset("app.css");
  const EmbeddedAsset* js = FindAsset("app.js");
  if (html == nullptr || css == nullptr || js == nullptr)
    return Status::Internal("report: page assets missing");
  if (ContainsNoCase(js->data, "</script") || ContainsNoCase(css->data, "</style"))
    return Status::Internal("report: app.js or app.css cannot be inlined (holds a closing tag)");
  std::string page(html->data);
  std::string style = "<style>\n" + std::string(css->data) + "</style>";
  std::string script = "<script type=\"application/json\" id=\"oomguard-data\">" +
                       ReportDataJson(index, generated_unix_ms) + "</script>\n<script type=\"module\">\n" +
                       std::string(js->data) + "</script>";
  if (!ReplaceOnce(&page, kStyleLink, style) || !ReplaceOnce(&page, kScriptTag, script) ||
      !ReplaceOnce(&page, "<head>", "<head>\n" + std::string(kReportCsp)))
    return Status::Internal("report: index.html lacks the stylesheet link, script tag or <head>");
  return page;
}

}  // namespace oomguard::server
