//! The policy parser: the example file parses, mistakes give errors that name the key and line.

use tapedeck_report::{Error, Policy};

#[test]
fn ci_example_policy_parses_and_matches_the_defaults() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/policy.toml");
    let p = Policy::from_file(&path).expect("ci/policy.toml");
    assert_eq!(
        p,
        Policy::default(),
        "ci/policy.toml documents the defaults"
    );
}

#[test]
fn empty_policy_is_the_default() {
    let p: Policy = "".parse().unwrap();
    assert_eq!(p, Policy::default());
    assert_eq!(p.latency.ttft_p99_max_regression, 0.05);
    assert!(p.latency.ttft_p50_max_regression.is_infinite());
    assert_eq!(p.fidelity.min_top1_agreement, 0.98);
}

#[test]
fn values_are_read_and_inf_disables() {
    let p: Policy = "[latency]\nttft_p99_max_regression = 0.2\ne2e_p50_max_regression = inf\n\
                     min_samples = 5\n[fidelity]\nmax_mean_kl = 0.5\nallow_new_probe_failures = true\n"
        .parse()
        .unwrap();
    assert_eq!(p.latency.ttft_p99_max_regression, 0.2);
    assert!(p.latency.e2e_p50_max_regression.is_infinite());
    assert_eq!(p.latency.min_samples, 5);
    assert_eq!(p.fidelity.max_mean_kl, 0.5);
    assert!(p.fidelity.allow_new_probe_failures);
}

fn policy_err(text: &str) -> (usize, String, String) {
    match Policy::from_toml(text, "p.toml") {
        Err(e @ Error::Policy { .. }) => {
            let shown = e.to_string();
            println!("{shown}");
            let Error::Policy { line, key, .. } = e else {
                unreachable!()
            };
            (line, key, shown)
        }
        other => panic!("expected a policy error, got {other:?}"),
    }
}

#[test]
fn unknown_key_is_named_with_its_line() {
    let (line, key, shown) =
        policy_err("[latency]\nmin_samples = 20\nttft_p99_max_regresion = 0.05\n");
    assert_eq!(line, 3, "{shown}");
    assert_eq!(key, "latency.ttft_p99_max_regresion", "{shown}");
    assert!(shown.starts_with("p.toml:3:"), "{shown}");
    assert!(
        shown.contains("ttft_p99_max_regression"),
        "lists the expected keys: {shown}"
    );
}

#[test]
fn unknown_table_is_an_error() {
    let (_, key, shown) = policy_err("[latncy]\nmin_samples = 20\n");
    assert!(key.contains("latncy"), "{shown}");
}

#[test]
fn wrong_type_is_named_with_its_line() {
    let (line, key, shown) =
        policy_err("[fidelity]\nmax_mean_kl = 0.01\nallow_new_prompt_divergence = \"no\"\n");
    assert_eq!(line, 3, "{shown}");
    assert_eq!(key, "fidelity.allow_new_prompt_divergence", "{shown}");
    assert!(
        shown.contains("bool") || shown.contains("boolean"),
        "{shown}"
    );
}

#[test]
fn out_of_range_is_named_with_its_line() {
    let (line, key, shown) = policy_err("[latency]\n\nconfidence = 1.5\n");
    assert_eq!((line, key.as_str()), (3, "latency.confidence"), "{shown}");
    let (_, key, _) = policy_err("[fidelity]\nmin_top1_agreement = 2\n");
    assert_eq!(key, "fidelity.min_top1_agreement");
    let (_, key, _) = policy_err("[latency]\nitl_p99_max_regression = -0.1\n");
    assert_eq!(key, "latency.itl_p99_max_regression");
}

#[test]
fn invalid_toml_is_an_error_with_a_line() {
    let (line, _, shown) = policy_err("[latency]\nconfidence = \n");
    assert_eq!(line, 2, "{shown}");
}
