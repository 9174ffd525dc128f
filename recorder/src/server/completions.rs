//! `POST /v1/completions`: the legacy endpoint over text or token IDs, and the way to score a
//! given sequence (`echo: true, logprobs: k, max_tokens: 0`) by teacher forcing.
//!
//! Besides OpenAI's legacy `logprobs` object (`tokens`, `token_logprobs` with `null` first,
//! `top_logprobs`, `text_offset`), the response carries tapedeck extensions the replayer needs
//! because token texts are ambiguous: `token_ids` (the exact IDs), `top_token_ids` (per position,
//! `[[id, logprob], ...]`, `null` where `top_logprobs` is) and `entropies` (nats, `null` likewise).
//! Sessions are assigned only by the session header here: a legacy prompt has no messages to
//! stitch by.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::USER_AGENT;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tapedeck_engine::generate::DEFAULT_SUMMARY_K;
use tapedeck_engine::{
    FinishReason, GenerateOutput, GenerateRequest, LogitsSummary, StopCriteria, TokenEvent,
};
use tokio::sync::oneshot;

use super::chat::{loose_model, MAX_TOP_LOGPROBS};
use super::driver::{drive, Done, Protocol, Reply, Run};
use super::openai::{finite, CompletionRequest, Prompt};
use super::{parse_json, read_body, ApiError, AppState, Arrival};
use crate::backend::{Backend, Generation};
use crate::record::{now_us, Endpoint, PromptScores, RecordedOutput, RequestRecord};

/// OpenAI's default `max_tokens` for this endpoint.
const DEFAULT_MAX_TOKENS: usize = 16;

pub(super) async fn handle(State(state): State<AppState>, req: Request) -> Response {
    if state.backend().upstream().is_some() {
        return super::proxy::handle(state, Endpoint::Completions, req).await;
    }
    let arrival = Arrival::of(&req);
    let (parts, body) = req.into_parts();
    let mut rec = state.new_record(Endpoint::Completions, arrival, &parts.headers);
    let header_session = parts
        .headers
        .get(state.options().session_header.as_str())
        .and_then(|v| v.to_str().ok());
    if header_session.is_some() {
        let hint = parts.headers.get(USER_AGENT).and_then(|v| v.to_str().ok());
        let (s, _) = state.stitcher().assign(header_session, &[], hint);
        rec.session = Some(s);
    }
    let bytes = match read_body(body, state.options().body_limit).await {
        Ok(b) => b,
        Err(e) => return state.fail(rec, arrival, e).await,
    };
    rec.request_body = String::from_utf8_lossy(&bytes).into_owned();
    let request: CompletionRequest = match parse_json(&bytes) {
        Ok(r) => r,
        Err(e) => {
            rec.model = loose_model(&bytes);
            return state.fail(rec, arrival, e).await;
        }
    };
    rec.model = request.model.clone();
    match start(&state, &mut rec, request).await {
        Ok(Started::Generate(generation, protocol, stream)) => {
            let (tx, rx) = oneshot::channel();
            let run = Run {
                state,
                record: rec,
                arrival,
                generation,
                protocol: *protocol,
                stream,
            };
            tokio::spawn(drive(run, tx));
            Reply::into_response(rx.await.ok())
        }
        Ok(Started::ScoredOnly(mut protocol, stream)) => {
            // Nothing to generate: answer now from the prompt scores.
            let empty = GenerateOutput {
                tokens: Vec::new(),
                text: String::new(),
                summaries: Vec::new(),
                finish_reason: FinishReason::Length,
                matched_stop: None,
                prompt_tokens: rec.prompt_tokens().unwrap_or(0),
                timings: Default::default(),
            };
            let done = protocol.done(&empty);
            rec.end_us = now_us();
            let response = if stream {
                let events: Vec<Result<Event, std::convert::Infallible>> = protocol
                    .opening()
                    .into_iter()
                    .chain(done.chunks)
                    .map(|c| Ok(Event::default().data(c.to_string())))
                    .chain(std::iter::once(Ok(Event::default().data("[DONE]"))))
                    .collect();
                Sse::new(futures::stream::iter(events)).into_response()
            } else {
                axum::Json(done.whole).into_response()
            };
            state.finish_nowait(rec, arrival);
            response
        }
        Err(e) => state.fail(rec, arrival, e).await,
    }
}

enum Started {
    Generate(Generation, Box<CompletionProtocol>, bool),
    ScoredOnly(Box<CompletionProtocol>, bool),
}

fn prompt_ids(
    backend: &dyn Backend,
    prompt: Prompt,
) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid_param(
                "prompt",
                "batched prompts are not supported; send one prompt per request",
            ))
        }
    };
    let (ids, text) = match prompt {
        Prompt::Text(t) => (backend.tokenize(&t)?, Some(t)),
        Prompt::Texts(mut v) => {
            one(v.len())?;
            let t = v.remove(0);
            (backend.tokenize(&t)?, Some(t))
        }
        Prompt::Ids(ids) => (ids, None),
        Prompt::IdLists(mut v) => {
            one(v.len())?;
            (v.remove(0), None)
        }
    };
    let vocab = backend.info().vocab_size;
    if vocab > 0 {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid_param(
                "prompt",
                format!("token ID {bad} is outside the vocabulary of {vocab} tokens"),
            ));
        }
    }
    if ids.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "prompt must not be empty",
        ));
    }
    Ok((ids, text))
}

async fn start(
    state: &AppState,
    rec: &mut RequestRecord,
    request: CompletionRequest,
) -> Result<Started, ApiError> {
    if let Some(m) = &request.model {
        if !state.serves(m) {
            return Err(ApiError::model_not_found(m));
        }
    }
    let backend = state.backend().clone();
    let k = request.logprobs.map(|k| k as usize);
    if request.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid_param(
            "logprobs",
            format!("logprobs must be at most {MAX_TOP_LOGPROBS}"),
        ));
    }
    let sampling = request.sampling.sampling()?;
    let echo = request.echo.unwrap_or(false);
    let max_tokens = request
        .max_tokens
        .map_or(DEFAULT_MAX_TOKENS, |n| n as usize);
    let (ids, text) = prompt_ids(backend.as_ref(), request.prompt)?;
    rec.prompt_ids = Some(ids.clone());
    let context = backend.info().context_len;
    if context > 0 && (ids.len() > context || (max_tokens > 0 && ids.len() >= context)) {
        return Err(ApiError::context_length(ids.len(), context).with_param("prompt"));
    }
    let max_tokens = if context > 0 {
        max_tokens.min(context - ids.len())
    } else {
        max_tokens
    };
    let toggles = state.options().toggles;
    let summary_k = DEFAULT_SUMMARY_K.max(k.unwrap_or(0));
    let mut protocol = CompletionProtocol {
        backend: backend.clone(),
        id: format!("cmpl-{}", rec.id.simple()),
        created: rec.arrival_us / 1_000_000,
        model: request
            .model
            .clone()
            .unwrap_or_else(|| state.model_name().to_string()),
        k,
        include_usage: request.sampling.include_usage(),
        prompt_tokens: ids.len(),
        echo: None,
        logprobs: Legacy::default(),
        text: String::new(),
    };
    if echo {
        let prompt_text = match text {
            Some(t) => t,
            None => backend.detokenize(&ids)?,
        };
        let mut lp = Legacy::default();
        if let Some(k) = k {
            let scores = if ids.len() > 1 {
                backend
                    .score(ids.clone(), 1, summary_k, toggles)
                    .await
                    .map_err(ApiError::from)?
            } else {
                Vec::new()
            };
            for (i, &id) in ids.iter().enumerate() {
                let s = i.checked_sub(1).and_then(|j| scores.get(j));
                lp.push(&protocol.token_text(id), id, s, k);
            }
            rec.prompt_scores = Some(PromptScores {
                from: 1,
                summaries: scores,
            });
        }
        // Generated tokens' `text_offset`s continue after the echoed prompt.
        protocol.logprobs = Legacy::starting_at(lp.offset);
        protocol.echo = Some((prompt_text, lp));
    }
    let stream = request.sampling.stream();
    if max_tokens == 0 {
        return Ok(Started::ScoredOnly(Box::new(protocol), stream));
    }
    let gen_req = GenerateRequest {
        prompt: ids,
        sampling,
        stop: StopCriteria {
            max_tokens,
            stop_strings: request
                .sampling
                .stop
                .clone()
                .map(|s| s.into_vec())
                .unwrap_or_default(),
            stop_token_ids: Vec::new(),
            ignore_eos: request.sampling.ignore_eos.unwrap_or(false),
        },
        top_k_summary: summary_k,
        toggles,
    };
    let generation = backend.generate(gen_req)?;
    Ok(Started::Generate(generation, Box::new(protocol), stream))
}

/// The legacy `logprobs` object, with tapedeck's ID extensions.
#[derive(Debug, Default, Clone)]
struct Legacy {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f64>>,
    top_logprobs: Vec<Option<Map<String, Value>>>,
    text_offset: Vec<usize>,
    token_ids: Vec<u32>,
    top_token_ids: Vec<Option<Vec<(u32, f64)>>>,
    entropies: Vec<Option<f64>>,
    /// Characters so far (the next token's `text_offset`).
    offset: usize,
}

impl Legacy {
    fn starting_at(offset: usize) -> Self {
        Legacy {
            offset,
            ..Legacy::default()
        }
    }

    /// Adds one position; `summary` is `None` for the first prompt token, which has no context.
    fn push(&mut self, text: &str, id: u32, summary: Option<&LogitsSummary>, k: usize) {
        self.tokens.push(text.to_string());
        self.token_ids.push(id);
        self.text_offset.push(self.offset);
        self.offset += text.chars().count();
        self.token_logprobs.push(summary.map(|s| finite(s.logprob)));
        self.entropies.push(summary.map(|s| finite(s.entropy)));
        self.top_logprobs.push(summary.map(|s| {
            s.top
                .iter()
                .take(k)
                .map(|&(tid, lp)| (self_text_placeholder(tid), json!(finite(lp))))
                .collect()
        }));
        self.top_token_ids.push(summary.map(|s| {
            s.top
                .iter()
                .take(k)
                .map(|&(t, lp)| (t, finite(lp)))
                .collect()
        }));
    }

    fn extend(&mut self, other: &Legacy) {
        self.tokens.extend(other.tokens.iter().cloned());
        self.token_logprobs
            .extend(other.token_logprobs.iter().cloned());
        self.top_logprobs.extend(other.top_logprobs.iter().cloned());
        self.text_offset.extend(other.text_offset.iter().cloned());
        self.token_ids.extend(other.token_ids.iter().cloned());
        self.top_token_ids
            .extend(other.top_token_ids.iter().cloned());
        self.entropies.extend(other.entropies.iter().cloned());
        self.offset = other.offset.max(self.offset);
    }

    fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
            "token_ids": self.token_ids,
            "top_token_ids": self.top_token_ids,
            "entropies": self.entropies,
        })
    }
}

/// Placeholder key, replaced by the token text in [`CompletionProtocol::fix_top`].
fn self_text_placeholder(id: u32) -> String {
    format!("\u{0}{id}")
}

/// Legacy completion formatting of one generation.
pub(super) struct CompletionProtocol {
    backend: Arc<dyn Backend>,
    id: String,
    created: i64,
    model: String,
    k: Option<usize>,
    include_usage: bool,
    prompt_tokens: usize,
    /// The echoed prompt text and its logprobs.
    echo: Option<(String, Legacy)>,
    /// Logprobs of the generated tokens.
    logprobs: Legacy,
    text: String,
}

impl CompletionProtocol {
    fn token_text(&self, id: u32) -> String {
        self.backend.detokenize(&[id]).unwrap_or_default()
    }

    /// Replaces the ID placeholders in `top_logprobs` keys with token texts.
    fn fix_top(&self, mut lp: Legacy) -> Legacy {
        for m in lp.top_logprobs.iter_mut().flatten() {
            let fixed: Map<String, Value> = std::mem::take(m)
                .into_iter()
                .map(|(key, v)| {
                    let text = key
                        .strip_prefix('\u{0}')
                        .and_then(|id| id.parse::<u32>().ok())
                        .map(|id| self.token_text(id))
                        .unwrap_or(key);
                    (text, v)
                })
                .collect();
            *m = fixed;
        }
        lp
    }

    fn chunk(&self, text: &str, logprobs: Option<Value>, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        })
    }
}

impl Protocol for CompletionProtocol {
    fn opening(&mut self) -> Vec<Value> {
        match &self.echo {
            Some((text, lp)) => {
                let lp = self.k.map(|_| self.fix_top(lp.clone()).to_json());
                vec![self.chunk(text, lp, None)]
            }
            None => Vec::new(),
        }
    }

    fn token(&mut self, ev: &TokenEvent) -> Vec<Value> {
        self.text.push_str(&ev.text);
        let lp = self.k.map(|k| {
            let mut one = Legacy::starting_at(self.logprobs.offset);
            one.push(&self.token_text(ev.id), ev.id, Some(&ev.summary), k);
            self.logprobs.extend(&one);
            self.fix_top(one).to_json()
        });
        if ev.text.is_empty() && lp.is_none() {
            return Vec::new();
        }
        vec![self.chunk(&ev.text, lp, None)]
    }

    fn done(&mut self, out: &GenerateOutput) -> Done {
        let finish = match out.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        let usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": out.tokens.len(),
            "total_tokens": self.prompt_tokens + out.tokens.len(),
        });
        let mut chunks = vec![self.chunk("", None, Some(finish))];
        if self.include_usage {
            chunks.push(json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }));
        }
        let mut text = String::new();
        let mut all = Legacy::default();
        if let Some((t, lp)) = &self.echo {
            text.push_str(t);
            all.extend(lp);
        }
        text.push_str(&out.text);
        all.extend(&self.logprobs);
        let whole = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": self.k.map(|_| self.fix_top(all).to_json()),
                "finish_reason": finish,
            }],
            "usage": usage,
        });
        Done {
            chunks,
            whole,
            finish_reason: finish.to_string(),
        }
    }

    fn record(&mut self, _rec: &mut RequestRecord, output: &mut RecordedOutput, _success: bool) {
        output.content = if output.text.is_empty() {
            self.text.clone()
        } else {
            output.text.clone()
        };
    }
}
