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

pub mod kernels;

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use crate::backend::{Backend, Device};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::generate::LogitsSummary;
use crate::model::{KvPool, Logits, Model, Pick, Segment, WantLogits};
use crate::models::llama::{batch_positions, chunk_boundary_hidden, Linear};
use crate::numerics::round_bf16;
use crate::toggles::{AttnDecode, KvDtype, Precision, Toggles};

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

/// A device allocation owned by Rust: freed on drop. Raw device pointers keep kernel arguments
/// and cuBLAS calls simple; the context is kept alive by the `Arc`.
struct DevBuf {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({} bytes)", self.bytes)
    }
}

impl DevBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: a plain device allocation; freed in Drop.
            unsafe { dr::malloc_sync(bytes) }
                .map_err(|e| dev_err(&format!("allocating {bytes} bytes of GPU memory"), e))?
        };
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// A buffer holding `data`.
    fn from_slice<T: Copy>(ctx: &Arc<CudaContext>, data: &[T]) -> Result<Self> {
        let b = DevBuf::new(ctx, std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: the destination holds exactly `data`'s bytes.
            unsafe { dr::memcpy_htod_sync(b.ptr, data) }.map_err(|e| dev_err("upload", e))?;
        }
        Ok(b)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in `new`, freed once.
            let _ = unsafe { dr::free_sync(self.ptr) };
        }
    }
}

// SAFETY: a device pointer is an integer; CUDA allows use from any thread of the process.
unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

/// The KV pool's device storage: per layer, keys and values `(num_blocks, block_size, kv_heads,
/// head_dim)` in f32.
#[derive(Debug)]
pub struct DeviceKv {
    k: Vec<DevBuf>,
    v: Vec<DevBuf>,
    /// f32 elements per layer in use.
    per_layer: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceKv {
    fn new(ctx: &Arc<CudaContext>, layers: usize, per_layer: usize) -> Result<Self> {
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(DevBuf::new(ctx, per_layer * 4)?);
            v.push(DevBuf::new(ctx, per_layer * 4)?);
        }
        Ok(DeviceKv {
            k,
            v,
            per_layer,
            ctx: ctx.clone(),
        })
    }

    /// Layers held.
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// Grows every layer to `per_layer` f32 elements, keeping what is stored (capacity doubles, so
    /// a sequence growing one block at a time copies O(n) in total).
    pub(crate) fn grow(&mut self, per_layer: usize) -> Result<()> {
        if per_layer <= self.per_layer {
            return Ok(());
        }
        if per_layer * 4 > self.k.first().map_or(0, |b| b.bytes) {
            let cap = (per_layer * 4).max(2 * self.k.first().map_or(0, |b| b.bytes));
            for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
                let new = DevBuf::new(&self.ctx, cap)?;
                if self.per_layer > 0 {
                    // SAFETY: both buffers are at least `per_layer * 4` bytes.
                    unsafe { dr::memcpy_dtod_sync(new.ptr, buf.ptr, self.per_layer * 4) }
                        .map_err(|e| dev_err("growing the KV cache", e))?;
                }
                *buf = new;
            }
        }
        self.per_layer = per_layer;
        Ok(())
    }
}

/// A linear layer on the device: f32 weights for `matmul=f32`, bf16 bits for `matmul=bf16`.
struct DevLinear {
    /// (out, in) f32
    w: DevBuf,
    /// (out, in) bf16
    w_bf16: DevBuf,
    /// (out) f32
    b: Option<DevBuf>,
    out: usize,
    inp: usize,
}

impl DevLinear {
    fn upload(ctx: &Arc<CudaContext>, l: &Linear) -> Result<Self> {
        let bits: Vec<u16> =
            l.w.iter()
                .map(|&x| (round_bf16(x).to_bits() >> 16) as u16)
                .collect();
        Ok(DevLinear {
            w: DevBuf::from_slice(ctx, &l.w)?,
            w_bf16: DevBuf::from_slice(ctx, &bits)?,
            b: l.b
                .as_ref()
                .map(|b| DevBuf::from_slice(ctx, b))
                .transpose()?,
            out: l.out,
            inp: l.inp,
        })
    }
}

struct DevLayer {
    attn_norm: DevBuf,
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    mlp_norm: DevBuf,
    gate: DevLinear,
    up: DevLinear,
    down: DevLinear,
}

/// Loaded kernel entry points.
struct Kernels {
    embed_gather: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    scatter_rows: CudaFunction,
    add_inplace: CudaFunction,
    add_bias: CudaFunction,
    f32_to_bf16: CudaFunction,
    kv_write: CudaFunction,
    attention: CudaFunction,
    attention_scores: CudaFunction,
    topk_mask: CudaFunction,
    decode_mma: CudaFunction,
    decode_combine: CudaFunction,
    pick_partial: CudaFunction,
    pick_finish: CudaFunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Self> {
        let ptx = kernels::ptx(&kernels::ENGINE, arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| dev_err("loading kernels/engine.cu", e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| dev_err(&format!("kernel {name}"), e))
        };
        let mma = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(kernels::ptx(
                &kernels::DECODE_MMA,
                arch,
            )?))
            .map_err(|e| dev_err("loading kernels/decode_attention_mma.cu", e))?;
        let decode_mma = mma
            .load_function("decode_attn_mma_f32kv")
            .map_err(|e| dev_err("kernel decode_attn_mma_f32kv", e))?;
        // SAFETY: a valid function handle; the value is within the device's opt-in limit.
        unsafe {
            cudarc::driver::sys::cuFuncSetAttribute(
                decode_mma.cu_function(),
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernels::DECODE_MMA_SMEM as i32,
            )
        }
        .result()
        .map_err(|e| dev_err("raising the mma kernel's shared-memory limit", e))?;
        Ok(Kernels {
            decode_mma,
            decode_combine: mma
                .load_function("decode_attn_combine")
                .map_err(|e| dev_err("kernel decode_attn_combine", e))?,
            embed_gather: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            silu_mul: f("silu_mul")?,
            scatter_rows: f("scatter_rows")?,
            add_inplace: f("add_inplace")?,
            add_bias: f("add_bias")?,
            f32_to_bf16: f("f32_to_bf16")?,
            kv_write: f("kv_write")?,
            attention: f("attention")?,
            attention_scores: f("attention_scores")?,
            topk_mask: f("topk_mask")?,
            pick_partial: f("pick_partial")?,
            pick_finish: f("pick_finish")?,
        })
    }
}

/// Kernel arguments, each in its own 8-byte slot (CUDA reads 4-byte values from the slot's start
/// on this little-endian host), so the parameter pointers stay valid for the launch.
struct Args {
    slots: [u64; 24],
    n: usize,
}

impl Args {
    fn new() -> Self {
        Args {
            slots: [0; 24],
            n: 0,
        }
    }

    fn push(mut self, v: u64) -> Self {
        self.slots[self.n] = v;
        self.n += 1;
        self
    }

    /// A device pointer.
    fn p(self, ptr: u64) -> Self {
        self.push(ptr)
    }

    fn i(self, v: usize) -> Self {
        self.push(v as i32 as u32 as u64)
    }

    fn f(self, v: f32) -> Self {
        self.push(v.to_bits() as u64)
    }

    fn launch(
        self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize),
        block: usize,
    ) -> Result<()> {
        self.launch_3d(stream, func, (grid.0, grid.1, 1), block, 0)
    }

    fn launch_3d(
        mut self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        shared_bytes: usize,
    ) -> Result<()> {
        let mut params: Vec<*mut c_void> = self.slots[..self.n]
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: the argument list matches the kernel's signature in kernels/engine.cu (the
        // callers below are written against it), and every pointer is a live device buffer.
        unsafe {
            dr::launch_kernel(
                func.cu_function(),
                (grid.0 as u32, grid.1 as u32, grid.2 as u32),
                (block as u32, 1, 1),
                shared_bytes as u32,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| dev_err("kernel launch", e))
    }
}

/// Activation buffers of one forward pass, grown to the largest batch seen and reused.
#[derive(Default)]
struct Scratch {
    tokens: usize,
    bufs: Option<ScratchBufs>,
    meta: Option<DevBuf>,
    scores: Option<DevBuf>,
    logits: Option<DevBuf>,
    /// Decode rows' queries and outputs for the mma kernel, (rows, heads, head_dim).
    q_dec: Option<DevBuf>,
    o_dec: Option<DevBuf>,
    /// Split-K workspace: outputs (rows, heads, splits, head_dim) and (max, sum) pairs.
    partial_out: Option<DevBuf>,
    partial_ml: Option<DevBuf>,
    /// Token picking: per-chunk statistics and candidates, and the results copied back.
    pick_stats: Option<DevBuf>,
    pick_top: Option<DevBuf>,
    pick_out: Option<DevBuf>,
}

struct ScratchBufs {
    /// (n, hidden)
    x: DevBuf,
    /// (n, hidden)
    xn: DevBuf,
    /// (n, heads, head_dim)
    q: DevBuf,
    /// (n, kv_heads, head_dim)
    k: DevBuf,
    /// (n, kv_heads, head_dim)
    v: DevBuf,
    /// (n, heads, head_dim)
    att: DevBuf,
    /// (n, hidden)
    tmp: DevBuf,
    /// (n, intermediate)
    g: DevBuf,
    /// (n, intermediate)
    u: DevBuf,
    /// bf16 GEMM input, (n, max(hidden, heads·head_dim, intermediate))
    xb: DevBuf,
}

fn ensure(slot: &mut Option<DevBuf>, ctx: &Arc<CudaContext>, bytes: usize) -> Result<u64> {
    if slot.as_ref().is_none_or(|b| b.bytes < bytes) {
        *slot = None;
        *slot = Some(DevBuf::new(ctx, bytes.next_power_of_two())?);
    }
    Ok(slot.as_ref().map_or(0, |b| b.ptr))
}

struct Inner {
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    k: Kernels,
    embed: DevBuf,
    /// The output head (`lm_head`, or the tied embedding).
    head: DevLinear,
    norm: DevBuf,
    layers: Vec<DevLayer>,
    inv_freq: DevBuf,
    scratch: Scratch,
    /// Multiprocessors (for the split-K rule).
    sms: usize,
}

/// The engine on one NVIDIA GPU.
pub struct CudaBackend {
    cfg: Config,
    context_len: usize,
    ordinal: usize,
    describe: String,
    ctx: Arc<CudaContext>,
    inner: Mutex<Inner>,
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
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| dev_err("compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        let arch = kernels::virtual_arch(major, minor);
        let stream = ctx.default_stream();
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| dev_err("creating a cuBLAS handle", e))?;
        let k = Kernels::load(&ctx, &arch)?;
        let cfg = model.config().clone();
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
            stream,
            blas,
            k,
            scratch: Scratch::default(),
            sms: ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                )
                .map_err(|e| dev_err("multiprocessor count", e))? as usize,
        };
        Ok(CudaBackend {
            describe: format!("cuda:{ordinal} {name} (sm_{major}{minor})"),
            context_len: model.context_len(),
            cfg,
            ordinal,
            ctx,
            inner: Mutex::new(inner),
        })
    }
}

/// Host-side index arrays of one pass, uploaded in one copy. Offsets are in i32 elements.
struct Meta {
    data: Vec<i32>,
    ids: usize,
    pos: usize,
    slots: usize,
    seg: usize,
    ctx: usize,
    hide: usize,
    tables: usize,
    max_blocks: usize,
    /// Rows whose logits are wanted, as token indices.
    logit_rows: usize,
    n_logit_rows: usize,
    /// Decode tokens (for the sparse top-k path and the bf16 decode kernel).
    decode_rows: usize,
    n_decode_rows: usize,
    /// The rest, when there are decode rows (prefill tokens, for the plain kernel).
    other_rows: usize,
    n_other_rows: usize,
    /// Per decode row: its block table (`max_blocks` each) and context length.
    decode_tables: usize,
    decode_ctx: usize,
    /// Segments whose token is picked on the device: their logit row (index into the logits
    /// buffer) and the token to report (-1: the most likely), `n_picks` each; `pick_k` is the
    /// largest number of alternatives any of them keeps (at least 1).
    pick_rows: usize,
    pick_chosen: usize,
    n_picks: usize,
    pick_k: usize,
}

/// Alternatives the device keeps per picked row (`PICK_MAX_K` in kernels/engine.cu).
const PICK_MAX_K: usize = 32;
/// Logits per partial reduction, and the most partials one row may have (`PICK_CHUNK`,
/// `PICK_MAX_CHUNKS`): vocabularies up to 512k tokens are picked on the device.
const PICK_CHUNK: usize = 8192;
const PICK_MAX_CHUNKS: usize = 64;

/// u32 words of one picked row's result (`PICK_WORDS` in kernels/engine.cu).
fn pick_words(k: usize) -> usize {
    6 + 2 * k
}

/// Whether the device can make this pick for a vocabulary of `vocab` (otherwise the row is
/// copied back and picked on the host, with the same result).
fn device_pick(p: &Pick, vocab: usize) -> bool {
    p.k <= PICK_MAX_K && vocab.div_ceil(PICK_CHUNK) <= PICK_MAX_CHUNKS
}

/// The pick of one row from the words `pick_finish` wrote: the summary `summarize` would give
/// from the same logits.
fn parse_pick(words: &[u32], k: usize) -> Logits {
    let f64_at = |i: usize| f64::from_bits(u64::from(words[i]) | (u64::from(words[i + 1]) << 32));
    let (lse, entropy) = (f64_at(0), f64_at(2));
    let token = words[4];
    let logprob = f32::from_bits(words[5]) as f64 - lse;
    let top = (0..k)
        .map(|r| (words[6 + 2 * r], f32::from_bits(words[7 + 2 * r])))
        .filter(|&(id, _)| id != u32::MAX)
        .map(|(id, v)| (id, (v as f64 - lse) as f32))
        .collect();
    Logits::Picked {
        token,
        summary: LogitsSummary {
            logprob: logprob as f32,
            top,
            entropy: entropy as f32,
        },
    }
}

fn build_meta(
    segs: &[Segment<'_>],
    where_: &[(usize, usize)],
    block_size: usize,
    vocab: usize,
    toggles: &Toggles,
) -> Meta {
    let n = where_.len();
    let max_blocks = segs
        .iter()
        .map(|s| s.table.blocks.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut data = Vec::with_capacity(7 * n + segs.len() * max_blocks);
    let ids = data.len();
    for s in segs {
        data.extend(s.tokens.iter().map(|&t| t as i32));
    }
    let pos = data.len();
    data.extend(where_.iter().map(|&(_, p)| p as i32));
    let slots = data.len();
    data.extend(
        where_
            .iter()
            .map(|&(si, p)| segs[si].table.slot(p, block_size) as i32),
    );
    let seg = data.len();
    data.extend(where_.iter().map(|&(si, _)| si as i32));
    let ctx = data.len();
    data.extend(where_.iter().map(|&(_, p)| p as i32 + 1));
    let hide = data.len();
    data.extend(where_.iter().map(|&(si, p)| {
        let s = &segs[si];
        chunk_boundary_hidden(s.fault_chunk_boundary, s.table.len, p).map_or(-1, |h| h as i32)
    }));
    // A block table as one row of `max_blocks` entries, padded with block 0 (never read).
    let push_table = |data: &mut Vec<i32>, s: &Segment<'_>| {
        data.extend(s.table.blocks.iter().map(|&b| b as i32));
        data.extend(std::iter::repeat_n(0, max_blocks - s.table.blocks.len()));
    };
    let tables = data.len();
    for s in segs {
        push_table(&mut data, s);
    }
    let logit_rows = data.len();
    let mut t0 = 0usize;
    for s in segs {
        data.extend(s.logit_rows().map(|r| (t0 + r) as i32));
        t0 += s.tokens.len();
    }
    let n_logit_rows = data.len() - logit_rows;
    let decode_rows = data.len();
    // Decode rows get their own kernel exactly when decode differs from prefill.
    if !toggles.decode_matches_prefill() {
        data.extend(
            where_
                .iter()
                .enumerate()
                .filter(|(_, &(si, _))| segs[si].decode)
                .map(|(t, _)| t as i32),
        );
    }
    let n_decode_rows = data.len() - decode_rows;
    // The other rows, which the plain attention kernel serves when the decode rows have their
    // own kernel.
    let other_rows = data.len();
    if n_decode_rows > 0 {
        data.extend(
            where_
                .iter()
                .enumerate()
                .filter(|(_, &(si, _))| !segs[si].decode)
                .map(|(t, _)| t as i32),
        );
    }
    let n_other_rows = data.len() - other_rows;
    let decode_tables = data.len();
    let dec: Vec<usize> = data[decode_rows..decode_rows + n_decode_rows]
        .iter()
        .map(|&t| t as usize)
        .collect();
    for &t in &dec {
        push_table(&mut data, &segs[where_[t].0]);
    }
    let decode_ctx = data.len();
    data.extend(dec.iter().map(|&t| where_[t].1 as i32 + 1));
    let (mut picked, mut chosen, mut pick_k, mut row) = (Vec::new(), Vec::new(), 1, 0);
    for s in segs {
        if let WantLogits::Pick(p) = s.want {
            if device_pick(&p, vocab) {
                picked.push(row as i32);
                chosen.push(p.token.map_or(-1, |t| t as i32));
                pick_k = pick_k.max(p.k);
            }
        }
        row += s.logit_rows().len();
    }
    let pick_rows = data.len();
    data.extend(&picked);
    let pick_chosen = data.len();
    data.extend(&chosen);
    Meta {
        data,
        ids,
        pos,
        slots,
        seg,
        ctx,
        hide,
        tables,
        max_blocks,
        logit_rows,
        n_logit_rows,
        decode_rows,
        n_decode_rows,
        other_rows,
        n_other_rows,
        decode_tables,
        decode_ctx,
        pick_rows,
        pick_chosen,
        n_picks: picked.len(),
        pick_k,
    }
}

/// The split-K rule of the mma decode kernel (docs/cuda_decode_attention.md, measured on the
/// H200): with fewer (KV head, sequence) pairs than resident blocks, about two blocks per
/// multiprocessor of long splits; with more, a few splits each. Returns `(split_len, max_splits)`.
fn split_rule(rows: usize, kv_heads: usize, max_len: usize, sms: usize) -> (usize, usize) {
    // Resident blocks of the kernel (3 per SM at 64 KiB of shared memory and 128 threads).
    let slots = 3 * sms;
    let base = (rows * kv_heads).max(1);
    let splits = if base >= slots {
        (5 * slots).div_ceil(base)
    } else {
        (2 * sms / base).max(1)
    };
    let split_len = (max_len.div_ceil(splits).div_ceil(64) * 64).max(256);
    (split_len, max_len.div_ceil(split_len).max(1))
}

impl Inner {
    /// `y (n, out) = x (n, in) · Wᵀ (+ b)`. `x` is f32, or bf16 bits when `p` is bf16.
    fn linear(&self, l: &DevLinear, x: u64, n: usize, y: u64, p: Precision) -> Result<()> {
        use cudarc::cublas::sys::{
            cublasComputeType_t as C, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType as T,
        };
        let (w, ty, compute) = match p {
            Precision::F32 => (l.w.ptr, T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_PEDANTIC),
            Precision::Bf16 => (l.w_bf16.ptr, T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major y = x·Wᵀ is column-major yᵀ (out × n) = W (as (in × out), transposed) · xᵀ.
        // SAFETY: pointers are live device buffers of the stated shapes.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                Op::CUBLAS_OP_T,
                Op::CUBLAS_OP_N,
                l.out as i32,
                n as i32,
                l.inp as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ty,
                l.inp as i32,
                x as *const c_void,
                ty,
                l.inp as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                T::CUDA_R_32F,
                l.out as i32,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev_err("cuBLAS GEMM", e))?;
        if let Some(b) = &l.b {
            let total = n * l.out;
            Args::new().p(y).p(b.ptr).i(n).i(l.out).launch(
                &self.stream,
                &self.k.add_bias,
                (total.div_ceil(256), 1),
                256,
            )?;
        }
        Ok(())
    }

    /// The GEMM input for precision `p`: `x` itself, or `x` rounded to bf16 into `xb`.
    fn gemm_input(&self, x: u64, len: usize, xb: u64, p: Precision) -> Result<u64> {
        match p {
            Precision::F32 => Ok(x),
            Precision::Bf16 => {
                Args::new().p(xb).p(x).i(len).launch(
                    &self.stream,
                    &self.k.f32_to_bf16,
                    (len.div_ceil(256), 1),
                    256,
                )?;
                Ok(xb)
            }
        }
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
        });
        self.scratch.tokens = n;
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

    fn new_pool(&self, block_size: usize, num_blocks: usize) -> Result<KvPool> {
        let per_layer = num_blocks * block_size * self.cfg.num_kv_heads * self.cfg.head_dim;
        let kv = DeviceKv::new(&self.ctx, self.cfg.num_layers, per_layer)?;
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
        let cfg = &self.cfg;
        let context_len = self.context_len;
        let bs = pool.block_size();
        let where_ = batch_positions(cfg, context_len, bs, segs)?;
        let n = where_.len();
        if n == 0 {
            return Ok(segs.iter().map(|_| Logits::Rows(Vec::new())).collect());
        }
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| Error::Device("the CUDA backend's lock was poisoned".into()))?;
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let kv = pool.device_mut()?;
        let meta = build_meta(segs, &where_, bs, cfg.vocab_size, toggles);
        inner.ensure_scratch(&self.ctx, cfg, n)?;
        let inner = &mut *inner;
        let meta_ptr = ensure(&mut inner.scratch.meta, &self.ctx, meta.data.len() * 4)?;
        // SAFETY: the meta buffer holds at least `meta.data.len()` i32s.
        unsafe { dr::memcpy_htod_async(meta_ptr, &meta.data, inner.stream.cu_stream()) }
            .map_err(|e| dev_err("uploading batch indices", e))?;
        let mi = |off: usize| meta_ptr + (off * 4) as u64;

        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let (q_dim, inter) = (nh * hd, cfg.intermediate_size);
        let pm = toggles.matmul;
        let scale = 1.0 / (hd as f32).sqrt();
        let attn_bf16 = usize::from(toggles.attention_bf16(false));
        let kv_mode = match toggles.kv_dtype {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
            KvDtype::Fp8E4m3 => 2,
        };
        let topk = toggles.decode_topk.map(|k| k.get());
        let decode_mma = toggles.attn_decode == AttnDecode::MmaBf16;
        let scores_stride = where_.iter().map(|&(_, p)| p + 1).max().unwrap_or(1);
        let scores_ptr = match (topk, meta.n_decode_rows) {
            (Some(_), rows) if rows > 0 => ensure(
                &mut inner.scratch.scores,
                &self.ctx,
                rows * nh * scores_stride * 4,
            )?,
            _ => 0,
        };
        // The mma decode kernel's shapes, split rule and buffers.
        let mma_shape_ok = matches!(hd, 64 | 128) && nh / nkv <= 16 && bs.is_multiple_of(16);
        let (mut q_dec, mut o_dec, mut partial_out, mut partial_ml) = (0, 0, 0, 0);
        let (mut split_len, mut max_splits) = (0, 0);
        if decode_mma && topk.is_none() && mma_shape_ok && meta.n_decode_rows > 0 {
            let nr = meta.n_decode_rows;
            let max_len = meta.data[meta.decode_ctx..meta.decode_ctx + nr]
                .iter()
                .map(|&c| c as usize)
                .max()
                .unwrap_or(1);
            (split_len, max_splits) = split_rule(nr, nkv, max_len, inner.sms);
            let sc = &mut inner.scratch;
            q_dec = ensure(&mut sc.q_dec, &self.ctx, nr * q_dim * 4)?;
            o_dec = ensure(&mut sc.o_dec, &self.ctx, nr * q_dim * 4)?;
            partial_out = ensure(
                &mut sc.partial_out,
                &self.ctx,
                nr * nh * max_splits * hd * 4,
            )?;
            partial_ml = ensure(&mut sc.partial_ml, &self.ctx, nr * nh * max_splits * 2 * 4)?;
        }
        let Some(b) = inner.scratch.bufs.as_ref() else {
            return Err(Error::Device("scratch buffers missing".into()));
        };
        let (x, xn, q, k, v, att, tmp, g, u, xb) = (
            b.x.ptr, b.xn.ptr, b.q.ptr, b.k.ptr, b.v.ptr, b.att.ptr, b.tmp.ptr, b.g.ptr, b.u.ptr,
            b.xb.ptr,
        );
        let s = &inner.stream;
        let kn = &inner.k;
        let elementwise = (n * h).div_ceil(256);

        Args::new()
            .p(x)
            .p(inner.embed.ptr)
            .p(mi(meta.ids))
            .i(h)
            .launch(s, &kn.embed_gather, (n, 1), 256)?;
        for (li, layer) in inner.layers.iter().enumerate() {
            Args::new()
                .p(xn)
                .p(x)
                .p(layer.attn_norm.ptr)
                .i(h)
                .f(cfg.rms_norm_eps)
                .launch(s, &kn.rms_norm, (n, 1), 256)?;
            let xin = inner.gemm_input(xn, n * h, xb, pm)?;
            inner.linear(&layer.q, xin, n, q, pm)?;
            inner.linear(&layer.k, xin, n, k, pm)?;
            inner.linear(&layer.v, xin, n, v, pm)?;
            for (buf, heads) in [(q, nh), (k, nkv)] {
                Args::new()
                    .p(buf)
                    .p(mi(meta.pos))
                    .p(inner.inv_freq.ptr)
                    .i(heads)
                    .i(hd)
                    .launch(s, &kn.rope, (n, 1), 256)?;
            }
            let (kp, vp) = (kv.k[li].ptr, kv.v[li].ptr);
            Args::new()
                .p(kp)
                .p(vp)
                .p(k)
                .p(v)
                .p(mi(meta.slots))
                .i(nkv)
                .i(hd)
                .i(kv_mode)
                .launch(s, &kn.kv_write, (n, nkv), hd.div_ceil(32) * 32)?;
            // The arguments the SIMT attention kernels share: where each token's context is, and
            // the head shapes.
            let context = |a: Args, rows: u64| {
                a.p(mi(meta.tables))
                    .i(meta.max_blocks)
                    .p(mi(meta.seg))
                    .p(mi(meta.ctx))
                    .p(mi(meta.hide))
                    .p(rows)
            };
            let heads = |a: Args, bf16: usize| a.i(nh).i(nkv).i(hd).i(bs).f(scale).i(bf16);
            let attention = |rows: u64, n_rows: usize, scores: u64, stride: usize, bf16: usize| {
                let a = context(Args::new().p(att).p(q).p(kp).p(vp), rows);
                heads(a.p(scores).i(stride), bf16).launch(s, &kn.attention, (n_rows, nh), 128)
            };
            if meta.n_decode_rows == 0 {
                attention(0, n, 0, 0, attn_bf16)?;
            } else if meta.n_other_rows > 0 {
                attention(mi(meta.other_rows), meta.n_other_rows, 0, 0, attn_bf16)?;
            }
            // Decode steps recomputed by their own kernel settings: bf16 operands for
            // attn_decode=mma-bf16 (the SIMT kernel with the tensor-core kernel's roundings), and
            // the sparse top-k selection.
            let decode_bf16 = usize::from(toggles.attention_bf16(true));
            let (rows, nr) = (mi(meta.decode_rows), meta.n_decode_rows);
            if let (Some(top_k), true) = (topk, scores_ptr != 0) {
                let a = context(Args::new().p(scores_ptr).i(scores_stride).p(q).p(kp), rows);
                heads(a, decode_bf16).launch(s, &kn.attention_scores, (nr, nh), 128)?;
                Args::new()
                    .p(scores_ptr)
                    .i(scores_stride)
                    .p(mi(meta.ctx))
                    .p(rows)
                    .i(nh)
                    .i(top_k)
                    .launch(s, &kn.topk_mask, (nr, nh), 256)?;
                attention(rows, nr, scores_ptr, scores_stride, decode_bf16)?;
            } else if decode_mma && nr > 0 && mma_shape_ok {
                // The bf16 tensor-core kernel on the decode rows: gather their queries, attend,
                // merge the splits, scatter the outputs back.
                Args::new().p(q_dec).p(q).p(rows).i(q_dim).launch(
                    s,
                    &kn.embed_gather,
                    (nr, 1),
                    256,
                )?;
                Args::new()
                    .p(o_dec)
                    .p(q_dec)
                    .p(kp)
                    .p(vp)
                    .p(mi(meta.decode_tables))
                    .p(mi(meta.decode_ctx))
                    .p(partial_out)
                    .p(partial_ml)
                    .i(meta.max_blocks)
                    .i(nh)
                    .i(nkv)
                    .i(bs)
                    .i(hd)
                    .i(split_len)
                    .i(max_splits)
                    .f(scale)
                    .launch_3d(
                        s,
                        &kn.decode_mma,
                        (nkv, nr, max_splits),
                        128,
                        kernels::DECODE_MMA_SMEM,
                    )?;
                Args::new()
                    .p(o_dec)
                    .p(partial_out)
                    .p(partial_ml)
                    .p(mi(meta.decode_ctx))
                    .i(nh)
                    .i(hd)
                    .i(split_len)
                    .i(max_splits)
                    .launch(s, &kn.decode_combine, (nh, nr), 256)?;
                Args::new().p(att).p(o_dec).p(rows).i(q_dim).launch(
                    s,
                    &kn.scatter_rows,
                    (nr, 1),
                    256,
                )?;
            } else if decode_mma && nr > 0 {
                // Shapes the tensor-core kernel does not take (head_dim other than 64 or 128,
                // more than 16 query heads per KV head): the SIMT kernel with its roundings.
                attention(rows, nr, 0, 0, 1)?;
            }
            let ain = inner.gemm_input(att, n * q_dim, xb, pm)?;
            inner.linear(&layer.o, ain, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
            Args::new()
                .p(xn)
                .p(x)
                .p(layer.mlp_norm.ptr)
                .i(h)
                .f(cfg.rms_norm_eps)
                .launch(s, &kn.rms_norm, (n, 1), 256)?;
            let xin = inner.gemm_input(xn, n * h, xb, pm)?;
            inner.linear(&layer.gate, xin, n, g, pm)?;
            inner.linear(&layer.up, xin, n, u, pm)?;
            Args::new().p(g).p(u).i(n * inter).launch(
                s,
                &kn.silu_mul,
                ((n * inter).div_ceil(256), 1),
                256,
            )?;
            let gin = inner.gemm_input(g, n * inter, xb, pm)?;
            inner.linear(&layer.down, gin, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
        }
        for sg in segs.iter_mut() {
            sg.table.len += sg.tokens.len();
        }
        // Final norm and head on the rows asked for: gather them (into `tmp`), norm, project;
        // then pick tokens where asked and copy back only what each segment needs.
        let r = meta.n_logit_rows;
        let vocab = cfg.vocab_size;
        let mut out: Vec<Option<Logits>> = segs.iter().map(|_| None).collect();
        let mut rows_host: Vec<(usize, Vec<f32>)> = Vec::new();
        let mut picks_host = vec![0u32; meta.n_picks * pick_words(meta.pick_k)];
        if r > 0 {
            Args::new().p(tmp).p(x).p(mi(meta.logit_rows)).i(h).launch(
                s,
                &kn.embed_gather,
                (r, 1),
                256,
            )?;
            Args::new()
                .p(xn)
                .p(tmp)
                .p(inner.norm.ptr)
                .i(h)
                .f(cfg.rms_norm_eps)
                .launch(s, &kn.rms_norm, (r, 1), 256)?;
            let logits = ensure(&mut inner.scratch.logits, &self.ctx, r * vocab * 4)?;
            let hin = inner.gemm_input(xn, r * h, xb, pm)?;
            inner.linear(&inner.head, hin, r, logits, pm)?;
            if meta.n_picks > 0 {
                inner.pick(
                    &self.ctx,
                    &meta,
                    logits,
                    vocab,
                    mi(meta.pick_rows),
                    mi(meta.pick_chosen),
                )?;
                let sc = &inner.scratch;
                let dst = sc.pick_out.as_ref().map_or(0, |b| b.ptr);
                // SAFETY: the buffer holds n_picks × pick_words(pick_k) words.
                unsafe { dr::memcpy_dtoh_async(&mut picks_host, dst, inner.stream.cu_stream()) }
                    .map_err(|e| dev_err("downloading picked tokens", e))?;
            }
            // Rows for the segments that sample on the host (or keep more alternatives than the
            // device picks), each segment's rows contiguous in the logits buffer.
            let mut at = 0usize;
            for (i, sg) in segs.iter().enumerate() {
                let rows = sg.logit_rows().len();
                let on_device = matches!(sg.want, WantLogits::Pick(p) if device_pick(&p, vocab));
                if rows > 0 && !on_device {
                    let mut host = vec![0.0f32; rows * vocab];
                    let src = logits + (at * vocab * 4) as u64;
                    // SAFETY: rows at..at+rows lie inside the r × vocab logits buffer.
                    unsafe { dr::memcpy_dtoh_async(&mut host, src, inner.stream.cu_stream()) }
                        .map_err(|e| dev_err("downloading logits", e))?;
                    rows_host.push((i, host));
                }
                at += rows;
            }
        }
        inner
            .stream
            .synchronize()
            .map_err(|e| dev_err("forward pass", e))?;
        for (i, host) in rows_host {
            out[i] = Some(match segs[i].want {
                WantLogits::Pick(p) => Logits::pick(&host, p),
                _ => Logits::Rows(host),
            });
        }
        let mut words = picks_host.chunks_exact(pick_words(meta.pick_k).max(1));
        for (i, sg) in segs.iter().enumerate() {
            if let WantLogits::Pick(p) = sg.want {
                if device_pick(&p, vocab) {
                    let w = words
                        .next()
                        .ok_or_else(|| Error::Device("a picked token is missing".into()))?;
                    out[i] = Some(parse_pick(w, p.k));
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or(Logits::Rows(Vec::new())))
            .collect())
    }
}

impl Inner {
    /// Picks tokens on the device for the meta's picked rows of `logits`, into `pick_out`.
    fn pick(
        &mut self,
        ctx: &Arc<CudaContext>,
        meta: &Meta,
        logits: u64,
        vocab: usize,
        rows: u64,
        chosen: u64,
    ) -> Result<()> {
        let (p, k) = (meta.n_picks, meta.pick_k);
        let chunks = vocab.div_ceil(PICK_CHUNK);
        let sc = &mut self.scratch;
        let stats = ensure(&mut sc.pick_stats, ctx, p * chunks * 3 * 8)?;
        let top = ensure(&mut sc.pick_top, ctx, p * chunks * k * 8)?;
        let out = ensure(&mut sc.pick_out, ctx, p * pick_words(k) * 4)?;
        let s = &self.stream;
        Args::new()
            .p(logits)
            .i(vocab)
            .p(rows)
            .i(k)
            .p(stats)
            .p(top)
            .launch(s, &self.k.pick_partial, (p, chunks), 256)?;
        Args::new()
            .p(logits)
            .i(vocab)
            .p(rows)
            .p(chosen)
            .i(k)
            .i(chunks)
            .p(stats)
            .p(top)
            .p(out)
            .launch(s, &self.k.pick_finish, (p, 1), 256)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rule_covers_every_context_and_fills_the_gpu() {
        for rows in [1, 3, 8, 64, 200] {
            for max_len in [1, 17, 256, 1000, 4096, 32768, 131072] {
                let (len, splits) = split_rule(rows, 8, max_len, 132);
                assert!(len >= 256 && len % 64 == 0, "{rows} {max_len}: {len}");
                assert!(max_len.div_ceil(len) <= splits, "{rows} {max_len}");
                assert!(
                    splits == 1 || (splits - 1) * len < max_len,
                    "no empty split"
                );
            }
        }
        // Batch 1 at 32k: long contexts are spread over about two blocks per multiprocessor.
        let (_, splits) = split_rule(1, 8, 32768, 132);
        assert!(splits * 8 >= 132, "{splits} splits leave the GPU idle");
    }

    #[test]
    fn meta_lists_logit_rows_decode_rows_and_hidden_positions() {
        let mut t1 = crate::model::BlockTable {
            blocks: vec![5, 2],
            len: 16,
        };
        let mut t2 = crate::model::BlockTable {
            blocks: vec![7],
            len: 3,
        };
        let (a, b) = ([1u32, 2, 3], [9u32]);
        let segs = [
            Segment {
                tokens: &a,
                table: &mut t1,
                decode: false,
                want: WantLogits::All,
                fault_chunk_boundary: true,
            },
            Segment {
                tokens: &b,
                table: &mut t2,
                decode: true,
                want: WantLogits::Pick(Pick {
                    k: 5,
                    token: Some(4),
                }),
                fault_chunk_boundary: false,
            },
        ];
        let where_ = [(0, 16), (0, 17), (0, 18), (1, 3)];
        let toggles: Toggles = "attn_decode=mma-bf16".parse().unwrap();
        let m = build_meta(&segs, &where_, 16, 1000, &toggles);
        let d = &m.data;
        assert_eq!(&d[m.ids..m.ids + 4], &[1, 2, 3, 9]);
        // Position 16 of the first sequence is slot 0 of block 2; position 3 of the second is
        // slot 3 of block 7.
        assert_eq!(&d[m.slots..m.slots + 4], &[32, 33, 34, 115]);
        assert_eq!(&d[m.ctx..m.ctx + 4], &[17, 18, 19, 4]);
        // The chunk-boundary fault hides position 15 from the chunk's first token only.
        assert_eq!(&d[m.hide..m.hide + 4], &[15, -1, -1, -1]);
        assert_eq!(m.max_blocks, 2);
        assert_eq!(&d[m.tables..m.tables + 4], &[5, 2, 7, 0]);
        assert_eq!(
            &d[m.logit_rows..m.logit_rows + m.n_logit_rows],
            &[0, 1, 2, 3]
        );
        assert_eq!(&d[m.decode_rows..m.decode_rows + m.n_decode_rows], &[3]);
        assert_eq!(&d[m.other_rows..m.other_rows + m.n_other_rows], &[0, 1, 2]);
        assert_eq!(&d[m.decode_tables..m.decode_tables + 2], &[7, 0]);
        assert_eq!(d[m.decode_ctx], 4);
        // The second segment's token is picked on the device: its logit row is the fourth.
        assert_eq!((m.n_picks, m.pick_k), (1, 5));
        assert_eq!((d[m.pick_rows], d[m.pick_chosen]), (3, 4));
    }

    #[test]
    fn picks_parse_as_the_host_summary_reads() {
        let lse = 2.5f64;
        let mut w = vec![0u32; pick_words(3)];
        w[..2].copy_from_slice(&[lse.to_bits() as u32, (lse.to_bits() >> 32) as u32]);
        let ent = 1.25f64;
        w[2..4].copy_from_slice(&[ent.to_bits() as u32, (ent.to_bits() >> 32) as u32]);
        w[4] = 7;
        w[5] = 2.0f32.to_bits();
        w[6..].copy_from_slice(&[7, 2.0f32.to_bits(), 3, 1.0f32.to_bits(), u32::MAX, 0]);
        let Logits::Picked { token, summary } = parse_pick(&w, 3) else {
            panic!()
        };
        assert_eq!(token, 7);
        assert!((summary.logprob - (2.0 - 2.5)).abs() < 1e-7);
        assert_eq!(summary.entropy, 1.25);
        // The third alternative lies past the vocabulary: dropped.
        assert_eq!(summary.top, vec![(7, -0.5), (3, -1.5)]);
    }
}
