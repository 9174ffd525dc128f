//! What a caller asks the engine for and what comes back: sampling parameters, stop criteria,
//! per-token events with their logits summaries, and the final output.
//!
//! One event type travels from the engine to both the HTTP layer and the recorder, so a streamed
//! token and its recorded row can never disagree.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::toggles::Toggles;

/// How the next token is drawn from the distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the K most likely tokens (`None` or 0: all).
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the smallest set whose probability reaches `top_p` (1.0: all).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top token's (0.0: none).
    pub min_p: f32,
    /// Seed of the request's random stream; the same seed and toggles give the same tokens.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

/// When generation ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopCriteria {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Strings that end generation; the returned text stops before the match.
    pub stop_strings: Vec<String>,
    /// Extra token IDs that end generation (the model's EOS IDs always do unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past EOS (benchmarks want fixed lengths).
    pub ignore_eos: bool,
}

impl Default for StopCriteria {
    fn default() -> Self {
        StopCriteria {
            max_tokens: 256,
            stop_strings: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A generation request over prompt token IDs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token IDs (already rendered and tokenized).
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop criteria.
    pub stop: StopCriteria,
    /// How many top alternatives each logits summary keeps.
    pub top_k_summary: usize,
    /// Toggles in force for this request.
    pub toggles: Toggles,
}

/// The default number of alternatives in a logits summary.
pub const DEFAULT_SUMMARY_K: usize = 8;

/// What the model's distribution looked like at one position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitsSummary {
    /// Log-probability of the token chosen (generation) or given (scoring).
    pub logprob: f32,
    /// The K most likely token IDs with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
    /// Entropy of the full distribution, in nats.
    pub entropy: f32,
}

/// One generated token, as streamed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    /// The token ID.
    pub id: u32,
    /// Text that became final with this token (may be empty mid-character or while a stop string
    /// might still match).
    pub text: String,
    /// The distribution it was drawn from.
    pub summary: LogitsSummary,
    /// Time since the request started.
    pub elapsed: Duration,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached or the context window is full.
    Length,
    /// The caller stopped listening.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI `finish_reason` text.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Timings of one request, measured in the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Prompt processing time.
    pub prefill: Duration,
    /// Time to the first generated token.
    pub first_token: Option<Duration>,
    /// Total time.
    pub total: Duration,
}

/// The complete result of a generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateOutput {
    /// Generated token IDs (the stop token included when one ended generation).
    pub tokens: Vec<u32>,
    /// Generated text, cut before a matched stop string.
    pub text: String,
    /// One summary per generated token.
    pub summaries: Vec<LogitsSummary>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The stop string matched, if any.
    pub matched_stop: Option<String>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Timings.
    pub timings: Timings,
}
