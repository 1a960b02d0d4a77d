// Out-of-memory messages as text: ClassifyMessage (oom.h) and the figures
// parser (oom_message.h).
//
// The rules look for phrases that only appear in failures ("out of memory",
// "can't allocate memory", "OOM when allocating", an OOM killer line), never
// for the word "memory" alone, so that "memory usage is fine" stays kNone.
// Figures are read next to the words each format prints them with; a figure
// that is not printed stays unknown.
#include "sdk/memory/oom_message.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "oomguard/oom.h"

namespace oomguard {
namespace internal {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

bool Has(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

// Saturating conversion: a parsed size never overflows int64.
int64_t ToBytes(double value) {
  if (!(value > 0)) return 0;
  if (value >= 9.2e18) return INT64_MAX;
  return static_cast<int64_t>(std::llround(value));
}

// Lower-cased, every run of whitespace one space: messages wrapped over lines
// (rich consoles wrap at 80 columns) read like one line.
std::string Normalize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool space = false;
  for (char c : s) {
    if (IsSpace(c)) {
      space = true;
      continue;
    }
    if (space && !out.empty()) out.push_back(' ');
    space = false;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

double UnitScale(std::string_view unit) {
  struct UnitScale {
    std::string_view name;
    double scale;
  };
  static constexpr UnitScale kUnits[] = {
      {"b", 1.0},        {"byte", 1.0},      {"bytes", 1.0},     {"kib", 1024.0},   {"mib", 1048576.0},
      {"gib", 1073741824.0}, {"tib", 1099511627776.0}, {"pib", 1125899906842624.0},
      {"eib", 1152921504606846976.0}, {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12}, {"pb", 1e15},
      {"eb", 1e18},
      // XLA prints "1.20G"; a bare letter there means binary.
      {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0}, {"t", 1099511627776.0},
  };
  for (const UnitScale& u : kUnits) {
    if (unit == u.name) return u.scale;
  }
  return 0;
}

// The size that ends right before `end` ("8.10 gib" in "8.10 gib already allocated").
std::optional<int64_t> SizeBefore(std::string_view m, size_t end) {
  size_t i = end;
  while (i > 0 && IsSpace(m[i - 1])) --i;
  size_t unit_end = i;
  while (i > 0 && IsAlpha(m[i - 1])) --i;
  if (i == unit_end) return std::nullopt;
  while (i > 0 && IsSpace(m[i - 1])) --i;
  size_t num_end = i;
  while (i > 0 && (IsDigit(m[i - 1]) || m[i - 1] == '.' || m[i - 1] == ',')) --i;
  if (i == num_end) return std::nullopt;
  return ParseSizeAt(m, i);
}

// The size right before the first occurrence of `phrase` that has one.
std::optional<int64_t> SizeBeforePhrase(std::string_view m, std::string_view phrase) {
  for (size_t at = m.find(phrase); at != std::string_view::npos; at = m.find(phrase, at + 1)) {
    if (auto v = SizeBefore(m, at)) return v;
  }
  return std::nullopt;
}

// The size right after the first occurrence of `phrase` that has one.
std::optional<int64_t> SizeAfterPhrase(std::string_view m, std::string_view phrase) {
  for (size_t at = m.find(phrase); at != std::string_view::npos; at = m.find(phrase, at + 1)) {
    if (auto v = ParseSizeAt(m, at + phrase.size())) return v;
  }
  return std::nullopt;
}

// A plain integer (TF's BFC stats print bytes without a unit).
std::optional<int64_t> IntegerAfter(std::string_view m, std::string_view phrase) {
  size_t at = m.find(phrase);
  if (at == std::string_view::npos) return std::nullopt;
  size_t pos = at + phrase.size();
  while (pos < m.size() && IsSpace(m[pos])) ++pos;
  size_t start = pos;
  while (pos < m.size() && IsDigit(m[pos])) ++pos;
  if (pos == start) return std::nullopt;
  return ToBytes(std::strtod(std::string(m.substr(start, pos - start)).c_str(), nullptr));
}

// "Tried to allocate 20.00 MiB", "you tried to allocate 123 bytes", "Failed to
// allocate 1.00GiB", "Out of memory allocating 2002 bytes", "trying to allocate
// more than 1EB": the size right after "allocat(e|ing)".
std::optional<int64_t> ParseAllocateSize(std::string_view m, bool* lower_bound) {
  static constexpr std::string_view kKey = "allocat";
  for (size_t at = m.find(kKey); at != std::string_view::npos; at = m.find(kKey, at + 1)) {
    size_t pos = at + kKey.size();
    while (pos < m.size() && IsAlpha(m[pos])) ++pos;
    while (pos < m.size() && IsSpace(m[pos])) ++pos;
    bool more = m.substr(pos, 9) == "more than";
    if (more) pos += 9;
    if (auto bytes = ParseSizeAt(m, pos)) {
      if (lower_bound != nullptr) *lower_bound = more;
      return bytes;
    }
  }
  return std::nullopt;
}

// PyTorch's MapAllocator: "unable to mmap 33484977464 bytes from file <...>": the
// size of the mapping it asked for.
std::optional<int64_t> MmapSize(std::string_view m) { return SizeAfterPhrase(m, "unable to mmap "); }

// Ollama refusing to load a model the host cannot hold: "model requires more system memory
// (19.3 GiB) than is available (14.8 GiB)" (continuedev/continue#9668 quotes it from Ollama's
// HTTP 500). The first size is what the model needs, the second what the host had free.
std::optional<int64_t> OllamaSystemNeed(std::string_view m) {
  return SizeAfterPhrase(m, "requires more system memory (");
}
std::optional<int64_t> OllamaSystemFree(std::string_view m) {
  if (!OllamaSystemNeed(m)) return std::nullopt;
  return SizeAfterPhrase(m, "than is available (");
}

// DyNet's allocator: "CPU memory allocation failed n=2097152000 align=32" (clab/dynet#983), and
// "GPU memory allocation failed n=..." on the device: n is the request in bytes. Where it failed
// ("cpu" or "gpu"), or nothing when the message is not DyNet's.
std::optional<std::string_view> DynetAllocFailed(std::string_view m) {
  if (Has(m, "cpu memory allocation failed n=")) return std::string_view("cpu");
  if (Has(m, "gpu memory allocation failed n=")) return std::string_view("gpu");
  return std::nullopt;
}

// Apple's Metal out of device memory. MLX: "[METAL] Command buffer execution failed:
// Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)" (jjang-ai/vmlx#58
// quotes it without the code); llama.cpp prints the code alone ("error: Insufficient Memory
// (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"); older macOS names it "Insufficient
// Memory (IOAF code 8)". And MLX's allocator refusing one buffer larger than Metal allows:
// "[metal::malloc] Attempting to allocate 86587211776 bytes which is greater than the maximum
// allowed buffer size of 86586540032 bytes." (ml-explore/mlx#3082). Other command buffer
// failures ("Caused GPU Timeout Error"), and MLX's "[metal::malloc] Resource limit (499000)
// exceeded" (a count of buffers, not bytes), are not OOMs.
bool MetalOom(std::string_view m) {
  // MLX's allocator when Metal cannot give it a buffer: "[malloc_or_wait] Unable to allocate 12
  // bytes." (ml-explore/mlx-examples#70).
  return Has(m, "command buffer execution failed: insufficient memory") ||
         Has(m, "[malloc_or_wait] unable to allocate") ||
         Has(m, "kiogpucommandbuffercallbackerroroutofmemory") || Has(m, "insufficient memory (ioaf code 8)") ||
         (Has(m, "attempting to allocate") && Has(m, "greater than the maximum allowed buffer size"));
}

// ggml's allocator (llama.cpp, whisper.cpp) refusing a backend buffer: "ggml_gallocr_reserve_n:
// failed to allocate ROCm0 buffer of size 18035509504" (ggml-org/llama.cpp#9352), "failed to
// allocate CUDA0 buffer of size N", and the CPU backend's own "ggml_backend_cpu_buffer_type_alloc_buffer:
// failed to allocate buffer of size N". The buffer type's name, lower case ("rocm0", "cuda0",
// "metal", "cuda_host", "cpu"), or nothing when the message is not one of these. The success
// lines ("CUDA0 compute buffer size = 164.01 MiB") never say "failed to allocate".
std::optional<std::string_view> GgmlBufferType(std::string_view m) {
  static constexpr std::string_view kFailed = "failed to allocate ";
  static constexpr std::string_view kSize = "buffer of size ";
  for (size_t at = m.find(kFailed); at != std::string_view::npos; at = m.find(kFailed, at + 1)) {
    std::string_view rest = m.substr(at + kFailed.size());
    if (rest.starts_with(kSize)) {
      if (Has(m, "ggml_backend_cpu_buffer_type_alloc_buffer") && rest.size() > kSize.size() &&
          IsDigit(rest[kSize.size()]))
        return std::string_view("cpu");
      continue;
    }
    const size_t space = rest.find(' ');
    if (space == std::string_view::npos || space == 0 || space > 24) continue;
    std::string_view after = rest.substr(space + 1);
    if (after.starts_with(kSize) && after.size() > kSize.size() && IsDigit(after[kSize.size()]))
      return rest.substr(0, space);
  }
  return std::nullopt;
}

// A ggml buffer type in host memory: the CPU's ("cpu", "cpu_mapped") and the pinned host memory
// a GPU backend allocates ("cuda_host"). Every other type is a device's.
bool GgmlHostBuffer(std::string_view type) { return type.starts_with("cpu") || type.ends_with("_host"); }

// The bytes ggml asked for: "buffer of size 18035509504" (a plain byte count).
std::optional<int64_t> GgmlBufferSize(std::string_view m) {
  if (!GgmlBufferType(m)) return std::nullopt;
  return IntegerAfter(m.substr(m.find("failed to allocate ")), "buffer of size ");
}

int64_t DtypeBytes(std::string_view dtype) {
  struct Dtype {
    std::string_view name;
    int64_t bytes;
  };
  static constexpr Dtype kDtypes[] = {
      {"float", 4},    {"float32", 4}, {"double", 8}, {"float64", 8}, {"half", 2},      {"float16", 2},
      {"bfloat16", 2}, {"int64", 8},   {"uint64", 8}, {"int32", 4},   {"uint32", 4},    {"int16", 2},
      {"uint16", 2},   {"int8", 1},    {"uint8", 1},  {"bool", 1},    {"complex64", 8}, {"complex128", 16},
  };
  for (const Dtype& d : kDtypes) {
    if (dtype == d.name) return d.bytes;
  }
  return 0;
}

// TensorFlow: "OOM when allocating tensor with shape[32,1024] and type float".
// Without a known dtype the element count alone is not a size.
std::optional<int64_t> ParseTensorFlowShape(std::string_view m) {
  size_t at = m.find("shape[");
  if (at == std::string_view::npos) at = m.find("shape [");
  if (at == std::string_view::npos) return std::nullopt;
  size_t pos = m.find('[', at) + 1;
  const size_t close = m.find(']', pos);
  if (close == std::string_view::npos) return std::nullopt;
  double elements = 1;
  while (pos < close) {
    while (pos < close && (IsSpace(m[pos]) || m[pos] == ',')) ++pos;
    size_t start = pos;
    while (pos < close && IsDigit(m[pos])) ++pos;
    if (pos == start) {
      if (pos < close) return std::nullopt;  // "?" or a symbolic dimension
      break;
    }
    elements *= std::strtod(std::string(m.substr(start, pos - start)).c_str(), nullptr);
  }
  static constexpr std::string_view kType = "type ";
  size_t type_at = m.find(kType, close);
  if (type_at == std::string_view::npos) return std::nullopt;
  size_t tpos = type_at + kType.size();
  size_t tend = tpos;
  while (tend < m.size() && (IsAlpha(m[tend]) || IsDigit(m[tend]))) ++tend;
  const int64_t dtype_bytes = DtypeBytes(m.substr(tpos, tend - tpos));
  if (dtype_bytes == 0) return std::nullopt;
  return ToBytes(elements * static_cast<double>(dtype_bytes));
}

// "GPU 2;", "NPU 3 has", "device:GPU:0": the device type and index printed.
void ParseDevice(std::string_view m, OomFigures* f) {
  static constexpr std::string_view kTypes[] = {"gpu", "npu", "xpu", "hip", "mps", "tpu", "cpu"};
  if (size_t at = m.find("device:"); at != std::string_view::npos) {
    size_t pos = at + 7;
    for (std::string_view t : kTypes) {
      if (m.substr(pos, t.size()) == t) {
        f->device = t == "gpu" ? "cuda" : std::string(t);
        pos += t.size();
        if (pos < m.size() && m[pos] == ':') ++pos;
        if (pos < m.size() && IsDigit(m[pos])) f->device_index = m[pos] - '0';
        return;
      }
    }
  }
  for (std::string_view t : {std::string_view("gpu "), std::string_view("npu "), std::string_view("xpu ")}) {
    for (size_t at = m.find(t); at != std::string_view::npos; at = m.find(t, at + 1)) {
      size_t pos = at + t.size();
      if (pos < m.size() && IsDigit(m[pos]) && (at == 0 || !IsAlpha(m[at - 1]))) {
        f->device_index = static_cast<int>(std::strtol(std::string(m.substr(pos, 4)).c_str(), nullptr, 10));
        if (f->device.empty()) f->device = t == "gpu " ? "cuda" : std::string(t.substr(0, 3));
        return;
      }
    }
  }
}

void ParsePyTorch(std::string_view m, OomFigures* f) {
  // >= 2.1: "GPU 0 has a total capacity of X of which Y is free." Some
  // releases print "capacty".
  for (std::string_view cap : {std::string_view("total capacity of "), std::string_view("total capacty of ")}) {
    if (auto v = SizeAfterPhrase(m, cap)) {
      f->capacity = v;
      f->format = "pytorch";
      if (size_t at = m.find("of which", m.find(cap)); at != std::string_view::npos)
        f->free = ParseSizeAt(m, at + 8);
    }
  }
  if (f->format == "pytorch") {
    f->process_in_use = SizeAfterPhrase(m, "this process has ");
    for (size_t at = m.find("process "); at != std::string_view::npos; at = m.find("process ", at + 1)) {
      size_t pos = at + 8;
      size_t start = pos;
      while (pos < m.size() && IsDigit(m[pos])) ++pos;
      if (pos == start || m.substr(pos, 5) != " has ") continue;
      if (auto bytes = ParseSizeAt(m, pos + 5)) {
        f->other_processes.push_back(
            {std::strtoll(std::string(m.substr(start, pos - start)).c_str(), nullptr, 10), *bytes});
      }
    }
    f->allocated = SizeAfterPhrase(m, "of the allocated memory ");
    if (auto unalloc = SizeBeforePhrase(m, "is reserved by pytorch but unallocated"); unalloc && f->allocated)
      f->reserved = *f->allocated + *unalloc;
    return;
  }
  // 1.4 - 2.0 (and torch_npu today): "(GPU 0; 15.78 GiB total capacity; 8.10
  // GiB already allocated; 1.05 GiB free; 8.20 GiB reserved in total by PyTorch)".
  auto total = SizeBeforePhrase(m, "total capacity");
  if (!total) total = SizeBeforePhrase(m, "total capacty");
  if (!total) return;
  f->capacity = total;
  f->allocated = SizeBeforePhrase(m, "already allocated");
  f->free = SizeBeforePhrase(m, " free");
  f->reserved = SizeBeforePhrase(m, "reserved in total");
  f->format = "pytorch-1.x";
  if (!f->reserved) {
    // <= 1.3 printed "X cached": the allocator's cached *free* blocks
    // (cached minus allocated), so reserved is their sum.
    if (auto cached = SizeBeforePhrase(m, " cached"); cached && f->allocated) {
      f->reserved = *f->allocated + *cached;
      f->format = "pytorch-cached";
    }
  }
}

void ParseOthers(std::string_view m, OomFigures* f) {
  if (Has(m, "oom when allocating") || Has(m, "bfc_allocator") || Has(m, "_bfc")) {
    if (f->format.empty()) f->format = Has(m, "oom when allocating") ? "tensorflow" : "tensorflow-bfc";
    // BFC allocator stats: "Limit: 10625279591 InUse: 7350513920" (bytes).
    if (auto limit = IntegerAfter(m, "limit:")) f->capacity = limit;
    if (auto in_use = IntegerAfter(m, "inuse:")) f->allocated = in_use;
  }
  if (Has(m, "bufferassignment") || Has(m, "resource_exhausted") || Has(m, "xlaruntimeerror")) {
    if (f->format.empty()) f->format = "xla";
    if (auto total = SizeAfterPhrase(m, "total allocation:")) f->program_total = total;
  }
  // NCCL's own lines, not a sentence that names NCCL ("does an NCCL timeout
  // lead to 'CUDA out of memory'?").
  if (Has(m, "nccl warn") || Has(m, "nccl error") || Has(m, "nccl info") || Has(m, "ncclunhandled") ||
      Has(m, "cuda calloc") || Has(m, "cuda malloc")) {
    if (f->format.empty()) f->format = "nccl";
    if (f->device.empty()) f->device = "cuda";
    if (!f->requested) {
      if (auto v = SizeAfterPhrase(m, "cuda calloc ")) f->requested = v;
      else if (auto w = SizeAfterPhrase(m, "cuda malloc ")) f->requested = w;
    }
  }
  // PyTorch's file mapping: "unable to mmap 33484977464 bytes from file <...>": the
  // mapping it asked for is the failing request (host memory).
  if (auto mapped = MmapSize(m)) {
    if (f->format.empty()) f->format = "pytorch-mmap";
    f->device = "cpu";
    if (!f->requested) f->requested = mapped;
  }
  if (auto where = DynetAllocFailed(m)) {
    if (f->format.empty()) f->format = "dynet";
    if (f->device.empty()) f->device = *where;
    if (!f->requested) f->requested = IntegerAfter(m, "allocation failed n=");
  }
  if (auto need = OllamaSystemNeed(m)) {
    if (f->format.empty()) f->format = "ollama";
    f->device = "cpu";
    if (!f->requested) f->requested = need;
    if (!f->free) f->free = OllamaSystemFree(m);
  }
  // MLX on Metal: a command buffer refused for memory, or a buffer larger than Metal allows
  // ("[metal::malloc] Attempting to allocate N bytes which is greater than the maximum allowed
  // buffer size of M bytes": N, read as "allocate N", is the request; M is a limit on one
  // buffer, not the device's capacity, so it is no figure here).
  if (MetalOom(m)) {
    if (f->format.empty()) f->format = "mlx-metal";
    if (f->device.empty()) f->device = "metal";
  }
  // ggml (llama.cpp): "failed to allocate ROCm0 buffer of size 18035509504": the buffer's bytes are
  // the request; the buffer type names the device ("rocm0": hip, device 0).
  if (auto type = GgmlBufferType(m)) {
    if (f->format.empty()) f->format = "ggml";
    if (!f->requested) f->requested = GgmlBufferSize(m);
    std::string_view t = *type;
    if (f->device.empty()) {
      f->device = GgmlHostBuffer(t)                                   ? "cpu"
                  : t.starts_with("cuda")                             ? "cuda"
                  : t.starts_with("rocm") || t.starts_with("hip")     ? "hip"
                  : t.starts_with("metal")                            ? "metal"
                                                                      : "gpu";
    }
    if (f->device_index < 0 && !t.empty() && IsDigit(t.back()) && !GgmlHostBuffer(t)) {
      size_t b = t.size();
      while (b > 0 && IsDigit(t[b - 1])) --b;
      f->device_index = static_cast<int>(std::strtol(std::string(t.substr(b)).c_str(), nullptr, 10));
    }
  }
  if (Has(m, "defaultcpuallocator") || Has(m, "alloc_cpu")) {
    if (f->format.empty()) f->format = "cpu-allocator";
    f->device = "cpu";
  }
  // TensorFlow's stream executor: "failed to allocate 190.31M (199557120
  // bytes) from device: CUDA_ERROR_OUT_OF_MEMORY" (the exact bytes in brackets).
  if (Has(m, "from device: cuda_error_out_of_memory") || Has(m, "from device: cuda error out of memory")) {
    if (f->format.empty()) f->format = "tensorflow-stream";
    if (f->device.empty()) f->device = "cuda";
    // The bracketed byte count is exact; the rounded "190.31M" before it is not.
    if (size_t at = m.find(" bytes) from device"); at != std::string_view::npos) {
      size_t b = at;
      while (b > 0 && IsDigit(m[b - 1])) --b;
      if (b < at && b > 0 && m[b - 1] == '(') f->requested = IntegerAfter(m.substr(b - 1), "(");
    }
  }
  if (Has(m, "mps backend out of memory")) {
    f->format = "mps";
    f->device = "mps";
    f->allocated = SizeAfterPhrase(m, "mps allocated:");
    f->capacity = SizeAfterPhrase(m, "max allowed:");
    if (auto other = SizeAfterPhrase(m, "other allocations:"); other && f->allocated) {
      f->process_in_use = *f->allocated + *other;
      // The MPS allocator's pool is what it allocated; what remains of the
      // allowed size is free to it.
      f->reserved = f->allocated;
      if (f->capacity) f->free = std::max<int64_t>(0, *f->capacity - *f->process_in_use);
    }
  }
  // Linux OOM killer: "Killed process 25315 (python3) total-vm:53312244kB,
  // anon-rss:31451456kB". The kernel's kB are KiB.
  if (size_t at = m.find("anon-rss:"); at != std::string_view::npos && Has(m, "killed process")) {
    f->format = "oom-killer";
    f->device = "cpu";
    size_t pos = at + 9;
    std::string digits;
    while (pos < m.size() && (IsDigit(m[pos]) || m[pos] == ',')) {
      if (m[pos] != ',') digits.push_back(m[pos]);
      ++pos;
    }
    if (!digits.empty()) f->host_rss = ToBytes(std::strtod(digits.c_str(), nullptr) * 1024.0);
  }
}

}  // namespace

std::string LowerAscii(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Units: b, byte(s), kib/mib/gib/tib/pib/eib (binary) and kb/mb/gb/tb/pb/eb
// (decimal, as SI defines them), and the bare k/m/g/t that XLA prints
// ("1.20G"), taken as binary. A number with no unit is not a size (it could be
// a count or an index).
std::optional<int64_t> ParseSizeAt(std::string_view s, size_t pos) {
  while (pos < s.size() && IsSpace(s[pos])) ++pos;
  size_t start = pos;
  while (pos < s.size() && (IsDigit(s[pos]) || s[pos] == '.' || s[pos] == ',')) ++pos;
  if (pos == start || !IsDigit(s[start])) return std::nullopt;
  std::string number;
  for (size_t i = start; i < pos; ++i) {
    if (s[i] != ',') number.push_back(s[i]);  // "1,073,741,824 bytes"
  }
  const double value = std::strtod(number.c_str(), nullptr);
  while (pos < s.size() && IsSpace(s[pos])) ++pos;
  size_t unit_start = pos;
  while (pos < s.size() && IsAlpha(s[pos])) ++pos;
  const double scale = UnitScale(LowerAscii(s.substr(unit_start, pos - unit_start)));
  if (scale == 0) return std::nullopt;
  return ToBytes(value * scale);
}

int64_t OomFigures::other_processes_total() const {
  int64_t sum = 0;
  for (const ProcessMemory& p : other_processes) sum += p.bytes;
  return sum;
}

OomFigures ParseOomFigures(std::string_view message) {
  OomFigures f;
  const std::string m = Normalize(message.substr(0, 64 * 1024));
  bool lower_bound = false;
  if (auto bytes = ParseAllocateSize(m, &lower_bound)) {
    f.requested = bytes;
    f.requested_is_lower_bound = lower_bound;
  } else if (auto tensor = ParseTensorFlowShape(m)) {
    f.requested = tensor;
  }
  for (std::string_view d : {"cuda", "npu", "xpu", "hip", "mps"}) {
    if (Has(m, std::string(d) + " out of memory") || Has(m, std::string(d) + " error: out of memory")) {
      f.device = d;
      break;
    }
  }
  ParseDevice(m, &f);
  ParsePyTorch(m, &f);
  ParseOthers(m, &f);
  // PyTorch's "Tried to allocate X" without the capacity clause ("more than
  // 1EB", messages cut short) is still PyTorch's.
  if (f.format.empty() && f.requested && Has(m, "tried to allocate")) f.format = "pytorch-request";
  return f;
}

}  // namespace internal

namespace {

// PyTorch's file mapping (MapAllocator, used by torch.load(mmap=True) and
// safetensors loads): "unable to mmap 33484977464 bytes from file
// <model.safetensors>: Cannot allocate memory (12)". With its reason cut off,
// as reports quote it ("RuntimeError: unable to mmap 33484977464 bytes",
// turboderp/exllama#245), the mapping that failed is host memory; a mapping
// that failed for another reason ("Invalid argument (22)") is no OOM.
bool MmapFailed(std::string_view m) {
  using internal::Has;
  if (!Has(m, "unable to mmap")) return false;
  if (Has(m, "cannot allocate memory")) return true;
  return !Has(m, "from file");
}

}  // namespace

OomInfo ClassifyMessage(std::string_view message) {
  using internal::Has;
  OomInfo info;
  info.message = std::string(message);
  const std::string m = internal::Normalize(message.substr(0, 64 * 1024));

  OomKind kind = OomKind::kNone;
  const bool out_of_memory = Has(m, "out of memory") || Has(m, "out-of-memory");
  const bool alloc_failed = out_of_memory || Has(m, "alloc_failed") || Has(m, "failed to allocate") ||
                            Has(m, "allocation failed") || Has(m, "could not allocate") ||
                            Has(m, "cannot allocate") || Has(m, "can't allocate") ||
                            Has(m, "unable to allocate") || Has(m, "not enough memory");
  const bool device_words = Has(m, "cuda") || Has(m, "gpu") || Has(m, "device") || Has(m, "hip") ||
                            Has(m, "xpu") || Has(m, "mps") || Has(m, "npu") || Has(m, "mlu") ||
                            Has(m, "hpu") || Has(m, "ascend") || Has(m, "vram");
  // Host-side kills: the kernel's OOM killer, cgroups (Slurm, Kubernetes),
  // and the DataLoader's report of a worker killed by one.
  // Launchers report a child killed by SIGKILL as a return code of -9
  // (DeepSpeed's "exits with return code = -9", torchrun's "exitcode: -9").
  const bool minus_nine = Has(m, "return code = -9") || Has(m, "return code -9") || Has(m, "returncode=-9") ||
                          Has(m, "exitcode: -9") || Has(m, "exit code -9") || Has(m, "exit code: -9") ||
                          Has(m, "signal 9 (sigkill)") || Has(m, "错误码-9") || Has(m, "错误码 -9");
  const bool host_kill = minus_nine || Has(m, "oom-kill") || Has(m, "oom_kill") || Has(m, "oomkilled") ||
                         Has(m, "killed by signal: killed") || Has(m, "invoked oom-killer") ||
                         Has(m, "exit code 137") || Has(m, "exit code: 137") || Has(m, "exitcode: 137") ||
                         // Docker Compose's line for a container the kernel killed:
                         // "server-1 exited with code 137" (128 + SIGKILL).
                         Has(m, "exited with code 137") ||
                         Has(m, "sigkill") ||
                         // Shared memory (/dev/shm) exhausted: a bus error, or no space left on it.
                         ((Has(m, "bus error") || Has(m, "no space left on device")) &&
                          (Has(m, "shared memory") || Has(m, "/dev/shm")));

  if (Has(m, "cublas_status_alloc_failed") || Has(m, "cudnn_status_alloc_failed") ||
      Has(m, "failed to create cublas handle") || Has(m, "create cublas handle failed") ||
      Has(m, "cudnn_status_internal_error_device_allocation_failed") ||
      // cuDNN answers NOT_SUPPORTED when no algorithm's workspace fits, and
      // cuBLAS fails to initialise when its handle's workspace does not.
      Has(m, "cudnn_status_not_supported") || Has(m, "cublas_status_not_initialized") ||
      // TensorFlow, when the memory it reserved up front leaves cuDNN none for its handle.
      Has(m, "could not create cudnn handle") ||
      (Has(m, "workspace") && alloc_failed)) {
    kind = OomKind::kWorkspace;
  } else if (host_kill || Has(m, "out of memory: killed process")) {
    kind = OomKind::kHost;
  } else if (Has(m, "oom when allocating") || Has(m, "ran out of memory trying to allocate") ||
             Has(m, "resourceexhaustederror") ||
             ((Has(m, "resource_exhausted") || Has(m, "resource exhausted")) &&
              (out_of_memory || Has(m, "oom") ||
               // XLA on TPU: "Resource exhausted: Attempting to allocate 180.59M. That was not possible."
               Has(m, "attempting to allocate") || Has(m, "attempting to reserve")))) {
    // TensorFlow/XLA/JAX. TF names the allocator; a CPU one is host memory.
    kind = (Has(m, "device:cpu") || Has(m, "allocator cpu")) ? OomKind::kHost : OomKind::kDevice;
  } else if (Has(m, "cudaerrormemoryallocation") || Has(m, "cuda_error_out_of_memory") ||
             Has(m, "outofmemoryerror") || Has(m, "cuda calloc") ||
             Has(m, "cuda malloc")) {
    kind = (Has(m, "defaultcpuallocator")) ? OomKind::kHost : OomKind::kDevice;
  } else if ((Has(m, "defaultcpuallocator") && alloc_failed) || Has(m, "std::bad_alloc") ||
             Has(m, "cannot allocate memory") || Has(m, "can't allocate memory") || Has(m, "memoryerror") ||
             Has(m, "bad_alloc") || Has(m, "bad allocation") ||
             // PyTorch 0.4's CPU allocator (THGeneral.c): "not enough memory: you tried to
             // allocate 160465GB. Buy new RAM!"
             Has(m, "not enough memory: you tried to allocate") || MmapFailed(m) ||
             internal::OllamaSystemNeed(m) || internal::DynetAllocFailed(m) == "cpu" ||
             // Windows out of commit (RAM + page file): "OSError: [WinError 1455] The paging file is
             // too small for this operation to complete", in Chinese "页面文件太小".
             Has(m, "winerror 1455") || Has(m, "paging file is too small") || Has(m, "页面文件太小")) {
    kind = OomKind::kHost;
  } else if (Has(m, "less than desired gpu memory utilization") ||
             Has(m, "no available memory for the cache blocks") ||
             // vLLM: "The model's max seq len (32768) is larger than the maximum
             // number of tokens that can be stored in KV cache (7344)."
             Has(m, "can be stored in kv cache") ||
             // PaddlePaddle 1.x: "Insufficient GPU memory to allocation."
             Has(m, "insufficient gpu memory") ||
             // Hugging Face TGI at startup: "Not enough memory to handle 16000 total tokens with 2
             // prefill tokens. You need to decrease `--max-batch-total-tokens`": its KV cache does
             // not fit on the card. DyNet's own device allocator.
             Has(m, "not enough memory to handle") || internal::DynetAllocFailed(m) == "gpu" ||
             // Apple's Metal (MLX, llama.cpp): the GPU's share of unified memory.
             internal::MetalOom(m)) {
    // vLLM at startup: the card's free memory does not cover the share it
    // was told to take, or nothing is left for the KV cache; Paddle's
    // allocator refusing a chunk larger than the card has free; Metal refusing a command
    // buffer for memory, or MLX a buffer over Metal's largest.
    kind = OomKind::kDevice;
  } else if (auto ggml = internal::GgmlBufferType(m)) {
    // ggml (llama.cpp) refusing a backend buffer: "failed to allocate ROCm0 buffer of size
    // 18035509504" is the card's memory, a CPU (or pinned "CUDA_Host") buffer the host's.
    kind = internal::GgmlHostBuffer(*ggml) ? OomKind::kHost : OomKind::kDevice;
  } else if (Has(m, "llama runner exited, you may not have enough")) {
    // Ollama, when the model's runner dies loading (ollama/ollama#1727): "Error: llama runner
    // exited, you may not have enough available memory to run this model". Ollama puts the model
    // on the GPU first, so it is the card's memory that did not fit.
    kind = OomKind::kDevice;
  } else if (out_of_memory) {
    kind = device_words ? OomKind::kDevice : OomKind::kHost;
  }
  if (kind == OomKind::kNone) return info;

  info.kind = kind;
  info.matched_by = "message";
  if (auto bytes = internal::ParseAllocateSize(m, nullptr)) {
    info.requested_bytes = *bytes;
  } else if (auto tensor = internal::ParseTensorFlowShape(m)) {
    info.requested_bytes = *tensor;
  } else if (auto mapped = internal::MmapSize(m)) {
    info.requested_bytes = *mapped;
  } else if (auto buffer = internal::GgmlBufferSize(m)) {
    info.requested_bytes = *buffer;
  } else if (auto need = internal::OllamaSystemNeed(m)) {
    info.requested_bytes = *need;
  } else if (internal::DynetAllocFailed(m)) {
    if (auto n = internal::IntegerAfter(m, "allocation failed n=")) info.requested_bytes = *n;
  }
  return info;
}

}  // namespace oomguard
