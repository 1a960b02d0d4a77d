// Checkpoint benchmark: a state of OOMGUARD_BENCH_CKPT_MIB MiB (default 1024)
// of float32 weights that look trained (normal(0, 0.02) matrices, LayerNorm
// gains near 1), saved and loaded through the Checkpointer, against the
// baselines the design targets name:
//   stall (SaveAsync's blocking part)        vs a memcpy of the same bytes   (<= 1.2x)
//   background save (SaveAsync .. Wait)      vs raw write + fsync            (>= 0.8x throughput)
//   load (LoadLatest, checksums verified)    vs raw read                     (<= 1.2x)
// Save and load alternate with their baseline iteration by iteration and
// report medians: on a shared VM disk and memory speeds drift by 2x within
// a minute, and a comparison of two separate runs mostly measures the drift.
// The raw file (OOMGUARD_BENCH_CKPT_DIR/raw.bin) is what checkpoint_bench.py
// feeds to torch.save/torch.load and h5py+gzip, so peers see the same bytes.
// Run through bench/checkpoint_bench.sh, which writes bench/checkpoint_bench.md.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchState {
  std::string dir;
  std::vector<std::vector<float>> tensors;  // name i: model/layers.<i>.weight ...
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::string> names;
  int64_t bytes = 0;
  std::unique_ptr<oomguard::Checkpointer> ckpt;
  int64_t step = 0;
  std::unique_ptr<oomguard::Checkpointer> zstd;  // compression = zstd, for the cold load of a compressed shard
};

uint64_t Next(uint64_t* s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

// Approximately normal(0, sigma): Irwin-Hall sum of 4 uniforms.
void FillNormal(std::vector<float>* v, float mean, float sigma, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
  const float scale = sigma * 1.7320508f / 2.0f / 2147483648.0f;
  for (auto& x : *v) {
    uint64_t a = Next(&s), b = Next(&s);
    float sum = static_cast<float>(static_cast<int64_t>(a & 0xffffffff) + static_cast<int64_t>(a >> 32) +
                                   static_cast<int64_t>(b & 0xffffffff) + static_cast<int64_t>(b >> 32) -
                                   4 * 2147483648LL);
    x = mean + sum * scale;
  }
}

BenchState& State() {
  static BenchState* st = [] {
    auto* s = new BenchState();
    const char* mib_env = std::getenv("OOMGUARD_BENCH_CKPT_MIB");
    const int64_t mib = mib_env != nullptr ? std::atoll(mib_env) : 1024;
    const char* dir_env = std::getenv("OOMGUARD_BENCH_CKPT_DIR");
    s->dir = dir_env != nullptr ? dir_env : "/tmp/oomguard-ckpt-bench";
    std::filesystem::remove_all(s->dir + "/ckpt");
    std::filesystem::create_directories(s->dir);
    // 4096 x 4096 float32 matrices (64 MiB each) plus a LayerNorm gain per matrix.
    const int64_t d = mib >= 256 ? 4096 : 1024;
    const int64_t n = std::max<int64_t>(1, (mib << 20) / (d * d * 4));
    for (int64_t i = 0; i < n; ++i) {
      s->names.push_back("model/layers." + std::to_string(i) + ".weight");
      s->shapes.push_back({d, d});
      s->tensors.emplace_back(static_cast<size_t>(d * d));
      FillNormal(&s->tensors.back(), 0.f, 0.02f, static_cast<uint64_t>(i) + 1);
      s->names.push_back("model/layers." + std::to_string(i) + ".norm");
      s->shapes.push_back({d});
      s->tensors.emplace_back(static_cast<size_t>(d));
      FillNormal(&s->tensors.back(), 1.f, 0.05f, static_cast<uint64_t>(i) + 1000);
    }
    for (const auto& t : s->tensors) s->bytes += static_cast<int64_t>(t.size() * 4);
    oomguard::CheckpointOptions o;
    o.dir = s->dir + "/ckpt";
    o.keep = 1;
    // Chunk size: the library's default unless OOMGUARD_BENCH_CKPT_CHUNK_KIB says.
    if (const char* cb = std::getenv("OOMGUARD_BENCH_CKPT_CHUNK_KIB")) o.chunk_bytes = std::atoll(cb) << 10;
    if (const char* lv = std::getenv("OOMGUARD_BENCH_CKPT_LEVEL")) o.compression_level = std::atoi(lv);
    // Compression: auto (the library's default) unless OOMGUARD_BENCH_CKPT_COMPRESSION says none or zstd.
    if (const char* cm = std::getenv("OOMGUARD_BENCH_CKPT_COMPRESSION")) {
      const std::string m = cm;
      o.compression = m == "none"   ? oomguard::CheckpointCompression::kNone
                      : m == "zstd" ? oomguard::CheckpointCompression::kZstd
                                    : oomguard::CheckpointCompression::kAuto;
    }
    auto c = oomguard::Checkpointer::Create(o);
    if (!c.ok()) {
      // Bad OOMGUARD_BENCH_CKPT_LEVEL / _CHUNK_KIB values end up here.
      std::fprintf(stderr, "checkpoint_bench: %s\n", c.status().ToString().c_str());
      std::exit(2);
    }
    s->ckpt = std::move(c).value();
    for (size_t i = 0; i < s->tensors.size(); ++i)
      if (!s->ckpt->AddTensor(s->names[i], oomguard::DType::kFloat32, s->shapes[i], s->tensors[i].data())
               .ok())
        std::abort();
    // Warm the staging buffers (first-touch page faults are a one-time cost).
    for (int i = 0; i < 2; ++i) {
      (void)s->ckpt->SaveAsync(s->step++);
      (void)s->ckpt->Wait();
    }
    return s;
  }();
  return *st;
}

// Drops a file's pages from the page cache (they are clean: every file here
// was fsynced), so that the next read comes from the disk: the load after a
// restart on another node. Works without privileges, unlike drop_caches.
void Evict(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void EvictTree(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file()) Evict(e.path().string());
}

// CPU seconds of the whole process (every thread) so far.
double ProcessCpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void BM_Memcpy(benchmark::State& state) {
  auto& s = State();
  std::vector<std::vector<float>> dst(s.tensors.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].assign(s.tensors[i].size(), 0.f);  // pre-faulted
  for (auto _ : state) {
    auto t0 = Clock::now();
    for (size_t i = 0; i < dst.size(); ++i)
      std::memcpy(dst[i].data(), s.tensors[i].data(), s.tensors[i].size() * 4);
    state.SetIterationTime(Seconds(t0));
    benchmark::DoNotOptimize(dst[0].data());
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

void BM_SaveStall(benchmark::State& state) {
  auto& s = State();
  for (auto _ : state) {
    auto t0 = Clock::now();
    if (!s.ckpt->SaveAsync(s.step++).ok()) state.SkipWithError("SaveAsync failed");
    state.SetIterationTime(Seconds(t0));
    if (!s.ckpt->Wait().ok()) state.SkipWithError("save failed");
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

// Moves all `bytes` at `data` through `io` (read or write), however short
// its transfers; aborts on an error (a benchmark has no one to report to).
template <typename Io>
void WholeIo(int fd, float* data, size_t bytes, Io io) {
  char* p = reinterpret_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = io(fd, p, bytes);
    if (n <= 0) std::abort();
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Writes the state as one plain file and fsyncs it and its directory. Files
// rotate like checkpoints with keep = 1 (a new file each time, the previous
// one deleted once the new one is durable), so both sides allocate fresh
// page cache and disk blocks: rewriting one file in place reuses both and
// is not what a checkpoint does.
void RawWrite(BenchState& s, int k) {
  const std::string path = s.dir + "/raw-" + std::to_string(k % 2) + ".bin";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) std::abort();
  for (const auto& t : s.tensors)
    WholeIo(fd, const_cast<float*>(t.data()), t.size() * 4,
            [](int f, char* p, size_t n) { return ::write(f, p, n); });
  ::fsync(fd);
  ::close(fd);
  int dfd = ::open(s.dir.c_str(), O_RDONLY | O_DIRECTORY);
  ::fsync(dfd);
  ::close(dfd);
}

// Untimed, after each raw write and each save: the raw file before the
// newest goes, and whatever the Checkpointer's retention dropped (deleted in
// the background under a hidden name) is waited for, so that neither
// deletion lands inside the next timed operation.
void DeleteOlder(BenchState& s, int k) {
  std::filesystem::remove(s.dir + "/raw-" + std::to_string((k + 1) % 2) + ".bin");
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  for (;;) {
    bool removing = false;
    for (const auto& e : std::filesystem::directory_iterator(s.dir + "/ckpt"))
      removing |= e.path().filename().string().rfind(".removing-", 0) == 0;
    if (!removing) break;
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "checkpoint_bench: what retention dropped is still not deleted after 60 s\n");
      std::exit(2);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void RawRead(BenchState& s, std::vector<std::vector<float>>* dst) {
  int fd = ::open((s.dir + "/raw.bin").c_str(), O_RDONLY);
  if (fd < 0) std::abort();
  for (auto& t : *dst)
    WholeIo(fd, t.data(), t.size() * 4, [](int f, char* p, size_t n) { return ::read(f, p, n); });
  ::close(fd);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

// Runs `a` and `b` alternately (AB, BA, AB, ...), so that both see the same
// machine state (disk, page cache, free memory) and neither always goes
// first. The benchmark's own time is b's; medians, minima and maxima of both
// are counters, and so is b's process CPU time (all threads).
// `after` runs untimed after each a and each b: deleting what they left
// behind, so that neither pays for the other's cleanup.
template <typename A, typename B, typename After>
void Alternate(benchmark::State& state, const std::string& a_name, A a, const std::string& b_name, B b,
               After after) {
  std::vector<double> ta, tb, cpu_b;
  int i = 0;
  for (auto _ : state) {
    double da = 0, db = 0;
    auto run_a = [&] {
      auto t0 = Clock::now();
      a(i);
      da = Seconds(t0);
      after();
    };
    auto run_b = [&] {
      const double c0 = ProcessCpuSeconds();
      auto t0 = Clock::now();
      b(i);
      db = Seconds(t0);
      cpu_b.push_back((ProcessCpuSeconds() - c0) * 1000);
      after();
    };
    if (i % 2 == 0) {
      run_a();
      run_b();
    } else {
      run_b();
      run_a();
    }
    ta.push_back(da * 1000);
    tb.push_back(db * 1000);
    state.SetIterationTime(db);
    ++i;
  }
  auto put = [&](const std::string& name, const std::vector<double>& t) {
    state.counters[name + "_median_ms"] = Median(t);
    state.counters[name + "_min_ms"] = *std::min_element(t.begin(), t.end());
    state.counters[name + "_max_ms"] = *std::max_element(t.begin(), t.end());
  };
  put(a_name, ta);
  put(b_name, tb);
  // CPU time of b over all threads: how many cores b would need to take as
  // long as a (the decode and hashing work is parallel; this box has 2).
  state.counters[b_name + "_cpu_median_ms"] = Median(cpu_b);
}

// Background save (SaveAsync .. Wait: compression, writing, fsync, file hash,
// manifest, retention) against a raw write + fsync of the same bytes.
void BM_SaveVsRawWrite(benchmark::State& state) {
  auto& s = State();
  int compressed = 0, saves = 0;
  int last_raw = 0;
  Alternate(
      state, "raw",
      [&](int k) {
        RawWrite(s, k);
        last_raw = k;
      },
      "save",
      [&](int) {
        if (!s.ckpt->SaveAsync(s.step++).ok()) state.SkipWithError("SaveAsync failed");
        if (!s.ckpt->Wait().ok()) state.SkipWithError("save failed");
        ++saves;
        if (s.ckpt->Stats().last_compression != "none") ++compressed;
      },
      [&] { DeleteOlder(s, last_raw); });
  const auto st = s.ckpt->Stats();
  // What compression = auto chose: how many timed saves compressed, and the
  // last choice with its measurements (for checkpoint_bench.sh).
  state.counters["saves_compressed"] = compressed;
  state.counters["saves"] = saves;
  {
    std::ofstream why(s.dir + "/auto.json");
    why << (st.last_compression_auto.empty() ? "{\"chose\": \"" + st.last_compression + "\"}"
                                             : st.last_compression_auto);
  }
  state.counters["file_bytes"] = static_cast<double>(st.last_file_bytes);
  state.counters["ratio"] = static_cast<double>(s.bytes) / static_cast<double>(st.last_file_bytes);
  state.SetBytesProcessed(state.iterations() * s.bytes);
  // The read baseline and the peers (checkpoint_bench.py) use raw.bin.
  std::filesystem::rename(s.dir + "/raw-" + std::to_string((state.iterations() - 1) % 2) + ".bin",
                          s.dir + "/raw.bin");
}

// Reference only: the same write rewriting one file in place (O_TRUNC),
// which reuses the page cache and disk blocks the previous write freed.
void BM_RawWriteInPlace(benchmark::State& state) {
  auto& s = State();
  for (auto _ : state) {
    auto t0 = Clock::now();
    RawWrite(s, 0);
    state.SetIterationTime(Seconds(t0));
  }
  std::filesystem::remove(s.dir + "/raw-0.bin");
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

// A second checkpointer of the same tensors that always compresses, with
// one checkpoint saved: auto may have written the main one uncompressed, and
// a cold load of a compressed shard is the case that has to hide its decode.
oomguard::Checkpointer& ZstdCheckpoint(BenchState& s) {
  if (!s.zstd) {
    oomguard::CheckpointOptions o;
    o.dir = s.dir + "/ckpt-zstd";
    o.keep = 1;
    o.compression = oomguard::CheckpointCompression::kZstd;
    s.zstd = oomguard::Checkpointer::Create(o).value();
    for (size_t i = 0; i < s.tensors.size(); ++i)
      if (!s.zstd->AddTensor(s.names[i], oomguard::DType::kFloat32, s.shapes[i], s.tensors[i].data()).ok())
        std::abort();
    if (!s.zstd->SaveAsync(0).ok() || !s.zstd->Wait().ok()) std::abort();
  }
  return *s.zstd;
}

// Load (LoadLatest: newest manifest, chunk hashes, decode, digest) against a
// raw read of the same bytes into buffers of the same shape. Arg 0: both from
// the page cache; arg 1: both from the disk (pages evicted first); arg 2: as
// 1, of a shard compressed with zstd whatever auto chose.
void BM_LoadVsRawRead(benchmark::State& state) {
  auto& s = State();
  const bool cold = state.range(0) != 0;
  oomguard::Checkpointer& ckpt = state.range(0) == 2 ? ZstdCheckpoint(s) : *s.ckpt;
  const std::string tree = state.range(0) == 2 ? s.dir + "/ckpt-zstd" : s.dir + "/ckpt";
  state.counters["compressed"] = ckpt.Stats().last_compression != "none" ? 1 : 0;
  std::vector<std::vector<float>> dst(s.tensors.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].assign(s.tensors[i].size(), 0.f);  // pre-faulted
  if (!cold) {  // both files in the page cache before the first timed read
    RawRead(s, &dst);
    if (!ckpt.LoadLatest().ok()) state.SkipWithError("load failed");
  }
  Alternate(
      state, "raw",
      [&](int) {
        if (cold) Evict(s.dir + "/raw.bin");
        RawRead(s, &dst);
      },
      "load",
      [&](int) {
        if (cold) EvictTree(tree);
        if (!ckpt.LoadLatest().ok()) state.SkipWithError("load failed");
      },
      [] {});
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

// Order matters: BM_SaveVsRawWrite leaves raw.bin and the checkpoint that
// BM_LoadVsRawRead reads.
BENCHMARK(BM_Memcpy)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveStall)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RawWriteInPlace)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveVsRawWrite)->UseManualTime()->Iterations(8)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadVsRawRead)->Arg(0)->UseManualTime()->Iterations(6)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadVsRawRead)->Arg(1)->UseManualTime()->Iterations(8)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadVsRawRead)->Arg(2)->UseManualTime()->Iterations(8)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
