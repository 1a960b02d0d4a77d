#!/usr/bin/env bash
# Prepares, on this machine, what the device run (tests/gpu/run.sh --bundle)
# needs that the GPU image lacks: oomguard built against the CUDA 13 toolkit
# here, the device-side check programs, and every library they load that is
# not part of the image (the image has libc, libstdc++, libm, libgcc_s,
# libcuda, the CUDA 13 runtime and NCCL, but none of Debian's -dev packages:
# spdlog, fmt, HDF5, SQLite, zstd, xxhash ...), plus the CLI11 headers that
# libtorch_train is built with there. No spdlog or fmt headers: nothing built
# there includes them (oomguard.h leaves logging.h out), and Debian's fmt
# ahead of torch 2's own bundled fmt on an include path would clash.
#
#   tests/gpu/bundle.sh DIR [BUILD]
#
# BUILD: a build directory configured with OOMGUARD_WITH_CUDA=ON (default:
# build, the tree's own build; configured and built there if missing). DIR is
# replaced. Layout:
#   DIR/bin/       gpu_checks, nccl_one_rank (stripped)
#   DIR/lib/       liboomguard.so.0, liboomguard_nccl.so, the libraries above
#   DIR/lib/hdf5-plugins/   the zstd filter for h5py there
#   DIR/include/   the CLI11 headers
#   DIR/BUNDLE.txt what is inside, with versions and sizes
# Fails when the bundle is over 60 MiB or when an ELF file in it needs a
# library that is neither in DIR/lib nor in the image's set
# (tests/gpu/check_bundle.py).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${1:?usage: tests/gpu/bundle.sh DIR [BUILD]}
BUILD=${2:-$ROOT/build}
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
LIMIT_MIB=60

# The project's Python (scripts/python: torch 2 from PyPI), unless PYTHON names another.
PY=${PYTHON:-$("$ROOT/scripts/python" --executable)}

if [[ ! -f $BUILD/CMakeCache.txt ]]; then
  echo "bundle: configuring $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -DPython_EXECUTABLE="$PY" > /dev/null
fi
if ! grep -q '^OOMGUARD_WITH_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt"; then
  echo "bundle: $BUILD is not built with CUDA (OOMGUARD_WITH_CUDA=ON needs the toolkit under /usr/local/cuda)" >&2
  exit 1
fi
targets=(oomguard oomguard_h5zstd gpu_checks)
grep -q '^OOMGUARD_WITH_NCCL:BOOL=ON' "$BUILD/CMakeCache.txt" && targets+=(oomguard_nccl nccl_one_rank)
echo "bundle: building ${targets[*]} in $BUILD"
cmake --build "$BUILD" -j"$(nproc)" --target "${targets[@]}" > "$BUILD/bundle-build.log" 2>&1 ||
  { tail -30 "$BUILD/bundle-build.log" >&2; exit 1; }

rm -rf "$DIR"
mkdir -p "$DIR/bin" "$DIR/lib/hdf5-plugins" "$DIR/include"
copy_stripped() {  # copy_stripped SRC DST
  cp -L "$1" "$2"
  chmod u+w "$2"
  strip --strip-unneeded "$2"
}
copy_stripped "$BUILD/bin/gpu_checks" "$DIR/bin/gpu_checks"
[[ -x $BUILD/bin/nccl_one_rank ]] && copy_stripped "$BUILD/bin/nccl_one_rank" "$DIR/bin/nccl_one_rank"
soname() { readelf -d "$1" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
copy_stripped "$BUILD/lib/liboomguard.so" "$DIR/lib/$(soname "$BUILD/lib/liboomguard.so")"
ln -sf "$(soname "$BUILD/lib/liboomguard.so")" "$DIR/lib/liboomguard.so"
[[ -f $BUILD/lib/liboomguard_nccl.so ]] && copy_stripped "$BUILD/lib/liboomguard_nccl.so" "$DIR/lib/liboomguard_nccl.so"
copy_stripped "$BUILD/lib/hdf5-plugins/liboomguard_h5zstd.so" "$DIR/lib/hdf5-plugins/liboomguard_h5zstd.so"

# The libraries they load, less the image's own: resolved here by ldd, copied
# under their soname.
image_set() {
  case $1 in
    linux-vdso.so.*|ld-linux-x86-64.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*) return 0 ;;
    libstdc++.so.*|libgcc_s.so.*) return 0 ;;
    libcuda.so.*|libcudart.so.*|libnccl.so.*) return 0 ;;
  esac
  return 1
}
for elf in "$DIR"/bin/* "$DIR"/lib/*.so* "$DIR"/lib/hdf5-plugins/*.so; do
  [[ -L $elf ]] && continue
  LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib ldd "$elf" | while read -r name arrow path _; do
    [[ $arrow == "=>" && -n $path && -f $path ]] || continue
    image_set "$name" && continue
    [[ -f $DIR/lib/$name ]] || cp -L "$path" "$DIR/lib/$name"
  done
done
chmod u+w "$DIR"/lib/*.so* 2> /dev/null || true
strip --strip-unneeded "$DIR"/lib/lib*.so.* 2> /dev/null || true

# Headers the device build needs besides the tree's own include/ and torch's.
cp -r /usr/include/CLI "$DIR/include/"  # CLI11, for libtorch_train built there

{
  echo "oomguard device bundle, built $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m)"
  echo "commit: $(git -C "$ROOT" describe --always --dirty 2> /dev/null || echo unknown)"
  echo "compiler: $(c++ --version | head -1)"
  echo "CUDA toolkit: $(/usr/local/cuda/bin/nvcc --version 2> /dev/null | tail -1 || echo unknown)"
  echo "spdlog $(dpkg-query -W -f='${Version}' libspdlog-dev 2> /dev/null), fmt $(dpkg-query -W -f='${Version}' libfmt-dev 2> /dev/null), HDF5 $(dpkg-query -W -f='${Version}' libhdf5-dev 2> /dev/null), CLI11 $(dpkg-query -W -f='${Version}' libcli11-dev 2> /dev/null)"
  echo
  (cd "$DIR" && find . -type f -not -path './include/*' -printf '%s\t%p\n' | sort -k2)
} > "$DIR/BUNDLE.txt"

"$PY" "$ROOT/tests/gpu/check_bundle.py" "$DIR" --limit-mib "$LIMIT_MIB"
