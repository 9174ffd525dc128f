//! The CPU reference against Hugging Face transformers (PyTorch, f32) on the same weights and
//! token IDs: max |Δ logprob| ≤ 1e-4 at every position. The golden files are made by
//! `fixtures/golden/make_golden.py`; see its header for how.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tapedeck_engine::{Engine, Toggles};

#[derive(Deserialize)]
struct Golden {
    model: String,
    transformers: String,
    sequences: Vec<Sequence>,
}

#[derive(Deserialize)]
struct Sequence {
    name: String,
    tokens: Vec<u32>,
    logprobs: Vec<f64>,
    top: Vec<Vec<(u32, f64)>>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn check(model: &str) {
    let path = root().join("golden").join(format!("{model}.json"));
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap();
    assert_eq!(golden.model, model);
    let engine = Engine::load(&root().join("models").join(model)).unwrap();
    for seq in &golden.sequences {
        let scores = engine
            .score(&seq.tokens, 1, 8, &Toggles::default())
            .unwrap();
        assert_eq!(scores.len(), seq.logprobs.len());
        let mut worst = (0.0f64, 0usize);
        for (i, (s, g)) in scores.iter().zip(&seq.logprobs).enumerate() {
            let d = (s.logprob as f64 - g).abs();
            if d > worst.0 {
                worst = (d, i);
            }
        }
        println!(
            "{model}/{}: {} positions, max |Δ logprob| {:.2e} at {} (transformers {})",
            seq.name,
            scores.len(),
            worst.0,
            worst.1,
            golden.transformers
        );
        assert!(
            worst.0 <= 1e-4,
            "{model}/{}: |Δ logprob| {:.3e} at position {}",
            seq.name,
            worst.0,
            worst.1
        );
        for (i, (s, g)) in scores.iter().zip(&seq.top).enumerate() {
            // Near-ties may swap IDs in the ranking; the k-th log-probability must still agree.
            for ((_, lp), (_, glp)) in s.top.iter().zip(g) {
                assert!(
                    (glp - *lp as f64).abs() <= 1e-4,
                    "{model}/{} top at {i}",
                    seq.name
                );
            }
        }
    }
}

#[test]
fn tiny_llama_matches_transformers() {
    check("tiny-llama");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check("tiny-qwen2");
}
