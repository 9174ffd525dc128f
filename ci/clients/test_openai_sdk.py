"""Real-client tests: the official OpenAI Python SDK against `tapedeck serve`.

Run by ci/client_tests.sh, which starts the server and sets
TAPEDECK_URL (http://127.0.0.1:PORT), TAPEDECK_BIN (the tapedeck binary) and TAPEDECK_DB
(the server's database). Every request carries its own `x-session-id`, so that each one is
exported as (part of) a session and the last test can check that all of them were recorded.
"""

import json
import os
import subprocess
import time
import uuid

import openai
import pytest

URL = os.environ["TAPEDECK_URL"].rstrip("/")
BIN = os.environ["TAPEDECK_BIN"]
DB = os.environ["TAPEDECK_DB"]
MODEL = os.environ.get("TAPEDECK_MODEL", "tiny-qwen2")

# session id -> (endpoint, expected status) for every request this file sends
SENT = {}
RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=URL + "/v1", api_key="sk-test-not-checked", max_retries=0, timeout=120)


def sid(name, endpoint="/v1/chat/completions", status=200):
    s = f"sdk-{RUN}-{name}"
    SENT[s] = (endpoint, status)
    return {"x-session-id": s}


MSGS = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hello."},
]


def test_models_list(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert MODEL in ids
    assert all(m.object == "model" for m in models.data)


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8, temperature=0, extra_headers=sid("chat")
    )
    assert r.object == "chat.completion"
    assert r.id
    assert r.model == MODEL
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=sid("stream"),
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1, "all chunks share one id"
    content_chunks = [ch for ch in chunks if ch.choices]
    text = "".join(ch.choices[0].delta.content or "" for ch in content_chunks)
    finishes = [ch.choices[0].finish_reason for ch in content_chunks if ch.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"]), finishes
    # include_usage: one last chunk with empty choices and the usage; none before it carry usage
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert 0 < last.usage.completion_tokens <= 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    # greedy: the stream says what the non-streaming answer says
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8, temperature=0, extra_headers=sid("stream-ref")
    )
    assert text == r.choices[0].message.content


def test_chat_streaming_without_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4, stream=True, extra_headers=sid("stream-nousage")
        )
    )
    assert chunks and all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_chat_tools_auto(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=16,
        temperature=0,
        extra_headers=sid("tools"),
    )
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason == "tool_calls":
        assert c.message.tool_calls
        for tc in c.message.tool_calls:
            assert tc.type == "function" and tc.id
            json.loads(tc.function.arguments)
    else:
        assert isinstance(c.message.content, str)


def test_chat_tools_streaming(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=16,
            stream=True,
            extra_headers=sid("tools-stream"),
        )
    )
    fin = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(fin) == 1 and fin[0] in ("stop", "length", "tool_calls")


def test_chat_tool_result_turn(client):
    """A conversation that already contains an assistant tool call and its result is accepted."""
    msgs = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8, extra_headers=sid("tool-result")
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_headers=sid("logprobs"),
    )
    c = r.choices[0]
    lp = c.logprobs.content
    assert len(lp) == r.usage.completion_tokens
    assert "".join(t.token for t in lp) == c.message.content
    for t in lp:
        assert t.logprob <= 0.0
        assert isinstance(t.bytes, list)
        assert bytes(t.bytes).decode("utf-8", errors="replace") is not None
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert abs(t.logprob - tops[0]) < 1e-4
        assert t.top_logprobs[0].token == t.token


def test_chat_logprobs_streaming(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_headers=sid("logprobs-stream"),
        )
    )
    entries = [
        t
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content
        for t in ch.choices[0].logprobs.content
    ]
    assert 1 <= len(entries) <= 4
    assert all(len(t.top_logprobs) == 2 for t in entries)


def test_completions_text(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, extra_headers=sid("cmpl", "/v1/completions")
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].text, str)
    assert 0 < r.usage.completion_tokens <= 5


def test_completions_score_token_ids(client):
    ids = [785, 1672, 315, 925, 374, 1209]  # tiny-qwen2's vocabulary is 2048 tokens
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        echo=True,
        logprobs=5,
        max_tokens=0,
        extra_headers=sid("score", "/v1/completions"),
    )
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == c.text
    assert len(lp.top_logprobs) == len(ids) and lp.top_logprobs[0] is None
    # token texts can collide as dict keys (e.g. two byte-fallback tokens both "\ufffd")
    assert all(1 <= len(t) <= 5 for t in lp.top_logprobs[1:])
    assert len(lp.text_offset) == len(ids)
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == len(ids)
    # tapedeck extensions (FORMAT.md §4) survive the SDK as extra fields
    extra = lp.model_dump()
    assert extra["token_ids"] == ids
    assert len(extra["top_token_ids"][1]) == 5


def test_error_empty_messages(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=MODEL, messages=[], max_tokens=4, extra_headers=sid("err-empty", status=400)
        )
    e = ei.value
    assert e.status_code == 400
    body = e.body  # the SDK unwraps {"error": {...}}
    assert isinstance(body, dict)
    assert isinstance(body.get("message"), str) and body["message"]
    assert body.get("type") == "invalid_request_error"
    assert "param" in body and "code" in body
    raw = e.response.json()
    assert set(raw) == {"error"}


def test_error_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(
            model="no-such-model", messages=MSGS, max_tokens=4, extra_headers=sid("err-model", status=404)
        )
    assert ei.value.status_code == 404
    assert isinstance(ei.value.body, dict) and ei.value.body.get("message")


def test_zz_export_endpoint_is_documented_path():
    """FORMAT.md §3: a request line's "endpoint" is the path, "/v1/chat/completions" or "/v1/completions"."""
    sessions = _wait_recorded()
    for s, (endpoint, _) in SENT.items():
        got = [r["endpoint"] for r in sessions[s]["requests"]]
        assert got and all(e == endpoint for e in got), (s, got)


def _wait_recorded():
    deadline = time.time() + 30
    while True:
        sessions = _export()
        missing = [s for s in SENT if s not in sessions]
        if not missing or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"not recorded: {missing}"
    return sessions


def _export():
    out = subprocess.run([BIN, "sessions", "export", "--db", DB], check=True, capture_output=True, text=True).stdout
    lines = [json.loads(l) for l in out.splitlines() if l.strip()]
    assert all(l["format"] == "tapedeck.session.v1" for l in lines)
    return {l["session"]["id"]: l for l in lines}


def test_zz_everything_recorded():
    """Last: every request above is in the database (recording is off the request path: poll)."""
    assert len(SENT) >= 10
    sessions = _wait_recorded()
    for s, (endpoint, status) in SENT.items():
        line = sessions[s]
        assert line["session"]["source"] == "header", (s, line["session"])
        reqs = line["requests"]
        assert len(reqs) >= 1
        assert all(r["headers"].get("x-session-id") == s for r in reqs)
        # credentials are never stored
        assert all("authorization" not in {k.lower() for k in r["headers"]} for r in reqs)
        assert reqs[0]["status"] == status, (s, reqs[0]["status"], reqs[0]["error"])
        if status != 200:
            assert reqs[0]["error"], (s, reqs[0])
        elif not s.endswith("-score"):  # max_tokens=0: no generation, so no response (FORMAT.md §3)
            assert reqs[0]["response"] is not None
            assert reqs[0]["headers"].get("user-agent", "").startswith("OpenAI/Python")
    # the stream and its reference are two requests, each in its own session
    assert sessions[f"sdk-{RUN}-stream"]["requests"][0]["params"].get("stream") is True
    # the error request kept its body as received
    err = sessions[f"sdk-{RUN}-err-empty"]["requests"][0]
    assert err["messages"] == []
    # the scoring request kept its prompt scores
    score = sessions[f"sdk-{RUN}-score"]["requests"][0]
    assert score["prompt_token_ids"] == [785, 1672, 315, 925, 374, 1209]
    assert score["prompt_scores"] is not None

    listing = subprocess.run([BIN, "sessions", "list", "--db", DB], check=True, capture_output=True, text=True).stdout
    for s in SENT:
        assert s in listing, f"{s} not in `sessions list`"
