"""Checks what opencode sent to `tapedeck serve`, from `tapedeck sessions export`.

Usage: check_opencode.py TAPEDECK_BIN DB RUNS   (RUNS: how many `opencode run` invocations were made)
Exits non-zero with a message on the first failed check. Every check prints a line.
"""
import json
import subprocess
import sys
import time

BIN, DB, RUNS = sys.argv[1], sys.argv[2], int(sys.argv[3])
failed = 0


def check(ok, what, detail=""):
    global failed
    print(("ok   " if ok else "FAIL ") + what + (f": {str(detail)[:600]}" if detail and not ok else ""))
    if not ok:
        failed += 1
    return ok


def export():
    out = subprocess.run([BIN, "sessions", "export", "--db", DB], check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def ua(r):
    return r["headers"].get("user-agent", "")


# recording is off the request path: wait until the request count stops changing
prev, lines = -1, []
for _ in range(40):
    lines = export()
    n = sum(len(l["requests"]) for l in lines)
    if n == prev and n > 0:
        break
    prev = n
    time.sleep(0.5)

oc = [l for l in lines if any(ua(r).startswith("opencode/") for r in l["requests"])]
reqs = [r for l in oc for r in l["requests"]]
check(len(reqs) >= 1 + RUNS, f"opencode requests recorded ({len(reqs)})", "expected a title request and one agent turn per run")

# every request opencode made is in the export and was answered (no 4xx/5xx: the prompt fits)
bad = [(r["turn"], r["kind"], r["status"], r["error"]) for r in reqs if r["status"] != 200 or r["error"]]
check(not bad, "every opencode request answered 200", bad)

# one session, identified by the x-session-id header opencode sends
check(len(oc) == 1, f"opencode traffic forms ONE session ({len(oc)})", [l["session"]["id"] for l in oc])
if not oc:
    sys.exit(1)
s = oc[0]
sid = s["session"]["id"]
check(s["session"]["source"] == "header", "session source is header", s["session"]["source"])
check(all(r["headers"].get("x-session-id") == sid for r in s["requests"]), "every request carries x-session-id == session id")
check(all(r["stitch"] == "header" for r in s["requests"]), "every request stitched by header", [r["stitch"] for r in s["requests"]])
check([r["turn"] for r in s["requests"]] == list(range(len(s["requests"]))), "turns are 0..n-1 in order")
check(s["session"]["client_hint"] and s["session"]["client_hint"].startswith("opencode/"), "client_hint is opencode's user agent", s["session"]["client_hint"])

# the title request is a side request
titles = [r for r in s["requests"] if r["kind"] == "title"]
check(len(titles) == 1, f"one title request ({len(titles)})", [(r["turn"], r["kind"]) for r in s["requests"]])
for t in titles:
    sysmsg = (t["messages"] or [{}])[0]
    check("title" in json.dumps(sysmsg).lower(), "title request asks for a title")
    check(not t["tools"], "title request offers no tools")

# agent turns: one per run, each extends the previous turn's messages plus its answer
agents = [r for r in s["requests"] if r["kind"] == "agent"]
compactions = [r for r in s["requests"] if r["kind"] == "compaction"]
check(not compactions, "no compaction (the prompt fits the context)", [r["turn"] for r in compactions])
check(len(agents) >= RUNS, f"agent turns >= runs ({len(agents)} >= {RUNS})", [(r["turn"], r["kind"]) for r in s["requests"]])
check(all(r["tools"] for r in agents), "agent turns offer tools")
check(all(r["params"].get("stream") is True for r in agents), "agent turns stream")
for a, b in zip(agents, agents[1:]):
    ma, mb = a["messages"], b["messages"]
    check(len(mb) > len(ma) and mb[: len(ma)] == ma, f"turn {b['turn']} messages extend turn {a['turn']}'s",
          f"{len(ma)} -> {len(mb)} messages")
    if len(mb) > len(ma):
        nxt = mb[len(ma)]
        check(nxt.get("role") == "assistant", f"turn {b['turn']} carries turn {a['turn']}'s answer next", nxt.get("role"))
        ans = (a["response"] or {}).get("content") or ""
        check((nxt.get("content") or "").strip() == ans.strip(), f"turn {b['turn']} carries turn {a['turn']}'s recorded answer verbatim",
              f"{(nxt.get('content') or '')[:80]!r} vs {ans[:80]!r}")
    check(b["parent_id"] == a["id"], f"turn {b['turn']} parent is turn {a['turn']}", b["parent_id"])

print(f"opencode checks: {failed} failed")
sys.exit(1 if failed else 0)
