//! Invariance of the serving scheduler: a sequence's tokens and log-probabilities do not depend on
//! prefill chunking, the prefix cache (on, off, hit, miss), what it is batched with, or the thread
//! count. And each fault toggle breaks one of these properties, visibly.
//!
//! Tolerance: ≤ 1e-5 relative on every logprob (the bound). The CPU reference is built to
//! be batch-invariant, so in practice the results are bit-identical.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::scheduler::{EngineHandle, Event, SchedulerConfig};
use tapedeck_engine::toggles::KvDtype;
use tapedeck_engine::{
    Engine, GenerateOutput, GenerateRequest, SamplingParams, StopCriteria, Toggles,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

fn engine(threads: usize) -> Arc<Engine> {
    Arc::new(
        Engine::load_with(
            &fixture("tiny-qwen2"),
            &EngineOptions {
                threads: Some(threads),
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn rng() -> rand_chacha::ChaCha8Rng {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

fn prompt(e: &Engine, n: usize, r: &mut impl Rng) -> Vec<u32> {
    let v = e.tokenizer().vocab_size() as u32;
    (0..n).map(|_| r.random_range(0..v)).collect()
}

fn request(prompt: Vec<u32>, toggles: &str) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling: SamplingParams::default(),
        stop: StopCriteria {
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
        top_k_summary: 4,
        toggles: toggles.parse().unwrap(),
    }
}

fn handle(e: Arc<Engine>) -> EngineHandle {
    EngineHandle::start(
        e,
        SchedulerConfig {
            kv_budget_bytes: 64 << 20,
            max_batch_tokens: 256,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Collects a stream to its final output.
fn collect(mut s: tapedeck_engine::scheduler::RequestStream) -> GenerateOutput {
    loop {
        match s.blocking_next() {
            Some(Event::Token(_)) => {}
            Some(Event::Done(o)) => return o,
            Some(Event::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without output"),
        }
    }
}

/// Whether two runs agree: same tokens, logprobs within 1e-5 relative.
fn same(a: &GenerateOutput, b: &GenerateOutput) -> Result<(), String> {
    if a.tokens != b.tokens {
        return Err(format!("tokens differ: {:?} vs {:?}", a.tokens, b.tokens));
    }
    for (i, (x, y)) in a.summaries.iter().zip(&b.summaries).enumerate() {
        let d = (x.logprob - y.logprob).abs();
        if d > 1e-5 * x.logprob.abs().max(1.0) {
            return Err(format!(
                "logprob {i}: {} vs {} (|Δ| {d:e})",
                x.logprob, y.logprob
            ));
        }
        for ((_, p), (_, q)) in x.top.iter().zip(&y.top) {
            if (p - q).abs() > 1e-5 * p.abs().max(1.0) {
                return Err(format!("top logprob at {i}: {p} vs {q}"));
            }
        }
    }
    Ok(())
}

fn reference(e: &Engine, req: &GenerateRequest) -> GenerateOutput {
    let mut r = req.clone();
    r.toggles = Toggles::default();
    r.toggles.prefix_cache = false;
    e.generate(&r, &mut |_| true).unwrap()
}

#[test]
fn chunk_size_changes_nothing() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    for _ in 0..3 {
        let n = r.random_range(20..150);
        let p = prompt(&e, n, &mut r);
        let want = reference(&e, &request(p.clone(), ""));
        for chunk in ["1", "7", "64", "off"] {
            let req = request(
                p.clone(),
                &format!("prefill_chunk={chunk},prefix_cache=off"),
            );
            let got = collect(h.submit(req).unwrap());
            same(&want, &got).unwrap_or_else(|m| panic!("prefill_chunk={chunk}, {n} tokens: {m}"));
        }
    }
}

#[test]
fn prefix_cache_hit_and_miss_change_nothing() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    let p = prompt(&e, r.random_range(70..140), &mut r);
    let want = reference(&e, &request(p.clone(), ""));
    let first = collect(h.submit(request(p.clone(), "prefix_cache=on")).unwrap());
    let hits_before = h.stats().prefix_hit_tokens.load(Ordering::Relaxed);
    let second = collect(h.submit(request(p.clone(), "prefix_cache=on")).unwrap());
    let hits_after = h.stats().prefix_hit_tokens.load(Ordering::Relaxed);
    assert!(
        hits_after - hits_before >= 64,
        "second request must hit the cache"
    );
    same(&want, &first).unwrap();
    same(&want, &second).unwrap();
    // A multi-turn continuation: the old prompt plus the answer plus new tokens hits the cache
    // for the shared prefix, and still equals a cold run.
    let mut longer = p.clone();
    longer.extend(&second.tokens);
    longer.extend(prompt(&e, 30, &mut r));
    let want2 = reference(&e, &request(longer.clone(), ""));
    let got2 = collect(
        h.submit(request(longer, "prefix_cache=on,prefill_chunk=7"))
            .unwrap(),
    );
    same(&want2, &got2).unwrap();
}

#[test]
fn batching_with_other_sequences_changes_nothing() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    for _ in 0..2 {
        let p = prompt(&e, r.random_range(10..90), &mut r);
        let want = reference(&e, &request(p.clone(), ""));
        let others = r.random_range(1..=15);
        let mut streams = Vec::new();
        for _ in 0..others {
            let q = prompt(&e, r.random_range(5..80), &mut r);
            streams.push(h.submit(request(q, "prefill_chunk=16")).unwrap());
        }
        let mine = h.submit(request(p, "prefill_chunk=16")).unwrap();
        for s in streams {
            collect(s);
        }
        let got = collect(mine);
        same(&want, &got).unwrap_or_else(|m| panic!("batched with {others}: {m}"));
    }
}

#[test]
fn thread_count_changes_nothing() {
    let e1 = engine(1);
    let e2 = engine(2);
    let mut r = rng();
    let p = prompt(&e1, 120, &mut r);
    let a = reference(&e1, &request(p.clone(), ""));
    let b = reference(&e2, &request(p, ""));
    same(&a, &b).unwrap();
}

#[test]
fn fault_prefix_cache_stale_is_caught() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    let p1 = prompt(&e, 100, &mut r);
    // p2 differs from p1 only in the last token of the first block: an exact lookup misses,
    // the stale lookup reuses p1's blocks.
    let mut p2 = p1.clone();
    p2[15] = (p1[15] + 1) % e.tokenizer().vocab_size() as u32;
    let want = reference(&e, &request(p2.clone(), ""));
    let t = "fault.prefix_cache=stale";
    collect(h.submit(request(p1.clone(), t)).unwrap());
    let got = collect(h.submit(request(p2.clone(), t)).unwrap());
    assert!(
        same(&want, &got).is_err(),
        "a stale prefix hit must change the output"
    );
    // Without the fault the same sequence of requests is exact.
    collect(h.submit(request(p1, "")).unwrap());
    let clean = collect(h.submit(request(p2, "")).unwrap());
    same(&want, &clean).unwrap();
}

#[test]
fn fault_chunk_boundary_is_caught() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    let p = prompt(&e, 90, &mut r);
    let want = reference(&e, &request(p.clone(), ""));
    let got = collect(
        h.submit(request(
            p.clone(),
            "prefill_chunk=7,fault.chunk=boundary,prefix_cache=off",
        ))
        .unwrap(),
    );
    assert!(
        same(&want, &got).is_err(),
        "an off-by-one mask at chunk boundaries must be caught"
    );
    // Unchunked, the fault has no boundary to act on.
    let whole = collect(
        h.submit(request(p, "fault.chunk=boundary,prefix_cache=off"))
            .unwrap(),
    );
    same(&want, &whole).unwrap();
}

#[test]
fn dropping_the_stream_frees_blocks_and_oversized_requests_are_refused() {
    let e = engine(2);
    let h = EngineHandle::start(
        e.clone(),
        SchedulerConfig {
            kv_budget_bytes: 8 << 20,
            max_waiting: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let mut r = rng();
    let mut req = request(prompt(&e, 40, &mut r), "prefix_cache=off");
    req.stop.max_tokens = 500;
    let mut s = h.submit(req).unwrap();
    // Wait for the first token, then hang up.
    loop {
        if let Some(Event::Token(_)) = s.blocking_next() {
            break;
        }
    }
    drop(s);
    let mut waited = 0;
    while h.stats().kv_blocks_used.load(Ordering::Relaxed) > 0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 1;
        assert!(waited < 500, "blocks of a cancelled request were not freed");
    }
    // A request that can never fit the KV budget is refused with a clear error.
    let mut huge = request(prompt(&e, 40, &mut r), "");
    huge.stop.max_tokens = 100_000;
    match h.submit(huge).unwrap().blocking_next() {
        Some(Event::Error(m)) => assert!(m.contains("KV"), "{m}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn scheduler_scoring_equals_engine_decode_scoring() {
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    let prompt_ids = prompt(&e, 70, &mut r);
    let output = prompt(&e, 12, &mut r);
    for toggles in ["", "decode_topk=16,prefill_chunk=7"] {
        let t: Toggles = toggles.parse().unwrap();
        let mut all = prompt_ids.clone();
        all.extend(&output);
        let want = e
            .score_with(
                &all,
                prompt_ids.len(),
                4,
                &t,
                tapedeck_engine::engine::ScoreMode::Decode,
            )
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // Twice: the second hits the prefix cache and must not change a bit.
        for _ in 0..2 {
            let got = rt
                .block_on(h.score(prompt_ids.clone(), output.clone(), 4, t))
                .unwrap();
            assert_eq!(got, want, "toggles {toggles:?}");
        }
    }
}

#[test]
fn decode_only_kernels_do_not_leak_decode_kv_into_later_prompts() {
    // Regression: KV written by decode steps was shared through the prefix cache whenever the
    // sparse indexer was off, but the bf16 decode kernel (attn_decode=mma-bf16) also makes decode
    // numerics differ from prefill's. The next turn of a conversation, whose prompt holds the
    // previous answer, then reused decode-computed KV where a cold run prefills it: a cache hit
    // changed the numbers.
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    // attn_prefill=mma-bf16 is the same hazard from the other side: prompt rows round to bf16,
    // decode rows do not.
    for toggles in [
        "attn_decode=mma-bf16",
        "decode_topk=8",
        "attn_prefill=mma-bf16",
    ] {
        let p = prompt(&e, 64, &mut r);
        let mut first = request(p.clone(), toggles);
        first.stop.max_tokens = 20;
        let answer = collect(h.submit(first).unwrap());
        let mut next = p.clone();
        next.extend(&answer.tokens);
        next.extend(prompt(&e, 5, &mut r));
        let warm = collect(h.submit(request(next.clone(), toggles)).unwrap());
        let cold = collect(
            h.submit(request(next, &format!("{toggles},prefix_cache=off")))
                .unwrap(),
        );
        same(&cold, &warm).unwrap_or_else(|m| panic!("{toggles}: warm turn differs: {m}"));
    }
}

/// Outputs equal bit for bit: same tokens, same logprob bits everywhere.
fn identical(a: &GenerateOutput, b: &GenerateOutput) -> Result<(), String> {
    if a.tokens != b.tokens {
        return Err(format!("tokens differ: {:?} vs {:?}", a.tokens, b.tokens));
    }
    for (i, (x, y)) in a.summaries.iter().zip(&b.summaries).enumerate() {
        let bits = |s: &tapedeck_engine::LogitsSummary| {
            std::iter::once(s.logprob.to_bits())
                .chain(s.top.iter().map(|(_, p)| p.to_bits()))
                .collect::<Vec<_>>()
        };
        if bits(x) != bits(y) {
            return Err(format!("summary {i}: {x:?} vs {y:?}"));
        }
    }
    Ok(())
}

#[test]
fn packed_kv_pools_change_capacity_not_numbers() {
    let e = engine(2);
    let budget = 16 << 20;
    let start = |kv_dtype| {
        EngineHandle::start(
            e.clone(),
            SchedulerConfig {
                kv_budget_bytes: budget,
                max_batch_tokens: 96,
                kv_dtype,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let blocks = |h: &EngineHandle| {
        let s = h.stats();
        let bytes = s.kv_pool_bytes.load(Ordering::Relaxed);
        assert!(bytes <= budget, "{bytes} bytes over a {budget}-byte budget");
        s.kv_blocks_total.load(Ordering::Relaxed)
    };
    let f32_pool = start(KvDtype::F32);
    let f32_blocks = blocks(&f32_pool);
    let hd = e.config().head_dim;
    let mut r = rng();
    for (dtype, name) in [(KvDtype::Bf16, "bf16"), (KvDtype::Fp8E4m3, "fp8-e4m3")] {
        let packed = start(dtype);
        // Capacity: bf16 halves a value's bytes, FP8 takes one byte plus a 4-byte scale per head.
        let per_head = match dtype {
            KvDtype::Bf16 => 2 * hd,
            _ => hd + 4,
        };
        let want = f32_blocks * 4 * hd / per_head;
        let got = blocks(&packed);
        assert!(
            got.abs_diff(want) <= 4 * hd / per_head,
            "{name}: {got} blocks, want ~{want}"
        );
        // Numbers: a packed pool reads back what an f32 pool holding the rounded values reads,
        // through chunked prefill, prefix-cache hits, decode-only kernels and concurrent batches.
        let shared = prompt(&e, 70, &mut r);
        let toggle_sets = [
            format!("kv_dtype={name},prefill_chunk=16"),
            format!("kv_dtype={name},attn_decode=mma-bf16,attn_scores=bf16"),
            format!("kv_dtype={name},decode_topk=24,prefill_chunk=32"),
        ];
        for toggles in &toggle_sets {
            let reqs: Vec<GenerateRequest> = (0..3)
                .map(|i| {
                    let mut p = shared.clone();
                    p.extend(prompt(&e, 10 + 17 * i, &mut r));
                    let mut req = request(p, toggles);
                    req.stop.max_tokens = 12;
                    req
                })
                .collect();
            let run = |h: &EngineHandle| -> Vec<GenerateOutput> {
                let streams: Vec<_> = reqs.iter().map(|q| h.submit(q.clone()).unwrap()).collect();
                streams.into_iter().map(collect).collect()
            };
            let (a, b) = (run(&f32_pool), run(&packed));
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                identical(x, y).unwrap_or_else(|m| panic!("{toggles}, request {i}: {m}"));
                // The single-sequence engine packs its private cache the same way.
                let alone = e.generate(&reqs[i], &mut |_| true).unwrap();
                identical(x, &alone).unwrap_or_else(|m| panic!("{toggles}, alone {i}: {m}"));
            }
        }
        // A request with another kv_dtype is refused with the reason, not run on the wrong store.
        let err = match packed.submit(request(shared.clone(), "kv_dtype=f32")) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a {name} pool accepted a kv_dtype=f32 request"),
        };
        assert!(err.contains(&format!("stores {name}")), "{err}");
    }
}

/// `generate` running its decode steps ahead (each step submitted before the token of the one
/// in flight is read back, and fed that token by the backend) gives the tokens, summaries, text
/// and finish reason of stepping one at a time, however generation ends: at `max_tokens`
/// (where nothing runs ahead past the last token), at a stop token or a cancel mid-way (where
/// the step ahead is discarded), or at a full context.
#[test]
fn running_ahead_changes_nothing() {
    let load = |ahead: bool| {
        let mut e = Engine::load_with(
            &fixture("tiny-qwen2"),
            &EngineOptions {
                threads: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        e.set_run_ahead(ahead);
        e
    };
    let (plain, ahead) = (load(false), load(true));
    let check = |req: &GenerateRequest, cancel_after: usize, what: &str| {
        let run = |e: &Engine| {
            let mut seen = 0;
            e.generate(req, &mut |_| {
                seen += 1;
                seen < cancel_after
            })
            .unwrap()
        };
        let (want, got) = (run(&plain), run(&ahead));
        identical(&want, &got).unwrap_or_else(|m| panic!("{what}: {m}"));
        assert_eq!(want.text, got.text, "{what}");
        assert_eq!(want.finish_reason, got.finish_reason, "{what}");
        want
    };
    let mut r = rng();
    for max_tokens in [1, 2, 9] {
        let n = r.random_range(5..60);
        let mut req = request(prompt(&plain, n, &mut r), "");
        req.stop.max_tokens = max_tokens;
        let out = check(&req, usize::MAX, &format!("max_tokens {max_tokens}"));
        assert_eq!(out.tokens.len(), max_tokens);
        if max_tokens == 9 {
            // Ends at the first occurrence of its fourth token, with the step ahead discarded.
            let mut stopped = req.clone();
            stopped.stop.stop_token_ids = vec![out.tokens[3]];
            let first = out.tokens.iter().position(|&t| t == out.tokens[3]).unwrap();
            let o = check(&stopped, usize::MAX, "stop token");
            assert_eq!(o.tokens.len(), first + 1);
            // Cancelled by the caller after three tokens.
            let o = check(&req, 3, "cancel");
            assert_eq!(o.tokens.len(), 3);
            // A context that fills after three generated tokens.
            let ctx = plain.context_len();
            let mut full = request(prompt(&plain, ctx - 3, &mut r), "");
            full.stop.max_tokens = 9;
            let o = check(&full, usize::MAX, "full context");
            assert_eq!(o.tokens.len(), 3);
        }
    }
}

/// The scheduler's run-ahead for a lone sequence (each decode step submitted before the one
/// ahead of it is collected, fed its token by the backend) gives what stepping one pass at a
/// time gives: greedy requests ending at `max_tokens`, at a stop token, at a full context or
/// cancelled by the client; a next turn that reuses blocks the prefix cache registered while a
/// step was ahead; teacher-forced scoring; and a sequence that stops running alone when a second
/// request arrives mid-way and runs alone again once that one is done. The engine told to run
/// ahead must have done so, the other never.
#[test]
fn scheduler_running_ahead_changes_nothing() {
    let load = |ahead: bool| {
        let mut e = Engine::load_with(
            &fixture("tiny-qwen2"),
            &EngineOptions {
                threads: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        e.set_run_ahead(ahead);
        handle(Arc::new(e))
    };
    let (plain, ahead) = (load(false), load(true));
    let e = plain.engine().clone();
    let both = |req: &GenerateRequest, what: &str| {
        let want = collect(plain.submit(req.clone()).unwrap());
        let got = collect(ahead.submit(req.clone()).unwrap());
        identical(&want, &got).unwrap_or_else(|m| panic!("{what}: {m}"));
        assert_eq!(want.text, got.text, "{what}");
        assert_eq!(want.finish_reason, got.finish_reason, "{what}");
        want
    };
    let mut r = rng();
    let p = prompt(&e, r.random_range(20..60), &mut r);
    for max_tokens in [1, 2, 9, 40] {
        let mut req = request(p.clone(), "prefix_cache=on");
        req.stop.max_tokens = max_tokens;
        let out = both(&req, &format!("max_tokens {max_tokens}"));
        assert_eq!(out.tokens.len(), max_tokens);
    }
    // The next turn of the conversation: its prompt holds the 40-token answer, whose blocks
    // were registered by steps that had a step ahead of them.
    let mut req = request(p.clone(), "prefix_cache=on");
    req.stop.max_tokens = 40;
    let answer = both(&req, "first turn");
    let mut turn = p.clone();
    turn.extend(&answer.tokens);
    turn.extend(prompt(&e, 7, &mut r));
    let hits = |h: &EngineHandle| h.stats().prefix_hit_tokens.load(Ordering::Relaxed);
    let before = hits(&ahead);
    both(&request(turn, "prefix_cache=on"), "next turn");
    assert!(
        hits(&ahead) - before >= (p.len() + 32) as u64 / 16 * 16,
        "the next turn must reuse blocks written while a step ran ahead"
    );
    // A stop token: ends at the first occurrence of the answer's fourth token.
    let mut stopped = request(p.clone(), "");
    stopped.stop.max_tokens = 40;
    stopped.stop.stop_token_ids = vec![answer.tokens[3]];
    let first = answer
        .tokens
        .iter()
        .position(|&t| t == answer.tokens[3])
        .unwrap();
    assert_eq!(both(&stopped, "stop token").tokens.len(), first + 1);
    // A context that fills after three generated tokens.
    let ctx = e.context_len();
    let mut full = request(prompt(&e, ctx - 3, &mut r), "");
    full.stop.max_tokens = 9;
    assert_eq!(both(&full, "full context").tokens.len(), 3);
    // Cancelled by the client after three tokens: the same three, and the scheduler goes on.
    let three = |h: &EngineHandle| {
        let mut s = h.submit(req.clone()).unwrap();
        let mut ids = Vec::new();
        while ids.len() < 3 {
            match s.blocking_next() {
                Some(Event::Token(t)) => ids.push(t.id),
                other => panic!("cancel: {other:?}"),
            }
        }
        ids
    };
    assert_eq!(three(&plain), three(&ahead), "cancel");
    both(&req, "after a cancel");
    // Teacher forcing through the scheduler.
    let output = prompt(&e, 12, &mut r);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let score = |h: &EngineHandle| {
        rt.block_on(h.score(p.clone(), output.clone(), 4, Toggles::default()))
            .unwrap()
    };
    assert_eq!(score(&plain), score(&ahead), "scoring");
    // A second request arrives after the lone sequence's second token and ends first.
    let mut second = request(prompt(&e, r.random_range(5..40), &mut r), "");
    second.stop.max_tokens = 3;
    let (want_a, want_b) = (
        collect(plain.submit(req.clone()).unwrap()),
        collect(plain.submit(second.clone()).unwrap()),
    );
    let mut a = ahead.submit(req.clone()).unwrap();
    let mut a_ids = Vec::new();
    while a_ids.len() < 2 {
        match a.blocking_next() {
            Some(Event::Token(t)) => a_ids.push(t.id),
            other => panic!("interleaved: {other:?}"),
        }
    }
    let got_b = collect(ahead.submit(second).unwrap());
    let got_a = collect(a);
    same(&want_a, &got_a).unwrap_or_else(|m| panic!("the lone sequence, interleaved: {m}"));
    same(&want_b, &got_b).unwrap_or_else(|m| panic!("the request that arrived: {m}"));
    assert_eq!(&got_a.tokens[..2], &a_ids[..], "streamed tokens");
    let ran_ahead = |h: &EngineHandle| h.stats().steps_ahead.load(Ordering::Relaxed);
    assert!(
        ran_ahead(&ahead) > 0,
        "the scheduler never ran a step ahead"
    );
    assert_eq!(ran_ahead(&plain), 0, "run-ahead was off");
}

#[test]
fn requests_submitted_together_are_one_batch() {
    // `submit_all` queues its requests as one arrival: the scheduler's first step prefills all
    // of them in one pass and every later step decodes all of them, so 4 requests of 6 tokens
    // take exactly 6 forward passes (one by one, the scheduler thread may start on the first
    // before the others arrive). Each gets what it gets alone; a bad request refuses them all.
    let e = engine(2);
    let h = handle(e.clone());
    let mut r = rng();
    let reqs: Vec<GenerateRequest> = (0..4)
        .map(|_| {
            let n = r.random_range(10..30);
            request(prompt(&e, n, &mut r), "")
        })
        .collect();
    let before = h.stats().steps.load(Ordering::Relaxed);
    let outs: Vec<GenerateOutput> = h
        .submit_all(reqs.clone())
        .unwrap()
        .into_iter()
        .map(collect)
        .collect();
    let passes = h.stats().steps.load(Ordering::Relaxed) - before;
    assert_eq!(passes, 6, "4 requests of 6 tokens arriving together");
    for (req, out) in reqs.iter().zip(&outs) {
        same(&reference(&e, req), out).unwrap();
    }
    let mut bad = reqs.clone();
    bad[2].prompt.clear();
    assert!(h.submit_all(bad).is_err());
    assert_eq!(
        h.stats().waiting.load(Ordering::Relaxed),
        0,
        "nothing queued"
    );
}
