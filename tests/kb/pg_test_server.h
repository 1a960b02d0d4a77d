// A real PostgreSQL server for one test (tests/kb/pg_server.sh: initdb in a
// temporary directory, a Unix socket, not root), stopped and removed when the
// object goes. The script's path comes from OOMGUARD_PG_SERVER_SCRIPT.
#ifndef OOMGUARD_TESTS_KB_PG_TEST_SERVER_H_
#define OOMGUARD_TESTS_KB_PG_TEST_SERVER_H_

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace oomguard::testing {

class PgTestServer {
 public:
  PgTestServer() {
    // Under /tmp: the server's user (nobody, when the tests run as root) must reach it.
    char tmpl[] = "/tmp/oomguard-pg-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    url_ = RunScript("start");
    if (url_.empty()) error_ = "pg_server.sh start failed (see its stderr above)";
  }
  ~PgTestServer() {
    if (dir_.empty()) return;
    RunScript("stop");
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  PgTestServer(const PgTestServer&) = delete;
  PgTestServer& operator=(const PgTestServer&) = delete;

  // "" when the server did not start (error() says why).
  const std::string& url() const { return url_; }
  const std::string& error() const { return error_; }
  const std::string& dir() const { return dir_; }
  bool Stop() { return Script("stop"); }
  bool Start() { return Script("restart"); }  // restart: works on a stopped server too

 private:
  bool Script(const char* cmd) {
    const std::string line = std::string(OOMGUARD_PG_SERVER_SCRIPT) + " " + cmd + " " + dir_ + " >/dev/null";
    return std::system(line.c_str()) == 0;
  }
  std::string RunScript(const char* cmd) {
    const std::string line = std::string(OOMGUARD_PG_SERVER_SCRIPT) + " " + cmd + " " + dir_;
    FILE* p = ::popen(line.c_str(), "r");
    if (p == nullptr) return "";
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    if (::pclose(p) != 0) return "";
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    return out;
  }

  std::string dir_, url_, error_;
};

}  // namespace oomguard::testing

#endif  // OOMGUARD_TESTS_KB_PG_TEST_SERVER_H_
