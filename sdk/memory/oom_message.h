// Reading out-of-memory messages as text: which format printed them and the
// figures they carry (requested size, capacity, free, allocated, reserved,
// other processes, ...), each known or unknown.
//
// ClassifyMessage (oom.h) decides whether a message is an OOM and of which
// kind; ParseOomFigures reads the numbers. Both are used on exception
// messages the guard catches and on text imported from logs and reports, so
// they accept every format the SDK meets in practice (docs/patterns.md lists
// them) and never guess a figure the text does not print.
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_SDK_MEMORY_OOM_MESSAGE_H_
#define OOMGUARD_SDK_MEMORY_OOM_MESSAGE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace oomguard::internal {

// A process that the message says holds device memory (PyTorch >= 2.1 lists
// them as "Process 12345 has 1.19 GiB memory in use").
struct ProcessMemory {
  int64_t pid = 0;
  int64_t bytes = 0;
};

// The figures of one OOM message. A figure the text does not print stays
// nullopt: absent is never read as zero.
struct OomFigures {
  // The format that matched: "pytorch" (>= 2.1 wording), "pytorch-1.x"
  // ("reserved in total by PyTorch"), "pytorch-cached" (<= 1.3: "X cached" is
  // the allocator's free cache), "pytorch-request" (only "Tried to allocate
  // X"), "tensorflow", "tensorflow-bfc", "xla", "nccl",
  // "cpu-allocator", "pytorch-mmap", "mps", "mlx-metal", "ggml", "ollama", "dynet", "oom-killer"; empty when none did.
  std::string format;
  std::string device;     // "cuda", "npu", "xpu", "hip", "mps", "metal", "gpu", "cpu", "tpu"; empty: not printed
  int device_index = -1;  // "GPU 2", "NPU 3", "device:GPU:0"; -1: not printed

  std::optional<int64_t> requested;     // bytes the failing allocation asked for
  bool requested_is_lower_bound = false;  // "more than 1EB": the true size is larger still
  std::optional<int64_t> capacity;      // device total, or the allocator's limit (TF BFC "Limit")
  std::optional<int64_t> free;          // free on the device as the driver reports it
  std::optional<int64_t> allocated;     // in live tensors of the framework's allocator
  std::optional<int64_t> reserved;      // held by the caching allocator (allocated + cached free blocks)
  std::optional<int64_t> process_in_use;  // this process in total (framework + CUDA context + libraries)
  std::vector<ProcessMemory> other_processes;  // listed processes other than this one
  std::optional<int64_t> program_total;  // XLA: the buffers of the whole compiled program
  std::optional<int64_t> host_rss;       // Linux OOM killer: resident memory of the killed process

  // reserved - allocated: memory the allocator holds in free blocks.
  std::optional<int64_t> cached_free() const {
    if (!reserved || !allocated) return std::nullopt;
    return *reserved - *allocated;
  }
  int64_t other_processes_total() const;
};

// Reads every figure `message` prints. Sizes are taken with their units as
// printed: KiB/MiB/GiB/TiB/EiB binary, kB/MB/GB/TB decimal, bytes; XLA's
// bare "1.20G" and the kernel's "kB" are binary, as those programs mean them.
// Messages wrapped over several lines are fine (whitespace is whitespace).
OomFigures ParseOomFigures(std::string_view message);

// Parses "<number>[ ]<unit>" at `pos` of a lower-cased string (the helper
// ParseOomFigures uses; exposed for the log parser). nullopt: no size there.
std::optional<int64_t> ParseSizeAt(std::string_view lower, size_t pos);

// Lower-case copy (ASCII).
std::string LowerAscii(std::string_view s);

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_MEMORY_OOM_MESSAGE_H_
