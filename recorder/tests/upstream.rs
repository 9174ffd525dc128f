//! Upstream mode end to end: a real tapedeck server (the engine on `fixtures/models/tiny-qwen2`)
//! is the upstream, and an upstream-mode tapedeck in front of it records to its own database.
//! The client sees what a direct request sees; the proxy's records hold the output, times, finish
//! reason, and (with the local tokenizer) the same prompt token IDs as the upstream's records.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::temp_store;
use serde_json::{json, Value};
use tapedeck_engine::tokenizer::Tokenizer;
use tapedeck_engine::Engine;
use tapedeck_recorder::server::{run, AppOptions, AppState};
use tapedeck_recorder::upstream::{UpstreamBackend, UpstreamConfig};
use tapedeck_recorder::{Backend, EngineBackend, RequestRecord};
use tokio::sync::oneshot;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/tiny-qwen2")
}

struct Server {
    base: String,
    state: AppState,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

async fn serve(backend: Arc<dyn Backend>) -> Server {
    let (dir, store) = temp_store().await;
    let state = AppState::new(backend, store, AppOptions::default())
        .await
        .unwrap();
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
        stop: tx,
        task,
        _dir: dir,
    }
}

async fn upstream_server() -> Server {
    let engine = Arc::new(Engine::load(&model_dir()).expect("fixture model loads"));
    serve(Arc::new(EngineBackend::new(engine, 16))).await
}

async fn proxy(upstream: &Server, tokenizer: bool, logprobs: Option<u32>) -> Server {
    let mut cfg = UpstreamConfig::new(format!("{}/v1", upstream.base));
    cfg.tokenizer = tokenizer.then(model_dir);
    cfg.logprobs = logprobs;
    serve(Arc::new(UpstreamBackend::connect(cfg).await.unwrap())).await
}

impl Server {
    async fn post_raw(&self, path: &str, body: Vec<u8>) -> reqwest::Response {
        reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .header("user-agent", "upstream-test/1")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.post_raw(path, serde_json::to_vec(body).unwrap()).await
    }

    async fn records(&self) -> Vec<RequestRecord> {
        self.state.writer().flush().await.unwrap();
        let store = self.state.store();
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT id FROM requests ORDER BY arrival_us, rowid")
                .fetch_all(store.pool())
                .await
                .unwrap();
        let mut out = Vec::new();
        for id in ids {
            out.push(store.request(id.parse().unwrap()).await.unwrap().unwrap());
        }
        out
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

fn chat(stream: bool) -> Value {
    json!({
        "model": "tiny-qwen2",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about tapes."},
        ],
        "temperature": 0,
        "max_tokens": 10,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// Content, finish reason, and whether any chunk carried logprobs.
fn streamed(body: &str) -> (String, Option<String>, bool, bool) {
    let mut content = String::new();
    let mut finish = None;
    let mut logprobs = false;
    let mut done = false;
    for e in events(body) {
        if e == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        if let Some(c) = v["choices"].get(0) {
            content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
            logprobs |= !c["logprobs"].is_null();
        }
    }
    (content, finish, logprobs, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_chat_matches_direct_and_is_recorded() {
    let up = upstream_server().await;
    let px = proxy(&up, true, None).await;

    // Non-streaming.
    let direct: Value = up
        .post("/v1/chat/completions", &chat(false))
        .await
        .json()
        .await
        .unwrap();
    let resp = px.post("/v1/chat/completions", &chat(false)).await;
    assert_eq!(resp.status(), 200);
    let proxied: Value = resp.json().await.unwrap();
    assert_eq!(proxied["choices"], direct["choices"]);
    assert_eq!(proxied["usage"], direct["usage"]);
    let content = direct["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.is_empty());

    // Streaming: same text, same finish reason, the stream ends with [DONE].
    let direct = up
        .post("/v1/chat/completions", &chat(true))
        .await
        .text()
        .await
        .unwrap();
    let resp = px.post("/v1/chat/completions", &chat(true)).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let proxied = resp.text().await.unwrap();
    let (d_text, d_finish, _, _) = streamed(&direct);
    let (p_text, p_finish, _, p_done) = streamed(&proxied);
    assert_eq!(p_text, d_text);
    assert_eq!(p_text, content);
    assert_eq!(p_finish, d_finish);
    assert!(p_done);
    assert_eq!(events(&proxied).len(), events(&direct).len());

    // A malformed request: the upstream's 400 and error body pass through and are recorded.
    let bad = br#"{"model": "tiny-qwen2", "messages": "#.to_vec();
    let d = up.post_raw("/v1/chat/completions", bad.clone()).await;
    let d_status = d.status();
    let d_body: Value = d.json().await.unwrap();
    let p = px.post_raw("/v1/chat/completions", bad).await;
    assert_eq!(p.status(), d_status);
    assert_eq!(p.status(), 400);
    let p_body: Value = p.json().await.unwrap();
    assert_eq!(p_body, d_body);
    assert!(p_body["error"]["message"].is_string());

    let ups = up.records().await;
    let recs = px.records().await;
    assert_eq!(recs.len(), 3);
    // The upstream saw: direct, proxied, direct, proxied, direct bad, proxied bad.
    assert_eq!(ups.len(), 6);
    let build = px
        .state
        .store()
        .build(recs[0].build_id.unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(build.backend, "upstream");
    assert_eq!(build.device, format!("{}/v1", up.base));
    for (i, r) in recs[..2].iter().enumerate() {
        let upstream_rec = &ups[2 * i + 1];
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.error.is_none());
        assert_eq!(r.headers["user-agent"], "upstream-test/1");
        assert!(r.request_body.contains("haiku"));
        assert_eq!(
            r.prompt_ids, upstream_rec.prompt_ids,
            "prompt IDs as encoded upstream"
        );
        assert!(r.prompt_ids.as_ref().is_some_and(|p| !p.is_empty()));
        let out = r.output.as_ref().unwrap();
        let up_out = upstream_rec.output.as_ref().unwrap();
        assert_eq!(out.content, content);
        assert_eq!(out.text, up_out.text);
        assert_eq!(out.finish_reason, up_out.finish_reason);
        assert!(!out.token_ids.is_empty());
        assert_eq!(out.token_offsets_us.len(), out.token_ids.len());
        assert!(out.token_offsets_us.windows(2).all(|w| w[0] <= w[1]));
        let first = r.first_token_us().unwrap();
        assert!(first >= r.arrival_us && first <= r.end_us);
        assert!(r.session.is_some());
    }
    // The streamed one has per-chunk times.
    let offs = &recs[1].output.as_ref().unwrap().token_offsets_us;
    assert!(offs.first() < offs.last(), "{offs:?}");
    let bad = &recs[2];
    assert_eq!(bad.status, 400);
    assert!(bad.error.as_deref().unwrap().contains("error"));
    assert!(bad.output.is_none());
    // Both good requests are the same first turn: two sessions, each turn 0.
    assert_eq!(recs[0].session.as_ref().unwrap().turn, 0);

    px.stop().await;
    up.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_stitches_turns_and_records_requested_logprobs() {
    let up = upstream_server().await;
    let px = proxy(&up, true, Some(3)).await;

    // Turn 1 (streaming), without logprobs: the proxy asks for 3 and strips them.
    let resp = px.post("/v1/chat/completions", &chat(true)).await;
    assert_eq!(resp.status(), 200);
    let (answer, _, logprobs, _) = streamed(&resp.text().await.unwrap());
    assert!(!logprobs, "logprobs were stripped from the client's stream");

    // Turn 2 (non-streaming) extends turn 1 plus its answer.
    let mut next = chat(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": answer}),
        json!({"role": "user", "content": "Another."}),
    ]);
    let v: Value = px
        .post("/v1/chat/completions", &next)
        .await
        .json()
        .await
        .unwrap();
    assert!(v["choices"][0]["logprobs"].is_null());

    // Legacy completions pass through too.
    let c: Value = px
        .post(
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert!(c["choices"][0]["text"].is_string());

    let ups = up.records().await;
    let recs = px.records().await;
    assert_eq!(recs.len(), 3);
    let (s1, s2) = (
        recs[0].session.as_ref().unwrap(),
        recs[1].session.as_ref().unwrap(),
    );
    assert_eq!(s1.id, s2.id, "turn 2 continues turn 1's session");
    assert_eq!(s2.turn, 1);
    assert_eq!(s2.parent, Some(recs[0].id));
    let tok = Tokenizer::from_dir(&model_dir()).unwrap();
    let (mut mapped, mut asked) = (0, 0);
    for (r, u) in recs.iter().zip(&ups) {
        let out = r.output.as_ref().unwrap();
        let up_out = u.output.as_ref().unwrap();
        assert_eq!(
            out.logits.len(),
            up_out.token_ids.len(),
            "one summary per token"
        );
        // Output IDs: the upstream's tokens mapped to local IDs when every one maps (a token
        // that is a fragment of a UTF-8 character has no exact text), else the text tokenized.
        assert!(
            out.token_ids == up_out.token_ids || out.token_ids == tok.encode(&out.text).unwrap(),
            "{:?} vs {:?}",
            out.token_ids,
            up_out.token_ids
        );
        for (a, b) in out.logits.iter().zip(&up_out.logits) {
            assert!((a.logprob - b.logprob).abs() < 1e-3);
            assert!(a.top.len() <= 3);
            for &(id, lp) in &a.top {
                assert!(b.top.iter().any(|&(i, l)| i == id && (l - lp).abs() < 1e-3));
            }
            mapped += a.top.len();
            asked += 3;
        }
        assert_eq!(r.prompt_ids, u.prompt_ids);
    }
    assert!(
        mapped * 10 >= asked * 8,
        "{mapped} of {asked} alternatives mapped"
    );
    px.stop().await;
    up.stop().await;
}

#[tokio::test]
async fn unreachable_upstream_is_a_recorded_502() {
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let backend = UpstreamBackend::connect(UpstreamConfig::new(url))
        .await
        .unwrap();
    assert_eq!(backend.info().backend, "upstream");
    let px = serve(Arc::new(backend)).await;
    let resp = px.post("/v1/chat/completions", &chat(false)).await;
    assert_eq!(resp.status(), 502);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "upstream_error");
    let recs = px.records().await;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].status, 502);
    assert!(recs[0].prompt_ids.is_none(), "no tokenizer: no token IDs");
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_is_recorded_and_cancels_upstream() {
    use futures::StreamExt;
    let up = upstream_server().await;
    let px = proxy(&up, false, None).await;
    let mut body = chat(true);
    body["max_tokens"] = json!(4000);
    body["ignore_eos"] = json!(true);
    let resp = px.post("/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    let mut recs = Vec::new();
    for _ in 0..100 {
        recs = px.records().await;
        if !recs.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(recs.len(), 1);
    assert!(recs[0].client_disconnected);
    let out = recs[0].output.as_ref().unwrap();
    assert_eq!(out.finish_reason.as_deref(), Some("cancelled"));
    assert!(out.token_ids.is_empty(), "no tokenizer: no output IDs");
    // The upstream request was dropped too, long before 4000 tokens.
    let mut ups = Vec::new();
    for _ in 0..100 {
        ups = up.records().await;
        if !ups.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(ups.len(), 1);
    assert!(
        ups[0].client_disconnected,
        "{:?}",
        ups[0].output.as_ref().map(|o| o.token_ids.len())
    );
    px.stop().await;
    up.stop().await;
}
