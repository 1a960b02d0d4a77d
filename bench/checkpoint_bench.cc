// Checkpoint benchmark: a state of OOMGUARD_BENCH_CKPT_MIB MiB (default 1024)
// of float32 weights that look trained (normal(0, 0.02) matrices, LayerNorm
// gains near 1), saved and loaded through the Checkpointer, against the
// baselines the design targets name:
//   stall (SaveAsync's blocking part)        vs a memcpy of the same bytes   (<= 1.2x)
//   background save (SaveAsync .. Wait)      vs raw write + fsync            (>= 0.8x throughput)
//   load (LoadLatest, checksums verified)    vs raw read                     (<= 1.2x)
// The raw file (OOMGUARD_BENCH_CKPT_DIR/raw.bin) is what checkpoint_bench.py
// feeds to torch.save/torch.load and h5py+gzip, so peers see the same bytes.
// Run through bench/checkpoint_bench.sh, which writes bench/checkpoint_bench.md.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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
    o.chunk_bytes = 4 << 20;
    if (const char* cb = std::getenv("OOMGUARD_BENCH_CKPT_CHUNK_KIB")) o.chunk_bytes = std::atoll(cb) << 10;
    if (const char* lv = std::getenv("OOMGUARD_BENCH_CKPT_LEVEL")) o.compression_level = std::atoi(lv);
    auto c = oomguard::Checkpointer::Create(o);
    if (!c.ok()) std::abort();
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

void BM_SaveBackground(benchmark::State& state) {
  auto& s = State();
  for (auto _ : state) {
    auto t0 = Clock::now();
    if (!s.ckpt->SaveAsync(s.step++).ok()) state.SkipWithError("SaveAsync failed");
    if (!s.ckpt->Wait().ok()) state.SkipWithError("save failed");
    state.SetIterationTime(Seconds(t0));
  }
  const auto st = s.ckpt->Stats();
  state.counters["file_bytes"] = static_cast<double>(st.last_file_bytes);
  state.counters["ratio"] = static_cast<double>(s.bytes) / static_cast<double>(st.last_file_bytes);
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

void BM_RawWriteFsync(benchmark::State& state) {
  auto& s = State();
  const std::string path = s.dir + "/raw.bin";
  for (auto _ : state) {
    auto t0 = Clock::now();
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (const auto& t : s.tensors) {
      const char* p = reinterpret_cast<const char*>(t.data());
      size_t left = t.size() * 4;
      while (left > 0) {
        ssize_t n = ::write(fd, p, left);
        if (n <= 0) break;
        p += n;
        left -= static_cast<size_t>(n);
      }
    }
    ::fsync(fd);
    ::close(fd);
    state.SetIterationTime(Seconds(t0));
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

void BM_Load(benchmark::State& state) {
  auto& s = State();
  const bool cold = state.range(0) != 0;
  for (auto _ : state) {
    if (cold) EvictTree(s.dir + "/ckpt");
    auto t0 = Clock::now();
    if (!s.ckpt->LoadLatest().ok()) state.SkipWithError("load failed");
    state.SetIterationTime(Seconds(t0));
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

void BM_RawRead(benchmark::State& state) {
  auto& s = State();
  const std::string path = s.dir + "/raw.bin";
  std::vector<std::vector<float>> dst(s.tensors.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].assign(s.tensors[i].size(), 0.f);
  const bool cold = state.range(0) != 0;
  for (auto _ : state) {
    if (cold) Evict(path);
    auto t0 = Clock::now();
    int fd = ::open(path.c_str(), O_RDONLY);
    for (auto& t : dst) {
      char* p = reinterpret_cast<char*>(t.data());
      size_t left = t.size() * 4;
      while (left > 0) {
        ssize_t n = ::read(fd, p, left);
        if (n <= 0) break;
        p += n;
        left -= static_cast<size_t>(n);
      }
    }
    ::close(fd);
    state.SetIterationTime(Seconds(t0));
  }
  state.SetBytesProcessed(state.iterations() * s.bytes);
}

// Order matters: raw.bin exists before BM_RawRead; Load reads the last save.
BENCHMARK(BM_Memcpy)->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveStall)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveBackground)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RawWriteFsync)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
// Arg 0: from the page cache; arg 1: from the disk (pages evicted first).
// Cold rows alternate with their baseline so both see the same disk state.
BENCHMARK(BM_RawRead)->Arg(0)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)->Arg(0)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RawRead)->Arg(1)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)->Arg(1)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
