//! Speed and fidelity arithmetic: pure functions over raw per-request facts.
//!
//! Everything here is deterministic and free of I/O so each formula can be checked against a hand
//! computation (see the unit tests at the bottom). The run loop stores raw facts (instants, token
//! IDs, logits summaries) and derives metrics here, never the other way round.
//!
//! Speed follows vLLM's `benchmark_serving` definitions:
//! * TTFT: send (or, open loop, *intended* send) to the first output token.
//! * ITL: every gap between consecutive output tokens (all gaps, not a per-request mean).
//! * TPOT: `(E2E − TTFT) / (n − 1)` per request with `n ≥ 2` output tokens.
//! * E2E: send to the last byte.
//! * Goodput: requests per second that met every SLO given.
//!
//! Every latency goes into an HDR histogram in microseconds (3 significant digits) so that runs and
//! shards merge exactly; a histogram travels as base64 of hdrhistogram's V2 serialization.

use std::collections::BTreeMap;

use base64::Engine as _;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tapedeck_engine::LogitsSummary;

use crate::error::{Error, Result};

// ---------------------------------------------------------------------------------------------
// Sequence comparison
// ---------------------------------------------------------------------------------------------

/// Index of the first position where `a` and `b` differ; `None` when they are equal.
///
/// When one is a strict prefix of the other, the first divergence is the shorter length (the
/// position where one has a token and the other has none).
pub fn first_divergence<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if common == a.len() && common == b.len() {
        None
    } else {
        Some(common)
    }
}

/// Levenshtein distance (insertions, deletions, substitutions, each cost 1).
///
/// Two-row dynamic programme: O(|a|·|b|) time, O(|b|) memory.
pub fn levenshtein<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    if a.is_empty() {
        return b.len();
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0usize; b.len() + 1];
    for (i, x) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, y) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(x != y);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// Levenshtein distance divided by the longer length: 0 identical, 1 nothing in common.
/// Two empty sequences are identical (0).
pub fn normalized_edit_distance<T: PartialEq>(a: &[T], b: &[T]) -> f64 {
    let longest = a.len().max(b.len());
    if longest == 0 {
        0.0
    } else {
        levenshtein(a, b) as f64 / longest as f64
    }
}

// ---------------------------------------------------------------------------------------------
// Teacher-forced drift
// ---------------------------------------------------------------------------------------------

/// Floor for a probability inside a logarithm, so a bucket estimated at 0 gives a large but
/// finite divergence instead of infinity.
pub const KL_PROB_FLOOR: f64 = 1e-10;

/// KL(P_rec ‖ Q_cand) estimated from two top-k summaries of the same position.
///
/// Only the top-k of each distribution is known, so the full-vocabulary KL cannot be computed.
/// The estimator coarse-grains the vocabulary into the recorded top-k IDs plus one `other` bucket
/// holding the rest of the mass (llama.cpp's `--kl-divergence` keeps full logits; when only top-k
/// survive, lumping the tail is the usual approximation):
/// * `P(i) = exp(rec_logprob_i)` for each recorded top-k ID, `P(other) = 1 − Σ P(i)`.
/// * `Q(i) = exp(cand_logprob_i)` when `i` is also in the candidate's top-k. When it is not, its
///   candidate probability is unknown but at most the candidate's smallest listed probability, and
///   the candidate's unlisted mass `r = 1 − Σ cand top-k` is shared by every unlisted ID; the
///   estimate is `min(smallest listed, r / (m + 1))`, where `m` counts the recorded IDs missing
///   from the candidate's list (the `+1` leaves a share for the tail).
/// * `Q(other) = 1 − Σ Q(i)`.
///
/// Probabilities are floored at [`KL_PROB_FLOOR`]. When every recorded ID appears in the
/// candidate's list the estimate is exactly the KL of the coarse-grained distributions, which by
/// the data-processing inequality never exceeds the true KL: the estimator errs low, so a large
/// value is a real divergence. Identical summaries give exactly 0.
pub fn kl_topk(rec: &[(u32, f32)], cand: &[(u32, f32)]) -> f64 {
    if rec.is_empty() {
        return 0.0;
    }
    let p: Vec<f64> = rec.iter().map(|&(_, lp)| f64::from(lp).exp()).collect();
    let p_other = (1.0 - p.iter().sum::<f64>()).max(0.0);
    let cand_known: Vec<f64> = cand.iter().map(|&(_, lp)| f64::from(lp).exp()).collect();
    let cand_min = cand_known.iter().cloned().fold(f64::INFINITY, f64::min);
    let cand_rest = (1.0 - cand_known.iter().sum::<f64>()).max(0.0);
    let missing = rec
        .iter()
        .filter(|(id, _)| !cand.iter().any(|(c, _)| c == id))
        .count();
    let unknown_share = if cand.is_empty() {
        cand_rest / (missing as f64 + 1.0)
    } else {
        cand_min.min(cand_rest / (missing as f64 + 1.0))
    };
    let q: Vec<f64> = rec
        .iter()
        .map(|(id, _)| {
            cand.iter()
                .position(|(c, _)| c == id)
                .map_or(unknown_share, |j| cand_known[j])
        })
        .collect();
    let q_other = (1.0 - q.iter().sum::<f64>()).max(0.0);
    let term = |p: f64, q: f64| {
        if p <= 0.0 {
            0.0
        } else {
            p * (p.max(KL_PROB_FLOOR).ln() - q.max(KL_PROB_FLOOR).ln())
        }
    };
    let kl: f64 = p.iter().zip(&q).map(|(&p, &q)| term(p, q)).sum::<f64>() + term(p_other, q_other);
    // Rounding can leave a tiny negative for equal inputs; KL is non-negative.
    kl.max(0.0)
}

/// Teacher-forced comparison of one output position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PositionDrift {
    /// Absolute context position: prompt length + output index.
    pub position: usize,
    /// Candidate − recorded log-probability of the recorded token.
    pub dlogprob: f64,
    /// Whether the candidate's most likely token is the recorded distribution's most likely token.
    pub top1_agree: bool,
    /// [`kl_topk`] of the recorded and candidate summaries.
    pub kl: f64,
}

/// Compares recorded summaries with the candidate's teacher-forced scores of the same tokens.
///
/// `prompt_len` anchors the absolute positions. Only positions present in both are compared.
pub fn drift(
    prompt_len: usize,
    rec: &[LogitsSummary],
    cand: &[LogitsSummary],
) -> Vec<PositionDrift> {
    rec.iter()
        .zip(cand)
        .enumerate()
        .map(|(i, (r, c))| PositionDrift {
            position: prompt_len + i,
            dlogprob: f64::from(c.logprob) - f64::from(r.logprob),
            top1_agree: match (r.top.first(), c.top.first()) {
                (Some(a), Some(b)) => a.0 == b.0,
                _ => true,
            },
            kl: kl_topk(&r.top, &c.top),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Descriptive statistics
// ---------------------------------------------------------------------------------------------

/// Mean with a 95% confidence interval and upper quantiles of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Sample size.
    pub n: usize,
    /// Arithmetic mean (0 when empty).
    pub mean: f64,
    /// Lower end of the 95% CI of the mean: `mean − 1.96·s/√n` (normal approximation, `s` the
    /// sample standard deviation; equals the mean when `n < 2`).
    pub ci95_low: f64,
    /// Upper end of the 95% CI of the mean.
    pub ci95_high: f64,
    /// 90th percentile (nearest rank).
    pub q90: f64,
    /// 99th percentile (nearest rank).
    pub q99: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

/// Nearest-rank quantile of a sorted sample: the value at rank `ceil(q·n)` (1-based).
pub fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Stats {
    /// Statistics of `values` (NaNs are ignored).
    pub fn of(values: &[f64]) -> Stats {
        let mut v: Vec<f64> = values.iter().cloned().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let half = if n >= 2 {
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            1.96 * (var / n as f64).sqrt()
        } else {
            0.0
        };
        Stats {
            n,
            mean,
            ci95_low: mean - half,
            ci95_high: mean + half,
            q90: quantile_sorted(&v, 0.90),
            q99: quantile_sorted(&v, 0.99),
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// Lower bounds (tokens) of the absolute-position buckets drift is reported by.
pub const BUCKET_STARTS: [usize; 6] = [0, 1024, 2048, 4096, 8192, 16384];

/// Labels of the buckets, in order.
pub const BUCKET_LABELS: [&str; 6] = ["0-1k", "1-2k", "2-4k", "4-8k", "8-16k", "16k+"];

/// The bucket index of an absolute context position.
pub fn bucket_of(position: usize) -> usize {
    BUCKET_STARTS
        .iter()
        .rposition(|&s| position >= s)
        .unwrap_or(0)
}

/// Aggregated teacher-forced drift over a set of positions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriftStats {
    /// Positions compared.
    pub positions: usize,
    /// Δlogprob (candidate − recorded) of the recorded token.
    pub dlogprob: Stats,
    /// |Δlogprob|.
    pub abs_dlogprob: Stats,
    /// Fraction of positions whose top-1 token agrees.
    pub top1_agreement: f64,
    /// KL estimate per position ([`kl_topk`]).
    pub kl: Stats,
}

impl DriftStats {
    /// Aggregates positions.
    pub fn of(points: &[PositionDrift]) -> DriftStats {
        if points.is_empty() {
            return DriftStats::default();
        }
        let d: Vec<f64> = points.iter().map(|p| p.dlogprob).collect();
        let a: Vec<f64> = d.iter().map(|x| x.abs()).collect();
        let kl: Vec<f64> = points.iter().map(|p| p.kl).collect();
        let agree = points.iter().filter(|p| p.top1_agree).count();
        DriftStats {
            positions: points.len(),
            dlogprob: Stats::of(&d),
            abs_dlogprob: Stats::of(&a),
            top1_agreement: agree as f64 / points.len() as f64,
            kl: Stats::of(&kl),
        }
    }
}

/// Drift of one position bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketDrift {
    /// Bucket label (`0-1k`, ...).
    pub bucket: String,
    /// First position of the bucket.
    pub from: usize,
    /// Its statistics.
    pub drift: DriftStats,
}

/// Drift aggregated per absolute-position bucket; empty buckets are left out.
pub fn drift_by_bucket(points: &[PositionDrift]) -> Vec<BucketDrift> {
    let mut groups: BTreeMap<usize, Vec<PositionDrift>> = BTreeMap::new();
    for p in points {
        groups.entry(bucket_of(p.position)).or_default().push(*p);
    }
    groups
        .into_iter()
        .map(|(b, pts)| BucketDrift {
            bucket: BUCKET_LABELS[b].to_string(),
            from: BUCKET_STARTS[b],
            drift: DriftStats::of(&pts),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Speed
// ---------------------------------------------------------------------------------------------

/// Time per output token after the first: `(e2e − ttft) / (n − 1)`; `None` for fewer than two
/// tokens or without a first token.
pub fn tpot_us(ttft_us: Option<u64>, e2e_us: u64, output_tokens: usize) -> Option<f64> {
    let ttft = ttft_us?;
    (output_tokens >= 2).then(|| e2e_us.saturating_sub(ttft) as f64 / (output_tokens - 1) as f64)
}

/// Service-level objectives for goodput, in milliseconds; an absent bound always holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Most time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Most time per output token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Most end-to-end latency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
}

impl std::str::FromStr for Slo {
    type Err = Error;

    /// Parses `ttft=500,tpot=50,e2e=10000` (milliseconds; any subset; empty means none).
    fn from_str(s: &str) -> Result<Slo> {
        let mut slo = Slo::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = |m: String| Error::Setting {
                name: "slo",
                message: m,
            };
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("{part:?} is not name=milliseconds")))?;
            let ms: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|x: &f64| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(format!("{v:?} is not a number of milliseconds")))?;
            match k.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2e" => slo.e2e_ms = Some(ms),
                other => return Err(bad(format!("unknown SLO {other:?} (ttft, tpot, e2e)"))),
            }
        }
        Ok(slo)
    }
}

impl Slo {
    /// Whether a successful request met every bound. A TTFT bound fails a request without a
    /// first token; a TPOT bound is vacuous for a one-token answer (vLLM does the same).
    pub fn met(&self, ttft_us: Option<u64>, tpot_us: Option<f64>, e2e_us: u64) -> bool {
        let ok_ttft = self
            .ttft_ms
            .is_none_or(|b| ttft_us.is_some_and(|t| t as f64 <= b * 1000.0));
        let ok_tpot = self
            .tpot_ms
            .is_none_or(|b| tpot_us.is_none_or(|t| t <= b * 1000.0));
        let ok_e2e = self.e2e_ms.is_none_or(|b| e2e_us as f64 <= b * 1000.0);
        ok_ttft && ok_tpot && ok_e2e
    }

    /// Whether any bound is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2e_ms.is_some()
    }
}

/// A latency histogram in microseconds, 3 significant digits, auto-resizing.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

impl Latency {
    /// An empty histogram.
    pub fn new() -> Self {
        // Not an input path: 3 significant digits with auto-resize is a valid configuration for
        // every hdrhistogram version, so this cannot fail.
        #[allow(clippy::expect_used)]
        let h = Histogram::new(3).expect("3 significant digits is a valid precision");
        Latency(h)
    }

    /// Records one value (µs); values are clamped to at least 1 since hdrhistogram's lowest
    /// discernible value is 1.
    pub fn record(&mut self, us: u64) {
        let _ = self.0.record(us.max(1));
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Latency) -> Result<()> {
        self.0
            .add(&other.0)
            .map_err(|e| Error::Histogram(format!("merge: {e:?}")))
    }

    /// The underlying histogram.
    pub fn histogram(&self) -> &Histogram<u64> {
        &self.0
    }

    /// base64 of the V2 serialization (what [`LatencySummary::hdr`] holds).
    pub fn encode(&self) -> Result<String> {
        let mut buf = Vec::new();
        V2Serializer::new()
            .serialize(&self.0, &mut buf)
            .map_err(|e| Error::Histogram(format!("serialize: {e:?}")))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(buf))
    }

    /// Reads what [`Latency::encode`] wrote.
    pub fn decode(text: &str) -> Result<Latency> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|e| Error::Histogram(format!("base64: {e}")))?;
        let mut h: Histogram<u64> = Deserializer::new()
            .deserialize(&mut bytes.as_slice())
            .map_err(|e| Error::Histogram(format!("deserialize: {e:?}")))?;
        // The wire format does not carry auto-resize; without it a merge of a wider range fails.
        h.auto(true);
        Ok(Latency(h))
    }

    /// Percentile summary (milliseconds) with the encoded histogram.
    pub fn summary(&self) -> Result<LatencySummary> {
        let h = &self.0;
        let ms = |us: u64| us as f64 / 1000.0;
        let empty = h.is_empty();
        let at = |q: f64| {
            if empty {
                0.0
            } else {
                ms(h.value_at_quantile(q))
            }
        };
        Ok(LatencySummary {
            count: h.len(),
            mean_ms: if empty { 0.0 } else { h.mean() / 1000.0 },
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p95_ms: at(0.95),
            p99_ms: at(0.99),
            p999_ms: at(0.999),
            max_ms: if empty { 0.0 } else { ms(h.max()) },
            hdr: self.encode()?,
        })
    }
}

/// Percentiles of one latency, in milliseconds, plus the histogram itself for merging.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Values recorded.
    pub count: u64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest value.
    pub max_ms: f64,
    /// base64 of the HDR histogram (µs, V2 serialization); merge with [`merge_encoded`].
    pub hdr: String,
}

/// Merges two encoded histograms (shards of one run, or runs) into one encoded histogram.
pub fn merge_encoded(a: &str, b: &str) -> Result<String> {
    let mut x = Latency::decode(a)?;
    x.merge(&Latency::decode(b)?)?;
    x.encode()
}

/// The speed facts of one request, already relative to its (intended) send time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestTiming {
    /// Time to first token, µs.
    pub ttft_us: Option<u64>,
    /// Every inter-token gap, µs.
    pub itl_us: Vec<u64>,
    /// End-to-end latency, µs.
    pub e2e_us: u64,
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Output tokens.
    pub output_tokens: usize,
}

/// Collects per-request timings and errors into a [`SpeedSummary`].
#[derive(Debug, Clone, Default)]
pub struct SpeedAccumulator {
    ttft: Latency,
    itl: Latency,
    tpot: Latency,
    e2e: Latency,
    ok: u64,
    good: u64,
    input_tokens: u64,
    output_tokens: u64,
    errors: BTreeMap<String, u64>,
}

impl SpeedAccumulator {
    /// Records a successful request under `slo`.
    pub fn success(&mut self, t: &RequestTiming, slo: &Slo) {
        self.ok += 1;
        if let Some(v) = t.ttft_us {
            self.ttft.record(v);
        }
        for &g in &t.itl_us {
            self.itl.record(g);
        }
        let tpot = tpot_us(t.ttft_us, t.e2e_us, t.output_tokens);
        if let Some(v) = tpot {
            self.tpot.record(v.round() as u64);
        }
        self.e2e.record(t.e2e_us);
        self.input_tokens += t.input_tokens as u64;
        self.output_tokens += t.output_tokens as u64;
        if slo.met(t.ttft_us, tpot, t.e2e_us) {
            self.good += 1;
        }
    }

    /// Records a failed request by error kind.
    pub fn failure(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    /// The summary over a wall-clock duration (seconds) of the run.
    pub fn summary(&self, duration_s: f64) -> Result<SpeedSummary> {
        let per_s = |x: u64| {
            if duration_s > 0.0 {
                x as f64 / duration_s
            } else {
                0.0
            }
        };
        Ok(SpeedSummary {
            duration_s,
            completed: self.ok,
            failed: self.errors.values().sum(),
            request_throughput: per_s(self.ok),
            input_token_throughput: per_s(self.input_tokens),
            output_token_throughput: per_s(self.output_tokens),
            total_input_tokens: self.input_tokens,
            total_output_tokens: self.output_tokens,
            good_requests: self.good,
            goodput: per_s(self.good),
            errors: self.errors.clone(),
            ttft: self.ttft.summary()?,
            itl: self.itl.summary()?,
            tpot: self.tpot.summary()?,
            e2e: self.e2e.summary()?,
        })
    }
}

/// Speed aggregates of a run (vLLM `benchmark_serving` definitions).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpeedSummary {
    /// Wall-clock duration the rates are computed over, seconds.
    pub duration_s: f64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Prompt tokens of completed requests per second.
    pub input_token_throughput: f64,
    /// Output tokens per second.
    pub output_token_throughput: f64,
    /// Prompt tokens of completed requests.
    pub total_input_tokens: u64,
    /// Output tokens.
    pub total_output_tokens: u64,
    /// Completed requests that met every SLO (all of them when no SLO is set).
    pub good_requests: u64,
    /// `good_requests` per second.
    pub goodput: f64,
    /// Failed requests by [`Error::kind`].
    pub errors: BTreeMap<String, u64>,
    /// Time to first token.
    pub ttft: LatencySummary,
    /// Inter-token latency (every gap).
    pub itl: LatencySummary,
    /// Time per output token after the first.
    pub tpot: LatencySummary,
    /// End-to-end latency.
    pub e2e: LatencySummary,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn first_divergence_cases() {
        assert_eq!(first_divergence::<u32>(&[], &[]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_divergence(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_divergence(&[5], &[6]), Some(0));
    }

    #[test]
    fn levenshtein_hand_cases() {
        // kitten -> sitting: k→s, e→i, +g = 3.
        let a: Vec<char> = "kitten".chars().collect();
        let b: Vec<char> = "sitting".chars().collect();
        assert_eq!(levenshtein(&a, &b), 3);
        assert_eq!(levenshtein::<u32>(&[], &[1, 2]), 2);
        assert_eq!(levenshtein(&[1, 2, 3], &[1, 2, 3]), 0);
        // One deletion in the middle.
        assert_eq!(levenshtein(&[1, 2, 3, 4], &[1, 3, 4]), 1);
        assert!(close(normalized_edit_distance(&a, &b), 3.0 / 7.0));
        assert!(close(normalized_edit_distance::<u32>(&[], &[]), 0.0));
        assert!(close(normalized_edit_distance(&[1, 2], &[3, 4]), 1.0));
    }

    #[test]
    fn kl_identical_is_zero() {
        let t = [(1, (0.5f32).ln()), (2, (0.3f32).ln())];
        assert_eq!(kl_topk(&t, &t), 0.0);
    }

    #[test]
    fn kl_hand_computed_full_support() {
        // P = (0.5, 0.3, other 0.2), Q = (0.4, 0.4, other 0.2).
        let p = [(1, 0.5f32.ln()), (2, 0.3f32.ln())];
        let q = [(2, 0.4f32.ln()), (1, 0.4f32.ln())];
        let expect = 0.5 * (0.5f64 / 0.4).ln() + 0.3 * (0.3f64 / 0.4).ln() + 0.0;
        assert!(
            (kl_topk(&p, &q) - expect).abs() < 1e-6,
            "{}",
            kl_topk(&p, &q)
        );
    }

    #[test]
    fn kl_hand_computed_missing_id() {
        // P = (id1 0.6, id2 0.3, other 0.1); Q lists id1 0.7, id3 0.2 (rest 0.1).
        // id2 is missing from Q: estimate min(0.2, 0.1 / (1 + 1)) = 0.05; Q(other) = 1 − 0.75.
        let p = [(1, 0.6f32.ln()), (2, 0.3f32.ln())];
        let q = [(1, 0.7f32.ln()), (3, 0.2f32.ln())];
        let expect =
            0.6 * (0.6f64 / 0.7).ln() + 0.3 * (0.3f64 / 0.05).ln() + 0.1 * (0.1f64 / 0.25).ln();
        assert!(
            (kl_topk(&p, &q) - expect).abs() < 1e-5,
            "{}",
            kl_topk(&p, &q)
        );
    }

    #[test]
    fn drift_per_position() {
        let s = |lp: f32, top: u32| LogitsSummary {
            logprob: lp,
            top: vec![(top, lp)],
            entropy: 0.0,
        };
        let rec = [s(-1.0, 7), s(-2.0, 8)];
        let cand = [s(-1.5, 7), s(-2.0, 9)];
        let d = drift(100, &rec, &cand);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].position, 100);
        assert!(close(d[0].dlogprob, -0.5));
        assert!(d[0].top1_agree);
        assert!(!d[1].top1_agree);
        let agg = DriftStats::of(&d);
        assert!(close(agg.top1_agreement, 0.5));
        assert!(close(agg.dlogprob.mean, -0.25));
    }

    #[test]
    fn stats_hand_computed() {
        let s = Stats::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.n, 4);
        assert!(close(s.mean, 2.5));
        // s = sqrt(5/3); half-width = 1.96 * s / 2.
        let half = 1.96 * (5.0f64 / 3.0).sqrt() / 2.0;
        assert!(close(s.ci95_high - s.mean, half));
        assert!(close(s.q90, 4.0));
        let many: Vec<f64> = (1..=100).map(f64::from).collect();
        let m = Stats::of(&many);
        assert!(close(m.q90, 90.0));
        assert!(close(m.q99, 99.0));
    }

    #[test]
    fn buckets() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1023), 0);
        assert_eq!(bucket_of(1024), 1);
        assert_eq!(bucket_of(4095), 2);
        assert_eq!(bucket_of(16383), 4);
        assert_eq!(bucket_of(1 << 20), 5);
        let pts = [
            PositionDrift {
                position: 10,
                dlogprob: 0.0,
                top1_agree: true,
                kl: 0.0,
            },
            PositionDrift {
                position: 5000,
                dlogprob: -1.0,
                top1_agree: false,
                kl: 1.0,
            },
        ];
        let b = drift_by_bucket(&pts);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].bucket, "0-1k");
        assert_eq!(b[1].bucket, "4-8k");
        assert!(close(b[1].drift.top1_agreement, 0.0));
    }

    #[test]
    fn tpot_and_goodput() {
        // TTFT 100 ms, E2E 500 ms, 5 tokens: (500 − 100) / 4 = 100 ms.
        assert_eq!(tpot_us(Some(100_000), 500_000, 5), Some(100_000.0));
        assert_eq!(tpot_us(Some(100_000), 500_000, 1), None);
        assert_eq!(tpot_us(None, 500_000, 5), None);
        let slo: Slo = "ttft=150,tpot=90".parse().unwrap();
        assert!(!slo.met(Some(100_000), Some(100_000.0), 500_000));
        assert!(slo.met(Some(100_000), Some(80_000.0), 500_000));
        assert!(!slo.met(None, None, 500_000));
        assert!("ttft=abc".parse::<Slo>().is_err());
        assert!("speed=1".parse::<Slo>().is_err());

        let mut acc = SpeedAccumulator::default();
        let t = |ttft: u64, e2e: u64, n: usize| RequestTiming {
            ttft_us: Some(ttft),
            itl_us: vec![(e2e - ttft) / (n as u64 - 1); n - 1],
            e2e_us: e2e,
            input_tokens: 10,
            output_tokens: n,
        };
        acc.success(&t(100_000, 500_000, 5), &slo); // tpot 100 ms: not good
        acc.success(&t(100_000, 420_000, 5), &slo); // tpot 80 ms: good
        acc.success(&t(200_000, 400_000, 3), &slo); // ttft 200 ms: not good
        acc.failure("http_429");
        acc.failure("http_429");
        let s = acc.summary(2.0).unwrap();
        assert_eq!(s.completed, 3);
        assert_eq!(s.failed, 2);
        assert_eq!(s.good_requests, 1);
        assert!(close(s.goodput, 0.5));
        assert!(close(s.request_throughput, 1.5));
        assert!(close(s.input_token_throughput, 15.0));
        assert!(close(s.output_token_throughput, 6.5));
        assert_eq!(s.errors.get("http_429"), Some(&2));
        assert_eq!(s.itl.count, 4 + 4 + 2);
    }

    #[test]
    fn histogram_roundtrip_and_merge() {
        let mut a = Latency::new();
        let mut b = Latency::new();
        for v in 1..=100u64 {
            a.record(v * 1000);
        }
        for v in 101..=200u64 {
            b.record(v * 1000);
        }
        let merged = merge_encoded(&a.encode().unwrap(), &b.encode().unwrap()).unwrap();
        let m = Latency::decode(&merged).unwrap();
        assert_eq!(m.histogram().len(), 200);
        let s = m.summary().unwrap();
        // 1..200 ms: the median is 100 ms, the max 200 ms (within 3 significant digits).
        assert!((s.p50_ms - 100.0).abs() <= 0.1, "{}", s.p50_ms);
        assert!((s.max_ms - 200.0).abs() <= 0.2, "{}", s.max_ms);
        assert!(Latency::decode("not base64!").is_err());
    }
}
