#!/usr/bin/env bash
# ctest gpu_bundle: the device bundle is made here and is whole, and what the
# device run builds from it builds and runs here, with the project's Python
# (scripts/python: torch 2.11 from PyPI, pybind11 from pip) standing in for
# the GPU image's:
#   1. tests/gpu/bundle.sh makes it from this build (size within the limit,
#      every ELF file's libraries in the bundle or the image's set, by
#      readelf and by the loader with the bundle alone on the library path);
#   2. check_bundle.py refuses a bundle with one library taken out (so the
#      check in 1 can fail);
#   3. build_python.sh builds the Python package from the bundle, the way the
#      device run does: it imports, oomguard.torch (a sub-package) with it,
#      runs a guarded step with only the bundle's libraries, and its
#      oomguard._budget is built against this torch;
#   4. tests/gpu/fit_cuda.py with that package: without a GPU it says so and
#      exits 2; its dry run on the CPU (--device cpu, the budgeted allocator
#      instead of a full device) recovers real torch OOMs in fit() and ends
#      equal to the unconstrained run;
#   5. build_libtorch_train.sh builds libtorch_train from the bundle against
#      this torch (the same wheel line as the image's), and it passes
#      tests/integration/libtorch_train_test.sh on the CPU: torch's OOMs
#      classified by type through the c10 translator compiled into it;
#   6. tests/gpu/run.sh --bundle on this machine, which has no GPU, says so,
#      writes its log and exits 0.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${1:?usage: bundle_test.sh BUILD}
PY=${OOMGUARD_PYTHON:-$("$ROOT/scripts/python" --executable)}
# Under the build tree, not a fresh temporary name, so that ccache (when
# installed) finds the same compile commands on the next run.
T=$BUILD/gpu-bundle-test
rm -rf "$T" && mkdir -p "$T"
trap 'kill $(jobs -p) 2> /dev/null || true; wait; rm -rf "$T"' EXIT  # the background builds below, if still running
command -v ccache > /dev/null 2>&1 && export CXX="ccache ${CXX:-c++}"
export OOMGUARD_LOG_LEVEL=error
fail() { echo "FAIL: $*" >&2; exit 1; }

out=$(PYTHON=$PY "$ROOT/tests/gpu/bundle.sh" "$T/b" "$BUILD") || { echo "$out"; fail "bundle.sh failed"; }
echo "$out"
grep -Eq '^bundle .*: [0-9.]+ MiB, [0-9]+ ELF files, limit 60 MiB$' <<< "$out" || fail "bundle.sh printed no size line"
[ -x "$T/b/bin/gpu_checks" ] && [ -f "$T/b/lib/liboomguard.so.0" ] && [ -f "$T/b/include/CLI/CLI.hpp" ] ||
  fail "the bundle lacks gpu_checks, liboomguard or the CLI11 headers"
[ ! -e "$T/b/include/fmt" ] && [ ! -e "$T/b/include/spdlog" ] ||
  fail "the bundle carries fmt or spdlog headers, which would shadow torch's own fmt on the device"

victim=$(cd "$T/b/lib" && ls libhdf5*.so.* | head -1)
cp -r "$T/b" "$T/cut" && rm "$T/cut/lib/$victim"
if "$PY" "$ROOT/tests/gpu/check_bundle.py" "$T/cut" > "$T/cut.out" 2>&1; then
  cat "$T/cut.out"; fail "check_bundle.py accepted a bundle without $victim"
fi
grep -q "needs $victim" "$T/cut.out" || { cat "$T/cut.out"; fail "check_bundle.py did not name the missing $victim"; }
echo "ok: a bundle without $victim is refused"
rm -rf "$T/cut"

# The two builds the device run starts side by side.
"$ROOT/tests/gpu/build_python.sh" "$T/b" "$T/py" "$PY" > "$T/py.out" 2>&1 &
py_build=$!
"$ROOT/tests/gpu/build_libtorch_train.sh" "$T/b" "$T/lt" "$PY" > "$T/lt.out" 2>&1 &
lt_build=$!
wait $py_build || { cat "$T/py.out"; fail "build_python.sh"; }
grep -q '_budget' "$T/py.out" && ! grep -q '_budget not built' "$T/py.out" ||
  { cat "$T/py.out"; fail "build_python.sh did not build oomguard._budget against this torch"; }
cat "$T/py.out"

export LD_LIBRARY_PATH=$T/b/lib
PYTHONPATH=$T/py "$PY" - <<'PY' || fail "the package built from the bundle does not run a step"
import oomguard, oomguard.budget, oomguard.torch, os
for m in (oomguard, oomguard.torch):
    assert os.path.dirname(m.__file__).startswith(os.environ["PYTHONPATH"]), m.__file__
assert callable(oomguard.torch.fit) and oomguard.budget.available()
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

rc=0
PYTHONPATH=$T/py "$PY" "$ROOT/tests/gpu/fit_cuda.py" > "$T/fit_nogpu.out" 2>&1 || rc=$?
[ $rc -eq 2 ] && grep -q "no CUDA device" "$T/fit_nogpu.out" ||
  { cat "$T/fit_nogpu.out"; fail "fit_cuda.py without a GPU exited $rc, not 2 saying so"; }
echo "ok: fit_cuda.py without a GPU: $(cat "$T/fit_nogpu.out")"
rc=0
PYTHONPATH=$T/py "$PY" "$ROOT/tests/gpu/fit_cuda.py" --device cpu > "$T/fit_cpu.out" 2> "$T/fit_cpu.err" || rc=$?
[ $rc -eq 0 ] || { cat "$T/fit_cpu.out" "$T/fit_cpu.err"; fail "fit_cuda.py --device cpu exited $rc"; }
"$PY" - "$T/fit_cpu.out" <<'PY' || fail "fit_cuda.py --device cpu: its figures do not hold"
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
t, c = d["tight"], d["clean"]
assert c["ooms"] == 0 and t["ooms"] >= 1 and t["final_micro_batch"] < d["global_batch"], d
assert d["equal"] and d["max_rel_diff"] <= 1e-10 and d["evals_max_rel_diff"] <= 1e-10, d
assert t["evals"] == c["evals"] >= 1 and t["checkpoint_step"] == d["steps"] - 1, d
assert "OutOfMemoryError" in t["incident"], t["incident"]
print(f"ok: fit() dry run on the CPU: {t['ooms']} torch OOMs recovered with {t['headroom_mib']} MiB of "
      f"{c['need_mib']} MiB, micro-batch {d['global_batch']} -> {t['final_micro_batch']}, "
      f"max rel diff {d['max_rel_diff']:.1e}")
PY
unset LD_LIBRARY_PATH

wait $lt_build || { cat "$T/lt.out"; fail "build_libtorch_train.sh"; }
cat "$T/lt.out"
OOMGUARD_PYTHON=$PY "$ROOT/tests/integration/libtorch_train_test.sh" "$T/lt/libtorch_train" > "$T/lt_test.out" 2>&1 ||
  { cat "$T/lt_test.out"; fail "libtorch_train built from the bundle does not pass libtorch_train_test.sh"; }
echo "ok: libtorch_train from the bundle: $(tail -1 "$T/lt_test.out")"

env OUT="$T/out" PATH=/usr/bin:/bin "$ROOT/tests/gpu/run.sh" --bundle "$T/b" > "$T/run.out" 2>&1 || { cat "$T/run.out"; fail "run.sh --bundle without a GPU exited non-zero"; }
grep -q "no GPU" "$T/run.out" || { cat "$T/run.out"; fail "run.sh --bundle did not say there is no GPU"; }
cmp -s "$T/run.out" "$T/out/gpu-run.log" || fail "run.sh --bundle did not write what it printed to \$OUT/gpu-run.log"
echo "ok: $(cat "$T/run.out")"
