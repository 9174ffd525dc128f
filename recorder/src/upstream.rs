//! Upstream mode: an [`UpstreamBackend`] stands for any OpenAI-compatible server (vLLM, SGLang,
//! llama.cpp, another tapedeck) that the recorder proxies to.
//!
//! The HTTP layer does not drive it through [`Backend::generate`]: a proxied request goes to the
//! upstream as received and its answer comes back unchanged (see `server::proxy`), so the two
//! generation endpoints check [`Backend::upstream`] first and take the proxy path. The
//! [`Backend`] methods that need a tokenizer (`encode_chat`, `tokenize`, `detokenize`,
//! `parse_output`) use the local tokenizer and chat template given with `--tokenizer DIR`, which
//! is how a proxied request still gets prompt and output token IDs in its record; without one
//! they refuse and the record keeps text only.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use tapedeck_engine::chat::{ChatTemplate, EncodeOptions, Encoding, ParsedOutput, ToolCallFormat};
use tapedeck_engine::tokenizer::Tokenizer;
use tapedeck_engine::{ChatMessage, GenerateRequest, LogitsSummary, Toggles};

use crate::backend::{Backend, BackendError, BackendInfo, Generation, Load};

/// How to reach and use an upstream server.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL (`http://host:port` or `http://host:port/v1`).
    pub url: String,
    /// A model directory whose tokenizer and chat template give the recorded token IDs.
    pub tokenizer: Option<PathBuf>,
    /// Ask the upstream for this many top logprobs per token when the client asked for none,
    /// and strip them from the client's response (they are recorded).
    pub logprobs: Option<u32>,
    /// Timeout for connecting to the upstream.
    pub connect_timeout: Duration,
}

impl UpstreamConfig {
    /// Defaults for a URL.
    pub fn new(url: impl Into<String>) -> Self {
        UpstreamConfig {
            url: url.into(),
            tokenizer: None,
            logprobs: None,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

struct LocalTokenizer {
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

/// An OpenAI-compatible server reached over HTTP.
pub struct UpstreamBackend {
    info: BackendInfo,
    base: String,
    client: reqwest::Client,
    local: Option<LocalTokenizer>,
    logprobs: Option<u32>,
    running: AtomicUsize,
}

impl std::fmt::Debug for UpstreamBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBackend")
            .field("base", &self.base)
            .field("model", &self.info.model_id)
            .field("tokenizer", &self.local.is_some())
            .finish()
    }
}

/// `http://h:p/v1/` → `http://h:p`.
fn base_url(url: &str) -> String {
    let t = url.trim().trim_end_matches('/');
    t.strip_suffix("/v1").unwrap_or(t).to_string()
}

impl UpstreamBackend {
    /// Loads the local tokenizer (when given) and asks the upstream for its model name
    /// (`GET /v1/models`; an unreachable upstream is not fatal: the name falls back to the
    /// tokenizer directory's name, else `upstream`).
    pub async fn connect(config: UpstreamConfig) -> Result<Self, BackendError> {
        let base = base_url(&config.url);
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(BackendError::InvalidRequest(format!(
                "upstream URL {:?} must start with http:// or https://",
                config.url
            )));
        }
        let local = match &config.tokenizer {
            Some(dir) => {
                let dir = dir.clone();
                Some(
                    tokio::task::spawn_blocking(move || load_local(&dir))
                        .await
                        .map_err(|e| BackendError::Internal(e.to_string()))??,
                )
            }
            None => None,
        };
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .build()
            .map_err(|e| BackendError::Internal(format!("HTTP client: {e}")))?;
        let listed = async {
            let v: serde_json::Value = client
                .get(format!("{base}/v1/models"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            v["data"][0]["id"].as_str().map(str::to_string)
        }
        .await;
        let model_id = listed
            .or_else(|| {
                config
                    .tokenizer
                    .as_deref()
                    .and_then(Path::file_name)
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "upstream".into());
        let context_len = config
            .tokenizer
            .as_deref()
            .and_then(|d| tapedeck_engine::config::Config::from_dir(d).ok())
            .map(|c| c.max_position_embeddings)
            .unwrap_or(0);
        let info = BackendInfo {
            model_id,
            context_len,
            vocab_size: local.as_ref().map_or(0, |l| l.tokenizer.vocab_size()),
            backend: "upstream".into(),
            device: config.url.clone(),
            tool_call_format: local
                .as_ref()
                .map_or(ToolCallFormat::Hermes, |l| l.template.tool_call_format()),
        };
        Ok(UpstreamBackend {
            info,
            base,
            client,
            local,
            logprobs: config.logprobs,
            running: AtomicUsize::new(0),
        })
    }

    /// The full URL of an upstream path (`/v1/chat/completions`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The HTTP client.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Top logprobs to ask for when the client asked for none (`--upstream-logprobs`).
    pub fn extra_logprobs(&self) -> Option<u32> {
        self.logprobs
    }

    /// Whether a local tokenizer was given.
    pub fn has_tokenizer(&self) -> bool {
        self.local.is_some()
    }

    /// The ID of one token under the local tokenizer: its text's vocabulary entry, else its
    /// bytes' byte-level (GPT-2) vocabulary entry, else the text's encoding when that is exactly
    /// one token.
    pub fn token_id(&self, token: &str, bytes: Option<&[u8]>) -> Option<u32> {
        let l = self.local.as_ref()?;
        l.tokenizer
            .token_to_id(token)
            .or_else(|| l.tokenizer.token_to_id(&byte_level(bytes?)))
            .or_else(|| {
                let ids = l.tokenizer.encode(token).ok()?;
                (ids.len() == 1).then(|| ids[0])
            })
    }

    pub(crate) fn enter(&self) -> RunningGuard<'_> {
        self.running.fetch_add(1, Ordering::Relaxed);
        RunningGuard(&self.running)
    }
}

pub(crate) struct RunningGuard<'a>(&'a AtomicUsize);

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Bytes in GPT-2's byte-level alphabet, as byte-level BPE vocabularies spell tokens.
fn byte_level(bytes: &[u8]) -> String {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    bytes
        .iter()
        .map(|&b| {
            if printable(b) {
                char::from(b)
            } else {
                let n = (0..b).filter(|&x| !printable(x)).count() as u32;
                char::from_u32(256 + n).unwrap_or('?')
            }
        })
        .collect()
}

fn load_local(dir: &Path) -> Result<LocalTokenizer, BackendError> {
    let tokenizer = Tokenizer::from_dir(dir)
        .map_err(|e| BackendError::InvalidRequest(format!("--tokenizer: {e}")))?;
    let template = ChatTemplate::from_dir(dir, &tokenizer)
        .map_err(|e| BackendError::InvalidRequest(format!("--tokenizer: {e}")))?;
    Ok(LocalTokenizer {
        tokenizer,
        template,
    })
}

fn no_tokenizer() -> BackendError {
    BackendError::InvalidRequest("upstream mode without a local tokenizer (--tokenizer)".into())
}

fn proxied() -> BackendError {
    BackendError::Internal("an upstream backend is driven through the proxy path".into())
}

impl Backend for UpstreamBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding, BackendError> {
        let l = self.local.as_ref().ok_or_else(no_tokenizer)?;
        Ok(l.template.encode(&l.tokenizer, messages, tools, opts)?)
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        let l = self.local.as_ref().ok_or_else(no_tokenizer)?;
        Ok(l.tokenizer.encode(text)?)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, BackendError> {
        let l = self.local.as_ref().ok_or_else(no_tokenizer)?;
        Ok(l.tokenizer.decode(ids)?)
    }

    fn parse_output(&self, text: &str) -> ParsedOutput {
        match &self.local {
            Some(l) => l.template.parse_output(text),
            None => ParsedOutput {
                content: text.to_string(),
                ..Default::default()
            },
        }
    }

    fn generate(&self, _req: GenerateRequest) -> Result<Generation, BackendError> {
        Err(proxied())
    }

    fn score(
        &self,
        _tokens: Vec<u32>,
        _from: usize,
        _top_k: usize,
        _toggles: Toggles,
    ) -> BoxFuture<'static, Result<Vec<LogitsSummary>, BackendError>> {
        Box::pin(async { Err(proxied()) })
    }

    fn load(&self) -> Load {
        Load {
            running: self.running.load(Ordering::Relaxed),
            queued: 0,
        }
    }

    fn upstream(&self) -> Option<&UpstreamBackend> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_drops_v1_and_slashes() {
        assert_eq!(base_url("http://h:1/v1/"), "http://h:1");
        assert_eq!(base_url("http://h:1"), "http://h:1");
        assert_eq!(base_url(" http://h:1/ "), "http://h:1");
    }

    #[test]
    fn byte_level_spells_like_gpt2() {
        assert_eq!(byte_level(b" hi"), "\u{120}hi");
        assert_eq!(byte_level(b"\n"), "\u{10a}");
        assert_eq!(byte_level(&[0xe4]), "\u{e4}");
    }
}
