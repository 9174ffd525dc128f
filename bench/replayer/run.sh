#!/usr/bin/env bash
# Replayer benchmark (issue 5, "Performance"): tapedeck's replayer vs a peer load generator
# (guidellm) against the same trivial, fast OpenAI-compatible target on loopback.
#
#   bench/replayer/run.sh            # from the repository root; ~2-3 minutes on 2 cores
#
# Environment knobs (defaults in brackets): CONC [64] concurrency of the throughput runs,
# TOKENS [16] output tokens per request, TD_REQUESTS [20000] tapedeck requests,
# PEER_REQUESTS [2000] guidellm requests, LAT_REQUESTS [300] requests of the concurrency-1 runs,
# PEER_VENV [$OUT/peer-venv] where guidellm is pip-installed, OUT [target/bench-replayer].
# Results: a table on stdout and JSON files under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

CONC=${CONC:-64}
TOKENS=${TOKENS:-16}
TD_REQUESTS=${TD_REQUESTS:-20000}
PEER_REQUESTS=${PEER_REQUESTS:-2000}
LAT_REQUESTS=${LAT_REQUESTS:-300}
OUT=${OUT:-target/bench-replayer}
PEER_VENV=${PEER_VENV:-$OUT/peer-venv}
mkdir -p "$OUT"

echo "== building the examples (release)"
cargo build --release -p tapedeck-replayer --example fake_openai --example replay_bench

echo "== installing the peer (guidellm) into $PEER_VENV"
if [ ! -x "$PEER_VENV/bin/guidellm" ]; then
    python3 -m venv "$PEER_VENV"
    "$PEER_VENV/bin/pip" install -q guidellm
fi
"$PEER_VENV/bin/guidellm" --version

echo "== starting the fake target (1 worker thread, $TOKENS tokens, no delay)"
./target/release/examples/fake_openai --listen 127.0.0.1:0 --tokens "$TOKENS" --threads 1 \
    > "$OUT/fake.out" 2>&1 &
FAKE_PID=$!
trap 'kill "$FAKE_PID" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    grep -q "listening on" "$OUT/fake.out" 2>/dev/null && break
    sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$OUT/fake.out")
[ -n "$ADDR" ] || { cat "$OUT/fake.out"; exit 1; }
URL="http://$ADDR"
echo "target: $URL"

td() {  # td NAME CONCURRENCY SESSIONS TURNS
    timeout 300 ./target/release/examples/replay_bench --url "$URL" --concurrency "$2" \
        --sessions "$3" --turns "$4" --tokens "$TOKENS" --threads 1 --json "$OUT/$1.json" \
        | grep -v "^{"
}
peer() {  # peer NAME CONCURRENCY REQUESTS
    timeout 300 "$PEER_VENV/bin/guidellm" run \
        --backend "kind=openai_http,target=$URL,model=fake" \
        --profile "kind=concurrent,streams=$2" \
        --constraint "kind=max_requests,count=$3" \
        --data "kind=synthetic_text,prompt_tokens=32,output_tokens=$TOKENS" \
        --tokenizer "kind=hf_auto,model=$PWD/fixtures/models/tiny-qwen2" \
        --output "kind=json,path=$OUT/$1.json" --disable-progress > "$OUT/$1.log" 2>&1 \
        || { tail -30 "$OUT/$1.log"; exit 1; }
    echo "guidellm $1: done ($OUT/$1.log)"
}

echo "== tapedeck replay: throughput (closed loop, concurrency $CONC, single-turn sessions)"
td td_tput "$CONC" "$TD_REQUESTS" 1
echo "== tapedeck replay: throughput (closed loop, concurrency $CONC, 4-turn sessions)"
td td_tput4 "$CONC" $((TD_REQUESTS / 4)) 4
echo "== tapedeck replay: latency overhead (concurrency 1)"
td td_lat 1 "$LAT_REQUESTS" 1
echo "== guidellm: throughput (concurrent, $CONC streams)"
peer gl_tput "$CONC" "$PEER_REQUESTS"
echo "== guidellm: latency overhead (concurrent, 1 stream)"
peer gl_lat 1 "$LAT_REQUESTS"
SERVED=$(curl -s "$URL/stats" || echo '?')
echo "target served: $SERVED"

python3 - "$OUT" "$CONC" "$TOKENS" <<'PY'
import json, sys
out, conc, tokens = sys.argv[1], sys.argv[2], sys.argv[3]
def td(name):
    d = json.load(open(f"{out}/{name}.json"))
    return dict(n=d["requests"], failed=d["failed"], s=d["duration_s"], rps=d["request_throughput"],
                p50=d["e2e_ms"]["p50"], p99=d["e2e_ms"]["p99"],
                cpu=d["client_cpu_us_per_request"])
def gl(name):
    b = json.load(open(f"{out}/{name}.json"))["benchmarks"][0]
    m = b["metrics"]
    lat = m["request_latency"]["successful"]
    tot = m["request_totals"]
    n = tot["successful"]
    return dict(n=n, failed=tot.get("errored", 0), s=b["duration"], rps=n / b["duration"],
                p50=lat["percentiles"]["p50"] * 1e3, p99=lat["percentiles"]["p99"] * 1e3,
                cpu=None)
rows = [("tapedeck replay", f"closed, c={conc}, 1-turn", td("td_tput")),
        ("tapedeck replay", f"closed, c={conc}, 4-turn", td("td_tput4")),
        ("guidellm", f"concurrent, streams={conc}", gl("gl_tput")),
        ("tapedeck replay", "closed, c=1", td("td_lat")),
        ("guidellm", "concurrent, streams=1", gl("gl_lat"))]
print()
print(f"fake target: 1 worker thread, {tokens} streamed output tokens per request, no delay "
      "(server work ~ 0, so client-measured latency is client + loopback overhead)")
print("| tool | pacing | requests | failed | duration s | req/s | E2E p50 ms | E2E p99 ms "
      "| client CPU µs/req |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for tool, pacing, r in rows:
    cpu = "-" if r["cpu"] is None else f"{r['cpu']:.0f}"
    print(f"| {tool} | {pacing} | {r['n']} | {r['failed']} | {r['s']:.2f} | {r['rps']:.0f} "
          f"| {r['p50']:.3f} | {r['p99']:.3f} | {cpu} |")
a, b = rows[0][2]["rps"], rows[2][2]["rps"]
print(f"\nrequest-rate ratio tapedeck / guidellm at concurrency {conc}: {a / b:.1f}x (goal >= 10x)")
print(f"client overhead at concurrency 1 (E2E p50 against a ~0 ms server): "
      f"tapedeck {rows[3][2]['p50']:.3f} ms, guidellm {rows[4][2]['p50']:.3f} ms")
json.dump({"rows": [dict(tool=t, pacing=p, **r) for t, p, r in rows], "ratio": a / b},
          open(f"{out}/summary.json", "w"), indent=2)
PY
