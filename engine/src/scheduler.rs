//! The serving scheduler: continuous batching over one shared, paged KV pool.
//!
//! One thread owns every piece of scheduling state (the queue, the running sequences, the block
//! manager and the pool); callers talk to it over a channel and receive their request's events on
//! a stream of their own. Each step it
//! 1. drops sequences whose stream was dropped (cancellation frees their blocks at once),
//! 2. admits waiting requests whose blocks fit the KV budget (reusing cached prefix blocks),
//! 3. runs one forward pass over a batch: a decode token for every decoding sequence plus prefill
//!    chunks of prompts (`prefill_chunk` toggle), for sequences sharing one toggle set,
//! 4. samples, streams each token, and retires finished sequences.
//!
//! While one greedy (or teacher-forced) sequence runs alone and nothing waits, on a backend
//! whose steps run asynchronously ([`Backend::runs_ahead`](crate::backend::Backend::runs_ahead),
//! the GPU), the scheduler decodes it as [`Engine::generate`] does: each step is submitted
//! before the one ahead of it is collected, fed that step's token on the device, so streaming a
//! token and launching the next step overlap the device's work. A request that arrives ends it
//! after at most one step; batching then resumes.
//!
//! Admission reserves blocks for the prompt plus `max_tokens` (capped by the context window), so a
//! running sequence never runs out of memory and nothing is ever preempted. A request that can never
//! fit is refused; a full waiting queue is refused with [`Error::Overloaded`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tokio::sync::mpsc as tmpsc;

use crate::backend::{Feed, Ticket};
use crate::decoding::Decoding;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::generate::{GenerateOutput, GenerateRequest, TokenEvent};
use crate::kv_blocks::{block_keys, BlockKey, BlockManager};
use crate::model::{BlockTable, KvPool, Segment, WantLogits};
use crate::toggles::{KvDtype, Toggles};

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Bytes of KV cache (the pool is allocated once at this size).
    pub kv_budget_bytes: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Most tokens in one forward pass (decode tokens plus prefill chunks). A prompt prefilled
    /// whole (no `prefill_chunk`) may exceed it, one prompt per step.
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting for admission; beyond it requests are refused (429).
    pub max_waiting: usize,
    /// The `kv_dtype` the pool is built for: the CPU backend stores it packed (bf16 holds twice
    /// the tokens of f32 in the same budget, FP8 nearly four times), and then refuses requests
    /// with another `kv_dtype`; f32 holds every dtype. Set it to the served toggles' `kv_dtype`.
    pub kv_dtype: KvDtype,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            kv_budget_bytes: 256 << 20,
            block_size: 16,
            max_batch_tokens: 512,
            max_running: 64,
            max_waiting: 256,
            kv_dtype: KvDtype::F32,
        }
    }
}

/// What a request's stream carries.
#[derive(Debug, Clone)]
pub enum Event {
    /// A generated token.
    Token(TokenEvent),
    /// The request finished; no more events follow.
    Done(GenerateOutput),
    /// The request failed; no more events follow.
    Error(String),
}

/// A request's events. Dropping it cancels the request and frees its KV blocks at the next step.
#[derive(Debug)]
pub struct RequestStream {
    rx: tmpsc::UnboundedReceiver<Event>,
}

impl RequestStream {
    /// The next event, or `None` after the last.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event, blocking the thread (not for async contexts).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

/// Live figures of the scheduler, readable from any thread.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Sequences running.
    pub running: AtomicUsize,
    /// Requests waiting for admission.
    pub waiting: AtomicUsize,
    /// KV blocks referenced by running sequences.
    pub kv_blocks_used: AtomicUsize,
    /// Most KV blocks ever referenced at once.
    pub kv_blocks_peak: AtomicUsize,
    /// KV blocks in the pool.
    pub kv_blocks_total: AtomicUsize,
    /// Bytes of the KV pool.
    pub kv_pool_bytes: AtomicUsize,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: AtomicU64,
    /// Prompt tokens that had to be prefilled.
    pub prefill_tokens: AtomicU64,
    /// Cached blocks evicted.
    pub prefix_evictions: AtomicU64,
    /// Forward passes run.
    pub steps: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Decode steps submitted before the step ahead of them was collected (a lone sequence's
    /// steps on a backend that runs ahead): how much of the decoding overlapped the host's work.
    pub steps_ahead: AtomicU64,
}

impl SchedulerStats {
    /// MiB one KV block takes (its storage type's size; NaN before the pool exists).
    pub fn kv_block_mib(&self) -> f64 {
        self.kv_pool_bytes.load(Ordering::Relaxed) as f64
            / self.kv_blocks_total.load(Ordering::Relaxed) as f64
            / (1 << 20) as f64
    }

    /// MiB of the KV pool referenced at the peak.
    pub fn kv_peak_mib(&self) -> f64 {
        self.kv_blocks_peak.load(Ordering::Relaxed) as f64 * self.kv_block_mib()
    }
}

enum Msg {
    /// Requests that arrive together (one, or a batch from `submit_all`): queued in one go, so
    /// the next step sees all of them.
    Submit(Vec<Pending>),
    Stop,
}

struct Pending {
    req: GenerateRequest,
    tx: tmpsc::UnboundedSender<Event>,
    arrival: Instant,
    /// Teacher forcing: tokens fed instead of sampled (empty: generate).
    forced: Vec<u32>,
}

/// A handle to a running scheduler. Cloning shares it; the scheduler stops when every handle is
/// dropped.
#[derive(Clone)]
pub struct EngineHandle {
    engine: Arc<Engine>,
    tx: mpsc::Sender<Msg>,
    stats: Arc<SchedulerStats>,
    max_waiting: usize,
    /// The pool's storage type (requests with a `kv_dtype` it cannot hold are refused).
    storage: KvDtype,
    _stopper: Arc<Stopper>,
}

struct Stopper {
    tx: mpsc::Sender<Msg>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Stopper {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Ok(mut t) = self.thread.lock() {
            if let Some(t) = t.take() {
                let _ = t.join();
            }
        }
    }
}

impl EngineHandle {
    /// Starts a scheduler thread over `engine`.
    pub fn start(engine: Arc<Engine>, cfg: SchedulerConfig) -> Result<Self> {
        let mut pool = engine.backend().new_pool(cfg.block_size, 0, cfg.kv_dtype)?;
        let block_bytes = pool.block_bytes();
        let num_blocks = cfg.kv_budget_bytes / block_bytes.max(1);
        if num_blocks == 0 {
            return Err(Error::InvalidRequest(format!(
                "KV budget of {} bytes holds no block ({} bytes each)",
                cfg.kv_budget_bytes, block_bytes
            )));
        }
        pool.grow(num_blocks)?;
        let storage = pool.storage_dtype();
        let stats = Arc::new(SchedulerStats::default());
        stats.kv_blocks_total.store(num_blocks, Ordering::Relaxed);
        stats
            .kv_pool_bytes
            .store(num_blocks * block_bytes, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let mut core = Core {
            pool,
            blocks: BlockManager::new(num_blocks),
            engine: engine.clone(),
            cfg: cfg.clone(),
            stats: stats.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            turn: 0,
        };
        let thread = std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || core.run(rx))
            .map_err(|e| Error::InvalidRequest(format!("cannot start the scheduler: {e}")))?;
        Ok(EngineHandle {
            engine,
            tx: tx.clone(),
            stats,
            max_waiting: cfg.max_waiting,
            storage,
            _stopper: Arc::new(Stopper {
                tx,
                thread: std::sync::Mutex::new(Some(thread)),
            }),
        })
    }

    /// The engine (tokenizer, template, scoring).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Live figures.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// The type the KV pool stores (f32 where the backend cannot store the configured
    /// `kv_dtype` packed).
    pub fn kv_storage(&self) -> KvDtype {
        self.storage
    }

    /// Queues a request; its events arrive on the returned stream.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream> {
        self.enqueue(req, Vec::new())
    }

    /// Teacher forcing through the serving path: the summaries of the model's distribution at
    /// each position of `output` after `prompt`, with `logprob` that of the given token. The
    /// prompt is prefilled (hitting the prefix cache, chunked per the toggles) and `output` is fed
    /// one decode step at a time, batched with other traffic, exactly as generation runs, so
    /// decode-only toggles (`decode_topk`) show.
    pub async fn score(
        &self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        top_k: usize,
        toggles: Toggles,
    ) -> Result<Vec<crate::generate::LogitsSummary>> {
        if output.is_empty() {
            return Ok(Vec::new());
        }
        let n = output.len();
        let req = GenerateRequest {
            prompt,
            sampling: Default::default(),
            stop: crate::generate::StopCriteria {
                max_tokens: n,
                ignore_eos: true,
                ..Default::default()
            },
            top_k_summary: top_k,
            toggles,
        };
        let mut stream = self.enqueue(req, output)?;
        loop {
            match stream.next().await {
                Some(Event::Token(_)) => {}
                Some(Event::Done(out)) => return Ok(out.summaries),
                Some(Event::Error(e)) => return Err(Error::InvalidRequest(e)),
                None => return Err(Error::SchedulerStopped),
            }
        }
    }

    /// Queues several requests as one arrival: the scheduler takes them all before its next
    /// step, so they are admitted together (as far as the KV budget allows) instead of in
    /// whatever groups the scheduler thread happened to catch between steps. A benchmark round
    /// that sends its requests "at once" is then the same batch every run. Each request is
    /// checked as [`submit`](Self::submit) checks it; if any fails, none is queued.
    pub fn submit_all(&self, reqs: Vec<GenerateRequest>) -> Result<Vec<RequestStream>> {
        self.queue(reqs.into_iter().map(|r| (r, Vec::new())).collect())
    }

    /// Whether `req` can be queued at all: a prompt, within the context, in a KV type the pool
    /// holds.
    fn check(&self, req: &GenerateRequest) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        self.storage.check_holds(req.toggles.kv_dtype)?;
        if req.prompt.len() >= self.engine.context_len() {
            return Err(Error::ContextOverflow {
                prompt_tokens: req.prompt.len(),
                context: self.engine.context_len(),
            });
        }
        Ok(())
    }

    fn enqueue(&self, req: GenerateRequest, forced: Vec<u32>) -> Result<RequestStream> {
        self.queue(vec![(req, forced)])?
            .pop()
            .ok_or(Error::SchedulerStopped)
    }

    /// Checks every request (with its forced tokens, empty to generate), then queues them all as
    /// one message; a refused request or a full queue refuses the whole batch.
    fn queue(&self, batch: Vec<(GenerateRequest, Vec<u32>)>) -> Result<Vec<RequestStream>> {
        for (req, _) in &batch {
            self.check(req)?;
        }
        let waiting = self.stats.waiting.load(Ordering::Relaxed);
        if waiting + batch.len() > self.max_waiting {
            return Err(Error::Overloaded {
                waiting,
                limit: self.max_waiting,
            });
        }
        let arrival = Instant::now();
        let (mut pending, mut streams) = (Vec::new(), Vec::new());
        for (req, forced) in batch {
            let (tx, rx) = tmpsc::unbounded_channel();
            pending.push(Pending {
                req,
                tx,
                arrival,
                forced,
            });
            streams.push(RequestStream { rx });
        }
        let n = pending.len();
        self.stats.waiting.fetch_add(n, Ordering::Relaxed);
        if self.tx.send(Msg::Submit(pending)).is_err() {
            self.stats.waiting.fetch_sub(n, Ordering::Relaxed);
            return Err(Error::SchedulerStopped);
        }
        Ok(streams)
    }

    /// Runs a request to completion on the calling thread's behalf (blocking), calling `on_token`
    /// for each token; returning `false` cancels. The batched counterpart of [`Engine::generate`].
    pub fn generate_blocking(
        &self,
        req: GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<GenerateOutput> {
        let mut stream = self.submit(req)?;
        loop {
            match stream.blocking_next() {
                Some(Event::Token(t)) => {
                    if !on_token(&t) {
                        drop(stream);
                        return Err(Error::InvalidRequest("cancelled".into()));
                    }
                }
                Some(Event::Done(out)) => return Ok(out),
                Some(Event::Error(e)) => return Err(Error::InvalidRequest(e)),
                None => return Err(Error::SchedulerStopped),
            }
        }
    }
}

/// A sequence admitted to the pool.
struct Seq {
    req: GenerateRequest,
    tx: tmpsc::UnboundedSender<Event>,
    dec: Decoding,
    table: BlockTable,
    /// Every token whose KV is (or is being) cached: the prompt, then generated tokens fed back.
    tokens: Vec<u32>,
    /// Keys of the full blocks registered so far.
    keys: Vec<(BlockKey, BlockKey)>,
    kv_key: String,
    /// The next generated token to feed (decode phase).
    next: Option<u32>,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.table.len < self.req.prompt.len()
    }
}

/// What became of a sequence once a pass's logits for it were taken.
enum Settled {
    /// It chose this token and goes on.
    Next(u32),
    /// It ended (finished, cancelled or failed): retire it.
    Ended,
    /// The pass wanted no logits for it (a prefill chunk before the prompt's last).
    NoLogits,
}

struct Core {
    engine: Arc<Engine>,
    cfg: SchedulerConfig,
    pool: KvPool,
    blocks: BlockManager,
    stats: Arc<SchedulerStats>,
    waiting: VecDeque<Pending>,
    running: Vec<Seq>,
    /// Round-robin position over toggle groups.
    turn: usize,
}

impl Core {
    fn run(&mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            // Block when idle; otherwise take whatever has arrived.
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(Msg::Submit(ps)) => self.waiting.extend(ps),
                    Ok(Msg::Stop) | Err(_) => return,
                }
            }
            if !self.poll(&rx) {
                return;
            }
            self.reap_cancelled();
            self.admit();
            let go_on = if self.solo() {
                self.decode_solo(&rx)
            } else {
                self.step();
                true
            };
            self.publish();
            if !go_on {
                return;
            }
        }
    }

    /// Takes whatever messages have arrived; `false` when the scheduler must stop (a stop
    /// message, or every handle dropped with nothing left to do).
    fn poll(&mut self, rx: &mpsc::Receiver<Msg>) -> bool {
        loop {
            match rx.try_recv() {
                Ok(Msg::Submit(ps)) => self.waiting.extend(ps),
                Ok(Msg::Stop) => return false,
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => {
                    return !(self.running.is_empty() && self.waiting.is_empty());
                }
            }
        }
    }

    /// Whether the next steps can run ahead: one sequence, decoding, alone, with a token the
    /// device can pick (greedy or forced), on an engine that runs ahead.
    fn solo(&self) -> bool {
        match self.running.as_slice() {
            [s] => {
                self.engine.runs_ahead()
                    && self.waiting.is_empty()
                    && !s.prefilling()
                    && s.next.is_some()
                    && matches!(s.dec.want(), WantLogits::Pick(_))
            }
            _ => false,
        }
    }

    /// Decodes the lone running sequence ([`solo`](Self::solo)) with each step submitted before
    /// the one ahead of it is collected, as [`Engine::generate`] does, until it ends, a request
    /// or a stop arrives, or its stream is dropped; then it is left with its next token to feed,
    /// for [`step`](Self::step). Returns `false` when a stop arrived.
    fn decode_solo(&mut self, rx: &mpsc::Receiver<Msg>) -> bool {
        let ctx = self.engine.context_len();
        let s = &mut self.running[0];
        let Some(first) = s.next.take() else {
            return true;
        };
        s.tokens.push(first);
        let toggles = s.req.toggles;
        // The step in flight produces token number `n`.
        let mut n = s.dec.tokens().len();
        let want = s.dec.want_at(n);
        let mut cur = match self.submit_solo(Feed::Token(first), want, &toggles) {
            Ok(t) => t,
            Err(e) => {
                self.fail(0, &e.to_string());
                return true;
            }
        };
        loop {
            let go_on = self.poll(rx);
            let s = &mut self.running[0];
            // The next step's input is token n: submitted where generation can go on past it
            // and nothing else wants the engine.
            let feed = if go_on && self.waiting.is_empty() && !s.tx.is_closed() {
                s.dec.feed_ahead(n, s.table.len + 1 < ctx, &mut cur)
            } else {
                None
            };
            let ahead = if let Some(feed) = feed {
                let want = s.dec.want_at(n + 1);
                match self.submit_solo(feed, want, &toggles) {
                    Ok(t) => {
                        self.stats.steps_ahead.fetch_add(1, Ordering::Relaxed);
                        Some(t)
                    }
                    Err(e) => {
                        self.engine.backend().discard(cur);
                        self.fail(0, &e.to_string());
                        return go_on;
                    }
                }
            } else {
                None
            };
            // The cache length the step of token n saw, without the step ahead.
            let seen = self.running[0].table.len - usize::from(ahead.is_some());
            let logits = self.engine.backend().collect(cur);
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
            n += 1;
            let settled = match logits {
                Ok(l) => self.settle(0, true, 0, seen, l),
                Err(e) => {
                    if let Some(a) = ahead {
                        self.engine.backend().discard(a);
                    }
                    self.fail(0, &e.to_string());
                    return go_on;
                }
            };
            match (settled, ahead) {
                (Settled::Next(id), Some(a)) => {
                    // The step ahead was fed `id` on the device: its KV is being cached.
                    self.running[0].tokens.push(id);
                    cur = a;
                }
                (Settled::Next(id), None) => {
                    self.running[0].next = Some(id);
                    return go_on;
                }
                (settled, ahead) => {
                    if let Some(a) = ahead {
                        self.engine.backend().discard(a);
                    }
                    if matches!(settled, Settled::NoLogits) {
                        self.fail(0, "a decode step returned no logits");
                    } else {
                        self.retire(0);
                    }
                    return go_on;
                }
            }
        }
    }

    /// Submits one decode step of the lone running sequence, its input token from `feed`.
    fn submit_solo(
        &mut self,
        feed: Feed<'_>,
        want: WantLogits,
        toggles: &Toggles,
    ) -> Result<Ticket> {
        let seg = Segment {
            // Never read: `feed` gives the token.
            tokens: &[0],
            table: &mut self.running[0].table,
            decode: true,
            want,
            fault_chunk_boundary: false,
        };
        self.engine
            .backend()
            .submit(&mut self.pool, seg, feed, toggles)
    }

    /// Ends sequence `i` with an error event and frees its blocks.
    fn fail(&mut self, i: usize, why: &str) {
        let seq = self.running.swap_remove(i);
        let _ = seq.tx.send(Event::Error(why.to_string()));
        self.release(&seq);
    }

    /// Retires ended sequence `i`: frees its blocks and sends its output.
    fn retire(&mut self, i: usize) {
        let seq = self.running.swap_remove(i);
        self.release(&seq);
        let Seq { dec, tx, .. } = seq;
        let _ = tx.send(Event::Done(dec.finish()));
    }

    /// Takes a pass's `logits` for sequence `i`: counts a prefill chunk of `prefilled` tokens,
    /// registers the blocks the pass completed in the prefix cache, and chooses and streams the
    /// next token. `seen`: the cache length the pass left the sequence at (without a step run
    /// ahead of it).
    fn settle(
        &mut self,
        i: usize,
        decode: bool,
        prefilled: usize,
        seen: usize,
        logits: crate::model::Logits,
    ) -> Settled {
        let ctx = self.engine.context_len();
        let bs = self.cfg.block_size;
        let s = &mut self.running[i];
        if !decode {
            self.stats
                .prefill_tokens
                .fetch_add(prefilled as u64, Ordering::Relaxed);
        }
        // Register blocks completed by this pass (decode-written blocks only when decode
        // numerics equal prefill numerics: no sparse indexer, no bf16 decode kernel). Only
        // tokens known here count: a step run ahead caches one the host has not read yet.
        if s.req.toggles.prefix_cache && (!decode || s.req.toggles.decode_matches_prefill()) {
            let full = s.table.len.min(s.tokens.len()) / bs;
            if full > s.keys.len() {
                let new = block_keys(&s.tokens[..full * bs], bs, &s.kv_key);
                for (b, key) in new.iter().enumerate().skip(s.keys.len()) {
                    self.blocks.register(s.table.blocks[b], *key);
                }
                s.keys = new;
            }
        }
        if logits.is_empty() {
            return Settled::NoLogits;
        }
        if !decode {
            s.dec.prefilled();
        }
        match s.dec.step(logits, self.engine.tokenizer(), seen + 1 >= ctx) {
            Ok((event, done)) => {
                self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                let id = event.id;
                if s.tx.send(Event::Token(event)).is_err() {
                    s.dec.cancel();
                    Settled::Ended
                } else if done {
                    Settled::Ended
                } else {
                    Settled::Next(id)
                }
            }
            Err(e) => {
                let _ = s.tx.send(Event::Error(e.to_string()));
                s.dec.cancel();
                Settled::Ended
            }
        }
    }

    fn publish(&self) {
        let s = &self.stats;
        s.running.store(self.running.len(), Ordering::Relaxed);
        s.waiting.store(self.waiting.len(), Ordering::Relaxed);
        let used = self.blocks.in_use();
        s.kv_blocks_used.store(used, Ordering::Relaxed);
        s.kv_blocks_peak.fetch_max(used, Ordering::Relaxed);
        s.prefix_evictions
            .store(self.blocks.counters.evictions, Ordering::Relaxed);
    }

    fn release(&mut self, seq: &Seq) {
        for &b in &seq.table.blocks {
            self.blocks.release(b);
        }
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].tx.is_closed() {
                let seq = self.running.swap_remove(i);
                self.release(&seq);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|p| !p.tx.is_closed());
    }

    /// Admits waiting requests in arrival order while their blocks fit.
    fn admit(&mut self) {
        let bs = self.cfg.block_size;
        let ctx = self.engine.context_len();
        while self.running.len() < self.cfg.max_running {
            let Some(p) = self.waiting.front() else { break };
            let prompt_len = p.req.prompt.len();
            let positions = (prompt_len + p.req.stop.max_tokens).min(ctx);
            let need = positions.div_ceil(bs);
            if need > self.blocks.total() {
                let Some(p) = self.waiting.pop_front() else {
                    break;
                };
                let _ = p.tx.send(Event::Error(format!(
                    "request needs {need} KV blocks but the KV budget holds {}; lower max_tokens or raise --kv-budget",
                    self.blocks.total()
                )));
                continue;
            }
            let toggles = p.req.toggles;
            let kv_key = toggles.kv_key();
            // Full blocks of the prompt, never the block holding its last token: that position
            // must be computed to produce the first logits.
            let keys = if toggles.prefix_cache {
                block_keys(&p.req.prompt[..prompt_len - 1], bs, &kv_key)
            } else {
                Vec::new()
            };
            let hits = self.blocks.lookup(&keys, toggles.fault_prefix_cache_stale);
            if self.blocks.available() < need - hits.len() {
                for &b in &hits {
                    self.blocks.release(b);
                }
                break;
            }
            let mut table = BlockTable {
                blocks: hits.clone(),
                len: hits.len() * bs,
            };
            for _ in hits.len()..need {
                match self.blocks.allocate() {
                    Some(b) => table.blocks.push(b),
                    None => unreachable!("availability was checked"),
                }
            }
            let Some(p) = self.waiting.pop_front() else {
                break;
            };
            self.stats
                .prefix_hit_tokens
                .fetch_add(table.len as u64, Ordering::Relaxed);
            let dec = if p.forced.is_empty() {
                Decoding::new(&p.req, p.arrival)
            } else {
                Decoding::new_forced(&p.req, p.arrival, p.forced)
            };
            self.running.push(Seq {
                tokens: p.req.prompt.clone(),
                keys: keys[..hits.len()].to_vec(),
                kv_key,
                req: p.req,
                tx: p.tx,
                dec,
                table,
                next: None,
            });
        }
    }

    /// The toggle set to run this step: round-robin over the distinct sets among running
    /// sequences, so no group starves.
    fn pick_group(&mut self) -> Option<Toggles> {
        let mut groups: Vec<Toggles> = Vec::new();
        for s in &self.running {
            if !groups.contains(&s.req.toggles) {
                groups.push(s.req.toggles);
            }
        }
        if groups.is_empty() {
            return None;
        }
        self.turn = (self.turn + 1) % groups.len();
        Some(groups[self.turn])
    }

    fn step(&mut self) {
        let Some(toggles) = self.pick_group() else {
            return;
        };
        let chunk_limit = toggles.prefill_chunk.map(|c| c.get());
        let mut budget = self.cfg.max_batch_tokens;
        // (sequence index, token range in its `tokens`, decode?)
        let mut plan: Vec<(usize, std::ops::Range<usize>, bool)> = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            if s.req.toggles != toggles || s.prefilling() {
                continue;
            }
            if let Some(t) = s.next.take() {
                s.tokens.push(t);
                let at = s.tokens.len() - 1;
                plan.push((i, at..at + 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        let mut whole_prompt_taken = false;
        for (i, s) in self.running.iter().enumerate() {
            if s.req.toggles != toggles || !s.prefilling() {
                continue;
            }
            let left = s.req.prompt.len() - s.table.len;
            let n = match chunk_limit {
                Some(c) => left.min(c).min(budget),
                // Unchunked: a whole prompt per pass; more than one only while the budget allows.
                None if !whole_prompt_taken || left <= budget => left,
                None => 0,
            };
            if n == 0 {
                continue;
            }
            whole_prompt_taken = true;
            budget = budget.saturating_sub(n);
            plan.push((i, s.table.len..s.table.len + n, false));
        }
        if plan.is_empty() {
            return;
        }
        let run = {
            let running = &mut self.running;
            let wants: Vec<WantLogits> = running.iter().map(|s| s.dec.want()).collect();
            let mut tables: Vec<Option<&mut BlockTable>> = Vec::new();
            let mut toks: Vec<Option<&[u32]>> = Vec::new();
            for s in running.iter_mut() {
                tables.push(Some(&mut s.table));
                toks.push(Some(&s.tokens));
            }
            let mut segs = Vec::with_capacity(plan.len());
            for (i, range, decode) in &plan {
                let Some(table) = tables[*i].take() else {
                    continue;
                };
                let Some(all) = toks[*i] else { continue };
                // While prefilling, a sequence's `tokens` are exactly its prompt.
                let ends_prompt = !*decode && range.end == all.len();
                let start = range.start;
                segs.push(Segment {
                    tokens: &all[range.clone()],
                    table,
                    decode: *decode,
                    want: if *decode || ends_prompt {
                        wants[*i]
                    } else {
                        WantLogits::None
                    },
                    fault_chunk_boundary: toggles.fault_chunk_boundary && !*decode && start > 0,
                });
            }
            let engine = &self.engine;
            let pool = &mut self.pool;
            engine.backend().forward(pool, &mut segs, &toggles)
        };
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let logits = match run {
            Ok(l) => l,
            Err(e) => {
                let mut failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
                failed.sort_unstable_by(|a, b| b.cmp(a));
                for i in failed {
                    self.fail(i, &e.to_string());
                }
                return;
            }
        };
        let mut finished: Vec<usize> = Vec::new();
        for ((i, range, decode), logits) in plan.iter().zip(logits) {
            let seen = self.running[*i].table.len;
            match self.settle(*i, *decode, range.len(), seen, logits) {
                Settled::Next(id) => self.running[*i].next = Some(id),
                Settled::Ended => finished.push(*i),
                Settled::NoLogits => {}
            }
        }
        finished.sort_unstable_by(|a, b| b.cmp(a));
        for i in finished {
            self.retire(i);
        }
    }
}
