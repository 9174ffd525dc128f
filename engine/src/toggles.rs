//! Named switches that change how the engine computes, recorded with every result.
//!
//! A replay A/Bs two toggle sets and a bisect searches the difference between them, so a toggle set
//! must be a value: canonical text form (`matmul=bf16,kv_dtype=fp8-e4m3`), parse, compare, diff.
//! The registry ([`REGISTRY`]) is what `tapedeck toggles` prints. Toggles named `fault.*` plant a
//! known bug class on purpose; they are off by default and exist to prove that replay catches it.

use std::fmt;
use std::num::NonZeroUsize;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Precision of the inputs of a matrix product or of attention scores.
///
/// `Bf16` rounds each input to bfloat16 (round-to-nearest-even) and accumulates in f32, exactly as a
/// tensor-core kernel with bf16 operands does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Precision {
    /// f32 inputs, f32 accumulation: the reference.
    #[default]
    F32,
    /// bf16 inputs, f32 accumulation.
    Bf16,
}

/// Storage type of the key/value cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum KvDtype {
    /// f32: the reference.
    #[default]
    F32,
    /// bfloat16, round-to-nearest-even.
    Bf16,
    /// FP8 E4M3 (OCP "e4m3fn": max 448, no infinities), one f32 scale per token and head, chosen as
    /// `amax / 448` so that every value of that head vector is representable.
    Fp8E4m3,
}

impl KvDtype {
    /// The toggle's text form of the value (`f32`, `bf16`, `fp8-e4m3`).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8E4m3 => "fp8-e4m3",
        }
    }

    /// Whether a cache storing `self` can hold a request's `kv_dtype`: f32 storage holds every
    /// dtype's rounded values, packed storage only its own type.
    pub fn holds(self, kv_dtype: KvDtype) -> bool {
        self == KvDtype::F32 || self == kv_dtype
    }

    /// An error unless a cache storing `self` can hold `kv_dtype`.
    pub(crate) fn check_holds(self, kv_dtype: KvDtype) -> crate::Result<()> {
        if self.holds(kv_dtype) {
            return Ok(());
        }
        Err(crate::Error::InvalidRequest(format!(
            "the KV cache stores {}, so it cannot run a request with kv_dtype={} (start the \
             server with that kv_dtype, or with kv_dtype=f32, which holds every dtype)",
            self.name(),
            kv_dtype.name()
        )))
    }
}

/// The decode attention kernel.
///
/// `MmaBf16` is the fast path of GPU engines: bf16 tensor-core MMAs (q, k, the softmax
/// probabilities and v rounded to bf16, f32 accumulation), split over the context. On the CPU it is
/// emulated bit for bit in its roundings; prefill attention is unaffected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum AttnDecode {
    /// f32 on CUDA cores: the reference.
    #[default]
    SimtF32,
    /// bf16 tensor cores, split-K over the context.
    MmaBf16,
}

/// The prompt (prefill) attention kernel.
///
/// `MmaBf16` is the bf16 tensor-core prefill of GPU engines (flash-attention style: q, k, the
/// softmax probabilities against a running max, and v rounded to bf16, f32 accumulation). On the
/// CPU, and on the GPU for head dims it does not take, its roundings are emulated with the row's
/// final max; decode steps are unaffected (see [`AttnDecode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum AttnPrefill {
    /// f32 on CUDA cores (the tiled kernel): the reference.
    #[default]
    SimtF32,
    /// bf16 tensor cores (`mma.sync`), online softmax.
    MmaBf16,
}

/// How the GPU runs linear layers of a few tokens (decode steps) with `matmul=bf16`.
///
/// Batch-1 decode is a matrix-vector product per weight matrix, bound by reading the weights.
/// `Gemv` runs our own kernels (one warp per output feature, q/k/v in one launch, gate/up fused
/// with SiLU·up, residual adds fused into the o and down projections); `Cublas` keeps cuBLAS's
/// GEMM. Both round the same inputs to bf16 and accumulate in f32, in a different order. The CPU
/// ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum SmallGemm {
    /// cuBLAS for every size: the reference.
    #[default]
    Cublas,
    /// Our bf16 GEMV kernels for up to 4 tokens; cuBLAS above.
    Gemv,
}

/// Which GPU kernels are launched with programmatic dependent launch (sm_90 and later; ignored
/// before and on the CPU).
///
/// Such a kernel may start while the one before it still runs and waits for it on the device, so
/// launch latency and the ramp-up of one kernel hide behind the tail of the previous one; with the
/// GEMV kernels the weight fetch itself overlaps. Numerically nothing changes; a kernel that read
/// its input before its wait would race, silently, so it is a toggle a replay can A/B.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Pdl {
    /// Every kernel waits for the previous one to finish before it starts: the reference.
    #[default]
    Off,
    /// The GEMV kernels (`small_gemm=gemv`), which prefetch their weights before they wait
    /// (text form `on`).
    Gemv,
    /// Also RoPE + KV write, decode attention and its split merge, the final RMSNorm and the token
    /// pick: one chain of early launches through the whole decode step.
    All,
}

/// An encoding fault: a deliberately wrong prompt-encoding rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum EncodingFault {
    /// The correct rule.
    #[default]
    Off,
    /// Drop `reasoning_content` of every assistant turn before the last user message, even when
    /// tools are present (the correct rule keeps it then).
    DropThinkingAlways,
}

/// Every toggle of the engine, with its current value.
///
/// `Default` is the reference configuration: f32 everywhere, no sparse attention, no faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Toggles {
    /// Input precision of every linear layer.
    pub matmul: Precision,
    /// Input precision of the `q·k` products and of `softmax·v` in attention.
    pub attn_scores: Precision,
    /// Storage type of cached keys and values.
    pub kv_dtype: KvDtype,
    /// Decode attention kernel (decode steps only).
    pub attn_decode: AttnDecode,
    /// Prompt attention kernel (prefill and prompt chunks only).
    pub attn_prefill: AttnPrefill,
    /// Sparse decode attention: each decode step attends only to the N cached tokens with the
    /// highest scores (like a DSA "lightning indexer"). `None` attends to all tokens.
    pub decode_topk: Option<NonZeroUsize>,
    /// Decode steps replayed as CUDA graphs captured per batch-size bucket (GPU only; the CPU
    /// ignores it). Graph replay is a known source of silent corruption in serving engines (stale
    /// pointers, padded rows, baked-in shapes), so it is a toggle a replay can A/B and bisect.
    pub cuda_graphs: bool,
    /// Kernels for linear layers of a few tokens (GPU, `matmul=bf16` only).
    pub small_gemm: SmallGemm,
    /// Programmatic dependent launch (see [`Pdl`]).
    pub pdl: Pdl,
    /// A single-sequence decode step runs as one persistent kernel (GPU, sm_80+; needs
    /// `matmul=bf16`, `small_gemm=gemv` and `attn_decode=mma-bf16`, otherwise the step runs as
    /// separate kernels). Its blocks stay resident for the whole step and meet at grid-wide
    /// barriers between the phases (q/k/v, RoPE, attention, merge, o, gate/up, down), so no phase
    /// waits for a launch and each one's weight fetch is issued before the barrier that opens it.
    /// Same arithmetic as the separate kernels, so the same bits; a barrier bug would race
    /// silently, hence a toggle.
    pub megakernel: bool,
    /// Decode-step kernel fusions on the GEMV path (GPU, `small_gemm=gemv`): the q/k/v GEMV
    /// applies RoPE and writes the KV cache in its epilogue (f32 or bf16 KV), one launch fewer per
    /// layer, and the head's GEMV does the final RMSNorm, one fewer per step; `TAPEDECK_FUSE`
    /// can add the o GEMV merging the mma decode kernel's splits as it reads them (measured
    /// slower, so not by default). Same arithmetic as the separate kernels, so the same bits; a
    /// fusion bug (a stale KV row, a merge read before the splits land) corrupts silently, hence
    /// a toggle.
    pub fuse: bool,
    /// Prompt-encoding fault.
    pub fault_encoding: EncodingFault,
    /// Context-window fault: silently drop the oldest non-system turns until the prompt fits in N
    /// tokens (what a proxy that "helpfully" truncates does). `None` never drops.
    pub fault_context_window: Option<NonZeroUsize>,
    /// Prefill prompts in chunks of at most N tokens, interleaved with other sequences' decode
    /// steps. `None` prefills a prompt in one pass.
    pub prefill_chunk: Option<NonZeroUsize>,
    /// Reuse cached KV blocks of a common token prefix across requests.
    pub prefix_cache: bool,
    /// Prefix-cache fault: a lookup ignores the last token of each block, so a block whose tokens
    /// differ only there is reused (a stale hit).
    pub fault_prefix_cache_stale: bool,
    /// Chunked-prefill fault: the first token of a chunk cannot see the token just before it.
    pub fault_chunk_boundary: bool,
}

impl Default for Toggles {
    fn default() -> Self {
        Toggles {
            matmul: Precision::F32,
            attn_scores: Precision::F32,
            kv_dtype: KvDtype::F32,
            attn_decode: AttnDecode::SimtF32,
            attn_prefill: AttnPrefill::SimtF32,
            decode_topk: None,
            cuda_graphs: false,
            small_gemm: SmallGemm::Cublas,
            pdl: Pdl::Off,
            megakernel: false,
            fuse: false,
            fault_encoding: EncodingFault::Off,
            fault_context_window: None,
            prefill_chunk: None,
            prefix_cache: true,
            fault_prefix_cache_stale: false,
            fault_chunk_boundary: false,
        }
    }
}

/// What the registry knows about one toggle.
#[derive(Debug, Clone, Copy)]
pub struct ToggleSpec {
    /// Name as written in `name=value`.
    pub name: &'static str,
    /// Allowed values, as a user would type them (`N` stands for a positive integer).
    pub values: &'static str,
    /// The default value's text.
    pub default: &'static str,
    /// One line on what it changes.
    pub description: &'static str,
}

/// Every toggle the engine knows, in canonical order.
pub const REGISTRY: &[ToggleSpec] = &[
    ToggleSpec {
        name: "matmul",
        values: "f32 | bf16",
        default: "f32",
        description: "input precision of linear layers (bf16 = RNE-rounded inputs, f32 accumulate)",
    },
    ToggleSpec {
        name: "attn_scores",
        values: "f32 | bf16",
        default: "f32",
        description: "input precision of attention q·k and p·v products",
    },
    ToggleSpec {
        name: "kv_dtype",
        values: "f32 | bf16 | fp8-e4m3",
        default: "f32",
        description: "storage type of the KV cache (fp8: per-token-head scale amax/448); \
                      the CPU stores it packed (bf16 2 bytes, fp8 1 byte + a scale per head), \
                      so the same KV budget holds 2x / ~3.8x the tokens",
    },
    ToggleSpec {
        name: "attn_decode",
        values: "simt-f32 | mma-bf16",
        default: "simt-f32",
        description: "decode attention kernel (mma-bf16: bf16 q/k/p/v, f32 accumulate)",
    },
    ToggleSpec {
        name: "attn_prefill",
        values: "simt-f32 | mma-bf16",
        default: "simt-f32",
        description: "prompt attention kernel (mma-bf16: bf16 tensor cores, q/k/p/v rounded, f32 accumulate)",
    },
    ToggleSpec {
        name: "decode_topk",
        values: "off | N",
        default: "off",
        description: "sparse decode attention over the N highest-scoring cached tokens",
    },
    ToggleSpec {
        name: "cuda_graphs",
        values: "on | off",
        default: "off",
        description: "replay decode steps as CUDA graphs per batch-size bucket (GPU only)",
    },
    ToggleSpec {
        name: "small_gemm",
        values: "cublas | gemv",
        default: "cublas",
        description:
            "linear layers of <= 4 tokens with matmul=bf16: cuBLAS or our GEMVs (GPU only)",
    },
    ToggleSpec {
        name: "pdl",
        values: "off | on | all",
        default: "off",
        description:
            "programmatic dependent launch (sm_90+): on = the GEMV kernels, all = every decode kernel",
    },
    ToggleSpec {
        name: "megakernel",
        values: "off | on",
        default: "off",
        description:
            "batch-1 decode step as one persistent kernel with grid barriers (GPU, gemv + mma-bf16)",
    },
    ToggleSpec {
        name: "fuse",
        values: "off | on",
        default: "off",
        description:
            "decode GEMVs absorb RoPE + KV write (q/k/v) and the final RMSNorm (head): fewer launches (GPU)",
    },
    ToggleSpec {
        name: "prefill_chunk",
        values: "off | N",
        default: "off",
        description: "prefill prompts in chunks of at most N tokens (interleaved with decodes)",
    },
    ToggleSpec {
        name: "prefix_cache",
        values: "on | off",
        default: "on",
        description: "reuse KV blocks of a shared token prefix across requests",
    },
    ToggleSpec {
        name: "fault.encoding",
        values: "off | drop_thinking_always",
        default: "off",
        description: "FAULT: drop prior-turn reasoning even when tools are present",
    },
    ToggleSpec {
        name: "fault.context_window",
        values: "off | N",
        default: "off",
        description: "FAULT: silently drop the oldest turns until the prompt fits N tokens",
    },
    ToggleSpec {
        name: "fault.prefix_cache",
        values: "off | stale",
        default: "off",
        description: "FAULT: prefix-cache lookups ignore each block's last token (stale hits)",
    },
    ToggleSpec {
        name: "fault.chunk",
        values: "off | boundary",
        default: "off",
        description: "FAULT: a prefill chunk's first token cannot see the token before it",
    },
];

fn bad(name: &str, value: &str) -> Error {
    let allowed = REGISTRY
        .iter()
        .find(|s| s.name == name)
        .map(|s| s.values)
        .unwrap_or("?");
    Error::Toggle {
        name: name.to_string(),
        message: format!("invalid value {value:?} (allowed: {allowed})"),
    }
}

fn parse_precision(name: &str, v: &str) -> Result<Precision> {
    match v {
        "f32" => Ok(Precision::F32),
        "bf16" => Ok(Precision::Bf16),
        _ => Err(bad(name, v)),
    }
}

fn parse_off_or_n(name: &str, v: &str) -> Result<Option<NonZeroUsize>> {
    if v == "off" {
        return Ok(None);
    }
    v.parse::<NonZeroUsize>()
        .map(Some)
        .map_err(|_| bad(name, v))
}

/// Parses a two-valued toggle whose "on" value is spelled `on_word` and whose other value is `off`.
fn parse_on_off(name: &str, v: &str, on_word: &str) -> Result<bool> {
    match v {
        "off" => Ok(false),
        v if v == on_word => Ok(true),
        _ => Err(bad(name, v)),
    }
}

fn on_off(v: bool, on_word: &str) -> String {
    if v { on_word } else { "off" }.to_string()
}

fn precision_str(p: Precision) -> &'static str {
    match p {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
    }
}

fn off_or_n(v: Option<NonZeroUsize>) -> String {
    v.map_or_else(|| "off".to_string(), |n| n.to_string())
}

/// Named toggle sets that `preset=NAME` applies (see [`Toggles::set`]): the fastest GPU decode
/// measured (docs/benchmarks.md), so a serving user types one name instead of seven toggles.
/// Records keep the toggles it expanded to, never the name, so a later change to a preset cannot
/// change what an old run says it ran.
pub const PRESETS: &[(&str, &str)] = &[(
    "gpu-fast",
    "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on,fuse=on,kv_dtype=bf16,\
     attn_prefill=mma-bf16",
)];

impl Toggles {
    /// Sets one toggle from its text form, e.g. `set("kv_dtype", "bf16")`. The name `preset`
    /// sets every toggle of a [`PRESETS`] entry at once; toggles set after it override it.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let value = value.trim();
        match name.trim() {
            "preset" => {
                let (_, set) = PRESETS.iter().find(|p| p.0 == value).ok_or_else(|| {
                    let known: Vec<_> = PRESETS.iter().map(|p| p.0).collect();
                    Error::Toggle {
                        name: "preset".to_string(),
                        message: format!("unknown preset {value:?} (known: {})", known.join(", ")),
                    }
                })?;
                self.set_list(set)?;
            }
            "matmul" => self.matmul = parse_precision(name, value)?,
            "attn_scores" => self.attn_scores = parse_precision(name, value)?,
            "kv_dtype" => {
                self.kv_dtype = match value {
                    "f32" => KvDtype::F32,
                    "bf16" => KvDtype::Bf16,
                    "fp8-e4m3" | "fp8" => KvDtype::Fp8E4m3,
                    _ => return Err(bad(name, value)),
                }
            }
            "attn_decode" => {
                self.attn_decode = match value {
                    "simt-f32" => AttnDecode::SimtF32,
                    "mma-bf16" => AttnDecode::MmaBf16,
                    _ => return Err(bad(name, value)),
                }
            }
            "attn_prefill" => {
                self.attn_prefill = match value {
                    "simt-f32" => AttnPrefill::SimtF32,
                    "mma-bf16" => AttnPrefill::MmaBf16,
                    _ => return Err(bad(name, value)),
                }
            }
            "decode_topk" => self.decode_topk = parse_off_or_n(name, value)?,
            "cuda_graphs" => self.cuda_graphs = parse_on_off(name, value, "on")?,
            "small_gemm" => {
                self.small_gemm = match value {
                    "cublas" => SmallGemm::Cublas,
                    "gemv" => SmallGemm::Gemv,
                    _ => return Err(bad(name, value)),
                }
            }
            "pdl" => {
                self.pdl = match value {
                    "off" => Pdl::Off,
                    "on" => Pdl::Gemv,
                    "all" => Pdl::All,
                    _ => return Err(bad(name, value)),
                }
            }
            "megakernel" => self.megakernel = parse_on_off(name, value, "on")?,
            "fuse" => self.fuse = parse_on_off(name, value, "on")?,
            "fault.encoding" => {
                self.fault_encoding = match value {
                    "off" => EncodingFault::Off,
                    "drop_thinking_always" => EncodingFault::DropThinkingAlways,
                    _ => return Err(bad(name, value)),
                }
            }
            "fault.context_window" => self.fault_context_window = parse_off_or_n(name, value)?,
            "prefill_chunk" => self.prefill_chunk = parse_off_or_n(name, value)?,
            "prefix_cache" => self.prefix_cache = parse_on_off(name, value, "on")?,
            "fault.prefix_cache" => {
                self.fault_prefix_cache_stale = parse_on_off(name, value, "stale")?
            }
            "fault.chunk" => self.fault_chunk_boundary = parse_on_off(name, value, "boundary")?,
            other => {
                let known: Vec<_> = REGISTRY.iter().map(|s| s.name).collect();
                return Err(Error::Toggle {
                    name: other.to_string(),
                    message: format!(
                        "unknown toggle (known: {}; and preset=NAME for a named set)",
                        known.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// Sets each `name=value` of a comma-separated list, in order.
    fn set_list(&mut self, list: &str) -> Result<()> {
        for part in list.split(',').filter(|p| !p.trim().is_empty()) {
            let (name, value) = part.split_once('=').ok_or_else(|| Error::Toggle {
                name: part.to_string(),
                message: "expected name=value".to_string(),
            })?;
            self.set(name, value)?;
        }
        Ok(())
    }

    /// The value of one toggle in text form, or `None` for an unknown name.
    pub fn get(&self, name: &str) -> Option<String> {
        Some(match name {
            "matmul" => precision_str(self.matmul).to_string(),
            "attn_scores" => precision_str(self.attn_scores).to_string(),
            "kv_dtype" => self.kv_dtype.name().to_string(),
            "attn_decode" => match self.attn_decode {
                AttnDecode::SimtF32 => "simt-f32",
                AttnDecode::MmaBf16 => "mma-bf16",
            }
            .to_string(),
            "attn_prefill" => match self.attn_prefill {
                AttnPrefill::SimtF32 => "simt-f32",
                AttnPrefill::MmaBf16 => "mma-bf16",
            }
            .to_string(),
            "decode_topk" => off_or_n(self.decode_topk),
            "cuda_graphs" => on_off(self.cuda_graphs, "on"),
            "small_gemm" => match self.small_gemm {
                SmallGemm::Cublas => "cublas",
                SmallGemm::Gemv => "gemv",
            }
            .to_string(),
            "pdl" => match self.pdl {
                Pdl::Off => "off",
                Pdl::Gemv => "on",
                Pdl::All => "all",
            }
            .to_string(),
            "megakernel" => on_off(self.megakernel, "on"),
            "fuse" => on_off(self.fuse, "on"),
            "fault.encoding" => match self.fault_encoding {
                EncodingFault::Off => "off",
                EncodingFault::DropThinkingAlways => "drop_thinking_always",
            }
            .to_string(),
            "fault.context_window" => off_or_n(self.fault_context_window),
            "prefill_chunk" => off_or_n(self.prefill_chunk),
            "prefix_cache" => on_off(self.prefix_cache, "on"),
            "fault.prefix_cache" => on_off(self.fault_prefix_cache_stale, "stale"),
            "fault.chunk" => on_off(self.fault_chunk_boundary, "boundary"),
            _ => return None,
        })
    }

    /// Every toggle as `(name, value)` in registry order, defaults included.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        REGISTRY
            .iter()
            .map(|s| (s.name, self.get(s.name).unwrap_or_default()))
            .collect()
    }

    /// Only the toggles that differ from the default, in registry order.
    pub fn non_default(&self) -> Vec<(&'static str, String)> {
        let d = Toggles::default();
        self.pairs()
            .into_iter()
            .filter(|(n, v)| d.get(n).as_deref() != Some(v.as_str()))
            .collect()
    }

    /// The names of the toggles whose values differ between `self` and `other`.
    pub fn diff(&self, other: &Toggles) -> Vec<&'static str> {
        REGISTRY
            .iter()
            .map(|s| s.name)
            .filter(|n| self.get(n) != other.get(n))
            .collect()
    }

    /// The toggles that change the numbers stored in the KV cache, in canonical text: the part of
    /// the set that a prefix-cache key must include. Chunking and caching themselves do not change
    /// the numbers (the invariance tests prove it), so they are left out, except the chunk fault.
    pub fn kv_key(&self) -> String {
        let mut t = *self;
        t.prefill_chunk = None;
        t.prefix_cache = true;
        t.fault_prefix_cache_stale = false;
        t.fault_encoding = EncodingFault::Off;
        t.fault_context_window = None;
        t.to_string()
    }

    /// Whether attention rounds its operands to bf16: everywhere with `attn_scores=bf16`, in
    /// decode steps with the bf16 tensor-core decode kernel (`attn_decode=mma-bf16`), in prompt
    /// tokens with the tensor-core prefill kernel (`attn_prefill=mma-bf16`).
    pub fn attention_bf16(&self, decode: bool) -> bool {
        self.attn_scores == Precision::Bf16
            || if decode {
                self.attn_decode == AttnDecode::MmaBf16
            } else {
                self.attn_prefill == AttnPrefill::MmaBf16
            }
    }

    /// True when a decode step computes exactly what a prefill of the same token would: no decode-
    /// only kernel or selection is on. Only then may KV written by decode steps be shared through
    /// the prefix cache with later prompts (which prefill those positions).
    pub fn decode_matches_prefill(&self) -> bool {
        self.decode_topk.is_none()
            && self.attn_decode == AttnDecode::SimtF32
            && self.attn_prefill == AttnPrefill::SimtF32
    }

    /// True when any `fault.*` toggle is on.
    pub fn has_fault(&self) -> bool {
        self.non_default()
            .iter()
            .any(|(n, _)| n.starts_with("fault."))
    }
}

/// Canonical text: the non-default toggles, `name=value` joined by commas (`""` for the default).
impl fmt::Display for Toggles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .non_default()
            .into_iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Parses `name=value,name=value` (empty or `default` for the default set).
impl FromStr for Toggles {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let mut t = Toggles::default();
        let s = s.trim();
        if s.is_empty() || s == "default" {
            return Ok(t);
        }
        t.set_list(s)?;
        Ok(t)
    }
}

impl Serialize for Toggles {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let pairs = self.pairs();
        let mut m = s.serialize_map(Some(pairs.len()))?;
        for (n, v) in pairs {
            m.serialize_entry(n, &v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Toggles {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let map = std::collections::BTreeMap::<String, String>::deserialize(d)?;
        let mut t = Toggles::default();
        for (n, v) in map {
            t.set(&n, &v).map_err(serde::de::Error::custom)?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_empty_text_and_round_trips() {
        let t = Toggles::default();
        assert_eq!(t.to_string(), "");
        assert_eq!("".parse::<Toggles>().unwrap(), t);
    }

    #[test]
    fn text_form_round_trips_every_toggle() {
        let s =
            "matmul=bf16,attn_scores=bf16,kv_dtype=fp8-e4m3,attn_decode=mma-bf16,decode_topk=64,\
                 cuda_graphs=on,small_gemm=gemv,pdl=all,megakernel=on,fuse=on,prefill_chunk=7,prefix_cache=off,fault.encoding=drop_thinking_always,\
                 fault.context_window=512,fault.prefix_cache=stale,fault.chunk=boundary";
        let t: Toggles = s.parse().unwrap();
        assert_eq!(t.to_string(), s);
        assert_eq!(t.to_string().parse::<Toggles>().unwrap(), t);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Toggles>(&json).unwrap(), t);
        assert!(t.has_fault());
    }

    #[test]
    fn pdl_on_keeps_meaning_the_gemv_kernels() {
        // Runs recorded before `pdl=all` existed say `pdl=on`: it must still read as GEMV-only.
        let t: Toggles = "pdl=on".parse().unwrap();
        assert_eq!(t.pdl, Pdl::Gemv);
        assert_eq!(t.to_string(), "pdl=on");
        assert_eq!("pdl=all".parse::<Toggles>().unwrap().pdl, Pdl::All);
        assert!("pdl=yes".parse::<Toggles>().is_err());
    }

    #[test]
    fn presets_expand_to_their_toggles_and_later_ones_override() {
        let fast: Toggles = "preset=gpu-fast".parse().unwrap();
        assert_eq!(
            fast.to_string(),
            "matmul=bf16,kv_dtype=bf16,attn_decode=mma-bf16,attn_prefill=mma-bf16,\
             cuda_graphs=on,small_gemm=gemv,pdl=on,fuse=on"
        );
        let t: Toggles = "preset=gpu-fast,kv_dtype=fp8,cuda_graphs=off"
            .parse()
            .unwrap();
        assert_eq!(t.kv_dtype, KvDtype::Fp8E4m3);
        assert!(!t.cuda_graphs);
        assert_eq!(t.diff(&fast), ["kv_dtype", "cuda_graphs"]);
        let before: Toggles = "kv_dtype=fp8,preset=gpu-fast".parse().unwrap();
        assert_eq!(before, fast, "a preset overrides what came before it");
        let e = "preset=turbo".parse::<Toggles>().unwrap_err().to_string();
        assert!(
            e.contains("unknown preset") && e.contains("gpu-fast"),
            "{e}"
        );
    }

    #[test]
    fn bad_names_and_values_are_clear_errors() {
        let e = "matmul=f16".parse::<Toggles>().unwrap_err().to_string();
        assert!(e.contains("matmul") && e.contains("f32 | bf16"), "{e}");
        let e = "nope=1".parse::<Toggles>().unwrap_err().to_string();
        assert!(e.contains("unknown toggle"), "{e}");
        let e = "decode_topk=0".parse::<Toggles>().unwrap_err().to_string();
        assert!(e.contains("decode_topk"), "{e}");
        assert!("matmul".parse::<Toggles>().is_err());
    }

    #[test]
    fn decode_only_toggles_break_decode_prefill_equality() {
        // (attn_prefill=mma-bf16 changes prompt rows only, which breaks the equality from the
        // other side: decode steps keep the f32 kernel.)
        assert!(Toggles::default().decode_matches_prefill());
        assert!("matmul=bf16,kv_dtype=fp8-e4m3,prefill_chunk=8"
            .parse::<Toggles>()
            .unwrap()
            .decode_matches_prefill());
        for t in [
            "decode_topk=64",
            "attn_decode=mma-bf16",
            "attn_prefill=mma-bf16",
        ] {
            assert!(
                !t.parse::<Toggles>().unwrap().decode_matches_prefill(),
                "{t}"
            );
        }
    }

    #[test]
    fn each_attention_kernel_toggle_rounds_only_its_own_rows() {
        let prefill: Toggles = "attn_prefill=mma-bf16".parse().unwrap();
        assert!(prefill.attention_bf16(false) && !prefill.attention_bf16(true));
        let decode: Toggles = "attn_decode=mma-bf16".parse().unwrap();
        assert!(!decode.attention_bf16(false) && decode.attention_bf16(true));
        let both: Toggles = "attn_scores=bf16".parse().unwrap();
        assert!(both.attention_bf16(false) && both.attention_bf16(true));
        assert!(!Toggles::default().attention_bf16(false));
    }

    #[test]
    fn diff_names_changed_toggles() {
        let a: Toggles = "matmul=bf16".parse().unwrap();
        let b: Toggles = "kv_dtype=bf16,matmul=bf16".parse().unwrap();
        assert_eq!(a.diff(&b), vec!["kv_dtype"]);
        assert!(a.diff(&a).is_empty());
    }
}
