//! `tapedeck bench engine`: prefill and decode speed of the CPU engine, batched throughput and
//! inter-token latency of the scheduler at several concurrencies, the prefix cache on a growing
//! multi-turn session, and peak memory. Prints tables; figures go to `docs/benchmarks.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use tapedeck_engine::cuda;
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::scheduler::{EngineHandle, Event, SchedulerConfig};
use tapedeck_engine::toggles::Precision;
use tapedeck_engine::{Engine, GenerateRequest, SamplingParams, StopCriteria, Toggles};

use crate::embedded;

/// Arguments of `tapedeck bench engine`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Models: directories, embedded names, or `llama-120m` (a ~120M-parameter Llama-shaped random
    /// model, generated into the cache on first use). Repeatable.
    #[arg(long = "model", default_values_t = vec!["tiny-qwen2".to_string(), "llama-120m".to_string()])]
    pub models: Vec<String>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Tokens decoded for the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub gen: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: tapedeck_engine::backend::Device,
    /// Concurrency levels for the batched measurement (`0`: skip).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 4, 16, 64])]
    pub concurrency: Vec<usize>,
    /// Turns of the multi-turn prefix-cache measurement (0: skip).
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// KV budget for the scheduler, MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_budget_mib: usize,
    /// A toggle for every measurement, `name=value`; repeatable.
    #[arg(long = "toggle")]
    pub toggles: Vec<String>,
}

/// Peak resident memory of this process, from `/proc/self/status` (Linux), in MiB.
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The middle value (the upper one of an even count), NaN for none.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn random_prompt(vocab: usize, n: usize, rng: &mut impl Rng) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

fn request(prompt: Vec<u32>, gen: usize, toggles: Toggles) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling: SamplingParams::default(),
        stop: StopCriteria {
            max_tokens: gen,
            ignore_eos: true,
            ..Default::default()
        },
        top_k_summary: 8,
        toggles,
    }
}

/// Runs `tapedeck bench engine`.
pub fn run(args: BenchArgs) -> Result<()> {
    let toggles = crate::cli_generate::parse_toggles(&args.toggles)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for spec in &args.models {
        let dir = embedded::resolve(spec)?;
        let engine = Arc::new(
            Engine::load_with(
                &dir,
                &EngineOptions {
                    threads: args.threads,
                    device: args.device,
                },
            )
            .with_context(|| format!("loading {}", dir.display()))?,
        );
        let cfg = engine.config();
        let vocab = engine.tokenizer().vocab_size();
        println!(
            "\n== {spec}: {:.1}M params, {} layers, hidden {}, on {}, toggles: {}",
            cfg.num_params() as f64 / 1e6,
            cfg.num_layers,
            cfg.hidden_size,
            engine.backend().describe(),
            if toggles.to_string().is_empty() {
                "default".into()
            } else {
                toggles.to_string()
            }
        );
        // Single sequence: prefill and decode.
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        // Device time of the decode passes (after the first token), where the backend keeps it.
        let mut decode_busy = Vec::new();
        let device_time = || engine.backend().device_time();
        // Where the CUDA backend's host time went in each run's decode passes, with the run's
        // decode rate (all zeros on the CPU).
        let mut host_decode = Vec::new();
        for _ in 0..3 {
            let req = request(
                random_prompt(vocab, args.prompt_len, &mut rng),
                args.gen,
                toggles,
            );
            // Decode is timed from the second token: the first decode step also captures the
            // step's CUDA graph for this request's new cache (a one-off a server's fixed pool
            // does not pay), which would otherwise count against every step here.
            let mut seen = 0usize;
            let mut from = None;
            let out = engine.generate(&req, &mut |ev| {
                seen += 1;
                if seen == 2 {
                    from = Some((ev.elapsed, device_time(), cuda::host_split()));
                }
                true
            })?;
            let p = out.timings.prefill.as_secs_f64();
            prefill.push(args.prompt_len as f64 / p);
            // At least one decode step after the second token, or there is nothing to time.
            let Some((t0, dev0, host0)) = from.filter(|_| out.tokens.len() >= 3) else {
                continue;
            };
            let steps = out.tokens.len() - 2;
            let rate = steps as f64 / (out.timings.total - t0).as_secs_f64().max(1e-9);
            decode.push(rate);
            if let (Some((b0, n0)), Some((b1, n1))) = (dev0, device_time()) {
                if n1 > n0 {
                    decode_busy.push((b1 - b0).as_secs_f64() / (n1 - n0) as f64);
                }
            }
            host_decode.push((rate, cuda::host_split().since(&host0)));
        }
        let decode_rate = median(decode);
        // The kernel timeline of these runs, when the backend records one (TAPEDECK_TRACE).
        if let Some(said) = engine.backend().save_trace()? {
            println!("trace: {said}");
        }
        println!(
            "single sequence: prefill {:.0} tokens/s ({} tokens), decode {:.1} tokens/s ({} tokens), peak RSS {:.0} MiB",
            median(prefill),
            args.prompt_len,
            decode_rate,
            args.gen,
            peak_rss_mib().unwrap_or(f64::NAN)
        );
        // Batch-1 decode reads every weight once per token: the roofline is weight bytes over
        // memory bandwidth. Weights are read as bf16 under matmul=bf16, as f32 otherwise.
        // (An untied embedding matrix is only gathered from, one row per token.)
        let untied_embedding = if cfg.tie_word_embeddings {
            0
        } else {
            cfg.vocab_size * cfg.hidden_size
        };
        let weight_bytes = (cfg.num_params() - untied_embedding)
            * if toggles.matmul == Precision::Bf16 {
                2
            } else {
                4
            };
        println!(
            "decode weight traffic: {:.2} GB per token ({}), {:.0} GB/s effective at batch 1",
            weight_bytes as f64 / 1e9,
            if toggles.matmul == Precision::Bf16 {
                "bf16"
            } else {
                "f32"
            },
            weight_bytes as f64 * decode_rate / 1e9
        );
        if let tapedeck_engine::backend::Device::Cuda(ordinal) = args.device {
            // The roofline: weight bytes over the GPU's measured copy bandwidth (256 MiB
            // buffers, well past any L2), taken here so the figure and the run share a machine.
            match tapedeck_engine::cuda::check::copy_bandwidth(ordinal, 256 << 20, 40) {
                Ok(bw) => {
                    let roofline = bw / weight_bytes as f64;
                    println!(
                        "roofline: {:.0} GB/s device copy bandwidth -> {roofline:.0} tokens/s at batch 1; this run {:.1}% of it",
                        bw / 1e9,
                        100.0 * decode_rate / roofline
                    );
                }
                Err(e) => println!("roofline: copy bandwidth not measured ({e})"),
            }
            if toggles.megakernel {
                let steps = tapedeck_engine::cuda::persistent_steps();
                match tapedeck_engine::cuda::check::grid_barrier(ordinal, 2000) {
                    Ok((blocks, us)) => println!(
                        "megakernel: {steps} decode steps ran as the persistent kernel; one grid barrier of {blocks} blocks costs {us:.2} µs"
                    ),
                    Err(e) => println!("megakernel: {steps} persistent steps; barrier not measured ({e})"),
                }
            }
        }
        if !decode_busy.is_empty() {
            // The rest of a step is host work: scheduling, the pass's index upload and the
            // launch, reading the token back.
            let busy = median(decode_busy);
            let step = 1.0 / decode_rate.max(1e-9);
            println!(
                "decode step: {:.1} µs wall, {:.1} µs on the device ({:.0}% busy), {:.0} GB/s while busy",
                step * 1e6,
                busy * 1e6,
                100.0 * busy / step,
                weight_bytes as f64 / busy / 1e9
            );
            host_line(&mut host_decode, engine.runs_ahead());
        }
        let handle = EngineHandle::start(
            engine.clone(),
            SchedulerConfig {
                kv_budget_bytes: args.kv_budget_mib << 20,
                max_running: 256,
                max_waiting: 4096,
                kv_dtype: toggles.kv_dtype,
                ..Default::default()
            },
        )?;
        let levels: Vec<usize> = args
            .concurrency
            .iter()
            .copied()
            .filter(|&c| c > 0)
            .collect();
        if !levels.is_empty() {
            println!(
                "{:>11} {:>14} {:>12} {:>12} {:>10} {:>14} {:>12}",
                "concurrency",
                "output tok/s",
                "ITL p50 ms",
                "ITL p99 ms",
                "TTFT p50",
                "KV peak MiB",
                "device busy"
            );
        }
        // Per level, where the host's time per forward pass went (CUDA only): printed after the
        // table, to show what keeps the device from being busy in batched serving.
        let mut host_lines = Vec::new();
        for &c in &levels {
            let prompt_len = 64.min(args.prompt_len);
            let mut batch = |gen: usize| {
                let reqs: Vec<GenerateRequest> = (0..c)
                    .map(|_| request(random_prompt(vocab, prompt_len, &mut rng), gen, toggles))
                    .collect();
                batch_round(&handle, reqs)
            };
            // An unmeasured round first, as long as the measured one: the level's first passes
            // compile kernels for new shapes and capture graphs for each batch size and
            // block-table bucket its contexts grow through, which the measured round would
            // otherwise count in its TTFT and inter-token latencies.
            batch(args.gen)?;
            // The device's share of the round (an accelerator only): what is not busy is the
            // host's scheduling, launching and streaming between passes.
            let busy_before = engine.backend().device_time();
            let host_before = cuda::host_split();
            let round = batch(args.gen)?;
            let host = cuda::host_split().since(&host_before);
            if host.passes > 0 {
                host_lines.push(format!(
                    "concurrency {c:>3}: {}",
                    host_pass_split(&host, round.secs)
                ));
            }
            let busy = match (busy_before, engine.backend().device_time()) {
                (Some((a, _)), Some((b, _))) => {
                    format!("{:.0}%", 100.0 * (b - a).as_secs_f64() / round.secs)
                }
                _ => "-".into(),
            };
            println!(
                "{:>11} {:>14.1} {:>12.2} {:>12.2} {:>10.1} {:>14.1} {:>12}",
                c,
                round.tokens as f64 / round.secs,
                round.itl.value_at_quantile(0.5) as f64 / 1e3,
                round.itl.value_at_quantile(0.99) as f64 / 1e3,
                round.ttft.value_at_quantile(0.5) as f64 / 1e3,
                handle.stats().kv_peak_mib(),
                busy
            );
        }
        if !host_lines.is_empty() {
            println!(
                "host per forward pass (the scheduler's share is what is outside the backend):"
            );
            for l in &host_lines {
                println!("  {l}");
            }
        }
        if !levels.is_empty() {
            let s = handle.stats();
            println!(
                "scheduler: {} forward passes, {} decode steps run ahead (a lone sequence's)",
                s.steps.load(std::sync::atomic::Ordering::Relaxed),
                s.steps_ahead.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        if args.turns > 0 {
            multi_turn(&handle, vocab, args.turns, toggles, &mut rng)?;
        }
        let stats = handle.stats();
        let blocks = stats
            .kv_blocks_total
            .load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "KV budget {} MiB: {blocks} blocks of {:.3} MiB ({} tokens, stored as {}); peak {:.1} MiB in use; process peak RSS {:.0} MiB",
            args.kv_budget_mib,
            stats.kv_block_mib(),
            blocks * tapedeck_engine::scheduler::SchedulerConfig::default().block_size,
            handle.kv_storage().name(),
            stats.kv_peak_mib(),
            peak_rss_mib().unwrap_or(f64::NAN)
        );
    }
    Ok(())
}

/// A captured-style session: each turn resends the whole history plus the last answer and a new
/// user message; time to first token per turn with the prefix cache on and off.
fn multi_turn(
    handle: &EngineHandle,
    vocab: usize,
    turns: usize,
    toggles: Toggles,
    rng: &mut impl Rng,
) -> Result<()> {
    let system = random_prompt(vocab, 400, rng);
    let users: Vec<Vec<u32>> = (0..turns).map(|_| random_prompt(vocab, 60, rng)).collect();
    let mut rows = Vec::new();
    for cache in [true, false] {
        let mut t = toggles;
        t.prefix_cache = cache;
        // A distinct first token per mode keeps the two runs from sharing cached blocks.
        let mut history = system.clone();
        history[0] = if cache { 1 } else { 2 };
        let mut ttfts = Vec::new();
        for user in &users {
            history.extend(user);
            let out = handle.generate_blocking(request(history.clone(), 16, t), &mut |_| true)?;
            ttfts.push(out.timings.first_token.unwrap_or_default());
            history.extend(&out.tokens);
        }
        rows.push(ttfts);
    }
    println!(
        "multi-turn session ({turns} turns, history grows to {} tokens): TTFT ms",
        400 + turns * 76
    );
    println!(
        "{:>5} {:>10} {:>10} {:>7}",
        "turn", "cache on", "cache off", "ratio"
    );
    for (k, (on, off)) in rows[0].iter().zip(&rows[1]).enumerate() {
        let (on, off) = (on.as_secs_f64() * 1e3, off.as_secs_f64() * 1e3);
        println!("{:>5} {:>10.1} {:>10.1} {:>7.2}", k + 1, on, off, on / off);
    }
    Ok(())
}

/// Prints where the host's time in the decode passes went (the CUDA backend's
/// [`cuda::HostSplit`]) in the run of median decode rate, of `(rate, split)` per run, against
/// that run's wall time per step: what is left is the scheduler's and the sampler's, outside the
/// backend. (One run, not a mean: the first run's passes also capture graphs.) `ahead`: the
/// engine submitted each step before reading the one before back, so these overlap the device.
fn host_line(runs: &mut [(f64, cuda::HostSplit)], ahead: bool) {
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(rate, split)) = runs.get(runs.len() / 2) else {
        return;
    };
    if split.passes == 0 {
        return;
    }
    println!(
        "host per decode step: {}{}",
        host_pass_split(&split, split.passes as f64 / rate.max(1e-9)),
        if ahead { " (steps run ahead)" } else { "" }
    );
}

/// `split`'s parts per pass, and what is left of `wall_secs` (the wall time those passes took)
/// outside the backend: the scheduler's and the sampler's work between passes.
fn host_pass_split(split: &cuda::HostSplit, wall_secs: f64) -> String {
    let passes = split.passes.max(1) as f64;
    let us = |d: std::time::Duration| d.as_secs_f64() * 1e6 / passes;
    let inside = us(split.prepare) + us(split.launch) + us(split.wait) + us(split.read);
    format!(
        "prepare {:.1} µs, launch {:.1} µs, wait for the device {:.1} µs, read {:.1} µs; outside the backend {:.1} µs ({} passes)",
        us(split.prepare),
        us(split.launch),
        us(split.wait),
        us(split.read),
        wall_secs * 1e6 / passes - inside,
        split.passes
    )
}

/// One round of the batched measurement: every request of `reqs` submitted at once, their
/// streams read on threads of their own.
struct Round {
    itl: Histogram<u64>,
    ttft: Histogram<u64>,
    tokens: u64,
    secs: f64,
}

/// Runs `reqs` through the scheduler together and measures them (see [`Round`]). They arrive
/// as one batch ([`EngineHandle::submit_all`]), so every run of a round schedules the same
/// passes: submitted one by one, the scheduler thread could start on the first few and prefill
/// the rest in later, mixed passes, a different split each run.
fn batch_round(handle: &EngineHandle, reqs: Vec<GenerateRequest>) -> Result<Round> {
    let start = Instant::now();
    let streams = handle.submit_all(reqs)?;
    let mut itl = Histogram::<u64>::new(3)?;
    let mut ttft = Histogram::<u64>::new(3)?;
    let mut tokens = 0u64;
    let threads: Vec<_> = streams
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                let mut gaps = Vec::new();
                let mut last: Option<Duration> = None;
                let mut first = None;
                while let Some(ev) = s.blocking_next() {
                    match ev {
                        Event::Token(t) => {
                            if let Some(l) = last {
                                gaps.push(t.elapsed - l);
                            } else {
                                first = Some(t.elapsed);
                            }
                            last = Some(t.elapsed);
                        }
                        Event::Done(_) | Event::Error(_) => break,
                    }
                }
                (gaps, first)
            })
        })
        .collect();
    for t in threads {
        let (gaps, first) = t.join().map_err(|_| anyhow::anyhow!("reader panicked"))?;
        tokens += gaps.len() as u64 + u64::from(first.is_some());
        for g in gaps {
            itl.record(g.as_micros() as u64)?;
        }
        if let Some(f) = first {
            ttft.record(f.as_micros() as u64)?;
        }
    }
    Ok(Round {
        itl,
        ttft,
        tokens,
        secs: start.elapsed().as_secs_f64(),
    })
}
