//! The engine a caller holds: model, tokenizer and chat template loaded from one directory, with
//! `generate` and `score` over token IDs.
//!
//! INTERFACE STUB: bodies in progress.

use std::path::{Path, PathBuf};

use crate::chat::{ChatTemplate, EncodeOptions, Encoding};
use crate::error::{Error, Result};
use crate::generate::{GenerateOutput, GenerateRequest, LogitsSummary, TokenEvent};
use crate::messages::ChatMessage;
use crate::tokenizer::Tokenizer;
use crate::toggles::Toggles;

/// A loaded model ready to serve. `Send + Sync`: share it behind an `Arc`.
pub struct Engine {
    dir: PathBuf,
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

/// The score of one given token under the model (teacher forcing).
pub type TokenScore = LogitsSummary;

impl Engine {
    /// Loads a model directory.
    pub fn load(dir: &Path) -> Result<Self> {
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir, &tokenizer)?;
        Ok(Engine {
            dir: dir.to_path_buf(),
            tokenizer,
            template,
        })
    }

    /// The model name served (the directory's last component).
    pub fn model_id(&self) -> String {
        self.dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The context window in tokens.
    pub fn context_len(&self) -> usize {
        0
    }

    /// Renders and tokenizes a chat.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding> {
        self.template
            .encode(&self.tokenizer, messages, tools, opts)
    }

    /// Generates from prompt IDs, calling `on_token` for each token; generation stops early with
    /// `FinishReason::Cancelled` when `on_token` returns `false`.
    pub fn generate(
        &self,
        _req: &GenerateRequest,
        _on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<GenerateOutput> {
        Err(Error::InvalidRequest("not yet implemented".into()))
    }

    /// Teacher forcing: for every position `i` in `from..tokens.len()`, the summary of the model's
    /// distribution after `tokens[..i]`, with `logprob` that of `tokens[i]`.
    pub fn score(
        &self,
        _tokens: &[u32],
        _from: usize,
        _top_k: usize,
        _toggles: &Toggles,
    ) -> Result<Vec<TokenScore>> {
        Err(Error::InvalidRequest("not yet implemented".into()))
    }
}
