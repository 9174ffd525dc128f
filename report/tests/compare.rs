//! Verdict logic of `compare` on hand-made runs: a real regression fails, run-to-run noise passes,
//! new fidelity flags fail, incomparable runs exit 2, and the JUnit/Markdown outputs are usable.

mod common;

use common::{base_specs, run, scaled};
use tapedeck_report::{compare, Policy, Verdict};

fn row<'a>(c: &'a tapedeck_report::Comparison, name: &str) -> &'a tapedeck_report::MetricRow {
    c.rows
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no row {name}: {}", c.to_text()))
}

#[test]
fn ttft_p99_regression_of_30_percent_fails() {
    let specs = base_specs(5, 10, 1); // 50 turns
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "", &scaled(&specs, 1.30, 1.0, 0.02, 2));
    let c = compare(&base, &cand, &Policy::default());
    println!("{}", c.to_text());
    let r = row(&c, "TTFT p99");
    assert_eq!(r.verdict, Verdict::Fail, "{}", c.to_text());
    let (lo, _) = r.ci.expect("ci");
    assert!(lo > 0.05, "lower bound {lo}");
    assert_eq!(c.exit_code(), 1);
    // ITL did not change: it passes.
    assert_eq!(row(&c, "ITL p99").verdict, Verdict::Pass, "{}", c.to_text());
}

#[test]
fn run_to_run_noise_of_3_percent_passes() {
    let specs = base_specs(5, 10, 3);
    // Both runs are noisy copies of the same "true" speeds.
    let base = run("engine:a", "", &scaled(&specs, 1.0, 1.0, 0.03, 10));
    for seed in 11..16 {
        let cand = run("engine:a", "", &scaled(&specs, 1.0, 1.0, 0.03, seed));
        let c = compare(&base, &cand, &Policy::default());
        assert_eq!(c.exit_code(), 0, "seed {seed}:\n{}", c.to_text());
        for r in c.rows.iter().filter(|r| r.rule.starts_with("latency.")) {
            assert_ne!(r.verdict, Verdict::Fail, "{}", c.to_text());
        }
    }
}

#[test]
fn small_regression_within_the_allowance_passes() {
    let specs = base_specs(5, 10, 4);
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "", &scaled(&specs, 1.02, 1.02, 0.01, 5));
    let c = compare(&base, &cand, &Policy::default());
    assert_eq!(c.exit_code(), 0, "{}", c.to_text());
}

#[test]
fn too_few_samples_is_no_data_not_failure() {
    let specs = base_specs(1, 5, 6);
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "", &scaled(&specs, 2.0, 2.0, 0.0, 7));
    let c = compare(&base, &cand, &Policy::default());
    assert_eq!(row(&c, "TTFT p99").verdict, Verdict::NoData);
    assert_eq!(c.exit_code(), 0, "{}", c.to_text());
}

#[test]
fn new_prompt_divergence_and_probe_failure_fail() {
    let specs = base_specs(3, 4, 8);
    let mut bad = specs.clone();
    bad[1].1[2].prompt_diverged = true;
    bad[2].1[3].probe = Some(false);
    let mut base_specs_probe = specs.clone();
    base_specs_probe[2].1[3].probe = Some(true);
    let base = run("engine:a", "", &base_specs_probe);
    let cand = run("engine:b", "fault.encoding=drop_thinking_always", &bad);
    let c = compare(&base, &cand, &Policy::default());
    let pd = row(&c, "prompt divergences");
    assert_eq!(pd.verdict, Verdict::Fail);
    assert!(pd.why.contains("s01#2"), "{}", pd.why);
    assert_eq!(row(&c, "failed probes").verdict, Verdict::Fail);
    assert_eq!(c.exit_code(), 1);
}

#[test]
fn divergence_already_in_baseline_is_not_new() {
    let mut specs = base_specs(2, 3, 9);
    specs[0].1[1].prompt_diverged = true;
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "", &specs);
    let c = compare(&base, &cand, &Policy::default());
    assert_eq!(row(&c, "prompt divergences").verdict, Verdict::Pass);
}

#[test]
fn output_mismatch_is_info_by_default_and_fails_when_disallowed() {
    let specs = base_specs(2, 3, 12);
    let mut cs = specs.clone();
    cs[0].1[0].exact = false;
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "", &cs);
    let c = compare(&base, &cand, &Policy::default());
    assert_eq!(row(&c, "output mismatches").verdict, Verdict::Info);
    let strict: Policy = "[fidelity]\nallow_new_output_mismatch = false\n"
        .parse()
        .unwrap();
    let c = compare(&base, &cand, &strict);
    assert_eq!(row(&c, "output mismatches").verdict, Verdict::Fail);
}

#[test]
fn drift_thresholds_overall_and_per_bucket() {
    let specs = base_specs(2, 6, 13);
    let mut cs = specs.clone();
    // A long session whose later turns cross 1k tokens of context and drift there.
    for (k, t) in cs[1].1.iter_mut().enumerate() {
        if k >= 3 {
            t.kl = 0.2;
            t.dlp = 0.3;
            t.top1 = false;
        }
    }
    let base = run("engine:a", "", &specs);
    let cand = run("engine:b", "kv_dtype=fp8-e4m3", &cs);
    let c = compare(&base, &cand, &Policy::default());
    let failing: Vec<_> = c
        .rows
        .iter()
        .filter(|r| r.verdict == Verdict::Fail)
        .map(|r| r.name.as_str())
        .collect();
    assert!(failing.contains(&"mean KL"), "{failing:?}");
    assert!(failing.contains(&"mean |Δlogprob|"), "{failing:?}");
    assert!(failing.contains(&"top-1 agreement"), "{failing:?}");
    assert!(
        failing
            .iter()
            .any(|n| n.starts_with("mean KL [") && !n.contains("0-1k")),
        "a long-context bucket must fail: {failing:?}\n{}",
        c.to_text()
    );
    // The clean baseline against itself passes every drift rule.
    let same = compare(&base, &base, &Policy::default());
    assert_eq!(same.exit_code(), 0, "{}", same.to_text());
}

#[test]
fn different_session_sets_cannot_be_compared() {
    let a = run("engine:a", "", &base_specs(3, 2, 14));
    let b = run("engine:a", "", &base_specs(2, 2, 14));
    let c = compare(&a, &b, &Policy::default());
    assert_eq!(c.exit_code(), 2);
    assert!(c.not_comparable.as_deref().unwrap().contains("session"));
}

#[test]
fn malformed_run_cannot_be_compared() {
    let a = run("engine:a", "", &base_specs(2, 2, 15));
    let mut b = a.clone();
    b.format = String::new();
    assert_eq!(compare(&a, &b, &Policy::default()).exit_code(), 2);
    // Same sessions, no turns in common.
    let mut e = a.clone();
    for s in &mut e.sessions {
        s.turns.clear();
    }
    let c = compare(&a, &e, &Policy::default());
    assert_eq!(c.exit_code(), 2);
    assert!(c.not_comparable.as_deref().unwrap().contains("no turn"));
}

#[test]
fn junit_is_well_formed_with_one_testcase_per_rule() {
    let specs = base_specs(5, 10, 16);
    let base = run("engine:a", "", &specs);
    let mut bad = scaled(&specs, 1.5, 1.0, 0.01, 17);
    bad[0].1[0].prompt_diverged = true;
    let cand = run("engine:b <&>", "", &bad);
    let c = compare(&base, &cand, &Policy::default());
    let xml = c.to_junit();
    let mut reader = quick_xml::Reader::from_str(&xml);
    let (mut cases, mut failures, mut depth) = (Vec::new(), 0, 0i32);
    loop {
        match reader.read_event() {
            Ok(quick_xml::events::Event::Start(e)) | Ok(quick_xml::events::Event::Empty(e))
                if e.name().as_ref() == b"testcase" =>
            {
                let name = e
                    .try_get_attribute("name")
                    .unwrap()
                    .unwrap()
                    .unescape_value()
                    .unwrap()
                    .to_string();
                cases.push(name);
                depth += 1;
            }
            Ok(quick_xml::events::Event::Start(e)) if e.name().as_ref() == b"failure" => {
                failures += 1
            }
            Ok(quick_xml::events::Event::Eof) => break,
            Ok(_) => {}
            Err(e) => panic!(
                "malformed JUnit at {}: {e}\n{xml}",
                reader.buffer_position()
            ),
        }
    }
    assert!(depth > 0);
    // Every rule once, per-bucket rows folded into one case.
    let mut dedup = cases.clone();
    dedup.dedup();
    assert_eq!(dedup.len(), cases.len(), "{cases:?}");
    for rule in [
        "ttft_p99_max_regression",
        "e2e_p50_max_regression",
        "max_mean_kl_per_bucket",
        "allow_new_prompt_divergence",
        "min_top1_agreement",
    ] {
        assert!(cases.iter().any(|c| c == rule), "{rule} missing: {cases:?}");
    }
    assert!(failures >= 2, "{xml}");
    // Incomparable runs: one error case, still well-formed.
    let mut other = base.clone();
    other.sessions.pop();
    let xml = compare(&base, &other, &Policy::default()).to_junit();
    assert!(xml.contains("<error"));
    let mut r = quick_xml::Reader::from_str(&xml);
    while !matches!(
        r.read_event().expect("well-formed"),
        quick_xml::events::Event::Eof
    ) {}
}

#[test]
fn markdown_and_text_show_the_verdict_table() {
    let specs = base_specs(5, 10, 18);
    let base = run("engine:a", "", &specs);
    let cand = run(
        "engine:b",
        "matmul=bf16",
        &scaled(&specs, 1.3, 1.0, 0.01, 19),
    );
    let c = compare(&base, &cand, &Policy::default());
    let md = c.to_markdown();
    assert!(
        md.contains("| metric | base | cand | Δ | Δ% | verdict | why |"),
        "{md}"
    );
    assert!(md.contains("FAIL"));
    assert!(md.contains("matmul=bf16"));
    let text = c.to_text();
    assert!(
        text.contains("TTFT p99") && text.contains("paired bootstrap"),
        "{text}"
    );
}
