//! One run as text, JSON, Markdown or a self-contained HTML page.
//!
//! Every format shows the same facts: who ran (target, toggles, build), speed (TTFT, ITL, TPOT,
//! E2E percentiles; throughput, goodput, errors), fidelity (prompt divergences, exact matches,
//! teacher-forced drift overall and by context position, probes, flags), and each session's first
//! divergent turn. JSON wraps the run summary with a versioned envelope ([`REPORT_SCHEMA`],
//! documented in `report/SCHEMA.md`) so tools can rely on it.

use std::fmt::Write as _;

use serde::Serialize;
use tapedeck_replayer::metrics::LatencySummary;
use tapedeck_replayer::report::{Pacing, RunSummary, ThinkTime};

use crate::error::{Error, Result};
use crate::plots;
use crate::table::{fmt_num, xml_escape, Table};

/// The `schema` of the JSON report. Keys are added, never renamed, within a version.
pub const REPORT_SCHEMA: &str = "tapedeck.report.v1";

/// Output format of [`report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned tables for a terminal.
    Text,
    /// The run summary in a versioned envelope ([`REPORT_SCHEMA`]).
    Json,
    /// Compact tables that fit a pull-request comment.
    Markdown,
    /// One self-contained page with inline SVG plots.
    Html,
}

impl std::str::FromStr for Format {
    type Err = String;

    /// `text`, `json`, `markdown` (or `md`), `html`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "text" | "txt" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            "markdown" | "md" => Ok(Format::Markdown),
            "html" => Ok(Format::Html),
            other => Err(format!(
                "unknown format {other:?} (text, json, markdown, html)"
            )),
        }
    }
}

/// Renders `run` in `format`. Fails only when an embedded histogram is corrupt (HTML) or JSON
/// serialization fails.
pub fn report(run: &RunSummary, format: Format) -> Result<String> {
    match format {
        Format::Text => Ok(text(run)),
        Format::Json => json(run),
        Format::Markdown => Ok(markdown(run)),
        Format::Html => html(run),
    }
}

// ---------------------------------------------------------------------------------------------
// Derived facts shared by the formats
// ---------------------------------------------------------------------------------------------

/// Completed turns in one time bin.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimeBin {
    /// Bin start, seconds since the run started.
    pub start_s: f64,
    /// Turns that completed in the bin.
    pub turns: usize,
    /// Their output tokens.
    pub output_tokens: usize,
}

/// Throughput over time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timeline {
    /// How the end times were obtained. The run summary holds per-turn durations but not per-turn
    /// wall-clock end times, so they are `reconstructed`: each session's turns back to back, sessions
    /// placed on `concurrency` slots (closed loop) or at `1/rate` spacing (open loop), then scaled
    /// to the run's measured duration.
    pub source: String,
    /// Bin width, seconds.
    pub bin_s: f64,
    /// Bins from the start of the run.
    pub bins: Vec<TimeBin>,
}

/// Bins per-turn end times into 5 to 30 bins (see [`Timeline::source`]).
pub fn throughput_over_time(run: &RunSummary) -> Timeline {
    let slots = match run.settings.pacing {
        Pacing::Closed { concurrency } => Some(concurrency.max(1)),
        Pacing::Open { .. } | Pacing::Recorded { .. } => None,
    };
    let mut free = vec![0.0f64; slots.unwrap_or(0)];
    let mut ends: Vec<(f64, usize)> = Vec::new();
    for (i, s) in run.sessions.iter().enumerate() {
        let start = match (&run.settings.pacing, slots) {
            (Pacing::Open { rate, .. }, _) if *rate > 0.0 => i as f64 / rate,
            (_, Some(_)) => {
                let (k, t) = free
                    .iter()
                    .copied()
                    .enumerate()
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .unwrap_or((0, 0.0));
                let len: f64 = s
                    .turns
                    .iter()
                    .filter_map(|t| t.timing.as_ref())
                    .map(|t| t.e2e_us as f64 / 1e6)
                    .sum();
                if let Some(f) = free.get_mut(k) {
                    *f = t + len;
                }
                t
            }
            _ => 0.0,
        };
        let mut t = start;
        for turn in &s.turns {
            if let Some(tm) = &turn.timing {
                t += tm.e2e_us as f64 / 1e6;
                ends.push((t, tm.output_tokens));
            }
        }
    }
    let last = ends.iter().map(|e| e.0).fold(0.0, f64::max);
    if ends.is_empty() || last <= 0.0 {
        return Timeline {
            source: "no timed turns".into(),
            ..Timeline::default()
        };
    }
    let measured = (run.ended_at_us - run.started_at_us) as f64 / 1e6;
    let scale = if measured > 0.0 { measured / last } else { 1.0 };
    let span = last * scale;
    // About four turns per bin, between 5 and 30 bins: fewer bins than that turn a small run into
    // spikes of 0, 1 or 2 turns.
    let nbins = (ends.len() / 4).clamp(5, 30);
    let bin_s = span / nbins as f64;
    let mut bins: Vec<TimeBin> = (0..nbins)
        .map(|i| TimeBin {
            start_s: i as f64 * bin_s,
            ..TimeBin::default()
        })
        .collect();
    for (t, tok) in ends {
        let k = (((t * scale) / bin_s) as usize).min(nbins - 1);
        bins[k].turns += 1;
        bins[k].output_tokens += tok;
    }
    Timeline {
        source: "reconstructed from per-turn durations".into(),
        bin_s,
        bins,
    }
}

/// A session's first divergent turn, for the tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionLine {
    /// Session ID.
    pub session_id: String,
    /// Turns replayed.
    pub turns: usize,
    /// Turns flagged.
    pub flagged_turns: usize,
    /// Turns that failed with an error.
    pub failed_turns: usize,
    /// First flagged turn.
    pub first_divergent_turn: Option<usize>,
    /// Its flags.
    pub flags: Vec<String>,
}

/// One line per session.
pub fn session_lines(run: &RunSummary) -> Vec<SessionLine> {
    run.sessions
        .iter()
        .map(|s| {
            // Recomputed from the rows: `first_divergent_turn` is the turn index, and the rows are
            // the source of truth for which flags it had.
            let first = s.turns.iter().find(|t| t.flagged());
            SessionLine {
                session_id: s.id.clone(),
                turns: s.turns.len(),
                flagged_turns: s.turns.iter().filter(|t| t.flagged()).count(),
                failed_turns: s.turns.iter().filter(|t| t.error.is_some()).count(),
                first_divergent_turn: s.first_divergent_turn.or(first.map(|t| t.turn)),
                flags: first.map(|t| t.flags.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

fn ms(v: f64) -> String {
    fmt_num(v)
}

fn latency_table(run: &RunSummary) -> Table {
    let mut t = Table::new(&[
        "latency (ms)",
        "n",
        "mean",
        "p50",
        "p90",
        "p95",
        "p99",
        "p99.9",
        "max",
    ]);
    let s = &run.speed;
    for (name, l) in [
        ("TTFT", &s.ttft),
        ("ITL", &s.itl),
        ("TPOT", &s.tpot),
        ("E2E", &s.e2e),
    ] {
        t.row(latency_cells(name, l));
    }
    t
}

fn latency_cells(name: &str, l: &LatencySummary) -> Vec<String> {
    if l.count == 0 {
        return vec![name.into(), "0".into()];
    }
    vec![
        name.into(),
        l.count.to_string(),
        ms(l.mean_ms),
        ms(l.p50_ms),
        ms(l.p90_ms),
        ms(l.p95_ms),
        ms(l.p99_ms),
        ms(l.p999_ms),
        ms(l.max_ms),
    ]
}

fn throughput_table(run: &RunSummary) -> Table {
    let s = &run.speed;
    let mut t = Table::new(&["throughput", "value"]);
    t.row(vec!["duration (s)".into(), fmt_num(s.duration_s)]);
    t.row(vec![
        "completed / failed requests".into(),
        format!("{} / {}", s.completed, s.failed),
    ]);
    t.row(vec![
        "request throughput (req/s)".into(),
        fmt_num(s.request_throughput),
    ]);
    t.row(vec![
        "input tokens/s".into(),
        fmt_num(s.input_token_throughput),
    ]);
    t.row(vec![
        "output tokens/s".into(),
        fmt_num(s.output_token_throughput),
    ]);
    let slo = &run.settings.slo;
    let slo_text = if slo.is_set() {
        let mut v = Vec::new();
        if let Some(x) = slo.ttft_ms {
            v.push(format!("ttft≤{x}ms"));
        }
        if let Some(x) = slo.tpot_ms {
            v.push(format!("tpot≤{x}ms"));
        }
        if let Some(x) = slo.e2e_ms {
            v.push(format!("e2e≤{x}ms"));
        }
        v.join(",")
    } else {
        "no SLO".into()
    };
    t.row(vec![
        format!("goodput (req/s, {slo_text})"),
        format!(
            "{} ({}/{} good)",
            fmt_num(s.goodput),
            s.good_requests,
            s.completed
        ),
    ]);
    if !s.errors.is_empty() {
        let e: Vec<String> = s.errors.iter().map(|(k, v)| format!("{k}={v}")).collect();
        t.row(vec!["errors".into(), e.join(", ")]);
    }
    t
}

fn pct(a: usize, b: usize) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{a}/{b} ({:.1}%)", 100.0 * a as f64 / b as f64)
    }
}

fn fidelity_table(run: &RunSummary) -> Table {
    let f = &run.fidelity;
    let d = &f.drift;
    let mut t = Table::new(&["fidelity", "value"]);
    t.row(vec!["compared turns".into(), f.compared_turns.to_string()]);
    t.row(vec![
        "prompt divergences".into(),
        pct(f.prompt_divergent_turns, f.compared_turns),
    ]);
    t.row(vec![
        "exact output match".into(),
        pct(f.exact_match_turns, f.compared_turns),
    ]);
    t.row(vec![
        "mean edit distance".into(),
        fmt_num(f.mean_edit_distance),
    ]);
    t.row(vec![
        "scored turns / positions".into(),
        format!("{} / {}", f.scored_turns, d.positions),
    ]);
    if d.positions > 0 {
        t.row(vec![
            "Δlogprob mean ± 95% CI".into(),
            format!(
                "{} ± {}",
                fmt_num(d.dlogprob.mean),
                fmt_num((d.dlogprob.ci95_high - d.dlogprob.ci95_low) / 2.0)
            ),
        ]);
        t.row(vec![
            "|Δlogprob| mean / q90 / q99".into(),
            format!(
                "{} / {} / {}",
                fmt_num(d.abs_dlogprob.mean),
                fmt_num(d.abs_dlogprob.q90),
                fmt_num(d.abs_dlogprob.q99)
            ),
        ]);
        t.row(vec![
            "top-1 agreement".into(),
            format!("{:.2}%", d.top1_agreement * 100.0),
        ]);
        t.row(vec![
            "KL mean / q99".into(),
            format!("{} / {}", fmt_num(d.kl.mean), fmt_num(d.kl.q99)),
        ]);
    }
    t.row(vec![
        "probes passed / failed".into(),
        format!("{} / {}", f.probes_passed, f.probes_failed),
    ]);
    t.row(vec!["flagged turns".into(), f.flagged_turns.to_string()]);
    if !f.flags.is_empty() {
        let fl: Vec<String> = f.flags.iter().map(|(k, v)| format!("{k}={v}")).collect();
        t.row(vec!["flags".into(), fl.join(", ")]);
    }
    t
}

fn bucket_table(run: &RunSummary) -> Table {
    let mut t = Table::new(&[
        "context",
        "positions",
        "mean |Δlp|",
        "q99 |Δlp|",
        "top-1",
        "KL mean",
        "KL q99",
    ]);
    for b in run
        .fidelity
        .drift_by_bucket
        .iter()
        .filter(|b| b.drift.positions > 0)
    {
        let d = &b.drift;
        t.row(vec![
            b.bucket.clone(),
            d.positions.to_string(),
            fmt_num(d.abs_dlogprob.mean),
            fmt_num(d.abs_dlogprob.q99),
            format!("{:.2}%", d.top1_agreement * 100.0),
            fmt_num(d.kl.mean),
            fmt_num(d.kl.q99),
        ]);
    }
    t
}

fn session_table(lines: &[SessionLine], limit: usize) -> Table {
    let mut t = Table::new(&[
        "session",
        "turns",
        "flagged",
        "errors",
        "first divergent turn",
        "flags",
    ]);
    for l in lines.iter().take(limit) {
        t.row(vec![
            l.session_id.clone(),
            l.turns.to_string(),
            l.flagged_turns.to_string(),
            l.failed_turns.to_string(),
            l.first_divergent_turn.map_or("-".into(), |x| x.to_string()),
            l.flags.join(", "),
        ]);
    }
    t
}

fn header_lines(run: &RunSummary) -> Vec<(String, String)> {
    let tg = &run.target;
    let mut v = vec![("target".to_string(), tg.spec.clone())];
    v.push((
        "toggles".into(),
        tg.toggles
            .clone()
            .map(|t| if t.is_empty() { "default".into() } else { t })
            .unwrap_or_else(|| "unknown".into()),
    ));
    if let Some(m) = &tg.model {
        v.push(("model".into(), m.clone()));
    }
    if let Some(b) = &tg.build {
        v.push(("build".into(), b.clone()));
    }
    let pacing = match run.settings.pacing {
        Pacing::Closed { concurrency } => format!("closed loop, concurrency {concurrency}"),
        Pacing::Open {
            rate,
            seed,
            burstiness,
        } if burstiness != 1.0 => {
            format!("open loop, {rate} sessions/s, burstiness {burstiness} (seed {seed})")
        }
        Pacing::Open { rate, seed, .. } => format!("open loop, {rate} sessions/s (seed {seed})"),
        Pacing::Recorded { speed } => format!("recorded timing, speed ×{speed}"),
    };
    let mut extra = String::new();
    if run.settings.think_time != ThinkTime::None {
        extra.push_str(&format!("; think time {}", run.settings.think_time));
        if let Some(ms) = run.settings.max_think_time_ms {
            extra.push_str(&format!(" (at most {ms} ms)"));
        }
    }
    if let Some(sh) = run.settings.shard {
        extra.push_str(&format!("; shard {sh}"));
    }
    if !run.merged_from.is_empty() {
        extra.push_str(&format!("; merged from {} runs", run.merged_from.len()));
    }
    v.push((
        "settings".into(),
        format!(
            "{pacing}; history {:?}; teacher forcing {}{extra}",
            run.settings.history,
            if run.settings.teacher_forcing {
                "on"
            } else {
                "off"
            }
        ),
    ));
    let turns: usize = run.sessions.iter().map(|s| s.turns.len()).sum();
    v.push((
        "sessions".into(),
        format!(
            "{} of {} started, {turns} turns{}",
            run.sessions_started,
            run.sessions_total,
            if run.cancelled {
                " (CANCELLED: partial results)"
            } else {
                ""
            }
        ),
    ));
    v.push((
        "verdict".into(),
        if run.flagged {
            format!("FLAGGED: {} turns flagged", run.fidelity.flagged_turns)
        } else {
            "clean: no turn flagged".into()
        },
    ));
    v
}

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

fn text(run: &RunSummary) -> String {
    let mut s = String::from("tapedeck run report\n");
    for (k, v) in header_lines(run) {
        let _ = writeln!(s, "  {k:<9} {v}");
    }
    let _ = writeln!(s, "\n== Speed");
    s.push_str(&latency_table(run).to_text());
    s.push('\n');
    s.push_str(&throughput_table(run).to_text());
    let _ = writeln!(s, "\n== Fidelity");
    s.push_str(&fidelity_table(run).to_text());
    let buckets = bucket_table(run);
    if !buckets.is_empty() {
        let _ = writeln!(s, "\n-- drift by context position");
        s.push_str(&buckets.to_text());
    }
    let lines = session_lines(run);
    let _ = writeln!(s, "\n== Sessions");
    s.push_str(&session_table(&lines, usize::MAX).to_text());
    s
}

// ---------------------------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------------------------

#[derive(Serialize)]
struct Derived {
    turns: usize,
    failed_turns: usize,
    flagged_turns: usize,
    sessions: usize,
    sessions_flagged: usize,
    first_divergent: Vec<SessionLine>,
    throughput_over_time: Timeline,
}

#[derive(Serialize)]
struct JsonReport<'a> {
    schema: &'static str,
    generator: String,
    verdict: &'static str,
    run: &'a RunSummary,
    derived: Derived,
}

fn json(run: &RunSummary) -> Result<String> {
    let lines = session_lines(run);
    let all = || run.sessions.iter().flat_map(|s| s.turns.iter());
    let doc = JsonReport {
        schema: REPORT_SCHEMA,
        generator: format!("tapedeck-report {}", env!("CARGO_PKG_VERSION")),
        verdict: if run.flagged { "flagged" } else { "clean" },
        run,
        derived: Derived {
            turns: all().count(),
            failed_turns: all().filter(|t| t.error.is_some()).count(),
            flagged_turns: all().filter(|t| t.flagged()).count(),
            sessions: lines.len(),
            sessions_flagged: lines.iter().filter(|l| l.flagged_turns > 0).count(),
            first_divergent: lines
                .into_iter()
                .filter(|l| l.first_divergent_turn.is_some())
                .collect(),
            throughput_over_time: throughput_over_time(run),
        },
    };
    serde_json::to_string_pretty(&doc).map_err(|source| Error::Json {
        context: "writing the report".into(),
        source,
    })
}

// ---------------------------------------------------------------------------------------------
// Markdown
// ---------------------------------------------------------------------------------------------

/// Flagged sessions listed in Markdown; the rest are counted (a PR comment has a size limit).
const MARKDOWN_SESSIONS: usize = 20;

fn markdown(run: &RunSummary) -> String {
    let mut s = String::new();
    let icon = if run.flagged { "⚠️" } else { "✅" };
    let _ = writeln!(s, "### {icon} tapedeck run report\n");
    for (k, v) in header_lines(run) {
        let _ = writeln!(s, "- **{k}**: {}", v.replace('|', "\\|"));
    }
    let _ = writeln!(s, "\n#### Speed\n");
    s.push_str(&latency_table(run).to_markdown());
    s.push('\n');
    s.push_str(&throughput_table(run).to_markdown());
    let _ = writeln!(s, "\n#### Fidelity\n");
    s.push_str(&fidelity_table(run).to_markdown());
    let buckets = bucket_table(run);
    if !buckets.is_empty() {
        s.push('\n');
        s.push_str(&buckets.to_markdown());
    }
    let flagged: Vec<SessionLine> = session_lines(run)
        .into_iter()
        .filter(|l| l.first_divergent_turn.is_some())
        .collect();
    if !flagged.is_empty() {
        let _ = writeln!(
            s,
            "\n<details><summary>{} flagged session(s)</summary>\n",
            flagged.len()
        );
        s.push_str(&session_table(&flagged, MARKDOWN_SESSIONS).to_markdown());
        if flagged.len() > MARKDOWN_SESSIONS {
            let _ = writeln!(s, "\n… and {} more", flagged.len() - MARKDOWN_SESSIONS);
        }
        let _ = writeln!(s, "\n</details>");
    }
    s
}

// ---------------------------------------------------------------------------------------------
// HTML
// ---------------------------------------------------------------------------------------------

const CSS: &str = "
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin:0 0 8px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}
dl.meta dt{font-weight:600;color:#555} dl.meta dd{margin:0;font-family:ui-monospace,monospace}
.verdict-bad{color:#b00020;font-weight:700} .verdict-ok{color:#1b7f3b;font-weight:700}
.plots{display:flex;flex-wrap:wrap;gap:12px} .plots svg{border:1px solid #eee}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left} th{background:#f5f5f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.first-divergent{background:#ffe0e0;font-weight:700;color:#b00020}
.strip{display:flex;gap:2px} .strip span{display:inline-block;width:12px;height:12px;border-radius:2px;background:#7bc67e}
.strip span.flag{background:#f0a0a0} .strip span.err{background:#999}
.strip span.first{background:#d32f2f;outline:2px solid #000}
.tables{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
";

fn html(run: &RunSummary) -> Result<String> {
    let sp = &run.speed;
    let curves = [
        plots::latency_curve("TTFT (ms) by percentile", &sp.ttft)?,
        plots::latency_curve("ITL (ms) by percentile", &sp.itl)?,
        plots::latency_curve("E2E (ms) by percentile", &sp.e2e)?,
    ];
    let tput = plots::throughput(&throughput_over_time(run))?;
    let drift = plots::drift(&run.fidelity.drift_by_bucket)?;
    let no_class = |_: usize, _: usize| None;

    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>tapedeck report: {}</title><style>{CSS}</style></head><body>\n",
        xml_escape(&run.target.spec)
    );
    let _ = writeln!(s, "<h1>tapedeck run report</h1>\n<dl class=\"meta\">");
    for (k, v) in header_lines(run) {
        let class = if k == "verdict" {
            if run.flagged {
                " class=\"verdict-bad\""
            } else {
                " class=\"verdict-ok\""
            }
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "<dt>{}</dt><dd{class}>{}</dd>",
            xml_escape(&k),
            xml_escape(&v)
        );
    }
    s.push_str("</dl>\n<h2>Speed</h2>\n<div class=\"tables\">");
    s.push_str(&latency_table(run).to_html(&no_class));
    s.push_str(&throughput_table(run).to_html(&no_class));
    s.push_str("</div>\n<h3>Latency percentile curves</h3>\n<div class=\"plots\">\n");
    for c in &curves {
        s.push_str(c);
        s.push('\n');
    }
    s.push_str("</div>\n<h3>Throughput over time</h3>\n<div class=\"plots\">\n");
    s.push_str(&tput);
    s.push_str("\n</div>\n<h2>Fidelity</h2>\n<div class=\"tables\">");
    s.push_str(&fidelity_table(run).to_html(&no_class));
    s.push_str(&bucket_table(run).to_html(&no_class));
    s.push_str("</div>\n<div class=\"plots\">\n");
    s.push_str(&drift);
    s.push_str("\n</div>\n<h2>Sessions</h2>\n");
    s.push_str(
        "<p>Each square is a turn: green clean, pink flagged, grey error; the first divergent turn \
         is red and outlined.</p>\n",
    );
    let lines = session_lines(run);
    let mut strips = Vec::with_capacity(run.sessions.len());
    for sess in &run.sessions {
        let first = lines
            .iter()
            .find(|l| l.session_id == sess.id)
            .and_then(|l| l.first_divergent_turn);
        let mut strip = String::from("<div class=\"strip\">");
        for t in &sess.turns {
            let class = if Some(t.turn) == first {
                " class=\"first\""
            } else if t.error.is_some() {
                " class=\"err\""
            } else if t.flagged() {
                " class=\"flag\""
            } else {
                ""
            };
            let title = if t.flags.is_empty() {
                format!("turn {}", t.turn)
            } else {
                format!("turn {}: {}", t.turn, t.flags.join(", "))
            };
            let _ = write!(
                strip,
                "<span{class} title=\"{}\"></span>",
                xml_escape(&title)
            );
        }
        strip.push_str("</div>");
        strips.push(strip);
    }
    // The session table with the first divergent turn highlighted and a per-turn strip; strips
    // are raw HTML, so this table is written by hand rather than through `Table`.
    s.push_str(
        "<table>\n<thead><tr><th>session</th><th>turns</th><th>flagged</th><th>errors</th>\
         <th>first divergent turn</th><th>flags</th><th>turns</th></tr></thead>\n<tbody>\n",
    );
    for (l, strip) in lines.iter().zip(&strips) {
        let first = match l.first_divergent_turn {
            Some(t) => format!("<td class=\"num first-divergent\">{t}</td>"),
            None => "<td class=\"num\">-</td>".to_string(),
        };
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>{first}<td>{}</td><td>{strip}</td></tr>",
            xml_escape(&l.session_id),
            l.turns,
            l.flagged_turns,
            l.failed_turns,
            xml_escape(&l.flags.join(", "))
        );
    }
    s.push_str("</tbody>\n</table>\n");
    let _ = writeln!(
        s,
        "<p style=\"color:#888;font-size:12px\">Generated by tapedeck-report {} (schema {REPORT_SCHEMA}); \
         run format {}.</p>\n</body></html>",
        env!("CARGO_PKG_VERSION"),
        xml_escape(&run.format)
    );
    Ok(s)
}
