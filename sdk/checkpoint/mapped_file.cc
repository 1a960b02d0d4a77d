#include "sdk/checkpoint/mapped_file.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>

namespace oomguard::ckpt {
namespace {

// The mappings the SIGBUS handler may repair. More at once than this (no
// process maps that many shards) are mapped unprotected, as before.
constexpr int kSlots = 1024;

struct Slot {
  // 0 free, 1 being set up or torn down, 2 live: the handler reads begin and
  // end only when it sees 2 (stored last, with release).
  std::atomic<int> state{0};
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<int> faults{0};
};

Slot g_slots[kSlots];
struct sigaction g_previous;
uintptr_t g_page = 4096;
std::once_flag g_installed;

// A SIGBUS that is not ours: what would have happened without this handler.
void Chain(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    // The faulting read runs again on return and faults again, now with the
    // default action (a SIGBUS from a fault cannot be ignored).
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGBUS, &dfl, nullptr);
    return;
  }
  g_previous.sa_handler(sig);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) != 2) continue;
    const uintptr_t begin = s.begin.load(std::memory_order_relaxed);
    const uintptr_t end = s.end.load(std::memory_order_relaxed);
    if (addr < begin || addr >= end) continue;
    // Zeros from the faulting page to the end of the mapping: the file was
    // truncated, so every page after this one faults too. A raw system call:
    // no library interceptor runs inside a signal handler.
    const uintptr_t page = addr & ~(g_page - 1);
    const long p =
        ::syscall(SYS_mmap, page, end - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == -1) break;
    s.faults.fetch_add(1, std::memory_order_relaxed);
    errno = saved_errno;
    return;
  }
  errno = saved_errno;
  Chain(sig, info, context);
}

void InstallHandler() {
  g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  struct sigaction sa {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &g_previous);
}

int Register(const uint8_t* data, size_t size) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + ((size + g_page - 1) & ~(g_page - 1));
  for (int i = 0; i < kSlots; ++i) {
    int expected = 0;
    if (!g_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    g_slots[i].begin.store(begin, std::memory_order_relaxed);
    g_slots[i].end.store(end, std::memory_order_relaxed);
    g_slots[i].faults.store(0, std::memory_order_relaxed);
    g_slots[i].state.store(2, std::memory_order_release);
    return i;
  }
  return -1;
}

}  // namespace

StatusOr<std::unique_ptr<MappedFile>> MappedFile::Map(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::DataLoss("stat " + path + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return Status::DataLoss(path + " is not a regular file");
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) return std::unique_ptr<MappedFile>(new MappedFile(nullptr, 0, -1));
  std::call_once(g_installed, InstallHandler);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::DataLoss(path + ": cannot map the file: " + std::strerror(errno));
  (void)::madvise(p, size, MADV_SEQUENTIAL);
  const auto* data = static_cast<const uint8_t*>(p);
  return std::unique_ptr<MappedFile>(new MappedFile(data, size, Register(data, size)));
}

MappedFile::~MappedFile() {
  if (data_ == nullptr) return;
  if (slot_ >= 0) g_slots[slot_].state.store(1, std::memory_order_release);
  ::munmap(const_cast<uint8_t*>(data_), size_);
  if (slot_ >= 0) {
    g_slots[slot_].begin.store(0, std::memory_order_relaxed);
    g_slots[slot_].end.store(0, std::memory_order_relaxed);
    g_slots[slot_].state.store(0, std::memory_order_release);
  }
}

bool MappedFile::truncated() const {
  return slot_ >= 0 && g_slots[slot_].faults.load(std::memory_order_relaxed) > 0;
}

}  // namespace oomguard::ckpt
