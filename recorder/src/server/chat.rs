//! `POST /v1/chat/completions`: validation, session stitching, encoding with the model's chat
//! template, and the chat chunk / completion formats.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::USER_AGENT;
use axum::response::Response;
use serde_json::{json, Value};
use tapedeck_engine::chat::{EncodeOptions, ToolCallFormat};
use tapedeck_engine::generate::DEFAULT_SUMMARY_K;
use tapedeck_engine::messages::MessageContent;
use tapedeck_engine::{
    ChatMessage, FinishReason, GenerateOutput, GenerateRequest, StopCriteria, TokenEvent,
};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::driver::{drive, Done, Protocol, Reply, Run};
use super::openai::{chat_logprob, ChatRequest};
use super::splitter::{ParseFn, Piece, Splitter, ToolMode};
use super::{parse_json, read_body, ApiError, AppState, Arrival};
use crate::backend::Backend;
use crate::record::{Endpoint, RecordedOutput, RequestKind, RequestRecord};
use crate::stitch::{classify, Chain};

/// Most alternatives per token a client may ask for.
pub(super) const MAX_TOP_LOGPROBS: u32 = 20;

pub(super) async fn handle(State(state): State<AppState>, req: Request) -> Response {
    if state.backend().upstream().is_some() {
        return super::proxy::handle(state, Endpoint::ChatCompletions, req).await;
    }
    let arrival = Arrival::of(&req);
    let (parts, body) = req.into_parts();
    let mut rec = state.new_record(Endpoint::ChatCompletions, arrival, &parts.headers);
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
    let header_only = |state: &AppState, rec: &mut RequestRecord| {
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
            header_only(&state, &mut rec);
            return state.fail(rec, arrival, e).await;
        }
    };
    rec.request_body = String::from_utf8_lossy(&bytes).into_owned();
    let request: ChatRequest = match parse_json(&bytes) {
        Ok(r) => r,
        Err(e) => {
            rec.model = loose_model(&bytes);
            header_only(&state, &mut rec);
            return state.fail(rec, arrival, e).await;
        }
    };
    rec.model = request.model.clone();
    let chain = if request.messages.is_empty() {
        header_only(&state, &mut rec);
        None
    } else {
        let tools_offered = request.effective_tools().is_some();
        rec.kind = classify(&request.messages, tools_offered);
        let (session, chain) = state.stitcher().assign(
            header_session.as_deref(),
            &request.messages,
            hint.as_deref(),
        );
        rec.session = Some(session);
        Some(chain)
    };
    match start(&state, &mut rec, request, chain).await {
        Ok((generation, protocol, stream)) => {
            let (tx, rx) = oneshot::channel();
            let run = Run {
                state,
                record: rec,
                arrival,
                generation,
                protocol,
                stream,
            };
            tokio::spawn(drive(run, tx));
            Reply::into_response(rx.await.ok())
        }
        Err(e) => state.fail(rec, arrival, e).await,
    }
}

/// The `model` of a body that did not parse as a request, for the record.
pub(super) fn loose_model(bytes: &[u8]) -> Option<String> {
    serde_json::from_slice::<Value>(bytes)
        .ok()?
        .get("model")?
        .as_str()
        .map(str::to_string)
}

/// Validates, encodes and starts the generation.
async fn start(
    state: &AppState,
    rec: &mut RequestRecord,
    request: ChatRequest,
    chain: Option<Chain>,
) -> Result<(crate::backend::Generation, ChatProtocol, bool), ApiError> {
    if let Some(m) = &request.model {
        if !state.serves(m) {
            return Err(ApiError::model_not_found(m));
        }
    }
    let Some(chain) = chain else {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    };
    let top_logprobs = match (request.logprobs.unwrap_or(false), request.top_logprobs) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
            ))
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, _) => None,
    };
    let sampling = request.sampling.sampling()?;
    let backend = state.backend().clone();
    let info = backend.info().clone();
    let tools = request.effective_tools().map(<[Value]>::to_vec);
    let opts = EncodeOptions {
        add_generation_prompt: true,
        toggles: state.options().toggles,
    };
    let messages = request.messages;
    let encoding = {
        let backend = backend.clone();
        let tools = tools.clone();
        tokio::task::spawn_blocking(move || backend.encode_chat(&messages, tools.as_deref(), &opts))
            .await
            .map_err(|e| ApiError::internal(format!("encoding task failed: {e}")))??
    };
    rec.prompt_ids = Some(encoding.ids.clone());
    rec.encoding_report = Some(encoding.report.clone());
    let prompt_len = encoding.ids.len();
    let context = info.context_len;
    if context > 0 && prompt_len >= context {
        return Err(ApiError::context_length(prompt_len, context));
    }
    let room = if context > 0 {
        context - prompt_len
    } else {
        usize::MAX
    };
    let asked = request
        .max_completion_tokens
        .or(request.max_tokens)
        .map(|n| n as usize);
    if asked == Some(0) {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    let max_tokens = asked
        .or(state.options().default_max_tokens)
        .unwrap_or(room)
        .min(room);
    let stream = request.sampling.stream();
    let include_usage = request.sampling.include_usage();
    let gen_req = GenerateRequest {
        prompt: encoding.ids,
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
        top_k_summary: DEFAULT_SUMMARY_K.max(top_logprobs.unwrap_or(0)),
        toggles: state.options().toggles,
    };
    let mode = match (tools.is_some(), info.tool_call_format) {
        (false, _) => ToolMode::Off,
        (true, ToolCallFormat::Hermes) => ToolMode::Hermes,
        (true, ToolCallFormat::LlamaJson) => ToolMode::Buffered,
    };
    let starts_in_reasoning = encoding.text.trim_end().ends_with("<think>");
    let parse: ParseFn = {
        let backend = backend.clone();
        Arc::new(move |t: &str| backend.parse_output(t))
    };
    let generation = backend.generate(gen_req)?;
    let protocol = ChatProtocol {
        state: state.clone(),
        backend,
        id: format!("chatcmpl-{}", rec.id.simple()),
        created: rec.arrival_us / 1_000_000,
        model: request
            .model
            .unwrap_or_else(|| state.model_name().to_string()),
        splitter: Splitter::new(mode, starts_in_reasoning, parse),
        top_logprobs,
        include_usage,
        pending_logprobs: Vec::new(),
        all_logprobs: Vec::new(),
        prompt_tokens: prompt_len,
        chain,
        kind: rec.kind,
        request_id: rec.id,
        session: rec.session.clone(),
        continuation: None,
    };
    Ok((generation, protocol, stream))
}

/// Chat formatting of one generation.
pub(super) struct ChatProtocol {
    state: AppState,
    backend: Arc<dyn Backend>,
    id: String,
    created: i64,
    model: String,
    splitter: Splitter,
    top_logprobs: Option<usize>,
    include_usage: bool,
    pending_logprobs: Vec<Value>,
    all_logprobs: Vec<Value>,
    prompt_tokens: usize,
    chain: Chain,
    kind: RequestKind,
    request_id: Uuid,
    session: Option<crate::record::SessionRef>,
    continuation: Option<String>,
}

impl ChatProtocol {
    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Option<Vec<Value>>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": logprobs.map(|c| json!({"content": c})),
                "finish_reason": finish,
            }],
        })
    }

    fn take_logprobs(&mut self) -> Option<Vec<Value>> {
        (!self.pending_logprobs.is_empty()).then(|| std::mem::take(&mut self.pending_logprobs))
    }

    fn piece_chunks(&mut self, pieces: Vec<Piece>) -> Vec<Value> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(s) => {
                    let lp = self.take_logprobs();
                    out.push(self.chunk(json!({"content": s}), None, lp));
                }
                Piece::Reasoning(s) => {
                    let lp = self.take_logprobs();
                    out.push(self.chunk(json!({"reasoning_content": s}), None, lp));
                }
                Piece::ToolCall(i, c) => {
                    let lp = self.take_logprobs();
                    out.push(self.chunk(
                        json!({"tool_calls": [{
                            "index": i,
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": ""},
                        }]}),
                        None,
                        lp,
                    ));
                    out.push(self.chunk(
                        json!({"tool_calls": [{
                            "index": i,
                            "function": {"arguments": c.function.arguments},
                        }]}),
                        None,
                        None,
                    ));
                }
            }
        }
        out
    }

    /// Makes the answer findable by the next turn. This runs before the response's last bytes are
    /// sent: a client may send its next turn the moment it has the answer.
    fn register(&mut self, split: &super::splitter::Split) {
        let Some(session) = &self.session else { return };
        let answer = ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text(split.content.clone())),
            reasoning_content: split.reasoning.clone(),
            tool_calls: (!split.tool_calls.is_empty()).then(|| split.tool_calls.clone()),
            tool_call_id: None,
            name: None,
        };
        self.continuation = Some(self.state.stitcher().complete(
            session,
            self.request_id,
            self.kind,
            &self.chain,
            &answer,
        ));
    }

    fn usage(&self, completion: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }
}

impl Protocol for ChatProtocol {
    fn opening(&mut self) -> Vec<Value> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None, None)]
    }

    fn token(&mut self, ev: &TokenEvent) -> Vec<Value> {
        if let Some(n) = self.top_logprobs {
            let backend = &self.backend;
            let text = |id: u32| backend.detokenize(&[id]).unwrap_or_default();
            let v = chat_logprob(&text, ev.id, &ev.summary, n);
            self.pending_logprobs.push(v.clone());
            self.all_logprobs.push(v);
        }
        let pieces = self.splitter.push(&ev.text);
        self.piece_chunks(pieces)
    }

    fn done(&mut self, out: &GenerateOutput) -> Done {
        let pieces = self.splitter.finish();
        let mut chunks = self.piece_chunks(pieces);
        let split = self.splitter.result();
        let finish = match out.finish_reason {
            FinishReason::Stop if !split.tool_calls.is_empty() => "tool_calls",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        if out.finish_reason != FinishReason::Cancelled {
            self.register(&split);
        }
        let lp = self.take_logprobs();
        chunks.push(self.chunk(json!({}), Some(finish), lp));
        let usage = self.usage(out.tokens.len());
        if self.include_usage {
            chunks.push(json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }));
        }
        // OpenAI sends `content: null` beside tool calls when there is no text.
        let content = if split.content.is_empty() && !split.tool_calls.is_empty() {
            Value::Null
        } else {
            Value::String(split.content.clone())
        };
        let mut message = json!({
            "role": "assistant",
            "content": content,
        });
        if let Some(r) = &split.reasoning {
            message["reasoning_content"] = json!(r);
        }
        if !split.tool_calls.is_empty() {
            message["tool_calls"] = json!(split.tool_calls);
        }
        let whole = json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": self.top_logprobs.map(|_| json!({"content": self.all_logprobs})),
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

    fn record(&mut self, rec: &mut RequestRecord, output: &mut RecordedOutput, success: bool) {
        let split = self.splitter.result();
        output.content = split.content;
        output.reasoning = split.reasoning;
        output.tool_calls = split.tool_calls;
        if success {
            rec.continuation_hash = self.continuation.take();
        }
    }
}
