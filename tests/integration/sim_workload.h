// A training step's memory, without its arithmetic: what the size
// controller's end-to-end tests and controller_bench run on a SimulatedDevice
// (allocator rounding, segments, caching and fragmentation all on), so that
// the guard sees peak memory, failed requests and capacities as it would on a
// GPU, at a GPU's scale (tens of GiB; backing=false keeps it free on the host).
//
// One micro-batch of u units (samples, or cost units such as tokens) does what
// a transformer's forward and backward do to an allocator:
//   forward   a fixed workspace; per layer a temporary (freed within the
//             layer) and a saved activation; the logits; a small buffer kept
//             until the step ends (per-micro-batch outputs, pinning a small
//             segment)
//   backward  per layer, in reverse: a gradient of the activation is
//             allocated, the activation and the previous gradient freed
// Layers differ in size, so freed blocks are split by best fit and stranded
// bytes appear (reserved > allocated), as on a real caching allocator.
//
// ForeignMemoryDevice wraps a device and lets "another process" take memory:
// the guard then sees the free memory shrink while its own allocated and
// reserved bytes stay as they were, which is how cudaMemGetInfo shows it.
//
// The oracles say what fits, as the device decides it: a plan fits when it
// runs kFitSteps steps in a row on a fresh device without an OOM (the
// first step at a size can fit where later ones, with the cache fragmented,
// do not).
//
// Thread-safety: a SimWorkload is driven by one thread; ForeignMemoryDevice
// is as thread-safe as the device it wraps, except TakeForeign (one thread,
// between steps).
#ifndef OOMGUARD_TESTS_INTEGRATION_SIM_WORKLOAD_H_
#define OOMGUARD_TESTS_INTEGRATION_SIM_WORKLOAD_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/guard.h"
#include "oomguard/plan.h"

namespace oomguard::testing {

inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;
inline constexpr int64_t kSimGpuCapacity = 80 * kGiB;  // an 80 GiB GPU
inline constexpr int kFitSteps = 5;                    // steps in a row that make a plan fit

struct SimWorkloadShape {
  int layers = 6;
  int64_t param_bytes = 2 * kGiB;       // parameters; gradients as many; Adam twice as many
  int64_t workspace_bytes = 96 * kMiB;  // per micro-batch, whatever its size (the model's `fixed`)
  int64_t unit_bytes = 64 * kMiB;       // saved activations per unit, summed over layers
  int64_t kept_bytes = 48 << 10;        // per micro-batch, kept until the step ends
  // Percent by which the layers' activations differ (0: identical layers, as
  // a transformer's; more strands more bytes between steps).
  int layer_spread = 0;
};

// The activation bytes of layer l per unit: unit_bytes / layers, varied by up
// to layer_spread percent.
inline int64_t LayerUnitBytes(const SimWorkloadShape& s, int l) {
  static constexpr int kPattern[] = {0, 3, -3, 2, -2, 1, -1, 0};  // thirds of the spread
  const int64_t per_layer = s.unit_bytes / s.layers;
  return per_layer * (300 + s.layer_spread * kPattern[l % 8]) / 300;
}

class SimWorkload {
 public:
  SimWorkload(Device* device, const SimWorkloadShape& shape) : device_(device), shape_(shape) {}

  // Parameters, gradients and optimizer state: allocated once, kept.
  void Setup() {
    state_.emplace_back(device_, static_cast<size_t>(shape_.param_bytes));
    state_.emplace_back(device_, static_cast<size_t>(shape_.param_bytes));
    state_.emplace_back(device_, static_cast<size_t>(2 * shape_.param_bytes));
  }

  // Forward and backward of one micro-batch of `units`, marking the phases
  // on `guard` when given. Throws DeviceOomError; whatever it allocated is
  // freed on the way out.
  void Micro(int64_t units, Guard* guard = nullptr) {
    const int L = shape_.layers;
    if (guard != nullptr) guard->MarkPhase(Phase::kForward);
    DeviceBuffer ws(device_, static_cast<size_t>(shape_.workspace_bytes));
    std::vector<DeviceBuffer> acts;
    acts.reserve(static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
      const int64_t a = LayerUnitBytes(shape_, l) * units;
      DeviceBuffer tmp(device_, static_cast<size_t>(a / 2 + 4096));
      acts.emplace_back(device_, static_cast<size_t>(a));
    }
    kept_.emplace_back(device_, static_cast<size_t>(shape_.kept_bytes));
    DeviceBuffer logits(device_, static_cast<size_t>(LayerUnitBytes(shape_, L) * units / 2 + 8192));
    if (guard != nullptr) guard->MarkPhase(Phase::kBackward);
    DeviceBuffer grad(device_, static_cast<size_t>(LayerUnitBytes(shape_, L) * units / 2 + 8192));
    logits.reset();
    for (int l = L - 1; l >= 0; --l) {
      DeviceBuffer g(device_, static_cast<size_t>(LayerUnitBytes(shape_, l) * units));
      acts[static_cast<size_t>(l)].reset();
      grad = std::move(g);
    }
  }

  // The end of a step: the kept buffers go, the optimizer takes a temporary.
  void Apply() {
    kept_.clear();
    DeviceBuffer tmp(device_, static_cast<size_t>(shape_.param_bytes / 4));
  }
  // After a failed step: the kept buffers go (the step is redone).
  void Reset() { kept_.clear(); }

  const SimWorkloadShape& shape() const { return shape_; }

 private:
  Device* device_;
  SimWorkloadShape shape_;
  std::vector<DeviceBuffer> state_;
  std::vector<DeviceBuffer> kept_;
};

// A GPU-sized SimulatedDevice: PyTorch's rounding (512 B), 2 MiB segments,
// requests up to 1 MiB from shared segments; no host memory behind it.
inline std::unique_ptr<Device> GpuSimDevice(int64_t capacity_bytes) {
  SimulatedDeviceOptions o;
  o.capacity_bytes = capacity_bytes;
  o.backing = false;
  return MakeSimulatedDevice(o).value();
}

// Wraps a device; TakeForeign allocates on it for "another process", which
// the figures then show only as missing free memory.
class ForeignMemoryDevice final : public Device {
 public:
  explicit ForeignMemoryDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  ~ForeignMemoryDevice() override { foreign_.clear(); }

  // REQUIRES: called between steps, by the thread that drives them. The
  // other process gets memory only once ours is back with the device (its
  // allocations cannot take our allocator's cache), so the cache goes first.
  void TakeForeign(int64_t bytes) {
    inner_->ReleaseCaches();
    const MemoryStats before = inner_->Stats();
    foreign_.emplace_back(inner_.get(), static_cast<size_t>(bytes));
    const MemoryStats after = inner_->Stats();
    hidden_allocated_ += after.allocated - before.allocated;
    hidden_reserved_ += after.reserved - before.reserved;
  }

  std::string Name() const override { return inner_->Name(); }
  MemoryStats Stats() const override { return Ours(inner_->Stats()); }
  void ReleaseCaches() override { inner_->ReleaseCaches(); }
  void ResetPeak() override { inner_->ResetPeak(); }
  void* Allocate(size_t bytes) override {
    try {
      return inner_->Allocate(bytes);
    } catch (const DeviceOomError& e) {
      throw DeviceOomError(e.what(), e.requested_bytes(), Ours(e.stats()), e.injected());
    }
  }
  void Free(void* p) override { inner_->Free(p); }

 private:
  // The figures as this process sees them: the foreign bytes only as less free.
  MemoryStats Ours(MemoryStats s) const {
    s.allocated -= hidden_allocated_;
    s.active -= hidden_allocated_;
    s.peak_allocated -= hidden_allocated_;
    s.reserved -= hidden_reserved_;
    return s;
  }

  std::unique_ptr<Device> inner_;
  std::vector<DeviceBuffer> foreign_;
  int64_t hidden_allocated_ = 0;
  int64_t hidden_reserved_ = 0;
};

// Runs `steps` steps of `n` units split as PlanBySamples(n, size) (or packed
// by `costs` at limit `size`) on a fresh device of `capacity` with one setup;
// true when no micro-batch ran out of memory. What "fits" means for the
// oracles of the tests and the bench. `prepare` runs after the setup (e.g. a
// foreign process taking memory).
template <typename Prepare>
bool RunsClean(const SimWorkloadShape& shape, int64_t capacity, int64_t n, std::span<const int64_t> costs,
               int64_t size, int steps, Prepare&& prepare) {
  ForeignMemoryDevice dev(GpuSimDevice(capacity));
  SimWorkload w(&dev, shape);
  try {
    w.Setup();
    prepare(dev);
    std::vector<MicroBatch> plan;
    if (costs.empty()) {
      plan = PlanBySamples(n, std::min(size, n));
    } else {
      plan = PlanByCost(costs, size).value();
    }
    for (int s = 0; s < steps; ++s) {
      for (const MicroBatch& mb : plan) w.Micro(mb.cost);
      w.Apply();
    }
  } catch (const DeviceOomError&) {
    return false;
  }
  return true;
}

// ---- Oracles ----

// The per-sample costs of step `step` (1..16, as token counts; a pure
// function of the step and the sample's index).
inline std::vector<int64_t> StepCosts(int64_t n, int step) {
  std::vector<int64_t> c(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint64_t x = (static_cast<uint64_t>(step) << 32) ^ static_cast<uint64_t>(i) ^ 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
    c[static_cast<size_t>(i)] = 1 + static_cast<int64_t>(x % 16);
  }
  return c;
}

inline int64_t LargestCost(const std::vector<MicroBatch>& plan) {
  int64_t top = 0;
  for (const MicroBatch& mb : plan) top = std::max(top, mb.cost);
  return top;
}

// The unit bytes for which L is the largest single micro-batch that fits
// (layers differing by `spread` percent).
inline SimWorkloadShape Calibrate(int64_t L, int spread, int64_t capacity = kSimGpuCapacity) {
  SimWorkloadShape shape;
  shape.layer_spread = spread;
  int64_t lo = 1 << 16, hi = capacity;
  while (hi - lo > 4096) {
    const int64_t mid = lo + (hi - lo) / 2;
    shape.unit_bytes = mid;
    (RunsClean(shape, capacity, L, {}, L, kFitSteps, [](ForeignMemoryDevice&) {}) ? lo : hi) = mid;
  }
  shape.unit_bytes = lo;
  return shape;
}

// The largest balanced split of n samples that fits, with `foreign` bytes
// taken by another process.
inline int64_t SplitOracle(const SimWorkloadShape& shape, int64_t n, int64_t foreign,
                           int64_t capacity = kSimGpuCapacity) {
  auto fits = [&](int64_t pieces) {
    const int64_t size = (n + pieces - 1) / pieces;
    return RunsClean(shape, capacity, n, {}, size, kFitSteps, [&](ForeignMemoryDevice& d) {
      if (foreign > 0) d.TakeForeign(foreign);
    });
  };
  int64_t lo = 1, hi = n;  // the fewest pieces that fit
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return (n + lo - 1) / lo;
}

// The largest cost limit up to L (the largest single micro-batch that fits)
// that fits the first steps of StepCosts(n, step). Packing by cost mixes
// sizes, so fitting is not monotone in the limit: scan down.
inline int64_t CostOracleLimit(const SimWorkloadShape& shape, int64_t n, int64_t L,
                               int64_t capacity = kSimGpuCapacity) {
  auto fits = [&](int64_t limit) {
    ForeignMemoryDevice dev(GpuSimDevice(capacity));
    SimWorkload w(&dev, shape);
    try {
      w.Setup();
      for (int s = 0; s < kFitSteps; ++s) {
        const std::vector<int64_t> costs = StepCosts(n, s);
        // (A named plan: a range-for over PlanByCost(...).value() would walk
        // a destroyed temporary.)
        const std::vector<MicroBatch> plan = PlanByCost(costs, limit).value();
        for (const MicroBatch& mb : plan) w.Micro(mb.cost);
        w.Apply();
      }
    } catch (const DeviceOomError&) {
      return false;
    }
    return true;
  };
  int64_t limit = L;
  while (limit > 1 && !fits(limit)) --limit;
  return limit;
}

}  // namespace oomguard::testing

#endif  // OOMGUARD_TESTS_INTEGRATION_SIM_WORKLOAD_H_
