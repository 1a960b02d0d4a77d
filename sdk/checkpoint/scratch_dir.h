// For the checkpoint tests: a fresh, empty directory under the system's
// temporary directory, unique to this process and object, removed with
// everything in it when the object goes.
#ifndef OOMGUARD_SDK_CHECKPOINT_SCRATCH_DIR_H_
#define OOMGUARD_SDK_CHECKPOINT_SCRATCH_DIR_H_

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace oomguard::ckpt {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix = "oomguard-ckpt-test") {
    static std::atomic<int> n{0};
    path_ = (std::filesystem::temp_directory_path() /
             (prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++)))
                .string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_SCRATCH_DIR_H_
