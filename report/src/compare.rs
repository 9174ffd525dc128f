//! Baseline vs candidate: one row per metric with its delta and a verdict a CI job can act on.
//!
//! Turns are paired by `(session_id, turn)`. Two runs are comparable when they replayed the same
//! set of sessions, have the run format, and share at least one turn; otherwise the comparison
//! says why and [`Comparison::exit_code`] is 2.
//!
//! # Latency: noise-aware
//! Latency differs between two runs of the same build. A rule such as "p99 TTFT may regress by at
//! most 5%" is judged on a *paired bootstrap* of the relative change of the percentile
//! ([`crate::stats::bootstrap_rel_change`]): resample paired turns with replacement (the same turns
//! on both sides), recompute `p(cand)/p(base) − 1`, and take the percentile interval at the
//! policy's confidence. The rule fails only when the interval's *lower* bound exceeds the allowed
//! regression — i.e. when we are confident the regression is larger than allowed. Fewer than
//! `min_samples` paired turns give `NoData`, never a failure. ITL pools every gap of the resampled
//! turns (a cluster bootstrap: gaps of one turn are not independent).
//!
//! # Fidelity: thresholds and new flags
//! Drift limits (mean KL overall and per context bucket, mean |Δlogprob|, top-1 agreement) apply
//! to the candidate's numbers, which already measure the distance to the recording. Flags are
//! judged per paired turn: a prompt divergence, output mismatch, failed probe or error on the
//! candidate that the baseline did not have on the same turn is *new*.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;
use tapedeck_replayer::metrics::tpot_us;
use tapedeck_replayer::report::{RunSummary, TurnRow};

use crate::policy::Policy;
use crate::stats::bootstrap_rel_change;
use crate::table::{fmt_num, xml_escape, Table};

/// The verdict of one metric row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Within the policy.
    Pass,
    /// Outside the policy: the build should not ship.
    Fail,
    /// Measured and shown, not judged (no limit, or the policy allows it).
    Info,
    /// Not enough data to judge (too few samples, nothing scored).
    NoData,
}

impl Verdict {
    /// Upper-case word for tables.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Info => "info",
            Verdict::NoData => "no data",
        }
    }
}

/// One compared metric.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricRow {
    /// The policy rule that judged it (`latency.ttft_p99_max_regression`), or `info.*` for rows
    /// that no rule judges. JUnit groups rows by rule.
    pub rule: String,
    /// Human name (`TTFT p99`, `mean KL [4-8k]`).
    pub name: String,
    /// Unit of `base` and `cand` (`ms`, `nats`, `turns`, ...).
    pub unit: String,
    /// Baseline value.
    pub base: Option<f64>,
    /// Candidate value.
    pub cand: Option<f64>,
    /// `cand − base`.
    pub delta_abs: Option<f64>,
    /// `cand / base − 1`.
    pub delta_rel: Option<f64>,
    /// Confidence interval of `delta_rel` (latency rows).
    pub ci: Option<(f64, f64)>,
    /// Verdict.
    pub verdict: Verdict,
    /// Why: the limit and the evidence.
    pub why: String,
}

impl MetricRow {
    fn new(rule: &str, name: &str, unit: &str, base: Option<f64>, cand: Option<f64>) -> Self {
        let delta_abs = base.zip(cand).map(|(b, c)| c - b);
        let delta_rel = base
            .zip(cand)
            .and_then(|(b, c)| (b != 0.0).then(|| c / b - 1.0));
        MetricRow {
            rule: rule.to_string(),
            name: name.to_string(),
            unit: unit.to_string(),
            base,
            cand,
            delta_abs,
            delta_rel,
            ci: None,
            verdict: Verdict::Info,
            why: String::new(),
        }
    }

    fn judged(mut self, verdict: Verdict, why: impl Into<String>) -> Self {
        self.verdict = verdict;
        self.why = why.into();
        self
    }
}

/// Identity of one side of a comparison.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunLabel {
    /// Target spec.
    pub spec: String,
    /// Toggles in force (canonical text), when known.
    pub toggles: Option<String>,
    /// Build identity, when known.
    pub build: Option<String>,
    /// Turns in the run.
    pub turns: usize,
}

impl RunLabel {
    fn of(run: &RunSummary) -> Self {
        RunLabel {
            spec: run.target.spec.clone(),
            toggles: run.target.toggles.clone(),
            build: run.target.build.clone(),
            turns: run.sessions.iter().map(|s| s.turns.len()).sum(),
        }
    }

    /// `spec [toggles] (build)` for headers.
    pub fn describe(&self) -> String {
        let mut s = self.spec.clone();
        if let Some(t) = self.toggles.as_deref().filter(|t| !t.is_empty()) {
            let _ = write!(s, " [{t}]");
        }
        if let Some(b) = &self.build {
            let _ = write!(s, " ({b})");
        }
        s
    }
}

/// The result of [`compare`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// The baseline.
    pub base: RunLabel,
    /// The candidate.
    pub cand: RunLabel,
    /// Turns present in both runs.
    pub paired_turns: usize,
    /// Turns present in only one of them (e.g. a cancelled run).
    pub unpaired_turns: usize,
    /// Why the runs could not be compared; `None` when they could.
    pub not_comparable: Option<String>,
    /// One row per metric, in policy order.
    pub rows: Vec<MetricRow>,
    /// How latency was judged, for the reader.
    pub method: String,
}

/// Turn key: `(session_id, turn)`.
type Key = (String, usize);

fn index(run: &RunSummary) -> BTreeMap<Key, &TurnRow> {
    run.sessions
        .iter()
        .flat_map(|s| s.turns.iter())
        .map(|t| ((t.session_id.clone(), t.turn), t))
        .collect()
}

/// Compares a candidate run with a baseline run under `policy`. See the module docs for the method.
pub fn compare(base: &RunSummary, cand: &RunSummary, policy: &Policy) -> Comparison {
    let lp = &policy.latency;
    let method = format!(
        "latency: paired bootstrap ({} resamples, seed {}) of the relative change of each \
         percentile over turns paired by (session, turn); {:.0}% interval; a rule fails when the \
         interval's lower bound exceeds its limit; fewer than {} pairs = no data",
        lp.resamples,
        lp.seed,
        lp.confidence * 100.0,
        lp.min_samples
    );
    let mut cmp = Comparison {
        base: RunLabel::of(base),
        cand: RunLabel::of(cand),
        paired_turns: 0,
        unpaired_turns: 0,
        not_comparable: None,
        rows: Vec::new(),
        method,
    };
    for (side, run) in [("baseline", base), ("candidate", cand)] {
        if !run.format.starts_with("tapedeck.run.v") {
            cmp.not_comparable = Some(format!(
                "the {side} is not a tapedeck run summary (format {:?})",
                run.format
            ));
            return cmp;
        }
    }
    let bs: BTreeSet<&str> = base.sessions.iter().map(|s| s.id.as_str()).collect();
    let cs: BTreeSet<&str> = cand.sessions.iter().map(|s| s.id.as_str()).collect();
    if bs != cs {
        let only_b: Vec<_> = bs.difference(&cs).take(5).collect();
        let only_c: Vec<_> = cs.difference(&bs).take(5).collect();
        cmp.not_comparable = Some(format!(
            "different session sets ({} vs {} sessions; only in baseline: {only_b:?}; only in \
             candidate: {only_c:?})",
            bs.len(),
            cs.len()
        ));
        return cmp;
    }
    let bi = index(base);
    let ci = index(cand);
    let pairs: Vec<(&TurnRow, &TurnRow)> = bi
        .iter()
        .filter_map(|(k, b)| ci.get(k).map(|c| (*b, *c)))
        .collect();
    cmp.paired_turns = pairs.len();
    cmp.unpaired_turns = bi.len() + ci.len() - 2 * pairs.len();
    if pairs.is_empty() {
        cmp.not_comparable = Some("no turn is present in both runs".to_string());
        return cmp;
    }
    latency_rows(&mut cmp.rows, &pairs, policy);
    info_speed_rows(&mut cmp.rows, base, cand);
    fidelity_rows(&mut cmp.rows, &pairs, base, cand, policy);
    cmp
}

/// A latency extractor: the values of one turn.
type Extract = fn(&TurnRow) -> Vec<f64>;

fn ttft(t: &TurnRow) -> Vec<f64> {
    t.timing
        .as_ref()
        .and_then(|x| x.ttft_us)
        .map(|v| vec![v as f64 / 1000.0])
        .unwrap_or_default()
}
fn itl(t: &TurnRow) -> Vec<f64> {
    t.timing
        .as_ref()
        .map(|x| x.itl_us.iter().map(|&v| v as f64 / 1000.0).collect())
        .unwrap_or_default()
}
fn tpot(t: &TurnRow) -> Vec<f64> {
    t.timing
        .as_ref()
        .and_then(|x| tpot_us(x.ttft_us, x.e2e_us, x.output_tokens))
        .map(|v| vec![v / 1000.0])
        .unwrap_or_default()
}
fn e2e(t: &TurnRow) -> Vec<f64> {
    t.timing
        .as_ref()
        .map(|x| vec![x.e2e_us as f64 / 1000.0])
        .unwrap_or_default()
}

fn latency_rows(rows: &mut Vec<MetricRow>, pairs: &[(&TurnRow, &TurnRow)], policy: &Policy) {
    let lp = &policy.latency;
    let rules: [(&str, &str, Extract, f64, f64); 8] = [
        (
            "ttft_p50_max_regression",
            "TTFT p50",
            ttft,
            0.50,
            lp.ttft_p50_max_regression,
        ),
        (
            "ttft_p99_max_regression",
            "TTFT p99",
            ttft,
            0.99,
            lp.ttft_p99_max_regression,
        ),
        (
            "itl_p50_max_regression",
            "ITL p50",
            itl,
            0.50,
            lp.itl_p50_max_regression,
        ),
        (
            "itl_p99_max_regression",
            "ITL p99",
            itl,
            0.99,
            lp.itl_p99_max_regression,
        ),
        (
            "tpot_p50_max_regression",
            "TPOT p50",
            tpot,
            0.50,
            lp.tpot_p50_max_regression,
        ),
        (
            "tpot_p99_max_regression",
            "TPOT p99",
            tpot,
            0.99,
            lp.tpot_p99_max_regression,
        ),
        (
            "e2e_p50_max_regression",
            "E2E p50",
            e2e,
            0.50,
            lp.e2e_p50_max_regression,
        ),
        (
            "e2e_p99_max_regression",
            "E2E p99",
            e2e,
            0.99,
            lp.e2e_p99_max_regression,
        ),
    ];
    for (i, (key, name, f, q, limit)) in rules.into_iter().enumerate() {
        let units: Vec<(Vec<f64>, Vec<f64>)> = pairs
            .iter()
            .map(|(b, c)| (f(b), f(c)))
            .filter(|(b, c)| !b.is_empty() && !c.is_empty())
            .collect();
        let rule = format!("latency.{key}");
        let pooled = |side: usize| {
            let mut v: Vec<f64> = units
                .iter()
                .flat_map(|u| if side == 0 { &u.0 } else { &u.1 })
                .copied()
                .collect();
            crate::stats::quantile(&mut v, q)
        };
        let mut row = MetricRow::new(&rule, name, "ms", pooled(0), pooled(1));
        if units.len() < lp.min_samples {
            rows.push(row.judged(
                Verdict::NoData,
                format!(
                    "{} paired turns, fewer than min_samples = {}",
                    units.len(),
                    lp.min_samples
                ),
            ));
            continue;
        }
        // A different seed per rule keeps the rules' resamples independent but reproducible.
        let Some(ci) =
            bootstrap_rel_change(&units, q, lp.confidence, lp.resamples, lp.seed + i as u64)
        else {
            rows.push(row.judged(Verdict::NoData, "baseline percentile is zero"));
            continue;
        };
        row.ci = Some((ci.low, ci.high));
        let interval = format!(
            "change {:+.1}% ({:.0}% CI {:+.1}%..{:+.1}%, n={})",
            ci.estimate * 100.0,
            lp.confidence * 100.0,
            ci.low * 100.0,
            ci.high * 100.0,
            units.len()
        );
        let row = if limit.is_infinite() {
            row.judged(Verdict::Info, format!("{interval}; no limit"))
        } else if ci.low > limit {
            row.judged(
                Verdict::Fail,
                format!(
                    "{interval}: regression above the {:.1}% allowed, beyond noise",
                    limit * 100.0
                ),
            )
        } else {
            row.judged(
                Verdict::Pass,
                format!(
                    "{interval}: within {:.1}% allowed or within noise",
                    limit * 100.0
                ),
            )
        };
        rows.push(row);
    }
}

fn info_speed_rows(rows: &mut Vec<MetricRow>, base: &RunSummary, cand: &RunSummary) {
    let (b, c) = (&base.speed, &cand.speed);
    let items = [
        (
            "request throughput",
            "req/s",
            b.request_throughput,
            c.request_throughput,
        ),
        (
            "output token throughput",
            "tok/s",
            b.output_token_throughput,
            c.output_token_throughput,
        ),
        ("goodput", "req/s", b.goodput, c.goodput),
        (
            "failed requests",
            "requests",
            b.failed as f64,
            c.failed as f64,
        ),
    ];
    for (name, unit, bv, cv) in items {
        let rule = format!("info.{}", name.replace(' ', "_"));
        rows.push(
            MetricRow::new(&rule, name, unit, Some(bv), Some(cv))
                .judged(Verdict::Info, "depends on load and machine; not judged"),
        );
    }
}

/// Lists up to five turn keys for a message.
fn some_turns(keys: &[(&str, usize)]) -> String {
    let mut s: Vec<String> = keys
        .iter()
        .take(5)
        .map(|(id, t)| format!("{id}#{t}"))
        .collect();
    if keys.len() > 5 {
        s.push(format!("… {} more", keys.len() - 5));
    }
    s.join(", ")
}

fn new_flag_row(
    rule: &str,
    name: &str,
    pairs: &[(&TurnRow, &TurnRow)],
    had: fn(&TurnRow) -> bool,
    allowed: bool,
) -> MetricRow {
    let nb = pairs.iter().filter(|(b, _)| had(b)).count();
    let nc = pairs.iter().filter(|(_, c)| had(c)).count();
    let new: Vec<(&str, usize)> = pairs
        .iter()
        .filter(|(b, c)| had(c) && !had(b))
        .map(|(_, c)| (c.session_id.as_str(), c.turn))
        .collect();
    let row = MetricRow::new(rule, name, "turns", Some(nb as f64), Some(nc as f64));
    if new.is_empty() {
        row.judged(Verdict::Pass, "none new")
    } else if allowed {
        row.judged(
            Verdict::Info,
            format!("{} new, allowed by policy: {}", new.len(), some_turns(&new)),
        )
    } else {
        row.judged(
            Verdict::Fail,
            format!("{} new: {}", new.len(), some_turns(&new)),
        )
    }
}

fn fidelity_rows(
    rows: &mut Vec<MetricRow>,
    pairs: &[(&TurnRow, &TurnRow)],
    base: &RunSummary,
    cand: &RunSummary,
    policy: &Policy,
) {
    let fp = &policy.fidelity;
    rows.push(new_flag_row(
        "fidelity.allow_new_prompt_divergence",
        "prompt divergences",
        pairs,
        |t| t.prompt.as_ref().is_some_and(|p| p.diverged),
        fp.allow_new_prompt_divergence,
    ));
    rows.push(new_flag_row(
        "fidelity.allow_new_output_mismatch",
        "output mismatches",
        pairs,
        |t| t.output.as_ref().is_some_and(|o| !o.exact_match),
        fp.allow_new_output_mismatch,
    ));
    rows.push(new_flag_row(
        "fidelity.allow_new_probe_failures",
        "failed probes",
        pairs,
        |t| t.probe_passed == Some(false),
        fp.allow_new_probe_failures,
    ));
    rows.push(new_flag_row(
        "fidelity.allow_new_errors",
        "failed turns",
        pairs,
        |t| t.error.is_some(),
        fp.allow_new_errors,
    ));

    let (bd, cd) = (&base.fidelity.drift, &cand.fidelity.drift);
    let scored = cd.positions > 0;
    let opt = |present: bool, v: f64| present.then_some(v);
    let bscored = bd.positions > 0;
    let max_rule =
        |rule: &str, name: &str, unit: &str, b: Option<f64>, c: Option<f64>, limit: f64| {
            let row = MetricRow::new(rule, name, unit, b, c);
            match c {
                None => row.judged(Verdict::NoData, "nothing scored by teacher forcing"),
                Some(_) if limit.is_infinite() => row.judged(Verdict::Info, "no limit"),
                Some(v) if v <= limit => row.judged(
                    Verdict::Pass,
                    format!("{} ≤ {}", fmt_num(v), fmt_num(limit)),
                ),
                Some(v) => row.judged(
                    Verdict::Fail,
                    format!("{} > {} allowed", fmt_num(v), fmt_num(limit)),
                ),
            }
        };
    rows.push(max_rule(
        "fidelity.max_mean_kl",
        "mean KL",
        "nats",
        opt(bscored, bd.kl.mean),
        opt(scored, cd.kl.mean),
        fp.max_mean_kl,
    ));
    let bb: BTreeMap<&str, f64> = base
        .fidelity
        .drift_by_bucket
        .iter()
        .filter(|b| b.drift.positions > 0)
        .map(|b| (b.bucket.as_str(), b.drift.kl.mean))
        .collect();
    let mut any_bucket = false;
    for b in cand
        .fidelity
        .drift_by_bucket
        .iter()
        .filter(|b| b.drift.positions > 0)
    {
        any_bucket = true;
        let mut row = max_rule(
            "fidelity.max_mean_kl_per_bucket",
            &format!("mean KL [{}]", b.bucket),
            "nats",
            bb.get(b.bucket.as_str()).copied(),
            Some(b.drift.kl.mean),
            fp.max_mean_kl_per_bucket,
        );
        let _ = write!(row.why, " ({} positions)", b.drift.positions);
        rows.push(row);
    }
    if !any_bucket {
        rows.push(max_rule(
            "fidelity.max_mean_kl_per_bucket",
            "mean KL per bucket",
            "nats",
            None,
            None,
            fp.max_mean_kl_per_bucket,
        ));
    }
    rows.push(max_rule(
        "fidelity.max_mean_abs_dlogprob",
        "mean |Δlogprob|",
        "nats",
        opt(bscored, bd.abs_dlogprob.mean),
        opt(scored, cd.abs_dlogprob.mean),
        fp.max_mean_abs_dlogprob,
    ));
    let row = MetricRow::new(
        "fidelity.min_top1_agreement",
        "top-1 agreement",
        "fraction",
        opt(bscored, bd.top1_agreement),
        opt(scored, cd.top1_agreement),
    );
    rows.push(match row.cand {
        None => row.judged(Verdict::NoData, "nothing scored by teacher forcing"),
        Some(v) if v >= fp.min_top1_agreement => row.judged(
            Verdict::Pass,
            format!("{} ≥ {}", fmt_num(v), fmt_num(fp.min_top1_agreement)),
        ),
        Some(v) => row.judged(
            Verdict::Fail,
            format!(
                "{} < {} required",
                fmt_num(v),
                fmt_num(fp.min_top1_agreement)
            ),
        ),
    });
}

impl Comparison {
    /// 0 when every rule passed, 1 when any failed, 2 when the runs could not be compared.
    pub fn exit_code(&self) -> i32 {
        if self.not_comparable.is_some() {
            2
        } else if self.failed() {
            1
        } else {
            0
        }
    }

    /// Whether any row failed.
    pub fn failed(&self) -> bool {
        self.rows.iter().any(|r| r.verdict == Verdict::Fail)
    }

    /// One word for the whole comparison: `PASS`, `FAIL` or `NOT COMPARABLE`.
    pub fn verdict_word(&self) -> &'static str {
        match self.exit_code() {
            0 => "PASS",
            1 => "FAIL",
            _ => "NOT COMPARABLE",
        }
    }

    fn headline(&self) -> String {
        match &self.not_comparable {
            Some(why) => format!("NOT COMPARABLE: {why}"),
            None => {
                let fails = self
                    .rows
                    .iter()
                    .filter(|r| r.verdict == Verdict::Fail)
                    .count();
                let judged = self
                    .rows
                    .iter()
                    .filter(|r| matches!(r.verdict, Verdict::Pass | Verdict::Fail))
                    .count();
                format!(
                    "{}: {fails} of {judged} judged metrics failed ({} paired turns{})",
                    self.verdict_word(),
                    self.paired_turns,
                    if self.unpaired_turns > 0 {
                        format!(", {} unpaired", self.unpaired_turns)
                    } else {
                        String::new()
                    }
                )
            }
        }
    }

    fn table(&self) -> Table {
        let mut t = Table::new(&["metric", "base", "cand", "Δ", "Δ%", "verdict", "why"]);
        for r in &self.rows {
            let unit = if r.unit == "ms" || r.unit == "nats" {
                format!(" {}", r.unit)
            } else {
                String::new()
            };
            t.row(vec![
                r.name.clone(),
                r.base
                    .map_or("-".into(), |v| format!("{}{unit}", fmt_num(v))),
                r.cand
                    .map_or("-".into(), |v| format!("{}{unit}", fmt_num(v))),
                r.delta_abs.map_or("-".into(), |v| {
                    format!("{}{}", if v >= 0.0 { "+" } else { "" }, fmt_num(v))
                }),
                r.delta_rel
                    .map_or("-".into(), |v| format!("{:+.1}%", v * 100.0)),
                r.verdict.word().to_string(),
                r.why.clone(),
            ]);
        }
        t
    }

    /// Aligned plain-text table for the terminal.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "baseline:  {}", self.base.describe());
        let _ = writeln!(s, "candidate: {}", self.cand.describe());
        let _ = writeln!(s, "{}", self.headline());
        if self.not_comparable.is_none() {
            let _ = writeln!(s);
            s.push_str(&self.table().to_text());
            let _ = writeln!(s);
            let _ = writeln!(s, "{}", self.method);
        }
        s
    }

    /// A Markdown summary for a pull-request comment: the verdict, then the table.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let icon = match self.exit_code() {
            0 => "✅",
            1 => "❌",
            _ => "⚠️",
        };
        let _ = writeln!(s, "### {icon} tapedeck compare: {}\n", self.headline());
        let _ = writeln!(s, "- baseline: `{}`", self.base.describe());
        let _ = writeln!(s, "- candidate: `{}`\n", self.cand.describe());
        if self.not_comparable.is_none() {
            s.push_str(&self.table().to_markdown());
            let _ = writeln!(s, "\n<sub>{}</sub>", self.method);
        }
        s
    }

    /// JUnit XML: one `<testcase>` per policy rule (rows grouped by `rule`; `info.*` rows left
    /// out), a `<failure>` with the reasons when any of its rows failed, `<skipped>` when it had no
    /// data. A comparison that could not be made is one test case with an `<error>`.
    pub fn to_junit(&self) -> String {
        let mut cases: Vec<(String, Vec<&MetricRow>)> = Vec::new();
        for r in self.rows.iter().filter(|r| !r.rule.starts_with("info.")) {
            match cases.iter_mut().find(|(k, _)| *k == r.rule) {
                Some((_, v)) => v.push(r),
                None => cases.push((r.rule.clone(), vec![r])),
            }
        }
        let mut body = String::new();
        let (mut failures, mut errors, mut skipped) = (0, 0, 0);
        if let Some(why) = &self.not_comparable {
            errors = 1;
            let _ = writeln!(
                body,
                "    <testcase classname=\"tapedeck.compare\" name=\"comparable\">\n      <error message=\"{}\" type=\"not_comparable\"/>\n    </testcase>",
                xml_escape(why)
            );
        }
        for (rule, rows) in &cases {
            let (class, name) = rule.split_once('.').unwrap_or(("compare", rule));
            let _ = write!(
                body,
                "    <testcase classname=\"tapedeck.compare.{}\" name=\"{}\">",
                xml_escape(class),
                xml_escape(name)
            );
            let failed: Vec<_> = rows.iter().filter(|r| r.verdict == Verdict::Fail).collect();
            let details: Vec<String> = rows
                .iter()
                .map(|r| format!("{}: {} — {}", r.name, r.verdict.word(), r.why))
                .collect();
            if !failed.is_empty() {
                failures += 1;
                let msg: Vec<String> = failed
                    .iter()
                    .map(|r| format!("{}: {}", r.name, r.why))
                    .collect();
                let _ = write!(
                    body,
                    "\n      <failure message=\"{}\" type=\"policy\">{}</failure>\n    ",
                    xml_escape(&msg.join("; ")),
                    xml_escape(&details.join("\n"))
                );
            } else if rows.iter().all(|r| r.verdict == Verdict::NoData) {
                skipped += 1;
                let _ = write!(
                    body,
                    "\n      <skipped message=\"{}\"/>\n    ",
                    xml_escape(&details.join("; "))
                );
            } else {
                let _ = write!(
                    body,
                    "\n      <system-out>{}</system-out>\n    ",
                    xml_escape(&details.join("\n"))
                );
            }
            body.push_str("</testcase>\n");
        }
        let tests = cases.len() + usize::from(self.not_comparable.is_some());
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"tapedeck compare\" tests=\"{tests}\" failures=\"{failures}\" errors=\"{errors}\" skipped=\"{skipped}\">\n  <testsuite name=\"tapedeck.compare\" tests=\"{tests}\" failures=\"{failures}\" errors=\"{errors}\" skipped=\"{skipped}\">\n{body}  </testsuite>\n</testsuites>\n"
        )
    }
}
