// MappedFile: a read-only mapping of a whole file that a truncation under it
// cannot turn into a crash.
//
// Reading a page of a shared file mapping that the file no longer backs (it
// was truncated in place while a load or a verify read it) raises SIGBUS,
// which kills the process. Every mapping made here is registered with a
// process-wide SIGBUS handler: a fault inside a registered mapping replaces
// the rest of that mapping, from the faulting page on, with zero-filled
// anonymous memory, records the truncation and lets the read go on. The
// reader then reports the file as truncated (truncated() below), so the
// caller refuses the file with a clear message instead of dying. A SIGBUS
// elsewhere goes to the handler that was installed before (or the default
// action), as if this one did not exist.
//
// Thread-safety: a MappedFile may be read from any number of threads; the
// handler is async-signal-safe (atomics and raw system calls only).
#ifndef OOMGUARD_SDK_CHECKPOINT_MAPPED_FILE_H_
#define OOMGUARD_SDK_CHECKPOINT_MAPPED_FILE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "oomguard/status.h"

namespace oomguard::ckpt {

class MappedFile {
 public:
  // Maps all of the regular file open at `fd` (its size now; the descriptor
  // may be closed afterwards). kDataLoss naming `path` when it cannot.
  static StatusOr<std::unique_ptr<MappedFile>> Map(int fd, const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  // Whether a read touched a page the file no longer backed: the file was
  // truncated while mapped, and what was read from there on was zeros.
  bool truncated() const;

 private:
  MappedFile(const uint8_t* data, size_t size, int slot) : data_(data), size_(size), slot_(slot) {}
  const uint8_t* data_;
  size_t size_;
  int slot_;  // in the handler's registry; -1: not registered (registry full)
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_MAPPED_FILE_H_
