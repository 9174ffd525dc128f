#!/usr/bin/env bash
# What recording costs: the same closed-loop load against `tapedeck serve` with recording on and
# with `--no-record`, in one run, side by side. Prints throughput, E2E p50/p99 and the ratio, and
# the recorder's own counters (records written, dropped, batches) from /metrics.
#
#   bench/serve/record_overhead.sh        # env: SESSIONS (default 300), TURNS (2), CONC (16), TOKENS (8)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
SESSIONS="${SESSIONS:-300}" TURNS="${TURNS:-2}" CONC="${CONC:-16}" TOKENS="${TOKENS:-8}"
cargo build --release -q
cargo build --release -q -p tapedeck-replayer --example replay_bench
bin="$root/target/release/tapedeck"
bench="$root/target/release/examples/replay_bench"
tmp="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run_one() { # $1 = label, $2.. = extra serve flags
  local label="$1"; shift
  local port; port="$(free_port)"
  "$bin" serve --listen "127.0.0.1:$port" --db "$tmp/$label.db" "$@" > "$tmp/$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.1; done
  "$bench" --url "http://127.0.0.1:$port" --sessions "$SESSIONS" --turns "$TURNS" \
    --concurrency "$CONC" --tokens "$TOKENS" --warmup 20 | tail -1 > "$tmp/$label.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^tapedeck_recorder_records_(written|dropped)_total" > "$tmp/$label.metrics" || true
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  echo "$label: $(cat "$tmp/$label.json")"
  cat "$tmp/$label.metrics"
}
run_one record_on
run_one record_off --no-record
python3 - "$tmp" <<'PY'
import json, sys, pathlib
t = pathlib.Path(sys.argv[1])
on = json.loads((t / "record_on.json").read_text())
off = json.loads((t / "record_off.json").read_text())
print(f"{'':12}{'req/s':>10}{'out tok/s':>11}{'E2E p50 ms':>12}{'E2E p99 ms':>12}{'failed':>8}")
for name, d in (("recording", on), ("no record", off)):
    print(f"{name:12}{d['request_throughput']:>10.2f}{d['output_token_throughput']:>11.1f}"
          f"{d['e2e_ms']['p50']:>12.2f}{d['e2e_ms']['p99']:>12.2f}{d['failed']:>8}")
r = on["request_throughput"] / off["request_throughput"]
print(f"throughput ratio recording/no-record: {r:.3f} (goal >= 0.98); "
      f"p99 E2E added by recording: {on['e2e_ms']['p99'] - off['e2e_ms']['p99']:+.2f} ms")
PY
