//! Any OpenAI-compatible server as a target: `http(s)://host[:port][/v1][?model=NAME]`.
//!
//! * Generation: streaming `POST /v1/chat/completions` (`stream: true`, `include_usage`,
//!   `logprobs` with `top_logprobs`). Times are taken at the client as SSE chunks arrive: TTFT at
//!   the first chunk carrying output, one ITL per later chunk carrying output (vLLM's benchmark
//!   measures the same way; a server that packs several tokens in one chunk shows one gap for
//!   them), E2E at the end of the stream. Token IDs are known only when the server reports them
//!   (a `token_id` field in a logprobs entry, or vLLM's `token_id:N` token strings).
//! * Teacher forcing: `POST /v1/completions` with the token IDs as the prompt, `echo: true`,
//!   `logprobs: k`, `max_tokens: 0`. tapedeck's server returns the exact IDs in the extension
//!   fields `logprobs.token_ids` and `logprobs.top_token_ids` (`[[id, logprob], ...]` per
//!   position) and `logprobs.entropies`; a server without them cannot be scored (an error, not a
//!   silent zero). That endpoint scores in one prefill pass, so HTTP drift uses prefill kernels.

use std::time::Instant;

use futures::future::BoxFuture;
use futures::StreamExt;
use serde_json::{json, Map, Value};
use tapedeck_engine::messages::{FunctionCall, MessageContent};
use tapedeck_engine::{ChatMessage, LogitsSummary, ToolCall};

use super::{Clock, GenOptions, Target, TargetInfo, TurnOutput};
use crate::error::{Error, Result};
use crate::session::ChatRequest;

/// tapedeck's server refuses more alternatives than this; so do most OpenAI servers.
const MAX_TOP_LOGPROBS: usize = 20;

/// A target that talks HTTP to an OpenAI-compatible server.
#[derive(Debug, Clone)]
pub struct HttpTarget {
    spec: String,
    base: String,
    model: Option<String>,
    client: reqwest::Client,
}

impl HttpTarget {
    /// Parses `http(s)://host[:port][/v1][?model=NAME]`.
    pub fn open(spec: &str) -> Result<Self> {
        let (url, query) = match spec.split_once('?') {
            Some((u, q)) => (u, q),
            None => (spec, ""),
        };
        let mut model = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("model", m)) if !m.is_empty() => model = Some(m.to_string()),
                _ => {
                    return Err(Error::TargetSpec {
                        spec: spec.to_string(),
                        message: format!("unknown query parameter {pair:?} (only model=NAME)"),
                    })
                }
            }
        }
        let base = url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_string();
        let client = reqwest::Client::builder()
            .build()
            .map_err(|e| Error::Http {
                url: base.clone(),
                status: None,
                message: e.to_string(),
            })?;
        Ok(HttpTarget {
            spec: spec.to_string(),
            base,
            model,
            client,
        })
    }

    async fn post(&self, path: &str, body: &Value) -> Result<reqwest::Response> {
        self.post_as(path, body, None).await
    }

    async fn post_as(
        &self,
        path: &str,
        body: &Value,
        session_id: Option<&str>,
    ) -> Result<reqwest::Response> {
        let url = format!("{}{}", self.base, path);
        let mut builder = self.client.post(&url).json(body);
        if let Some(id) = session_id {
            builder = builder.header("x-session-id", id);
        }
        let resp = builder.send().await.map_err(|e| Error::Http {
            url: url.clone(),
            status: None,
            message: e.to_string(),
        })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        Err(Error::Http {
            url,
            status: Some(status.as_u16()),
            message,
        })
    }

    async fn run_chat(&self, req: ChatRequest, opts: GenOptions) -> Result<TurnOutput> {
        let mut body = Map::new();
        if let Some(m) = &self.model {
            body.insert("model".into(), json!(m));
        }
        body.insert("messages".into(), json!(req.messages));
        if let Some(t) = &req.tools {
            body.insert("tools".into(), json!(t));
        }
        if let Some(t) = req.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = req.top_p {
            body.insert("top_p".into(), json!(p));
        }
        let max_tokens = match (req.max_tokens.map(|n| n as usize), opts.max_tokens_cap) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(n) = max_tokens {
            body.insert("max_tokens".into(), json!(n.max(1)));
        }
        if let Some(s) = req.seed {
            body.insert("seed".into(), json!(s));
        }
        if !req.stop.is_empty() {
            body.insert("stop".into(), json!(req.stop));
        }
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
        body.insert("logprobs".into(), json!(true));
        body.insert(
            "top_logprobs".into(),
            json!(opts.top_k.clamp(1, MAX_TOP_LOGPROBS)),
        );
        let sent = Instant::now();
        let resp = self
            .post_as(
                "/v1/chat/completions",
                &Value::Object(body),
                opts.session_id.as_deref(),
            )
            .await?;
        let mut parser = SseParser::default();
        let mut state = ChatStream::default();
        let mut bytes = resp.bytes_stream();
        'read: while let Some(chunk) = bytes.next().await {
            let chunk = chunk.map_err(|e| Error::Http {
                url: format!("{}/v1/chat/completions", self.base),
                status: None,
                message: format!("reading the stream: {e}"),
            })?;
            let now = Instant::now();
            for data in parser.push(&chunk) {
                if data.trim() == "[DONE]" {
                    break 'read;
                }
                let v: Value = serde_json::from_str(&data)
                    .map_err(|e| Error::Protocol(format!("SSE data is not JSON: {e}: {data}")))?;
                state.apply(&v, now)?;
            }
        }
        let end = Instant::now();
        Ok(state.finish(sent, end))
    }

    async fn run_score(
        &self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        top_k: usize,
    ) -> Result<Vec<LogitsSummary>> {
        if output.is_empty() || prompt.is_empty() {
            return Ok(Vec::new());
        }
        let from = prompt.len();
        let mut ids = prompt;
        ids.extend_from_slice(&output);
        let mut body = json!({
            "prompt": ids,
            "echo": true,
            "logprobs": top_k.clamp(1, MAX_TOP_LOGPROBS),
            "max_tokens": 0,
        });
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        let resp = self.post("/v1/completions", &body).await?;
        let v: Value = resp.json().await.map_err(|e| Error::Http {
            url: format!("{}/v1/completions", self.base),
            status: None,
            message: format!("reading the body: {e}"),
        })?;
        parse_echo_scores(&v, &ids, from)
    }
}

impl Target for HttpTarget {
    fn info(&self) -> TargetInfo {
        TargetInfo {
            spec: self.spec.clone(),
            kind: "http".into(),
            toggles: None,
            model: self.model.clone(),
            build: None,
            scoring: "prefill".into(),
        }
    }

    fn chat(&self, request: ChatRequest, opts: GenOptions) -> BoxFuture<'_, Result<TurnOutput>> {
        Box::pin(self.run_chat(request, opts))
    }

    fn score(
        &self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        top_k: usize,
    ) -> BoxFuture<'_, Result<Vec<LogitsSummary>>> {
        Box::pin(self.run_score(prompt, output, top_k))
    }
}

/// Reads scores of positions `from..` out of a `/v1/completions` echo response.
pub fn parse_echo_scores(v: &Value, ids: &[u32], from: usize) -> Result<Vec<LogitsSummary>> {
    let lp = &v["choices"][0]["logprobs"];
    let missing = |f: &str| {
        Error::Protocol(format!("/v1/completions echo response has no logprobs.{f} (the server must return token IDs, as tapedeck does)"))
    };
    let got_ids: Vec<u32> =
        serde_json::from_value(lp["token_ids"].clone()).map_err(|_| missing("token_ids"))?;
    if got_ids.len() < ids.len() || got_ids[..ids.len()] != *ids {
        return Err(Error::Protocol(
            "the echoed token IDs differ from the IDs sent".into(),
        ));
    }
    let logprobs = lp["token_logprobs"]
        .as_array()
        .ok_or_else(|| missing("token_logprobs"))?;
    let tops = lp["top_token_ids"]
        .as_array()
        .ok_or_else(|| missing("top_token_ids"))?;
    let entropies = lp["entropies"].as_array();
    let mut out = Vec::with_capacity(ids.len() - from);
    for i in from..ids.len() {
        let logprob = logprobs
            .get(i)
            .and_then(Value::as_f64)
            .ok_or_else(|| Error::Protocol(format!("no logprob at position {i}")))?;
        let top: Vec<(u32, f32)> = tops
            .get(i)
            .and_then(|t| serde_json::from_value::<Vec<(u32, f64)>>(t.clone()).ok())
            .unwrap_or_default()
            .into_iter()
            .map(|(id, lp)| (id, lp as f32))
            .collect();
        let entropy = entropies
            .and_then(|e| e.get(i))
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN);
        out.push(LogitsSummary {
            logprob: logprob as f32,
            top,
            entropy: entropy as f32,
        });
    }
    Ok(out)
}

/// Splits a byte stream of server-sent events into `data` payloads.
///
/// Events end at a blank line (`\n\n` or `\r\n\r\n`); the `data:` lines of one event are joined
/// with `\n` as the SSE specification says; comments and other fields are ignored.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the payloads of the events completed by them.
    ///
    /// Works on bytes (carriage returns dropped) so that a UTF-8 character or a `\r\n` split
    /// across two network reads is reassembled before decoding.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend(bytes.iter().filter(|&&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            self.buf.drain(..end + 2);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Accumulates streamed chat-completion chunks into a [`TurnOutput`].
#[derive(Debug, Default)]
pub struct ChatStream {
    content: String,
    reasoning: String,
    tool_calls: Vec<(String, String, String)>,
    token_times: Vec<Instant>,
    ids: Vec<Option<u32>>,
    summaries: Vec<LogitsSummary>,
    finish_reason: Option<String>,
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
}

fn entry_id(e: &Value) -> Option<u32> {
    if let Some(id) = e["token_id"].as_u64() {
        return u32::try_from(id).ok();
    }
    e["token"]
        .as_str()
        .and_then(|t| t.strip_prefix("token_id:"))
        .and_then(|n| n.parse().ok())
}

impl ChatStream {
    /// Applies one chunk that arrived at `now`.
    pub fn apply(&mut self, v: &Value, now: Instant) -> Result<()> {
        if let Some(err) = v.get("error") {
            let msg = err["message"].as_str().unwrap_or("error event in stream");
            return Err(Error::Generation(msg.to_string()));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.prompt_tokens = u["prompt_tokens"].as_u64().map(|n| n as usize);
            self.completion_tokens = u["completion_tokens"].as_u64().map(|n| n as usize);
        }
        let Some(choice) = v["choices"].get(0) else {
            return Ok(());
        };
        let delta = &choice["delta"];
        let mut carries = false;
        if let Some(s) = delta["content"].as_str().filter(|s| !s.is_empty()) {
            self.content.push_str(s);
            carries = true;
        }
        if let Some(s) = delta["reasoning_content"]
            .as_str()
            .filter(|s| !s.is_empty())
        {
            self.reasoning.push_str(s);
            carries = true;
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            for c in calls {
                let idx = c["index"].as_u64().unwrap_or(0) as usize;
                while self.tool_calls.len() <= idx {
                    self.tool_calls.push(Default::default());
                }
                let slot = &mut self.tool_calls[idx];
                if let Some(id) = c["id"].as_str() {
                    slot.0.push_str(id);
                }
                if let Some(n) = c["function"]["name"].as_str() {
                    slot.1.push_str(n);
                }
                if let Some(a) = c["function"]["arguments"].as_str() {
                    slot.2.push_str(a);
                }
                carries = true;
            }
        }
        if let Some(entries) = choice["logprobs"]["content"].as_array() {
            for e in entries {
                let id = entry_id(e);
                self.ids.push(id);
                let top = e["top_logprobs"]
                    .as_array()
                    .map(|t| {
                        t.iter()
                            .filter_map(|x| Some((entry_id(x)?, x["logprob"].as_f64()? as f32)))
                            .collect()
                    })
                    .unwrap_or_default();
                self.summaries.push(LogitsSummary {
                    logprob: e["logprob"].as_f64().unwrap_or(f64::NAN) as f32,
                    top,
                    entropy: f32::NAN,
                });
            }
            carries |= !entries.is_empty();
        }
        if carries {
            self.token_times.push(now);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(f.to_string());
        }
        Ok(())
    }

    /// The turn's output.
    pub fn finish(self, sent: Instant, end: Instant) -> TurnOutput {
        let ids: Option<Vec<u32>> = if self.ids.is_empty() {
            None
        } else {
            self.ids.iter().cloned().collect()
        };
        let output_tokens = self
            .completion_tokens
            .or(ids.as_ref().map(Vec::len))
            .unwrap_or(self.token_times.len());
        let tool_calls: Vec<ToolCall> = self
            .tool_calls
            .into_iter()
            .enumerate()
            .map(|(i, (id, name, arguments))| ToolCall {
                id: if id.is_empty() {
                    format!("call_{i}")
                } else {
                    id
                },
                kind: "function".into(),
                function: FunctionCall { name, arguments },
            })
            .collect();
        let message = ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text(self.content.clone())),
            reasoning_content: (!self.reasoning.is_empty()).then_some(self.reasoning),
            tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
            tool_call_id: None,
            name: None,
        };
        let summaries = if ids.is_some() {
            self.summaries
        } else {
            Vec::new()
        };
        TurnOutput {
            prompt_ids: None,
            prompt_tokens: self.prompt_tokens,
            output_ids: ids,
            output_tokens,
            text: self.content,
            message,
            summaries,
            finish_reason: self.finish_reason,
            clock: Clock {
                sent,
                tokens: self.token_times,
                end,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_split_across_pushes() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(
            p.push(b"1}\r\n\r\ndata: [DONE]\n\n"),
            ["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(p.push(b": comment\n\ndata:x\ndata:y\n\n"), ["x\ny"]);
        // A CRLF split between two pushes.
        assert!(p.push(b"data: z\r").is_empty());
        assert_eq!(p.push(b"\n\r\n"), ["z"]);
    }

    #[test]
    fn chat_stream_accumulates() {
        let t0 = Instant::now();
        let mut s = ChatStream::default();
        let chunks = [
            json!({"choices":[{"delta":{"role":"assistant","content":""}}]}),
            json!({"choices":[{"delta":{"content":"Hel"},"logprobs":{"content":[{"token":"Hel","token_id":5,"logprob":-0.5,"top_logprobs":[{"token":"Hel","token_id":5,"logprob":-0.5}]}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"f","arguments":"{\"x\""}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}),
            json!({"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}),
        ];
        for c in &chunks {
            s.apply(c, t0).unwrap();
        }
        let out = s.finish(t0, t0);
        assert_eq!(out.text, "Hel");
        assert_eq!(
            out.clock.tokens.len(),
            3,
            "the role-only chunk carries no output"
        );
        assert_eq!(out.prompt_tokens, Some(7));
        assert_eq!(out.output_tokens, 3);
        assert_eq!(out.output_ids, Some(vec![5]));
        let calls = out.message.tool_calls.unwrap();
        assert_eq!(calls[0].function.arguments, "{\"x\":1}");
        assert_eq!(out.finish_reason.as_deref(), Some("tool_calls"));
        let mut bad = ChatStream::default();
        assert!(bad.apply(&json!({"error":{"message":"boom"}}), t0).is_err());
    }

    #[test]
    fn echo_scores() {
        let v = json!({"choices":[{"logprobs":{
            "token_ids":[1,2,3],
            "token_logprobs":[null,-0.1,-0.2],
            "top_token_ids":[null,[[2,-0.1]],[[3,-0.2],[4,-2.0]]],
            "entropies":[null,0.5,0.7]}}]});
        let s = parse_echo_scores(&v, &[1, 2, 3], 2).unwrap();
        assert_eq!(s.len(), 1);
        assert!((s[0].logprob + 0.2).abs() < 1e-6);
        assert_eq!(s[0].top.len(), 2);
        assert!(parse_echo_scores(&v, &[1, 9, 3], 2).is_err());
        assert!(parse_echo_scores(&json!({"choices":[{"logprobs":{}}]}), &[1], 1).is_err());
    }

    #[test]
    fn spec_parsing() {
        let t = HttpTarget::open("http://127.0.0.1:8000/v1/?model=m").unwrap();
        assert_eq!(t.base, "http://127.0.0.1:8000");
        assert_eq!(t.model.as_deref(), Some("m"));
        assert!(HttpTarget::open("http://x?foo=1").is_err());
    }
}
