//! Merging run summaries: the shards of one replay split across machines (`--shard i/n`), or
//! runs over disjoint sets of sessions, into one summary (`tapedeck replay merge`).
//!
//! What merges exactly and what does not:
//! * **Latencies** merge exactly: each summary carries its HDR histograms, and adding histograms
//!   adds their bucket counts, so the merged percentiles are the percentiles of one run over the
//!   same requests — not an average of per-shard percentiles, which would be meaningless.
//! * **Counts and totals** (requests, tokens, errors by kind, good requests, fidelity counts,
//!   flags) are sums; rates are recomputed over the merged wall-clock span (earliest start to
//!   latest end), which is the aggregate rate whether the shards ran side by side or one after
//!   another.
//! * **Drift statistics** merge exactly in `n`, mean, min, max and top-1 agreement, and the 95% CI
//!   is recomputed from the pooled variance (recovered from each part's CI half-width), equal up to
//!   floating-point rounding. The q90/q99 quantiles of a part cannot be combined exactly from
//!   summaries; the merge takes the largest part's quantile, which is an upper bound of the pooled
//!   quantile (if at most 10% of every part lies above its q90, at most 10% of the union lies
//!   above the largest of them).
//! * **Per-turn rows** are concatenated; a session in two inputs is an error, because it would be
//!   counted twice.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::error::{Error, Result};
use crate::metrics::{BucketDrift, DriftStats, Latency, LatencySummary, SpeedSummary, Stats};
use crate::report::{FidelitySummary, MergedPart, RunSummary, RUN_FORMAT};
use crate::session::Shard;

/// z of a two-sided 95% normal interval, as [`Stats::of`] uses it.
const Z95: f64 = 1.96;

/// Merges run summaries (see the module docs for what is exact). Inputs must be replays of the
/// same target with the same settings (the shard aside) over disjoint sessions; an input that is
/// itself a merge contributes its parts. Each shard may appear once; missing shards are allowed
/// (a lost machine should not make the others' results unusable) and are reported by
/// [`missing_shards`].
pub fn merge_runs(runs: &[RunSummary]) -> Result<RunSummary> {
    let Some(first) = runs.first() else {
        return Err(Error::Merge("no runs to merge".into()));
    };
    let unsharded = |r: &RunSummary| {
        let mut s = r.settings.clone();
        s.shard = None;
        s
    };
    let settings = unsharded(first);
    for (k, r) in runs.iter().enumerate() {
        let input = k + 1;
        if r.format != RUN_FORMAT {
            return Err(Error::Merge(format!(
                "input {input} has format {:?}, not {RUN_FORMAT:?}",
                r.format
            )));
        }
        if r.target != first.target {
            return Err(Error::Merge(format!(
                "input {input} replayed target {:?} (toggles {:?}, build {:?}) but input 1 \
                 replayed {:?} (toggles {:?}, build {:?}): only runs of one target merge",
                r.target.spec,
                r.target.toggles,
                r.target.build,
                first.target.spec,
                first.target.toggles,
                first.target.build
            )));
        }
        if unsharded(r) != settings {
            return Err(Error::Merge(format!(
                "input {input} was replayed with different settings than input 1 \
                 ({:?} vs {:?}): only runs of one configuration merge",
                unsharded(r),
                settings
            )));
        }
    }

    // Parts, flattened, and their shards.
    let mut parts: Vec<MergedPart> = Vec::new();
    for r in runs {
        if r.merged_from.is_empty() {
            parts.push(MergedPart {
                shard: r.settings.shard,
                started_at_us: r.started_at_us,
                ended_at_us: r.ended_at_us,
                sessions_total: r.sessions_total,
                completed: r.speed.completed,
                cancelled: r.cancelled,
            });
        } else {
            parts.extend(r.merged_from.iter().cloned());
        }
    }
    check_shards(&parts)?;

    // Sessions: disjoint.
    let mut seen: HashSet<&str> = HashSet::new();
    for (k, r) in runs.iter().enumerate() {
        for s in &r.sessions {
            if !seen.insert(s.id.as_str()) {
                return Err(Error::Merge(format!(
                    "session {:?} appears again in input {} (was a shard or run given twice?)",
                    s.id,
                    k + 1
                )));
            }
        }
    }

    let started_at_us = runs.iter().map(|r| r.started_at_us).min().unwrap_or(0);
    let ended_at_us = runs.iter().map(|r| r.ended_at_us).max().unwrap_or(0);
    let span_s = ended_at_us.saturating_sub(started_at_us) as f64 / 1e6;
    let duration_s = if span_s > 0.0 {
        span_s
    } else {
        runs.iter().map(|r| r.speed.duration_s).fold(0.0, f64::max)
    };
    let speed = merge_speed(
        &runs.iter().map(|r| &r.speed).collect::<Vec<_>>(),
        duration_s,
    )?;
    let fidelity = merge_fidelity(&runs.iter().map(|r| &r.fidelity).collect::<Vec<_>>());
    Ok(RunSummary {
        format: RUN_FORMAT.into(),
        target: first.target.clone(),
        settings,
        started_at_us,
        ended_at_us,
        cancelled: runs.iter().any(|r| r.cancelled),
        sessions_total: runs.iter().map(|r| r.sessions_total).sum(),
        sessions_started: runs.iter().map(|r| r.sessions_started).sum(),
        speed,
        flagged: fidelity.flagged_turns > 0 || runs.iter().any(|r| r.flagged),
        fidelity,
        sessions: runs
            .iter()
            .flat_map(|r| r.sessions.iter().cloned())
            .collect(),
        merged_from: parts,
    })
}

/// Every part with a shard must be of the same `n`, each index at most once, and shards and whole
/// runs do not mix (a whole run already holds every shard's sessions).
fn check_shards(parts: &[MergedPart]) -> Result<()> {
    let sharded: Vec<Shard> = parts.iter().filter_map(|p| p.shard).collect();
    if sharded.is_empty() {
        return Ok(());
    }
    if sharded.len() != parts.len() {
        return Err(Error::Merge(
            "some inputs are shards and some are whole runs; merge the shards of one replay".into(),
        ));
    }
    let n = sharded[0].count;
    let mut indices = BTreeSet::new();
    for sh in &sharded {
        if sh.count != n {
            return Err(Error::Merge(format!(
                "shard {sh} is of a {}-way split but shard {} of a {n}-way one",
                sh.count, sharded[0]
            )));
        }
        if !indices.insert(sh.index) {
            return Err(Error::Merge(format!("shard {sh} is given more than once")));
        }
    }
    Ok(())
}

/// The shards of a merged run's split that are not among its parts (empty when complete, or when
/// the parts are not shards).
pub fn missing_shards(run: &RunSummary) -> Vec<Shard> {
    let present: BTreeSet<u32> = run
        .merged_from
        .iter()
        .filter_map(|p| p.shard.map(|s| s.index))
        .collect();
    let Some(n) = run
        .merged_from
        .iter()
        .find_map(|p| p.shard.map(|s| s.count))
    else {
        return Vec::new();
    };
    (0..n)
        .filter(|i| !present.contains(i))
        .map(|index| Shard { index, count: n })
        .collect()
}

/// Adds the HDR histograms of latency summaries and summarizes the sum: exactly the summary one
/// histogram over all the values would give.
pub fn merge_latency(parts: &[&LatencySummary]) -> Result<LatencySummary> {
    let mut acc = Latency::new();
    for p in parts {
        if p.hdr.trim().is_empty() {
            if p.count == 0 {
                continue;
            }
            return Err(Error::Merge(format!(
                "a latency summary of {} values has no histogram (hdr) to merge",
                p.count
            )));
        }
        acc.merge(&Latency::decode(&p.hdr)?)?;
    }
    acc.summary()
}

/// Merges speed summaries; rates are recomputed over `duration_s`.
pub fn merge_speed(parts: &[&SpeedSummary], duration_s: f64) -> Result<SpeedSummary> {
    let sum = |f: fn(&SpeedSummary) -> u64| parts.iter().map(|p| f(p)).sum::<u64>();
    let per_s = |x: u64| {
        if duration_s > 0.0 {
            x as f64 / duration_s
        } else {
            0.0
        }
    };
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for p in parts {
        for (k, v) in &p.errors {
            *errors.entry(k.clone()).or_default() += v;
        }
    }
    let latency = |f: fn(&SpeedSummary) -> &LatencySummary| {
        merge_latency(&parts.iter().map(|p| f(p)).collect::<Vec<_>>())
    };
    let completed = sum(|p| p.completed);
    let input = sum(|p| p.total_input_tokens);
    let output = sum(|p| p.total_output_tokens);
    let good = sum(|p| p.good_requests);
    Ok(SpeedSummary {
        duration_s,
        completed,
        failed: sum(|p| p.failed),
        request_throughput: per_s(completed),
        input_token_throughput: per_s(input),
        output_token_throughput: per_s(output),
        total_input_tokens: input,
        total_output_tokens: output,
        good_requests: good,
        goodput: per_s(good),
        errors,
        ttft: latency(|p| &p.ttft)?,
        itl: latency(|p| &p.itl)?,
        tpot: latency(|p| &p.tpot)?,
        e2e: latency(|p| &p.e2e)?,
    })
}

/// Pools [`Stats`] of disjoint samples: exact `n`, mean, min and max; the CI from the pooled
/// variance (each part's sample variance recovered from its CI half-width); q90/q99 the largest
/// part's, an upper bound of the pooled quantile. Empty parts are ignored; one non-empty part is
/// returned unchanged.
pub fn merge_stats(parts: &[Stats]) -> Stats {
    let parts: Vec<&Stats> = parts.iter().filter(|p| p.n > 0).collect();
    match parts.as_slice() {
        [] => return Stats::default(),
        [one] => return **one,
        _ => {}
    }
    let n: usize = parts.iter().map(|p| p.n).sum();
    let mean = parts.iter().map(|p| p.n as f64 * p.mean).sum::<f64>() / n as f64;
    // Sum of squared deviations from the pooled mean: within parts plus between them.
    let ss: f64 = parts
        .iter()
        .map(|p| {
            let within = if p.n >= 2 {
                let s = (p.ci95_high - p.mean) / Z95 * (p.n as f64).sqrt();
                (p.n - 1) as f64 * s * s
            } else {
                0.0
            };
            within + p.n as f64 * (p.mean - mean).powi(2)
        })
        .sum();
    let half = Z95 * (ss / (n - 1) as f64 / n as f64).sqrt();
    let fold = |f: fn(&Stats) -> f64, g: fn(f64, f64) -> f64, init: f64| {
        parts.iter().map(|p| f(p)).fold(init, g)
    };
    Stats {
        n,
        mean,
        ci95_low: mean - half,
        ci95_high: mean + half,
        q90: fold(|p| p.q90, f64::max, f64::NEG_INFINITY),
        q99: fold(|p| p.q99, f64::max, f64::NEG_INFINITY),
        min: fold(|p| p.min, f64::min, f64::INFINITY),
        max: fold(|p| p.max, f64::max, f64::NEG_INFINITY),
    }
}

/// Pools [`DriftStats`] of disjoint position sets (see [`merge_stats`]); top-1 agreement is
/// weighted by positions.
pub fn merge_drift(parts: &[&DriftStats]) -> DriftStats {
    let positions: usize = parts.iter().map(|p| p.positions).sum();
    if positions == 0 {
        return DriftStats::default();
    }
    let agree: f64 = parts
        .iter()
        .map(|p| p.top1_agreement * p.positions as f64)
        .sum();
    let pick =
        |f: fn(&DriftStats) -> Stats| merge_stats(&parts.iter().map(|p| f(p)).collect::<Vec<_>>());
    DriftStats {
        positions,
        dlogprob: pick(|p| p.dlogprob),
        abs_dlogprob: pick(|p| p.abs_dlogprob),
        top1_agreement: agree / positions as f64,
        kl: pick(|p| p.kl),
    }
}

/// Merges fidelity summaries: counts add, the mean edit distance is weighted by compared turns,
/// drift pools overall and per position bucket.
pub fn merge_fidelity(parts: &[&FidelitySummary]) -> FidelitySummary {
    let mut out = FidelitySummary::default();
    let mut edit_sum = 0.0;
    let mut buckets: BTreeMap<usize, (String, Vec<&DriftStats>)> = BTreeMap::new();
    for p in parts {
        out.compared_turns += p.compared_turns;
        out.prompt_divergent_turns += p.prompt_divergent_turns;
        out.exact_match_turns += p.exact_match_turns;
        out.scored_turns += p.scored_turns;
        out.probes_passed += p.probes_passed;
        out.probes_failed += p.probes_failed;
        out.flagged_turns += p.flagged_turns;
        edit_sum += p.mean_edit_distance * p.compared_turns as f64;
        for (k, v) in &p.flags {
            *out.flags.entry(k.clone()).or_default() += v;
        }
        for b in &p.drift_by_bucket {
            buckets
                .entry(b.from)
                .or_insert_with(|| (b.bucket.clone(), Vec::new()))
                .1
                .push(&b.drift);
        }
    }
    if out.compared_turns > 0 {
        out.mean_edit_distance = edit_sum / out.compared_turns as f64;
    }
    out.drift = merge_drift(&parts.iter().map(|p| &p.drift).collect::<Vec<_>>());
    out.drift_by_bucket = buckets
        .into_iter()
        .map(|(from, (bucket, d))| BucketDrift {
            bucket,
            from,
            drift: merge_drift(&d),
        })
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_stats_equal_stats_of_the_union() {
        let a = [0.5, -1.0, 2.0, 3.5, 0.0];
        let b = [10.0, 11.0];
        let c = [4.0];
        let all: Vec<f64> = a.iter().chain(&b).chain(&c).copied().collect();
        let whole = Stats::of(&all);
        let m = merge_stats(&[
            Stats::of(&a),
            Stats::of(&b),
            Stats::default(),
            Stats::of(&c),
        ]);
        assert_eq!(m.n, whole.n);
        assert!((m.mean - whole.mean).abs() < 1e-12);
        assert!(
            (m.ci95_low - whole.ci95_low).abs() < 1e-9,
            "{m:?} {whole:?}"
        );
        assert!((m.ci95_high - whole.ci95_high).abs() < 1e-9);
        assert_eq!((m.min, m.max), (whole.min, whole.max));
        assert!(
            m.q90 >= whole.q90 && m.q99 >= whole.q99,
            "quantiles are upper bounds"
        );
        assert_eq!(merge_stats(&[Stats::of(&a)]), Stats::of(&a));
        assert_eq!(merge_stats(&[]), Stats::default());
    }
}
