//! The replay input model: sessions of turns, each a chat request with what was recorded for it.
//!
//! A [`Session`] is what the replayer plays: its turns in order, each holding the request as the
//! client sent it ([`ChatRequest`]), optionally what the recorded server answered ([`Recorded`]:
//! the reference fidelity is measured against) and an optional [`Probe`]. Sessions come from
//! * a JSONL file in the recorder's `tapedeck.session.v1` exchange format ([`load_jsonl`]; the
//!   line type is [`tapedeck_recorder::sessions::SessionLine`], described in
//!   `recorder/FORMAT.md`), one session per line, as `tapedeck sessions export` and
//!   `tapedeck synth` write it, or
//! * a tapedeck recording database through the recorder's [`Store`] read API ([`load_db`]).
//!
//! Both go through the same [`SessionFilter`] (session IDs, minimum turns, seeded sample).

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tapedeck_engine::{ChatMessage, LogitsSummary, ToolCall};
use tapedeck_recorder::record::{Endpoint, RequestRecord};
use tapedeck_recorder::sessions::{RequestLine, SessionLine};
use tapedeck_recorder::Store;

use crate::error::{Error, Result};

/// The `format` field every session line carries (the recorder's exchange format).
pub const SESSION_FORMAT: &str = tapedeck_recorder::sessions::FORMAT;

/// One multi-turn conversation to replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Session {
    /// Session ID (the recorder's session ID when loaded from a database).
    pub id: String,
    /// Turns in the order they were sent.
    pub turns: Vec<Turn>,
}

impl Session {
    /// A session with the format tag filled in.
    pub fn new(id: impl Into<String>, turns: Vec<Turn>) -> Self {
        Session {
            id: id.into(),
            turns,
        }
    }
}

/// What a turn is for, as the recorder classified it. Side requests (titles, compactions) are
/// replayed like any turn but never feed a candidate answer into the agent's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnKind {
    /// A turn of an agent loop (tools offered).
    Agent,
    /// A side request for a conversation title.
    Title,
    /// A request to summarize the conversation (history is rewritten after it).
    Compaction,
    /// Anything else.
    #[default]
    Other,
}

impl From<tapedeck_recorder::RequestKind> for TurnKind {
    fn from(k: tapedeck_recorder::RequestKind) -> Self {
        use tapedeck_recorder::RequestKind as K;
        match k {
            K::Agent => TurnKind::Agent,
            K::Title => TurnKind::Title,
            K::Compaction => TurnKind::Compaction,
            K::Other => TurnKind::Other,
        }
    }
}

/// One request of a session with its recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// What the turn is for.
    #[serde(default)]
    pub kind: TurnKind,
    /// The chat request as the client sent it.
    pub request: ChatRequest,
    /// What the recorded server produced, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Recorded>,
    /// An expected property of the answer (e.g. a planted needle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<Probe>,
    /// When the recorded request arrived at the recording server, µs since the Unix epoch
    /// (`timing.arrival_us` of a session line, `arrival_us` of a database record). Used by
    /// [`Pacing::Recorded`](crate::Pacing::Recorded) to start sessions at their recorded offsets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_us: Option<i64>,
}

impl Session {
    /// The recorded arrival of the session's first request: the first turn that has one.
    pub fn first_arrival_us(&self) -> Option<i64> {
        self.turns.iter().find_map(|t| t.arrival_us)
    }
}

/// A chat-completions request: messages, tools and the sampling parameters that matter for replay.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Tool definitions offered (OpenAI JSON), when any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// Softmax temperature; absent means the OpenAI default of 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Output token limit (`max_completion_tokens` or `max_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
}

impl ChatRequest {
    /// Reads the fields the replayer needs from an OpenAI request body; unknown fields are ignored.
    pub fn from_openai(body: &Value) -> std::result::Result<ChatRequest, String> {
        let obj = body
            .as_object()
            .ok_or("the request body is not a JSON object")?;
        let messages: Vec<ChatMessage> = serde_json::from_value(
            obj.get("messages")
                .cloned()
                .ok_or("the request has no messages")?,
        )
        .map_err(|e| format!("messages: {e}"))?;
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(a.clone()),
            Some(_) => return Err("tools is not a list".into()),
        };
        let f32_of = |k: &str| obj.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let max_tokens = obj
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| obj.get("max_tokens").and_then(Value::as_u64))
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        let stop = match obj.get("stop") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect(),
            _ => Vec::new(),
        };
        Ok(ChatRequest {
            messages,
            tools,
            temperature: f32_of("temperature"),
            top_p: f32_of("top_p"),
            max_tokens,
            seed: obj.get("seed").and_then(Value::as_u64),
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        })
    }
}

/// What the recorded server produced for a turn: the reference of every fidelity metric.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    /// Rendered prompt token IDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Generated token IDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_ids: Option<Vec<u32>>,
    /// Raw generated text.
    #[serde(default)]
    pub output_text: String,
    /// The assistant message the client received (content, reasoning, tool calls), used as the
    /// recorded answer when history is rebuilt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessage>,
    /// One logits summary per generated token.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub summaries: Vec<LogitsSummary>,
    /// OpenAI finish reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// Recorded time to first token, µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_us: Option<u64>,
    /// Recorded end-to-end latency, µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_us: Option<u64>,
    /// Toggles the recording ran with (canonical text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toggles: Option<String>,
}

/// An expected property of a turn's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// Strings the answer text must contain (all of them).
    #[serde(default)]
    pub must_contain: Vec<String>,
}

impl Probe {
    /// Whether `answer` passes.
    pub fn passes(&self, answer: &str) -> bool {
        self.must_contain
            .iter()
            .all(|s| answer.contains(s.as_str()))
    }
}

/// Which sessions to replay.
#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    /// Keep only these session IDs (empty: all).
    pub ids: Vec<String>,
    /// Keep sessions with at least this many turns.
    pub min_turns: usize,
    /// Keep a uniform random sample of this many sessions (seeded, so a rerun picks the same).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
}

impl SessionFilter {
    /// Applies the filter; the relative order of kept sessions is preserved.
    pub fn apply(&self, sessions: Vec<Session>) -> Vec<Session> {
        let mut kept: Vec<Session> = sessions
            .into_iter()
            .filter(|s| self.ids.is_empty() || self.ids.contains(&s.id))
            .filter(|s| s.turns.len() >= self.min_turns)
            .collect();
        if let Some(n) = self.sample {
            if n < kept.len() {
                let mut idx: Vec<usize> = (0..kept.len()).collect();
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed);
                idx.shuffle(&mut rng);
                let mut chosen: Vec<usize> = idx.into_iter().take(n).collect();
                chosen.sort_unstable();
                let mut all: Vec<Option<Session>> = kept.into_iter().map(Some).collect();
                kept = chosen.into_iter().filter_map(|i| all[i].take()).collect();
            }
        }
        kept
    }
}

/// Parses `tapedeck.session.v1` JSONL text (blank lines and lines starting with `#` are skipped).
/// `path` only labels errors.
pub fn parse_jsonl(text: &str, path: &Path) -> Result<Vec<Session>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |message: String| Error::SessionFormat {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let s: SessionLine = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        if s.format != SESSION_FORMAT {
            return Err(err(format!(
                "format {:?} is not {SESSION_FORMAT:?}",
                s.format
            )));
        }
        out.push(session_from_line(&s).map_err(err)?);
    }
    Ok(out)
}

/// Reads a `tapedeck.session.v1` JSONL file and applies `filter`.
pub fn load_jsonl(path: &Path, filter: &SessionFilter) -> Result<Vec<Session>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(filter.apply(parse_jsonl(&text, path)?))
}

/// Converts one exported session line. Requests that are not chat turns (legacy completions,
/// malformed bodies) are skipped; a chat request whose messages do not parse is an error.
pub fn session_from_line(line: &SessionLine) -> std::result::Result<Session, String> {
    let mut turns = Vec::new();
    for (k, req) in line.requests.iter().enumerate() {
        if let Some(t) = turn_from_line(req).map_err(|m| format!("request {k}: {m}"))? {
            turns.push(t);
        }
    }
    Ok(Session::new(line.session.id.clone(), turns))
}

/// Converts one exported request; `Ok(None)` when it is not a replayable chat turn.
pub fn turn_from_line(req: &RequestLine) -> std::result::Result<Option<Turn>, String> {
    if req.endpoint.is_some_and(|e| e != Endpoint::ChatCompletions) || req.raw_body.is_some() {
        return Ok(None);
    }
    let Some(messages) = &req.messages else {
        return Ok(None);
    };
    let mut body = req.params.clone();
    body.insert("messages".into(), Value::Array(messages.clone()));
    if let Some(t) = &req.tools {
        body.insert("tools".into(), Value::Array(t.clone()));
    }
    let request = ChatRequest::from_openai(&Value::Object(body))?;
    let tm = &req.timing;
    let first_token = tm.first_token_us.or_else(|| {
        let off = i64::try_from(*tm.token_offsets_us.first()?).ok()?;
        Some(tm.arrival_us? + off)
    });
    let since_arrival = |t: Option<i64>| u64::try_from(t? - tm.arrival_us?).ok();
    let has_response = req.response.is_some() || req.prompt_token_ids.is_some();
    let recorded = has_response.then(|| {
        let resp = req.response.as_ref();
        Recorded {
            prompt_ids: req.prompt_token_ids.clone(),
            // A generator may give text without IDs; an empty list then means "unknown".
            output_ids: resp
                .filter(|r| {
                    !r.token_ids.is_empty() || r.text.as_deref().unwrap_or(&r.content).is_empty()
                })
                .map(|r| r.token_ids.clone()),
            output_text: resp
                .map(|r| r.text.clone().unwrap_or_else(|| r.content.clone()))
                .unwrap_or_default(),
            message: resp.map(|r| assistant(&r.content, &r.reasoning_content, &r.tool_calls)),
            summaries: resp
                .map(|r| r.logprobs.iter().map(LogitsSummary::from).collect())
                .unwrap_or_default(),
            finish_reason: resp.and_then(|r| r.finish_reason.clone()),
            ttft_us: since_arrival(first_token),
            e2e_us: since_arrival(tm.end_us),
            toggles: Some(req.toggles.clone()),
        }
    });
    let kind = req.kind.map_or_else(
        || {
            if request.tools.as_ref().is_some_and(|t| !t.is_empty()) {
                TurnKind::Agent
            } else {
                TurnKind::Other
            }
        },
        TurnKind::from,
    );
    Ok(Some(Turn {
        kind,
        request,
        recorded,
        probe: req.probe.as_ref().map(|p| Probe {
            must_contain: p.must_contain.clone(),
        }),
        arrival_us: tm.arrival_us,
    }))
}

fn assistant(content: &str, reasoning: &Option<String>, calls: &[ToolCall]) -> ChatMessage {
    ChatMessage {
        role: "assistant".into(),
        content: Some(tapedeck_engine::messages::MessageContent::Text(
            content.to_string(),
        )),
        reasoning_content: reasoning.clone(),
        tool_calls: (!calls.is_empty()).then(|| calls.to_vec()),
        tool_call_id: None,
        name: None,
    }
}

/// Turns one recorded request into a turn; `None` for requests that cannot be replayed as chat
/// (legacy completions, bodies that did not parse).
pub fn turn_from_record(rec: &RequestRecord) -> Option<Turn> {
    if rec.endpoint != Endpoint::ChatCompletions {
        return None;
    }
    let body: Value = serde_json::from_str(&rec.request_body).ok()?;
    let request = ChatRequest::from_openai(&body).ok()?;
    let recorded = Recorded {
        prompt_ids: rec.prompt_ids.clone(),
        output_ids: rec.output.as_ref().map(|o| o.token_ids.clone()),
        output_text: rec
            .output
            .as_ref()
            .map(|o| o.text.clone())
            .unwrap_or_default(),
        message: rec
            .output
            .as_ref()
            .map(|o| assistant(&o.content, &o.reasoning, &o.tool_calls)),
        summaries: rec
            .output
            .as_ref()
            .map(|o| o.logits.clone())
            .unwrap_or_default(),
        finish_reason: rec.output.as_ref().and_then(|o| o.finish_reason.clone()),
        ttft_us: rec
            .first_token_us()
            .and_then(|t| u64::try_from(t - rec.arrival_us).ok()),
        e2e_us: u64::try_from(rec.end_us - rec.arrival_us).ok(),
        toggles: Some(rec.toggles.to_string()),
    };
    Some(Turn {
        kind: rec.kind.into(),
        request,
        recorded: Some(recorded),
        probe: None,
        arrival_us: Some(rec.arrival_us),
    })
}

/// Reads sessions from a tapedeck recording database through the recorder's [`Store`] and applies
/// `filter`. Requests that are not replayable chat turns are skipped; sessions left empty are
/// dropped. The file is opened with the recorder's migrations (an older database is upgraded).
pub async fn load_db(path: &Path, filter: &SessionFilter) -> Result<Vec<Session>> {
    let store = Store::open(path).await?;
    let summaries = store.sessions().await?;
    let mut sessions = Vec::new();
    for s in summaries {
        if !filter.ids.is_empty() && !filter.ids.contains(&s.id) {
            continue;
        }
        let records = store.session_requests(&s.id).await?;
        let turns: Vec<Turn> = records.iter().filter_map(turn_from_record).collect();
        if !turns.is_empty() {
            sessions.push(Session::new(s.id.clone(), turns));
        }
    }
    store.close().await;
    Ok(filter.apply(sessions))
}

/// Where sessions come from, as the CLI names it: a `.jsonl` file or a database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionSource {
    /// A `tapedeck.session.v1` JSONL file.
    Jsonl(PathBuf),
    /// A tapedeck SQLite recording database.
    Database(PathBuf),
}

impl SessionSource {
    /// Chooses by extension: `.jsonl`/`.json`/`.ndjson` are session files, anything else a
    /// database.
    pub fn from_path(path: &Path) -> SessionSource {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "ndjson" | "json") => SessionSource::Jsonl(path.to_path_buf()),
            _ => SessionSource::Database(path.to_path_buf()),
        }
    }

    /// Loads and filters.
    pub async fn load(&self, filter: &SessionFilter) -> Result<Vec<Session>> {
        match self {
            SessionSource::Jsonl(p) => load_jsonl(p, filter),
            SessionSource::Database(p) => load_db(p, filter).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(id: &str, turns: usize) -> Session {
        let t = Turn {
            kind: TurnKind::Agent,
            request: ChatRequest {
                messages: vec![ChatMessage::new("user", "hi")],
                ..ChatRequest::default()
            },
            recorded: None,
            probe: None,
            arrival_us: None,
        };
        Session::new(id, vec![t; turns])
    }

    #[test]
    fn jsonl_lines_and_errors() {
        let p = Path::new("s.jsonl");
        let line = serde_json::json!({
            "format": SESSION_FORMAT,
            "session": {"id": "s1"},
            "requests": [
                {"messages": [{"role": "user", "content": "hi"}],
                 "params": {"temperature": 0, "max_tokens": 5},
                 "timing": {"arrival_us": 100, "end_us": 600, "token_offsets_us": [50, 80]},
                 "prompt_token_ids": [1, 2, 3],
                 "response": {"content": "yo", "text": "yo", "token_ids": [7, 8],
                              "logprobs": [{"logprob": -0.5, "top": [[7, -0.5]]},
                                           {"logprob": null, "top": []}],
                              "finish_reason": "stop"},
                 "probe": {"must_contain": ["yo"]}},
                {"endpoint": "completions", "params": {"prompt": "x"}}
            ]
        });
        let text = format!("# comment\n\n{line}\n");
        let s = parse_jsonl(&text, p).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].id, "s1");
        assert_eq!(s[0].turns.len(), 1, "legacy completions are skipped");
        let t = &s[0].turns[0];
        assert_eq!(t.request.temperature, Some(0.0));
        assert_eq!(t.request.max_tokens, Some(5));
        let r = t.recorded.as_ref().unwrap();
        assert_eq!(r.prompt_ids.as_deref(), Some(&[1, 2, 3][..]));
        assert_eq!(r.output_ids.as_deref(), Some(&[7, 8][..]));
        assert_eq!(r.summaries.len(), 2);
        assert_eq!(r.summaries[1].logprob, f32::NEG_INFINITY);
        assert_eq!(r.ttft_us, Some(50));
        assert_eq!(r.e2e_us, Some(500));
        assert!(t.probe.as_ref().unwrap().passes("yo!"));
        assert_eq!(t.arrival_us, Some(100), "the recorded arrival is kept");
        assert_eq!(s[0].first_arrival_us(), Some(100));
        let bad = text.replace(SESSION_FORMAT, "other.v9");
        assert!(parse_jsonl(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("s.jsonl:3:"));
        assert!(parse_jsonl("\n\nnot json", p)
            .unwrap_err()
            .to_string()
            .contains(":3:"));
    }

    #[test]
    fn filter_ids_min_turns_sample() {
        let all: Vec<Session> = (0..10).map(|i| session(&format!("s{i}"), i % 4)).collect();
        let f = SessionFilter {
            min_turns: 2,
            ..Default::default()
        };
        assert!(f.apply(all.clone()).iter().all(|s| s.turns.len() >= 2));
        let f = SessionFilter {
            ids: vec!["s3".into(), "s5".into()],
            ..Default::default()
        };
        let ids: Vec<String> = f.apply(all.clone()).into_iter().map(|s| s.id).collect();
        assert_eq!(ids, ["s3", "s5"]);
        let f = SessionFilter {
            sample: Some(4),
            seed: 7,
            ..Default::default()
        };
        let a = f.apply(all.clone());
        assert_eq!(a.len(), 4);
        assert_eq!(a, f.apply(all), "a seeded sample is reproducible");
    }

    #[test]
    fn openai_body_fields() {
        let body = serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "temperature": 0, "max_completion_tokens": 12, "max_tokens": 99,
            "seed": 3, "stop": "END"
        });
        let r = ChatRequest::from_openai(&body).unwrap();
        assert_eq!(r.messages.len(), 1);
        assert_eq!(r.tools.as_ref().map(Vec::len), Some(1));
        assert_eq!(r.temperature, Some(0.0));
        assert_eq!(r.max_tokens, Some(12));
        assert_eq!(r.seed, Some(3));
        assert_eq!(r.stop, ["END"]);
        assert!(ChatRequest::from_openai(&serde_json::json!({"x": 1})).is_err());
    }
}
