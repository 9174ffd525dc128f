//! Report renderers: the HTML page carries one SVG per plot and no external resources, Markdown has
//! its tables, JSON parses and has the documented keys of `report/SCHEMA.md`, text is aligned.

mod common;

use common::{base_specs, run};
use tapedeck_report::render::{report, Format, REPORT_SCHEMA};

fn sample() -> tapedeck_replayer::RunSummary {
    let mut specs = base_specs(4, 8, 31);
    specs[1].1[5].prompt_diverged = true;
    specs[3].1[2].exact = false;
    specs[3].1[6].probe = Some(false);
    specs[0].1[3].error = true;
    for t in specs[2].1.iter_mut().skip(4) {
        t.kl = 0.05;
        t.dlp = 0.1;
    }
    run(
        "engine:tiny-qwen2?kv_dtype=fp8-e4m3",
        "kv_dtype=fp8-e4m3",
        &specs,
    )
}

#[test]
fn html_is_self_contained_with_every_plot() {
    let html = report(&sample(), Format::Html).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    // TTFT, ITL, E2E curves, throughput, drift.
    assert_eq!(html.matches("<svg").count(), 5, "one <svg> per plot");
    for title in [
        "TTFT (ms) by percentile",
        "ITL (ms) by percentile",
        "E2E (ms) by percentile",
        "Throughput over time",
        "Fidelity drift by context position",
    ] {
        assert!(html.contains(title), "missing plot {title}");
    }
    assert!(
        html.contains("first-divergent"),
        "first divergent turn highlighted"
    );
    for external in [
        "<script",
        "<link",
        "src=\"http",
        "href=\"http",
        "@import",
        "url(",
    ] {
        assert!(!html.contains(external), "external resource {external}");
    }
    if let Ok(path) = std::env::var("TAPEDECK_REPORT_HTML") {
        std::fs::write(path, &html).unwrap();
    }
}

#[test]
fn html_of_an_empty_run_still_renders() {
    let r = run("engine:x", "", &[]);
    let html = report(&r, Format::Html).unwrap();
    assert_eq!(html.matches("<svg").count(), 5);
    assert!(html.contains("no data"));
}

#[test]
fn markdown_has_the_tables() {
    let md = report(&sample(), Format::Markdown).unwrap();
    assert!(
        md.contains("| latency (ms) | n | mean | p50 | p90 | p95 | p99 | p99.9 | max |"),
        "{md}"
    );
    assert!(md.contains("| fidelity | value |"));
    assert!(md.contains("| context | positions |"));
    assert!(md.contains("flagged session(s)"));
    assert!(md.len() < 65_536, "fits a GitHub comment");
}

#[test]
fn json_parses_and_has_the_documented_keys() {
    let r = sample();
    let text = report(&r, Format::Json).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["schema"], REPORT_SCHEMA);
    for key in ["schema", "generator", "verdict", "run", "derived"] {
        assert!(v.get(key).is_some(), "missing top-level key {key}");
    }
    assert_eq!(v["verdict"], "flagged");
    for key in [
        "turns",
        "failed_turns",
        "flagged_turns",
        "sessions",
        "sessions_flagged",
        "first_divergent",
        "throughput_over_time",
    ] {
        assert!(v["derived"].get(key).is_some(), "missing derived.{key}");
    }
    let first = &v["derived"]["first_divergent"];
    assert!(first
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["session_id"] == "s01" && s["first_divergent_turn"] == 5));
    for key in ["source", "bin_s", "bins"] {
        assert!(
            v["derived"]["throughput_over_time"].get(key).is_some(),
            "{key}"
        );
    }
    // The embedded run round-trips into the replayer's type.
    let back: tapedeck_replayer::RunSummary = serde_json::from_value(v["run"].clone()).unwrap();
    // (Floats may differ in the last bit: serde_json parses without `float_roundtrip`.)
    assert_eq!(back.sessions.len(), r.sessions.len());
    assert_eq!(back.fidelity.flags, r.fidelity.flags);
    assert_eq!(back.speed.ttft.hdr, r.speed.ttft.hdr);
    // Every key SCHEMA.md documents with a backticked `derived.*` path exists.
    let schema = include_str!("../SCHEMA.md");
    for line in schema.lines().filter(|l| l.starts_with("| `derived.")) {
        let path = line.split('`').nth(1).unwrap();
        let mut cur = &v;
        for part in path.split('.') {
            let part = part.trim_end_matches("[]");
            cur = if cur.is_array() {
                &cur[0][part]
            } else {
                &cur[part]
            };
        }
        assert!(!cur.is_null(), "documented {path} missing");
    }
}

#[test]
fn text_is_aligned_and_complete() {
    let text = report(&sample(), Format::Text).unwrap();
    for s in [
        "== Speed",
        "TTFT",
        "ITL",
        "TPOT",
        "E2E",
        "p99.9",
        "goodput",
        "errors",
        "== Fidelity",
        "prompt divergences",
        "exact output match",
        "top-1 agreement",
        "KL mean / q99",
        "-- drift by context position",
        "== Sessions",
        "first divergent turn",
    ] {
        assert!(text.contains(s), "missing {s}:\n{text}");
    }
    // The latency table's numeric columns end at the same column.
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("TTFT ") || l.starts_with("E2E "))
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].len(), rows[1].len(), "{text}");
}
