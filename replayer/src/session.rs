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
//! Both go through the same [`SessionFilter`] (session IDs, recorded start time, client, minimum
//! turns, seeded sample, shard).

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
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
    /// Who sent the session, as the recorder identified it: the session's stored client hint
    /// (the `user-agent` of its first request), else the `user-agent` header of its first request
    /// that recorded one. `--client` filters on it; absent in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
}

impl Session {
    /// A session with no client identity (see [`Session::with_client`]).
    pub fn new(id: impl Into<String>, turns: Vec<Turn>) -> Self {
        Session {
            id: id.into(),
            turns,
            client: None,
        }
    }

    /// The same session with its client identity set.
    pub fn with_client(mut self, client: Option<String>) -> Self {
        self.client = client;
        self
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
///
/// The criteria are applied in a fixed order so that every machine of a sharded replay cuts the
/// same set: first the per-session predicates (IDs, time window, client, minimum turns), then the
/// seeded sample, then the shard. Sampling before sharding means the shards of one `--sample N`
/// partition exactly that sample.
#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    /// Keep only these session IDs (empty: all).
    pub ids: Vec<String>,
    /// Keep sessions whose recorded start ([`Session::first_arrival_us`]) is at or after this
    /// time, µs since the Unix epoch. A session with no recorded arrival is dropped when either
    /// bound is set: it cannot be placed in the window.
    pub since_us: Option<i64>,
    /// Keep sessions whose recorded start is strictly before this time (µs since the epoch); the
    /// window is half-open so consecutive windows never share a session.
    pub until_us: Option<i64>,
    /// Keep sessions whose client identity ([`Session::client`]) contains one of these strings,
    /// ignoring case (empty: all). `opencode` matches `opencode/1.18.33 ai-sdk/5`; a session with
    /// no recorded client never matches a non-empty list.
    pub clients: Vec<String>,
    /// Keep sessions with at least this many turns.
    pub min_turns: usize,
    /// Keep a uniform random sample of this many sessions (seeded, so a rerun picks the same).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
    /// Keep only this shard's sessions (see [`Shard::contains`]), applied last.
    pub shard: Option<Shard>,
}

impl SessionFilter {
    /// Whether a session passes the per-session predicates (everything but sample and shard).
    pub fn keeps(&self, s: &Session) -> bool {
        (self.ids.is_empty() || self.ids.contains(&s.id))
            && self.in_window(s.first_arrival_us())
            && self.client_matches(s.client.as_deref())
            && s.turns.len() >= self.min_turns
    }

    /// Whether a recorded start time lies in `[since_us, until_us)`; always true with no bounds.
    pub fn in_window(&self, start_us: Option<i64>) -> bool {
        if self.since_us.is_none() && self.until_us.is_none() {
            return true;
        }
        let Some(t) = start_us else { return false };
        self.since_us.is_none_or(|a| t >= a) && self.until_us.is_none_or(|b| t < b)
    }

    /// Whether a client identity matches [`SessionFilter::clients`].
    pub fn client_matches(&self, client: Option<&str>) -> bool {
        if self.clients.is_empty() {
            return true;
        }
        let Some(c) = client else { return false };
        let c = c.to_lowercase();
        self.clients
            .iter()
            .any(|want| c.contains(&want.to_lowercase()))
    }

    /// Checks that the settings can select anything: a window that ends before it starts, or a
    /// shard index out of range, is a mistake to report rather than an empty replay.
    pub fn check(&self) -> Result<()> {
        if let (Some(a), Some(b)) = (self.since_us, self.until_us) {
            if b <= a {
                return Err(Error::Setting {
                    name: "until",
                    message: format!(
                        "the window [{a} µs, {b} µs) is empty: --until must be after --since"
                    ),
                });
            }
        }
        if let Some(sh) = self.shard {
            Shard::new(sh.index, sh.count)?;
        }
        Ok(())
    }

    /// Applies the filter; the relative order of kept sessions is preserved.
    pub fn apply(&self, sessions: Vec<Session>) -> Vec<Session> {
        let mut kept: Vec<Session> = sessions.into_iter().filter(|s| self.keeps(s)).collect();
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
        if let Some(sh) = self.shard {
            kept.retain(|s| sh.contains(&s.id));
        }
        kept
    }
}

/// One part of a replay split across machines: shard `index` of `count` (`--shard i/n`, 0-based).
///
/// A session belongs to the shard its ID hashes to, so the split depends only on the IDs — not
/// on load order, the database, or which machine loads first — and every machine computes the
/// same partition without coordinating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shard {
    /// This shard, `0..count`.
    pub index: u32,
    /// Number of shards (at least 1).
    pub count: u32,
}

impl Shard {
    /// A validated shard: `count ≥ 1` and `index < count`.
    pub fn new(index: u32, count: u32) -> Result<Shard> {
        if count == 0 || index >= count {
            return Err(Error::Setting {
                name: "shard",
                message: format!("{index}/{count}: need 0 <= i < n (0-based shard i of n)"),
            });
        }
        Ok(Shard { index, count })
    }

    /// The shard a session ID belongs to among `count`: the first 8 bytes of SHA-256 of the ID
    /// (big-endian) modulo `count`. SHA-256 rather than a std hasher because the value must be
    /// identical across machines, builds and Rust versions.
    pub fn of(id: &str, count: u32) -> u32 {
        let digest = Sha256::digest(id.as_bytes());
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest[..8]);
        (u64::from_be_bytes(head) % u64::from(count.max(1))) as u32
    }

    /// Whether session `id` belongs to this shard.
    pub fn contains(&self, id: &str) -> bool {
        Shard::of(id, self.count) == self.index
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = Error;

    /// Parses `i/n` (0-based: `0/4` … `3/4`).
    fn from_str(s: &str) -> Result<Shard> {
        let bad = || Error::Setting {
            name: "shard",
            message: format!("{s:?} is not i/n (e.g. 0/4; shards are numbered from 0)"),
        };
        let (i, n) = s.trim().split_once('/').ok_or_else(bad)?;
        let i: u32 = i.trim().parse().map_err(|_| bad())?;
        let n: u32 = n.trim().parse().map_err(|_| bad())?;
        Shard::new(i, n)
    }
}

/// Parses a point in time for `--since`/`--until`: Unix seconds (`1764720000`, fractions allowed),
/// an RFC 3339 / ISO 8601 instant with its UTC offset (`2026-12-03T10:00:00Z`,
/// `2026-12-03 10:00:00.5+01:00`), or a bare date (`2026-12-03`: its midnight UTC). Returns µs
/// since the Unix epoch, the unit recordings use (finer digits are dropped).
pub fn parse_time(text: &str) -> Result<i64> {
    let s = text.trim();
    let bad = |why: &dyn std::fmt::Display| Error::Setting {
        name: "time",
        message: format!(
            "{text:?}: {why} (expected Unix seconds or RFC 3339, e.g. 2026-12-03T10:00:00Z)"
        ),
    };
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_digit() || c == '.' || c == '-')
        && !s[1..].contains('-')
    {
        let secs: f64 = s.parse().map_err(|_| bad(&"not a number"))?;
        if !secs.is_finite() || secs.abs() > 1e13 {
            return Err(bad(&"out of range"));
        }
        return Ok((secs * 1e6).round() as i64);
    }
    let at = match s.parse::<jiff::Timestamp>() {
        Ok(t) => t,
        // A date alone is that day's midnight UTC; anything else needs its offset.
        Err(e) => match s.parse::<jiff::civil::Date>() {
            Ok(d) if s.len() == 10 => d
                .to_zoned(jiff::tz::TimeZone::UTC)
                .map_err(|e| bad(&e))?
                .timestamp(),
            _ => return Err(bad(&e)),
        },
    };
    Ok(at.as_microsecond())
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
    filter.check()?;
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
    let client = line
        .session
        .client_hint
        .clone()
        .or_else(|| line.requests.iter().find_map(|r| user_agent(&r.headers)));
    Ok(Session::new(line.session.id.clone(), turns).with_client(client))
}

/// The `user-agent` of a recorded header map (the recorder stores names lower-cased).
fn user_agent(headers: &serde_json::Map<String, Value>) -> Option<String> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("user-agent"))
        .and_then(|(_, v)| v.as_str())
        .map(str::to_string)
        .filter(|v| !v.is_empty())
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
    filter.check()?;
    let store = Store::open(path).await?;
    let summaries = store.sessions().await?;
    let mut sessions = Vec::new();
    for s in summaries {
        if !filter.ids.is_empty() && !filter.ids.contains(&s.id) {
            continue;
        }
        // Without a sample the shard can be cut before reading requests (a sample must be drawn
        // from the whole selection first, so every shard sees the same sample).
        if filter.sample.is_none() && filter.shard.is_some_and(|sh| !sh.contains(&s.id)) {
            continue;
        }
        let records = store.session_requests(&s.id).await?;
        let turns: Vec<Turn> = records.iter().filter_map(turn_from_record).collect();
        if !turns.is_empty() {
            let client = s
                .client_hint
                .clone()
                .or_else(|| records.iter().find_map(|r| user_agent(&r.headers)));
            sessions.push(Session::new(s.id.clone(), turns).with_client(client));
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

    /// `session(id, turns)` recorded from `start_us` (turns 1 s apart) by `client`.
    fn timed(id: &str, start_us: Option<i64>, client: Option<&str>) -> Session {
        let mut s = session(id, 2).with_client(client.map(str::to_string));
        for (k, t) in s.turns.iter_mut().enumerate() {
            t.arrival_us = start_us.map(|a| a + 1_000_000 * k as i64);
        }
        s
    }

    fn ids(v: Vec<Session>) -> Vec<String> {
        v.into_iter().map(|s| s.id).collect()
    }

    #[test]
    fn filter_time_window_is_half_open_on_the_session_start() {
        let t0 = 1_764_720_000_000_000; // 2025-12-03T00:00:00Z
        let all = vec![
            timed("early", Some(t0 - 1), None),
            timed("at-since", Some(t0), None),
            timed("inside", Some(t0 + 5_000_000), None),
            timed("at-until", Some(t0 + 10_000_000), None),
            timed("untimed", None, None),
        ];
        let f = SessionFilter {
            since_us: Some(t0),
            until_us: Some(t0 + 10_000_000),
            ..Default::default()
        };
        assert_eq!(ids(f.apply(all.clone())), ["at-since", "inside"]);
        // A session that started before the window but ran into it is not in it: the start counts.
        let f = SessionFilter {
            since_us: Some(t0 + 500_000),
            ..Default::default()
        };
        assert_eq!(ids(f.apply(all.clone())), ["inside", "at-until"]);
        let f = SessionFilter {
            until_us: Some(t0),
            ..Default::default()
        };
        assert_eq!(
            ids(f.apply(all.clone())),
            ["early"],
            "no bounds → untimed kept; bounds → dropped"
        );
        assert_eq!(SessionFilter::default().apply(all).len(), 5);
        let empty = SessionFilter {
            since_us: Some(t0),
            until_us: Some(t0),
            ..Default::default()
        };
        assert!(empty.check().unwrap_err().to_string().contains("--until"));
    }

    #[test]
    fn filter_client_substring_ignoring_case() {
        let all = vec![
            timed("oc", Some(1), Some("opencode/1.18.33 ai-sdk/5.0")),
            timed("py", Some(2), Some("OpenAI/Python 3.57.0")),
            timed("anon", Some(3), None),
        ];
        let by = |c: &[&str]| SessionFilter {
            clients: c.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        assert_eq!(ids(by(&["OpenCode"]).apply(all.clone())), ["oc"]);
        assert_eq!(ids(by(&["python"]).apply(all.clone())), ["py"]);
        assert_eq!(
            ids(by(&["python", "opencode"]).apply(all.clone())),
            ["oc", "py"]
        );
        assert!(by(&["curl"]).apply(all.clone()).is_empty());
        assert_eq!(by(&[]).apply(all).len(), 3);
    }

    #[test]
    fn filters_combine_and_the_shard_is_cut_after_the_sample() {
        let all: Vec<Session> = (0..60)
            .map(|i| {
                timed(
                    &format!("s{i}"),
                    Some(i),
                    Some(if i % 2 == 0 { "a" } else { "b" }),
                )
            })
            .collect();
        let base = SessionFilter {
            since_us: Some(10),
            clients: vec!["a".into()],
            sample: Some(12),
            seed: 3,
            ..Default::default()
        };
        let whole = ids(base.apply(all.clone()));
        assert_eq!(whole.len(), 12);
        let mut parts: Vec<String> = Vec::new();
        for i in 0..3 {
            let f = SessionFilter {
                shard: Some(Shard::new(i, 3).unwrap()),
                ..base.clone()
            };
            let part = ids(f.apply(all.clone()));
            assert!(part.iter().all(|id| Shard::of(id, 3) == i));
            parts.extend(part);
        }
        parts.sort();
        let mut sorted = whole.clone();
        sorted.sort();
        assert_eq!(
            parts, sorted,
            "the shards of a sample partition that sample"
        );
    }

    #[test]
    fn shard_hash_is_stable_and_spreads() {
        // Pinned values (computed with Python's hashlib): the split must not change between
        // builds, machines or Rust versions, or shards cut by two builds would overlap.
        let of = |n: u32| -> Vec<u32> {
            ["s0", "s1", "session-42", ""]
                .iter()
                .map(|id| Shard::of(id, n))
                .collect()
        };
        assert_eq!(of(4), [3, 3, 1, 0]);
        assert_eq!(of(3), [2, 0, 1, 1]);
        // SHA-256("") starts e3b0c442 98fc1c14.
        assert_eq!(Shard::of("", 7), (0xe3b0_c442_98fc_1c14u64 % 7) as u32);
        assert_eq!(Shard::of("anything", 1), 0);
        let mut counts = [0usize; 4];
        for i in 0..4000 {
            counts[Shard::of(&format!("sess-{i}"), 4) as usize] += 1;
        }
        // Binomial(4000, 1/4): sd ≈ 27; 800..1200 is more than 7 sd either side.
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(
            "2/4".parse::<Shard>().unwrap(),
            Shard { index: 2, count: 4 }
        );
        assert_eq!(Shard::new(2, 4).unwrap().to_string(), "2/4");
        for bad in ["4/4", "1/0", "x/2", "3", "-1/2"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }

    #[test]
    fn times_in_unix_seconds_and_rfc3339() {
        assert_eq!(parse_time("1764720000").unwrap(), 1_764_720_000_000_000);
        assert_eq!(parse_time("1764720000.25").unwrap(), 1_764_720_000_250_000);
        assert_eq!(parse_time("1970-01-01T00:00:00Z").unwrap(), 0);
        assert_eq!(
            parse_time("2025-12-03T00:00:00Z").unwrap(),
            1_764_720_000_000_000
        );
        assert_eq!(parse_time("2025-12-03").unwrap(), 1_764_720_000_000_000);
        // 2024-02-29 exists (leap year); +01:30 is 90 minutes ahead of UTC.
        assert_eq!(
            parse_time("2024-02-29T12:00:00.123456789+01:30").unwrap(),
            parse_time("2024-02-29T10:30:00Z").unwrap() + 123_456
        );
        assert_eq!(
            parse_time("2000-03-01t00:00:00.5-00:30").unwrap(),
            parse_time("2000-03-01 00:30:00.500z").unwrap()
        );
        assert_eq!(parse_time("1969-12-31T23:59:59Z").unwrap(), -1_000_000);
        for bad in [
            "",
            "yesterday",
            "2023-02-29T00:00:00Z",
            "2025-13-01T00:00:00Z",
            "2025-12-03T24:00:00Z",
            "2025-12-03T10:00:00",
            "2025-12-03T10:00:00.Z",
            "2025-12-03Z",
        ] {
            let e = parse_time(bad).unwrap_err().to_string();
            assert!(e.contains("RFC 3339"), "{bad}: {e}");
        }
    }

    #[test]
    fn client_identity_from_the_session_hint_or_a_user_agent_header() {
        let p = Path::new("s.jsonl");
        let req = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
        let mut with_header = req.clone();
        with_header["headers"] = serde_json::json!({"user-agent": "curl/8.5"});
        let lines = [
            serde_json::json!({"format": SESSION_FORMAT,
                "session": {"id": "hinted", "client_hint": "opencode/1.18"},
                "requests": [with_header.clone()]}),
            serde_json::json!({"format": SESSION_FORMAT,
                "session": {"id": "header"}, "requests": [req.clone(), with_header]}),
            serde_json::json!({"format": SESSION_FORMAT,
                "session": {"id": "old"}, "requests": [req]}),
        ];
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        let s = parse_jsonl(&text, p).unwrap();
        let clients: Vec<Option<&str>> = s.iter().map(|s| s.client.as_deref()).collect();
        assert_eq!(clients, [Some("opencode/1.18"), Some("curl/8.5"), None]);
        // The replayer's own serialization keeps it, and reads sessions written without it.
        let json = serde_json::to_value(&s[0]).unwrap();
        assert_eq!(json["client"], "opencode/1.18");
        let old: Session =
            serde_json::from_value(serde_json::json!({"id": "x", "turns": []})).unwrap();
        assert_eq!(old.client, None);
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
