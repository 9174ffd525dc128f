#!/usr/bin/env bash
# Builds the CUDA test executables and the tapedeck binary here, stripped, into .device/ (ignored
# by git; carried to the GPU machine by the device tool). The test binaries look for fixtures at
# the absolute path of this checkout's engine/ folder (CARGO_MANIFEST_DIR), so the GPU machine
# must run them from a checkout at a path where ../fixtures resolves: the script records the
# path, and run_engine_tests.sh is run from the repository root where it is the same layout.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device
rm -f .device/test-*
json=$(cargo test -p tapedeck-engine --test cuda --no-run --message-format=json 2>/dev/null)
for exe in $(echo "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except Exception: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"] + "=" + m["executable"])
'); do
  name=${exe%%=*}; path=${exe#*=}
  cp "$path" ".device/test-$name"
  strip ".device/test-$name"
done
if [ "${WITH_CLI:-1}" = 1 ]; then
  cargo build --release
  cp target/release/tapedeck .device/tapedeck
  strip .device/tapedeck
fi
ls -la .device
