#!/usr/bin/env bash
# Real-client tests against `tapedeck serve` (issue 4, "Real clients, in tests that run in CI"):
#   1. the official OpenAI Python SDK (ci/clients/test_openai_sdk.py, pytest)
#   2. the real opencode CLI (npm `opencode-ai`), two turns (`run`, then `run --continue`),
#      checked from the recorded sessions by ci/clients/check_opencode.py
# Installs what it needs into a temp dir: a Python venv with `openai pytest` (PyPI) and
# `opencode-ai` (npm; at run time opencode installs `@ai-sdk/openai-compatible` into its own cache).
# Needs: python3 (venv), node + npm, cargo, curl. CPU only.
# Env: TAPEDECK_BIN=path skips `cargo build --release`; CLIENT_TESTS_KEEP=1 keeps the temp dir.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tapedeck-clients.XXXXXX")
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
  if [ "${CLIENT_TESTS_KEEP:-0}" = 1 ]; then echo "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
die() { echo "client_tests: $*" >&2; exit 1; }
T0=$(date +%s)

echo "== client tests: installing (temp dir $TMP)"
python3 -m venv "$TMP/venv" || die "python3 -m venv failed"
"$TMP/venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==3.57.0" pytest || die "pip install failed"
mkdir -p "$TMP/npm"
(cd "$TMP/npm" && npm install --silent --no-audit --no-fund --no-save opencode-ai@1.18.33 >/dev/null) || die "npm install opencode-ai failed"
OPENCODE="$TMP/npm/node_modules/.bin/opencode"
"$OPENCODE" --version >/dev/null 2>&1 || die "opencode does not run"
echo "openai $("$TMP/venv/bin/python" -c 'import openai; print(openai.__version__)'), opencode $("$OPENCODE" --version)"

if [ -z "${TAPEDECK_BIN:-}" ]; then
  echo "== cargo build --release"
  cargo build --release --quiet || die "cargo build --release failed"
  TAPEDECK_BIN="$ROOT/target/release/tapedeck"
fi
[ -x "$TAPEDECK_BIN" ] || die "no binary at $TAPEDECK_BIN"

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
DB="$TMP/clients.db"
echo "== tapedeck serve on 127.0.0.1:$PORT"
"$TAPEDECK_BIN" serve --db "$DB" --listen "127.0.0.1:$PORT" >"$TMP/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$TMP/serve.log"; die "server exited"; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { cat "$TMP/serve.log"; die "server not healthy after 60 s"; }

PASSED=0; FAILED=0
pass() { echo "PASS $1"; PASSED=$((PASSED+1)); }
fail() { echo "FAIL $1"; FAILED=$((FAILED+1)); }

echo "== OpenAI Python SDK (pytest)"
if TAPEDECK_URL="http://127.0.0.1:$PORT" TAPEDECK_BIN="$TAPEDECK_BIN" TAPEDECK_DB="$DB" \
   "$TMP/venv/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/ci/clients/test_openai_sdk.py"; then
  pass "openai-sdk"
else
  fail "openai-sdk"
fi

echo "== opencode"
OCH="$TMP/opencode-home"; PROJ="$TMP/project"
mkdir -p "$OCH" "$PROJ"
sed "s/@PORT@/$PORT/" "$ROOT/ci/clients/opencode.json.in" >"$OCH/opencode.json"
printf 'hello\n' >"$PROJ/README.md"
(cd "$PROJ" && git init -q . 2>/dev/null || true)
oc() {
  (cd "$PROJ" && env HOME="$OCH" XDG_CONFIG_HOME="$OCH/.config" XDG_DATA_HOME="$OCH/.local/share" \
     XDG_CACHE_HOME="$OCH/.cache" XDG_STATE_HOME="$OCH/.local/state" OPENCODE_CONFIG="$OCH/opencode.json" \
     OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_SHARE=1 OPENCODE_DISABLE_MODELS_FETCH=1 \
     OPENCODE_DISABLE_LSP_DOWNLOAD=1 timeout 180 "$OPENCODE" run --agent tiny -m tapedeck/tiny-qwen2 "$@")
}
OC_OK=1
oc "Say hi and list the files here." >"$TMP/opencode1.out" 2>"$TMP/opencode1.err" || { OC_OK=0; echo "opencode run exited $?"; tail -c 2000 "$TMP/opencode1.err"; }
oc --continue "Now say goodbye." >"$TMP/opencode2.out" 2>"$TMP/opencode2.err" || { OC_OK=0; echo "opencode run --continue exited $?"; tail -c 2000 "$TMP/opencode2.err"; }
if [ "$OC_OK" = 1 ]; then pass "opencode runs (2 turns)"; else fail "opencode runs (2 turns)"; fi
if "$TMP/venv/bin/python" "$ROOT/ci/clients/check_opencode.py" "$TAPEDECK_BIN" "$DB" 2; then
  pass "opencode recording checks"
else
  fail "opencode recording checks"
fi

echo "== client tests took $(( $(date +%s) - T0 )) s"
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
