//! Small statistics used by compare: nearest-rank quantiles and a seeded paired bootstrap.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Nearest-rank quantile (`ceil(q·n)`, 1-based) of an unsorted sample, in O(n) by selection.
/// Returns `None` for an empty sample. Reorders `values`.
pub fn quantile(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    let (_, v, _) = values.select_nth_unstable_by(rank - 1, f64::total_cmp);
    Some(*v)
}

/// A bootstrap confidence interval of a relative change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelChangeCi {
    /// Point estimate on the full sample: `stat(cand) / stat(base) − 1`.
    pub estimate: f64,
    /// Lower end of the percentile interval.
    pub low: f64,
    /// Upper end of the percentile interval.
    pub high: f64,
}

/// Paired (cluster) bootstrap of the relative change of a quantile.
///
/// `pairs[i]` holds the values of paired unit `i` (a turn) on the baseline and on the candidate:
/// one value for TTFT/E2E/TPOT, every inter-token gap for ITL. Each resample draws units with
/// replacement — the same units for both runs, which keeps the pairing and cancels the
/// per-turn difficulty (a long prompt is slow on both) — pools their values, and computes
/// `quantile_q(cand) / quantile_q(base) − 1`. The interval is the percentile interval at
/// `confidence` (two-sided). Deterministic for a given `seed`.
///
/// Returns `None` when either side has no values.
pub fn bootstrap_rel_change(
    pairs: &[(Vec<f64>, Vec<f64>)],
    q: f64,
    confidence: f64,
    resamples: usize,
    seed: u64,
) -> Option<RelChangeCi> {
    let pool = |idx: &mut dyn Iterator<Item = usize>, b: &mut Vec<f64>, c: &mut Vec<f64>| {
        b.clear();
        c.clear();
        for i in idx {
            b.extend_from_slice(&pairs[i].0);
            c.extend_from_slice(&pairs[i].1);
        }
    };
    let mut b = Vec::new();
    let mut c = Vec::new();
    pool(&mut (0..pairs.len()), &mut b, &mut c);
    let rel = |b: &mut [f64], c: &mut [f64]| -> Option<f64> {
        let qb = quantile(b, q)?;
        let qc = quantile(c, q)?;
        (qb > 0.0).then(|| qc / qb - 1.0)
    };
    let estimate = rel(&mut b, &mut c)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = pairs.len();
    let mut draws = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        let mut idx = (0..n).map(|_| rng.random_range(0..n));
        pool(&mut idx, &mut b, &mut c);
        if let Some(r) = rel(&mut b, &mut c) {
            draws.push(r);
        }
    }
    if draws.is_empty() {
        return None;
    }
    let alpha = (1.0 - confidence) / 2.0;
    let low = quantile(&mut draws, alpha).unwrap_or(estimate);
    let high = quantile(&mut draws, 1.0 - alpha).unwrap_or(estimate);
    Some(RelChangeCi {
        estimate,
        low,
        high,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), Some(50.0));
        assert_eq!(quantile(&mut v, 0.99), Some(99.0));
        assert_eq!(quantile(&mut [], 0.5), None);
    }

    #[test]
    fn bootstrap_identical_runs_is_zero() {
        let pairs: Vec<_> = (1..=30)
            .map(|i| (vec![f64::from(i)], vec![f64::from(i)]))
            .collect();
        let ci = bootstrap_rel_change(&pairs, 0.5, 0.95, 500, 1).unwrap();
        assert_eq!(ci.estimate, 0.0);
        assert_eq!(ci.low, 0.0);
        assert_eq!(ci.high, 0.0);
    }
}
