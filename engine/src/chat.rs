//! Chat encoding: the model's own Jinja `chat_template` rendered with minijinja, the explicit
//! reasoning-drop rule, the encoding faults, and parsing tool calls back out of generated text.
//!
//! INTERFACE STUB: the bodies are being written; the signatures are the contract.

use std::num::NonZeroUsize;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::messages::{ChatMessage, ToolCall};
use crate::tokenizer::Tokenizer;
use crate::toggles::Toggles;

/// How tool calls appear in generated text, detected from the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    LlamaJson,
}

/// A compiled chat template and the facts about it the encoder needs.
pub struct ChatTemplate {
    _private: (),
}

/// What an encoding did, recorded with every request so a replay can tell encodings apart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodingReport {
    /// Name of the reasoning rule applied (`drop_before_last_user_unless_tools`).
    pub reasoning_rule: String,
    /// Whether tools were present (the rule keeps reasoning when they are).
    pub tools_present: bool,
    /// Indices (into the request's messages) of assistant turns whose reasoning was dropped.
    pub reasoning_dropped: Vec<usize>,
    /// Indices of assistant turns whose reasoning was rendered.
    pub reasoning_kept: Vec<usize>,
    /// Messages silently dropped from the front by `fault.context_window` (0 without the fault).
    pub messages_truncated: usize,
    /// SHA-256 of the template source, hex.
    pub template_sha256: String,
    /// The encoding-relevant toggles in force (`fault.encoding`, `fault.context_window`).
    pub faults: Vec<String>,
}

/// A rendered and tokenized prompt.
#[derive(Debug, Clone)]
pub struct Encoding {
    /// The rendered prompt text.
    pub text: String,
    /// Its token IDs.
    pub ids: Vec<u32>,
    /// What the encoder did.
    pub report: EncodingReport,
}

/// Generated text split into its parts per the template's convention.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParsedOutput {
    /// Visible answer text (reasoning and tool-call markup removed).
    pub content: String,
    /// Text inside `<think>...</think>`, if any.
    pub reasoning_content: Option<String>,
    /// Tool calls found, with generated IDs `call_<n>`.
    pub tool_calls: Vec<ToolCall>,
}

/// Options of one encoding.
#[derive(Debug, Clone, Copy)]
pub struct EncodeOptions {
    /// Append the assistant header so the model answers.
    pub add_generation_prompt: bool,
    /// Toggles in force (only the encoding faults matter here).
    pub toggles: Toggles,
}

impl ChatTemplate {
    /// Reads `chat_template` from `tokenizer_config.json` (or `chat_template.jinja`) in a model dir.
    pub fn from_dir(_dir: &Path, _tokenizer: &Tokenizer) -> Result<Self> {
        Err(Error::Template("not yet implemented".into()))
    }

    /// Compiles a template from source.
    pub fn from_source(_source: &str, _bos: Option<&str>, _eos: Option<&str>) -> Result<Self> {
        Err(Error::Template("not yet implemented".into()))
    }

    /// The tool-call convention of this template.
    pub fn tool_call_format(&self) -> ToolCallFormat {
        ToolCallFormat::Hermes
    }

    /// Renders messages (after the reasoning rule) to prompt text.
    pub fn render(
        &self,
        _messages: &[ChatMessage],
        _tools: Option<&[serde_json::Value]>,
        _opts: &EncodeOptions,
    ) -> Result<(String, EncodingReport)> {
        Err(Error::Template("not yet implemented".into()))
    }

    /// Renders and tokenizes, applying `fault.context_window` (which needs token counts).
    pub fn encode(
        &self,
        _tokenizer: &Tokenizer,
        _messages: &[ChatMessage],
        _tools: Option<&[serde_json::Value]>,
        _opts: &EncodeOptions,
    ) -> Result<Encoding> {
        Err(Error::Template("not yet implemented".into()))
    }

    /// Splits generated text into content, reasoning and tool calls.
    pub fn parse_output(&self, text: &str) -> ParsedOutput {
        ParsedOutput {
            content: text.to_string(),
            ..Default::default()
        }
    }
}

#[allow(dead_code)]
fn _unused(_: NonZeroUsize) {}
