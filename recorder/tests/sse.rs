//! Streaming over a real socket (port 0, reqwest): chunk order, reasoning and tool-call deltas,
//! the usage chunk and `[DONE]`, client disconnects, and the records they leave behind.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{scripted_app, Scripted};
use futures::StreamExt;
use serde_json::{json, Value};
use tapedeck_recorder::server::{run, AppOptions, AppState};
use tokio::sync::oneshot;

struct Server {
    base: String,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

async fn start(backend: Arc<Scripted>) -> Server {
    let (dir, state) = scripted_app(backend, AppOptions::default()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let st = state.clone();
    let task = tokio::spawn(async move {
        run(listener, st, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    Server {
        base,
        state,
        stop: Some(tx),
        task,
        _dir: dir,
    }
}

impl Server {
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap();
    }
}

/// The `data:` payloads of an SSE body, in order.
fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.trim().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_chunk_order_usage_and_done() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["<think>|plan| it|</think>|\n\nOK|, reading.|\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>"]);
    let server = start(backend).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/chat/completions", server.base))
        .header("x-session-id", "sess-1")
        .json(&json!({
            "model": "scripted",
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "go"}],
            "tools": [{"type": "function", "function": {"name": "read", "parameters": {}}}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let body = resp.text().await.unwrap();
    let ev = events(&body);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    // First: the role.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["delta"])
        .collect();
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| d["reasoning_content"].as_str())
        .collect();
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(reasoning, "plan it");
    assert_eq!(content, "OK, reading.");
    // Reasoning comes before content, content before the tool call.
    let pos = |f: &dyn Fn(&Value) -> bool| deltas.iter().position(|d| f(d)).unwrap();
    let first_reasoning = pos(&|d| d["reasoning_content"].is_string());
    let first_content = pos(&|d| d["content"].as_str().is_some_and(|s| !s.is_empty()));
    let first_call = pos(&|d| d["tool_calls"].is_array());
    assert!(first_reasoning < first_content && first_content < first_call);
    let call_head = &deltas[first_call]["tool_calls"][0];
    assert_eq!(call_head["index"], 0);
    assert_eq!(call_head["type"], "function");
    assert_eq!(call_head["function"]["name"], "read");
    assert!(call_head["id"].as_str().unwrap().starts_with("call_"));
    let args: String = deltas
        .iter()
        .filter_map(|d| d["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(args, r#"{"path":"a"}"#);
    // Then the finish reason, then usage with no choices.
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 7);
    assert!(chunks[..n - 2]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    server.state.writer().flush().await.unwrap();
    let sessions = server.state.store().sessions().await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].id, "sess-1");
    let recs = server
        .state
        .store()
        .session_requests("sess-1")
        .await
        .unwrap();
    assert_eq!(recs.len(), 1);
    let out = recs[0].output.as_ref().unwrap();
    assert_eq!(out.content, "OK, reading.");
    assert_eq!(out.tool_calls[0].id, call_head["id"].as_str().unwrap());
    assert!(!recs[0].client_disconnected);
    assert_eq!(recs[0].headers["x-session-id"], "sess-1");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_without_usage_and_completions_stream() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["a|b"]);
    let server = start(backend).await;
    let client = reqwest::Client::new();
    let body = client
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let ev = events(&body);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(last.get("usage").is_none());

    let body = client
        .post(format!("{}/v1/completions", server.base))
        .json(
            &json!({"stream": true, "prompt": "hi", "echo": true, "max_tokens": 4,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let ev = events(&body);
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "hiab");
    assert_eq!(chunks[0]["object"], "text_completion");
    assert_eq!(chunks[chunks.len() - 1]["usage"]["total_tokens"], 4);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_and_is_recorded() {
    let mut b = Scripted::new(4096);
    b.delay = Duration::from_millis(20);
    let backend = Arc::new(b);
    let long: Vec<String> = (0..500).map(|i| format!("t{i} ")).collect();
    *backend.replies.lock().unwrap() = vec![long];
    let server = start(backend).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"stream": true, "messages": [{"role": "user", "content": "talk"}]}))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    // Read until a content delta has arrived, then hang up.
    let mut seen = String::new();
    while !seen.contains("t1") {
        let chunk = stream.next().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(stream);
    // The driver notices, cancels the generation and records; wait for the record (generously:
    // 500 tokens at 20 ms would take 10 s, so a short wait proves cancellation).
    let store = server.state.store().clone();
    let mut rec = None;
    for _ in 0..200 {
        server.state.writer().flush().await.unwrap();
        if store.count_requests().await.unwrap() == 1 {
            let id: String = sqlx::query_scalar("SELECT id FROM requests")
                .fetch_one(store.pool())
                .await
                .unwrap();
            rec = store.request(id.parse().unwrap()).await.unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let rec = rec.expect("the disconnected request was recorded within 5 s");
    assert!(rec.client_disconnected);
    let out = rec.output.unwrap();
    assert_eq!(out.finish_reason.as_deref(), Some("cancelled"));
    assert!(out.token_ids.len() < 500, "generation was not cancelled");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_before_the_first_token_keep_their_status_when_streaming() {
    let backend = Arc::new(Scripted::new(16));
    let server = start(backend).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"stream": true, "messages": [{"role": "user", "content": "much too long for sixteen"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_mid_stream_is_a_final_error_event_and_recorded() {
    let mut b = Scripted::new(4096);
    b.fail_after = Some(2);
    let backend = Arc::new(b);
    backend.script(&["a|b|c|d"]);
    let server = start(backend).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ev = events(&resp.text().await.unwrap());
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error");
    // Internal details are not sent...
    assert!(!last.to_string().contains("GPU"));
    assert!(!ev.iter().any(|e| e == "[DONE]"));
    server.state.writer().flush().await.unwrap();
    let id: String = sqlx::query_scalar("SELECT id FROM requests")
        .fetch_one(server.state.store().pool())
        .await
        .unwrap();
    let rec = server
        .state
        .store()
        .request(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    // ...but they are recorded, with the tokens that made it out.
    assert!(rec.error.as_deref().unwrap().contains("GPU fell off"));
    assert_eq!(rec.status, 200);
    let out = rec.output.unwrap();
    assert_eq!(out.finish_reason.as_deref(), Some("error"));
    assert_eq!(out.token_ids.len(), 2);
    server.stop().await;
}

/// Recording under load over a real socket: 1000 streamed requests from 16 concurrent clients,
/// every one recorded, nothing dropped. Prints the rate (not asserted: machines differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recording_keeps_up_with_many_streams() {
    let backend = Arc::new(Scripted::new(1 << 16));
    backend.script(&["one| two| three| four| five| six| seven| eight"]);
    let server = start(backend).await;
    let client = reqwest::Client::new();
    let start_t = std::time::Instant::now();
    let per_client = 1000 / 16 + 1;
    let mut tasks = Vec::new();
    for c in 0..16 {
        let client = client.clone();
        let url = format!("{}/v1/chat/completions", server.base);
        tasks.push(tokio::spawn(async move {
            for i in 0..per_client {
                let body = json!({"stream": true, "messages": [
                    {"role": "system", "content": "x".repeat(2000)},
                    {"role": "user", "content": format!("client {c} request {i}")}]});
                let text = client
                    .post(&url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap();
                assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = start_t.elapsed().as_secs_f64();
    server.state.writer().flush().await.unwrap();
    let stats = server.state.writer().stats();
    let n = 16 * per_client as u64;
    eprintln!(
        "{n} streamed requests in {secs:.2} s: {:.0} requests/s recorded, {} transactions",
        n as f64 / secs,
        stats.batches
    );
    assert_eq!((stats.written, stats.dropped, stats.failed), (n, 0, 0));
    server.stop().await;
}
