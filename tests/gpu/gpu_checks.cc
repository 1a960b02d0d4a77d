// The C++ checks of the device run (tests/gpu/run.sh), one per subcommand,
// each printing one JSON line and exiting 0 on PASS, 1 on FAIL, 77 when no
// GPU is visible (ctest's skip code):
//
//   gpu_checks guard-oom
//     Real out-of-memory errors of the CUDA device's memory pool, recovered
//     by the guard. Most of the device is taken by a plain cudaMalloc first,
//     so that the step's whole batch no longer fits; every micro-batch holds
//     its samples' activations as pool allocations (CudaDevice) and writes
//     them with the GPU. The guard must split the step until it fits, and
//     the step's result must equal the arithmetic of the whole batch.
//
//   gpu_checks staging [--gib 4] [--dir DIR]
//     Checkpoint staging of CUDA tensors against a plain cudaMemcpy of the
//     same bytes into page-locked host memory: the SaveAsync stall (median
//     of the steady-state saves, buffers already pinned) over the memcpy
//     (median), target <= 1.2; then a round trip that must give back every
//     byte, from the in-memory snapshot and from disk.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/device.h"
#include "oomguard/guard.h"
#include "oomguard/logging.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSkip = 77;

double MsSince(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool HaveGpu(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    *why = e != cudaSuccess ? cudaGetErrorString(e) : "no device";
    cudaGetLastError();
    return false;
  }
  return true;
}

int GuardOom() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 1;
  // Leave 3 GiB: the whole batch (64 samples x 96 MiB = 6 GiB) cannot fit;
  // 16 samples (1.5 GiB) can.
  const size_t leave = size_t{3} << 30;
  void* filler = nullptr;
  if (free_b > leave && cudaMalloc(&filler, free_b - leave) != cudaSuccess) {
    std::printf("{\"check\":\"guard-oom\",\"ok\":false,\"error\":\"could not take %zu bytes\"}\n", free_b - leave);
    return 1;
  }
  auto dev = oomguard::MakeCudaDevice(0);
  if (!dev.ok()) {
    std::printf("{\"check\":\"guard-oom\",\"ok\":false,\"error\":\"%s\"}\n", dev.status().ToString().c_str());
    return 1;
  }
  oomguard::GuardOptions o;
  o.initial_micro_batch = 64;
  o.device = dev->get();
  auto guard = oomguard::Guard::Create(o).value();
  constexpr int64_t kSamples = 64;
  constexpr size_t kPerSample = size_t{96} << 20;
  double grad = 0;
  int64_t touched = 0;
  oomguard::StepRequest req;
  req.samples = kSamples;
  req.micro = [&](const oomguard::MicroBatch& mb) {
    guard->MarkPhase(oomguard::Phase::kForward);
    oomguard::DeviceBuffer acts(dev->get(), kPerSample * static_cast<size_t>(mb.size));  // real pool allocation
    if (cudaMemset(acts.data(), 1, acts.size()) != cudaSuccess) throw std::runtime_error("cudaMemset failed");
    guard->MarkPhase(oomguard::Phase::kBackward);
    double s = 0;
    for (int64_t i = mb.offset; i < mb.offset + mb.size; ++i) s += static_cast<double>(i);
    grad += mb.weight * s / static_cast<double>(mb.size);
    touched += mb.size;
  };
  req.reset = [&] {
    grad = 0;
    touched = 0;
  };
  oomguard::StepReport rep;
  const auto t0 = Clock::now();
  oomguard::Status st = guard->Step(req, &rep);
  const double ms = MsSince(t0);
  const double want = (kSamples - 1) / 2.0;  // the mean sample index
  bool real = !rep.incidents.empty();
  for (const auto& inc : rep.incidents) real = real && !inc.injected && inc.kind == oomguard::IncidentKind::kDevice;
  const bool ok = st.ok() && rep.ooms >= 1 && real && touched == kSamples && std::abs(grad - want) < 1e-12;
  std::printf("{\"check\":\"guard-oom\",\"ok\":%s,\"status\":\"%s\",\"ooms\":%d,\"final_micro_batch\":%" PRId64
              ",\"incident\":\"%s\",\"result\":%.17g,\"expected\":%.17g,\"step_ms\":%.1f}\n",
              ok ? "true" : "false", st.ToString().c_str(), rep.ooms, rep.largest_micro,
              rep.incidents.empty() ? "" : rep.incidents[0].message.substr(0, 120).c_str(), grad, want, ms);
  cudaFree(filler);
  return ok ? 0 : 1;
}

int Staging(double gib, const std::string& dir) {
  const size_t total = static_cast<size_t>(gib * (1 << 30));
  constexpr int kTensors = 8;
  const size_t each = total / kTensors / 4 * 4;
  std::vector<float*> dev(kTensors, nullptr);
  std::vector<float> pattern(each / 4);
  for (int t = 0; t < kTensors; ++t) {
    if (cudaMalloc(reinterpret_cast<void**>(&dev[t]), each) != cudaSuccess) return 1;
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<float>((i * 2654435761u + t) % 100003) * 0.5f;
    if (cudaMemcpy(dev[t], pattern.data(), each, cudaMemcpyHostToDevice) != cudaSuccess) return 1;
  }
  // The baseline: the same bytes, device to page-locked host, one stream.
  void* pinned = nullptr;
  if (cudaMallocHost(&pinned, each * kTensors) != cudaSuccess) return 1;
  std::vector<double> memcpy_ms;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = Clock::now();
    for (int t = 0; t < kTensors; ++t)
      cudaMemcpyAsync(static_cast<uint8_t*>(pinned) + t * each, dev[t], each, cudaMemcpyDeviceToHost, nullptr);
    cudaStreamSynchronize(nullptr);
    memcpy_ms.push_back(MsSince(t0));
  }
  cudaFreeHost(pinned);
  oomguard::CheckpointOptions o;
  o.dir = dir;
  o.keep = 2;
  o.fsync = false;  // the stall is the subject; the disk is not
  auto c = oomguard::Checkpointer::Create(o).value();
  for (int t = 0; t < kTensors; ++t) {
    oomguard::Status s = c->AddTensor("model/t" + std::to_string(t), oomguard::DType::kFloat32,
                                      {static_cast<int64_t>(each / 4)}, dev[t], oomguard::MemoryLocation::kCuda);
    if (!s.ok()) {
      std::printf("{\"check\":\"staging\",\"ok\":false,\"error\":\"%s\"}\n", s.ToString().c_str());
      return 1;
    }
  }
  // Save 0 pins the buffers; saves 1..3 are the steady state.
  for (int step = 0; step < 4; ++step) {
    oomguard::Status s = c->SaveAsync(step);
    if (s.ok()) s = c->Wait();
    if (!s.ok()) {
      std::printf("{\"check\":\"staging\",\"ok\":false,\"error\":\"%s\"}\n", s.ToString().c_str());
      return 1;
    }
  }
  std::vector<double> stalls = c->Stats().stall_ms;
  stalls.erase(stalls.begin());
  const double stall = Median(stalls), base = Median(memcpy_ms);
  // Round trip: zero the device, restore from memory, compare; then from disk.
  auto same = [&]() {
    for (int t = 0; t < kTensors; ++t) {
      std::vector<float> back(each / 4);
      if (cudaMemcpy(back.data(), dev[t], each, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
      for (size_t i = 0; i < back.size(); i += 4099)
        if (back[i] != static_cast<float>((i * 2654435761u + t) % 100003) * 0.5f) return false;
      if (back.back() != static_cast<float>(((back.size() - 1) * 2654435761u + t) % 100003) * 0.5f) return false;
    }
    return true;
  };
  for (int t = 0; t < kTensors; ++t) cudaMemset(dev[t], 0, each);
  const bool from_memory = c->Restore(3).ok() && same();
  for (int t = 0; t < kTensors; ++t) cudaMemset(dev[t], 0, each);
  c.reset();
  auto fresh = oomguard::Checkpointer::Create(o).value();
  for (int t = 0; t < kTensors; ++t)
    (void)fresh->AddTensor("model/t" + std::to_string(t), oomguard::DType::kFloat32, {static_cast<int64_t>(each / 4)},
                           dev[t], oomguard::MemoryLocation::kCuda);
  auto loaded = fresh->LoadLatest();
  const bool from_disk = loaded.ok() && *loaded == 3 && same();
  const double ratio = stall / base;
  const bool ok = ratio <= 1.2 && from_memory && from_disk;
  std::printf("{\"check\":\"staging\",\"ok\":%s,\"gib\":%.2f,\"stall_ms\":%.1f,\"memcpy_ms\":%.1f,\"ratio\":%.3f,"
              "\"stall_gbps\":%.2f,\"memcpy_gbps\":%.2f,\"restore_from_memory\":%s,\"load_from_disk\":%s}\n",
              ok ? "true" : "false", static_cast<double>(total) / (1 << 30), stall, base, ratio,
              static_cast<double>(each * kTensors) / stall / 1e6, static_cast<double>(each * kTensors) / base / 1e6,
              from_memory ? "true" : "false", from_disk ? "true" : "false");
  for (float* p : dev) cudaFree(p);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: gpu_checks guard-oom | staging [--gib G] [--dir DIR]\n");
    return 2;
  }
  oomguard::Logger()->set_level(spdlog::level::err);
  std::string why;
  if (!HaveGpu(&why)) {
    std::printf("SKIP: no GPU is visible (%s)\n", why.c_str());
    return kSkip;
  }
  const std::string cmd = argv[1];
  if (cmd == "guard-oom") return GuardOom();
  if (cmd == "staging") {
    double gib = 4;
    std::string dir = (std::filesystem::temp_directory_path() / "oomguard-gpu-staging").string();
    for (int i = 2; i + 1 < argc; i += 2) {
      if (std::strcmp(argv[i], "--gib") == 0) gib = std::atof(argv[i + 1]);
      else if (std::strcmp(argv[i], "--dir") == 0) dir = argv[i + 1];
    }
    if (!(gib > 0)) {
      std::fprintf(stderr, "gpu_checks staging: --gib must be > 0\n");
      return 2;
    }
    std::filesystem::remove_all(dir);
    const int rc = Staging(gib, dir);
    std::filesystem::remove_all(dir);
    return rc;
  }
  std::fprintf(stderr, "gpu_checks: unknown check '%s'\n", cmd.c_str());
  return 2;
}
