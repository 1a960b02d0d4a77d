// The knowledge base on PostgreSQL beside SQLite (issue 26): Record() on the
// training thread, incidents/s sustained into the store from 8 writer
// processes, and the reads of the browser and CLI over 100,000 incidents
// (answered by the server: filters, paging, counts, groups, stats).
//
//   kb_pg_bench URL WORK_DIR      (bench/kb_pg_bench.sh starts a server for it)
//
// Prints a Markdown section for bench/RESULTS.md on stdout.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/file_set.h"

namespace {

using namespace oomguard;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Incident Sample(int writer, int k) {
  Incident i;
  char id[40];
  std::snprintf(id, sizeof(id), "b%d-%07d", writer, k);
  i.id = id;
  i.run_id = "run-" + std::to_string(writer) + "-" + std::to_string(k / 500);
  i.time_unix_ms = 1'700'000'000'000 + static_cast<int64_t>(k) * 1000 + writer;
  i.host = "host" + std::to_string(writer);
  i.rank = writer;
  i.step = k;
  i.phase = k % 3 == 0 ? Phase::kForward : Phase::kBackward;
  i.kind = IncidentKind::kDevice;
  i.workload = "bench-" + std::to_string(k % 7);
  i.requested_bytes = int64_t{1} << (20 + k % 8);
  i.memory.total = int64_t{16} << 30;
  i.memory.reserved = int64_t{15} << 30;
  i.memory.allocated = int64_t{10} << 30;
  i.memory.inactive_split = (k % 2 ? int64_t{4} : int64_t{0}) << 30;
  i.step_peaks.assign(16, int64_t{9} << 30);
  i.steps_ok_before = 40 + k % 100;
  i.message = "simulated device out of memory";
  return i;
}

// 8 processes, `per` incidents each through the sink, as fast as they come;
// incidents per second from the first fork to the last exit (Flush included).
double Writers(const std::string& kb, const std::string& spool, int writers, int per, int base) {
  const auto t0 = Clock::now();
  std::vector<pid_t> kids;
  for (int w = 0; w < writers; ++w) {
    pid_t pid = ::fork();
    if (pid == 0) {
      KnowledgeBaseOptions o;
      o.queue_capacity = static_cast<size_t>(per) + 16;
      o.spool_dir = spool;
      auto k = KnowledgeBase::Open(kb, o);
      if (!k.ok()) ::_exit(3);
      for (int i = 0; i < per; ++i) (*k)->sink()->Record(Sample(base + w, i));
      Status s = (*k)->Flush();
      ::_exit(s.ok() && (*k)->sink_stats().lost() == 0 ? 0 : 4);
    }
    kids.push_back(pid);
  }
  bool ok = true;
  for (pid_t p : kids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  const double s = Ms(Clock::now() - t0) / 1000;
  if (!ok) std::fprintf(stderr, "kb_pg_bench: a writer failed on %s\n", kb.c_str());
  return ok ? writers * per / s : 0;
}

struct RecordCost {
  double mean_ns, p99_ns;
};

RecordCost Records(const std::string& kb, const std::string& spool, int n) {
  KnowledgeBaseOptions o;
  o.queue_capacity = static_cast<size_t>(n) + 16;
  o.spool_dir = spool;
  auto k = KnowledgeBase::Open(kb, o).value();
  std::vector<Incident> incs;
  for (int i = 0; i < n; ++i) incs.push_back(Sample(90, i));
  std::vector<double> ns(static_cast<size_t>(n));
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    const auto a = Clock::now();
    k->sink()->Record(incs[static_cast<size_t>(i)]);
    ns[static_cast<size_t>(i)] = std::chrono::duration<double, std::nano>(Clock::now() - a).count();
  }
  const double mean = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / n;
  (void)k->Flush();
  std::sort(ns.begin(), ns.end());
  return {mean, ns[static_cast<size_t>(n * 99 / 100)]};
}

template <typename F>
double Median(F f, int runs = 5) {
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const auto a = Clock::now();
    f();
    t.push_back(Ms(Clock::now() - a));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: kb_pg_bench URL WORK_DIR\n");
    return 2;
  }
  const std::string url = argv[1];
  const std::string file = std::string(argv[2]) + "/bench.db";
  constexpr int kWriters = 8, kPer = 2500, kTotal = 100'000;

  // Forks first, while this process has no threads.
  const std::string spool = std::string(argv[2]) + "/spool";
  const double pg_rate = Writers(url, spool, kWriters, kPer, 0);
  const double lite_rate = Writers(file, spool, kWriters, kPer, 0);

  const RecordCost pg_rec = Records(url, spool, 20'000);
  const RecordCost lite_rec = Records(file, spool, 20'000);

  // Fill the server to 100,000 incidents (Insert: one transaction per 2,000).
  {
    KnowledgeBaseOptions o;
    o.spool_dir = spool;
    auto k = KnowledgeBase::Open(url, o).value();
    int have = static_cast<int>(*k->Count(IncidentQuery{}));
    for (int b = 0; have < kTotal; ++b) {
      std::vector<Incident> batch;
      for (int i = 0; i < 2000 && have < kTotal; ++i, ++have) batch.push_back(Sample(100 + b, i));
      if (!k->Insert(batch).ok()) return 5;
    }
  }
  KnowledgeBaseOptions ro;
  ro.read_only = true;
  auto k = KnowledgeBase::Open(url, ro).value();
  const int64_t n = *k->Count(IncidentQuery{});
  IncidentQuery first;
  first.limit = 50;
  IncidentQuery deep = first;
  deep.offset = n / 2;
  IncidentQuery filtered = first;
  filtered.workload = "bench-3";
  IncidentQuery run = first;
  run.run_id = "run-3-2";
  const double t_first = Median([&] { (void)k->Query(first); });
  const double t_deep = Median([&] { (void)k->Query(deep); });
  const double t_filtered = Median([&] { (void)k->Query(filtered); });
  const double t_run = Median([&] { (void)k->Query(run); });
  const double t_count = Median([&] { (void)k->Count(filtered); });
  const double t_groups = Median([&] { (void)k->Groups(); });
  const double t_stats = Median([&] { (void)k->Stats(); });
  // What `kb report` does (it embeds everything); `kb serve` no longer loads
  // (bench/kb_serve_http_bench.py measures it over HTTP).
  const double t_load = Median(
      [&] {
        auto set = kb::KnowledgeBaseSet::Open({url}).value();
        (void)set.Query(IncidentQuery{});
        (void)set.Stats();
      },
      3);

  std::printf("## Knowledge base on PostgreSQL (issue 26)\n\n");
  std::printf("PostgreSQL 15 from Debian on the same machine (Unix socket, fsync off as in the tests), beside an\n"
              "SQLite file on local disk. bench/kb_pg_bench.sh; figures from one run.\n\n");
  std::printf("| | PostgreSQL | SQLite |\n|---|---:|---:|\n");
  std::printf("| Record() on the training thread, mean | %.0f ns | %.0f ns |\n", pg_rec.mean_ns, lite_rec.mean_ns);
  std::printf("| Record() p99 | %.0f ns | %.0f ns |\n", pg_rec.p99_ns, lite_rec.p99_ns);
  std::printf("| incidents/s into the store, 8 writer processes x %d (classified, flushed) | %.0f | %.0f |\n\n", kPer,
              pg_rate, lite_rate);
  std::printf("Reads answered by the server over %lld incidents (median of 5, ms):\n\n", static_cast<long long>(n));
  std::printf("| read | ms |\n|---|---:|\n");
  std::printf("| first page (50, newest first) | %.2f |\n", t_first);
  std::printf("| deep page (offset %lld) | %.2f |\n", static_cast<long long>(n / 2), t_deep);
  std::printf("| filtered page (workload) | %.2f |\n", t_filtered);
  std::printf("| one run's incidents | %.2f |\n", t_run);
  std::printf("| count of a filter | %.2f |\n", t_count);
  std::printf("| groups (all fingerprints) | %.2f |\n", t_groups);
  std::printf("| stats (by pattern, outcome, kind; priors) | %.2f |\n", t_stats);
  std::printf("| every incident read into memory (what kb report does; median of 3) | %.2f |\n\n", t_load);
  std::printf("Target: Record() cost unchanged by the backend (the queue takes it; the writer thread talks to the\n"
              "server); list and stats over 100,000 incidents fast on the server.\n");
  return 0;
}
