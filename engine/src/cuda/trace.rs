//! The per-block kernel timeline (`TAPEDECK_TRACE=path`; `kernels/trace.cu`).
//!
//! A decode step's losses between kernels (launch gaps, what programmatic dependent launch
//! overlaps, one grid's tail against the next one's head) show only on a timeline, and the device
//! machine has no Nsight Systems. With the knob set, every kernel is compiled with `TD_TRACE=1`:
//! each block's thread 0 appends one event (start, PDL wait released, end, SM, block, grid) to a
//! buffer shared by every module, and [`Trace::write`] saves them as CSV for
//! `bench/cuda/trace_summary.py`. One atomic per block perturbs the timing slightly; the knob is
//! for diagnosis, never for the figures in docs/benchmarks.md.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaModule, CudaStream};

use super::memory::DevBuf;
use super::{dev_err, kernels};
use crate::error::{Error, Result};

/// Events the buffer holds (32 bytes each: 128 MiB; a llama-1b decode step launches ~60k
/// blocks, so about 65 steps: `bench engine`'s first request); later ones are counted and dropped.
const CAPACITY: usize = 4 << 20;

/// The event buffer and where to save it.
pub(crate) struct Trace {
    buf: DevBuf,
    path: PathBuf,
}

/// The kernel id `kernels/trace.cu` records: FNV-1a over the name (its `td_hash`).
fn kernel_id(name: &str) -> u32 {
    name.bytes().fold(2_166_136_261u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(16_777_619)
    })
}

impl Trace {
    /// An empty buffer on `ctx`'s GPU, to be saved at `path`.
    pub(crate) fn new(ctx: &Arc<CudaContext>, path: &Path) -> Result<Self> {
        let buf = DevBuf::new(ctx, 8 * (1 + 4 * CAPACITY))?;
        // SAFETY: the first word of a live allocation of at least 8 bytes.
        unsafe { dr::memset_d8_sync(buf.ptr, 0, 8) }
            .map_err(|e| dev_err("clearing the trace buffer", e))?;
        Ok(Trace {
            buf,
            path: path.to_path_buf(),
        })
    }

    /// Where the timeline is saved.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Points a module compiled with `TD_TRACE=1` at the buffer (its `td_events` and
    /// `td_capacity` globals).
    pub(crate) fn attach(&self, module: &Arc<CudaModule>, stream: &Arc<CudaStream>) -> Result<()> {
        for (name, value) in [
            ("td_events", self.buf.ptr),
            ("td_capacity", CAPACITY as u64),
        ] {
            let mut global = module
                .get_global(name, stream)
                .map_err(|e| dev_err(&format!("the trace global {name}"), e))?;
            stream
                .memcpy_htod(&value.to_le_bytes()[..], &mut global)
                .map_err(|e| dev_err(&format!("setting {name}"), e))?;
        }
        stream
            .synchronize()
            .map_err(|e| dev_err("attaching the trace", e))
    }

    /// Saves the events recorded so far as CSV (`kernel,sm,block,blocks,start_ns,waited_ns,end_ns`,
    /// times from the first event's start; `waited_ns` empty for a block that did not wait), in
    /// start order. Returns the events saved and those dropped for want of room.
    pub(crate) fn write(&self, stream: &Arc<CudaStream>) -> Result<(usize, u64)> {
        stream
            .synchronize()
            .map_err(|e| dev_err("finishing the traced work", e))?;
        let mut count = [0u64];
        // SAFETY: the buffer's first word.
        unsafe { dr::memcpy_dtoh_sync(&mut count, self.buf.ptr) }
            .map_err(|e| dev_err("reading the trace count", e))?;
        let n = (count[0] as usize).min(CAPACITY);
        let mut words = vec![0u64; 4 * n];
        if n > 0 {
            // SAFETY: n ≤ CAPACITY events of 4 words follow the count.
            unsafe { dr::memcpy_dtoh_sync(&mut words, self.buf.ptr + 8) }
                .map_err(|e| dev_err("reading the trace", e))?;
        }
        let names: HashMap<u32, &str> = kernels::ALL
            .iter()
            .flat_map(|s| s.entry_points.iter())
            .map(|&e| (kernel_id(e), e))
            .collect();
        let mut events: Vec<&[u64]> = words.chunks_exact(4).collect();
        events.sort_by_key(|e| e[0]);
        let base = events.first().map_or(0, |e| e[0]);
        let io = |e: std::io::Error| {
            Error::Device(format!("writing the trace {}: {e}", self.path.display()))
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(&self.path).map_err(io)?);
        writeln!(out, "kernel,sm,block,blocks,start_ns,waited_ns,end_ns").map_err(io)?;
        for e in &events {
            let start = e[0] - base;
            let (took, waited) = (e[1] >> 32, e[1] & 0xffff_ffff);
            let id = (e[2] >> 32) as u32;
            let name = names
                .get(&id)
                .map_or_else(|| format!("{id:#x}"), |n| n.to_string());
            let waited = if waited == 0xffff_ffff {
                String::new()
            } else {
                (start + waited).to_string()
            };
            writeln!(
                out,
                "{name},{},{},{},{start},{waited},{}",
                e[2] & 0xffff_ffff,
                e[3] >> 32,
                e[3] & 0xffff_ffff,
                start + took
            )
            .map_err(io)?;
        }
        out.flush().map_err(io)?;
        Ok((n, count[0].saturating_sub(n as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_ids_match_the_device_hash_and_do_not_collide() {
        // FNV-1a 32 of "a" is 0xe40c292c (the published test vector); trace.cu's td_hash is the
        // same loop.
        assert_eq!(kernel_id("a"), 0xe40c_292c);
        let mut seen = HashMap::new();
        for e in kernels::ALL.iter().flat_map(|s| s.entry_points.iter()) {
            if let Some(other) = seen.insert(kernel_id(e), e) {
                assert_eq!(other, e, "{other} and {e} share an id");
            }
        }
    }
}
