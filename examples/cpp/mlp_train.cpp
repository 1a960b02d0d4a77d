// mlp_train: a guarded training run of a small MLP on a simulated device.
//
//   mlp_train --steps 40 --global-batch 512 --device-budget-mib 4 --json
//
// The simulated device has the capacity given by --device-budget-mib (0:
// unlimited). When a micro-batch does not fit, the guard releases caches,
// splits the step into smaller micro-batches (same global batch, same
// gradient) and retries; the final parameters equal an unlimited run's.
// Exit codes: 0 done, 1 training failed, 2 bad arguments, 3 --check-against mismatch.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "mlp.h"
#include "oomguard/oomguard.h"

namespace {

std::string Mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

std::string Json(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  mlp::Config cfg;
  double budget_mib = 0;
  std::string dump_params, check_against, faults;
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
  app.add_option("--hidden", cfg.hidden, "hidden units per layer")->check(CLI::Range(1, 8192));
  app.add_option("--seed", cfg.seed, "data and initialisation seed");
  app.add_option("--optimizer", cfg.optimizer, "adam or sgd")->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--lr", cfg.lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_flag("--lazy-optimizer-state", cfg.lazy_optimizer_state,
               "allocate Adam moments at the first optimizer step");
  app.add_option("--leak-bytes-per-step", cfg.leak_bytes_per_step,
                 "device bytes deliberately leaked every step (a gradual-growth scenario)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--workload", cfg.workload, "workload signature (default: derived from the model)");
  app.add_option("--device-budget-mib", budget_mib, "simulated device capacity in MiB (0: unlimited)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--faults", faults, "fault rules, as OOMGUARD_FAULTS (e.g. oom@step=3,site=backward)");
  app.add_option("--dump-params", dump_params, "write the final parameters (little-endian float64)");
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
  if (cfg.micro_batch > 0 && cfg.micro_batch < cfg.min_micro_batch) {
    std::fprintf(stderr, "mlp_train: --micro-batch (%" PRId64 ") must be >= --min-micro-batch (%" PRId64 ")\n",
                 cfg.micro_batch, cfg.min_micro_batch);
    return 2;
  }
  if (!faults.empty()) {
    oomguard::Status s = oomguard::SetFaultRules(faults);
    if (!s.ok()) {
      std::fprintf(stderr, "mlp_train: --faults: %s\n", s.message().c_str());
      return 2;
    }
  }

  oomguard::SimulatedDeviceOptions dev_opts;
  dev_opts.capacity_bytes = static_cast<int64_t>(budget_mib * 1024.0 * 1024.0);
  // A caching allocator scaled to this small model: segments of 256 KiB (PyTorch
  // uses 2 MiB for GiB-sized GPUs), so that budgets of a few MiB behave alike.
  dev_opts.segment_bytes = 256 << 10;
  dev_opts.small_request_bytes = 128 << 10;
  auto device_or = oomguard::MakeSimulatedDevice(dev_opts);
  if (!device_or.ok()) {
    std::fprintf(stderr, "mlp_train: %s\n", device_or.status().ToString().c_str());
    return 2;
  }
  auto device = std::move(device_or).value();

  if (!quiet) {
    std::printf("mlp_train: %" PRId64 " steps, global batch %" PRId64 ", hidden %d, %s, device %s\n",
                cfg.steps, cfg.global_batch, cfg.hidden, cfg.optimizer.c_str(),
                budget_mib > 0 ? ("budget " + Mib(dev_opts.capacity_bytes)).c_str() : "unlimited");
    std::fflush(stdout);
  }
  const int64_t every = std::max<int64_t>(1, cfg.steps / 10);
  mlp::TrainHooks hooks;
  hooks.on_step = [&](const oomguard::StepReport& r, double loss) {
    if (quiet) return;
    for (const auto& inc : r.incidents) {
      std::printf("  step %" PRId64 ": OOM in %s (%s memory; asked for %s with %s allocated, %s reserved of %s)"
                  " -> released caches, micro-batch %" PRId64 " -> %" PRId64 " [%s], %s\n",
                  inc.step, inc.phase.c_str(), inc.kind.c_str(), Mib(inc.requested_bytes).c_str(),
                  Mib(inc.memory.allocated).c_str(), Mib(inc.memory.reserved).c_str(),
                  inc.memory.total > 0 ? Mib(inc.memory.total).c_str() : "unlimited", inc.micro_before,
                  inc.micro_after, inc.action.c_str(), inc.outcome.c_str());
    }
    if ((r.step + 1) % every == 0 || r.step + 1 == cfg.steps) {
      std::printf("step %" PRId64 "/%" PRId64 "  loss %.6f  micro-batch %" PRId64 " x %d  peak %s\n", r.step + 1,
                  cfg.steps, loss, r.largest_micro, r.micro_batches, Mib(r.peak_allocated).c_str());
    }
    std::fflush(stdout);
  };

  const auto t0 = std::chrono::steady_clock::now();
  mlp::TrainResult res = mlp::Train(cfg, device.get(), hooks);
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!res.status.ok()) {
    std::fprintf(stderr, "mlp_train: training stopped at step %" PRId64 ": %s\n", res.steps_done,
                 res.status.ToString().c_str());
    return 1;
  }

  std::string error;
  if (!dump_params.empty() && !mlp::WriteDoubles(dump_params, res.params, &error)) {
    std::fprintf(stderr, "mlp_train: --dump-params: %s\n", error.c_str());
    return 1;
  }
  double rel = -1;
  if (!check_against.empty()) {
    std::vector<double> ref;
    if (!mlp::ReadDoubles(check_against, &ref, &error)) {
      std::fprintf(stderr, "mlp_train: --check-against: %s\n", error.c_str());
      return 2;
    }
    rel = mlp::MaxRelativeDifference(res.params, ref);
    if (!quiet)
      std::printf("final parameters vs %s: max relative difference %.3g (%s)\n", check_against.c_str(), rel,
                  rel <= 1e-10 ? "equal within 1e-10" : "DIFFERENT");
  }
  if (!quiet)
    std::printf("done: %" PRId64 " steps, %" PRId64 " OOMs recovered, micro-batch %" PRId64 " -> %" PRId64
                ", loss %.6f -> %.6f, %.2f s\n",
                res.steps_done, res.ooms, res.initial_micro_batch, res.final_micro_batch, res.loss_first,
                res.loss_last, wall_s);
  if (json) {
    std::printf("{\"steps\":%" PRId64 ",\"global_batch\":%" PRId64 ",\"initial_micro_batch\":%" PRId64
                ",\"final_micro_batch\":%" PRId64 ",\"ooms\":%" PRId64
                ",\"loss_first\":%s,\"loss_last\":%s,\"wall_s\":%s,\"device_budget_mib\":%s,\"hidden\":%d,"
                "\"max_rel_diff\":%s}\n",
                res.steps_done, cfg.global_batch, res.initial_micro_batch, res.final_micro_batch, res.ooms,
                Json(res.loss_first).c_str(), Json(res.loss_last).c_str(), Json(wall_s).c_str(),
                Json(budget_mib).c_str(), cfg.hidden, rel < 0 ? "null" : Json(rel).c_str());
  }
  std::fflush(stdout);
  if (rel > 1e-10) return 3;
  return 0;
}
