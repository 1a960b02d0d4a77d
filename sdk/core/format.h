// Human-readable byte counts, shared by the guard's log lines, the
// classifier's evidence, the devices' OOM messages and the CLI.
// Thread-safety: pure functions.
#ifndef OOMGUARD_SDK_CORE_FORMAT_H_
#define OOMGUARD_SDK_CORE_FORMAT_H_

#include <cstdint>
#include <string>

namespace oomguard::internal {

// "512 B", "2.1 GiB": whole bytes, one decimal in larger units (binary units).
std::string FormatBytes(double bytes);

// "2.00 MiB": two decimals in every unit, as PyTorch's OOM messages print
// sizes, so the devices' messages read (and parse) like PyTorch's.
std::string FormatBytesFixed2(double bytes);

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_CORE_FORMAT_H_
