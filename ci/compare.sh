#!/usr/bin/env bash
# Release comparison: replay one session set against a baseline and a candidate, then let
# `tapedeck compare` judge them under a policy. Exit code: 0 pass, 1 fail, 2 could not compare.
#
#   ci/compare.sh --base TARGET --cand TARGET [--base-bin BIN] [--cand-bin BIN]
#                 [--sessions FILE|DB] [--record-with TARGET] [--policy FILE] [--out DIR]
#
# TARGET is what `tapedeck replay --target` takes: `engine:MODEL?toggles` (run in process by the
# given binary: two builds = two binaries) or an OpenAI-compatible base URL (two running servers).
# When --sessions is a JSONL file without recorded answers (e.g. fixtures/sessions/smoke.jsonl),
# it is first recorded through --record-with (default: the baseline target) with `synth record`,
# so that both replays compare against real token IDs and logits summaries.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
base="" cand="" base_bin="" cand_bin="" sessions="$here/fixtures/sessions/smoke.jsonl"
record_with="" policy="$here/ci/policy.toml" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --cand) cand="$2"; shift 2 ;;
    --base-bin) base_bin="$2"; shift 2 ;;
    --cand-bin) cand_bin="$2"; shift 2 ;;
    --sessions) sessions="$2"; shift 2 ;;
    --record-with) record_with="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "ci/compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$base" ] && [ -n "$cand" ] || { echo "ci/compare.sh: --base and --cand are required" >&2; exit 2; }
default_bin="$here/target/release/tapedeck"
base_bin="${base_bin:-$default_bin}"
cand_bin="${cand_bin:-$default_bin}"
for b in "$base_bin" "$cand_bin"; do
  [ -x "$b" ] || { echo "ci/compare.sh: no tapedeck binary at $b (cargo build --release)" >&2; exit 2; }
done
out="${out:-$(mktemp -d)}"
mkdir -p "$out"

case "$sessions" in
  *.jsonl|*.ndjson|*.json)
    db="$out/recorded.db"
    rm -f "$db" "$db-wal" "$db-shm"
    echo "== recording $sessions through ${record_with:-$base}"
    "$base_bin" synth record --sessions "$sessions" --target "${record_with:-$base}" --db "$db"
    sessions="$db" ;;
esac

echo "== baseline: $base"
"$base_bin" replay --sessions "$sessions" --target "$base" --json "$out/base.json" --quiet
echo "== candidate: $cand"
"$cand_bin" replay --sessions "$sessions" --target "$cand" --json "$out/cand.json" --quiet
echo "== compare"
set +e
"$cand_bin" compare "$out/base.json" "$out/cand.json" --policy "$policy" \
  --junit "$out/junit.xml" --markdown "$out/summary.md"
code=$?
set -e
"$cand_bin" report "$out/cand.json" --format html -o "$out/report.html"
echo "verdict exit code $code; artifacts in $out (junit.xml, summary.md, report.html, base.json, cand.json)"
exit $code
