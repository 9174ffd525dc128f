//! Single kernels on data the caller gives, outside any model: what the GPU tests compare with a
//! float64 reference, and what the kernel benchmark times against the cuBLAS path they replace.
//!
//! Each call makes its own stream and cuBLAS handle on GPU `ordinal`, uploads, runs once for the
//! result (outputs poisoned with NaN first, so an element the kernel never writes shows), then
//! times `reps` more launches with CUDA events. Timed launches cycle through copies of the
//! weights filling more than the GPU's L2 cache, so each reads its weights from memory, as a
//! model's layers do.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaStream};

use super::launch::Args;
use super::linears::{
    bf16_bits, gemv_splits, DevLinear, GemvIn, GEMV_MAX_ROWS, GEMV_NORM_SMEM, GEMV_SLICE,
};
use super::memory::DevBuf;
use super::{dev_err, kernels, probe, timing_event, Gpu, Precision};
use crate::error::{Error, Result};

/// One few-token linear layer: `y (n, out) = bf16(x) · bf16(W)ᵀ (+ b)`, added to `residual`
/// when given (the o and down projections add into the residual stream).
#[derive(Debug, Clone, Copy)]
pub struct GemvCase<'a> {
    /// Weights `(out, in)`, rounded to bf16 on upload.
    pub w: &'a [f32],
    /// Output features.
    pub out: usize,
    /// Input features (a multiple of 8).
    pub inp: usize,
    /// Bias `(out)`.
    pub bias: Option<&'a [f32]>,
    /// Inputs `(n, in)`.
    pub x: &'a [f32],
    /// Input rows, 1 to 4.
    pub n: usize,
    /// Upload `x` as f32 and let the kernel round it (the o projection reads attention's f32
    /// output); otherwise it is uploaded as bf16.
    pub x_f32: bool,
    /// RMSNorm weights `(in)` and epsilon: `x` is uploaded as f32 and normalized by the kernel
    /// (q/k/v read the normalized residual stream); the cuBLAS path runs the RMSNorm kernel.
    pub norm: Option<(&'a [f32], f32)>,
    /// Starting value of `y` `(n, out)`, added to.
    pub residual: Option<&'a [f32]>,
}

/// What a kernel computed and how long it took, next to the cuBLAS path it replaces.
#[derive(Debug, Clone)]
pub struct KernelRun {
    /// Our kernel's output.
    pub ours: Vec<f32>,
    /// The cuBLAS path's output on the same inputs (GEMM, then the separate element-wise kernels).
    pub cublas: Vec<f32>,
    /// Mean time of our kernel, microseconds.
    pub ours_us: f64,
    /// Mean time of the cuBLAS path, microseconds.
    pub cublas_us: f64,
    /// The streaming kernels (`TAPEDECK_GEMV_STREAM`) at each of [`STREAM_GRIDS`] blocks per SM:
    /// (blocks per SM, output, mean microseconds). Empty where they do not apply (more than one
    /// row, slices longer than 2048 inputs).
    pub stream: Vec<(usize, Vec<f32>, f64)>,
}

/// Blocks per SM the streaming GEMV kernels are run with by [`gemv`] and [`swiglu`].
pub const STREAM_GRIDS: [usize; 2] = [1, 2];

/// Runs `once` (which launches on `gpu` and returns the output) and times `launch` with each of
/// [`STREAM_GRIDS`] blocks per SM of the streaming kernels, when they apply to `n` rows of
/// `slice`-input warp slices; then restores the default kernels.
fn stream_runs(
    ctx: &Arc<CudaContext>,
    gpu: &Gpu,
    n: usize,
    slice: usize,
    reps: usize,
    mut once: impl FnMut() -> Result<Vec<f32>>,
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<(usize, Vec<f32>, f64)>> {
    let mut runs = Vec::new();
    for per_sm in STREAM_GRIDS {
        gpu.gemv_stream.store(per_sm, Ordering::Relaxed);
        if gpu.stream_grid(n, slice).is_none() {
            break;
        }
        let y = once()?;
        runs.push((per_sm, y, time(ctx, &gpu.stream, reps, &mut launch)?));
    }
    gpu.gemv_stream.store(0, Ordering::Relaxed);
    Ok(runs)
}

fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    probe()?;
    let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating a CUDA context", e))?;
    // SAFETY: no allocation was made through this handle's event tracking yet.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

fn download<T: Copy + Default>(gpu: &Gpu, buf: &DevBuf, len: usize) -> Result<Vec<T>> {
    let mut host = vec![T::default(); len];
    // SAFETY: `buf` holds at least `len` elements of T.
    unsafe { dr::memcpy_dtoh_async(&mut host, buf.ptr, gpu.stream.cu_stream()) }
        .map_err(|e| dev_err("downloading a result", e))?;
    gpu.stream
        .synchronize()
        .map_err(|e| dev_err("running a kernel", e))?;
    Ok(host)
}

fn upload<T: Copy>(gpu: &Gpu, buf: &DevBuf, data: &[T]) -> Result<()> {
    // SAFETY: `buf` holds at least `data.len()` elements of T.
    unsafe { dr::memcpy_htod_async(buf.ptr, data, gpu.stream.cu_stream()) }
        .map_err(|e| dev_err("uploading", e))
}

/// Mean microseconds of `f(i)` (which launches on `stream`) over runs `i` in `0..reps`, after
/// one untimed run.
fn time(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    if reps == 0 {
        return Ok(0.0);
    }
    let (start, end) = (timing_event(ctx)?, timing_event(ctx)?);
    f(0)?;
    start
        .record(stream)
        .map_err(|e| dev_err("recording an event", e))?;
    for i in 0..reps {
        f(i)?;
    }
    end.record(stream)
        .map_err(|e| dev_err("recording an event", e))?;
    let ms = start.elapsed_ms(&end).map_err(|e| dev_err("timing", e))?;
    Ok(ms as f64 * 1000.0 / reps as f64)
}

/// Copies of a `bytes`-byte weight set that together exceed the L2 cache (50 MB on an H200),
/// when timing; one otherwise.
fn copies(bytes: usize, reps: usize) -> usize {
    if reps == 0 {
        1
    } else {
        (256usize << 20).div_ceil(bytes.max(1)).clamp(1, 64)
    }
}

fn check_rows(n: usize, inp: usize) -> Result<()> {
    if n == 0 || n > GEMV_MAX_ROWS || !inp.is_multiple_of(8) {
        return Err(Error::Device(format!(
            "the GEMV kernels take 1..={GEMV_MAX_ROWS} rows and inputs a multiple of 8 wide \
             (got {n} rows of {inp})"
        )));
    }
    Ok(())
}

/// Runs `gemv_bf16` on one matrix (and the cuBLAS GEMM, input rounding and residual add it
/// replaces) on GPU `ordinal`.
pub fn gemv(ordinal: usize, case: &GemvCase<'_>, reps: usize) -> Result<KernelRun> {
    let GemvCase {
        w,
        out,
        inp,
        n,
        x,
        x_f32,
        residual,
        ..
    } = *case;
    check_rows(n, inp)?;
    let ctx = context(ordinal)?;
    let (gpu, _, _) = Gpu::new(&ctx, 64)?;
    gpu.gemv_stream.store(0, Ordering::Relaxed);
    let ls = (0..copies(out * inp * 2, reps))
        .map(|_| DevLinear::from_parts(&ctx, w, case.bias, out, inp))
        .collect::<Result<Vec<_>>>()?;
    if case.norm.is_some() && n * inp * 2 > GEMV_NORM_SMEM {
        return Err(Error::Device(format!(
            "{n} rows of {inp} do not fit the fused RMSNorm's shared memory"
        )));
    }
    let norm_w = case
        .norm
        .map(|(w, _)| DevBuf::from_slice(&ctx, w))
        .transpose()?;
    let eps = case.norm.map_or(0.0, |(_, e)| e);
    let xd = if x_f32 || norm_w.is_some() {
        DevBuf::from_slice(&ctx, x)?
    } else {
        DevBuf::from_slice(&ctx, &bf16_bits(x))?
    };
    let xb = DevBuf::new(&ctx, n * inp * 2)?;
    let y = DevBuf::new(&ctx, n * out * 4)?;
    let tmp = DevBuf::new(&ctx, n * out * 4)?;
    let start: Vec<f32> = residual.map_or_else(|| vec![f32::NAN; n * out], <[f32]>::to_vec);
    let add = residual.is_some();
    let input = match &norm_w {
        Some(w) => GemvIn::Normed {
            x: xd.ptr,
            w: w.ptr,
            eps,
        },
        None if x_f32 => GemvIn::F32(xd.ptr),
        None => GemvIn::Bf16(xd.ptr),
    };
    let ours = |i: usize| gpu.gemv(&[(&ls[i % ls.len()], y.ptr)], input, n, add, false);
    let theirs = |i: usize| -> Result<()> {
        let l = &ls[i % ls.len()];
        let xin = match (&norm_w, x_f32) {
            (Some(w), _) => {
                Args::new()
                    .p(0)
                    .p(xb.ptr)
                    .p(xd.ptr)
                    .p(w.ptr)
                    .i(inp)
                    .f(eps)
                    .launch(&gpu.stream, &gpu.k.rms_norm, (n, 1), 256)?;
                xb.ptr
            }
            (None, true) => gpu.gemm_input(xd.ptr, n * inp, xb.ptr, Precision::Bf16)?,
            (None, false) => xd.ptr,
        };
        let dst = if add { tmp.ptr } else { y.ptr };
        gpu.linear(l, xin, n, dst, Precision::Bf16)?;
        if add {
            Args::new().p(y.ptr).p(tmp.ptr).i(n * out).launch(
                &gpu.stream,
                &gpu.k.add_inplace,
                ((n * out).div_ceil(256), 1),
                256,
            )?;
        }
        Ok(())
    };
    upload(&gpu, &y, &start)?;
    ours(0)?;
    let ours_y = download(&gpu, &y, n * out)?;
    upload(&gpu, &y, &start)?;
    theirs(0)?;
    let cublas_y = download(&gpu, &y, n * out)?;
    let ours_us = time(&ctx, &gpu.stream, reps, ours)?;
    let cublas_us = time(&ctx, &gpu.stream, reps, theirs)?;
    let slice = inp / gemv_splits(inp, n, GEMV_SLICE);
    let stream = stream_runs(
        &ctx,
        &gpu,
        n,
        slice,
        reps,
        || {
            upload(&gpu, &y, &start)?;
            ours(0)?;
            download(&gpu, &y, n * out)
        },
        ours,
    )?;
    Ok(KernelRun {
        ours: ours_y,
        cublas: cublas_y,
        ours_us,
        cublas_us,
        stream,
    })
}

/// The MLP's gate and up projections of a few tokens, fused with SiLU·up.
#[derive(Debug, Clone, Copy)]
pub struct SwigluCase<'a> {
    /// Gate weights `(inter, in)`, rounded to bf16 on upload.
    pub wg: &'a [f32],
    /// Up weights `(inter, in)`, rounded to bf16 on upload.
    pub wu: &'a [f32],
    /// Output features.
    pub inter: usize,
    /// Input features (a multiple of 8).
    pub inp: usize,
    /// Inputs `(n, in)`, uploaded as bf16.
    pub x: &'a [f32],
    /// Input rows, 1 to 4.
    pub n: usize,
}

/// Runs `gemv_bf16_swiglu`: `bf16(silu(bf16(x)·Wgᵀ) · (bf16(x)·Wuᵀ))` `(n, inter)` (and the two
/// cuBLAS GEMMs and `silu_mul` it replaces) on GPU `ordinal`. Outputs are the bf16 values as f32.
pub fn swiglu(ordinal: usize, case: &SwigluCase<'_>, reps: usize) -> Result<KernelRun> {
    let SwigluCase {
        wg,
        wu,
        inter,
        inp,
        x,
        n,
    } = *case;
    check_rows(n, inp)?;
    let ctx = context(ordinal)?;
    let (gpu, _, _) = Gpu::new(&ctx, 64)?;
    gpu.gemv_stream.store(0, Ordering::Relaxed);
    let pairs = (0..copies(2 * inter * inp * 2, reps))
        .map(|_| {
            Ok((
                DevLinear::from_parts(&ctx, wg, None, inter, inp)?,
                DevLinear::from_parts(&ctx, wu, None, inter, inp)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let xd = DevBuf::from_slice(&ctx, &bf16_bits(x))?;
    let out = DevBuf::new(&ctx, n * inter * 2)?;
    let (gd, ud) = (
        DevBuf::new(&ctx, n * inter * 4)?,
        DevBuf::new(&ctx, n * inter * 4)?,
    );
    let ours = |i: usize| {
        let (g, u) = &pairs[i % pairs.len()];
        gpu.swiglu(g, u, GemvIn::Bf16(xd.ptr), n, out.ptr, false)
    };
    let theirs = |i: usize| -> Result<()> {
        let (g, u) = &pairs[i % pairs.len()];
        gpu.linear(g, xd.ptr, n, gd.ptr, Precision::Bf16)?;
        gpu.linear(u, xd.ptr, n, ud.ptr, Precision::Bf16)?;
        Args::new()
            .p(gd.ptr)
            .p(out.ptr)
            .p(ud.ptr)
            .i(n * inter)
            .launch(
                &gpu.stream,
                &gpu.k.silu_mul,
                ((n * inter).div_ceil(256), 1),
                256,
            )
    };
    let as_f32 = |bits: Vec<u16>| -> Vec<f32> {
        bits.into_iter()
            .map(|b| f32::from_bits(u32::from(b) << 16))
            .collect()
    };
    // 0x7fc0: a bf16 NaN, the poison.
    let poison = vec![0x7fc0u16; n * inter];
    upload(&gpu, &out, &poison)?;
    ours(0)?;
    let ours_y = as_f32(download(&gpu, &out, n * inter)?);
    upload(&gpu, &out, &poison)?;
    theirs(0)?;
    let cublas_y = as_f32(download(&gpu, &out, n * inter)?);
    let ours_us = time(&ctx, &gpu.stream, reps, ours)?;
    let cublas_us = time(&ctx, &gpu.stream, reps, theirs)?;
    let stream = stream_runs(
        &ctx,
        &gpu,
        n,
        inp,
        reps,
        || {
            upload(&gpu, &out, &poison)?;
            ours(0)?;
            Ok(as_f32(download(&gpu, &out, n * inter)?))
        },
        ours,
    )?;
    Ok(KernelRun {
        ours: ours_y,
        cublas: cublas_y,
        ours_us,
        cublas_us,
        stream,
    })
}

/// Device-to-device copy bandwidth of GPU `ordinal`, in bytes per second counting what is read
/// and what is written: the memory roofline a batch-1 decode step, which reads every weight once,
/// is measured against (weight bytes / this = the fastest possible step). Copies `bytes` bytes
/// `reps` times between two buffers, after one untimed copy.
pub fn copy_bandwidth(ordinal: usize, bytes: usize, reps: usize) -> Result<f64> {
    if bytes == 0 || reps == 0 {
        return Err(Error::Device(
            "a bandwidth measurement needs bytes and repetitions".into(),
        ));
    }
    let ctx = context(ordinal)?;
    let stream = ctx
        .new_stream()
        .map_err(|e| dev_err("creating a stream", e))?;
    let (src, dst) = (DevBuf::new(&ctx, bytes)?, DevBuf::new(&ctx, bytes)?);
    let us = time(&ctx, &stream, reps, |_| {
        // SAFETY: both buffers hold `bytes` bytes.
        unsafe { dr::memcpy_dtod_async(dst.ptr, src.ptr, bytes, stream.cu_stream()) }
            .map_err(|e| dev_err("device-to-device copy", e))
    })?;
    Ok(2.0 * bytes as f64 / (us / 1e6))
}

/// What one grid-wide barrier of the persistent decode-step kernel (`megakernel=on`) costs on GPU
/// `ordinal`: `iters` barriers in one launch of as many blocks as that kernel uses, timed by
/// events, in microseconds per barrier. Returns the block count too.
pub fn grid_barrier(ordinal: usize, iters: usize) -> Result<(usize, f64)> {
    let ctx = context(ordinal)?;
    let (arch, sms, _) = super::arch_and_sms(&ctx)?;
    let mk = super::step::Megakernel::load(&ctx, &arch, sms, kernels::DECODE_MMA_SMEM, 1, None)?;
    let stream = ctx
        .new_stream()
        .map_err(|e| dev_err("creating a stream", e))?;
    let us = time(&ctx, &stream, 3, |_| mk.barrier_bench(&stream, iters))?;
    Ok((mk.grid(), us / iters as f64))
}
