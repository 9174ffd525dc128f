//! The host's side of a pass: the page-locked buffers its small copies can go through
//! (`TAPEDECK_HOST_COPIES=pinned`, cuda/tune.rs) and where its time goes ([`host_split`]).
//!
//! At batch 1 a Llama-1B decode step is ~1.2 ms, of which the host's own work (building the
//! pass's indices, launching the graph, reading the token back, the scheduler around it) is
//! ~35 µs on an H100: 3% of the throughput, and the part no kernel change reaches. The split
//! says which piece of it to work on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result as dr;
use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};

use super::{dev_err, timing_event};
use crate::error::{Error, Result};

/// Where the host's time in the backend's passes went, summed over the process (all CUDA
/// backends in it): a benchmark takes two readings and prints the difference per pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostSplit {
    /// Passes counted.
    pub passes: u64,
    /// Taking the backend's lock and building the pass's indices, before anything is enqueued.
    pub prepare: Duration,
    /// Enqueueing: the index upload, the launches or the graph launch, the timing events.
    pub launch: Duration,
    /// From the last launch to the pass's end on the device, the downloads included: the host
    /// idles here while the device works, so this shrinks as the host's other parts grow.
    pub wait: Duration,
    /// Turning the downloaded words into the logits summaries the scheduler reads.
    pub read: Duration,
}

impl HostSplit {
    /// What was spent between `earlier` and this reading.
    pub fn since(&self, earlier: &HostSplit) -> HostSplit {
        HostSplit {
            passes: self.passes.saturating_sub(earlier.passes),
            prepare: self.prepare.saturating_sub(earlier.prepare),
            launch: self.launch.saturating_sub(earlier.launch),
            wait: self.wait.saturating_sub(earlier.wait),
            read: self.read.saturating_sub(earlier.read),
        }
    }
}

impl std::ops::Add for HostSplit {
    type Output = HostSplit;

    /// Both readings' time together (the runs of a benchmark, say).
    fn add(self, o: HostSplit) -> HostSplit {
        HostSplit {
            passes: self.passes + o.passes,
            prepare: self.prepare + o.prepare,
            launch: self.launch + o.launch,
            wait: self.wait + o.wait,
            read: self.read + o.read,
        }
    }
}

/// One counter of nanoseconds per [`HostSplit`] part, and the pass count.
static PREPARE_NS: AtomicU64 = AtomicU64::new(0);
static LAUNCH_NS: AtomicU64 = AtomicU64::new(0);
static WAIT_NS: AtomicU64 = AtomicU64::new(0);
static READ_NS: AtomicU64 = AtomicU64::new(0);
static PASSES: AtomicU64 = AtomicU64::new(0);

/// The host's time in CUDA passes so far in this process.
pub fn host_split() -> HostSplit {
    let d = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
    HostSplit {
        passes: PASSES.load(Ordering::Relaxed),
        prepare: d(&PREPARE_NS),
        launch: d(&LAUNCH_NS),
        wait: d(&WAIT_NS),
        read: d(&READ_NS),
    }
}

/// The parts a pass's host time is split into.
#[derive(Debug, Clone, Copy)]
pub(super) enum Part {
    Prepare,
    Launch,
    Wait,
    Read,
}

/// A stopwatch over one pass: each [`Laps::lap`] adds the time since the last to a part.
pub(super) struct Laps(Instant);

impl Laps {
    /// Starts timing a pass.
    pub fn start() -> Laps {
        Laps(Instant::now())
    }

    /// Adds the time since the last lap (or the start) to `part`.
    pub fn lap(&mut self, part: Part) {
        let now = Instant::now();
        let counter = match part {
            Part::Prepare => &PREPARE_NS,
            Part::Launch => &LAUNCH_NS,
            Part::Wait => &WAIT_NS,
            Part::Read => &READ_NS,
        };
        counter.fetch_add((now - self.0).as_nanos() as u64, Ordering::Relaxed);
        self.0 = now;
    }

    /// Counts the pass (once, at its end).
    pub fn finish(mut self) {
        self.lap(Part::Read);
        PASSES.fetch_add(1, Ordering::Relaxed);
    }
}

/// The host side of each pass's index upload and picked-token download, through page-locked
/// buffers (`TAPEDECK_HOST_COPIES=pinned`) or ordinary memory (the default), so that a pass
/// copies the same way whichever is in force.
pub(super) enum HostCopies {
    /// From the caller's slice, and into a vector kept from pass to pass.
    Pageable {
        picks: Vec<u32>,
    },
    Pinned(Pinned),
}

impl HostCopies {
    /// Copies per the `TAPEDECK_HOST_COPIES` knob, in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>, pinned: bool) -> Result<HostCopies> {
        Ok(if pinned {
            HostCopies::Pinned(Pinned::new(ctx)?)
        } else {
            HostCopies::Pageable { picks: Vec::new() }
        })
    }

    /// Enqueues the copy of `data` to device address `dst` on `stream`. The caller keeps `dst`
    /// alive until the stream has run the copy.
    pub fn upload(&mut self, dst: u64, data: &[i32], stream: &CudaStream) -> Result<()> {
        match self {
            HostCopies::Pinned(p) => p.upload(dst, data, stream),
            // SAFETY: `dst` holds `data.len()` i32s; the driver stages pageable memory before
            // the call returns.
            HostCopies::Pageable { .. } => {
                unsafe { dr::memcpy_htod_async(dst, data, stream.cu_stream()) }
                    .map_err(|e| dev_err("uploading batch indices", e))
            }
        }
    }

    /// Enqueues the copy of `len` words at device address `src` on `stream`;
    /// [`HostCopies::downloaded`] reads them once the stream has synchronized.
    pub fn download(&mut self, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
        match self {
            HostCopies::Pinned(p) => p.download(src, len, stream),
            HostCopies::Pageable { picks } => {
                picks.clear();
                picks.resize(len, 0);
                // The vector is read only after the stream synchronizes and is not resized
                // before.
                download_picks(picks, src, stream)
            }
        }
    }

    /// The first `len` words of the last download (after the stream has synchronized).
    pub fn downloaded(&mut self, len: usize) -> Result<&[u32]> {
        match self {
            HostCopies::Pinned(p) => p.downloaded(len),
            HostCopies::Pageable { picks } => picks
                .get(..len)
                .ok_or_else(|| Error::Device("fewer picked words downloaded than read".into())),
        }
    }
}

/// Page-locked host buffers for the per-pass index upload and picked-token download, grown to
/// the largest pass so far. From pageable memory the driver first copies into a staging buffer
/// of its own (and a download blocks the host until it is done); from these it copies by DMA.
pub(super) struct Pinned {
    ctx: Arc<CudaContext>,
    meta: Option<PinnedHostSlice<i32>>,
    picks: Option<PinnedHostSlice<u32>>,
    /// Recorded after each upload: the buffer is rewritten only once the copy out of it is done.
    uploaded: CudaEvent,
}

impl Pinned {
    /// Empty buffers (allocated on first use) in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Pinned> {
        let uploaded = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| dev_err("creating an upload event", e))?;
        Ok(Pinned {
            ctx: ctx.clone(),
            meta: None,
            picks: None,
            uploaded,
        })
    }

    /// Enqueues the copy of `data` to device address `dst` on `stream`, through the pinned
    /// buffer. The caller keeps `dst` alive until the stream has run the copy.
    pub fn upload(&mut self, dst: u64, data: &[i32], stream: &CudaStream) -> Result<()> {
        self.uploaded
            .synchronize()
            .map_err(|e| dev_err("waiting for the previous upload", e))?;
        // Write-combined: the host only writes it, and the device reads it faster.
        let buf = room(
            &self.ctx,
            &mut self.meta,
            data.len(),
            sys::CU_MEMHOSTALLOC_WRITECOMBINED,
        )?;
        buf.copy_from_slice(data);
        // SAFETY: `dst` holds `data.len()` i32s (the caller's buffer), and `buf` is page-locked
        // memory that is not written again before `uploaded` says the copy has run.
        unsafe { dr::memcpy_htod_async(dst, &*buf, stream.cu_stream()) }
            .map_err(|e| dev_err("uploading batch indices", e))?;
        self.uploaded
            .record(stream)
            .map_err(|e| dev_err("recording the upload event", e))
    }

    /// Enqueues the copy of `len` words at device address `src` into the pinned buffer on
    /// `stream`; [`Pinned::downloaded`] reads them once the stream has synchronized.
    pub fn download(&mut self, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
        // The buffer is read only after the stream synchronizes.
        download_picks(room(&self.ctx, &mut self.picks, len, 0)?, src, stream)
    }

    /// The first `len` words of the last download (after the stream has synchronized).
    pub fn downloaded(&mut self, len: usize) -> Result<&[u32]> {
        Ok(room(&self.ctx, &mut self.picks, len, 0)?)
    }
}

/// Where a step submitted ahead (`CudaBackend::submit`) lands on the host: a page-locked buffer
/// for its picked words, which its download fills without blocking the host, and the events that
/// time the step and say it has ended. Lent to one step at a time from the backend's pool.
pub(super) struct Landing {
    words: PinnedHostSlice<u32>,
    pub start: CudaEvent,
    pub end: CudaEvent,
}

impl Landing {
    /// A landing for up to `len` words in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Landing> {
        let mut slot = None;
        room(ctx, &mut slot, len, 0)?;
        let words =
            slot.ok_or_else(|| Error::Device("a page-locked buffer went missing".into()))?;
        Ok(Landing {
            words,
            start: timing_event(ctx)?,
            end: timing_event(ctx)?,
        })
    }

    /// Enqueues the copy of `len` words at device address `src` into the buffer on `stream`;
    /// record `end` after it, and read them with [`Landing::read`] once it has passed.
    pub fn download(&mut self, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
        let buf = self
            .words
            .as_mut_slice()
            .map_err(|e| dev_err("page-locked host memory", e))?;
        let buf = buf
            .get_mut(..len)
            .ok_or_else(|| Error::Device("a landing too small for its download".into()))?;
        // The buffer is read (or lent again, or freed) only after `end`, recorded after this
        // copy, has passed.
        download_picks(buf, src, stream)
    }

    /// Waits for `end`, then the first `len` words downloaded.
    pub fn read(&self, len: usize) -> Result<&[u32]> {
        self.end
            .synchronize()
            .map_err(|e| dev_err("waiting for a decode step", e))?;
        let words = self
            .words
            .as_slice()
            .map_err(|e| dev_err("page-locked host memory", e))?;
        words
            .get(..len)
            .ok_or_else(|| Error::Device("fewer picked words downloaded than read".into()))
    }
}

/// Enqueues the copy of `buf.len()` picked words at device address `src` into `buf` on
/// `stream`. The caller neither reads nor frees `buf` before the stream has run the copy.
fn download_picks(buf: &mut [u32], src: u64, stream: &CudaStream) -> Result<()> {
    // SAFETY: `src` holds at least `buf.len()` words (the pass's pick buffer); the caller keeps
    // `buf` alive and unread until the copy has run.
    unsafe { dr::memcpy_dtoh_async(buf, src, stream.cu_stream()) }
        .map_err(|e| dev_err("downloading picked tokens", e))
}

/// The first `len` elements of the buffer in `slot`, replaced first by a zeroed one (allocated
/// with `cuMemHostAlloc` `flags`) of the next power of two if it is shorter.
fn room<'a, T: DeviceRepr + ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    slot: &'a mut Option<PinnedHostSlice<T>>,
    len: usize,
    flags: u32,
) -> Result<&'a mut [T]> {
    let fits = |b: &PinnedHostSlice<T>| b.len() >= len;
    if !slot.as_ref().is_some_and(fits) {
        *slot = None;
        let cap = len.next_power_of_two().max(256);
        // SAFETY: the memory is zeroed right below, before any slice of it is made.
        let mut b = unsafe { ctx.alloc_pinned_with_flags::<T>(cap, flags) }
            .map_err(|e| dev_err("allocating page-locked host memory", e))?;
        let p = b
            .as_mut_ptr()
            .map_err(|e| dev_err("page-locked host memory", e))?;
        // SAFETY: `p` points at `cap` elements of T, for which all-zero bits are valid.
        unsafe { std::ptr::write_bytes(p, 0, cap) };
        *slot = Some(b);
    }
    let b = slot
        .as_mut()
        .ok_or_else(|| Error::Device("a page-locked buffer went missing".into()))?;
    let all = b
        .as_mut_slice()
        .map_err(|e| dev_err("page-locked host memory", e))?;
    Ok(&mut all[..len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_to_their_parts_and_splits_subtract_and_add() {
        let before = host_split();
        let mut laps = Laps::start();
        std::thread::sleep(Duration::from_millis(3));
        laps.lap(Part::Prepare);
        std::thread::sleep(Duration::from_millis(2));
        laps.lap(Part::Wait);
        laps.finish();
        // Other tests may run passes beside this one: each part grew by at least what this did.
        let d = host_split().since(&before);
        assert!(d.passes >= 1);
        assert!(d.prepare >= Duration::from_millis(3), "{d:?}");
        assert!(d.wait >= Duration::from_millis(2), "{d:?}");
        let twice = d + d;
        assert_eq!(twice.since(&d), d);
        assert_eq!(
            d.since(&twice),
            HostSplit::default(),
            "an earlier reading saturates at 0"
        );
    }
}
