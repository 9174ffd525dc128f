//! Choosing the next token and summarizing the distribution it came from.
//!
//! The summary ([`summarize`]) always describes the model's raw distribution (temperature 1, no
//! truncation): it is what fidelity comparisons read, and it must not depend on how a client chose
//! to sample. Sampling ([`Sampler`]) applies temperature, top-k, top-p and min-p in that order and
//! draws from a per-request ChaCha stream, so the same seed and toggles give the same tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::generate::{LogitsSummary, SamplingParams};

/// The log-probability of `chosen`, the `k` most likely tokens, and the entropy (nats) of the
/// distribution `softmax(logits)`, in f64.
///
/// One pass over the logits after the maximum: `lse = max + ln Σ e^(x-max)` and
/// `entropy = lse - Σ e^(x-max)·x / Σ e^(x-max)` (the same as `-Σ p ln p`), with the sums taken
/// in fixed chunks of [`SUMMARY_CHUNK`] combined in order, so the result does not depend on how
/// many threads computed it. Large vocabularies (Llama 3's 128k) run the chunks in parallel: this
/// runs once per generated token on the serving path.
pub fn summarize(logits: &[f32], chosen: u32, k: usize) -> LogitsSummary {
    use rayon::prelude::*;
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sums = |c: &[f32]| {
        c.iter().fold((0.0f64, 0.0f64), |(s0, s1), &v| {
            let x = v as f64;
            let e = (x - max).exp();
            // exp(-inf) is 0; keep 0·(-inf) out of s1.
            if e > 0.0 {
                (s0 + e, s1 + e * x)
            } else {
                (s0, s1)
            }
        })
    };
    let parts: Vec<(f64, f64)> = if logits.len() >= 4 * SUMMARY_CHUNK {
        logits.par_chunks(SUMMARY_CHUNK).map(sums).collect()
    } else {
        logits.chunks(SUMMARY_CHUNK).map(sums).collect()
    };
    let (s0, s1) = parts
        .iter()
        .fold((0.0, 0.0), |(a, b), &(c, d)| (a + c, b + d));
    let lse = max + s0.ln();
    let logprob = logits
        .get(chosen as usize)
        .map_or(f64::NEG_INFINITY, |&v| v as f64 - lse);
    let top = top_indices(logits, k, f32::total_cmp)
        .into_iter()
        .map(|i| (i as u32, (logits[i] as f64 - lse) as f32))
        .collect();
    LogitsSummary {
        logprob: logprob as f32,
        top,
        entropy: (lse - s1 / s0) as f32,
    }
}

/// Logits per partial sum of [`summarize`].
pub const SUMMARY_CHUNK: usize = 8192;

/// The `k` largest entries as `(index, value)`, largest first, ties to the lower index.
pub fn top_k(values: &[f64], k: usize) -> Vec<(u32, f32)> {
    top_indices(values, k, f64::total_cmp)
        .into_iter()
        .map(|i| (i as u32, values[i] as f32))
        .collect()
}

/// Indices of the `k` largest values under `cmp`, largest first, ties to the lower index: one
/// pass keeping the best `k` seen in order, with no allocation beyond them (`k` is a handful, a
/// vocabulary 10⁵; this runs for every generated token).
fn top_indices<T>(
    values: &[T],
    k: usize,
    cmp: impl Fn(&T, &T) -> std::cmp::Ordering,
) -> Vec<usize> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let better = |a: usize, b: usize| match cmp(&values[a], &values[b]) {
        std::cmp::Ordering::Greater => true,
        std::cmp::Ordering::Equal => a < b,
        std::cmp::Ordering::Less => false,
    };
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..values.len() {
        if best.len() == k && !better(i, best[k - 1]) {
            continue;
        }
        let at = best.partition_point(|&b| better(b, i));
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// The index of the largest logit, ties to the lower index.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if v.total_cmp(&logits[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}

/// Draws tokens for one request.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// The seed in use (drawn at random when the request gave none), so it can be recorded.
    pub seed: u64,
}

impl Sampler {
    /// A sampler for these parameters.
    pub fn new(params: &SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Sampler {
            params: params.clone(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            seed,
        }
    }

    /// Whether every choice is the most likely token (temperature 0 or top-k 1): the choice then
    /// needs no random draw and no logits beyond the maximum, so a backend can make it.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == Some(1)
    }

    /// Chooses the next token from raw logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let p = &self.params;
        let t = p.temperature as f64;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        // (candidates) unnormalized probabilities, most likely first
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, ((v as f64 - max) / t).exp()))
            .filter(|(_, w)| *w > 0.0)
            .collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = p.top_k.filter(|&k| k > 0) {
            cand.truncate(k);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 * p.min_p as f64;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut u = self.rng.random::<f64>() * total;
        for c in &cand {
            if u < c.1 {
                return c.0;
            }
            u -= c.1;
        }
        cand.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_logits(n: usize) -> Vec<f32> {
        let mut r = ChaCha8Rng::seed_from_u64(rand::random());
        (0..n).map(|_| r.random_range(-5.0..5.0)).collect()
    }

    #[test]
    fn summary_of_a_large_vocabulary_matches_the_two_pass_reference() {
        // The parallel chunked path (128k, Llama 3's vocabulary) against log_softmax in f64,
        // with ties planted in the top.
        let mut l = random_logits(128_256);
        l[1000] = 50.0;
        l[70_000] = 50.0;
        l[5] = 49.0;
        let s = summarize(&l, 70_000, 8);
        let lp = crate::numerics::log_softmax(&l);
        let entropy: f64 = -lp.iter().map(|&v| v.exp() * v).sum::<f64>();
        assert!((s.logprob as f64 - lp[70_000]).abs() < 1e-6);
        assert!((s.entropy as f64 - entropy).abs() < 1e-5 * entropy.max(1.0));
        let want = top_k(&lp, 8);
        assert_eq!(
            s.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            want.iter().map(|t| t.0).collect::<Vec<_>>()
        );
        assert_eq!(s.top[0].0, 1000, "ties go to the lower index");
        for (a, b) in s.top.iter().zip(&want) {
            assert!((a.1 - b.1).abs() < 1e-6);
        }
        // Same answer from the sequential path on the same data.
        let again = summarize(&l, 70_000, 8);
        assert_eq!(s, again);
    }

    #[test]
    fn summary_matches_direct_computation() {
        let l = random_logits(500);
        let s = summarize(&l, 7, 8);
        let z: f64 = l.iter().map(|&v| (v as f64).exp()).sum();
        let p: Vec<f64> = l.iter().map(|&v| (v as f64).exp() / z).collect();
        assert!((s.logprob as f64 - p[7].ln()).abs() < 1e-5);
        let h: f64 = -p.iter().map(|q| q * q.ln()).sum::<f64>();
        assert!((s.entropy as f64 - h).abs() < 1e-4);
        assert_eq!(s.top.len(), 8);
        let mut sorted: Vec<usize> = (0..l.len()).collect();
        sorted.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        assert_eq!(s.top[0].0 as usize, sorted[0]);
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn same_seed_same_tokens_and_filters_hold() {
        let l = random_logits(300);
        let params = SamplingParams {
            temperature: 0.8,
            top_k: Some(20),
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(42),
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(&params);
            (0..50).map(|_| s.sample(&l)).collect()
        };
        let mut s = Sampler::new(&params);
        let b: Vec<u32> = (0..50).map(|_| s.sample(&l)).collect();
        assert_eq!(a, b);
        let mut order: Vec<u32> = (0..300).collect();
        order.sort_by(|&x, &y| l[y as usize].total_cmp(&l[x as usize]));
        let top20: Vec<u32> = order[..20].to_vec();
        assert!(a.iter().all(|t| top20.contains(t)));
        let greedy = Sampler::new(&SamplingParams::default()).sample(&l);
        assert_eq!(greedy, order[0]);
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let mut l = vec![-10.0f32; 100];
        l[3] = 5.0;
        l[4] = 4.9;
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(&params);
        for _ in 0..200 {
            let t = s.sample(&l);
            assert!(t == 3 || t == 4);
        }
    }
}
