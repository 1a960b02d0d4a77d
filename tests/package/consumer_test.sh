#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then configures, builds
# and runs a tiny consumer project with find_package(oomguard). The consumer
# sets no C++ standard of its own: C++20 must come with oomguard::oomguard.
# With MPI=ON (the build has the MPI engine) it links oomguard::mpi as well.
# With TORCH_DIR (the build has oomguard::torch; libtorch's CMake package) it
# also builds examples/cpp/libtorch_train against the installed package and
# checks that its runs through OOMs and rollbacks equal the plain libtorch loop.
#   consumer_test.sh SRC BUILD [CMAKE] [MPI=ON|OFF] [TORCH_DIR]
set -euo pipefail
SRC=$1 BUILD=$2 CMAKE=${3:-cmake} MPI=${4:-OFF} TORCH_DIR=${5:-}
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
if [ -n "$TORCH_DIR" ]; then
  test -f "$T/prefix/include/oomguard/torch.h" || { echo "oomguard/torch.h not installed"; exit 1; }
  test -f "$T/prefix/lib/liboomguard_torch.so" || { echo "liboomguard_torch.so not installed"; exit 1; }
  "$CMAKE" -S "$SRC/tests/package/libtorch" -B "$T/torch-build" -DCMAKE_PREFIX_PATH="$T/prefix" \
    -DTorch_DIR="$TORCH_DIR" > "$T/torch-configure.log" 2>&1 || { cat "$T/torch-configure.log"; exit 1; }
  if grep -q "CMAKE_CXX_STANDARD" "$SRC/tests/package/libtorch/CMakeLists.txt"; then
    echo "the libtorch consumer must not set a C++ standard: the package has to carry it"; exit 1
  fi
  "$CMAKE" --build "$T/torch-build" > "$T/torch-build.log" 2>&1 || { tail -n 40 "$T/torch-build.log"; exit 1; }
  BIN="$T/torch-build/libtorch_train"
  # No private header or in-tree library was needed.
  if grep -qE -- "-I$SRC/include|-I$SRC( |$)|/sdk/|oomguard_private" "$T/torch-build/CMakeFiles/libtorch_train.dir/flags.make"; then
    echo "libtorch_train was compiled against the source tree, not the installed package"; exit 1
  fi
  export LD_LIBRARY_PATH="$T/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" OOMGUARD_LOG_LEVEL=error
  ARGS=(--global-batch 512 --hidden 256 --seed 3 --steps 8 --lr-step 3 --json --quiet)
  # 4 MiB: the whole batch does not fit (the step is split). During step 3 a
  # neighbour holds more: 1 MiB stops Adam's optimizer step (its temporaries)
  # and 2 MiB even one sample of SGD's: both roll back, from memory.
  for spec in adam:1 adamw:1 sgd:2; do
    opt=${spec%:*} squeeze=${spec#*:}
    "$BIN" "${ARGS[@]}" --optimizer "$opt" --plain --dump-params "$T/plain-$opt.f64" > "$T/plain-$opt.out"
    "$BIN" "${ARGS[@]}" --optimizer "$opt" --grow-after 1 --budget-mib 4 --squeeze-mib "$squeeze" --squeeze-step 3 \
      --check-against "$T/plain-$opt.f64" > "$T/guarded-$opt.out" || {
        echo "libtorch_train --optimizer $opt under the budget failed (exit $?)"; cat "$T/guarded-$opt.out"; exit 1; }
    "$SRC/scripts/python" - "$T/guarded-$opt.out" "$T/plain-$opt.out" <<'PY' || exit 1
import json, sys
g, p = (json.loads(open(f).read().splitlines()[-1]) for f in sys.argv[1:])
assert g["ooms"] >= 2 and g["rollbacks"] >= 1, g
assert g["max_rel_diff"] is not None and g["max_rel_diff"] <= 1e-10, g
assert g["lr"] == p["lr"], (g["lr"], p["lr"])
assert g["checkpoints_written"] == 0, g
print(f"libtorch_train {g['optimizer']}: {g['ooms']} OOMs, {g['rollbacks']} rollback(s), "
      f"max rel diff {g['max_rel_diff']:.2g} from the plain loop")
PY
  done
fi
echo "installed package consumer: ok"
