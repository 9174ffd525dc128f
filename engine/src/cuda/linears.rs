//! The linear layers on the GPU: their weights ([`DevLinear`], one [`DevLayer`] per layer), and
//! the launches that apply them: cuBLAS GEMMs, or at a few rows our bf16 GEMV kernels with their
//! fused prologues and epilogues (RMSNorm, SwiGLU, RoPE + KV write, the split merge, the L2
//! prefetch beside them).

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};

use super::launch::Args;
use super::memory::{DevBuf, KvElem};
use super::{dev_err, tune, Gpu};
use crate::error::{Error, Result};
use crate::models::llama::Linear;
use crate::numerics::round_bf16;
use crate::toggles::Precision;

/// The GEMV entry point for `n` rows.
pub(super) fn gemv_for(fns: &[CudaFunction], n: usize) -> Result<&CudaFunction> {
    n.checked_sub(1).and_then(|i| fns.get(i)).ok_or_else(|| {
        Error::Device(format!(
            "the GEMV kernels take 1..={GEMV_MAX_ROWS} rows, not {n}"
        ))
    })
}

/// The input of a GEMV launch.
#[derive(Debug, Clone, Copy)]
pub(super) enum GemvIn {
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

/// The first layer's q/k/v launch reading its input from the embedding table
/// (`TAPEDECK_EMBED_FUSED=on`): the pass's token ids, the previous pass's pick (for a fed id) and
/// the residual stream the row is copied to.
#[derive(Debug, Clone, Copy)]
pub(super) struct EmbedGather {
    pub(super) ids: u64,
    pub(super) fed: u64,
    pub(super) residual: u64,
}

/// Where the o projection's fused split merge reads (the mma decode pass's buffers and split
/// geometry; see `kernels/decode_fused.cu`).
#[derive(Debug, Clone, Copy)]
pub(super) struct MergedSplits {
    pub(super) att: u64,
    pub(super) partial_out: u64,
    pub(super) partial_ml: u64,
    pub(super) ctx: u64,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) split_len: usize,
    pub(super) max_splits: usize,
}

/// Most splits the o GEMV merges itself: every one of its blocks reads all rows' partials, so
/// past a few splits (long contexts) the combine kernel, which reads them once, is cheaper.
pub(super) const FUSED_MERGE_MAX_SPLITS: usize = 8;

impl MergedSplits {
    /// Dynamic shared memory of the merging GEMV over `n` rows of `inp` inputs, or `None` where
    /// the merge cannot be fused (then the combine kernel merges): the merged rows in bf16, then
    /// every split's partial outputs and (max, sum) pairs in f32, staged by the kernel
    /// (`TAPEDECK_MERGE_STAGED=on`: needs `head_dim % 4 == 0` and at most
    /// [`MERGE_STAGED_SMEM`]), or by default the split weights, their sums and the (max, sum)
    /// pairs (within the default 48 KB).
    pub(super) fn smem(&self, n: usize, inp: usize) -> Option<usize> {
        let rows = n * inp * 2;
        if tune::get().merge_staged {
            let staged = rows + 4 * n * self.heads * self.max_splits * (self.head_dim + 2);
            let fits = self.head_dim.is_multiple_of(4) && inp == self.heads * self.head_dim;
            (fits && staged <= MERGE_STAGED_SMEM).then_some(staged)
        } else {
            let registers = rows + 4 * n * self.heads * (3 * self.max_splits + 1);
            (registers <= GEMV_NORM_SMEM).then_some(registers)
        }
    }

    /// Whether the o GEMV can merge these splits itself for `n` rows of `inp` inputs: the merge
    /// fits (`smem`) and so do the launch's staged weights beside it (the limit `with_stage`
    /// enforces); else the pass keeps the combine kernel.
    pub(super) fn fits(&self, n: usize, inp: usize) -> bool {
        let stage = tune::get().gemv_stage_bytes(tune::get().gemv_block);
        self.smem(n, inp)
            .is_some_and(|b| b + stage <= super::launch::GEMV_SMEM_LIMIT)
    }
}

/// Most dynamic shared memory the merging GEMV stages splits in (its functions' limit is raised
/// to [`super::launch::GEMV_SMEM_LIMIT`]; the rest is left for staged weights): one row of
/// Llama-3.2-1B's 32 heads of 64 with 8 splits takes 4 KB + 66 KB.
pub(super) const MERGE_STAGED_SMEM: usize = 72 << 10;

/// Dynamic shared memory the GEMV kernels' fused RMSNorm may use (the default per-block limit).
pub(super) const GEMV_NORM_SMEM: usize = 48 << 10;

/// A GEMV launch's `smem` bytes of dynamic shared memory plus `stage` bytes of weights staged at
/// its end (`TAPEDECK_GEMV_ASYNC`, `TAPEDECK_SWIGLU_ASYNC`), or an error past what such a launch
/// may take (the functions' raised limit).
fn with_stage(smem: usize, stage: usize, n: usize, inp: usize) -> Result<usize> {
    let total = smem + stage;
    if total > super::launch::GEMV_SMEM_LIMIT {
        return Err(Error::Device(format!(
            "a GEMV of {n} rows of {inp} inputs needs {total} bytes of shared memory with its \
             staged weights, over the {} it may take",
            super::launch::GEMV_SMEM_LIMIT
        )));
    }
    Ok(total)
}

/// Dynamic shared memory for a plain GEMV to copy an as-given input of `n` rows of `inp` into
/// (unless `TAPEDECK_GEMV_X_SMEM=off`, and where it fits the default per-block limit; the kernel copies only when
/// it gets at least that much), else 0.
fn x_stage_smem(n: usize, inp: usize) -> usize {
    let bytes = n * inp * 2;
    if tune::get().gemv_x_smem && bytes <= GEMV_NORM_SMEM {
        bytes
    } else {
        0
    }
}

impl GemvIn {
    /// Appends the kernels' input arguments: `(x, x_f32, norm_w, eps)`, or for `Merged` the
    /// merge's `(att, partial_out, partial_ml, ctx, heads, head_dim, split_len, max_splits)`;
    /// returns the dynamic shared memory the launch needs, or an error for a merge that does not
    /// fit (the pass fuses only merges that do).
    pub(super) fn args(self, a: Args, n: usize, inp: usize) -> Result<(Args, usize)> {
        Ok(match self {
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
                m.smem(n, inp).ok_or_else(|| {
                    Error::Device(format!(
                        "the o GEMV cannot merge {} splits of {n} rows of {inp} inputs itself",
                        m.max_splits
                    ))
                })?,
            ),
        })
    }
}

/// The device address of a layer's bias, 0 for none (what the kernels take).
pub(super) fn bias(l: &DevLinear) -> u64 {
    l.b.as_ref().map_or(0, |b| b.ptr)
}

/// What RoPE and the KV write of one layer need: the arguments `rope_kv_write` and the fused
/// q/k/v kernel (`fuse=on`) both end with.
pub(super) struct RopeArgs {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) k_pool: u64,
    pub(super) v_pool: u64,
    /// An FP8 pool's scales (0 for the others).
    pub(super) k_scale: u64,
    pub(super) v_scale: u64,
    pub(super) pos: u64,
    pub(super) inv_freq: u64,
    pub(super) slots: u64,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) kv_mode: usize,
    /// The pool's element type (which kernel variant writes it).
    pub(super) elem: KvElem,
}

impl RopeArgs {
    /// Appends `(q, k, v, k_pool, v_pool, k_scale, v_scale, pos, inv_freq, slots, heads,
    /// kv_heads, hd, mode)`.
    pub(super) fn append(&self, a: Args) -> Args {
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
pub(super) struct DevLinear {
    /// (out, in) f32
    pub(super) w: DevBuf,
    /// (out, in) bf16
    pub(super) w_bf16: DevBuf,
    /// (out) f32
    pub(super) b: Option<DevBuf>,
    pub(super) out: usize,
    pub(super) inp: usize,
}

impl DevLinear {
    pub(super) fn upload(ctx: &Arc<CudaContext>, l: &Linear) -> Result<Self> {
        Self::from_parts(ctx, &l.w, l.b.as_deref(), l.out, l.inp)
    }

    /// `w` is `(out, in)` f32; the bf16 copy is made from it here.
    pub(super) fn from_parts(
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
pub(super) fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| (round_bf16(v).to_bits() >> 16) as u16)
        .collect()
}

pub(super) struct DevLayer {
    pub(super) attn_norm: DevBuf,
    pub(super) q: DevLinear,
    pub(super) k: DevLinear,
    pub(super) v: DevLinear,
    pub(super) o: DevLinear,
    pub(super) mlp_norm: DevBuf,
    pub(super) gate: DevLinear,
    pub(super) up: DevLinear,
    pub(super) down: DevLinear,
}

/// Most rows the GEMV kernels take (their `GEMV_MAX_ROWS`), and warps per block (`GEMV_WARPS`).
pub(super) const GEMV_MAX_ROWS: usize = 4;
pub(super) const GEMV_WARPS: usize = 8;
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
pub(super) fn gemv_splits(inp: usize, n: usize, slice: usize) -> usize {
    let mut s = 1;
    if n > 2 {
        return s;
    }
    while s < GEMV_WARPS && inp > s * slice && inp.is_multiple_of(16 * s) {
        s *= 2;
    }
    s
}
/// Where the MLP dataflow kernel's per-output-group counters start in its counter set
/// (`MLP_FLOW_GROUPS_AT` in kernels/engine.cu).
pub(super) const MLP_FLOW_GROUPS_AT: usize = 16;

/// The MLP dataflow kernel's buffers for one pass (`mlp_flow_N`, kernels/engine.cu).
pub(super) struct MlpFlow {
    /// Zeroed u32 counter sets, one per layer, `stride` words apart.
    pub(super) counters: u64,
    pub(super) stride: usize,
    /// The down projection's slice sums, (splits, rows, hidden) f32.
    pub(super) partial: u64,
    /// Slices of the down projection: the warps per feature of the separate down GEMV, so that
    /// the sums are added in the same order and the bits agree.
    pub(super) splits: usize,
}

/// The down-projection slices of the MLP dataflow kernel for `n` rows of a `hidden` → `inter`
/// → `hidden` MLP, or `None` where it does not apply: it has entry points for 1 and 2 rows
/// (the separate GEMVs split their rows only up to 2), runs blocks of `GEMV_WARPS` warps, one
/// per row group (so not with `TAPEDECK_GEMV_BLOCK=4` or `TAPEDECK_GEMV_GRID`), and needs whole
/// row groups in every slice and whole output groups (`TAPEDECK_MLP_DROWS` warps' worth).
pub(super) fn mlp_flow_splits(hidden: usize, inter: usize, n: usize) -> Option<usize> {
    let t = tune::get();
    if !(1..=2).contains(&n) || t.gemv_block != GEMV_WARPS || t.gemv_grid != 0 {
        return None;
    }
    let s = gemv_splits(inter, n, t.gemv_slice);
    (hidden.is_multiple_of(t.mlp_drows * GEMV_WARPS) && inter.is_multiple_of(s * GEMV_WARPS))
        .then_some(s)
}

/// Blocks of a streaming GEMV launch (`TAPEDECK_GEMV_STREAM=per_sm`) over `tasks` output
/// features: at most `per_sm` per SM, never more than the tasks need, and where a grid of at
/// least three quarters of that divides the features evenly among its warps, that one: every
/// warp then streams the same number of rows and none is left with a last row alone (llama-1b
/// on 132 SMs: 256 blocks for 8192 gate/up rows, 2048 down or o rows).
pub(super) fn stream_blocks(sms: usize, per_sm: usize, tasks: usize) -> usize {
    let most = (sms * per_sm).min(tasks.div_ceil(GEMV_WARPS)).max(1);
    (most.div_ceil(4) * 3..=most)
        .rev()
        .find(|&g| g > 0 && tasks.is_multiple_of(g * GEMV_WARPS))
        .unwrap_or(most)
}

impl Gpu {
    /// `y (n, out) = x (n, in) · Wᵀ (+ b)`. `x` is f32, or bf16 bits when `p` is bf16.
    pub(super) fn linear(
        &self,
        l: &DevLinear,
        x: u64,
        n: usize,
        y: u64,
        p: Precision,
    ) -> Result<()> {
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
    pub(super) fn gemv(
        &self,
        mats: &[(&DevLinear, u64)],
        x: GemvIn,
        n: usize,
        add: bool,
        pdl: bool,
    ) -> Result<()> {
        let inp = mats.first().map_or(0, |(l, _)| l.inp);
        let block = tune::get().gemv_block;
        let splits = gemv_splits(inp, n, tune::get().gemv_slice).min(block);
        let (a, smem) = x.args(Args::new(), n, inp)?;
        let smem = match x {
            GemvIn::Bf16(_) | GemvIn::F32(_) => x_stage_smem(n, inp),
            _ => smem,
        };
        let mut a = a.i(n).i(inp).i(splits).i(usize::from(add));
        // The merging entry point takes one matrix; the others up to three.
        let (kernels, max_mats) = match x {
            GemvIn::Merged(_) if self.k.gemv_merged.is_empty() => {
                return Err(Error::Device(
                    "the merging o GEMV is loaded only where TAPEDECK_FUSE names `merge`".into(),
                ))
            }
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
        // Staged weights (TAPEDECK_GEMV_ASYNC) take the end of the default kernels' shared memory.
        let smem = match stream {
            Some(_) => smem,
            None => with_stage(smem, tune::get().gemv_stage_bytes(block), n, inp)?,
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
            None => self.gemv_grid((total * splits).div_ceil(block)),
        };
        // The streaming kernels keep GEMV_WARPS warps a block.
        let warps = if stream.is_some() { GEMV_WARPS } else { block };
        a.launch_pdl(
            &self.stream,
            gemv_for(kernels, n)?,
            (grid, 1, 1),
            32 * warps,
            smem,
            pdl && self.pdl_capable,
        )
    }

    /// `out (n, inter) = bf16(silu(x · Wgᵀ) · (x · Wuᵀ))`, the MLP's input to its down
    /// projection, in one launch. `x` is bf16 or the normalized residual stream.
    pub(super) fn swiglu(
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
        let (a, smem) = x.args(Args::new(), n, gate.inp)?;
        let block = tune::get().gemv_block;
        let (kernel, grid, threads, smem) = match self.stream_grid(n, gate.inp) {
            Some(per_sm) => (
                &self.k.gemv_stream_swiglu,
                stream_blocks(self.sms, per_sm, gate.out),
                32 * GEMV_WARPS,
                smem,
            ),
            None => (
                gemv_for(&self.k.gemv_swiglu, n)?,
                self.gemv_grid(gate.out.div_ceil(block)),
                32 * block,
                // Staged weights (TAPEDECK_SWIGLU_ASYNC) at the end of its shared memory.
                with_stage(smem, tune::get().swiglu_stage_bytes(block), n, gate.inp)?,
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
                threads,
                smem,
                pdl && self.pdl_capable,
            )
    }

    /// `y (n, hidden) += down(bf16(silu(x · Wgᵀ) · (x · Wuᵀ)))` of one layer as one dataflow
    /// grid (`mlp_flow_N`, kernels/engine.cu): what `swiglu` into `act` followed by the down
    /// `gemv` with `add` computes, bit for bit, without the kernel boundary between them. `li`
    /// picks the layer's counter set.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp_flow(
        &self,
        layer: &DevLayer,
        x: GemvIn,
        n: usize,
        act: u64,
        y: u64,
        flow: &MlpFlow,
        li: usize,
        pdl: bool,
    ) -> Result<()> {
        if matches!(x, GemvIn::F32(_) | GemvIn::Merged(_)) || !(1..=2).contains(&n) {
            return Err(Error::Device(
                "the MLP dataflow kernel takes 1-2 rows of bf16 or normalized input".into(),
            ));
        }
        let (gate, up, down) = (&layer.gate, &layer.up, &layer.down);
        let (hidden, inter, s) = (gate.inp, gate.out, flow.splits);
        let (a, smem) = x.args(Args::new(), n, hidden)?;
        let grid = s * (inter / s / GEMV_WARPS + hidden / (tune::get().mlp_drows * GEMV_WARPS));
        a.i(n)
            .i(hidden)
            .i(inter)
            .i(s)
            .p(gate.w_bf16.ptr)
            .p(bias(gate))
            .p(up.w_bf16.ptr)
            .p(bias(up))
            .p(act)
            .p(down.w_bf16.ptr)
            .p(bias(down))
            .p(y)
            .p(flow.partial)
            .p(flow.counters + (li * flow.stride * 4) as u64)
            .launch_pdl(
                &self.stream,
                &self.k.mlp_flow[n - 1],
                (grid, 1, 1),
                32 * GEMV_WARPS,
                smem,
                pdl && self.pdl_capable,
            )
    }

    /// Blocks per SM of the streaming GEMV kernels for `n` rows whose warps read slices of
    /// `slice` inputs, when `TAPEDECK_GEMV_STREAM` asks for them and they apply (one row, slices
    /// of at most 2048 inputs); `None` for the one-block-per-row-group kernels.
    pub(super) fn stream_grid(&self, n: usize, slice: usize) -> Option<usize> {
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
    pub(super) fn l2_prefetch(&self, ranges: &[(u64, usize)]) -> Result<()> {
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
    pub(super) fn gemv_grid(&self, groups: usize) -> usize {
        match tune::get().gemv_grid {
            0 => groups,
            k => groups.min(k * self.sms),
        }
    }

    /// The q/k/v projections of `n` rows with RoPE and the KV write in their epilogue (`fuse=on`,
    /// KV modes 0 and 1): what `gemv` over q, k and v followed by `rope_kv_write` computes, in one
    /// launch. `x` is bf16 or the normalized residual stream.
    /// With `embed` (`TAPEDECK_EMBED_FUSED=on`, one row): `x` is the embedding table normalized
    /// at the row the token ids say, and block 0 writes that row to the residual stream (the
    /// `_embed_1` entry points); see [`EmbedGather`].
    pub(super) fn qkv_rope(
        &self,
        layer: &DevLayer,
        x: GemvIn,
        n: usize,
        rope: &RopeArgs,
        pdl: bool,
        embed: Option<EmbedGather>,
    ) -> Result<()> {
        if matches!(x, GemvIn::F32(_) | GemvIn::Merged(_)) || rope.kv_mode > 1 {
            return Err(Error::Device(
                "the fused q/k/v kernel takes bf16 or normalized input and f32 or bf16 KV".into(),
            ));
        }
        let (a, smem) = x.args(Args::new(), n, layer.q.inp)?;
        let mut a = a.i(n).i(layer.q.inp);
        for l in [&layer.q, &layer.k, &layer.v] {
            a = a.p(l.w_bf16.ptr).p(bias(l));
        }
        let pairs = (rope.heads + 2 * rope.kv_heads) * rope.head_dim / 2;
        // Staged weights (TAPEDECK_QKV_ASYNC) at the end of its shared memory.
        let smem = with_stage(
            smem,
            tune::get().qkv_stage_bytes(GEMV_WARPS),
            n,
            layer.q.inp,
        )?;
        let mut a = rope.append(a);
        let pool = self.k.pool(rope.elem);
        let kernel = match embed {
            None => gemv_for(&pool.gemv_qkv_rope, n)?,
            Some(e) => {
                a = a.p(e.ids).p(e.fed).p(e.residual);
                match (&pool.gemv_qkv_rope_embed, n) {
                    (Some(k), 1) => k,
                    _ => {
                        return Err(Error::Device(format!(
                            "no q/k/v kernel gathers the embeddings of {n} rows from this pool"
                        )))
                    }
                }
            }
        };
        a.launch_pdl(
            &self.stream,
            kernel,
            (pairs.div_ceil(GEMV_WARPS), 1, 1),
            32 * GEMV_WARPS,
            smem,
            pdl && self.pdl_capable,
        )
    }

    /// The GEMM input for precision `p`: `x` itself, or `x` rounded to bf16 into `xb`.
    pub(super) fn gemm_input(&self, x: u64, len: usize, xb: u64, p: Precision) -> Result<u64> {
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
}
