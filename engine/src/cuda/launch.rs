//! Kernels and their launches: the compiled module's entry points ([`Kernels`], one
//! [`PoolKernels`] set per KV element type) and the argument packing and launch attributes
//! (PDL, dynamic shared memory) of a launch ([`Args`]).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use super::linears::GEMV_MAX_ROWS;
use super::memory::KvElem;
use super::{dev_err, kernels, trace};
use crate::error::{Error, Result};

/// The kernels that read or write the KV pool, for one element type ([`KvElem`]).
pub(super) struct PoolKernels {
    pub(super) rope_kv_write: CudaFunction,
    /// q/k/v with RoPE and the KV write in the epilogue (`fuse=on`), per row count like `gemv`
    /// (none for FP8, whose per-head scale needs the whole head: that pool keeps rope_kv_write).
    pub(super) gemv_qkv_rope: Vec<CudaFunction>,
    /// Its one-row form that gathers the token's embedding first (`TAPEDECK_EMBED_FUSED=on`, the
    /// first layer of a decode step); none for FP8.
    pub(super) gemv_qkv_rope_embed: Option<CudaFunction>,
    pub(super) attention: CudaFunction,
    pub(super) attention_scores: CudaFunction,
    /// The tensor-core decode kernel (`attn_decode=mma-bf16`).
    pub(super) decode_mma: CudaFunction,
    /// The same in thread block clusters that merge their splits (`TAPEDECK_MMA_MERGE=cluster`).
    pub(super) decode_mma_cluster: CudaFunction,
    /// The tiled prefill kernel for this model's head_dim (none for other head dims).
    pub(super) prefill: Option<CudaFunction>,
    /// The tensor-core prefill kernel (`attn_prefill=mma-bf16`; head_dim 64 and 128 only, the
    /// others run `prefill` with its bf16 roundings).
    pub(super) prefill_mma: Option<CudaFunction>,
}

/// Loaded kernel entry points.
pub(super) struct Kernels {
    pub(super) embed_gather: CudaFunction,
    pub(super) embed_tokens: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) silu_mul: CudaFunction,
    pub(super) scatter_rows: CudaFunction,
    pub(super) add_inplace: CudaFunction,
    pub(super) add_bias: CudaFunction,
    pub(super) f32_to_bf16: CudaFunction,
    /// The GEMV kernels for 1..=GEMV_MAX_ROWS rows (index rows - 1).
    pub(super) gemv: Vec<CudaFunction>,
    pub(super) gemv_swiglu: Vec<CudaFunction>,
    /// gate/up and down as one dataflow grid (`fuse=on` with `mlp`), for 1 and 2 rows.
    pub(super) mlp_flow: [CudaFunction; 2],
    /// The o projection that merges the mma kernel's splits as it reads them (`fuse=on` with
    /// `merge`), per row count like `gemv`; empty unless `TAPEDECK_FUSE` names `merge`.
    pub(super) gemv_merged: Vec<CudaFunction>,
    /// The one-row GEMV and gate/up kernels on a resident grid, each warp streaming its rows
    /// (`TAPEDECK_GEMV_STREAM`, cuda/tune.rs): the same bits as `gemv[0]` and `gemv_swiglu[0]`.
    pub(super) gemv_stream: CudaFunction,
    pub(super) gemv_stream_swiglu: CudaFunction,
    /// L2 prefetch of weight ranges (`TAPEDECK_L2_PREFETCH`).
    pub(super) l2_prefetch: CudaFunction,
    pub(super) topk_mask: CudaFunction,
    pub(super) decode_combine: CudaFunction,
    pub(super) pick_partial: CudaFunction,
    pub(super) pick_finish: CudaFunction,
    /// The pool's readers and writers, indexed by [`KvElem::index`].
    pub(super) pool: [PoolKernels; 3],
}

impl Kernels {
    /// The pool kernels for pools of `elem`.
    pub(super) fn pool(&self, elem: KvElem) -> &PoolKernels {
        &self.pool[elem.index()]
    }
}

/// A compiled kernel file on the device, pointed at the kernel timeline when tracing.
pub(super) fn load_module(
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

/// The kernel files of `srcs` (None: not wanted) compiled and loaded side by side, one thread
/// each, in the order given. Why: NVRTC and the driver's PTX compiler take one thread per
/// program, and an engine start on a new kernel configuration (every `TAPEDECK_NVRTC_DEFINES`
/// sweep point) spent most of its time compiling its files one after another.
pub(super) fn load_modules<const N: usize>(
    ctx: &Arc<CudaContext>,
    srcs: [Option<&kernels::KernelSource>; N],
    arch: &str,
    trace: Option<(&trace::Trace, &Arc<CudaStream>)>,
) -> Result<[Option<Arc<cudarc::driver::CudaModule>>; N]> {
    let loaded = std::thread::scope(|s| {
        let jobs =
            srcs.map(|src| src.map(|src| s.spawn(move || load_module(ctx, src, arch, None))));
        jobs.map(|job| {
            job.map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Device("a kernel-loading thread panicked".into()))
                })
            })
            .transpose()
        })
    });
    let mut out = [const { None }; N];
    for (slot, module) in out.iter_mut().zip(loaded) {
        *slot = module?;
        if let (Some(m), Some((t, stream))) = (slot.as_ref(), trace) {
            t.attach(m, stream)?;
        }
    }
    Ok(out)
}

/// An entry point of a loaded module, with the preferred shared-memory carveout
/// `TAPEDECK_SMEM_CARVEOUT` asks for (cuda/tune.rs), if any.
pub(super) fn load_function(
    module: &Arc<cudarc::driver::CudaModule>,
    name: &str,
) -> Result<CudaFunction> {
    let f = module
        .load_function(name)
        .map_err(|e| dev_err(&format!("kernel {name}"), e))?;
    if let Some(percent) = super::tune::get().smem_carveout {
        // SAFETY: a valid function handle; the value is a percentage (0..=100), checked by tune.
        unsafe {
            cudarc::driver::sys::cuFuncSetAttribute(
                f.cu_function(),
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                percent as i32,
            )
        }
        .result()
        .map_err(|e| dev_err(&format!("setting {name}'s shared-memory carveout"), e))?;
    }
    Ok(f)
}

/// The dynamic shared memory a plain GEMV launch may take with staged weights
/// (`TAPEDECK_GEMV_ASYNC`): sm_120's opt-in limit per block, the smallest of the GPUs we build for.
pub(super) const GEMV_SMEM_LIMIT: usize = 99 << 10;

/// An entry point that takes `smem` bytes of dynamic shared memory (above the default 48 KB, so
/// its limit is raised first).
pub(super) fn load_with_smem(
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
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        head_dim: usize,
        trace: Option<(&trace::Trace, &Arc<CudaStream>)>,
    ) -> Result<Self> {
        let t = super::tune::get();
        // The merging o GEMV's module only where it can run (`TAPEDECK_FUSE` names `merge`): it
        // compiles engine.cu and the mma kernels once more, ~40% of the engine's NVRTC time and
        // a third of the PTX the driver compiles at start. The prefill kernels for the head
        // dims they are written for.
        let [module, mma, fused, prefill, prefill_mma] = load_modules(
            ctx,
            [
                Some(&kernels::ENGINE),
                Some(&kernels::DECODE_MMA),
                t.fuse.merge.then_some(&kernels::FUSED),
                matches!(head_dim, 32 | 64 | 128).then_some(&kernels::PREFILL),
                matches!(head_dim, 64 | 128).then_some(&kernels::PREFILL_MMA),
            ],
            arch,
            trace,
        )?;
        let (Some(module), Some(mma)) = (module, mma) else {
            return Err(Error::Device(
                "the engine's kernel files were not loaded".into(),
            ));
        };
        let f = |name: &str| load_function(&module, name);
        // The entry points for 1..=GEMV_MAX_ROWS rows; where they stage in shared memory (weights,
        // `TAPEDECK_GEMV_ASYNC`, `TAPEDECK_SWIGLU_ASYNC`, `TAPEDECK_QKV_ASYNC`; the merge's splits,
        // `TAPEDECK_MERGE_STAGED`) their shared-memory limit raised to GEMV_SMEM_LIMIT.
        let staged = |m: &Arc<cudarc::driver::CudaModule>, name: &str, raise: bool| match raise {
            false => load_function(m, name),
            true => load_with_smem(m, name, GEMV_SMEM_LIMIT),
        };
        let staged_rows = |m: &Arc<cudarc::driver::CudaModule>, stem: &str, raise: bool| {
            (1..=GEMV_MAX_ROWS)
                .map(|n| staged(m, &format!("{stem}_{n}"), raise))
                .collect::<Result<Vec<_>>>()
        };
        let (stage, swiglu_stage) = (
            t.gemv_stage_bytes(t.gemv_block),
            t.swiglu_stage_bytes(t.gemv_block),
        );
        let pool = |elem: KvElem| -> Result<PoolKernels> {
            let sfx = elem.suffix();
            let mma_name = format!("decode_attn_mma{}", elem.mma_suffix());
            Ok(PoolKernels {
                rope_kv_write: f(&format!("rope_kv_write{sfx}"))?,
                gemv_qkv_rope: match elem {
                    KvElem::Fp8 => Vec::new(),
                    _ => staged_rows(&module, &format!("gemv_bf16_qkv_rope{sfx}"), t.qkv_async)?,
                },
                gemv_qkv_rope_embed: match elem {
                    KvElem::Fp8 => None,
                    _ => Some(staged(
                        &module,
                        &format!("gemv_bf16_qkv_rope{sfx}_embed_1"),
                        t.qkv_async,
                    )?),
                },
                attention: f(&format!("attention{sfx}"))?,
                attention_scores: f(&format!("attention_scores{sfx}"))?,
                decode_mma: load_with_smem(&mma, &mma_name, kernels::DECODE_MMA_SMEM)?,
                decode_mma_cluster: load_with_smem(
                    &mma,
                    &format!("decode_attn_mma_cluster{}", elem.mma_suffix()),
                    kernels::DECODE_MMA_SMEM,
                )?,
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
            embed_tokens: f("embed_tokens")?,
            rms_norm: f("rms_norm")?,
            silu_mul: f("silu_mul")?,
            scatter_rows: f("scatter_rows")?,
            add_inplace: f("add_inplace")?,
            add_bias: f("add_bias")?,
            f32_to_bf16: f("f32_to_bf16")?,
            gemv: staged_rows(&module, "gemv_bf16", stage > 0)?,
            gemv_swiglu: staged_rows(&module, "gemv_bf16_swiglu", swiglu_stage > 0)?,
            mlp_flow: [f("mlp_flow_1")?, f("mlp_flow_2")?],
            gemv_merged: match &fused {
                Some(m) => staged_rows(m, "gemv_bf16_merged", stage > 0 || t.merge_staged)?,
                None => Vec::new(),
            },
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
pub(super) struct Args {
    pub(super) slots: [u64; MAX_KERNEL_ARGS],
    pub(super) n: usize,
}

/// The most parameters a kernel entry point may take (`Args` holds that many); a test counts
/// every entry point's parameters in the sources, since an overflow would only surface on a GPU.
pub(crate) const MAX_KERNEL_ARGS: usize = 32;

impl Args {
    pub(super) fn new() -> Self {
        Args {
            slots: [0; MAX_KERNEL_ARGS],
            n: 0,
        }
    }

    pub(super) fn push(mut self, v: u64) -> Self {
        assert!(
            self.n < MAX_KERNEL_ARGS,
            "a kernel launch with more than {MAX_KERNEL_ARGS} arguments"
        );
        self.slots[self.n] = v;
        self.n += 1;
        self
    }

    /// A device pointer.
    pub(super) fn p(self, ptr: u64) -> Self {
        self.push(ptr)
    }

    pub(super) fn i(self, v: usize) -> Self {
        self.push(v as i32 as u32 as u64)
    }

    pub(super) fn f(self, v: f32) -> Self {
        self.push(v.to_bits() as u64)
    }

    pub(super) fn launch(
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
    pub(super) fn launch_pdl(
        self,
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
        self.launch_with(stream, func, grid, block, shared_bytes, &[LaunchAttr::Pdl])
    }

    /// `launch_3d` in thread block clusters of `cluster_z` blocks along z (sm_90+), with
    /// programmatic dependent launch when `pdl`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_cluster(
        self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        shared_bytes: usize,
        cluster_z: usize,
        pdl: bool,
    ) -> Result<()> {
        let cluster = LaunchAttr::ClusterZ(cluster_z);
        let attrs: &[LaunchAttr] = if pdl {
            &[cluster, LaunchAttr::Pdl]
        } else {
            &[cluster]
        };
        self.launch_with(stream, func, grid, block, shared_bytes, attrs)
    }

    /// `launch_3d` through `cuLaunchKernelEx` with launch attributes.
    fn launch_with(
        mut self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        shared_bytes: usize,
        attrs: &[LaunchAttr],
    ) -> Result<()> {
        let mut params = self.param_ptrs();
        // SAFETY: as in `launch_3d`.
        unsafe { launch_ex(stream, func, grid, block, shared_bytes, attrs, &mut params) }
            .map_err(|e| dev_err(&format!("kernel launch ({attrs:?})"), e))
    }

    /// Pointers to the packed arguments, as a launch takes them.
    fn param_ptrs(&mut self) -> Vec<*mut c_void> {
        self.slots[..self.n]
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect()
    }

    pub(super) fn launch_3d(
        mut self,
        stream: &CudaStream,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        shared_bytes: usize,
    ) -> Result<()> {
        let mut params = self.param_ptrs();
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

/// A launch attribute [`launch_ex`] sets.
#[derive(Debug, Clone, Copy)]
pub(super) enum LaunchAttr {
    /// Programmatic stream serialization: the kernel may start before the previous one on the
    /// stream ends (programmatic dependent launch, sm_90+).
    Pdl,
    /// Every block resident at once, or the launch is refused (grid-wide barriers need it).
    Cooperative,
    /// Thread block clusters of this many blocks along z (sm_90+; at most 8, the portable size).
    ClusterZ(usize),
}

/// `cuLaunchKernelEx` with launch attributes; capturable into CUDA graphs like a plain launch.
///
/// # Safety
/// `params` must match `func`'s parameters and point at live values; every device pointer among
/// them must be a live buffer of the shape the kernel expects.
pub(super) unsafe fn launch_ex(
    stream: &CudaStream,
    func: &CudaFunction,
    grid: (usize, usize, usize),
    block: usize,
    shared_bytes: usize,
    attrs: &[LaunchAttr],
    params: &mut [*mut c_void],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let mut attrs: Vec<sys::CUlaunchAttribute> = attrs
        .iter()
        .map(|attr| {
            // SAFETY: an all-zero launch attribute value is valid (a plain C union of integers).
            let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
            let id = match *attr {
                LaunchAttr::Pdl => {
                    value.programmaticStreamSerializationAllowed = 1;
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                }
                LaunchAttr::Cooperative => {
                    value.cooperative = 1;
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE
                }
                LaunchAttr::ClusterZ(z) => {
                    value.clusterDim.x = 1;
                    value.clusterDim.y = 1;
                    value.clusterDim.z = z as u32;
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                }
            };
            sys::CUlaunchAttribute {
                id,
                pad: [0; 4],
                value,
            }
        })
        .collect();
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0 as u32,
        gridDimY: grid.1 as u32,
        gridDimZ: grid.2 as u32,
        blockDimX: block as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes as u32,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
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
