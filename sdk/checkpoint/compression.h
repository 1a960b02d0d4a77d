// How a shard is compressed: the names recorded in shards and manifests, and
// the choice compression = auto makes (include/oomguard/checkpoint.h).
//
// Auto weighs two measured throughputs. Compressing pays when the pool
// compresses faster than the disk writes: a compressed save takes about
// max(B / C, r * B / W) (compression and writing overlap), an uncompressed
// one B / W, for B bytes, C the pool's shuffle + zstd throughput measured on
// a sample of this save's state, r its ratio and W the write + fsync
// throughput the previous large save measured. A wrong guess corrects
// itself: a compressed save that was compression-bound keeps the disk idle,
// measures a high W and the next save writes uncompressed; an uncompressed
// save on a slow disk measures a low W and the next one compresses.
//
// The overlap is rarely perfect: on two cores whose writes cost CPU (a VM's
// disk), the writer, the hashing and the kernel's I/O take cores from the
// compression, and compressed saves predicted at 622 ms took 1033. So the
// compression term is scaled by how much slower compression ran inside
// earlier compressed saves than in its sample (AutoCalibration): a
// compressed save takes about max(B / C * k, r * B / W). On a slow disk the
// write term still dominates and compressing still pays.
//
// Thread-safety: pure functions; SampleCompression uses the pool it is given.
#ifndef OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_
#define OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sdk/checkpoint/thread_pool.h"

namespace oomguard::ckpt {

// zstd levels a checkpoint may use: [-7, -1] (fast) and [1, 22]; 0 would
// silently mean zstd's default level 3.
inline bool IsZstdLevel(int level) { return (level >= -7 && level <= -1) || (level >= 1 && level <= 22); }

// "none", or "zstd-<level>".
std::string ShardCompressionName(std::optional<int> zstd_level);
// The level of a "zstd-<level>" name; nullopt for "none". REQUIRES:
// IsCompressionName(name).
std::optional<int> ZstdLevelOf(std::string_view name);
// Whether `name` is "none" or "zstd-<level>" with a level IsZstdLevel accepts.
bool IsCompressionName(std::string_view name);

// Below this many bytes a save's time is fsync latency and fixed costs, not
// throughput: auto compresses (cheap at this size) and measures nothing.
inline constexpr int64_t kAutoMinBytes = int64_t{32} << 20;
// Compress only when the model predicts a save at least this much shorter:
// the measurements are noisy and compressing costs CPU the job may want.
inline constexpr double kAutoMinGain = 0.10;

// Shuffle + zstd measured on a sample of a state.
struct CompressionSample {
  double bytes_per_s = 0;  // raw bytes per second, all pool threads together
  double ratio = 1;        // stored bytes / raw bytes
  int64_t sampled_bytes = 0;
};

// One tensor of a state, as the sampler sees it.
struct SampleSource {
  std::span<const uint8_t> bytes;
  size_t elem_size = 1;
  bool floating_point = false;
};

// Encodes windows of `window` bytes spread evenly over the bytes of `state`
// (two per pool thread, at most the whole state) on `pool`, at zstd `level`,
// and times them together. REQUIRES: nobody writes `state` meanwhile.
CompressionSample SampleCompression(const std::vector<SampleSource>& state, int level, int64_t window,
                                    ThreadPool* pool);

struct AutoCompression {
  bool compress = false;
  std::string why;  // a JSON object: the basis and the figures it used
  // For a compressed save chosen from measurements: B / C, the time its
  // compression alone would take at the sampled speed; else 0.
  double sampled_compress_seconds = 0;
};

// How much longer compressed saves took than their compression alone at the
// sampled speed (k above), averaged over recent ones; nullopt: none
// measured yet (k = 1).
struct AutoCalibration {
  std::optional<double> compress_slowdown;
  // Folds in one compressed save of `seconds` whose compression alone was
  // predicted at `sampled_compress_seconds` (ignored unless both are
  // positive). A save bound by the disk overstates k, which only matters
  // once the disk is fast, where writing uncompressed is the better guess.
  void Observe(double seconds, double sampled_compress_seconds);
};

// The choice for a save of `state_bytes` at `level`, from the write
// throughput of earlier saves (nullopt: none measured yet), a sample of
// this state (nullopt: none could be taken) and the calibration of earlier
// saves.
AutoCompression ChooseCompression(int64_t state_bytes, int level, std::optional<double> write_bytes_per_s,
                                  std::optional<CompressionSample> sample, const AutoCalibration& calibration = {});

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_
