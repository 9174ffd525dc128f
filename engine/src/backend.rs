//! Where forward passes run: the [`Backend`] trait and its CPU implementation.
//!
//! The engine, the scheduler and teacher forcing talk to one trait, so the same scheduling code
//! (continuous batching, chunked prefill, the paged KV pool and its prefix cache) drives the CPU
//! reference and the CUDA backend alike, and a replay can A/B the two without either knowing. A
//! backend owns its weights and allocates the KV pools its forward passes read and write; callers
//! never write `#[cfg]` or check for a GPU themselves: asking for CUDA where there is none is a
//! clear [`Error::Device`] at load time.

use std::fmt;
use std::str::FromStr;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::{KvPool, Logits, Model, Segment};
use crate::toggles::{KvDtype, Toggles};

/// Which device runs the forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU reference backend (always available).
    #[default]
    Cpu,
    /// The CUDA backend on GPU number N.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`.
impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::InvalidRequest(format!(
                        "unknown device {s:?} (expected cpu, cuda or cuda:N)"
                    ))
                }),
        }
    }
}

/// A place that runs the model: it owns the weights and allocates the KV pools it computes in.
///
/// `forward` appends each segment's tokens to its sequence's cache and returns the logits each
/// segment asked for (`(rows, vocab)` flattened, f32, or reduced on the device to a picked token
/// and its summary), exactly as [`Model::forward`] documents.
/// Implementations must keep a segment's results independent of the other segments in the batch
/// as far as their arithmetic allows (the CPU backend does bit for bit; the CUDA backend states
/// its tolerance).
pub trait Backend: Send + Sync {
    /// The device.
    fn device(&self) -> Device;

    /// One line for logs and build identities, e.g. `cuda:0 NVIDIA H200 (sm_90)`.
    fn describe(&self) -> String;

    /// The model configuration.
    fn config(&self) -> &Config;

    /// An empty-or-sized KV pool in this backend's memory, for requests whose `kv_dtype` is
    /// `dtype`. The backend stores that type as compactly as its kernels can read it
    /// ([`KvPool::storage_dtype`] says how).
    fn new_pool(&self, block_size: usize, num_blocks: usize, dtype: KvDtype) -> Result<KvPool>;

    /// Runs new tokens of several sequences through the model (see [`Model::forward`]).
    fn forward(
        &self,
        pool: &mut KvPool,
        segs: &mut [Segment<'_>],
        toggles: &Toggles,
    ) -> Result<Vec<Logits>>;

    /// Worker threads used on the host (for the CPU backend, the compute threads).
    fn threads(&self) -> usize;

    /// Device time spent in forward passes so far (from the upload of a pass's inputs to its
    /// last kernel, as the device's own clock measures it) and the number of passes; `None`
    /// where the host is the device. Against wall time it says how much of a decode step the
    /// accelerator is busy and how much is host work between steps.
    fn device_time(&self) -> Option<(std::time::Duration, u64)> {
        None
    }

    /// Saves the kernel timeline recorded so far, where the backend records one (the CUDA
    /// backend with `TAPEDECK_TRACE=path`), and says what it saved; `None` where there is none.
    fn save_trace(&self) -> Result<Option<String>> {
        Ok(None)
    }

    /// Whether [`submit`](Backend::submit) returns while the step still runs, so that a caller
    /// gains by submitting the next step before collecting this one: the host's work between
    /// steps (reading the token back, streaming it, launching the next) then overlaps the
    /// device's. `false` where `submit` runs the step to its end.
    fn runs_ahead(&self) -> bool {
        false
    }

    /// Enqueues one decode step of one sequence: `seg`, one token wanting a pick, whose input
    /// token comes from `feed` (the segment's own token is not read). The step appends to the
    /// cache as [`forward`](Backend::forward) does. This default runs it now.
    fn submit(
        &self,
        pool: &mut KvPool,
        seg: Segment<'_>,
        feed: Feed<'_>,
        toggles: &Toggles,
    ) -> Result<Ticket> {
        submit_now(self, pool, seg, feed, toggles)
    }

    /// The logits of a submitted step, once it has run.
    fn collect(&self, ticket: Ticket) -> Result<Logits> {
        ticket.into_done()
    }

    /// Drops a submitted step whose logits are no longer wanted (a step run ahead past the end
    /// of a generation), without waiting for it where the backend can.
    fn discard(&self, ticket: Ticket) {
        drop(ticket);
    }
}

/// [`Backend::submit`] for a backend that runs the step now: the fed token on the host, then
/// [`Backend::forward`].
pub(crate) fn submit_now<B: Backend + ?Sized>(
    backend: &B,
    pool: &mut KvPool,
    seg: Segment<'_>,
    feed: Feed<'_>,
    toggles: &Toggles,
) -> Result<Ticket> {
    let tokens = [feed.token(backend)?];
    let mut segs = [Segment {
        tokens: &tokens,
        ..seg
    }];
    let logits = backend.forward(pool, &mut segs, toggles)?.pop();
    Ok(Ticket::done(logits.unwrap_or(Logits::Rows(Vec::new()))))
}

/// A decode step [`Backend::submit`] enqueued: hand it to [`Backend::collect`] for its logits,
/// or to [`Backend::discard`].
#[must_use = "a submitted step is collected or discarded"]
pub struct Ticket(pub(crate) TicketState);

/// What a [`Ticket`] holds.
pub(crate) enum TicketState {
    /// The step has run: its logits.
    Done(Logits),
    /// The step is (or was) in flight on a GPU.
    Cuda(crate::cuda::InFlight),
}

impl Ticket {
    /// A step that has run.
    pub(crate) fn done(logits: Logits) -> Ticket {
        Ticket(TicketState::Done(logits))
    }

    /// The logits of a step that has run.
    pub(crate) fn into_done(self) -> Result<Logits> {
        match self.0 {
            TicketState::Done(l) => Ok(l),
            TicketState::Cuda(_) => Err(Error::Device(
                "a GPU step was handed to a backend that did not submit it".into(),
            )),
        }
    }
}

/// Where a submitted step's input token comes from.
pub enum Feed<'t> {
    /// Known on the host.
    Token(u32),
    /// The token this earlier step picks: read where it was picked (on the device) where the
    /// backend can, so the step can be enqueued before that one is collected.
    Picked(&'t mut Ticket),
}

impl Feed<'_> {
    /// The token, on the host: waits for a `Picked` step through `backend` if it has not been
    /// collected (it stays collectable, with the same logits).
    pub(crate) fn token<B: Backend + ?Sized>(self, backend: &B) -> Result<u32> {
        let ticket = match self {
            Feed::Token(t) => return Ok(t),
            Feed::Picked(t) => t,
        };
        if let TicketState::Cuda(_) = ticket.0 {
            let waiting = std::mem::replace(ticket, Ticket::done(Logits::Rows(Vec::new())));
            *ticket = Ticket::done(backend.collect(waiting)?);
        }
        match &ticket.0 {
            TicketState::Done(Logits::Picked { token, .. }) => Ok(*token),
            _ => Err(Error::Device(
                "a step fed from an earlier one needs that step's token picked".into(),
            )),
        }
    }
}

/// The CPU reference: [`Model::forward`] on a private rayon pool.
pub struct CpuBackend {
    model: Model,
    pool: rayon::ThreadPool,
}

impl CpuBackend {
    /// Wraps a loaded model with `threads` worker threads (`None`: one per core).
    pub fn new(model: Model, threads: Option<usize>) -> Result<Self> {
        let mut builder = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("engine-{i}"));
        if let Some(n) = threads {
            builder = builder.num_threads(n.max(1));
        }
        let pool = builder
            .build()
            .map_err(|e| Error::InvalidRequest(format!("cannot start worker threads: {e}")))?;
        Ok(CpuBackend { model, pool })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.pool.current_num_threads())
    }

    fn config(&self) -> &Config {
        self.model.config()
    }

    fn new_pool(&self, block_size: usize, num_blocks: usize, dtype: KvDtype) -> Result<KvPool> {
        Ok(KvPool::new(
            self.model.config(),
            block_size,
            num_blocks,
            dtype,
        ))
    }

    fn forward(
        &self,
        pool: &mut KvPool,
        segs: &mut [Segment<'_>],
        toggles: &Toggles,
    ) -> Result<Vec<Logits>> {
        self.pool
            .install(|| self.model.forward(pool, segs, toggles))
    }

    fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        let e = "tpu".parse::<Device>().unwrap_err().to_string();
        assert!(e.contains("cpu, cuda or cuda:N"), "{e}");
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
