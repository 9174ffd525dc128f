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
