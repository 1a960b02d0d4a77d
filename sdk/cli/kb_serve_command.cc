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
#include "sdk/kb/file_set.h"
#include "sdk/kb/store.h"
#include "sdk/server/browser_data.h"
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
  std::string notes_db;
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
  // No load: every request is answered by the stores (browser_data.h).
  auto opened = server::StoreData::Open(a.dbs, a.poll_ms);
  if (!opened.ok()) {
    std::fprintf(stderr, "oomguard kb serve: %s\n", opened.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<server::StoreData> data = std::move(opened).value();
  server::BrowserApi api(data);
  std::string notes_to;
  if (!a.notes_token_file.empty()) {
    std::string error;
    std::string token = ReadToken(a.notes_token_file, &error);
    if (token.empty()) {
      std::fprintf(stderr, "oomguard kb serve: --notes-token-file %s\n", error.c_str());
      return 1;
    }
    // Which store a note goes to: --notes-db, or the one store served.
    if (!a.notes_db.empty()) {
      notes_to = a.notes_db;
    } else if (data->specs().size() == 1) {
      notes_to = data->specs().front();
    } else {
      std::fprintf(stderr,
                   "oomguard kb serve: --notes-token-file with %zu stores: name the one notes are written to "
                   "with --notes-db (e.g. the team's server); the page shows the notes of every store\n",
                   data->specs().size());
      return 1;
    }
    // Opened now, so that a store notes cannot be written to is said at the
    // start, not on the first note; then again per note (nothing held open).
    const int busy_ms = KnowledgeBaseOptions{}.busy_timeout_ms;
    if (auto check = kb::Store::Open(notes_to, busy_ms, false); !check.ok()) {
      std::fprintf(stderr, "oomguard kb serve: notes go to %s: %s\n", kb::RedactUrl(notes_to).c_str(),
                   check.status().ToString().c_str());
      return 1;
    }
    auto mu = std::make_shared<std::mutex>();
    api.EnableNoteWrites(std::move(token), [target = notes_to, busy_ms, mu](const GroupNote& note) -> Status {
      std::lock_guard<std::mutex> lock(*mu);
      auto store = kb::Store::Open(target, busy_ms, false);
      if (!store.ok()) return store.status();
      return (*store)->SetNote(note);
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
  std::fprintf(stderr, "oomguard kb serve: %zu store(s); %s%s; Ctrl-C stops\n", data->specs().size(),
               a.notes_token_file.empty() ? "read-only" : "notes written with the token to ",
               a.notes_token_file.empty() ? "" : kb::RedactUrl(notes_to).c_str());
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
  auto files = kb::KnowledgeBaseSet::Open(a.dbs);
  auto loaded = files.ok() ? server::LoadIndex(&*files) : StatusOr<std::shared_ptr<const server::IncidentIndex>>(
                                                               files.status());
  if (!loaded.ok()) {
    std::fprintf(stderr, "oomguard kb report: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  auto snap = std::move(loaded).value();
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
  serve->add_option("--poll-ms", args.poll_ms,
                    "how often, at most, to ask the stores whether they changed (cached totals, runs and groups "
                    "are read again then; 0: on every request)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  serve->add_option("--notes-token-file", args.notes_token_file,
                    "let the page write notes on groups when it sends the token in this file (first line, 16+ "
                    "characters); reading needs none");
  serve->add_option("--notes-db", args.notes_db,
                    "where the page's notes are written (a knowledge-base file or postgresql:// URL; required "
                    "with several --db, default the one --db)");
  serve->callback([result] { result->exit_code = Serve(args); });

  CLI::App* report =
      kb->add_subcommand("report", "write the browser's views as one self-contained HTML file");
  report->add_option("--db", args.dbs, db_help)->required();
  report->add_option("--html", args.html, "output file (e.g. incidents.html)")->required();
  report->callback([result] { result->exit_code = Report(args); });
}

}  // namespace oomguard::cli
