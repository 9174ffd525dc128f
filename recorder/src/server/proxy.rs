//! Upstream mode's request path: `POST /v1/chat/completions` and `POST /v1/completions` are
//! forwarded to the upstream server as received and its answer is passed back unchanged — the
//! status, the error body, the JSON body, or the SSE stream byte for byte — while the record is
//! filled in from what went by: the request, its headers, the session and kind (stitched exactly
//! as for local serving), the deltas (`content`, `reasoning_content`/`reasoning`, `tool_calls`),
//! the finish reason, logprobs, and the arrival / per-chunk / end times.
//!
//! With a local tokenizer (`--tokenizer DIR`) the record also gets the prompt token IDs (the
//! messages through the local chat template, as the local engine would encode them) and output
//! token IDs (the upstream's logprob tokens when they all map to local IDs, else the output text
//! tokenized). With `--upstream-logprobs K` a request whose client asked for no logprobs is sent
//! with `logprobs`/`top_logprobs: K`, and the logprobs are removed from the client's response
//! (the stream is then re-serialized event by event instead of passed through verbatim).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header::{CONTENT_TYPE, USER_AGENT};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures::StreamExt as _;
use serde_json::{json, Value};
use tapedeck_engine::chat::EncodeOptions;
use tapedeck_engine::messages::{FunctionCall, MessageContent};
use tapedeck_engine::{ChatMessage, LogitsSummary, ToolCall};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::openai::ChatRequest;
use super::{read_body, AppState, Arrival};
use crate::backend::Backend;
use crate::record::{now_us, Endpoint, RecordedOutput, RequestRecord};
use crate::stitch::{classify, Chain};
use crate::upstream::UpstreamBackend;

/// Headers that belong to one connection and are not forwarded either way.
const HOP_BY_HOP: &[&str] = &[
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    // reqwest is built without decompression: ask for identity so bodies pass through as is.
    "accept-encoding",
];

fn forwardable(name: &str) -> bool {
    !HOP_BY_HOP.contains(&name)
}

/// Proxies one request to the upstream and records it.
pub(super) async fn handle(state: AppState, endpoint: Endpoint, req: Request) -> Response {
    let arrival = Arrival::of(&req);
    let (parts, body) = req.into_parts();
    let mut rec = state.new_record(endpoint, arrival, &parts.headers);
    let header_session = parts
        .headers
        .get(state.options().session_header.as_str())
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let hint = parts
        .headers
        .get(USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let header_only = |rec: &mut RequestRecord| {
        if header_session.is_some() {
            let (s, _) = state
                .stitcher()
                .assign(header_session.as_deref(), &[], hint.as_deref());
            rec.session = Some(s);
        }
    };
    let bytes = match read_body(body, state.options().body_limit).await {
        Ok(b) => b,
        Err(e) => {
            header_only(&mut rec);
            return state.fail(rec, arrival, e).await;
        }
    };
    rec.request_body = String::from_utf8_lossy(&bytes).into_owned();
    // The upstream judges the request; the recorder only reads what it can.
    let mut body: Option<Value> = serde_json::from_slice(&bytes).ok().filter(Value::is_object);
    rec.model = body
        .as_ref()
        .and_then(|b| b.get("model"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let chat: Option<ChatRequest> = match (endpoint, &body) {
        (Endpoint::ChatCompletions, Some(b)) => serde_json::from_value::<ChatRequest>(b.clone())
            .ok()
            .filter(|r| !r.messages.is_empty()),
        _ => None,
    };
    let mut chain = None;
    match &chat {
        Some(r) => {
            rec.kind = classify(&r.messages, r.effective_tools().is_some());
            let (s, c) =
                state
                    .stitcher()
                    .assign(header_session.as_deref(), &r.messages, hint.as_deref());
            rec.session = Some(s);
            chain = Some(c);
        }
        None => header_only(&mut rec),
    }
    let backend = state.backend().clone();
    let Some(up) = backend.upstream() else {
        return state
            .fail(rec, arrival, super::ApiError::internal("no upstream"))
            .await;
    };
    if up.has_tokenizer() {
        rec_prompt(&state, &backend, &mut rec, chat.as_ref(), body.as_ref()).await;
    }
    // Ask for logprobs the client did not ask for, to record them.
    let mut strip = false;
    if let (Some(k), Some(b)) = (up.extra_logprobs(), body.as_mut()) {
        let asked = match endpoint {
            Endpoint::ChatCompletions => {
                b.get("logprobs").and_then(Value::as_bool).unwrap_or(false)
            }
            Endpoint::Completions => b.get("logprobs").is_some_and(|v| !v.is_null()),
        };
        if !asked {
            match endpoint {
                Endpoint::ChatCompletions => {
                    b["logprobs"] = json!(true);
                    b["top_logprobs"] = json!(k);
                }
                Endpoint::Completions => b["logprobs"] = json!(k),
            }
            strip = true;
        }
    }
    let out_body = match (&body, strip) {
        (Some(b), true) => Bytes::from(serde_json::to_vec(b).unwrap_or_default()),
        _ => bytes.clone(),
    };
    let mut headers = HeaderMap::new();
    for (n, v) in &parts.headers {
        if forwardable(n.as_str()) {
            headers.append(n.clone(), v.clone());
        }
    }
    let guard = up.enter();
    let sent = up
        .client()
        .post(up.url(endpoint.as_str()))
        .headers(headers)
        .body(out_body)
        .send()
        .await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => return bad_gateway(&state, rec, arrival, &e.to_string()),
    };
    let status = resp.status();
    let resp_headers = resp.headers().clone();
    if !status.is_success() {
        // Errors pass through as they are: status, headers (`Retry-After`), body.
        let body = resp.bytes().await.unwrap_or_default();
        rec.status = status.as_u16();
        rec.error = Some(String::from_utf8_lossy(&body).into_owned());
        rec.end_us = now_us();
        drop(guard);
        state.finish_nowait(rec, arrival);
        return respond(status, &resp_headers, Body::from(body));
    }
    let is_sse = resp_headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let acc = Acc::new(endpoint, chain);
    if !is_sse {
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return bad_gateway(&state, rec, arrival, &e.to_string()),
        };
        drop(guard);
        let mut acc = acc;
        let offset = elapsed_us(arrival);
        let out = match serde_json::from_slice::<Value>(&body) {
            Ok(mut v) => {
                acc.chunk(&v, offset);
                acc.register(&state, &rec);
                if strip {
                    strip_logprobs(&mut v);
                    Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
                } else {
                    body
                }
            }
            Err(_) => body,
        };
        acc.finish(up, &mut rec);
        rec.end_us = now_us();
        state.finish_nowait(rec, arrival);
        return respond(status, &resp_headers, Body::from(out));
    }
    drop(guard);
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    let task_state = state.clone();
    tokio::spawn(pump(
        task_state, backend, rec, arrival, resp, acc, strip, tx,
    ));
    respond(
        status,
        &resp_headers,
        Body::from_stream(ReceiverStream::new(rx)),
    )
}

fn elapsed_us(arrival: Arrival) -> u64 {
    u64::try_from(arrival.at.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The response to the client: the upstream's status and headers (less hop-by-hop ones).
fn respond(status: StatusCode, headers: &HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    for (n, v) in headers {
        if forwardable(n.as_str()) {
            r.headers_mut().append(n.clone(), v.clone());
        }
    }
    r
}

/// The upstream could not be reached or broke off: 502 in OpenAI's error shape.
fn bad_gateway(state: &AppState, mut rec: RequestRecord, arrival: Arrival, e: &str) -> Response {
    let message = format!("upstream request failed: {e}");
    rec.status = 502;
    rec.error = Some(message.clone());
    rec.end_us = now_us();
    state.finish_nowait(rec, arrival);
    let body = json!({"error": {
        "message": message, "type": "upstream_error", "param": null, "code": 502,
    }});
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r.headers_mut().insert(
        CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    r
}

/// Prompt token IDs through the local tokenizer (errors leave them out: the upstream decides).
async fn rec_prompt(
    state: &AppState,
    backend: &Arc<dyn Backend>,
    rec: &mut RequestRecord,
    chat: Option<&ChatRequest>,
    body: Option<&Value>,
) {
    if let Some(r) = chat {
        let messages = r.messages.clone();
        let tools = r.effective_tools().map(<[Value]>::to_vec);
        let opts = EncodeOptions {
            add_generation_prompt: true,
            toggles: state.options().toggles,
        };
        let b = backend.clone();
        let enc =
            tokio::task::spawn_blocking(move || b.encode_chat(&messages, tools.as_deref(), &opts))
                .await;
        match enc {
            Ok(Ok(e)) => {
                rec.prompt_ids = Some(e.ids);
                rec.encoding_report = Some(e.report);
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "local encoding of a proxied chat failed"),
            Err(e) => tracing::warn!(error = %e, "encoding task failed"),
        }
        return;
    }
    let Some(prompt) = body.and_then(|b| b.get("prompt")) else {
        return;
    };
    let prompt = match prompt {
        Value::Array(a) if a.len() == 1 => &a[0],
        p => p,
    };
    rec.prompt_ids = match prompt {
        Value::String(s) => backend.tokenize(s).ok(),
        Value::Array(a) => a
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => None,
    };
}

/// A token as logprobs name it: its text and, when sent, its bytes.
type Tok = (String, Option<Vec<u8>>);

/// One logprob entry: the token, its logprob, and alternatives.
type Lp = (Tok, f32, Vec<(Tok, f32)>);

fn tok(v: &Value) -> Tok {
    let bytes = v["bytes"].as_array().and_then(|a| {
        a.iter()
            .map(|b| b.as_u64().and_then(|n| u8::try_from(n).ok()))
            .collect()
    });
    (v["token"].as_str().unwrap_or_default().to_string(), bytes)
}

#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// What the response said so far.
struct Acc {
    endpoint: Endpoint,
    chain: Option<Chain>,
    content: String,
    reasoning: String,
    calls: Vec<PartialCall>,
    finish: Option<String>,
    logprobs: Vec<Lp>,
    /// Per chunk that carried output: µs since arrival, once per token when logprobs say how many.
    offsets: Vec<u64>,
    error: Option<String>,
    continuation: Option<String>,
}

fn lp_f32(v: &Value) -> f32 {
    v.as_f64().map_or(f32::NEG_INFINITY, |x| x as f32)
}

impl Acc {
    fn new(endpoint: Endpoint, chain: Option<Chain>) -> Self {
        Acc {
            endpoint,
            chain,
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            finish: None,
            logprobs: Vec::new(),
            offsets: Vec::new(),
            error: None,
            continuation: None,
        }
    }

    /// Takes in one chunk (streaming) or the whole body; true when it carried the finish reason.
    fn chunk(&mut self, v: &Value, offset: u64) -> bool {
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            self.error = Some(e.to_string());
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["index"].as_u64().unwrap_or(0) == 0))
        else {
            return false;
        };
        let mut output = false;
        let before = self.logprobs.len();
        match self.endpoint {
            Endpoint::ChatCompletions => {
                let d = choice.get("delta").or_else(|| choice.get("message"));
                if let Some(d) = d {
                    if let Some(s) = d["content"].as_str().filter(|s| !s.is_empty()) {
                        self.content.push_str(s);
                        output = true;
                    }
                    let r = d
                        .get("reasoning_content")
                        .or_else(|| d.get("reasoning"))
                        .and_then(Value::as_str);
                    if let Some(s) = r.filter(|s| !s.is_empty()) {
                        self.reasoning.push_str(s);
                        output = true;
                    }
                    for (pos, tc) in d["tool_calls"].as_array().into_iter().flatten().enumerate() {
                        let i = tc["index"].as_u64().map_or(pos, |i| i as usize);
                        if self.calls.len() <= i {
                            self.calls.resize_with(i + 1, PartialCall::default);
                        }
                        let c = &mut self.calls[i];
                        if let Some(id) = tc["id"].as_str() {
                            c.id = id.to_string();
                        }
                        if let Some(n) = tc["function"]["name"].as_str() {
                            c.name.push_str(n);
                        }
                        if let Some(a) = tc["function"]["arguments"].as_str() {
                            c.arguments.push_str(a);
                        }
                        output = true;
                    }
                }
                for e in choice["logprobs"]["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let top = e["top_logprobs"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|t| (tok(t), lp_f32(&t["logprob"])))
                        .collect();
                    self.logprobs.push((tok(e), lp_f32(&e["logprob"]), top));
                }
            }
            Endpoint::Completions => {
                if let Some(s) = choice["text"].as_str().filter(|s| !s.is_empty()) {
                    self.content.push_str(s);
                    output = true;
                }
                let lp = &choice["logprobs"];
                let tokens = lp["tokens"].as_array().cloned().unwrap_or_default();
                for (i, t) in tokens.iter().enumerate() {
                    let top = lp["top_logprobs"][i]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| ((k.clone(), None), lp_f32(v)))
                        .collect();
                    self.logprobs.push((
                        (t.as_str().unwrap_or_default().to_string(), None),
                        lp_f32(&lp["token_logprobs"][i]),
                        top,
                    ));
                }
            }
        }
        let n = (self.logprobs.len() - before).max(usize::from(output));
        self.offsets.extend(std::iter::repeat_n(offset, n));
        match choice["finish_reason"].as_str() {
            Some(f) if self.finish.is_none() => {
                self.finish = Some(f.to_string());
                true
            }
            _ => false,
        }
    }

    fn tool_calls(&self) -> Vec<ToolCall> {
        self.calls
            .iter()
            .map(|c| ToolCall {
                id: c.id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                },
            })
            .collect()
    }

    /// Makes the answer findable by the next turn (before the last bytes reach the client).
    fn register(&mut self, state: &AppState, rec: &RequestRecord) {
        let (Some(session), Some(chain)) = (&rec.session, &self.chain) else {
            return;
        };
        if self.continuation.is_some() || self.finish.is_none() || self.error.is_some() {
            return;
        }
        let calls = self.tool_calls();
        let answer = ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text(self.content.clone())),
            reasoning_content: (!self.reasoning.is_empty()).then(|| self.reasoning.clone()),
            tool_calls: (!calls.is_empty()).then_some(calls),
            tool_call_id: None,
            name: None,
        };
        self.continuation = Some(
            state
                .stitcher()
                .complete(session, rec.id, rec.kind, chain, &answer),
        );
    }

    /// Fills in the record's output.
    fn finish(self, up: &UpstreamBackend, rec: &mut RequestRecord) {
        let text = if self.reasoning.is_empty() {
            self.content.clone()
        } else {
            format!("<think>{}</think>{}", self.reasoning, self.content)
        };
        let from_logprobs: Option<Vec<u32>> = (!self.logprobs.is_empty())
            .then(|| {
                self.logprobs
                    .iter()
                    .map(|((t, b), _, _)| up.token_id(t, b.as_deref()))
                    .collect()
            })
            .flatten();
        let token_ids = match from_logprobs {
            Some(ids) => ids,
            None if up.has_tokenizer() => up.tokenize(&text).unwrap_or_default(),
            None => Vec::new(),
        };
        let logits = self
            .logprobs
            .iter()
            .map(|(_, lp, top)| {
                let top: Vec<(u32, f32)> = top
                    .iter()
                    .filter_map(|((t, b), l)| Some((up.token_id(t, b.as_deref())?, *l)))
                    .collect();
                // The upstream sends no entropy: this is the top-K part of it (a lower bound).
                let entropy = top
                    .iter()
                    .map(|&(_, l)| l.exp())
                    .filter(|p| p.is_finite() && *p > 0.0)
                    .map(|p| -p * p.ln())
                    .sum();
                LogitsSummary {
                    logprob: *lp,
                    top,
                    entropy,
                }
            })
            .collect();
        // One time per token: chunk times spread over the tokens when the counts differ.
        let offsets = if token_ids.is_empty() || self.offsets.is_empty() {
            self.offsets.clone()
        } else {
            let (n, m) = (token_ids.len(), self.offsets.len());
            (0..n).map(|i| self.offsets[i * m / n]).collect()
        };
        if rec.error.is_none() {
            rec.error = self.error.clone();
        }
        let finish = self.finish.clone().or_else(|| {
            Some(if rec.client_disconnected {
                "cancelled".into()
            } else {
                "error".into()
            })
        });
        rec.output = Some(RecordedOutput {
            token_ids,
            text,
            content: self.content.clone(),
            reasoning: (!self.reasoning.is_empty()).then(|| self.reasoning.clone()),
            tool_calls: self.tool_calls(),
            finish_reason: finish,
            token_offsets_us: offsets,
            logits,
        });
        if rec.error.is_none() && !rec.client_disconnected {
            rec.continuation_hash = self.continuation;
        }
    }
}

/// Removes `logprobs` from every choice (the client did not ask for them).
fn strip_logprobs(v: &mut Value) {
    for c in v["choices"].as_array_mut().into_iter().flatten() {
        if let Some(o) = c.as_object_mut() {
            if o.contains_key("logprobs") {
                o.insert("logprobs".into(), Value::Null);
            }
        }
    }
}

/// Where the first SSE event in `buf` ends: (end of its text, length of the blank line).
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

/// The `data:` of one SSE event (lines joined with `\n`), if any.
fn event_data(ev: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in ev.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            let d = d.strip_prefix(' ').unwrap_or(d);
            match &mut data {
                Some(s) => {
                    s.push('\n');
                    s.push_str(d);
                }
                None => data = Some(d.to_string()),
            }
        }
    }
    data
}

/// Streams the upstream's SSE body to the client while recording it.
#[allow(clippy::too_many_arguments)]
async fn pump(
    state: AppState,
    backend: Arc<dyn Backend>,
    mut rec: RequestRecord,
    arrival: Arrival,
    resp: reqwest::Response,
    mut acc: Acc,
    strip: bool,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let Some(up) = backend.upstream() else { return };
    let _running = up.enter();
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let item = tokio::select! {
            biased;
            _ = tx.closed() => {
                rec.client_disconnected = true;
                break;
            }
            item = stream.next() => item,
        };
        let chunk = match item {
            None => break,
            Some(Err(e)) => {
                rec.error = Some(format!("upstream stream failed: {e}"));
                break;
            }
            Some(Ok(c)) => c,
        };
        let offset = elapsed_us(arrival);
        buf.extend_from_slice(&chunk);
        let mut out: Vec<u8> = Vec::new();
        while let Some((end, sep)) = event_end(&buf) {
            let ev: Vec<u8> = buf.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&ev[..end]);
            let parsed = event_data(&text)
                .filter(|d| d.trim() != "[DONE]")
                .and_then(|d| serde_json::from_str::<Value>(&d).ok());
            match parsed {
                Some(mut v) => {
                    if acc.chunk(&v, offset) {
                        acc.register(&state, &rec);
                    }
                    if strip {
                        strip_logprobs(&mut v);
                        out.extend_from_slice(format!("data: {v}\n\n").as_bytes());
                    }
                }
                None if strip => out.extend_from_slice(&ev),
                None => {}
            }
        }
        let send = if strip { Bytes::from(out) } else { chunk };
        if !send.is_empty() && tx.send(Ok(send)).await.is_err() {
            rec.client_disconnected = true;
            break;
        }
    }
    if strip && !buf.is_empty() && !rec.client_disconnected {
        let _ = tx.send(Ok(Bytes::from(buf))).await;
    }
    drop(tx);
    acc.finish(up, &mut rec);
    rec.end_us = now_us();
    state.finish_nowait(rec, arrival);
}
