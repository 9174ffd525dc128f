//! What the server generates with: a [`Backend`] trait, implemented by [`EngineBackend`] (the
//! in-process engine, one generation at a time) and [`SchedulerBackend`] (the engine's
//! continuous-batching scheduler with its prefix cache). [`crate::upstream::UpstreamBackend`] is
//! an OpenAI-compatible server reached over HTTP (see [`Backend::upstream`]).
//!
//! The engine's `generate` is synchronous, CPU-heavy and reports tokens through a callback.
//! [`EngineBackend`] turns that into an async stream: a semaphore admits one generation at a time
//! (a batching scheduler will replace it), the work runs on `spawn_blocking`, and the callback
//! forwards each token into a channel. Dropping or cancelling the [`Generation`] makes the callback
//! return `false`, which stops the engine at the next token: a client that hangs up does not keep
//! the model busy.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tapedeck_engine::chat::{EncodeOptions, Encoding, ParsedOutput, ToolCallFormat};
use tapedeck_engine::scheduler::{EngineHandle, Event as SchedEvent, SchedulerConfig};
use tapedeck_engine::{
    ChatMessage, Engine, FinishReason, GenerateOutput, GenerateRequest, LogitsSummary, Toggles,
    TokenEvent,
};
use tokio::sync::{mpsc, Semaphore};

/// Static facts about a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// The model name served.
    pub model_id: String,
    /// Context window in tokens.
    pub context_len: usize,
    /// Vocabulary size (token IDs must be below it).
    pub vocab_size: usize,
    /// Backend name recorded in `builds.backend`.
    pub backend: String,
    /// Device recorded in `builds.device`.
    pub device: String,
    /// How the model writes tool calls.
    pub tool_call_format: ToolCallFormat,
}

/// Why a backend refused or failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// Too many requests are waiting; try again later.
    #[error("server overloaded: {queued} requests waiting")]
    Overloaded {
        /// Requests waiting when this one was refused.
        queued: usize,
        /// A suggested wait.
        retry_after: Duration,
    },
    /// The request cannot be served as given.
    #[error("{0}")]
    InvalidRequest(String),
    /// The prompt does not fit the context window.
    #[error("prompt of {prompt_tokens} tokens exceeds the context window of {context} tokens")]
    ContextOverflow {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// The context window.
        context: usize,
    },
    /// The generation was cancelled before it started.
    #[error("cancelled")]
    Cancelled,
    /// Something failed inside the backend (details are for the log, not the client).
    #[error("internal backend error: {0}")]
    Internal(String),
}

impl From<tapedeck_engine::Error> for BackendError {
    fn from(e: tapedeck_engine::Error) -> Self {
        use tapedeck_engine::Error as E;
        match e {
            E::ContextOverflow {
                prompt_tokens,
                context,
            } => BackendError::ContextOverflow {
                prompt_tokens,
                context,
            },
            // A template that raises (roles must alternate, ...) or an untokenizable request is the
            // client's to fix.
            E::InvalidRequest(m) | E::Template(m) => BackendError::InvalidRequest(m),
            E::Toggle { name, message } => {
                BackendError::InvalidRequest(format!("toggle {name}: {message}"))
            }
            E::Overloaded { waiting, .. } => BackendError::Overloaded {
                queued: waiting,
                retry_after: Duration::from_secs(1),
            },
            other => BackendError::Internal(other.to_string()),
        }
    }
}

/// One event of a generation.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// A generated token.
    Token(TokenEvent),
    /// Generation finished (the last event).
    Done(GenerateOutput),
    /// Generation failed (the last event).
    Error(BackendError),
}

/// A cancellation flag the consumer sets and the producer checks (synchronously from an engine
/// callback, or by awaiting [`CancelToken::cancelled`]). Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<CancelInner>);

#[derive(Debug, Default)]
struct CancelInner {
    flag: AtomicBool,
    notify: tokio::sync::Notify,
}

impl CancelToken {
    /// A token not cancelled yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels; idempotent.
    pub fn cancel(&self) {
        if !self.0.flag.swap(true, Ordering::AcqRel) {
            // `notify_one` keeps a permit when nobody waits yet, so a later `cancelled()` returns.
            self.0.notify.notify_one();
        }
    }

    /// Whether it was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.0.flag.load(Ordering::Acquire)
    }

    /// Resolves once cancelled (meant for one waiting producer).
    pub async fn cancelled(&self) {
        while !self.is_cancelled() {
            self.0.notify.notified().await;
        }
    }
}

/// A running generation: a stream of [`GenEvent`]s ending with `Done` or `Error`.
///
/// Dropping it cancels the generation.
#[derive(Debug)]
pub struct Generation {
    rx: mpsc::UnboundedReceiver<GenEvent>,
    cancel: CancelToken,
}

impl Generation {
    /// A generation fed by the given channel; cancelling `cancel` asks the producer to stop and
    /// end with `Done` (finish reason `Cancelled`).
    pub fn new(rx: mpsc::UnboundedReceiver<GenEvent>, cancel: CancelToken) -> Self {
        Generation { rx, cancel }
    }

    /// The next event; `None` after the last one (or if the producer vanished).
    pub async fn next(&mut self) -> Option<GenEvent> {
        self.rx.recv().await
    }

    /// Asks the backend to stop; a `Done` with `FinishReason::Cancelled` follows.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// How busy a backend is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests generating or scoring now.
    pub running: usize,
    /// Requests admitted and waiting for their turn.
    pub queued: usize,
}

/// A model server the HTTP layer can drive.
pub trait Backend: Send + Sync + 'static {
    /// Static facts.
    fn info(&self) -> &BackendInfo;

    /// Renders and tokenizes a chat with the model's template (CPU work: call it off the async
    /// threads for long prompts).
    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding, BackendError>;

    /// Tokenizes plain text (no special tokens added).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BackendError>;

    /// Decodes token IDs to text.
    fn detokenize(&self, ids: &[u32]) -> Result<String, BackendError>;

    /// Splits generated text into content, reasoning and tool calls.
    fn parse_output(&self, text: &str) -> ParsedOutput;

    /// Starts a generation; refuses at once with `Overloaded` when too many are waiting.
    fn generate(&self, req: GenerateRequest) -> Result<Generation, BackendError>;

    /// Teacher forcing: summaries of positions `from..tokens.len()`.
    fn score(
        &self,
        tokens: Vec<u32>,
        from: usize,
        top_k: usize,
        toggles: Toggles,
    ) -> BoxFuture<'static, Result<Vec<LogitsSummary>, BackendError>>;

    /// Running and waiting requests now.
    fn load(&self) -> Load;

    /// Cache and batching figures, for `/metrics` (none by default).
    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }

    /// The upstream server this backend forwards to, when it is one: the chat and completions
    /// handlers then proxy the request as received instead of encoding and generating locally
    /// (none by default).
    fn upstream(&self) -> Option<&crate::upstream::UpstreamBackend> {
        None
    }
}

/// Prefix-cache and KV figures of a backend that has them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens that had to be prefilled.
    pub prefill_tokens: u64,
    /// Decode steps submitted before the step ahead of them was collected (a lone greedy
    /// sequence on the GPU): the share of decoding that overlapped the host's work.
    pub decode_steps_ahead: u64,
    /// KV blocks in use.
    pub kv_blocks_used: u64,
    /// KV blocks in the pool.
    pub kv_blocks_total: u64,
    /// Bytes of the KV pool.
    pub kv_pool_bytes: u64,
    /// The type the KV pool stores (`None` where the backend does not say).
    pub kv_storage: Option<tapedeck_engine::toggles::KvDtype>,
    /// Device time of the engine's forward passes so far and their count, where the engine runs
    /// on an accelerator (its busy fraction is the rate of the first).
    pub device_busy: Option<(std::time::Duration, u64)>,
}

/// The in-process engine behind a one-at-a-time semaphore.
pub struct EngineBackend {
    engine: Arc<Engine>,
    info: BackendInfo,
    permits: Arc<Semaphore>,
    max_queued: usize,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    running: AtomicUsize,
    queued: AtomicUsize,
}

/// Decrements a counter when dropped, so a panic or an early return cannot leak a count.
struct CountGuard(Arc<Counts>, fn(&Counts) -> &AtomicUsize);

impl CountGuard {
    fn new(c: &Arc<Counts>, which: fn(&Counts) -> &AtomicUsize) -> Self {
        which(c).fetch_add(1, Ordering::Relaxed);
        CountGuard(c.clone(), which)
    }
}

impl Drop for CountGuard {
    fn drop(&mut self) {
        (self.1)(&self.0).fetch_sub(1, Ordering::Relaxed);
    }
}

impl EngineBackend {
    /// Wraps a loaded engine. At most `max_queued` requests wait for the engine; more are refused
    /// with [`BackendError::Overloaded`] (HTTP 429).
    pub fn new(engine: Arc<Engine>, max_queued: usize) -> Self {
        let info = BackendInfo {
            model_id: engine.model_id(),
            context_len: engine.context_len(),
            vocab_size: engine.tokenizer().vocab_size(),
            backend: engine.device().to_string(),
            device: engine.backend().describe(),
            tool_call_format: engine.template().tool_call_format(),
        };
        EngineBackend {
            engine,
            info,
            permits: Arc::new(Semaphore::new(1)),
            max_queued,
            counts: Arc::default(),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn admit(&self) -> Result<CountGuard, BackendError> {
        let queued = self.counts.queued.load(Ordering::Relaxed);
        if queued >= self.max_queued {
            return Err(BackendError::Overloaded {
                queued,
                retry_after: Duration::from_secs(1),
            });
        }
        Ok(CountGuard::new(&self.counts, |c| &c.queued))
    }
}

impl Backend for EngineBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding, BackendError> {
        Ok(self.engine.encode_chat(messages, tools, opts)?)
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        Ok(self.engine.tokenizer().encode(text)?)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, BackendError> {
        Ok(self.engine.tokenizer().decode(ids)?)
    }

    fn parse_output(&self, text: &str) -> ParsedOutput {
        self.engine.template().parse_output(text)
    }

    fn generate(&self, req: GenerateRequest) -> Result<Generation, BackendError> {
        let waiting = self.admit()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancelToken::new();
        let engine = self.engine.clone();
        let permits = self.permits.clone();
        let counts = self.counts.clone();
        let stop = cancel.clone();
        tokio::spawn(async move {
            let Ok(_permit) = permits.acquire_owned().await else {
                let _ = tx.send(GenEvent::Error(BackendError::Internal(
                    "engine semaphore closed".into(),
                )));
                return;
            };
            drop(waiting);
            if stop.is_cancelled() {
                let _ = tx.send(GenEvent::Error(BackendError::Cancelled));
                return;
            }
            let _running = CountGuard::new(&counts, |c| &c.running);
            let token_tx = tx.clone();
            let result = tokio::task::spawn_blocking(move || {
                engine.generate(&req, &mut |ev: &TokenEvent| {
                    !stop.is_cancelled() && token_tx.send(GenEvent::Token(ev.clone())).is_ok()
                })
            })
            .await;
            let last = match result {
                Ok(Ok(out)) => GenEvent::Done(out),
                Ok(Err(e)) => GenEvent::Error(e.into()),
                Err(join) => GenEvent::Error(BackendError::Internal(format!(
                    "generation task failed: {join}"
                ))),
            };
            let _ = tx.send(last);
        });
        Ok(Generation::new(rx, cancel))
    }

    fn score(
        &self,
        tokens: Vec<u32>,
        from: usize,
        top_k: usize,
        toggles: Toggles,
    ) -> BoxFuture<'static, Result<Vec<LogitsSummary>, BackendError>> {
        let admitted = self.admit();
        let engine = self.engine.clone();
        let permits = self.permits.clone();
        let counts = self.counts.clone();
        Box::pin(async move {
            let waiting = admitted?;
            let _permit = permits
                .acquire_owned()
                .await
                .map_err(|_| BackendError::Internal("engine semaphore closed".into()))?;
            drop(waiting);
            let _running = CountGuard::new(&counts, |c| &c.running);
            tokio::task::spawn_blocking(move || engine.score(&tokens, from, top_k, &toggles))
                .await
                .map_err(|e| BackendError::Internal(format!("scoring task failed: {e}")))?
                .map_err(BackendError::from)
        })
    }

    fn load(&self) -> Load {
        Load {
            running: self.counts.running.load(Ordering::Relaxed),
            queued: self.counts.queued.load(Ordering::Relaxed),
        }
    }
}

/// The engine's continuous-batching scheduler ([`EngineHandle`]): concurrent requests share
/// forward passes, and a prompt that starts like an earlier one (every turn of an agent session)
/// reuses its cached KV blocks.
pub struct SchedulerBackend {
    handle: EngineHandle,
    info: BackendInfo,
}

impl SchedulerBackend {
    /// Starts the scheduler over a loaded engine.
    pub fn start(engine: Arc<Engine>, config: SchedulerConfig) -> Result<Self, BackendError> {
        let info = BackendInfo {
            model_id: engine.model_id(),
            context_len: engine.context_len(),
            vocab_size: engine.tokenizer().vocab_size(),
            backend: engine.device().to_string(),
            device: engine.backend().describe(),
            tool_call_format: engine.template().tool_call_format(),
        };
        let block_size = config.block_size;
        let handle = EngineHandle::start(engine, config)?;
        let s = handle.stats();
        let blocks = s.kv_blocks_total.load(Ordering::Relaxed);
        tracing::info!(
            blocks,
            tokens = blocks * block_size,
            mib = s.kv_pool_bytes.load(Ordering::Relaxed) >> 20,
            storage = handle.kv_storage().name(),
            "KV pool"
        );
        Ok(SchedulerBackend { handle, info })
    }

    /// The scheduler handle.
    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }

    fn engine(&self) -> &Arc<Engine> {
        self.handle.engine()
    }
}

impl Backend for SchedulerBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding, BackendError> {
        Ok(self.engine().encode_chat(messages, tools, opts)?)
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        Ok(self.engine().tokenizer().encode(text)?)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, BackendError> {
        Ok(self.engine().tokenizer().decode(ids)?)
    }

    fn parse_output(&self, text: &str) -> ParsedOutput {
        self.engine().template().parse_output(text)
    }

    fn generate(&self, req: GenerateRequest) -> Result<Generation, BackendError> {
        let prompt_tokens = req.prompt.len();
        let mut stream = self.handle.submit(req)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancelToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            // What was streamed so far, to report a cancelled generation: the scheduler frees a
            // request's blocks as soon as its stream is dropped and sends nothing more.
            let mut partial = GenerateOutput {
                tokens: Vec::new(),
                text: String::new(),
                summaries: Vec::new(),
                finish_reason: FinishReason::Cancelled,
                matched_stop: None,
                prompt_tokens,
                timings: Default::default(),
            };
            loop {
                let ev = tokio::select! {
                    biased;
                    _ = stop.cancelled() => {
                        drop(stream);
                        let _ = tx.send(GenEvent::Done(partial));
                        return;
                    }
                    ev = stream.next() => ev,
                };
                let last = match ev {
                    Some(SchedEvent::Token(t)) => {
                        partial.tokens.push(t.id);
                        partial.text.push_str(&t.text);
                        partial.summaries.push(t.summary.clone());
                        if tx.send(GenEvent::Token(t)).is_err() {
                            return; // the consumer is gone: dropping `stream` cancels
                        }
                        continue;
                    }
                    Some(SchedEvent::Done(out)) => GenEvent::Done(out),
                    Some(SchedEvent::Error(e)) => GenEvent::Error(BackendError::Internal(e)),
                    None => GenEvent::Error(BackendError::Internal("the scheduler stopped".into())),
                };
                let _ = tx.send(last);
                return;
            }
        });
        Ok(Generation::new(rx, cancel))
    }

    fn score(
        &self,
        tokens: Vec<u32>,
        from: usize,
        top_k: usize,
        toggles: Toggles,
    ) -> BoxFuture<'static, Result<Vec<LogitsSummary>, BackendError>> {
        let handle = self.handle.clone();
        Box::pin(async move {
            // The scheduler scores `output` after `prompt`: position i of the sequence is scored
            // given tokens[..i], exactly as `Engine::score(tokens, from, ..)`.
            let from = from.clamp(1, tokens.len().max(1));
            let (prompt, output) = tokens.split_at(from.min(tokens.len()));
            Ok(handle
                .score(prompt.to_vec(), output.to_vec(), top_k, toggles)
                .await?)
        })
    }

    fn load(&self) -> Load {
        let s = self.handle.stats();
        Load {
            running: s.running.load(Ordering::Relaxed),
            queued: s.waiting.load(Ordering::Relaxed),
        }
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        let s = self.handle.stats();
        Some(CacheStats {
            prefix_hit_tokens: s.prefix_hit_tokens.load(Ordering::Relaxed),
            prefill_tokens: s.prefill_tokens.load(Ordering::Relaxed),
            decode_steps_ahead: s.steps_ahead.load(Ordering::Relaxed),
            kv_blocks_used: s.kv_blocks_used.load(Ordering::Relaxed) as u64,
            kv_blocks_total: s.kv_blocks_total.load(Ordering::Relaxed) as u64,
            kv_pool_bytes: s.kv_pool_bytes.load(Ordering::Relaxed) as u64,
            kv_storage: Some(self.handle.kv_storage()),
            device_busy: self.handle.engine().backend().device_time(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cancel_token_wakes_a_waiter_before_and_after() {
        let t = CancelToken::new();
        assert!(!t.is_cancelled());
        t.cancel();
        t.cancel(); // idempotent
        t.cancelled().await; // cancelled before anyone waited: still resolves
        let t = CancelToken::new();
        let waiter = {
            let t = t.clone();
            tokio::spawn(async move { t.cancelled().await })
        };
        tokio::task::yield_now().await;
        t.cancel();
        waiter.await.unwrap();
    }

    #[test]
    fn engine_errors_map_to_client_or_server_errors() {
        use tapedeck_engine::Error as E;
        assert!(matches!(
            BackendError::from(E::ContextOverflow {
                prompt_tokens: 9,
                context: 8
            }),
            BackendError::ContextOverflow { .. }
        ));
        assert!(matches!(
            BackendError::from(E::Overloaded {
                waiting: 3,
                limit: 3
            }),
            BackendError::Overloaded { queued: 3, .. }
        ));
        assert!(matches!(
            BackendError::from(E::Template("roles must alternate".into())),
            BackendError::InvalidRequest(_)
        ));
        assert!(matches!(
            BackendError::from(E::Tokenizer("boom".into())),
            BackendError::Internal(_)
        ));
    }
}
