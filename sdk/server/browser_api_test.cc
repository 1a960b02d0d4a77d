#include "sdk/server/browser_api.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "sdk/server/metrics.h"
#include "sdk/server/report.h"

namespace oomguard::server {
namespace {

using nlohmann::json;

const char* kXss = "<img src=x onerror=alert(1)><script>alert(2)</script>";

std::shared_ptr<const IncidentIndex> Index(int n) {
  std::vector<Incident> v;
  for (int k = 0; k < n; ++k) {
    Incident i;
    i.id = "id-" + std::to_string(k);
    i.time_unix_ms = 1000 + k;
    i.run_id = k % 2 ? "odd" : "even";
    i.rank = k % 4;
    i.step = 10 * k;
    i.pattern = k % 3 ? "fragmentation" : "gradual_growth";
    i.kind = IncidentKind::kDevice;
    i.outcome = IncidentOutcome::kRecovered;
    i.recovery_ms = 2.5;
    i.message = k == 0 ? kXss : "CUDA out of memory";
    v.push_back(std::move(i));
  }
  return std::make_shared<IncidentIndex>(std::move(v), kb::FileSetStats{}, 0);
}

TEST(BrowserApi, ListsPagesAndFilters) {
  auto idx = Index(25);
  BrowserApi api([idx] { return idx; });
  auto r = api.Handle("GET", "/api/incidents?limit=10&offset=20");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["total"], 25);
  ASSERT_EQ(j["items"].size(), 5u);
  EXPECT_EQ(j["items"][0]["id"], "id-4");  // newest first: 24..0, the 21st is id-4
  j = json::parse(api.Handle("GET", "/api/incidents?run=odd&rank=1&q=cuda+OUT").body);
  EXPECT_EQ(j["total"], 6);  // k % 4 == 1 below 25: 1, 5, 9, 13, 17, 21
  j = json::parse(api.Handle("GET", "/api/incidents?q=%3Cimg").body);
  ASSERT_EQ(j["total"], 1);
  EXPECT_EQ(j["items"][0]["message"], kXss);
}

TEST(BrowserApi, SimilarIncidentsOfOne) {
  auto idx = Index(25);
  BrowserApi api([idx] { return idx; });
  auto r = api.Handle("GET", "/api/incidents/id-4/similar");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 5u);
  for (const auto& s : j) {
    EXPECT_NE(s["id"], "id-4");
    EXPECT_EQ(s["pattern"], "fragmentation") << s.dump();  // id-4's pattern ranks first
    EXPECT_FALSE(s["resolution"].get<std::string>().empty());
  }
  EXPECT_EQ(api.Handle("GET", "/api/incidents/nope/similar").status, 404);
}

TEST(BrowserApi, ErrorsNameTheParameter) {
  auto idx = Index(3);
  BrowserApi api([idx] { return idx; });
  struct Case {
    const char* target;
    int status;
    const char* needle;
  };
  for (const Case& c :
       {Case{"/api/incidents?limit=abc", 400, "limit"}, Case{"/api/incidents?rank=-1", 400, "rank"},
        Case{"/api/incidents?since=soon", 400, "since"}, Case{"/api/incidents?bogus=1", 400, "bogus"},
        Case{"/api/incidents?q=%4", 400, "percent"}, Case{"/api/incidents/nope", 404, "nope"},
        Case{"/static/../../etc/passwd", 404, "no such path"}, Case{"/api/runs/x", 404, "x"}}) {
    HttpResponse r = api.Handle("GET", c.target);
    EXPECT_EQ(r.status, c.status) << c.target;
    EXPECT_NE(json::parse(r.body)["error"].get<std::string>().find(c.needle), std::string::npos) << r.body;
  }
  EXPECT_EQ(api.Handle("DELETE", "/api/stats").status, 405);
  EXPECT_EQ(api.Handle("GET", "/" + std::string(5000, 'a')).status, 414);
  std::string many = "/api/incidents?";
  for (int k = 0; k < 40; ++k) many += "a" + std::to_string(k) + "=1&";
  EXPECT_EQ(api.Handle("GET", many).status, 400);
}

TEST(BrowserApi, ServesOnlyTheEmbeddedAssets) {
  auto idx = Index(1);
  BrowserApi api([idx] { return idx; });
  auto page = api.Handle("GET", "/");
  EXPECT_EQ(page.status, 200);
  EXPECT_EQ(page.content_type, "text/html; charset=utf-8");
  EXPECT_EQ(api.Handle("GET", "/app.js").status, 200);
  EXPECT_EQ(api.Handle("GET", "/index.html/../app.js").status, 404);
  EXPECT_EQ(api.Handle("GET", "/CMakeLists.txt").status, 404);
  bool csp = false;
  for (auto& [k, v] : page.headers)
    csp = csp || (k == "Content-Security-Policy" && v.find("script-src 'self'") != std::string::npos);
  EXPECT_TRUE(csp);
}

TEST(Metrics, TextFormatWithEscapedLabels) {
  std::vector<Incident> v(1);
  v[0].id = "a";
  v[0].pattern = "we\"ird\\pat\ntern";
  v[0].outcome = IncidentOutcome::kRecovered;
  v[0].recovery_ms = 1500;
  v[0].time_unix_ms = 2000;
  auto idx = std::make_shared<const IncidentIndex>(std::move(v), kb::FileSetStats{}, 0);
  IndexData data([idx] { return idx; });
  std::string t = PrometheusText(*data.Totals());
  EXPECT_NE(t.find("oomguard_incidents_by_pattern_total{pattern=\"we\\\"ird\\\\pat\\ntern\"} 1\n"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("oomguard_last_recovery_seconds 1.5\n"), std::string::npos) << t;
  EXPECT_NE(t.find("# TYPE oomguard_incidents_total counter\n"), std::string::npos);
}

TEST(Report, EmbedsDataThatCannotCloseItsScript) {
  auto idx = Index(2);
  auto html = RenderReport(*idx, 0);
  ASSERT_TRUE(html.ok()) << html.status().ToString();
  EXPECT_EQ(html->find("<img src=x"), std::string::npos);
  EXPECT_EQ(html->find("alert(2)</script>"), std::string::npos);
  EXPECT_NE(html->find("\\u003cimg src=x onerror=alert(1)\\u003e\\u003cscript\\u003e"), std::string::npos);
  EXPECT_NE(html->find("<script type=\"application/json\" id=\"oomguard-data\">"), std::string::npos);
  EXPECT_EQ(html->find("src=\"/app.js\""), std::string::npos);  // inlined: the file works offline
  // The embedded document parses back to the same message.
  std::string data = ReportDataJson(*idx, 7);
  json j = json::parse(data);
  EXPECT_EQ(j["generated_unix_ms"], 7);
  EXPECT_EQ(j["incidents"][1]["message"], kXss);
}

}  // namespace
}  // namespace oomguard::server
