//! The compare policy: which differences between a baseline and a candidate fail a release.
//!
//! A policy is a TOML file with two tables. Every key is optional; an absent key takes the default
//! documented on its field (the defaults are what `ci/policy.toml` spells out). A limit of `inf`
//! turns a rule into information only (it is still measured and printed). Unknown keys are errors,
//! so a typo cannot silently disable a rule.
//!
//! ```toml
//! [latency]
//! ttft_p99_max_regression = 0.05   # p99 TTFT may grow by at most 5%
//! e2e_p50_max_regression = 0.10
//! min_samples = 20
//! confidence = 0.95
//!
//! [fidelity]
//! max_mean_kl = 0.01
//! allow_new_prompt_divergence = false
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Limits on latency regressions, judged with a paired bootstrap (see [`crate::compare`]).
///
/// A `*_max_regression` is a fraction: `0.05` allows the candidate's percentile to be at most 5%
/// above the baseline's. A rule fails only when the lower end of the bootstrap confidence interval
/// of the relative change exceeds the limit, so run-to-run noise does not fail a build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyPolicy {
    /// Median time to first token. Default `inf` (information only).
    pub ttft_p50_max_regression: f64,
    /// p99 time to first token. Default `0.05`.
    pub ttft_p99_max_regression: f64,
    /// Median inter-token latency. Default `inf`.
    pub itl_p50_max_regression: f64,
    /// p99 inter-token latency. Default `0.05`.
    pub itl_p99_max_regression: f64,
    /// Median time per output token. Default `inf`.
    pub tpot_p50_max_regression: f64,
    /// p99 time per output token. Default `inf`.
    pub tpot_p99_max_regression: f64,
    /// Median end-to-end latency. Default `0.10`.
    pub e2e_p50_max_regression: f64,
    /// p99 end-to-end latency. Default `inf`.
    pub e2e_p99_max_regression: f64,
    /// Paired turns needed before a latency rule can fail; fewer give `NoData`. Default `20`.
    pub min_samples: usize,
    /// Two-sided confidence level of the bootstrap interval. Default `0.95`.
    pub confidence: f64,
    /// Bootstrap resamples. Default `2000`.
    pub resamples: usize,
    /// Seed of the bootstrap, so a verdict is reproducible. Default `0`.
    pub seed: u64,
}

impl Default for LatencyPolicy {
    fn default() -> Self {
        LatencyPolicy {
            ttft_p50_max_regression: f64::INFINITY,
            ttft_p99_max_regression: 0.05,
            itl_p50_max_regression: f64::INFINITY,
            itl_p99_max_regression: 0.05,
            tpot_p50_max_regression: f64::INFINITY,
            tpot_p99_max_regression: f64::INFINITY,
            e2e_p50_max_regression: 0.10,
            e2e_p99_max_regression: f64::INFINITY,
            min_samples: 20,
            confidence: 0.95,
            resamples: 2000,
            seed: 0,
        }
    }
}

/// Limits on fidelity. Drift limits apply to the candidate's teacher-forced drift against the
/// recording (absolute, not relative to the baseline: a baseline that already drifts does not
/// excuse the candidate); `allow_new_*` compare the candidate's per-turn flags with the baseline's
/// on the same (session, turn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FidelityPolicy {
    /// Mean KL (recorded ‖ candidate, top-k estimate) over every scored position. Default `0.01`.
    pub max_mean_kl: f64,
    /// Mean KL within every context-position bucket (0–1k, 1–2k, ...). Default `0.02`: long
    /// contexts may not hide behind a good average.
    pub max_mean_kl_per_bucket: f64,
    /// Mean |Δlogprob| of the recorded tokens, nats. Default `0.05`.
    pub max_mean_abs_dlogprob: f64,
    /// Fraction of positions whose top-1 token agrees with the recording. Default `0.98`.
    pub min_top1_agreement: f64,
    /// Whether a turn whose prompt encoding newly differs from the recording may pass. Default
    /// `false`: an encoding change is the bug class that loses context silently.
    pub allow_new_prompt_divergence: bool,
    /// Whether a probe that passed on the baseline may fail on the candidate. Default `false`.
    pub allow_new_probe_failures: bool,
    /// Whether a turn whose free-running output newly differs may pass. Default `true`: with
    /// reduced precision, greedy outputs legitimately fork; drift limits judge the numbers.
    pub allow_new_output_mismatch: bool,
    /// Whether a turn that succeeded on the baseline may fail (error) on the candidate. Default
    /// `false`.
    pub allow_new_errors: bool,
}

impl Default for FidelityPolicy {
    fn default() -> Self {
        FidelityPolicy {
            max_mean_kl: 0.01,
            max_mean_kl_per_bucket: 0.02,
            max_mean_abs_dlogprob: 0.05,
            min_top1_agreement: 0.98,
            allow_new_prompt_divergence: false,
            allow_new_probe_failures: false,
            allow_new_output_mismatch: true,
            allow_new_errors: false,
        }
    }
}

/// A whole policy: `[latency]` and `[fidelity]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Latency limits.
    pub latency: LatencyPolicy,
    /// Fidelity limits.
    pub fidelity: FidelityPolicy,
}

/// 1-based (line, column) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// The key written on a line (`key = value` → `key`), with the table it sits in.
fn key_at(text: &str, line: usize) -> Option<String> {
    let mut table = String::new();
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            table = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
        }
        if i + 1 == line {
            let (k, _) = t.split_once('=')?;
            let k = k.trim().trim_matches('"');
            return Some(if table.is_empty() {
                k.to_string()
            } else {
                format!("{table}.{k}")
            });
        }
    }
    None
}

/// Where `table.key` is written, for errors found after parsing.
fn find_key(text: &str, table: &str, key: &str) -> (usize, usize) {
    let mut current = String::new();
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            current = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
        } else if current == table && t.split_once('=').map(|(k, _)| k.trim()) == Some(key) {
            return (i + 1, l.len() - l.trim_start().len() + 1);
        }
    }
    (0, 0)
}

impl Policy {
    /// Parses a policy from TOML text. `source_name` names the text in errors (a file name).
    ///
    /// Errors name the key and its line: an unknown key (`deny_unknown_fields`), a value of the
    /// wrong type, or a value out of range ([`Policy::validate`]).
    pub fn from_toml(text: &str, source_name: &str) -> Result<Policy> {
        let policy: Policy = toml::from_str(text).map_err(|e| {
            let (line, column) = e.span().map_or((0, 0), |s| line_col(text, s.start));
            let message = e.message().trim().to_string();
            // An unknown field's message names it; otherwise the key is the one on that line.
            let key = message
                .strip_prefix("unknown field `")
                .and_then(|r| r.split('`').next())
                .map(|k| {
                    // Qualify with the table the span sits in.
                    key_at(text, line)
                        .and_then(|q| q.rsplit_once('.').map(|(t, _)| format!("{t}.{k}")))
                        .unwrap_or_else(|| k.to_string())
                })
                .or_else(|| key_at(text, line))
                .unwrap_or_else(|| "?".to_string());
            Error::Policy {
                source_name: source_name.to_string(),
                line,
                column,
                key,
                message,
            }
        })?;
        policy.validate().map_err(|(table, key, message)| {
            let (line, column) = find_key(text, table, key);
            Error::Policy {
                source_name: source_name.to_string(),
                line,
                column,
                key: format!("{table}.{key}"),
                message,
            }
        })?;
        Ok(policy)
    }

    /// Reads and parses a policy file.
    pub fn from_file(path: &Path) -> Result<Policy> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Policy::from_toml(&text, &path.display().to_string())
    }

    /// Checks ranges: limits are non-negative (or `inf`), `confidence` in (0, 1), agreement in
    /// [0, 1], at least 100 resamples. Returns `(table, key, message)` of the first violation.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, &'static str, String)> {
        let l = &self.latency;
        let limits = [
            ("ttft_p50_max_regression", l.ttft_p50_max_regression),
            ("ttft_p99_max_regression", l.ttft_p99_max_regression),
            ("itl_p50_max_regression", l.itl_p50_max_regression),
            ("itl_p99_max_regression", l.itl_p99_max_regression),
            ("tpot_p50_max_regression", l.tpot_p50_max_regression),
            ("tpot_p99_max_regression", l.tpot_p99_max_regression),
            ("e2e_p50_max_regression", l.e2e_p50_max_regression),
            ("e2e_p99_max_regression", l.e2e_p99_max_regression),
        ];
        for (k, v) in limits {
            if v.is_nan() || v < 0.0 {
                return Err(("latency", k, format!("must be ≥ 0 or inf, got {v}")));
            }
        }
        if !(l.confidence > 0.0 && l.confidence < 1.0) {
            return Err((
                "latency",
                "confidence",
                format!("must be between 0 and 1 (exclusive), got {}", l.confidence),
            ));
        }
        if l.resamples < 100 {
            return Err((
                "latency",
                "resamples",
                format!("must be at least 100, got {}", l.resamples),
            ));
        }
        let f = &self.fidelity;
        for (k, v) in [
            ("max_mean_kl", f.max_mean_kl),
            ("max_mean_kl_per_bucket", f.max_mean_kl_per_bucket),
            ("max_mean_abs_dlogprob", f.max_mean_abs_dlogprob),
        ] {
            if v.is_nan() || v < 0.0 {
                return Err(("fidelity", k, format!("must be ≥ 0 or inf, got {v}")));
            }
        }
        if !(0.0..=1.0).contains(&f.min_top1_agreement) {
            return Err((
                "fidelity",
                "min_top1_agreement",
                format!("must be between 0 and 1, got {}", f.min_top1_agreement),
            ));
        }
        Ok(())
    }
}

impl std::str::FromStr for Policy {
    type Err = Error;

    /// Parses TOML text (errors name the source `<policy>`).
    fn from_str(s: &str) -> Result<Policy> {
        Policy::from_toml(s, "<policy>")
    }
}
