//! The CUDA backend: the Llama forward pass on an NVIDIA GPU through `cudarc`.
//!
//! The driver, NVRTC and cuBLAS are loaded at run time, so this module builds everywhere and a
//! machine without them gets a clear [`Error::Device`] from [`CudaBackend::new`] (probed first:
//! cudarc itself panics when a library is missing). Linear layers run on cuBLAS (`matmul=f32`:
//! f32 inputs with the pedantic f32 compute type, so no TF32; `matmul=bf16`: bf16 inputs on the
//! tensor cores with f32 accumulation). Everything else runs in our kernels from `kernels/`,
//! compiled by NVRTC for the GPU's own compute capability ([`kernels`]).
//!
//! The KV pool has the CPU pool's layout and holds f32 values that are exactly what the
//! `kv_dtype` toggle's storage type would hold, so the toggles mean the same on both backends and
//! a replay can compare them position by position. The forward pass mirrors
//! [`Model::forward`](crate::model::Model::forward) step for step; only summation order differs
//! (cuBLAS chooses its own), so f32 results agree with the CPU to about 1e-6 relative per layer.
//!
//! Where things are: [`CudaBackend`] (this file) owns the GPU and runs passes under a lock;
//! `pass` builds, launches, captures and collects one pass; `linears` holds the weights and the
//! GEMM/GEMV launches; `memory` the device buffers (KV pool, scratch); `launch` the loaded kernels
//! and the argument packing; `meta` the per-pass index layout; `step` the persistent decode-step
//! kernel; `host` the host's copies and time split; `tune` the tuning knobs; `trace` the per-block
//! kernel timeline; [`kernels`] the NVRTC compile and cache; [`check`] the GPU self-checks and
//! micro-benchmarks.

pub mod check;
mod host;
pub mod kernels;
mod launch;
mod linears;
mod memory;
mod meta;
mod pass;
mod step;
mod trace;
mod tune;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::backend::{submit_now, Backend, Device, Feed, Ticket, TicketState};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::{KvPool, Logits, Model, Segment, WantLogits};
use crate::models::llama::batch_positions;
use crate::toggles::{KvDtype, Precision, Toggles};
pub use host::{host_split, HostSplit};
use host::{HostCopies, Landing, Laps, Part};
use launch::Kernels;
use linears::{DevLayer, DevLinear};
pub use memory::DeviceKv;
use memory::{DevBuf, KvElem, Scratch, ScratchBufs};
use meta::{device_pick, parse_pick, pick_words, Pad, FED_TOKEN, PICK_MAX_K};

fn dev_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// Why CUDA cannot be used here, or `Ok` with the number of GPUs. Never panics.
pub fn probe() -> Result<usize> {
    // SAFETY: these only try to open the shared libraries.
    let (driver, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(Error::Device(
            "no CUDA driver (libcuda.so) on this machine; run with --device cpu".into(),
        ));
    }
    if !kernels::nvrtc_present() {
        return Err(Error::Device(
            "the NVRTC library (libnvrtc.so.13) was not found; add the CUDA toolkit's lib64 \
             folder to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    if !blas {
        return Err(Error::Device(
            "the cuBLAS library (libcublas.so.13) was not found; add the CUDA toolkit's lib64 \
             folder to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let n = CudaContext::device_count().map_err(|e| dev_err("counting GPUs", e))?;
    if n <= 0 {
        return Err(Error::Device("the CUDA driver sees no GPU".into()));
    }
    Ok(n as usize)
}

/// Most rows a decode graph takes; larger decode batches run eagerly.
const GRAPH_MAX_ROWS: usize = 512;
/// Graphs kept before the cache is emptied (each holds a few hundred nodes).
const GRAPH_CACHE: usize = 128;
/// cuBLAS workspace, set explicitly so that captured GEMMs never allocate.
const BLAS_WORKSPACE: usize = 32 << 20;

/// What a captured graph baked in: the padded shape, every toggle (they choose kernels and
/// their arguments), the pick width, the KV pool's buffers and the scratch buffers' generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct GraphKey {
    pad: Pad,
    toggles: Toggles,
    pick_k: usize,
    kv: u64,
    generation: u64,
}

/// Decode steps run as the persistent kernel (`megakernel=on`) in this process, over all GPUs: so
/// a test or a benchmark can tell that the toggle took effect rather than falling back to the
/// separate kernels.
static PERSISTENT_STEPS: AtomicU64 = AtomicU64::new(0);

/// How many decode steps ran as the persistent kernel so far (see [`Toggles::megakernel`]).
pub fn persistent_steps() -> u64 {
    PERSISTENT_STEPS.load(Ordering::Relaxed)
}

/// Launches of the mma decode kernel whose splits merged in their thread block cluster
/// (`TAPEDECK_MMA_MERGE=cluster`) in this process: so a test can tell the path ran.
static CLUSTER_MERGES: AtomicU64 = AtomicU64::new(0);

/// How many mma decode launches so far merged their splits in clusters (a graph replay launches
/// nothing, so this counts captures and eager passes).
pub fn cluster_merges() -> u64 {
    CLUSTER_MERGES.load(Ordering::Relaxed)
}

/// Layers recorded with RoPE + KV write fused into the q/k/v GEMV, and with the split merge fused
/// into the o GEMV (`fuse=on`), in this process: so a test can tell that each fusion took effect.
static FUSED_ROPE: AtomicU64 = AtomicU64::new(0);
static FUSED_MERGE: AtomicU64 = AtomicU64::new(0);
/// Layers recorded with the MLP as one dataflow grid (`fuse=on` with `TAPEDECK_FUSE=...,mlp`).
static FUSED_MLP: AtomicU64 = AtomicU64::new(0);

/// How many layers were recorded so far with the fused q/k/v + RoPE kernel and with the fused
/// split merge (see [`Toggles::fuse`]); a graph replay records nothing, so counts only captures
/// and eager passes.
pub fn fused_layers() -> (u64, u64) {
    (
        FUSED_ROPE.load(Ordering::Relaxed),
        FUSED_MERGE.load(Ordering::Relaxed),
    )
}

/// How many layers were recorded so far with gate/up and down as one dataflow grid (the MLP
/// fusion), counted like [`fused_layers`].
pub fn fused_mlp_layers() -> u64 {
    FUSED_MLP.load(Ordering::Relaxed)
}

/// Whether `fuse=on` runs the MLP as one dataflow grid in this process (`TAPEDECK_FUSE` names
/// `mlp`), where the shape allows (1-2 rows on the GEMV path).
pub fn mlp_fusion_in_effect() -> bool {
    tune::get().fuse.mlp
}

/// Which fusions `fuse=on` applies in this process (RoPE, split merge, head norm), as
/// `TAPEDECK_FUSE` or its default says: tests check what they expect fused against it.
pub fn fusions_in_effect() -> (bool, bool, bool) {
    let f = tune::get().fuse;
    (f.rope, f.merge, f.head)
}

/// A hash of the KV pool's buffer addresses: what graphs and the decode-step kernel's layer
/// table baked in.
fn kv_key(kv: &DeviceKv) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in kv.addresses() {
        p.hash(&mut h);
    }
    h.finish()
}

/// A captured decode step.
struct Graph(cudarc::driver::CudaGraph);

// SAFETY: a graph is only launched or dropped under the backend's lock, so its handles are never
// used from two threads at once (the CUDA requirement on graph objects).
unsafe impl Send for Graph {}

/// The shape a graph pass pads this batch to, or `None` when the pass runs eagerly: graphs take
/// decode steps only (one token per sequence, logits wanted), with `cuda_graphs=on`.
fn graph_pad(segs: &[Segment<'_>], toggles: &Toggles) -> Option<Pad> {
    let decode_only = segs.iter().all(|s| {
        s.decode && s.tokens.len() == 1 && matches!(s.want, WantLogits::Last | WantLogits::Pick(_))
    });
    if !toggles.cuda_graphs || !decode_only || segs.is_empty() || segs.len() > GRAPH_MAX_ROWS {
        return None;
    }
    let longest = segs.iter().map(|s| s.table.blocks.len()).max().unwrap_or(1);
    Some(Pad {
        rows: segs.len().next_power_of_two(),
        max_blocks: longest.max(1).next_power_of_two(),
    })
}

/// What every launch needs, apart from the model: our own stream, cuBLAS on it with an explicit
/// workspace, and the compiled kernels. Kept apart from the weights so that single kernels can
/// run on their own ([`check`]).
struct Gpu {
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    k: Kernels,
    /// Multiprocessors (for the split-K rule).
    sms: usize,
    /// Programmatic dependent launch and thread block clusters exist (compute capability 9.0
    /// and later).
    pdl_capable: bool,
    /// Blocks per SM of the streaming one-row GEMV kernels, 0 for the default kernels
    /// (`TAPEDECK_GEMV_STREAM`; [`check`] sets it to run both).
    gemv_stream: AtomicUsize,
    /// The virtual architecture the kernels are compiled for (`compute_XY`).
    arch: String,
    /// The cuBLAS workspace (kept alive for the handle).
    _workspace: DevBuf,
    /// The kernel timeline, when `TAPEDECK_TRACE` asks for one.
    trace: Option<trace::Trace>,
}

/// The virtual architecture to compile kernels for (`compute_XY`), the multiprocessor count and
/// the compute capability of `ctx`'s GPU.
fn arch_and_sms(ctx: &Arc<CudaContext>) -> Result<(String, usize, (i32, i32))> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| dev_err("compute capability", e))?;
    let sms = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| dev_err("multiprocessor count", e))? as usize;
    Ok((kernels::virtual_arch(major, minor), sms, (major, minor)))
}

impl Gpu {
    /// A stream, a cuBLAS handle and the kernels compiled for this context's GPU (the prefill
    /// kernel for `head_dim`). Returns the GPU's name and compute capability too.
    fn new(ctx: &Arc<CudaContext>, head_dim: usize) -> Result<(Self, String, (i32, i32))> {
        let (arch, sms, (major, minor)) = arch_and_sms(ctx)?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx
            .new_stream()
            .map_err(|e| dev_err("creating a CUDA stream", e))?;
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| dev_err("creating a cuBLAS handle", e))?;
        let workspace = DevBuf::new(ctx, BLAS_WORKSPACE)?;
        // SAFETY: the handle is live and the workspace outlives it (both live in `Gpu`).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.ptr as *mut c_void,
                BLAS_WORKSPACE,
            )
        }
        .result()
        .map_err(|e| dev_err("setting the cuBLAS workspace", e))?;
        let trace = match &tune::get().trace {
            Some(path) => Some(trace::Trace::new(ctx, path)?),
            None => None,
        };
        let k = Kernels::load(ctx, &arch, head_dim, trace.as_ref().map(|t| (t, &stream)))?;
        let gpu = Gpu {
            trace,
            stream,
            blas,
            k,
            sms,
            pdl_capable: major >= 9,
            gemv_stream: AtomicUsize::new(tune::get().gemv_stream),
            arch,
            _workspace: workspace,
        };
        Ok((gpu, name, (major, minor)))
    }
}

struct Inner {
    gpu: Gpu,
    embed: DevBuf,
    /// The output head (`lm_head`, or the tied embedding).
    head: DevLinear,
    norm: DevBuf,
    layers: Vec<DevLayer>,
    inv_freq: DevBuf,
    scratch: Scratch,
    /// Every linear layer's input width is a multiple of 8 (the GEMV kernels' 16-byte loads).
    gemv_fits: bool,
    /// Captured decode steps, and the scratch generation they were captured at.
    graphs: std::collections::HashMap<GraphKey, Graph>,
    /// Events around each pass (see [`CudaBackend::busy_ns`]).
    timing: (CudaEvent, CudaEvent),
    /// The persistent decode-step kernel, compiled on first use (`megakernel=on`).
    mega: Option<step::Megakernel>,
    /// The host side of the per-pass copies (page-locked with `TAPEDECK_HOST_COPIES=pinned`).
    copies: HostCopies,
    /// Passes enqueued so far: a step fed on the device must directly follow the step that
    /// picks its token, whose pick it reads from the shared pick buffer.
    serial: u64,
}

/// An event that records a time stamp (for [`Backend::device_time`]).
fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| dev_err("creating a timing event", e))
}

/// Records a timing event on `stream`.
fn mark(event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    event
        .record(stream)
        .map_err(|e| dev_err("recording a timing event", e))
}

/// The engine on one NVIDIA GPU.
pub struct CudaBackend {
    cfg: Config,
    context_len: usize,
    ordinal: usize,
    describe: String,
    ctx: Arc<CudaContext>,
    inner: Mutex<Inner>,
    /// Device time of all passes so far, in nanoseconds, and their count: atomics, so `/metrics`
    /// reads them without waiting for the pass that holds `inner`.
    busy_ns: AtomicU64,
    passes: AtomicU64,
    /// Landings of steps submitted ahead, free to lend (see [`InFlight`]).
    landings: Mutex<Vec<Landing>>,
}

/// A decode step [`CudaBackend::submit`] enqueued: where its picked words land, and what the
/// step after it needs to read its token on the device.
pub(crate) struct InFlight {
    /// `None` once collected or discarded (then back in the backend's pool).
    landing: Option<Landing>,
    /// Words downloaded, and the summary size to parse them with.
    words: usize,
    k: usize,
    /// The backend's pass count with this step enqueued, and the device buffer its pick went
    /// to: the next step reads the token there if no pass came between.
    serial: u64,
    pick_out: u64,
}

impl Drop for InFlight {
    /// A step dropped unread (an error on the way) may still be downloading into its landing:
    /// wait for it before the page-locked memory is freed.
    fn drop(&mut self) {
        if let Some(l) = &self.landing {
            let _ = l.end.synchronize();
        }
    }
}

impl CudaBackend {
    /// Uploads a loaded model to GPU `ordinal` and compiles the kernels for it.
    pub fn new(model: &Model, ordinal: usize) -> Result<Self> {
        let count = probe()?;
        if ordinal >= count {
            return Err(Error::Device(format!(
                "GPU {ordinal} asked for, but the driver sees {count} (cuda:0..cuda:{})",
                count - 1
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating a CUDA context", e))?;
        // One stream, used in order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any allocation through cudarc.
        unsafe { ctx.disable_event_tracking() };
        let cfg = model.config().clone();
        let (gpu, name, (major, minor)) = Gpu::new(&ctx, cfg.head_dim)?;
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(2) {
            return Err(Error::Device(format!(
                "head_dim {} is not supported by the CUDA kernels (even, at most 256)",
                cfg.head_dim
            )));
        }
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DevLayer {
                attn_norm: DevBuf::from_slice(&ctx, &l.attn_norm)?,
                q: DevLinear::upload(&ctx, &l.q)?,
                k: DevLinear::upload(&ctx, &l.k)?,
                v: DevLinear::upload(&ctx, &l.v)?,
                o: DevLinear::upload(&ctx, &l.o)?,
                mlp_norm: DevBuf::from_slice(&ctx, &l.mlp_norm)?,
                gate: DevLinear::upload(&ctx, &l.gate)?,
                up: DevLinear::upload(&ctx, &l.up)?,
                down: DevLinear::upload(&ctx, &l.down)?,
            });
        }
        let inner = Inner {
            embed: DevBuf::from_slice(&ctx, &model.embed)?,
            head: DevLinear::upload(&ctx, model.head()?)?,
            norm: DevBuf::from_slice(&ctx, &model.norm)?,
            inv_freq: DevBuf::from_slice(&ctx, &model.inv_freq)?,
            layers,
            gpu,
            scratch: Scratch::default(),
            graphs: Default::default(),
            timing: (timing_event(&ctx)?, timing_event(&ctx)?),
            mega: None,
            copies: HostCopies::new(&ctx, tune::get().pinned)?,
            serial: 0,
            gemv_fits: [
                cfg.hidden_size,
                cfg.num_heads * cfg.head_dim,
                cfg.intermediate_size,
            ]
            .iter()
            .all(|d| d.is_multiple_of(8)),
        };
        Ok(CudaBackend {
            describe: format!("cuda:{ordinal} {name} (sm_{major}{minor})"),
            context_len: model.context_len(),
            cfg,
            ordinal,
            ctx,
            inner: Mutex::new(inner),
            busy_ns: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            landings: Mutex::new(Vec::new()),
        })
    }
}

impl CudaBackend {
    /// A landing from the pool (once the step it last served has passed), or a new one; every
    /// landing holds the largest pick there is.
    fn landing(&self) -> Result<Landing> {
        let lent = self
            .landings
            .lock()
            .map_err(|_| Error::Device("the CUDA backend's landing pool was poisoned".into()))?
            .pop();
        match lent {
            Some(l) => {
                l.end
                    .synchronize()
                    .map_err(|e| dev_err("waiting for a discarded decode step", e))?;
                Ok(l)
            }
            None => Landing::new(&self.ctx, pick_words(PICK_MAX_K)),
        }
    }

    /// Counts a finished pass and its device time, between its `start` and `end` events (see
    /// [`Backend::device_time`]).
    fn count_pass(&self, start: &CudaEvent, end: &CudaEvent) -> Result<()> {
        let ms = start
            .elapsed_ms(end)
            .map_err(|e| dev_err("reading a timing event", e))?;
        self.busy_ns
            .fetch_add((f64::from(ms.max(0.0)) * 1e6) as u64, Ordering::Relaxed);
        self.passes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Returns a landing to the pool.
    fn give_back(&self, landing: Landing) {
        if let Ok(mut pool) = self.landings.lock() {
            pool.push(landing);
        }
    }
}

/// The split-K rule of the mma decode kernel (docs/cuda_decode_attention.md, measured on the
/// H200): with fewer (KV head, sequence) pairs than resident blocks, about two blocks per
/// multiprocessor of long splits; with more, a few splits each; no split shorter than `split_min`
/// (`TAPEDECK_MMA_SPLIT_MIN`, cuda/tune.rs). Returns `(split_len, max_splits)`.
fn split_rule(
    rows: usize,
    kv_heads: usize,
    max_len: usize,
    sms: usize,
    split_min: usize,
) -> (usize, usize) {
    // Resident blocks of the kernel (3 per SM at 64 KiB of shared memory and 128 threads).
    let slots = 3 * sms;
    let base = (rows * kv_heads).max(1);
    let splits = if base >= slots {
        (5 * slots).div_ceil(base)
    } else {
        (2 * sms / base).max(1)
    };
    let split_len = (max_len.div_ceil(splits).div_ceil(64) * 64).max(split_min);
    (split_len, max_len.div_ceil(split_len).max(1))
}

impl Inner {
    /// Uploads a prepared pass's indices and launches it (its graph, capturing it first, where
    /// `pad` gives the graph's shape).
    fn launch_pass(
        &mut self,
        cfg: &Config,
        kv: &DeviceKv,
        pass: &pass::Pass,
        pad: Option<Pad>,
        toggles: &Toggles,
    ) -> Result<()> {
        // The meta buffer holds at least `meta.data.len()` i32s (`prepare` sized it).
        self.copies
            .upload(pass.meta_ptr, &pass.meta.data, &self.gpu.stream)?;
        match pad {
            None => self.record(cfg, kv, pass)?,
            Some(pad) => self.replay(cfg, kv, pass, pad, toggles)?,
        }
        if pass.mega.is_some() {
            PERSISTENT_STEPS.fetch_add(1, Ordering::Relaxed);
        }
        self.serial += 1;
        Ok(())
    }

    fn ensure_scratch(&mut self, ctx: &Arc<CudaContext>, cfg: &Config, n: usize) -> Result<()> {
        if self.scratch.bufs.is_some() && self.scratch.tokens >= n {
            return Ok(());
        }
        let n = n.next_power_of_two();
        let (h, q_dim, kv_dim, inter) = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        );
        let f = |elems: usize| DevBuf::new(ctx, n * elems * 4);
        self.scratch.bufs = None;
        self.scratch.bufs = Some(ScratchBufs {
            x: f(h)?,
            xn: f(h)?,
            q: f(q_dim)?,
            k: f(kv_dim)?,
            v: f(kv_dim)?,
            att: f(q_dim)?,
            tmp: f(h)?,
            g: f(inter)?,
            u: f(inter)?,
            xb: DevBuf::new(ctx, n * h.max(q_dim).max(inter) * 2)?,
            act: DevBuf::new(ctx, n * inter * 2)?,
        });
        self.scratch.tokens = n;
        self.scratch.generation += 1;
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn config(&self) -> &Config {
        &self.cfg
    }

    /// The pool stores `dtype` in its own size: bf16 bits, or FP8 codes and a scale per position
    /// and KV head (f32 for every dtype under `TAPEDECK_KV_STORAGE=f32`).
    fn new_pool(&self, block_size: usize, num_blocks: usize, dtype: KvDtype) -> Result<KvPool> {
        let per_layer = num_blocks * block_size * self.cfg.num_kv_heads * self.cfg.head_dim;
        let elem = if tune::get().kv_f32 {
            KvElem::F32
        } else {
            KvElem::for_dtype(dtype)
        };
        let kv = DeviceKv::new(
            &self.ctx,
            self.cfg.num_layers,
            per_layer,
            self.cfg.head_dim,
            elem,
        )?;
        Ok(KvPool::on_device(&self.cfg, block_size, num_blocks, kv))
    }

    fn threads(&self) -> usize {
        1
    }

    fn forward(
        &self,
        pool: &mut KvPool,
        segs: &mut [Segment<'_>],
        toggles: &Toggles,
    ) -> Result<Vec<Logits>> {
        let mut laps = Laps::start();
        let cfg = &self.cfg;
        let bs = pool.block_size();
        let where_ = batch_positions(cfg, self.context_len, bs, segs)?;
        if where_.is_empty() {
            return Ok(segs.iter().map(|_| Logits::Rows(Vec::new())).collect());
        }
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| Error::Device("the CUDA backend's lock was poisoned".into()))?;
        let inner = &mut *inner;
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let kv = pool.device_mut()?;
        let pad = graph_pad(segs, toggles);
        let pass = inner.prepare(&self.ctx, cfg, segs, &where_, bs, toggles, pad, kv)?;
        laps.lap(Part::Prepare);
        mark(&inner.timing.0, &inner.gpu.stream)?;
        inner.launch_pass(cfg, kv, &pass, pad, toggles)?;
        mark(&inner.timing.1, &inner.gpu.stream)?;
        for sg in segs.iter_mut() {
            sg.table.len += sg.tokens.len();
        }
        laps.lap(Part::Launch);
        let out = inner.collect(segs, &pass, cfg.vocab_size, &mut laps)?;
        // Both events have completed: collect waited for the stream.
        self.count_pass(&inner.timing.0, &inner.timing.1)?;
        laps.finish();
        Ok(out)
    }

    fn device_time(&self) -> Option<(std::time::Duration, u64)> {
        let ns = self.busy_ns.load(Ordering::Relaxed);
        let passes = self.passes.load(Ordering::Relaxed);
        Some((std::time::Duration::from_nanos(ns), passes))
    }

    fn save_trace(&self) -> Result<Option<String>> {
        let inner = self
            .inner
            .lock()
            .map_err(|_| Error::Device("the CUDA backend's lock was poisoned".into()))?;
        let Some(t) = &inner.gpu.trace else {
            return Ok(None);
        };
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let (saved, dropped) = t.write(&inner.gpu.stream)?;
        Ok(Some(format!(
            "{saved} kernel blocks traced to {} ({dropped} dropped for want of room)",
            t.path().display()
        )))
    }

    fn runs_ahead(&self) -> bool {
        tune::get().run_ahead
    }

    /// Enqueues the step and returns: its pick is downloaded into a page-locked landing, and a
    /// step fed from it (`Feed::Picked`) reads the token on the device (`embed_tokens`) when
    /// no other pass came between. Steps that do not pick on the device run now.
    fn submit(
        &self,
        pool: &mut KvPool,
        seg: Segment<'_>,
        feed: Feed<'_>,
        toggles: &Toggles,
    ) -> Result<Ticket> {
        let k = match device_pick(seg.want, self.cfg.vocab_size) {
            Some(p) if seg.tokens.len() == 1 => p.k,
            _ => return submit_now(self, pool, seg, feed, toggles),
        };
        let mut laps = Laps::start();
        // A fed token is written into the pass's indices below, once the pass is prepared.
        let tokens = [match feed {
            Feed::Token(t) => t,
            Feed::Picked(_) => 0,
        }];
        let mut segs = [Segment {
            tokens: &tokens,
            ..seg
        }];
        let cfg = &self.cfg;
        let bs = pool.block_size();
        let where_ = batch_positions(cfg, self.context_len, bs, &segs)?;
        let mut landing = self.landing()?;
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| Error::Device("the CUDA backend's lock was poisoned".into()))?;
        let inner = &mut *inner;
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let kv = pool.device_mut()?;
        let pad = graph_pad(&segs, toggles);
        let mut pass = inner.prepare(&self.ctx, cfg, &segs, &where_, bs, toggles, pad, kv)?;
        let pick_out = match pass.pick {
            Some((_, _, out, _)) if pass.meta.n_picks == 1 => out,
            _ => return Err(Error::Device("a submitted step makes no pick".into())),
        };
        if let Feed::Picked(t) = feed {
            let on_device = matches!(&t.0, TicketState::Cuda(f)
                if f.serial == inner.serial && f.pick_out == pick_out);
            let id = if on_device {
                FED_TOKEN
            } else {
                // Another pass came between (or the step was collected already): its token on
                // the host, the same result without the overlap.
                Feed::Picked(t).token(self)?
            };
            pass.meta.data[pass.meta.ids] = id as i32;
        }
        laps.lap(Part::Prepare);
        mark(&landing.start, &inner.gpu.stream)?;
        inner.launch_pass(cfg, kv, &pass, pad, toggles)?;
        let words = pick_words(pass.meta.pick_k);
        landing.download(pick_out, words, &inner.gpu.stream)?;
        mark(&landing.end, &inner.gpu.stream)?;
        for sg in segs.iter_mut() {
            sg.table.len += sg.tokens.len();
        }
        laps.lap(Part::Launch);
        Ok(Ticket(TicketState::Cuda(InFlight {
            landing: Some(landing),
            words,
            k,
            serial: inner.serial,
            pick_out,
        })))
    }

    fn collect(&self, ticket: Ticket) -> Result<Logits> {
        let mut f = match ticket.0 {
            TicketState::Done(l) => return Ok(l),
            TicketState::Cuda(f) => f,
        };
        let landing = f
            .landing
            .take()
            .ok_or_else(|| Error::Device("a decode step was collected twice".into()))?;
        let mut laps = Laps::start();
        let read = landing.read(f.words).map(|w| parse_pick(w, f.k));
        laps.lap(Part::Wait);
        let counted = self.count_pass(&landing.start, &landing.end);
        self.give_back(landing);
        let logits = read?;
        counted?;
        laps.finish();
        Ok(logits)
    }

    /// The step runs on; its landing goes back to the pool, to be lent again once the step
    /// has passed.
    fn discard(&self, ticket: Ticket) {
        if let TicketState::Cuda(mut f) = ticket.0 {
            if let Some(l) = f.landing.take() {
                self.give_back(l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rule_covers_every_context_and_fills_the_gpu() {
        for floor in [64, 128, 256] {
            for rows in [1, 3, 8, 64, 200] {
                for max_len in [1, 17, 256, 1000, 4096, 32768, 131072] {
                    let (len, splits) = split_rule(rows, 8, max_len, 132, floor);
                    assert!(len >= floor && len % 64 == 0, "{rows} {max_len}: {len}");
                    assert!(max_len.div_ceil(len) <= splits, "{rows} {max_len}");
                    assert!(
                        splits == 1 || (splits - 1) * len < max_len,
                        "no empty split"
                    );
                }
            }
        }
        // Batch 1 at 32k: long contexts are spread over about two blocks per multiprocessor.
        let (_, splits) = split_rule(1, 8, 32768, 132, 256);
        assert!(splits * 8 >= 132, "{splits} splits leave the GPU idle");
    }
}
