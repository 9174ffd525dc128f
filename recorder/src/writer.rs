//! The record writer: one task that owns all writes, fed by a bounded queue.
//!
//! Request handlers must never wait on SQLite while tokens stream, so a finished request's record
//! is handed to a bounded `mpsc` queue and a single writer task commits records in batches (up to
//! `max_batch` records or `max_delay` after the first one, whichever comes first), one transaction
//! per batch: a crash loses at most the batch in flight, never half of one. When the queue is full
//! the configured [`QueuePolicy`] decides: wait a bounded time for room, or drop the record at
//! once; either way every dropped record is counted and shown in `/metrics`.
//!
//! [`RecordWriter::shutdown`] closes the queue, drains what is in it, and returns the final counts;
//! records submitted after that are counted as dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::record::RequestRecord;
use crate::store::Store;

/// What to do with a record when the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueuePolicy {
    /// Wait up to this long for room, then drop.
    Wait(Duration),
    /// Drop at once.
    Drop,
}

impl std::str::FromStr for QueuePolicy {
    type Err = Error;

    /// `drop`, or `wait` / `wait:MS` (milliseconds; `wait` alone is 1000 ms).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "drop" {
            return Ok(QueuePolicy::Drop);
        }
        if s == "wait" {
            return Ok(QueuePolicy::Wait(Duration::from_secs(1)));
        }
        s.strip_prefix("wait:")
            .or_else(|| s.strip_prefix("wait("))
            .map(|ms| ms.trim_end_matches(')').trim_end_matches("ms"))
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(|ms| QueuePolicy::Wait(Duration::from_millis(ms)))
            .ok_or_else(|| {
                Error::Config(format!(
                    "queue policy {s:?}: expected `drop`, `wait` or `wait:MS`"
                ))
            })
    }
}

/// Writer settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterConfig {
    /// Records the queue holds before the policy applies.
    pub capacity: usize,
    /// What happens when it is full.
    pub policy: QueuePolicy,
    /// Most records per transaction.
    pub max_batch: usize,
    /// Longest a record waits for its batch to fill.
    pub max_delay: Duration,
}

impl Default for WriterConfig {
    fn default() -> Self {
        WriterConfig {
            capacity: 4096,
            policy: QueuePolicy::Wait(Duration::from_millis(100)),
            max_batch: 64,
            max_delay: Duration::from_millis(20),
        }
    }
}

/// A snapshot of the writer's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WriterStats {
    /// Records waiting in the queue now.
    pub depth: u64,
    /// Queue capacity.
    pub capacity: u64,
    /// Records committed.
    pub written: u64,
    /// Records dropped because the queue was full or closed.
    pub dropped: u64,
    /// Records lost because their batch's transaction failed.
    pub failed: u64,
    /// Transactions committed.
    pub batches: u64,
}

/// The outcome of [`RecordWriter::submit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// In the queue; it will be written.
    Queued,
    /// Not queued (full queue or closed writer); counted in `dropped`.
    Dropped,
}

enum Msg {
    Record(Box<RequestRecord>),
    Flush(oneshot::Sender<()>),
    Shutdown(oneshot::Sender<()>),
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    batches: AtomicU64,
}

struct Shared {
    counters: Counters,
    capacity: usize,
    policy: QueuePolicy,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// A handle for submitting records; cheap to clone, all clones feed the same writer task.
#[derive(Clone)]
pub struct RecordWriter {
    tx: mpsc::Sender<Msg>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RecordWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordWriter")
            .field("stats", &self.stats())
            .finish()
    }
}

impl RecordWriter {
    /// Starts the writer task on the current tokio runtime.
    pub fn spawn(store: Store, config: WriterConfig) -> RecordWriter {
        // The queue also carries flush/shutdown markers, which need a slot of their own.
        let (tx, rx) = mpsc::channel(config.capacity.max(1));
        let shared = Arc::new(Shared {
            counters: Counters::default(),
            capacity: config.capacity.max(1),
            policy: config.policy,
            task: Mutex::new(None),
        });
        let task = tokio::spawn(run(store, config, rx, shared.clone()));
        if let Ok(mut slot) = shared.task.lock() {
            *slot = Some(task);
        }
        RecordWriter { tx, shared }
    }

    /// Queues a record under the configured policy. Never fails: a record that cannot be queued is
    /// counted as dropped.
    pub async fn submit(&self, record: RequestRecord) -> Submitted {
        let msg = Msg::Record(Box::new(record));
        let sent = match self.shared.policy {
            QueuePolicy::Drop => self.tx.try_send(msg).is_ok(),
            QueuePolicy::Wait(d) => self.tx.send_timeout(msg, d).await.is_ok(),
        };
        if sent {
            Submitted::Queued
        } else {
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            Submitted::Dropped
        }
    }

    /// Queues a record without waiting: at once when there is room; when the queue is full, under
    /// `Drop` it is dropped and under `Wait` a task waits for room (so the caller never does).
    /// Used on request paths, where a response must not wait for the recorder.
    pub fn submit_nowait(&self, record: RequestRecord) -> Submitted {
        let msg = match self.tx.try_send(Msg::Record(Box::new(record))) {
            Ok(()) => return Submitted::Queued,
            Err(mpsc::error::TrySendError::Full(msg)) => msg,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return Submitted::Dropped;
            }
        };
        match self.shared.policy {
            QueuePolicy::Wait(d) => {
                let this = self.clone();
                tokio::spawn(async move {
                    if this.tx.send_timeout(msg, d).await.is_err() {
                        this.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                });
                Submitted::Queued
            }
            QueuePolicy::Drop => {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                Submitted::Dropped
            }
        }
    }

    /// Waits until every record queued before this call is committed (or has failed).
    pub async fn flush(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Msg::Flush(tx))
            .await
            .map_err(|_| Error::WriterClosed)?;
        rx.await.map_err(|_| Error::WriterClosed)
    }

    /// The counters now.
    pub fn stats(&self) -> WriterStats {
        let c = &self.shared.counters;
        let cap = self.shared.capacity;
        WriterStats {
            depth: cap.saturating_sub(self.tx.capacity()) as u64,
            capacity: cap as u64,
            written: c.written.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting records, writes everything already queued, and waits for the task to end.
    /// Calling it again (from any clone) only returns the counters.
    pub async fn shutdown(&self) -> WriterStats {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Shutdown(tx)).await.is_ok() {
            let _ = rx.await;
        }
        let task = self.shared.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "record writer task failed");
            }
        }
        self.stats()
    }
}

async fn run(store: Store, config: WriterConfig, mut rx: mpsc::Receiver<Msg>, shared: Arc<Shared>) {
    let max_batch = config.max_batch.max(1);
    let mut batch: Vec<RequestRecord> = Vec::with_capacity(max_batch);
    loop {
        let Some(first) = rx.recv().await else { break };
        let mut waiters = Vec::new();
        let mut shutdown = None;
        let mut take = |m: Msg, batch: &mut Vec<RequestRecord>| match m {
            Msg::Record(r) => batch.push(*r),
            Msg::Flush(w) => waiters.push(w),
            Msg::Shutdown(w) => shutdown = Some(w),
        };
        take(first, &mut batch);
        let deadline = Instant::now() + config.max_delay;
        while batch.len() < max_batch && !batch.is_empty() {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(m)) => {
                    let is_marker = !matches!(m, Msg::Record(_));
                    take(m, &mut batch);
                    if is_marker {
                        break;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        write(&store, &mut batch, &shared.counters).await;
        for w in waiters {
            let _ = w.send(());
        }
        if let Some(done) = shutdown {
            rx.close();
            while let Some(m) = rx.recv().await {
                match m {
                    Msg::Record(r) => {
                        batch.push(*r);
                        if batch.len() >= max_batch {
                            write(&store, &mut batch, &shared.counters).await;
                        }
                    }
                    Msg::Flush(w) | Msg::Shutdown(w) => {
                        write(&store, &mut batch, &shared.counters).await;
                        let _ = w.send(());
                    }
                }
            }
            write(&store, &mut batch, &shared.counters).await;
            let _ = done.send(());
            break;
        }
    }
    // Every sender is gone or we were shut down: anything left was written above.
}

async fn write(store: &Store, batch: &mut Vec<RequestRecord>, counters: &Counters) {
    if batch.is_empty() {
        return;
    }
    let n = batch.len() as u64;
    match store.insert_batch(batch).await {
        Ok(()) => {
            counters.written.fetch_add(n, Ordering::Relaxed);
            counters.batches.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            // One bad record (say, a duplicate ID) must not take its batch-mates with it: retry
            // them one by one so that only the bad ones are lost.
            tracing::warn!(error = %e, records = n, "recording batch failed; retrying one by one");
            for rec in batch.iter() {
                match store.insert_batch(std::slice::from_ref(rec)).await {
                    Ok(()) => counters.written.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        tracing::error!(error = %e, request = %rec.id, "record lost");
                        counters.failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
            counters.batches.fetch_add(1, Ordering::Relaxed);
        }
    }
    batch.clear();
}
