// The oomguard version (kept in step with project(VERSION) in CMakeLists.txt).
#ifndef OOMGUARD_VERSION_H_
#define OOMGUARD_VERSION_H_

#define OOMGUARD_VERSION_MAJOR 0
#define OOMGUARD_VERSION_MINOR 1
#define OOMGUARD_VERSION_PATCH 0
#define OOMGUARD_VERSION_STRING "0.1.0"

#endif  // OOMGUARD_VERSION_H_
