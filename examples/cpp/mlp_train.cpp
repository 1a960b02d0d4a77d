// mlp_train: a guarded training run of a small MLP on a simulated device.
//
//   mlp_train --steps 40 --global-batch 512 --device-budget-mib 4 --json
//   mlp_train --steps 40 --ckpt-dir /tmp/ck --ckpt-every 5 --keep 3 [--resume]
//   mlp_train --dist threads --ranks 4 --rank-budget-mib 1=0.5 --kb /tmp/kb.sqlite
//   mpirun -np 4 mlp_train --dist mpi ...
//
// The simulated device has the capacity given by --device-budget-mib (0:
// unlimited). When a micro-batch does not fit, the guard releases caches,
// splits the step into smaller micro-batches (same global batch, same
// gradient) and retries; the final parameters equal an unlimited run's.
// Exit codes: 0 done, 1 training failed, 2 bad arguments, 3 --check-against
// mismatch, 4 done but the knowledge base lost incidents (incident_ops_lost in
// the JSON line), 75 a peer rank stopped answering (restart every rank with
// --resume).
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mlp.h"
#include "oomguard/oomguard.h"
#ifdef OOMGUARD_EXAMPLE_HAVE_MPI
#include "oomguard/mpi_coordinator.h"
#endif

namespace {

std::string Mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

// FNV-1a over the parameters' bytes: equal on every rank iff (with
// overwhelming probability) the ranks hold the same parameters.
uint64_t ParameterHash(const std::vector<double>& params) {
  uint64_t h = 1469598103934665603ULL;
  const auto* p = reinterpret_cast<const unsigned char*>(params.data());
  for (size_t i = 0; i < params.size() * sizeof(double); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

// A JSON number; null for NaN and infinities (a diverged loss), which JSON cannot spell.
std::string Json(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// A finite number in (lo, hi] when `above_lo`, else [lo, hi]. CLI11's
// PositiveNumber and Range let NaN through (every comparison with it is false).
CLI::Validator FiniteNumber(double lo, double hi, bool above_lo) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !std::isfinite(v))
          return "must be a finite number, got '" + text + "'";
        if ((above_lo ? !(v > lo) : !(v >= lo)) || v > hi) {
          char range[96];
          std::snprintf(range, sizeof(range), "must be %s %g and at most %g", above_lo ? ">" : ">=", lo, hi);
          return range + std::string(", got '") + text + "'";
        }
        return "";
      },
      "NUMBER");
}

// MiB as bytes, for a simulated device; an error when a positive budget is
// below one byte (it would become 0, which means unlimited).
std::string BudgetError(const std::string& what, double mib) {
  if (!(mib > 0 && mib * 1048576.0 < 1.0)) return "";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g MiB", mib);
  return "mlp_train: " + what + ": " + buf + " is less than one byte (0 means unlimited)\n";
}

}  // namespace

int main(int argc, char** argv) {
  mlp::Config cfg;
  double budget_mib = 0;
  std::string dump_params, check_against, faults, kb_path, dist = "none";
  std::vector<std::string> rank_budgets;
  int ranks = 1;
  bool json = false, quiet = false;

  CLI::App app{"Train a small MLP through the oomguard guard on a simulated device."};
  app.add_option("--steps", cfg.steps, "optimizer steps")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--global-batch", cfg.global_batch, "samples per optimizer step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--micro-batch", cfg.micro_batch, "starting micro-batch size (0: the whole batch)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--min-micro-batch", cfg.min_micro_batch, "smallest micro-batch the guard splits to")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--grow-after", cfg.grow_after, "clean steps before probing a larger micro-batch (0: never)")
      ->check(CLI::Range(0, 1 << 20));
  std::string controller = "predictive";
  app.add_option("--controller", controller,
                 "predictive (fit the device's memory figures) or search (halve, then binary search)")
      ->check(CLI::IsMember({"predictive", "search"}));
  app.add_option("--hidden", cfg.hidden, "hidden units per layer")->check(CLI::Range(1, 8192));
  app.add_option("--seed", cfg.seed, "data and initialisation seed");
  app.add_option("--optimizer", cfg.optimizer, "adam or sgd")->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--lr", cfg.lr, "learning rate")->check(FiniteNumber(0, 1e9, /*above_lo=*/true));
  app.add_flag("--lazy-optimizer-state", cfg.lazy_optimizer_state,
               "allocate Adam moments at the first optimizer step");
  app.add_option("--leak-bytes-per-step", cfg.leak_bytes_per_step,
                 "device bytes deliberately leaked every step (a gradual-growth scenario)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--workload", cfg.workload, "workload signature (default: derived from the model)");
  app.add_option("--device-budget-mib", budget_mib, "simulated device capacity in MiB (0: unlimited)")
      ->check(FiniteNumber(0, 1e9, /*above_lo=*/false));
  app.add_option("--faults", faults, "fault rules, as OOMGUARD_FAULTS (e.g. oom@step=3,site=backward)");
  app.add_option("--ckpt-dir", cfg.ckpt_dir, "write checkpoints (oomguard-ckpt/1) to this directory");
  app.add_option("--ckpt-every", cfg.ckpt_every, "save a checkpoint after every N steps (0: only after a recovered OOM)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--keep", cfg.ckpt_keep, "complete checkpoints kept (0: all)")->check(CLI::Range(0, 1 << 20));
  app.add_flag("--resume", cfg.resume, "continue from the newest complete checkpoint in --ckpt-dir");
  app.add_flag("--costly-samples", cfg.costly_samples,
               "a few samples per step cost 12x the others (data-dependent activation spikes)");
  app.add_flag("--fragmentation", cfg.fragmentation,
               "keep small long-lived blocks between activations (allocator fragmentation)");
  if (const char* url = std::getenv("OOMGUARD_KB_URL"); url != nullptr) kb_path = url;
  app.add_option("--kb", kb_path,
                 "record incidents in this knowledge base (an SQLite file or a postgresql:// URL; default: "
                 "$OOMGUARD_KB_URL) and learn micro-batch priors");
  app.add_option("--dist", dist, "none, threads (ranks as threads) or mpi (under mpirun)")
      ->check(CLI::IsMember({"none", "threads", "mpi"}));
  app.add_option("--ranks", ranks, "ranks for --dist threads")->check(CLI::Range(1, 64));
  app.add_option("--rank-budget-mib", rank_budgets,
                 "R=X: simulated capacity of rank R in MiB (repeatable; others use --device-budget-mib)");
  app.add_flag("--uniform-micro-batch", cfg.uniform_micro_batch, "every rank uses the smallest micro-batch");
  app.add_flag("--token-weighted", cfg.token_weighted,
               "each sample carries 1..16 loss units (as valid tokens do); the loss is the mean over the global "
               "batch's units");
  app.add_option("--dump-params", dump_params, "write the final parameters (little-endian float64; rank 0)");
  app.add_option("--check-against", check_against,
                 "compare the final parameters with a --dump-params file (1e-10 relative)");
  app.add_flag("--json", json, "end with one JSON line of results");
  app.add_flag("--quiet", quiet, "no progress lines");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (std::string e = BudgetError("--device-budget-mib", budget_mib); !e.empty()) {
    std::fputs(e.c_str(), stderr);
    return 2;
  }
  cfg.controller = controller == "search" ? oomguard::SizePolicy::kSearch : oomguard::SizePolicy::kPredictive;
  if (cfg.micro_batch > 0 && cfg.micro_batch < cfg.min_micro_batch) {
    std::fprintf(stderr, "mlp_train: --micro-batch (%" PRId64 ") must be >= --min-micro-batch (%" PRId64 ")\n",
                 cfg.micro_batch, cfg.min_micro_batch);
    return 2;
  }
  if ((cfg.resume || cfg.ckpt_every > 0) && cfg.ckpt_dir.empty()) {
    std::fprintf(stderr, "mlp_train: --resume and --ckpt-every need --ckpt-dir\n");
    return 2;
  }
  if (!faults.empty()) {
    oomguard::Status s = oomguard::SetFaultRules(faults);
    if (!s.ok()) {
      std::fprintf(stderr, "mlp_train: --faults: %s\n", s.message().c_str());
      return 2;
    }
  }

  // Per-rank capacities: --device-budget-mib for all, --rank-budget-mib R=X for one.
  std::map<int, double> budget_of;
  for (const std::string& rb : rank_budgets) {
    const size_t eq = rb.find('=');
    char* end = nullptr;
    const long r = eq == std::string::npos ? -1 : std::strtol(rb.c_str(), &end, 10);
    if (eq == std::string::npos || eq == 0 || end != rb.c_str() + eq || r < 0 || r > 1 << 20) {
      std::fprintf(stderr, "mlp_train: --rank-budget-mib '%s': expected R=X (rank, MiB), e.g. 1=2.5\n", rb.c_str());
      return 2;
    }
    const std::string value = rb.substr(eq + 1);
    char* vend = nullptr;
    const double mib = std::strtod(value.c_str(), &vend);
    if (value.empty() || *vend != '\0' || !std::isfinite(mib) || mib < 0 || mib > 1e9) {
      std::fprintf(stderr, "mlp_train: --rank-budget-mib '%s': '%s' is not a number of MiB in [0, 1e9]\n", rb.c_str(),
                   value.c_str());
      return 2;
    }
    if (std::string e = BudgetError("--rank-budget-mib '" + rb + "'", mib); !e.empty()) {
      std::fputs(e.c_str(), stderr);
      return 2;
    }
    budget_of[static_cast<int>(r)] = mib;
  }
  if (dist != "threads" && ranks != 1) {
    std::fprintf(stderr, "mlp_train: --ranks is for --dist threads (under MPI, mpirun -np sets the ranks)\n");
    return 2;
  }

  // ---- the ranks ----
  std::unique_ptr<oomguard::Coordinator> mpi;
  std::vector<std::unique_ptr<oomguard::Coordinator>> group;
  if (dist == "mpi") {
#ifdef OOMGUARD_EXAMPLE_HAVE_MPI
    auto c = oomguard::MakeMpiCoordinator();
    if (!c.ok()) {
      std::fprintf(stderr, "mlp_train: --dist mpi: %s\n", c.status().ToString().c_str());
      return 1;
    }
    mpi = std::move(c).value();
#else
    std::fprintf(stderr, "mlp_train: --dist mpi: built without MPI (OOMGUARD_WITH_MPI=OFF)\n");
    return 2;
#endif
  } else if (dist == "threads") {
    auto g = oomguard::MakeThreadGroup(ranks);
    if (!g.ok()) {
      std::fprintf(stderr, "mlp_train: --ranks: %s\n", g.status().message().c_str());
      return 2;
    }
    group = std::move(g).value();
  }
  const int world = mpi ? mpi->size() : dist == "threads" ? ranks : 1;
  const int first_rank = mpi ? mpi->rank() : 0;
  const int local_ranks = dist == "threads" ? ranks : 1;
  for (const auto& [r, mib] : budget_of) {
    if (r >= world) {
      std::fprintf(stderr, "mlp_train: --rank-budget-mib %d=...: there are only %d rank(s)\n", r, world);
      return 2;
    }
  }
  if (cfg.global_batch % world != 0) {
    std::fprintf(stderr, "mlp_train: --global-batch %" PRId64 " must divide evenly over %d ranks\n",
                 cfg.global_batch, world);
    return 2;
  }
  const bool talk = !quiet && first_rank == 0;

  // ---- the knowledge base: one per process, shared by its ranks ----
  std::unique_ptr<oomguard::KnowledgeBase> kb;
  if (!kb_path.empty()) {
    auto kb_or = oomguard::KnowledgeBase::Open(kb_path);
    if (!kb_or.ok()) {
      // A broken knowledge base must not stop training: say so and go on.
      std::fprintf(stderr, "mlp_train: --kb: %s (training without it)\n", kb_or.status().ToString().c_str());
    } else {
      kb = std::move(kb_or).value();
    }
  }

  auto make_device = [&](int rank) {
    oomguard::SimulatedDeviceOptions o;
    const double mib = budget_of.count(rank) ? budget_of[rank] : budget_mib;
    o.capacity_bytes = static_cast<int64_t>(mib * 1024.0 * 1024.0);
    o.index = rank;
    // A caching allocator scaled to this small model: segments of 256 KiB (PyTorch
    // uses 2 MiB for GiB-sized GPUs), so that budgets of a few MiB behave alike.
    o.segment_bytes = 256 << 10;
    o.small_request_bytes = 128 << 10;
    return oomguard::MakeSimulatedDevice(o);
  };
  std::vector<std::unique_ptr<oomguard::Device>> devices;
  for (int i = 0; i < local_ranks; ++i) {
    auto d = make_device(first_rank + i);
    if (!d.ok()) {
      std::fprintf(stderr, "mlp_train: %s\n", d.status().ToString().c_str());
      return 2;
    }
    devices.push_back(std::move(d).value());
  }

  if (talk) {
    std::printf("mlp_train: %" PRId64 " steps, global batch %" PRId64 ", hidden %d, %s, device %s%s\n", cfg.steps,
                cfg.global_batch, cfg.hidden, cfg.optimizer.c_str(),
                budget_mib > 0 ? ("budget " + Mib(static_cast<int64_t>(budget_mib * 1048576.0))).c_str()
                               : "unlimited",
                world > 1 ? (", " + std::to_string(world) + " ranks (" + dist + ")").c_str() : "");
    std::fflush(stdout);
  }
  const int64_t every = std::max<int64_t>(1, cfg.steps / 10);
  std::mutex print_mu;
  auto hooks_for = [&](int rank) {
    mlp::TrainHooks hooks;
    hooks.incidents = kb ? kb->sink() : nullptr;
    hooks.priors = kb.get();
    hooks.on_step = [&, rank](const oomguard::StepReport& r, double loss) {
      if (quiet) return;
      std::lock_guard<std::mutex> lock(print_mu);
      const std::string who = world > 1 ? "[rank " + std::to_string(rank) + "] " : "";
      for (const auto& inc : r.incidents) {
        if (inc.kind == oomguard::IncidentKind::kCoordination) continue;
        // The ladder's "halve" rung takes the controller's size, which is a
        // halving only for the halving controller: say which one this was.
        std::string action(oomguard::LadderActionName(inc.action));
        if (inc.action == oomguard::LadderAction::kHalve && inc.micro_after * 2 != inc.micro_before)
          action = "shrink to the controller's pick";
        std::printf("  %sstep %" PRId64 ": OOM in %s (%s memory; asked for %s with %s allocated, %s reserved of %s)"
                    " -> released caches, micro-batch %" PRId64 " -> %" PRId64 " [%s], %s\n",
                    who.c_str(), inc.step, oomguard::PhaseName(inc.phase).data(),
                    oomguard::IncidentKindName(inc.kind).data(), Mib(inc.requested_bytes).c_str(),
                    Mib(inc.memory.allocated).c_str(), Mib(inc.memory.reserved).c_str(),
                    inc.memory.total > 0 ? Mib(inc.memory.total).c_str() : "unlimited", inc.micro_before,
                    inc.micro_after, action.c_str(),
                    oomguard::IncidentOutcomeName(inc.outcome).data());
      }
      if (rank == 0 && ((r.step + 1) % every == 0 || r.step + 1 == cfg.steps)) {
        std::printf("step %" PRId64 "/%" PRId64 "  loss %.6f  micro-batch %" PRId64 " x %d  peak %s\n", r.step + 1,
                    cfg.steps, loss, r.largest_micro, r.micro_batches, Mib(r.peak_allocated).c_str());
      }
      std::fflush(stdout);
    };
    return hooks;
  };

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<mlp::TrainResult> results(static_cast<size_t>(local_ranks));
  if (dist == "threads") {
    std::vector<std::thread> threads;
    for (int i = 0; i < local_ranks; ++i) {
      threads.emplace_back([&, i] {
        mlp::TrainHooks h = hooks_for(i);
        h.coordinator = group[static_cast<size_t>(i)].get();
        // A rank that stops tells its peers through the guard: they stop at
        // the same step, so nothing here needs to abort the group.
        results[static_cast<size_t>(i)] = mlp::Train(cfg, devices[static_cast<size_t>(i)].get(), h);
      });
    }
    for (auto& t : threads) t.join();
  } else {
    mlp::TrainHooks h = hooks_for(first_rank);
    h.coordinator = mpi.get();
    results[0] = mlp::Train(cfg, devices[0].get(), h);
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Incidents the knowledge base did not store: part of the result (the JSON
  // line and exit code 4), not only a log line.
  int64_t incidents_lost = 0;
  if (kb) {
    oomguard::Status f = kb->Flush();
    if (!f.ok()) std::fprintf(stderr, "mlp_train: --kb: %s\n", f.ToString().c_str());
    incidents_lost = kb->sink_stats().lost();
  } else if (!kb_path.empty()) {
    for (const auto& r : results) incidents_lost += r.ooms;  // none of them was recorded
  }
  if (incidents_lost > 0)
    std::fprintf(stderr, "mlp_train: --kb %s: %" PRId64 " incident operation(s) were not recorded\n",
                 (kb ? kb->path() : std::string("(not opened)")).c_str(), incidents_lost);
  const mlp::TrainResult& res = results[0];
  if (talk && res.resumed_from_step >= 0)
    std::printf("resumed from the checkpoint of step %" PRId64 " in %s\n", res.resumed_from_step,
                cfg.ckpt_dir.c_str());
  // A failure: every rank stopped at the same step. Print the failing rank's
  // own status (its peers' statuses name it); exit 75 only for a lost peer.
  const mlp::TrainResult* failed = nullptr;
  for (size_t i = 0; i < results.size(); ++i) {
    const mlp::TrainResult& r = results[i];
    if (r.status.ok()) continue;
    if (failed == nullptr || r.failed_rank == first_rank + static_cast<int>(i)) failed = &r;
  }
  if (failed != nullptr) {
    std::fprintf(stderr, "mlp_train: %straining stopped at step %" PRId64 ": %s\n",
                 world > 1 ? ("[rank " + std::to_string(first_rank + static_cast<int>(failed - results.data())) + "] ")
                                 .c_str()
                           : "",
                 failed->steps_done, failed->status.ToString().c_str());
    std::fflush(stderr);
    if (failed->status.code() == oomguard::StatusCode::kUnavailable) {
      // A peer stopped answering: the documented exit code tells the launcher
      // to restart every rank, which then resume from the newest checkpoint.
      // _exit: MPI_Finalize would wait for the collective that never completes.
      std::fflush(stdout);
      _exit(oomguard::kExitCoordinationTimeout);
    }
    return 1;
  }

  // Every rank's figures, and whether all ended with the same parameters (a
  // hash of each rank's parameter bytes), in one gather.
  constexpr int kWords = 4;
  std::vector<int64_t> per_rank(static_cast<size_t>(kWords) * static_cast<size_t>(world));
  for (size_t i = 0; i < results.size(); ++i) {
    const mlp::TrainResult& r = results[i];
    int64_t* w = per_rank.data() + (static_cast<size_t>(first_rank) + i) * kWords;
    w[0] = r.ooms;
    w[1] = r.final_micro_batch;
    w[2] = static_cast<int64_t>(ParameterHash(r.params));
    w[3] = r.redone;
  }
  if (mpi) {
    std::vector<int64_t> mine(per_rank.begin() + first_rank * kWords, per_rank.begin() + (first_rank + 1) * kWords);
    oomguard::Status g = mpi->Allgather(mine, per_rank, std::chrono::milliseconds(60000));
    if (!g.ok()) {
      std::fprintf(stderr, "mlp_train: gathering the ranks' results: %s\n", g.ToString().c_str());
      std::fflush(stderr);
      _exit(oomguard::kExitCoordinationTimeout);
    }
  }
  bool agree = true;
  for (int r = 1; r < world; ++r) agree = agree && per_rank[static_cast<size_t>(r) * kWords + 2] == per_rank[2];
  if (world > 1 && talk)
    std::printf("all %d ranks end with %s parameters\n", world, agree ? "identical" : "DIFFERENT");
  if (!agree) {
    std::fprintf(stderr, "mlp_train: ranks disagree on the final parameters\n");
    return 1;
  }
  if (first_rank != 0) return incidents_lost > 0 ? 4 : 0;  // rank 0 writes files and the JSON line

  double rel = -1;
  if (int rc = mlp::DumpAndCheckParameters("mlp_train", res.params, dump_params, check_against,
                                           quiet ? nullptr : stdout, &rel);
      rc != 0)
    return rc;
  // Staging stall of the checkpoint saves: median and max.
  double stall_median = 0, stall_max = 0;
  if (!res.stall_ms.empty()) {
    std::vector<double> v = res.stall_ms;
    std::sort(v.begin(), v.end());
    stall_median = v[v.size() / 2];
    stall_max = v.back();
  }
  int64_t ooms = 0, redone = 0;
  std::string ranks_json;
  for (int r = 0; r < world; ++r) {
    const int64_t* w = per_rank.data() + static_cast<size_t>(r) * kWords;
    ooms += w[0];
    redone = std::max(redone, w[3]);
    if (!ranks_json.empty()) ranks_json += ",";
    ranks_json += "{\"rank\":" + std::to_string(r) + ",\"ooms\":" + std::to_string(w[0]) +
                  ",\"final_micro_batch\":" + std::to_string(w[1]) + "}";
  }
  if (!quiet && !cfg.ckpt_dir.empty())
    std::printf("checkpoints: %" PRId64 " written to %s, %" PRId64 " rollbacks, staging stall %.3f ms median, %.3f ms max\n",
                res.checkpoints_written, cfg.ckpt_dir.c_str(), res.rollbacks, stall_median, stall_max);
  if (!quiet)
    std::printf("done: %" PRId64 " steps, %" PRId64 " OOMs recovered%s, micro-batch %" PRId64 " -> %" PRId64
                ", loss %.6f -> %.6f, %.2f s\n",
                res.steps_done, ooms, world > 1 ? " (all ranks)" : "", res.initial_micro_batch,
                res.final_micro_batch, res.loss_first, res.loss_last, wall_s);
  if (json) {
    std::printf("{\"steps\":%" PRId64 ",\"global_batch\":%" PRId64 ",\"initial_micro_batch\":%" PRId64
                ",\"final_micro_batch\":%" PRId64 ",\"ooms\":%" PRId64
                ",\"loss_first\":%s,\"loss_last\":%s,\"wall_s\":%s,\"device_budget_mib\":%s,\"hidden\":%d,"
                "\"max_rel_diff\":%s,\"checkpoints_written\":%" PRId64 ",\"resumed_from_step\":%s,"
                "\"rollbacks\":%" PRId64 ",\"redone\":%" PRId64 ",\"last_checkpoint\":%s,"
                "\"ckpt_stall_ms_median\":%s,\"ckpt_stall_ms_max\":%s,"
                "\"world_size\":%d,\"dist\":\"%s\",\"token_weighted\":%s,\"ranks\":[%s],"
                "\"incident_ops_lost\":%" PRId64 "}\n",
                res.steps_done, cfg.global_batch, res.initial_micro_batch, res.final_micro_batch, ooms,
                Json(res.loss_first).c_str(), Json(res.loss_last).c_str(), Json(wall_s).c_str(),
                Json(budget_mib).c_str(), cfg.hidden, rel < 0 ? "null" : Json(rel).c_str(), res.checkpoints_written,
                res.resumed_from_step < 0 ? "null" : std::to_string(res.resumed_from_step).c_str(), res.rollbacks,
                redone, res.last_checkpoint < 0 ? "null" : std::to_string(res.last_checkpoint).c_str(),
                Json(stall_median).c_str(), Json(stall_max).c_str(), world, dist.c_str(),
                cfg.token_weighted ? "true" : "false", ranks_json.c_str(), incidents_lost);
  }
  std::fflush(stdout);
  if (rel > 1e-10) return 3;
  return incidents_lost > 0 ? 4 : 0;
}
