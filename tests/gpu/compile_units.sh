# shellcheck shell=bash
# Sourced by build_python.sh and build_libtorch_train.sh: compiles translation
# units in parallel, each on its own command line (so that a compiler launcher
# such as ccache can cache each), before the caller's one link.
#
#   compile_units OBJDIR SRC...
# Uses the caller's arrays CXX (the compiler, a launcher first if any) and
# FLAGS; sets OBJS to the object files, in the order of SRC. Returns non-zero
# when a unit failed (the compiler's messages are on stderr).
compile_units() {
  local dir=$1 src obj p rc=0
  shift
  local pids=()
  OBJS=()
  for src in "$@"; do
    obj=$dir/$(basename "${src%.*}").o
    "${CXX[@]}" "${FLAGS[@]}" -c "$src" -o "$obj" &
    pids+=($!)
    OBJS+=("$obj")
    while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 0.2; done
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
