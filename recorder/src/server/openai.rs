//! The OpenAI request shapes the server accepts, and small builders for the response shapes.
//!
//! Fields the server does not use are accepted and ignored (the raw body is recorded as received,
//! so nothing is lost); `null` is accepted wherever a field is optional, as SDKs send it.

use serde::Deserialize;
use serde_json::{json, Value};
use tapedeck_engine::{ChatMessage, LogitsSummary};

use super::error::ApiError;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings, empty ones removed.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling and stopping fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Softmax temperature (default 1, OpenAI's).
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Top-k (vLLM extension; 0 or -1 means off).
    pub top_k: Option<i64>,
    /// Min-p (vLLM extension).
    pub min_p: Option<f32>,
    /// Random seed (any integer; negative values are taken as their two's-complement bits).
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
    /// Stream the response as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Keep generating past EOS (vLLM extension).
    pub ignore_eos: Option<bool>,
}

impl SamplingFields {
    /// Checks ranges and builds the engine's sampling parameters.
    pub fn sampling(&self) -> Result<tapedeck_engine::SamplingParams, ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::invalid_param(
                "temperature",
                "temperature must be a number >= 0",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", "top_p must be in (0, 1]"));
        }
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid_param("min_p", "min_p must be in [0, 1]"));
        }
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => None,
            Some(k) if k > 0 => Some(k as usize),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    "top_k must be positive, 0 or -1",
                ))
            }
        };
        if self.n.unwrap_or(1) != 1 {
            return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
        }
        Ok(tapedeck_engine::SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: self.seed.map(|s| s as u64),
        })
    }

    /// Whether to stream.
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a streamed response ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Model name; must be the served one when present.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tool definitions (`[{"type": "function", "function": {...}}]`).
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", ...}`: `"none"` hides the tools
    /// from the model; the others are accepted and not enforced.
    pub tool_choice: Option<Value>,
    /// Return logprobs of the generated tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token (0..=20).
    pub top_logprobs: Option<u32>,
    /// Token limit (legacy name).
    pub max_tokens: Option<u32>,
    /// Token limit (current name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u32>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

impl ChatRequest {
    /// The tools to show the model: none when absent, empty or `tool_choice` is `"none"`.
    pub fn effective_tools(&self) -> Option<&[Value]> {
        if self.tool_choice.as_ref().and_then(Value::as_str) == Some("none") {
            return None;
        }
        self.tools.as_deref().filter(|t| !t.is_empty())
    }
}

/// A legacy prompt: text, token IDs, or a one-element batch of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token IDs.
    Ids(Vec<u32>),
    /// A batch of texts (only one supported).
    Texts(Vec<String>),
    /// A batch of token-ID lists (only one supported).
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name; must be the served one when present.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Token limit (default 16, OpenAI's; 0 allowed, e.g. with `echo` to score only).
    pub max_tokens: Option<u32>,
    /// Return the prompt before the completion (and score it when `logprobs` is set).
    pub echo: Option<bool>,
    /// Alternatives per token (0..=20); present means "return logprobs".
    pub logprobs: Option<u32>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// The text of a token as clients see it in logprobs.
pub fn token_entry(text: &str, logprob: f32) -> Value {
    json!({"token": text, "logprob": finite(logprob), "bytes": text.as_bytes()})
}

/// A JSON number for a logprob: `-inf` (a token the model ruled out) becomes -9999, as vLLM does,
/// because JSON has no infinities.
pub fn finite(x: f32) -> f64 {
    if x.is_finite() {
        f64::from(x)
    } else if x.is_nan() {
        0.0
    } else {
        -9999.0
    }
}

/// One element of chat `logprobs.content`.
pub fn chat_logprob(
    token_text: &dyn Fn(u32) -> String,
    id: u32,
    s: &LogitsSummary,
    top_n: usize,
) -> Value {
    let mut v = token_entry(&token_text(id), s.logprob);
    let top: Vec<Value> = s
        .top
        .iter()
        .take(top_n)
        .map(|&(tid, lp)| token_entry(&token_text(tid), lp))
        .collect();
    v["top_logprobs"] = Value::Array(top);
    v
}
