// `oomguard ckpt ...`: list, verify and inspect checkpoints (format
// oomguard-ckpt/2, and format 1). Read-only: safe to run next to a training job.
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/cli/command.h"
#include "sdk/cli/table.h"

namespace oomguard::cli {
namespace {

using nlohmann::ordered_json;

struct CkptArgs {
  std::string target;  // DIR or FILE
  bool json = false;
  int64_t step = -1;
  int world_size = -1;
};

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int Fail(const Status& s) {
  std::fprintf(stderr, "oomguard ckpt: %s\n", TerminalSafe(s.ToString()).c_str());
  return 1;
}

int List(const CkptArgs& a) {
  auto list = ListCheckpoints(a.target);
  if (!list.ok()) return Fail(list.status());
  if (a.json) {
    ordered_json j = ordered_json::array();
    for (const auto& c : *list)
      j.push_back({{"step", c.step},
                   {"dir", c.dir},
                   {"committed", c.committed},
                   {"world_size", c.world_size},
                   {"created_unix", c.created_unix},
                   {"bytes", c.bytes},
                   {"shards", c.shards},
                   {"problem", c.problem}});
    std::printf("%s\n", JsonText(j).c_str());
    return 0;
  }
  Table t({"STEP", "STATE", "WORLD", "SIZE", "SHARDS", "CREATED"});
  for (const auto& c : *list)
    t.AddRow({std::to_string(c.step),
              c.committed ? "committed" : (c.problem.empty() ? "incomplete" : "bad manifest"),
              c.world_size > 0 ? std::to_string(c.world_size) : "-", FormatBytes(c.bytes),
              std::to_string(c.shards.size()), FormatTime(c.created_unix * 1000)});
  t.Print(stdout);
  if (list->empty()) std::printf("(no checkpoints in %s)\n", a.target.c_str());
  return 0;
}

int Verify(const CkptArgs& a) {
  // A bad OOMGUARD_CKPT_READS is this run's setting, not a bad checkpoint:
  // one error and exit 2, rather than BAD for every healthy checkpoint.
  if (Status reads = ckpt::CheckReadsSetting(); !reads.ok()) {
    std::fprintf(stderr, "oomguard ckpt: %s\n", TerminalSafe(reads.message()).c_str());
    return 2;
  }
  std::vector<int64_t> steps, incomplete;
  if (a.step >= 0) {
    steps.push_back(a.step);
  } else {
    // Every step directory with a MANIFEST.json is a checkpoint someone meant
    // to commit: one whose manifest does not parse is reported as bad, never
    // skipped. Directories without one are saves in progress or crash
    // leftovers (no load ever uses them): listed, not failed.
    auto list = ListCheckpoints(a.target);
    if (!list.ok()) return Fail(list.status());
    for (const auto& c : *list) {
      if (c.committed || !c.problem.empty())
        steps.push_back(c.step);
      else
        incomplete.push_back(c.step);
    }
    if (steps.empty()) return Fail(Status::NotFound("no committed checkpoint in " + a.target));
  }
  ordered_json results = ordered_json::array();
  int bad = 0;
  for (int64_t step : steps) {
    // Progress on stderr for large shards; the result lines stay on stdout.
    auto progress = [&](int64_t done, int64_t total) {
      if (!a.json && total > (int64_t{256} << 20))
        std::fprintf(stderr, "  step %" PRId64 ": verified %s of %s\n", step, FormatBytes(done).c_str(),
                     FormatBytes(total).c_str());
    };
    Status s = VerifyCheckpoint(a.target, step, a.world_size, progress);
    if (!s.ok()) ++bad;
    if (a.json) {
      results.push_back({{"step", step},
                         {"ok", s.ok()},
                         {"code", std::string(StatusCodeName(s.code()))},
                         {"message", s.message()}});
    } else if (s.ok()) {
      std::printf("step %" PRId64 ": ok\n", step);
    } else {
      std::printf("step %" PRId64 ": BAD: %s\n", step, TerminalSafe(s.message()).c_str());
    }
  }
  if (a.json) {
    std::printf("%s\n",
                JsonText(ordered_json{{"ok", bad == 0}, {"checkpoints", results}, {"incomplete", incomplete}}).c_str());
  } else {
    for (int64_t step : incomplete)
      std::printf("step %" PRId64 ": incomplete (no MANIFEST.json), not a checkpoint\n", step);
    if (bad > 0) std::printf("%d of %zu checkpoint(s) did not verify\n", bad, steps.size());
  }
  return bad == 0 ? 0 : 1;
}

int Inspect(const CkptArgs& a) {
  auto info = InspectShard(a.target);
  if (!info.ok()) return Fail(info.status());
  if (a.json) {
    ordered_json tensors = ordered_json::array();
    for (const auto& t : info->tensors)
      tensors.push_back({{"path", t.path},
                         {"dtype", t.dtype},
                         {"shape", t.shape},
                         {"chunk", t.chunk},
                         {"bytes", t.bytes},
                         {"stored_bytes", t.stored_bytes},
                         {"xxh3", t.xxh3},
                         {"filters", t.filters}});
    ordered_json j{{"file", info->file}, {"format", info->format},         {"step", info->step},
                   {"rank", info->rank}, {"world_size", info->world_size}, {"file_bytes", info->file_bytes},
                   {"tensors", tensors}};
    std::printf("%s\n", JsonText(j).c_str());
    return 0;
  }
  std::printf("%s: format %s, step %" PRId64 ", rank %d of %d, %s\n", TerminalSafe(info->file).c_str(),
              TerminalSafe(info->format).c_str(), info->step, info->rank, info->world_size,
              FormatBytes(info->file_bytes).c_str());
  Table t({"TENSOR", "DTYPE", "SHAPE", "SIZE", "STORED", "RATIO", "FILTERS", "XXH3"});
  int64_t raw = 0, stored = 0;
  for (const auto& x : info->tensors) {
    std::string filters;
    for (const auto& f : x.filters) filters += (filters.empty() ? "" : "+") + f;
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%.2f",
                  x.stored_bytes > 0 ? double(x.bytes) / double(x.stored_bytes) : 0.0);
    t.AddRow({x.path, x.dtype, Shape(x.shape), FormatBytes(x.bytes), FormatBytes(x.stored_bytes), ratio,
              filters.empty() ? "-" : filters, x.xxh3});
    raw += x.bytes;
    stored += x.stored_bytes;
  }
  t.Print(stdout);
  std::printf("%zu tensors, %s -> %s stored (%.2fx)\n", info->tensors.size(), FormatBytes(raw).c_str(),
              FormatBytes(stored).c_str(), stored > 0 ? double(raw) / double(stored) : 0.0);
  return 0;
}

}  // namespace

void AddCkptCommands(CLI::App* app, CommandResult* result) {
  CLI::App* ckpt = app->add_subcommand("ckpt", "List, verify and inspect checkpoints (oomguard-ckpt/2 and /1)");
  ckpt->require_subcommand(1);
  auto args = std::make_shared<CkptArgs>();

  CLI::App* list = ckpt->add_subcommand("list", "Every step directory: committed or not, size, shards");
  list->add_option("dir", args->target, "checkpoint directory")->required();
  list->add_flag("--json", args->json, "one JSON array");
  list->callback([=] { result->exit_code = List(*args); });

  CLI::App* verify = ckpt->add_subcommand(
      "verify", "Verify manifests, shard checksums and every tensor checksum (exit 1 naming what is bad)");
  verify->add_option("dir", args->target, "checkpoint directory")->required();
  verify->add_option("--step", args->step, "only this step (default: every committed checkpoint)")
      ->check(CLI::NonNegativeNumber);
  verify->add_option("--world-size", args->world_size, "fail when a manifest names another world size")
      ->check(CLI::PositiveNumber);
  verify->add_flag("--json", args->json, "one JSON object");
  verify->callback([=] { result->exit_code = Verify(*args); });

  CLI::App* inspect =
      ckpt->add_subcommand("inspect", "Attributes, tensors, filters and checksums of one shard");
  inspect->add_option("file", args->target, "shard file (rank-NNNNN.h5)")->required();
  inspect->add_flag("--json", args->json, "one JSON object");
  inspect->callback([=] { result->exit_code = Inspect(*args); });
}

}  // namespace oomguard::cli
