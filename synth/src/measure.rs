//! Token counting with the target model's real chat encoding.
//!
//! Needle depths are absolute token positions in the prompt *as the model sees it*: the messages
//! rendered by the model's own chat template (tools block included) and tokenized by its own
//! tokenizer, exactly what `tapedeck serve` would feed the engine. Only the tokenizer and the
//! template are loaded (not the weights), through the engine's own loaders, so counts cannot drift
//! from what the engine encodes.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tapedeck_engine::chat::{ChatTemplate, EncodeOptions};
use tapedeck_engine::tokenizer::Tokenizer;
use tapedeck_engine::{ChatMessage, Toggles};

use crate::error::{Error, Result};

/// A model's tokenizer and chat template, for measuring prompts.
pub struct Counter {
    dir: PathBuf,
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counter").field("dir", &self.dir).finish()
    }
}

fn opts() -> EncodeOptions {
    EncodeOptions {
        add_generation_prompt: true,
        toggles: Toggles::default(),
    }
}

impl Counter {
    /// Loads the tokenizer and chat template of a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let model = |source| Error::Model {
            dir: dir.to_path_buf(),
            source,
        };
        let tokenizer = Tokenizer::from_dir(dir).map_err(model)?;
        let template = ChatTemplate::from_dir(dir, &tokenizer).map_err(model)?;
        Ok(Counter {
            dir: dir.to_path_buf(),
            tokenizer,
            template,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Token IDs of the prompt for `messages` with the generation prompt appended, as the engine
    /// encodes a chat request.
    pub fn encode(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> std::result::Result<Vec<u32>, String> {
        self.template
            .encode(&self.tokenizer, messages, tools, &opts())
            .map(|e| e.ids)
            .map_err(|e| e.to_string())
    }

    /// Number of prompt tokens (see [`Counter::encode`]).
    pub fn count(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> std::result::Result<usize, String> {
        self.encode(messages, tools).map(|ids| ids.len())
    }

    /// The index of the token holding the first byte of the first occurrence of `needle` in the
    /// rendered prompt, or `None` when the prompt does not contain it.
    ///
    /// Uses the tokenizer's byte offsets on the rendered text, so the answer is exact even when
    /// the needle starts in the middle of a token. The IDs are checked against the engine's own
    /// encoding so a divergence (e.g. a different special-token rule) is an error, not a silent
    /// off-by-some.
    pub fn position(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        needle: &str,
    ) -> std::result::Result<Option<usize>, String> {
        let (text, _) = self
            .template
            .render(messages, tools, &opts())
            .map_err(|e| e.to_string())?;
        let Some(at) = text.find(needle) else {
            return Ok(None);
        };
        let enc = self
            .tokenizer
            .inner()
            .encode(text.as_str(), false)
            .map_err(|e| e.to_string())?;
        let engine_ids = self.encode(messages, tools)?;
        if enc.get_ids() != engine_ids.as_slice() {
            return Err("offset encoding differs from the engine's encoding".to_string());
        }
        Ok(enc.get_offsets().iter().position(|&(_, end)| end > at))
    }

    /// Whether ` word` is a single token: such words make padding exact (each adds one token).
    pub fn single_token_word(&self, word: &str) -> bool {
        self.tokenizer
            .encode(&format!(" {word}"))
            .map(|ids| ids.len() == 1)
            .unwrap_or(false)
    }
}
