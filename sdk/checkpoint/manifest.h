// Names, the manifest and durable file operations of formats oomguard-ckpt/2 and /1.
//
// Durability protocol (crash consistency): a file is written as <name>.tmp,
// fsynced, renamed over <name>, and its directory fsynced; MANIFEST.json is
// written the same way, last. A reader trusts a step only when its manifest
// exists, so a crash at any moment leaves either the previous checkpoints or
// a complete new one, plus *.tmp litter that retention removes.
//
// Thread-safety: free functions on distinct paths may run concurrently.
#ifndef OOMGUARD_SDK_CHECKPOINT_MANIFEST_H_
#define OOMGUARD_SDK_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "oomguard/status.h"

namespace oomguard::ckpt {

inline constexpr const char* kManifestName = "MANIFEST.json";
// A manifest is a few hundred bytes per rank; anything larger is not one.
inline constexpr int64_t kMaxManifestBytes = int64_t{8} << 20;
// The most ranks a manifest may list (bounds what a hostile manifest makes a reader allocate).
inline constexpr int kMaxWorldSize = 1 << 20;

std::string StepDirName(int64_t step);  // "step-00000100"
std::string ShardFileName(int rank);    // "rank-00000.h5"
// The step of a "step-NNNNNNNN" name, or nullopt.
std::optional<int64_t> ParseStepDirName(const std::string& name);

struct ManifestShard {
  int rank = 0;
  std::string file;  // relative to the step directory
  int64_t bytes = 0;
  std::string xxh3;         // format 1: XXH3 of the whole file
  std::string digest;       // format 2: the shard's digest (shard_digest.h)
  std::string compression;  // format 2: "none" or "zstd-<level>"
  // Format 2, optional: why `compression = auto` chose what it chose, as a
  // JSON object (measured throughputs); empty when the choice was fixed.
  std::string auto_choice;
};

struct Manifest {
  std::string format;  // kCheckpointFormat, or kCheckpointFormatV1 (read only)
  int64_t step = -1;
  int world_size = 0;
  int64_t created_unix = 0;
  std::vector<ManifestShard> shards;
};

// Deepest nesting of arrays and objects in JSON `text` (strings skipped),
// counting no further than stop_at + 1. A manifest nests three deep; JSON
// parsers and DOMs recurse per level, so a hostile "[[[[..." is refused
// before it is parsed.
int JsonNestingDepth(std::string_view text, int stop_at);

std::string ManifestToJson(const Manifest& m);
// kDataLoss naming what is malformed: not JSON, a format other than 1 or 2, a
// missing field or one of the wrong type, an integer out of range, world_size outside [1, kMaxWorldSize],
// a shard count other than world_size, a rank listed twice or outside
// [0, world_size), a shard file name that is not one plain path component, an
// xxh3 (format 1) or digest (format 2) that is not 16 lowercase hex digits, a
// compression (format 2) other than "none" or "zstd-<level>".
StatusOr<Manifest> ParseManifest(const std::string& text);
// Whether `step_dir` may be used as a step directory: a real directory, not a
// symbolic link (to another run's step, say) or another kind of file. Every
// read, write and deletion of a step directory asks this first, so that
// nothing is read, written or deleted through a link. kNotFound when it does
// not exist; kDataLoss naming it otherwise.
Status CheckStepDir(const std::string& step_dir);
// Reads <step_dir>/MANIFEST.json. kNotFound when absent; kDataLoss when the
// step directory is refused by CheckStepDir, when the manifest is not a
// regular file (a symlink, FIFO, device or directory), is larger than
// kMaxManifestBytes, or does not parse.
StatusOr<Manifest> ReadManifest(const std::string& step_dir);
// Reads a whole regular file of at most max_bytes. Never follows a symlink,
// never blocks on a FIFO, never reads more than max_bytes + 1 bytes.
// kNotFound when absent, kDataLoss otherwise (naming the path and why).
StatusOr<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes);

// Writes `data` to `path` durably (tmp, fsync, rename, directory fsync).
Status WriteFileDurably(const std::string& path, const std::string& data, bool fsync);
// fsync of a file or directory by path.
Status FsyncPath(const std::string& path, bool directory);
// XXH3_64bits of a whole file, and its size. Hashes a read-only mapping of
// the file (read() where mapping fails); the file must not shrink meanwhile.
// Only a regular file is hashed (never through a symlink, never a FIFO or a
// device, which could block or never end): kDataLoss otherwise.
Status HashFile(const std::string& path, uint64_t* hash, int64_t* bytes);

// Hashes a whole file on a thread of its own, from construction on, and
// compares it with the manifest's xxh3: loads and verification decode the
// shard meanwhile. Verdict() waits; the destructor waits too.
class FileHashCheck {
 public:
  FileHashCheck(std::string path, std::string expect_xxh3);
  // kDataLoss naming the file when the hash differs; HashFile's error when
  // the file cannot be read.
  Status Verdict();

 private:
  const std::string path_, expect_;
  Status status_;
  std::jthread thread_;  // last: starts after, and is joined before, the fields it uses
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_MANIFEST_H_
