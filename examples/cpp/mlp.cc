#include "mlp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <stdexcept>

namespace mlp {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

namespace {

// Uniform in [-1, 1), a pure function of its arguments.
double Uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = SplitMix64(seed ^ SplitMix64(a ^ SplitMix64(b ^ SplitMix64(c))));
  return static_cast<double>(h >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

struct Layout {
  int64_t w1, b1, w2, b2, w3, b3, total;
  explicit Layout(int h) {
    w1 = 0;
    b1 = w1 + int64_t{h} * kInputs;
    w2 = b1 + h;
    b2 = w2 + int64_t{h} * h;
    w3 = b2 + h;
    b3 = w3 + h;
    total = b3 + 1;
  }
};

}  // namespace

int64_t SampleCost(uint64_t seed, int64_t step, int64_t index) {
  const double u = Uniform(seed, 5000 + static_cast<uint64_t>(step), static_cast<uint64_t>(index), 99);
  return u > 1.0 - 2.0 / 48.0 ? 12 : 1;
}

int64_t UnitCount(uint64_t seed, int64_t step, int64_t index) {
  const double u = Uniform(seed, 9000 + static_cast<uint64_t>(step), static_cast<uint64_t>(index), 7);
  return 1 + std::min<int64_t>(15, static_cast<int64_t>((u + 1.0) * 8.0));
}

std::string WorkloadSignature(const Config& cfg) {
  if (!cfg.workload.empty()) return cfg.workload;
  return "mlp-h" + std::to_string(cfg.hidden) + "-b" + std::to_string(cfg.global_batch) + "-" + cfg.optimizer;
}

MlpTrainer::MlpTrainer(const Config& config, oomguard::Device* device)
    : cfg_(config), device_(device), n_params_(Layout(config.hidden).total) {
  const size_t bytes = static_cast<size_t>(n_params_) * sizeof(double);
  params_ = oomguard::DeviceBuffer(device_, bytes);
  grads_ = oomguard::DeviceBuffer(device_, bytes);
  Layout L(cfg_.hidden);
  double* p = params_.as<double>();
  const int h = cfg_.hidden;
  // Scaled uniform initialisation (Xavier-like), deterministic in the seed.
  for (int64_t i = 0; i < n_params_; ++i) {
    double fan_in = i < L.b1 ? kInputs : (i < L.w3 ? h : h);
    p[i] = Uniform(cfg_.seed, 7, 0, static_cast<uint64_t>(i)) / std::sqrt(fan_in);
    if ((i >= L.b1 && i < L.w2) || (i >= L.b2 && i < L.w3) || i == L.b3) p[i] = 0.0;
  }
  teacher_.resize(kInputs);
  for (int j = 0; j < kInputs; ++j) teacher_[j] = Uniform(cfg_.seed, 11, 0, j);
  ZeroGrad();
  if (cfg_.optimizer == "adam" && !cfg_.lazy_optimizer_state) EnsureOptimizerState();
}

MlpTrainer::~MlpTrainer() = default;

void MlpTrainer::EnsureOptimizerState() {
  if (m_.data() != nullptr) return;
  const size_t bytes = static_cast<size_t>(n_params_) * sizeof(double);
  oomguard::DeviceBuffer m(device_, bytes);
  oomguard::DeviceBuffer v(device_, bytes);
  std::memset(m.data(), 0, bytes);
  std::memset(v.data(), 0, bytes);
  m_ = std::move(m);
  v_ = std::move(v);
}

void MlpTrainer::ZeroGrad() { std::memset(grads_.data(), 0, grads_.size()); }

double MlpTrainer::Micro(int64_t step, const oomguard::MicroBatch& mb, int64_t rank_offset, oomguard::Guard* guard,
                         std::span<const int64_t> units) {
  const int h = cfg_.hidden;
  const int64_t m = mb.size;
  Layout L(h);
  const double* P = params_.as<double>();
  double* G = grads_.as<double>();
  auto mark = [&](oomguard::Phase ph) {
    if (guard != nullptr) guard->MarkPhase(ph);
  };
  auto alloc = [&](int64_t n) { return oomguard::DeviceBuffer(device_, static_cast<size_t>(n) * sizeof(double)); };

  mark(oomguard::Phase::kData);
  oomguard::DeviceBuffer xb = alloc(m * kInputs);
  std::vector<double> target(static_cast<size_t>(m));
  double* X = xb.as<double>();
  for (int64_t k = 0; k < m; ++k) {
    const uint64_t idx = static_cast<uint64_t>(rank_offset + mb.offset + k);
    double dot = 0;
    for (int j = 0; j < kInputs; ++j) {
      X[k * kInputs + j] = Uniform(cfg_.seed, 1000 + static_cast<uint64_t>(step), idx, j);
      dot += teacher_[j] * X[k * kInputs + j];
    }
    target[k] = std::sin(2.0 * dot) + 0.1 * X[k * kInputs] * X[k * kInputs + 1];
  }

  mark(oomguard::Phase::kForward);
  oomguard::DeviceBuffer a1b = alloc(m * h);
  double* A1 = a1b.as<double>();
  // Costly samples hold more activation memory (as long sequences do); the
  // extra memory does not change the arithmetic.
  oomguard::DeviceBuffer extra;
  if (cfg_.costly_samples && mb.cost > mb.size) extra = alloc((mb.cost - mb.size) * 2 * h);
  if (cfg_.fragmentation) {
    // A small block that outlives this micro-batch, placed between its
    // activations: the segment it lands in can no longer be released.
    pinned_small_.emplace_back(device_, 1024);
    if (pinned_small_.size() > 64) pinned_small_.pop_front();
  }
  for (int64_t k = 0; k < m; ++k)
    for (int i = 0; i < h; ++i) {
      double s = P[L.b1 + i];
      const double* w = P + L.w1 + int64_t{i} * kInputs;
      for (int j = 0; j < kInputs; ++j) s += w[j] * X[k * kInputs + j];
      A1[k * h + i] = std::tanh(s);
    }
  oomguard::DeviceBuffer a2b = alloc(m * h);
  double* A2 = a2b.as<double>();
  for (int64_t k = 0; k < m; ++k)
    for (int i = 0; i < h; ++i) {
      double s = P[L.b2 + i];
      const double* w = P + L.w2 + int64_t{i} * h;
      for (int j = 0; j < h; ++j) s += w[j] * A1[k * h + j];
      A2[k * h + i] = std::tanh(s);
    }
  // Each sample's share of the micro-batch's mean: 1/m, or u_k / (its units).
  std::vector<double> share(static_cast<size_t>(m), 1.0 / static_cast<double>(m));
  if (!units.empty()) {
    int64_t total = 0;
    for (int64_t k = 0; k < m; ++k) total += units[static_cast<size_t>(mb.offset + k)];
    for (int64_t k = 0; k < m; ++k)
      share[k] = total > 0 ? static_cast<double>(units[static_cast<size_t>(mb.offset + k)]) / static_cast<double>(total)
                           : 0.0;
  }
  std::vector<double> err(static_cast<size_t>(m));
  double loss = 0;
  for (int64_t k = 0; k < m; ++k) {
    double y = P[L.b3];
    for (int j = 0; j < h; ++j) y += P[L.w3 + j] * A2[k * h + j];
    err[k] = y - target[k];
    loss += share[k] * 0.5 * err[k] * err[k];
  }

  // Backward of weight * mean loss: each sample's gradient is scaled by weight * its share.
  mark(oomguard::Phase::kBackward);
  oomguard::DeviceBuffer d2b = alloc(m * h);
  double* D2 = d2b.as<double>();
  for (int64_t k = 0; k < m; ++k) {
    const double e = err[k] * mb.weight * share[k];
    G[L.b3] += e;
    for (int j = 0; j < h; ++j) {
      G[L.w3 + j] += e * A2[k * h + j];
      D2[k * h + j] = e * P[L.w3 + j] * (1.0 - A2[k * h + j] * A2[k * h + j]);
    }
  }
  // Allocated after the last layer's gradients were accumulated: an OOM here
  // leaves a partial gradient behind, which is what the reset hook is for.
  oomguard::DeviceBuffer d1b = alloc(m * h);
  double* D1 = d1b.as<double>();
  std::fill(D1, D1 + m * h, 0.0);
  for (int64_t k = 0; k < m; ++k)
    for (int i = 0; i < h; ++i) {
      const double d = D2[k * h + i];
      G[L.b2 + i] += d;
      double* gw = G + L.w2 + int64_t{i} * h;
      const double* w = P + L.w2 + int64_t{i} * h;
      for (int j = 0; j < h; ++j) {
        gw[j] += d * A1[k * h + j];
        D1[k * h + j] += d * w[j];
      }
    }
  for (int64_t k = 0; k < m; ++k)
    for (int j = 0; j < h; ++j) {
      const double d = D1[k * h + j] * (1.0 - A1[k * h + j] * A1[k * h + j]);
      G[L.b1 + j] += d;
      double* gw = G + L.w1 + int64_t{j} * kInputs;
      for (int q = 0; q < kInputs; ++q) gw[q] += d * X[k * kInputs + q];
    }
  return loss * mb.weight;
}

void MlpTrainer::Commit(oomguard::Guard* guard) {
  if (guard != nullptr) guard->MarkPhase(oomguard::Phase::kOptimizer);
  double* P = params_.as<double>();
  const double* G = grads_.as<double>();
  if (cfg_.optimizer == "sgd") {
    for (int64_t i = 0; i < n_params_; ++i) P[i] -= cfg_.lr * G[i];
  } else {
    EnsureOptimizerState();  // may throw DeviceOomError before anything is updated
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    ++adam_t_;
    const double c1 = 1.0 - std::pow(b1, static_cast<double>(adam_t_));
    const double c2 = 1.0 - std::pow(b2, static_cast<double>(adam_t_));
    double* M = m_.as<double>();
    double* V = v_.as<double>();
    for (int64_t i = 0; i < n_params_; ++i) {
      M[i] = b1 * M[i] + (1 - b1) * G[i];
      V[i] = b2 * V[i] + (1 - b2) * G[i] * G[i];
      P[i] -= cfg_.lr * (M[i] / c1) / (std::sqrt(V[i] / c2) + eps);
    }
  }
  if (cfg_.leak_bytes_per_step > 0)
    leaked_.emplace_back(device_, static_cast<size_t>(cfg_.leak_bytes_per_step));
  ZeroGrad();
}

oomguard::Status MlpTrainer::RegisterState(oomguard::Checkpointer* ckpt) {
  using oomguard::DType;
  Layout L(cfg_.hidden);
  const int64_t h = cfg_.hidden;
  double* p = params_.as<double>();
  struct Part {
    const char* name;
    int64_t offset;
    std::vector<int64_t> shape;
  };
  const Part parts[] = {{"model/fc1.weight", L.w1, {h, kInputs}}, {"model/fc1.bias", L.b1, {h}},
                        {"model/fc2.weight", L.w2, {h, h}},       {"model/fc2.bias", L.b2, {h}},
                        {"model/fc3.weight", L.w3, {1, h}},       {"model/fc3.bias", L.b3, {1}}};
  for (const Part& part : parts)
    OOMGUARD_RETURN_IF_ERROR(ckpt->AddTensor(part.name, DType::kFloat64, part.shape, p + part.offset));
  // Adam's moments may be allocated lazily (at the first optimizer step), so
  // they travel as an object with the step counter rather than as tensors at
  // fixed addresses.
  return ckpt->AddObject(
      "optimizer/state",
      [this] {
        std::vector<double> s = OptimizerState();
        std::vector<uint8_t> b(s.size() * sizeof(double));
        std::memcpy(b.data(), s.data(), b.size());
        return b;
      },
      [this](std::span<const uint8_t> b) {
        if (b.size() % sizeof(double) != 0)
          return oomguard::Status::DataLoss("optimizer state is not a whole number of float64");
        std::vector<double> s(b.size() / sizeof(double));
        std::memcpy(s.data(), b.data(), b.size());
        SetOptimizerState(s);
        return oomguard::Status::Ok();
      });
}

std::vector<double> MlpTrainer::Parameters() const {
  const double* p = params_.as<double>();
  return std::vector<double>(p, p + n_params_);
}

void MlpTrainer::SetParameters(const std::vector<double>& p) {
  std::copy(p.begin(), p.begin() + std::min<int64_t>(n_params_, static_cast<int64_t>(p.size())),
            params_.as<double>());
}

std::vector<double> MlpTrainer::OptimizerState() const {
  std::vector<double> s;
  s.push_back(static_cast<double>(adam_t_));
  if (m_.data() != nullptr) {
    s.insert(s.end(), m_.as<double>(), m_.as<double>() + n_params_);
    s.insert(s.end(), v_.as<double>(), v_.as<double>() + n_params_);
  }
  return s;
}

void MlpTrainer::SetOptimizerState(const std::vector<double>& s) {
  if (s.empty()) return;
  adam_t_ = static_cast<int64_t>(s[0]);
  if (static_cast<int64_t>(s.size()) == 1 + 2 * n_params_) {
    EnsureOptimizerState();
    std::copy(s.begin() + 1, s.begin() + 1 + n_params_, m_.as<double>());
    std::copy(s.begin() + 1 + n_params_, s.end(), v_.as<double>());
  }
}

TrainResult Train(const Config& cfg, oomguard::Device* device, const TrainHooks& hooks) {
  TrainResult result;
  oomguard::Coordinator* coord = hooks.coordinator;
  const int world = coord != nullptr ? coord->size() : 1;
  const int rank = coord != nullptr ? coord->rank() : 0;
  if (cfg.global_batch % world != 0) {
    result.status = oomguard::Status::InvalidArgument(
        "the global batch (" + std::to_string(cfg.global_batch) + ") must divide evenly over " +
        std::to_string(world) + " ranks");
    return result;
  }
  // Rank r trains on samples [r*n, (r+1)*n) of every global batch, so the
  // global batch is the same for any world size.
  const int64_t n_local = cfg.global_batch / world;
  const int64_t rank_offset = rank * n_local;
  std::unique_ptr<MlpTrainer> trainer_ptr;
  try {
    trainer_ptr = std::make_unique<MlpTrainer>(cfg, device);
  } catch (const oomguard::DeviceOomError& e) {
    // Parameters and optimizer state alone do not fit: no micro-batch size helps.
    result.status = oomguard::Status::ResourceExhausted(
        std::string("the model's parameters and optimizer state do not fit on the device: ") + e.what());
    return result;
  }
  MlpTrainer& trainer = *trainer_ptr;
  oomguard::GuardOptions opts;
  opts.initial_micro_batch = cfg.micro_batch;
  opts.min_micro_batch = cfg.min_micro_batch;
  opts.grow_after = cfg.grow_after;
  opts.device = device;
  opts.incidents = hooks.incidents;
  opts.priors = hooks.priors;
  opts.coordinator = coord;
  opts.uniform_micro_batch = cfg.uniform_micro_batch;
  opts.controller = cfg.controller;
  opts.workload = WorkloadSignature(cfg);
  // Checkpoints: the guard's RecoveryStore (saves every N steps and after a
  // recovered OOM; rollbacks restore through it). With several ranks each
  // writes its shard and rank 0 commits the manifest through the vote.
  std::unique_ptr<oomguard::Checkpointer> ckpt;
  if (!cfg.ckpt_dir.empty() || cfg.ckpt_in_memory) {
    oomguard::CheckpointOptions co;
    co.dir = cfg.ckpt_dir;
    co.every_steps = cfg.ckpt_every;
    co.keep = cfg.ckpt_keep;
    co.rank = rank;
    co.world_size = world;
    co.incidents = hooks.incidents;
    auto ckpt_or = oomguard::Checkpointer::Create(co);
    if (!ckpt_or.ok()) {
      result.status = ckpt_or.status();
      return result;
    }
    ckpt = std::move(ckpt_or).value();
    oomguard::Status reg = trainer.RegisterState(ckpt.get());
    if (!reg.ok()) {
      result.status = reg;
      return result;
    }
    opts.recovery = ckpt.get();
  }
  auto guard_or = oomguard::Guard::Create(opts);
  if (!guard_or.ok()) {
    result.status = guard_or.status();
    return result;
  }
  auto guard = std::move(guard_or).value();
  if (ckpt != nullptr && cfg.resume) {
    // Every rank resumes from the same step: the newest one all can load.
    // Resume sets the guard's step too: the loop starts at guard->step().
    auto loaded = guard->Resume();
    if (loaded.ok()) {
      result.resumed_from_step = *loaded;
      result.steps_done = guard->step();
    } else if (loaded.status().code() != oomguard::StatusCode::kNotFound) {
      result.status = loaded.status();
      return result;
    }
  }
  result.initial_micro_batch = std::min(guard->micro_limit(), n_local);
  std::vector<int64_t> costs, units;
  double loss = 0;  // this rank's weighted loss; after the sync, the global batch's mean
  for (int64_t s = guard->step(); s < cfg.steps; s = guard->step()) {
    result.micro_limits.push_back(std::min(guard->micro_limit(), n_local));
    loss = 0;
    oomguard::StepRequest req;
    req.samples = n_local;
    if (cfg.costly_samples) {
      costs.resize(static_cast<size_t>(n_local));
      for (int64_t i = 0; i < n_local; ++i) costs[static_cast<size_t>(i)] = SampleCost(cfg.seed, s, rank_offset + i);
      req.costs = costs;
    }
    if (cfg.token_weighted) {
      units.resize(static_cast<size_t>(n_local));
      for (int64_t i = 0; i < n_local; ++i) units[static_cast<size_t>(i)] = UnitCount(cfg.seed, s, rank_offset + i);
      if (cfg.guard_knows_units) req.units = units;
    }
    req.micro = [&](const oomguard::MicroBatch& mb) {
      // Only completed micro-batches count: an OOM inside discards this one's loss.
      loss += trainer.Micro(s, mb, rank_offset, guard.get(), cfg.token_weighted ? std::span<const int64_t>(units)
                                                                                 : std::span<const int64_t>());
    };
    req.reset = [&] {
      trainer.ZeroGrad();
      loss = 0;
    };
    // Gradients and the loss, summed over ranks by the guard after its vote.
    req.sync = [&] {
      return std::vector<oomguard::SumBuffer>{oomguard::SumBuffer::Host(trainer.grads(), trainer.ParameterCount()),
                                              oomguard::SumBuffer::Host(&loss, 1)};
    };
    req.apply = [&] { trainer.Commit(guard.get()); };
    oomguard::StepReport report;
    oomguard::Status st;
    try {
      st = guard->Step(req, &report);
    } catch (const std::exception& e) {
      // The guard passed a non-OOM error through after telling the other
      // ranks, which stop at this step too.
      st = oomguard::Status(oomguard::StatusCode::kUnknown, std::string("training step raised: ") + e.what());
      report.failed_rank = rank;
    }
    result.ooms += report.ooms;
    result.redone += report.redone;
    if (st.code() == oomguard::StatusCode::kAborted && report.rolled_back_to.has_value()) {
      // Rolled back: the guard's step() says where to continue; the steps
      // since the restored checkpoint are redone on the same data (the guard
      // called the reset hook, so no gradient of the abandoned step remains).
      ++result.rollbacks;
      if (hooks.on_step) hooks.on_step(report, loss);
      continue;
    }
    if (!st.ok()) {
      result.status = st;
      result.failed_rank = report.failed_rank;
      break;
    }
    if (s == 0) result.loss_first = loss;
    result.loss_last = loss;
    result.steps_done = s + 1;
    result.final_micro_batch = report.largest_micro;
    if (hooks.on_step) hooks.on_step(report, loss);
  }
  if (ckpt != nullptr) {
    // Every rank agrees on the newest checkpoint durable everywhere (rank 0
    // commits it); after a failed step the run is over, but what is durable
    // still is, so the agreement runs unless the peers are gone.
    if (result.status.code() != oomguard::StatusCode::kUnavailable &&
        result.status.code() != oomguard::StatusCode::kInternal) {
      auto last = guard->Finish();
      if (!last.ok() && result.status.ok()) result.status = last.status();
      if (last.ok()) result.last_checkpoint = *last;
    }
    oomguard::CheckpointStats cs = ckpt->Stats();
    result.checkpoints_written = cs.checkpoints_written;
    result.stall_ms = cs.stall_ms;
  }
  result.params = trainer.Parameters();
  return result;
}

double MaxRelativeDifference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return num / den;
}

int DumpAndCheckParameters(const char* program, const std::vector<double>& params, const std::string& dump,
                           const std::string& check, std::FILE* report, double* rel) {
  *rel = -1;
  std::string error;
  if (!dump.empty() && !WriteDoubles(dump, params, &error)) {
    std::fprintf(stderr, "%s: --dump-params: %s\n", program, error.c_str());
    return 1;
  }
  if (check.empty()) return 0;
  std::vector<double> ref;
  if (!ReadDoubles(check, &ref, &error)) {
    std::fprintf(stderr, "%s: --check-against: %s\n", program, error.c_str());
    return 2;
  }
  *rel = MaxRelativeDifference(params, ref);
  if (report != nullptr)
    std::fprintf(report, "final parameters vs %s: max relative difference %.3g (%s)\n", check.c_str(), *rel,
                 *rel <= 1e-10 ? "equal within 1e-10" : "DIFFERENT");
  return 0;
}

bool WriteDoubles(const std::string& path, const std::vector<double>& v, std::string* error) {
  static_assert(std::numeric_limits<double>::is_iec559, "float64 must be IEEE 754");
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    *error = "cannot open " + path + " for writing: " + std::strerror(errno);
    return false;
  }
  // x86-64 and aarch64 are little-endian; the file format is little-endian float64.
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(double)));
  f.close();
  if (!f) {
    *error = "writing " + path + " failed";
    return false;
  }
  return true;
}

bool ReadDoubles(const std::string& path, std::vector<double>* v, std::string* error) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) {
    *error = "cannot open " + path + ": " + std::strerror(errno);
    return false;
  }
  const std::streamsize n = f.tellg();
  if (n % static_cast<std::streamsize>(sizeof(double)) != 0) {
    *error = path + " is " + std::to_string(n) + " bytes, not a whole number of float64 values";
    return false;
  }
  v->resize(static_cast<size_t>(n) / sizeof(double));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v->data()), n);
  if (!f) {
    *error = "reading " + path + " failed";
    return false;
  }
  return true;
}

}  // namespace mlp
