//! What is recorded about one request: the typed form of a `requests` row.
//!
//! The server builds a [`RequestRecord`] as a request runs and hands it to the
//! [`crate::writer::RecordWriter`]; the session tools read them back. Optional parts are grouped so
//! that a row cannot claim a session without a turn index, or an output without its tokens.

use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tapedeck_engine::chat::EncodingReport;
use tapedeck_engine::{LogitsSummary, Toggles, ToolCall};
use uuid::Uuid;

/// Microseconds since the Unix epoch, now. The clock is the wall clock: recordings from different
/// machines line up, at the price of trusting NTP.
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

macro_rules! text_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vm])* $var),+ }

        impl $name {
            /// The text stored in the database and in JSONL.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$var => $s),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($s => Ok($name::$var),)+
                    other => Err(format!(
                        "unknown {} {other:?} (expected one of: {})",
                        stringify!($name),
                        [$($s),+].join(", ")
                    )),
                }
            }
        }
    };
}

text_enum! {
    /// What a request is for, as far as the recorder can tell (see [`crate::stitch::classify`]).
    RequestKind {
        /// A turn of an agent loop: tools were offered.
        Agent = "agent",
        /// A side request asking for a conversation title.
        Title = "title",
        /// A request asking to summarize the conversation so far; the agent's history is rewritten
        /// after it (a branch point).
        Compaction = "compaction",
        /// Anything else (plain chat, legacy completions).
        Other = "other",
    }
}

text_enum! {
    /// How a session was identified.
    SessionSource {
        /// The client sent a session header.
        Header = "header",
        /// Stitched by message content.
        Content = "content",
        /// Imported from a JSONL file.
        Import = "import",
    }
}

text_enum! {
    /// How one request was attached to its session.
    StitchMethod {
        /// By the session header.
        Header = "header",
        /// Its messages extend an earlier request's messages plus that request's answer.
        Prefix = "prefix",
        /// It carries the summary a compaction request produced: the history was rewritten.
        Compaction = "compaction",
        /// Nothing matched: it starts a new session.
        New = "new",
        /// Imported from a JSONL file.
        Import = "import",
    }
}

text_enum! {
    /// The endpoint a request came to.
    Endpoint {
        /// `POST /v1/chat/completions`.
        ChatCompletions = "/v1/chat/completions",
        /// `POST /v1/completions`.
        Completions = "/v1/completions",
    }
}

/// Where a request sits in a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRef {
    /// Session ID: the header value, or a UUID for content-stitched sessions.
    pub id: String,
    /// How the session was identified.
    pub source: SessionSource,
    /// A hint about the client (its `user-agent`), stored when the session is created.
    pub client_hint: Option<String>,
    /// 0-based turn index within the session, in arrival order.
    pub turn: u32,
    /// The request this one continues, when known.
    pub parent: Option<Uuid>,
    /// How it was attached.
    pub stitch: StitchMethod,
}

/// The identity of the build that served a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BuildInfo {
    /// Crate version.
    pub version: String,
    /// Git revision given at build time in `TAPEDECK_GIT_REVISION`, else `unknown`.
    pub git_revision: String,
    /// Comma-separated compile-time features.
    pub features: String,
    /// Backend name (`cpu`, `cuda`, `upstream`).
    pub backend: String,
    /// Device description.
    pub device: String,
}

impl BuildInfo {
    /// This build, serving on the given backend and device.
    pub fn current(backend: &str, device: &str) -> Self {
        BuildInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            git_revision: option_env!("TAPEDECK_GIT_REVISION")
                .filter(|s| !s.is_empty())
                .unwrap_or("unknown")
                .to_string(),
            features: String::new(),
            backend: backend.to_string(),
            device: device.to_string(),
        }
    }
}

/// What the model produced for a request (absent when it failed before generating).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordedOutput {
    /// Generated token IDs.
    pub token_ids: Vec<u32>,
    /// Raw generated text (markup included).
    pub text: String,
    /// The visible answer as sent to the client.
    pub content: String,
    /// Reasoning text, when the model emitted `<think>`.
    pub reasoning: Option<String>,
    /// Tool calls as sent to the client.
    pub tool_calls: Vec<ToolCall>,
    /// The OpenAI finish reason sent (`stop`, `length`, `tool_calls`), or `cancelled` / `error`.
    pub finish_reason: Option<String>,
    /// Per token: microseconds from arrival until the token reached the server.
    pub token_offsets_us: Vec<u64>,
    /// Per token: the logits summary (top-8 at least).
    pub logits: Vec<LogitsSummary>,
}

/// Teacher-forced scores of prompt positions (`/v1/completions` with `echo` and `logprobs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptScores {
    /// First prompt position scored.
    pub from: u32,
    /// One summary per position from `from`.
    pub summaries: Vec<LogitsSummary>,
}

/// One recorded request: a row of `requests`.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Request ID (also the response `id` suffix).
    pub id: Uuid,
    /// Session membership, when stitched.
    pub session: Option<SessionRef>,
    /// What the request is for.
    pub kind: RequestKind,
    /// Endpoint.
    pub endpoint: Endpoint,
    /// Arrival, µs since the epoch.
    pub arrival_us: i64,
    /// End (last byte produced or error), µs since the epoch.
    pub end_us: i64,
    /// HTTP status returned (200 for a stream that later failed: see `error`).
    pub status: u16,
    /// Error text, when the request failed.
    pub error: Option<String>,
    /// Body as received (lossy UTF-8; empty when it was not read).
    pub request_body: String,
    /// Selected request headers, name → value.
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// The `model` asked for.
    pub model: Option<String>,
    /// Toggles in force.
    pub toggles: Toggles,
    /// What the chat encoder did.
    pub encoding_report: Option<EncodingReport>,
    /// Prompt token IDs, when the prompt was encoded.
    pub prompt_ids: Option<Vec<u32>>,
    /// Output, when generation started.
    pub output: Option<RecordedOutput>,
    /// Prompt scores, for scoring requests.
    pub prompt_scores: Option<PromptScores>,
    /// Build that served it (`builds.id`).
    pub build_id: Option<i64>,
    /// The client went away before the response was complete.
    pub client_disconnected: bool,
    /// Stitch key under which a later request extending this one's messages plus its answer will
    /// find it (see [`crate::stitch`]).
    pub continuation_hash: Option<String>,
}

impl RequestRecord {
    /// A record with only the arrival facts filled in.
    pub fn new(id: Uuid, endpoint: Endpoint, arrival_us: i64, toggles: Toggles) -> Self {
        RequestRecord {
            id,
            session: None,
            kind: RequestKind::Other,
            endpoint,
            arrival_us,
            end_us: arrival_us,
            status: 200,
            error: None,
            request_body: String::new(),
            headers: serde_json::Map::new(),
            model: None,
            toggles,
            encoding_report: None,
            prompt_ids: None,
            output: None,
            prompt_scores: None,
            build_id: None,
            client_disconnected: false,
            continuation_hash: None,
        }
    }

    /// First-token time, µs since the epoch: derived from the per-token offsets.
    pub fn first_token_us(&self) -> Option<i64> {
        let first = *self.output.as_ref()?.token_offsets_us.first()?;
        Some(
            self.arrival_us
                .saturating_add(i64::try_from(first).unwrap_or(i64::MAX)),
        )
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> Option<usize> {
        self.prompt_ids.as_ref().map(Vec::len)
    }

    /// Output length in tokens.
    pub fn completion_tokens(&self) -> Option<usize> {
        self.output.as_ref().map(|o| o.token_ids.len())
    }
}
