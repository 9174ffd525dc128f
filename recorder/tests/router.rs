//! The HTTP protocol layer without a socket (`tower::ServiceExt::oneshot`): error shapes and
//! statuses, non-streaming chat and completions, the auxiliary endpoints, and that every request
//! — failures included — is recorded.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{scripted_app, Scripted};
use serde_json::{json, Value};
use tapedeck_recorder::record::{Endpoint, RequestKind, StitchMethod};
use tapedeck_recorder::server::{app, AppOptions, AppState};
use tapedeck_recorder::RequestRecord;
use tower::ServiceExt;

async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    body: Body,
) -> (StatusCode, Value, axum::http::HeaderMap) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .header("user-agent", "opencode/0.9 test")
        .header("authorization", "Bearer secret")
        .body(body)
        .unwrap();
    let resp = app(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v, headers)
}

async fn post(state: &AppState, path: &str, body: Value) -> (StatusCode, Value) {
    let (s, v, _) = call(state, "POST", path, Body::from(body.to_string())).await;
    (s, v)
}

/// All records, oldest first.
async fn records(state: &AppState) -> Vec<RequestRecord> {
    state.writer().flush().await.unwrap();
    let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM requests ORDER BY arrival_us, rowid")
        .fetch_all(state.store().pool())
        .await
        .unwrap();
    let mut out = Vec::new();
    for id in ids {
        out.push(
            state
                .store()
                .request(id.parse().unwrap())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    out
}

fn assert_openai_error(v: &Value, code: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    if let Some(c) = code {
        assert_eq!(e["code"], c, "{v}");
    }
}

async fn app_with(backend: Arc<Scripted>) -> (tempfile::TempDir, AppState) {
    scripted_app(
        backend,
        AppOptions {
            body_limit: 64 * 1024,
            ..AppOptions::default()
        },
    )
    .await
}

#[tokio::test]
async fn malformed_and_mistyped_bodies_are_400_and_recorded() {
    let (_d, state) = app_with(Arc::new(Scripted::new(4096))).await;
    let (s, v, _) = call(
        &state,
        "POST",
        "/v1/chat/completions",
        Body::from("{\"model\": \"scripted\", "),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v, None);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("malformed JSON"));

    let (s, v) = post(&state, "/v1/chat/completions", json!({"messages": "hello"})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v, None);

    let (s, v) = post(&state, "/v1/completions", json!({"prompt": {"a": 1}})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");

    let recs = records(&state).await;
    assert_eq!(recs.len(), 3);
    assert_eq!(recs[0].status, 400);
    assert_eq!(recs[0].request_body, "{\"model\": \"scripted\", ");
    assert!(recs[0].error.as_deref().unwrap().contains("malformed"));
    assert_eq!(recs[2].endpoint, Endpoint::Completions);
    // Credentials are never recorded; other headers are.
    assert!(!recs[0].headers.contains_key("authorization"));
    assert_eq!(recs[0].headers["user-agent"], "opencode/0.9 test");
}

#[tokio::test]
async fn unknown_model_empty_messages_and_bad_params() {
    let (_d, state) = app_with(Arc::new(Scripted::new(4096))).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (s, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"model": "gpt-9", "messages": msgs}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_openai_error(&v, Some("model_not_found"));

    let (s, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"model": "scripted", "messages": []}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "messages");

    for bad in [
        json!({"messages": msgs, "top_logprobs": 21, "logprobs": true}),
        json!({"messages": msgs, "temperature": -1}),
        json!({"messages": msgs, "top_p": 0}),
        json!({"messages": msgs, "n": 2}),
        json!({"messages": msgs, "max_tokens": 0}),
    ] {
        let (s, v) = post(&state, "/v1/chat/completions", bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad} -> {v}");
        assert_openai_error(&v, None);
    }
    let recs = records(&state).await;
    assert_eq!(recs.len(), 7);
    assert!(recs.iter().all(|r| r.status >= 400 && r.error.is_some()));
    assert_eq!(recs[0].model.as_deref(), Some("gpt-9"));
}

#[tokio::test]
async fn oversized_body_is_413() {
    let (_d, state) = app_with(Arc::new(Scripted::new(4096))).await;
    let big = "x".repeat(100 * 1024);
    let (s, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": big}]}),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_openai_error(&v, None);
    let recs = records(&state).await;
    assert_eq!(recs[0].status, 413);
}

#[tokio::test]
async fn prompt_over_the_context_window_is_400() {
    let (_d, state) = app_with(Arc::new(Scripted::new(32))).await;
    let (s, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "this prompt is longer than thirty-two bytes"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v, Some("context_length_exceeded"));
    let (s, v) = post(
        &state,
        "/v1/completions",
        json!({"prompt": "z".repeat(40), "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_openai_error(&v, Some("context_length_exceeded"));
    let recs = records(&state).await;
    // The prompt was encoded before the check: its IDs are in the record.
    assert!(recs[0].prompt_ids.as_ref().unwrap().len() > 32);
}

#[tokio::test]
async fn overload_is_429_with_retry_after() {
    let backend = Arc::new(Scripted::new(4096));
    backend.overloaded.store(true, Ordering::Relaxed);
    let (_d, state) = app_with(backend).await;
    let (s, v, headers) = call(
        &state,
        "POST",
        "/v1/chat/completions",
        Body::from(json!({"messages": [{"role": "user", "content": "hi"}]}).to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_openai_error(&v, Some("rate_limit_exceeded"));
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(records(&state).await[0].status, 429);
}

#[tokio::test]
async fn chat_non_stream_with_reasoning_and_tool_calls() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["<think>|\nI should| read it.\n|</think>|\n\nLet me| look.|\n<tool|_call>\n{\"name\": \"read\", |\"arguments\": {\"path\": \"src/main.rs\"}}\n</tool_call>"]);
    let (_d, state) = app_with(backend.clone()).await;
    let tools = json!([{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]);
    let (s, v) = post(
        &state,
        "/v1/chat/completions",
        json!({
            "model": "scripted",
            "messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "read main"}],
            "tools": tools,
            "logprobs": true,
            "top_logprobs": 3,
            "temperature": 0,
            "some_vendor_field": {"x": 1},
        }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let msg = &choice["message"];
    assert_eq!(msg["role"], "assistant");
    assert_eq!(msg["reasoning_content"], "I should read it.");
    // The scripted backend's parser finds nothing, so the server's own Hermes fallback parses.
    assert_eq!(msg["content"], "Let me look.");
    assert_eq!(msg["tool_calls"][0]["type"], "function");
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "read");
    assert_eq!(
        msg["tool_calls"][0]["function"]["arguments"],
        r#"{"path":"src/main.rs"}"#
    );
    assert!(msg["tool_calls"][0]["id"]
        .as_str()
        .unwrap()
        .starts_with("call_"));
    let lp = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 9);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(v["usage"]["completion_tokens"], 9);
    assert_eq!(
        v["usage"]["prompt_tokens"],
        backend.prompts.lock().unwrap()[0].len()
    );

    let recs = records(&state).await;
    let r = &recs[0];
    assert_eq!(r.status, 200);
    assert_eq!(r.kind, RequestKind::Agent);
    assert_eq!(r.endpoint, Endpoint::ChatCompletions);
    let out = r.output.as_ref().unwrap();
    assert_eq!(out.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(out.reasoning.as_deref(), Some("I should read it."));
    assert_eq!(out.tool_calls[0].function.name, "read");
    assert_eq!(out.token_ids.len(), 9);
    assert_eq!(out.token_offsets_us.len(), 9);
    assert!(out.token_offsets_us.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(out.logits.len(), 9);
    assert_eq!(
        out.logits[0].top.len(),
        8,
        "top-8 recorded whatever the client asked"
    );
    assert!(r.first_token_us().unwrap() >= r.arrival_us && r.end_us >= r.first_token_us().unwrap());
    assert!(r.request_body.contains("some_vendor_field"));
    assert!(r.continuation_hash.is_some());
    assert_eq!(r.session.as_ref().unwrap().stitch, StitchMethod::New);
    assert!(r.build_id.is_some());
}

#[tokio::test]
async fn chat_stop_and_length_finish_reasons() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["a|b|c|d"]);
    let (_d, state) = app_with(backend.clone()).await;
    let m = json!([{"role": "user", "content": "hi"}]);
    let (_, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"messages": m, "max_tokens": 2}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
    assert!(v["choices"][0]["logprobs"].is_null());
    let (_, v) = post(
        &state,
        "/v1/chat/completions",
        json!({"messages": m, "tool_choice": "none", "tools": []}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["content"], "abcd");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    // tool_choice "none" hides the tools from the template.
    let tools = json!([{"type": "function", "function": {"name": "ls", "parameters": {}}}]);
    post(
        &state,
        "/v1/chat/completions",
        json!({"messages": m, "tools": tools, "tool_choice": "none"}),
    )
    .await;
    post(
        &state,
        "/v1/chat/completions",
        json!({"messages": m, "tools": tools, "tool_choice": "auto"}),
    )
    .await;
    let prompts = backend.prompts.lock().unwrap().clone();
    let text = |p: &Vec<u32>| p.iter().map(|&b| b as u8 as char).collect::<String>();
    assert!(!text(&prompts[2]).contains("[1 tools]"));
    assert!(text(&prompts[3]).contains("[1 tools]"));
    let recs = records(&state).await;
    assert_eq!(recs[2].kind, RequestKind::Other);
    assert_eq!(recs[3].kind, RequestKind::Agent);
}

#[tokio::test]
async fn completions_scoring_returns_legacy_logprobs_and_ids() {
    let (_d, state) = app_with(Arc::new(Scripted::new(4096))).await;
    let (s, v) = post(
        &state,
        "/v1/completions",
        json!({"model": "scripted", "prompt": [72, 105, 33], "echo": true, "logprobs": 2, "max_tokens": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "Hi!");
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "i", "!"]));
    assert_eq!(lp["token_ids"], json!([72, 105, 33]));
    assert_eq!(lp["token_logprobs"], json!([null, -1.0, -1.0]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert!(lp["top_logprobs"][0].is_null());
    assert_eq!(lp["top_logprobs"][1]["i"], -1.0);
    assert_eq!(lp["top_token_ids"][1], json!([[105, -1.0], [106, -2.0]]));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 0);

    let recs = records(&state).await;
    let scores = recs[0].prompt_scores.as_ref().unwrap();
    assert_eq!(scores.from, 1);
    assert_eq!(scores.summaries.len(), 2);
    assert!(recs[0].output.is_none());
}

#[tokio::test]
async fn completions_generate_with_echo() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["x|y"]);
    let (_d, state) = app_with(backend).await;
    let (s, v) = post(
        &state,
        "/v1/completions",
        json!({"prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 5}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "abxy");
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["logprobs"]["tokens"], json!(["a", "b", "x", "y"]));
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 1, 2, 3]));
    assert_eq!(
        c["logprobs"]["token_logprobs"],
        json!([null, -1.0, -0.5, -0.5])
    );
    let (_, v) = post(&state, "/v1/completions", json!({"prompt": [[1, 2], [3]]})).await;
    assert_eq!(v["error"]["param"], "prompt");
    let (_, v) = post(&state, "/v1/completions", json!({"prompt": [1, 999]})).await;
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("vocabulary"));
}

#[tokio::test]
async fn models_health_metrics_and_unknown_routes() {
    let (_d, state) = app_with(Arc::new(Scripted::new(4096))).await;
    let (s, v, _) = call(&state, "GET", "/v1/models", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], "scripted");
    assert_eq!(v["data"][0]["max_model_len"], 4096);
    let (s, v, _) = call(&state, "GET", "/v1/models/scripted", Body::empty()).await;
    assert_eq!((s, v["id"].as_str()), (StatusCode::OK, Some("scripted")));
    let (s, v, _) = call(&state, "GET", "/v1/models/other", Body::empty()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_openai_error(&v, Some("model_not_found"));
    let (s, v, _) = call(&state, "GET", "/health", Body::empty()).await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ok")));
    post(
        &state,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    post(&state, "/v1/chat/completions", json!({"messages": []})).await;
    state.writer().flush().await.unwrap();
    let (s, v, headers) = call(&state, "GET", "/metrics", Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = v.as_str().unwrap();
    for needle in [
        "tapedeck_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "tapedeck_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1",
        "tapedeck_time_to_first_token_seconds_count 1",
        "tapedeck_inter_token_latency_seconds_count 1",
        "tapedeck_e2e_request_latency_seconds_count 2",
        "tapedeck_generation_tokens_total 2",
        "tapedeck_recorder_records_written_total 2",
        "tapedeck_recorder_records_dropped_total 0",
        "tapedeck_recorder_queue_depth 0",
        "tapedeck_requests_running 0",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let (s, v, _) = call(&state, "GET", "/v2/nothing", Body::empty()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_openai_error(&v, None);
}

/// Never panic on input: random bytes and randomly mangled requests all get an answer in OpenAI's
/// shape (or a 200), and every one of them is recorded.
#[tokio::test]
async fn random_bodies_never_panic_and_are_all_recorded() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let backend = Arc::new(Scripted::new(256));
    backend.script(&["ok"]);
    let (_d, state) = app_with(backend).await;
    let valid = json!({
        "model": "scripted",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "max_tokens": 3,
        "stop": ["x"],
        "logprobs": true,
        "top_logprobs": 2,
    })
    .to_string();
    let junk = [
        "null", "[]", "{}", "1e999", "\"s\"", "-1", "true", "{\"a\":", "[[[[[[[[", "\u{0}",
        "\u{fffd}",
    ];
    let n = 300;
    for i in 0..n {
        let body: Vec<u8> = match rng.random_range(0..4) {
            0 => (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            1 => {
                // Replace a random slice of a valid request with junk.
                let mut s = valid.clone();
                let a = rng.random_range(0..s.len());
                let b = (a + rng.random_range(0..20)).min(s.len());
                if s.is_char_boundary(a) && s.is_char_boundary(b) {
                    s.replace_range(a..b, junk[rng.random_range(0..junk.len())]);
                }
                s.into_bytes()
            }
            2 => {
                // A valid request with one field set to a value of the wrong type.
                let mut v: Value = serde_json::from_str(&valid).unwrap();
                let keys = [
                    "model",
                    "messages",
                    "tools",
                    "max_tokens",
                    "stop",
                    "logprobs",
                    "top_logprobs",
                    "temperature",
                    "seed",
                    "stream_options",
                    "tool_choice",
                    "prompt",
                ];
                let k = keys[rng.random_range(0..keys.len())];
                let j = junk[rng.random_range(0..7)];
                v[k] = serde_json::from_str(j).unwrap_or(Value::Null);
                v.to_string().into_bytes()
            }
            _ => valid.clone().into_bytes(),
        };
        let path = if i % 3 == 0 {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let (s, v, _) = call(&state, "POST", path, Body::from(body)).await;
        assert!(s.is_success() || s.is_client_error(), "{s}: {v}");
        if !s.is_success() {
            assert_openai_error(&v, None);
        }
    }
    assert_eq!(records(&state).await.len(), n);
}
