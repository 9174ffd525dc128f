//! The model's tokenizer (`tokenizer.json`, through the `tokenizers` crate) with the special tokens
//! that `tokenizer_config.json` and `generation_config.json` name.

use std::path::Path;

use crate::error::{Error, Result};

/// A loaded tokenizer plus the special tokens generation needs.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Token IDs that end generation (from `generation_config.json` `eos_token_id`, else the
    /// tokenizer config's `eos_token`).
    pub eos_ids: Vec<u32>,
    /// Text of the BOS token, when the model has one (templates print it).
    pub bos_token: Option<String>,
    /// Text of the EOS token (templates print it).
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn special_token(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadJson {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and, when present, `generation_config.json`
    /// from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(Error::MissingFile {
                dir: dir.to_path_buf(),
                file: "tokenizer.json".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() {
            read_json(&cfg_path)?
        } else {
            serde_json::Value::Null
        };
        let bos_token = special_token(cfg.get("bos_token"));
        let eos_token = special_token(cfg.get("eos_token"));
        let mut eos_ids = Vec::new();
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let gen = read_json(&gen_path)?;
            match gen.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
                Some(serde_json::Value::Array(a)) => {
                    eos_ids.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
                }
                _ => {}
            }
        }
        if let Some(eos) = &eos_token {
            if let Some(id) = inner.token_to_id(eos) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        Ok(Tokenizer {
            inner,
            eos_ids,
            bos_token,
            eos_token,
        })
    }

    /// Encodes text. Special tokens written in the text (`<|im_start|>`) become their IDs, as
    /// Hugging Face does for rendered chat templates; no BOS is added (templates print it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes IDs to text, special tokens included (the recorder wants to see them).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The number of token IDs, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ID of a token's exact text, e.g. a special token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of one token ID as stored in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns a growing list of token IDs into text increments without splitting a UTF-8 character
/// that spans several byte-level tokens.
///
/// It decodes a short window of recent tokens and emits only the new suffix once it no longer ends
/// in a replacement character, which is how streaming servers (TGI, vLLM) avoid sending mojibake.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Adds one token and returns the text that became final, possibly empty.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        let tail = full
            .strip_prefix(prefix.as_str())
            .or_else(|| full.get(prefix.len()..));
        if let Some(new) = tail.filter(|t| !t.is_empty() && !full.ends_with('\u{FFFD}')) {
            let new = new.to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(new)
        } else {
            Ok(String::new())
        }
    }
}
