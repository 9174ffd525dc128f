//! Drives the replayer's [`HttpTarget`] + [`replay`] against an OpenAI-compatible server with
//! synthetic sessions and prints the sustained request rate and the client-side latency (the
//! benchmark of `bench/replayer/run.sh`, against `fake_openai`).
//!
//! ```sh
//! cargo run --release -p tapedeck-replayer --example replay_bench -- \
//!     --url http://127.0.0.1:PORT --sessions 2000 --turns 4 --concurrency 64 --tokens 16 \
//!     [--threads 1] [--warmup 200] [--json out.json]
//! ```
//! Closed loop, `recorded` history, teacher forcing off. Every turn asks for `--tokens` output
//! tokens. The last stdout line is one JSON object with the figures.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use tapedeck_engine::ChatMessage;
use tapedeck_replayer::session::ChatRequest;
use tapedeck_replayer::{
    replay, HistoryMode, HttpTarget, Pacing, ReplayConfig, Session, Target, Turn,
};
use tokio::sync::watch;

fn sessions(n: usize, turns: usize, tokens: u32, tag: &str) -> Vec<Session> {
    (0..n)
        .map(|i| {
            let mut messages = vec![ChatMessage::new("system", "You are a benchmark.")];
            let mut out = Vec::with_capacity(turns);
            for k in 0..turns {
                messages.push(ChatMessage::new(
                    "user",
                    &format!("{tag} session {i} turn {k}: say something"),
                ));
                out.push(Turn {
                    kind: Default::default(),
                    request: ChatRequest {
                        messages: messages.clone(),
                        temperature: Some(0.0),
                        max_tokens: Some(tokens),
                        ..ChatRequest::default()
                    },
                    recorded: None,
                    probe: None,
                    arrival_us: None,
                });
                messages.push(ChatMessage::new(
                    "assistant",
                    &"tok ".repeat(tokens as usize),
                ));
            }
            Session::new(format!("{tag}{i}"), out)
        })
        .collect()
}

/// This process's user + system CPU time in seconds (Linux `/proc/self/stat`; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on every Linux configuration that matters here.
    (ticks(11) + ticks(12)) / 100.0
}

fn main() {
    let mut url = String::new();
    let (mut n, mut turns, mut conc, mut tokens, mut threads, mut warmup) =
        (2000usize, 4usize, 64usize, 16u32, 1usize, 200usize);
    let mut json_out: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--url" => url = v,
            "--sessions" => n = v.parse().unwrap(),
            "--turns" => turns = v.parse().unwrap(),
            "--concurrency" => conc = v.parse().unwrap(),
            "--tokens" => tokens = v.parse().unwrap(),
            "--threads" => threads = v.parse().unwrap(),
            "--warmup" => warmup = v.parse().unwrap(),
            "--json" => json_out = Some(v),
            _ => panic!("unknown argument {a}"),
        }
    }
    assert!(
        url.starts_with("http://127.") || url.starts_with("http://localhost"),
        "--url must be a loopback http:// URL"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .unwrap();
    let target: Arc<dyn Target> = Arc::new(HttpTarget::open(&url).expect("target"));
    let cfg = ReplayConfig {
        pacing: Pacing::Closed { concurrency: conc },
        history: HistoryMode::Recorded,
        teacher_forcing: false,
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    // Warm-up: connections opened, allocator and caches warm; not measured.
    if warmup > 0 {
        let w = sessions(warmup.div_ceil(turns), turns, tokens, "w");
        rt.block_on(replay(w, target.clone(), &cfg, rx.clone()))
            .expect("warm-up");
    }
    let t = Instant::now();
    let cpu0 = cpu_seconds();
    let run = rt
        .block_on(replay(sessions(n, turns, tokens, "s"), target, &cfg, rx))
        .expect("replay");
    let wall = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let s = &run.speed;
    let cpu_per_req_us = cpu * 1e6 / (s.completed + s.failed).max(1) as f64;
    println!(
        "tapedeck replay: {} requests ({} failed) in {:.2} s = {:.0} req/s, {:.0} output tok/s",
        s.completed, s.failed, s.duration_s, s.request_throughput, s.output_token_throughput
    );
    println!(
        "  E2E ms p50 {:.3} p90 {:.3} p99 {:.3} max {:.3}; TTFT ms p50 {:.3} p99 {:.3}",
        s.e2e.p50_ms, s.e2e.p90_ms, s.e2e.p99_ms, s.e2e.max_ms, s.ttft.p50_ms, s.ttft.p99_ms
    );
    println!(
        "  client CPU {cpu:.2} s = {cpu_per_req_us:.0} µs per request (one core: {:.0} req/s)",
        1e6 / cpu_per_req_us.max(1e-9)
    );
    let summary = json!({
        "tool": "tapedeck",
        "requests": s.completed,
        "failed": s.failed,
        "errors": s.errors,
        "duration_s": s.duration_s,
        "wall_s": wall,
        "client_cpu_s": cpu,
        "client_cpu_us_per_request": cpu_per_req_us,
        "concurrency": conc,
        "output_tokens_per_request": tokens,
        "request_throughput": s.request_throughput,
        "output_token_throughput": s.output_token_throughput,
        "e2e_ms": {"mean": s.e2e.mean_ms, "p50": s.e2e.p50_ms, "p90": s.e2e.p90_ms,
                   "p99": s.e2e.p99_ms, "max": s.e2e.max_ms},
        "ttft_ms": {"mean": s.ttft.mean_ms, "p50": s.ttft.p50_ms, "p99": s.ttft.p99_ms},
    });
    if let Some(p) = json_out {
        std::fs::write(&p, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    }
    println!("{summary}");
}
