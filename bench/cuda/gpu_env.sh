# Sourced by the device scripts: cudarc loads libcuda from the driver and libnvrtc / libcublas /
# libcublasLt (CUDA 13) at run time; the driver ships only libcuda, so the toolkit's (or
# PyTorch's bundled) folders are put on LD_LIBRARY_PATH.
for lib in libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
  f=$(find /usr/local /opt /usr/lib -name "$lib*" 2>/dev/null | head -1)
  if [ -n "$f" ]; then
    export LD_LIBRARY_PATH="$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "warning: $lib not found"
  fi
done

# Each of a comma-separated toggle set ("a=b,c=d") as `--toggle` arguments, one per line (read
# them with `mapfile -t args < <(toggle_args "$set")`).
toggle_args() { local IFS=,; for p in $1; do printf -- '--toggle\n%s\n' "$p"; done; }

# Runs every test of the test executable $1 in a process of its own, each under `timeout $2`
# seconds, with the rest of the arguments (a filter, --skip NAME, ...) choosing which: an illegal
# address or another sticky CUDA error poisons its process's context, so one crash in a shared
# process fails every test after it (the twenty-third session's first call lost ten tests so).
# Prints each test's output; returns 1 if any failed, or if none was listed (an executable
# that cannot list its tests must not pass as an empty run).
run_each() {
  local exe=$1 limit=$2 rc=0 ran=0 name
  shift 2
  for name in $("$exe" --list --format terse "$@" 2>/dev/null | sed -n 's/: test$//p'); do
    timeout "$limit" "$exe" --exact "$name" --test-threads=1 --nocapture || rc=1
    ran=$((ran + 1))
  done
  [ "$ran" -gt 0 ] || { echo "run_each: $exe listed no tests"; rc=1; }
  return $rc
}
