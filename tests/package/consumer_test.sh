#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then configures, builds
# and runs a tiny consumer project with find_package(oomguard).
set -euo pipefail
SRC=$1 BUILD=$2 CMAKE=${3:-cmake}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$CMAKE" --install "$BUILD" --prefix "$T/prefix" > "$T/install.log"
test -f "$T/prefix/lib/cmake/oomguard/oomguardConfig.cmake" || { echo "no oomguardConfig.cmake installed"; exit 1; }
test -f "$T/prefix/include/oomguard/oomguard.h" || { echo "no public headers installed"; exit 1; }
if ls "$T/prefix/include/oomguard" | grep -v '\.h$'; then echo "non-header files installed"; exit 1; fi
"$CMAKE" -S "$SRC/tests/package/consumer" -B "$T/build" -DCMAKE_PREFIX_PATH="$T/prefix" > "$T/configure.log"
"$CMAKE" --build "$T/build" > "$T/build.log"
LD_LIBRARY_PATH="$T/prefix/lib" "$T/build/consumer"
# Only the public API is exported from the shared library.
if nm -DC --defined-only "$T/prefix/lib/liboomguard.so" | grep -q "GuardImpl"; then
  echo "private symbols are exported"; exit 1
fi
echo "installed package consumer: ok"
