//! Helpers shared by the recorder's integration tests.
#![allow(dead_code)]

use tapedeck_engine::messages::FunctionCall;
use tapedeck_engine::{LogitsSummary, Toggles, ToolCall};
use tapedeck_recorder::record::{
    Endpoint, RecordedOutput, RequestKind, RequestRecord, SessionRef, SessionSource, StitchMethod,
};
use tapedeck_recorder::Store;
use uuid::Uuid;

/// A fresh database in its own temporary directory (kept alive by the returned guard).
pub async fn temp_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("t.db"))
        .await
        .expect("open store");
    (dir, store)
}

/// A record with every column filled in.
pub fn full_record(i: u32) -> RequestRecord {
    let mut r = RequestRecord::new(
        Uuid::new_v4(),
        Endpoint::ChatCompletions,
        1_764_000_000_000_000 + i64::from(i),
        "matmul=bf16".parse::<Toggles>().expect("toggles"),
    );
    r.session = Some(SessionRef {
        id: format!("s-{}", i % 7),
        source: SessionSource::Header,
        client_hint: Some("opencode/1.0".into()),
        turn: i,
        parent: None,
        stitch: StitchMethod::Header,
    });
    r.kind = RequestKind::Agent;
    r.end_us = r.arrival_us + 5_000;
    r.request_body = format!(r#"{{"messages":[{{"role":"user","content":"hi {i}"}}]}}"#);
    r.headers.insert("user-agent".into(), "opencode/1.0".into());
    r.model = Some("tiny-qwen2".into());
    r.prompt_ids = Some((0..100).map(|k| k * 31 + i).collect());
    r.output = Some(RecordedOutput {
        token_ids: vec![5, 6, 151_643],
        text: "<think>hm</think>ok".into(),
        content: "ok".into(),
        reasoning: Some("hm".into()),
        tool_calls: vec![ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "read".into(),
                arguments: r#"{"path":"a"}"#.into(),
            },
        }],
        finish_reason: Some("tool_calls".into()),
        token_offsets_us: vec![1_000, 1_500, 2_200],
        logits: (0..3)
            .map(|k| LogitsSummary {
                logprob: -0.25 * k as f32,
                top: (0..8).map(|j| (j * 10 + k, -(j as f32))).collect(),
                entropy: 1.5,
            })
            .collect(),
    });
    r.continuation_hash = Some(format!("hash-{i}"));
    r.probe = Some(tapedeck_recorder::record::Probe {
        must_contain: vec!["needle".into()],
        needle_position: Some(4096),
        label: None,
    });
    r
}

// ---------------------------------------------------------------------------------------------
// A scripted backend for protocol tests.
//
// The fixture models have random weights, so they never write a `<think>` block or a tool call on
// purpose; tests of how the server streams, parses and records those use this backend, which
// "generates" a given text. Everything the real engine can exercise is tested against it instead
// (tests/engine_e2e.rs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tapedeck_engine::chat::{
    EncodeOptions, Encoding, EncodingReport, ParsedOutput, ToolCallFormat,
};
use tapedeck_engine::{ChatMessage, FinishReason, GenerateOutput, GenerateRequest, TokenEvent};
use tapedeck_recorder::backend::{Backend, BackendError, BackendInfo, GenEvent, Generation, Load};
use tapedeck_recorder::server::{AppOptions, AppState};

/// Replies with scripted pieces of text, one token per piece.
pub struct Scripted {
    info: BackendInfo,
    /// Pieces of the next replies (each reply is a list of token texts); the last one repeats.
    pub replies: Mutex<Vec<Vec<String>>>,
    /// Pause between tokens.
    pub delay: Duration,
    /// Refuse every generation with `Overloaded`.
    pub overloaded: AtomicBool,
    /// Prompts seen.
    pub prompts: Mutex<Vec<Vec<u32>>>,
    /// Fail with an internal error after this many tokens.
    pub fail_after: Option<usize>,
}

impl Scripted {
    pub fn new(context_len: usize) -> Self {
        Scripted {
            info: BackendInfo {
                model_id: "scripted".into(),
                context_len,
                vocab_size: 256,
                backend: "scripted".into(),
                device: "none".into(),
                tool_call_format: ToolCallFormat::Hermes,
            },
            replies: Mutex::new(vec![vec!["Hello".into(), " world".into()]]),
            delay: Duration::ZERO,
            overloaded: AtomicBool::new(false),
            prompts: Mutex::new(Vec::new()),
            fail_after: None,
        }
    }

    /// Scripts the replies: each string is split into tokens at `|`.
    pub fn script(&self, replies: &[&str]) {
        *self.replies.lock().unwrap() = replies
            .iter()
            .map(|r| r.split('|').map(str::to_string).collect())
            .collect();
    }

    fn next_reply(&self) -> Vec<String> {
        let mut r = self.replies.lock().unwrap();
        if r.len() > 1 {
            r.remove(0)
        } else {
            r[0].clone()
        }
    }
}

fn summary(id: u32) -> tapedeck_engine::LogitsSummary {
    tapedeck_engine::LogitsSummary {
        logprob: -0.5,
        top: (0..8).map(|j| ((id + j) % 256, -0.5 - j as f32)).collect(),
        entropy: 1.25,
    }
}

impl Backend for Scripted {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        _opts: &EncodeOptions,
    ) -> Result<Encoding, BackendError> {
        let mut text = String::new();
        if let Some(t) = tools {
            text.push_str(&format!("[{} tools]\n", t.len()));
        }
        for m in messages {
            text.push_str(&format!("{}: {}\n", m.role, m.text()));
        }
        text.push_str("assistant: ");
        Ok(Encoding {
            ids: text.bytes().map(u32::from).collect(),
            text,
            report: EncodingReport {
                reasoning_rule: "scripted".into(),
                tools_present: tools.is_some(),
                reasoning_dropped: vec![],
                reasoning_kept: vec![],
                messages_truncated: 0,
                template_sha256: "0".repeat(64),
                faults: vec![],
            },
        })
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, BackendError> {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn parse_output(&self, text: &str) -> ParsedOutput {
        ParsedOutput {
            content: text.to_string(),
            ..Default::default()
        }
    }

    fn generate(&self, req: GenerateRequest) -> Result<Generation, BackendError> {
        if self.overloaded.load(Ordering::Relaxed) {
            return Err(BackendError::Overloaded {
                queued: 1,
                retry_after: Duration::from_secs(2),
            });
        }
        self.prompts.lock().unwrap().push(req.prompt.clone());
        let pieces = self.next_reply();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = tapedeck_recorder::backend::CancelToken::new();
        let stop = cancel.clone();
        let delay = self.delay;
        let fail_after = self.fail_after;
        tokio::spawn(async move {
            let start = std::time::Instant::now();
            let mut out = GenerateOutput {
                tokens: vec![],
                text: String::new(),
                summaries: vec![],
                finish_reason: FinishReason::Stop,
                matched_stop: None,
                prompt_tokens: req.prompt.len(),
                timings: Default::default(),
            };
            for (i, p) in pieces.iter().enumerate() {
                if fail_after == Some(i) {
                    let _ = tx.send(GenEvent::Error(BackendError::Internal(
                        "GPU fell off".into(),
                    )));
                    return;
                }
                if i >= req.stop.max_tokens {
                    out.finish_reason = FinishReason::Length;
                    break;
                }
                if stop.is_cancelled() {
                    out.finish_reason = FinishReason::Cancelled;
                    break;
                }
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let id = u32::from(p.bytes().next().unwrap_or(0));
                let ev = TokenEvent {
                    id,
                    text: p.clone(),
                    summary: summary(id),
                    elapsed: start.elapsed(),
                };
                out.tokens.push(id);
                out.text.push_str(p);
                out.summaries.push(summary(id));
                if tx.send(GenEvent::Token(ev)).is_err() {
                    out.finish_reason = FinishReason::Cancelled;
                    break;
                }
            }
            let _ = tx.send(GenEvent::Done(out));
        });
        Ok(Generation::new(rx, cancel))
    }

    fn score(
        &self,
        tokens: Vec<u32>,
        from: usize,
        _top_k: usize,
        _toggles: tapedeck_engine::Toggles,
    ) -> BoxFuture<'static, Result<Vec<tapedeck_engine::LogitsSummary>, BackendError>> {
        Box::pin(async move {
            Ok(tokens[from.min(tokens.len())..]
                .iter()
                .map(|&t| tapedeck_engine::LogitsSummary {
                    logprob: -1.0,
                    top: vec![(t, -1.0), ((t + 1) % 256, -2.0)],
                    entropy: 0.5,
                })
                .collect())
        })
    }

    fn load(&self) -> Load {
        Load::default()
    }
}

/// An app over a scripted backend and a fresh database.
pub async fn scripted_app(
    backend: Arc<Scripted>,
    options: AppOptions,
) -> (tempfile::TempDir, AppState) {
    let (dir, store) = temp_store().await;
    let state = AppState::new(backend, store, options)
        .await
        .expect("app state");
    (dir, state)
}
