//! What a replay runs against: the in-process engine with a toggle set, or any OpenAI-compatible
//! HTTP server.
//!
//! A [`Target`] does two things per turn:
//! * [`Target::chat`]: free-running generation of one chat request, with client-side timing as raw
//!   instants ([`Clock`]) so the run loop can measure from the *intended* send time;
//! * [`Target::score`]: teacher forcing — the candidate's distribution at every position of a
//!   given token sequence — which is what makes drift measurable independently of sampling.
//!
//! Targets are named by a spec string ([`open`]): `engine:DIR?name=value,...` or an `http(s)://`
//! base URL (`?model=NAME` optional). The trait returns boxed futures so that it stays object safe
//! (`Arc<dyn Target>`), which the CLI needs to pick a target at run time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tapedeck_engine::{ChatMessage, LogitsSummary};

use crate::error::{Error, Result};
use crate::session::ChatRequest;

pub mod engine;
pub mod http;

pub use engine::EngineTarget;
pub use http::HttpTarget;

/// Describes a target in run summaries.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// The spec string it was opened with.
    pub spec: String,
    /// `engine` or `http`.
    pub kind: String,
    /// Toggles in force (canonical text, `""` for defaults), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toggles: Option<String>,
    /// Model name or directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Build identity, when known (`version git_revision` for the in-process engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// How teacher forcing runs: `decode` (engine) or `prefill` (HTTP `/v1/completions`).
    pub scoring: String,
}

/// Per-call generation options set by the run, not by the recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenOptions {
    /// Alternatives per logits summary to ask for.
    pub top_k: usize,
    /// Upper bound on output tokens regardless of the request (`None`: the request's own).
    pub max_tokens_cap: Option<usize>,
    /// The replayed session's ID, sent to HTTP targets as `x-session-id` so a recording server
    /// stitches the replayed turns into one session (content stitching cannot: in recorded mode
    /// each turn carries the recorded answers, not the ones the server just gave).
    pub session_id: Option<String>,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            top_k: tapedeck_engine::generate::DEFAULT_SUMMARY_K,
            max_tokens_cap: None,
            session_id: None,
        }
    }
}

/// Raw client-side times of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clock {
    /// When the request was handed to the target.
    pub sent: Instant,
    /// When each output token (HTTP: each SSE chunk carrying output) arrived.
    pub tokens: Vec<Instant>,
    /// When the response was complete.
    pub end: Instant,
}

/// What a target produced for one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutput {
    /// Prompt token IDs as the candidate encoded them (engine only: HTTP servers do not return
    /// them).
    pub prompt_ids: Option<Vec<u32>>,
    /// Prompt length in tokens (engine: exact; HTTP: `usage.prompt_tokens`).
    pub prompt_tokens: Option<usize>,
    /// Output token IDs, when the target exposes them.
    pub output_ids: Option<Vec<u32>>,
    /// Output tokens (counted even when the IDs are unknown).
    pub output_tokens: usize,
    /// Generated text (engine: raw, markup included; HTTP: the streamed content).
    pub text: String,
    /// The answer as an assistant message (content, reasoning, tool calls), fed back in `self`
    /// history mode.
    pub message: ChatMessage,
    /// One summary per output token, when the target exposes token IDs.
    pub summaries: Vec<LogitsSummary>,
    /// OpenAI finish reason.
    pub finish_reason: Option<String>,
    /// Client-side times.
    pub clock: Clock,
}

/// A candidate to replay against.
pub trait Target: Send + Sync {
    /// Its description for reports.
    fn info(&self) -> TargetInfo;

    /// Generates one chat turn.
    fn chat(&self, request: ChatRequest, opts: GenOptions) -> BoxFuture<'_, Result<TurnOutput>>;

    /// Teacher forcing: for each `i` in `0..output.len()`, the candidate's distribution after
    /// `prompt ++ output[..i]`, with `logprob` that of `output[i]` and `top_k` alternatives.
    fn score(
        &self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        top_k: usize,
    ) -> BoxFuture<'_, Result<Vec<LogitsSummary>>>;
}

/// Maps an embedded-fixture name (or any name the CLI knows) to a model directory. The CLI owns
/// the embedded models, so it passes this in; a plain directory path should be returned as is.
pub type ModelResolver = dyn Fn(&str) -> std::result::Result<PathBuf, String> + Send + Sync;

/// How to open targets from specs.
#[derive(Clone, Default)]
pub struct TargetOptions {
    /// Resolves the `DIR` of `engine:DIR`; `None` treats it as a path.
    pub resolver: Option<Arc<ModelResolver>>,
    /// Engine worker threads (`None`: one per core).
    pub threads: Option<usize>,
    /// Scheduler limits of an engine target.
    pub scheduler: tapedeck_engine::scheduler::SchedulerConfig,
}

impl std::fmt::Debug for TargetOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetOptions")
            .field("resolver", &self.resolver.as_ref().map(|_| "<fn>"))
            .field("threads", &self.threads)
            .field("scheduler", &self.scheduler)
            .finish()
    }
}

/// Opens a target from its spec: `engine:DIR?toggles` or `http(s)://host[:port][/v1][?model=M]`.
pub fn open(spec: &str, opts: &TargetOptions) -> Result<Arc<dyn Target>> {
    if spec.starts_with("engine:") {
        Ok(Arc::new(EngineTarget::open(spec, opts)?))
    } else if spec.starts_with("http://") || spec.starts_with("https://") {
        Ok(Arc::new(HttpTarget::open(spec)?))
    } else {
        Err(Error::TargetSpec {
            spec: spec.to_string(),
            message: "expected engine:DIR?toggles or an http(s):// base URL".into(),
        })
    }
}
