// `oomguard kb serve` and `oomguard kb report`: the knowledge-base browser
// (sdk/server) served over HTTP, or written as one self-contained HTML file.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/cli/command.h"
#include "sdk/core/ids.h"
#include "sdk/server/browser_api.h"
#include "sdk/server/http_server.h"
#include "sdk/server/report.h"
#include "sdk/server/snapshot.h"

namespace oomguard::cli {
namespace {

struct ServeArgs {
  std::vector<std::string> dbs;
  std::string bind = "127.0.0.1";
  int port = 8080;
  int poll_ms = 1000;
  std::string html;
  std::string notes_token_file;
};

// The token that lets the page write notes: the file's first line (a token
// on the command line would show in `ps`). "" with an error message on failure.
std::string ReadToken(const std::string& path, std::string* error) {
  std::ifstream in(path);
  std::string token;
  if (!in || !std::getline(in, token)) {
    *error = path + ": cannot read the token";
    return "";
  }
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.size() < 16) {
    *error = path + ": the token must be at least 16 characters";
    return "";
  }
  return token;
}

int Serve(const ServeArgs& a) {
  auto source = server::SnapshotSource::Open(a.dbs, a.poll_ms);
  if (!source.ok()) {
    std::fprintf(stderr, "oomguard kb serve: %s\n", source.status().ToString().c_str());
    return 1;
  }
  server::SnapshotSource* src = source->get();
  server::BrowserApi api([src] { return src->Current(); });
  if (!a.notes_token_file.empty()) {
    std::string error;
    std::string token = ReadToken(a.notes_token_file, &error);
    if (token.empty()) {
      std::fprintf(stderr, "oomguard kb serve: --notes-token-file %s\n", error.c_str());
      return 1;
    }
    // Notes go to the first --db (a team's server, typically); the poller
    // shows them with the next snapshot. One writer at a time.
    const std::string target = src->paths().front();
    auto mu = std::make_shared<std::mutex>();
    api.EnableNoteWrites(std::move(token), [target, mu](const GroupNote& note) -> Status {
      std::lock_guard<std::mutex> lock(*mu);
      KnowledgeBaseOptions o;
      o.create_if_missing = false;
      auto kb = KnowledgeBase::Open(target, o);
      if (!kb.ok()) return kb.status();
      return (*kb)->SetNote(note);
    });
  }
  server::HttpServerOptions o;
  o.bind = a.bind;
  o.port = static_cast<uint16_t>(a.port);
  o.handle_signals = true;
  auto srv = server::HttpServer::Listen(
      o, [&api](std::string_view method, std::string_view target, std::string_view authorization) {
        return api.Handle(method, target, authorization);
      });
  if (!srv.ok()) {
    std::fprintf(stderr, "oomguard kb serve: %s\n", srv.status().message().c_str());
    return 1;
  }
  // The first line on stdout is the contract scripts and tests read (port 0).
  std::printf("Serving %s\n", (*srv)->url().c_str());
  std::fflush(stdout);
  auto snap = src->Current();
  std::fprintf(stderr, "oomguard kb serve: %zu incident(s) from %zu file(s); %s; Ctrl-C stops\n",
               snap->incidents().size(), src->paths().size(),
               a.notes_token_file.empty() ? "read-only" : "notes writable with the token");
  if (a.bind != "127.0.0.1" && a.bind != "::1" && a.bind != "localhost")
    std::fprintf(
        stderr,
        "oomguard kb serve: warning: listening on %s: anyone who can reach this address can read every "
        "incident (messages, hosts, workloads); there is no authentication\n",
        a.bind.c_str());
  (*srv)->Run();
  std::fprintf(stderr, "oomguard kb serve: stopped\n");
  return 0;
}

int Report(const ServeArgs& a) {
  auto source = server::SnapshotSource::Open(a.dbs, 0);
  if (!source.ok()) {
    std::fprintf(stderr, "oomguard kb report: %s\n", source.status().ToString().c_str());
    return 1;
  }
  auto snap = (*source)->Current();
  auto html = server::RenderReport(*snap, internal::NowUnixMs());
  if (!html.ok()) {
    std::fprintf(stderr, "oomguard kb report: %s\n", html.status().ToString().c_str());
    return 1;
  }
  // Written beside the target and renamed: a reader never sees half a report.
  std::string tmp = a.html + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << *html;
    out.close();
    if (!out) {
      std::fprintf(stderr, "oomguard kb report: cannot write %s: %s\n", tmp.c_str(), std::strerror(errno));
      std::remove(tmp.c_str());
      return 1;
    }
  }
  if (std::rename(tmp.c_str(), a.html.c_str()) != 0) {
    std::fprintf(stderr, "oomguard kb report: cannot rename %s to %s: %s\n", tmp.c_str(), a.html.c_str(),
                 std::strerror(errno));
    std::remove(tmp.c_str());
    return 1;
  }
  std::printf("wrote %s: %zu incident(s), %.1f KiB\n", a.html.c_str(), snap->incidents().size(),
              static_cast<double>(html->size()) / 1024.0);
  return 0;
}

}  // namespace

void AddKbServeCommands(CLI::App* kb, CommandResult* result) {
  static ServeArgs args;  // lives as long as the app; main parses once
  const char* db_help =
      "knowledge-base file or postgresql:// URL; repeat it or use a glob ('kb/*.db') to read several";

  CLI::App* serve = kb->add_subcommand("serve", "browse the incidents in a web page (read-only HTTP server)");
  serve->add_option("--db", args.dbs, db_help)->required();
  serve
      ->add_option("--bind", args.bind,
                   "address to listen on (loopback by default; incidents are not public)")
      ->capture_default_str();
  serve->add_option("--port", args.port, "TCP port; 0 picks a free one")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_option("--poll-ms", args.poll_ms, "how often to look for new incidents in the files (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  serve->add_option("--notes-token-file", args.notes_token_file,
                    "let the page write notes on groups (into the first --db) when it sends the token in this "
                    "file (first line, 16+ characters); reading needs none");
  serve->callback([result] { result->exit_code = Serve(args); });

  CLI::App* report =
      kb->add_subcommand("report", "write the browser's views as one self-contained HTML file");
  report->add_option("--db", args.dbs, db_help)->required();
  report->add_option("--html", args.html, "output file (e.g. incidents.html)")->required();
  report->callback([result] { result->exit_code = Report(args); });
}

}  // namespace oomguard::cli
