// Symbol visibility for the oomguard shared library.
//
// The library is built with -fvisibility=hidden; only declarations marked
// OOMGUARD_EXPORT form the ABI. Exception types are exported so that their
// type_info is shared across the library boundary (catch by type works).
#ifndef OOMGUARD_EXPORT_H_
#define OOMGUARD_EXPORT_H_

#if defined(_WIN32)
#define OOMGUARD_EXPORT
#else
#define OOMGUARD_EXPORT __attribute__((visibility("default")))
#endif

#endif  // OOMGUARD_EXPORT_H_
