//! The CPU reference model on the committed fixtures: KV-cache consistency, batch and thread
//! invariance, what each toggle does to the logits, and load errors.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use tapedeck_engine::config::Config;
use tapedeck_engine::engine::{EngineOptions, ScoreMode};
use tapedeck_engine::model::{BlockTable, KvCache, KvPool, Logits, Segment, WantLogits};
use tapedeck_engine::{Engine, Error, GenerateRequest, SamplingParams, StopCriteria, Toggles};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

fn engine(name: &str, threads: usize) -> Engine {
    Engine::load_with(
        &fixture(name),
        &EngineOptions {
            threads: Some(threads),
            ..Default::default()
        },
    )
    .expect("fixture loads")
}

fn random_tokens(engine: &Engine, n: usize, rng: &mut impl Rng) -> Vec<u32> {
    let v = engine.tokenizer().vocab_size() as u32;
    (0..n).map(|_| rng.random_range(0..v)).collect()
}

fn rng() -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(rand::random())
}

/// Full logits of the last position after `tokens`.
fn last_logits(e: &Engine, tokens: &[u32], toggles: &Toggles) -> Vec<f32> {
    let mut cache = KvCache::new(e.config(), toggles.kv_dtype);
    let (pool, seg) = cache.segment(tokens, false, WantLogits::Last).unwrap();
    e.backend()
        .forward(pool, &mut [seg], toggles)
        .unwrap()
        .remove(0)
        .into_rows()
        .unwrap()
}

#[test]
fn decode_steps_match_one_prefill() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let e = engine(name, 2);
        let toks = random_tokens(&e, 96, &mut rng());
        let t = Toggles::default();
        let a = e.score_with(&toks, 40, 8, &t, ScoreMode::Prefill).unwrap();
        let b = e.score_with(&toks, 40, 8, &t, ScoreMode::Decode).unwrap();
        assert_eq!(a.len(), 56);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let d = (x.logprob - y.logprob).abs();
            assert!(d <= 1e-5 * x.logprob.abs().max(1.0), "{name} pos {i}: {d}");
            assert_eq!(x.top[0].0, y.top[0].0, "{name} pos {i}");
        }
    }
}

#[test]
fn batch_composition_and_threads_change_nothing() {
    let e1 = engine("tiny-qwen2", 1);
    let e2 = engine("tiny-qwen2", 2);
    let mut r = rng();
    let seqs: Vec<Vec<u32>> = (0..4)
        .map(|i| random_tokens(&e1, 10 + 17 * i, &mut r))
        .collect();
    let t = Toggles::default();
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| last_logits(&e1, s, &t)).collect();
    // One shared pool; each sequence gets its own blocks, interleaved to shake out indexing bugs.
    let bs = 16;
    let need: Vec<usize> = seqs.iter().map(|s| s.len().div_ceil(bs)).collect();
    let total: usize = need.iter().sum();
    let mut pool = KvPool::new(e2.config(), bs, total, t.kv_dtype);
    let mut tables: Vec<BlockTable> = seqs.iter().map(|_| BlockTable::default()).collect();
    let mut next = 0u32;
    for round in 0..*need.iter().max().unwrap() {
        for (i, t) in tables.iter_mut().enumerate() {
            if round < need[i] {
                t.blocks.push(next);
                next += 1;
            }
        }
    }
    let mut segs: Vec<Segment> = seqs
        .iter()
        .zip(tables.iter_mut())
        .map(|(s, table)| Segment {
            tokens: s,
            table,
            decode: false,
            want: WantLogits::Last,
            fault_chunk_boundary: false,
        })
        .collect();
    let batched = e2.backend().forward(&mut pool, &mut segs, &t).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(
            &Logits::Rows(a.clone()),
            b,
            "batched result differs from the sequence alone"
        );
    }
}

/// Relative L2 change of the last-position logits under `toggles` against the reference.
fn logit_change(e: &Engine, tokens: &[u32], toggles: &str) -> f64 {
    let t: Toggles = toggles.parse().unwrap();
    let base = last_logits(e, tokens, &Toggles::default());
    let moved = last_logits(e, tokens, &t);
    let num: f64 = base
        .iter()
        .zip(&moved)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = base.iter().map(|a| (*a as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn toggles_move_logits_by_the_expected_order() {
    let e = engine("tiny-llama", 2);
    let toks = random_tokens(&e, 300, &mut rng());
    let off = logit_change(&e, &toks, "");
    assert_eq!(
        off, 0.0,
        "default toggles must be bit-identical to the reference"
    );
    for (toggle, lo, hi) in [
        // Every linear layer rounds its inputs: 1.4e-2 – 3.3e-2 over 25 random draws (ninth
        // session), so the bound leaves room; garbage would move the logits by ~1.
        ("matmul=bf16", 1e-4, 1e-1),
        ("attn_scores=bf16", 1e-5, 3e-2),
        ("kv_dtype=bf16", 1e-5, 3e-2),
        // FP8 keeps 3 mantissa bits: random tokens on a random model move the logits by 0.05–0.3
        // (0.26 seen once), garbage KV would move them by ~1.
        ("kv_dtype=fp8-e4m3", 1e-3, 5e-1),
    ] {
        let c = logit_change(&e, &toks, toggle);
        assert!(
            c >= lo && c <= hi,
            "{toggle}: relative logit change {c:e} not in [{lo:e}, {hi:e}]"
        );
    }
}

#[test]
fn decode_topk_changes_only_decode_steps_beyond_n() {
    let e = engine("tiny-llama", 2);
    let toks = random_tokens(&e, 200, &mut rng());
    let sparse: Toggles = "decode_topk=16".parse().unwrap();
    let dense = Toggles::default();
    // Prefill ignores the decode indexer.
    let a = e
        .score_with(&toks, 100, 8, &dense, ScoreMode::Prefill)
        .unwrap();
    let b = e
        .score_with(&toks, 100, 8, &sparse, ScoreMode::Prefill)
        .unwrap();
    assert_eq!(a, b);
    // Decode steps attend to 16 of 100+ tokens: visibly different.
    let c = e
        .score_with(&toks, 100, 8, &sparse, ScoreMode::Decode)
        .unwrap();
    let max_d = a
        .iter()
        .zip(&c)
        .map(|(x, y)| (x.logprob - y.logprob).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_d > 1e-3,
        "decode_topk=16 changed logprobs by only {max_d}"
    );
    // With N above the context, sparse decode is dense decode.
    let wide: Toggles = "decode_topk=4096".parse().unwrap();
    let d = e
        .score_with(&toks, 100, 8, &wide, ScoreMode::Decode)
        .unwrap();
    let dd = e
        .score_with(&toks, 100, 8, &dense, ScoreMode::Decode)
        .unwrap();
    assert_eq!(d, dd);
}

#[test]
fn same_seed_same_tokens() {
    let e = engine("tiny-qwen2", 2);
    let prompt = random_tokens(&e, 20, &mut rng());
    let req = GenerateRequest {
        prompt,
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(7),
            ..Default::default()
        },
        stop: StopCriteria {
            max_tokens: 24,
            ignore_eos: true,
            ..Default::default()
        },
        top_k_summary: 4,
        toggles: Toggles::default(),
    };
    let a = e.generate(&req, &mut |_| true).unwrap();
    let b = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.tokens.len(), 24);
    assert_eq!(a.summaries.len(), 24);
    // Each summary's logprob is that of the token chosen, and the teacher-forced score agrees.
    let mut full = req.prompt.clone();
    full.extend(&a.tokens);
    let scored = e
        .score_with(&full, req.prompt.len(), 4, &req.toggles, ScoreMode::Decode)
        .unwrap();
    for (s, g) in scored.iter().zip(&a.summaries) {
        assert_eq!(s.logprob, g.logprob);
    }
}

#[test]
fn cancel_stops_generation() {
    let e = engine("tiny-qwen2", 2);
    let req = GenerateRequest {
        prompt: random_tokens(&e, 8, &mut rng()),
        sampling: SamplingParams::default(),
        stop: StopCriteria {
            max_tokens: 50,
            ignore_eos: true,
            ..Default::default()
        },
        top_k_summary: 2,
        toggles: Toggles::default(),
    };
    let mut n = 0;
    let out = e
        .generate(&req, &mut |_| {
            n += 1;
            n < 3
        })
        .unwrap();
    assert_eq!(out.tokens.len(), 3);
    assert_eq!(out.finish_reason, tapedeck_engine::FinishReason::Cancelled);
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    dir
}

#[test]
fn load_errors_name_what_is_wrong() {
    // Missing weights file.
    let d = copy_fixture("tiny-llama");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let e = Engine::load(d.path()).err().expect("must fail").to_string();
    assert!(e.contains("model.safetensors"), "{e}");

    // Config that disagrees with the tensors: the error names the tensor and both shapes.
    let d = copy_fixture("tiny-llama");
    let cfg_path = d.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(100);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    match Engine::load(d.path()) {
        Err(Error::ShapeMismatch {
            name,
            expected,
            found,
            ..
        }) => {
            assert!(name.contains("mlp"), "{name}");
            assert_ne!(expected, found);
        }
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("loaded a model whose config disagrees with its weights"),
    }

    // Unsupported architecture.
    cfg["architectures"] = serde_json::json!(["BertModel"]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = Config::from_dir(d.path()).unwrap_err().to_string();
    assert!(e.contains("BertModel"), "{e}");
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let e = engine("tiny-qwen2", 1);
    let t = Toggles::default();
    assert!(e.score(&[1, 2, 3], 0, 4, &t).is_err());
    let too_big = e.config().vocab_size as u32 + 5;
    assert!(e.score(&[1, too_big, 3], 1, 4, &t).is_err());
    let req = GenerateRequest {
        prompt: vec![],
        sampling: SamplingParams::default(),
        stop: StopCriteria::default(),
        top_k_summary: 2,
        toggles: t,
    };
    assert!(e.generate(&req, &mut |_| true).is_err());
    let long = vec![1u32; e.context_len() + 1];
    assert!(matches!(
        e.score(&long, 1, 4, &t),
        Err(Error::ContextOverflow { .. })
    ));
}

#[test]
fn sharded_checkpoint_loads_the_same_model() {
    use safetensors::tensor::TensorView;
    let d = copy_fixture("tiny-qwen2");
    let bytes = std::fs::read(d.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [first, second].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, TensorView)> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &d.path().join(&file)).unwrap();
        for n in part.iter() {
            weight_map.insert(n.clone(), serde_json::json!(file));
        }
    }
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    let sharded = Engine::load(d.path()).unwrap();
    let whole = engine("tiny-qwen2", 2);
    let toks = random_tokens(&whole, 50, &mut rng());
    let t = Toggles::default();
    assert_eq!(
        last_logits(&sharded, &toks, &t),
        last_logits(&whole, &toks, &t)
    );

    // A shard named by the index but missing is an error naming it.
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = Engine::load(d.path()).err().expect("must fail").to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn mistral_config_loads_with_its_defaults() {
    let d = copy_fixture("tiny-llama");
    let cfg_path = d.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    cfg["model_type"] = serde_json::json!("mistral");
    cfg["sliding_window"] = serde_json::json!(4096);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = Engine::load(d.path()).unwrap();
    assert_eq!(e.config().arch, tapedeck_engine::config::Arch::Mistral);
    // Sliding-window attention is not applied, so the usable context stops at the window.
    assert_eq!(e.context_len(), 4096);
}
