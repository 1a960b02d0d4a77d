#include "sdk/core/ids.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>

namespace oomguard::internal {

std::string RandomHex16() {
  static std::mutex mu;
  static std::mt19937_64 gen([] {
    std::random_device rd;
    // Mix in time and pid so that processes started together differ even when
    // random_device is weak.
    uint64_t seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    seed ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    seed ^= static_cast<uint64_t>(getpid()) << 17;
    return seed;
  }());
  uint64_t v;
  {
    std::lock_guard<std::mutex> lock(mu);
    v = gen();
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

const std::string& HostName() {
  static const std::string name = [] {
    char buf[256] = {0};
    if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return std::string("unknown-host");
    return std::string(buf);
  }();
  return name;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace oomguard::internal
