// One writer process of the PostgreSQL stress test (kb_pg_stress_test.sh):
// records `count` incidents with ids w<writer>-<0000..>, a few milliseconds
// apart, through the knowledge base's sink, then flushes until everything
// reached the server (the spool included) or `deadline_s` passed.
//
//   kb_pg_writer URL SPOOL_DIR WRITER COUNT DEADLINE_S
//
// Prints one line: writer, recorded, spooled, lost, the longest Record() call
// in microseconds. Exit 0 when nothing was lost and nothing waits in the spool.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "oomguard/knowledge_base.h"

int main(int argc, char** argv) {
  using namespace oomguard;
  if (argc != 6) {
    std::fprintf(stderr, "usage: kb_pg_writer URL SPOOL_DIR WRITER COUNT DEADLINE_S\n");
    return 2;
  }
  const std::string url = argv[1];
  KnowledgeBaseOptions o;
  o.spool_dir = argv[2];
  o.retry_interval_ms = 200;
  const int writer = std::atoi(argv[3]);
  const int count = std::atoi(argv[4]);
  const int deadline_s = std::atoi(argv[5]);
  auto kb = KnowledgeBase::Open(url, o);
  if (!kb.ok()) {
    std::fprintf(stderr, "writer %d: %s\n", writer, kb.status().ToString().c_str());
    return 3;
  }
  int64_t longest_us = 0;
  for (int k = 0; k < count; ++k) {
    Incident i;
    char id[32];
    std::snprintf(id, sizeof(id), "w%d-%04d", writer, k);
    i.id = id;
    i.run_id = "run-w" + std::to_string(writer);
    i.time_unix_ms = 1'700'000'000'000 + k;
    i.rank = writer;
    i.step = k;
    i.kind = IncidentKind::kDevice;
    i.phase = Phase::kBackward;
    i.workload = "stress";
    i.requested_bytes = 1 << 20;
    i.steps_ok_before = 100;
    i.pattern = "fragmentation";  // pre-classified: the writers' cost is the store's, not the classifier's
    i.fingerprint = "stress";
    const auto t0 = std::chrono::steady_clock::now();
    (*kb)->sink()->Record(i);
    const auto us =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    if (us > longest_us) longest_us = us;
    ::usleep(2000);
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(deadline_s);
  Status s = (*kb)->Flush();
  while (!s.ok() && std::chrono::steady_clock::now() < end) {
    ::usleep(200 * 1000);
    s = (*kb)->Flush();
  }
  const SinkStats st = (*kb)->sink_stats();
  std::printf("writer=%d recorded=%d spooled=%lld lost=%lld longest_record_us=%lld flush=%s\n", writer, count,
              static_cast<long long>(st.spooled), static_cast<long long>(st.lost()),
              static_cast<long long>(longest_us), s.ok() ? "ok" : s.ToString().c_str());
  std::fflush(stdout);
  return s.ok() && st.lost() == 0 ? 0 : 1;
}
