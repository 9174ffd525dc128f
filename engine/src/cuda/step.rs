//! The persistent decode-step kernel (`megakernel=on`, `kernels/decode_step.cu`): a
//! single-sequence decode step, every layer and the head, in one launch whose blocks meet at
//! grid-wide barriers between phases instead of ending and relaunching.
//!
//! It computes the same bits as the separate kernels of `small_gemm=gemv, attn_decode=mma-bf16`
//! (each phase runs their device functions over the same virtual blocks), so the toggle can be
//! A/B'd for speed alone and any difference it makes is a bug. A pass takes it when that path
//! would run anyway for exactly one decode row; otherwise the step runs kernel by kernel.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use super::launch::{launch_ex, load_function, load_module, load_with_smem, LaunchAttr};
use super::linears::{bias, DevLayer};
use super::memory::{DevBuf, DeviceKv, KvElem};
use super::{dev_err, kernels};
use crate::error::{Error, Result};

/// One layer's device pointers, as `MkLayer` in decode_step.cu (same order).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MkLayer {
    wq: u64,
    bq: u64,
    wk: u64,
    bk: u64,
    wv: u64,
    bv: u64,
    wo: u64,
    bo: u64,
    wg: u64,
    bg: u64,
    wu: u64,
    bu: u64,
    wd: u64,
    bd: u64,
    attn_norm: u64,
    mlp_norm: u64,
    k_pool: u64,
    v_pool: u64,
}

/// The kernel's one argument, as `MkParams` in decode_step.cu (same order; the 8-byte fields
/// first, so both sides lay it out without padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct MkParams {
    pub x: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub att: u64,
    pub act: u64,
    pub logits: u64,
    pub layers: u64,
    pub bar: u64,
    pub head_w: u64,
    pub head_b: u64,
    pub final_norm: u64,
    pub inv_freq: u64,
    pub pos: u64,
    pub slots: u64,
    pub tables: u64,
    pub ctx: u64,
    pub partial_out: u64,
    pub partial_ml: u64,
    pub q_scr: u64,
    pub done: u64,
    pub n_layers: i32,
    pub hidden: i32,
    pub inter: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub vocab: i32,
    pub block_size: i32,
    pub max_blocks: i32,
    pub split_len: i32,
    pub max_splits: i32,
    pub kv_mode: i32,
    pub splits_qkv: i32,
    pub splits_o: i32,
    pub splits_down: i32,
    pub splits_head: i32,
    pub eps: f32,
    pub scale: f32,
}

/// The compiled kernel, its launch size and its device state.
pub(super) struct Megakernel {
    /// `decode_step` and `decode_step_bf16kv`, indexed by [`KvElem::index`].
    funcs: [CudaFunction; 2],
    /// `grid_sync_bench`: the barrier alone (for [`super::check::grid_barrier`]).
    bench: CudaFunction,
    /// Blocks per launch: every multiprocessor times the blocks that fit on one, so all are
    /// resident together (the barriers need that).
    grid: usize,
    /// The barrier's two words (arrivals, generation), zeroed once.
    bar: DevBuf,
    /// Per KV head, the attention splits finished in the current layer (zero between layers).
    done: DevBuf,
    /// The layer table and the KV buffers it was built for.
    table: Option<(DevBuf, u64)>,
}

/// The kernel's block: `MK_THREADS` (8 warps, the GEMV kernels' block).
const THREADS: usize = 256;

impl Megakernel {
    /// Compiles the kernel for `arch` and sizes its grid for a GPU of `sms` multiprocessors.
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        sms: usize,
        smem: usize,
        kv_heads: usize,
        trace: Option<(&super::trace::Trace, &Arc<CudaStream>)>,
    ) -> Result<Self> {
        let module = load_module(ctx, &kernels::DECODE_STEP, arch, trace)?;
        let funcs = [
            load_with_smem(&module, "decode_step", smem)?,
            load_with_smem(&module, "decode_step_bf16kv", smem)?,
        ];
        // One grid for both variants: the smaller residency of the two.
        let mut per_sm = usize::MAX;
        for func in &funcs {
            let n = func
                .occupancy_max_active_blocks_per_multiprocessor(THREADS as u32, smem, None)
                .map_err(|e| dev_err("the decode step kernel's occupancy", e))?;
            per_sm = per_sm.min(n as usize);
        }
        if per_sm == 0 {
            return Err(Error::Device(
                "the decode step kernel does not fit on a multiprocessor".into(),
            ));
        }
        Ok(Megakernel {
            bench: load_function(&module, "grid_sync_bench")?,
            funcs,
            grid: sms * per_sm,
            bar: DevBuf::from_slice(ctx, &[0u32; 2])?,
            done: DevBuf::from_slice(ctx, &vec![0u32; kv_heads])?,
            table: None,
        })
    }

    /// The layer table's device address for this KV pool, built (and uploaded) when the pool's
    /// buffers changed. Returns whether it was rebuilt: graphs captured with the old table must
    /// not run again.
    pub(super) fn table(
        &mut self,
        ctx: &Arc<CudaContext>,
        layers: &[DevLayer],
        kv: &DeviceKv,
        kv_key: u64,
    ) -> Result<(u64, bool)> {
        if let Some((t, key)) = &self.table {
            if *key == kv_key {
                return Ok((t.ptr, false));
            }
        }
        let rows: Vec<MkLayer> = layers
            .iter()
            .enumerate()
            .map(|(i, l)| MkLayer {
                wq: l.q.w_bf16.ptr,
                bq: bias(&l.q),
                wk: l.k.w_bf16.ptr,
                bk: bias(&l.k),
                wv: l.v.w_bf16.ptr,
                bv: bias(&l.v),
                wo: l.o.w_bf16.ptr,
                bo: bias(&l.o),
                wg: l.gate.w_bf16.ptr,
                bg: bias(&l.gate),
                wu: l.up.w_bf16.ptr,
                bu: bias(&l.up),
                wd: l.down.w_bf16.ptr,
                bd: bias(&l.down),
                attn_norm: l.attn_norm.ptr,
                mlp_norm: l.mlp_norm.ptr,
                k_pool: kv.k[i].ptr,
                v_pool: kv.v[i].ptr,
            })
            .collect();
        let t = DevBuf::from_slice(ctx, &rows)?;
        let ptr = t.ptr;
        self.table = Some((t, kv_key));
        Ok((ptr, true))
    }

    /// The barrier words' and the split counters' addresses (for [`MkParams`]).
    pub(super) fn state(&self) -> (u64, u64) {
        (self.bar.ptr, self.done.ptr)
    }

    /// Blocks per launch.
    pub(super) fn grid(&self) -> usize {
        self.grid
    }

    /// Launches `iters` grid barriers alone, on the step's grid.
    pub(super) fn barrier_bench(&self, stream: &CudaStream, iters: usize) -> Result<()> {
        let (mut bar, mut n) = (self.bar.ptr, iters as i32);
        let mut args = [
            &mut bar as *mut u64 as *mut c_void,
            &mut n as *mut i32 as *mut c_void,
        ];
        // SAFETY: grid_sync_bench(unsigned* bar, int iters); `bar` is the live barrier state.
        unsafe { self.cooperative(&self.bench, stream, 0, &mut args) }
            .map_err(|e| dev_err("launching the grid barrier benchmark", e))
    }

    /// Launches one step on `stream` over a pool of `elem` (capturable: no copies, no
    /// allocation).
    pub(super) fn launch(
        &self,
        stream: &CudaStream,
        params: &MkParams,
        smem: usize,
        elem: KvElem,
    ) -> Result<()> {
        let mut p = *params;
        let mut args = [&mut p as *mut MkParams as *mut c_void];
        let func = self.funcs.get(elem.index()).ok_or_else(|| {
            Error::Device("the decode step kernel does not read FP8 KV pools".into())
        })?;
        // SAFETY: the kernel takes one `MkParams` by value, laid out as this `repr(C)` struct;
        // every pointer in it is a live device buffer of the shapes it names.
        unsafe { self.cooperative(func, stream, smem, &mut args) }
            .map_err(|e| dev_err("launching the decode step kernel", e))
    }

    /// A cooperative launch of `func` on the step's grid: the driver guarantees that every block
    /// is resident at once, or refuses the launch (a plain launch of a grid that does not fit, say
    /// beside another context's kernels, would deadlock at the first barrier). Captured into CUDA
    /// graphs as a cooperative kernel node.
    ///
    /// # Safety
    /// `args` must match `func`'s parameters and point at live values.
    unsafe fn cooperative(
        &self,
        func: &CudaFunction,
        stream: &CudaStream,
        smem: usize,
        args: &mut [*mut c_void],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        // SAFETY: the caller vouches for `args`.
        unsafe {
            launch_ex(
                stream,
                func,
                (self.grid, 1, 1),
                THREADS,
                smem,
                &[LaunchAttr::Cooperative],
                args,
            )
        }
    }
}
