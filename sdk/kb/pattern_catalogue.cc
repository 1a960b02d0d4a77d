// The pattern catalogue: what each pattern means, the classifier's rule in
// words, and remedies best first with the figures of the troubleshooting
// literature the project started from (mixed precision saves 30-50%,
// activation checkpointing 60-70% of activations for 20-30% more compute,
// 20-30% headroom, fragmentation cut from 35% to 8% by pooling buffers).
// docs/patterns.md is the long form; classifier_rules.cc holds the rules.
#include "oomguard/knowledge_base.h"

namespace oomguard {
namespace {

const char* kMixedPrecision = "Mixed precision (FP16/BF16 autocast) cuts training memory by about 30-50%";
const char* kActivationCkpt =
    "Activation (gradient) checkpointing saves about 60-70% of activation memory for 20-30% more compute";
const char* kHeadroom = "Leave 20-30% headroom over the estimated per-device need when sizing the job";
const char* kAccumulation =
    "Smaller micro-batches with gradient accumulation keep the global batch (the guard does this; start "
    "from the learned prior)";
const char* kHostRequest = "Request 20-30% more host memory than the estimate for the container/pod/Slurm job";

std::vector<PatternInfo> BuildCatalogue() {
  return {
      {"startup_capacity", "The configuration does not fit from the first step",
       "OOM at the first step(s) or while the model is placed on the device; allocated + requested exceeds capacity.",
       "Needs evidence that nothing ran before: step 0/1 with no clean step (0.75), the model being moved to the "
       "device or built (0.75), progress logged at 0/N (0.7), said at the start (0.65), XLA's whole-program buffers "
       "(0.6), one request larger than the device (0.55). A record with only a message gets no step-based pattern.",
       {kAccumulation, kMixedPrecision, kActivationCkpt, kHeadroom,
        "Models that do not fit one device: ZeRO-3/FSDP sharding, tensor or pipeline parallelism; CPU/NVMe "
        "offload (ZeRO-Offload/Infinity) as a last resort, it slows training markedly",
        "Scale up in stages: small data subset, small model, one device first, then grow"}},
      {"activation_spike", "A data-dependent peak: one long or large batch",
       "Clean steps, then one micro-batch holding an unusually costly sample (long sequence, large image) fails.",
       "sample_cost.this >= 1.5 x sample_cost.median (0.8; 0.95 at 3x); >= 5 clean steps with a flat step peak "
       "and an OOM in forward/backward (0.5); the report ties it to particular batches (long lines, the same step "
       "every time, non-deterministic) (0.7); clean steps before on variable-size data (0.55). Not with growth cues.",
       {"Bucket samples by length (dynamic batching) so a long sample does not share a micro-batch with many",
        "Limit micro-batches by cost (tokens), not sample count: pass per-sample costs to Guard::Step",
        kActivationCkpt, "Memory-efficient (flash) attention saves a further 20-30% on long sequences",
        "Truncate or filter outlier samples during data preparation"}},
      {"gradual_growth", "Memory grows step after step (a leak)",
       "The per-step peak climbs over many steps until an OOM.",
       ">= 6 step peaks rising by >= 5% of capacity (10% of the first peaks when capacity is unknown) in >= 60% of "
       "changes (0.7-0.85); the report says memory keeps growing (0.7; 0.75 after long runs); >= 3 clean epochs "
       "over the same data with no batch-specific cue (0.55).",
       {"Look for references kept across steps: losses summed without .item()/.detach(), lists of tensors, "
        "caches keyed by step, retain_graph=True",
        "Compare memory at the same point of every step or epoch; memory not released after an epoch is a leak",
        "Remove hooks and closures that capture tensors; clear metric accumulators each epoch",
        "Until fixed, checkpoints let the guard roll back and resume instead of failing the run"}},
      {"fragmentation", "Enough free memory in total, but not in one piece",
       "reserved - allocated is large while a request of that size fails; inactive_split is high.",
       "reserved - allocated >= the request and >= 3% of reserved, and the device's free memory does not cover the "
       "request (0.6; +0.15 when >= 2x the request, +0.1 when >= 10% of reserved, +0.05 for split blocks or "
       "allocator retries; -0.2 before any step completed).",
       {"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or max_split_size_mb) so blocks are not split "
        "across segments",
        "The asynchronous allocator cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)",
        "Pool fixed-size tensors and reuse buffers of constant shape: one CV team cut fragmentation from 35% "
        "to 8% this way",
        "Pad variable shapes to a few bucket sizes so freed blocks are reused",
        "torch.cuda.empty_cache() between phases returns cached segments; it stalls training, call it rarely"}},
      {"rank_imbalance", "One rank needs much more memory than the others",
       "Per-rank peaks differ widely; the heaviest rank fails while others have room.",
       ">= 2 ranks and (max - min) / max of per-rank peak (or allocated) >= 20% (0.7; 0.85 when the failing rank is "
       "the heaviest); the report says one GPU holds much more than the others (0.7).",
       {"Balance the data across ranks: equal token counts per rank, length bucketing across ranks",
        "Check model/pipeline partitioning and rank 0's extra buffers (metrics, logging, embeddings, "
        "DataParallel's gathered outputs)",
        "Shard optimizer state with ZeRO so it is spread evenly across ranks",
        "Call torch.cuda.set_device(local_rank) before any CUDA work so no rank creates a context on GPU 0",
        "Size micro-batches per rank in cost units, not samples"}},
      {"optimizer_state", "Optimizer state appears at the first optimizer step",
       "Forward and backward fit, then the optimizer step (or its state's creation) fails; Adam/AdamW moments are "
       "2-3x the parameters.",
       "phase optimizer before any clean step (0.85) or later (0.65 recorded, 0.7 from frames); Adam fails where "
       "SGD fits (0.7); the report names optimizer state creation (0.65, 0.8 at start-up); exactly one step done and "
       "the next forward/backward fails (0.6); the message mentions optimizer state (0.5).",
       {"Budget for optimizer state: AdamW keeps two moments, 2-3x the parameter memory",
        "Shard optimizer state with ZeRO-1/2 or FSDP; offload it with ZeRO-Offload at a throughput cost",
        "Use a leaner optimizer (8-bit Adam, Adafactor, SGD with momentum)", kMixedPrecision}},
      {"host_dataloader", "Host memory exhausted by the data pipeline",
       "A host (not device) OOM in the data pipeline: a loader worker killed, shared memory exhausted, dataset "
       "preparation; or a device OOM during data preprocessing.",
       "kind host and phase data (0.9), a loader-worker or shared-memory message (0.85), dataset preparation logged "
       "(0.8), the report names the pipeline (0.65); device OOM in phase data (0.6); loader words only (0.5).",
       {"Fewer DataLoader workers (num_workers) and a smaller prefetch_factor: each worker holds prefetched "
        "batches in host memory",
        "Load large files (video) in shards instead of whole; move preprocessing to the GPU",
        "Share memory between workers instead of copying; pin_memory only with host memory to spare; raise "
        "/dev/shm (docker --shm-size) when workers die of a bus error",
        kHostRequest}},
      {"checkpoint_staging", "Saving a checkpoint needs memory the step also needs",
       "The OOM happens while a checkpoint is staged, gathered (consolidate_state_dict) or written.",
       "phase checkpoint (0.9 recorded, 0.85 from frames or a 'Saving checkpoint' line); the message names "
       "checkpoint staging (0.7); the report ties it to saving (0.7).",
       {"Lower the checkpoint staging budget or save fewer tensors at once (sharded, asynchronous save)",
        "Stage to host memory, not device memory, and keep at most one snapshot in host memory",
        "Gather sharded optimizer state to the CPU rank by rank, or save sharded checkpoints without consolidating",
        "Save right after the optimizer step, when activations are freed", "Keep retention to the last K checkpoints"}},
      {"workspace", "A library workspace (cuDNN/cuBLAS) could not be allocated",
       "A small or medium request from a math library fails near the capacity limit.",
       "kind workspace (0.9); the message names a cuDNN/cuBLAS workspace or *_STATUS_ALLOC_FAILED (0.8).",
       {"Limit library workspaces (CUBLAS_WORKSPACE_CONFIG=:4096:8; torch.backends.cudnn.benchmark=False)",
        kHeadroom, "Pick algorithms with smaller workspaces or run the layer at a smaller micro-batch",
        kMixedPrecision}},
      {"foreign_memory", "Memory held outside the framework (NCCL buffers, another process)",
       "Someone other than this process's allocator holds device memory: NCCL, another process, libraries.",
       "NCCL failed to allocate its buffers (0.8); other processes listed in the message, or capacity - reserved - "
       "free less this process's own non-PyTorch memory (a CUDA context when not printed), >= 25% of reserved and "
       ">= the shortfall (0.85 listed, 0.75 inferred; +0.1 when it exceeds reserved); this process's own "
       "non-PyTorch memory that large (0.65); the report names another process (0.55).",
       {"Find other processes on the device (nvidia-smi) and run one training process per GPU",
        "Account for NCCL communication buffers; lower NCCL_BUFFSIZE or the number of channels, and leave memory "
        "for them (PyTorch's per-process memory fraction)",
        "Set the device (CUDA_VISIBLE_DEVICES, torch.cuda.set_device) before any CUDA call so ranks do not "
        "create contexts on each other's GPUs",
        kHeadroom}},
      {"eval_without_no_grad", "Evaluation runs with gradient tracking on",
       "Training fits, but evaluation/validation runs out: without no_grad every activation is kept for a "
       "backward pass that never comes, and outputs kept for metrics hold their graphs.",
       "An evaluation/validation frame or progress line (0.7) or the report's words (0.6), with nothing in the text "
       "disabling gradients there (no_grad/inference_mode frames or code, eval loops known to run without "
       "gradients); +0.1 when the evaluation code shown lacks no_grad, +0.05 after clean training steps; 0.4 when "
       "two or more epochs (with their evaluations) passed before.",
       {"Wrap evaluation in torch.no_grad() or torch.inference_mode() (with model.eval()): activations are freed "
        "layer by layer instead of kept for backward",
        "Accumulate metrics with .item() or .detach().cpu(), never the output tensors (they hold their graph)",
        "Give evaluation its own, smaller batch size when its inputs are larger (full images, full-length "
        "sequences)",
        "Run evaluation under autocast (FP16/BF16): about 30-50% less memory"}},
      {"checkpoint_load", "A restored checkpoint still holds device memory",
       "Training from scratch fits, resuming does not: the checkpoint was restored onto the device and its tensors "
       "(the loaded dict, optimizer state, all ranks' copies on GPU 0) are still held when training resumes.",
       "the OOM is raised inside torch.load/load_state_dict restoring onto the device (0.85); a resume is logged and "
       "the OOM comes in its first steps (0.75); the report ties it to resuming (0.7). Device memory only.",
       {"Load with map_location='cpu' (or each rank's own device) and copy into the model",
        "Drop the loaded checkpoint once restored (del checkpoint; gc.collect(); torch.cuda.empty_cache()) before "
        "the first forward",
        "Restore optimizer state after the model is on its device, one state at a time; with ZeRO/FSDP load "
        "sharded checkpoints per rank",
        kHeadroom}},
      {"host_memory", "Host memory exhausted outside the data pipeline",
       "The process (or its cgroup) ran out of host RAM with no loader involved: weights loaded, merged or "
       "offloaded on the CPU, evaluation on the CPU, a process killed by the OOM killer.",
       "kind host with no data-pipeline evidence: weights loaded/merged/offloaded (0.75), no loader workers (0.7), "
       "otherwise (0.5).",
       {"Load weights shard by shard and memory-mapped (safetensors, low_cpu_mem_usage, device_map) instead of "
        "materialising the whole model in host memory",
        "Merge adapters (LoRA) in half precision or on the GPU; keep one copy of the weights at a time",
        kHostRequest,
        "Compare the killed process's resident memory (dmesg anon-rss, Slurm MaxRSS) with its limit to size the "
        "request"}},
      {"impossible_request", "A request no device can hold: a size bug, not capacity",
       "One allocation asks for more than any device has (hundreds of GiB, 'more than 1EB'): a shape, dtype or unit "
       "error, or a corrupted size, computed it.",
       ">= 2x the device's capacity (0.9); larger than the device and >= 10x what the process holds (0.8); capacity "
       "unknown and >= 256 GiB (0.85); 'more than 1EB' (0.95).",
       {"Print the shapes of the failing op's inputs: a batch, sequence or image dimension multiplied in the wrong "
        "place, an integer overflow, or a unit mix-up",
        "Compare input sizes with what the model expects (an image or sequence far larger than in training; a "
        "dtype of 8 bytes where 2 were meant)",
        "No memory setting fixes it: halving the batch will not reach that size"}},
  };
}

}  // namespace

const std::vector<PatternInfo>& PatternCatalogue() {
  static const std::vector<PatternInfo> kCatalogue = BuildCatalogue();
  return kCatalogue;
}

}  // namespace oomguard
