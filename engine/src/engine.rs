//! The engine a caller holds: model, tokenizer and chat template loaded from one directory, with
//! `generate` and `score` over token IDs.
//!
//! This is the synchronous core. It runs one request's forward passes on its backend (CPU or
//! CUDA); the serving scheduler batches many requests through [`Backend::forward`] directly.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::backend::{Backend, CpuBackend, Device, Feed, Ticket};
use crate::chat::{ChatTemplate, EncodeOptions, Encoding};
use crate::config::Config;
use crate::decoding::Decoding;
use crate::error::{Error, Result};
use crate::generate::{GenerateOutput, GenerateRequest, LogitsSummary, TokenEvent};
use crate::messages::ChatMessage;
use crate::model::{KvCache, Logits, Model, Pick, WantLogits};
use crate::sampling::summarize;
use crate::toggles::{KvDtype, Toggles};
use crate::tokenizer::Tokenizer;
use crate::weights::WeightStore;

/// How to load an engine.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// Worker threads for forward passes on the CPU (`None`: one per core).
    pub threads: Option<usize>,
    /// Where forward passes run.
    pub device: Device,
}

/// A loaded model ready to serve. `Send + Sync`: share it behind an `Arc`.
pub struct Engine {
    dir: PathBuf,
    backend: Box<dyn Backend>,
    context_len: usize,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    /// `generate` submits each decode step before reading the one in flight back
    /// ([`Engine::set_run_ahead`]).
    run_ahead: bool,
}

/// The score of one given token under the model (teacher forcing).
pub type TokenScore = LogitsSummary;

/// How teacher forcing feeds the scored tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreMode {
    /// One forward pass over the whole sequence (what `/v1/completions` with `echo` does).
    Prefill,
    /// The context before `from` as one prefill, then one decode step per scored token, exactly
    /// as generation runs: decode-only kernels and toggles (`decode_topk`) apply.
    Decode,
}

/// Positions of generation [`Engine::generate`] reserves in a GPU cache before the prompt's
/// prefill; a longer generation grows the cache (doubling) past them.
const GENERATION_RESERVE: usize = 2048;

impl Engine {
    /// Loads a model directory with default options.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &EngineOptions::default())
    }

    /// Loads a model directory.
    pub fn load_with(dir: &Path, opts: &EngineOptions) -> Result<Self> {
        let cfg = Config::from_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir, &tokenizer)?;
        if tokenizer.vocab_size() > cfg.vocab_size {
            return Err(Error::InvalidConfig(format!(
                "tokenizer has {} tokens but the model's vocab_size is {}",
                tokenizer.vocab_size(),
                cfg.vocab_size
            )));
        }
        let mut ws = WeightStore::load(dir)?;
        let model = Model::load(cfg, &mut ws)?;
        let context_len = model.context_len();
        let backend: Box<dyn Backend> = match opts.device {
            Device::Cpu => Box::new(CpuBackend::new(model, opts.threads)?),
            Device::Cuda(ordinal) => Box::new(crate::cuda::CudaBackend::new(&model, ordinal)?),
        };
        Ok(Engine {
            dir: dir.to_path_buf(),
            run_ahead: backend.runs_ahead(),
            backend,
            context_len,
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

    /// The directory the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The backend that runs forward passes (for batched passes and new KV pools).
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The device forward passes run on.
    pub fn device(&self) -> Device {
        self.backend.device()
    }

    /// The model configuration.
    pub fn config(&self) -> &Config {
        self.backend.config()
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
        self.context_len
    }

    /// Whether `generate` runs its decode steps one ahead (see [`Engine::set_run_ahead`]).
    pub fn runs_ahead(&self) -> bool {
        self.run_ahead
    }

    /// Whether `generate` runs its decode steps one ahead (see [`Backend::runs_ahead`]; the
    /// backend's choice by default). The tokens are the same either way, so a test can run
    /// ahead where the backend gains nothing and an A/B can turn it off where it does.
    pub fn set_run_ahead(&mut self, on: bool) {
        self.run_ahead = on;
    }

    /// Worker threads used for forward passes.
    pub fn threads(&self) -> usize {
        self.backend.threads()
    }

    /// An empty single-sequence cache in the backend's memory, storing `dtype` (one request's
    /// cache holds only that request's `kv_dtype`, so it is always packed where the backend can).
    fn new_cache(&self, dtype: KvDtype) -> Result<KvCache> {
        Ok(KvCache::in_pool(self.backend.new_pool(16, 0, dtype)?))
    }

    /// Renders and tokenizes a chat.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding> {
        self.template.encode(&self.tokenizer, messages, tools, opts)
    }

    fn forward_one(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        decode: bool,
        want: WantLogits,
        toggles: &Toggles,
    ) -> Result<Logits> {
        let (pool, seg) = cache.segment(tokens, decode, want)?;
        let mut segs = [seg];
        let mut out = self.backend.forward(pool, &mut segs, toggles)?;
        Ok(out.pop().unwrap_or(Logits::Rows(Vec::new())))
    }

    fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        if prompt.len() >= self.context_len() {
            return Err(Error::ContextOverflow {
                prompt_tokens: prompt.len(),
                context: self.context_len(),
            });
        }
        Ok(())
    }

    /// Generates from prompt IDs, calling `on_token` for each token; generation stops early with
    /// [`FinishReason::Cancelled`](crate::FinishReason::Cancelled) when `on_token` returns `false`.
    ///
    /// This runs one request alone, with the same prefill chunking and decode steps as the
    /// batching scheduler, so its tokens and summaries are those the server would produce.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<GenerateOutput> {
        let start = Instant::now();
        self.check_prompt(&req.prompt)?;
        let mut cache = self.new_cache(req.toggles.kv_dtype)?;
        // On a GPU, room for the prompt and the generation up front (at most GENERATION_RESERVE
        // positions of it): a device pool that grows mid-decode is copied into a larger buffer,
        // and its new addresses cost a fresh capture of the decode step's graph. A host pool
        // grows in place, cheaper than zeroing room a short reply never uses.
        if cache.pool.is_on_device() {
            let gen_room = req.stop.max_tokens.min(GENERATION_RESERVE);
            cache.reserve((req.prompt.len() + gen_room).min(self.context_len()))?;
        }
        let mut dec = Decoding::new(req, start);
        let logits = self.prefill(&req.prompt, &mut cache, dec.want(), &req.toggles)?;
        dec.prefilled();
        // Running ahead needs the backend to pick each token (greedy or forced decoding): a
        // sampled token is drawn on the host from the whole row.
        if self.run_ahead && matches!(dec.want(), WantLogits::Pick(_)) {
            self.decode_ahead(&mut dec, logits, &mut cache, &req.toggles, on_token)?;
        } else {
            self.decode(&mut dec, logits, &mut cache, &req.toggles, on_token)?;
        }
        Ok(dec.finish())
    }

    /// Chooses a token from `logits` and streams it (`full`: the context has no room for another
    /// position). Returns the token and whether generation goes on; a caller that stopped
    /// listening cancels it.
    fn emit(
        &self,
        dec: &mut Decoding,
        logits: Logits,
        full: bool,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<(u32, bool)> {
        let (event, finished) = dec.step(logits, &self.tokenizer, full)?;
        if !on_token(&event) {
            dec.cancel();
            return Ok((event.id, false));
        }
        Ok((event.id, !finished))
    }

    /// Decode steps one after another, each submitted once the token before it is read.
    fn decode(
        &self,
        dec: &mut Decoding,
        mut logits: Logits,
        cache: &mut KvCache,
        toggles: &Toggles,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<()> {
        loop {
            let full = cache.len() + 1 >= self.context_len();
            let (id, go_on) = self.emit(dec, logits, full, on_token)?;
            if !go_on {
                return Ok(());
            }
            logits = self.forward_one(&[id], cache, true, dec.want(), toggles)?;
        }
    }

    /// Decode steps run one ahead: while a step is in flight, the step after it is submitted,
    /// fed the token the one in flight picks (on the device, where the backend can), before
    /// that token is read back. The host's reading, streaming and launching then overlap the
    /// device's step instead of leaving it idle between steps; the tokens are those of
    /// [`decode`](Self::decode). A step submitted past the end of generation (an end-of-sequence
    /// token or a stop string, which only the token read back reveals) is discarded: it wrote
    /// one cache position that nothing reads, since the cache ends with the request.
    fn decode_ahead(
        &self,
        dec: &mut Decoding,
        logits: Logits,
        cache: &mut KvCache,
        toggles: &Toggles,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<()> {
        let ctx = self.context_len();
        let (id, go_on) = self.emit(dec, logits, cache.len() + 1 >= ctx, on_token)?;
        if !go_on {
            return Ok(());
        }
        // The step in flight produces token number `n`; the cache counts its input.
        let mut n = dec.tokens().len();
        let mut cur = self.submit_step(cache, Feed::Token(id), dec.want_at(n), toggles)?;
        loop {
            // The next step's input is token n, at position cache.len(): submitted where
            // generation can go on past token n (the rules `Decoding::step` applies).
            let ahead = match dec.feed_ahead(n, cache.len() + 1 < ctx, &mut cur) {
                Some(feed) => match self.submit_step(cache, feed, dec.want_at(n + 1), toggles) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        self.backend.discard(cur);
                        return Err(e);
                    }
                },
                None => None,
            };
            // The cache length the step of token n saw, without the step ahead.
            let seen = cache.len() - usize::from(ahead.is_some());
            let emitted = self
                .backend
                .collect(cur)
                .and_then(|l| self.emit(dec, l, seen + 1 >= ctx, on_token));
            n += 1;
            match (emitted, ahead) {
                (Ok((_, true)), Some(a)) => cur = a,
                // Not expected (the rule above mirrors `Decoding::step`), but should generation
                // go on without a step ahead, submit it now: the same tokens, no overlap.
                (Ok((id, true)), None) => {
                    cur = self.submit_step(cache, Feed::Token(id), dec.want_at(n), toggles)?
                }
                (done, ahead) => {
                    if let Some(a) = ahead {
                        self.backend.discard(a);
                    }
                    return done.map(|_| ());
                }
            }
        }
    }

    /// Submits one decode step of the request in `cache`, its input token from `feed`.
    fn submit_step(
        &self,
        cache: &mut KvCache,
        feed: Feed<'_>,
        want: WantLogits,
        toggles: &Toggles,
    ) -> Result<Ticket> {
        // The segment's own token is never read: `feed` gives it.
        let (pool, seg) = cache.segment(&[0], true, want)?;
        self.backend.submit(pool, seg, feed, toggles)
    }

    /// Prefills `tokens` in chunks per the `prefill_chunk` toggle; returns what the last chunk's
    /// `want` asked for.
    fn prefill(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want_last: WantLogits,
        toggles: &Toggles,
    ) -> Result<Logits> {
        let chunk = toggles
            .prefill_chunk
            .map_or(tokens.len(), |c| c.get())
            .max(1);
        let mut logits = Logits::Rows(Vec::new());
        for (i, piece) in tokens.chunks(chunk).enumerate() {
            let last = (i + 1) * chunk >= tokens.len();
            let want = if last { want_last } else { WantLogits::None };
            let (pool, mut seg) = cache.segment(piece, false, want)?;
            seg.fault_chunk_boundary = toggles.fault_chunk_boundary && i > 0;
            let mut segs = [seg];
            let mut out = self.backend.forward(pool, &mut segs, toggles)?;
            if let (true, Some(l)) = (last, out.pop()) {
                logits = l;
            }
        }
        Ok(logits)
    }

    /// Teacher forcing in one prefill pass: for every position `i` in `from..tokens.len()`, the
    /// summary of the model's distribution after `tokens[..i]`, with `logprob` that of `tokens[i]`.
    pub fn score(
        &self,
        tokens: &[u32],
        from: usize,
        top_k: usize,
        toggles: &Toggles,
    ) -> Result<Vec<TokenScore>> {
        self.score_with(tokens, from, top_k, toggles, ScoreMode::Prefill)
    }

    /// Teacher forcing with a chosen [`ScoreMode`].
    pub fn score_with(
        &self,
        tokens: &[u32],
        from: usize,
        top_k: usize,
        toggles: &Toggles,
        mode: ScoreMode,
    ) -> Result<Vec<TokenScore>> {
        if from == 0 || from > tokens.len() {
            return Err(Error::InvalidRequest(format!(
                "scoring starts at position {from}, which must be in 1..={}",
                tokens.len()
            )));
        }
        if tokens.len() > self.context_len() {
            return Err(Error::ContextOverflow {
                prompt_tokens: tokens.len(),
                context: self.context_len(),
            });
        }
        let mut cache = self.new_cache(toggles.kv_dtype)?;
        let vocab = self.config().vocab_size;
        let mut scores = Vec::with_capacity(tokens.len() - from);
        match mode {
            ScoreMode::Prefill => {
                // Only rows from-1.. are needed, but a single pass keeps the numerics of one prefill.
                let logits = self
                    .forward_one(
                        &tokens[..tokens.len() - 1],
                        &mut cache,
                        false,
                        WantLogits::All,
                        toggles,
                    )?
                    .into_rows()?;
                for i in from..tokens.len() {
                    let row = &logits[(i - 1) * vocab..i * vocab];
                    scores.push(summarize(row, tokens[i], top_k));
                }
            }
            ScoreMode::Decode => {
                let pick = |i: usize| {
                    WantLogits::Pick(Pick {
                        k: top_k,
                        token: Some(tokens[i]),
                    })
                };
                let mut logits = self.prefill(&tokens[..from], &mut cache, pick(from), toggles)?;
                for i in from..tokens.len() {
                    let this = std::mem::replace(&mut logits, Logits::Rows(Vec::new()));
                    scores.push(this.summary_of(tokens[i], top_k)?);
                    if i + 1 < tokens.len() {
                        logits = self.forward_one(
                            &tokens[i..i + 1],
                            &mut cache,
                            true,
                            pick(i + 1),
                            toggles,
                        )?;
                    }
                }
            }
        }
        Ok(scores)
    }
}
