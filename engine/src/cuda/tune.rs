//! Tuning knobs for kernel sweeps on a GPU machine, read once from the environment.
//!
//! The device machine has no Rust toolchain and little time, so a sweep (blocks per
//! multiprocessor of the persistent step kernel, the attention split length) must not need a
//! rebuild: the test and bench executables built elsewhere read these variables instead. Unset,
//! every knob keeps the measured default. Values that do not parse are reported once and ignored.
//!
//! - `TAPEDECK_NVRTC_DEFINES=NAME=VALUE,...`: preprocessor definitions for every kernel source
//!   (each kernel's tunable macros are `#ifndef`-guarded: decode_step.cu's `MK_MIN_BLOCKS`,
//!   `MK_DEPTH`, `MK_SWIGLU_DEPTH`, `MK_PHASES`), e.g. `MK_MIN_BLOCKS=1`. They enter the PTX
//!   cache key like any other compile option.
//! - `TAPEDECK_MMA_SPLIT_MIN=N`: the shortest split of the mma decode kernel's split-K (a
//!   multiple of 64, default 128).
//! - `TAPEDECK_GEMV_SLICE=N`: the longest slice of a weight row one GEMV warp reads (256, 512,
//!   1024 or 2048, the default): shorter slices spread a row over more warps.
//! - `TAPEDECK_MMA_MERGE=in-kernel`: merge the mma decode kernel's splits in the mma kernel's last
//!   block per KV head instead of in the separate combine kernel (`kernel`, the default). The
//!   same bits either way; in-kernel measured slower (llama-1b batch-1 decode on the H200: 724
//!   against 852 tok/s, cause not established).

use std::sync::OnceLock;

/// The knobs in effect for this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tuning {
    /// `-D` options added to every NVRTC compile.
    pub nvrtc_defines: Vec<String>,
    /// The mma decode kernel's shortest split, in positions.
    pub split_min: usize,
    /// The GEMV kernels' longest slice per warp, in inputs.
    pub gemv_slice: usize,
    /// Whether the mma decode kernel merges its own splits (else the combine kernel runs, the
    /// default).
    pub mma_merge_in_kernel: bool,
}

/// The default split floor. The engine's pool holds f32 (the `_f32kv` kernel, one tile in flight
/// per warp), where more, shorter splits pay at short contexts: llama-1b batch-1 decode at 576
/// positions ran 834 / 855 / 847 tok/s with 256 / 128 / 64 (H200). The standalone bf16-KV sweeps
/// (docs/cuda_decode_attention.md) chose 256.
const SPLIT_MIN: usize = 128;

impl Tuning {
    /// Parses the variables' values (`None` when unset).
    fn parse(
        defines: Option<&str>,
        split_min: Option<&str>,
        gemv_slice: Option<&str>,
        merge: Option<&str>,
    ) -> Tuning {
        let mut nvrtc_defines = Vec::new();
        for d in defines
            .unwrap_or("")
            .split(',')
            .filter(|d| !d.trim().is_empty())
        {
            let d = d.trim();
            let ok = d.split_once('=').is_some_and(|(name, value)| {
                !name.is_empty()
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && value
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            });
            if ok {
                nvrtc_defines.push(format!("-D{d}"));
            } else {
                tracing::warn!("TAPEDECK_NVRTC_DEFINES: ignoring {d:?} (want NAME=VALUE)");
            }
        }
        let split_min = number(
            "TAPEDECK_MMA_SPLIT_MIN",
            split_min,
            SPLIT_MIN,
            |n| n >= 64 && n.is_multiple_of(64),
            "a multiple of 64",
        );
        let gemv_slice = number(
            "TAPEDECK_GEMV_SLICE",
            gemv_slice,
            super::GEMV_SLICE,
            |n| [256, 512, 1024, 2048].contains(&n),
            "256, 512, 1024 or 2048",
        );
        let mma_merge_in_kernel = match merge.map(str::trim) {
            None | Some("kernel") => false,
            Some("in-kernel") => true,
            Some(other) => {
                tracing::warn!("TAPEDECK_MMA_MERGE: want in-kernel or kernel, not {other:?}");
                false
            }
        };
        Tuning {
            nvrtc_defines,
            split_min,
            gemv_slice,
            mma_merge_in_kernel,
        }
    }
}

/// Variable `name`'s number, `default` when unset or not one that `ok` accepts (`want` says which
/// are, in the warning).
fn number(
    name: &str,
    value: Option<&str>,
    default: usize,
    ok: impl Fn(usize) -> bool,
    want: &str,
) -> usize {
    match value.map(|v| v.trim().parse::<usize>()) {
        None => default,
        Some(Ok(n)) if ok(n) => n,
        Some(_) => {
            tracing::warn!("{name}: want {want}; using {default}");
            default
        }
    }
}

/// The process's knobs (the environment is read on first use).
pub(crate) fn get() -> &'static Tuning {
    static T: OnceLock<Tuning> = OnceLock::new();
    T.get_or_init(|| {
        let defines = std::env::var("TAPEDECK_NVRTC_DEFINES").ok();
        let split = std::env::var("TAPEDECK_MMA_SPLIT_MIN").ok();
        let slice = std::env::var("TAPEDECK_GEMV_SLICE").ok();
        let merge = std::env::var("TAPEDECK_MMA_MERGE").ok();
        Tuning::parse(
            defines.as_deref(),
            split.as_deref(),
            slice.as_deref(),
            merge.as_deref(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_knobs_keep_the_defaults_and_bad_values_are_ignored() {
        assert_eq!(
            Tuning::parse(None, None, None, None),
            Tuning {
                nvrtc_defines: vec![],
                split_min: 128,
                gemv_slice: 2048,
                mma_merge_in_kernel: false,
            }
        );
        let t = Tuning::parse(
            Some("MK_MIN_BLOCKS=1, X=2.5,bad,Y=a b,=3"),
            Some("96"),
            Some("100"),
            Some("in-kernel"),
        );
        assert_eq!(t.nvrtc_defines, ["-DMK_MIN_BLOCKS=1", "-DX=2.5"]);
        assert_eq!(t.split_min, 128, "96 is not a multiple of 64");
        assert_eq!(t.gemv_slice, 2048, "100 is not a slice length");
        assert!(t.mma_merge_in_kernel);
        assert_eq!(Tuning::parse(None, Some("64"), None, None).split_min, 64);
        assert_eq!(Tuning::parse(None, None, Some("512"), None).gemv_slice, 512);
    }
}
