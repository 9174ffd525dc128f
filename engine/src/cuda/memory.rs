//! Device memory the backend owns: raw allocations freed on drop ([`DevBuf`]), the KV pool's
//! per-layer buffers that grow by doubling ([`DeviceKv`]), and the activation scratch of a pass,
//! grown to the largest batch seen ([`Scratch`]).

use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::CudaContext;

use super::dev_err;
use crate::error::Result;
use crate::toggles::KvDtype;

/// A device allocation owned by Rust: freed on drop. Raw device pointers keep kernel arguments
/// and cuBLAS calls simple; the context is kept alive by the `Arc`.
pub(super) struct DevBuf {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({} bytes)", self.bytes)
    }
}

impl DevBuf {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
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
    pub(super) fn from_slice<T: Copy>(ctx: &Arc<CudaContext>, data: &[T]) -> Result<Self> {
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
    pub(super) fn for_dtype(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => KvElem::F32,
            KvDtype::Bf16 => KvElem::Bf16,
            KvDtype::Fp8E4m3 => KvElem::Fp8,
        }
    }

    /// Bytes per element (an FP8 pool's scales come on top).
    pub(super) fn bytes(self) -> usize {
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
    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// The suffix of the kernels' entry points for this element type.
    pub(super) fn suffix(self) -> &'static str {
        match self {
            KvElem::F32 => "",
            KvElem::Bf16 => "_bf16kv",
            KvElem::Fp8 => "_fp8kv",
        }
    }

    /// The suffix of the tensor-core kernels' entry points, which name every element type
    /// (`decode_attn_mma_f32kv`, `prefill_attn_mma_bf16kv_hd64`).
    pub(super) fn mma_suffix(self) -> &'static str {
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
    pub(super) k: Vec<DevBuf>,
    pub(super) v: Vec<DevBuf>,
    /// FP8 pools only (empty otherwise): one f32 scale per position and KV head, per layer.
    pub(super) k_scale: Vec<DevBuf>,
    pub(super) v_scale: Vec<DevBuf>,
    /// Elements per layer in use.
    pub(super) per_layer: usize,
    pub(super) head_dim: usize,
    pub(super) elem: KvElem,
    pub(super) ctx: Arc<CudaContext>,
}

impl DeviceKv {
    pub(super) fn new(
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
    pub(super) fn layer(&self, li: usize) -> [u64; 4] {
        let scale = |s: &[DevBuf]| s.get(li).map_or(0, |b| b.ptr);
        [
            self.k[li].ptr,
            self.v[li].ptr,
            scale(&self.k_scale),
            scale(&self.v_scale),
        ]
    }

    /// Every buffer's address: what graphs and the decode-step kernel's layer table baked in.
    pub(super) fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
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
pub(super) fn grow_buf(
    ctx: &Arc<CudaContext>,
    buf: &mut DevBuf,
    used: usize,
    want: usize,
) -> Result<()> {
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

/// Activation buffers of one forward pass, grown to the largest batch seen and reused.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) tokens: usize,
    pub(super) bufs: Option<ScratchBufs>,
    pub(super) meta: Option<DevBuf>,
    pub(super) scores: Option<DevBuf>,
    pub(super) logits: Option<DevBuf>,
    /// Decode rows' queries and outputs for the mma kernel, (rows, heads, head_dim).
    pub(super) q_dec: Option<DevBuf>,
    pub(super) o_dec: Option<DevBuf>,
    /// Split-K workspace: outputs (rows, heads, splits, head_dim) and (max, sum) pairs.
    pub(super) partial_out: Option<DevBuf>,
    pub(super) partial_ml: Option<DevBuf>,
    /// Split counters of the mma kernel's own merge, zeroed and left zeroed by every launch.
    pub(super) mma_done: Option<DevBuf>,
    /// The persistent decode step's rotated queries, one copy per split (splits, heads, head_dim).
    pub(super) mk_q: Option<DevBuf>,
    /// The MLP dataflow kernel's counters (one zeroed set per layer, left zeroed by every
    /// launch) and its down-projection slice sums.
    pub(super) mlp_counters: Option<DevBuf>,
    pub(super) mlp_partial: Option<DevBuf>,
    /// Token picking: per-chunk statistics and candidates, and the results copied back.
    pub(super) pick_stats: Option<DevBuf>,
    pub(super) pick_top: Option<DevBuf>,
    pub(super) pick_out: Option<DevBuf>,
    /// Bumped whenever a buffer is replaced: captured graphs hold the old addresses.
    pub(super) generation: u64,
}

pub(super) struct ScratchBufs {
    /// (n, hidden)
    pub(super) x: DevBuf,
    /// (n, hidden)
    pub(super) xn: DevBuf,
    /// (n, heads, head_dim)
    pub(super) q: DevBuf,
    /// (n, kv_heads, head_dim)
    pub(super) k: DevBuf,
    /// (n, kv_heads, head_dim)
    pub(super) v: DevBuf,
    /// (n, heads, head_dim)
    pub(super) att: DevBuf,
    /// (n, hidden)
    pub(super) tmp: DevBuf,
    /// (n, intermediate)
    pub(super) g: DevBuf,
    /// (n, intermediate)
    pub(super) u: DevBuf,
    /// bf16 GEMM input, (n, max(hidden, heads·head_dim, intermediate))
    pub(super) xb: DevBuf,
    /// bf16 SiLU·up output of the fused gate/up GEMV (the down projection's input; it cannot be
    /// `xb`, which that kernel reads), (n, intermediate)
    pub(super) act: DevBuf,
}

/// The buffer in `slot`, replaced by a larger one (and `generation` bumped) when it holds fewer
/// than `bytes`.
pub(super) fn ensure(
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
pub(super) fn ensure_zeroed(
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
