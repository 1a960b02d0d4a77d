#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then configures, builds
# and runs a tiny consumer project with find_package(oomguard). The consumer
# sets no C++ standard of its own: C++20 must come with oomguard::oomguard.
# With MPI=ON (the build has the MPI engine) it links oomguard::mpi as well.
#   consumer_test.sh SRC BUILD [CMAKE] [MPI=ON|OFF]
set -euo pipefail
SRC=$1 BUILD=$2 CMAKE=${3:-cmake} MPI=${4:-OFF}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$CMAKE" --install "$BUILD" --prefix "$T/prefix" > "$T/install.log"
test -f "$T/prefix/lib/cmake/oomguard/oomguardConfig.cmake" || { echo "no oomguardConfig.cmake installed"; exit 1; }
test -f "$T/prefix/include/oomguard/oomguard.h" || { echo "no public headers installed"; exit 1; }
if ls "$T/prefix/include/oomguard" | grep -v '\.h$'; then echo "non-header files installed"; exit 1; fi
"$CMAKE" -S "$SRC/tests/package/consumer" -B "$T/build" -DCMAKE_PREFIX_PATH="$T/prefix" \
  -DCONSUMER_WITH_MPI="$MPI" > "$T/configure.log"
if grep -q "CMAKE_CXX_STANDARD" "$SRC/tests/package/consumer/CMakeLists.txt"; then
  echo "the consumer must not set a C++ standard: the package has to carry it"; exit 1
fi
"$CMAKE" --build "$T/build" > "$T/build.log"
LD_LIBRARY_PATH="$T/prefix/lib" "$T/build/consumer"
if [ "$MPI" = ON ]; then
  test -f "$T/prefix/lib/liboomguard_mpi.so" || { echo "liboomguard_mpi.so not installed"; exit 1; }
  # Captured first: under pipefail, `ldd | grep -q` fails when grep stops
  # reading at the match and ldd dies of SIGPIPE (seen once in CI).
  linked=$(ldd "$T/build/consumer")
  grep -q liboomguard_mpi <<< "$linked" || { echo "the consumer does not link oomguard::mpi"; exit 1; }
fi
# Only the public API is exported from the shared library.
exported=$(nm -DC --defined-only "$T/prefix/lib/liboomguard.so")
if grep -q "GuardImpl" <<< "$exported"; then
  echo "private symbols are exported"; exit 1
fi
echo "installed package consumer: ok"
