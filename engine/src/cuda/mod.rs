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

pub mod check;
mod host;
pub mod kernels;
mod meta;
mod step;
mod trace;
mod tune;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream};

use crate::backend::{Backend, Device};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::{KvPool, Logits, Model, Segment, WantLogits};
use crate::models::llama::{batch_positions, Linear};
use crate::numerics::round_bf16;
use crate::toggles::{AttnDecode, AttnPrefill, KvDtype, Pdl, Precision, SmallGemm, Toggles};
pub use host::{host_split, HostSplit};
use host::{Laps, Part, Pinned};
use meta::{build_meta, device_pick, parse_pick, pick_words, Meta, Pad, PICK_CHUNK};

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

/// What a device KV pool's elements are. Every kernel that reads or writes the pool comes in one
/// variant per element type (the `_bf16kv` entry points read and write bf16 bits, the `_fp8kv`
/// ones FP8 E4M3 codes and their scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum KvElem {
    /// f32: holds any `kv_dtype` as f32 of the rounded values.
    F32,
    /// bf16 bits: a `kv_dtype=bf16` pool at half the bytes, reading back the same f32 values.
    Bf16,
    /// FP8 E4M3 codes plus one f32 scale per position and KV head (`kv_dtype=fp8-e4m3`): a
    /// quarter of the bytes and a scale, reading back the same f32 values. The persistent
    /// decode-step kernel does not read it (that pass keeps the separate kernels).
    Fp8,
}

impl KvElem {
    /// The element type a pool for `dtype` stores.
    fn for_dtype(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => KvElem::F32,
            KvDtype::Bf16 => KvElem::Bf16,
            KvDtype::Fp8E4m3 => KvElem::Fp8,
        }
    }

    /// Bytes per element (an FP8 pool's scales come on top).
    fn bytes(self) -> usize {
        match self {
            KvElem::F32 => 4,
            KvElem::Bf16 => 2,
            KvElem::Fp8 => 1,
        }
    }

    /// The `kv_dtype` values a pool of this element type holds exactly ([`KvDtype::holds`]).
    pub(crate) fn dtype(self) -> KvDtype {
        match self {
            KvElem::F32 => KvDtype::F32,
            KvElem::Bf16 => KvDtype::Bf16,
            KvElem::Fp8 => KvDtype::Fp8E4m3,
        }
    }

    /// Index into the per-element-type kernel sets.
    fn index(self) -> usize {
        self as usize
    }

    /// The suffix of the kernels' entry points for this element type.
    fn suffix(self) -> &'static str {
        match self {
            KvElem::F32 => "",
            KvElem::Bf16 => "_bf16kv",
            KvElem::Fp8 => "_fp8kv",
        }
    }

    /// The suffix of the tensor-core kernels' entry points, which name every element type
    /// (`decode_attn_mma_f32kv`, `prefill_attn_mma_bf16kv_hd64`).
    fn mma_suffix(self) -> &'static str {
        match self {
            KvElem::F32 => "_f32kv",
            KvElem::Bf16 => "_bf16kv",
            KvElem::Fp8 => "_fp8kv",
        }
    }
}

/// The KV pool's device storage: per layer, keys and values `(num_blocks, block_size, kv_heads,
/// head_dim)` of one element type, and for FP8 their scales `(num_blocks, block_size, kv_heads)`.
#[derive(Debug)]
pub struct DeviceKv {
    k: Vec<DevBuf>,
    v: Vec<DevBuf>,
    /// FP8 pools only (empty otherwise): one f32 scale per position and KV head, per layer.
    k_scale: Vec<DevBuf>,
    v_scale: Vec<DevBuf>,
    /// Elements per layer in use.
    per_layer: usize,
    head_dim: usize,
    elem: KvElem,
    ctx: Arc<CudaContext>,
}

impl DeviceKv {
    fn new(
        ctx: &Arc<CudaContext>,
        layers: usize,
        per_layer: usize,
        head_dim: usize,
        elem: KvElem,
    ) -> Result<Self> {
        let mut kv = DeviceKv {
            k: Vec::new(),
            v: Vec::new(),
            k_scale: Vec::new(),
            v_scale: Vec::new(),
            per_layer: 0,
            head_dim,
            elem,
            ctx: ctx.clone(),
        };
        for _ in 0..layers {
            kv.k.push(DevBuf::new(ctx, 0)?);
            kv.v.push(DevBuf::new(ctx, 0)?);
            if elem == KvElem::Fp8 {
                kv.k_scale.push(DevBuf::new(ctx, 0)?);
                kv.v_scale.push(DevBuf::new(ctx, 0)?);
            }
        }
        kv.grow(per_layer)?;
        Ok(kv)
    }

    /// Layers held.
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// The `kv_dtype` the elements are stored as (see [`KvElem::dtype`]).
    pub fn storage_dtype(&self) -> KvDtype {
        self.elem.dtype()
    }

    /// Layer `li`'s key and value buffers, and their scales (0 for pools without).
    fn layer(&self, li: usize) -> [u64; 4] {
        let scale = |s: &[DevBuf]| s.get(li).map_or(0, |b| b.ptr);
        [
            self.k[li].ptr,
            self.v[li].ptr,
            scale(&self.k_scale),
            scale(&self.v_scale),
        ]
    }

    /// Every buffer's address: what graphs and the decode-step kernel's layer table baked in.
    fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.k
            .iter()
            .chain(&self.v)
            .chain(&self.k_scale)
            .chain(&self.v_scale)
            .map(|b| b.ptr)
    }

    /// Grows every layer to `per_layer` elements, keeping what is stored (capacity doubles, so
    /// a sequence growing one block at a time copies O(n) in total).
    pub(crate) fn grow(&mut self, per_layer: usize) -> Result<()> {
        if per_layer <= self.per_layer {
            return Ok(());
        }
        let (old, hd) = (self.per_layer, self.head_dim.max(1));
        let eb = self.elem.bytes();
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            grow_buf(&self.ctx, buf, old * eb, per_layer * eb)?;
        }
        for buf in self.k_scale.iter_mut().chain(self.v_scale.iter_mut()) {
            grow_buf(&self.ctx, buf, old / hd * 4, per_layer / hd * 4)?;
        }
        self.per_layer = per_layer;
        Ok(())
    }
}

/// Makes `buf` hold at least `want` bytes, keeping its first `used`: a new buffer of at least
/// twice the old capacity when it does not.
fn grow_buf(ctx: &Arc<CudaContext>, buf: &mut DevBuf, used: usize, want: usize) -> Result<()> {
    if want <= buf.bytes {
        return Ok(());
    }
    let new = DevBuf::new(ctx, want.max(2 * buf.bytes))?;
    if used > 0 {
        // SAFETY: both buffers are at least `used` bytes.
        unsafe { dr::memcpy_dtod_sync(new.ptr, buf.ptr, used) }
            .map_err(|e| dev_err("growing the KV cache", e))?;
    }
    *buf = new;
    Ok(())
}

/// The GEMV entry point for `n` rows.
fn gemv_for(fns: &[CudaFunction], n: usize) -> Result<&CudaFunction> {
    n.checked_sub(1).and_then(|i| fns.get(i)).ok_or_else(|| {
        Error::Device(format!(
            "the GEMV kernels take 1..={GEMV_MAX_ROWS} rows, not {n}"
        ))
    })
}

/// The input of a GEMV launch.
#[derive(Debug, Clone, Copy)]
enum GemvIn {
    /// bf16 bits `(n, in)`.
    Bf16(u64),
    /// f32 `(n, in)`, rounded to bf16 as read.
    F32(u64),
    /// The f32 residual stream `(n, in)`, RMS-normalized with weights `w` and `eps` by each
    /// block into shared memory first (fits when `n · in · 2 ≤ GEMV_NORM_SMEM`).
    Normed { x: u64, w: u64, eps: f32 },
    /// The attention output of an mma decode pass, merged from the split partials by each block
    /// into shared memory (`fuse=on`; fits when `n · in · 2 ≤ GEMV_NORM_SMEM`).
    Merged(MergedSplits),
}

/// Where the o projection's fused split merge reads (the mma decode pass's buffers and split
/// geometry; see `kernels/decode_fused.cu`).
#[derive(Debug, Clone, Copy)]
struct MergedSplits {
    att: u64,
    partial_out: u64,
    partial_ml: u64,
    ctx: u64,
    heads: usize,
    head_dim: usize,
    split_len: usize,
    max_splits: usize,
}

/// Most splits the o GEMV merges itself: every one of its blocks reads all rows' partials, so
/// past a few splits (long contexts) the combine kernel, which reads them once, is cheaper.
const FUSED_MERGE_MAX_SPLITS: usize = 8;

impl MergedSplits {
    /// Dynamic shared memory of the merging GEMV over `n` rows of `inp` inputs: the merged rows
    /// in bf16, then the split weights, their sums and the splits' (max, sum) pairs in f32.
    fn smem(&self, n: usize, inp: usize) -> usize {
        n * inp * 2 + 4 * n * self.heads * (3 * self.max_splits + 1)
    }
}

/// Dynamic shared memory the GEMV kernels' fused RMSNorm may use (the default per-block limit).
const GEMV_NORM_SMEM: usize = 48 << 10;

impl GemvIn {
    /// Appends the kernels' input arguments: `(x, x_f32, norm_w, eps)`, or for `Merged` the
    /// merge's `(att, partial_out, partial_ml, ctx, heads, head_dim, split_len, max_splits)`;
    /// returns the dynamic shared memory the launch needs.
    fn args(self, a: Args, n: usize, inp: usize) -> (Args, usize) {
        match self {
            GemvIn::Bf16(x) => (a.p(x).i(0).p(0).f(0.0), 0),
            GemvIn::F32(x) => (a.p(x).i(1).p(0).f(0.0), 0),
            GemvIn::Normed { x, w, eps } => (a.p(x).i(0).p(w).f(eps), n * inp * 2),
            GemvIn::Merged(m) => (
                a.p(m.att)
                    .p(m.partial_out)
                    .p(m.partial_ml)
                    .p(m.ctx)
                    .i(m.heads)
                    .i(m.head_dim)
                    .i(m.split_len)
                    .i(m.max_splits),
                m.smem(n, inp),
            ),
        }
    }
}

/// The device address of a layer's bias, 0 for none (what the kernels take).
fn bias(l: &DevLinear) -> u64 {
    l.b.as_ref().map_or(0, |b| b.ptr)
}

/// What RoPE and the KV write of one layer need: the arguments `rope_kv_write` and the fused
/// q/k/v kernel (`fuse=on`) both end with.
struct RopeArgs {
    q: u64,
    k: u64,
    v: u64,
    k_pool: u64,
    v_pool: u64,
    /// An FP8 pool's scales (0 for the others).
    k_scale: u64,
    v_scale: u64,
    pos: u64,
    inv_freq: u64,
    slots: u64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    kv_mode: usize,
    /// The pool's element type (which kernel variant writes it).
    elem: KvElem,
}

impl RopeArgs {
    /// Appends `(q, k, v, k_pool, v_pool, k_scale, v_scale, pos, inv_freq, slots, heads,
    /// kv_heads, hd, mode)`.
    fn append(&self, a: Args) -> Args {
        a.p(self.q)
            .p(self.k)
            .p(self.v)
            .p(self.k_pool)
            .p(self.v_pool)
            .p(self.k_scale)
            .p(self.v_scale)
            .p(self.pos)
            .p(self.inv_freq)
            .p(self.slots)
            .i(self.heads)
            .i(self.kv_heads)
            .i(self.head_dim)
            .i(self.kv_mode)
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
        Self::from_parts(ctx, &l.w, l.b.as_deref(), l.out, l.inp)
    }

    /// `w` is `(out, in)` f32; the bf16 copy is made from it here.
    fn from_parts(
        ctx: &Arc<CudaContext>,
        w: &[f32],
        b: Option<&[f32]>,
        out: usize,
        inp: usize,
    ) -> Result<Self> {
        Ok(DevLinear {
            w: DevBuf::from_slice(ctx, w)?,
            w_bf16: DevBuf::from_slice(ctx, &bf16_bits(w))?,
            b: b.map(|b| DevBuf::from_slice(ctx, b)).transpose()?,
            out,
            inp,
        })
    }
}

/// `x` rounded to bf16 (nearest, ties to even), as raw bits.
fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| (round_bf16(v).to_bits() >> 16) as u16)
        .collect()
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

/// The kernels that read or write the KV pool, for one element type ([`KvElem`]).
struct PoolKernels {
    rope_kv_write: CudaFunction,
    /// q/k/v with RoPE and the KV write in the epilogue (`fuse=on`), per row count like `gemv`
    /// (none for FP8, whose per-head scale needs the whole head: that pool keeps rope_kv_write).
    gemv_qkv_rope: Vec<CudaFunction>,
    attention: CudaFunction,
    attention_scores: CudaFunction,
    /// The tensor-core decode kernel (`attn_decode=mma-bf16`).
    decode_mma: CudaFunction,
    /// The tiled prefill kernel for this model's head_dim (none for other head dims).
    prefill: Option<CudaFunction>,
    /// The tensor-core prefill kernel (`attn_prefill=mma-bf16`; head_dim 64 and 128 only, the
    /// others run `prefill` with its bf16 roundings).
    prefill_mma: Option<CudaFunction>,
}

/// Loaded kernel entry points.
struct Kernels {
    embed_gather: CudaFunction,
    rms_norm: CudaFunction,
    silu_mul: CudaFunction,
    scatter_rows: CudaFunction,
    add_inplace: CudaFunction,
    add_bias: CudaFunction,
    f32_to_bf16: CudaFunction,
    /// The GEMV kernels for 1..=GEMV_MAX_ROWS rows (index rows - 1).
    gemv: Vec<CudaFunction>,
    gemv_swiglu: Vec<CudaFunction>,
    /// The o projection that merges the mma kernel's splits as it reads them (`fuse=on`), per
    /// row count like `gemv`.
    gemv_merged: Vec<CudaFunction>,
    /// The one-row GEMV and gate/up kernels on a resident grid, each warp streaming its rows
    /// (`TAPEDECK_GEMV_STREAM`, cuda/tune.rs): the same bits as `gemv[0]` and `gemv_swiglu[0]`.
    gemv_stream: CudaFunction,
    gemv_stream_swiglu: CudaFunction,
    /// L2 prefetch of weight ranges (`TAPEDECK_L2_PREFETCH`).
    l2_prefetch: CudaFunction,
    topk_mask: CudaFunction,
    decode_combine: CudaFunction,
    pick_partial: CudaFunction,
    pick_finish: CudaFunction,
    /// The pool's readers and writers, indexed by [`KvElem::index`].
    pool: [PoolKernels; 3],
}

impl Kernels {
    /// The pool kernels for pools of `elem`.
    fn pool(&self, elem: KvElem) -> &PoolKernels {
        &self.pool[elem.index()]
    }
}

/// A compiled kernel file on the device, pointed at the kernel timeline when tracing.
fn load_module(
    ctx: &Arc<CudaContext>,
    src: &kernels::KernelSource,
    arch: &str,
    trace: Option<(&trace::Trace, &Arc<CudaStream>)>,
) -> Result<Arc<cudarc::driver::CudaModule>> {
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(kernels::ptx(src, arch)?))
        .map_err(|e| dev_err(&format!("loading kernels/{}", src.name), e))?;
    if let Some((t, stream)) = trace {
        t.attach(&module, stream)?;
    }
    Ok(module)
}

/// An entry point of a loaded module.
fn load_function(module: &Arc<cudarc::driver::CudaModule>, name: &str) -> Result<CudaFunction> {
    module
        .load_function(name)
        .map_err(|e| dev_err(&format!("kernel {name}"), e))
}

/// An entry point that takes `smem` bytes of dynamic shared memory (above the default 48 KB, so
/// its limit is raised first).
fn load_with_smem(
    module: &Arc<cudarc::driver::CudaModule>,
    name: &str,
    smem: usize,
) -> Result<CudaFunction> {
    let f = load_function(module, name)?;
    // SAFETY: a valid function handle; every caller's size is within sm_80+'s 99 KB opt-in limit.
    unsafe {
        cudarc::driver::sys::cuFuncSetAttribute(
            f.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
    }
    .result()
    .map_err(|e| dev_err(&format!("raising {name}'s shared-memory limit"), e))?;
    Ok(f)
}

impl Kernels {
    fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        head_dim: usize,
        trace: Option<(&trace::Trace, &Arc<CudaStream>)>,
    ) -> Result<Self> {
        let module = load_module(ctx, &kernels::ENGINE, arch, trace)?;
        let f = |name: &str| load_function(&module, name);
        let mma = load_module(ctx, &kernels::DECODE_MMA, arch, trace)?;
        let fused = load_module(ctx, &kernels::FUSED, arch, trace)?;
        let rows = |m: &Arc<cudarc::driver::CudaModule>, stem: &str| {
            (1..=GEMV_MAX_ROWS)
                .map(|n| load_function(m, &format!("{stem}_{n}")))
                .collect::<Result<Vec<_>>>()
        };
        let prefill = match head_dim {
            32 | 64 | 128 => Some(load_module(ctx, &kernels::PREFILL, arch, trace)?),
            _ => None,
        };
        let prefill_mma = match head_dim {
            64 | 128 => Some(load_module(ctx, &kernels::PREFILL_MMA, arch, trace)?),
            _ => None,
        };
        let pool = |elem: KvElem| -> Result<PoolKernels> {
            let sfx = elem.suffix();
            let mma_name = format!("decode_attn_mma{}", elem.mma_suffix());
            Ok(PoolKernels {
                rope_kv_write: f(&format!("rope_kv_write{sfx}"))?,
                gemv_qkv_rope: match elem {
                    KvElem::Fp8 => Vec::new(),
                    _ => rows(&module, &format!("gemv_bf16_qkv_rope{sfx}"))?,
                },
                attention: f(&format!("attention{sfx}"))?,
                attention_scores: f(&format!("attention_scores{sfx}"))?,
                decode_mma: load_with_smem(&mma, &mma_name, kernels::DECODE_MMA_SMEM)?,
                prefill: prefill
                    .as_ref()
                    .map(|m| {
                        load_with_smem(
                            m,
                            &format!("prefill_attention{sfx}_hd{head_dim}"),
                            kernels::prefill_smem(head_dim),
                        )
                    })
                    .transpose()?,
                prefill_mma: prefill_mma
                    .as_ref()
                    .map(|m| {
                        load_with_smem(
                            m,
                            &format!("prefill_attn_mma{}_hd{head_dim}", elem.mma_suffix()),
                            kernels::prefill_mma_smem(head_dim, elem.bytes()),
                        )
                    })
                    .transpose()?,
            })
        };
        Ok(Kernels {
            pool: [pool(KvElem::F32)?, pool(KvElem::Bf16)?, pool(KvElem::Fp8)?],
            decode_combine: load_function(&mma, "decode_attn_combine")?,
            embed_gather: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            silu_mul: f("silu_mul")?,
            scatter_rows: f("scatter_rows")?,
            add_inplace: f("add_inplace")?,
            add_bias: f("add_bias")?,
            f32_to_bf16: f("f32_to_bf16")?,
            gemv: rows(&module, "gemv_bf16")?,
            gemv_swiglu: rows(&module, "gemv_bf16_swiglu")?,
            gemv_merged: rows(&fused, "gemv_bf16_merged")?,
            gemv_stream: f("gemv_stream_bf16_1")?,
            gemv_stream_swiglu: f("gemv_stream_swiglu_1")?,
            l2_prefetch: f("l2_prefetch")?,
            topk_mask: f("topk_mask")?,
            pick_partial: f("pick_partial")?,
            pick_finish: f("pick_finish")?,
        })
    }
}

/// Kernel arguments, each in its own 8-byte slot (CUDA reads 4-byte values from the slot's start
/// on this little-endian host), so the parameter pointers stay valid for the launch.
struct Args {
    slots: [u64; MAX_KERNEL_ARGS],
    n: usize,
}

/// The most parameters a kernel entry point may take (`Args` holds that many); a test counts
/// every entry point's parameters in the sources, since an overflow would only surface on a GPU.
pub(crate) const MAX_KERNEL_ARGS: usize = 32;

impl Args {
    fn new() -> Self {
        Args {
            slots: [0; MAX_KERNEL_ARGS],
            n: 0,
        }
    }

    fn push(mut self, v: u64) -> Self {
        assert!(
            self.n < MAX_KERNEL_ARGS,
            "a kernel launch with more than {MAX_KERNEL_ARGS} arguments"
        );
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

    /// `launch_3d`, with programmatic dependent launch when `pdl` (the kernel may start before
    /// the previous one on the stream ends; it must call `pdl_wait` before reading its input:
    /// the GEMV kernels, RoPE + KV write, RMSNorm, decode attention and its merge and the picks
    /// do).
    fn launch_pdl(
        mut self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        shared_bytes: usize,
        pdl: bool,
    ) -> Result<()> {
        if !pdl {
            return self.launch_3d(stream, func, grid, block, shared_bytes);
        }
        let mut params: Vec<*mut c_void> = self.slots[..self.n]
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: as in `launch_3d`.
        unsafe {
            launch_ex(
                stream,
                func,
                grid,
                block,
                shared_bytes,
                LaunchAttr::Pdl,
                &mut params,
            )
        }
        .map_err(|e| dev_err("kernel launch (PDL)", e))
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

/// The one launch attribute [`launch_ex`] sets.
#[derive(Debug, Clone, Copy)]
enum LaunchAttr {
    /// Programmatic stream serialization: the kernel may start before the previous one on the
    /// stream ends (programmatic dependent launch, sm_90+).
    Pdl,
    /// Every block resident at once, or the launch is refused (grid-wide barriers need it).
    Cooperative,
}

/// `cuLaunchKernelEx` with one launch attribute; capturable into CUDA graphs like a plain launch.
///
/// # Safety
/// `params` must match `func`'s parameters and point at live values; every device pointer among
/// them must be a live buffer of the shape the kernel expects.
unsafe fn launch_ex(
    stream: &CudaStream,
    func: &CudaFunction,
    grid: (usize, usize, usize),
    block: usize,
    shared_bytes: usize,
    attr: LaunchAttr,
    params: &mut [*mut c_void],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    // SAFETY: an all-zero launch attribute value is valid (a plain C union of integers).
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    let id = match attr {
        LaunchAttr::Pdl => {
            value.programmaticStreamSerializationAllowed = 1;
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        }
        LaunchAttr::Cooperative => {
            value.cooperative = 1;
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        }
    };
    let mut attr = sys::CUlaunchAttribute {
        id,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0 as u32,
        gridDimY: grid.1 as u32,
        gridDimZ: grid.2 as u32,
        blockDimX: block as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes as u32,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` outlive the call; the caller vouches for `params`.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
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
    /// Split counters of the mma kernel's own merge, zeroed and left zeroed by every launch.
    mma_done: Option<DevBuf>,
    /// The persistent decode step's rotated queries, one copy per split (splits, heads, head_dim).
    mk_q: Option<DevBuf>,
    /// Token picking: per-chunk statistics and candidates, and the results copied back.
    pick_stats: Option<DevBuf>,
    pick_top: Option<DevBuf>,
    pick_out: Option<DevBuf>,
    /// Bumped whenever a buffer is replaced: captured graphs hold the old addresses.
    generation: u64,
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
    /// bf16 SiLU·up output of the fused gate/up GEMV (the down projection's input; it cannot be
    /// `xb`, which that kernel reads), (n, intermediate)
    act: DevBuf,
}

/// The buffer in `slot`, replaced by a larger one (and `generation` bumped) when it holds fewer
/// than `bytes`.
fn ensure(
    slot: &mut Option<DevBuf>,
    ctx: &Arc<CudaContext>,
    bytes: usize,
    generation: &mut u64,
) -> Result<u64> {
    if slot.as_ref().is_none_or(|b| b.bytes < bytes) {
        *slot = None;
        *slot = Some(DevBuf::new(ctx, bytes.next_power_of_two())?);
        *generation += 1;
    }
    Ok(slot.as_ref().map_or(0, |b| b.ptr))
}

/// [`ensure`] for a buffer whose new allocations start zeroed (the kernels leave it zeroed).
fn ensure_zeroed(
    slot: &mut Option<DevBuf>,
    ctx: &Arc<CudaContext>,
    bytes: usize,
    generation: &mut u64,
) -> Result<u64> {
    let before = *generation;
    let ptr = ensure(slot, ctx, bytes, generation)?;
    if *generation != before {
        let len = slot.as_ref().map_or(0, |b| b.bytes);
        // SAFETY: `ptr` is the live allocation of `len` bytes just made by `ensure`.
        unsafe { dr::memset_d8_sync(ptr, 0, len) }.map_err(|e| dev_err("zeroing", e))?;
    }
    Ok(ptr)
}

/// Most rows the GEMV kernels take (their `GEMV_MAX_ROWS`), and warps per block (`GEMV_WARPS`).
const GEMV_MAX_ROWS: usize = 4;
const GEMV_WARPS: usize = 8;
/// Inputs one GEMV warp holds in its prefetched chunks (32 lanes × `GEMV_PRE` 8 × 8 bf16): the
/// default longest slice (`TAPEDECK_GEMV_SLICE`, cuda/tune.rs, sets a shorter one).
pub(crate) const GEMV_SLICE: usize = 2048;

/// Warps that share one output feature of a GEMV of `n` rows over `inp` inputs: doubled (up to
/// a block) while a warp's slice is longer than what it prefetches, so a long row (the down
/// projection's 8192) is fetched by several warps at once rather than by one in dependent rounds
/// (H200, down projection: 15.5 → 13.3 µs at one row). Each slice must stay a whole number of
/// 16-byte chunks. One warp per feature for 3-4 rows, where splitting measured slower (the
/// kernels for 3-4 rows ignore the argument). `slice`: the longest slice, normally
/// [`GEMV_SLICE`].
fn gemv_splits(inp: usize, n: usize, slice: usize) -> usize {
    let mut s = 1;
    if n > 2 {
        return s;
    }
    while s < GEMV_WARPS && inp > s * slice && inp.is_multiple_of(16 * s) {
        s *= 2;
    }
    s
}
/// Blocks of a streaming GEMV launch (`TAPEDECK_GEMV_STREAM=per_sm`) over `tasks` output
/// features: at most `per_sm` per SM, never more than the tasks need, and where a grid of at
/// least three quarters of that divides the features evenly among its warps, that one: every
/// warp then streams the same number of rows and none is left with a last row alone (llama-1b
/// on 132 SMs: 256 blocks for 8192 gate/up rows, 2048 down or o rows).
fn stream_blocks(sms: usize, per_sm: usize, tasks: usize) -> usize {
    let most = (sms * per_sm).min(tasks.div_ceil(GEMV_WARPS)).max(1);
    (most.div_ceil(4) * 3..=most)
        .rev()
        .find(|&g| g > 0 && tasks.is_multiple_of(g * GEMV_WARPS))
        .unwrap_or(most)
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

/// Layers recorded with RoPE + KV write fused into the q/k/v GEMV, and with the split merge fused
/// into the o GEMV (`fuse=on`), in this process: so a test can tell that each fusion took effect.
static FUSED_ROPE: AtomicU64 = AtomicU64::new(0);
static FUSED_MERGE: AtomicU64 = AtomicU64::new(0);

/// How many layers were recorded so far with the fused q/k/v + RoPE kernel and with the fused
/// split merge (see [`Toggles::fuse`]); a graph replay records nothing, so counts only captures
/// and eager passes.
pub fn fused_layers() -> (u64, u64) {
    (
        FUSED_ROPE.load(Ordering::Relaxed),
        FUSED_MERGE.load(Ordering::Relaxed),
    )
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
    /// Programmatic dependent launch exists (compute capability 9.0 and later).
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
    /// Page-locked buffers for the per-pass copies (`TAPEDECK_HOST_COPIES=pinned`), else none.
    pinned: Option<Pinned>,
}

/// An event that records a time stamp (for [`Backend::device_time`]).
fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| dev_err("creating a timing event", e))
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
            pinned: if tune::get().pinned {
                Some(Pinned::new(&ctx)?)
            } else {
                None
            },
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
        })
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

impl Gpu {
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

    /// `y_j (n, out_j) = x (n, in) · W_jᵀ (+ b_j)` for up to three bf16 matrices sharing the
    /// input, in one launch of the GEMV kernel; with `add`, `y_j +=` it (the residual stream).
    /// `n ≤ GEMV_MAX_ROWS`.
    fn gemv(
        &self,
        mats: &[(&DevLinear, u64)],
        x: GemvIn,
        n: usize,
        add: bool,
        pdl: bool,
    ) -> Result<()> {
        let inp = mats.first().map_or(0, |(l, _)| l.inp);
        let splits = gemv_splits(inp, n, tune::get().gemv_slice);
        let (a, smem) = x.args(Args::new(), n, inp);
        let mut a = a.i(n).i(inp).i(splits).i(usize::from(add));
        // The merging entry point takes one matrix; the others up to three.
        let (kernels, max_mats) = match x {
            GemvIn::Merged(_) => (&self.k.gemv_merged, 1),
            _ => (&self.k.gemv, 3),
        };
        if mats.len() > max_mats {
            return Err(Error::Device(format!(
                "this GEMV takes at most {max_mats} matrices, not {}",
                mats.len()
            )));
        }
        // The streaming kernel takes what `gemv` takes, but not merged splits.
        let stream = match x {
            GemvIn::Merged(_) => None,
            _ => self.stream_grid(n, inp / splits),
        };
        let kernels = match stream {
            Some(_) => std::slice::from_ref(&self.k.gemv_stream),
            None => kernels.as_slice(),
        };
        let mut total = 0;
        for j in 0..max_mats {
            a = match mats.get(j) {
                Some((l, y)) => {
                    total += l.out;
                    a.p(l.w_bf16.ptr).p(bias(l)).p(*y).i(l.out)
                }
                None => a.p(0).p(0).p(0).i(0),
            };
        }
        let grid = match stream {
            Some(per_sm) => stream_blocks(self.sms, per_sm, total),
            None => self.gemv_grid((total * splits).div_ceil(GEMV_WARPS)),
        };
        a.launch_pdl(
            &self.stream,
            gemv_for(kernels, n)?,
            (grid, 1, 1),
            32 * GEMV_WARPS,
            smem,
            pdl && self.pdl_capable,
        )
    }

    /// `out (n, inter) = bf16(silu(x · Wgᵀ) · (x · Wuᵀ))`, the MLP's input to its down
    /// projection, in one launch. `x` is bf16 or the normalized residual stream.
    fn swiglu(
        &self,
        gate: &DevLinear,
        up: &DevLinear,
        x: GemvIn,
        n: usize,
        out: u64,
        pdl: bool,
    ) -> Result<()> {
        if matches!(x, GemvIn::F32(_)) {
            return Err(Error::Device(
                "the fused gate/up kernel takes bf16 or normalized input".into(),
            ));
        }
        let (a, smem) = x.args(Args::new(), n, gate.inp);
        let (kernel, grid) = match self.stream_grid(n, gate.inp) {
            Some(per_sm) => (
                &self.k.gemv_stream_swiglu,
                stream_blocks(self.sms, per_sm, gate.out),
            ),
            None => (
                gemv_for(&self.k.gemv_swiglu, n)?,
                self.gemv_grid(gate.out.div_ceil(GEMV_WARPS)),
            ),
        };
        a.i(n)
            .i(gate.inp)
            .p(gate.w_bf16.ptr)
            .p(bias(gate))
            .p(up.w_bf16.ptr)
            .p(bias(up))
            .p(out)
            .i(gate.out)
            .launch_pdl(
                &self.stream,
                kernel,
                (grid, 1, 1),
                32 * GEMV_WARPS,
                smem,
                pdl && self.pdl_capable,
            )
    }

    /// Blocks per SM of the streaming GEMV kernels for `n` rows whose warps read slices of
    /// `slice` inputs, when `TAPEDECK_GEMV_STREAM` asks for them and they apply (one row, slices
    /// of at most 2048 inputs); `None` for the one-block-per-row-group kernels.
    fn stream_grid(&self, n: usize, slice: usize) -> Option<usize> {
        match self.gemv_stream.load(Ordering::Relaxed) {
            0 => None,
            k if n == 1 && slice <= GEMV_SLICE => Some(k),
            _ => None,
        }
    }

    /// Asks the L2 for up to four byte ranges of weights (`l2_prefetch` in kernels/engine.cu),
    /// launched with PDL so that it runs beside the kernel before it; only where PDL is (a plain
    /// launch would add a kernel boundary to the step instead of hiding one). Empty ranges are
    /// left out, and with none nothing is launched.
    fn l2_prefetch(&self, ranges: &[(u64, usize)]) -> Result<()> {
        let mut wanted = ranges.iter().filter(|r| r.1 >= 16).take(4);
        if !self.pdl_capable || wanted.clone().next().is_none() {
            return Ok(());
        }
        let mut a = Args::new();
        for _ in 0..4 {
            let (ptr, bytes) = wanted.next().copied().unwrap_or((0, 0));
            a = a.p(ptr).p((bytes & !15) as u64);
        }
        a.launch_pdl(
            &self.stream,
            &self.k.l2_prefetch,
            (tune::get().l2_prefetch.blocks, 1, 1),
            128,
            0,
            true,
        )
    }

    /// Blocks of a GEMV launch over `groups` row groups: one per group, or at most
    /// `TAPEDECK_GEMV_GRID` per SM (the kernels then loop, see cuda/tune.rs).
    fn gemv_grid(&self, groups: usize) -> usize {
        match tune::get().gemv_grid {
            0 => groups,
            k => groups.min(k * self.sms),
        }
    }

    /// The q/k/v projections of `n` rows with RoPE and the KV write in their epilogue (`fuse=on`,
    /// KV modes 0 and 1): what `gemv` over q, k and v followed by `rope_kv_write` computes, in one
    /// launch. `x` is bf16 or the normalized residual stream.
    fn qkv_rope(
        &self,
        layer: &DevLayer,
        x: GemvIn,
        n: usize,
        rope: &RopeArgs,
        pdl: bool,
    ) -> Result<()> {
        if matches!(x, GemvIn::F32(_) | GemvIn::Merged(_)) || rope.kv_mode > 1 {
            return Err(Error::Device(
                "the fused q/k/v kernel takes bf16 or normalized input and f32 or bf16 KV".into(),
            ));
        }
        let (a, smem) = x.args(Args::new(), n, layer.q.inp);
        let mut a = a.i(n).i(layer.q.inp);
        for l in [&layer.q, &layer.k, &layer.v] {
            a = a.p(l.w_bf16.ptr).p(bias(l));
        }
        let pairs = (rope.heads + 2 * rope.kv_heads) * rope.head_dim / 2;
        rope.append(a).launch_pdl(
            &self.stream,
            gemv_for(&self.k.pool(rope.elem).gemv_qkv_rope, n)?,
            (pairs.div_ceil(GEMV_WARPS), 1, 1),
            32 * GEMV_WARPS,
            smem,
            pdl && self.pdl_capable,
        )
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
}

impl Inner {
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
        inner
            .timing
            .0
            .record(&inner.gpu.stream)
            .map_err(|e| dev_err("recording a timing event", e))?;
        match &mut inner.pinned {
            Some(pinned) => pinned.upload(pass.meta_ptr, &pass.meta.data, &inner.gpu.stream)?,
            // SAFETY: the meta buffer holds at least `meta.data.len()` i32s.
            None => unsafe {
                dr::memcpy_htod_async(pass.meta_ptr, &pass.meta.data, inner.gpu.stream.cu_stream())
            }
            .map_err(|e| dev_err("uploading batch indices", e))?,
        }
        match pad {
            None => inner.record(cfg, kv, &pass)?,
            Some(pad) => inner.replay(cfg, kv, &pass, pad, toggles)?,
        }
        if pass.mega.is_some() {
            PERSISTENT_STEPS.fetch_add(1, Ordering::Relaxed);
        }
        inner
            .timing
            .1
            .record(&inner.gpu.stream)
            .map_err(|e| dev_err("recording a timing event", e))?;
        for sg in segs.iter_mut() {
            sg.table.len += sg.tokens.len();
        }
        laps.lap(Part::Launch);
        let out = inner.collect(segs, &pass, cfg.vocab_size, &mut laps)?;
        // Both events have completed: collect waited for the stream.
        let (start, end) = &inner.timing;
        let ms = start
            .elapsed_ms(end)
            .map_err(|e| dev_err("reading a timing event", e))?;
        let ns = (f64::from(ms.max(0.0)) * 1e6) as u64;
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        self.passes.fetch_add(1, Ordering::Relaxed);
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
}

/// The first `bytes` of a linear layer's bf16 weights (all of them at most), as an L2 prefetch
/// range: its first rows, which the first blocks of its GEMV read.
fn prefix(l: &DevLinear, bytes: usize) -> (u64, usize) {
    (l.w_bf16.ptr, bytes.min(l.out * l.inp * 2))
}

/// Everything one pass's launches read, fixed before the first of them: a captured graph
/// replays exactly these addresses and shapes.
struct Pass {
    meta: Meta,
    meta_ptr: u64,
    block_size: usize,
    matmul: Precision,
    scale: f32,
    kv_mode: usize,
    /// Attention rounds to bf16 in prefill rows / in decode rows.
    attn_bf16: usize,
    decode_bf16: usize,
    /// Prompt tiles go through the tensor-core prefill kernel (`attn_prefill=mma-bf16`, where
    /// the head_dim has one); the tile list was cut for it.
    prefill_mma: bool,
    /// `decode_topk`: the selection size, its scores buffer and row stride.
    topk: Option<(usize, u64, usize)>,
    /// The mma decode kernel's buffers and split geometry.
    mma: Option<MmaPass>,
    /// How the linear layers run.
    linears: Linears,
    /// The GEMV kernels are launched with programmatic dependent launch (`pdl=on` or `all`).
    pdl: bool,
    /// So are the other kernels of a decode step (`pdl=all`): RoPE + KV write, the mma decode
    /// kernel and its merge, the final RMSNorm and the picks.
    pdl_all: bool,
    /// Kernel fusions on the GEMV path (`fuse=on`, those `TAPEDECK_FUSE` selects): RoPE + KV
    /// write in the q/k/v GEMV, the split merge in the o GEMV, the final norm in the head (each
    /// where its conditions hold, see `record`).
    fuse: tune::Fusions,
    /// The logit rows are the pass's rows in order: the head reads the hidden states in place.
    logits_in_place: bool,
    logits: u64,
    /// Token picking: statistics, candidates, results; chunks per row.
    pick: Option<(u64, u64, u64, usize)>,
    /// The whole step as one persistent kernel (`megakernel=on`, when it applies): its argument
    /// and dynamic shared memory.
    mega: Option<(step::MkParams, usize)>,
}

/// The mma decode kernel's buffers. When every row is a decode row, in order, `q_dec` and
/// `o_dec` are the pass's own query and attention-output buffers (`gather` false); otherwise the
/// decode rows are gathered into them and scattered back.
/// How a pass runs its linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Linears {
    /// cuBLAS GEMMs, with RMSNorm, SiLU·up and residual adds as kernels of their own.
    Cublas,
    /// The GEMV kernels (`small_gemm=gemv`, `matmul=bf16`, few rows), the RMSNorm before q/k/v
    /// and gate/up still its own launch (the rows do not fit the fused norm's shared memory).
    Gemv,
    /// The GEMV kernels with the RMSNorm fused in.
    GemvFusedNorm,
}

struct MmaPass {
    q_dec: u64,
    o_dec: u64,
    gather: bool,
    partial_out: u64,
    partial_ml: u64,
    split_len: usize,
    max_splits: usize,
    /// The split counters, (rows, KV heads) zeroed words, when the mma kernel merges its own
    /// splits (`TAPEDECK_MMA_MERGE=in-kernel`); else 0 and the combine kernel runs.
    done: u64,
}

impl Inner {
    /// Builds the pass's indices and makes sure every buffer it needs exists.
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &mut self,
        ctx: &Arc<CudaContext>,
        cfg: &Config,
        segs: &[Segment<'_>],
        where_: &[(usize, usize)],
        bs: usize,
        toggles: &Toggles,
        pad: Option<Pad>,
        kv: &DeviceKv,
    ) -> Result<Pass> {
        // Tokens per prefill tile: the tiled kernel that will run decides.
        let pk = self.gpu.k.pool(kv.elem);
        let prefill_mma = toggles.attn_prefill == AttnPrefill::MmaBf16 && pk.prefill_mma.is_some();
        let tile_rows = if prefill_mma {
            Some(kernels::prefill_mma_rows(cfg.head_dim))
        } else {
            pk.prefill.as_ref().map(|_| kernels::PREFILL_ROWS)
        };
        let tile_tokens = tile_rows
            .map(|rows| rows / (cfg.num_heads / cfg.num_kv_heads))
            .filter(|&t| t > 0);
        let meta = build_meta(segs, where_, bs, cfg.vocab_size, toggles, pad, tile_tokens);
        let rows = meta.rows;
        self.ensure_scratch(ctx, cfg, rows)?;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let q_dim = nh * hd;
        let sms = self.gpu.sms;
        let linears = if toggles.small_gemm == SmallGemm::Gemv
            && toggles.matmul == Precision::Bf16
            && rows <= GEMV_MAX_ROWS
            && self.gemv_fits
        {
            if rows * cfg.hidden_size * 2 <= GEMV_NORM_SMEM {
                Linears::GemvFusedNorm
            } else {
                Linears::Gemv
            }
        } else {
            Linears::Cublas
        };
        let sc = &mut self.scratch;
        let (q_buf, att_buf) = match &sc.bufs {
            Some(b) => (b.q.ptr, b.att.ptr),
            None => return Err(Error::Device("scratch buffers missing".into())),
        };
        let in_order = |at: usize, count: usize| {
            count == rows && meta.data[at..at + count].iter().copied().eq(0..rows as i32)
        };
        let decode_in_order = in_order(meta.decode_rows, meta.n_decode_rows);
        let logits_in_place = in_order(meta.logit_rows, meta.n_logit_rows);
        let g = &mut sc.generation;
        let meta_ptr = ensure(&mut sc.meta, ctx, meta.data.len() * 4, g)?;
        // The longest context a decode row may have: the real one, or the graph's capacity.
        let decode_ctx = &meta.data[meta.decode_ctx..meta.decode_ctx + meta.n_decode_rows];
        let max_len = match pad {
            Some(p) => p.max_blocks * bs,
            None => decode_ctx.iter().map(|&c| c as usize).max().unwrap_or(1),
        };
        let nr = meta.n_decode_rows;
        let topk = match (toggles.decode_topk, nr) {
            (Some(k), 1..) => {
                let stride = max_len.max(1);
                let scores = ensure(&mut sc.scores, ctx, nr * nh * stride * 4, g)?;
                Some((k.get(), scores, stride))
            }
            _ => None,
        };
        let mma_shape_ok = matches!(hd, 64 | 128) && nh / nkv <= 16 && bs.is_multiple_of(16);
        let mma = if toggles.attn_decode == AttnDecode::MmaBf16
            && topk.is_none()
            && mma_shape_ok
            && nr > 0
        {
            let (split_len, max_splits) = split_rule(nr, nkv, max_len, sms, tune::get().split_min);
            let (q_dec, o_dec) = if decode_in_order {
                (q_buf, att_buf)
            } else {
                (
                    ensure(&mut sc.q_dec, ctx, nr * q_dim * 4, g)?,
                    ensure(&mut sc.o_dec, ctx, nr * q_dim * 4, g)?,
                )
            };
            Some(MmaPass {
                q_dec,
                o_dec,
                gather: !decode_in_order,
                partial_out: ensure(&mut sc.partial_out, ctx, nr * nh * max_splits * hd * 4, g)?,
                partial_ml: ensure(&mut sc.partial_ml, ctx, nr * nh * max_splits * 2 * 4, g)?,
                split_len,
                max_splits,
                done: if tune::get().mma_merge_in_kernel {
                    ensure_zeroed(&mut sc.mma_done, ctx, nr * nkv * 4, g)?
                } else {
                    0
                },
            })
        } else {
            None
        };
        let vocab = cfg.vocab_size;
        let r = meta.n_logit_rows;
        let logits = if r > 0 {
            ensure(&mut sc.logits, ctx, r * vocab * 4, g)?
        } else {
            0
        };
        let pick = if meta.n_picks > 0 {
            let (p, k, chunks) = (meta.n_picks, meta.pick_k, vocab.div_ceil(PICK_CHUNK));
            Some((
                ensure(&mut sc.pick_stats, ctx, p * chunks * 3 * 8, g)?,
                ensure(&mut sc.pick_top, ctx, p * chunks * k * 8, g)?,
                ensure(&mut sc.pick_out, ctx, p * pick_words(k) * 4, g)?,
                chunks,
            ))
        } else {
            None
        };
        let kv_mode: usize = match toggles.kv_dtype {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
            KvDtype::Fp8E4m3 => 2,
        };
        let mega_applies = toggles.megakernel
            && linears == Linears::GemvFusedNorm
            && rows == 1
            && nr == 1
            && logits_in_place
            && meta.n_logit_rows == 1
            && meta.n_simt_rows == 0
            && meta.n_tiles == 0
            && kv.elem != KvElem::Fp8
            && matches!(hd, 64 | 128);
        let mega = match (&mma, mega_applies) {
            (Some(m), true) if !m.gather => {
                let smem = kernels::DECODE_MMA_SMEM.max(cfg.hidden_size * 2);
                let mk = match &mut self.mega {
                    Some(mk) => mk,
                    slot => {
                        let trace = self.gpu.trace.as_ref().map(|t| (t, &self.gpu.stream));
                        let mk =
                            step::Megakernel::load(ctx, &self.gpu.arch, sms, smem, nkv, trace)?;
                        slot.insert(mk)
                    }
                };
                let (table, rebuilt) = mk.table(ctx, &self.layers, kv, kv_key(kv))?;
                if rebuilt {
                    // Graphs captured with the old table must never run again.
                    self.scratch.generation += 1;
                }
                let q_scr = ensure(
                    &mut self.scratch.mk_q,
                    ctx,
                    m.max_splits * q_dim * 4,
                    &mut self.scratch.generation,
                )?;
                let (bar, done) = mk.state();
                let b = self
                    .scratch
                    .bufs
                    .as_ref()
                    .ok_or_else(|| Error::Device("scratch buffers missing".into()))?;
                let mi = |off: usize| meta_ptr + (off * 4) as u64;
                let int = |v: usize| v as i32;
                let slice = tune::get().gemv_slice;
                Some((
                    step::MkParams {
                        x: b.x.ptr,
                        q: b.q.ptr,
                        k: b.k.ptr,
                        v: b.v.ptr,
                        att: b.att.ptr,
                        act: b.act.ptr,
                        logits,
                        layers: table,
                        bar,
                        done,
                        q_scr,
                        head_w: self.head.w_bf16.ptr,
                        head_b: bias(&self.head),
                        final_norm: self.norm.ptr,
                        inv_freq: self.inv_freq.ptr,
                        pos: mi(meta.pos),
                        slots: mi(meta.slots),
                        tables: mi(meta.decode_tables),
                        ctx: mi(meta.decode_ctx),
                        partial_out: m.partial_out,
                        partial_ml: m.partial_ml,
                        n_layers: int(self.layers.len()),
                        hidden: int(cfg.hidden_size),
                        inter: int(cfg.intermediate_size),
                        heads: int(nh),
                        kv_heads: int(nkv),
                        head_dim: int(hd),
                        vocab: int(vocab),
                        block_size: int(bs),
                        max_blocks: int(meta.max_blocks),
                        split_len: int(m.split_len),
                        max_splits: int(m.max_splits),
                        kv_mode: int(kv_mode),
                        splits_qkv: int(gemv_splits(cfg.hidden_size, 1, slice)),
                        splits_o: int(gemv_splits(q_dim, 1, slice)),
                        splits_down: int(gemv_splits(cfg.intermediate_size, 1, slice)),
                        splits_head: int(gemv_splits(cfg.hidden_size, 1, slice)),
                        eps: cfg.rms_norm_eps,
                        scale: 1.0 / (hd as f32).sqrt(),
                    },
                    smem,
                ))
            }
            _ => None,
        };
        Ok(Pass {
            mega,
            meta,
            meta_ptr,
            block_size: bs,
            matmul: toggles.matmul,
            scale: 1.0 / (hd as f32).sqrt(),
            kv_mode,
            attn_bf16: usize::from(toggles.attention_bf16(false)),
            decode_bf16: usize::from(toggles.attention_bf16(true)),
            prefill_mma,
            topk,
            mma,
            linears,
            pdl: toggles.pdl != Pdl::Off,
            pdl_all: toggles.pdl == Pdl::All && self.gpu.pdl_capable,
            fuse: if toggles.fuse && linears != Linears::Cublas {
                tune::get().fuse
            } else {
                tune::Fusions::NONE
            },
            logits_in_place,
            logits,
            pick,
        })
    }

    /// Runs a graph pass: replays the graph captured for this shape, capturing it first when
    /// there is none (captured work does not run, so the first replay is the computation).
    fn replay(
        &mut self,
        cfg: &Config,
        kv: &DeviceKv,
        pass: &Pass,
        pad: Pad,
        toggles: &Toggles,
    ) -> Result<()> {
        let key = GraphKey {
            pad,
            toggles: *toggles,
            pick_k: pass.meta.pick_k,
            kv: kv_key(kv),
            generation: self.scratch.generation,
        };
        if !self.graphs.contains_key(&key) {
            // Graphs of older buffers can never match again.
            let generation = self.scratch.generation;
            self.graphs.retain(|k, _| k.generation == generation);
            if self.graphs.len() >= GRAPH_CACHE {
                self.graphs.clear();
            }
            use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
            self.gpu
                .stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| dev_err("starting a CUDA graph capture", e))?;
            let recorded = self.record(cfg, kv, pass);
            // End the capture whatever happened, so the stream is usable again.
            let graph = self.gpu.stream.end_capture(CUgraphInstantiate_flags(0));
            recorded?;
            let graph = graph
                .map_err(|e| dev_err("capturing a decode step as a CUDA graph", e))?
                .ok_or_else(|| Error::Device("a CUDA graph capture recorded nothing".into()))?;
            self.graphs.insert(key, Graph(graph));
        }
        self.graphs
            .get(&key)
            .ok_or_else(|| Error::Device("a captured CUDA graph went missing".into()))?
            .0
            .launch()
            .map_err(|e| dev_err("launching a CUDA graph", e))
    }

    /// Launches the whole pass on the stream: embedding, layers, final norm, head, picks. Nothing
    /// here copies to or from the host, allocates or synchronizes, so it can be captured.
    fn record(&self, cfg: &Config, kv: &DeviceKv, pass: &Pass) -> Result<()> {
        let meta = &pass.meta;
        let n = meta.rows;
        let mi = |off: usize| pass.meta_ptr + (off * 4) as u64;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let (q_dim, inter) = (nh * hd, cfg.intermediate_size);
        let (bs, pm) = (pass.block_size, pass.matmul);
        let Some(b) = self.scratch.bufs.as_ref() else {
            return Err(Error::Device("scratch buffers missing".into()));
        };
        let (x, xn, q, k, v, att, tmp, g, u, xb, act) = (
            b.x.ptr, b.xn.ptr, b.q.ptr, b.k.ptr, b.v.ptr, b.att.ptr, b.tmp.ptr, b.g.ptr, b.u.ptr,
            b.xb.ptr, b.act.ptr,
        );
        let s = &self.gpu.stream;
        let kn = &self.gpu.k;
        let pk = kn.pool(kv.elem);
        let elementwise = (n * h).div_ceil(256);
        Args::new()
            .p(x)
            .p(self.embed.ptr)
            .p(mi(meta.ids))
            .i(h)
            .launch(s, &kn.embed_gather, (n, 1), 256)?;
        if let Some((params, smem)) = &pass.mega {
            self.mega
                .as_ref()
                .ok_or_else(|| Error::Device("the decode step kernel is not loaded".into()))?
                .launch(s, params, *smem, kv.elem)?;
            return self.record_picks(pass);
        }
        // RMSNorm of `rows` rows of `src`, written as the next GEMM's input: f32 into `xn`, or
        // rounded to bf16 into `xb` in the same launch. Returns where it went.
        // `early`: launched with PDL (pdl=all).
        let norm_pdl = |src: u64, w: u64, rows: usize, early: bool| -> Result<u64> {
            let (out, out_bf16) = match pm {
                Precision::F32 => (xn, 0),
                Precision::Bf16 => (0, xb),
            };
            Args::new()
                .p(out)
                .p(out_bf16)
                .p(src)
                .p(w)
                .i(h)
                .f(cfg.rms_norm_eps)
                .launch_pdl(s, &kn.rms_norm, (rows, 1, 1), 256, 0, early)?;
            Ok(out.max(out_bf16))
        };
        let norm = |src: u64, w: u64, rows: usize| norm_pdl(src, w, rows, false);
        let early = pass.pdl_all;
        // The GEMV kernels' input: the residual stream normalized with `w`, by the kernel itself
        // or by the RMSNorm kernel before it.
        let gemv_normed = |w: u64| -> Result<GemvIn> {
            Ok(match pass.linears {
                Linears::GemvFusedNorm => GemvIn::Normed {
                    x,
                    w,
                    eps: cfg.rms_norm_eps,
                },
                _ => GemvIn::Bf16(norm(x, w, n)?),
            })
        };
        let (gemv, pdl) = (pass.linears != Linears::Cublas, pass.pdl);
        // FP8 KV scales each head by its amax: that mode keeps the separate RoPE + KV kernel.
        let rope_fused = pass.fuse.rope && pass.kv_mode <= 1;
        // The L2 prefetches `TAPEDECK_L2_PREFETCH` asks for, in one-row GEMV passes with PDL.
        let prefetch = tune::get().l2_prefetch;
        let prefetching = gemv && pdl && n == 1 && prefetch.any();
        let all = usize::MAX;
        for (li, layer) in self.layers.iter().enumerate() {
            let qkv = [(&layer.q, q), (&layer.k, k), (&layer.v, v)];
            let [kp, vp, ksc, vsc] = kv.layer(li);
            let rope = RopeArgs {
                q,
                k,
                v,
                k_pool: kp,
                v_pool: vp,
                k_scale: ksc,
                v_scale: vsc,
                pos: mi(meta.pos),
                inv_freq: self.inv_freq.ptr,
                slots: mi(meta.slots),
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
                kv_mode: pass.kv_mode,
                elem: kv.elem,
            };
            if rope_fused {
                self.gpu
                    .qkv_rope(layer, gemv_normed(layer.attn_norm.ptr)?, n, &rope, pdl)?;
                FUSED_ROPE.fetch_add(1, Ordering::Relaxed);
            } else if gemv {
                self.gpu
                    .gemv(&qkv, gemv_normed(layer.attn_norm.ptr)?, n, false, pdl)?;
            } else {
                let xin = norm(x, layer.attn_norm.ptr, n)?;
                for (l, y) in qkv {
                    self.gpu.linear(l, xin, n, y, pm)?;
                }
            }
            // While the attention runs, the L2 may fetch what the o and MLP GEMVs read next.
            if prefetching {
                self.gpu.l2_prefetch(&[
                    prefix(&layer.o, if prefetch.o { all } else { 0 }),
                    prefix(&layer.gate, prefetch.mlp_bytes / 2),
                    prefix(&layer.up, prefetch.mlp_bytes / 2),
                ])?;
            }
            // The o projection's input: the attention output, or (fused) the mma kernel's splits.
            let mut o_in = GemvIn::F32(att);
            if !rope_fused {
                rope.append(Args::new()).launch_pdl(
                    s,
                    &pk.rope_kv_write,
                    (n, nh + nkv, 1),
                    hd.div_ceil(32) * 32,
                    0,
                    early,
                )?;
            }
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
            let heads = |a: Args, bf16: usize| a.i(nh).i(nkv).i(hd).i(bs).f(pass.scale).i(bf16);
            let attention = |rows: u64, n_rows: usize, scores: u64, stride: usize, bf16: usize| {
                let a = context(Args::new().p(att).p(q).p(kp).p(vp).p(ksc).p(vsc), rows);
                heads(a.p(scores).i(stride), bf16).launch(s, &pk.attention, (n_rows, nh), 128)
            };
            // Prompt chunks through a tiled kernel (same arguments as `attention`, with the
            // tile list where it takes rows and scores): the tensor-core one, or the SIMT one.
            // (`pass.prefill_mma` was decided, and the tile list cut, where the kernel exists.)
            let tiled = if pass.prefill_mma {
                pk.prefill_mma.as_ref().map(|f| {
                    let smem = kernels::prefill_mma_smem(hd, kv.elem.bytes());
                    (f, kernels::PREFILL_MMA_THREADS, smem)
                })
            } else {
                pk.prefill
                    .as_ref()
                    .map(|f| (f, 256, kernels::prefill_smem(hd)))
            };
            if let (Some((f, threads, smem)), 1..) = (tiled, meta.n_tiles) {
                let a = context(
                    Args::new().p(att).p(q).p(kp).p(vp).p(ksc).p(vsc),
                    mi(meta.tiles),
                );
                heads(a, pass.attn_bf16).launch_3d(
                    s,
                    f,
                    (meta.n_tiles * nkv, 1, 1),
                    threads,
                    smem,
                )?;
            }
            if meta.n_simt_rows > 0 {
                attention(mi(meta.simt_rows), meta.n_simt_rows, 0, 0, pass.attn_bf16)?;
            }
            // Decode steps recomputed by their own kernel settings: bf16 operands for
            // attn_decode=mma-bf16 (the SIMT kernel with the tensor-core kernel's roundings), and
            // the sparse top-k selection.
            let (rows, nr) = (mi(meta.decode_rows), meta.n_decode_rows);
            if let Some((top_k, scores, stride)) = pass.topk {
                let a = context(Args::new().p(scores).i(stride).p(q).p(kp).p(ksc), rows);
                heads(a, pass.decode_bf16).launch(s, &pk.attention_scores, (nr, nh), 128)?;
                Args::new()
                    .p(scores)
                    .i(stride)
                    .p(mi(meta.ctx))
                    .p(rows)
                    .i(nh)
                    .i(top_k)
                    .launch(s, &kn.topk_mask, (nr, nh), 256)?;
                attention(rows, nr, scores, stride, pass.decode_bf16)?;
            } else if let Some(m) = &pass.mma {
                // The bf16 tensor-core kernel on the decode rows: gather their queries (unless
                // they are all the rows), attend, merge the splits, scatter the outputs back.
                if m.gather {
                    Args::new().p(m.q_dec).p(q).p(rows).i(q_dim).launch(
                        s,
                        &kn.embed_gather,
                        (nr, 1),
                        256,
                    )?;
                }
                Args::new()
                    .p(m.o_dec)
                    .p(m.q_dec)
                    .p(kp)
                    .p(vp)
                    .p(mi(meta.decode_tables))
                    .p(mi(meta.decode_ctx))
                    .p(m.partial_out)
                    .p(m.partial_ml)
                    .i(meta.max_blocks)
                    .i(nh)
                    .i(nkv)
                    .i(bs)
                    .i(hd)
                    .i(m.split_len)
                    .i(m.max_splits)
                    .f(pass.scale)
                    .p(m.done)
                    .p(ksc)
                    .p(vsc)
                    .launch_pdl(
                        s,
                        &pk.decode_mma,
                        (nkv, nr, m.max_splits),
                        128,
                        kernels::DECODE_MMA_SMEM,
                        early,
                    )?;
                let merged = MergedSplits {
                    att: m.o_dec,
                    partial_out: m.partial_out,
                    partial_ml: m.partial_ml,
                    ctx: mi(meta.decode_ctx),
                    heads: nh,
                    head_dim: hd,
                    split_len: m.split_len,
                    max_splits: m.max_splits,
                };
                // The o GEMV merges the splits itself when every row is a decode row in order
                // and the merged rows fit its shared memory.
                if pass.fuse.merge
                    && m.done == 0
                    && !m.gather
                    && m.max_splits <= FUSED_MERGE_MAX_SPLITS
                    && merged.smem(n, q_dim) <= GEMV_NORM_SMEM
                {
                    o_in = GemvIn::Merged(merged);
                    FUSED_MERGE.fetch_add(1, Ordering::Relaxed);
                } else if m.done == 0 && m.max_splits > 1 {
                    // With one split the mma kernel writes the attention output itself.
                    Args::new()
                        .p(m.o_dec)
                        .p(m.partial_out)
                        .p(m.partial_ml)
                        .p(mi(meta.decode_ctx))
                        .i(nh)
                        .i(hd)
                        .i(m.split_len)
                        .i(m.max_splits)
                        .launch_pdl(s, &kn.decode_combine, (nh, nr, 1), 256, 0, early)?;
                }
                if m.gather {
                    Args::new().p(att).p(m.o_dec).p(rows).i(q_dim).launch(
                        s,
                        &kn.scatter_rows,
                        (nr, 1),
                        256,
                    )?;
                }
            } else if nr > 0 {
                // Shapes the tensor-core kernel does not take (head_dim other than 64 or 128,
                // more than 16 query heads per KV head): the SIMT kernel with its roundings.
                attention(rows, nr, 0, 0, pass.decode_bf16)?;
            }
            if gemv {
                // x += o(att), then x += down(silu(gate(xn)) · up(xn)): three launches (and the
                // L2 prefetches asked for beside them).
                self.gpu.gemv(&[(&layer.o, x)], o_in, n, true, pdl)?;
                if prefetching {
                    self.gpu
                        .l2_prefetch(&[prefix(&layer.down, prefetch.down_bytes)])?;
                }
                let xin = gemv_normed(layer.mlp_norm.ptr)?;
                self.gpu.swiglu(&layer.gate, &layer.up, xin, n, act, pdl)?;
                if let (true, Some(next)) = (prefetching && prefetch.next, self.layers.get(li + 1))
                {
                    let [q, k, v] = [&next.q, &next.k, &next.v].map(|l| prefix(l, all));
                    self.gpu.l2_prefetch(&[q, k, v])?;
                }
                self.gpu
                    .gemv(&[(&layer.down, x)], GemvIn::Bf16(act), n, true, pdl)?;
                continue;
            }
            let ain = self.gpu.gemm_input(att, n * q_dim, xb, pm)?;
            self.gpu.linear(&layer.o, ain, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
            let xin = norm(x, layer.mlp_norm.ptr, n)?;
            self.gpu.linear(&layer.gate, xin, n, g, pm)?;
            self.gpu.linear(&layer.up, xin, n, u, pm)?;
            // silu(g)·u, in place in f32 or rounded into `xb` for a bf16 down projection.
            let gin = match pm {
                Precision::F32 => g,
                Precision::Bf16 => xb,
            };
            Args::new()
                .p(g)
                .p(if gin == xb { xb } else { 0 })
                .p(u)
                .i(n * inter)
                .launch(s, &kn.silu_mul, ((n * inter).div_ceil(256), 1), 256)?;
            self.gpu.linear(&layer.down, gin, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
        }
        // Final norm and head on the rows asked for: gather them (into `tmp`), norm, project;
        // then pick tokens where asked.
        let r = meta.n_logit_rows;
        if r == 0 {
            return Ok(());
        }
        let rows_in = if pass.logits_in_place {
            x
        } else {
            Args::new().p(tmp).p(x).p(mi(meta.logit_rows)).i(h).launch(
                s,
                &kn.embed_gather,
                (r, 1),
                256,
            )?;
            tmp
        };
        if gemv {
            // With `fuse.head` the final RMSNorm runs inside the head's GEMV, as before q/k/v and
            // gate/up.
            let hin = if pass.fuse.head && pass.linears == Linears::GemvFusedNorm {
                GemvIn::Normed {
                    x: rows_in,
                    w: self.norm.ptr,
                    eps: cfg.rms_norm_eps,
                }
            } else {
                GemvIn::Bf16(norm_pdl(rows_in, self.norm.ptr, r, early)?)
            };
            self.gpu
                .gemv(&[(&self.head, pass.logits)], hin, r, false, pdl)?;
            // Beside the head, the next step's first weights.
            if let (true, Some(first)) = (prefetching && prefetch.first, self.layers.first()) {
                let [q, k, v, o] = [&first.q, &first.k, &first.v, &first.o].map(|l| prefix(l, all));
                self.gpu.l2_prefetch(&[q, k, v, o])?;
            }
        } else {
            let hin = norm_pdl(rows_in, self.norm.ptr, r, early)?;
            self.gpu.linear(&self.head, hin, r, pass.logits, pm)?;
        }
        self.record_picks(pass)
    }

    /// The token picks of a pass (after its head), where asked.
    fn record_picks(&self, pass: &Pass) -> Result<()> {
        let (meta, s, kn, early) = (&pass.meta, &self.gpu.stream, &self.gpu.k, pass.pdl_all);
        let mi = |off: usize| pass.meta_ptr + (off * 4) as u64;
        let vocab = self.head.out;
        if let Some((stats, top, out, chunks)) = pass.pick {
            let (p, k) = (meta.n_picks, meta.pick_k);
            Args::new()
                .p(pass.logits)
                .i(vocab)
                .p(mi(meta.pick_rows))
                .i(k)
                .p(stats)
                .p(top)
                .launch_pdl(s, &kn.pick_partial, (p, chunks, 1), 256, 0, early)?;
            Args::new()
                .p(pass.logits)
                .i(vocab)
                .p(mi(meta.pick_rows))
                .p(mi(meta.pick_chosen))
                .i(k)
                .i(chunks)
                .p(stats)
                .p(top)
                .p(out)
                .launch_pdl(s, &kn.pick_finish, (p, 1, 1), 256, 0, early)?;
        }
        Ok(())
    }

    /// Copies back what each segment asked for (picked tokens, or whole rows) and waits for the
    /// pass to finish (timed as [`Part::Wait`] in `laps`).
    fn collect(
        &mut self,
        segs: &[Segment<'_>],
        pass: &Pass,
        vocab: usize,
        laps: &mut Laps,
    ) -> Result<Vec<Logits>> {
        let meta = &pass.meta;
        let stream = self.gpu.stream.cu_stream();
        let words = pick_words(meta.pick_k);
        let n_words = meta.n_picks * words;
        let pinned = self.pinned.as_mut().filter(|_| pass.pick.is_some());
        let mut picks = if pinned.is_some() {
            Vec::new()
        } else {
            vec![0u32; n_words]
        };
        match (pass.pick, pinned) {
            (Some((_, _, out, _)), Some(pinned)) => {
                pinned.download(out, n_words, &self.gpu.stream)?;
            }
            // SAFETY: the buffer holds n_picks × pick_words(pick_k) words.
            (Some((_, _, out, _)), None) => {
                unsafe { dr::memcpy_dtoh_async(&mut picks, out, stream) }
                    .map_err(|e| dev_err("downloading picked tokens", e))?
            }
            (None, _) => {}
        }
        // Rows for the segments that sample on the host (or keep more alternatives than the
        // device picks), each segment's rows contiguous in the logits buffer.
        let mut rows: Vec<Option<Vec<f32>>> = segs.iter().map(|_| None).collect();
        let mut at = 0usize;
        for (i, sg) in segs.iter().enumerate() {
            let n = sg.logit_rows().len();
            if n > 0 && meta.pick_slot[i].is_none() {
                let mut host = vec![0.0f32; n * vocab];
                let src = pass.logits + (at * vocab * 4) as u64;
                // SAFETY: rows at..at+n lie inside the logits buffer.
                unsafe { dr::memcpy_dtoh_async(&mut host, src, stream) }
                    .map_err(|e| dev_err("downloading logits", e))?;
                rows[i] = Some(host);
            }
            at += n;
        }
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| dev_err("forward pass", e))?;
        laps.lap(Part::Wait);
        let picks = match (&mut self.pinned, pass.pick) {
            (Some(pinned), Some(_)) => pinned.downloaded(n_words)?,
            _ => &picks[..],
        };
        Ok(segs
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(i, (sg, host))| match (meta.pick_slot[i], host) {
                (Some(slot), _) => parse_pick(
                    &picks[slot * words..(slot + 1) * words],
                    device_pick(sg.want, vocab).map_or(0, |p| p.k),
                ),
                (None, Some(host)) => match sg.want {
                    WantLogits::Pick(p) => Logits::pick(&host, p),
                    _ => Logits::Rows(host),
                },
                (None, None) => Logits::Rows(Vec::new()),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_slices_are_whole_chunks_and_fit_the_prefetch() {
        for (inp, want) in [
            (64, 1),
            (2048, 1),
            (2056, 1),
            (2064, 2),
            (3072, 2),
            (8192, 4),
            (8200, 1),
        ] {
            assert_eq!(gemv_splits(inp, 1, GEMV_SLICE), want, "{inp} inputs");
            assert_eq!(gemv_splits(inp, 2, GEMV_SLICE), want, "{inp} inputs");
            assert_eq!(gemv_splits(inp, 3, GEMV_SLICE), 1, "{inp} inputs, 3 rows");
        }
        for inp in (8..70_000).step_by(8) {
            let s = gemv_splits(inp, 1, GEMV_SLICE);
            assert!(GEMV_WARPS.is_multiple_of(s), "{inp}: {s}");
            assert!(
                (inp / s).is_multiple_of(8) && inp.is_multiple_of(s),
                "{inp}: {s}"
            );
            // Split no further only when a block is full, the slice fits, or halves would not be
            // whole chunks.
            let stop = s == GEMV_WARPS || inp / s <= GEMV_SLICE || !inp.is_multiple_of(16 * s);
            assert!(stop, "{inp}: {s}");
        }
    }

    #[test]
    fn streaming_grids_split_the_rows_evenly_where_they_can() {
        assert_eq!(stream_blocks(132, 2, 8192), 256);
        assert_eq!(stream_blocks(132, 1, 8192), 128);
        assert_eq!(stream_blocks(132, 2, 2048), 256);
        // 3072 = 8 * 384: no grid of 198..=264 blocks divides it.
        assert_eq!(stream_blocks(132, 2, 3072), 264);
        assert_eq!(
            stream_blocks(132, 2, 40),
            5,
            "no more blocks than rows need"
        );
        assert_eq!(stream_blocks(132, 2, 1), 1);
        for tasks in 1..3000 {
            let g = stream_blocks(132, 2, tasks);
            assert!((1..=264).contains(&g), "{tasks}: {g}");
        }
    }

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
