//! Model configuration: Hugging Face `config.json` parsed into a validated [`Config`].
//!
//! Two forms of RoPE settings are in use and both are read: the classic top-level `rope_theta` /
//! `rope_scaling`, and the `rope_parameters` object that transformers v5 writes.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::tokenizer::read_json;

/// The architectures this engine runs. All are Llama-shaped decoders; they differ in biases and
/// defaults, which [`Config`] makes explicit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `LlamaForCausalLM`.
    Llama,
    /// `Qwen2ForCausalLM`: q/k/v projections carry biases.
    Qwen2,
    /// `MistralForCausalLM` (sliding-window attention is not applied; see [`Config::sliding_window`]).
    Mistral,
}

const SUPPORTED: &str = "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM";

/// How rotary frequencies are scaled for long context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Linear position interpolation: frequencies divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Overall scale factor (8 for Llama 3.1).
        factor: f64,
        /// Wavelengths longer than `original / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (fewer than `num_heads` with grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Context window in tokens.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// The output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases.
    pub qkv_bias: bool,
    /// The o projection and MLP carry biases (`attention_bias`/`mlp_bias` in some Llama configs).
    pub o_bias: bool,
    /// Mistral's sliding window, recorded but not applied: contexts beyond it are refused.
    pub sliding_window: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
}

fn num(v: &serde_json::Value, key: &str) -> Option<f64> {
    v.get(key).and_then(|x| x.as_f64())
}

/// Reads the scaling from an object carrying `rope_type` (or the older `type`) and its parameters.
fn parse_scaling(v: &serde_json::Value) -> Result<RopeScaling> {
    if v.is_null() {
        return Ok(RopeScaling::None);
    }
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    let need = |key: &str| {
        num(v, key)
            .ok_or_else(|| Error::InvalidConfig(format!("rope scaling {kind:?} lacks {key}")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        }),
        other => Err(Error::InvalidConfig(format!(
            "unsupported rope scaling type {other:?} (supported: default, linear, llama3)"
        ))),
    }
}

impl Config {
    /// Reads and validates `config.json` in a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(Error::MissingFile {
                dir: dir.to_path_buf(),
                file: "config.json".into(),
            });
        }
        let value = read_json(&path)?;
        Self::from_json(&value, &path)
    }

    /// Validates a parsed `config.json`; `path` is only used in error messages.
    pub fn from_json(value: &serde_json::Value, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_value(value.clone()).map_err(|e| Error::BadJson {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or_else(|| raw.model_type.clone())
            .unwrap_or_default();
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            "MistralForCausalLM" | "mistral" => Arch::Mistral,
            _ => {
                return Err(Error::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    found: arch_name,
                    supported: SUPPORTED.into(),
                })
            }
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(Error::InvalidConfig(format!(
                    "hidden_act {act:?} unsupported (only silu)"
                )));
            }
        }
        // transformers v5 moves rope_theta and the scaling into `rope_parameters`.
        let (rope_theta, rope_scaling) = match &raw.rope_parameters {
            Some(p) if p.is_object() => (num(p, "rope_theta"), parse_scaling(p)?),
            _ => (
                raw.rope_theta,
                parse_scaling(
                    raw.rope_scaling
                        .as_ref()
                        .unwrap_or(&serde_json::Value::Null),
                )?,
            ),
        };
        let default_theta = match arch {
            Arch::Qwen2 | Arch::Mistral => 1_000_000.0,
            Arch::Llama => 10_000.0,
        };
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0 || num_kv_heads == 0 {
            return Err(Error::InvalidConfig("zero attention heads".into()));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None => {
                if !raw.hidden_size.is_multiple_of(raw.num_attention_heads) {
                    return Err(Error::InvalidConfig(format!(
                        "hidden_size {} is not divisible by num_attention_heads {}",
                        raw.hidden_size, raw.num_attention_heads
                    )));
                }
                raw.hidden_size / raw.num_attention_heads
            }
        };
        if !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(Error::InvalidConfig(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                raw.num_attention_heads
            )));
        }
        if !head_dim.is_multiple_of(2) {
            return Err(Error::InvalidConfig(format!("head_dim {head_dim} is odd")));
        }
        let sliding_window = match (&raw.sliding_window, raw.use_sliding_window) {
            (_, Some(false)) => None,
            (Some(v), _) => v.as_u64().map(|w| w as usize),
            _ => None,
        };
        let attention_bias = raw.attention_bias.unwrap_or(false);
        if raw.mlp_bias.unwrap_or(false) {
            return Err(Error::InvalidConfig(
                "mlp_bias = true is unsupported".into(),
            ));
        }
        Ok(Config {
            arch,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta.unwrap_or(default_theta),
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: attention_bias,
            sliding_window,
        })
    }

    /// Rotary inverse frequencies, one per pair of head dimensions, with scaling applied.
    ///
    /// Computed in f32 with exactly transformers' operations and order (`1 / base^(2i/d)`, then
    /// the scaling rule). An inverse frequency one ulp off shifts the rotary angle at position
    /// 1500 by ~1e-4 rad, which alone moves log-probabilities past the golden tests' 1e-4 bound.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f32;
        let base = self.rope_theta as f32;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = 1.0f32 / base.powf((2 * i) as f32 / d);
                match self.rope_scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor as f32,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: orig,
                    } => {
                        let (factor, low, high, orig) =
                            (factor as f32, low_freq_factor, high_freq_factor, orig);
                        let low_wavelen = (orig / low) as f32;
                        let high_wavelen = (orig / high) as f32;
                        let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        // transformers: `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth =
                                (orig as f32 / wavelen - low as f32) / (high as f32 - low as f32);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    }
                }
            })
            .collect()
    }

    /// Parameter count implied by the shapes (embedding counted once when tied).
    pub fn num_params(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let attn = h * q + 2 * h * kv + q * h;
        let mlp = 3 * h * self.intermediate_size;
        let per_layer = attn + mlp + 2 * h;
        let emb = self.vocab_size * h;
        emb + if self.tie_word_embeddings { 0 } else { emb } + self.num_layers * per_layer + h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu"
        })
    }

    #[test]
    fn reads_classic_and_v5_rope_forms_alike() {
        let mut classic = base();
        classic["rope_theta"] = json!(500000.0);
        classic["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024});
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024});
        let a = Config::from_json(&classic, Path::new("c.json")).unwrap();
        let b = Config::from_json(&v5, Path::new("c.json")).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.head_dim, 16);
        assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { .. }));
        // High frequencies kept, low frequencies divided by the factor.
        let plain = Config {
            rope_scaling: RopeScaling::None,
            ..a.clone()
        };
        let (fs, fp) = (a.inv_freq(), plain.inv_freq());
        assert_eq!(fs[0], fp[0]);
        let last = fs.len() - 1;
        assert!((fs[last] * 8.0 - fp[last]).abs() <= fp[last] * 1e-6);
    }

    #[test]
    fn rejects_unknown_architecture_naming_it() {
        let mut c = base();
        c["architectures"] = json!(["GPT2LMHeadModel"]);
        let e = Config::from_json(&c, Path::new("m/config.json")).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("GPT2LMHeadModel") && s.contains("m/config.json"),
            "{s}"
        );
    }

    #[test]
    fn rejects_inconsistent_heads() {
        let mut c = base();
        c["num_key_value_heads"] = json!(3);
        assert!(Config::from_json(&c, Path::new("c.json")).is_err());
    }
}
