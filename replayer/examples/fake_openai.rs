//! A trivial, fast OpenAI-compatible target for the replayer benchmark (`bench/replayer/run.sh`).
//!
//! `POST /v1/chat/completions` and `POST /v1/completions` answer with `max_tokens` (or
//! `max_completion_tokens`, else `--tokens`) fixed chunks, streamed as SSE with a usage chunk and
//! `[DONE]` when `stream` is true, else as one JSON body; `GET /v1/models` lists one model. An
//! optional per-token delay (`--delay-ms`, default 0) simulates decoding. The server does no other
//! work, so with zero delay everything a client measures above loopback cost is client overhead.
//!
//! ```sh
//! cargo run --release -p tapedeck-replayer --example fake_openai -- \
//!     --listen 127.0.0.1:0 --tokens 16 [--delay-ms 0] [--threads 1]
//! ```
//! Prints `listening on ADDR` on stdout once it accepts connections; `GET /stats` returns the
//! number of requests served.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};

const MODEL: &str = "fake";

struct App {
    tokens: usize,
    delay: Duration,
    served: AtomicU64,
}

fn requested_tokens(body: &Value, default: usize) -> usize {
    body.get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64))
        .map_or(default, |n| n as usize)
}

fn prompt_tokens(body: &Value) -> usize {
    // A rough count (one per 4 bytes of the request): enough for usage to be plausible.
    body.get("messages")
        .or_else(|| body.get("prompt"))
        .map_or(1, |v| v.to_string().len() / 4 + 1)
}

async fn generate(app: Arc<App>, body: Value, chat: bool) -> Response {
    app.served.fetch_add(1, Ordering::Relaxed);
    let n = requested_tokens(&body, app.tokens);
    let prompt = prompt_tokens(&body);
    let usage =
        json!({"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n});
    let (object, chunk_object) = if chat {
        ("chat.completion", "chat.completion.chunk")
    } else {
        ("text_completion", "text_completion")
    };
    if !body.get("stream").and_then(Value::as_bool).unwrap_or(false) {
        if !app.delay.is_zero() {
            tokio::time::sleep(app.delay * n as u32).await;
        }
        let text = "tok ".repeat(n);
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        return Json(
            json!({"id": "fake-1", "object": object, "created": 0, "model": MODEL,
                           "choices": [choice], "usage": usage}),
        )
        .into_response();
    }
    let chunk = move |choice: Value, usage: Value| {
        let v = json!({"id": "fake-1", "object": chunk_object, "created": 0, "model": MODEL,
                       "choices": choice, "usage": usage});
        Bytes::from(format!("data: {v}\n\n"))
    };
    let piece = |i: usize| {
        if chat {
            let mut delta = json!({"content": "tok "});
            if i == 0 {
                delta["role"] = json!("assistant");
            }
            json!([{"index": 0, "delta": delta, "finish_reason": Value::Null}])
        } else {
            json!([{"index": 0, "text": "tok ", "finish_reason": Value::Null}])
        }
    };
    let fin = if chat {
        json!([{"index": 0, "delta": {}, "finish_reason": "length"}])
    } else {
        json!([{"index": 0, "text": "", "finish_reason": "length"}])
    };
    let mut frames: Vec<Bytes> = (0..n).map(|i| chunk(piece(i), Value::Null)).collect();
    frames.push(chunk(fin, Value::Null));
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if include_usage {
        frames.push(chunk(json!([]), usage));
    }
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let body = if app.delay.is_zero() {
        // Everything at once: the fastest a server can answer.
        Body::from(frames.concat())
    } else {
        let delay = app.delay;
        let s = stream::iter(frames.into_iter().enumerate()).then(move |(i, f)| async move {
            if i < n {
                tokio::time::sleep(delay).await;
            }
            Ok::<_, Infallible>(f)
        });
        Body::from_stream(s)
    };
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn main() {
    let mut listen = "127.0.0.1:0".to_string();
    let mut tokens = 16usize;
    let mut delay_ms = 0f64;
    let mut threads = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--listen" => listen = val(),
            "--tokens" => tokens = val().parse().expect("--tokens N"),
            "--delay-ms" => delay_ms = val().parse().expect("--delay-ms MS"),
            "--threads" => threads = val().parse().expect("--threads N"),
            _ => panic!("unknown argument {a}"),
        }
    }
    assert!(
        listen.starts_with("127.")
            || listen.starts_with("[::1]")
            || listen.starts_with("localhost"),
        "loopback addresses only"
    );
    let app = Arc::new(App {
        tokens,
        delay: Duration::from_secs_f64(delay_ms / 1000.0),
        served: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let router = Router::new()
            .route(
                "/v1/chat/completions",
                post(|State(a): State<Arc<App>>, Json(b): Json<Value>| generate(a, b, true)),
            )
            .route(
                "/v1/completions",
                post(|State(a): State<Arc<App>>, Json(b): Json<Value>| generate(a, b, false)),
            )
            .route(
                "/v1/models",
                get(|| async {
                    Json(json!({"object": "list", "data": [
                        {"id": MODEL, "object": "model", "created": 0, "owned_by": "tapedeck",
                         "max_model_len": 1_000_000}]}))
                }),
            )
            .route("/health", get(|| async { "ok" }))
            .route(
                "/stats",
                get(|State(a): State<Arc<App>>| async move {
                    Json(json!({"served": a.served.load(Ordering::Relaxed)}))
                }),
            )
            .with_state(app);
        let listener = tokio::net::TcpListener::bind(&listen).await.expect("bind");
        println!("listening on {}", listener.local_addr().unwrap());
        use std::io::Write;
        std::io::stdout().flush().ok();
        axum::serve(listener, router).await.expect("serve");
    });
}
