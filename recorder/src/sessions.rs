//! `tapedeck sessions`: list, show, export and import recorded sessions.
//!
//! The exchange format is JSONL, one session per line, `"format": "tapedeck.session.v1"`
//! ([`FORMAT`]), described field by field in `recorder/FORMAT.md`. The recorder writes it
//! ([`export`]), `tapedeck synth` generates it, the replayer reads it, and [`import`] loads it back
//! into a database. Export is complete (every recorded column, blobs decoded to JSON); import is
//! lenient about what a generator may leave out (IDs, timings, kinds), filling in defaults that
//! are documented on each field.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tapedeck_engine::chat::EncodingReport;
use tapedeck_engine::messages::MessageContent;
use tapedeck_engine::{ChatMessage, LogitsSummary, Toggles, ToolCall};
use uuid::Uuid;

use crate::error::{Error, Result};
pub use crate::record::Probe;
use crate::record::{
    now_us, BuildInfo, Endpoint, PromptScores, RecordedOutput, RequestKind, RequestRecord,
    SessionRef, SessionSource, StitchMethod,
};
use crate::stitch::{classify, continuation_hash};
use crate::store::{SessionSummary, Store};

/// The format tag of every line.
pub const FORMAT: &str = "tapedeck.session.v1";

/// One line of the JSONL file: a session and its requests in turn order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionLine {
    /// Always [`FORMAT`].
    pub format: String,
    /// The session.
    pub session: SessionInfo,
    /// Its requests, in turn order.
    pub requests: Vec<RequestLine>,
}

/// The session header of a line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Session ID.
    pub id: String,
    /// How it was identified (default on import: `import`).
    #[serde(default = "default_source")]
    pub source: SessionSource,
    /// Client hint (user agent).
    #[serde(default)]
    pub client_hint: Option<String>,
    /// Creation time, µs since the epoch (default: the first request's arrival).
    #[serde(default)]
    pub created_us: Option<i64>,
}

fn default_source() -> SessionSource {
    SessionSource::Import
}

/// Times of one request. Everything is optional on import.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Arrival, µs since the epoch.
    #[serde(default)]
    pub arrival_us: Option<i64>,
    /// First token, µs since the epoch (derived from `token_offsets_us` on import).
    #[serde(default)]
    pub first_token_us: Option<i64>,
    /// End, µs since the epoch.
    #[serde(default)]
    pub end_us: Option<i64>,
    /// Per output token: µs from arrival.
    #[serde(default)]
    pub token_offsets_us: Vec<u64>,
}

/// One position's distribution: a [`LogitsSummary`] in JSON. `null` logprobs mean -infinity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// Logprob of the chosen (or given) token.
    pub logprob: Option<f32>,
    /// Entropy of the full distribution, nats.
    #[serde(default)]
    pub entropy: Option<f32>,
    /// Top alternatives, most likely first: `[token_id, logprob]`.
    #[serde(default)]
    pub top: Vec<(u32, Option<f32>)>,
}

fn finite(x: f32) -> Option<f32> {
    x.is_finite().then_some(x)
}

impl From<&LogitsSummary> for TokenLogprobs {
    fn from(s: &LogitsSummary) -> Self {
        TokenLogprobs {
            logprob: finite(s.logprob),
            entropy: finite(s.entropy),
            top: s.top.iter().map(|&(id, lp)| (id, finite(lp))).collect(),
        }
    }
}

impl From<&TokenLogprobs> for LogitsSummary {
    fn from(t: &TokenLogprobs) -> Self {
        LogitsSummary {
            logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
            entropy: t.entropy.unwrap_or(f32::NAN),
            top: t
                .top
                .iter()
                .map(|&(id, lp)| (id, lp.unwrap_or(f32::NEG_INFINITY)))
                .collect(),
        }
    }
}

/// The recorded response of one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseLine {
    /// Visible answer.
    #[serde(default)]
    pub content: String,
    /// Reasoning, if any.
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// Tool calls.
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    /// `stop`, `length`, `tool_calls`, `cancelled` or `error`.
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// Raw generated text (default on import: `content`).
    #[serde(default)]
    pub text: Option<String>,
    /// Generated token IDs.
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// One entry per generated token.
    #[serde(default)]
    pub logprobs: Vec<TokenLogprobs>,
}

/// Teacher-forced scores of prompt positions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptScoresLine {
    /// First position scored.
    pub from: u32,
    /// One entry per position from `from`.
    pub logprobs: Vec<TokenLogprobs>,
}

/// One request of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestLine {
    /// Request ID (default on import: a new UUID).
    #[serde(default)]
    pub id: Option<Uuid>,
    /// Turn index (default: position in `requests`).
    #[serde(default)]
    pub turn: Option<u32>,
    /// The request this one continues.
    #[serde(default)]
    pub parent_id: Option<Uuid>,
    /// How it was stitched (default: `import`).
    #[serde(default)]
    pub stitch: Option<StitchMethod>,
    /// Kind (default: classified from `messages` and `tools`).
    #[serde(default)]
    pub kind: Option<RequestKind>,
    /// Endpoint (default: `/v1/chat/completions`).
    #[serde(default)]
    pub endpoint: Option<Endpoint>,
    /// Model asked for.
    #[serde(default)]
    pub model: Option<String>,
    /// Chat messages exactly as the client sent them (OpenAI shape; `null` for legacy
    /// completions). Kept as JSON so that fields this version does not model survive a round trip.
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    /// Tool definitions.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Every other field of the request body (temperature, max_tokens, stream, prompt, ...).
    #[serde(default)]
    pub params: Map<String, Value>,
    /// The body as received when it was not a JSON object (malformed requests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_body: Option<String>,
    /// Selected request headers.
    #[serde(default)]
    pub headers: Map<String, Value>,
    /// Toggles in force, canonical text (`""` = defaults).
    #[serde(default)]
    pub toggles: String,
    /// The build that served it.
    #[serde(default)]
    pub build: Option<BuildInfo>,
    /// HTTP status (default 200).
    #[serde(default)]
    pub status: Option<u16>,
    /// Error text.
    #[serde(default)]
    pub error: Option<String>,
    /// The client went away before the end.
    #[serde(default)]
    pub client_disconnected: bool,
    /// Times.
    #[serde(default)]
    pub timing: Timing,
    /// Rendered prompt token IDs.
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// What the chat encoder did.
    #[serde(default)]
    pub encoding_report: Option<EncodingReport>,
    /// The response, when generation started.
    #[serde(default)]
    pub response: Option<ResponseLine>,
    /// Prompt scores (`echo` + `logprobs` on `/v1/completions`).
    #[serde(default)]
    pub prompt_scores: Option<PromptScoresLine>,
    /// What a faithful answer to this turn must show (set by `tapedeck synth` for planted
    /// needles; never recorded from traffic). The replayer reports pass/fail per probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<Probe>,
}

/// Every session with its summary.
pub async fn list(store: &Store) -> Result<Vec<SessionSummary>> {
    store.sessions().await
}

/// One session as a [`SessionLine`].
pub async fn show(store: &Store, id: &str) -> Result<SessionLine> {
    let summary = store.session(id).await?.ok_or_else(|| Error::NotFound {
        what: "session",
        id: id.to_string(),
    })?;
    let mut builds = std::collections::HashMap::new();
    let mut requests = Vec::new();
    for rec in store.session_requests(id).await? {
        let build = match rec.build_id {
            None => None,
            Some(b) => {
                if let std::collections::hash_map::Entry::Vacant(e) = builds.entry(b) {
                    e.insert(store.build(b).await?);
                }
                builds.get(&b).cloned().flatten()
            }
        };
        requests.push(request_line(rec, build));
    }
    Ok(SessionLine {
        format: FORMAT.to_string(),
        session: SessionInfo {
            id: summary.id,
            source: summary.source,
            client_hint: summary.client_hint,
            created_us: Some(summary.created_us),
        },
        requests,
    })
}

fn request_line(rec: RequestRecord, build: Option<BuildInfo>) -> RequestLine {
    let first_token_us = rec.first_token_us();
    let (messages, tools, params, raw_body) = match serde_json::from_str::<Value>(&rec.request_body)
    {
        Ok(Value::Object(mut body)) => {
            // Only well-formed lists move out of `params`: a malformed request keeps its body.
            let messages = match body.get("messages") {
                Some(Value::Array(_)) => match body.remove("messages") {
                    Some(Value::Array(m)) => Some(m),
                    _ => None,
                },
                _ => None,
            };
            let tools = match body.get("tools") {
                Some(Value::Array(_)) => match body.remove("tools") {
                    Some(Value::Array(t)) => Some(t),
                    _ => None,
                },
                _ => None,
            };
            (messages, tools, body, None)
        }
        _ => (None, None, Map::new(), Some(rec.request_body.clone())),
    };
    let (response, offsets) = match rec.output {
        None => (None, Vec::new()),
        Some(o) => (
            Some(ResponseLine {
                content: o.content,
                reasoning_content: o.reasoning,
                tool_calls: o.tool_calls,
                finish_reason: o.finish_reason,
                text: Some(o.text),
                token_ids: o.token_ids,
                logprobs: o.logits.iter().map(TokenLogprobs::from).collect(),
            }),
            o.token_offsets_us,
        ),
    };
    let session = rec.session.as_ref();
    RequestLine {
        id: Some(rec.id),
        turn: session.map(|s| s.turn),
        parent_id: session.and_then(|s| s.parent),
        stitch: session.map(|s| s.stitch),
        kind: Some(rec.kind),
        endpoint: Some(rec.endpoint),
        model: rec.model,
        messages,
        tools,
        params,
        raw_body,
        headers: rec.headers,
        toggles: rec.toggles.to_string(),
        build,
        status: Some(rec.status),
        error: rec.error,
        client_disconnected: rec.client_disconnected,
        timing: Timing {
            arrival_us: Some(rec.arrival_us),
            first_token_us,
            end_us: Some(rec.end_us),
            token_offsets_us: offsets,
        },
        prompt_token_ids: rec.prompt_ids,
        encoding_report: rec.encoding_report,
        response,
        prompt_scores: rec.prompt_scores.map(|p| PromptScoresLine {
            from: p.from,
            logprobs: p.summaries.iter().map(TokenLogprobs::from).collect(),
        }),
        // Probes are authored (by `tapedeck synth`) and kept through import; never recorded from
        // traffic.
        probe: rec.probe,
    }
}

/// Writes sessions as JSONL: the given IDs, or every session when `ids` is empty. Returns the
/// number of lines written.
pub async fn export(store: &Store, ids: &[String], out: &mut impl Write) -> Result<usize> {
    let ids: Vec<String> = if ids.is_empty() {
        store.sessions().await?.into_iter().map(|s| s.id).collect()
    } else {
        ids.to_vec()
    };
    for id in &ids {
        let line = show(store, id).await?;
        serde_json::to_writer(&mut *out, &line)
            .map_err(Error::json(format!("writing session {id}")))?;
        out.write_all(b"\n")
            .map_err(Error::io(format!("writing session {id}")))?;
    }
    out.flush().map_err(Error::io("flushing the export"))?;
    Ok(ids.len())
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ImportReport {
    /// Lines (sessions) read.
    pub sessions: usize,
    /// Requests inserted.
    pub requests: usize,
    /// Requests skipped because their ID was already in the database.
    pub skipped: usize,
}

/// Reads JSONL sessions into the database, one transaction per line. Blank lines are ignored;
/// requests whose ID is already present are skipped, so importing the same file twice is safe.
pub async fn import(store: &Store, input: impl BufRead) -> Result<ImportReport> {
    let mut report = ImportReport::default();
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(Error::io(format!("reading import line {n}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: SessionLine = serde_json::from_str(&line).map_err(|e| Error::Import {
            line: n,
            message: e.to_string(),
        })?;
        if parsed.format != FORMAT {
            return Err(Error::Import {
                line: n,
                message: format!("format {:?} is not {FORMAT:?}", parsed.format),
            });
        }
        let mut records = Vec::new();
        for (k, req) in parsed.requests.into_iter().enumerate() {
            let id = req.id.unwrap_or_else(Uuid::new_v4);
            if store.has_request(id).await? {
                report.skipped += 1;
                continue;
            }
            let build_id = match &req.build {
                Some(b) => Some(store.register_build(b).await?),
                None => None,
            };
            let rec = line_to_record(&parsed.session, req, id, k, build_id).map_err(|message| {
                Error::Import {
                    line: n,
                    message: format!("request {k}: {message}"),
                }
            })?;
            records.push(rec);
        }
        if let Some(created) = parsed.session.created_us {
            store
                .ensure_session(
                    &parsed.session.id,
                    parsed.session.source,
                    parsed.session.client_hint.as_deref(),
                    created,
                )
                .await?;
        }
        store.insert_batch(&records).await?;
        report.sessions += 1;
        report.requests += records.len();
    }
    Ok(report)
}

fn line_to_record(
    session: &SessionInfo,
    req: RequestLine,
    id: Uuid,
    index: usize,
    build_id: Option<i64>,
) -> std::result::Result<RequestRecord, String> {
    let toggles: Toggles = req.toggles.parse().map_err(|e| format!("toggles: {e}"))?;
    let arrival = req
        .timing
        .arrival_us
        .or(session.created_us.map(|c| c + index as i64))
        .unwrap_or_else(now_us);
    let endpoint = req.endpoint.unwrap_or(Endpoint::ChatCompletions);
    let mut rec = RequestRecord::new(id, endpoint, arrival, toggles);
    let typed: Option<Vec<ChatMessage>> = req
        .messages
        .as_ref()
        .and_then(|m| serde_json::from_value(Value::Array(m.clone())).ok());
    let kind = req.kind.unwrap_or_else(|| match &typed {
        Some(m) => classify(m, req.tools.as_ref().is_some_and(|t| !t.is_empty())),
        None => RequestKind::Other,
    });
    rec.kind = kind;
    rec.session = Some(SessionRef {
        id: session.id.clone(),
        source: session.source,
        client_hint: session.client_hint.clone(),
        turn: req.turn.unwrap_or(index as u32),
        parent: req.parent_id,
        stitch: req.stitch.unwrap_or(StitchMethod::Import),
    });
    rec.request_body = match req.raw_body {
        Some(raw) => raw,
        None => {
            let mut body = req.params;
            if let Some(m) = &req.messages {
                body.insert("messages".into(), Value::Array(m.clone()));
            }
            if let Some(t) = &req.tools {
                body.insert("tools".into(), Value::Array(t.clone()));
            }
            if let (Some(model), false) = (&req.model, body.contains_key("model")) {
                body.insert("model".into(), Value::String(model.clone()));
            }
            Value::Object(body).to_string()
        }
    };
    rec.headers = req.headers;
    rec.probe = req.probe;
    rec.model = req.model;
    rec.status = req.status.unwrap_or(200);
    rec.error = req.error;
    rec.client_disconnected = req.client_disconnected;
    rec.prompt_ids = req.prompt_token_ids;
    rec.encoding_report = req.encoding_report;
    rec.build_id = build_id;
    rec.prompt_scores = req.prompt_scores.map(|p| PromptScores {
        from: p.from,
        summaries: p.logprobs.iter().map(LogitsSummary::from).collect(),
    });
    let offsets = req.timing.token_offsets_us;
    rec.end_us = req
        .timing
        .end_us
        .unwrap_or_else(|| arrival + offsets.last().map_or(0, |&o| o as i64));
    if let Some(r) = req.response {
        let answer = ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text(r.content.clone())),
            reasoning_content: r.reasoning_content.clone(),
            tool_calls: (!r.tool_calls.is_empty()).then(|| r.tool_calls.clone()),
            tool_call_id: None,
            name: None,
        };
        if let (Some(m), true) = (&typed, rec.status == 200 && rec.error.is_none()) {
            rec.continuation_hash = Some(continuation_hash(m, &answer));
        }
        rec.output = Some(RecordedOutput {
            text: r.text.unwrap_or_else(|| r.content.clone()),
            content: r.content,
            reasoning: r.reasoning_content,
            tool_calls: r.tool_calls,
            finish_reason: r.finish_reason,
            token_ids: r.token_ids,
            logits: r.logprobs.iter().map(LogitsSummary::from).collect(),
            token_offsets_us: offsets,
        });
    }
    Ok(rec)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for µs since the epoch (UTC), without a date crate.
pub fn format_utc(us: i64) -> String {
    let secs = us.div_euclid(1_000_000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn clip(s: &str, n: usize) -> String {
    let one_line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        one_line
            .chars()
            .take(n.saturating_sub(1))
            .collect::<String>()
            + "…"
    }
}

/// A table of sessions for `tapedeck sessions list`.
pub fn render_list(sessions: &[SessionSummary]) -> String {
    let mut out = format!(
        "{:<36}  {:<7}  {:>4}  {:>3}  {:>9}  {:>8}  {:<20}  {:>8}  {}\n",
        "SESSION", "SOURCE", "REQS", "ERR", "PROMPT", "OUTPUT", "STARTED (UTC)", "SPAN s", "CLIENT"
    );
    for s in sessions {
        let span = match (s.first_arrival_us, s.last_end_us) {
            (Some(a), Some(b)) => format!("{:.1}", (b - a) as f64 / 1e6),
            _ => "-".into(),
        };
        out.push_str(&format!(
            "{:<36}  {:<7}  {:>4}  {:>3}  {:>9}  {:>8}  {:<20}  {:>8}  {}\n",
            clip(&s.id, 36),
            s.source.as_str(),
            s.requests,
            s.errors,
            s.prompt_tokens,
            s.completion_tokens,
            format_utc(s.first_arrival_us.unwrap_or(s.created_us)),
            span,
            clip(s.client_hint.as_deref().unwrap_or("-"), 40),
        ));
    }
    out
}

/// A turn-by-turn summary of one session for `tapedeck sessions show`.
pub fn render_session(line: &SessionLine) -> String {
    let s = &line.session;
    let mut out = format!(
        "session {} ({}, {} requests{})\n",
        s.id,
        s.source.as_str(),
        line.requests.len(),
        s.client_hint
            .as_deref()
            .map(|h| format!(", {h}"))
            .unwrap_or_default()
    );
    for r in &line.requests {
        let t = &r.timing;
        let ms = |a: Option<i64>, b: Option<i64>| match (a, b) {
            (Some(a), Some(b)) => format!("{:.0}ms", (b - a) as f64 / 1e3),
            _ => "-".into(),
        };
        let last_user = r
            .messages
            .iter()
            .flatten()
            .rev()
            .find(|m| m["role"] == "user" || m["role"] == "tool")
            .map(|m| {
                let role = m["role"].as_str().unwrap_or("?");
                let text = serde_json::from_value::<ChatMessage>(m.clone())
                    .map(|c| c.text())
                    .unwrap_or_default();
                format!("{role}: {}", clip(&text, 50))
            })
            .unwrap_or_default();
        let answer = match &r.response {
            None => format!("error: {}", clip(r.error.as_deref().unwrap_or("-"), 60)),
            Some(resp) if !resp.tool_calls.is_empty() => format!(
                "calls {}",
                resp.tool_calls
                    .iter()
                    .map(|c| c.function.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(resp) => clip(&resp.content, 60),
        };
        out.push_str(&format!(
            "  #{:<3} {:<10} {:<10} {} {:>6}→{:<5} ttft {:>7} e2e {:>7} {:<10} | {} → {}\n",
            r.turn.map_or("-".into(), |t| t.to_string()),
            r.kind.map_or("-", RequestKind::as_str),
            r.stitch.map_or("-", StitchMethod::as_str),
            r.status.unwrap_or(200),
            r.prompt_token_ids.as_ref().map_or(0, Vec::len),
            r.response.as_ref().map_or(0, |x| x.token_ids.len()),
            ms(t.arrival_us, t.first_token_us),
            ms(t.arrival_us, t.end_us),
            r.response
                .as_ref()
                .and_then(|x| x.finish_reason.as_deref())
                .unwrap_or("-"),
            last_user,
            answer,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formatting() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400_000_000), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_764_732_723_500_000), "2025-12-03T03:32:03Z");
        assert_eq!(format_utc(-1_000_000), "1969-12-31T23:59:59Z");
    }
}
