#!/usr/bin/env bash
# ctest gpu_bundle: the device bundle is made here and is whole.
#   1. tests/gpu/bundle.sh makes it from this build (size within the limit,
#      every ELF file's libraries in the bundle or the image's set, by
#      readelf and by the loader with the bundle alone on the library path);
#   2. check_bundle.py refuses a bundle with one library taken out (so the
#      check in 1 can fail);
#   3. build_python.sh builds the Python package from the bundle, the way the
#      device run does, and it imports and runs a guarded step with only the
#      bundle's libraries;
#   4. tests/gpu/run.sh --bundle on this machine, which has no GPU, says so,
#      writes its log and exits 0.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${1:?usage: bundle_test.sh BUILD}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

out=$("$ROOT/tests/gpu/bundle.sh" "$T/b" "$BUILD") || { echo "$out"; fail "bundle.sh failed"; }
echo "$out"
grep -Eq '^bundle .*: [0-9.]+ MiB, [0-9]+ ELF files, limit 60 MiB$' <<< "$out" || fail "bundle.sh printed no size line"
[ -x "$T/b/bin/gpu_checks" ] && [ -f "$T/b/lib/liboomguard.so.0" ] && [ -f "$T/b/include/CLI/CLI.hpp" ] ||
  fail "the bundle lacks gpu_checks, liboomguard or the CLI11 headers"

victim=$(cd "$T/b/lib" && ls libhdf5*.so.* | head -1)
cp -r "$T/b" "$T/cut" && rm "$T/cut/lib/$victim"
if /usr/bin/python3 "$ROOT/tests/gpu/check_bundle.py" "$T/cut" > "$T/cut.out" 2>&1; then
  cat "$T/cut.out"; fail "check_bundle.py accepted a bundle without $victim"
fi
grep -q "needs $victim" "$T/cut.out" || { cat "$T/cut.out"; fail "check_bundle.py did not name the missing $victim"; }
echo "ok: a bundle without $victim is refused"

"$ROOT/tests/gpu/build_python.sh" "$T/b" "$T/py" /usr/bin/python3 > "$T/py.out" 2>&1 || { cat "$T/py.out"; fail "build_python.sh"; }
LD_LIBRARY_PATH=$T/b/lib PYTHONPATH=$T/py /usr/bin/python3 - <<'PY' || fail "the package built from the bundle does not run a step"
import oomguard, os
assert os.path.dirname(oomguard.__file__).startswith(os.environ["PYTHONPATH"]), oomguard.__file__
g = oomguard.Guard(workload="bundle-smoke")
seen = []
def micro(mb):
    if mb.size > 2:
        raise MemoryError("host out of memory (bundle smoke)")
    seen.append((mb.offset, mb.size))
r = g.step(8, micro, reset=seen.clear)
assert r.ooms >= 1 and sum(c for _, c in seen) == 8, (r.ooms, seen)
print("ok: oomguard", oomguard.__version__, "from the bundle:", r.ooms, "OOMs recovered, micro-batch", max(c for _, c in seen))
PY

env OUT="$T/out" PATH=/usr/bin:/bin "$ROOT/tests/gpu/run.sh" --bundle "$T/b" > "$T/run.out" 2>&1 || { cat "$T/run.out"; fail "run.sh --bundle without a GPU exited non-zero"; }
grep -q "no GPU" "$T/run.out" || { cat "$T/run.out"; fail "run.sh --bundle did not say there is no GPU"; }
cmp -s "$T/run.out" "$T/out/gpu-run.log" || fail "run.sh --bundle did not write what it printed to \$OUT/gpu-run.log"
echo "ok: $(cat "$T/run.out")"
