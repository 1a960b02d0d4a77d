#include "sdk/checkpoint/compression.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <future>
#include <nlohmann/json.hpp>

#include "sdk/checkpoint/codec.h"

namespace oomguard::ckpt {

std::string ShardCompressionName(std::optional<int> zstd_level) {
  return zstd_level ? "zstd-" + std::to_string(*zstd_level) : "none";
}

namespace {
std::optional<int> ParseLevel(std::string_view name) {
  if (name.substr(0, 5) != "zstd-") return std::nullopt;
  const std::string_view digits = name.substr(5);
  int level = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), level);
  if (ec != std::errc() || end != digits.data() + digits.size() || !IsZstdLevel(level)) return std::nullopt;
  return level;
}
}  // namespace

std::optional<int> ZstdLevelOf(std::string_view name) { return ParseLevel(name); }

bool IsCompressionName(std::string_view name) { return name == "none" || ParseLevel(name).has_value(); }

CompressionSample SampleCompression(const std::vector<SampleSource>& state, int level, int64_t window,
                                    ThreadPool* pool) {
  CompressionSample out;
  int64_t total = 0;
  for (const SampleSource& t : state) total += static_cast<int64_t>(t.bytes.size());
  if (total <= 0 || window <= 0) return out;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(2 * pool->size(), total / window));
  struct Window {
    const SampleSource* t;
    size_t begin, len;
  };
  std::vector<Window> windows;
  size_t t = 0;
  int64_t t_start = 0;  // offset of state[t] in the whole state
  for (int64_t k = 0; k < n; ++k) {
    const int64_t at = (2 * k + 1) * total / (2 * n);  // the middle of the k-th n-th
    while (t_start + static_cast<int64_t>(state[t].bytes.size()) <= at) t_start += state[t++].bytes.size();
    // The window centred on `at`, moved inside its tensor.
    const SampleSource& s = state[t];
    const size_t size = s.bytes.size();
    const size_t len = std::min(static_cast<size_t>(window), size);
    size_t begin = static_cast<size_t>(at - t_start);
    begin = begin > len / 2 ? begin - len / 2 : 0;
    begin = std::min(begin, size - len);
    begin -= begin % s.elem_size;
    windows.push_back({&s, begin, len});
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<size_t>> done;
  for (const Window& w : windows)
    done.push_back(pool->Submit([w, level] {
      thread_local std::vector<uint8_t> scratch, frame;
      frame.resize(EncodeBound(w.len));
      return EncodeChunkInto(w.t->bytes.data() + w.begin, w.len, w.t->elem_size, level, w.t->floating_point,
                             &scratch, frame.data(), frame.size());
    }));
  int64_t raw = 0, stored = 0;
  for (size_t i = 0; i < done.size(); ++i) {
    const size_t frame = done[i].get();
    raw += static_cast<int64_t>(windows[i].len);
    stored += static_cast<int64_t>(frame == 0 ? windows[i].len : frame);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.sampled_bytes = raw;
  out.ratio = raw > 0 ? static_cast<double>(stored) / static_cast<double>(raw) : 1;
  out.bytes_per_s = seconds > 0 ? static_cast<double>(raw) / seconds : 0;
  return out;
}

namespace {
double Rounded(double v, double unit) { return std::round(v / unit) * unit; }
}  // namespace

void AutoCalibration::Observe(double seconds, double sampled_compress_seconds) {
  if (!(seconds > 0) || !(sampled_compress_seconds > 0)) return;
  // Clamped: one save stalled by something else must not silence compression.
  const double k = std::clamp(seconds / sampled_compress_seconds, 0.5, 8.0);
  compress_slowdown = compress_slowdown ? 0.5 * *compress_slowdown + 0.5 * k : k;
}

AutoCompression ChooseCompression(int64_t state_bytes, int level, std::optional<double> write_bytes_per_s,
                                  std::optional<CompressionSample> sample, const AutoCalibration& calibration) {
  AutoCompression c;
  nlohmann::ordered_json why;
  if (state_bytes < kAutoMinBytes) {
    c.compress = true;
    why["basis"] = "small state";
  } else if (!write_bytes_per_s || *write_bytes_per_s <= 0) {
    why["basis"] = "first save: write throughput not measured yet";
  } else if (!sample || sample->bytes_per_s <= 0) {
    why["basis"] = "no sample of the state";
    why["write_MBps"] = Rounded(*write_bytes_per_s / 1e6, 0.1);
  } else {
    const double b = static_cast<double>(state_bytes), w = *write_bytes_per_s;
    const double k = calibration.compress_slowdown.value_or(1);
    const double none_s = b / w;
    const double compress_s = b / sample->bytes_per_s;
    const double zstd_s = std::max(compress_s * k, sample->ratio * b / w);
    c.compress = zstd_s < (1 - kAutoMinGain) * none_s;
    if (c.compress) c.sampled_compress_seconds = compress_s;
    why["basis"] = "measured";
    why["compress_MBps"] = Rounded(sample->bytes_per_s / 1e6, 0.1);
    why["ratio"] = Rounded(sample->ratio, 0.001);
    why["sampled_bytes"] = sample->sampled_bytes;
    why["write_MBps"] = Rounded(w / 1e6, 0.1);
    why["compress_slowdown"] = Rounded(k, 0.01);
    why["predicted_ms"] = {{"none", Rounded(none_s * 1e3, 0.1)}, {"zstd", Rounded(zstd_s * 1e3, 0.1)}};
  }
  why["level"] = level;
  why["chose"] = ShardCompressionName(c.compress ? std::optional<int>(level) : std::nullopt);
  c.why = why.dump();
  return c;
}

}  // namespace oomguard::ckpt
