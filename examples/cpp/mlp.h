// A small multilayer perceptron in plain C++ (float64) trained through the
// guard, with its activations allocated on an oomguard Device so that memory
// grows with the micro-batch. Shared by the mlp_train example and the tests.
//
// Model: x (16) -> tanh(W1 x + b1) (H) -> tanh(W2 h1 + b2) (H) -> W3 h2 + b3 (1),
// loss = mean over samples of 0.5 * (y - t)^2; with token weighting, each
// sample carries 1..16 loss units (think valid tokens) and the loss is the
// mean over units: sum_i u_i * 0.5 * (y_i - t_i)^2 / sum_i u_i.
// Data: sample i of step s depends only on (seed, s, i), so any split of a step
// into micro-batches, and any world size, sees the same global batch.
//
// Parameter order (also the --dump-params layout, little-endian float64):
// W1 [H x 16] row-major, b1 [H], W2 [H x H] row-major, b2 [H], W3 [H], b3 [1].
//
// Thread-safety: an MlpTrainer is driven by one thread.
#ifndef OOMGUARD_EXAMPLES_MLP_H_
#define OOMGUARD_EXAMPLES_MLP_H_

#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/oomguard.h"

namespace mlp {

inline constexpr int kInputs = 16;

struct Config {
  int64_t steps = 40;
  int64_t global_batch = 256;
  int64_t micro_batch = 0;      // starting micro-batch limit; 0: whole batch
  int64_t min_micro_batch = 1;
  int grow_after = 10;
  int hidden = 64;
  uint64_t seed = 1;
  std::string optimizer = "adam";  // adam | sgd
  double lr = 1e-3;
  bool lazy_optimizer_state = false;  // allocate Adam moments at the first optimizer step
  int64_t leak_bytes_per_step = 0;    // deliberately never freed (gradual growth scenario)
  std::string workload;               // workload signature ("" : derived from the config)
  // Data-dependent spikes: a few samples per step cost many times the others
  // (think long sequences); the guard plans by cost (StepRequest::costs).
  bool costly_samples = false;
  // Small long-lived allocations interleaved with the activations, so that
  // freed activation blocks are stranded in partly used segments.
  bool fragmentation = false;
  bool uniform_micro_batch = false;   // every rank uses the smallest limit (multi-rank)
  // How the guard picks the micro-batch limit (GuardOptions::controller).
  oomguard::SizePolicy controller = oomguard::SizePolicy::kPredictive;
  // Each sample carries UnitCount() loss units and the loss is the mean over
  // the global batch's units (the token-weighted loss of LLM training).
  bool token_weighted = false;
  // With token_weighted: pass the units to the guard (StepRequest::units).
  // Off only to show that the gradient is then wrong when the step is split.
  bool guard_knows_units = true;
  // Checkpoints (oomguard::Checkpointer); off when ckpt_dir is empty, unless
  // ckpt_in_memory.
  std::string ckpt_dir;
  // Without ckpt_dir: a checkpointer that keeps its saves in memory only
  // (CheckpointOptions::dir empty), so that an OOM in the optimizer step or
  // at the smallest micro-batch rolls back instead of ending the run.
  bool ckpt_in_memory = false;
  int64_t ckpt_every = 0;             // save after every N steps (0: only after a recovered OOM)
  int ckpt_keep = 3;                  // complete checkpoints kept (0: all)
  bool resume = false;                // continue from the newest complete checkpoint in ckpt_dir
};

// Parameters, gradients and optimizer state, held in device buffers.
class MlpTrainer {
 public:
  // REQUIRES: device outlives the trainer.
  MlpTrainer(const Config& config, oomguard::Device* device);
  ~MlpTrainer();

  // Forward and backward of samples [mb.offset, mb.offset + mb.size) of step
  // `step`, adding mb.weight * grad(mean loss of the micro-batch) into the
  // gradients; the mean is over the samples' `units` when given (indexed by
  // the sample's position in this rank's share). Marks phases on `guard` when
  // given. Returns the micro-batch's weighted loss. Throws
  // oomguard::DeviceOomError when the device is full.
  double Micro(int64_t step, const oomguard::MicroBatch& mb, int64_t rank_offset, oomguard::Guard* guard,
               std::span<const int64_t> units = {});
  // The optimizer step on the accumulated gradients.
  void Commit(oomguard::Guard* guard);
  void ZeroGrad();

  std::vector<double> Parameters() const;
  void SetParameters(const std::vector<double>& p);
  // Optimizer state (moments and the Adam step counter) for checkpoints.
  std::vector<double> OptimizerState() const;
  void SetOptimizerState(const std::vector<double>& s);
  int64_t ParameterCount() const { return n_params_; }
  // Gradient buffer (what the guard sums over ranks).
  double* grads() { return grads_.as<double>(); }
  // Registers the parameters (one tensor per layer, model/fc1.weight, ...)
  // and the optimizer state with a checkpointer. REQUIRES: the trainer
  // outlives `ckpt`.
  oomguard::Status RegisterState(oomguard::Checkpointer* ckpt);

 private:
  void EnsureOptimizerState();

  Config cfg_;
  oomguard::Device* device_;
  int64_t n_params_;
  oomguard::DeviceBuffer params_, grads_, m_, v_;
  std::vector<oomguard::DeviceBuffer> leaked_;
  std::deque<oomguard::DeviceBuffer> pinned_small_;  // the fragmentation scenario's long-lived blocks
  int64_t adam_t_ = 0;
  std::vector<double> teacher_;
};

struct TrainResult {
  oomguard::Status status;      // OK, or why training stopped
  std::vector<double> params;   // final parameters
  int64_t steps_done = 0;
  int64_t ooms = 0;
  int64_t initial_micro_batch = 0;
  int64_t final_micro_batch = 0;     // largest micro-batch of the last step
  double loss_first = 0;
  double loss_last = 0;
  std::vector<int64_t> micro_limits;  // limit used at each step (the controller's trajectory)
  // Checkpoints (zero/empty without Config::ckpt_dir).
  int64_t checkpoints_written = 0;
  int64_t resumed_from_step = -1;     // -1: started from scratch
  int64_t rollbacks = 0;              // steps that ended in a rollback (kAborted) and continued
  int64_t redone = 0;                 // steps redone because a rank failed in the gradient sync
  int64_t last_checkpoint = -1;       // newest checkpoint complete on every rank at the end (Guard::Finish)
  int failed_rank = -1;               // the rank whose failure stopped training (-1: none, or this one)
  std::vector<double> stall_ms;       // blocking time of each checkpoint save
};

struct TrainHooks {
  // Called after every step with its report and loss (progress, narration).
  std::function<void(const oomguard::StepReport&, double loss)> on_step;
  oomguard::IncidentSink* incidents = nullptr;
  oomguard::MicroBatchPriors* priors = nullptr;  // learned starting sizes (the knowledge base)
  // Data parallelism: this rank's coordinator (null: one process). Each rank
  // trains on its shard of every global batch; the guard sums gradients (and
  // the reported loss) over ranks after its vote.
  oomguard::Coordinator* coordinator = nullptr;
};

// The per-sample cost of the costly-samples scenario: 1 for most samples, 12
// for about one in 48 (a pure function of seed, step and the global index).
int64_t SampleCost(uint64_t seed, int64_t step, int64_t index);
// The loss units of a sample with token weighting: 1..16, a pure function of
// seed, step and the global index.
int64_t UnitCount(uint64_t seed, int64_t step, int64_t index);

// Trains cfg.steps steps on `device` through a Guard. Non-OOM errors propagate.
TrainResult Train(const Config& cfg, oomguard::Device* device, const TrainHooks& hooks = {});

// The workload signature of a config ("mlp-h64-b256-adam"), unless cfg.workload is set.
std::string WorkloadSignature(const Config& cfg);

// ||a - b||_inf / ||b||_inf (0 when both are all zero; inf when sizes differ).
double MaxRelativeDifference(const std::vector<double>& a, const std::vector<double>& b);

// The examples' --dump-params / --check-against: writes `params` to `dump`
// (when set) and compares them with the file `check` (when set), printing the
// comparison to `report` (null: silent). Returns 0, 1 (the dump could not be
// written) or 2 (the reference could not be read), the message naming the
// flag; *rel is the max relative difference, or -1 without `check`.
int DumpAndCheckParameters(const char* program, const std::vector<double>& params, const std::string& dump,
                           const std::string& check, std::FILE* report, double* rel);

// SplitMix64's output function: counter-based randomness, so a sample
// depends only on its coordinates, never on how many values came before.
uint64_t SplitMix64(uint64_t x);

// Writes/reads little-endian float64 arrays.
bool WriteDoubles(const std::string& path, const std::vector<double>& v, std::string* error);
bool ReadDoubles(const std::string& path, std::vector<double>* v, std::string* error);

}  // namespace mlp

#endif  // OOMGUARD_EXAMPLES_MLP_H_
