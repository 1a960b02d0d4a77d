#!/usr/bin/env bash
# Builds (if needed) and runs the benchmarks, then writes bench/RESULTS.md,
# bench/controller.svg and bench/controller_policies.svg.
#
# Usage: bench/run.sh [BUILD_DIR]   (default: build, relative to the repository root)
# Raw results go to BUILD_DIR/bench-results/. Takes about a minute on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
case $build in
  /*) ;;
  *) build=$root/$build ;;
esac
py=$("$root/scripts/python" --executable)  # the project's interpreter (torch 2.11)

if [[ ! -f $build/CMakeCache.txt ]]; then
  echo "== configuring $build"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py"
fi
echo "== building the benchmarks in $build"
targets=(guard_overhead_bench controller_bench vote_bench kb_bench kb_serve_bench kb_pg_bench checkpoint_bench diagnosis_bench)
grep -q '^OOMGUARD_WITH_MPI:BOOL=ON' "$build/CMakeCache.txt" && targets+=(mpi_vote)
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

out=$build/bench-results
mkdir -p "$out"

{
  echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) cores online)"
  echo "- kernel: $(uname -r)"
  echo "- load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "- GPU: $(nvidia-smi -L | head -1) (not used: these benchmarks measure host-side SDK cost)"
  else
    echo "- GPU: none"
  fi
  echo "- build: $(grep -m1 '^CMAKE_BUILD_TYPE' "$build/CMakeCache.txt" | cut -d= -f2), $(c++ --version | head -1)"
} >"$out/machine.txt"

echo "== guard overhead and recovery (about 40 s; one line per benchmark)"
"$build/bin/guard_overhead_bench" --benchmark_out="$out/guard_overhead.json" \
  --benchmark_out_format=json
echo "== size controller: the policies on a simulated GPU (about 30 s)"
"$build/bin/controller_bench" --csv="$out/controller.csv" --json="$out/controller.json"

$py "$root/bench/plot_controller.py" "$out/controller.csv" "$root/bench/controller.svg" \
  --L 300 --start 4096 --panels "$root/bench/controller_policies.svg"
$py "$root/bench/make_report.py" --overhead "$out/guard_overhead.json" \
  --controller "$out/controller.json" --machine "$out/machine.txt" --out "$root/bench/RESULTS.md" \
  --commit "$(git -C "$root" describe --always --dirty 2>/dev/null || true)"
echo "== the step protocol (ThreadGroup; MPI with 4 ranks)"
"$build/bin/vote_bench" --ranks 4 --votes 20000 | tee "$out/vote.jsonl"
if [[ -x $build/bin/mpi_vote ]]; then
  mpirun --allow-run-as-root --oversubscribe -np 4 "$build/bin/mpi_vote" --rounds 20000 | tee -a "$out/vote.jsonl"
fi
echo "== knowledge base: Record() cost and classification"
"$build/bin/kb_bench" --benchmark_out="$out/kb.json" --benchmark_out_format=json
echo "== browser API over 100,000 incidents"
"$build/bin/kb_serve_bench" --benchmark_out="$out/kb_serve.json" --benchmark_out_format=json
echo "== diagnosis on the real OOM reports of tests/kb/testdata/reports"
"$build/bin/diagnosis_bench" --json="$out/diagnosis.json"
echo "== checkpoints (${OOMGUARD_BENCH_CKPT_MIB:-1024} MiB state; set OOMGUARD_BENCH_CKPT_MIB to change)"
"$root/bench/checkpoint_bench.sh" "$build" "${OOMGUARD_BENCH_CKPT_MIB:-1024}"
train_step_md=""
if grep -q '^OOMGUARD_BUILD_PYTHON:BOOL=ON' "$build/CMakeCache.txt" && $py -c "import torch" 2>/dev/null; then
  echo "== TrainStep against the plain PyTorch loop (about a minute)"
  cmake --build "$build" -j"$(nproc)" --target oomguard_python
  train_step_md=$out/train_step_bench.md
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" $py "$root/bench/train_step_bench.py" \
    --markdown "$train_step_md" | tee "$out/train_step.json"
fi
$py "$root/bench/append_sections.py" --results "$root/bench/RESULTS.md" --vote "$out/vote.jsonl" \
  --kb "$out/kb.json" --serve "$out/kb_serve.json" --checkpoint "$root/bench/checkpoint_bench.md" \
  --diagnosis "$out/diagnosis.json" --reports-readme "$root/tests/kb/testdata/reports/README.md" \
  ${train_step_md:+--train-step "$train_step_md"}
echo "== the knowledge base on PostgreSQL (a server started for it)"
"$root/bench/kb_pg_bench.sh" "$build" > "$out/kb_pg.md"
{ echo; cat "$out/kb_pg.md"; } >> "$root/bench/RESULTS.md"
# the last bench/peers/run.sh (its own script: about 20 minutes, a second torch for Composer)
if [[ -f "$root/bench/peers/RESULTS.md" ]]; then
  $py "$root/bench/peers/section.py" "$root/bench/peers/RESULTS.md" "$root/bench/RESULTS.md"
fi
echo "== wrote $root/bench/RESULTS.md, $root/bench/controller.svg and $root/bench/controller_policies.svg"
