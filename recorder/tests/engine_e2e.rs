//! End to end through the real engine on the fixture models (`fixtures/models/tiny-qwen2`,
//! `tiny-llama`): what is served is what is recorded — prompt IDs equal the engine's own encoding,
//! output IDs and logits summaries match the stream, scoring the recorded output by teacher
//! forcing reproduces the logprobs of generation, and a disconnect cancels the engine.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::temp_store;
use futures::StreamExt;
use serde_json::{json, Value};
use tapedeck_engine::chat::EncodeOptions;
use tapedeck_engine::scheduler::SchedulerConfig;
use tapedeck_engine::{ChatMessage, Engine};
use tapedeck_recorder::server::{run, AppOptions, AppState};
use tapedeck_recorder::{EngineBackend, RequestRecord, SchedulerBackend};
use tokio::sync::oneshot;

fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

struct Server {
    base: String,
    state: AppState,
    engine: Arc<Engine>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// Which backend a test runs on: every test body below runs on both (see `on_every_backend!`).
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// `EngineBackend`: one generation at a time.
    Serial,
    /// `SchedulerBackend`: continuous batching with a prefix cache.
    Batched,
}

async fn start(model: &str, kind: Kind) -> Server {
    let engine = Arc::new(Engine::load(&model_dir(model)).expect("fixture model loads"));
    let (dir, store) = temp_store().await;
    let backend: Arc<dyn tapedeck_recorder::Backend> = match kind {
        Kind::Serial => Arc::new(EngineBackend::new(engine.clone(), 16)),
        Kind::Batched => {
            Arc::new(SchedulerBackend::start(engine.clone(), SchedulerConfig::default()).unwrap())
        }
    };
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
        engine,
        stop: tx,
        task,
        _dir: dir,
    }
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        reqwest::Client::new()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap()
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

fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn messages() -> Value {
    json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about tapes."},
    ])
}

async fn qwen2_chat_is_recorded_as_served(kind: Kind) {
    let server = start("tiny-qwen2", kind).await;
    let body = json!({"model": "tiny-qwen2", "messages": messages(), "temperature": 0, "max_tokens": 12,
                      "logprobs": true, "top_logprobs": 2});
    let resp = server.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!((1..=12).contains(&n), "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        n
    );

    // Greedy is deterministic: the same request streams the same answer.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let text = server
        .post("/v1/chat/completions", sbody)
        .await
        .text()
        .await
        .unwrap();
    let ev = events(&text);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    let msg = &v["choices"][0]["message"];
    assert_eq!(content, msg["content"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], n);

    let recs = server.records().await;
    assert_eq!(recs.len(), 2);
    let msgs: Vec<ChatMessage> = serde_json::from_value(messages()).unwrap();
    let enc = server
        .engine
        .encode_chat(
            &msgs,
            None,
            &EncodeOptions {
                add_generation_prompt: true,
                toggles: Default::default(),
            },
        )
        .unwrap();
    for r in &recs {
        assert_eq!(r.status, 200);
        assert_eq!(
            r.prompt_ids.as_deref(),
            Some(enc.ids.as_slice()),
            "prompt IDs are the engine's encoding"
        );
        assert_eq!(r.encoding_report.as_ref(), Some(&enc.report));
        let out = r.output.as_ref().unwrap();
        assert_eq!(out.token_ids.len(), n);
        assert_eq!(out.logits.len(), n);
        assert!(out.logits.iter().all(|s| s.top.len() == 8));
        assert_eq!(out.token_offsets_us.len(), n, "one arrival time per token");
        assert_eq!(out.content, msg["content"].as_str().unwrap());
    }
    assert_eq!(
        recs[0].output.as_ref().unwrap().token_ids,
        recs[1].output.as_ref().unwrap().token_ids
    );
    server.stop().await;
}

async fn scoring_the_recorded_output_reproduces_its_logprobs(kind: Kind) {
    let server = start("tiny-qwen2", kind).await;
    let resp = server
        .post(
            "/v1/chat/completions",
            json!({"messages": messages(), "temperature": 0, "max_tokens": 8, "ignore_eos": true}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let rec = server.records().await.remove(0);
    let prompt = rec.prompt_ids.clone().unwrap();
    let out = rec.output.clone().unwrap();
    let mut seq = prompt.clone();
    seq.extend(&out.token_ids);

    let v: Value = server
        .post(
            "/v1/completions",
            json!({"prompt": seq, "echo": true, "logprobs": 5, "max_tokens": 0}),
        )
        .await
        .json()
        .await
        .unwrap();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["token_ids"], json!(seq));
    assert!(lp["token_logprobs"][0].is_null());
    assert_eq!(lp["tokens"].as_array().unwrap().len(), seq.len());
    assert_eq!(lp["top_token_ids"][1].as_array().unwrap().len(), 5);
    let scored: Vec<f64> = lp["token_logprobs"].as_array().unwrap()[prompt.len()..]
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    for (i, (s, g)) in scored.iter().zip(&out.logits).enumerate() {
        assert!(
            (s - f64::from(g.logprob)).abs() < 1e-3,
            "token {i}: scored {s} vs generated {}",
            g.logprob
        );
    }
    let recs = server.records().await;
    let scores = recs[1].prompt_scores.as_ref().unwrap();
    assert_eq!(scores.summaries.len(), seq.len() - 1);
    server.stop().await;
}

async fn tools_reach_the_template_and_the_report(kind: Kind) {
    let server = start("tiny-qwen2", kind).await;
    let tools = json!([{"type": "function", "function": {"name": "read", "description": "Read a file",
        "parameters": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                       "properties": {"path": {"type": "string"}}}}}]);
    let msgs = json!([
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "read a.txt"},
        {"role": "assistant", "content": "", "reasoning_content": "I will read it.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    ]);
    let resp = server
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": tools, "temperature": 0, "max_tokens": 4}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let rec = server.records().await.remove(0);
    let report = rec.encoding_report.unwrap();
    assert!(report.tools_present);
    assert_eq!(rec.kind, tapedeck_recorder::RequestKind::Agent);
    let prompt_text = server
        .engine
        .tokenizer()
        .decode(rec.prompt_ids.as_ref().unwrap())
        .unwrap();
    assert!(
        prompt_text.contains("<tools>") && prompt_text.contains("<tool_response>"),
        "{prompt_text}"
    );
    server.stop().await;
}

async fn llama_serves_too(kind: Kind) {
    let server = start("tiny-llama", kind).await;
    let v: Value = server
        .post(
            "/v1/chat/completions",
            json!({"messages": messages(), "max_tokens": 5, "seed": 7, "temperature": 0.8}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "chat.completion", "{v}");
    let models: Value = reqwest::get(format!("{}/v1/models", server.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    assert!(models["data"][0]["max_model_len"].as_u64().unwrap() > 0);
    server.stop().await;
}

async fn disconnect_cancels_the_engine(kind: Kind) {
    let server = start("tiny-qwen2", kind).await;
    let max = 4000;
    let resp = server
        .post(
            "/v1/chat/completions",
            json!({"messages": messages(), "stream": true, "max_tokens": max, "ignore_eos": true}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    let mut rec = None;
    for _ in 0..600 {
        if let Some(r) = server.records().await.pop() {
            rec = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rec = rec.expect("recorded within 30 s");
    assert!(rec.client_disconnected);
    let out = rec.output.unwrap();
    assert_eq!(out.finish_reason.as_deref(), Some("cancelled"));
    assert!(out.token_ids.len() < max, "the engine ran to max_tokens");
    server.stop().await;
}

#[tokio::test]
async fn engine_backend_refuses_beyond_its_queue() {
    use tapedeck_recorder::backend::{Backend, BackendError};
    let engine = Arc::new(Engine::load(&model_dir("tiny-qwen2")).unwrap());
    let backend = EngineBackend::new(engine, 2);
    let req = tapedeck_engine::GenerateRequest {
        prompt: vec![1, 2, 3],
        sampling: Default::default(),
        stop: tapedeck_engine::StopCriteria {
            max_tokens: 2,
            ..Default::default()
        },
        top_k_summary: 8,
        toggles: Default::default(),
    };
    // On this single-threaded runtime the spawned generations cannot take the engine before we
    // yield, so both stay queued and the third is refused.
    let mut g1 = backend.generate(req.clone()).unwrap();
    let mut g2 = backend.generate(req.clone()).unwrap();
    assert_eq!(backend.load().queued, 2);
    match backend.generate(req.clone()) {
        Err(BackendError::Overloaded { queued: 2, .. }) => {}
        other => panic!("expected Overloaded, got {other:?}"),
    }
    // Both admitted generations complete, one after the other.
    for g in [&mut g1, &mut g2] {
        let mut tokens = 0;
        loop {
            match g.next().await {
                Some(tapedeck_recorder::backend::GenEvent::Token(_)) => tokens += 1,
                Some(tapedeck_recorder::backend::GenEvent::Done(out)) => {
                    assert_eq!(out.tokens.len(), tokens);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(backend.load(), Default::default());
    assert!(backend.generate(req).is_ok());
}

async fn concurrent_requests_are_all_served_and_recorded(kind: Kind) {
    let server = Arc::new(start("tiny-qwen2", kind).await);
    let mut tasks = Vec::new();
    for i in 0..6 {
        let s = server.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"messages": [{"role": "user", "content": format!("request {i}")}],
                              "max_tokens": 6, "stream": i % 2 == 0, "temperature": 0});
            let resp = s.post("/v1/chat/completions", body).await;
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap()
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let recs = server.records().await;
    assert_eq!(recs.len(), 6);
    for r in &recs {
        assert_eq!(r.status, 200);
        assert!(!r.client_disconnected);
        let first = r.first_token_us().unwrap();
        assert!(r.arrival_us <= first && first <= r.end_us);
    }
    // Six different conversations: six sessions.
    assert_eq!(server.state.store().sessions().await.unwrap().len(), 6);
    let Ok(server) = Arc::try_unwrap(server) else {
        panic!("server still shared")
    };
    server.stop().await;
}

/// A multi-turn session through the batching scheduler reuses the cached prefix of the previous
/// turn, and `/metrics` shows it.
async fn prefix_cache_hits_show_in_metrics(kind: Kind) {
    let server = start("tiny-qwen2", kind).await;
    let sys = json!({"role": "system", "content": "You are a careful assistant. ".repeat(20)});
    let first = json!([sys, {"role": "user", "content": "first question"}]);
    let v: Value = server
        .post(
            "/v1/chat/completions",
            json!({"messages": first, "max_tokens": 4, "temperature": 0}),
        )
        .await
        .json()
        .await
        .unwrap();
    let answer = v["choices"][0]["message"]["content"].clone();
    let second = json!([sys, {"role": "user", "content": "first question"},
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": "second question"}]);
    let resp = server
        .post(
            "/v1/chat/completions",
            json!({"messages": second, "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let metrics = reqwest::get(format!("{}/metrics", server.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tapedeck_prefix_cache_hit_tokens_total "))
        .map(|v| v.parse::<u64>().unwrap());
    match kind {
        Kind::Serial => assert_eq!(hits, None, "the serial backend has no prefix cache"),
        Kind::Batched => {
            assert!(hits.unwrap() > 0, "{metrics}");
            // The pool says what it stores (the default toggles: f32).
            assert!(
                metrics.contains("tapedeck_kv_cache_info{storage=\"f32\"} 1"),
                "{metrics}"
            );
        }
    }
    // The engine runs on the CPU here: no accelerator time to report.
    assert!(
        !metrics.contains("tapedeck_device_busy_seconds_total"),
        "{metrics}"
    );
    let recs = server.records().await;
    assert_eq!(
        recs[1].session.as_ref().unwrap().turn,
        1,
        "stitched into one session"
    );
    server.stop().await;
}

/// Runs each test body on every backend.
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod serial {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Serial).await
                }
            )*
        }
        mod batched {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Batched).await
                }
            )*
        }
    };
}

on_every_backend!(
    qwen2_chat_is_recorded_as_served,
    scoring_the_recorded_output_reproduces_its_logprobs,
    tools_reach_the_template_and_the_report,
    llama_serves_too,
    disconnect_cancels_the_engine,
    concurrent_requests_are_all_served_and_recorded,
    prefix_cache_hits_show_in_metrics,
);
