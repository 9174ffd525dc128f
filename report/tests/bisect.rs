//! Delta debugging over toggle differences: planted culprits are found with few replays, an
//! interaction is found as a pair, and a failure that does not reproduce says so.

use std::cell::Cell;

use futures::executor::block_on;
use tapedeck_engine::Toggles;
use tapedeck_report::{bisect, BisectOutcome, Evidence};

/// Five toggle differences, one of them the encoding fault.
fn sets() -> (Toggles, Toggles) {
    let good = Toggles::default();
    let bad: Toggles = "matmul=bf16,attn_scores=bf16,kv_dtype=bf16,prefill_chunk=64,\
                        fault.encoding=drop_thinking_always,prefix_cache=off"
        .parse()
        .unwrap();
    (good, bad)
}

type Outcome = Result<(bool, Evidence), std::io::Error>;

#[test]
fn finds_a_planted_culprit_among_six_differences() {
    let (good, bad) = sets();
    assert_eq!(good.diff(&bad).len(), 6);
    let calls = Cell::new(0);
    let r = block_on(bisect(good, bad, |t: Toggles| {
        calls.set(calls.get() + 1);
        let culprit = t.get("fault.encoding").as_deref() == Some("drop_thinking_always");
        async move { Outcome::Ok((culprit, Evidence::note(format!("replayed {t}")))) }
    }))
    .unwrap();
    println!("{r}");
    assert_eq!(r.outcome, BisectOutcome::Found, "{r}");
    assert_eq!(r.culprit.len(), 1, "{r}");
    assert_eq!(r.culprit[0].name, "fault.encoding");
    assert_eq!(r.culprit[0].good, "off");
    assert_eq!(r.culprit[0].bad, "drop_thinking_always");
    assert_eq!(
        r.culprit_toggles.as_deref(),
        Some("fault.encoding=drop_thinking_always")
    );
    assert_eq!(r.replays, calls.get(), "every replay is counted once");
    // bad + good + about 2·log2(6) steps.
    assert!(r.replays <= 8, "{} replays:\n{r}", r.replays);
    assert!(
        r.to_string()
            .contains("culprit (1 of 6 changes): fault.encoding: off -> drop_thinking_always"),
        "{r}"
    );
    assert_eq!(r.exit_code(), 0);
}

#[test]
fn finds_an_interaction_as_the_pair() {
    let (good, bad) = sets();
    let calls = Cell::new(0);
    let mut seen = std::collections::HashSet::new();
    let r = block_on(bisect(good, bad, |t: Toggles| {
        calls.set(calls.get() + 1);
        assert!(
            seen.insert(t.to_string()),
            "configuration {t} replayed twice"
        );
        // Fails only when both reduced-precision KV and chunked prefill are on.
        let b = t.get("kv_dtype").as_deref() == Some("bf16")
            && t.get("prefill_chunk").as_deref() == Some("64");
        async move { Outcome::Ok((b, Evidence::default())) }
    }))
    .unwrap();
    println!("{r}");
    assert_eq!(r.outcome, BisectOutcome::Found, "{r}");
    let mut names: Vec<_> = r.culprit.iter().map(|c| c.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["kv_dtype", "prefill_chunk"], "{r}");
    assert!(r.replays <= 16, "{} replays:\n{r}", r.replays);
    assert!(r.to_string().contains("interaction"), "{r}");
}

#[test]
fn all_good_says_it_could_not_reproduce() {
    let (good, bad) = sets();
    let r = block_on(bisect(good, bad, |_t: Toggles| async {
        Outcome::Ok((false, Evidence::default()))
    }))
    .unwrap();
    assert_eq!(r.outcome, BisectOutcome::NotReproduced);
    assert!(r.culprit.is_empty());
    assert_eq!(r.replays, 1, "one replay of the bad set is enough to know");
    assert!(r.to_string().contains("could not reproduce"), "{r}");
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn good_that_also_fails_is_reported() {
    let (good, bad) = sets();
    let r = block_on(bisect(good, bad, |_t: Toggles| async {
        Outcome::Ok((true, Evidence::default()))
    }))
    .unwrap();
    assert_eq!(r.outcome, BisectOutcome::GoodAlsoFails);
    assert_eq!(r.replays, 2);
}

#[test]
fn identical_sets_need_no_replay() {
    let r = block_on(bisect(
        Toggles::default(),
        Toggles::default(),
        |_t: Toggles| async { Outcome::Ok((true, Evidence::default())) },
    ))
    .unwrap();
    assert_eq!(r.outcome, BisectOutcome::NoDifference);
    assert_eq!(r.replays, 0);
}

#[test]
fn replay_errors_abort_with_the_toggles() {
    let (good, bad) = sets();
    let err = block_on(bisect(good, bad, |_t: Toggles| async {
        Outcome::Err(std::io::Error::other("engine crashed"))
    }))
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("engine crashed") && msg.contains("fault.encoding"),
        "{msg}"
    );
}

#[test]
fn evidence_names_sessions_turns_and_buckets() {
    #[path = "common/mod.rs"]
    mod common;
    let mut specs = common::base_specs(3, 6, 21);
    specs[2].1[4].prompt_diverged = true;
    specs[2].1[5].probe = Some(false);
    let run = common::run("engine:x", "fault.encoding=drop_thinking_always", &specs);
    let (bad, ev) = Evidence::judge(&run);
    assert!(bad);
    assert_eq!(ev.sessions_flagged, 1);
    assert_eq!(ev.turns.len(), 1);
    let t = &ev.turns[0];
    assert_eq!((t.session_id.as_str(), t.turn), ("s02", 4));
    assert_eq!(t.flags, ["prompt_divergence"]);
    assert!(t.bucket.is_some() && t.position.is_some());
    assert_eq!(ev.flags.get("probe_failed"), Some(&1));
}
