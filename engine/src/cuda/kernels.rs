//! The CUDA C sources in `kernels/`, compiled by NVRTC for the GPU found and cached.
//!
//! Kernels are compiled for a virtual architecture (`compute_XY`): the PTX carries forward to any
//! newer GPU, and the driver turns it into machine code for the exact chip. Compiling is slow
//! (hundreds of milliseconds), so the PTX is cached twice: in memory for the life of the process
//! (a hit takes only the read lock) and on disk under the user's cache directory, keyed by the
//! SHA-256 of source and options, so a restart skips NVRTC entirely.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{OnceLock, RwLock};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// One kernel source file.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub name: &'static str,
    /// The CUDA C text.
    pub code: &'static str,
    /// Entry points the engine loads from it.
    pub entry_points: &'static [&'static str],
}

/// The engine's kernels: norms, rotary with the KV write, element-wise ops, few-token bf16 GEMVs,
/// SIMT attention and the token picks.
pub const ENGINE: KernelSource = KernelSource {
    name: "engine.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/engine.cu")
    ),
    entry_points: &[
        "embed_gather",
        "embed_tokens",
        "rms_norm",
        "rope_kv_write",
        "silu_mul",
        "scatter_rows",
        "add_inplace",
        "add_bias",
        "f32_to_bf16",
        "gemv_bf16_1",
        "gemv_bf16_2",
        "gemv_bf16_3",
        "gemv_bf16_4",
        "gemv_bf16_swiglu_1",
        "gemv_bf16_swiglu_2",
        "gemv_bf16_swiglu_3",
        "gemv_bf16_swiglu_4",
        "mlp_flow_1",
        "mlp_flow_2",
        "gemv_bf16_qkv_rope_1",
        "gemv_bf16_qkv_rope_2",
        "gemv_bf16_qkv_rope_3",
        "gemv_bf16_qkv_rope_4",
        "gemv_bf16_qkv_rope_bf16kv_1",
        "gemv_bf16_qkv_rope_bf16kv_2",
        "gemv_bf16_qkv_rope_bf16kv_3",
        "gemv_bf16_qkv_rope_bf16kv_4",
        "gemv_bf16_qkv_rope_embed_1",
        "gemv_bf16_qkv_rope_bf16kv_embed_1",
        "rope_kv_write_bf16kv",
        "rope_kv_write_fp8kv",
        "attention",
        "attention_bf16kv",
        "attention_fp8kv",
        "attention_scores",
        "attention_scores_bf16kv",
        "attention_scores_fp8kv",
        "topk_mask",
        "pick_partial",
        "pick_finish",
        "l2_prefetch",
    ],
};

/// Tiled prefill attention (f32 on CUDA cores, the `simt-f32` prefill path): one block per tile
/// of a prompt chunk's tokens times the query heads of one KV head, K/V staged in shared memory.
pub const PREFILL: KernelSource = KernelSource {
    name: "prefill_attention.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/prefill_attention.cu")
    ),
    entry_points: &[
        "prefill_attention_hd32",
        "prefill_attention_hd64",
        "prefill_attention_hd128",
        "prefill_attention_bf16kv_hd32",
        "prefill_attention_bf16kv_hd64",
        "prefill_attention_bf16kv_hd128",
        "prefill_attention_fp8kv_hd32",
        "prefill_attention_fp8kv_hd64",
        "prefill_attention_fp8kv_hd128",
    ],
};

/// Rows (tile tokens × query heads per KV head) of one prefill tile (its `PA_ROWS`).
pub const PREFILL_ROWS: usize = 64;

/// Dynamic shared memory of the prefill kernel for `head_dim` (its `PA_SMEM_BYTES(hd, PA_BN(hd))`).
pub fn prefill_smem(head_dim: usize) -> usize {
    let bn = if head_dim <= 64 { 64 } else { 32 };
    4 * ((PREFILL_ROWS + 2 * bn) * (head_dim + 4) + PREFILL_ROWS * (bn + 4))
}

/// The bf16 tensor-core prefill attention (`attn_prefill=mma-bf16`): `mma.sync` m16n8k16 over
/// the same tile list as [`PREFILL`], after the decode kernel's source, whose device helpers
/// (fragments, swizzle, cp.async, conversions) it shares (so the module also holds the decode
/// entry points, unused from here).
pub const PREFILL_MMA: KernelSource = KernelSource {
    name: "prefill_attention_mma.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/decode_attention_mma.cu"),
        include_str!("../../../kernels/prefill_attention_mma.cu")
    ),
    entry_points: &[
        "prefill_attn_mma_f32kv_hd64",
        "prefill_attn_mma_f32kv_hd128",
        "prefill_attn_mma_bf16kv_hd64",
        "prefill_attn_mma_bf16kv_hd128",
        "prefill_attn_mma_fp8kv_hd64",
        "prefill_attn_mma_fp8kv_hd128",
    ],
};

/// Threads per block of the tensor-core prefill kernel (its `PM_THREADS`).
pub const PREFILL_MMA_THREADS: usize = 128;

/// Rows (tile tokens × query heads per KV head) of one tile of the tensor-core prefill kernel
/// (its `PM_ROWS(hd)`): two row tiles of 16 per warp at head_dim 64, one at 128.
pub fn prefill_mma_rows(head_dim: usize) -> usize {
    if head_dim <= 64 {
        128
    } else {
        64
    }
}

/// Dynamic shared memory of the tensor-core prefill kernel for `head_dim` over a pool of
/// `elem_bytes`-byte elements (its `PM_SMEM_BYTES(hd, es)`): bf16 pools double-buffer the bf16
/// K/V tiles of 64 positions, f32 and FP8 pools stage one raw tile (and FP8 its scales) beside
/// one converted pair.
pub fn prefill_mma_smem(head_dim: usize, elem_bytes: usize) -> usize {
    const BN: usize = 64;
    let tile = BN * 2 * head_dim;
    match elem_bytes {
        2 => 4 * tile,
        1 => 2 * BN * head_dim + 2 * BN * 4 + 2 * tile,
        _ => 2 * BN * elem_bytes * head_dim + 2 * tile,
    }
}

/// The bf16 tensor-core decode attention (`attn_decode=mma-bf16`): `mma.sync` m16n8k16 over a
/// paged KV cache, split-K over the context, and the kernel that merges the splits. See
/// `docs/cuda_decode_attention.md`.
pub const DECODE_MMA: KernelSource = KernelSource {
    name: "decode_attention_mma.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/decode_attention_mma.cu")
    ),
    entry_points: &[
        "decode_attn_mma_bf16kv",
        "decode_attn_mma_f32kv",
        "decode_attn_mma_fp8kv",
        "decode_attn_combine",
        "decode_attn_mma_cluster_bf16kv",
        "decode_attn_mma_cluster_f32kv",
        "decode_attn_mma_cluster_fp8kv",
    ],
};

/// Dynamic shared memory of the mma decode kernel (its `DA_SMEM_BYTES`), within sm_120's 99 KB.
pub const DECODE_MMA_SMEM: usize = 65536;

/// The persistent single-sequence decode step (`megakernel=on`): `kernels/decode_step.cu` after
/// the engine's and the mma decode kernels' sources, whose device functions are its phases (so
/// the module also holds their entry points, unused from here).
pub const DECODE_STEP: KernelSource = KernelSource {
    name: "decode_step.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/engine.cu"),
        include_str!("../../../kernels/decode_attention_mma.cu"),
        include_str!("../../../kernels/decode_step.cu")
    ),
    entry_points: &["decode_step", "decode_step_bf16kv", "grid_sync_bench"],
};

/// The o projection that merges the mma decode kernel's splits as it reads them (`fuse=on`):
/// `kernels/decode_fused.cu` after the engine's and the mma decode kernels' sources, whose GEMV
/// and split-merge device functions it combines (so the module also holds their entry points,
/// unused from here).
pub const FUSED: KernelSource = KernelSource {
    name: "decode_fused.cu",
    code: concat!(
        include_str!("../../../kernels/trace.cu"),
        include_str!("../../../kernels/engine.cu"),
        include_str!("../../../kernels/decode_attention_mma.cu"),
        include_str!("../../../kernels/decode_fused.cu")
    ),
    entry_points: &[
        "gemv_bf16_merged_1",
        "gemv_bf16_merged_2",
        "gemv_bf16_merged_3",
        "gemv_bf16_merged_4",
    ],
};

/// Every kernel source shipped (what the portability test compiles for each architecture).
pub const ALL: &[KernelSource] = &[ENGINE, DECODE_MMA, PREFILL, PREFILL_MMA, DECODE_STEP, FUSED];

/// The virtual architecture for a compute capability, e.g. `(9, 0)` → `compute_90`.
pub fn virtual_arch(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

/// True when the NVRTC library can be loaded (checked without panicking).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        // IEEE division and square root, no flush-to-zero, no fused contraction changes beyond
        // the default: the kernels must compute what the CPU reference computes.
        "--fmad=true".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
        "-default-device".into(),
        "--std=c++17".into(),
    ]
    .into_iter()
    .chain(super::tune::get().nvrtc_defines.iter().cloned())
    .collect()
}

fn cache_key(src: &KernelSource, arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(src.code.as_bytes());
    for o in options(arch) {
        h.update(o.as_bytes());
        h.update([0]);
    }
    let digest = hex::encode(h.finalize());
    format!(
        "{}-{}-{arch}",
        src.name.trim_end_matches(".cu"),
        &digest[..16]
    )
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TAPEDECK_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("tapedeck").join("kernels"))
}

fn memory_cache() -> &'static RwLock<HashMap<String, String>> {
    static CACHE: OnceLock<RwLock<HashMap<String, String>>> = OnceLock::new();
    CACHE.get_or_init(|| RwLock::new(HashMap::new()))
}

/// Compiles `src` to PTX for `arch` (e.g. `compute_90`) with NVRTC, without caching. The error
/// carries NVRTC's log.
pub fn compile_uncached(src: &KernelSource, arch: &str) -> Result<String> {
    if !nvrtc_present() {
        return Err(Error::Device(
            "the NVRTC library (libnvrtc.so) was not found; add the CUDA toolkit's lib64 folder to \
             LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch),
        name: Some(src.name.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src.code, opts)
        .map_err(|e| Error::Device(format!("kernels/{} for {arch}: {e:?}", src.name)))?;
    Ok(ptx.to_src())
}

/// PTX of `src` for `arch`, from the memory cache, the disk cache, or NVRTC (filling both).
pub fn ptx(src: &KernelSource, arch: &str) -> Result<String> {
    let key = cache_key(src, arch);
    if let Ok(map) = memory_cache().read() {
        if let Some(p) = map.get(&key) {
            return Ok(p.clone());
        }
    }
    // Compiled outside the lock, so several files compile at once (cuda/launch.rs
    // `load_modules`); a file two threads want at once is compiled twice, the same text.
    let file = cache_dir().map(|d| d.join(format!("{key}.ptx")));
    let from_disk = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok());
    let text = match from_disk {
        Some(t) if t.contains(".entry") => t,
        _ => {
            let t = compile_uncached(src, arch)?;
            if let Some(f) = &file {
                // A cache that cannot be written only costs a recompile next time.
                if let Some(dir) = f.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &t).is_ok() {
                    let _ = std::fs::rename(&tmp, f);
                }
            }
            t
        }
    };
    memory_cache()
        .write()
        .map_err(|_| Error::Device("kernel cache lock poisoned".into()))?
        .insert(key, text.clone());
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_change_with_source_and_arch() {
        let a = cache_key(&ENGINE, "compute_90");
        let b = cache_key(&ENGINE, "compute_120");
        assert_ne!(a, b);
        let other = KernelSource {
            code: "extern \"C\" __global__ void k() {}",
            ..ENGINE
        };
        assert_ne!(cache_key(&other, "compute_90"), a);
        assert!(
            a.starts_with("engine-") && a.ends_with("-compute_90"),
            "{a}"
        );
    }

    #[test]
    fn every_entry_point_is_in_its_source() {
        for src in ALL {
            for e in src.entry_points {
                // `extern "C" __global__ void [__launch_bounds__(..)] NAME(` on one or two lines.
                let at = src
                    .code
                    .match_indices(&format!("{e}("))
                    .map(|(i, _)| i)
                    .find(|&i| {
                        let before = &src.code[i.saturating_sub(120)..i];
                        before.contains("extern \"C\" __global__")
                    });
                assert!(at.is_some(), "{} lacks the entry point {e}", src.name);
            }
        }
    }

    /// The text between the parenthesis at `open` and its match.
    fn parenthesised(code: &str, open: usize) -> &str {
        let mut depth = 0;
        for (i, ch) in code[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        return &code[open + 1..open + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unbalanced parentheses")
    }

    /// The parameters of a parameter list, expanding a lone `MACRO(..)` from its `#define`.
    fn parameters(code: &str, list: &str) -> usize {
        let list = list.trim();
        let macro_name = list
            .strip_suffix(')')
            .and_then(|l| l.split_once('('))
            .map(|p| p.0)
            .filter(|name| !name.contains([',', ' ']));
        if let Some(name) = macro_name {
            let def = format!("#define {name}(");
            let at = code.find(&def).expect("the macro's #define") + def.len() - 1;
            let rest = &code[at + parenthesised(code, at).len() + 2..];
            let body: String = rest
                .lines()
                .scan(true, |more, line| {
                    let keep = *more;
                    *more = line.trim_end().ends_with('\\');
                    keep.then(|| line.trim_end().trim_end_matches('\\').to_string())
                })
                .collect::<Vec<_>>()
                .join(" ");
            return parameters(code, &body);
        }
        let mut depth = 0;
        1 + list
            .chars()
            .filter(|&c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .count()
    }

    #[test]
    fn no_entry_point_takes_more_arguments_than_a_launch_holds() {
        // A launch packs its arguments into a fixed array; an entry point with more parameters
        // panics at launch, which a CPU-only run never reaches (the fused q/k/v + RoPE GEMV
        // outgrew 24 slots this way).
        let mut longest = ("", 0);
        for src in ALL {
            for e in src.entry_points {
                let at = src
                    .code
                    .match_indices(&format!("{e}("))
                    .filter(|&(i, _)| {
                        let b = src.code.as_bytes()[i.saturating_sub(1)];
                        !(b.is_ascii_alphanumeric() || b == b'_')
                    })
                    .map(|(i, _)| i + e.len())
                    .find(|&i| src.code[i.saturating_sub(160)..i].contains("__global__"))
                    .unwrap_or_else(|| panic!("{} lacks {e}", src.name));
                let n = parameters(src.code, parenthesised(src.code, at));
                assert!(
                    n <= crate::cuda::launch::MAX_KERNEL_ARGS,
                    "{e} takes {n} parameters, a launch holds {}",
                    crate::cuda::launch::MAX_KERNEL_ARGS
                );
                if n > longest.1 {
                    longest = (e, n);
                }
            }
        }
        // The count is real: the fused q/k/v + RoPE GEMV's list comes from its macro.
        assert!(longest.1 >= 20, "{longest:?}");
        println!("longest parameter list: {} ({})", longest.0, longest.1);
    }
}
